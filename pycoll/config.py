"""The one place pycoll reads configuration.

Precedence: keyword arguments to ``pycoll.init`` (or ``configure``), then ``PYCOLL_*``
environment variables, then the defaults below. ``pycollrun`` turns each knob into a
command-line flag that sets its variable, so this table is the only list of knobs.
"""
import math
import os
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Callable, Optional

from .emulation import parse_link


def _bool(text: str) -> bool:
    value = str(text).strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off", ""):
        return False
    raise ValueError(f"expected a boolean (1/0, true/false), got {text!r}")


def _number(kind: type, low: float, what: str, above: bool = False) -> Callable[[Any], Any]:
    """A parser of ``kind`` values >= ``low`` (> with ``above``), finite; ``what`` names
    the accepted range in its error."""
    def parse(text):
        try:
            value = kind(text)
        except (TypeError, ValueError):
            value = None
        if (value is None or isinstance(text, bool) or not math.isfinite(value)
                or value < low or (above and value == low)):
            raise ValueError(f"expected {what}, got {text!r}")
        return value
    return parse


def _choice(*names: str) -> Callable[[str], str]:
    def parse(text):
        value = str(text).strip().lower()
        if value not in names:
            raise ValueError(f"expected one of {', '.join(names)}, got {text!r}")
        return value
    return parse


class Windows(float):
    """A rank's slowdown that comes and goes: the float is its largest factor (what a
    plain ``RANK:FACTOR`` entry holds); ``at(t)`` the factor ``t`` seconds after the
    start, from ``windows`` ((start, end, factor), the last listed winning) else ``base``."""

    def __new__(cls, base: float, windows):
        value = float.__new__(cls, max([base] + [factor for _, _, factor in windows]))
        value.base, value.windows = base, tuple(windows)
        return value

    def at(self, t: float) -> float:
        for start, end, factor in reversed(self.windows):
            if start <= t < end:
                return factor
        return self.base

    def __repr__(self) -> str:
        return ",".join([f"{self.base:g}"] * (self.base != 1) + [
            f"{f:g}@{s:g}-{'' if e == float('inf') else f'{e:g}'}" for s, e, f in self.windows])


def parse_slowdown(text: str) -> dict:
    """``"1:3,4:1.5"`` -> ``{1: 3.0, 4: 1.5}`` (rank -> compute slowdown factor).
    ``RANK:FACTOR@START-END`` slows the rank only from START to END seconds after the
    start (``pycoll.init``), END omitted: to the end; a rank may have several windows
    (and a plain entry for the time outside them); its value is then a ``Windows``."""
    factors, windows = {}, {}
    for item in filter(None, (part.strip() for part in str(text).split(","))):
        rank, sep, factor = item.partition(":")
        factor, at, span = factor.partition("@")
        try:
            rank, factor = int(rank), float(factor)
            start, dash, end = span.partition("-")
            start, end = (float(start), float(end) if end.strip() else float("inf")) if at \
                else (0.0, float("inf"))
        except ValueError:
            raise ValueError(f"slowdown {item!r} is not RANK:FACTOR[@START-END], e.g. 1:3 "
                             "or 1:3@10-20") from None
        if not sep or rank < 0 or factor < 1:
            raise ValueError(f"slowdown {item!r}: need RANK >= 0 and FACTOR >= 1, e.g. 1:3")
        if at and (not dash or not 0 <= start < end):
            raise ValueError(f"slowdown {item!r}: a window is @START-END seconds with "
                             "0 <= START < END, e.g. 1:3@10-20 (or 1:3@10- to the end)")
        if at:
            windows.setdefault(rank, []).append((start, end, factor))
        else:
            factors[rank] = factor
    for rank, spans in windows.items():
        factors[rank] = Windows(factors.get(rank, 1.0), spans)
    return factors


def parse_steps(text) -> Optional[tuple]:
    """``--timeline-steps``: ``"10-12"`` -> (10, 12); ``"10-"`` -> (10, inf); ``"5"`` -> (5, 5)."""
    if text is None or str(text).strip() == "":
        return None
    first, dash, last = str(text).strip().partition("-")
    try:
        first = int(first)
        last = (int(last) if last.strip() else math.inf) if dash else first
    except ValueError:
        raise ValueError(f"expected steps A-B (e.g. 10-12, or 10- to the end), got {text!r}") \
            from None
    if first < 0 or last < first:
        raise ValueError(f"expected steps A-B with 0 <= A <= B, got {text!r}")
    return first, last


def _log_level(text) -> str:
    """``--log-level``; Horovod's levels beyond Python's, trace and fatal, are its nearest."""
    nearest = {"trace": "debug", "fatal": "error"}.get(str(text).strip().lower(), text)
    return _choice("debug", "info", "warning", "error")(nearest)


