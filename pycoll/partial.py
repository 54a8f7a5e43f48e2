"""Partial All-Reduce: reduce among any subset of ranks, with no communicator per call.

    y = pycoll.partial_allreduce(x, ranks=[1, 4, 5])     # called on ranks 1, 4 and 5 only

Ripples' primitive (Luo et al., 2019). Only the members call it and all of them pass the
same ranks (in any order). Two paths:

- Point-to-point, the default, in the compiled core (``_C.partial_allreduce``,
  csrc/partial.cpp) on pycoll's own duplicate of the world communicator, calling MPI's
  non-blocking sends and receives without the GIL. Up to PYCOLL_PARTIAL_DIRECT_BYTES one
  latency-bound exchange: groups smaller than PYCOLL_PARTIAL_DOUBLING_FROM send their
  tensor to every other member at once, larger ones use recursive doubling (log2 k steps,
  one partner each). Beyond, a ring reduce-scatter then allgather in chunks of
  PYCOLL_CHUNK_BYTES (``tensors.pieces``), reducing one chunk while the next arrives.
  Every member gets the same bits. (Where _C has not found MPI, the same ring runs here in
  Python.) Under ``--link`` a round costs the modelled time of that exchange, paced as
  collectives are (``emulation.timed``).
- A cached communicator: the ``PYCOLL_PARTIAL_CACHE_AFTER``-th use of a set of ranks
  creates a communicator for it (``MPI_Comm_create_group``, collective over the members
  only) and later uses run MPI's own Allreduce on it. Every member counts a group's uses
  alike (each use involves them all), so the members switch paths together.

Tags: a message between two ranks carries the number of rounds those two began together
before (``pair_tags``), modulo MPI's tag range. Groups that share ranks are issued in the
same relative order on their common members, so both ends of every pair count alike and
no two rounds between a pair share a tag until the tag range (2^31 in Open MPI, at least
2^15 by the standard) has wrapped: a late message of a failed round never matches another
round's receive, whatever the groups. (Ranks only ever match messages from a named
source, so other pairs' tags do not matter.)

A blocking call on a contiguous host tensor, made while the engine is idle and with
checks and the timeline off, is one compiled call (``_C.partial_now``,
csrc/partial_now.cpp): it reads the tensor and routes its (op, dtype) as the collectives'
short path does (its reader and its table), counts the round in this module's own dicts
(``_Cache``: uses, rounds per peer) by the same rules, and runs the exchange or the
cached communicator's Allreduce without the GIL; under ``--link`` between the emulation's
``enter`` and ``leave`` (``_link_enter``), as the short path's collectives. Anything else
it leaves to ``_plan``.

Partial all-reduces run on the engine in issue order, like every collective. Groups that
share ranks must be issued in the same relative order on their common members (a group
generator that hands out groups in one global order guarantees it); otherwise they wait
for each other and raise ``CollectiveTimeout`` after PYCOLL_TIMEOUT, naming the peer, or
with PYCOLL_CHECK=1 raise ``CollectiveMismatch`` naming the group.

Fail-stop: after a round fails on a member (a timeout: messages of that round may still
be in flight), every later partial all-reduce of the same ranks on that member raises
``GroupBroken`` naming the failure, and its peers time out waiting for it. A mismatch
found by PYCOLL_CHECK is raised by every member after a complete exchange: the group
stays usable.
"""
import hashlib
import time
from collections import Counter
from typing import List, NamedTuple, Optional, Sequence, Tuple

import numpy as np
from mpi4py import MPI

from . import _C, config, emulation, runtime, tensors, timeline
from .collectives import (Average, check_reduction, kernel_op, message, mpi_op, reduce_op,
                          staged)
from .inspector import CollectiveMismatch
from .work import CollectiveTimeout, GroupBroken, Work, poll

class _Group(NamedTuple):
    """A set of ranks as this rank uses it: sorted, as a list (for _C), this rank's index,
    and as operations' names show it (formatted once: this is read on every call)."""
    members: Tuple[int, ...]
    ranks: List[int]
    index: int
    label: str


