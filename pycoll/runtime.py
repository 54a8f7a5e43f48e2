"""Process state: the world communicator, groups of ranks and their engines."""
import atexit
import logging
import os
import sys
import threading
import time
import weakref
from typing import Iterable, Optional

import numpy as np

from . import _C, config, hetero, timeline
from .engine import Engine
from .inspector import Checker
from .work import wait_request


class Group:
    """A set of ranks that collectives can run on (``group=``), with its own communicator.

    ``ranks`` are ranks of the communicator pycoll was initialized with, in group order.
    On a rank outside the group ``comm`` is None and collectives refuse the group.
    Its ``engine`` runs its collectives in issue order (MPI's order on a communicator);
    ``gate`` is that engine's, which the compiled short path claims.
    """

    def __init__(self, comm, ranks: tuple):
        self.comm = comm
        self.ranks = ranks
        # By rank of ``comm``: its world rank (None outside pycoll's world).
        self.world_ranks = _world_ranks(comm) if comm is not None else ()
        self.engine = (Engine(on_stuck=_abort, members=frozenset(self.world_ranks) - {None},
                              gone=gone) if comm is not None else None)
        self.freed = False          # by pycoll.shutdown(): using it again is an error
        self.handle = None          # the MPI handle of ``comm``: what _C's MPI calls take
        # allgather's, alltoall's and reduce_scatter's capacity for data sent with their
        # sizes (_C.carried_exchange): the same on every member, as it follows their calls
        self.carry = np.zeros(3, np.int64)
        if comm is not None:
            from mpi4py import MPI
            self.handle = MPI._handleof(comm)
        self._checker: Optional[Checker] = None
        if comm is not None and config.get("check"):
            self._checker = Checker(comm, ranks)

    def agree(self, kind: str, name: str, timeout: Optional[float] = None, **details) -> None:
        """With PYCOLL_CHECK, make sure every rank is about to run the same collective
        (waiting ``timeout`` s for them, default PYCOLL_TIMEOUT)."""
        if config.get("check"):
            if self._checker is None:
                self._checker = Checker(self.comm, self.ranks)
            with timeline.phase("checked"):
                self._checker.agree(kind, name, timeout, **details)

    def free(self, comm: bool = True) -> None:
        if self.freed:
            return
        if self._checker is not None:
            self._checker.free()
        if comm and self.comm is not None:
            self.comm.Free()
        self.comm = self.handle = self._checker = None
        self.freed = True

    @property
    def is_member(self) -> bool:
        return self.comm is not None

    @property
    def gate(self):
        """Its engine's Gate (what the compiled short path claims)."""
        return self.engine.gate if self.engine is not None else None

    def release(self) -> None:
        """Free the group once what its engine holds has run, and end the engine's thread
        (every member calls it at the same place among the group's operations)."""
        if self.freed:
            return
        self.engine.run(self.free, f"release {self}")
        self.engine.stop(config.get("timeout"))

    def rank(self) -> int:
        return self.comm.Get_rank() if self.comm is not None else -1

    def size(self) -> int:
        return len(self.ranks)

    def __repr__(self) -> str:
        return f"<pycoll.Group ranks={list(self.ranks)}>"


def _world_ranks(comm) -> tuple:
    """Each rank of ``comm`` as a rank of pycoll's world (None for one outside it)."""
    if _state.world is None:                # the world itself
        return tuple(range(comm.Get_size()))
    from mpi4py import MPI
    mine, world = comm.Get_group(), _state.world.comm.Get_group()
    try:
        ranks = MPI.Group.Translate_ranks(mine, list(range(comm.Get_size())), world)
    finally:
        mine.Free()
        world.Free()
    return tuple(None if r == MPI.UNDEFINED else r for r in ranks)