def _timeline_path(text) -> Optional[str]:
    """``--timeline PATH``; ``DYNAMIC``, what Horovod's scripts set for a timeline that
    ``start_timeline`` starts later (pycoll's starts with the job), is no path."""
    text = str(text)
    return None if text in ("", "DYNAMIC") else text


@dataclass(frozen=True)
class Knob:
    name: str
    default: Any
    parse: Callable[[str], Any]
    help: str
    horovod: Optional[str] = None   # Horovod's variable for it, read where PYCOLL_'s is unset

    @property
    def env(self) -> str:
        return "PYCOLL_" + self.name.upper()

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")


KNOBS = {k.name: k for k in (
    Knob("timeout", 300.0, _number(float, 0, "a positive, finite number of seconds", above=True),
         "seconds a blocking call or Work.wait() waits before raising CollectiveTimeout"),
    # 4 MiB: small enough that batches leave while backward runs. bench/fusion.py's sweep
    # (1 to 128 MiB), which issues every tensor before waiting, favours 128 MiB by 10-13%.
    Knob("fusion_threshold", 4 * 2**20, _number(int, 0, "a whole number of bytes >= 0"),
         "bytes: allreduces issued one after another are fused into batches up to this size",
         horovod="HOROVOD_FUSION_THRESHOLD"),
    # 4 MiB: bench/fusion.py's chunk sweep (1-64 MiB), best over all cases at 4 ranks and
    # within 3% of 2 MiB at 2; a 64 MiB allreduce in 4 MiB pieces ran 2-3x faster than
    # in one MPI call (the pieces stay in cache).
    Knob("chunk_bytes", 4 * 2**20, _number(int, 1, "a whole number of bytes >= 1"),
         "bytes: an allreduce larger than this (one tensor or a fused batch) travels in pieces "
         "of this size, each packed, reduced and unpacked while it is in cache; also the most "
         "host memory that staging GPU tensors takes, the chunk of partial_allreduce's ring and "
         "the payload message of parameter-server pushes (tensors.pieces; every rank the same)"),
    # 0: bench/fusion.py's cycle sweep found 0, 0.5 and 2 ms within noise of each other,
    # and without a cycle batches are cut alike on every rank with no negotiation round.
    Knob("cycle_time_ms", 0.0, _number(float, 0, "a finite number of milliseconds >= 0"),
         "milliseconds: a fused batch still filling is sent once it is this old, ranks agreeing "
         "on its contents by one small allreduce (Horovod's cycle); 0: batches are cut only at "
         "the fusion threshold, another kind of operation, or when a result is needed",
         horovod="HOROVOD_CYCLE_TIME"),
    Knob("check", False, _bool,
         "before each collective, ranks compare what they submit; mismatches and missing "
         "ranks raise on every rank"),
    Knob("abort_on_error", True, _bool,
         "an uncaught exception on one rank ends every rank of the job, as `python -m "
         "mpi4py` does, instead of leaving the others waiting in a collective for it, and so "
         "does a collective still waiting for a rank that has left pycoll (its script "
         "ended, sys.exit, shutdown); 0 leaves them running to PYCOLL_TIMEOUT (also "
         "pycollrun's --no-abort-on-error)"),
    Knob("stall_warning_s", 60.0, _number(float, 0, "a positive, finite number of seconds", above=True),
         "with check on, log which ranks have not joined a collective after this many seconds",
         horovod="HOROVOD_STALL_CHECK_TIME_SECONDS"),
    Knob("log_level", "warning", _log_level,
         "logging level of the pycoll logger: debug, info, warning, error (Horovod's trace "
         "and fatal: debug and error)", horovod="HOROVOD_LOG_LEVEL"),
    Knob("cuda_aware_mpi", False, _bool,
         "hand GPU buffers to MPI directly instead of staging them through host memory"),
    Knob("slowdown", {}, parse_slowdown,
         "RANK:FACTOR[@START-END][,...]: pycoll.slowdown() makes these ranks' compute FACTOR "
         "times slower (from START to END seconds after pycoll.init, if given)"),
    Knob("link", None, parse_link,
         "[RANK:]LATENCY,BANDWIDTH[,...], e.g. 50us,1.25GB/s: emulate a network; every "
         "transfer takes at least its alpha-beta time, each rank's NIC a FIFO (a RANK: "
         "entry gives that rank its own link)"),
    Knob("servers", 1, _number(int, 1, "a whole number of server ranks >= 1"),
         "pycoll.ps: how many ranks (the last ones) serve parameters; the others are workers"),
    # 256 KiB: 2 ms of a 1 Gb/s link, the longest an urgent answer waits behind others
    # posted before it (plus the one being sent); much less and the link would idle
    # while the server wakes up between answers.
    Knob("ps_reply_credit", 256 * 2**10, _number(int, 0, "a whole number of bytes >= 0"),
         "pycoll.ps: bytes of pull answers a server keeps in flight; the others wait and go "
         "most urgent first (the requests' priority); 0: each goes when answered"),
    Knob("timeline", None, _timeline_path,
         "PATH: write a Chrome trace (Perfetto, chrome://tracing) of every operation on "
         "every rank to PATH at exit",
         horovod="HOROVOD_TIMELINE"),
    Knob("timeline_steps", None, parse_steps,
         "A-B: record the timeline from step A to step B only (steps end at "
         "pycoll.timeline.step(); DistributedOptimizer and ps.TorchWorker call it); "
         "A- to the end"),
    # 200,000 events: about 40 MB of Python objects per rank.
    Knob("timeline_max_events", 200_000, _number(int, 1, "a whole number of events >= 1"),
         "events a rank keeps for the timeline (and collectives for the report); past it "
         "the oldest are dropped"),
    Knob("report", False, _bool,
         "at exit, print a table of each rank's time computing, communicating and waiting "
         "for peers, and the ranks everybody waited for most"),
    Knob("partial_cache_after", 3, _number(int, 0, "a whole number of uses >= 0"),
         "partial_allreduce: a group of ranks gets its own cached communicator at this use (0: never)"),
    Knob("ipart_grain", 256 * 2**10, _number(int, 1, "a whole number of bytes >= 1"),
         "pycoll.overlap: bytes: iPart splits larger parameters into row runs of at most this "
         "size (one row at least), the units its partitions are made of"),
    Knob("ipart_profile_steps", 3, _number(int, 1, "a whole number of steps >= 1"),
         "pycoll.overlap: steps iPart profiles under one partition, then as many under "
         "layerwise (each after one to settle), before it plans"),
    Knob("ipart_replan_every", 50, _number(int, 0, "a whole number of steps >= 0"),
         "pycoll.overlap: iPart checks for drift of the step time this often (0: never)"),
    Knob("ipart_drift", 0.25, _number(float, 0, "a positive, finite fraction", above=True),
         "pycoll.overlap: iPart profiles and plans again when the mean step time moves this "
         "fraction away from the one after planning"),
    Knob("partial_direct_bytes", 65536, _number(int, 0, "a whole number of bytes >= 0"),
         "partial_allreduce: tensors up to this size go to every member at once (one latency) "
         "instead of around the ring"),
    Knob("partial_doubling_from", 4, _number(int, 2, "a whole number of ranks >= 2"),
         "partial_allreduce: groups of this many ranks or more exchange tensors up to "
         "PYCOLL_PARTIAL_DIRECT_BYTES by recursive doubling (log2 of the group's steps, one "
         "partner each) rather than all to all"),
)}

