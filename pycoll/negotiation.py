"""Name-matched negotiation: ranks submit named operations in any order, all run them in one.

MPI matches collectives by their order on a communicator, so pycoll's engine runs
operations in issue order and every rank must issue the same sequence. Horovod instead
matches operations by name: a rank whose unused parameter has no gradient, or whose
hooks fire in another order, still meets its peers. This module is Horovod's controller
for pycoll, per group, for whoever asks (``pycoll.torch`` always; anyone through
``submit`` or the ``*_async`` functions below):

- Each rank's controller thread runs *cycles* while it has operations waiting. In a
  cycle every rank sends the group's first rank (the coordinator) what it has ready;
  the coordinator answers every rank with the same list: the operations ready on all
  ranks, in one order, and errors (different shapes under one name, a name some ranks
  never submit). Every rank starts them in that order, so its engine, which runs
  operations in issue order, sees the same sequence as everyone else's.
- Response cache (Horovod's): the first time a name is negotiated, its request travels
  whole and the coordinator checks it; the answer is cached under a bit that every rank
  assigns alike. Later cycles send only a bit vector of the cached requests ready here
  and get back the AND over the ranks (an allreduce of bits, routed through the
  coordinator so that it knows which ranks are missing): one small message each way.
- Join (Horovod's ``join``): a joined rank counts as having submitted every operation
  that can join (allreduce); it takes part with zeros, from the answer's shape and
  dtype. Operations that cannot join fail at once while a rank has joined.
- Stall inspector: a name pending on some ranks but not others is logged after
  PYCOLL_STALL_WARNING_S with the ranks that lack it, and fails after PYCOLL_TIMEOUT on
  the ranks that submitted it, naming the others. A rank that never takes part in a
  cycle (it submitted nothing) is named the same way; the group then refuses further
  negotiation (``GroupBroken``), as its ranks are out of step.

Cycles are point to point on a duplicate of the group's communicator, pickled and
polled with a short backoff, so every wait has a deadline and an idle rank costs no core.
"""
import atexit
import logging
import threading
import time
from typing import Any, Callable, Dict, List, NamedTuple, Optional, Tuple

from . import config, runtime
from .engine import gone_ranks
from .inspector import CollectiveMismatch
from .work import CollectiveTimeout, GroupBroken, Latch, Work, poll

log = logging.getLogger("pycoll")

CACHE_CAPACITY = 1024     # Horovod's default; the oldest entry makes room (same on every rank)
_TAGS = 32768             # tags cycle with the cycle number
_SPIN_S = 2e-4            # waits poll without sleeping this long (a healthy peer answers by then)
_PAUSE_S = 1e-3           # the longest pause between idle cycles: Horovod's cycle time
_ERRORS = {"mismatch": CollectiveMismatch, "timeout": CollectiveTimeout, "broken": GroupBroken}


class Request(NamedTuple):
    """What one rank submits under ``name``. ``meta``: ((field, value), ...), which every
    rank must submit alike; ``local``: what may differ (an allgather's rows); ``joinable``:
    whether a joined rank can take part (from the answer's ``meta``)."""
    name: str
    kind: str
    meta: tuple = ()
    local: Any = None
    joinable: bool = False


class Response(NamedTuple):
    """The coordinator's word on ``name``: run it (``error`` None) or fail it."""
    name: str
    kind: str
    meta: tuple = ()
    joinable: bool = False
    error: Optional[Tuple[str, str]] = None        # (kind of error, message)


class _Answer(NamedTuple):
    bits: int                           # cached requests ready everywhere
    responses: tuple                    # then these, in this order
    join_last: Optional[int] = None     # every rank has joined: the last one (world rank)
    broken: Optional[str] = None        # the group is out of step: why


