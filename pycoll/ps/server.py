"""The server loop: one shard of every key, its optimizer state and its workers' clocks.

One thread serves requests in arrival order. Waiting for one costs no core: MPI's
blocking receive busy-polls, so the loop probes (``Improbe``) and, while nothing comes,
sleeps with a back-off from 50 us to 1 ms (an idle server uses about 1% of a core).
"""
import json
import logging
import os
import pickle
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


@dataclass
class _Pull:
    worker: int
    request: int
    keys: list
    need: int
    since: float
    waited: float             # seconds the worker already spent on refused attempts


class Server:
    def __init__(self, comm, index: int, workers: int, policy: Policy, sgd: Optional[SGD],
                 checkpoint_dir: Optional[str], checkpoint_every: float, timeout: float):
        self.comm, self.index, self.workers = comm, index, workers
        self.policy, self.sgd, self.timeout = policy, sgd, timeout
        self.checkpoint_dir, self.checkpoint_every = checkpoint_dir, checkpoint_every
        self.sync = SyncState([0] * workers, active=[True] * workers)
        self.sync.rng.seed(index)
        self.shards: Dict[str, Shard] = {}
        self.rounds: Dict[int, Dict[str, np.ndarray]] = {}     # BSP: clock -> key -> sum
        self.applied_round = 0
        self.pending: List[_Pull] = []
        self.stats = dict(server=index, policy=policy.name, pushes=0, pulls=0,
                          delayed_pulls=0, delay_s=0.0, bytes_in=0, bytes_out=0,
                          updates=0, checkpoints=0, resumed=False)
        self.scratch = np.empty(0, np.uint8)
        self.last_checkpoint = self.last_housekeeping = time.monotonic()
        if checkpoint_dir:
            self._load()

    # ------------------------------------------------------------ main loop
    def serve(self) -> dict:
        """Serve until every worker has said it is done; the server's statistics."""
        sleep, status = SLEEP_MIN, MPI.Status()
        while any(self.sync.active):
            message = self.comm.improbe(MPI.ANY_SOURCE, wire.REQUEST, status)
            if message is None or time.monotonic() - self.last_housekeeping > 1.0:
                self._housekeeping()
            if message is None:
                time.sleep(sleep)
                sleep = min(2 * sleep, SLEEP_MAX)
                continue
            sleep = SLEEP_MIN
            op, request, keys, extra = message.recv()
            worker = status.Get_source()
            try:
                getattr(self, "_on_" + op)(worker, request, keys, extra)
            except _ClientError as err:
                self._reply(worker, request, wire.ERROR, str(err).encode())
        if self.checkpoint_dir:
            self.checkpoint()
        return self.stats_dict()

    def _housekeeping(self) -> None:
        now = self.last_housekeeping = time.monotonic()
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
        payload = self._receive(worker, sum((hi - lo) * np.dtype(dt).itemsize
                                            for _, dt, _, lo, hi in specs))
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
        shards = self._shards(keys, worker, "push")
        payload = self._receive(worker, sum(s.params.nbytes for s in shards))
        self.stats["pushes"] += 1
        self.sync.clocks[worker] += 1
        scale = 1.0 / self.workers
        offset = 0
        round_sums = self.rounds.setdefault(self.sync.clocks[worker], {}) \
            if self.policy.rounds else None
        for name, shard in zip(keys, shards):
            part = payload[offset:offset + shard.params.nbytes].view(shard.dtype)
            offset += shard.params.nbytes
            if round_sums is None:
                update = part * scale if scale != 1.0 else part
                shard.apply(update, self.sgd)
                self.stats["updates"] += 1
            elif name in round_sums:
                round_sums[name] += part * scale
            else:
                round_sums[name] = part * scale
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

    def _receive(self, worker: int, nbytes: int) -> np.ndarray:
        status = MPI.Status()
        self.comm.Probe(worker, wire.PAYLOAD, status)
        got = status.Get_count(MPI.BYTE)
        if self.scratch.nbytes < got:
            self.scratch = np.empty(got, np.uint8)
        self.comm.Recv([self.scratch, got, MPI.BYTE], worker, wire.PAYLOAD)
        self.stats["bytes_in"] += got
        if got != nbytes:
            raise _ClientError(f"pycoll.ps server {self.index}: worker {worker} sent {got} bytes "
                               f"where its keys hold {nbytes}; every worker must declare the "
                               "same shapes and dtypes")
        return self.scratch[:got]

    def _advance(self) -> None:
        """Apply completed BSP rounds, then answer the buffered pulls that may go."""
        low = self.sync.min_clock
        while self.policy.rounds and self.applied_round < low and self.rounds:
            self.applied_round += 1
            for name, total in self.rounds.pop(self.applied_round, {}).items():
                self.shards[name].apply(total, self.sgd)
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
        if len(shards) == 1:
            data = shards[0].params.view(np.uint8)
        else:
            nbytes = sum(s.params.nbytes for s in shards)
            if self.scratch.nbytes < nbytes:
                self.scratch = np.empty(nbytes, np.uint8)
            data, offset = self.scratch[:nbytes], 0
            for s in shards:
                data[offset:offset + s.params.nbytes] = s.params.view(np.uint8)
                offset += s.params.nbytes
        self._reply(pull.worker, pull.request, wire.OK, data)

    def _reply(self, worker, request, status, data=b"", laggard=-1) -> None:
        meta_tag, data_tag, text_tag = wire.reply_tags(request)
        if isinstance(data, bytes):
            data, data_tag = np.frombuffer(data, np.uint8), text_tag
        clock = self.sync.clocks[worker]
        low = min(self.sync.min_clock, max(self.sync.clocks))
        self.comm.Send(wire.meta(status, clock, low, data.nbytes, laggard), worker, meta_tag)
        if data.nbytes:
            # Blocking send straight from the parameters: nothing changes them meanwhile.
            self.comm.Send([data, data.nbytes, MPI.BYTE], worker, data_tag)
            self.stats["bytes_out"] += data.nbytes

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
