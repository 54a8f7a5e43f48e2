"""A worker's side of the protocol: requests become ``Work`` at once.

``push``, ``pull`` and ``push_pull`` build one ``_Part`` per server holding the keys
(``layout.by_server``) and hand them to the worker's thread, which posts each part's
nonblocking sends and receives as soon as the part has a tag slot (``wire.Slots``), in
submission order, so requests to different servers overlap, and completes the request's
``Work`` when all of its parts are done. Payloads go straight from and to the caller's
tensors when a server holds one contiguous range of them; otherwise they are packed or
unpacked with ``pycoll._C`` (GIL released). The thread polls MPI while requests are in
flight, napping a fraction of the quiet spell between polls (``wire.nap``), and sleeps on
a condition variable when none are.

Every request is answered. A server's error fails the request's ``Work`` with the
server's text once its other parts are answered too (the streams stay in step). A
request with no answer within the timeout is cancelled: its MPI requests are cancelled
and completed before their buffers are let go, and its slot is never used again (a late
answer could land there). If the thread itself fails, every pending ``Work`` fails with
the error and the next call raises it.
"""
import collections
import logging
import threading
import time
from typing import Dict, List, Optional, Sequence

import numpy as np
from mpi4py import MPI

from .. import _C, config, timeline
from ..work import wait_requests
from ..tensors import as_buffer
from ..work import CollectiveTimeout, Work
from . import wire
from .layout import Key, by_server

log = logging.getLogger("pycoll.ps")
SLEEP_MIN, SLEEP_MAX = 20e-6, 5e-4
# While a transfer this large is in flight the thread polls after time.sleep(0), which on
# Python 3.11 is a short nap (40-90 us here), not a yield: the copies progress in our MPI
# calls, and a longer sleep would stall them. A true yield (os.sched_yield) was slower:
# 64 MiB push+pull over 2 servers 23-24 ms against 17.6-19.8 (bench/ps_throughput.py, 4
# runs each, alternated): the spinning worker took the cores the servers copy on.
# Not under --link: there the emulation holds a request well past its copy and wakes the
# nap when it releases it, and the spin only took the cores from compute (the overlap
# bench's worker at 1 Gb/s: about 20 ms of CPU a step, bench/overlap.py's w cpu).
BIG = 256 << 10
RETRY_MIN, RETRY_MAX = 5e-4, 4e-3        # SSP's refused pulls are sent again after this
CANCEL_GRACE_S = 1.0                     # how long a cancelled request may take to complete


class PSWork(Work):
    """A PS request's Work. Its default wait outlasts the thread's own timeout, so a
    request that times out reports which server did not answer."""

    def __init__(self, name: str, timeout: float):
        super().__init__(name)
        self._timeout = timeout

    def wait(self, timeout: Optional[float] = None):
        return super().wait(self._timeout + 5.0 if timeout is None else timeout)


class _Part:
    """One request to one server."""

    def __init__(self, server: int, op: int, table: bytes = b"", nkeys: int = 0, arg: int = 0,
                 payload=None, pieces=(), into=None, value: float = 1.0, value2: float = 0.0):
        self.server, self.op, self.table, self.nkeys, self.arg = server, op, table, nkeys, arg
        self.value = value              # the header's float: a push's weight (wire)
        self.value2 = value2            # the second: a turn's computing seconds, a pull's priority
        self.payload = payload          # uint8 array sent after the header, or None
        self.pieces = pieces            # (first, end) bytes of each payload message
        self.nbytes = 0 if payload is None else payload.nbytes
        self.into = into                # pull: uint8 memory the parameters land in
        into_bytes = 0 if into is None else (
            into.nbytes if isinstance(into, np.ndarray) else len(into))
        self.big = max(self.nbytes, into_bytes) >= BIG
        self.requests: List[MPI.Request] = []
        self.receive = None             # pull: the receive into ``into``, posted at send
        self.meta = np.zeros(wire.META_LEN, np.int64)
        self.data = None                # reply text or JSON when not ``into``
        self.stage = "new"              # new -> sent -> data -> done; retry; failed
        self.slot: Optional[int] = None
        self.request_id = 0
        self.first_sent = self.retry_at = 0.0
        self.backoff = RETRY_MIN
        self.laggard = -1
        self.held = False               # waits for its op's gate to open