class Ticket:
    """A submitted operation: negotiated, then started. Like ``pycoll.Work``: ``wait``
    returns its result (or raises), ``is_completed`` and ``exception`` never block."""

    def __init__(self, request: Request, start: Callable[[Response], Any]):
        self.request, self.name = request, request.name
        self._start = start
        self._started = Latch()
        self._work: Any = None          # a Work, a list of them, or None (nothing to run)
        self._error: Optional[BaseException] = None

    def _begin(self, response: Response) -> None:
        try:
            self._work = self._start(response)
        except BaseException as error:          # delivered to whoever waits
            self._error = error
        self._started.set()

    def _fail(self, error: BaseException) -> None:
        self._error = error
        self._started.set()

    def _works(self) -> list:
        work = self._work
        return [] if work is None else work if isinstance(work, list) else [work]

    def is_completed(self) -> bool:
        return self._started.is_set() and (
            self._error is not None or all(w.is_completed() for w in self._works()))

    def exception(self) -> Optional[BaseException]:
        if self._error is None and self._started.is_set():
            return next((w.exception() for w in self._works() if w.exception()), None)
        return self._error

    def wait(self, timeout: Optional[float] = None) -> Any:
        """The result: the Work's, a list for a list of Works; raises the error."""
        timeout = config.get("timeout") if timeout is None else timeout
        deadline = time.monotonic() + timeout
        # The negotiator fails a stalled ticket itself (naming the ranks); this bound is
        # for a negotiator that is gone.
        if not self._started.wait(timeout):
            raise CollectiveTimeout(f"pycoll: '{self.name}' was not negotiated within "
                                    f"{timeout:g} s (PYCOLL_TIMEOUT)")
        if self._error is not None:
            raise self._error
        results = [w.wait(max(0.0, deadline - time.monotonic())) for w in self._works()]
        return results if isinstance(self._work, list) else results[0] if results else None

    result = wait

    def __repr__(self) -> str:
        state = ("failed" if self._error else "started" if self._started.is_set()
                 else "negotiating")
        return f"<pycoll.negotiation.Ticket {self.name} {state}>"


def _bits(x: int):
    """The indices of the bits set in ``x``, lowest first."""
    while x:
        low = x & -x
        yield low.bit_length() - 1
        x ^= low


class _Cache:
    """Answers negotiated before, each under a bit that every rank assigns alike (answers
    are applied in the same order everywhere). A request hits when this rank submitted
    exactly the same under that name before."""

    def __init__(self, capacity: int = CACHE_CAPACITY):
        self.capacity = capacity
        self.bit: Dict[str, int] = {}
        self.entries: List[Tuple[Response, Optional[Request]]] = []    # by bit: (answer, ours)
        self._oldest = 0

    def hit(self, request: Request) -> Optional[int]:
        bit = self.bit.get(request.name)
        if bit is not None and self.entries[bit][1] == request:
            return bit
        return None

    def put(self, response: Response, ours: Optional[Request]) -> None:
        bit = self.bit.get(response.name)
        if bit is None:
            if len(self.entries) < self.capacity:
                bit = len(self.entries)
                self.entries.append(None)
            else:
                bit, self._oldest = self._oldest, (self._oldest + 1) % self.capacity
                del self.bit[self.entries[bit][0].name]
            self.bit[response.name] = bit
        self.entries[bit] = (response, ours)


