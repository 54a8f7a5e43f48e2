"""SaPS, a straggler-aware asynchronous parameter server (Yu et al., HPCC 2019): our reading.

    ps.init(policy="saps")                                   # the defaults below
    ps.init(policy="saps:bound=12,window=8,threshold=2")     # or ps.init(policy=ps.SaPS(...))

The paper's exact rule is not public; this is the rule pycoll runs, with every knob named.
N is the number of workers and E = max(1, N - 1) the staleness equal workers show under
asynchronous training (each pushes once while the N - 1 others push once each).

- Versions and staleness. A server's version counts the updates applied to its shard of
  the model (under BSP, the rounds). Every pull answer carries it; every push carries the
  version of the parameters its gradient was computed on (the worker's last answer from
  that server), so the server knows the staleness s = version - pushed version of every
  update (under every policy: ``counters()`` shows each scheme's distribution).
- Nobody waits: updates apply on arrival and pulls are answered at once (ASP's latency).
- Discount and drop, on every push: weight(s) = 1 for s <= T = ``threshold`` x E;
  (T / s) ** ``power`` for T < s <= ``bound``; 0 (dropped) for s > ``bound``. An update
  is applied as weight x gradient / N (/ (N - F) while F are flagged, below), so the
  staleness of an applied update never exceeds ``bound``: a hard guarantee, whatever
  the detector thinks.
- Detection: each server reports its (worker, staleness) observations to a coordinator
  on the first server (batched, never in a request's path). A worker whose last
  ``window`` observations were all above T is flagged; a flagged worker whose last
  ``window`` were all at or below T is unflagged (it recovered). The coordinator sends
  the flags to every server.
- A flagged straggler gets fresh parameters at once and its stale update is not allowed
  to drag the model back: with ``drop_flagged`` (default) its updates staler than T are
  dropped rather than discounted, and its push is answered at once with the newest
  parameters, so its next gradient starts from them. (A worker computes on what it
  pulled when its step began, so a fresher basis than the answer to its push would mean
  interrupting its compute.)
- The flagged leave the average: while F workers are flagged (with ``drop_flagged``),
  every applied update counts weight x gradient / (N - F) instead of / N, as synchronous
  SGD with backup workers (Chen et al. 2016) averages the gradients that came and not
  the stragglers'. The model then keeps the step per unit of time its learning rate was
  tuned for with N equal workers. Without it, dropping lost what ASP keeps: with two of
  four workers slowed 4x they bring a fifth of the updates, and SaPS reached 90% later
  than ASP (bench/ps_stragglers.py's setting (b)); discounting them instead
  (``drop_flagged`` off) was no faster there and slower in setting (a), one worker
  slowed 3x at a larger learning rate (docs/benchmarks.md, SaPS).

Defaults: ``threshold`` 1.5 (a worker whose steps take k times as long shows about kE;
equal workers' jitter passes 1.5E now and then, never 8 times in a row in our runs),
``window`` 8 observations (every server holding a part of a push observes it: with 2
servers, 4 of a straggler's pushes), ``bound`` 4E, ``power`` 1 (the
staleness-scaled step of Zhang et al. 2016), ``drop_flagged`` True.

Counters (each server's ``saps`` entry of ``counters()``, merged by ``stragglers``):
updates discounted and dropped per worker; the flags with their times (seconds since
``init`` and as Unix time, to align with other records) from the coordinator; the applied
staleness histograms are every policy's.
"""
import collections
import logging
import math
import time
from typing import Dict, List, Optional

import numpy as np

from . import wire
from .policy import Policy

log = logging.getLogger("pycoll.ps")
OBSERVATIONS, FLAGS = 11, 12     # tags on the servers' own communicator (wire.EXCHANGE is 1)
FLUSH_S = 0.005                  # a server sends its observations at least this often
FLUSH_COUNT = 64                 # ... or once it has this many observations


