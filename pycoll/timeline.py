"""The timeline (``--timeline PATH``): a Chrome trace of every operation; and the
straggler report (``--report``): who computed, communicated and waited, and for whom.

    pycollrun -np 4 --timeline trace.json --timeline-steps 10-12 python train.py
    pycollrun -np 4 --report --slowdown 1:3 python train.py

The trace opens in Perfetto (ui.perfetto.dev) and chrome://tracing: a process per rank,
a track per thread (the caller's, ``pycoll-engine``, ``pycoll-ps``), and on them each
operation as it ran: its phases (checked, packed, in MPI, unpacked) nested inside it,
the operations a fused batch held (``args.members``), the time each waited in the queue
and its completion, the compute inside ``pycoll.slowdown()``, PS requests and, on
servers, the time a pull waited there and why; emulated time (``--link``,
``--slowdown``) is its own category, ``emulated``. Each rank records its own part;
at exit rank 0 gathers them over MPI and writes one file, with every rank's clock moved
onto rank 0's by offsets measured over MPI when pycoll started (ping-pong, the
round trip of least delay).

Everything is called through this module. Hooks test ``on`` (a module attribute,
false unless a timeline or a report was asked for) before they build anything, so
with neither the cost is that test; a hook that runs per operation uses ``phase``,
which then returns one shared no-op context. While a timeline or a report is
configured, the blocking allreduce leaves the compiled short path (which records
nothing) for the general one. A new layer marks its work the same way (``phase`` on
its thread, ``interval`` for what overlaps, e.g. iPart's partitions); a PS policy
names why a pull waits by ``Policy.why_wait`` (R²SP's turn), and PS counters with a
``waited_for`` map (rank -> seconds) feed the report.

Memory is bounded: at most PYCOLL_TIMELINE_MAX_EVENTS events per rank are kept, the
oldest dropped first (the trace says how many); ``--timeline-steps A-B`` records steps
A to B only (``step()`` ends a step; ``DistributedOptimizer.step`` and
``ps.TorchWorker.push`` call it), and ``start()`` / ``stop()`` switch recording by hand.
"""
import atexit
import collections
import itertools
import json
import logging
import math
import threading
import time
import zlib
from typing import Optional

from . import config

log = logging.getLogger("pycoll")

on = False               # a hook must run: recording a trace, or counting for the report
_recording = False       # trace events are being kept
_counting = False        # the report's totals and collective records are being kept
_begun = False
_comm = None             # our duplicate of the communicator pycoll started on
_events: collections.deque = collections.deque()
_dropped = [0]
_ops: collections.deque = collections.deque()    # report: (name, seq, start, end)
# An operation's seq counts the operations before it whose names share its bucket (the
# same on every rank running them): bounded however many names a program makes.
_seq = [0] * 4096
_totals = collections.Counter()                  # report: seconds by category
_tids: dict = {}          # thread ident -> (track id, thread name)
_ids = itertools.count(1)
_step = 0                 # steps ended so far (pycoll.timeline.step())
_step_began = 0.0
_role = ""
_started = 0.0
_ps_counters: list = []   # report: what ps.counters() returned on this worker
_offsets: list = []       # rank 0: each rank's clock minus rank 0's, seconds
_ROUNDS = 8               # ping-pongs per rank when measuring clock offsets

now = time.monotonic      # the clock of every event (and of emulation and slowdown)


# ---------------------------------------------------------------- hooks

class _Nothing:
    """What ``phase`` returns while nothing records: one shared no-op context."""
    __slots__ = ()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


_NOTHING = _Nothing()


_COUNTED = ("compute",)     # categories whose time the report sums


class _Span:
    __slots__ = ("name", "cat", "args", "start")

    def __init__(self, name, cat, args):
        self.name, self.cat, self.args = name, cat, args

    def __enter__(self):
        self.start = now()
        return self

    def __exit__(self, *exc):
        end = now()
        if self.cat in _COUNTED and _counting:
            _totals[self.cat] += end - self.start
        if _recording:
            _add("X", self.name, self.cat, self.start, end - self.start, self.args)
        return False


def phase(name: str, cat: str = "phase", **args):
    """``with timeline.phase("in MPI"):`` a span on this thread's track, nested in the
    operation running there; a shared no-op while nothing records."""
    if not on:
        return _NOTHING
    return _Span(name, cat, args)


def issued(work) -> None:
    """An operation was queued (engine.submit): its wait in the queue starts now."""
    work._issued = now()