class _Coordinator:
    """The group's first rank's side of a cycle: from every rank's message, the answer.
    Pure but for the clock and the log: tests drive it without MPI."""

    def __init__(self, cache: _Cache, ranks: tuple):
        self.cache, self.ranks = cache, ranks       # ranks: world ranks, for messages
        self.joined: List[int] = []                 # group ranks, in the order they joined
        self.since: Dict[str, float] = {}           # partial names: when first seen
        self.warned: set = set()

    def decide(self, messages: list) -> _Answer:
        """``messages[r]`` = (bits, uncached requests, joined) from group rank r."""
        for r, (_, _, joined) in enumerate(messages):
            if joined and r not in self.joined:
                self.joined.append(r)
        active = [r for r, m in enumerate(messages) if not m[2]]
        if not active:                      # everyone joined: join returns on every rank
            last, self.joined = self.ranks[self.joined[-1]], []
            self.since.clear()
            return _Answer(0, (), last)
        joining = len(active) < len(messages)
        if not joining and not any(m[1] for m in messages):
            # The steady state: only cache bits. Ready: what every rank has.
            ready = partial = messages[0][0]
            for bits, _, _ in messages[1:]:
                ready &= bits
                partial |= bits
            have = {}
            for bit in _bits(partial ^ ready):
                name = self.cache.entries[bit][0].name
                have[name] = [r for r in active if messages[r][0] >> bit & 1]
            return _Answer(ready, self._inspect(have, len(active)))
        # Someone sent a request in full or has joined: a table of who has what.
        table: Dict[str, Dict[int, tuple]] = {}
        for r in active:
            bits, uncached, _ = messages[r]
            for bit in _bits(bits):
                response = self.cache.entries[bit][0]
                table.setdefault(response.name, {})[r] = (response.kind, response.meta,
                                                          response.joinable, bit)
            for request in uncached:
                table.setdefault(request.name, {})[r] = (request.kind, request.meta,
                                                         request.joinable, None)
        ready, responses, have = 0, [], {}
        for name, by_rank in table.items():
            if joining and not all(entry[2] for entry in by_rank.values()):
                kind = next(iter(by_rank.values()))[0]
                responses.append(Response(name, kind, error=("mismatch", (
                    f"pycoll: {kind} '{name}' cannot run while ranks "
                    f"{sorted(self.ranks[r] for r in self.joined)} have joined; only "
                    "allreduce takes part in join (as in Horovod)"))))
            elif len(by_rank) < len(active):
                have[name] = sorted(by_rank)
            else:
                bits = {entry[3] for entry in by_rank.values()}
                if len(bits) == 1 and None not in bits:
                    ready |= 1 << bits.pop()         # cached alike everywhere: no check
                else:
                    responses.append(self._check(name, by_rank))
                self.since.pop(name, None)
                self.warned.discard(name)
        responses += self._inspect(have, len(active))
        return _Answer(ready, tuple(responses))

    def _check(self, name: str, by_rank: Dict[int, tuple]) -> Response:
        """The response for ``name``, submitted by every active rank: ready, or an error
        naming what differs and on which ranks."""
        entries = sorted(by_rank.items())
        kind, meta, joinable, _ = entries[0][1]
        kinds = {entry[0] for _, entry in entries}
        if len(kinds) > 1:
            listing = ", ".join(f"rank {self.ranks[r]}: {e[0]}" for r, e in entries)
            return Response(name, kind, error=("mismatch", f"pycoll: ranks submitted different "
                                               f"operations under the name '{name}': {listing}"))
        for i, (field, _) in enumerate(meta):
            values = [e[1][i][1] if i < len(e[1]) else None for _, e in entries]
            if any(v != values[0] for v in values):
                listing = ", ".join(f"rank {self.ranks[r]}: {v}"
                                    for (r, _), v in zip(entries, values))
                return Response(name, kind, error=("mismatch", (
                    f"pycoll: ranks submitted {kind} '{name}' with different {field}: "
                    f"{listing}")))
        if any(len(e[1]) != len(meta) for _, e in entries):
            return Response(name, kind, error=("mismatch", f"pycoll: ranks submitted {kind} "
                                               f"'{name}' with different arguments"))
        return Response(name, kind, meta, all(e[2] for _, e in entries))

    def _inspect(self, have: Dict[str, List[int]], active: int) -> List[Response]:
        """The stall inspector: ``have`` maps names pending on some ranks only to those
        ranks. Warn once past PYCOLL_STALL_WARNING_S; past PYCOLL_TIMEOUT, fail the name."""
        now, failed = time.monotonic(), []
        for name in list(self.since):
            if name not in have:
                del self.since[name]
                self.warned.discard(name)
        for name, ranks in have.items():
            waited = now - self.since.setdefault(name, now)
            missing = [self.ranks[r] for r in range(len(self.ranks))
                       if r not in ranks and r not in self.joined]
            there = [self.ranks[r] for r in ranks]
            if waited > config.get("timeout"):
                kind = self._kind(name)
                failed.append(Response(name, kind, error=("timeout", (
                    f"pycoll: ranks {there} submitted '{name}' but ranks {missing} did not "
                    f"within {config.get('timeout'):g} s (PYCOLL_TIMEOUT): they skipped it, "
                    "named it differently, or are stuck elsewhere"))))
                del self.since[name]
                self.warned.discard(name)
            elif waited > config.get("stall_warning_s") and name not in self.warned:
                self.warned.add(name)
                log.warning("pycoll: '%s' has waited %.0f s: submitted by ranks %s, not yet "
                            "by ranks %s", name, waited, there, missing)
        return failed

    def _kind(self, name: str) -> str:
        bit = self.cache.bit.get(name)
        return self.cache.entries[bit][0].kind if bit is not None else "operation"


