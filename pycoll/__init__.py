"""pycoll: collectives for distributed deep learning on MPI, Horovod-like.

    import pycoll
    pycoll.init()
    y = pycoll.allreduce(x, op=pycoll.Average)

Importing pycoll does not start MPI (so ``pycollrun`` and tools can import it);
``pycoll.init()`` or the first use of a collective does.
"""
import importlib

from .config import configure
from .hetero import slowdown, slowdown_factor
from .runtime import (Group, init, is_initialized, local_rank, local_size, new_group, rank,
                      shutdown, size)
from .inspector import CollectiveMismatch
from .ops import Average, BitwiseAnd, BitwiseOr, BitwiseXor, Max, Min, Product, ReduceOp, Sum
from .work import CollectiveTimeout, GroupBroken, Work

__version__ = "0.1.0"

_OPS = ("ReduceOp", "Sum", "Average", "Min", "Max", "Product", "BitwiseAnd", "BitwiseOr",
        "BitwiseXor")
_COLLECTIVES = (
    "allreduce", "allreduce_", "allreduce_async", "allreduce_async_",
    "grouped_allreduce", "grouped_allreduce_", "grouped_allreduce_async",
    "grouped_allreduce_async_", "allgather", "allgather_async",
    "broadcast", "broadcast_", "broadcast_async", "broadcast_async_",
    "reduce_scatter", "reduce_scatter_async", "alltoall", "alltoall_async",
    "barrier", "barrier_async", "flush",
)
_PARTIAL = ("partial_allreduce", "partial_allreduce_", "partial_allreduce_async",
            "partial_allreduce_async_")

__all__ = ["configure", "slowdown", "slowdown_factor", "Group", "init", "is_initialized",
           "local_rank", "local_size", "new_group", "rank", "shutdown", "size",
           "CollectiveMismatch", "CollectiveTimeout", "GroupBroken", "Work", "has_cuda", *_OPS,
           *_COLLECTIVES, *_PARTIAL]


def has_cuda() -> bool:
    """Whether pycoll's CUDA kernels were built."""
    from . import _C
    return _C.has_cuda()


_LAZY = {**dict.fromkeys(_COLLECTIVES, ".collectives"), **dict.fromkeys(_PARTIAL, ".partial")}


def __getattr__(name):
    # These modules import mpi4py.MPI, which starts MPI: load them on first use only,
    # then keep their names here so later lookups skip this function.
    if name not in _LAZY:
        raise AttributeError(f"module 'pycoll' has no attribute {name!r}")
    module = importlib.import_module(_LAZY[name], __name__)
    globals().update({n: getattr(module, n) for n, m in _LAZY.items() if m == _LAZY[name]})
    return globals()[name]


def __dir__():
    return sorted(__all__)
