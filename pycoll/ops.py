"""Reduction ops and the argument checks every layer shares; no MPI here, so the layers
above (pycoll.torch) can import them without starting MPI."""
import enum
from typing import Optional

import numpy as np

from .tensors import DTYPES, FLOAT8, FLOATS


class ReduceOp(str, enum.Enum):
    SUM = "sum"
    AVERAGE = "average"
    MIN = "min"
    MAX = "max"
    PRODUCT = "prod"
    BITWISE_AND = "band"
    BITWISE_OR = "bor"
    BITWISE_XOR = "bxor"


Sum, Average, Min, Max, Product = (ReduceOp.SUM, ReduceOp.AVERAGE, ReduceOp.MIN,
                                   ReduceOp.MAX, ReduceOp.PRODUCT)
BitwiseAnd, BitwiseOr, BitwiseXor = ReduceOp.BITWISE_AND, ReduceOp.BITWISE_OR, ReduceOp.BITWISE_XOR
BITWISE = (BitwiseAnd, BitwiseOr, BitwiseXor)


def reduce_op(op) -> ReduceOp:
    if op.__class__ is ReduceOp:
        return op
    try:
        return ReduceOp(op)
    except ValueError:
        raise ValueError(f"unknown reduction {op!r}; use pycoll.Sum, Average, Min, Max, "
                         "Product, BitwiseAnd, BitwiseOr or BitwiseXor") from None


def kernel_op(op: ReduceOp) -> str:
    """The reduction the compiled kernels (``_C.reduce``) apply for ``op``: Average sums,
    and the scaling by 1/n comes after."""
    return "sum" if op is Average else op.value


def check_reduction(op: ReduceOp, dtype: str) -> None:
    if op not in REDUCES.get(dtype, ()):
        refusal = _refusal(op, dtype)
        if refusal:
            raise TypeError(refusal)


def _refusal(op: ReduceOp, dtype: str) -> Optional[str]:
    """Why ``op`` cannot reduce ``dtype`` tensors; None if it can."""
    what = f"{op.name.title().replace('_', '')} of {dtype} tensors"
    if dtype in FLOAT8:
        return (f"{what} is not defined: pycoll moves float8 (allgather, broadcast, "
                "alltoall, send/recv) but reduces none; cast to bfloat16 or float32 to reduce")
    if op in BITWISE and dtype in FLOATS:
        return f"{what} is not defined; bitwise reductions take integer and bool tensors"
    if op is Average and dtype == "bool":
        return ("Average of bool tensors is not defined; use op=pycoll.Sum or Max "
                "(any rank's True), Min or Product (every rank's)")
    if op is Average and dtype not in FLOATS:
        return (f"Average of {dtype} tensors would truncate; use op=pycoll.Sum "
                "and divide, or cast to a float dtype")
    return None


# dtype -> the ops that reduce it: on a hot path the check is an identity test in a short
# tuple (an enum member's hash is a Python call).
REDUCES = {dtype: tuple(op for op in ReduceOp if _refusal(op, dtype) is None)
           for dtype in DTYPES}


def check_root(root, grp, what: str = "root") -> None:
    """``root`` (a rank of ``grp``; ``what`` names it in the error) is one of its ranks."""
    if not isinstance(root, (int, np.integer)) or not 0 <= root < grp.size():
        raise ValueError(f"{what} must be a rank in [0, {grp.size()}), got {root!r}")
