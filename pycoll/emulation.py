"""Cluster emulation on one machine: links with latency and bandwidth (``--link``).

    pycollrun -np 4 --link 50us,1.25GB/s python train.py       # or PYCOLL_LINK, init(link=)
    pycollrun -np 4 --link 50us,1.25GB/s,3:1ms,125MB/s ...     # rank 3 has a slower NIC

Here MPI moves bytes through shared memory at memory speed. With a link set, every
transfer pycoll makes takes at least the time the alpha-beta model gives it: the real
transfer runs first, then the caller sleeps (no CPU burned) until the modelled time has
passed, so overlap of communication with compute shows as it would on a network.

- Collectives cost the standard alpha-beta time of their algorithm (``collective_time``),
  paced by the group's slowest link. Each member writes its entry (time, link, bytes) to
  a shared-memory file before the real collective and reads the others' after it, so
  every member computes the same start (the latest entry) and cost and they leave
  together. A member's entry is when it called the collective (the general path stamps
  it with ``called``/``timed``, the compiled paths' ``Paced`` in C), so pycoll's own
  work before the MPI calls runs under the modelled time as the real transfer does.
  Entering and leaving are compiled (csrc/pacing.cpp), and the C short path paces its
  collectives without Python but for ``group``'s lookup, so a small collective costs its
  model plus a wake-up.
- Point-to-point messages (partial all-reduce's ring, the parameter server, torch
  send/recv, AD-PSGD) cost ``alpha + bytes/beta``, and each rank's NIC is a FIFO resource
  for egress and one for ingress. A sender puts a message on its egress when it posts
  it; the receiver takes messages into its ingress in the order it takes them, each no
  earlier than its sender put it on the wire, so N senders into one receiver share its
  bandwidth (incast). A receive completes ``alpha`` after its last byte is in; a send
  when the receiver has taken its last byte (as MPI's rendezvous protocol, and the
  standard mode's rules, allow), so incast holds senders back too. A communicator gets
  this by ``p2p(comm)``: a subclass whose sends and receives hold their requests (MPI
  generalized requests) until the modelled times. Ranks tell each other about messages
  through one FIFO per rank in /dev/shm: a SENT record before the real message, a TAKEN
  record back. The emulation thread books and matches in Python; it completes the held
  requests at their times in C, without the GIL (csrc/link.cpp).

Without a link none of this runs: ``p2p`` returns the communicator itself and the
collectives' hooks read one knob.

``count_core_waits`` and ``core_wait_after`` tell a benchmark how long the ranks waited
for a core after their modelled deadlines: time this machine's oversubscription adds
that a cluster, a core per rank, would not (``bench/emulation.py``'s cluster column).
"""
import atexit
import collections
import errno
import functools
import hashlib
import heapq
import itertools
import logging
import math
import numbers
import os
import re
import shutil
import struct
import tempfile
import threading
import time
from typing import Dict, Optional, Tuple

import numpy as np

from . import _C, config, timeline
from .work import CollectiveTimeout, lazy, mpi_from_c, wait_request

log = logging.getLogger("pycoll")

# ---------------------------------------------------------------- parsing

_LATENCY = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "ms": 1e-3, "s": 1.0}
_PREFIX = {"": 1.0, "k": 1e3, "K": 1e3, "M": 1e6, "G": 1e9, "T": 1e12,
           "Ki": 2.0 ** 10, "Mi": 2.0 ** 20, "Gi": 2.0 ** 30, "Ti": 2.0 ** 40}
_QUANTITY = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?)\s*(\S*)\s*$")


def parse_latency(text: str) -> float:
    """``"50us"`` -> 5e-05 seconds (ns, us, ms, s; a bare 0 is allowed)."""
    match = _QUANTITY.match(str(text))
    if match and match.group(2) in _LATENCY:
        return float(match.group(1)) * _LATENCY[match.group(2)]
    if match and not match.group(2) and float(match.group(1)) == 0:
        return 0.0
    raise ValueError(f"latency {text!r} is not a time like 50us, 1.5ms or 0")


def parse_bandwidth(text: str) -> float:
    """``"1.25GB/s"`` -> 1.25e9 bytes/s. B is bytes, b or bit is bits; K, M, G, T are
    powers of 1000, Ki, Mi, Gi of 1024: ``10Gb/s`` = ``10Gbit/s`` = ``1.25GB/s``."""
    match = _QUANTITY.match(str(text))
    unit = match.group(2) if match else ""
    for suffix, per in (("B/s", 1.0), ("bit/s", 0.125), ("b/s", 0.125), ("bps", 0.125)):
        if unit.endswith(suffix) and unit[:-len(suffix)] in _PREFIX:
            value = float(match.group(1)) * _PREFIX[unit[:-len(suffix)]] * per
            if value > 0:
                return value
    raise ValueError(f"bandwidth {text!r} is not a positive rate like 1.25GB/s, 10Gb/s "
                     "or 100MiB/s")


class Links(dict):
    """The parsed ``link`` knob: ``{rank: (latency s, bandwidth B/s)}`` for the ranks given
    their own link, and ``default`` for the others (None: an ideal link, no cost)."""

    def __init__(self, default: Optional[Tuple[float, float]] = None, ranks=()):
        super().__init__(ranks)
        self.default = default

    def of(self, rank: int) -> Tuple[float, float]:
        """(latency, bandwidth) of ``rank``'s link."""
        return self.get(rank, self.default or (0.0, math.inf))

    def __bool__(self) -> bool:          # a link of rank 3 alone still emulates
        return self.default is not None or len(self) > 0

    def __eq__(self, other) -> bool:
        return (isinstance(other, Links) and dict.__eq__(self, other)
                and self.default == other.default)

    __hash__ = None

    def __repr__(self) -> str:
        def one(link):
            return f"{link[0] * 1e6:g}us,{link[1] / 1e6:g}MB/s"
        parts = ([one(self.default)] if self.default else []) + [
            f"{rank}:{one(link)}" for rank, link in sorted(self.items())]
        return f"Links({','.join(parts)!r})"


