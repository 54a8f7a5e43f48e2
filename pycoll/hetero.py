"""Heterogeneity emulation: make chosen ranks' compute FACTOR times slower.

    pycollrun -np 4 --slowdown 1:3 python train.py       # or PYCOLL_SLOWDOWN=1:3

    with pycoll.slowdown():        # in the training loop
        loss = step(batch)

On a slowed rank the block runs as usual, then the rank sleeps (FACTOR - 1) times the
block's wall time: it is FACTOR times slower yet uses no extra CPU, so ranks may
outnumber cores. Every other rank pays a dictionary lookup.
"""
import contextlib
import os
import sys
import time

from . import config

_RANK_VARIABLES = ("OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK")


def _rank() -> int:
    """COMM_WORLD rank if MPI is up, else the launcher's variables, else 0.
    Never imports mpi4py.MPI (that would initialize MPI)."""
    mpi = sys.modules.get("mpi4py.MPI")
    if mpi is not None and mpi.Is_initialized() and not mpi.Is_finalized():
        return mpi.COMM_WORLD.Get_rank()
    for name in _RANK_VARIABLES:
        value = os.environ.get(name)
        if value is not None and value.strip().isdigit():
            return int(value)
    return 0


def slowdown_factor(rank=None) -> float:
    """This rank's (or `rank`'s) compute slowdown factor from the `slowdown` knob; 1.0 if
    the rank is not named."""
    factors = config.get("slowdown")
    if not factors:
        return 1.0
    return float(factors.get(_rank() if rank is None else rank, 1.0))


@contextlib.contextmanager
def slowdown(rank=None):
    """Wrap a compute step; on a slowed rank, sleep (factor - 1) x the step's wall time
    after it. Yields the factor. Nothing is added when the block raises."""
    factor = slowdown_factor(rank)
    if factor <= 1.0:
        yield factor
        return
    start = time.perf_counter()
    yield factor
    time.sleep((factor - 1.0) * (time.perf_counter() - start))
