"""Adasum (Maleki et al., "Scaling Distributed Training with Adaptive Summation", MLSys
2021), the reduction Horovod's ``op=hvd.Adasum`` runs.

Two gradients a and b combine as

    adasum(a, b) = (1 - a.b / (2 |a|^2)) a + (1 - a.b / (2 |b|^2)) b

(orthogonal gradients add, parallel ones average), each tensor on its own, dot products
in float64, a coefficient left at 1 where a norm is below sqrt(DBL_MIN), as in Horovod's
``FusedPairwiseReduceWithComm``. The ranks combine pairwise in a binary tree: at level k
each rank exchanges its current vector with rank ^ 2^k and both compute adasum(lower
rank's, higher rank's), so partners hold bit-identical results and after log2(n) levels
every rank holds the tree's root. Horovod cuts the vectors in halves across levels
(vector-halving distance-doubling) to move 2x the bytes instead of log2(n)x; the
arithmetic combined is the same. Like Horovod on CPUs, it needs a power-of-2 number of
ranks and the global process set.
"""
from typing import List

import torch

import pycoll

_DBL_MIN_SQRT = 2.2250738585072014e-308 ** 0.5
_TAG = 0x5ADA       # point-to-point on the group's communicator, inside the engine's order


def check(tensors, process_set, size: int) -> None:
    """Refuse what Horovod refuses, at the call."""
    from .api import global_process_set
    if process_set is not global_process_set:
        raise NotImplementedError("Adasum does not support non-global process sets yet "
                                  "(as in Horovod)")
    if size & (size - 1):
        raise NotImplementedError(f"Running Adasum with non-power of 2 ranks is not supported "
                                  f"yet (as in Horovod); this job has {size}")
    for t in tensors:
        if not t.is_floating_point():
            raise TypeError(f"Adasum needs floating-point tensors, got {t.dtype}")


def combine(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """adasum(a, b), in a's dtype (computed in float64)."""
    a64, b64 = a.reshape(-1).double(), b.reshape(-1).double()
    dot, anorm, bnorm = float(a64 @ b64), float(a64 @ a64), float(b64 @ b64)
    acoeff = 1.0 - dot / anorm * 0.5 if anorm >= _DBL_MIN_SQRT else 1.0
    bcoeff = 1.0 - dot / bnorm * 0.5 if bnorm >= _DBL_MIN_SQRT else 1.0
    return (acoeff * a64 + bcoeff * b64).to(a.dtype).reshape(a.shape)


def _bytes(t: torch.Tensor):
    return t.reshape(-1).view(torch.uint8).numpy()


def reduce_(tensors: List[torch.Tensor], comm) -> List[torch.Tensor]:
    """Adasum of each tensor over ``comm``'s ranks, in place; returns ``tensors``."""
    rank, size = comm.Get_rank(), comm.Get_size()
    for t in tensors:
        mine = t.detach().cpu() if t.device.type != "cpu" else t.detach()
        theirs = torch.empty_like(mine)
        distance = 1
        while distance < size:
            peer = rank ^ distance
            comm.Sendrecv(_bytes(mine), dest=peer, sendtag=_TAG, recvbuf=_bytes(theirs),
                          source=peer, recvtag=_TAG)
            pair = (mine, theirs) if rank < peer else (theirs, mine)
            mine.copy_(combine(*pair))
            distance *= 2
        if mine is not t:
            t.copy_(mine)
    return tensors


def allreduce_async_(tensors: List[torch.Tensor], group: pycoll.Group, name: str):
    """Adasum of ``tensors`` in place, run by the engine in issue order; a Work whose
    result is the list."""
    return group.engine.submit(lambda: reduce_(tensors, group.comm), name)
