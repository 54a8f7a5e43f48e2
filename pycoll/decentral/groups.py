"""Where Ripples' groups come from: three pluggable policies.

A policy answers ``next_group()`` once per local step with the world ranks this worker
averages with now (a group of one means "no averaging this step"), and ``leave()`` when
the worker stops, with the groups it must still run so nobody waits for it in vain;
``close()`` after those.

- ``StaticGroups``: a precomputed conflict-free schedule for equal workers. Phase k of
  the schedule partitions the workers into disjoint groups; every worker runs phase
  ``step % phases``. When the number of workers is a power of the group size, phase k
  groups the ranks that differ only in base-``group_size`` digit k, so one pass over the
  phases averages every model exactly (a butterfly); otherwise each phase is a seeded
  random partition.
- ``RandomGroups``: a fresh random partition at every step, drawn from a seed all workers
  share, so the groups are random yet conflict-free with no service at all.
- ``GroupGenerator``: Ripples' Group Generator, a service on one rank (``root``) that
  hands out groups on request, in one global order (hence no deadlock: the oldest
  unfinished group has every member free to run it). Group Buffer: a group is put in
  each partner's buffer while that partner computes, so its next request returns at
  once. Group Division: a worker whose buffer already holds a group would make the new
  group wait behind that one, so the new group is split off without it. Speed awareness
  (our reading of "fast workers never wait for slow ones"): the generator learns each
  worker's step period from its requests and only picks partners expected to be ready
  within ``tolerance`` of the requester's own period; a slow worker is picked rarely (it
  joins fewer groups) and never keeps a fast one waiting for more than that.

Static and random groups make every worker take part in every step, so one slow worker
slows everyone (use them for equal workers); the generator is for unequal ones.
"""
import itertools
import math
import random
import threading
import time
from collections import deque
from typing import Dict, List, Optional, Sequence, Tuple

from .. import config, emulation, runtime
from ..work import CollectiveTimeout, poll

Groups = List[Tuple[int, ...]]


def _check(n: int, group_size: int) -> None:
    if n < 1 or group_size < 1:
        raise ValueError(f"need at least one worker and group_size >= 1, got {n} workers "
                         f"and group_size={group_size}")


def _chunks(order: Sequence[int], group_size: int) -> Groups:
    return [tuple(sorted(order[i:i + group_size])) for i in range(0, len(order), group_size)]


def random_partition(n: int, group_size: int, seed: int, step: int) -> Groups:
    """A random partition of range(n) into groups of group_size (the last may be smaller),
    the same wherever it is drawn with the same seed and step."""
    _check(n, group_size)
    order = list(range(n))
    random.Random(f"{seed}:{step}").shuffle(order)
    return _chunks(order, group_size)


