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
from typing import Optional

import numpy as np

from . import config
from .work import CollectiveTimeout, wait_requests

log = logging.getLogger("pycoll")

_GO, _MISMATCH, _TIMEOUT = 0, 1, 2
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
        size = self.side.Get_size()
        self._prints = np.empty((size, 2), np.uint64)
        self._verdict = np.empty(size + 1, np.int64)     # code, then missing side ranks

    def free(self) -> None:
        self.side.Free()

    def agree(self, kind: str, name: str, timeout: Optional[float] = None, **details) -> None:
        """Return when every rank of the group submitted the same within ``timeout`` s
        (default PYCOLL_TIMEOUT); raise otherwise."""
        seq, self.seq = self.seq, self.seq + 1
        size = self.side.Get_size()
        if size == 1:
            return
        text = f"{kind} #{seq} '{name}' " + " ".join(f"{k}={v}" for k, v in details.items())
        digest = np.frombuffer(hashlib.blake2b(text.encode(), digest_size=16).digest(), np.uint64)
        tag, limit = seq % _TAGS, "PYCOLL_TIMEOUT" if timeout is None else "its timeout"
        timeout = config.get("timeout") if timeout is None else timeout
        verdict = self._verdict
        if self.side.Get_rank() == 0:
            self._prints[0] = digest
            requests = [self.side.Irecv(self._prints[r], source=r, tag=tag) for r in range(1, size)]
            missing = wait_requests(requests, timeout, (config.get("stall_warning_s"), lambda pending:
                            log.warning("pycoll: %s has waited %g s for ranks %s", text,
                                        config.get("stall_warning_s"),
                                        [self.ranks[i + 1] for i in pending])))
            verdict[:] = -1
            verdict[0] = _TIMEOUT if missing else (
                _MISMATCH if (self._prints != digest).any() else _GO)
            verdict[1:1 + len(missing)] = [i + 1 for i in missing]
            for i in missing:
                requests[i].Cancel()
            for r in range(1, size):
                if r - 1 not in missing:
                    self.side.Send(verdict, dest=r, tag=tag)
        else:
            self.side.Send(digest, dest=0, tag=tag)
            if wait_requests([self.side.Irecv(verdict, source=0, tag=tag)], timeout + 2.0, None):
                raise CollectiveTimeout(
                    f"pycoll: {text} got no answer within {timeout:g} s from rank "
                    f"{self.ranks[0]}, which coordinates this group: it has died or is stuck "
                    "in another operation")
        if verdict[0] == _MISMATCH:
            texts = self.side.allgather(text[:_DISPLAY])      # everyone is here: safe
            lines = "\n".join(f"  rank {self.ranks[r]}: {t}" for r, t in enumerate(texts))
            raise CollectiveMismatch("pycoll: ranks submitted different collectives at the "
                                     f"same point:\n{lines}\nEvery rank must issue the same "
                                     "collectives, with the same dtypes and shapes, in the "
                                     "same order.")
        if verdict[0] == _TIMEOUT:
            missing = [self.ranks[r] for r in verdict[1:] if r >= 0]
            raise CollectiveTimeout(f"pycoll: {text}: ranks {missing} did not join within "
                                    f"{timeout:g} s ({limit}); they skipped this "
                                    "collective, are stuck elsewhere, or died")