class SaPS(Policy):
    """The SaPS policy and its knobs (see the module's docstring for the rule); ``bound``
    None is 4 (N - 1), resolved when the servers know N."""
    staleness = math.inf
    buffers = True
    name = "saps"

    def __init__(self, bound: Optional[int] = None, threshold: float = 1.5, window: int = 8,
                 power: float = 1.0, drop_flagged: bool = True):
        if bound is not None and (int(bound) != bound or bound < 0):
            raise ValueError(f"SaPS bound must be an integer >= 0 (versions), got {bound!r}")
        if not threshold > 0:
            raise ValueError(f"SaPS threshold must be > 0 (times N - 1), got {threshold!r}")
        if int(window) != window or window < 1:
            raise ValueError(f"SaPS window must be an integer >= 1 (observations), got {window!r}")
        if not power >= 0:
            raise ValueError(f"SaPS power must be >= 0, got {power!r}")
        self.bound = None if bound is None else int(bound)
        self.threshold, self.window, self.power = float(threshold), int(window), float(power)
        self.drop_flagged = bool(drop_flagged)

    def limits(self, workers: int):
        """(T, bound) in versions for ``workers`` workers."""
        expect = max(1, workers - 1)
        return self.threshold * expect, 4 * expect if self.bound is None else self.bound

    def weight(self, staleness: int, workers: int, flagged: bool = False) -> float:
        """The factor an update ``staleness`` versions old is applied with; 0 drops it."""
        tolerated, bound = self.limits(workers)
        if staleness > bound:
            return 0.0
        if staleness <= tolerated:
            return 1.0
        if flagged and self.drop_flagged:
            return 0.0
        return (tolerated / staleness) ** self.power

    def share(self, workers: int, flagged: int) -> float:
        """The factor every applied update's 1 / N grows by while ``flagged`` workers are
        flagged: with ``drop_flagged`` the others' updates average over N - flagged."""
        return workers / max(1, workers - flagged) if self.drop_flagged else 1.0

    def server_side(self, comm, index: int, workers: int) -> "Coordination":
        return Coordination(self, comm, index, workers)

    def __repr__(self) -> str:
        knobs = [f"bound={self.bound}"] if self.bound is not None else []
        knobs += [f"threshold={self.threshold:g}", f"window={self.window}"]
        return f"saps({', '.join(knobs)})"

    @classmethod
    def parse(cls, text: str) -> "SaPS":
        """``"bound=12,window=8"`` (or a bare bound, ``"12"``) -> SaPS."""
        kwargs: dict = {}
        kinds = {"bound": int, "threshold": float, "window": int, "power": float,
                 "drop_flagged": lambda v: v.strip().lower() in ("1", "true", "yes", "on")}
        for item in filter(None, (i.strip() for i in text.split(","))):
            key, eq, value = item.partition("=")
            key = key.strip() if eq else "bound"
            value = value if eq else item
            if key not in kinds:
                raise ValueError(f"policy 'saps:{text}': unknown knob {key!r}; knobs are "
                                 f"{', '.join(kinds)}, e.g. saps:bound=12,window=8")
            try:
                kwargs[key] = kinds[key](value)
            except ValueError:
                raise ValueError(f"policy 'saps:{text}': {key}={value!r} is not a number") from None
        return cls(**kwargs)


class Detector:
    """The coordinator's rule: flag a worker whose last ``window`` observations were all
    above ``limit``, unflag a flagged one whose last ``window`` were all at or below it."""

    def __init__(self, workers: int, limit: float, window: int):
        self.limit = limit
        self.recent = [collections.deque(maxlen=window) for _ in range(workers)]
        self.flagged = [False] * workers
        self.events: List[list] = []          # [worker, flagged at, unflagged at or None]

    def feed(self, worker: int, staleness: int, now: float) -> bool:
        """Take one observation; whether the flags changed."""
        recent = self.recent[worker]
        recent.append(staleness)
        if len(recent) < recent.maxlen:
            return False
        if not self.flagged[worker] and min(recent) > self.limit:
            self.flagged[worker] = True
            self.events.append([worker, now, None])
            return True
        if self.flagged[worker] and max(recent) <= self.limit:
            self.flagged[worker] = False
            next(e for e in reversed(self.events) if e[0] == worker)[2] = now
            return True
        return False