def parse_link(text) -> Optional[Links]:
    """``"50us,1.25GB/s"`` -> every rank's link; ``"3:1ms,125MB/s"`` -> rank 3's; several
    entries comma-separated, e.g. ``"50us,1.25GB/s,3:1ms,125MB/s"``. ``""``, ``"0"``,
    ``"off"`` or ``"none"``: no emulation (None)."""
    if isinstance(text, Links):
        return text
    if isinstance(text, (tuple, list)) and len(text) == 2 and not isinstance(text[0], str):
        return Links((float(text[0]), float(text[1])))     # init(link=(50e-6, 1.25e9))
    text = str(text).strip()
    if text.lower() in ("", "0", "off", "none", "no"):
        return None
    tokens = [token.strip() for token in text.split(",")]
    if len(tokens) % 2 or not all(tokens):
        raise ValueError(f"link {text!r} is not [RANK:]LATENCY,BANDWIDTH[,...], "
                         "e.g. 50us,1.25GB/s or 50us,1.25GB/s,3:1ms,125MB/s")
    links = Links()
    for latency, bandwidth in zip(tokens[::2], tokens[1::2]):
        rank, sep, latency = latency.rpartition(":")
        link = (parse_latency(latency), parse_bandwidth(bandwidth))
        if not sep:
            if links.default is not None:
                raise ValueError(f"link {text!r}: two entries without a rank; name the "
                                 "rank of the second, e.g. 3:1ms,125MB/s")
            links.default = link
            continue
        try:
            rank = int(rank)
        except ValueError:
            rank = -1
        if rank < 0:
            raise ValueError(f"link {text!r}: {rank!r} is not a rank; per-rank entries are "
                             "RANK:LATENCY,BANDWIDTH, e.g. 3:1ms,125MB/s")
        links[rank] = link
    return links


# ---------------------------------------------------------------- the model

def transfer_time(nbytes: float, latency: float, bandwidth: float) -> float:
    """One point-to-point message on an idle link: alpha + bytes / beta."""
    return latency + nbytes / bandwidth


def collective_time(kind: str, n: int, nbytes: float, latency: float, bandwidth: float) -> float:
    """The alpha-beta cost of collective ``kind`` over ``n`` ranks. ``nbytes``: the
    tensor of an allreduce or broadcast, the full result of an allgather, the full input
    of a reduce-scatter, the most one rank sends in an alltoall.

    ring allreduce 2(n-1)(alpha + B/(n beta)); allgather, reduce-scatter and pairwise
    alltoall (n-1)(alpha + B/(n beta)); binomial-tree broadcast ceil(log2 n)(alpha + B/beta);
    barrier ceil(log2 n) alpha; direct exchange (every member sends its B bytes to every
    other at once: the partial all-reduce of small tensors) alpha + (n-1)B/beta. Computed
    in C (csrc/pacing.cpp), where the paced collectives use it."""
    return _C.collective_time(kind, n, nbytes, latency, bandwidth)


# ---------------------------------------------------------------- waiting

# Sleeping to a deadline, and counting the waits for a core after it, are compiled
# (csrc/clock.cpp): the collectives' pacing runs them without Python, and so does this.
sleep_until = _C.sleep_until


def nap(seconds: float) -> None:
    """A poller's sleep between tests of MPI requests: under a link it ends early when
    the emulation thread releases held requests (every napper of the process wakes; a
    release while the poller tested ends its next nap at once), so the poller sees a
    completion at once instead of up to ``seconds`` later (the parameter server naps up
    to 1 ms: every paced transfer ran that much over). Either way with the 1 ns timer
    slack (the default 50 us made every nap that much longer)."""
    _C.precise_timers()
    if not config.get("link"):
        time.sleep(seconds)
        return
    _C.link_nap(seconds)


# ---------------------------------------------------------------- core waits


def count_core_waits() -> None:
    """From now on, count this process's waits for a core after modelled deadlines
    (``core_wait_after``): the time this machine's oversubscription adds that a cluster,
    a core per rank, would not (``bench/emulation.py``'s cluster column). A benchmark's
    switch; it costs about 1 us a wait (procfs reads around it: 0.4-0.9 us measured on the
    VM and the 16-core machine, 2026-11-28).

    Linux counts, per thread, the time it was runnable without a core (schedstat's run
    delay). A thread asleep to a deadline is not runnable; the run delay it gains from
    just before its sleep until it is back on a core is its wait for one, so the part
    after the deadline is min(that, back - deadline) (csrc/clock.cpp). ``sleep_until``,
    the emulation thread's sleep to a due release and a poller's nap ended by that
    release (``nap``) count toward their deadlines."""
    _C.count_core_waits(True)


def core_wait_after(since: float) -> float:
    """Seconds this process's threads waited for a core after the latest modelled
    deadline since ``since`` (time.monotonic()), up to now; 0 without one."""
    return _C.core_wait_after(since)


# ---------------------------------------------------------------- collectives

# Each rank's entries into its latest collectives lie in a file in shared memory that every
# rank maps; entering and leaving are compiled (csrc/pacing.cpp: the file's layout, the
# model, the sleep), so a small collective under a link costs its model plus a wake-up.

def _world_ranks(comm, ranks) -> list:
    """``comm``'s ``ranks`` as ranks of MPI.COMM_WORLD (the slots' rows)."""
    from mpi4py import MPI
    group, world = comm.Get_group(), MPI.COMM_WORLD.Get_group()
    try:
        return MPI.Group.Translate_ranks(group, list(ranks), world)
    finally:
        group.Free()
        world.Free()


_groups: Dict[object, "_C.PaceGroup"] = {}
_next_cid = 1
_bound = False                  # the slots mapped (pace_bind), settings watched
_settled = False                # the link and timeout given to C (pace_settings) as they are


def _unsettle() -> None:
    global _settled
    _settled = False            # a knob changed: pace_settings again at the next collective


def group(comm, members: Optional[tuple] = None):
    """The ``_C.PaceGroup`` that paces collectives on ``comm`` (among its ranks ``members``
    if given: a group with no communicator of its own, a partial all-reduce's); None for a
    group of one. Made at its first paced collective: a communicator's members agree on
    its id by one small allreduce there (they run their collectives on it in one order);
    a group of members takes the negated hash of their world ranks."""
    global _next_cid, _bound, _settled
    if (comm.Get_size() if members is None else len(members)) <= 1:
        return None
    if not _bound or not _settled:
        from mpi4py import MPI
        world = MPI.COMM_WORLD
        if not _bound:          # (config imports this module: watched from the first use)
            _C.pace_bind(os.path.join(_job().dir, "collectives"), world.Get_size(), world.Get_rank())
            config.watch(_unsettle)
            _bound = True
        latency, bandwidth = parse_link(config.get("link")).of(world.Get_rank())
        _C.pace_settings(latency, 1.0 / bandwidth, config.get("timeout"))
        _settled = True
    key = id(comm) if members is None else (id(comm), members)
    found = _groups.get(key)
    if found is None or found.owner is not comm:
        from mpi4py import MPI
        if members is None:
            cid = _agreed_id(comm)
            _next_cid = cid + 1
            ranks = _world_ranks(comm, range(comm.Get_size()))
        else:
            ranks = _world_ranks(comm, members)
            cid = -1 - (hash(tuple(ranks)) & (2**61 - 1))
        found = _groups[key] = _C.PaceGroup(cid, ranks, MPI.COMM_WORLD.Get_rank(), comm)
    return found