def run(fn, args: tuple, name: str, works=()):
    """``fn(*args)``, one engine operation (a batch of ``works`` or a blocking call), as
    a span on this thread's track; the time each of ``works`` waited in the queue; and,
    for the report, when it started and ended, matched across ranks by name and order."""
    if len(works) > 1:
        name = f"{name} and {len(works) - 1} more"      # a fused batch
    start = now()
    try:
        return fn(*args)
    finally:
        end = now()
        if _counting:
            bucket = zlib.crc32(name.encode()) % len(_seq)
            _seq[bucket] += 1
            _ops.append((name, _seq[bucket], start, end))
            _totals["collective"] += end - start
        if _recording:
            members = [w.name for w in works]
            _add("X", name, "op", start, end - start,
                 {"members": members} if len(members) > 1 else {})
            for work in works:
                issued_at = getattr(work, "_issued", None)
                if issued_at is not None:
                    _async("queued", "queue", issued_at, start, {"op": work.name})
            _add("i", "completed", "op", end, 0, {"ops": len(works) or 1})


def interval(name: str, cat: str, start: float, end: Optional[float] = None, **args) -> None:
    """A span from ``start`` to ``end`` (default now) that other spans may overlap (a PS
    request, a pull waiting at a server): an async slice of this rank."""
    if _recording:
        _async(name, cat, start, now() if end is None else end, args)


def instant(name: str, **args) -> None:
    if _recording:
        _add("i", name, "mark", now(), 0, args)


def role(text: str) -> None:
    """What this rank is, shown in its track's name ("PS server 0")."""
    global _role
    _role = text


def ps_counters(counters: dict) -> None:
    """For the report: this worker's ``pycoll.ps.counters()`` (``pull_wait_s`` counts as
    waiting; ``waited_for``, {rank: seconds}, in the worker's or a server's counters
    names whom it waited for; ``straggler_line``, the PS's, is printed as it is)."""
    if _counting:
        _ps_counters.append(counters)


def _add(ph, name, cat, start, dur, args) -> None:
    ident = threading.get_ident()
    tid = _tids.get(ident)
    if tid is None:
        tid = _tids[ident] = (len(_tids) + 1, threading.current_thread().name)
    if len(_events) == _events.maxlen:
        _dropped[0] += 1
    _events.append((ph, name, cat, start, dur, tid[0], args, 0))


def _async(name, cat, start, end, args) -> None:
    span = next(_ids)
    _dropped[0] += max(0, len(_events) + 2 - (_events.maxlen or math.inf))
    _events.append(("b", name, cat, start, 0, 0, args, span))
    _events.append(("e", name, cat, end, 0, 0, {}, span))


# ---------------------------------------------------------------- what to record

def step() -> None:
    """A training step ended. With ``--timeline-steps A-B`` recording runs from the end
    of step A - 1 (the start, for A = 0) to the end of step B; steps count from 0."""
    global _step, _step_began
    _step += 1
    if not _begun:
        return
    ended = now()
    if _recording:             # the step's span, enclosing what this thread did in it
        _add("X", f"step {_step - 1}", "step", _step_began, ended - _step_began, {})
    _step_began = ended
    steps = config.get("timeline_steps")
    if steps is not None and config.get("timeline"):
        if _step == steps[0]:
            _set(recording=True)
        elif _step == steps[1] + 1:
            _set(recording=False)


def start() -> None:
    """Record from now on (into the configured timeline file)."""
    if not config.get("timeline"):
        raise ValueError("pycoll.timeline.start(): no timeline file is configured; set "
                         "PYCOLL_TIMELINE, pycollrun --timeline PATH or "
                         "pycoll.init(timeline=PATH)")
    _set(recording=True)


def stop() -> None:
    """Stop recording; what was recorded is still written at exit."""
    _set(recording=False)


def _set(recording: Optional[bool] = None, counting: Optional[bool] = None) -> None:
    global on, _recording, _counting
    _recording = _recording if recording is None else recording
    _counting = _counting if counting is None else counting
    on = _recording or _counting


def configured() -> bool:
    return bool(config.get("timeline") or config.get("report"))


# ---------------------------------------------------------------- start and exit

