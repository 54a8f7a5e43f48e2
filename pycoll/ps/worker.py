"""The worker side: requests to servers, in flight together, driven by one thread.

Every push, pull or control request becomes one part per server it touches. The
``pycoll-ps`` thread posts each part's nonblocking sends and receives as soon as it is
issued, so requests to different servers overlap, and completes the request's ``Work``
when all of its parts are done. Payloads go straight from and to the caller's tensors
when a server holds one contiguous range of them; otherwise they are packed or unpacked
with ``pycoll._C`` (GIL released). The thread polls MPI while requests are in flight,
napping a fraction of the quiet spell between polls (``wire.nap``), and sleeps on a
condition variable when none are.
"""
import collections
import threading
import time
from typing import Dict, List, Optional, Sequence

import numpy as np
from mpi4py import MPI

from .. import _C
from ..tensors import as_buffer
from ..work import CollectiveTimeout, Work
from . import wire
from .layout import Key, by_server

SLEEP_MIN, SLEEP_MAX = 20e-6, 5e-4
BIG = 256 << 10      # while a transfer this large is in flight the thread only yields:
                     # the copies progress in our MPI calls, and a sleep would stall them
RETRY_MIN, RETRY_MAX = 5e-4, 4e-3        # SSP's refused pulls are sent again after this


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

    def __init__(self, server: int, op: str, keys: list, extra=None, payload=None,
                 reply: bool = False, into=None, pieces=()):
        self.server, self.op, self.keys, self.extra = server, op, keys, extra
        self.payload = payload          # uint8 array sent after the header, or None
        self.pieces = pieces            # (first, end) bytes of each payload message
        self.nbytes = 0 if payload is None else payload.nbytes
        self.reply = reply              # whether the server answers
        self.into = into                # pull: uint8 memory the parameters land in
        self.receive = None             # pull: the receive into ``into``, posted at send
        into_bytes = 0 if into is None else (
            into.nbytes if isinstance(into, np.ndarray) else len(into))
        self.big = max(self.nbytes, into_bytes) >= BIG
        self.requests: List[MPI.Request] = []
        self.meta = np.zeros(wire.META_LEN, np.int64)
        self.data = None                # reply data when not ``into``
        self.stage = "new"              # new -> sent -> meta -> data -> done; retry
        self.request_id = 0
        self.first_sent = self.retry_at = 0.0
        self.backoff = RETRY_MIN


class _Op:
    def __init__(self, name: str, parts: List[_Part], work: PSWork, finish=None, keep=None):
        self.name, self.parts, self.work, self.finish = name, parts, work, finish
        self.keep = keep                # tensors the MPI calls read or write
        self.started = time.monotonic()



def _spans(where, items):
    """(address, bytes) of each key range ``items`` names, in the caller's buffers."""
    return [(where[k.name].ptr + r.lo * k.itemsize, r.count * k.itemsize) for k, r in items]

