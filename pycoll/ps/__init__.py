"""pycoll.ps: a sharded parameter server with BSP, ASP, SSP and FluentPS.

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
  layout from the declared names, shapes and dtypes. Keys of 1 MiB or more are split
  into one range per server, smaller ones go whole to the least loaded server.
- Requests (``worker``, ``wire``): push, pull and push_pull return ``Work`` at once; one
  thread per worker drives the nonblocking MPI traffic, so requests to different servers
  overlap, and data goes straight between tensors and the wire where it can. The server
  answers a pull with one raw message per request.
- Updates (``server``): a push carries gradients (server-side ``SGD`` with momentum and
  weight decay) or, without an optimizer, steps the worker's own optimizer computed,
  which the server adds. Each push counts 1/N (N workers): BSP applies the mean of one
  clock's N pushes as one update, so BSP equals synchronous data-parallel SGD; other
  policies apply each push on arrival.
- Consistency (``policy``): every server decides alone from its own workers' clocks (a
  worker's clock at a server = its pushes there). BSP: a pull at clock c waits for all
  workers at c. ASP: never waits. SSP(s): waits for all at c - s; like a PS without
  request buffering, the server refuses a pull that must wait and the worker polls
  again. FluentPS(s): the same bound, but a pull that must wait is buffered and
  answered the moment it may be (no polling); a worker L clocks ahead of the slowest is
  paused with probability (L/(s+1))^8, always past the bound, and released with room
  (see ``policy.FluentPS``). R²SP and SaPS plug in as policies.
- Counters: per worker (``counters()["worker"]``) and per server (pushes, pulls, delayed
  pulls, delay, bytes, clocks); ``init(stats=path)`` writes all of them as JSON at exit.
- Checkpoints: with ``checkpoint_dir``, servers save parameters, momentum and clocks on
  ``checkpoint()``, every ``checkpoint_every`` seconds and at the end; a job started with
  the same directory and layout resumes: ``init_params`` pulls the saved values and
  ``clock()`` tells where each worker left off.
- Failure: a pull that waits longer than PYCOLL_TIMEOUT for a worker is answered with an
  error naming that worker; a request a server does not answer fails naming the server.
  Under ``pycollrun`` a dead rank ends the whole job (MPI's abort names its rank).
"""
import atexit
import json
import sys
from typing import Optional

from .. import config, emulation
from . import wire
from .layout import plan
from .optim import SGD
from .policy import ASP, BSP, FluentPS, Policy, SSP, make as make_policy

__all__ = ["init", "shutdown", "init_params", "push", "pull", "push_pull",
           "checkpoint", "counters", "clock", "Policy", "BSP", "ASP", "SSP", "FluentPS",
           "SGD", "TorchWorker"]


class _State:
    client = None            # worker.Client
    comm = None              # all ranks (our duplicate)
    workers_comm = None      # workers only (our duplicate)
    stats_path: Optional[str] = None
    checkpoint_dir: Optional[str] = None


_state = _State()


def init(servers: Optional[int] = None, policy="bsp", optimizer: Optional[SGD] = None,
         checkpoint_dir: Optional[str] = None, checkpoint_every: float = 0.0,
         stats: Optional[str] = None, comm=None, exit_servers: bool = True):
    """Start the parameter server on ``comm`` (default COMM_WORLD); every rank calls it.

    On server ranks this serves until every worker is done, then exits the process;
    with ``exit_servers=False`` it returns the server's counters instead, so the program
    goes on there too (a benchmark that alternates the PS with raw MPI; the workers call
    ``shutdown()`` and ``init()`` again). Returns None on workers.
    ``policy``: "bsp", "asp", "ssp:S", "fluentps:S" or a Policy. ``optimizer``: an
    ``SGD`` the servers run on pushed gradients, or None (servers add pushed steps).
    """
    from mpi4py import MPI
    from .. import runtime
    from .server import Server
    from .worker import Client
    if _state.client is not None:
        raise RuntimeError("pycoll.ps is already initialized; call pycoll.ps.shutdown() first")
    comm = MPI.COMM_WORLD if comm is None else comm
    servers = config.get("servers") if servers is None else int(servers)
    policy = make_policy(policy)
    if not 1 <= servers < comm.size:
        raise ValueError(f"pycoll.ps needs 1 <= servers < ranks, got servers={servers} with "
                         f"{comm.size} ranks; run e.g. pycollrun -np {max(2, servers + 1)} "
                         f"--servers {max(1, servers)} ...")
    workers = comm.size - servers
    timeout = float(config.get("timeout"))
    own = emulation.p2p(comm.Dup())      # --link paces every message on it
    is_worker = own.rank < workers
    workers_comm = own.Split(0 if is_worker else MPI.UNDEFINED, own.rank)
    if not is_worker:
        server = Server(own, own.rank - workers, workers, policy, optimizer, checkpoint_dir,
                        checkpoint_every, timeout)
        stats = server.serve()
        own.Free()
        if exit_servers:
            sys.exit(0)      # under pycollrun (python -m mpi4py) a clean exit of this rank
        return stats
    _state.comm, _state.workers_comm = own, workers_comm
    _state.stats_path, _state.checkpoint_dir = stats, checkpoint_dir
    _state.client = Client(own, range(workers, comm.size), own.rank, timeout)
    runtime.init(comm=workers_comm)
    atexit.register(shutdown)