class _Cache:
    """Per-world state: uses of each group, rounds begun with each peer, and the
    communicators made for repeat groups."""

    GROUPS = 1 << 14                     # ranks lists remembered (read on every call)

    def __init__(self, comm):
        self.comm = comm
        self.me, self.size = comm.Get_rank(), comm.Get_size()
        self.tag_ub = comm.Get_attr(MPI.TAG_UB)
        self.groups: dict = {}               # ranks as passed -> _Group
        self.uses: Counter = Counter()
        self.shared: Counter = Counter()     # peer -> rounds begun with it
        self.comms: dict = {}
        self.broken: dict = {}           # members -> the error that broke them here
        self.compiled = _C.mpi_bound()           # else the ring runs in Python
        self.handles = (comm.handle, MPI.BYTE.handle, MPI.REQUEST_NULL.handle, MPI.UNDEFINED)
        if self.compiled:                # the compiled entry counts in the same dicts
            _C.partial_bind(self.shared, self.uses, self.comms, self.broken, _abandoned,
                            self.handles + (int(MPI.IN_PLACE),),
                            self.me, self.size, self.tag_ub, tensors.clone, _failed)

    def group(self, ranks) -> _Group:
        try:
            key = ranks if type(ranks) is tuple else tuple(ranks)
            found = self.groups.get(key)
        except TypeError:                    # not iterable, or not hashable: _members says
            key = found = None
        if found is None:
            members = _members(ranks, self.me, self.size)
            found = _Group(members, list(members), members.index(self.me), f"({list(members)})")
            if key is not None:
                if len(self.groups) >= self.GROUPS:
                    self.groups.clear()
                self.groups[key] = found
        return found


_cache: Optional[_Cache] = None


def _state() -> _Cache:
    global _cache
    comm = runtime.p2p_comm()                     # raises if pycoll is not initialized
    if _cache is None or _cache.comm is not comm:     # first use, or after shutdown/init
        _cache = _Cache(comm)
    return _cache


def _members(ranks: Sequence[int], me: int, size: int) -> Tuple[int, ...]:
    try:
        members = tuple(sorted(int(r) for r in ranks))
    except (TypeError, ValueError):
        raise TypeError(f"ranks must be a sequence of world ranks, got {ranks!r}") from None
    if not members or len(set(members)) != len(members) or not 0 <= members[0] <= members[-1] < size:
        raise ValueError(f"partial_allreduce needs distinct ranks in [0, {size}), got {list(ranks)}")
    if me not in members:
        raise ValueError(f"rank {me} is not in ranks {list(members)}; only the members of a "
                         "group call partial_allreduce")
    return members


def pair_tags(shared: Counter, members: Tuple[int, ...], me: int, tag_ub: int) -> List[int]:
    """The tags of a round of ``members`` on rank ``me``: for each member, the rounds
    ``me`` began with it before (``shared``, counted here) modulo ``tag_ub + 1``."""
    tags = [shared[m] % (tag_ub + 1) for m in members]
    for m in members:
        if m != me:
            shared[m] += 1
    return tags


# Sends of failed rounds, with the objects that own their buffers: MPI cannot cancel a
# send, and may read its buffer until the peer takes it (or the process ends).
_abandoned: list = []


def _late(name, members, me, peer) -> str:
    return (f"pycoll: {name} among ranks {list(members)} did not complete within "
            f"PYCOLL_TIMEOUT ({config.get('timeout'):g} s): rank {me} waited for rank {peer}; "
            "a member may have skipped it, issued its groups in another order, or died")


def _reduce(state: _Cache, group: _Group, tags, ptr, count, dtype, op, deadline, name, keep,
            direct_bytes: int) -> None:
    """Reduce ``count`` elements at ``ptr`` among ``group`` in place; ``keep`` owns that
    memory (kept while sends of a failed round may still read it)."""
    if _abandoned:
        _abandoned[:] = [(sends, owner) for sends, owner in _abandoned
                         if not MPI.Request.Testall(sends)]
    if not state.compiled:
        _Ring(state.comm, group.members, state.me, tags, ptr, count, dtype, op, deadline, name,
              keep).run()
        return
    average = op is Average
    status, peer, error, sends = _C.partial_allreduce(
        *state.handles, group.ranks, tags, group.index, ptr, count, dtype,
        kernel_op(op), 1.0 / len(group.ranks) if average else 1.0,
        tensors.piece_bytes(tensors.ITEMSIZE[dtype], _settings.chunk_bytes), direct_bytes,
        _settings.doubling_from, max(0.0, deadline - time.monotonic()))
    if status:
        _raise_failure(group.members, state.me, name, keep, status, peer, error, sends)


