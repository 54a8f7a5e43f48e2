"""The messages between workers and servers: one place for tags, headers and layouts.

A request is one binary message on ``REQUEST``: a fixed header (``HEADER``: magic,
protocol version, op, tag slot, request id, an int argument, the seconds a pull has
waited, key count, payload message count and bytes, two float arguments and the time
the worker sent it by its own clock), then one ``ENTRY`` per key range (dtype code, name
length, the key's element count, the range's first and end element), then the names
in UTF-8. Nothing is pickled: a server parses it with ``parse`` and checks every field
before it touches parameters. INIT, PUSH and PUSH_PULL are followed by their payload
(the server's ranges of the keys, back to back in key order) in the ``pieces`` both
sides compute from the key sizes, on the slot's payload tag. Every request is answered
on its slot's tags: a ``META`` int64 vector (status, clocks, bytes, the request id it
answers), then, if ``META[NBYTES]`` > 0, one raw message of that many bytes: parameters
on the data tag (the worker posts that receive with the request, straight into the
pull's tensors), statistics as JSON or an error text on the text tag. A request too
broken to name its slot is answered with a text on ``BAD``.

The arguments: CHECKPOINT's int is the BSP cut; a push's float is its weight (the server
multiplies the pushed values by it: 1 for a plain push); TURN (R²SP's gate, to server 0)
carries the samples of the worker's last iteration (int), the seconds it was busy and,
of those, the seconds it computed (the part that grows with the batch; floats), and is
answered, when it is the worker's turn, with JSON: the weight of
that push and the worker's next batch size (``r2sp``). A pull's and a push_pull's second
float is its priority: the server sends the answers with the smaller first (``server``).

Tags: a worker owns ``slots(tag_ub)`` slots of 4 tags each above ``TAG_BASE`` and gives
each request a free one, so tags never pass the communicator's ``MPI.TAG_UB`` however
many requests a job makes; a slot is reused only once its request is complete.

Versions: a push's int argument is the version (of that server's shard) of the
parameters its gradient was computed on, and ``META[SHARD_VERSION]`` of every answer is
the server's version (the updates applied to its shard), so a server knows the
staleness of every update.
"""
import collections
import math
import struct
import time
from typing import List, NamedTuple, Optional, Sequence, Tuple

import numpy as np

from .. import emulation, tensors

MAGIC, VERSION = b"PCPS", 3
REQUEST, BAD = 1, 2
TAG_BASE, TAGS_PER_SLOT = 16, 4
INIT, PUSH, PULL, PUSH_PULL, STATS, CHECKPOINT, DONE, TURN = range(1, 9)
OP_NAMES = {INIT: "init", PUSH: "push", PULL: "pull", PUSH_PULL: "push_pull",
            STATS: "stats", CHECKPOINT: "checkpoint", DONE: "done", TURN: "turn"}
WITH_PAYLOAD = (INIT, PUSH, PUSH_PULL)
OK, RETRY, ERROR = 0, 1, 2
STATUS, CLOCK, MIN_CLOCK, NBYTES, LAGGARD, REQUEST_ID, SHARD_VERSION = range(7)
META_LEN = 7
# magic, version, op, slot, request id, arg (int), waited (s), keys, payload messages, bytes,
# value (float), sent (the worker's time.monotonic()), value2 (float)
HEADER = struct.Struct("<4sHHIQqdIIQddd")
ENTRY = np.dtype([("dtype", "<u1"), ("name_len", "<u2"), ("count", "<i8"), ("lo", "<i8"),
                  ("hi", "<i8")])                       # packed: 27 bytes
DTYPES = tensors.DTYPES                                 # a dtype's code is its index
# Payload pieces (PYCOLL_CHUNK_BYTES, ``tensors.piece_bytes``): the server adds each piece
# into its parameters while the piece is still in cache, instead of landing the whole
# payload in memory and reading it back (a third less memory traffic for big pushes).
# Workers and servers must run with the same PYCOLL_CHUNK_BYTES: a server refuses a
# payload cut otherwise, naming both counts.


class BadRequest(Exception):
    """A request the server cannot act on; ``slot``/``request`` say where to answer
    (None: the header is too broken to tell, answer on ``BAD``)."""

    def __init__(self, text: str, slot: Optional[int] = None, request: int = 0):
        super().__init__(text)
        self.slot, self.request = slot, request


class Entry(NamedTuple):
    name: str
    dtype: str
    count: int          # the key's elements
    lo: int             # this range's first and end element
    hi: int

    @property
    def nbytes(self) -> int:
        return (self.hi - self.lo) * tensors.ITEMSIZE[self.dtype]


