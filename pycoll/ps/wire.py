"""The messages between workers and servers (one place for tags and layouts).

A request is a pickled header ``(op, request_id, keys, extra)`` on ``REQUEST``; INIT and
PUSH are followed by one raw payload on ``PAYLOAD`` (the server's ranges of the keys,
back to back in key order). Messages from one sender on one tag arrive in order, so a
payload always follows its header. Every reply is a ``META`` int64 vector on the
request's own tags, then, if ``META[NBYTES]`` > 0, a raw message of that many bytes:
parameters on the DATA tag (the worker posts that receive with the request, straight
into the pull's tensors), statistics as JSON or an error text on the TEXT tag.
"""
import numpy as np

REQUEST, PAYLOAD = 1, 2
INIT, PUSH, PULL, STATS, CHECKPOINT, DONE = "init", "push", "pull", "stats", "checkpoint", "done"
OK, RETRY, ERROR = 0, 1, 2
STATUS, CLOCK, MIN_CLOCK, NBYTES, LAGGARD = range(5)
META_LEN = 5
_TAG_BASE, _TAG_SPAN = 16, 1 << 24


def reply_tags(request_id: int):
    """(meta, data, text) tags of a request: distinct for any 16M requests in flight."""
    base = _TAG_BASE + 3 * (request_id % _TAG_SPAN)
    return base, base + 1, base + 2


def meta(status=OK, clock=0, min_clock=0, nbytes=0, laggard=-1) -> np.ndarray:
    return np.array([status, clock, min_clock, nbytes, laggard], np.int64)
