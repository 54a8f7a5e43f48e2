"""The handle of an operation that may still be running."""
import os
import threading
import time
from typing import Any, Callable, List, Optional, TypeVar

from . import _C, config

T = TypeVar("T")


class CollectiveTimeout(TimeoutError):
    """A collective did not complete within the timeout."""


class GroupBroken(RuntimeError):
    """An earlier operation on this group failed part-way: its messages may still arrive,
    so the group refuses further operations rather than take them for new ones."""


class Latch:
    """A one-shot ``threading.Event`` (``set``, ``is_set``, ``wait``; never cleared) made of
    one lock, held until it is set: an Event, a Condition with its lock, costs 2 us to
    make, as much as the rest of queueing an operation, and every batch makes one."""

    __slots__ = ("_lock", "_set")

    def __init__(self):
        self._set = False
        self._lock = threading.Lock()
        self._lock.acquire()

    def set(self) -> None:
        self._set = True
        try:
            self._lock.release()
        except RuntimeError:            # set already
            pass

    def is_set(self) -> bool:
        return self._set

    def wait(self, timeout: Optional[float] = None) -> bool:
        """Whether it is set, waiting at most ``timeout`` s (None: for as long as it takes)."""
        if self._set:
            return True
        if self._lock.acquire(timeout=-1 if timeout is None else max(timeout, 0.0)):
            try:                        # let the next waiter through
                self._lock.release()
            except RuntimeError:        # a second set() released it meanwhile
                pass
        return self._set


class Work:
    """The handle of an operation that may still be running.

    ``wait(timeout)`` returns its result or raises its error; ``is_completed()`` and
    ``exception()`` never block. Each of them first calls ``on_wait`` (the engine's
    flush: an operation whose result is asked for must be on its way); ``wait`` without
    a timeout passes it the event it is about to wait for, which the engine may set by
    running the operation in the waiting thread. ``_done`` may be shared with the Works
    that finish together, and replaced while unset when the engine moves this Work to a
    later batch.
    """

    __slots__ = ("name", "_on_wait", "_done", "_result", "_error", "__dict__")

    def __init__(self, name: str, on_wait: Optional[Callable[..., None]] = None,
                 done: Optional[Latch] = None):
        self.name = name
        self._on_wait = on_wait or (lambda until=None: None)
        self._done = done or Latch()     # shared by Works that finish together
        self._result: Any = None
        self._error: Optional[BaseException] = None

    def finish(self, result: Any = None, error: Optional[BaseException] = None,
               signal: bool = True) -> None:
        """Complete this Work with its result or error: called by whoever runs the
        operation (the engine, the PS worker's thread, the torch backend), once.
        ``signal=False`` records them for a shared ``_done`` set later."""
        self._result, self._error = result, error
        if signal:
            self._done.set()

    def is_completed(self) -> bool:
        self._on_wait()
        done = self._done
        return done.is_set() and done is self._done

    def exception(self) -> Optional[BaseException]:
        """The error the operation raised, None if it succeeded or is still running."""
        self._on_wait()
        return self._error

    def wait(self, timeout: Optional[float] = None) -> Any:
        """Block until done (at most ``timeout`` s, default PYCOLL_TIMEOUT); the result."""
        done = self._done
        if done.is_set() and done is self._done:    # the usual case after a fused batch
            if self._error is not None:
                raise self._error
            return self._result
        self._on_wait(done if timeout is None else None)    # a caller's deadline must hold
        timeout = config.get("timeout") if timeout is None else timeout
        deadline = time.monotonic() + timeout
        while True:
            done = self._done
            finished = done.wait(max(0.0, deadline - time.monotonic()))
            if done is self._done:      # else the engine moved this Work to a later batch
                break
        if not finished:
            raise CollectiveTimeout(f"pycoll: {self.name} did not complete within the timeout "
                                    f"of {timeout:g} s; a rank may have skipped it or died "
                                    "(PYCOLL_TIMEOUT sets the limit, or the torch group's timeout)")
        if self._error is not None:
            raise self._error
        return self._result

    def result(self) -> Any:
        return self.wait()

    def __repr__(self) -> str:
        state = "failed" if self._error else "done" if self._done.is_set() else "pending"
        return f"<pycoll.Work {self.name} {state}>"


def poll(test: Callable[[], Any], deadline: float, late: Callable[[], str],
         stall=None, spin: float = 0.0) -> Any:
    """The one wait with a deadline for what MPI cannot wait on with one: call ``test``
    until it returns something other than None and return that; past ``deadline``
    (``time.monotonic()``), raise ``CollectiveTimeout(late())``. ``stall`` = (seconds,
    callback()) fires once when the wait has lasted that long. The first ``spin`` seconds
    only yield the GIL (a peer that answers at once is not kept waiting for a sleep);
    then sleeps between tries grow to 1 ms: ranks may outnumber cores, and a spinning
    waiter would starve the ranks it waits for."""
    start, delay = time.monotonic(), 0.0
    while True:
        result = test()
        if result is not None:
            return result
        now = time.monotonic()
        if now > deadline:
            raise CollectiveTimeout(late())
        if stall is not None and now - start >= stall[0]:
            stall, fire = None, stall[1]
            fire()
        if delay:
            time.sleep(delay)
        else:
            os.sched_yield()    # releases the GIL; time.sleep(0) would nap (40-90 us here)
        if now - start >= spin:
            delay = min(max(2 * delay, 1e-5), 1e-3)


def wait_requests(requests, timeout: float, stall=None) -> List[int]:
    """Wait for MPI ``requests`` at most ``timeout`` s (``poll``'s sleeps); the indices of
    those still pending. ``stall`` = (seconds, callback(pending indices)) fires once."""
    pending = list(range(len(requests)))

    def test():
        pending[:] = [i for i in pending if not requests[i].Test()]
        return True if not pending else None
    try:
        poll(test, time.monotonic() + timeout, lambda: "",
             stall and (stall[0], lambda: stall[1](pending)))
    except CollectiveTimeout:
        return pending
    return []


_abandoned: list = []     # (request, buffers) left at their deadline: MPI may still write there


def wait_request(request, timeout: float, *buffers) -> bool:
    """Whether MPI completes ``request`` within ``timeout`` s: ``MPI_Test`` in C without the
    GIL (``_C.wait_request``), or ``wait_requests``'s polling where _C found no MPI. Past
    the deadline the request and the ``buffers`` it uses are kept: MPI completes it when
    the late ranks come, and may write there."""
    from mpi4py import MPI
    code = _C.wait_request(MPI._addressof(request), timeout)
    if code > 0:
        raise MPI.Exception(code)
    done = code == 0 or (code == -2 and not wait_requests([request], timeout))
    if not done:
        _abandoned.append((request, buffers))
    return done


def lazy(make: Callable[[], T]) -> Callable[[], T]:
    """A function returning ``make()``'s one result, made at the first call from
    whichever thread asks first (a process's singletons: made only when used)."""
    lock, made = threading.Lock(), []

    def get() -> T:
        if not made:
            with lock:
                if not made:
                    made.append(make())
        return made[0]
    return get


def _bind_mpi() -> str:
    from mpi4py import MPI
    return _C.mpi_bind(MPI.__file__, MPI._sizeof(MPI.Comm))


# "" once _C has found the functions of the MPI that mpi4py loaded (the compiled paths call
# them), else why not: bound at the first call, by whichever path needs it first.
mpi_from_c = lazy(_bind_mpi)