def _client():
    if _state.client is None:
        raise RuntimeError("pycoll.ps is not initialized on this rank; call pycoll.ps.init() "
                           "on every rank first")
    return _state.client


def _names(keys):
    return [keys] if isinstance(keys, str) else list(keys)


def _values(keys, values):
    return [values] if isinstance(keys, str) else list(values)


def init_params(params) -> None:
    """Declare the parameters (``{name: tensor}`` or ``[(name, tensor)]``, the same on
    every worker) and set them: worker 0's values seed the servers unless they resumed
    from a checkpoint; then every worker's tensors receive the servers' values in place."""
    client = _client()
    items = list(params.items() if hasattr(params, "items") else params)
    from ..tensors import as_buffer
    specs = [(name, as_buffer(t).shape, as_buffer(t).dtype) for name, t in items]
    client.keys = plan(specs, len(client.server_ranks))
    names, tensors = [n for n, _ in items], [t for _, t in items]
    keys = client.lookup(names)
    if _state.workers_comm.rank == 0:
        bufs = client.buffers(keys, tensors, writable=False)
        parts = client.push_parts(keys, bufs, op=wire.INIT, reply=True)
        client.submit("init_params", parts, keep=tensors).wait()
    _state.workers_comm.Barrier()                  # servers hold every key from here on
    pull(names, tensors).wait()


def push(keys, values):
    """Send gradients (or steps) for ``keys``; Work completes when the tensors may be
    reused. ``keys`` is a name or a list of names, ``values`` a tensor or a list."""
    client = _client()
    names, values = _names(keys), _values(keys, values)
    found = client.lookup(names)
    parts = client.push_parts(found, client.buffers(found, values, writable=False))
    client.counters["pushes"] += 1
    return client.submit(f"pycoll.ps push of {_short(names)}", parts, keep=values)


def _outs(keys, outs, found):
    """Where pulled values land: the caller's tensors, or new numpy arrays."""
    if outs is None:
        import numpy as np
        return [np.empty(k.shape, k.dtype) for k in found]
    return _values(keys, outs)


def pull(keys, outs=None):
    """Fetch ``keys``' parameters into ``outs`` (new numpy arrays if None); Work's result
    is the tensor (one name) or the list of tensors."""
    client = _client()
    names = _names(keys)
    found = client.lookup(names)
    outs = _outs(keys, outs, found)
    parts, unpack = client.pull_parts(found, client.buffers(found, outs, writable=True))
    client.counters["pulls"] += 1

    def finish():
        unpack()
        return outs[0] if isinstance(keys, str) else outs
    return client.submit(f"pycoll.ps pull of {_short(names)}", parts, finish, keep=outs)


def push_pull(keys, values, outs=None):
    """``push`` then ``pull`` in one request per server: each server sees the push first."""
    client = _client()
    names, values = _names(keys), _values(keys, values)
    found = client.lookup(names)
    pushes = client.push_parts(found, client.buffers(found, values, writable=False))
    outs = _outs(keys, outs, found)
    pulls, unpack = client.pull_parts(found, client.buffers(found, outs, writable=True))
    client.counters["pushes"] += 1
    client.counters["pulls"] += 1

    def finish():
        unpack()
        return outs[0] if isinstance(keys, str) else outs
    return client.submit(f"pycoll.ps push_pull of {_short(names)}", pushes + pulls, finish,
                         keep=(values, outs))


def checkpoint() -> None:
    """Make every server save its parameters, optimizer state and clocks now."""
    client = _client()
    parts = [_control(s, wire.CHECKPOINT) for s in range(len(client.server_ranks))]
    client.submit("pycoll.ps checkpoint", parts).wait()


def counters() -> dict:
    """``{"worker": this worker's counters, "servers": [each server's]}``."""
    client = _client()
    parts = [_control(s, wire.STATS) for s in range(len(client.server_ranks))]
    client.submit("pycoll.ps counters", parts).wait()
    return dict(worker=dict(client.counters, clock=clock()),
                servers=[json.loads(bytes(p.data).decode()) for p in parts])


def clock() -> int:
    """This worker's clock: the pushes the servers had received from it at their last
    answers (after a resume, where it left off)."""
    return min(_client().clocks)


def _control(server: int, op: str):
    from .worker import _Part
    return _Part(server, op, [], reply=op != wire.DONE)


def shutdown() -> None:
    """Tell the servers this worker is done (after writing ``stats`` on worker 0); every
    worker calls it, or it runs at exit. Servers exit when every worker is done."""
    client = _state.client
    if client is None:
        return
    if _state.stats_path:
        mine = counters()
        everyone = _state.workers_comm.gather(mine["worker"], root=0)
        if _state.workers_comm.rank == 0:
            with open(_state.stats_path, "w") as f:
                json.dump(dict(workers=everyone, servers=mine["servers"]), f, indent=1)
    parts = [_control(s, wire.DONE) for s in range(len(client.server_ranks))]
    client.submit("pycoll.ps shutdown", parts).wait()
    client.close()
    _state.client = None
    atexit.unregister(shutdown)


def _short(names) -> str:
    shown = ", ".join(repr(n) for n in names[:3])
    return f"[{shown}{', ...' if len(names) > 3 else ''}] ({len(names)} keys)"



def __getattr__(name):
    if name == "TorchWorker":          # imports torch: only when asked for
        from .model import TorchWorker
        return TorchWorker
    raise AttributeError(f"module 'pycoll.ps' has no attribute {name!r}")