def begin(comm) -> None:
    """Where pycoll starts on ``comm`` (every rank of it calls this; the first call
    counts): with a timeline or a report asked for, measure each rank's clock offset
    against rank 0's, start recording (or wait for the steps) and gather at exit."""
    global _begun, _comm, _started, _offsets, _events, _ops, _step_began
    if _begun or not configured():
        return
    _begun = True
    _comm = comm.Dup()
    _offsets = _clock_offsets(_comm)
    _events = collections.deque(maxlen=config.get("timeline_max_events"))
    _ops = collections.deque(maxlen=config.get("timeline_max_events"))
    _started = _step_began = now()
    steps = config.get("timeline_steps")
    _set(recording=bool(config.get("timeline")) and (steps is None or steps[0] <= _step
                                                      <= steps[1]),
         counting=bool(config.get("report")))
    atexit.register(finish)


def _clock_offsets(comm) -> list:
    """Rank 0: each rank's clock minus rank 0's (seconds), from ping-pongs, taking the
    round trip of least delay; the others: []."""
    import numpy as np
    buf = np.zeros(1, np.float64)
    if comm.rank != 0:
        for _ in range(_ROUNDS):
            comm.Recv(buf, source=0, tag=7)
            buf[0] = now()
            comm.Send(buf, dest=0, tag=7)
        return []
    offsets = [0.0]
    for rank in range(1, comm.size):
        best = (math.inf, 0.0)
        for _ in range(_ROUNDS):
            sent = now()
            comm.Send(buf, dest=rank, tag=7)
            comm.Recv(buf, source=rank, tag=7)
            back = now()
            best = min(best, (back - sent, buf[0] - (sent + back) / 2))
        offsets.append(best[1])
    return offsets


def _part() -> dict:
    """This rank's recording, in the form rank 0 gathers."""
    from mpi4py import MPI
    threads = {tid: name for tid, name in _tids.values()}
    return dict(rank=MPI.COMM_WORLD.Get_rank(), role=_role, events=list(_events),
                threads=threads, dropped=_dropped[0], started=_started, ended=now(),
                ops=list(_ops), totals=dict(_totals), ps=_ps_counters)


def finish() -> None:
    """At exit (before MPI is finalized): gather every rank's part on rank 0, which
    writes the trace and prints the report. Ranks that do not come within
    PYCOLL_TIMEOUT are left out, with a warning."""
    global _comm
    if _comm is None:
        return
    comm, _comm = _comm, None
    _set(recording=False, counting=False)
    from mpi4py import MPI
    import numpy as np
    from .work import wait_requests
    data = np.frombuffer(json.dumps(_part()).encode(), np.uint8)
    sizes = np.zeros(comm.size, np.int64)
    timeout = config.get("timeout")
    request = comm.Igather(np.array([data.size], np.int64), sizes, root=0)
    if wait_requests([request], timeout):
        log.warning("pycoll.timeline: not every rank reached the end within %g s; "
                    "no trace or report written", timeout)
        return
    everything = np.empty(int(sizes.sum()) if comm.rank == 0 else 0, np.uint8)
    displs = np.concatenate([[0], np.cumsum(sizes)[:-1]]).tolist()
    request = comm.Igatherv(data, [everything, sizes.tolist(), displs, MPI.BYTE], root=0)
    if wait_requests([request], timeout) or comm.rank != 0:
        return
    parts = [json.loads(everything[d:d + n].tobytes()) for d, n in zip(displs, sizes.tolist())]
    for part, offset in zip(parts, _offsets):
        part["offset"] = offset
    path = config.get("timeline")
    if path:
        with open(path, "w") as f:
            json.dump(trace(parts), f)
        dropped = {p["rank"]: p["dropped"] for p in parts if p["dropped"]}
        if dropped:
            log.warning("pycoll.timeline: ranks dropped their oldest events past "
                        "PYCOLL_TIMELINE_MAX_EVENTS (rank: events) %s; record fewer steps "
                        "(--timeline-steps) or raise the limit", dropped)
    if config.get("report"):
        print(report(parts, config.get("slowdown")), flush=True)


# ---------------------------------------------------------------- rank 0's merge