class Negotiator:
    """Name-matched negotiation on one group (see the module's docstring). Made on every
    rank of the group at the same point (it duplicates the group's communicator)."""

    def __init__(self, group: runtime.Group):
        self.group = group
        self.comm = group.engine.run(group.comm.Dup, "negotiation setup")
        self.rank, self.size = self.comm.Get_rank(), self.comm.Get_size()
        self.cache = _Cache()
        self._coordinator = _Coordinator(self.cache, group.ranks) if self.rank == 0 else None
        self._cv = threading.Condition()
        self._pending: Dict[str, Ticket] = {}      # submitted, not answered; in order
        self._fresh = False                        # submitted since the last cycle
        self._join: Optional[tuple] = None         # (ticket, fill) while joined
        self._broken: Optional[str] = None
        self._stopping = False
        self._thread: Optional[threading.Thread] = None
        self._seq = 0
        self._sends: list = []                     # pickled isends in flight

    # ------------------------------------------------------------ submitting
    def submit(self, request: Request, start: Callable[[Response], Any]) -> Ticket:
        """Queue ``request``; once every rank of the group has submitted its name,
        ``start(response)`` runs (on the controller's thread, in the agreed order) and
        returns what the ticket waits for: a ``Work``, a list of them, or None."""
        ticket = Ticket(request, start)
        if self.size == 1:                  # the order is this rank's own
            ticket._begin(Response(request.name, request.kind, request.meta, request.joinable))
            return ticket
        with self._cv:
            self._check_usable()
            if request.name in self._pending:
                raise ValueError(f"pycoll: an operation named '{request.name}' is already "
                                 "being negotiated on this group; names must be unique among "
                                 "pending operations")
            self._pending[request.name] = ticket
            self._wake()
        return ticket

    def join(self, fill: Callable[[Response], Any],
             finish: Callable[[int], Any] = lambda last: None) -> Ticket:
        """Join (Horovod's): until every rank of the group has joined, take part in the
        others' joinable operations with ``fill(response)``; then ``finish(last)`` gives
        the ticket's result, ``last`` the world rank that joined last."""
        ticket = Ticket(Request("join", "join"), lambda response: finish(response.meta))
        if self.size == 1:
            ticket._begin(Response("join", "join", self.group.ranks[0]))
            return ticket
        with self._cv:
            self._check_usable()
            if self._join is not None:
                raise ValueError("pycoll: this rank has already joined this group")
            self._join = (ticket, fill)
            self._wake()
        return ticket

    def _check_usable(self) -> None:
        if self._broken is not None:
            raise GroupBroken(f"pycoll: negotiation on {self.group} broke earlier: "
                              f"{self._broken}")
        if self._stopping:
            raise ValueError(f"pycoll: negotiation on {self.group} was shut down")

    def _wake(self) -> None:
        self._fresh = True
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, daemon=True,
                                            name=f"pycoll-negotiation-{list(self.group.ranks)}")
            self._thread.start()
        self._cv.notify()

    def stop(self, timeout: float = 5.0) -> None:
        """End the controller's thread (operations still pending fail) and free the
        communicator. Collective in MPI's terms, like ``MPI_Comm_free``."""
        with self._cv:
            self._stopping = True
            self._cv.notify()
        if self._thread is not None:
            self._thread.join(timeout)
        self._fail_all(ValueError(f"pycoll: negotiation on {self.group} was shut down"))
        if not self.group.freed and (self._thread is None or not self._thread.is_alive()):
            self.group.engine.run(self.comm.Free, "negotiation shutdown")

    # ------------------------------------------------------------ the controller
    def _loop(self) -> None:
        pause = 0.0
        while True:
            with self._cv:
                # Cycle when something was submitted, or (after a cycle that ran nothing,
                # with a growing pause) while something still waits: ranks that share no
                # ready name need not spin.
                deadline = time.monotonic() + pause
                while not self._stopping and not self._fresh:
                    waiting = self._pending or self._join is not None
                    left = deadline - time.monotonic()
                    if waiting and left <= 0:
                        break
                    self._cv.wait(left if waiting else None)
                if self._stopping:
                    return
                self._fresh = False
                message = self._message()
            try:
                answer = self._exchange(message)
            except BaseException as error:          # out of step with the group: give up
                self._break(error)
                return
            ran = self._apply(answer)
            if answer.broken is not None:
                return
            pause = 0.0 if ran else min(max(2 * pause, 1e-4), _PAUSE_S)

    def _message(self) -> tuple:
        """(bits of cached requests, requests sent whole, joined), under the lock."""
        bits, uncached = 0, []
        for ticket in self._pending.values():
            bit = self.cache.hit(ticket.request)
            if bit is None:
                uncached.append(ticket.request)
            else:
                bits |= 1 << bit
        return bits, tuple(uncached), self._join is not None

    def _exchange(self, message: tuple) -> _Answer:
        """One cycle: every rank's message to the coordinator, its answer back."""
        tag, self._seq = self._seq % _TAGS, self._seq + 1
        self._sends = [s for s in self._sends if not s.Test()]
        timeout = config.get("timeout")
        began = time.monotonic()        # a missing rank that left is waited for in vain
        if self.rank != 0:
            self._sends.append(self.comm.isend(message, dest=0, tag=tag))

            def answered():
                found = self.comm.improbe(source=0, tag=tag)
                if found is None and runtime.gone(self.group.ranks[:1], began):
                    return False
                return self._unless_stopping(found)
            found = poll(answered, time.monotonic() + timeout + 2.0, lambda: (
                f"pycoll: rank {self.group.ranks[0]}, which coordinates negotiation "
                f"on {self.group}, did not answer within {timeout:g} s "
                "(PYCOLL_TIMEOUT): it submitted nothing in that time (it skipped "
                "these operations or is stuck elsewhere), or it died"), spin=_SPIN_S)
            if found is False:
                return _Answer(0, (), None, f"negotiation on {self.group} waits for "
                               f"{gone_ranks(self.group.ranks[:1])}, which coordinates it")
            return found.recv()
        messages: List[Optional[tuple]] = [message] + [None] * (self.size - 1)
        left: list = []

        def arrived() -> Optional[bool]:
            for r, m in enumerate(messages):
                if m is None:
                    found = self.comm.improbe(source=r, tag=tag)
                    if found is not None:
                        messages[r] = found.recv()
            if all(m is not None for m in messages):
                return True
            left[:] = runtime.gone([self.group.ranks[r] for r, m in enumerate(messages)
                                    if m is None], began)
            return False if left else self._unless_stopping(None)

        def stalled() -> None:
            missing = [self.group.ranks[r] for r, m in enumerate(messages) if m is None]
            log.warning("pycoll: negotiation on %s has waited %g s for ranks %s, which "
                        "submitted nothing; pending here: %s", self.group,
                        config.get("stall_warning_s"), missing, self._names(messages))
        try:
            everyone = poll(arrived, time.monotonic() + timeout, lambda: "",
                            (config.get("stall_warning_s"), stalled), spin=_SPIN_S)
        except CollectiveTimeout:
            missing = [self.group.ranks[r] for r, m in enumerate(messages) if m is None]
            why = (f"ranks {missing} took no part in negotiation on {self.group} within "
                   f"{timeout:g} s (PYCOLL_TIMEOUT) while ranks had {self._names(messages)} "
                   "pending: they skipped these operations, are stuck elsewhere, or died")
            answer = _Answer(0, (), None, why)
        else:
            answer = (self._coordinator.decide(messages) if everyone else _Answer(
                0, (), None, f"negotiation on {self.group} waits for {gone_ranks(left)} "
                f"while ranks had {self._names(messages)} pending"))
        for r in range(1, self.size):
            if messages[r] is not None:
                self._sends.append(self.comm.isend(answer, dest=r, tag=tag))
        return answer

    def _names(self, messages: list) -> List[str]:
        names = []
        for m in messages:
            if m is not None:
                names += [self.cache.entries[b][0].name for b in _bits(m[0])]
                names += [request.name for request in m[1]]
        return sorted(set(names))

    def _unless_stopping(self, found):
        """``found``, or the end of a wait that shutdown() cut short."""
        if found is None and self._stopping:
            raise ValueError(f"pycoll: negotiation on {self.group} was shut down")
        return found

    def _apply(self, answer: _Answer) -> bool:
        """Start what the answer says, in its order; True if anything ran or failed."""
        run: List[tuple] = []
        with self._cv:
            for bit in _bits(answer.bits):
                self._take(self.cache.entries[bit][0], run)
            for response in answer.responses:
                ticket = self._take(response, run)
                if response.error is None and response.kind not in ("barrier", "join"):
                    self.cache.put(response, ticket.request if ticket is not None else None)
            if answer.join_last is not None and self._join is not None:
                ticket, _ = self._join
                self._join = None
                run.append((ticket, Response("join", "join", answer.join_last)))
        if run:
            # Under the engine's lock, so that no other thread's wait cuts the engine's
            # open batch while they go in: batches are then cut alike on every rank.
            engine = self.group.engine
            with engine._lock:
                for ticket, response in run:
                    ticket._begin(response)
                engine.flush()              # a peer may wait on these: send them now
        if answer.broken is not None:
            self._break(CollectiveTimeout(f"pycoll: {answer.broken}"))
        return bool(run) or bool(answer.responses)

    def _take(self, response: Response, run: list) -> Optional[Ticket]:
        """This rank's ticket for ``response`` (popped), queued in ``run`` or failed; a
        joined rank without one fills in."""
        ticket = self._pending.pop(response.name, None)
        if response.error is not None:
            if ticket is not None:
                kind, text = response.error
                ticket._fail(_ERRORS[kind](text))
            return ticket
        if ticket is not None:
            run.append((ticket, response))
        elif self._join is not None and response.joinable:
            fill = self._join[1]
            run.append((Ticket(Request(response.name, response.kind),
                               lambda response: _filled(fill, response)), response))
        return ticket

    def _break(self, error: BaseException) -> None:
        with self._cv:
            self._broken = str(error)
        self._fail_all(error)

    def _fail_all(self, error: BaseException) -> None:
        with self._cv:
            tickets = list(self._pending.values())
            self._pending.clear()
            if self._join is not None:
                tickets.append(self._join[0])
                self._join = None
        for ticket in tickets:
            ticket._fail(error)


