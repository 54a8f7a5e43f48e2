"""Heterogeneity emulation: make chosen ranks' compute FACTOR times slower.

    pycollrun -np 4 --slowdown 1:3 python train.py       # or PYCOLL_SLOWDOWN=1:3

    with pycoll.slowdown():        # in the training loop
        loss = step(batch)

On a slowed rank the block runs as usual, then the rank sleeps (FACTOR - 1) times the
block's wall time: it is FACTOR times slower yet uses no extra CPU, so ranks may
outnumber cores. Every other rank pays a dictionary lookup.

A straggler that comes and goes: ``--slowdown 1:3@10-20,1:2@40-`` slows rank 1 three
times from 10 to 20 s after the start, and twice from 40 s on. The start is
``pycoll.init()`` (which every rank leaves at about the same time), else this module's
import; a block takes the factor in force when it begins.
"""
import contextlib
import os
import sys
import time

from . import config, timeline

_RANK_VARIABLES = ("OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK")
_start = time.monotonic()


def mark_start() -> None:
    """Windows of ``--slowdown RANK:FACTOR@START-END`` count seconds from now
    (``pycoll.init`` calls it)."""
    global _start
    _start = time.monotonic()


def elapsed() -> float:
    """Seconds since the start that slowdown windows count from."""
    return time.monotonic() - _start


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
    """This rank's (or `rank`'s) compute slowdown factor from the `slowdown` knob, now; 1.0
    if the rank is not named (or outside its windows)."""
    factors = config.get("slowdown")
    if not factors:
        return 1.0
    factor = factors.get(_rank() if rank is None else rank, 1.0)
    return float(factor.at(elapsed()) if hasattr(factor, "at") else factor)


@contextlib.contextmanager
def slowdown(rank=None):
    """Wrap a compute step; on a slowed rank, sleep (factor - 1) x the step's wall time
    after it. Yields the factor. Nothing is added when the block raises."""
    factor = slowdown_factor(rank)
    with timeline.phase("compute", "compute", factor=factor):      # the report sums these
        if factor <= 1.0:
            yield factor
            return
        start = time.perf_counter()
        yield factor
        with timeline.phase("slowdown (emulated)", "emulated"):
            time.sleep((factor - 1.0) * (time.perf_counter() - start))
