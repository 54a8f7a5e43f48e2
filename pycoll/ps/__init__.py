"""pycoll.ps: a sharded parameter server with BSP, ASP, SSP, FluentPS, R²SP and SaPS.

    import pycoll, pycoll.ps as ps
    ps.init(servers=2, policy="fluentps:3", optimizer=ps.SGD(lr=0.1, momentum=0.9))
    ps.init_params(dict(model.named_parameters()))     # worker 0's values seed the servers
    for batch in data:
        ...backward...
        ps.push_pull(names, grads, outs=params).wait()

Design
- Roles: ``init`` splits COMM_WORLD: the last S ranks (``servers=`` or
  ``pycollrun --servers S``) serve, the others are workers, so a worker's rank is its
  world rank and ``--slowdown RANK:F`` names workers by it. On a server ``init`` runs the
  server loop and exits the process when every worker is done (``shutdown()`` or exit):
  worker code never sees servers. On workers it calls ``pycoll.init`` on the workers'
  communicator, so ``pycoll.rank()``, ``size()`` and collectives count workers only.
- Keys and shards (``layout``): parameters are named; each worker derives the same
  layout from the declared names, shapes and dtypes, which ``init_params`` compares
  across workers first. Keys of 1 MiB or more are split into one range per server,
  smaller ones go whole to the least loaded server.
- Requests (``worker``, ``wire``): push, pull and push_pull return ``Work`` at once; one
  thread per worker drives the nonblocking MPI traffic, so requests to different servers
  overlap, and data goes straight between tensors and the wire where it can. A request
  is a binary header (protocol version, op, tag slot, request id, and per key range its
  dtype, element count and range; never pickled) that the server checks against its
  shards before touching them; every request is answered, a push by an acknowledgement,
  a pull by one raw message of parameters, a bad request by an error text that fails
  its ``Work`` (the server consumes its payload and serves on). Reply tags come from a
  few reused slots below ``MPI.TAG_UB``.
- Updates (``server``): a push carries gradients (server-side ``SGD`` with momentum and
  weight decay) or, without an optimizer, steps the worker's own optimizer computed,
  which the server adds. BSP applies, per key, the mean of one clock's pushes as one
  update: over all N workers, so BSP equals synchronous data-parallel SGD, and once
  some workers are done, over those still active. Other policies apply each push on
  arrival, scaled by 1/N.
- Consistency (``policy``): every server decides alone from its own workers' clocks (a
  worker's clock at a server = its pushes there). BSP: a pull at clock c waits for all
  workers at c. ASP: never waits. SSP(s): waits for all at c - s; like a PS without
  request buffering, the server refuses a pull that must wait and the worker polls
  again. FluentPS(s): the same bound, but a pull that must wait is buffered and
  answered the moment it may be (no polling); a worker L clocks ahead of the slowest is
  paused with probability (L/(s+1))^8, always past the bound, and released with room
  (see ``policy.FluentPS``). R²SP (``r2sp``): workers push in a round robin, one push
  at a time, spaced by the measured period, released by a coordinator on server 0
  (``turn``), with batch sizes split by speed and pushes weighted by samples. SaPS (``saps``): asynchronous,
  stale updates discounted and dropped past a bound, stragglers flagged by a coordinator
  (see ``saps``).
- Versions: a server's version counts the updates applied to its shard; pushes carry the
  version they were computed on, so every update's staleness is known and counted.
- Counters: per worker (``counters()["worker"]``) and per server (pushes, pulls, delayed
  pulls, delay, bytes, clocks, applied staleness per worker, SaPS's, ``waited_for``:
  worker -> seconds pulls waited for it), and the job's stragglers
  (``counters()["stragglers"]``: staleness histograms, SaPS's flags with their times,
  discounted and dropped updates; ``straggler_line`` says it in one line);
  ``init(stats=path)`` writes all of them as JSON at exit; with ``--report`` every
  worker hands them to ``pycoll.timeline`` at shutdown (``waited_for`` maps there name
  the stragglers).
- Checkpoints (``checkpoints``): with ``checkpoint_dir``, servers save numbered
  generations (raw arrays and a JSON manifest with checksums, written durably; the last
  two kept) on ``checkpoint()`` (collective over workers), when worker 0 asks every
  ``checkpoint_every`` seconds, and at the end. Every server saves the same generation:
  worker 0 sends the requests, and under BSP a generation is the state after exactly
  one round. A job started with the same directory resumes from the newest generation
  intact on every server (warning about newer ones it skips; refusing, naming the file,
  if there is none): ``init_params`` pulls the saved values and ``clock()`` tells where
  each worker left off.
- Failure: a pull that waits longer than PYCOLL_TIMEOUT for a worker is answered with an
  error naming that worker; so is a payload that never comes; a request a server does
  not answer fails naming the server; the exchanges of ``init_params``, ``checkpoint``
  and ``shutdown`` name a worker that never joins. Under ``pycollrun`` a dead rank ends
  the whole job (MPI's abort names its rank).
"""
import atexit
import json
import math
import sys
import time
from typing import Optional