class Coordination:
    """One server's part of SaPS: it weighs its pushes, and sends its observations to the
    coordinator on server 0 (which runs the ``Detector`` and sends back the flags)."""

    def __init__(self, policy: SaPS, comm, index: int, workers: int):
        from mpi4py import MPI        # here: benchmarks import this module without MPI
        self.MPI = MPI
        self.policy, self.comm, self.index, self.workers = policy, comm, index, workers
        self.start = time.monotonic()
        self.epoch = time.time() - self.start         # monotonic -> Unix time
        limit, _ = policy.limits(workers)
        self.detector = Detector(workers, limit, policy.window) if index == 0 else None
        self._flag([False] * workers)
        self.outbox: List[int] = []              # worker, staleness, worker, ...
        self.last_flush = self.start
        self.sends: list = []                    # (request, buffer) in flight
        self.sent = [0] * comm.size              # messages sent to each server
        self.received = [0] * comm.size          # ... and received from each
        self.discounted = [0] * workers
        self.dropped = [0] * workers
        self.status = MPI.Status()

    def observe(self, worker: int, staleness: int) -> float:
        """A push ``staleness`` versions old from ``worker``: the factor its gradient / N is
        applied with (its weight x ``share``; 0 drops it)."""
        weight = self.policy.weight(staleness, self.workers, self.flagged[worker])
        factor = weight * self.share           # before this observation changes the flags
        if weight == 0.0:
            self.dropped[worker] += 1
        elif weight < 1.0:
            self.discounted[worker] += 1
        if self.detector is not None:
            if self.detector.feed(worker, staleness, time.monotonic() - self.start):
                self._publish()
        else:
            self.outbox += (worker, staleness)
        return factor

    def poll(self) -> None:
        """Between requests: take the messages of the other servers, send ours when due."""
        self.sends = [s for s in self.sends if not s[0].Test()]
        if self.comm.size == 1:
            return
        if self.detector is not None:
            changed = False
            now = time.monotonic() - self.start
            for data in self._take(OBSERVATIONS):
                for worker, staleness in data.reshape(-1, 2).tolist():
                    changed |= self.detector.feed(worker, staleness, now)
            if changed:
                self._publish()
        else:
            for data in self._take(FLAGS):
                self._flag(data)
            now = time.monotonic()
            if self.outbox and (len(self.outbox) >= 2 * FLUSH_COUNT
                                or now - self.last_flush >= FLUSH_S):
                self._send(np.array(self.outbox, np.int64), 0, OBSERVATIONS)
                self.outbox, self.last_flush = [], now

    def close(self, timeout: float) -> None:
        """At the end of the run (every server calls it): the coordinator takes every
        observation still on its way, the others every flag, and all sends complete."""
        from ..work import wait_requests
        if self.outbox:
            self._send(np.array(self.outbox, np.int64), 0, OBSERVATIONS)
            self.outbox = []
        if self.comm.size > 1:
            counts = wire.exchange(self.comm, np.array(self.sent, np.int64).tobytes(),
                                   "SaPS's last observations", "server", timeout)
            owed = [int(np.frombuffer(c, np.int64)[self.index]) for c in counts]
            tag = OBSERVATIONS if self.detector is not None else FLAGS
            deadline = time.monotonic() + timeout
            while any(r < o for r, o in zip(self.received, owed)) and time.monotonic() < deadline:
                for data in self._take(tag):
                    if self.detector is not None:
                        for worker, staleness in data.reshape(-1, 2).tolist():
                            self.detector.feed(worker, staleness, time.monotonic() - self.start)
                    else:
                        self._flag(data)
                time.sleep(1e-4)
            if any(r < o for r, o in zip(self.received, owed)):
                log.warning("pycoll.ps server %d: SaPS messages of other servers did not come "
                            "within %g s; the counters miss them", self.index, timeout)
        if wait_requests([r for r, _ in self.sends], timeout, None):
            log.warning("pycoll.ps server %d: SaPS messages to other servers were not taken",
                        self.index)

    def stats(self) -> dict:
        out = dict(discounted=self.discounted, dropped=self.dropped,
                   flagged=[w for w, f in enumerate(self.flagged) if f])
        if self.detector is not None:
            out["flags"] = [dict(worker=w, flagged_s=round(a, 3),
                                 unflagged_s=None if b is None else round(b, 3),
                                 flagged_at=self.start + self.epoch + a,
                                 unflagged_at=None if b is None else self.start + self.epoch + b)
                            for w, a, b in self.detector.events]
        limit, bound = self.policy.limits(self.workers)
        out.update(policy=repr(self.policy), limit=limit, bound=bound)
        return out

    def _publish(self) -> None:
        """Server 0: the new flags, here and to every other server."""
        self._flag(self.detector.flagged)
        if self.comm.size > 1:
            flags = np.array(self.flagged, np.int8)
            for server in range(1, self.comm.size):
                self._send(flags.copy(), server, FLAGS)

    def _flag(self, flags) -> None:
        self.flagged = [bool(f) for f in flags]
        self.share = self.policy.share(self.workers, sum(self.flagged))

    def _send(self, data: np.ndarray, server: int, tag: int) -> None:
        request = self.comm.Isend([data, self.MPI.BYTE], server, tag)
        self.sends.append((request, data))
        self.sent[server] += 1

    def _take(self, tag: int):
        """Every message with ``tag`` that has arrived."""
        dtype = np.int64 if tag == OBSERVATIONS else np.int8
        while True:
            message = self.comm.improbe(self.MPI.ANY_SOURCE, tag, self.status)
            if message is None:
                return
            data = np.empty(self.status.Get_count(self.MPI.BYTE) // np.dtype(dtype).itemsize, dtype)
            message.Recv([data, self.MPI.BYTE])
            self.received[self.status.Get_source()] += 1
            yield data


def stragglers(servers: List[dict]) -> dict:
    """One job-wide view of the servers' counters: per worker its applied staleness
    histogram (summed over servers), updates discounted and dropped (SaPS), and the
    coordinator's flags with their times."""
    histogram: Dict[str, Dict[str, int]] = {}
    for s in servers:
        for worker, counts in s.get("staleness", {}).items():
            mine = histogram.setdefault(worker, {})
            for value, n in counts.items():
                mine[value] = mine.get(value, 0) + n
    out = dict(policy=servers[0]["policy"] if servers else None, staleness=histogram)
    saps = [s["saps"] for s in servers if "saps" in s]
    if saps:
        out.update(discounted=[sum(x) for x in zip(*(s["discounted"] for s in saps))],
                   dropped=[sum(x) for x in zip(*(s["dropped"] for s in saps))],
                   flags=saps[0].get("flags", []), flagged=saps[0].get("flagged", []),
                   bound=saps[0]["bound"], limit=saps[0]["limit"])
    return out


def percentile(histogram: Dict[str, int], q: float) -> Optional[int]:
    """The ``q`` quantile (0-1) of a ``{staleness: count}`` histogram; None if empty."""
    items = sorted((int(k), n) for k, n in histogram.items())
    total = sum(n for _, n in items)
    if not total:
        return None
    seen = 0
    for value, n in items:
        seen += n
        if seen >= q * total:
            return value
    return items[-1][0]


def merged(histograms: Dict[str, Dict[str, int]]) -> Dict[str, int]:
    out: Dict[str, int] = {}
    for counts in histograms.values():
        for value, n in counts.items():
            out[value] = out.get(value, 0) + n
    return out


def summary(view: dict) -> str:
    """The straggler line of an end-of-run summary, from ``stragglers``' view."""
    every = merged(view["staleness"])
    text = (f"applied staleness median {percentile(every, 0.5)}, p99 {percentile(every, 0.99)}, "
            f"max {percentile(every, 1.0)}") if every else "no updates applied"
    if "flags" not in view:
        return f"stragglers: not tracked by {view['policy']}; {text}"
    flags = "; ".join(f"worker {f['worker']} flagged at {f['flagged_s']:.1f} s"
                      + (f", unflagged at {f['unflagged_s']:.1f} s" if f["unflagged_s"] is not None
                         else " (to the end)") for f in view["flags"]) or "none flagged"
    return (f"stragglers: {flags}; updates discounted {sum(view['discounted'])}, dropped "
            f"{sum(view['dropped'])} (bound {view['bound']}); {text}")
