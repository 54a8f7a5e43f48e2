"""R²SP, round-robin synchronous parallel (Chen, Wang, Li; INFOCOM 2019), on pycoll.ps.

Under BSP every worker pushes at the same moment: the server's link is congested, then
idle. Under R²SP workers push in turn, evenly spaced, so about one talks to the servers
at a time:

- The gate. Before each push a worker asks server 0's ``Coordinator`` for its turn
  (``wire.TURN``, ``pycoll.ps.turn``; ``TorchWorker`` does it). The coordinator
  releases workers in a fixed round-robin order (0, 1, ..., N-1, 0, ...), one push at
  a time: the next worker is released when the push of the one before reaches server
  0 (its header; that worker asking again, or leaving, counts too). Each release comes
  with a slot, when its push should set out for server 0: at least ``gap`` after the
  slot before, and not before the push arriving now has come in (its arrival plus the
  median push time measured there). The answer goes at once, so it travels while that
  push comes in, ahead of the slot by the turn's latency (release to push sent, less
  the hold; the least of the last 20, since more means the worker was still
  computing), and says how long the worker holds its push (``delay_s``). So pushes do
  not share the server's link (a FIFO: a push sent while another comes in waits
  behind it, which is what "pushes in flight" counts, ``traffic``) and reach server 0
  in the order of their turns. ``gap = P / (safety * N)``, P the iteration period (the
  median of the workers' last ``window * N`` iteration times, computing and
  communicating, as each reports them with its request). The gap is a floor, not a
  schedule: a worker comes back about P after its push, so its slot keeps its place in
  the ring, P/N after the one before, by itself; a floor of P/N (``safety`` 1) would
  keep a ring that fell behind from closing up, ``safety`` 1.2 (the authors' "about
  1.2N") lets it. P leaves out the wait for a turn on purpose: measured with it, the
  gate's own delay at each release fed back into the gap (P = P / 1.2 + N x delay),
  which stretched a 23 ms iteration to 45 in bench/ps_training.py. ``TorchWorker``
  asks for its turn when its computing starts (the gate's messages overlap the compute)
  and hands its push over with the turn: the worker's communication thread sends it
  when the answer is in and the hold is over, without waking the training loop. Until
  every worker has asked once the gate is closed (a start line); for the first
  ``warmup`` rounds there is no P yet and slots only follow the pushes.
- Bounded waits. A worker waits for its turn at most ``patience`` periods (default
  one), or until the push of the worker released before it reaches server 0 if that
  takes longer: past that it is released out of turn, and the workers before it in the
  order that have not come lose this round's turn (counted as ``skipped``); one that
  lost two turns in a row is passed over without waiting until it asks again. A worker
  done training leaves the ring with ``pycoll.ps.turn(0)`` (``shutdown`` does it too).
  A worker that does not come back for its turn within PYCOLL_TIMEOUT of its release
  (dead, hung) ends the job: every turn request is answered with an error naming it.
- Staleness. Servers apply every push on arrival (as ASP; pulls never wait), and each
  worker pushes once per turn, right after its push's answer brings it the parameters
  it computes its next gradient on. Pushes reach server 0 in release order, one at a
  time, and the ring passes every worker once a round (released, or losing its turn).
  So between a worker's two pushes each other worker pushes at most 1 + ``lost`` times,
  ``lost`` the turns the worker lost in between (the turn's answer says it): a gradient
  is at most (N-1)(1 + lost) updates stale, N-1 when its worker lost no turn (the
  common case: a turn is lost only by a worker late by ``patience`` periods). At the
  other servers the same holds as pushes reach them in the order they reach server 0: a
  worker posts a push's requests to the other servers before server 0's, and the next
  worker is released only once that one has reached server 0.
- Heterogeneity (``adapt``). Each turn request reports the samples of the worker's last
  iteration, how long it was busy (``busy_s``: computing and communicating, without the
  wait for its turn) and how much of that it computed (``compute_s``: from the
  parameters in to the push handed over, the part that grows with the batch). The
  coordinator models each worker's iteration as ``fixed + per_sample * batch``, each the
  median of the worker's last ``MODEL_REPORTS`` (busy less computing; computing per
  sample), and at the start of every round after the warm-up splits the global batch B
  (the sum of the workers' first batches) so that every modelled iteration takes the
  same time, each worker within ``batch`` times its first batch; the split sums to B
  every round. Why a model and not a split by samples per busy second: that has the
  same end point, but closes only the computing's share of the difference each round
  (the communication does not shrink with the batch), and an epoch's short last batch,
  few samples per busy second for the same reason, shrinks the worker's next batch;
  the model is there a round after the warm-up, and its medians ignore short batches
  and stalls (docs/benchmarks.md, "R²SP, batch sizes from a time model"). A push weighs ``samples * N / B`` (the server multiplies it by that
  and by 1/N, as every ASP push), so a round of pushes moves the model by the
  sample-weighted mean gradient: that of one batch of B samples.

Our reading of the paper and of the authors' TensorFlow prototype (read, not copied):
the gate at the first server, the gap of period / 1.2N and updates on arrival are
theirs; the paper's worker i communicating at offset i T/N is what the slots hold to
(the prototype spaces releases, not pushes, so a push late after its release overlaps
the next: 1.35-1.5 pushes in flight here before the slots). The start line, the slots
chained on pushes' arrival with the hold, the patience and the error for a missing
worker are ours (their prototype waits for ever), and so are the batch split by a
measured time model (the paper tunes batch sizes to speed; the prototype's hook grows a
batch by its blocked time) and the sample weights.
"""
import collections
import math
import statistics
import time
from typing import Dict, List, Optional