def _filled(fill: Callable[[Response], Any], response: Response) -> Any:
    """A joined rank's part in ``response``; nobody waits on it, so failures are logged."""
    try:
        return fill(response)
    except Exception:
        log.exception("pycoll: a joined rank could not take part in '%s'", response.name)
        raise


# ---------------------------------------------------------------- one negotiator per group

_negotiators: Dict[int, Negotiator] = {}
_registry_lock = threading.Lock()
_at_exit: list = []


def negotiator(group=None) -> Negotiator:
    """The negotiator of ``group`` (None: the world; a Group or an mpi4py communicator),
    made at the first call, which every rank of the group must reach (it is collective)."""
    grp = runtime.resolve(group)
    with _registry_lock:
        found = _negotiators.get(id(grp))
        if found is None or found.group is not grp or grp.freed:
            if found is not None:
                found.stop(timeout=0.5)
            if not _at_exit:
                # Registered after pycoll.init's handler, so it runs first: negotiators
                # stop while the engine still runs.
                _at_exit.append(atexit.register(shutdown))
            found = _negotiators[id(grp)] = Negotiator(grp)
    return found


def release(group) -> None:
    """Stop ``group``'s negotiator, if it has one (every rank of the group calls this)."""
    with _registry_lock:
        found = _negotiators.pop(id(group), None)
    if found is not None and found.group is group:
        found.stop()