def _agreed_id(comm) -> int:
    """The largest ``_next_cid`` of ``comm``'s members: an allreduce polled to the deadline
    (PYCOLL_TIMEOUT), not a blocking call, which a member that never comes would hold
    forever, and mpi4py's first pickled one with the GIL, so that no wait of this
    process could time out."""
    from mpi4py import MPI
    mine, agreed = np.array([_next_cid], np.int64), np.empty(1, np.int64)
    timeout = config.get("timeout")
    if not wait_request(comm.Iallreduce(mine, agreed, op=MPI.MAX), timeout, mine, agreed):
        raise CollectiveTimeout(
            f"pycoll: the first collective paced by --link on a group of {comm.Get_size()} "
            f"ranks: not every rank joined within {timeout:g} s (PYCOLL_TIMEOUT); they "
            "skipped this collective, are stuck elsewhere, or died")
    return int(agreed[0])


def enter(kind: str, comm, nbytes: int, issued: float = math.inf,
          members: Optional[tuple] = None):
    """Before collective ``kind`` on ``comm`` (among its ranks ``members`` if given): this
    rank's entry (when it was issued, but not before this rank's previous one ended; its
    link, its bytes) where the other members can read it, for ``leave``; None for a group
    of one. (The compiled paths enter through ``group`` and their own stamp of the call.)"""
    now = time.monotonic()
    paced = group(comm, members)
    if getattr(_called, "at", None) is not None:
        issued, _called.at = min(issued, _called.at), None
    return paced.enter(kind, nbytes, min(issued, now)) if paced is not None else None


_called = threading.local()


def called() -> None:
    """A blocking collective was called in this thread and the short path left it to the
    general path: its modelled time runs from here."""
    if config.get("link"):
        _called.at = time.monotonic()


def leave(entry) -> None:
    """After the real collective: sleep until the modelled end (the same on every member).
    A member that never comes: the real call says so, not this."""
    if entry is None:
        return
    if timeline.on:
        with timeline.phase("emulated link", "emulated", model=entry.kind):
            _C.pace_leave(entry)
    else:
        _C.pace_leave(entry)


def modelled(kind: str, what):
    """Decorator of a function that runs one collective ``kind``: with a link set it
    costs the modelled time. ``what(*args)`` -> (communicator, nbytes)."""
    def decorate(run):
        @functools.wraps(run)
        def emulated(*args):
            if not config.get("link"):
                return run(*args)
            entry = enter(kind, *what(*args))
            result = run(*args)
            leave(entry)
            return result
        return emulated
    return decorate


def timed(kind: str, comm, nbytes: int, run, members: Optional[tuple] = None):
    """``run`` (a collective's thunk, on ``comm`` or among its ranks ``members``), costing
    the modelled time of ``kind`` when a link is set; ``run`` itself otherwise."""
    if not config.get("link"):
        return run
    issued = time.monotonic()               # planned in the caller's thread: its call

    def emulated():
        entry = enter(kind, comm, nbytes, issued, members)
        result = run()
        leave(entry)
        return result
    return emulated


# ---------------------------------------------------------------- point to point

# SENT (sender -> receiver): kind, communicator id, sender's rank in it, tag; when the
# message's first and last byte left the sender's NIC, how long it occupies a NIC (-1:
# sent to itself), its latency. TAKEN (receiver -> sender): kind, communicator id, the
# receiver's rank in it, tag, when the receiver had its last byte.
_RECORD = struct.Struct("<Bqiidddd")
_SENT, _TAKEN = 0, 1
_RECORDS_PER_READ = 65520 // _RECORD.size
_POLL_MIN, _POLL_MAX = 20e-6, 1e-3
# A matched receive whose message arrives in the model within this long is waited for in
# the caller's thread: the link thread's release reaches a waiter 15-35 us after it
# (MPI's completion alone, on the VM) to 40-130 us (with the hand-over of the GIL).
_INLINE_S = 100e-6
# How often every queue's first receive is tested, records or not: a safety net for a
# message that came unbooked, never the way a booked message is found (tests set it to inf).
_FALLBACK_S = 0.01


def _job_name() -> str:
    """A name this job's ranks share on this machine, from the launcher's variables."""
    for name in ("PMIX_NAMESPACE", "OMPI_MCA_orte_ess_jobid", "OMPI_MCA_ess_base_jobid",
                 "PMI_KVSNAME", "SLURM_JOB_ID"):
        value = os.environ.get(name)
        if value:
            step = os.environ.get("SLURM_STEP_ID", "") if name == "SLURM_JOB_ID" else ""
            return re.sub(r"[^A-Za-z0-9_.-]", "_", f"{value}.{step}" if step else value)
    return f"ppid{os.getppid()}"        # every rank here is a child of one launcher daemon


class _Entry:
    """A send or receive whose completion waits for its modelled time: behind a
    generalized request (Isend, Irecv), or a blocking Send waiting on ``event``."""
    __slots__ = ("real", "grequest", "due", "send", "cid", "source", "tag", "count",
                 "cancelled", "keep", "taken", "event", "queued", "asked", "posted")

    def __init__(self, real, send: bool, due: Optional[float] = None, cid: int = 0, keep=None):
        self.real, self.send, self.due, self.cid, self.keep = real, send, due, cid, keep
        self.grequest = self.taken = self.event = None
        self.source = self.tag = -1
        self.count = 0
        self.cancelled = self.queued = False
        self.asked = None               # a receive: (cid, source, tag) as posted (ANY: -1)
        self.posted = time.monotonic()  # the timeline marks it from here to its release


def _query(status, entry: _Entry) -> None:
    from mpi4py import MPI
    status.Set_source(entry.source)
    status.Set_tag(entry.tag)
    status.Set_elements(MPI.BYTE, entry.count)
    status.Set_cancelled(entry.cancelled)


def _free(entry: _Entry) -> None:
    entry.keep = None


def _cancel(completed: bool, entry: _Entry) -> None:
    if not completed:
        _emulator().cancelled(entry)