class _Departures:
    """Which ranks have left pycoll (their script ended, or they called sys.exit or
    shutdown) while this one runs: a collective still waiting for one then ends the job
    within seconds (the engines' watchdog), as gloo's ranks fail when a peer's process
    ends, not at PYCOLL_TIMEOUT. A rank that leaves, once its operations have completed,
    sends every other rank an empty message on a communicator of its own; each rank keeps a
    receive posted there, which the watchdog's thread tests, so MPI_THREAD_MULTIPLE only."""

    def __init__(self, comm):
        from mpi4py import MPI
        self.comm, self.MPI = comm, MPI
        self.lock = threading.Lock()        # the watchdog tests while the caller may leave
        self.seen: dict = {}                # rank -> time.monotonic() its notice came
        self.status = MPI.Status()
        self.request = (comm.Irecv([None, 0, MPI.BYTE], MPI.ANY_SOURCE)
                        if MPI.Query_thread() == MPI.THREAD_MULTIPLE else None)

    def departed(self) -> dict:
        with self.lock:
            if self.request is not None and self.MPI.Is_finalized():   # by the user
                self.request = None
            while self.request is not None and self.request.Test(self.status):
                self.seen.setdefault(self.status.Get_source(), time.monotonic())
                self.request = self.comm.Irecv([None, 0, self.MPI.BYTE], self.MPI.ANY_SOURCE)
        return self.seen

    def leave(self) -> None:
        """Stop listening and tell every other rank this one has left (waiting at most a
        second for the notices to go: a rank past MPI's finalize takes none)."""
        with self.lock:
            if self.request is None or self.MPI.Is_finalized():
                self.request = None
                return
            self.request.Cancel()
            self.request.Wait()
            self.request = None
            comm, deadline = self.comm, time.monotonic() + 1.0
            sends = [comm.Isend([None, 0, self.MPI.BYTE], peer)
                     for peer in range(comm.Get_size()) if peer != comm.Get_rank()]
            for send in sends:
                wait_request(send, max(0.0, deadline - time.monotonic()))


class _State:
    world: Optional[Group] = None
    departures: Optional[_Departures] = None
    local_comm = None
    p2p_comm = None      # pycoll.partial's own duplicate: its tags never meet other traffic
    user_groups: dict = {}          # id(communicator) -> Group, so each keeps its checker
    new_groups = weakref.WeakSet()  # new_group()'s, released by shutdown()
    aborting = False                # an uncaught exception: MPI is aborted at exit


_state = _State()


def init(comm=None, **options) -> None:
    """Start pycoll on ``comm`` (default ``MPI.COMM_WORLD``); idempotent.

    Keyword options override ``PYCOLL_*`` variables (see ``pycoll.config.KNOBS``).
    """
    from mpi4py import MPI
    config.configure(**options)
    comm = MPI.COMM_WORLD if comm is None else comm
    if _state.world is not None:
        if MPI.Comm.Compare(_state.world.comm, comm) == MPI.UNEQUAL:
            raise ValueError("pycoll is already initialized on another communicator; "
                             "call pycoll.shutdown() before init() with a new one")
        return
    if MPI.Query_thread() < MPI.THREAD_SERIALIZED:
        raise RuntimeError("pycoll runs MPI from a background thread and needs MPI initialized "
                           "with at least MPI_THREAD_SERIALIZED; let mpi4py initialize MPI "
                           "(its default is MPI_THREAD_MULTIPLE)")
    # Our own duplicate: pycoll's traffic never matches the user's messages on ``comm``.
    own = comm.Dup()
    hetero.mark_start()             # --slowdown windows count from here
    timeline.begin(comm)            # with --timeline or --report: clocks aligned here
    _state.world = Group(own, tuple(range(own.Get_size())))
    _state.p2p_comm = own.Dup()     # made here: Dup is collective, partial groups are not
    _state.local_comm = own.Split_type(MPI.COMM_TYPE_SHARED)
    if own.Get_size() > 1:
        _state.departures = _Departures(own.Dup())
    _C.short_path_bind(_state.world.gate, _state.world.handle, own.Get_size(), _state.world)
    atexit.register(_finish_queued)
    if config.get("abort_on_error") and MPI.COMM_WORLD.Get_size() > 1:
        _abort_on_uncaught_exceptions()
    log = logging.getLogger("pycoll")
    log.setLevel(config.get("log_level").upper())
    log.info("pycoll initialized: rank %d of %d, local rank %d of %d, %s", own.rank, own.size,
             _state.local_comm.rank, _state.local_comm.size, MPI.Get_library_version().split(",")[0])