class Request(NamedTuple):
    op: int
    slot: int
    request: int
    arg: int
    waited: float
    entries: Tuple[Entry, ...]
    table: bytes         # the raw entries and names: a server caches what it validated
    npieces: int
    nbytes: int
    value: float         # a push's weight, a turn's busy seconds
    sent: float          # the worker's clock when it sent the request
    value2: float        # a turn's computing seconds (of its busy ones); a pull's priority


def encode_table(entries: Sequence[Entry]) -> bytes:
    """The entries and names of a header (workers cache it per key set)."""
    names = [e.name.encode() for e in entries]
    table = np.zeros(len(entries), ENTRY)
    for row, (e, name) in zip(table, zip(entries, names)):
        row["dtype"], row["name_len"] = DTYPES.index(e.dtype), len(name)
        row["count"], row["lo"], row["hi"] = e.count, e.lo, e.hi
    return table.tobytes() + b"".join(names)


def encode(op: int, slot: int, request: int, table: bytes = b"", nkeys: int = 0,
           arg: int = 0, waited: float = 0.0, npieces: int = 0, nbytes: int = 0,
           value: float = 1.0, sent: float = 0.0, value2: float = 0.0) -> bytes:
    return HEADER.pack(MAGIC, VERSION, op, slot, request, arg, waited, nkeys, npieces,
                       nbytes, value, sent, value2) + table


def parse(raw, tag_ub: int) -> Request:
    """Check and decode a request; ``BadRequest`` says what is wrong."""
    raw = bytes(raw)
    if len(raw) < HEADER.size:
        raise BadRequest(f"request of {len(raw)} bytes is shorter than the {HEADER.size}-byte "
                         "header (truncated or not a pycoll.ps request)")
    magic, version, op, slot, request, arg, waited, nkeys, npieces, nbytes, value, sent, \
        value2 = HEADER.unpack_from(raw)
    if magic != MAGIC:
        raise BadRequest(f"request starts with {magic!r}, not {MAGIC!r}: not a pycoll.ps request")
    if version != VERSION:
        raise BadRequest(f"request has protocol version {version}; this server speaks "
                         f"{VERSION} (mixed pycoll versions?)")
    if slot >= slots(tag_ub):
        raise BadRequest(f"request names tag slot {slot}; tags end at {tag_ub} "
                         f"({slots(tag_ub)} slots)")
    if op not in OP_NAMES:
        raise BadRequest(f"unknown op {op} (known: {OP_NAMES})", slot, request)
    if op in (PUSH, PUSH_PULL) and not 0 < value < math.inf:
        raise BadRequest(f"{OP_NAMES[op]} request {request} has weight {value}; a push's "
                         "weight must be positive and finite", slot, request)
    table = raw[HEADER.size:]
    if nkeys * ENTRY.itemsize > len(table):
        raise BadRequest(f"{OP_NAMES[op]} request {request} declares {nkeys} keys but carries "
                         f"{len(table)} bytes for them (truncated)", slot, request)
    rows = np.frombuffer(table, ENTRY, nkeys)
    names, offset = table[nkeys * ENTRY.itemsize:], 0
    if len(names) != int(rows["name_len"].sum()):
        raise BadRequest(f"{OP_NAMES[op]} request {request}: the key names take {len(names)} "
                         f"bytes, the entries say {int(rows['name_len'].sum())} (truncated?)",
                         slot, request)
    entries = []
    for row in rows.tolist():
        code, length, count, lo, hi = row
        try:
            name = names[offset:offset + length].decode()
        except UnicodeDecodeError:
            raise BadRequest(f"{OP_NAMES[op]} request {request}: a key name is not UTF-8",
                             slot, request) from None
        offset += length
        if code >= len(DTYPES) or not 0 <= lo <= hi <= count:
            raise BadRequest(f"{OP_NAMES[op]} request {request}: key {name!r} has dtype code "
                             f"{code}, range [{lo}:{hi}] of {count}: invalid", slot, request)
        entries.append(Entry(name, DTYPES[code], count, lo, hi))
    return Request(op, slot, request, arg, waited, tuple(entries), table, npieces, nbytes,
                   value, sent, value2)