from .. import config, emulation, tensors, timeline
from . import wire
from .layout import mismatch, plan
from .optim import SGD
from .policy import ASP, BSP, FluentPS, Policy, SSP, make as make_policy
from .r2sp import R2SP, AdaptiveBatchSampler
from .saps import SaPS, stragglers as _stragglers, summary as _straggler_summary

__all__ = ["init", "shutdown", "init_params", "push", "pull", "push_pull", "turn",
           "checkpoint", "counters", "clock", "straggler_line", "Policy", "BSP", "ASP", "SSP",
           "FluentPS", "R2SP", "AdaptiveBatchSampler", "SaPS", "SGD", "TorchWorker"]


class _State:
    client = None            # worker.Client
    comm = None              # all ranks (our duplicate)
    workers_comm = None      # workers only (our duplicate)
    stats_path: Optional[str] = None
    policy: Optional[Policy] = None
    checkpoint_every = 0.0   # worker 0 asks for a checkpoint this often (seconds)
    last_checkpoint = 0.0
    background: list = []    # worker 0's periodic checkpoint requests still running


_state = _State()


def init(servers: Optional[int] = None, policy="bsp", optimizer: Optional[SGD] = None,
         checkpoint_dir: Optional[str] = None, checkpoint_every: float = 0.0,
         stats: Optional[str] = None, comm=None, exit_servers: bool = True,
         tag_ub: Optional[int] = None):
    """Start the parameter server on ``comm`` (default COMM_WORLD); every rank calls it.

    On server ranks this serves until every worker is done, then exits the process;
    with ``exit_servers=False`` it returns the server's counters instead, so the program
    goes on there too (a benchmark that alternates the PS with raw MPI; the workers call
    ``shutdown()`` and ``init()`` again). Returns None on workers.
    ``policy``: "bsp", "asp", "ssp:S", "fluentps:S", "r2sp[:knob=value,...]",
    "saps[:KNOB=V,...]" or a Policy. ``optimizer``: an ``SGD`` the servers run on pushed
    gradients, or None (servers add pushed steps).
    ``checkpoint_dir``: where servers save generations and resume from; with
    ``checkpoint_every`` > 0 worker 0 asks for one every that many seconds (at a push).
    ``tag_ub``: the largest MPI tag workers use (default the communicator's
    ``MPI.TAG_UB``; tests shrink it to see the tags wrap around).
    """
    from mpi4py import MPI
    from .. import runtime
    from ..work import wait_requests
    from ..work import CollectiveTimeout
    from .server import Server
    from .worker import Client
    from .wire import _LEFT
    if _state.client is not None:
        raise RuntimeError("pycoll.ps is already initialized; call pycoll.ps.shutdown() first")
    comm = MPI.COMM_WORLD if comm is None else comm
    servers = config.get("servers") if servers is None else int(servers)
    policy = make_policy(policy)
    if not 1 <= servers < comm.size:
        raise ValueError(f"pycoll.ps needs 1 <= servers < ranks, got servers={servers} with "
                         f"{comm.size} ranks; run e.g. pycollrun -np {max(2, servers + 1)} "
                         f"--servers {max(1, servers)} ...")
    if tag_ub is not None:
        wire.Slots(int(tag_ub))              # raises if it leaves no slot, on every rank
    workers = comm.size - servers
    timeout = float(config.get("timeout"))
    # Dup and Split block until every rank comes: a bounded barrier first (a collective,
    # so it never meets the user's messages on ``comm``).
    arrived = comm.Ibarrier()
    if wait_requests([arrived], timeout, None):
        _LEFT.append(arrived)
        raise CollectiveTimeout(f"pycoll.ps.init: not every one of the {comm.size} ranks called "
                                f"init within {timeout:g} s; a rank may have died, hung or "
                                "skipped it (PYCOLL_TIMEOUT sets the limit)")
    timeline.begin(comm)                 # before the split: servers are on the timeline too
    own = emulation.p2p(comm.Dup())      # --link paces every message on it
    is_worker = own.rank < workers
    mine = own.Split(0 if is_worker else 1, own.rank)     # the workers', or the servers'
    if not is_worker:
        timeline.role(f"PS server {own.rank - workers}")
        server = Server(own, mine, own.rank - workers, workers, policy, optimizer,
                        checkpoint_dir, timeout)
        stats = server.serve()
        mine.Free()
        own.Free()
        if exit_servers:
            sys.exit(0)      # under pycollrun (python -m mpi4py) a clean exit of this rank
        return stats
    _state.comm, _state.workers_comm = own, mine
    _state.stats_path = stats
    _state.policy = policy
    _state.checkpoint_every = float(checkpoint_every) if checkpoint_dir else 0.0
    _state.last_checkpoint, _state.background = time.monotonic(), []
    _state.client = Client(own, range(workers, comm.size), own.rank, timeout, tag_ub)
    runtime.init(comm=mine)
    atexit.register(shutdown)


