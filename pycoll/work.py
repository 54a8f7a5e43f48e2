"""Work handles and the executor that runs a process's collectives in order."""
import collections
import threading
from typing import Any, Callable, Optional

from . import config


class CollectiveTimeout(TimeoutError):
    """A collective did not complete within the timeout."""


class Work:
    """The handle of an operation that may still be running.

    ``wait(timeout)`` returns its result or raises its error; ``is_completed()`` and
    ``exception()`` never block.
    """

    def __init__(self, name: str):
        self.name = name
        self._done = threading.Event()
        self._result: Any = None
        self._error: Optional[BaseException] = None

    def _finish(self, result: Any = None, error: Optional[BaseException] = None) -> None:
        self._result, self._error = result, error
        self._done.set()

    def is_completed(self) -> bool:
        return self._done.is_set()

    def exception(self) -> Optional[BaseException]:
        """The error the operation raised, None if it succeeded or is still running."""
        return self._error

    def wait(self, timeout: Optional[float] = None) -> Any:
        """Block until done (at most ``timeout`` s, default PYCOLL_TIMEOUT); the result."""
        timeout = config.get("timeout") if timeout is None else timeout
        if not self._done.wait(timeout):
            raise CollectiveTimeout(f"pycoll: {self.name} did not complete within {timeout:g} s; "
                                    "a rank may have skipped it or died (PYCOLL_TIMEOUT sets the limit)")
        if self._error is not None:
            raise self._error
        return self._result

    def result(self) -> Any:
        return self.wait()

    def __repr__(self) -> str:
        state = "failed" if self._error else "done" if self.is_completed() else "pending"
        return f"<pycoll.Work {self.name} {state}>"


class Executor:
    """Runs one process's collectives one at a time, in issue order.

    Ordering rule: operations run in the order in which ``submit``/``run`` were called
    in this process, whatever thread called them. MPI matches collectives by their
    order on each communicator, so every rank must issue them in the same order, as
    with MPI itself. Async operations run on one background thread; a blocking call
    made while nothing is queued runs in the caller's thread, saving a thread switch.
    MPI releases the GIL while it communicates, so the caller keeps computing.
    """

    def __init__(self):
        self._queue: collections.deque = collections.deque()
        self._busy = False
        self._cv = threading.Condition()
        self._thread: Optional[threading.Thread] = None

    def submit(self, fn: Callable[[], Any], name: str) -> Work:
        work = Work(name)
        with self._cv:
            self._queue.append((fn, work))
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name="pycoll-executor",
                                                daemon=True)
                self._thread.start()
            self._cv.notify_all()
        return work

    def run(self, fn: Callable[[], Any], name: str) -> Any:
        with self._cv:
            inline = not self._queue and not self._busy
            self._busy = self._busy or inline
        if not inline:
            return self.submit(fn, name).wait()
        try:
            return fn()
        finally:
            with self._cv:
                self._busy = False
                self._cv.notify_all()

    def _loop(self) -> None:
        while True:
            with self._cv:
                while not self._queue or self._busy:
                    self._cv.wait()
                fn, work = self._queue.popleft()
                self._busy = True
            try:
                work._finish(fn())
            except BaseException as error:      # delivered to whoever waits on the Work
                work._finish(error=error)
            finally:
                with self._cv:
                    self._busy = False
                    self._cv.notify_all()