class _PickledReceive:
    """``comm.irecv()``'s request. The emulation thread takes the message (so its sender's
    TAKEN record does not wait for this rank to look); ``test()`` and ``wait()`` give the
    object once it has arrived in the model."""

    def __init__(self, request, emulator, cid: int):
        self._request, self._emulator, self._cid = request, emulator, cid
        self._taken = threading.Event()
        self._due = self._value = None
        self._source = self._tag = -1
        emulator.watch(self)

    def _poll(self, status) -> bool:
        """In the emulation thread: whether the message has come (then it is taken)."""
        flag, value = self._request.test(status)
        if flag:
            self._value, self._source, self._tag = value, status.Get_source(), status.Get_tag()
            self._due = self._emulator.arrival((self._cid, self._source, self._tag))
            self._taken.set()
        return flag

    def _status(self, status) -> None:
        if status is not None:
            status.source, status.tag = self._source, self._tag

    def test(self, status=None):
        if not self._taken.is_set() or (self._due is not None and time.monotonic() < self._due):
            return False, None
        self._status(status)
        return True, self._value

    def wait(self, status=None):
        self._taken.wait()
        if self._due is not None:
            sleep_until(self._due)
        self._status(status)
        return self._value

    def Test(self, status=None) -> bool:
        return self.test(status)[0]

    def Wait(self, status=None) -> None:
        self.wait(status)

    def cancel(self) -> None:
        self._request.Cancel()          # the thread's next test completes it

    Cancel = cancel