def _client():
    if _state.client is None:
        raise RuntimeError("pycoll.ps is not initialized on this rank; call pycoll.ps.init() "
                           "on every rank first")
    return _state.client


def _exchange(data: bytes, what: str) -> list:
    """Every worker's ``data`` (bounded by PYCOLL_TIMEOUT, naming a worker that is missing)."""
    return wire.exchange(_state.workers_comm, data, what, "worker", _client().timeout)


def _on_every_worker(what: str, action) -> None:
    """Run ``action`` on worker 0; if it fails, raise its error on every worker."""
    error = b""
    if _state.workers_comm.rank == 0:
        try:
            action()
        except Exception as err:
            error = str(err).encode()
    failures = [e.decode() for e in _exchange(error, what) if e]
    if failures:
        raise RuntimeError(f"pycoll.ps: {what} failed on worker 0: {failures[0]}")


def _names(keys):
    return [keys] if isinstance(keys, str) else list(keys)


def _values(keys, values):
    return [values] if isinstance(keys, str) else list(values)


def init_params(params) -> None:
    """Declare the parameters (``{name: tensor}`` or ``[(name, tensor)]``, the same on
    every worker) and set them: worker 0's values seed the servers unless they resumed
    from a checkpoint; then every worker's tensors receive the servers' values in place.
    Workers compare their declarations first: any difference (a name, shape, dtype or
    the order) raises ``ValueError`` on every worker, naming the key and both sides."""
    client = _client()
    items = list(params.items() if hasattr(params, "items") else params)
    from ..tensors import as_buffer
    specs = [(str(name), tuple(as_buffer(t).shape), as_buffer(t).dtype) for name, t in items]
    declared = json.dumps([[n, list(shape), dtype] for n, shape, dtype in specs]).encode()
    problem = mismatch([json.loads(d) for d in _exchange(declared, "init_params")])
    if problem:
        raise ValueError(f"pycoll.ps.init_params: {problem}")
    client.keys = plan(specs, len(client.server_ranks))
    names, tensors = [n for n, _ in items], [t for _, t in items]
    keys = client.lookup(names)

    def seed():
        parts, _ = client.parts(wire.INIT, keys, sources=client.buffers(keys, tensors, False))
        client.submit("pycoll.ps init_params", parts, keep=tensors).wait()
    _on_every_worker("init_params", seed)          # servers hold every key from here on
    pull(names, tensors).wait()
    client.pushed = list(client.clocks)