class Client:
    """One worker's connection to the servers (``comm`` ranks ``server_ranks``)."""

    def __init__(self, comm, server_ranks: Sequence[int], worker: int, timeout: float):
        self.comm, self.server_ranks, self.worker = comm, list(server_ranks), worker
        self.timeout = timeout
        self.keys: Dict[str, Key] = {}
        self._new: collections.deque = collections.deque()
        self._cv = threading.Condition()
        self._closed = False
        self._next_id = 0
        self._thread = threading.Thread(target=self._loop, name="pycoll-ps", daemon=True)
        self._thread.start()
        self.counters = dict(worker=worker, pushes=0, pulls=0, refused_pulls=0,
                             pull_wait_s=0.0, bytes_sent=0, bytes_received=0, clock=0,
                             max_staleness=0)
        self.clocks = [0] * len(self.server_ranks)

    # ------------------------------------------------------------ building requests
    def lookup(self, names) -> List[Key]:
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

    def push_parts(self, keys: List[Key], bufs, op=wire.PUSH, extra=None, reply=False,
                   servers=None) -> List[_Part]:
        parts = []
        where = {k.name: b for k, b in zip(keys, bufs)}
        for server, items in sorted(by_server(keys).items()):
            if servers is not None and server not in servers:
                continue
            spans = _spans(where, items)
            if len(spans) == 1:
                payload = np.frombuffer(MPI.buffer.fromaddress(*spans[0]), np.uint8)
            else:
                payload = np.empty(sum(n for _, n in spans), np.uint8)
                _C.pack(payload.ctypes.data, [p for p, _ in spans], [n for _, n in spans])
            if op == wire.INIT:
                extra = [(k.name, k.dtype, k.count, r.lo, r.hi) for k, r in items]
            pieces = wire.bounds(wire.pieces([n for _, n in spans],
                                             [k.itemsize for k, _ in items]))
            parts.append(_Part(server, op, [k.name for k, _ in items], extra, payload, reply,
                               pieces=pieces))
        return parts

    def pull_parts(self, keys: List[Key], bufs):
        """Parts that receive ``keys`` into ``bufs``, and the unpacking to run after."""
        parts, unpacks = [], []
        where = {k.name: b for k, b in zip(keys, bufs)}
        for server, items in sorted(by_server(keys).items()):
            spans = _spans(where, items)
            if len(spans) == 1:
                into = MPI.buffer.fromaddress(spans[0][0], spans[0][1])
            else:
                into = np.empty(sum(n for _, n in spans), np.uint8)
                unpacks.append((into, spans))
            parts.append(_Part(server, wire.PULL, [k.name for k, _ in items], 0.0,
                               reply=True, into=into))

        def unpack():
            for staging, spans in unpacks:
                _C.unpack(staging.ctypes.data, [p for p, _ in spans], [n for _, n in spans])
        return parts, unpack

    def submit(self, name: str, parts: List[_Part], finish=None, keep=None) -> PSWork:
        work = PSWork(name, self.timeout)
        op = _Op(name, parts, work, finish, keep)
        if not parts:
            work._finish(finish() if finish else None)
            return work
        with self._cv:
            self._new.append(op)
            self._cv.notify()
        return work

    def close(self) -> None:
        """End the thread once the requests submitted so far are done."""
        with self._cv:
            self._closed = True
            self._cv.notify()

    # ------------------------------------------------------------ the thread
    def _loop(self) -> None:
        active: List[_Op] = []
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
                for part in op.parts:
                    self._send(part)
            active += fresh
            moved = bool(fresh)
            for op in list(active):
                try:
                    moved |= self._progress(op)
                    done = all(p.stage == "done" for p in op.parts)
                    if done:
                        result = op.finish() if op.finish else None
                except Exception as error:             # delivered to whoever waits
                    self._cancel(op)
                    active.remove(op)
                    op.work._finish(error=error)
                    continue
                if done:
                    active.remove(op)
                    op.work._finish(result)
            now = time.monotonic()
            if moved:
                quiet_since = now
            elif any(p.big and p.stage in ("sent", "data") for op in active for p in op.parts):
                time.sleep(0)
            else:
                wire.nap(now - quiet_since, SLEEP_MIN, SLEEP_MAX)

    def _send(self, part: _Part) -> None:
        dest = self.server_ranks[part.server]
        resend = part.stage == "retry"
        if not resend:
            self._next_id += 1
            part.request_id = self._next_id
        meta_tag, data_tag, _ = wire.reply_tags(part.request_id)
        now = time.monotonic()
        part.first_sent = part.first_sent or now
        waited = now - part.first_sent if part.op == wire.PULL else part.extra
        header = (part.op, part.request_id, part.keys, waited)
        part.requests = [self.comm.isend(header, dest, wire.REQUEST)]
        if part.payload is not None:
            part.requests += [self.comm.Isend([part.payload[lo:hi], MPI.BYTE], dest, wire.PAYLOAD)
                              for lo, hi in part.pieces]
            self.counters["bytes_sent"] += part.nbytes
        if part.reply:
            part.requests.append(self.comm.Irecv([part.meta, MPI.INT64_T], dest, meta_tag))
        if part.into is not None and not resend:
            # Posted now, straight into the tensors: the server's send never waits for us.
            part.receive = self.comm.Irecv([part.into, MPI.BYTE], dest, data_tag)
        part.stage = "sent"

    def _progress(self, op: _Op) -> bool:
        """Advance ``op``'s parts; whether anything happened."""
        moved, now = False, time.monotonic()
        for part in op.parts:
            if part.stage == "retry":
                if now >= part.retry_at:
                    self._send(part)
                    moved = True
                continue
            if part.stage == "done" or not MPI.Request.Testall(part.requests):
                continue
            moved = True
            if part.stage == "sent" and part.reply:
                self._on_meta(op, part)
            elif part.stage in ("sent", "data"):
                self._on_data(part)
        # A margin over the servers' own timeout, whose errors name the late workers.
        if not moved and now - op.started > self.timeout + 2.0:
            raise self._timed_out(op)
        return moved

    def _on_meta(self, op: _Op, part: _Part) -> None:
        meta, dest = part.meta, self.server_ranks[part.server]
        self.clocks[part.server] = int(meta[wire.CLOCK])
        if meta[wire.STATUS] == wire.RETRY:
            self.counters["refused_pulls"] += 1
            part.stage, part.retry_at = "retry", time.monotonic() + part.backoff
            part.backoff = min(2 * part.backoff, RETRY_MAX)
            part.laggard = int(meta[wire.LAGGARD])
            return
        nbytes = int(meta[wire.NBYTES])
        self.counters["bytes_received"] += nbytes
        part.stage = "data"
        if meta[wire.STATUS] == wire.OK and part.into is not None:
            expected = len(part.into) if not isinstance(part.into, np.ndarray) else part.into.nbytes
            if nbytes != expected:
                raise RuntimeError(f"pycoll.ps: server {part.server} answered {op.name} with "
                                   f"{nbytes} bytes, expected {expected}")
            self.counters["max_staleness"] = max(self.counters["max_staleness"],
                                                 int(meta[wire.CLOCK] - meta[wire.MIN_CLOCK]))
            part.requests, part.receive = [part.receive], None
            return
        _, _, text_tag = wire.reply_tags(part.request_id)
        part.data = np.empty(nbytes, np.uint8)
        part.requests = [self.comm.Irecv([part.data, nbytes, MPI.BYTE], dest, text_tag)] \
            if nbytes else []
        if meta[wire.STATUS] == wire.ERROR:
            MPI.Request.Waitall(part.requests)      # the text is already on its way
            raise _server_error(bytes(part.data).decode())
        if not nbytes:
            self._on_data(part)

    def _on_data(self, part: _Part) -> None:
        part.stage = "done"
        if part.op == wire.PULL:
            self.counters["pull_wait_s"] += time.monotonic() - part.first_sent

    def _cancel(self, op: _Op) -> None:
        for part in op.parts:
            for request in part.requests + ([part.receive] if part.receive else []):
                if request != MPI.REQUEST_NULL and not request.Test():
                    request.Cancel()

    def _timed_out(self, op: _Op) -> Exception:
        for part in op.parts:
            rank = self.server_ranks[part.server]
            if part.stage == "retry":
                return CollectiveTimeout(
                    f"pycoll.ps: {op.name} was refused by server {part.server} (world rank "
                    f"{rank}) for {self.timeout:g} s while it waited for worker "
                    f"{part.laggard} (world rank {part.laggard}); that worker may have died "
                    "or hung (PYCOLL_TIMEOUT sets the limit)")
            if part.stage != "done":
                return CollectiveTimeout(
                    f"pycoll.ps: server {part.server} (world rank {rank}) did not answer "
                    f"{op.name} within {self.timeout:g} s; it may have died or hung "
                    "(PYCOLL_TIMEOUT sets the limit)")
        return CollectiveTimeout(f"pycoll.ps: {op.name} timed out")


def _server_error(text: str) -> Exception:
    return (CollectiveTimeout if "waited" in text and "may have died" in text else ValueError)(text)