def static_schedule(n: int, group_size: int, seed: int = 0) -> List[Groups]:
    """Phases of disjoint groups covering range(n): a butterfly over base-group_size digits
    when n is a power of group_size, else n seeded random partitions."""
    _check(n, group_size)
    digits = round(math.log(n, group_size)) if group_size > 1 and n > 1 else 0
    if n > 1 and group_size > 1 and group_size ** digits == n:
        phases = []
        for d in range(digits):
            unit = group_size ** d
            phases.append([tuple(base + j * unit for j in range(group_size))
                           for base in range(n) if base // unit % group_size == 0])
        return phases
    return [random_partition(n, group_size, seed, phase) for phase in range(n)]


def _mine(groups: Groups, rank: int) -> Tuple[int, ...]:
    return next(g for g in groups if rank in g)


class _Lockstep:
    """Policies whose groups every worker works out alone, one group per step: nothing
    to ask for, leave or close."""

    def __init__(self):
        self.rank, self.step = runtime.rank(), 0

    def partition(self, step: int) -> Groups:
        raise NotImplementedError

    def next_group(self) -> Tuple[int, ...]:
        group = _mine(self.partition(self.step), self.rank)
        self.step += 1
        return group

    def leave(self) -> Groups:
        return []

    def close(self) -> None:
        pass


class StaticGroups(_Lockstep):
    """A precomputed conflict-free schedule; every worker runs one group per step."""

    def __init__(self, group_size: int = 2, seed: int = 0):
        super().__init__()
        self.phases = static_schedule(runtime.size(), group_size, seed)

    def partition(self, step: int) -> Groups:
        return self.phases[step % len(self.phases)]


class RandomGroups(_Lockstep):
    """A random partition per step from a shared seed: random yet conflict-free."""

    def __init__(self, group_size: int = 3, seed: int = 0):
        super().__init__()
        self.size, self.group_size, self.seed = runtime.size(), group_size, seed

    def partition(self, step: int) -> Groups:
        return random_partition(self.size, self.group_size, self.seed, step)


class GroupBook:
    """The Group Generator's decisions, without MPI: buffers, division and speeds.

    ``request(rank, now)`` is a worker ready to average at time ``now``; ``leave(rank)``
    a worker that stops. Times are the generator's own clock.
    """

    def __init__(self, n: int, group_size: int = 3, seed: int = 0, tolerance: float = 0.5):
        _check(n, group_size)
        self.group_size, self.tolerance = group_size, tolerance
        self.active = set(range(n))
        self.buffer: Dict[int, deque] = {r: deque() for r in range(n)}
        self.last: Dict[int, float] = {}
        self.period: Dict[int, float] = {}
        self.rng = random.Random(seed)
        self.issued: Groups = []            # every group of two or more, in issue order

    def request(self, rank: int, now: float) -> Tuple[int, ...]:
        if rank in self.last:               # smoothed period: robust to one odd step
            gap = now - self.last[rank]
            self.period[rank] = gap if rank not in self.period else 0.7 * self.period[rank] + 0.3 * gap
        self.last[rank] = now
        if self.buffer[rank]:
            return self.buffer[rank].popleft()
        horizon = now + self.tolerance * self.period.get(rank, 0.0)
        free = [r for r in sorted(self.active) if r != rank and not self.buffer[r]
                and r in self.period and self.last[r] + self.period[r] <= horizon]
        partners = self.rng.sample(free, min(len(free), self.group_size - 1))
        group = tuple(sorted([rank, *partners]))
        for r in partners:
            self.buffer[r].append(group)
        if partners:
            self.issued.append(group)
        return group

    def leave(self, rank: int) -> Groups:
        """Stop choosing ``rank``; the groups it must still run."""
        self.active.discard(rank)
        pending, self.buffer[rank] = list(self.buffer[rank]), deque()
        return pending


_REQUEST, _REPLY = 1, 2


class GroupGenerator:
    """Ripples' Group Generator: a service thread on ``root`` serving ``GroupBook``'s groups.

    Collective to construct (every rank makes one: it duplicates pycoll's world).
    """

    def __init__(self, group_size: int = 3, seed: int = 0, tolerance: float = 0.5, root: int = 0):
        self.comm = emulation.p2p(runtime.world().comm.Dup())
        self.rank, self.root = self.comm.Get_rank(), root
        self.book = GroupBook(self.comm.Get_size(), group_size, seed, tolerance)
        self.thread: Optional[threading.Thread] = None
        self.failure: Optional[BaseException] = None     # what ended the service early
        if self.rank == root:
            self.thread = threading.Thread(target=self._serve, name="pycoll-group-generator",
                                           daemon=True)
            self.thread.start()

    def _serve(self) -> None:
        from mpi4py import MPI
        book, start = self.book, time.monotonic()
        try:
            while book.active:
                timeout = config.get("timeout")
                poll(lambda: True if self.comm.iprobe(MPI.ANY_SOURCE, _REQUEST) else None,
                     time.monotonic() + timeout, lambda: self._silent(timeout))
                status = MPI.Status()
                kind = self.comm.recv(source=MPI.ANY_SOURCE, tag=_REQUEST, status=status)
                worker = status.Get_source()
                reply = (book.request(worker, time.monotonic() - start) if kind == "next"
                         else book.leave(worker))
                self.comm.send(reply, dest=worker, tag=_REPLY)
        except BaseException as error:      # raised by close(), on the thread that called it
            self.failure = error

    def _silent(self, timeout: float) -> str:
        return (f"pycoll: the group generator on rank {self.root} heard from no worker within "
                f"PYCOLL_TIMEOUT ({timeout:g} s); ranks {sorted(self.book.active)} have not "
                "left: they died, hang, or stopped without close()")

    def _ask(self, kind: str):
        self.comm.send(kind, dest=self.root, tag=_REQUEST)
        request = self.comm.irecv(source=self.root, tag=_REPLY)
        timeout = config.get("timeout")

        def answer():
            done, value = request.test()
            return (value,) if done else None     # a tuple: the answer itself may be falsy
        return poll(answer, time.monotonic() + timeout,
                    lambda: f"pycoll: the group generator on rank {self.root} did not answer "
                            f"rank {self.rank} within PYCOLL_TIMEOUT ({timeout:g} s)")[0]

    def next_group(self) -> Tuple[int, ...]:
        return tuple(self._ask("next"))

    def leave(self) -> Groups:
        return [tuple(g) for g in self._ask("leave")]

    def close(self) -> None:
        """After ``leave`` and its groups: the root waits for every worker to leave (at most
        PYCOLL_TIMEOUT after the last one it heard from)."""
        if self.thread is not None:
            self.thread.join(config.get("timeout") + 1.0)     # the service times out first
            if self.thread.is_alive():
                raise CollectiveTimeout(self._silent(config.get("timeout")))
            self.thread = None
            if self.failure is not None:
                raise self.failure
        self.comm.Free()


def schedule_conflicts(phases: List[Groups], n: int) -> List[str]:
    """What is wrong with a schedule: a phase whose groups overlap or miss a worker."""
    problems = []
    for k, phase in enumerate(phases):
        members = list(itertools.chain.from_iterable(phase))
        if sorted(members) != list(range(n)):
            problems.append(f"phase {k}: {phase} is not a partition of range({n})")
    return problems