def _tick(client) -> None:
    """Worker 0's periodic checkpoint requests: raise the error of one that failed, and
    ask for the next when it is time."""
    for work in [w for w in _state.background if w.is_completed()]:
        _state.background.remove(work)
        work.wait()
    if _state.checkpoint_every and _state.workers_comm.rank == 0 and \
            time.monotonic() - _state.last_checkpoint >= _state.checkpoint_every:
        _state.last_checkpoint = time.monotonic()
        _state.background.append(_request_checkpoint(client))


def _weight(weight) -> float:
    if not 0 < float(weight) < float("inf"):
        raise ValueError(f"pycoll.ps: a push's weight must be positive and finite, got {weight!r}")
    return float(weight)


def push(keys, values, weight: float = 1.0, turn=None):
    """Send gradients (or steps) for ``keys``; Work completes when every server holding
    them has acknowledged the push (or fails with a server's error). ``keys`` is a name
    or a list of names, ``values`` a tensor or a list. Servers multiply the values by
    ``weight`` (R²SP's sample weight, from ``turn``). ``turn``: R²SP, a turn asked for
    with ``turn(samples, wait=False)``; the push goes out when it is granted and its
    hold is over, weighing ``weight`` times the turn's weight, and the caller does not
    wait for it (its Work fails with the turn's error, if any)."""
    client = _client()
    _tick(client)
    names, values = _names(keys), _values(keys, values)
    found = client.lookup(names)
    parts, _ = client.parts(wire.PUSH, found, sources=client.buffers(found, values, False),
                            weight=_weight(weight))
    client.counters["pushes"] += 1
    return client.submit(f"pycoll.ps push of {_short(names)}", parts, keep=values,
                         gate=None if turn is None else turn.gate)


def _outs(keys, outs, found):
    """Where pulled values land: the caller's tensors, or new numpy arrays."""
    if outs is None:
        import numpy as np
        return [np.empty(k.shape, tensors.numpy_dtype(k.dtype)) for k in found]
    return _values(keys, outs)


def _pulling(op, keys, names, values=None, outs=None, weight: float = 1.0, turn=None,
             priority: float = 0.0):
    if not isinstance(priority, (int, float)) or not -math.inf < priority < math.inf:
        raise ValueError(f"pycoll.ps: a pull's priority must be a finite number (smaller "
                         f"is answered first), got {priority!r}")
    client = _client()
    found = client.lookup(names)
    sources = None if values is None else client.buffers(found, values, writable=False)
    outs = _outs(keys, outs, found)
    parts, unpack = client.parts(op, found, sources, client.buffers(found, outs, writable=True),
                                 _weight(weight), float(priority))
    client.counters["pulls"] += 1
    client.counters["pushes"] += values is not None

    def finish():
        unpack()
        return outs[0] if isinstance(keys, str) else outs
    return client.submit(f"pycoll.ps {wire.OP_NAMES[op]} of {_short(names)}", parts, finish,
                         keep=(values, outs), gate=None if turn is None else turn.gate)


def pull(keys, outs=None, priority: float = 0.0):
    """Fetch ``keys``' parameters into ``outs`` (new numpy arrays if None); Work's result
    is the tensor (one name) or the list of tensors. ``priority``: a server with answers
    waiting (``PYCOLL_PS_REPLY_CREDIT``) sends the smaller first."""
    return _pulling(wire.PULL, keys, _names(keys), outs=outs, priority=priority)


