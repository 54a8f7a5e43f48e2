"""Reduction ops and the argument checks every layer shares; no MPI here, so the layers
above (pycoll.torch) can import them without starting MPI."""
import enum

import numpy as np

from .tensors import FLOAT8, FLOATS


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
    if dtype in FLOAT8:
        raise TypeError(f"{op.name.title().replace('_', '')} of {dtype} tensors is not "
                        "defined: pycoll moves float8 (allgather, broadcast, alltoall, "
                        "send/recv) but reduces none; cast to bfloat16 or float32 to reduce")
    if op in BITWISE and dtype in FLOATS:
        raise TypeError(f"{op.name.title().replace('_', '')} of {dtype} tensors is not "
                        "defined; bitwise reductions take integer and bool tensors")
    if op is Average and dtype == "bool":
        raise TypeError("Average of bool tensors is not defined; use op=pycoll.Sum or Max "
                        "(any rank's True), Min or Product (every rank's)")
    if op is Average and dtype not in FLOATS:
        raise TypeError(f"Average of {dtype} tensors would truncate; use op=pycoll.Sum "
                        "and divide, or cast to a float dtype")


def check_root(root, grp, what: str = "root") -> None:
    """``root`` (a rank of ``grp``; ``what`` names it in the error) is one of its ranks."""
    if not isinstance(root, (int, np.integer)) or not 0 <= root < grp.size():
        raise ValueError(f"{what} must be a rank in [0, {grp.size()}), got {root!r}")