class _Emulator:
    """This process's side of point-to-point emulation: its NIC (when its egress and
    ingress are next free), the FIFO through which other ranks tell it about messages,
    and the thread that completes the held requests on time.

    A sender puts a message on its egress (FIFO, from when it is posted) and writes a
    SENT record to the receiver's FIFO before posting the real message. The receiver,
    when it takes the message, books its ingress (FIFO in the order it takes messages,
    from when the sender put it on the wire), so the receive completes ``latency`` after
    the last byte is in, and answers a TAKEN record: the send completes when the
    receiver has taken its last byte (MPI's standard mode allows a send to wait for its
    receive). Under incast the senders therefore finish in turn too."""

    def __init__(self):
        from mpi4py import MPI
        if MPI.Query_thread() < MPI.THREAD_MULTIPLE:
            raise RuntimeError("--link emulation of point-to-point messages needs "
                               "MPI_THREAD_MULTIPLE (mpi4py's default); MPI was initialized "
                               "with less")
        cannot = mpi_from_c()
        if cannot:
            raise RuntimeError("--link emulation of point-to-point messages completes its "
                               f"requests from pycoll._C, which cannot call MPI ({cannot}); "
                               "run without --link")
        self.handle_of = MPI._handleof
        world = MPI.COMM_WORLD
        self.rank, self.size = world.Get_rank(), world.Get_size()
        local = os.environ.get("OMPI_COMM_WORLD_LOCAL_SIZE") or os.environ.get("MPI_LOCALNRANKS")
        if local and int(local) != self.size:
            raise RuntimeError(f"--link emulates a cluster on one machine, but this job's "
                               f"{self.size} ranks run on several ({local} here)")
        self.dir = _job().dir
        self.fifo = self._fifo_path(self.rank)
        try:
            os.mkfifo(self.fifo, 0o600)
        except FileExistsError:
            pass
        self.records_fd = os.open(self.fifo, os.O_RDWR | os.O_NONBLOCK)
        self.wake_r, self.wake_w = os.pipe()
        for fd in (self.wake_r, self.wake_w):
            os.set_blocking(fd, False)
        self.egress_free = self.ingress_free = 0.0      # when this rank's NIC is next free
        self.egress_lock = threading.Lock()
        self.lock = threading.Lock()                    # the rest, between threads
        self.comms: Dict[int, tuple] = {}               # cid -> (world ranks, this rank's)
        self.records: Dict[tuple, collections.deque] = collections.defaultdict(collections.deque)
        self.taken: list = []                           # TAKEN records the thread matches
        self.outbox: Dict[int, list] = {}               # the thread's, to send: peer -> records
        self.untaken: Dict[tuple, collections.deque] = collections.defaultdict(collections.deque)
        self.new: list = []               # held requests the thread has not seen yet
        self.cancels: list = []
        self.sending: list = []           # heap of (due, order, entry): taken sends to test
        self.late_sends: list = []        # due, but MPI has not finished them
        # receives MPI has not matched yet, by (cid, source, tag) as posted (ANY_SOURCE
        # and ANY_TAG stay -1), each queue in posting order: MPI matches them in that order
        self.receiving: Dict[tuple, collections.deque] = {}
        self.tracking = False             # whether the thread knows of receives
        self.announced = 0                # SENT records read so far
        self.pickled: list = []           # comm.irecv()'s, likewise
        self.due: list = []               # heap of (due, order, entry): done, to release
        self.statuses: list = []
        self.status = MPI.Status()
        self.order = itertools.count()
        self.peers: Dict[int, Optional[int]] = {}     # world rank -> write end of its FIFO
        self.closed = self.broken = False
        self.fallback = 0.0             # when receives are tested next without a record
        self.thread = threading.Thread(target=self._loop, name="pycoll-link", daemon=True)
        self.thread.start()
        atexit.register(self.close)

    def _fifo_path(self, rank: int) -> str:
        return os.path.join(self.dir, f"rank-{rank}.fifo")

    def _write(self, dst: int, record: bytes) -> bool:
        """Put ``record`` in world rank ``dst``'s FIFO; False if it cannot be reached."""
        fd = self._peer(dst)
        if fd is None:
            return False
        try:
            os.write(fd, record)
            return True
        except OSError as err:          # the peer has exited
            log.debug("pycoll: --link cannot reach rank %d: %s", dst, err)
            self.peers[dst] = None
            return False

    def _peer(self, dst: int) -> Optional[int]:
        if dst in self.peers:
            return self.peers[dst]
        deadline = time.monotonic() + 30.0      # the peer makes its FIFO when it starts
        while True:
            try:
                fd = os.open(self._fifo_path(dst), os.O_WRONLY | os.O_NONBLOCK)
                os.set_blocking(fd, True)
                break
            except OSError as err:
                if err.errno not in (errno.ENOENT, errno.ENXIO) or time.monotonic() > deadline:
                    log.warning("pycoll: --link cannot reach rank %d's FIFO (%s); its "
                                "messages from here arrive unpaced", dst, err)
                    fd = None
                    break
                time.sleep(1e-3)
        self.peers[dst] = fd
        return fd

    # ------------------------------------------------------------ the sender's side
    def post(self, entry: _Entry, cid: int, src: int, dst: int, peer: int, tag: int,
             nbytes: int, link: Tuple[float, float]) -> None:
        """Before the real message of ``entry`` is posted: put ``nbytes`` from this rank
        (``src`` in communicator ``cid``) to ``dst`` (world rank ``peer``) on this rank's
        egress, tell the receiver, and wait for its TAKEN record (``entry.due``: when the
        last byte leaves; ``entry.taken``: when the receiver has it, None until then)."""
        latency, bandwidth = link
        if peer == self.rank:                    # to itself: no NIC, no cost, no answer
            entry.due = start = time.monotonic()
            self._write(peer, _RECORD.pack(_SENT, cid, src, tag, start, start, -1.0, 0.0))
            entry.taken = start
            return
        duration = nbytes / bandwidth
        with self.egress_lock:
            start = max(time.monotonic(), self.egress_free)
            entry.due = self.egress_free = start + duration
        with self.lock:
            self.untaken[cid, dst, tag].append(entry)
        if not self._write(peer, _RECORD.pack(_SENT, cid, src, tag, start, entry.due,
                                              duration, latency)):
            with self.lock:
                self.untaken[cid, dst, tag].remove(entry)
            entry.taken = entry.due              # unreachable: unpaced beyond its egress

    # ------------------------------------------------------------ the receiver's side
    def _read_records(self) -> None:
        """Move the records waiting in this rank's FIFO into ``records`` and ``taken``
        (lock held)."""
        answered = False
        while True:
            try:
                data = os.read(self.records_fd, _RECORDS_PER_READ * _RECORD.size)
            except BlockingIOError:
                break
            for kind, cid, rank, tag, *times in _RECORD.iter_unpack(data):
                if kind == _SENT:
                    self.records[cid, rank, tag].append(times)
                    self.announced += 1
                else:
                    self.taken.append(((cid, rank, tag), times[0]))
                    answered = True
            if len(data) < _RECORDS_PER_READ * _RECORD.size:
                break
        if answered and threading.current_thread() is not self.thread:
            self.wake()                 # the thread matches TAKEN records with sends

    def arrived_by(self, key: tuple, now: float) -> bool:
        """Whether the next message of ``key``, a matched one the caller is about to
        receive, has arrived in the model by ``now``, or will within ``_INLINE_S``; if so
        it is taken (as ``arrival``), the caller sleeps to its arrival, and its receive
        needs no holding. Not while an earlier matched receive of ``key`` is held: that
        one takes the next record."""
        matched = key + ("matched",)
        with self.lock:
            self._read_records()
            queue = self.records.get(key)
            if not queue or self.receiving.get(matched) or any(
                    getattr(e, "asked", None) == matched for e in self.new):
                return False
            start, end, duration, latency = queue[0]
            if duration >= 0 and (max(max(start, self.ingress_free) + duration, end) + latency
                                  > now + _INLINE_S):
                return False
        due = self.arrival(key)
        if due is not None:
            sleep_until(due)
        return True

    def arrival(self, key: tuple, defer: bool = False) -> Optional[float]:
        """When the message that this rank has just taken, from ``key`` = (cid, source,
        tag), has arrived: it goes through this rank's ingress, FIFO in the order this
        rank takes messages, from when its sender put it on the wire, and arrives
        ``latency`` after its last byte. None for a message that was not booked.
        ``defer``: the thread sends the TAKEN record with the others of its pass."""
        with self.lock:
            self._read_records()
            queue = self.records.get(key)
            if not queue:
                return None
            start, end, duration, latency = queue.popleft()
            if not queue:
                del self.records[key]
            if duration < 0:                     # from this rank itself
                return end
            start = max(start, self.ingress_free)
            taken = self.ingress_free = max(start + duration, end)
            world, me = self.comms[key[0]]
        record = _RECORD.pack(_TAKEN, key[0], me, key[2], taken, 0, 0, 0)
        if defer:
            self.outbox.setdefault(world[key[1]], []).append(record)
        else:
            self._write(world[key[1]], record)
        return taken + latency

    def _flush(self) -> None:
        """The thread's TAKEN records of one pass: one write per peer (up to PIPE_BUF
        bytes, which a FIFO writes whole)."""
        per_write = 4096 // _RECORD.size
        for peer, records in self.outbox.items():
            for i in range(0, len(records), per_write):
                self._write(peer, b"".join(records[i:i + per_write]))
        self.outbox.clear()

    # ------------------------------------------------------------ held requests
    def hold(self, entry: _Entry):
        """A generalized request that completes once ``entry``'s real request has and its
        modelled time has come."""
        from mpi4py import MPI
        entry.grequest = grequest = MPI.Grequest.Start(_query, _free, _cancel, args=(entry,))
        with self.lock:
            self.new.append(entry)
            # A receive whose record another thread has already read (the parameter
            # server's payload pieces: reading the header's took theirs too) would wait
            # for the thread's next poll, backed off to 1 ms: 0.8 ms a piece, measured.
            wake = entry.taken is not None if entry.send else not self.tracking or bool(self.records)
        # Otherwise a record (SENT or TAKEN) brings the wake-up; a thread that knows of
        # receives also looks at least every FALLBACK_S, and polls while records wait.
        if wake:
            self.wake()
        return grequest                 # (the thread drops entry.grequest once complete)

    def wait_taken(self, entry: _Entry) -> None:
        """A blocking send: until the receiver has taken it (at most PYCOLL_TIMEOUT)."""
        if entry.taken is None:
            entry.event = threading.Event()
            with self.lock:
                known = entry.taken is not None
            if not known:
                self.wake()
                if not entry.event.wait(config.get("timeout")):
                    log.warning("pycoll: --link: a send was not received within "
                                "PYCOLL_TIMEOUT; it completes unpaced")
                    entry.taken = entry.due
        sleep_until(max(entry.due, entry.taken))

    def watch(self, receive: _PickledReceive) -> None:
        with self.lock:
            self.new.append(receive)
        self.wake()

    def cancelled(self, entry: _Entry) -> None:
        with self.lock:
            self.cancels.append(entry)
        self.wake()

    def wake(self) -> None:
        try:
            os.write(self.wake_w, b"!")
        except BlockingIOError:
            pass                        # already pending

    def _loop(self) -> None:
        """Complete each held request once its real request has completed and its
        modelled time has come. Sleeps until the next due time, or on the FIFO and the
        wake-up pipe; polls real requests (backing off to 1 ms) only while one is later
        than its model."""
        _C.precise_timers()
        poll, heard, released = _POLL_MIN, 0, False
        while not self.closed:
            with self.lock:
                self._read_records()
                # a message just announced is usually in a moment: test it soon again
                fresh, heard = self.announced != heard, self.announced
                new, self.new = self.new, []
                cancels, self.cancels = self.cancels, []
                taken, self.taken = self.taken, []
                waiting = list(self.records)     # messages on their way to this rank
                matched = []
                for key, when in taken:          # in the order the sends were posted
                    queue = self.untaken.get(key)
                    if queue:
                        matched.append((queue.popleft(), when))
                        if not queue:
                            del self.untaken[key]
            try:
                for entry in new:
                    if isinstance(entry, _PickledReceive):
                        self.pickled.append(entry)
                        continue
                    entry.queued = True
                    if not entry.send:
                        self.receiving.setdefault(entry.asked, collections.deque()).append(entry)
                    elif entry.taken is not None:
                        self._taken(entry)
                for entry, when in matched:
                    entry.taken = when
                    if entry.event is not None:
                        entry.event.set()
                    elif entry.queued:
                        self._taken(entry)
                for entry in cancels:
                    self._cancel_real(entry)
                moved, late = self._step(waiting)
                self._flush()
            except Exception:                                # noqa: BLE001
                if not self._failed():
                    return
                moved, late = True, True
            poll = _POLL_MIN if moved or released or fresh else min(2 * poll, _POLL_MAX)
            now = time.monotonic()
            wake = min(self.sending[0][0] if self.sending else math.inf,
                       self.fallback if self.receiving or self.pickled else math.inf,
                       now + poll if late else math.inf)
            with self.lock:
                self.tracking = bool(self.receiving or self.pickled)
                busy = bool(self.new or self.cancels or self.taken)
            try:
                released = self._release(now if busy else wake)
            except Exception:                                # noqa: BLE001
                if not self._failed():
                    return

    def _failed(self) -> bool:
        """After an exception in the thread: whether it goes on (not once MPI is finalized).
        Never die: a dead thread would leave every held request waiting. From here on
        requests complete with their real ones, unpaced."""
        from mpi4py import MPI
        if MPI.Is_finalized():
            return False
        if not self.broken:
            log.exception("pycoll: --link emulation failed; messages from now on are not paced")
        self.broken = True
        self._release_all()
        return True

    def _release(self, until: float) -> bool:
        """Complete the held requests of ``due`` at their modelled times until ``until``, or
        until a record or a wake-up comes. In C without the GIL: a completion from Python
        reached its waiter 15-40 us late, after the GIL's hand-over (2 ranks, the VM), and a
        sleep in select woke 10-25 us past the due. Whether it completed any."""
        held = [item for item in sorted(self.due) if item[2].grequest is not None]
        done, ready, error = _C.link_wait(
            [(due, self.handle_of(entry.grequest)) for due, _, entry in held],
            (self.wake_r, self.records_fd), until)
        now = time.monotonic()
        for _, _, entry in held[:done]:
            entry.grequest = None
            if timeline.on:
                timeline.interval("emulated " + ("send" if entry.send else "receive"),
                                  "emulated", entry.posted, now)
        self.due = held[done:]                  # sorted: a heap
        if 0 in ready:
            try:
                os.read(self.wake_r, 4096)
            except BlockingIOError:
                pass
        if error:
            from mpi4py import MPI
            raise MPI.Exception(error)
        return done > 0

    def _taken(self, entry: _Entry) -> None:
        """A held send whose receiver has taken it: tested when both its last byte has
        left and the receiver has it."""
        heapq.heappush(self.sending, (max(entry.due, entry.taken), next(self.order), entry))

    def _candidates(self, waiting) -> list:
        """The receive queues that could take the messages whose records wait, a probed
        message's receive too (left to the FALLBACK_S sweep, the parameter server's
        payload pieces cost up to 10 ms each)."""
        found = []
        for cid, src, tag in waiting:
            for key in ((cid, src, tag, "matched"), (cid, src, tag), (cid, -1, tag),
                        (cid, src, -1), (cid, -1, -1)):
                if key in self.receiving and key not in found:
                    found.append(key)
        return found

    def _take(self, key: tuple, now: float) -> bool:
        """Test the receives of queue ``key`` in posting order, up to the first still
        waiting; release the completed. In order: MPI matches them in that order, so
        the k-th taken gets the k-th record (a later one can finish first, when one test
        progresses both, and must not take an earlier message's record)."""
        from mpi4py import MPI
        queue, moved = self.receiving[key], False
        for entry in list(queue):
            if entry.real is not None:
                if not entry.real.Test(self.status):
                    break
                status = self.status
                entry.real = None
                entry.source, entry.tag = status.Get_source(), status.Get_tag()
                entry.count = status.Get_count(MPI.BYTE)
                entry.cancelled = status.Is_cancelled()
                entry.due = self.arrival((entry.cid, entry.source, entry.tag), defer=True)
                heapq.heappush(self.due, (entry.due or now, next(self.order), entry))
            queue.remove(entry)
            moved = True
        if not queue:
            del self.receiving[key]
        return moved

    def _step(self, waiting):
        """Advance the held requests: (whether any completed, whether a real request is
        later than its model). ``waiting``: the keys of the records of messages to this
        rank that no receive has taken yet."""
        moved, late, now = False, False, time.monotonic()
        if self.broken:
            self._release_all()
            return False, bool(self.receiving or self.pickled or self.late_sends or self.sending
                               or self.due)
        # A receive can only have completed once its message's record came: the sender
        # writes it first. So for each record waiting, the first receive posted that could
        # take it is tested (and the next, while they complete); every queue's first
        # every FALLBACK_S, in case a message came unbooked.
        if self.receiving:
            every = now >= self.fallback
            if every:
                self.fallback = now + _FALLBACK_S
            for key in list(self.receiving) if every else self._candidates(waiting):
                moved |= self._take(key, now)
            late = bool(waiting) and bool(self.receiving)
        if self.pickled and (waiting or now >= self.fallback):
            self.fallback = now + _FALLBACK_S
            self.pickled = [p for p in self.pickled if not p._poll(self.status)]
            late |= bool(self.pickled) and bool(waiting)
        while self.sending and self.sending[0][0] <= now:      # sends are tested when due
            entry = heapq.heappop(self.sending)[2]
            if entry.real is not None:
                self.late_sends.append(entry)
        if self.late_sends:
            for entry in self.late_sends:
                if entry.real is not None and entry.real.Test():
                    entry.real = None
                    heapq.heappush(self.due, (now, next(self.order), entry))
            self.late_sends = [e for e in self.late_sends if e.real is not None]
            late |= bool(self.late_sends)
        # A message taken above is often due already (its bytes arrived in the model
        # while the thread slept): ``_release``, next in the same pass, completes it.
        return moved, late

    def _release_all(self) -> None:
        """After a failure: complete every held request whose real one has completed."""
        with self.lock:
            waiting = [e for queue in self.untaken.values() for e in queue]
            self.untaken.clear()
        for entry in waiting:
            if entry.event is not None:
                entry.taken = entry.due
                entry.event.set()
        receiving = [e for queue in self.receiving.values() for e in queue]
        for entry in (receiving + self.late_sends + waiting
                      + [e for _, _, e in self.sending + self.due]):
            try:
                if entry.grequest is not None and (entry.real is None or entry.real.Test()):
                    entry.real = None
                    entry.grequest.Complete()
                    entry.grequest = None
            except Exception:                                # noqa: BLE001
                pass
        for receive in self.pickled:
            try:
                if receive._poll(self.status):
                    receive._due = None
            except Exception:                                # noqa: BLE001
                pass
        self.pickled = [p for p in self.pickled if not p._taken.is_set()]
        self.receiving = {}
        for entry in receiving:
            if entry.grequest is not None:
                self.receiving.setdefault(entry.asked, collections.deque()).append(entry)
        self.late_sends = [e for e in self.late_sends + waiting if e.grequest is not None]
        self.sending = [item for item in self.sending if item[2].grequest is not None]
        self.due = [item for item in self.due if item[2].grequest is not None]
        heapq.heapify(self.sending)
        heapq.heapify(self.due)
        _C.link_released()

    def _cancel_real(self, entry: _Entry) -> None:
        """Cancel what the generalized request stands for; it completes at once."""
        from mpi4py import MPI
        real, entry.real, status = entry.real, None, MPI.Status()
        if real is not None:
            if not real.Test(status):
                real.Cancel()
                real.Wait(status)
            entry.cancelled = status.Is_cancelled()
            if not entry.send and not entry.cancelled:
                entry.source, entry.tag = status.Get_source(), status.Get_tag()
                entry.count = status.Get_count(MPI.BYTE)
                self.arrival((entry.cid, entry.source, entry.tag))     # taken after all
        if entry.send and entry.taken is None:
            with self.lock:                      # no TAKEN record will come for it
                for queue in self.untaken.values():
                    if entry in queue:
                        queue.remove(entry)
        queue = self.receiving.get(entry.asked)
        if queue is not None and entry in queue:
            queue.remove(entry)
            if not queue:
                del self.receiving[entry.asked]
        if entry.grequest is not None:
            entry.grequest.Complete()
            entry.grequest = None
            _C.link_released()

    def close(self) -> None:
        """At exit (before MPI is finalized): stop the thread, remove this rank's FIFO,
        and the directory with the last rank."""
        if self.closed:
            return
        self.closed = True
        self.wake()
        if self.thread.is_alive():
            self.thread.join(timeout=1.0)
        for fd in [fd for fd in self.peers.values() if fd is not None]:
            try:
                os.close(fd)
            except OSError:
                pass
        try:
            os.unlink(self.fifo)
        except OSError:
            pass


