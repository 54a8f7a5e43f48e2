"""The engine: runs a process's collectives in order, fusing small allreduces.

As DDP's buckets do, consecutive fusable operations with the same key share a batch
until the batch would pass the fusion threshold, another kind of operation is issued,
or someone needs a result (``Work.wait``, ``is_completed``, a blocking call, ``flush``).
Every rank issuing the same program makes the same batches. With a cycle time
(PYCOLL_CYCLE_TIME_MS) a batch is also sent once it is that old, as Horovod's cycle
does; ranks then cut by their own clocks, so a batch's ``run`` may agree with the
other ranks to take only a prefix of its items, and the engine runs the rest next.
"""
import collections
import logging
import threading
import time
import weakref
from typing import Any, Callable, Hashable, List, Optional

import numpy as np

from . import _C, config, tensors, timeline
from .work import Latch, Work


def _read_settings() -> None:
    """PYCOLL_FUSION_THRESHOLD, kept here when it changes (``config.watch``): queueing an
    item reads it, and ``config.get`` costs a tenth of the rest."""
    global _fusion_threshold
    _fusion_threshold = config.get("fusion_threshold")


_fusion_threshold: int
config.watch(_read_settings)


class _Batch:
    """Operations that run as one: a thunk, or fusable items with one key."""

    def __init__(self, run: Callable, key: Hashable = None, among: Optional[tuple] = None):
        self.run, self.key = run, key
        self.among = among              # the world ranks it waits for, where not the group's
        self.done = Latch()             # one for all its Works: cheaper than one each
        self.items: List[Any] = []
        self.works: List[Work] = []
        self.nbytes = 0
        self.opened = time.monotonic()

    def split(self, count: int) -> "_Batch":
        """The items after the first ``count``, moved to a batch of their own."""
        rest = _Batch(self.run, self.key)     # fusable items wait for the group
        rest.items, rest.works = self.items[count:], self.works[count:]
        del self.items[count:], self.works[count:]
        for work in rest.works:
            work._done = rest.done          # set before self.done: see Work.wait
        return rest