from .. import timeline
from .policy import Policy

MODEL_REPORTS = 9    # a worker's time model: medians of its last reports (odd: a report's)


class R2SP(Policy):
    """``pycoll.ps.init(policy=R2SP(...))`` or ``"r2sp"``, ``"r2sp:patience=2,adapt=0"``.

    ``safety``: gap (the least spacing of pushes) = period / (safety * N), >= 1 so that
    the gate never stretches the period. ``patience``: the most a worker waits for its
    turn, in periods. ``warmup``: rounds before the gap and batch adaptation start.
    ``adapt``: split the global batch so that iterations take the same time. ``batch``: (low, high), a worker's batch
    stays within these multiples of its first one. ``window``: periods are measured over
    the last ``window * N`` requests."""
    name = "r2sp"
    turns = True

    def __init__(self, safety: float = 1.2, patience: float = 1.0, warmup: int = 2,
                 adapt: bool = True, batch=(0.25, 4.0), window: int = 2):
        low, high = batch
        problems = [text for bad, text in (
            (not 1.0 <= safety < math.inf, f"safety must be >= 1, got {safety!r}"),
            (not 0 < patience < math.inf, f"patience must be > 0 periods, got {patience!r}"),
            (int(warmup) != warmup or warmup < 1,
             f"warmup must be an integer >= 1, got {warmup!r}"),
            (int(window) != window or window < 1,
             f"window must be an integer >= 1, got {window!r}"),
            (not 0 < low <= 1 <= high < math.inf,
             f"batch bounds must satisfy 0 < low <= 1 <= high, got {batch!r}"))
            if bad]
        if problems:
            raise ValueError("pycoll.ps.R2SP: " + "; ".join(problems))
        self.safety, self.patience, self.adapt = float(safety), float(patience), bool(adapt)
        self.warmup, self.window, self.batch = int(warmup), int(window), (float(low), float(high))

    @classmethod
    def parse(cls, text: str) -> "R2SP":
        """``"safety=1.5,patience=2,warmup=3,adapt=0,batch=0.5-2,window=3"`` (any subset)."""
        kwargs: Dict[str, object] = {}
        for item in filter(None, (t.strip() for t in text.split(","))):
            key, _, value = item.partition("=")
            try:
                if key == "batch":
                    low, _, high = value.partition("-")
                    kwargs[key] = (float(low), float(high))
                elif key == "adapt":
                    kwargs[key] = {"1": True, "0": False, "true": True, "false": False}[value]
                elif key in ("safety", "patience"):
                    kwargs[key] = float(value)
                elif key in ("warmup", "window"):
                    kwargs[key] = int(value)
                else:
                    raise KeyError(key)
            except (KeyError, ValueError):
                raise ValueError(f"policy 'r2sp:{text}': cannot read {item!r}; knobs are "
                                 "safety=F, patience=F, warmup=N, adapt=0|1, batch=LOW-HIGH, "
                                 "window=N, e.g. r2sp:patience=2,batch=0.5-2") from None
        return cls(**kwargs)

    def coordinator(self, server: int, workers: int, timeout: float):
        return Coordinator(self, workers, timeout) if server == 0 else None

    def __repr__(self) -> str:
        return self.name