def push_pull(keys, values, outs=None, weight: float = 1.0, turn=None, priority: float = 0.0):
    """``push`` (with ``weight`` and ``turn``) then ``pull`` (with ``priority``) of the
    same keys, one request per server: each server applies the push first, and its
    answer (the parameters) acknowledges it."""
    _tick(_client())
    return _pulling(wire.PUSH_PULL, keys, _names(keys), _values(keys, values), outs, weight,
                    turn, priority)


def turn(samples: int, busy_s: float = 0.0, wait: bool = True, compute_s: float = 0.0):
    """R²SP: wait for this worker's turn to push (see ``r2sp``). ``samples``: in the
    gradient to be pushed; ``busy_s``: how long this worker's last iteration took, less
    its wait for the turn (periods and batch sizes follow it; 0 if unknown);
    ``compute_s``: of that, the computing, which grows with the batch (the rest, the
    communication, does not; 0 if unknown: all of ``busy_s`` is taken to grow). Returns
    ``{"weight": for that push, "batch": the next batch size, "period_s", "gap_s",
    "delay_s": the hold before pushing, "push_at": its end (time.monotonic()), "lost":
    turns this worker lost since its last one}`` once the hold is over: push right
    then. With ``wait=False`` it returns at once an object whose ``wait()`` returns the
    answer likewise; ask as the computing starts, so the gate's messages overlap the
    compute, and either wait before pushing or hand it to ``push``/``push_pull``
    (``turn=``), whose request then goes out by itself at the turn. ``turn(0)`` leaves
    the ring (done training; asking again rejoins it) and answers a turn still asked for
    with ``{}``."""
    client = _client()
    if not _state.policy.turns:
        raise RuntimeError(f"pycoll.ps.turn() is for policies whose workers take turns "
                           f"(r2sp); this job runs {_state.policy}")
    if int(samples) != samples or samples < 0:
        raise ValueError(f"pycoll.ps.turn: samples must be an integer >= 0, got {samples!r}")
    if not 0 <= compute_s <= busy_s:
        raise ValueError(f"pycoll.ps.turn: compute_s ({compute_s!r}) must be between 0 and "
                         f"busy_s ({busy_s!r}): it is the computing part of the busy time")
    parts = client.control(wire.TURN, arg=int(samples), servers=[0], value=float(busy_s),
                           value2=float(compute_s))

    def answer():
        got = json.loads(bytes(parts[0].data).decode())
        if got:                                  # not void (the worker left the ring)
            client.counters["turns"] = client.counters.get("turns", 0) + 1
            client.counters["batch_size"] = got["batch"]
            got["push_at"] = time.monotonic() + got["delay_s"]     # the push's slot
        return got
    pending = _Turn(client, client.submit("pycoll.ps turn", parts, answer))
    return pending.wait() if wait else pending


class _Turn:
    """A turn asked for; ``wait()`` returns the coordinator's answer (counting the wait)."""

    def __init__(self, client, work):
        self.client, self.work = client, work

    def gate(self):
        """For the communication thread: None until the answer is in, then (when the push
        may go, the factor of its weight); raises the turn's error."""
        if not self.work.is_completed():
            return None
        got = self.work.wait()
        if not got:
            raise RuntimeError("pycoll.ps: a push waited for a turn that turn(0) voided; "
                               "leave the ring only after the last push")
        return got["push_at"], got["weight"]

    def held(self, since: float) -> float:
        """How long a push handed over at ``since`` was held for this turn (counted as
        turn wait); call once the push is answered."""
        held = max(0.0, self.work.wait()["push_at"] - since)
        counters = self.client.counters
        counters["turn_wait_s"] = counters.get("turn_wait_s", 0.0) + held
        return held

    def wait(self) -> dict:
        started = time.monotonic()
        try:
            got = self.work.wait()
            emulation.sleep_until(got.get("push_at", 0.0))
            return got
        finally:
            counters = self.client.counters
            counters["turn_wait_s"] = counters.get("turn_wait_s", 0.0) + time.monotonic() - started