def shutdown() -> None:
    """Stop every negotiator: before ``pycoll.shutdown()``, and at exit."""
    with _registry_lock:
        found = list(_negotiators.values())
        _negotiators.clear()
    for n in found:
        if not n.group.freed:
            n.stop(timeout=1.0)



# ---------------------------------------------------------------- named collectives

def submit(name: str, kind: str, start: Callable[[Response], Any], meta: tuple = (),
           group=None, local: Any = None) -> Ticket:
    """Negotiate an operation of your own: ``start(response)`` runs once every rank of
    ``group`` has submitted ``name`` with equal ``meta``, in the same order everywhere."""
    return negotiator(group).submit(Request(name, kind, tuple(meta), local), start)


def _meta(x) -> tuple:
    from .tensors import as_buffer
    buf = as_buffer(x)
    return buf, (("dtype", buf.dtype), ("shape", tuple(buf.shape)), ("device", buf.device))


def allreduce_async(x, name: str, op="average", group=None, inplace: bool = False) -> Ticket:
    """``pycoll.allreduce_async`` matched by ``name`` instead of by issue order."""
    from . import collectives
    op = collectives.reduce_op(op)
    _, meta = _meta(x)
    issue = collectives.allreduce_async_ if inplace else collectives.allreduce_async
    return submit(name, "allreduce", lambda r: issue(x, op=op, group=group, name=name),
                  meta + (("op", op.value),), group)


def allreduce_async_(x, name: str, op="average", group=None) -> Ticket:
    return allreduce_async(x, name, op, group, inplace=True)


def allgather_async(x, name: str, group=None) -> Ticket:
    """``pycoll.allgather_async`` matched by ``name`` (dim-0 sizes may differ)."""
    from . import collectives
    buf, _ = _meta(x)
    meta = (("dtype", buf.dtype), ("row shape", tuple(buf.shape[1:])), ("device", buf.device))
    return submit(name, "allgather", lambda r: collectives.allgather_async(x, group=group,
                                                                           name=name),
                  meta, group, local=tuple(buf.shape[:1]))


def broadcast_async(x, name: str, root: int = 0, group=None, inplace: bool = False) -> Ticket:
    """``pycoll.broadcast_async`` matched by ``name``; ``root`` is a rank of ``group``."""
    from . import collectives
    _, meta = _meta(x)
    issue = collectives.broadcast_async_ if inplace else collectives.broadcast_async
    return submit(name, "broadcast", lambda r: issue(x, root=root, group=group, name=name),
                  meta + (("root", root),), group)


def broadcast_async_(x, name: str, root: int = 0, group=None) -> Ticket:
    return broadcast_async(x, name, root, group, inplace=True)