class Engine:
    """Runs one communicator's collectives one at a time, in issue order (each group has
    its own engine, so collectives on different groups, issued from different threads,
    run side by side, as MPI and gloo allow).

    Ordering rule: operations run in the order in which they were issued in this
    process, whatever thread issued them; fused operations run together at the
    place of the first of them. MPI matches collectives by their order on each
    communicator, so every rank must issue them in the same order, as with MPI
    itself. A batch whose ranks agree on only a prefix runs the rest at once, ahead
    of everything issued after it. Batches run on one background thread; a blocking
    call made while nothing is pending runs in the caller's thread, saving a thread
    switch, and so do batches that a caller waits for while the engine's thread is
    idle. MPI and the compiled kernels release the GIL, so the caller keeps computing
    meanwhile.
    """

    def __init__(self, on_stuck: Callable[[str], None], members: frozenset = frozenset(),
                 gone: Callable[[Any, float], list] = lambda ranks, since: []):
        self._on_stuck = on_stuck
        self._members = members         # the world ranks of its group
        self._gone = gone               # gone(ranks, since): those of them waited for in vain
        # ``with self._lock`` is the C lock itself; the Condition's own __enter__ is a
        # Python call, and this lock is taken on every collective's path.
        self._lock = threading.RLock()
        self._cv = threading.Condition(self._lock)
        # Whoever holds its token runs the next operation: this engine's thread, or a caller
        # (a blocking call, or the compiled short path) when nothing is pending. A claim
        # costs no lock round trip. ``pending`` mirrors _ready and _open (_sync, under _lock).
        self.gate = _C.Gate(self._notify)
        self._flush = self.flush    # every queued item's Work holds it: made once, not each time
        _watched.add(self)
        _watchdog()
        self._ready: collections.deque = collections.deque()
        self._open: Optional[_Batch] = None       # fusable batch still taking items
        self._thread: Optional[threading.Thread] = None     # the engine's, once started
        self._runner: Optional[int] = None        # the thread running a batch now
        self._stopped = False
        self._fusion = {False: np.empty(0, np.uint8), True: np.empty(0, np.uint8)}   # by pinned

    # ------------------------------------------------------------ issuing
    def submit(self, thunk: Callable[[], Any], name: str, among: Optional[tuple] = None) -> Work:
        """Queue ``thunk``; its Work returns what it returns. ``among``: the world ranks it
        waits for, where not the group's (a partial all-reduce on the world's engine)."""
        batch = _Batch(lambda items: [thunk()], among=among)
        work = Work(name, self.flush, batch.done)
        batch.works.append(work)
        if timeline.on:
            timeline.issued(work)
        with self._lock:
            self._close_open()
            self._enqueue(batch)
        return work

    def submit_fusable(self, key: Hashable, nbytes: int, item: Any,
                       run: Callable[[list], list], name: str) -> Work:
        """Queue ``item``; items with equal ``key`` may run as one ``run(items)``,
        which returns one result for each item, or for a prefix of them: the engine
        then runs the rest as the next batch."""
        threshold = _fusion_threshold
        self._lock.acquire()        # not ``with``: its protocol costs as much again
        try:
            batch = self._open
            if batch is None or batch.key != key or batch.nbytes + nbytes > threshold:
                self._close_open()
                batch = self._open = _Batch(run, key)
                self._sync()                    # only a new or closed batch changes the count
                if config.get("cycle_time_ms"):
                    self._wake()                # to time the new batch's cycle
            work = Work(name, self._flush, batch.done)
            if timeline.on:
                timeline.issued(work)
            batch.items.append(item)
            batch.works.append(work)
            batch.nbytes += nbytes
            if batch.nbytes >= threshold:
                self._close_open()
        finally:
            self._lock.release()
        return work

    def run(self, thunk: Callable[[], Any], name: str, among: Optional[tuple] = None) -> Any:
        """Run ``thunk`` after everything issued before it; its result (``among``: as
        ``submit``'s)."""
        if threading.get_ident() == self._runner:
            return thunk()      # called back from a running batch: waiting would deadlock
        if not self.gate.claim(name, among):       # something issued earlier runs first
            return self.submit(thunk, name, among).wait()
        try:
            self._runner = threading.get_ident()
            return thunk() if not timeline.on else timeline.run(thunk, (), name)
        finally:
            self._runner = None
            self.gate.release()

    def running(self) -> Optional[str]:
        """The name of the operation running now, if any."""
        running = self.gate.running()
        return running[0] if running else None

    def _notify(self) -> None:
        """Wake the engine's thread for work queued while a caller held the token."""
        with self._lock:
            self._cv.notify_all()

    def _sync(self) -> None:
        """Tell the gate how many batches are pending (after _ready or _open changed)."""
        self.gate.pending = len(self._ready) + (self._open is not None)

    def flush(self, until: Optional[Latch] = None) -> None:
        """Send the open batch now (what asking for any of its results does). With
        ``until``, the event a caller is about to wait for: while the engine's thread is
        idle, run the queued batches in the caller's thread until it is set. The caller
        would only wait, and a CPU rank with no core to spare saves two thread switches
        (and a wait on a descheduled thread) per batch."""
        while True:
            with self._lock:
                self._close_open(wake=until is None)
                if until is None or until.is_set() or not self._ready or not self.gate.take():
                    if until is not None and self._ready:
                        self._wake()        # what this thread leaves, the engine's runs
                    return
                batch = self._ready.popleft()
                self._sync()
            self._run_batch(batch)

    def drain(self, timeout: float) -> bool:
        """Wait until nothing queued or running is left (at most ``timeout`` s); the open
        batch stays unsent, since other ranks may never issue its partners."""
        deadline = time.monotonic() + timeout
        with self._lock:
            # Polled: a caller's claim gives the token back without notifying.
            while self._ready or not self.gate.idle:
                if time.monotonic() > deadline:
                    return False
                self._cv.wait(0.01)
        return True

    def stop(self, timeout: float) -> bool:
        """``drain``, then end the engine's thread and wait until it has: a thread still
        running at interpreter exit dies as it frees its last tensors. False if something
        still ran at the deadline (the thread may then be inside MPI)."""
        if not self.drain(timeout):
            return False
        with self._lock:
            self._stopped = True
            self._cv.notify_all()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout)
        return True

    def fusion_buffer(self, nbytes: int, device: Optional[int] = None) -> np.ndarray:
        """The one reusable staging buffer, at least ``nbytes`` long (it grows to the
        largest piece asked for: PYCOLL_CHUNK_BYTES at most). Batches run one at a time,
        so they share it. With ``device``: the page-locked one that batches of that GPU
        stage through (two pieces long), allocated with the first of them."""
        pinned = device is not None
        if self._fusion[pinned].nbytes < nbytes:
            self._fusion[pinned] = (tensors.pinned_empty(nbytes, device) if pinned
                                    else np.empty(nbytes, np.uint8))
        return self._fusion[pinned][:nbytes]

    # ------------------------------------------------------------ internals
    def _close_open(self, wake: bool = True) -> None:
        if self._open is not None:
            batch, self._open = self._open, None
            self._enqueue(batch, wake)

    def _enqueue(self, batch: _Batch, wake: bool = True) -> None:
        self._ready.append(batch)
        self._sync()
        if wake:
            self._wake()

    def _wake(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="pycoll-engine", daemon=True)
            self._thread.start()
        self._cv.notify_all()

    def _close_if_cycle_over(self) -> Optional[float]:
        """Close the open batch if it has waited PYCOLL_CYCLE_TIME_MS; else the seconds
        it has left (None: no cycle, or no open batch)."""
        cycle = config.get("cycle_time_ms") / 1e3
        if not cycle or self._open is None:
            return None
        left = self._open.opened + cycle - time.monotonic()
        if left > 0:
            return left
        self._close_open()
        return None

    def _overdue(self, warned: dict) -> None:
        """Warn of an operation running past PYCOLL_STALL_WARNING_S; end the job past
        PYCOLL_TIMEOUT, or at once if a rank it waits for has left pycoll (``warned``: what
        was warned of, by engine)."""
        running = self.gate.running()
        if running is None:
            return
        name, start, among = running
        waited = time.monotonic() - start
        gone = self._gone(self._members if among is None else among, start)
        if gone:
            _watched.discard(self)
            self._on_stuck(f"pycoll: {name} waits for {gone_ranks(gone)}; ending the job "
                           "(PYCOLL_ABORT_ON_ERROR=0 waits PYCOLL_TIMEOUT instead).")
            return
        if waited > config.get("stall_warning_s") and warned.get(self) != running:
            warned[self] = running
            logging.getLogger("pycoll").warning(
                "pycoll: %s has run for %.0f s; a rank may have skipped it or died "
                "(PYCOLL_CHECK=1 names the ranks)", name, waited)
        if waited > config.get("timeout") + 5.0:
            _watched.discard(self)
            self._on_stuck(f"pycoll: {name} has not completed after {waited:.0f} s "
                           "(PYCOLL_TIMEOUT); a rank skipped it, is stuck elsewhere or "
                           "died. Ending the job; rerun with PYCOLL_CHECK=1 to name the "
                           "ranks.")

    def _loop(self) -> None:
        while True:
            with self._lock:
                while True:
                    if self._stopped:
                        return
                    left = self._close_if_cycle_over()
                    if self._ready and self.gate.take():
                        break
                    self._cv.wait(left)
                batch = self._ready.popleft()
                self._sync()
            self._run_batch(batch)

    def _run_batch(self, batch: _Batch) -> None:
        """Run ``batch``, which the caller took off the queue with the idle token."""
        self.gate.running_as(batch.works[0].name, batch.among)
        self._runner = threading.get_ident()
        try:
            results = (batch.run(batch.items) if not timeline.on else
                       timeline.run(batch.run, (batch.items,), batch.works[0].name, batch.works))
            if len(results) < len(batch.items):     # the ranks agreed on a prefix
                rest = batch.split(len(results))
                with self._lock:
                    self._ready.appendleft(rest)
                    self._sync()
            for work, result in zip(batch.works, results):
                work._result = result           # batch.done, set below, signals them all
        except BaseException as error:      # delivered to whoever waits on the Works
            for work in batch.works:
                work.finish(error=error, signal=False)
        finally:
            self._runner = None
            batch.done.set()
            with self._lock:
                self.gate.release()
                self._cv.notify_all()


def gone_ranks(gone: list) -> str:
    """Words for ranks that left pycoll while others waited for them."""
    return (f"rank{'s' * (len(gone) > 1)} {', '.join(map(str, gone))}, which left pycoll "
            "without joining it (its script ended, or it called sys.exit or pycoll.shutdown)")


# The stall inspector of last resort, one thread for every engine: a blocking MPI call
# cannot time out, so a rank stuck in one past PYCOLL_TIMEOUT, or waiting for a rank that
# has left pycoll, ends the job with a message, not a hang.
_watched: "weakref.WeakSet[Engine]" = weakref.WeakSet()
_watching = threading.Lock()
_watcher: Optional[threading.Thread] = None


def _watchdog() -> None:
    global _watcher
    with _watching:
        if _watcher is None:
            _watcher = threading.Thread(target=_watch, name="pycoll-watchdog", daemon=True)
            _watcher.start()


def _watch() -> None:
    warned = weakref.WeakKeyDictionary()
    while True:
        time.sleep(1.0)
        for engine in list(_watched):
            engine._overdue(warned)