class _JobDir:
    """This job's directory in /dev/shm: the ranks' FIFOs and the collectives' slots.
    Each process leaves a pid- marker there while it runs; the last one out removes it."""

    def __init__(self):
        base = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
        prefix = f"pycoll-link-{os.getuid()}-"
        self.dir = os.path.join(base, prefix + _job_name())
        _remove_stale(base, prefix, self.dir)
        os.makedirs(self.dir, mode=0o700, exist_ok=True)
        self.marker = os.path.join(self.dir, f"pid-{os.getpid()}")
        open(self.marker, "w").close()
        atexit.register(self.close)

    def close(self) -> None:
        try:
            os.unlink(self.marker)
            if not any(n.startswith("pid-") for n in os.listdir(self.dir)):
                shutil.rmtree(self.dir, ignore_errors=True)
        except OSError:
            pass


_job = lazy(_JobDir)


def _remove_stale(base: str, prefix: str, mine: str) -> None:
    """Remove the directories of earlier jobs whose ranks all died without cleaning up
    (killed, or aborted by MPI): those with no live process among their pid- markers."""
    try:
        names = [n for n in os.listdir(base) if n.startswith(prefix)]
    except OSError:
        return
    for name in names:
        path = os.path.join(base, name)
        if path == mine:
            continue
        try:
            pids = [int(n[4:]) for n in os.listdir(path) if n.startswith("pid-")]
        except (OSError, ValueError):
            continue
        alive = False
        for pid in pids:
            try:
                os.kill(pid, 0)
                alive = True
            except ProcessLookupError:
                pass
            except OSError:
                alive = True                       # someone else's: not ours to judge
        if not alive and pids:
            shutil.rmtree(path, ignore_errors=True)


