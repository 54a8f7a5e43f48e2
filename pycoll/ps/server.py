"""The server loop: one shard of every key, its optimizer state and its workers' clocks.

One thread serves requests in arrival order. Waiting for one costs no core: MPI's
blocking receive busy-polls, so the loop probes (``Improbe``) and, while nothing comes,
sleeps a fraction of the quiet spell (``wire.nap``: 50 us while requests flow, up to
1 ms when idle). Replies are sent without waiting for the worker to take them, so one
slow receiver never holds up the answers to the others.
"""
import json
import logging
import os
import pickle
import random
import time
from dataclasses import dataclass
from typing import Dict, List, Optional

import numpy as np
from mpi4py import MPI

from . import wire
from .optim import FLOATS, SGD, Shard
from .policy import Policy, SyncState

log = logging.getLogger("pycoll.ps")
SLEEP_MIN, SLEEP_MAX = 50e-6, 1e-3
HOUSEKEEPING_S = 0.5       # how often timeouts and periodic checkpoints are looked at


@dataclass
class _Pull:
    worker: int
    request: int
    keys: list
    need: int
    since: float
    waited: float             # seconds the worker already spent on refused attempts


@dataclass
class _Sending:
    requests: list
    buffers: tuple               # kept alive until the requests complete
    lent: Optional[np.ndarray]   # the parameters array a reply reads in place, if any