# A rank leaves only once every operation it joined has completed on its side, so what
# still waits for it has at most its last bytes in flight: this covers them, on a loaded
# machine or a slow emulated link, and is a small part of PYCOLL_TIMEOUT.
DEPARTED_GRACE_S = 5.0


def gone(ranks, since: float = 0.0) -> list:
    """Those of the world ``ranks`` that an operation begun at ``since``
    (``time.monotonic()``) waits for in vain: they left pycoll, and DEPARTED_GRACE_S has
    passed since then and since ``since``. Empty with PYCOLL_ABORT_ON_ERROR=0. While
    ``since`` is recent it answers without testing MPI, so a wait that polls may ask at
    every try."""
    last = time.monotonic() - DEPARTED_GRACE_S
    departures = _state.departures
    if departures is None or since >= last or not config.get("abort_on_error"):
        return []
    seen = departures.departed()
    return sorted(r for r in ranks if r in seen and seen[r] < last)


def _leave() -> None:
    """This rank's operations are done: tell the others it will join no more."""
    if _state.departures is not None:
        _state.departures.leave()


def engines() -> list:
    """The engines of every group this process is a member of, the world's first."""
    if _state.world is None:
        return []
    groups = [_state.world, *_state.user_groups.values(), *_state.new_groups]
    return [group.engine for group in groups if group.engine is not None]


def _abort_on_uncaught_exceptions() -> None:
    """What ``python -m mpi4py`` (pycollrun's way) does, for jobs started by a bare
    ``mpiexec python script.py``: an uncaught exception on one rank aborts the job at exit.
    Without it, that rank's exit finalizes MPI, which waits for the other ranks, which
    wait in a collective for it, as long as PYCOLL_TIMEOUT. Interactive sessions, where
    an uncaught exception is routine, are left alone."""
    previous = sys.excepthook
    if getattr(previous, "pycoll", False) or hasattr(sys, "ps1") or sys.flags.interactive:
        return

    def hook(kind, value, traceback):
        from mpi4py.run import set_abort_status
        _state.aborting = True
        previous(kind, value, traceback)
        set_abort_status(value)
    hook.pycoll = True
    sys.excepthook = hook


def _finish_queued() -> None:
    """At exit, before MPI is finalized (mpi4py's handler runs after this one): let queued
    collectives finish and stop the engines' threads. Finalizing under a thread still
    inside MPI is undefined, so a rank whose collectives do not finish within
    PYCOLL_TIMEOUT ends the job instead; one that is aborting waits for nothing."""
    if _state.aborting:
        return
    for engine in engines():
        if not engine.stop(timeout=config.get("timeout")):
            _abort(f"pycoll: {engine.running() or 'a collective'} was still running at exit "
                   f"after PYCOLL_TIMEOUT ({config.get('timeout'):g} s): a rank skipped it or "
                   "died; ending the job rather than finalizing MPI under it")
    _leave()


def _abort(message: str) -> None:
    """End every rank of the job: the only way out of an MPI call that never returns."""
    from mpi4py import MPI
    logging.getLogger("pycoll").error(message)
    MPI.COMM_WORLD.Abort(1)