def split(total: int, fixed: List[float], per_sample: List[float], low: List[int],
          high: List[int]) -> List[int]:
    """``total`` samples split so that every worker's iteration, ``fixed[i] +
    per_sample[i] * share``, takes the same time, each share within ``[low[i], high[i]]``,
    as integers summing to ``total`` (if the bounds allow it)."""
    def shares(time):
        return [min(max((time - a) / b, lo), hi)
                for a, b, lo, hi in zip(fixed, per_sample, low, high)]
    below = min(fixed)
    above = max(a + b * hi for a, b, hi in zip(fixed, per_sample, high))
    for _ in range(100):                          # the time whose clamped shares sum to total
        middle = (below + above) / 2
        below, above = (middle, above) if sum(shares(middle)) < total else (below, middle)
    exact = shares(above)
    out = [max(lo, min(hi, math.floor(x))) for x, lo, hi in zip(exact, low, high)]
    order = sorted(range(len(out)), key=lambda i: out[i] - exact[i])   # largest remainder
    for i in order * 2:
        short = total - sum(out)
        if short > 0 and out[i] < high[i]:
            out[i] += 1
        elif short < 0 and out[i] > low[i]:
            out[i] -= 1
    return out


class Coordinator:
    """Server 0's side of R²SP: when each worker may push, and its next batch size.
    Times are passed in (``now``), so tests drive it with their own clock."""
    RECENT = 20          # per worker: the recent work and iteration times kept

    def __init__(self, policy: R2SP, workers: int, timeout: float):
        self.policy, self.n, self.timeout = policy, workers, timeout
        self.active = [True] * workers
        self.turn = 0                            # whose turn it is
        self.waiting: Dict[int, float] = {}      # worker -> when it asked
        self.asked: List[Optional[float]] = [None] * workers
        self.released: List[Optional[float]] = [None] * workers
        self.first_ask: Optional[float] = None
        self.periods = collections.deque(maxlen=policy.window * workers)
        self.samples = [0] * workers             # in the gradient each is about to push
        self.base = [0] * workers                # each worker's first batch
        self.batch = [0] * workers               # the batch each was last told to use
        # Each worker's time per iteration as fixed + per_sample * batch: its recent
        # communicating (busy less computing) and computing per sample.
        self.fixed = [collections.deque(maxlen=MODEL_REPORTS) for _ in range(workers)]
        self.per_sample = [collections.deque(maxlen=MODEL_REPORTS) for _ in range(workers)]
        self.reports = [0] * workers
        self.plan: Optional[List[int]] = None
        self.rounds = self.out_of_turn = 0
        self.turns = [0] * workers
        self.batches = [0] * workers             # the batch sizes handed out, summed
        self.wait_s = [0.0] * workers
        self.longest_wait = [0.0] * workers
        self.skipped = [0] * workers
        self.missed = [0] * workers              # turns lost in a row
        self.previous = -1                       # the worker released last
        self.work = [collections.deque(maxlen=self.RECENT) for _ in range(workers)]
        self.iteration = [collections.deque(maxlen=self.RECENT) for _ in range(workers)]
        # releases: worker, time, gap, in turn, slot, the workers whose turns the ring
        # passed since the release before (they lost them)
        self.log = collections.deque(maxlen=64)
        self.passed: List[int] = []
        # One push at a time: the released workers whose push server 0 has not seen yet,
        # when the latest released push is due there, and when the one arriving ends.
        self.unpushed: set = set()
        self.slot = self.end = -math.inf
        self.delay = [0.0] * workers             # each one's hold, given with its release
        self.lost_before = [0] * workers         # skipped[w] at w's last release
        self.durations = collections.deque(maxlen=self.RECENT)   # of pushes at server 0
        self.latencies = collections.deque(maxlen=self.RECENT)   # release -> push, less hold

    # ------------------------------------------------------------ requests
    def ask(self, worker: int, samples: int, busy_s: float, now: float,
            compute_s: float = 0.0) -> None:
        """``worker`` wants to push; its last iteration took ``samples`` and was busy
        (computing and communicating, not waiting for a turn) ``busy_s`` (0: unknown),
        of which it computed ``compute_s`` (0: unknown, all of ``busy_s`` grows with the
        batch).
        The push weighs ``samples``' share (``Pacer`` scales it to the samples it sends)."""
        if samples < 1:
            raise ValueError(f"worker {worker}'s turn request says its gradient holds {samples} "
                             "samples; pass the batch's size (>= 1) to pycoll.ps.turn")
        if worker in self.waiting:
            raise ValueError(f"worker {worker} asked for a turn while waiting for one")
        if self.asked[worker] is not None:
            self.iteration[worker].append(now - self.asked[worker])
        if self.released[worker] is None:
            self.base[worker] = self.batch[worker] = samples
        if self.reports[worker] and busy_s > 0:      # the first is warm-up, not speed
            self.work[worker].append(busy_s)
            self.periods.append(busy_s)
            compute_s = compute_s if 0 < compute_s <= busy_s else busy_s
            self.fixed[worker].append(busy_s - compute_s)
            self.per_sample[worker].append(compute_s / samples)
        self.reports[worker] += 1
        self.active[worker], self.missed[worker] = True, 0     # back in the ring
        self.unpushed.discard(worker)            # its push, if any, is done
        self.asked[worker] = now
        self.first_ask = now if self.first_ask is None else self.first_ask
        self.samples[worker] = samples
        self.waiting[worker] = now

    def leave(self, worker: int) -> None:
        """``worker`` is done: it no longer has a turn."""
        self.active[worker] = False
        self.waiting.pop(worker, None)
        self.unpushed.discard(worker)
        if self.turn == worker:
            self.turn = self._after(worker)

    def withdraw(self, worker: int) -> None:
        """Forget ``worker``'s request (the server answered it with an error)."""
        self.waiting.pop(worker, None)

    def pushing(self, worker: int, now: float, sent: float) -> None:
        """A push of ``worker`` sent at ``sent`` has reached server 0 (its header,
        ``now``; both on server 0's clock): once a push's time there is known, the link
        is taken until about ``now`` plus that, and the next turn may go."""
        if worker in self.unpushed:
            self.latencies.append(sent - self.released[worker] - self.delay[worker])
            if self.durations:
                self.unpushed.discard(worker)
                self.end = now + statistics.median(self.durations)

    def pushed(self, worker: int, seconds: float, now: float) -> None:
        """The payload of ``worker``'s push was all in at ``now``, ``seconds`` after its
        header (the first push frees the link only then)."""
        self.durations.append(seconds)
        if worker in self.unpushed:
            self.unpushed.discard(worker)
            self.end = now

    def poll(self, now: float) -> List[tuple]:
        """``[(worker, answer)]`` for the workers released now, in release order."""
        out = []
        if any(a and t is None for a, t in zip(self.active, self.asked)):
            return out                           # the start line: not every worker has asked
        while self.waiting and not self.unpushed:    # one push at a time
            self._pass_over()
            gap, period = self.gap(), self.period()
            if self.turn in self.waiting:
                out.append(self._release(self.turn, now, gap, True))
                continue
            if period is not None:
                late = [w for w, since in self.waiting.items()
                        if now >= since + self.policy.patience * period]   # as next_due
                if late:
                    out.append(self._release(min(late, key=self.waiting.get), now, gap, False))
                    continue
            break
        return out

    def next_due(self, now: float) -> Optional[float]:
        """When ``poll`` may next release someone (None: only a request can change it)."""
        if not self.waiting or self.unpushed or \
                any(a and t is None for a, t in zip(self.active, self.asked)):
            return None
        due, period = math.inf, self.period()
        self._pass_over()
        if self.turn in self.waiting:
            due = now
        if period is not None:
            due = min(due, min(self.waiting.values()) + self.policy.patience * period)
        return due if due < math.inf else None

    def overdue(self, now: float) -> Optional[str]:
        """The error for the workers asking for turns if a worker has not come for its
        turn within the timeout (it may have died or hung), else None."""
        for w in range(self.n):
            if not self.active[w] or w in self.waiting:
                continue
            since = self.released[w] if self.released[w] is not None else self.first_ask
            if since is not None and now - since > self.timeout:
                what = ("has not asked for its next turn since its release" if
                        self.released[w] is not None else "has never asked for a turn")
                return (f"R²SP turns waited for worker {w} (world rank {w}), which {what} "
                        f"{now - since:.0f} s ago; it may have died or hung (PYCOLL_TIMEOUT "
                        "sets the limit; under R²SP every worker calls pycoll.ps.turn before "
                        "each push, as TorchWorker does)")
        return None

    # ------------------------------------------------------------ decisions
    def period(self) -> Optional[float]:
        """The iteration period without the wait for a turn, once the warm-up measured it."""
        if self.rounds < self.policy.warmup or len(self.periods) < min(self.n, 2):
            return None
        return statistics.median(self.periods)

    def gap(self) -> float:
        period, active = self.period(), sum(self.active)
        return 0.0 if period is None or active <= 1 else period / (self.policy.safety * active)

    def _after(self, worker: int) -> int:
        for step in range(1, self.n + 1):
            w = (worker + step) % self.n
            if self.active[w]:
                return w
        return worker

    def _pass_over(self) -> None:
        """Move the turn past workers that lost two turns in a row and have not asked."""
        for _ in range(self.n):
            if self.turn in self.waiting or self.missed[self.turn] < 2:
                return
            self.skipped[self.turn] += 1
            self.passed.append(self.turn)
            self.turn = self._after(self.turn)

    def _release(self, worker: int, now: float, gap: float, in_turn: bool):
        if not in_turn:
            self.out_of_turn += 1
            w = self.turn
            while w != worker:                   # they lose this round's turn
                if self.active[w]:
                    self.skipped[w] += 1
                    self.missed[w] += 1
                    self.passed.append(w)
                w = (w + 1) % self.n
        if worker <= self.previous or self.previous < 0:     # the order wrapped: a round
            self.rounds += 1
            self._plan()
        self.previous = worker
        self.turn = self._after(worker)
        waited = now - self.waiting.pop(worker)
        self.wait_s[worker] += waited
        self.longest_wait[worker] = max(self.longest_wait[worker], waited)
        self.turns[worker] += 1
        # Its push is due at server 0 a gap after the last one's, and not before that one
        # ends; the answer goes now, ahead by the turn's measured latency (release to push
        # sent, less the hold), and the worker holds its push for the rest.
        lead = min(self.latencies) if self.latencies else 0.0
        self.slot = max(now + lead, self.slot + gap, self.end)
        self.delay[worker] = self.slot - now - lead
        self.unpushed.add(worker)
        self.released[worker] = now
        self.log.append((worker, now, gap, in_turn, self.slot, self.passed))
        self.passed = []
        lost, self.lost_before[worker] = self.skipped[worker] - self.lost_before[worker], \
            self.skipped[worker]
        if self.plan is not None:
            self.batch[worker] = self.plan[worker]
        self.batches[worker] += self.batch[worker]
        weight = self.samples[worker] * self.n / sum(self.base)
        return worker, dict(weight=weight, batch=self.batch[worker], period_s=self.period(),
                            gap_s=gap, delay_s=self.delay[worker], lost=lost)

    def _plan(self) -> None:
        """This round's batch sizes (after the warm-up): the global batch split so that
        every worker's modelled iteration takes the same time."""
        ready = [w for w in range(self.n) if self.active[w]]
        if not self.policy.adapt or self.rounds <= self.policy.warmup or \
                not all(self.per_sample[w] for w in ready):
            return
        low, high = self.policy.batch
        sizes = split(sum(self.base[w] for w in ready),
                      [statistics.median(self.fixed[w]) for w in ready],
                      [statistics.median(self.per_sample[w]) for w in ready],
                      [max(1, math.ceil(low * self.base[w])) for w in ready],
                      [max(1, math.floor(high * self.base[w])) for w in ready])
        self.plan = list(self.batch)
        for w, size in zip(ready, sizes):
            self.plan[w] = size

    def stats(self) -> dict:
        def median(values):
            return statistics.median(values) if values else None
        return dict(
            period_s=self.period(), gap_s=self.gap(), rounds=self.rounds,
            push_s=median(self.durations), lead_s=min(self.latencies, default=None),
            out_of_turn=self.out_of_turn, global_batch=sum(self.base), plan=self.plan,
            workers=[dict(worker=w, turns=self.turns[w], turn_wait_s=self.wait_s[w],
                          longest_wait_s=self.longest_wait[w], skipped=self.skipped[w],
                          batch=self.batch[w], first_batch=self.base[w],
                          mean_batch=self.batches[w] / max(1, self.turns[w]),
                          fixed_s=median(self.fixed[w]),
                          per_sample_s=median(self.per_sample[w]), work_s=median(self.work[w]),
                          iteration_s=median(self.iteration[w])) for w in range(self.n)],
            recent_releases=[list(entry) for entry in self.log])


