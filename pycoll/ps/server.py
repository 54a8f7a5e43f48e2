"""The server loop: one shard of every key, its optimizer state and its workers' clocks.

One thread serves requests in arrival order. Waiting for one costs no core: MPI's
blocking receive busy-polls, so the loop probes (``Improbe``) and, while nothing comes,
sleeps 1/64 of the quiet spell (``wire.nap``: 20 us while requests flow, up to 1 ms
when idle). Replies are sent without waiting for the worker to take them, so one
slow receiver never holds up the answers to the others.

Pulls' answers go out by priority (ByteScheduler's and P3's, at the server): a pull or
push_pull carries one (``wire``: smaller is needed sooner; ``pycoll.overlap`` gives a
partition its rank in the next forward's order), and while the answers in flight hold
``PYCOLL_PS_REPLY_CREDIT`` bytes or more, the others wait in a queue that sends the most
urgent first (among equals, the first answered). Posted answers cannot be overtaken (the
link is a FIFO), so the credit bounds how long an urgent one waits. What each answer
holds is fixed when it is answered, so the order changes no values. Requests themselves
are served in arrival order: a worker's requests must be (its BSP rounds are its pushes
in order), and its own issue order is already by priority.

Every request is checked before it touches anything: the header (``wire.parse``), its
keys against the shards (dtype, element count, range), its payload's message count and
sizes (all of its messages are matched before any is applied). A bad request is
answered with an error naming what is wrong, its payload is consumed so the worker's
stream stays in step, and the server goes on; so it does after an internal error.
"""
import heapq
import itertools
import json
import logging
import random
import time
from dataclasses import dataclass, field
from typing import Dict, List, Optional

import numpy as np
from mpi4py import MPI

from .. import config, tensors, timeline
from . import checkpoints as ckpt
from . import wire
from .optim import FLOATS, SGD, Shard
from .policy import Policy, SyncState
from .traffic import Traffic

log = logging.getLogger("pycoll.ps")
# Between polls for requests the server naps 1/64 of the quiet spell (20 us to 1 ms): a
# request is seen at most 1/64 of the gap before it late (tens of microseconds within a
# few milliseconds of the last one, as a blocking receive would), and the polls of a
# quiet spell grow with its logarithm. (1/8 up to 1 ms: 0.7-0.9 ms late a few ms after
# the last request; a fixed 100 us cap: 15% of a core while idle.)
SLEEP_MIN, SLEEP_MAX, SLEEP_SHARE = 20e-6, 1e-3, 1 / 64
HOUSEKEEPING_S = 0.5       # how often timeouts are looked at


class _ClientError(Exception):
    """A bad request: reported to the worker that sent it; the server goes on."""


@dataclass
class _Call:
    """One request being served: who asked, what, and how much of its payload is taken."""
    worker: int
    req: wire.Request
    taken: int = 0               # payload messages received or discarded
    answered: bool = False
    since: float = 0.0
    pending: list = field(default_factory=list)   # matched, not received: (message, bytes)


@dataclass
class _Pull:
    call: _Call
    shards: list
    need: int
    since: float
    waited: float             # seconds the worker already spent on refused attempts
    reason: str = ""          # why it waits here (policy.why_wait), if it does
    laggards: tuple = ()      # the workers it waits for


@dataclass
class _Sending:
    requests: list
    buffers: tuple               # kept alive until the requests complete
    lent: Optional[np.ndarray]   # the parameters array a reply reads in place, if any
    nbytes: int = 0              # the answer's data


@dataclass(order=True)
class _Queued:
    """An answer waiting for the credit: the most urgent first, then the first answered."""
    priority: float
    seq: int
    call: "_Call" = field(compare=False)
    data: np.ndarray = field(compare=False)
    lent: Optional[np.ndarray] = field(compare=False)