def trace(parts: list) -> dict:
    """One Chrome trace (trace-event JSON) of every rank's part, on rank 0's clock,
    microseconds from rank 0's start."""
    base = parts[0]["started"]
    events = []
    for part in parts:
        pid, shift = part["rank"], base + part.get("offset", 0.0)
        label = f"rank {pid}" + (f" ({part['role']})" if part["role"] else "")
        events.append(dict(ph="M", name="process_name", pid=pid, tid=0, args={"name": label}))
        events.append(dict(ph="M", name="process_sort_index", pid=pid, tid=0,
                           args={"sort_index": pid}))
        for tid, name in part["threads"].items():
            events.append(dict(ph="M", name="thread_name", pid=pid, tid=int(tid),
                               args={"name": name}))
        for ph, name, cat, start, dur, tid, args, span in part["events"]:
            event = dict(ph=ph, name=name, cat=cat, pid=pid, tid=tid,
                         ts=round((start - shift) * 1e6, 3))
            if ph == "X":
                event["dur"] = round(dur * 1e6, 3)
            elif ph == "i":
                event["s"] = "t"
            else:
                event["id"] = pid << 32 | span         # async ids: unique across ranks
            if args:
                event["args"] = args
            events.append(event)
    dropped = {p["rank"]: p["dropped"] for p in parts if p["dropped"]}
    return {"traceEvents": events, "displayTimeUnit": "ms",
            "otherData": {"pycoll": "timeline", "clock_offsets_s": {
                p["rank"]: p.get("offset", 0.0) for p in parts},
                "dropped_events": dropped}}


def waits(parts: list):
    """From the collectives every rank recorded (matched by name and order): each rank's
    seconds waiting for peers, and each rank's seconds that others waited for it. In a
    collective every member waits for the last to arrive; what it spends after that is
    communication."""
    waited = collections.Counter()
    waited_for = collections.Counter()
    matched = collections.defaultdict(list)
    for part in parts:
        shift = part.get("offset", 0.0)
        for name, seq, start, end in part["ops"]:
            matched[name, seq].append((start - shift, end - shift, part["rank"]))
    for members in matched.values():
        if len(members) < 2:
            continue
        last = max(members)
        for start, end, rank in members:
            wait = max(0.0, min(last[0] - start, end - start))
            waited[rank] += wait
            waited_for[last[2]] += wait
    return waited, waited_for


def report(parts: list, slowdown=None) -> str:
    """The straggler report: a row per rank (computing, communicating, waiting for
    peers, PS pull wait), then the ranks the others waited for most, with a hint."""
    waited, waited_for = waits(parts)
    pulls = collections.Counter()
    servers, straggler_line = [], None
    for part in parts:
        for counters in part["ps"]:
            straggler_line = counters.get("straggler_line", straggler_line)
            worker = counters.get("worker", {})
            pulls[part["rank"]] += worker.get("pull_wait_s", 0.0)
            for rank, seconds in worker.get("waited_for", {}).items():
                waited_for[int(rank)] += seconds
            servers = counters.get("servers", servers)
    for server in servers:                   # the same on every worker: counted once
        for rank, seconds in server.get("waited_for", {}).items():
            waited_for[int(rank)] += seconds
    header = ("rank", "wall s", "computing", "communicating", "waiting for peers",
              "PS pull wait", "other")
    rows = []
    for part in parts:
        rank, totals = part["rank"], part["totals"]
        wall = part["ended"] - part["started"]
        compute, collective = totals.get("compute", 0.0), totals.get("collective", 0.0)
        wait = min(waited[rank], collective)
        other = max(0.0, wall - compute - collective - pulls[rank])
        label = f"{rank}" + (f" ({part['role']})" if part["role"] else "")
        rows.append((label, f"{wall:.2f}", f"{compute:.2f}", f"{collective - wait:.2f}",
                     f"{wait:.2f}", f"{pulls[rank]:.2f}", f"{other:.2f}"))
    widths = [max(len(str(r[i])) for r in rows + [header]) for i in range(len(header))]
    lines = ["pycoll report (seconds; computing: inside pycoll.slowdown(); waiting: in "
             "collectives, for the last rank to arrive)"]
    for row in [header] + rows:
        lines.append("  ".join(str(v).rjust(w) for v, w in zip(row, widths)))
    if straggler_line:                       # the parameter server's (SaPS's flags)
        lines.append(f"parameter server {straggler_line}")
    total = sum(waited_for.values())
    if total <= 0:
        lines.append("nobody waited for anybody in collectives")
        return "\n".join(lines)
    ranked = [(s, r) for r, s in waited_for.most_common() if s >= 0.1 * total][:3]
    named = ", ".join(f"rank {r} ({s:.2f} s, {100 * s / total:.0f}%"
                      + (f"; --slowdown {r}:{slowdown[r]!r}" if slowdown and r in slowdown
                         else "") + ")" for s, r in ranked)
    lines.append(f"waited for most: {named} of the {total:.2f} s ranks waited for others")
    lines.append("hint: rerun with --timeline trace.json (and --timeline-steps A-B to keep "
                 "it small) and open it in ui.perfetto.dev to see where")
    return "\n".join(lines)