class Pacer:
    """A worker's side of the turns, for a training loop: ``start()`` when the parameters
    are in (an iteration begins: it asks for the turn now), ``turn()`` when the gradient
    is ready: the turn and the weight to push with (``push_pull(turn=, weight=)``: the
    communication thread sends the push at the turn, the loop goes on). ``batch_size``
    is the size of the next batch to train on, which the coordinator adapts: it follows
    each answer at the next ``start()`` (``TorchWorker.pull``), so a batch drawn after
    that has the newest size."""

    def __init__(self, batch_size: int):
        if not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"R²SP needs each worker's batch size (an integer >= 1), got "
                             f"{batch_size!r}: e.g. TorchWorker(model, batch_size=64)")
        self.batch_size = int(batch_size)
        self.began: Optional[float] = None       # when this iteration began
        self.busy = self.handed = 0.0            # the last one's busy time; push handed over
        self.compute = 0.0                       # the last one's computing (start to hand-over)
        self.asking = None                       # this iteration's turn, asked for
        self.granted = None                      # the last one's, its push handed over
        self.asked = self.done = 0               # samples reported; in the last push

    def start(self) -> None:
        if self.asking is not None:              # this iteration has asked already
            return
        from . import turn
        now = time.monotonic()
        if self.granted is not None:             # the last push is answered: so is its turn
            self.batch_size = self.granted.wait()["batch"]
            held = self.granted.held(self.handed)
            timeline.interval("turn wait", "ps", self.handed, self.handed + held, reason="turn")
            self.busy, self.granted = now - self.began - held, None
            self.compute = min(self.handed - self.began, self.busy)
        self.began, self.asked = now, self.done or self.batch_size
        self.asking = turn(self.asked, self.busy, wait=False, compute_s=self.compute)

    def turn(self, samples: Optional[int] = None):
        """(the turn, the weight of its push relative to the turn's); ``samples``: in the
        gradient (default: the batch size handed out)."""
        self.start()
        self.done = self.batch_size if samples is None else samples
        self.handed, self.granted, self.asking = time.monotonic(), self.asking, None
        return self.granted, self.done / self.asked


class AdaptiveBatchSampler:
    """Batches of the indices ``sampler`` yields (a list, ``torch.utils.data.RandomSampler``
    ...), each as long as ``worker.batch_size`` (a ``TorchWorker`` under R²SP) says when it
    is drawn: ``DataLoader(dataset, batch_sampler=AdaptiveBatchSampler(sampler, worker))``.
    A DataLoader with worker processes draws ``num_workers * prefetch_factor`` batches
    ahead, so a new size shows that many batches later."""

    def __init__(self, sampler, worker, drop_last: bool = False):
        self.sampler, self.worker, self.drop_last = sampler, worker, drop_last

    def __iter__(self):
        batch = []
        for index in self.sampler:
            batch.append(index)
            if len(batch) >= self.worker.batch_size:
                yield batch
                batch = []
        if batch and not self.drop_last:
            yield batch

    def __len__(self) -> int:
        """At the current batch size (sizes may change while iterating)."""
        whole, rest = divmod(len(self.sampler), self.worker.batch_size)
        return whole + (rest > 0 and not self.drop_last)