class Server:
    def __init__(self, comm, servers_comm, index: int, workers: int, policy: Policy,
                 sgd: Optional[SGD], checkpoint_dir: Optional[str], timeout: float):
        self.comm, self.index, self.workers = comm, index, workers
        self.policy, self.sgd, self.timeout = policy, sgd, timeout
        self.tag_ub = comm.Get_attr(MPI.TAG_UB) or MPI.COMM_WORLD.Get_attr(MPI.TAG_UB)
        self.checkpoint_dir = checkpoint_dir
        self.job = dict(servers=servers_comm.size, workers=workers, policy=policy.name)
        self.sync = SyncState([0] * workers, active=[True] * workers, rng=random.Random(index))
        # Versions: updates applied to this shard (BSP: rounds); every push's staleness
        # against the version it was computed on goes in its worker's histogram.
        self.version = 0
        self.staleness: List[Dict[int, int]] = [{} for _ in range(workers)]
        self.side = policy.server_side(servers_comm, index, workers)     # SaPS
        self.shards: Dict[str, Shard] = {}
        self.tables: Dict[bytes, List[Shard]] = {}   # key tables already checked
        self.rounds: Dict[int, Dict[str, list]] = {}  # BSP: clock -> key -> [sum, pushes]
        self.applied_round = 0
        self.pending: List[_Pull] = []
        self.waiting_checkpoints: list = []          # BSP: (generation, cut, call)
        self.last_request = [0] * workers
        self.traffic = Traffic()                     # pushes in flight, gaps between them
        self.coordinator = policy.coordinator(index, workers, timeout)   # turns (R²SP)
        self.turns: Dict[int, _Call] = {}            # turn requests not yet released
        self.stats = dict(server=index, policy=policy.name, pushes=0, pulls=0,
                          delayed_pulls=0, delay_s=0.0, bytes_in=0, bytes_out=0,
                          updates=0, checkpoints=0, resumed=False, bad_requests=0,
                          waited_for={})      # worker -> seconds pulls waited for it
        self.scratch = np.empty(tensors.piece_bytes(), np.uint8)    # one payload piece
        self.sending: List[_Sending] = []                    # replies still in flight
        self.queued: List[_Queued] = []                      # answers waiting for credit
        self.credit = config.get("ps_reply_credit")
        # Without a link a payload comes at memory speed and the wait for it spins; under
        # one the emulation holds it until its modelled arrival (tens of ms for a large
        # push), and spinning then took a core from the workers (bench/overlap.py's PS
        # server: 135 ms of CPU a 250 ms step).
        self.link = bool(config.get("link"))
        self.answer_order = itertools.count()                # ties in priority: FIFO
        self.abandoned: list = []                            # receives that never completed
        self.quiet_since = self.last_housekeeping = time.monotonic()
        self.generation = 0          # the newest generation number in use in checkpoint_dir
        self.kept: Optional[int] = None              # the last good generation of ours
        self.resumed: Optional[ckpt.State] = None    # checked against the first init
        self.refusal: Optional[str] = None           # why this server cannot serve
        self.changed = False                         # since the last generation saved
        if checkpoint_dir:
            self._resume(servers_comm)

    # ------------------------------------------------------------ main loop
    def serve(self) -> dict:
        """Serve until every worker has said it is done; the server's statistics."""
        status = MPI.Status()
        while any(self.sync.active):
            now = time.monotonic()
            if self.side is not None:
                self.side.poll()
            if now - self.last_housekeeping > HOUSEKEEPING_S:
                self._housekeeping()
            if self.turns:
                self._release(now)
            message = self.comm.improbe(MPI.ANY_SOURCE, wire.REQUEST, status)
            if message is None:
                self._retire()
                wire.nap(now - self.quiet_since, SLEEP_MIN, self._longest_nap(now), SLEEP_SHARE)
                continue
            raw = np.empty(status.Get_count(MPI.BYTE), np.uint8)
            message.Recv([raw, MPI.BYTE])
            self._handle(status.Get_source(), raw)
            self.quiet_since = time.monotonic()
        if self.checkpoint_dir and self.refusal is None:
            for generation, _, call in self.waiting_checkpoints:     # their cut never came
                self._save_for(call, generation)
            self.waiting_checkpoints.clear()
            if self.changed:                     # the last generation is not the end state
                self.generation += 1
                try:
                    self._save(self.generation)
                except _ClientError as err:
                    log.error("pycoll.ps server %d: %s", self.index, err)
        if self.side is not None:
            self.side.close(self.timeout)
        self._drain()
        return self.stats_dict()

    def _handle(self, worker: int, raw: np.ndarray) -> None:
        try:
            req = wire.parse(raw, self.tag_ub)
            if worker >= self.workers:
                raise wire.BadRequest(f"rank {worker} is a server, not a worker")
        except wire.BadRequest as err:
            self.stats["bad_requests"] += 1
            text = f"pycoll.ps server {self.index}: bad request from rank {worker}: {err}"
            log.warning("%s", text)
            if err.slot is None:
                self._send_text(worker, wire.BAD, text)
            else:
                self._reply_to(worker, err.slot, err.request, wire.ERROR, text.encode())
            return
        call = _Call(worker, req, since=time.monotonic())
        self.traffic.heard(worker, req.sent, call.since)
        name = wire.OP_NAMES[req.op]
        try:
            if req.request <= self.last_request[worker]:
                raise _ClientError(f"request {req.request} ({name}) came after request "
                                   f"{self.last_request[worker]}: out of order")
            self.last_request[worker] = req.request
            if self.refusal is not None and req.op not in (wire.STATS, wire.DONE):
                raise _ClientError(self.refusal)
            with timeline.phase(name, "ps", worker=worker):
                getattr(self, "_on_" + name)(call)
        except _ClientError as err:
            self._fail(call, str(err))
        except Exception as err:                   # a bug here must not end the server
            log.exception("pycoll.ps server %d: internal error serving %s request %d of "
                          "worker %d", self.index, name, req.request, worker)
            self._fail(call, f"pycoll.ps server {self.index}: internal error serving {name} "
                             f"request {req.request} of worker {worker}: {err!r}")

    def _fail(self, call: _Call, text: str) -> None:
        """Answer ``call`` with an error, after taking what is left of its payload."""
        self.stats["bad_requests"] += 1
        try:
            self._discard(call)
        except Exception as err:         # what is left may never come: say so, serve on
            text += f"; {err}"
        if not text.startswith("pycoll.ps"):
            text = f"pycoll.ps server {self.index}: {text}"
        if call.answered:                # an error after the answer: the worker has its own
            log.error("%s", text)
            return
        self._reply(call, wire.ERROR, text.encode())

    def _housekeeping(self) -> None:
        now = self.last_housekeeping = time.monotonic()
        self._retire()
        self.abandoned = [a for a in self.abandoned if not a[0].Test()]
        for pull in [p for p in self.pending if now - p.since > self.timeout]:
            self.pending.remove(pull)
            behind = self._behind(pull.need)
            self._reply(pull.call, wire.ERROR, (
                f"pycoll.ps server {self.index}: a {self.policy} pull by worker "
                f"{pull.call.worker} waited {now - pull.since:.0f} s for worker(s) {behind} "
                f"(world ranks {behind}) to reach clock {pull.need}; they may have died or "
                "hung").encode())
        missing = self.coordinator.overdue(now) if self.turns else None
        if missing:
            for worker, call in self.turns.items():
                self.coordinator.withdraw(worker)
                self._reply(call, wire.ERROR, f"pycoll.ps server {self.index}: {missing}".encode())
            self.turns.clear()
        for entry in [e for e in self.waiting_checkpoints if now - e[2].since > self.timeout]:
            self.waiting_checkpoints.remove(entry)
            self._reply(entry[2], wire.ERROR, (
                f"pycoll.ps server {self.index}: checkpoint generation {entry[0]} waited "
                f"{now - entry[2].since:.0f} s for worker(s) {self._behind(entry[1])} to reach "
                f"clock {entry[1]}; they may have died or hung").encode())

    def _behind(self, clock: int) -> list:
        return [w for w in range(self.workers)
                if self.sync.active[w] and self.sync.clocks[w] < clock]

    # ------------------------------------------------------------ requests
    def _on_init(self, call: _Call) -> None:
        """The keys' declarations and worker 0's values; keys already held (declared by
        an earlier init or loaded from a checkpoint) must match and keep their values."""
        entries = call.req.entries
        for e in entries:
            if e.dtype not in FLOATS:
                raise _ClientError(f"key {e.name!r} is {e.dtype}; servers keep float "
                                   f"parameters ({', '.join(FLOATS)}); cast it first")
        if len({e.name for e in entries}) != len(entries):
            raise _ClientError("init declares a key twice")
        sizes = [e.nbytes for e in entries]
        self._check_payload(call, sizes, [np.dtype(e.dtype).itemsize for e in entries])
        if self.resumed is not None:
            self._check_resumed(entries)
        for e in entries:
            shard = self.shards.get(e.name)
            if shard is not None and (shard.dtype, shard.count, shard.lo, shard.hi) != \
                    (e.dtype, e.count, e.lo, e.hi):
                raise _ClientError(
                    f"key {e.name!r} is held as {shard.dtype} [{shard.lo}:{shard.hi}] of "
                    f"{shard.count} but worker {call.worker} declares {e.dtype} "
                    f"[{e.lo}:{e.hi}] of {e.count}; declare the same parameters on every "
                    "worker and run")
        payload = np.empty(sum(sizes), np.uint8)                 # rare: whole, then set
        edges = wire.bounds(self._messages(sizes, entries))
        for message, (first, end) in zip(self._match(call, [b - a for a, b in edges]), edges):
            self._take(call, message, payload[first:end])
        offset = 0
        for e, nbytes in zip(entries, sizes):
            if e.name not in self.shards:
                shard = self.shards[e.name] = Shard(e.dtype, e.count, e.lo, e.hi)
                shard.params[:] = payload[offset:offset + nbytes].view(shard.params.dtype)
                self.changed = True
            offset += nbytes
        self._reply(call, wire.OK)

    def _on_push(self, call: _Call, answer: bool = True) -> None:
        """Each payload piece is applied (or added to its BSP round) as it arrives, while
        it is in cache; every message is matched and its size checked first."""
        shards = self._shards(call, "push")
        sizes = [s.params.nbytes for s in shards]
        self._check_payload(call, sizes, [s.params.itemsize for s in shards])
        messages = self._messages(sizes, shards)
        matched = self._match(call, [end - first for first, end in wire.bounds(messages)])
        worker, keys = call.worker, [e.name for e in call.req.entries]
        if self.coordinator is not None:         # R²SP: the next turn goes while this comes
            self.coordinator.pushing(worker, call.since,
                                     self.traffic.start(worker, call.req.sent, call.since))
            self._release(time.monotonic())
        self.stats["pushes"] += 1
        self.changed = True
        self.sync.clocks[worker] += 1
        staleness = max(0, self.version - call.req.arg)
        discount = 1.0 if self.side is None else self.side.observe(worker, staleness)
        if discount:
            seen = self.staleness[worker]
            seen[staleness] = seen.get(staleness, 0) + 1
            self.version += not self.policy.rounds
        weight = call.req.value * discount           # value: 1 for a plain push (wire)
        scale = weight / self.workers
        round_sums = self.rounds.setdefault(self.sync.clocks[worker], {}) \
            if self.policy.rounds else None
        if round_sums is not None:
            for name in keys:
                round_sums.setdefault(name, [None, 0])[1] += 1
        taken = call.since
        for segments, message in zip(messages, matched):
            piece = self._take(call, message, self._piece(sum(h - l for _, l, h in segments)))
            taken = time.monotonic()
            if not weight:                  # dropped: its payload is taken, not applied
                continue
            offset = 0
            for index, lo, hi in segments:
                shard, name = shards[index], keys[index]
                values = piece[offset:offset + hi - lo].view(shard.params.dtype)
                start = lo // shard.params.itemsize
                offset += hi - lo
                if round_sums is None:
                    if scale != 1.0:
                        values *= scale
                    self._apply(shard, values, start)
                else:                      # summed now, divided by its pushes when applied
                    if weight != 1.0:
                        values *= weight
                    entry = round_sums[name]
                    if entry[0] is None:
                        entry[0] = np.zeros_like(shard.params)
                    entry[0][start:start + len(values)] += values
        if round_sums is None and weight:
            self.stats["updates"] += len(shards)
        self.traffic.pushed(worker, call.req.sent, taken)
        if self.coordinator is not None:
            self.coordinator.pushed(worker, taken - call.since, taken)
        if answer:
            self._reply(call, wire.OK)
        self._advance()

    def _on_pull(self, call: _Call, shards=None) -> None:
        if shards is None:
            shards = self._shards(call, "pull")
            self._check_payload(call, [], [])
        worker = call.worker
        self.stats["pulls"] += 1
        pull = _Pull(call, shards, self.policy.wait_for(self.sync, worker),
                     time.monotonic(), call.req.waited)
        queued = any(p.call.worker == worker for p in self.pending)   # a worker's pulls in order
        if not queued and self.sync.min_clock >= pull.need:
            self._answer(pull)
        elif self.policy.buffers or queued:
            pull.reason = "order" if queued else self.policy.why_wait(self.sync, worker, pull.need)
            pull.laggards = tuple(self.sync.slowest())
            self.pending.append(pull)
            self.stats["delayed_pulls"] += 1
        else:
            self.stats["delayed_pulls"] += 1
            slowest = self.sync.slowest()
            if timeline.on:
                timeline.instant("pull refused", worker=worker, laggards=slowest,
                                 reason=self.policy.why_wait(self.sync, worker, pull.need))
            self._reply(call, wire.RETRY, laggard=slowest[0] if slowest else -1)

    def _on_push_pull(self, call: _Call) -> None:
        """A push, then a pull of the same keys: one header, one answer (the parameters)."""
        self._on_push(call, answer=False)
        self._on_pull(call, self.tables[call.req.table])

    def _on_stats(self, call: _Call) -> None:
        self._reply(call, wire.OK, json.dumps(self.stats_dict()).encode())

    def _on_checkpoint(self, call: _Call) -> None:
        """Save a generation. Under BSP ``arg`` is the requesting worker's push count
        here: the generation holds the state after exactly that round, written when it is
        applied (later rounds' pushes wait in their sums), so every server saves the same
        cut without talking to the others."""
        if not self.checkpoint_dir:
            raise _ClientError("checkpoint() needs pycoll.ps.init(checkpoint_dir=...)")
        self.generation += 1
        if self.policy.rounds and self.applied_round < call.req.arg:
            self.waiting_checkpoints.append((self.generation, call.req.arg, call))
            return
        self._save_for(call, self.generation, call.req.arg if self.policy.rounds else None)

    def _on_done(self, call: _Call) -> None:
        self.sync.active[call.worker] = False       # no longer holds anyone back
        if self.coordinator is not None:
            self.coordinator.leave(call.worker)
        self._reply(call, wire.OK)
        self._advance()

    def _on_turn(self, call: _Call) -> None:
        """R²SP: answered when the coordinator releases the worker (``_release``); a
        turn of 0 samples leaves the ring."""
        if self.coordinator is None:
            raise _ClientError(f"turn requests go to server 0 under a policy with turns "
                               f"(r2sp); this is server {self.index} under {self.policy}")
        self._check_payload(call, [], [])
        missing = self.coordinator.overdue(call.since)
        if missing:
            raise _ClientError(missing)
        if call.req.arg == 0:
            self.coordinator.leave(call.worker)
            asked = self.turns.pop(call.worker, None)
            for answered in filter(None, (asked, call)):    # a turn asked for is void now
                self._reply(answered, wire.OK, b"{}")
        else:
            try:
                self.coordinator.ask(call.worker, call.req.arg, call.req.value, call.since,
                                     compute_s=call.req.value2)
            except ValueError as err:
                raise _ClientError(str(err)) from None
            self.turns[call.worker] = call
        self._release(time.monotonic())

    def _release(self, now: float) -> None:
        for worker, answer in self.coordinator.poll(now):
            self._reply(self.turns.pop(worker), wire.OK, json.dumps(answer).encode())

    def _longest_nap(self, now: float) -> float:
        """A nap ends by the next turn the coordinator may release."""
        due = self.coordinator.next_due(now) if self.turns else None
        return SLEEP_MAX if due is None else min(SLEEP_MAX, max(0.0, due - now))

    # ------------------------------------------------------------ checks
    def _shards(self, call: _Call, what: str) -> List[Shard]:
        """The shards a request names, checked against its entries (cached per table)."""
        table = call.req.table
        shards = self.tables.get(table)
        if shards is not None:
            return shards
        shards = []
        for e in call.req.entries:
            shard = self.shards.get(e.name)
            if shard is None:
                raise _ClientError(f"worker {call.worker} asked to {what} key {e.name!r}, which "
                                   "this server does not hold; call pycoll.ps.init_params with "
                                   "every key on every worker first")
            if (shard.dtype, shard.count, shard.lo, shard.hi) != (e.dtype, e.count, e.lo, e.hi):
                raise _ClientError(
                    f"worker {call.worker}'s {what} says key {e.name!r} is {e.dtype} "
                    f"[{e.lo}:{e.hi}] of {e.count}; this server holds {shard.dtype} "
                    f"[{shard.lo}:{shard.hi}] of {shard.count}")
            shards.append(shard)
        if len(set(map(id, shards))) != len(shards):
            raise _ClientError(f"worker {call.worker}'s {what} names a key twice")
        self.tables[table] = shards
        return shards

    @staticmethod
    def _messages(sizes, items):
        itemsizes = [np.dtype(i.dtype).itemsize for i in items]
        return wire.pieces(sizes, itemsizes)

    def _check_payload(self, call: _Call, sizes, itemsizes) -> None:
        req = call.req
        expect = len(wire.pieces(sizes, itemsizes)) if sizes else 0
        if req.npieces != expect or req.nbytes != sum(sizes):
            raise _ClientError(f"{wire.OP_NAMES[req.op]} request {req.request} of worker "
                               f"{call.worker} announces {req.npieces} payload messages of "
                               f"{req.nbytes} bytes; its keys take {expect} of {sum(sizes)}")

    def _match(self, call: _Call, sizes: List[int]) -> List[MPI.Message]:
        """Match every payload message of ``call`` (waiting at most the timeout for a
        sender that may have died) and check their sizes, before any is received."""
        tag, status = wire.tags(call.req.slot)[3], MPI.Status()
        deadline = time.monotonic() + self.timeout
        while len(call.pending) < len(sizes):
            message = self.comm.improbe(call.worker, tag, status)
            if message is not None:
                call.pending.append((message, status.Get_count(MPI.BYTE)))
                continue
            _late(deadline, self.timeout)
            if time.monotonic() > deadline:
                call.taken = call.req.npieces - len(call.pending)   # stop looking for more
                raise _ClientError(
                    f"worker {call.worker} (world rank {call.worker}) sent {len(call.pending)} "
                    f"of the {len(sizes)} payload messages of its {wire.OP_NAMES[call.req.op]} "
                    f"request {call.req.request} within {self.timeout:g} s; it may have died")
        got = [n for _, n in call.pending]
        if got != sizes:
            raise _ClientError(f"worker {call.worker}'s {wire.OP_NAMES[call.req.op]} payload "
                               f"came in messages of {got} bytes where its keys take {sizes} "
                               "(a wrong-size tensor?)")
        return [m for m, _ in call.pending]

    def _piece(self, nbytes: int) -> np.ndarray:
        """``nbytes`` of the one reused buffer that payload pieces land in."""
        if self.scratch.nbytes < nbytes:
            self.scratch = np.empty(nbytes, np.uint8)
        return self.scratch[:nbytes]

    def _take(self, call: _Call, message: MPI.Message, into: np.ndarray) -> np.ndarray:
        """Receive one matched payload message into ``into`` within the timeout."""
        call.pending = [p for p in call.pending if p[0] is not message]
        call.taken += 1
        request = message.Irecv([into, into.nbytes, MPI.BYTE])
        since = time.monotonic()
        deadline = since + self.timeout
        while not request.Test():
            self._retire()                  # the answers' credit frees while this comes in
            now = time.monotonic()
            if self.link:   # held to its modelled arrival: a release ends the nap, and 1/8
                wire.nap(now - since, SLEEP_MIN, SLEEP_MAX)     # bounds it where none comes
            if now > deadline:
                request.Cancel()
                self.abandoned.append((request, into))      # MPI may still write there
                if into.base is self.scratch:
                    self.scratch = np.empty(self.scratch.nbytes, np.uint8)
                raise _ClientError(f"a payload message of worker {call.worker} did not arrive "
                                   f"within {self.timeout:g} s; it may have died")
        self.stats["bytes_in"] += into.nbytes
        return into

    def _discard(self, call: _Call) -> None:
        """Take what is left of a refused request's payload, so that the worker's next
        request on this slot is read from its own start."""
        tag, status = wire.tags(call.req.slot)[3], MPI.Status()
        deadline = time.monotonic() + self.timeout
        while call.pending or call.taken < call.req.npieces:
            if not call.pending:
                message = self.comm.improbe(call.worker, tag, status)
                if message is not None:
                    call.pending = [(message, status.Get_count(MPI.BYTE))]
                    continue
                _late(deadline, self.timeout)
                if time.monotonic() > deadline:
                    left, call.taken = call.req.npieces - call.taken, call.req.npieces
                    raise _ClientError(f"{left} of its payload messages did not come within "
                                       f"{self.timeout:g} s")
                continue
            message, size = call.pending[0]
            self._take(call, message, self.scratch[:size] if size <= self.scratch.nbytes
                       else np.empty(size, np.uint8))

    def _check_resumed(self, entries) -> None:
        """The first init after a resume must declare exactly the checkpoint's layout."""
        state, self.resumed = self.resumed, None
        declared = {e.name: (e.dtype, e.count, e.lo, e.hi) for e in entries}
        saved = {k[0]: tuple(k[1:]) for k in state.keys}
        if declared == saved:
            return
        diffs = [f"{n!r}: checkpoint {_range(saved.get(n))}, job {_range(declared.get(n))}"
                 for n in sorted(set(saved) | set(declared)) if saved.get(n) != declared.get(n)]
        self.resumed = state
        raise _ClientError(f"checkpoint {state.manifest} holds another layout than this job "
                           f"declares: {'; '.join(diffs[:5])}{' ...' if len(diffs) > 5 else ''} "
                           "(declare the same parameters, or use another checkpoint_dir)")

    # ------------------------------------------------------------ updates and answers
    def _apply(self, shard: Shard, update: np.ndarray, start: int = 0) -> None:
        """Copy on write: a reply still sending the shard's parameters keeps the old array
        and the shard goes on with a copy, so replies never wait and never copy up front."""
        self._retire()
        if any(s.lent is shard.params for s in self.sending) or \
                any(q.lent is shard.params for q in self.queued):
            shard.params = shard.params.copy()
        shard.apply(update, self.sgd, start)

    def _advance(self) -> None:
        """Apply completed BSP rounds (each key's sum over the pushes it got: the mean
        over the workers still active), save the checkpoints waiting for them, then
        answer the buffered pulls that may go."""
        low = self.sync.min_clock
        while self.policy.rounds and self.applied_round < low and self.rounds:
            self.applied_round += 1
            self.version += 1
            for name, (total, pushes) in self.rounds.pop(self.applied_round, {}).items():
                if total is not None:
                    if pushes > 1:
                        total *= 1.0 / pushes
                    self._apply(self.shards[name], total)
                    self.stats["updates"] += 1
            for entry in [e for e in self.waiting_checkpoints if e[1] <= self.applied_round]:
                self.waiting_checkpoints.remove(entry)
                self._save_for(entry[2], entry[0], entry[1])
        waiting = set()
        for pull in list(self.pending):
            if pull.call.worker not in waiting and self.sync.min_clock >= pull.need:
                self.pending.remove(pull)
                self._answer(pull)
            else:
                waiting.add(pull.call.worker)

    def _answer(self, pull: _Pull) -> None:
        shards = pull.shards
        self.stats["delay_s"] += time.monotonic() - pull.since + pull.waited
        if pull.reason:
            waited = time.monotonic() - pull.since
            for worker in pull.laggards:
                self.stats["waited_for"][worker] = self.stats["waited_for"].get(worker, 0.0) \
                    + waited / len(pull.laggards)
            timeline.interval("pull waited", "ps wait", pull.since, worker=pull.call.worker,
                              reason=pull.reason, waited_for=list(pull.laggards))
        if len(shards) == 1:               # straight from the parameters (see _apply)
            data, lent = shards[0].params.view(np.uint8), shards[0].params
        else:
            data, offset, lent = np.empty(sum(s.params.nbytes for s in shards), np.uint8), 0, None
            for s in shards:
                data[offset:offset + s.params.nbytes] = s.params.view(np.uint8)
                offset += s.params.nbytes
        pull.call.answered = True          # queued counts: an error now is logged, not sent
        heapq.heappush(self.queued, _Queued(pull.call.req.value2, next(self.answer_order),
                                            pull.call, data, lent))
        self._send_queued()

    def _send_queued(self) -> None:
        """Send queued answers, most urgent first, while those in flight hold less than
        the credit (one at least; a credit of 0 sends each at once)."""
        while self.queued:
            if self.credit and sum(s.nbytes for s in self.sending) >= self.credit:
                return
            q = heapq.heappop(self.queued)
            self._reply(q.call, wire.OK, q.data, lent=q.lent)

    def _reply(self, call: _Call, status, data=b"", laggard=-1, lent=None) -> None:
        call.answered = True
        self._reply_to(call.worker, call.req.slot, call.req.request, status, data, laggard, lent)

    def _reply_to(self, worker, slot, request, status, data=b"", laggard=-1, lent=None) -> None:
        """Send a reply without waiting for the worker to take it: the worker's thread
        completes it when it next polls. ``lent``: parameters the reply reads."""
        meta_tag, data_tag, text_tag, _ = wire.tags(slot)
        if isinstance(data, bytes):
            data, data_tag = np.frombuffer(data, np.uint8), text_tag
        clock = self.sync.clocks[worker] if worker < self.workers else 0
        low = min(self.sync.min_clock, max(self.sync.clocks))
        meta = wire.meta(status, clock, low, data.nbytes, laggard, request, self.version)
        requests = [self.comm.Isend(meta, worker, meta_tag)]
        if data.nbytes:
            requests.append(self.comm.Isend([data, data.nbytes, MPI.BYTE], worker, data_tag))
            self.stats["bytes_out"] += data.nbytes
        self.sending.append(_Sending(requests, (meta, data), lent, data.nbytes))

    def _send_text(self, rank: int, tag: int, text: str) -> None:
        data = np.frombuffer(text.encode(), np.uint8)
        self.sending.append(_Sending([self.comm.Isend([data, MPI.BYTE], rank, tag)], (data,), None))

    def _retire(self) -> None:
        """Forget the replies that are complete, and send queued answers in their credit.
        A worker that has just taken one is likely to send its next request soon: that
        ends the quiet spell too."""
        if self.sending:
            left = [s for s in self.sending if not MPI.Request.Testall(s.requests)]
            if len(left) < len(self.sending):
                self.quiet_since = time.monotonic()
                self.sending = left
                self._send_queued()

    def _drain(self) -> None:
        """Before exiting: let in-flight replies finish (a worker that gave up on one
        never takes it, hence the limit)."""
        deadline = time.monotonic() + min(self.timeout, 10.0)
        while (self.sending or self.queued) and time.monotonic() < deadline:
            self._retire()
            time.sleep(SLEEP_MIN)
        if self.sending or self.queued:
            log.warning("pycoll.ps server %d: %d replies were never taken by their workers",
                        self.index, len(self.sending) + len(self.queued))

    # ------------------------------------------------------------ state
    def stats_dict(self) -> dict:
        extra = {} if self.coordinator is None else {self.policy.name: self.coordinator.stats()}
        if self.side is not None:
            extra["saps"] = self.side.stats()
        return dict(self.stats, clocks=list(self.sync.clocks), min_clock=min(self.sync.clocks),
                    cpu_s=time.process_time(), generation=self.generation, version=self.version,
                    staleness={str(w): {str(k): n for k, n in sorted(h.items())}
                               for w, h in enumerate(self.staleness)},
                    **self.traffic.stats(), **extra)

    def _save_for(self, call: _Call, generation: int, cut: Optional[int] = None) -> None:
        """Save for a worker's request and answer it, with the error if the save failed."""
        try:
            self._save(generation, cut)
        except _ClientError as err:
            self._reply(call, wire.ERROR, f"pycoll.ps server {self.index}: {err}".encode())
            return
        self._reply(call, wire.OK)

    def _save(self, generation: int, cut: Optional[int] = None) -> None:
        """Write ``generation``; ``cut``: the BSP round it is the state after (clocks past
        it belong to pushes still waiting in their rounds' sums)."""
        names = sorted(self.shards)
        shards = [self.shards[n] for n in names]
        clocks = self.sync.clocks if cut is None else [min(c, cut) for c in self.sync.clocks]
        try:
            ckpt.save(self.checkpoint_dir, self.index, generation, self.job,
                      [(n, s.dtype, s.count, s.lo, s.hi) for n, s in zip(names, shards)],
                      [s.params for s in shards], [s.momentum for s in shards], clocks,
                      self.applied_round)
        except OSError as err:
            raise _ClientError(f"could not write checkpoint generation {generation} to "
                               f"{self.checkpoint_dir}: {err}") from None
        ckpt.prune(self.checkpoint_dir, self.index, {generation, self.kept})
        self.kept, self.changed = generation, False
        self.stats["checkpoints"] += 1

    def _resume(self, servers_comm) -> None:
        """Load the newest generation that is complete and intact on every server (they
        agree by exchanging what they have); refuse to serve if there is none."""
        good, bad = ckpt.scan(self.checkpoint_dir, self.index, self.job)
        mine = dict(good=sorted(good), bad={str(g): t for g, t in bad.items()},
                    newest=max(list(good) + list(bad), default=0))
        everyone = [json.loads(b) for b in wire.exchange(
            servers_comm, json.dumps(mine).encode(), "resuming from a checkpoint", "server",
            self.timeout)]
        self.generation = max(e["newest"] for e in everyone)
        if self.generation == 0:
            return                                     # nothing saved anywhere: start afresh
        common = set.intersection(*(set(e["good"]) for e in everyone))
        if not common:
            problems = [t for e in everyone for t in e["bad"].values()] or [
                f"server {s} has generations {e['good'] or 'none'}"
                for s, e in enumerate(everyone)]
            self.refusal = (f"pycoll.ps server {self.index}: no checkpoint generation in "
                            f"{self.checkpoint_dir} is complete and intact on every server: "
                            + "; ".join(problems))
            log.error("%s", self.refusal)
            return
        chosen = max(common)
        for generation in sorted(set(good) | set(bad), reverse=True):
            if generation > chosen:
                why = bad.get(generation) or "it is not complete on every server"
                log.warning("pycoll.ps server %d: resuming from generation %d, not %d: %s",
                            self.index, chosen, generation, why)
        state = self.resumed = good[chosen]
        for (name, dtype, count, lo, hi), params, momentum in zip(state.keys, state.params,
                                                                 state.momentum):
            shard = self.shards[name] = Shard(dtype, count, lo, hi)
            shard.params[:] = params
            shard.momentum = momentum
        self.sync.clocks[:] = state.clocks
        self.applied_round = state.applied_round
        self.kept = chosen
        self.stats["resumed"] = chosen
        log.info("pycoll.ps server %d resumed from %s at clocks %s", self.index, state.manifest,
                 self.sync.clocks)


def _late(deadline: float, timeout: float) -> None:
    """While a payload is late: spin for the first millisecond (it follows its header at
    once), then nap, so a dead sender does not cost a core until the deadline."""
    if time.monotonic() > deadline - timeout + 1e-3:
        time.sleep(1e-4)


def _range(spec) -> str:
    if spec is None:
        return "absent"
    dtype, count, lo, hi = spec
    return f"{dtype} [{lo}:{hi}] of {count}"