class _Op:
    def __init__(self, name: str, parts: List[_Part], work: PSWork, finish=None, keep=None,
                 gate=None):
        self.name, self.parts, self.work, self.finish = name, parts, work, finish
        self.keep = keep                # tensors the MPI calls read or write
        self.gate = gate                # None, or () -> None | (send at, weight factor)
        for part in parts:
            part.held = gate is not None
        self.started = time.monotonic()
        self.error: Optional[BaseException] = None     # a server's answer: after the rest


def _spans(where, items):
    """(address, bytes) of each key range ``items`` names, in the caller's buffers."""
    return [(where[k.name].ptr + r.lo * k.itemsize, r.count * k.itemsize) for k, r in items]


def _joined(spans):
    """``spans`` with neighbours in memory made one: one span is used in place, no copy
    (e.g. keys that are consecutive views of one buffer)."""
    out = []
    for ptr, n in spans:
        if out and out[-1][0] + out[-1][1] == ptr:
            out[-1] = (out[-1][0], out[-1][1] + n)
        else:
            out.append((ptr, n))
    return out


class Client:
    """One worker's connection to the servers (``comm`` ranks ``server_ranks``)."""

    def __init__(self, comm, server_ranks: Sequence[int], worker: int, timeout: float,
                 tag_ub: Optional[int] = None):
        self.comm, self.server_ranks, self.worker = comm, list(server_ranks), worker
        self.timeout = timeout
        real_ub = comm.Get_attr(MPI.TAG_UB) or MPI.COMM_WORLD.Get_attr(MPI.TAG_UB)
        self.tag_ub = real_ub if tag_ub is None else min(int(tag_ub), real_ub)
        self.slots = wire.Slots(self.tag_ub)
        self.keys: Dict[str, Key] = {}
        self._tables: Dict[tuple, bytes] = {}          # (server, names) -> header entries
        self._new: collections.deque = collections.deque()
        self._cv = threading.Condition()
        self._closed = False
        self._link = bool(config.get("link"))
        self._failed: Optional[BaseException] = None
        self._next_id = 0
        self._zombies: list = []        # cancelled requests not yet complete, and buffers
        self.counters = dict(worker=worker, pushes=0, pulls=0, refused_pulls=0,
                             pull_wait_s=0.0, bytes_sent=0, bytes_received=0, clock=0,
                             max_staleness=0, requests=0, max_tag=0)
        self.clocks = [0] * len(self.server_ranks)     # this worker's clock at each server
        self.pushed = [0] * len(self.server_ranks)     # push requests submitted to each
        self.versions = [0] * len(self.server_ranks)   # of the parameters last pulled from each
        self._thread = threading.Thread(target=self._run, name="pycoll-ps", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------ building requests
    def lookup(self, names) -> List[Key]:
        if len(set(names)) != len(names):
            twice = sorted({n for n in names if names.count(n) > 1})
            raise ValueError(f"pycoll.ps: key(s) {twice} appear more than once in one call; "
                             "name each key once")
        try:
            return [self.keys[n] for n in names]
        except KeyError as err:
            raise KeyError(f"pycoll.ps: unknown key {err.args[0]!r}; declare it with "
                           "pycoll.ps.init_params first (known: "
                           f"{', '.join(list(self.keys)[:10]) or 'none'})") from None

    def buffers(self, keys: List[Key], values, writable: bool) -> list:
        if len(values) != len(keys):
            raise ValueError(f"pycoll.ps: {len(keys)} keys but {len(values)} tensors")
        bufs = []
        for key, value in zip(keys, values):
            buf = as_buffer(value, writable=writable)
            if buf.is_cuda:
                raise TypeError(f"pycoll.ps: key {key.name!r} is a CUDA tensor; the parameter "
                                "server keeps parameters in host memory: pass x.cpu()")
            if buf.dtype != key.dtype or buf.count != key.count:
                raise ValueError(f"pycoll.ps: key {key.name!r} is {key.dtype} {list(key.shape)} "
                                 f"but the tensor given is {buf.dtype} {list(buf.shape)}")
            bufs.append(buf)
        return bufs

    def _table(self, server: int, items) -> bytes:
        cache = (server, tuple(items))           # the keys themselves: they may be redeclared
        table = self._tables.get(cache)
        if table is None:
            table = self._tables[cache] = wire.encode_table(
                [wire.Entry(k.name, k.dtype, k.count, r.lo, r.hi) for k, r in items])
        return table

    def parts(self, op: int, keys: List[Key], sources=None, outs=None, weight: float = 1.0,
              priority: float = 0.0):
        """Parts that send ``sources`` (push, init, with ``weight``) and/or receive into
        ``outs`` (pull, answered by ``priority``), and the unpacking to run once they are
        done."""
        parts, unpacks = [], []
        send = None if sources is None else {k.name: b for k, b in zip(keys, sources)}
        recv = None if outs is None else {k.name: b for k, b in zip(keys, outs)}
        # Server 0's request last: under R²SP its arrival there releases the next turn,
        # so this one's requests to the other servers are out ahead of the next worker's.
        for server, items in sorted(by_server(keys).items(), reverse=True):
            payload = pieces = into = None
            if send is not None:
                spans = _spans(send, items)
                joined = _joined(spans)
                if len(joined) == 1:
                    payload = np.frombuffer(MPI.buffer.fromaddress(*joined[0]), np.uint8)
                else:
                    payload = np.empty(sum(n for _, n in joined), np.uint8)
                    _C.pack(payload.ctypes.data, [p for p, _ in joined], [n for _, n in joined])
                pieces = wire.bounds(wire.pieces([n for _, n in spans],
                                                 [k.itemsize for k, _ in items]))
            if recv is not None:
                spans = _joined(_spans(recv, items))
                if len(spans) == 1:
                    into = MPI.buffer.fromaddress(spans[0][0], spans[0][1])
                else:
                    into = np.empty(sum(n for _, n in spans), np.uint8)
                    unpacks.append((into, spans))
            version = self.versions[server] if op in (wire.PUSH, wire.PUSH_PULL) else 0
            parts.append(_Part(server, op, self._table(server, items), len(items), arg=version,
                               payload=payload, pieces=pieces or (), into=into, value=weight,
                               value2=priority if recv is not None else 0.0))

        def unpack():
            for staging, spans in unpacks:
                _C.unpack(staging.ctypes.data, [p for p, _ in spans], [n for _, n in spans])
        return parts, unpack

    def control(self, op: int, arg: int = 0, servers=None, value: float = 1.0,
                value2: float = 0.0) -> List[_Part]:
        """A keyless request (stats, checkpoint, done, turn) to each server."""
        servers = range(len(self.server_ranks)) if servers is None else servers
        return [_Part(s, op, arg=arg(s) if callable(arg) else arg, value=value, value2=value2)
                for s in servers]

    def submit(self, name: str, parts: List[_Part], finish=None, keep=None,
               gate=None) -> PSWork:
        """``gate``: the parts are sent only once ``gate()`` (called by the thread; it may
        raise) returns (time.monotonic() to send at, a factor of their weight), and
        later requests wait behind them (R²SP: a push waiting for its turn)."""
        self.raise_if_failed()
        work = PSWork(name, self.timeout)
        op = _Op(name, parts, work, finish, keep, gate)
        for part in parts:
            if part.op in (wire.PUSH, wire.PUSH_PULL):
                self.pushed[part.server] += 1
        if not parts:
            work.finish(finish() if finish else None)
            return work
        with self._cv:
            self._new.append(op)
            self._cv.notify()
        return work

    def raise_if_failed(self) -> None:
        if self._failed is not None:
            raise RuntimeError(f"pycoll.ps: this worker's communication thread failed: "
                               f"{self._failed!r}; the parameter server cannot be used "
                               "further from this process") from self._failed

    def close(self) -> None:
        """End the thread once the requests submitted so far are done."""
        with self._cv:
            self._closed = True
            self._cv.notify()
        if self._thread is not threading.current_thread():
            self._thread.join(self.timeout + 10.0)

    # ------------------------------------------------------------ the thread
    def _run(self) -> None:
        active: List[_Op] = []
        try:
            self._loop(active)
        except BaseException as error:          # never silently: every Work learns of it
            log.error("pycoll.ps: worker %d's communication thread failed: %r",
                      self.worker, error)
            with self._cv:
                self._failed = error
                pending = active + list(self._new)
                self._new.clear()
            self._orphans = pending       # kept: MPI may still read or write their buffers
            for op in pending:
                if not op.work._done.is_set():
                    op.work.finish(error=error)

    def _loop(self, active: List[_Op]) -> None:
        unsent: collections.deque = collections.deque()       # parts waiting for a slot
        quiet_since = time.monotonic()
        while True:
            with self._cv:
                while not self._new and not active:
                    if self._closed:
                        return
                    self._cv.wait()
                fresh = list(self._new)
                self._new.clear()
            for op in fresh:
                unsent.extend(op.parts)
            active += fresh
            moved = bool(fresh)
            while unsent and self.slots.available() and not unsent[0].held:
                self._send(unsent.popleft())           # in order: servers see them as issued
            for op in list(active):
                try:
                    moved |= self._progress(op)
                    if any(p.stage not in ("done", "failed") for p in op.parts):
                        continue
                    if op.error is not None:
                        raise op.error
                    result = op.finish() if op.finish else None
                except Exception as error:             # delivered to whoever waits
                    self._abandon(op)
                    for part in op.parts:
                        if part in unsent:
                            unsent.remove(part)
                    active.remove(op)
                    op.work.finish(error=error)
                    continue
                active.remove(op)
                op.work.finish(result)
            self._bury()
            now = time.monotonic()
            if moved:
                quiet_since = now
            elif not self._link and any(p.big and p.stage in ("sent", "data")
                                        for op in active for p in op.parts):
                time.sleep(0)
            else:
                wire.nap(now - quiet_since, SLEEP_MIN, SLEEP_MAX)

    def _send(self, part: _Part) -> None:
        dest = self.server_ranks[part.server]
        resend = part.stage == "retry"
        if not resend:
            part.slot = self.slots.take()
        self._next_id += 1
        part.request_id = self._next_id
        meta_tag, data_tag, text_tag, payload_tag = wire.tags(part.slot)
        now = time.monotonic()
        part.first_sent = part.first_sent or now
        header = wire.encode(part.op, part.slot, part.request_id, part.table, part.nkeys,
                             part.arg, now - part.first_sent, len(part.pieces), part.nbytes,
                             part.value, now, part.value2)
        part.requests = [self.comm.Isend([header, MPI.BYTE], dest, wire.REQUEST)]
        part.header = header            # kept alive until the send completes
        if part.payload is not None:
            part.requests += [self.comm.Isend([part.payload[lo:hi], MPI.BYTE], dest, payload_tag)
                              for lo, hi in part.pieces]
            self.counters["bytes_sent"] += part.nbytes
        part.requests.append(self.comm.Irecv([part.meta, MPI.INT64_T], dest, meta_tag))
        if part.into is not None and not resend:
            # Posted now, straight into the tensors: the server's send never waits for us.
            part.receive = self.comm.Irecv([part.into, MPI.BYTE], dest, data_tag)
        self.counters["requests"] += 1
        self.counters["max_tag"] = max(self.counters["max_tag"], payload_tag)
        part.stage = "sent"

    def _progress(self, op: _Op) -> bool:
        """Advance ``op``'s parts; whether anything happened."""
        moved, now = False, time.monotonic()
        if op.gate is not None:
            opened = op.gate()
            if opened is None or opened[0] > now:
                return False
            for part in op.parts:
                part.value *= opened[1]
                part.held = False
            op.gate = None
            return True
        for part in op.parts:
            if part.stage == "retry":
                if now >= part.retry_at:          # it kept its slot
                    self._send(part)
                    moved = True
                continue
            if part.stage in ("new", "done", "failed") or not MPI.Request.Testall(part.requests):
                continue
            moved = True
            if part.stage == "sent":
                self._on_meta(op, part)
            else:
                self._on_data(op, part)
        # A margin over the servers' own timeout, whose errors name the late workers.
        if not moved and now - op.started > self.timeout + 2.0:
            raise self._timed_out(op)
        return moved

    def _on_meta(self, op: _Op, part: _Part) -> None:
        meta, dest = part.meta, self.server_ranks[part.server]
        if meta[wire.REQUEST_ID] != part.request_id:
            raise RuntimeError(f"pycoll.ps: server {part.server} (world rank {dest}) answered "
                               f"request {int(meta[wire.REQUEST_ID])} on the tags of request "
                               f"{part.request_id} ({op.name}); the stream is out of step")
        self.clocks[part.server] = int(meta[wire.CLOCK])
        if meta[wire.STATUS] == wire.RETRY:
            self.counters["refused_pulls"] += 1
            if part.op == wire.PUSH_PULL:     # the push is in: only the pull is asked again
                part.op, part.payload, part.pieces, part.nbytes = wire.PULL, None, (), 0
            part.stage, part.retry_at = "retry", time.monotonic() + part.backoff
            part.backoff = min(2 * part.backoff, RETRY_MAX)
            part.laggard = int(meta[wire.LAGGARD])
            return
        nbytes = int(meta[wire.NBYTES])
        self.counters["bytes_received"] += nbytes
        part.stage = "data"
        if meta[wire.STATUS] == wire.OK and part.into is not None:
            expected = len(part.into) if not isinstance(part.into, np.ndarray) else part.into.nbytes
            if nbytes != expected:           # cannot happen: the server checked the entries
                raise RuntimeError(f"pycoll.ps: server {part.server} answered {op.name} with "
                                   f"{nbytes} bytes, expected {expected}")
            self.counters["max_staleness"] = max(self.counters["max_staleness"],
                                                 int(meta[wire.CLOCK] - meta[wire.MIN_CLOCK]))
            self.versions[part.server] = int(meta[wire.SHARD_VERSION])
            part.requests, part.receive = [part.receive], None
            return
        if part.receive is not None:         # an error: no data comes, take the receive back
            part.receive.Cancel()
            part.receive.Wait()
            part.receive = None
        text_tag = wire.tags(part.slot)[2]
        part.data = np.empty(nbytes, np.uint8)
        part.requests = [self.comm.Irecv([part.data, nbytes, MPI.BYTE], dest, text_tag)] \
            if nbytes else []
        if not nbytes:
            self._on_data(op, part)

    def _on_data(self, op: _Op, part: _Part) -> None:
        if timeline.on:
            timeline.interval(f"{wire.OP_NAMES[part.op]} server {part.server}", "ps",
                              part.first_sent, op=op.name)
        if part.op == wire.PULL or part.op == wire.PUSH_PULL:
            self.counters["pull_wait_s"] += time.monotonic() - part.first_sent
        self.slots.give(part.slot)
        if part.meta[wire.STATUS] == wire.ERROR:
            part.stage = "failed"
            if op.error is None:
                op.error = _server_error(bytes(part.data).decode(errors="replace"))
        else:
            part.stage = "done"

    def _abandon(self, op: _Op) -> None:
        """Cancel what ``op`` still has in flight and complete it before its buffers go;
        what does not complete in time is kept (with the buffers) and its slot retired."""
        pending = []
        for part in op.parts:
            if part.stage == "retry":        # answered: its slot is free of late answers
                self.slots.give(part.slot)
            if part.stage in ("new", "done", "failed", "retry"):
                part.stage = "failed"
                continue
            part.stage = "failed"
            requests = part.requests + ([part.receive] if part.receive else [])
            for request in requests:
                if request != MPI.REQUEST_NULL and not request.Test():
                    request.Cancel()
            pending += requests
            self.slots.lose(part.slot)       # a late answer may still come on its tags
        if pending and wait_requests(pending, CANCEL_GRACE_S, None):
            self._zombies.append((pending, op.keep, op.parts))

    def _bury(self) -> None:
        self._zombies = [z for z in self._zombies if not MPI.Request.Testall(z[0])]

    def _timed_out(self, op: _Op) -> Exception:
        for part in op.parts:
            rank = self.server_ranks[part.server]
            if part.stage == "retry":
                return CollectiveTimeout(
                    f"pycoll.ps: {op.name} was refused by server {part.server} (world rank "
                    f"{rank}) for {self.timeout:g} s while it waited for worker "
                    f"{part.laggard} (world rank {part.laggard}); that worker may have died "
                    "or hung (PYCOLL_TIMEOUT sets the limit)")
            if part.stage == "new":
                return CollectiveTimeout(
                    f"pycoll.ps: {op.name} found no free tag slot within {self.timeout:g} s "
                    f"({self.slots.lost} slots retired by requests that timed out)")
            if part.stage not in ("done", "failed"):
                return CollectiveTimeout(
                    f"pycoll.ps: server {part.server} (world rank {rank}) did not answer "
                    f"{op.name} within {self.timeout:g} s; it may have died or hung "
                    "(PYCOLL_TIMEOUT sets the limit)")
        return CollectiveTimeout(f"pycoll.ps: {op.name} timed out")


def _server_error(text: str) -> Exception:
    return (CollectiveTimeout if "waited" in text and "may have died" in text else ValueError)(text)