# ---------------------------------------------------------------- tags
def slots(tag_ub: int) -> int:
    """How many requests may be in flight at once under ``tag_ub``."""
    return max(0, (tag_ub - TAG_BASE + 1) // TAGS_PER_SLOT)


def tags(slot: int):
    """(meta, data, text, payload) tags of a slot."""
    base = TAG_BASE + TAGS_PER_SLOT * slot
    return base, base + 1, base + 2, base + 3


class Slots:
    """A worker's tag slots: a slot is reused once its request is complete (most recently
    freed last), and a new one is opened only when none is free, so the tags in use stay
    few and low. ``lose`` retires a slot whose request was abandoned: a late answer could
    still arrive on its tags."""

    def __init__(self, tag_ub: int):
        self.count = slots(tag_ub)
        if self.count < 1:
            raise ValueError(f"pycoll.ps: tag_ub={tag_ub} leaves no tag slot; it must be at "
                             f"least {TAG_BASE + TAGS_PER_SLOT - 1}")
        self.opened = 0                       # slots 0 .. opened-1 have been handed out
        self.free: collections.deque = collections.deque()
        self.lost = 0

    def available(self) -> bool:
        return bool(self.free) or self.opened < self.count

    def take(self) -> int:
        if self.free:
            return self.free.popleft()
        self.opened += 1
        return self.opened - 1

    def give(self, slot: int) -> None:
        self.free.append(slot)

    def lose(self, slot: int) -> None:
        self.lost += 1


def meta(status=OK, clock=0, min_clock=0, nbytes=0, laggard=-1, request=0,
         version=0) -> np.ndarray:
    return np.array([status, clock, min_clock, nbytes, laggard, request, version], np.int64)


def nap(quiet_s: float, shortest: float, longest: float, share: float = 1 / 8) -> None:
    """How both sides wait for MPI without burning a core (a blocking MPI call spins):
    sleep ``share`` of the quiet spell so far, so an answer that ends it is late by about
    that share of the spell at most, and a long-idle rank wakes only 1/longest a second.
    Under --link the nap ends when the emulation releases a paced request."""
    emulation.nap(min(longest, max(shortest, quiet_s * share)))


def pieces(nbytes: Sequence[int], itemsizes: Sequence[int],
           limit: Optional[int] = None) -> List[List[Tuple[int, int, int]]]:
    """How a payload of keys (``nbytes[i]`` bytes of ``itemsizes[i]``-byte elements each,
    back to back) is cut into messages: each message is a list of ``(key index, first
    byte, end byte)`` within that key, at most ``limit`` bytes in all (PYCOLL_CHUNK_BYTES
    unless given). Small keys share a message, big ones are cut, never inside an element."""
    limit = tensors.piece_bytes(max(itemsizes, default=1), limit)    # room for any element
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


_LEFT: list = []    # sends a timed-out exchange left in flight, with their buffers
EXCHANGE = 1        # the tag of ``exchange`` on the workers' or the servers' own communicator


def exchange(comm, data: bytes, what: str, who: str, timeout: float) -> List[bytes]:
    """Every rank's ``data``: an allgather of byte strings by point-to-point messages,
    polled until ``timeout``, so a rank that never joins is named (as ``who`` N) instead
    of hanging everyone; nothing is pickled. Also the barrier of ``pycoll.ps``."""
    from mpi4py import MPI
    from ..work import wait_requests
    from ..work import CollectiveTimeout
    mine = np.frombuffer(data, np.uint8)
    sends = [comm.Isend([mine, MPI.BYTE], r, EXCHANGE) for r in range(comm.size)
             if r != comm.rank]
    got, status, start = {comm.rank: bytes(data)}, MPI.Status(), time.monotonic()
    while len(got) < comm.size:
        for r in range(comm.size):
            message = None if r in got else comm.improbe(r, EXCHANGE, status)
            if message is not None:
                buf = np.empty(status.Get_count(MPI.BYTE), np.uint8)
                message.Recv([buf, MPI.BYTE])
                got[r] = buf.tobytes()
        waited = time.monotonic() - start
        if len(got) < comm.size and waited > timeout:
            _LEFT.append((sends, mine))      # MPI may still read ``mine``: keep it
            missing = [r for r in range(comm.size) if r not in got]
            raise CollectiveTimeout(f"pycoll.ps: {what}: {who}(s) {missing} did not join within "
                                    f"{timeout:g} s; they may have died or hung (PYCOLL_TIMEOUT "
                                    "sets the limit)")
        if len(got) < comm.size:
            nap(waited, 20e-6, 1e-2)
    if wait_requests(sends, timeout, None):
        _LEFT.append((sends, mine))
        raise CollectiveTimeout(f"pycoll.ps: {what}: a {who} did not take this rank's message "
                                f"within {timeout:g} s")
    return [got[r] for r in range(comm.size)]
