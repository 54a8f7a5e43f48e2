"""Agreement before communication: mismatch checks, stall warnings and timeouts.

With PYCOLL_CHECK=1, before each collective the ranks of its group agree on what
they are about to run. Every rank sends a fingerprint (operation, sequence number on
the group, dtype, shape, op, root, name) to the group's first rank, which waits for
all of them and answers with a verdict: go, mismatch (every rank raises
``CollectiveMismatch`` listing what each submitted), or timeout (the ranks that never
came are named in the ``CollectiveTimeout`` that every waiting rank raises). While
it waits past PYCOLL_STALL_WARNING_S it logs which ranks have not joined.

The exchange runs on a duplicate of the group's communicator, point to point and
polled with a growing sleep, so it can give up at a deadline (a blocking MPI call
cannot) and an idle wait costs no core.
"""
import hashlib
import logging
import time
from typing import Dict, List, Optional

from . import config
from .work import CollectiveTimeout

log = logging.getLogger("pycoll")

_GO, _MISMATCH, _TIMEOUT = "go", "mismatch", "timeout"
_TAGS = 32768            # tags cycle with the sequence number: old messages never match
_DISPLAY = 300           # characters of a fingerprint shown in errors


class CollectiveMismatch(ValueError):
    """Ranks submitted different collectives at the same point."""


class Checker:
    """Per-communicator state: the side channel and the sequence number."""

    def __init__(self, comm, ranks):
        self.side = comm.Dup()
        self.ranks = ranks          # world ranks, for messages
        self.seq = 0

    def free(self) -> None:
        self.side.Free()

    def agree(self, kind: str, name: str, **details) -> None:
        """Return when every rank of the group submitted the same; raise otherwise."""
        seq, self.seq = self.seq, self.seq + 1
        if self.side.Get_size() == 1:
            return
        text = f"{kind} #{seq} '{name}' " + " ".join(f"{k}={v}" for k, v in details.items())
        mine = (hashlib.sha1(text.encode()).hexdigest(), text[:_DISPLAY])
        tag = seq % _TAGS
        timeout = config.get("timeout")
        if self.side.Get_rank() == 0:
            self._coordinate(mine, tag, text, timeout)
        else:
            self.side.isend(mine, dest=0, tag=tag)
            verdict = _poll([self.side.irecv(source=0, tag=tag)], timeout + 2.0, None)[0]
            if verdict is None:
                raise CollectiveTimeout(
                    f"pycoll: {text} got no answer within {timeout:g} s from rank "
                    f"{self.ranks[0]}, which coordinates this group: it has died or is stuck "
                    "in another operation")
            self._raise_for(verdict)

    def _coordinate(self, mine, tag, text, timeout) -> None:
        size = self.side.Get_size()
        requests = [self.side.irecv(source=r, tag=tag) for r in range(1, size)]
        warn_after = config.get("stall_warning_s")

        def warn(pending: List[int]) -> None:
            log.warning("pycoll: %s has waited %g s for ranks %s", text, warn_after,
                        [self.ranks[r] for r in pending])
        got = _poll(requests, timeout, (warn_after, warn))
        prints: Dict[int, tuple] = {0: mine}
        prints.update({r: fp for r, fp in zip(range(1, size), got) if fp is not None})
        missing = [r for r in range(size) if r not in prints]
        if missing:
            for request in requests:
                if not request.Test():
                    request.Cancel()
            verdict = (_TIMEOUT, text, [self.ranks[r] for r in missing], timeout)
        elif len({fp[0] for fp in prints.values()}) > 1:
            verdict = (_MISMATCH, {self.ranks[r]: fp[1] for r, fp in prints.items()})
        else:
            verdict = (_GO,)
        for r in range(1, size):
            if r not in missing:
                self.side.isend(verdict, dest=r, tag=tag)
        self._raise_for(verdict)

    @staticmethod
    def _raise_for(verdict) -> None:
        if verdict[0] == _MISMATCH:
            lines = "\n".join(f"  rank {r}: {fp}" for r, fp in sorted(verdict[1].items()))
            raise CollectiveMismatch("pycoll: ranks submitted different collectives at the "
                                     f"same point:\n{lines}\nEvery rank must issue the same "
                                     "collectives, with the same dtypes and shapes, in the "
                                     "same order.")
        if verdict[0] == _TIMEOUT:
            _, text, missing, timeout = verdict
            raise CollectiveTimeout(f"pycoll: {text}: ranks {missing} did not join within "
                                    f"{timeout:g} s (PYCOLL_TIMEOUT); they skipped this "
                                    "collective, are stuck elsewhere, or died")


def _poll(requests, timeout: float, stall) -> List[Optional[object]]:
    """Wait for pickled messages until ``timeout``; None for those that never came.
    ``stall`` = (seconds, callback(pending indices)) fires once, if given."""
    results: List[Optional[object]] = [None] * len(requests)
    pending = set(range(len(requests)))
    start = time.monotonic()
    sleep = 0.0
    while pending:
        for i in list(pending):
            done, message = requests[i].test()
            if done:
                results[i] = message
                pending.discard(i)
        if not pending:
            break
        waited = time.monotonic() - start
        if stall is not None and waited >= stall[0]:
            stall[1](sorted(i + 1 for i in pending))
            stall = None
        if waited >= timeout:
            break
        # Spin briefly (a healthy group answers within microseconds), then back off.
        sleep = 0.0 if waited < 1e-3 else min(max(sleep * 2, 1e-4), 0.01)
        time.sleep(sleep)
    return results