def _request_checkpoint(client):
    """Worker 0 asks every server for the next generation; under BSP the cut is its own
    push count at each server (see Server._on_checkpoint)."""
    parts = client.control(wire.CHECKPOINT, arg=lambda s: client.pushed[s])
    return client.submit("pycoll.ps checkpoint", parts)


def checkpoint() -> None:
    """Every worker calls it (with no request of its own in flight): once all have,
    worker 0 asks every server to save the same generation, and all return when it is
    written, so the generation is one consistent state under any policy."""
    client = _client()
    _exchange(b"", "checkpoint")
    _on_every_worker("checkpoint", lambda: _request_checkpoint(client).wait())


def counters() -> dict:
    """``{"worker": this worker's counters, "servers": [each server's], "stragglers": the
    job's staleness histograms per worker and SaPS's flags, discounted and dropped}``."""
    client = _client()
    parts = client.control(wire.STATS)
    client.submit("pycoll.ps counters", parts).wait()
    servers = [json.loads(bytes(p.data).decode()) for p in parts]
    return dict(worker=dict(client.counters, clock=clock()), servers=servers,
                stragglers=_stragglers(servers))


def straggler_line(stats: Optional[dict] = None) -> str:
    """The straggler line of an end-of-run summary, from ``counters()`` (or ``stats``,
    what it returned): SaPS's flags with their times, updates discounted and dropped,
    and the applied staleness; under other policies the staleness alone."""
    return _straggler_summary((stats or counters())["stragglers"])


def clock() -> int:
    """This worker's clock: the pushes the servers had received from it at their last
    answers (after a resume, where it left off)."""
    return min(_client().clocks)


def shutdown() -> None:
    """Tell the servers this worker is done (after writing ``stats`` on worker 0); every
    worker calls it, or it runs at exit. Servers exit when every worker is done."""
    client = _state.client
    if client is None:
        return
    try:
        if client._failed is not None:
            _farewell(client)
        else:
            for work in _state.background:
                work.wait()
            if config.get("report"):
                stats = counters()
                timeline.ps_counters(dict(stats, straggler_line=straggler_line(stats)))
            if _state.stats_path:
                mine = counters()
                everyone = [json.loads(b) for b in _exchange(
                    json.dumps(mine["worker"]).encode(), "shutdown (stats)")]
                if _state.workers_comm.rank == 0:
                    with open(_state.stats_path, "w") as f:
                        json.dump(dict(workers=everyone, servers=mine["servers"],
                                       stragglers=mine["stragglers"]), f, indent=1)
            client.submit("pycoll.ps shutdown", client.control(wire.DONE)).wait()
    finally:
        client.close()
        _state.client = None
        _state.background = []
        atexit.unregister(shutdown)


def _farewell(client) -> None:
    """DONE to every server from this thread, when the worker's own thread has failed:
    the servers must not wait for a worker that is gone (their answers go unread)."""
    from mpi4py import MPI
    sends = []
    for rank in client.server_ranks:
        client._next_id += 1
        header = wire.encode(wire.DONE, 0, client._next_id)
        sends.append((client.comm.Isend([header, MPI.BYTE], rank, wire.REQUEST), header))
    from ..work import wait_requests
    wait_requests([r for r, _ in sends], client.timeout, None)


def _short(names) -> str:
    shown = ", ".join(repr(n) for n in names[:3])
    return f"[{shown}{', ...' if len(names) > 3 else ''}] ({len(names)} keys)"


def __getattr__(name):
    if name == "TorchWorker":          # imports torch: only when asked for
        from .model import TorchWorker
        return TorchWorker
    raise AttributeError(f"module 'pycoll.ps' has no attribute {name!r}")