_overrides: dict = {}
_from_environment: dict = {}     # parsed once: get() sits on every collective's path
_watchers: list = []             # called after every change: they cache what they read


def watch(callback: Callable[[], None]) -> None:
    """Call ``callback`` now and after every change of the settings (``configure``,
    ``reload``, ``overriding``): for whoever keeps settings where ``get`` is too slow to
    call (the compiled short path)."""
    _watchers.append(callback)
    callback()


def _changed() -> None:
    for callback in _watchers:
        callback()


def configure(**kwargs) -> None:
    """Override knobs for this process (what ``pycoll.init(**kwargs)`` calls); on a bad
    value nothing changes."""
    _set(kwargs)
    reload()


@contextmanager
def overriding(**kwargs):
    """Override knobs inside a ``with`` block, then restore them (tests, benchmarks)."""
    saved = dict(_overrides)
    try:
        _set(kwargs)
        _changed()
        yield
    finally:
        _overrides.clear()
        _overrides.update(saved)
        _changed()


def _set(kwargs: dict) -> None:
    """All of ``kwargs`` into the overrides, or none of them (a ValueError or TypeError)."""
    parsed = {}
    for name, value in kwargs.items():
        if name not in KNOBS:
            raise TypeError(f"unknown pycoll option {name!r}; known: {', '.join(KNOBS)}")
        knob = KNOBS[name]
        try:
            # Text and numbers go through the knob's parser, which checks the range.
            parsed[name] = knob.parse(value) if isinstance(value, (str, int, float)) else value
        except ValueError as err:
            raise ValueError(f"pycoll option {name}={value!r}: {err}") from None
    _overrides.update(parsed)


def reload() -> None:
    """Read the PYCOLL_* variables again (they are read once, at first use)."""
    _from_environment.clear()
    _changed()


def get(name: str) -> Any:
    """The value of knob ``name``: override, then environment, then default."""
    if name in _overrides:
        return _overrides[name]
    if name not in _from_environment:
        knob = KNOBS[name]
        variable = next((v for v in (knob.env, knob.horovod) if v and v in os.environ), None)
        text = os.environ.get(variable) if variable else None
        try:
            _from_environment[name] = knob.default if text is None else knob.parse(text)
        except ValueError as err:
            raise ValueError(f"{variable}={text!r}: {err}") from None
    return _from_environment[name]