def _raise_failure(members, me, name, keep, status, peer, error, sends) -> None:
    """A compiled round's failure (status 1: late waiting for rank ``peer``; 2: MPI's
    ``error``) raised; ``sends`` that may still read ``keep``'s memory are kept."""
    if sends:
        _abandoned.append(([MPI.Request.fromhandle(h) for h in sends], keep))
    if status == 1:
        raise CollectiveTimeout(_late(name, members, me, peer))
    raise MPI.Exception(error)


def _failed(members, name, keep, status, peer, error, sends) -> None:
    """The compiled entry's failed round: raised, and the group broken here, as ``run``
    in _plan does."""
    state = _state()
    try:
        _raise_failure(members, state.me, name, keep, status, peer, error, sends)
    except BaseException as failure:
        state.broken[members] = f"{type(failure).__name__}: {failure}"
        raise


class _Ring:
    """One ring reduce-scatter + allgather over the members on buffer ``ptr`` in place;
    ``keep`` owns that memory."""

    def __init__(self, comm, members, me, tags, ptr, count, dtype, op, deadline, name, keep):
        self.keep = keep
        k, p = len(members), members.index(me)
        self.comm, self.members, self.k, self.p = comm, members, k, p
        self.left, self.right = members[(p - 1) % k], members[(p + 1) % k]
        self.send_tag, self.recv_tag = tags[(p + 1) % k], tags[(p - 1) % k]
        self.ptr, self.dtype, self.op, self.deadline, self.name = ptr, dtype, op, deadline, name
        self.item = tensors.ITEMSIZE[dtype]
        self.bounds = [count * i // k for i in range(k + 1)]
        self.chunks = [[(lo + offset // self.item, lo + (offset + nbytes) // self.item)
                        for offset, nbytes in tensors.pieces((hi - lo) * self.item, self.item)
                        if nbytes]
                       for lo, hi in zip(self.bounds, self.bounds[1:])]
        self.sending: dict = {}          # (block, chunk) -> send requests still reading it
        self.scratch = None

    def _send(self, block: int, c: int) -> None:
        lo, hi = self.chunks[block][c]
        req = self.comm.Isend(message(self.ptr + lo * self.item, (hi - lo) * self.item),
                              dest=self.right, tag=self.send_tag)
        self.sending.setdefault((block, c), []).append(req)

    def run(self) -> None:
        try:
            self._run()
        except BaseException:
            sends = [req for reqs in self.sending.values() for req in reqs]
            _abandoned.append((sends, (self.keep, self.scratch)))
            raise

    def _run(self) -> None:
        k, p = self.k, self.p
        # Steps 0..k-2 reduce-scatter (receive block p-s-1 and reduce it in), then k-1
        # allgather steps (receive block p-t into place). What a step receives is what the
        # next step sends, so each chunk is forwarded the moment it is ready.
        steps = [((p - s - 1) % k, True) for s in range(k - 1)]
        steps += [((p - t) % k, False) for t in range(k - 1)]
        largest = max(hi - lo for hi, lo in zip(self.bounds[1:], self.bounds))
        self.scratch = scratch = np.empty(largest * self.item, np.uint8)   # a step's chunks
        for c in range(len(self.chunks[p])):
            self._send(p, c)
        for s, (block, reduce) in enumerate(steps):
            recvs = []
            for c, (lo, hi) in enumerate(self.chunks[block]):
                if reduce:
                    dst = scratch.ctypes.data + (lo - self.chunks[block][0][0]) * self.item
                else:
                    # Receiving in place: a send still reading this chunk must finish first.
                    for req in self.sending.pop((block, c), []):
                        poll(lambda: True if req.Test() else None, self.deadline,
                              lambda: self._late(self.right))
                    dst = self.ptr + lo * self.item
                recvs.append(self.comm.Irecv(message(dst, (hi - lo) * self.item),
                                             source=self.left, tag=self.recv_tag))
            # In chunk order, not as they land: the next step's receiver matches this
            # step's sends to its receives, all of one tag, in the order they are posted.
            for c in range(len(recvs)):
                self._wait(recvs, c)
                lo, hi = self.chunks[block][c]
                if reduce:
                    src = scratch.ctypes.data + (lo - self.chunks[block][0][0]) * self.item
                    _C.reduce(self.ptr + lo * self.item, src, hi - lo, self.dtype,
                              kernel_op(self.op))
                    if s == k - 2 and self.op is Average:     # this block is complete here
                        _C.scale(self.ptr + lo * self.item, hi - lo, self.dtype, 1.0 / k)
                if s + 1 < len(steps):
                    self._send(block, c)
        for reqs in self.sending.values():
            for req in reqs:
                poll(lambda: True if req.Test() else None, self.deadline,
                      lambda: self._late(self.right))

    def _wait(self, recvs, c: int) -> None:
        try:
            poll(lambda: True if recvs[c].Test() else None, self.deadline,
                 lambda: self._late(self.left))
        except CollectiveTimeout:
            for req in recvs:            # no late message may land in freed scratch memory
                if req != MPI.REQUEST_NULL:
                    req.Cancel()
                    req.Wait()
            raise

    def _late(self, peer: int) -> str:
        return _late(self.name, self.members, self.members[self.p], peer)


def _agree(state: _Cache, group: _Group, tags, deadline, name, what: str) -> None:
    """PYCOLL_CHECK for a group with no communicator: a max of (h, -h), h a hash of what
    this member passes (its group included), tells every member whether all passed the
    same."""
    k = len(group.members)
    h = int.from_bytes(hashlib.blake2b(f"{group.members} {what}".encode(),
                                       digest_size=8).digest(), "little") >> 2
    token = np.repeat(np.array([h, -h], np.int64), k)
    _reduce(state, group, tags, token.ctypes.data, token.size, "int64", reduce_op("max"),
            deadline, name, token, direct_bytes=token.nbytes)
    if token[0] != -token[k]:
        raise CollectiveMismatch(f"pycoll: {name} among ranks {group.ranks}: the members "
                                 f"passed different tensors or ops; rank {state.me} passed "
                                 f"{what}. Every member must pass the same dtype, size and op.")


def _cached_comm(state: _Cache, group: _Group, tags, uses, deadline, name):
    """The group's own communicator, made at its PYCOLL_PARTIAL_CACHE_AFTER-th use."""
    comm = state.comms.get(group.members)
    if comm is None:
        # A token first: MPI_Comm_create_group has no timeout, our wait does.
        token = np.zeros(len(group.members), np.uint8)
        _reduce(state, group, tags, token.ctypes.data, token.size, "uint8", reduce_op("max"),
                deadline, name, token, direct_bytes=token.nbytes)
        mpi_group = state.comm.Get_group().Incl(group.ranks)
        try:
            comm = state.comm.Create_group(mpi_group, uses % (state.tag_ub + 1))
        finally:
            mpi_group.Free()
        state.comms[group.members] = comm
    return comm


class _Settings(NamedTuple):
    """The knobs read on every call, kept here when they change (``config.watch``):
    ``config.get`` costs about 0.1 us a knob."""
    check: bool
    cache_after: int
    direct_bytes: int
    doubling_from: int
    chunk_bytes: int
    timeout: float
    link: object


def _read_settings() -> None:
    global _settings
    _settings = _Settings(config.get("check"), config.get("partial_cache_after"),
                          config.get("partial_direct_bytes"), config.get("partial_doubling_from"),
                          config.get("chunk_bytes"), config.get("timeout"), config.get("link"))
    # The compiled entry: checks and the timeline happen here only.
    _C.partial_settings(not _settings.check and not timeline.configured(),
                        _settings.cache_after, _settings.direct_bytes, _settings.doubling_from,
                        _settings.chunk_bytes, _settings.timeout,
                        *((_link_pace,) if _settings.link else ()))


def _link_pace(members: Tuple[int, ...]):
    """The compiled entry's pacing of a round of ``members`` (as ``_plan``'s)."""
    return emulation.group(_state().comm, members)


_settings: _Settings
config.watch(_read_settings)


def _exchange(state: _Cache, group: _Group, dst, ptr: int, op, uses: int, tags, deadline,
              name, keep) -> None:
    """Reduce ``dst`` (its host memory at ``ptr``) among ``group``: on the group's cached
    communicator from its PYCOLL_PARTIAL_CACHE_AFTER-th use, else point to point."""
    after = _settings.cache_after
    if after and uses >= after:
        comm = _cached_comm(state, group, tags, uses, deadline, name)
        comm.Allreduce(MPI.IN_PLACE, message(ptr, dst.nbytes, dst.dtype), mpi_op(op, dst.dtype))
        if op is Average:
            _C.scale(ptr, dst.count, dst.dtype, 1.0 / len(group.members))
    else:
        _reduce(state, group, tags, ptr, dst.count, dst.dtype, op, deadline, name, keep,
                _settings.direct_bytes)


def _plan(x, ranks, op, name, inplace):
    op, name = reduce_op(op), name or "partial_allreduce"
    state = _state()
    group = state.group(ranks)
    members, me = group.members, state.me
    src = tensors.as_buffer(x, writable=inplace)
    check_reduction(op, src.dtype)
    out = x if inplace else tensors.clone(x)
    dst = src if inplace else tensors.as_buffer(out, writable=True)

    def run():
        if len(members) == 1:
            return out                   # a group of one: the reduction is x itself
        # Counted before anything can fail: every member counts every round issued to it.
        state.uses[members] += 1
        uses = state.uses[members]
        tags = pair_tags(state.shared, members, me, state.tag_ub)
        if state.broken and members in state.broken:
            raise GroupBroken(f"pycoll: {name} among ranks {group.ranks}: this group is broken "
                              f"on rank {me} since an earlier round failed "
                              f"({state.broken[members]}); that round's messages may still "
                              "arrive. Use other groups, or restart the job.")
        deadline = time.monotonic() + _settings.timeout
        try:
            if _settings.check:
                _agree(state, group, tags, deadline, name,
                       f"{dst.dtype} x {dst.count} op={op.value}")
            if dst.device == "cpu":
                _exchange(state, group, dst, dst.ptr, op, uses, tags, deadline, name, out)
            else:
                # The ring reduces with the CPU kernels: GPU memory is staged, CUDA-aware
                # MPI or not.
                with staged(dst, True, True) as ptr:
                    _exchange(state, group, dst, ptr, op, uses, tags, deadline, name, out)
        except CollectiveMismatch:
            raise                        # every member found it after a complete exchange
        except BaseException as error:
            state.broken[members] = f"{type(error).__name__}: {error}"
            raise
        return out
    if _settings.link:          # the cost of the exchange the compiled core runs, either path
        kind = "direct" if dst.nbytes <= _settings.direct_bytes else "allreduce"
        run = emulation.timed(kind, state.comm, dst.nbytes, run, members)
    return name + group.label, run, members


def partial_allreduce(x, ranks, op=Average, name: Optional[str] = None):
    """Reduce ``x`` over the world ranks ``ranks`` (called by those ranks only); a new tensor."""
    out = _C.partial_now(x, False, ranks, op, name)
    if out is not None:
        return out
    name, run, members = _plan(x, ranks, op, name, inplace=False)
    return runtime.engine().run(run, name, members)


def partial_allreduce_(x, ranks, op=Average, name: Optional[str] = None):
    """``partial_allreduce`` into ``x`` itself; returns ``x``."""
    if _C.partial_now(x, True, ranks, op, name) is not None:
        return x
    name, run, members = _plan(x, ranks, op, name, inplace=True)
    return runtime.engine().run(run, name, members)


def partial_allreduce_async(x, ranks, op=Average, name: Optional[str] = None) -> Work:
    """Start a ``partial_allreduce``; ``Work.wait()`` returns the new tensor."""
    name, run, members = _plan(x, ranks, op, name, inplace=False)
    return runtime.engine().submit(run, name, members)


def partial_allreduce_async_(x, ranks, op=Average, name: Optional[str] = None) -> Work:
    name, run, members = _plan(x, ranks, op, name, inplace=True)
    return runtime.engine().submit(run, name, members)
