"""The messages between workers and servers (one place for tags and layouts).

A request is a pickled header ``(op, request_id, keys, extra)`` on ``REQUEST``; INIT and
PUSH are followed by their payload on ``PAYLOAD`` (the server's ranges of the keys,
back to back in key order), cut into the ``pieces`` both sides compute from the key
sizes. Messages from one sender on one tag arrive in order, so a payload always follows
its header. Every reply is a ``META`` int64 vector on the request's own tags, then, if
``META[NBYTES]`` > 0, a raw message of that many bytes: parameters on the DATA tag (the
worker posts that receive with the request, straight into the pull's tensors),
statistics as JSON or an error text on the TEXT tag.
"""
import time
from typing import List, Sequence, Tuple

import numpy as np

REQUEST, PAYLOAD = 1, 2
INIT, PUSH, PULL, STATS, CHECKPOINT, DONE = "init", "push", "pull", "stats", "checkpoint", "done"
OK, RETRY, ERROR = 0, 1, 2
STATUS, CLOCK, MIN_CLOCK, NBYTES, LAGGARD = range(5)
META_LEN = 5
_TAG_BASE, _TAG_SPAN = 16, 1 << 24
# Payload pieces: the server adds each piece into its parameters while the piece is still
# in cache, instead of landing the whole payload in memory and reading it back (a third
# less memory traffic for big pushes); 1 MiB keeps the per-message cost negligible.
PIECE = 1 << 20


def nap(quiet_s: float, shortest: float, longest: float) -> None:
    """How both sides wait for MPI without burning a core (a blocking MPI call spins):
    sleep a fraction of the quiet spell so far, so an answer that ends it is late by
    about 1/8 of the spell at most, and a long-idle rank wakes only 1/longest a second."""
    time.sleep(min(longest, max(shortest, quiet_s / 8)))


def reply_tags(request_id: int):
    """(meta, data, text) tags of a request: distinct for any 16M requests in flight."""
    base = _TAG_BASE + 3 * (request_id % _TAG_SPAN)
    return base, base + 1, base + 2


def meta(status=OK, clock=0, min_clock=0, nbytes=0, laggard=-1) -> np.ndarray:
    return np.array([status, clock, min_clock, nbytes, laggard], np.int64)


def pieces(nbytes: Sequence[int], itemsizes: Sequence[int],
           limit: int = PIECE) -> List[List[Tuple[int, int, int]]]:
    """How a payload of keys (``nbytes[i]`` bytes of ``itemsizes[i]``-byte elements each,
    back to back) is cut into messages: each message is a list of ``(key index, first
    byte, end byte)`` within that key, at most ``limit`` bytes in all. Small keys share
    a message, big ones are cut, never inside an element."""
    messages, current, used = [], [], 0
    for key, (n, size) in enumerate(zip(nbytes, itemsizes)):
        lo = 0
        while lo < n:
            take = min(n - lo, (limit - used) // size * size)
            if take == 0:                      # no room for one more element: next message
                messages.append(current)
                current, used = [], 0
                continue
            current.append((key, lo, lo + take))
            used += take
            lo += take
    if current:
        messages.append(current)
    return messages


def bounds(messages: List[List[Tuple[int, int, int]]]) -> List[Tuple[int, int]]:
    """The (first, end) bytes of each of ``pieces``' messages within the payload."""
    out, offset = [], 0
    for segments in messages:
        end = offset + sum(hi - lo for _, lo, hi in segments)
        out.append((offset, end))
        offset = end
    return out