class Server:
    def __init__(self, comm, index: int, workers: int, policy: Policy, sgd: Optional[SGD],
                 checkpoint_dir: Optional[str], checkpoint_every: float, timeout: float):
        self.comm, self.index, self.workers = comm, index, workers
        self.policy, self.sgd, self.timeout = policy, sgd, timeout
        self.checkpoint_dir, self.checkpoint_every = checkpoint_dir, checkpoint_every
        self.sync = SyncState([0] * workers, active=[True] * workers, rng=random.Random(index))
        self.shards: Dict[str, Shard] = {}
        self.rounds: Dict[int, Dict[str, np.ndarray]] = {}     # BSP: clock -> key -> sum
        self.applied_round = 0
        self.pending: List[_Pull] = []
        self.stats = dict(server=index, policy=policy.name, pushes=0, pulls=0,
                          delayed_pulls=0, delay_s=0.0, bytes_in=0, bytes_out=0,
                          updates=0, checkpoints=0, resumed=False)
        self.scratch = np.empty(wire.PIECE, np.uint8)      # one payload piece
        self.sending: List[_Sending] = []                    # replies still in flight
        self.quiet_since = time.monotonic()          # the last request or reply taken
        self.last_checkpoint = self.last_housekeeping = time.monotonic()
        if checkpoint_dir:
            self._load()

    # ------------------------------------------------------------ main loop
    def serve(self) -> dict:
        """Serve until every worker has said it is done; the server's statistics."""
        status = MPI.Status()
        while any(self.sync.active):
            now = time.monotonic()
            if now - self.last_housekeeping > HOUSEKEEPING_S:
                self._housekeeping()
            message = self.comm.improbe(MPI.ANY_SOURCE, wire.REQUEST, status)
            if message is None:
                self._retire()
                wire.nap(now - self.quiet_since, SLEEP_MIN, SLEEP_MAX)
                continue
            op, request, keys, extra = message.recv()
            worker = status.Get_source()
            try:
                getattr(self, "_on_" + op)(worker, request, keys, extra)
            except _ClientError as err:
                self._reply(worker, request, wire.ERROR, str(err).encode())
            self.quiet_since = time.monotonic()
        if self.checkpoint_dir:
            self.checkpoint()
        self._drain()
        return self.stats_dict()

    def _housekeeping(self) -> None:
        now = self.last_housekeeping = time.monotonic()
        self._retire()
        if self.checkpoint_dir and self.checkpoint_every and \
                now - self.last_checkpoint >= self.checkpoint_every:
            self.checkpoint()
        for pull in [p for p in self.pending if now - p.since > self.timeout]:
            self.pending.remove(pull)
            behind = [w for w in range(self.workers)
                      if self.sync.active[w] and self.sync.clocks[w] < pull.need]
            self._reply(pull.worker, pull.request, wire.ERROR, (
                f"pycoll.ps server {self.index}: a {self.policy} pull by worker {pull.worker} "
                f"waited {now - pull.since:.0f} s for worker(s) {behind} (world ranks {behind}) "
                f"to reach clock {pull.need}; they may have died or hung").encode())

    # ------------------------------------------------------------ requests
    def _on_init(self, worker, request, keys, specs):
        """``specs``: [(key, dtype, total count, lo, hi)] in payload order."""
        itemsizes = [np.dtype(dt).itemsize for _, dt, _, _, _ in specs]
        sizes = [(hi - lo) * size for (_, _, _, lo, hi), size in zip(specs, itemsizes)]
        payload = np.empty(sum(sizes), np.uint8)                 # rare: whole, then check
        for first, end in wire.bounds(wire.pieces(sizes, itemsizes)):
            self._receive(worker, payload[first:end])
        offset, fresh = 0, []
        for name, dtype, count, lo, hi in specs:
            nbytes = (hi - lo) * np.dtype(dtype).itemsize
            shard = self.shards.get(name)
            if shard is None:
                if dtype not in FLOATS:
                    raise _ClientError(f"pycoll.ps: key {name!r} is {dtype}; servers keep "
                                       f"float parameters ({', '.join(FLOATS)}); cast it first")
                shard = self.shards[name] = Shard(dtype, count, lo, hi)
                shard.params[:] = payload[offset:offset + nbytes].view(dtype)
                fresh.append(name)
            elif (shard.dtype, shard.count, shard.lo, shard.hi) != (dtype, count, lo, hi):
                raise _ClientError(
                    f"pycoll.ps server {self.index}: key {name!r} is held as {shard.dtype} "
                    f"[{shard.lo}:{shard.hi}] of {shard.count} (from a checkpoint or another "
                    f"worker) but worker {worker} declares {dtype} [{lo}:{hi}] of {count}; "
                    "declare the same parameters on every worker and run")
            offset += nbytes
        self._reply(worker, request, wire.OK)

    def _on_push(self, worker, request, keys, _extra):
        """Each payload piece is scaled and applied (or added to its BSP round) as it
        arrives, while it is in cache."""
        shards = self._shards(keys, worker, "push")
        self.stats["pushes"] += 1
        self.sync.clocks[worker] += 1
        scale = 1.0 / self.workers
        round_sums = self.rounds.setdefault(self.sync.clocks[worker], {}) \
            if self.policy.rounds else None
        sizes = [s.params.nbytes for s in shards]
        messages = wire.pieces(sizes, [s.params.itemsize for s in shards])
        for segments, (first, end) in zip(messages, wire.bounds(messages)):
            piece = self._receive(worker, self.scratch[:end - first])
            offset = 0
            for index, lo, hi in segments:
                shard, name = shards[index], keys[index]
                values = piece[offset:offset + hi - lo].view(shard.dtype)
                start = lo // shard.params.itemsize
                offset += hi - lo
                if scale != 1.0:
                    values *= scale
                if round_sums is None:
                    self._apply(shard, values, start)
                else:
                    total = round_sums.get(name)
                    if total is None:
                        total = round_sums[name] = np.zeros_like(shard.params)
                    total[start:start + len(values)] += values
        if round_sums is None:
            self.stats["updates"] += len(shards)
        self._advance()

    def _on_pull(self, worker, request, keys, waited):
        self._shards(keys, worker, "pull")
        self.stats["pulls"] += 1
        pull = _Pull(worker, request, keys, self.policy.wait_for(self.sync, worker),
                     time.monotonic(), waited)
        queued = any(p.worker == worker for p in self.pending)   # a worker's pulls stay in order
        if not queued and self.sync.min_clock >= pull.need:
            self._answer(pull)
        elif self.policy.buffers or queued:
            self.pending.append(pull)
            self.stats["delayed_pulls"] += 1
        else:
            self.stats["delayed_pulls"] += 1
            slowest = self.sync.slowest()
            self._reply(worker, request, wire.RETRY, laggard=slowest[0] if slowest else -1)

    def _on_stats(self, worker, request, keys, _extra):
        self._reply(worker, request, wire.OK, json.dumps(self.stats_dict()).encode())

    def _on_checkpoint(self, worker, request, keys, _extra):
        if not self.checkpoint_dir:
            raise _ClientError("pycoll.ps: checkpoint() needs pycoll.ps.init(checkpoint_dir=...)")
        self.checkpoint()
        self._reply(worker, request, wire.OK)

    def _on_done(self, worker, request, keys, _extra):
        self.sync.active[worker] = False       # no longer holds anyone back
        self._advance()

    # ------------------------------------------------------------ helpers
    def _shards(self, keys, worker, what) -> List[Shard]:
        try:
            return [self.shards[k] for k in keys]
        except KeyError as err:
            raise _ClientError(f"pycoll.ps server {self.index}: worker {worker} asked to {what} "
                               f"key {err.args[0]!r}, which it does not hold; call "
                               "pycoll.ps.init_params with every key on every worker first") from None

    def _receive(self, worker: int, into: np.ndarray) -> np.ndarray:
        """The next payload piece from ``worker``, which must fill ``into`` exactly."""
        status = MPI.Status()
        self.comm.Probe(worker, wire.PAYLOAD, status)
        got = status.Get_count(MPI.BYTE)
        if got != into.nbytes:
            self.comm.Recv([np.empty(got, np.uint8), got, MPI.BYTE], worker, wire.PAYLOAD)
            raise _ClientError(f"pycoll.ps server {self.index}: worker {worker} sent a piece of "
                               f"{got} bytes where its keys hold {into.nbytes}; every worker "
                               "must declare the same shapes and dtypes")
        self.comm.Recv([into, got, MPI.BYTE], worker, wire.PAYLOAD)
        self.stats["bytes_in"] += got
        return into

    def _apply(self, shard: Shard, update: np.ndarray, start: int = 0) -> None:
        """Copy on write: a reply still sending the shard's parameters keeps the old array
        and the shard goes on with a copy, so replies never wait and never copy up front."""
        self._retire()
        if any(s.lent is shard.params for s in self.sending):
            shard.params = shard.params.copy()
        shard.apply(update, self.sgd, start)

    def _advance(self) -> None:
        """Apply completed BSP rounds, then answer the buffered pulls that may go."""
        low = self.sync.min_clock
        while self.policy.rounds and self.applied_round < low and self.rounds:
            self.applied_round += 1
            for name, total in self.rounds.pop(self.applied_round, {}).items():
                self._apply(self.shards[name], total)
                self.stats["updates"] += 1
        waiting = set()
        for pull in list(self.pending):
            if pull.worker not in waiting and self.sync.min_clock >= pull.need:
                self.pending.remove(pull)
                self._answer(pull)
            else:
                waiting.add(pull.worker)

    def _answer(self, pull: _Pull) -> None:
        shards = [self.shards[k] for k in pull.keys]
        self.stats["delay_s"] += time.monotonic() - pull.since + pull.waited
        if len(shards) == 1:               # straight from the parameters (see _apply)
            self._reply(pull.worker, pull.request, wire.OK, shards[0].params.view(np.uint8),
                        lent=shards[0].params)
            return
        data, offset = np.empty(sum(s.params.nbytes for s in shards), np.uint8), 0
        for s in shards:
            data[offset:offset + s.params.nbytes] = s.params.view(np.uint8)
            offset += s.params.nbytes
        self._reply(pull.worker, pull.request, wire.OK, data)

    def _reply(self, worker, request, status, data=b"", laggard=-1, lent=None) -> None:
        """Send a reply without waiting for the worker to take it: the worker's thread
        completes it when it next polls. ``lent``: parameters the reply reads."""
        meta_tag, data_tag, text_tag = wire.reply_tags(request)
        if isinstance(data, bytes):
            data, data_tag = np.frombuffer(data, np.uint8), text_tag
        clock = self.sync.clocks[worker]
        low = min(self.sync.min_clock, max(self.sync.clocks))
        meta = wire.meta(status, clock, low, data.nbytes, laggard)
        requests = [self.comm.Isend(meta, worker, meta_tag)]
        if data.nbytes:
            requests.append(self.comm.Isend([data, data.nbytes, MPI.BYTE], worker, data_tag))
            self.stats["bytes_out"] += data.nbytes
        self.sending.append(_Sending(requests, (meta, data), lent))

    def _retire(self) -> None:
        """Forget the replies that are complete. A worker that has just taken one is
        likely to send its next request soon: that ends the quiet spell too."""
        if self.sending:
            left = [s for s in self.sending if not MPI.Request.Testall(s.requests)]
            if len(left) < len(self.sending):
                self.quiet_since = time.monotonic()
            self.sending = left

    def _drain(self) -> None:
        """Before exiting: let in-flight replies finish (a worker that gave up on one
        never takes it, hence the limit)."""
        deadline = time.monotonic() + min(self.timeout, 10.0)
        while self.sending and time.monotonic() < deadline:
            self._retire()
            time.sleep(SLEEP_MIN)
        if self.sending:
            log.warning("pycoll.ps server %d: %d replies were never taken by their workers",
                        self.index, len(self.sending))

    # ------------------------------------------------------------ state
    def stats_dict(self) -> dict:
        return dict(self.stats, clocks=list(self.sync.clocks), min_clock=min(self.sync.clocks),
                    cpu_s=time.process_time())

    def _path(self) -> str:
        return os.path.join(self.checkpoint_dir, f"server-{self.index}.pkl")

    def checkpoint(self) -> None:
        """Save parameters, optimizer state and clocks (atomically: write, then rename)."""
        os.makedirs(self.checkpoint_dir, exist_ok=True)
        state = dict(shards={k: (s.dtype, s.count, s.lo, s.hi, s.params, s.momentum)
                             for k, s in self.shards.items()},
                     clocks=self.sync.clocks, rounds=self.rounds,
                     applied_round=self.applied_round, policy=self.policy.name)
        with open(self._path() + ".tmp", "wb") as f:
            pickle.dump(state, f, protocol=pickle.HIGHEST_PROTOCOL)
        os.replace(self._path() + ".tmp", self._path())
        self.stats["checkpoints"] += 1
        self.last_checkpoint = time.monotonic()

    def _load(self) -> None:
        if not os.path.exists(self._path()):
            return
        with open(self._path(), "rb") as f:
            state = pickle.load(f)
        if len(state["clocks"]) != self.workers:
            raise RuntimeError(f"pycoll.ps server {self.index}: checkpoint {self._path()} is "
                               f"from {len(state['clocks'])} workers, this job has {self.workers}; "
                               "restart with the same numbers of servers and workers")
        for name, (dtype, count, lo, hi, params, momentum) in state["shards"].items():
            shard = self.shards[name] = Shard(dtype, count, lo, hi)
            shard.params[:] = params
            shard.momentum = momentum
        self.sync.clocks[:] = state["clocks"]
        self.rounds, self.applied_round = state["rounds"], state["applied_round"]
        self.stats["resumed"] = True
        log.info("server %d resumed from %s at clocks %s", self.index, self._path(),
                 self.sync.clocks)


class _ClientError(Exception):
    """A bad request: reported to the worker that sent it; the server goes on."""