_emulator = lazy(_Emulator)


def _message_bytes(buf) -> int:
    """The bytes an mpi4py message spec (``buf``, ``[buf, type]``, ``[buf, count, type]``)
    sends."""
    from mpi4py import MPI
    if isinstance(buf, (list, tuple)):
        if len(buf) >= 3 and isinstance(buf[2], MPI.Datatype) and isinstance(buf[1], numbers.Integral):
            return int(buf[1]) * buf[2].Get_size()
        buf = buf[0]
    try:
        return memoryview(buf).nbytes
    except TypeError:
        return 0


_created: collections.Counter = collections.Counter()


def p2p(comm):
    """``comm`` whose point-to-point messages are paced by the ``link`` knob (its
    ``Comm`` subclass), or ``comm`` itself when no link is set. Call it where every
    member makes the communicator, in the same order (as MPI's own constructors)."""
    if not config.get("link") or comm is None or isinstance(comm, Comm):
        return comm
    return Comm(comm)


def _make_comm_class():
    from mpi4py import MPI

    class _Message:
        """A matched message (``improbe``/``mprobe``): its receive waits for the
        modelled arrival."""

        def __init__(self, message, comm, source: int, tag: int):
            self._message, self._comm, self._key = message, comm, (comm._cid, source, tag)

        def recv(self, status=None):
            obj = self._message.recv(status)
            self._comm._arrived(self._key)
            return obj

        def Recv(self, buf, status=None):
            self._message.Recv(buf, status)
            self._comm._arrived(self._key)

        def Irecv(self, buf):
            posted, real = time.monotonic(), self._message.Irecv(buf)
            # A message that has arrived in the model, or soon will (a small one whose
            # header the receiver waited for: the parameter server's payload), completes
            # with its real receive, the caller sleeping to its arrival, not on the
            # emulation thread's next turn.
            if self._comm._emulator.arrived_by(self._key, posted):
                if timeline.on:             # as the thread marks the receives it releases
                    timeline.interval("emulated receive", "emulated", posted, time.monotonic())
                return real
            return self._comm._hold_receive(real, *self._key[1:], matched=True)

        def irecv(self):
            return _PickledReceive(self._message.irecv(), self._comm._emulator, self._comm._cid)

    class EmulatedComm(MPI.Intracomm):
        """An intracommunicator whose sends book the NICs of the ``link`` model and
        whose sends and receives complete at the modelled times (``p2p``).

        Emulated: Send, Isend, send, isend, Recv, Irecv, recv, irecv, and receives of
        the messages that improbe/Improbe/mprobe/Mprobe match. Other calls (Ssend,
        Sendrecv, collectives on it) pass through unpaced. A message to this rank itself
        is free."""

        def __init__(self, comm):               # mpi4py's __new__ took comm's handle
            self._emulator = _emulator()
            group, world = comm.Get_group(), MPI.COMM_WORLD.Get_group()
            try:
                self._world = MPI.Group.Translate_ranks(group, list(range(group.Get_size())),
                                                        world)
            finally:
                group.Free()
                world.Free()
            self._me = comm.Get_rank()
            members = tuple(self._world)
            _created[members] += 1       # the n-th communicator of these ranks: same everywhere
            digest = hashlib.blake2b(repr((members, _created[members])).encode(), digest_size=8)
            self._cid = int.from_bytes(digest.digest(), "little") >> 1
            self._links = parse_link(config.get("link"))
            self._emulator.comms[self._cid] = (self._world, self._me)

        # ------------------------------------------------------------ sending
        def _book(self, dest: int, tag: int, nbytes: int) -> Optional[_Entry]:
            """The entry of a message to ``dest``, booked before the real one is posted
            (None for PROC_NULL)."""
            if dest < 0:
                return None
            peer = self._world[dest]
            (lat_me, bw_me), (lat_peer, bw_peer) = self._links.of(self._emulator.rank), \
                self._links.of(peer)
            entry = _Entry(None, True)
            self._emulator.post(entry, self._cid, self._me, dest, peer, tag, nbytes,
                                (max(lat_me, lat_peer), min(bw_me, bw_peer)))
            return entry

        def Send(self, buf, dest, tag=0):
            entry = self._book(dest, tag, _message_bytes(buf))
            super().Send(buf, dest, tag)
            if entry is not None:
                self._emulator.wait_taken(entry)

        def send(self, obj, dest, tag=0):
            self.Send([MPI.pickle.dumps(obj), MPI.BYTE], dest, tag)

        def Isend(self, buf, dest, tag=0):
            entry = self._book(dest, tag, _message_bytes(buf))
            real = super().Isend(buf, dest, tag)
            if entry is None:
                return real
            entry.real = real
            return self._emulator.hold(entry)

        def isend(self, obj, dest, tag=0):
            data = MPI.pickle.dumps(obj)
            entry = self._book(dest, tag, len(data))
            real = super().Isend([data, MPI.BYTE], dest, tag)
            if entry is None:
                return real
            entry.real, entry.keep = real, data
            return self._emulator.hold(entry)

        # ------------------------------------------------------------ receiving
        def _arrived(self, key: tuple) -> None:
            due = self._emulator.arrival(key)
            if due is not None:
                sleep_until(due)

        def _hold_receive(self, real, source: int, tag: int, matched: bool = False):
            entry = _Entry(real, False, cid=self._cid)
            entry.asked = (self._cid, source if source >= 0 else -1, tag if tag >= 0 else -1)
            if matched:
                entry.asked += ("matched",)
            return self._emulator.hold(entry)

        def Recv(self, buf, source=MPI.ANY_SOURCE, tag=MPI.ANY_TAG, status=None):
            own = status if status is not None else MPI.Status()
            super().Recv(buf, source, tag, own)
            self._arrived((self._cid, own.Get_source(), own.Get_tag()))

        def recv(self, buf=None, source=MPI.ANY_SOURCE, tag=MPI.ANY_TAG, status=None):
            own = status if status is not None else MPI.Status()
            obj = super().recv(buf, source, tag, own)
            self._arrived((self._cid, own.Get_source(), own.Get_tag()))
            return obj

        def Irecv(self, buf, source=MPI.ANY_SOURCE, tag=MPI.ANY_TAG):
            return self._hold_receive(super().Irecv(buf, source, tag), source, tag)

        def irecv(self, buf=None, source=MPI.ANY_SOURCE, tag=MPI.ANY_TAG):
            return _PickledReceive(super().irecv(buf, source, tag), self._emulator, self._cid)

        def _matched(self, message, status):
            if message is None:
                return None
            return _Message(message, self, status.Get_source(), status.Get_tag())

        def improbe(self, source=MPI.ANY_SOURCE, tag=MPI.ANY_TAG, status=None):
            status = status if status is not None else MPI.Status()
            return self._matched(super().improbe(source, tag, status), status)

        def Improbe(self, source=MPI.ANY_SOURCE, tag=MPI.ANY_TAG, status=None):
            status = status if status is not None else MPI.Status()
            return self._matched(super().Improbe(source, tag, status), status)

        def mprobe(self, source=MPI.ANY_SOURCE, tag=MPI.ANY_TAG, status=None):
            status = status if status is not None else MPI.Status()
            return self._matched(super().mprobe(source, tag, status), status)

        def Mprobe(self, source=MPI.ANY_SOURCE, tag=MPI.ANY_TAG, status=None):
            status = status if status is not None else MPI.Status()
            return self._matched(super().Mprobe(source, tag, status), status)

    return EmulatedComm


class _LazyComm(type):
    """``Comm``: the emulating communicator class, made on first use (it subclasses an
    mpi4py type, and importing mpi4py.MPI starts MPI)."""
    _cls = None

    def _get(cls):
        if _LazyComm._cls is None:
            _LazyComm._cls = _make_comm_class()
        return _LazyComm._cls

    def __call__(cls, comm):
        return cls._get()(comm)

    def __instancecheck__(cls, obj):
        return _LazyComm._cls is not None and isinstance(obj, _LazyComm._cls)


class Comm(metaclass=_LazyComm):
    """The emulating communicator: ``Comm(comm)`` (see ``p2p``)."""