def shutdown() -> None:
    """Release pycoll's communicators; ``init`` may be called again afterwards."""
    if _state.world is None:
        return
    live = engines()
    for engine in live:
        engine.run(lambda: None, "shutdown")         # drain what is queued
    _leave()
    _C.short_path_bind(None)
    _C.partial_bind(None)               # pycoll.partial's compiled entry: its comm is freed here
    _state.local_comm.Free()
    _state.p2p_comm.Free()
    if _state.departures is not None:
        _state.departures.comm.Free()
        _state.departures = None
    _state.world.free()
    for group in _state.user_groups.values():
        group.free(comm=False)          # the communicator is the user's
    for group in list(_state.new_groups):
        group.free()
    for engine in live:
        engine.stop(timeout=config.get("timeout"))
    _state.world = _state.local_comm = _state.p2p_comm = None
    _state.user_groups.clear()


def is_initialized() -> bool:
    return _state.world is not None


def world() -> Group:
    if _state.world is None:
        raise ValueError("pycoll has not been initialized; call pycoll.init() first")
    return _state.world


def engine() -> Engine:
    """The world group's engine."""
    return (_state.world or world()).engine             # world() raises if uninitialized


def rank() -> int:
    return world().rank()


def size() -> int:
    return world().size()


def p2p_comm():
    """pycoll's own duplicate of the world communicator for point-to-point protocols
    (partial_allreduce): their tags never meet anyone else's messages."""
    world()
    return _state.p2p_comm


def local_rank() -> int:
    world()
    return _state.local_comm.Get_rank()


def local_size() -> int:
    world()
    return _state.local_comm.Get_size()


def overlap_pays(on_cpu: bool, compute_threads: int) -> bool:
    """Whether communicating from the engine's thread while the caller computes (on the
    CPU with ``compute_threads`` threads, or on a device) can save time: off the CPU
    always; on it unless this rank is bound to no more cores than it computes with. A rank
    bound so (MPI binds ranks to cores when there are enough) has no core to overlap on:
    the engine's thread time-slices with compute, and the MPI library busy-polls while it
    waits for a peer whose engine thread is descheduled, burning the slices it gets (2
    ranks on 2 cores: DistributedOptimizer 1.3x slower than blocking allreduces after
    backward). There a blocking call from the caller's thread costs less; the engine runs
    it in that thread. Unbound ranks (more ranks than cores, where MPI also yields while it
    waits) overlap: at 4 ranks on 2 cores that made DDP 1.4x faster than blocking."""
    return not on_cpu or len(os.sched_getaffinity(0)) > compute_threads


def new_group(ranks: Iterable[int]) -> Group:
    """A group of the given world ranks. Only its members need to call this."""
    parent = world().comm
    ranks = [int(r) for r in ranks]
    if not ranks or len(set(ranks)) != len(ranks) or not all(0 <= r < parent.size for r in ranks):
        raise ValueError(f"new_group needs distinct ranks in [0, {parent.size}), got {ranks}")
    ranks = tuple(sorted(ranks))
    if parent.rank not in ranks:
        group = Group(None, ranks)
    else:
        def create():
            members = parent.Get_group().Incl(list(ranks))
            try:
                return parent.Create_group(members)
            finally:
                members.Free()
        group = Group(engine().run(create, f"new_group({list(ranks)})", among=ranks), ranks)
    _state.new_groups.add(group)
    return group


def resolve(group) -> Group:
    """``group=`` as users pass it: None (world), a Group or an mpi4py communicator."""
    if group is None:
        return _state.world or world()                 # world() raises if uninitialized
    if isinstance(group, Group):
        if group.freed:
            raise ValueError(f"{group} was released by pycoll.shutdown(); make groups anew "
                             "with pycoll.new_group() after pycoll.init()")
        if not group.is_member:
            raise ValueError(f"rank {world().rank()} is not a member of {group}; "
                             "only its members may run collectives on it")
        return group
    if hasattr(group, "Get_size") and hasattr(group, "Allreduce"):
        known = _state.user_groups.get(id(group))
        if known is None or known.comm is not group:
            known = _state.user_groups[id(group)] = Group(group, tuple(range(group.Get_size())))
        return known
    raise TypeError(f"group must be None, a pycoll.Group or an mpi4py communicator, "
                    f"got {type(group).__name__}")
