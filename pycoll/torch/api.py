"""Horovod's PyTorch API (``horovod.torch``) over pycoll's collectives.

Every operation is matched across ranks by name, as Horovod's controller matches them
(``pycoll.negotiation``): ranks may submit in different orders, a joined rank takes part
in the others' allreduces, and a name submitted with different shapes fails on every
rank that submitted it. An unnamed operation is named ``<kind>.noname.<handle>``, as in
Horovod, so unnamed operations match while every rank has made as many calls.

Async calls return an int handle; ``synchronize(handle)`` returns the output and
``poll(handle)`` says whether it is ready. A name may not be reused while its operation
is still running. Errors of an operation that was submitted (mismatches, stalls) raise
``HorovodInternalError`` from ``synchronize``; bad arguments raise at the call.
``allreduce``, ``allgather``, ``broadcast``, ``alltoall`` and ``reducescatter`` (and the
grouped forms) are differentiable, as Horovod's are.
"""
import itertools
import pickle
import threading
from typing import Any, Callable, Dict, List, Optional

import torch

import pycoll
from pycoll import Average, Max, Min, Product, Sum, negotiation, ops, runtime, tensors  # noqa: F401

from . import adasum as _adasum
from .compression import Compression

Adasum = "adasum"       # Horovod's Adasum: the algorithm, for power-of-2 ranks (adasum.py)


class HorovodInternalError(RuntimeError):
    """An operation failed after it was submitted (mismatched shapes or types, a stall,
    a broken group): what Horovod raises from ``synchronize``. The pycoll error is the
    ``__cause__``."""


class HostsUpdatedInterrupt(RuntimeError):
    """Horovod's elastic interrupt; a pycoll job's ranks are fixed (``pycoll.torch.elastic``),
    so it is never raised."""

    def __init__(self, skip_sync=False):
        super().__init__("hosts updated")
        self.skip_sync = skip_sync


# ---------------------------------------------------------------- what this build is

def mpi_built() -> bool:
    """pycoll runs on MPI (mpi4py)."""
    return True


def mpi_enabled() -> bool:
    return True


def gloo_built() -> bool:
    """No Gloo controller in pycoll (torch's gloo backend is torch's, not pycoll's)."""
    return False


gloo_enabled = gloo_built


def nccl_built() -> int:
    """0: pycoll has no NCCL path (GPU tensors are staged through host memory or handed to
    a CUDA-aware MPI). Horovod returns the NCCL version when it has one."""
    return 0


def ddl_built() -> bool:
    return False


def ccl_built() -> bool:
    return False


def rocm_built() -> bool:
    return False


def cuda_built() -> bool:
    """Whether pycoll's CUDA kernels were built (``pycoll.has_cuda()``)."""
    return pycoll.has_cuda()


def mpi_threads_supported() -> bool:
    """Whether MPI was initialized with MPI_THREAD_MULTIPLE."""
    from mpi4py import MPI
    return MPI.Query_thread() == MPI.THREAD_MULTIPLE


def start_timeline(file_path, mark_cycles=False):
    """Horovod starts its own timeline format here; pycoll's trace is set up at start."""
    raise NotImplementedError(
        "pycoll writes its timeline (a Chrome trace) from the start: run under "
        f"`pycollrun --timeline {file_path}` (or PYCOLL_TIMELINE, pycoll.init(timeline=...)) "
        "and switch recording with pycoll.timeline.start()/stop() or --timeline-steps")


def stop_timeline():
    raise NotImplementedError("pycoll's timeline stops with pycoll.timeline.stop() and is "
                              "written at exit; see start_timeline")


# ---------------------------------------------------------------- process sets

class ProcessSet:
    """Ranks that operations may run on (``process_set=``), as Horovod's: made from a
    list of world ranks or an mpi4py communicator, usable once registered
    (``add_process_set`` or ``init(process_sets=...)``). ``rank()`` and ``size()`` are
    None until then; roots of broadcasts are world ranks, as in Horovod."""

    def __init__(self, ranks_or_comm=None):
        self.process_set_id: Optional[int] = None
        self.mpi_comm = None
        self.ranks: Optional[List[int]] = None
        if ranks_or_comm is None:
            pass
        elif hasattr(ranks_or_comm, "Get_group") and hasattr(ranks_or_comm, "Allreduce"):
            self.mpi_comm = ranks_or_comm
        else:
            ranks = sorted(ranks_or_comm)
            if any(not isinstance(r, int) for r in ranks):
                raise ValueError("ProcessSet takes a list of process ranks or an mpi4py "
                                 "communicator")
            self.ranks = ranks
        self._group: Optional[pycoll.Group] = None

    @property
    def group(self) -> pycoll.Group:
        if self.process_set_id is None:
            raise ValueError(f"{self} is not registered; call pycoll.torch.add_process_set() "
                             "(or pass it to init(process_sets=...)) first")
        return runtime.world() if self.process_set_id == 0 else self._group

    def included(self) -> Optional[bool]:
        """Whether this process is in the set (None while its ranks are unknown)."""
        return None if self.ranks is None else pycoll.rank() in self.ranks

    def rank(self) -> Optional[int]:
        """This process's rank within the set: -1 outside it, None if not registered."""
        if self.process_set_id is None:
            return None
        return self.ranks.index(pycoll.rank()) if self.included() else -1

    def size(self) -> Optional[int]:
        return None if self.process_set_id is None else len(self.ranks)

    def __repr__(self) -> str:
        return f"ProcessSet(process_set_id={self.process_set_id}, ranks={self.ranks})"


global_process_set = ProcessSet()
_process_sets: Dict[int, ProcessSet] = {}
_next_set_id = itertools.count(1)


def _comm_ranks(comm) -> List[int]:
    """World ranks of ``comm``'s processes."""
    from mpi4py import MPI
    world = runtime.world().comm.Get_group()
    theirs = comm.Get_group()
    try:
        return sorted(MPI.Group.Translate_ranks(theirs, list(range(comm.Get_size())), world))
    finally:
        theirs.Free()
        world.Free()


def _resolved(process_set) -> ProcessSet:
    """``process_set`` (a ProcessSet or a list of world ranks) with its ranks known and
    checked; registered by nothing yet."""
    if not isinstance(process_set, ProcessSet):
        process_set = ProcessSet(process_set)
    if process_set.ranks is None and process_set.mpi_comm is not None:
        process_set.ranks = _comm_ranks(process_set.mpi_comm)
    ranks = process_set.ranks
    if ranks is None:
        raise ValueError("a ProcessSet needs ranks (or an mpi4py communicator)")
    n = pycoll.size()
    if not ranks or len(set(ranks)) != len(ranks) or not all(0 <= r < n for r in ranks):
        raise ValueError(f"a process set needs distinct ranks in [0, {n}), got {ranks}")
    return process_set


def _registered(ranks: List[int]) -> Optional[ProcessSet]:
    """The set registered over ``ranks``, the global one included."""
    if ranks == list(range(pycoll.size())):
        return global_process_set
    return next((ps for ps in _process_sets.values() if ps.ranks == ranks), None)


def _register(process_set: ProcessSet) -> ProcessSet:
    process_set._group = pycoll.new_group(process_set.ranks)
    process_set.process_set_id = next(_next_set_id)
    _process_sets[process_set.process_set_id] = process_set
    if process_set._group.is_member:
        negotiation.negotiator(process_set._group)        # collective over the members
    return process_set


def add_process_set(process_set) -> ProcessSet:
    """Register a process set (a ``ProcessSet`` or a list of world ranks) and return it.
    Collective over its members, like Horovod's (every rank may call it)."""
    runtime.world()
    if getattr(process_set, "process_set_id", None) is not None:
        raise ValueError(f"{process_set} is registered already")
    process_set = _resolved(process_set)
    if _registered(process_set.ranks) is not None:
        raise ValueError(f"Attempted to add a duplicate process set: {process_set}")
    return _register(process_set)


def remove_process_set(process_set: ProcessSet) -> bool:
    """Unregister a process set (every rank that added it calls this); False for the
    global set or one that is not registered, as in Horovod."""
    registered = _process_sets.get(process_set.process_set_id)      # None for the global set
    if registered is None or registered._group is not process_set._group:  # not it, nor bound
        return False
    del _process_sets[process_set.process_set_id]
    group, process_set._group, process_set.process_set_id = process_set._group, None, None
    if group.is_member and not group.freed:
        negotiation.release(group)
        group.release()
    return True


def _member(process_set: ProcessSet) -> ProcessSet:
    runtime.world()                         # raises if pycoll is not initialized
    if process_set is global_process_set:
        _start_global()
    if not isinstance(process_set, ProcessSet):
        raise TypeError(f"process_set must be a pycoll.torch.ProcessSet, got "
                        f"{type(process_set).__name__}")
    if not process_set.included() and process_set.process_set_id is not None:
        raise ValueError(f"rank {pycoll.rank()} is not in {process_set}; only its members "
                         "may run operations on it")
    process_set.group                      # raises if not registered
    return process_set


def _negotiator(process_set: ProcessSet) -> negotiation.Negotiator:
    return negotiation.negotiator(process_set.group)


# ---------------------------------------------------------------- start / ranks

def init(comm=None, process_sets=None) -> None:
    """Start pycoll (idempotent). ``comm``: an mpi4py communicator, or a list of world
    ranks to run on; ``process_sets``: sets to register now, or Horovod's ``"dynamic"``
    (none now; ``add_process_set`` works either way)."""
    from mpi4py import MPI
    if isinstance(comm, (list, tuple)):
        ranks, world = sorted(comm), MPI.COMM_WORLD
        if world.rank not in ranks:
            raise ValueError(f"rank {world.rank} is not in init's ranks {ranks}")
        members = world.Get_group().Incl(ranks)
        comm = world.Create_group(members)
        members.Free()
    elif comm is not None:
        global_process_set.mpi_comm = comm          # as Horovod's: the communicator given
    pycoll.init(comm)
    _start_global()
    if isinstance(process_sets, str) and process_sets.lower() == "dynamic":
        process_sets = None
    _init_process_sets(list(process_sets or ()))


def _init_process_sets(process_sets: list) -> None:
    """Horovod's ``init(process_sets=...)``: every set is checked before any is
    registered, so a list with a duplicate registers nothing and a corrected list may be
    passed to init again; a set over ranks an earlier init registered is bound to that
    registration, as Horovod's later inits do."""
    fresh = [ps for ps in process_sets if getattr(ps, "process_set_id", None) is None]
    fresh = [_resolved(ps) for ps in fresh]
    for i, ps in enumerate(fresh):
        if _registered(ps.ranks) is global_process_set or \
                any(o.ranks == ps.ranks for o in fresh[:i]):
            raise ValueError(f"init's process_sets hold a duplicate, {ps} (the global set's "
                             "ranks, or another entry's); none of them was registered")
    for ps in fresh:
        known = _registered(ps.ranks)
        if known is None:
            _register(ps)
        else:
            ps.process_set_id, ps._group = known.process_set_id, known._group


def _start_global() -> None:
    """Register the global set on pycoll's world (collective: every rank's first call to
    init, or to an operation after pycoll.init() alone)."""
    if global_process_set.process_set_id is None:
        world = runtime.world().comm
        _hosts[:] = runtime.engine().run(
            lambda: world.allgather((local_rank(), local_size())), "init")
        negotiation.negotiator(None)
        global_process_set.ranks = list(range(pycoll.size()))
        global_process_set.process_set_id = 0


def shutdown() -> None:
    _handles.clear()
    negotiation.shutdown()
    for process_set in list(_process_sets.values()) + [global_process_set]:
        process_set.process_set_id, process_set._group = None, None
    _process_sets.clear()
    global_process_set.mpi_comm = None
    pycoll.shutdown()


is_initialized, rank, size = pycoll.is_initialized, pycoll.rank, pycoll.size
local_rank, local_size = pycoll.local_rank, pycoll.local_size


_hosts: List[tuple] = []          # every rank's (local rank, local size), read at init


def cross_rank() -> int:
    """The index of this rank's host among the hosts (hosts counted by their local rank 0)."""
    _member(global_process_set)
    return sum(1 for local, _ in _hosts[:rank() + 1] if local == 0) - 1


def cross_size() -> int:
    """The number of hosts."""
    _member(global_process_set)
    return sum(1 for local, _ in _hosts if local == 0)


def is_homogeneous() -> bool:
    """Whether every host runs as many ranks."""
    _member(global_process_set)
    return len({count for _, count in _hosts}) == 1


# ---------------------------------------------------------------- overlap

def overlap_pays(tensor: torch.Tensor) -> bool:
    """``runtime.overlap_pays`` for ``tensor``, computed on by torch's threads."""
    return runtime.overlap_pays(tensor.device.type == "cpu", torch.get_num_threads())


# ---------------------------------------------------------------- handles

class _Handles:
    """int handle -> (ticket, finisher). Unnamed operations are named as in Horovod,
    ``<kind>.noname.<n>``, n counting every operation (named or not) on their process
    set: Horovod counts them per process, so that there an operation on one set shifts the
    names of later unnamed ones on every other."""

    def __init__(self):
        self._lock = threading.Lock()
        self._table: Dict[int, tuple] = {}
        self._running: Dict[str, negotiation.Ticket] = {}     # name -> its latest ticket
        self._next = itertools.count(1)
        self._counts: Dict[int, int] = {}                     # process set id -> operations

    def reserve(self, name: Optional[str], kind: str, process_set: "ProcessSet") -> tuple:
        """(handle, name): a fresh handle, and ``name`` or Horovod's for unnamed ops. A
        name still running is refused before it counts, so a refused call leaves the
        count (and the names of later unnamed operations) as it was."""
        with self._lock:
            if name is not None:
                self.check(name)
            count = self._counts[process_set.process_set_id] = \
                self._counts.get(process_set.process_set_id, 0) + 1
        return next(self._next), name if name is not None else f"{kind}.noname.{count}"

    def count(self, process_set: "ProcessSet") -> int:
        with self._lock:
            return self._counts.get(process_set.process_set_id, 0)

    def resume(self, process_set: "ProcessSet", count: int) -> None:
        """Name later unnamed operations on ``process_set`` from ``count`` on."""
        with self._lock:
            self._counts[process_set.process_set_id] = count

    def check(self, name: str) -> None:
        ticket = self._running.get(name)
        if ticket is not None and not ticket.is_completed():
            raise ValueError(f"an operation named {name!r} is still running; a name may be "
                             "reused only once its operation has finished. Give each pending "
                             "operation its own name.")

    def add(self, handle: int, ticket, finish: Callable[[Any], Any]) -> int:
        with self._lock:
            self._table[handle] = (ticket, finish)
            self._running[ticket.name] = ticket
        return handle

    def pop(self, handle: int) -> tuple:
        with self._lock:
            if handle not in self._table:
                raise ValueError(f"unknown handle {handle!r}: it was synchronized already or "
                                 "never returned by an *_async call")
            ticket, finish = self._table.pop(handle)
            if self._running.get(ticket.name) is ticket:
                del self._running[ticket.name]
        return ticket, finish

    def get(self, handle: int):
        with self._lock:
            if handle not in self._table:
                raise ValueError(f"unknown handle {handle!r}: it was synchronized already or "
                                 "never returned by an *_async call")
            return self._table[handle][0]

    def clear(self) -> None:
        with self._lock:
            self._table.clear()
            self._running.clear()
            self._counts.clear()


_handles = _Handles()


def align_names(process_set=global_process_set) -> None:
    """pycoll's own: after the members of ``process_set`` issued different numbers of
    operations on it (a ``join``, an operation some ranks skipped), name their later
    unnamed operations alike again, each continuing from the highest count. Collective
    over the set's members. Horovod has no such call: there the names stay apart."""
    _member(process_set)
    top = allreduce(torch.tensor([_handles.count(process_set)]), op=Max,
                    name="pycoll.align_names", process_set=process_set)
    _handles.resume(process_set, int(top.item()))


def synchronize(handle: int):
    """Wait for the operation of ``handle``; its output (the tensor, or a list of them).
    Its failure raises ``HorovodInternalError``."""
    ticket, finish = _handles.pop(handle)
    try:
        out = ticket.wait()
    except HorovodInternalError:
        raise
    except Exception as error:
        raise HorovodInternalError(f"{type(error).__name__}: {error}") from error
    return finish(out)


def poll(handle: int) -> bool:
    """Whether the operation of ``handle`` has finished (``synchronize`` won't block)."""
    return _handles.get(handle).is_completed()


def _submit(process_set: ProcessSet, kind: str, name: Optional[str], meta: tuple,
            start: Callable, finish: Callable = lambda out: out, local=None,
            joinable: bool = False, prefix: Optional[str] = None) -> int:
    """Negotiate an operation on ``process_set``: ``start(response)`` issues it once every
    member has submitted ``name``; ``finish(output)`` is what ``synchronize`` returns."""
    process_set = _member(process_set)
    handle, name = _handles.reserve(name, prefix or kind, process_set)
    request = negotiation.Request(name, kind, meta, local, joinable)
    ticket = _negotiator(process_set).submit(request, lambda response: start(name, response))
    return _handles.add(handle, ticket, finish)


# ---------------------------------------------------------------- tensors and numbers

_DTYPES = {getattr(torch, name): name for name in tensors.DTYPES}


def _check(tensor, what: str) -> str:
    """The dtype name of ``tensor``, refused here as Horovod refuses it at the call."""
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{what} takes torch tensors, got {type(tensor).__name__}")
    if tensor.dtype not in _DTYPES:
        raise TypeError(f"pycoll does not support dtype {tensor.dtype} ({what}); supported: "
                        f"{', '.join(_DTYPES.values())}")
    if tensor.device.type not in ("cpu", "cuda"):
        raise TypeError(f"{what}: pycoll supports CPU and CUDA tensors, not {tensor.device}")
    if not tensor.is_contiguous():
        raise ValueError(f"{what}: the tensor must be contiguous; pass tensor.contiguous()")
    return _DTYPES[tensor.dtype]


def _reduction(op, average):
    """Horovod's ``average=`` (deprecated) and ``op=``: one of them, Average by default."""
    if op is not None and average is not None:
        raise ValueError("pass op= or the deprecated average=, not both")
    if average is not None:
        return Average if average else Sum
    if op is None:
        return Average
    if op == Adasum:
        return Adasum
    return ops.reduce_op(op)


def _op_name(op) -> str:
    return op if op == Adasum else op.value


def _scale_(tensor: torch.Tensor, factor: float) -> torch.Tensor:
    """``tensor *= factor`` in place, as Horovod scales: floats in their own type (halves
    in float32 on the CPU, as torch computes them), integers in float64, truncated."""
    if factor != 1.0:
        if tensor.is_floating_point():
            tensor.mul_(factor)
        else:
            tensor.copy_((tensor.double() * factor).to(tensor.dtype))
    return tensor


def core_op(op, tensors) -> "pycoll.ReduceOp":
    """The op pycoll runs: Average of integers is a Sum that ``finish_reduce`` divides
    (Horovod's and NCCL's integer Average; the torch backend's AVG uses it too). bool's
    Average stays undefined: pycoll refuses it with the ops it has."""
    if op is Average and any(not t.is_floating_point() and t.dtype != torch.bool
                             for t in tensors):
        return Sum
    return op


# Unsigned dtypes torch cannot divide ("div_trunc_cpu" not implemented).
_NO_DIVISION = (torch.uint16, torch.uint32, torch.uint64)


def finish_reduce(out: torch.Tensor, op, core, postscale: float, n: int) -> torch.Tensor:
    """The postscale, and Average where pycoll ran a Sum (``core_op``): Horovod's
    integer Average is the sum divided by the ranks, truncated toward zero."""
    if op is Average and core is Sum:
        if out.is_floating_point():
            out.div_(n)
        elif postscale != 1.0:
            return _scale_(out, postscale / n)
        elif out.dtype in _NO_DIVISION:     # unsigned: truncation is numpy's floor
            return out.copy_(torch.from_numpy(out.cpu().numpy() // n))
        else:
            return out.copy_(torch.div(out, n, rounding_mode="trunc"))
    return _scale_(out, postscale)


def _tensor_meta(tensor, dtype: str, **fields) -> tuple:
    return (("dtype", dtype), ("shape", tuple(tensor.shape)),
            ("device", tensor.device.type), *fields.items())


# ---------------------------------------------------------------- allreduce

def _allreduce_async(tensors: list, inplace: bool, name, op, prescale: float,
                     postscale: float, process_set: ProcessSet, grouped: bool) -> int:
    what = "grouped_allreduce" if grouped else "allreduce"
    if not tensors:
        raise ValueError(f"{what} needs at least one tensor")
    dtypes = [_check(t, what) for t in tensors]
    if grouped and len({t.device for t in tensors}) > 1:
        raise ValueError("grouped_allreduce: every tensor must be on one device")
    if op == Adasum:
        _adasum.check(tensors, process_set, size())
    prescale, postscale = float(prescale), float(postscale)
    group = _member(process_set).group
    shapes = tuple(tuple(t.shape) for t in tensors)
    meta = (("dtype", tuple(dtypes) if grouped else dtypes[0]),
            ("shape", shapes if grouped else shapes[0]), ("device", tensors[0].device.type),
            ("op", _op_name(op)), ("prescale", prescale), ("postscale", postscale))

    def start(name, response):
        srcs, in_place = [t.detach() for t in tensors], inplace
        if prescale != 1.0:
            srcs = [_scale_(t if inplace else t.clone(), prescale) for t in srcs]
            in_place = True
        if op == Adasum:
            return _adasum.allreduce_async_(srcs if in_place else [t.clone() for t in srcs],
                                            group, name)
        core = core_op(op, srcs)
        if grouped:         # one Work, whose result is the list
            issue = pycoll.grouped_allreduce_async_ if in_place else pycoll.grouped_allreduce_async
            return issue(srcs, op=core, group=group, name=name)
        # Alone: consecutive responses fuse in the engine (Horovod's tensor fusion).
        issue = pycoll.allreduce_async_ if in_place else pycoll.allreduce_async
        return [issue(srcs[0], op=core, group=group, name=name)]

    def finish(outs):
        n, core = process_set.size(), core_op(op, tensors)
        outs = [_scale_(o, postscale) if op == Adasum else
                finish_reduce(o, op, core, postscale, n) for o in outs]
        if inplace:
            for t, o in zip(tensors, outs):
                if o.data_ptr() != t.data_ptr():
                    t.copy_(o)
            outs = list(tensors)
        return outs if grouped else outs[0]
    kind = ("grouped_" if grouped else "") + ("adasum" if op == Adasum else "allreduce")
    return _submit(process_set, kind, name, meta, start, finish,
                   joinable=op != Adasum, prefix=what)


def allreduce_async_(tensor, average=None, name=None, op=None, prescale_factor=1.0,
                     postscale_factor=1.0, process_set=global_process_set) -> int:
    """Start reducing ``tensor`` in place (matched by ``name``); a handle."""
    return _allreduce_async([tensor], True, name, _reduction(op, average), prescale_factor,
                            postscale_factor, process_set, grouped=False)


def allreduce_async(tensor, average=None, name=None, op=None, prescale_factor=1.0,
                    postscale_factor=1.0, process_set=global_process_set) -> int:
    """Start reducing ``tensor`` into a new tensor; the input is not modified."""
    return _allreduce_async([tensor], False, name, _reduction(op, average), prescale_factor,
                            postscale_factor, process_set, grouped=False)


def allreduce_(tensor, average=None, name=None, op=None, prescale_factor=1.0,
               postscale_factor=1.0, process_set=global_process_set):
    return synchronize(allreduce_async_(tensor, average, name, op, prescale_factor,
                                        postscale_factor, process_set))


class _Allreduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, name, op, prescale, postscale, process_set):
        ctx.args = op, prescale, postscale, process_set
        return synchronize(allreduce_async(tensor, None, name, op, prescale, postscale,
                                           process_set))

    @staticmethod
    def backward(ctx, grad):
        op, prescale, postscale, process_set = ctx.args
        if op not in (Sum, Average, Adasum):
            raise RuntimeError(f"allreduce with op {op} has no gradient; only Sum, Average "
                               "and Adasum do")
        return (synchronize(allreduce_async(grad.contiguous(), None, None, op, prescale,
                                            postscale, process_set)),
                None, None, None, None, None)


def allreduce(tensor, average=None, device_dense="", device_sparse="",
              compression=Compression.none, op=None, prescale_factor=1.0,
              postscale_factor=1.0, name=None, process_set=global_process_set):
    """The reduction of ``tensor`` over the ranks, as a new tensor (differentiable)."""
    compressed, context = compression.compress(tensor)
    summed = _Allreduce.apply(compressed, name, _reduction(op, average), prescale_factor,
                              postscale_factor, process_set)
    return compression.decompress(summed, context)


def grouped_allreduce_async_(tensors, average=None, name=None, op=None, prescale_factor=1.0,
                             postscale_factor=1.0, process_set=global_process_set) -> int:
    """One handle for a list of tensors reduced in place together (one fused call per dtype)."""
    return _allreduce_async(list(tensors), True, name, _reduction(op, average),
                            prescale_factor, postscale_factor, process_set, grouped=True)


def grouped_allreduce_async(tensors, average=None, name=None, op=None, prescale_factor=1.0,
                            postscale_factor=1.0, process_set=global_process_set) -> int:
    return _allreduce_async(list(tensors), False, name, _reduction(op, average),
                            prescale_factor, postscale_factor, process_set, grouped=True)


def grouped_allreduce_(tensors, average=None, name=None, op=None, prescale_factor=1.0,
                       postscale_factor=1.0, process_set=global_process_set) -> list:
    return synchronize(grouped_allreduce_async_(tensors, average, name, op, prescale_factor,
                                                postscale_factor, process_set))


class _GroupedAllreduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, name, op, prescale, postscale, process_set, *tensors):
        ctx.args = op, prescale, postscale, process_set
        return tuple(synchronize(grouped_allreduce_async(list(tensors), None, name, op,
                                                         prescale, postscale, process_set)))

    @staticmethod
    def backward(ctx, *grads):
        op, prescale, postscale, process_set = ctx.args
        if op not in (Sum, Average, Adasum):
            raise RuntimeError(f"grouped_allreduce with op {op} has no gradient")
        grads = [g.contiguous() for g in grads]
        return (None, None, None, None, None,
                *synchronize(grouped_allreduce_async(grads, None, None, op, prescale,
                                                     postscale, process_set)))


def grouped_allreduce(tensors, average=None, name=None, compression=Compression.none, op=None,
                      prescale_factor=1.0, postscale_factor=1.0,
                      process_set=global_process_set) -> list:
    """The reductions of ``tensors`` as new tensors, fused (differentiable)."""
    compressed = [compression.compress(t) for t in tensors]
    outs = _GroupedAllreduce.apply(name, _reduction(op, average), prescale_factor,
                                   postscale_factor, process_set, *[c for c, _ in compressed])
    return [compression.decompress(o, ctx) for o, (_, ctx) in zip(outs, compressed)]


def sparse_allreduce_async(tensor, name, op, process_set=global_process_set):
    """Horovod's sparse allreduce: allgathers of the indices and values (duplicates add up
    when the result is coalesced). Returns a callable that waits and gives the sparse
    result, as Horovod's does."""
    if op not in (Sum, Average):
        raise NotImplementedError(f"sparse allreduce supports Sum and Average, not {op}")
    t = tensor
    indices = allgather_async(t._indices().transpose(0, 1).contiguous(),
                              name=f"{name}.indices", process_set=process_set)
    values = allgather_async(t._values(), name=f"{name}.values", process_set=process_set)

    def handle():
        gathered_values = synchronize(values)
        gathered_indices = synchronize(indices)
        if op is Average:
            gathered_values = gathered_values / process_set.size()
        if gathered_indices.dim() == 0 or gathered_values.dim() == 0:
            return t.new().resize_as_(t)
        return torch.sparse_coo_tensor(gathered_indices.transpose(0, 1), gathered_values,
                                       t.size())
    return handle


# ---------------------------------------------------------------- allgather

def _allgather_async(tensors: list, name, process_set: ProcessSet, grouped: bool) -> int:
    what = "grouped_allgather" if grouped else "allgather"
    if not tensors:
        raise ValueError(f"{what} needs at least one tensor")
    dtypes = [_check(t, what) for t in tensors]
    group = _member(process_set).group
    rows = [tuple(t.shape[1:]) for t in tensors]
    meta = (("dtype", tuple(dtypes)), ("shape after dim 0", tuple(rows)),
            ("device", tensors[0].device.type if tensors else "cpu"))
    if not grouped:
        meta = tuple((k, v[0] if k != "device" else v) for k, v in meta)

    def start(name, response):
        return [pycoll.allgather_async(t.detach(), group=group,
                                       name=name if not grouped else f"{name}[{i}]")
                for i, t in enumerate(tensors)]
    # Rows may differ (pycoll's allgather exchanges them): they are not part of the request.
    return _submit(process_set, what, name, meta, start,
                   (lambda outs: outs) if grouped else (lambda outs: outs[0]))


def allgather_async(tensor, name=None, process_set=global_process_set) -> int:
    return _allgather_async([tensor], name, process_set, grouped=False)


def grouped_allgather_async(tensors, name=None, process_set=global_process_set) -> int:
    return _allgather_async(list(tensors), name, process_set, grouped=True)


def _gathered_slices(grads, dims, process_set) -> list:
    """Horovod's allgather gradient: the averaged gradients, this rank's rows of each."""
    reduced = synchronize(grouped_allreduce_async([g.contiguous() for g in grads], True,
                                                  None, None, 1.0, 1.0, process_set))
    counts = synchronize(grouped_allgather_async([torch.tensor([d], dtype=torch.int32)
                                                  for d in dims], None, process_set))
    r = process_set.rank()
    return [g.narrow(0, int(c[:r].sum()), d) for g, c, d in zip(reduced, counts, dims)]


class _Allgather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, name, process_set):
        ctx.dim, ctx.process_set = tensor.shape[0], process_set
        return synchronize(allgather_async(tensor, name, process_set))

    @staticmethod
    def backward(ctx, grad):
        return _gathered_slices([grad], [ctx.dim], ctx.process_set)[0], None, None


def allgather(tensor, name=None, process_set=global_process_set):
    """Every rank's ``tensor`` concatenated on dim 0 (dim-0 sizes may differ); differentiable."""
    return _Allgather.apply(tensor, name, process_set)


class _GroupedAllgather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, name, process_set, *tensors):
        ctx.dims, ctx.process_set = [t.shape[0] for t in tensors], process_set
        return tuple(synchronize(grouped_allgather_async(list(tensors), name, process_set)))

    @staticmethod
    def backward(ctx, *grads):
        return (None, None, *_gathered_slices(grads, ctx.dims, ctx.process_set))


def grouped_allgather(tensors, name=None, process_set=global_process_set) -> list:
    """``allgather`` of each tensor of a list, negotiated as one operation."""
    return list(_GroupedAllgather.apply(name, process_set, *tensors))


# ---------------------------------------------------------------- broadcast

def _root(root_rank, process_set: ProcessSet) -> int:
    """``root_rank`` (a world rank, as in Horovod) as a rank of the set's group."""
    ranks = _member(process_set).ranks
    if isinstance(root_rank, bool) or not isinstance(root_rank, int) or root_rank not in ranks:
        raise ValueError(f"root_rank must be a rank of the process set {ranks} (world ranks, "
                         f"as in Horovod), got {root_rank!r}")
    return ranks.index(root_rank)


def _broadcast_async(tensor, root_rank, name, process_set, inplace: bool) -> int:
    dtype = _check(tensor, "broadcast")
    root, group = _root(root_rank, process_set), process_set.group
    issue = pycoll.broadcast_async_ if inplace else pycoll.broadcast_async

    def start(name, response):
        return issue(tensor.detach(), root=root, group=group, name=name)
    return _submit(process_set, "broadcast", name,
                   _tensor_meta(tensor, dtype, root=root_rank), start,
                   (lambda out: tensor) if inplace else (lambda out: out))


def broadcast_async(tensor, root_rank, name=None, process_set=global_process_set) -> int:
    return _broadcast_async(tensor, root_rank, name, process_set, inplace=False)


def broadcast_async_(tensor, root_rank, name=None, process_set=global_process_set) -> int:
    return _broadcast_async(tensor, root_rank, name, process_set, inplace=True)


class _Broadcast(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, root_rank, name, process_set):
        ctx.root, ctx.process_set = root_rank, process_set
        return synchronize(broadcast_async(tensor, root_rank, name, process_set))

    @staticmethod
    def backward(ctx, grad):
        # Horovod's: the averaged gradient on the root, zeros elsewhere.
        reduced = synchronize(allreduce_async(grad.contiguous(), True, None, None, 1.0, 1.0,
                                              ctx.process_set))
        if rank() != ctx.root:
            reduced = reduced * 0
        return reduced, None, None, None


def broadcast(tensor, root_rank, name=None, process_set=global_process_set):
    """``root_rank``'s tensor on every rank, as a new tensor (differentiable)."""
    return _Broadcast.apply(tensor, root_rank, name, process_set)


def broadcast_(tensor, root_rank, name=None, process_set=global_process_set):
    """Overwrite ``tensor`` with ``root_rank``'s; returns it."""
    return synchronize(broadcast_async_(tensor, root_rank, name, process_set))


# ---------------------------------------------------------------- alltoall

def _splits_list(splits, rows: int, n: int) -> Optional[List[int]]:
    if splits is None:
        if rows % n:
            raise ValueError(f"alltoall without splits needs dim 0 ({rows}) divisible by the "
                             f"number of ranks ({n}); pass splits")
        return None
    if isinstance(splits, torch.Tensor):
        if splits.is_floating_point() or splits.is_complex() or splits.dtype == torch.bool:
            raise ValueError(f"alltoall splits must hold integers (int32), got {splits.dtype}")
        splits = splits.tolist()
    splits = [int(s) for s in splits]
    if len(splits) != n or min(splits, default=0) < 0 or sum(splits) != rows:
        raise ValueError(f"alltoall splits must be {n} non-negative row counts summing to "
                         f"dim 0 ({rows}), got {splits}")
    return splits


def alltoall_async(tensor, splits=None, name=None, process_set=global_process_set) -> int:
    """Handle whose ``synchronize`` gives ``(output, received_splits)``."""
    dtype = _check(tensor, "alltoall")
    if tensor.dim() == 0:
        raise ValueError("alltoall splits dim 0 across ranks; got a 0-d tensor")
    group = _member(process_set).group
    sent = _splits_list(splits, tensor.shape[0], process_set.size())
    like = splits if isinstance(splits, torch.Tensor) else torch.empty(0, dtype=torch.int32)

    def start(name, response):
        return pycoll.alltoall_async(tensor.detach(), splits=sent, group=group, name=name)

    def finish(result):
        output, received = result
        return output, torch.as_tensor(received.tolist(), dtype=like.dtype, device=like.device)
    meta = (("dtype", dtype), ("shape after dim 0", tuple(tensor.shape[1:])),
            ("device", tensor.device.type))
    return _submit(process_set, "alltoall", name, meta, start, finish)


class _Alltoall(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, splits, name, process_set):
        output, received = synchronize(alltoall_async(tensor, splits, name, process_set))
        ctx.received, ctx.process_set = received, process_set
        ctx.mark_non_differentiable(received)
        return output, received

    @staticmethod
    def backward(ctx, grad, _):
        back, _ = synchronize(alltoall_async(grad.contiguous(), ctx.received, None,
                                             ctx.process_set))
        return back, None, None, None


def alltoall(tensor, splits=None, name=None, process_set=global_process_set):
    """Row block ``splits[r]`` of ``tensor`` goes to rank r (equal blocks without splits).
    Returns the gathered rows, and with ``splits`` also the rows received from each rank."""
    output, received = _Alltoall.apply(tensor, splits, name, process_set)
    return output if splits is None else (output, received)


# ---------------------------------------------------------------- reducescatter

def _reducescatter_async(tensors: list, name, op, process_set, prescale: float,
                         postscale: float, grouped: bool) -> int:
    what = "grouped_reducescatter" if grouped else "reducescatter"
    if op == Adasum:
        raise NotImplementedError(f"{what} does not support Adasum (as in Horovod)")
    op = _reduction(op, None)
    if not tensors:
        raise ValueError(f"{what} needs at least one tensor")
    dtypes = [_check(t, what) for t in tensors]
    if any(t.dim() == 0 for t in tensors):
        raise ValueError(f"{what} splits dim 0 across ranks; got a 0-d tensor")
    group = _member(process_set).group
    prescale, postscale = float(prescale), float(postscale)
    meta = (("dtype", tuple(dtypes)), ("shape", tuple(tuple(t.shape) for t in tensors)),
            ("device", tensors[0].device.type if tensors else "cpu"), ("op", _op_name(op)),
            ("prescale", prescale), ("postscale", postscale))

    def start(name, response):
        works = []
        for i, t in enumerate(tensors):
            t = t.detach()
            if prescale != 1.0:
                t = _scale_(t.clone(), prescale)
            works.append(pycoll.reduce_scatter_async(t, op=core_op(op, [t]), group=group,
                                                     name=name if not grouped else f"{name}[{i}]"))
        return works

    def finish(outs):
        outs = [finish_reduce(o, op, core_op(op, [t]), postscale, process_set.size())
                for o, t in zip(outs, tensors)]
        return outs if grouped else outs[0]
    return _submit(process_set, what, name, meta, start, finish)


def reducescatter_async(tensor, name=None, op=Average, process_set=global_process_set,
                        prescale_factor=1.0, postscale_factor=1.0) -> int:
    return _reducescatter_async([tensor], name, op, process_set, prescale_factor,
                                postscale_factor, grouped=False)


def grouped_reducescatter_async(tensors, name=None, op=Average, process_set=global_process_set,
                                prescale_factor=1.0, postscale_factor=1.0) -> int:
    return _reducescatter_async(list(tensors), name, op, process_set, prescale_factor,
                                postscale_factor, grouped=True)


def _scattered_grads(grads, op, prescale, postscale, process_set) -> list:
    """Horovod's reducescatter gradient: the gradients scaled as the forward was, gathered."""
    factor = (process_set.size() if op is Sum else 1) * prescale * postscale
    grads = [g.contiguous() * factor if factor != 1 else g.contiguous() for g in grads]
    return synchronize(grouped_allgather_async(grads, None, process_set))


class _Reducescatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, name, op, process_set, prescale, postscale):
        ctx.args = op, prescale, postscale, process_set
        return synchronize(reducescatter_async(tensor, name, op, process_set, prescale,
                                               postscale))

    @staticmethod
    def backward(ctx, grad):
        op, prescale, postscale, process_set = ctx.args
        return (_scattered_grads([grad], op, prescale, postscale, process_set)[0],
                None, None, None, None, None)


def reducescatter(tensor, name=None, compression=Compression.none, op=Average,
                  process_set=global_process_set, prescale_factor=1.0, postscale_factor=1.0):
    """This rank's block of dim 0 of the reduction (the first ranks get the extra rows)."""
    compressed, context = compression.compress(tensor)
    out = _Reducescatter.apply(compressed, name, op, process_set, prescale_factor,
                               postscale_factor)
    return compression.decompress(out, context)


class _GroupedReducescatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, name, op, process_set, prescale, postscale, *tensors):
        ctx.args = op, prescale, postscale, process_set
        return tuple(synchronize(grouped_reducescatter_async(list(tensors), name, op,
                                                             process_set, prescale, postscale)))

    @staticmethod
    def backward(ctx, *grads):
        op, prescale, postscale, process_set = ctx.args
        return (None, None, None, None, None,
                *_scattered_grads(grads, op, prescale, postscale, process_set))


def grouped_reducescatter(tensors, name=None, compression=Compression.none, op=Average,
                          process_set=global_process_set, prescale_factor=1.0,
                          postscale_factor=1.0) -> list:
    """``reducescatter`` of each tensor of a list, negotiated as one operation."""
    compressed = [compression.compress(t) for t in tensors]
    outs = _GroupedReducescatter.apply(name, op, process_set, prescale_factor,
                                       postscale_factor, *[c for c, _ in compressed])
    return [compression.decompress(o, ctx) for o, (_, ctx) in zip(outs, compressed)]


# ---------------------------------------------------------------- barrier and join

def barrier(process_set=global_process_set) -> None:
    """Return once every rank of the set has called it (negotiated: operations submitted
    before it on any rank keep their own order)."""
    synchronize(_submit(process_set, "barrier", "barrier", (), lambda name, r: None,
                        joinable=True))


def _fill(device):
    """A joined rank's part in others' allreduces: zeros of the answer's shape and dtype."""
    group = runtime.world()
    dtypes = {v: k for k, v in _DTYPES.items()}

    def fill(response):
        if response.kind == "barrier":
            return None
        meta = dict(response.meta)
        grouped = response.kind.startswith("grouped_")
        shapes = meta["shape"] if grouped else [meta["shape"]]
        types = meta["dtype"] if grouped else [meta["dtype"]]
        zeros = [torch.zeros(s, dtype=dtypes[d], device=device) for s, d in zip(shapes, types)]
        op = core_op(_reduction(meta["op"], None), zeros)
        # As the others issue it (``_allreduce_async``), so that batches fuse alike.
        if grouped:
            return pycoll.grouped_allreduce_async_(zeros, op=op, group=group, name=response.name)
        return pycoll.allreduce_async_(zeros[0], op=op, group=group, name=response.name)
    return fill


def join(device=-1) -> int:
    """Stop contributing data (Horovod's ``join``): until every rank has joined, this rank
    takes part in the others' allreduces with zeros (Average still divides by every
    rank). Returns the rank that joined last, the same on every rank."""
    runtime.world()
    _handles.reserve(None, "join", global_process_set)    # joins count, as in Horovod
    device = torch.device("cpu") if device is None or device < 0 else torch.device("cuda", device)
    engine = runtime.engine()
    # The result comes through the engine, after the zeros this rank contributed.
    ticket = _negotiator(global_process_set).join(
        _fill(device), lambda last: engine.submit(lambda: last, "join"))
    try:
        return int(ticket.wait())
    except HorovodInternalError:
        raise
    except Exception as error:
        raise HorovodInternalError(f"{type(error).__name__}: {error}") from error


# ---------------------------------------------------------------- objects and models

def broadcast_object(obj, root_rank=0, name=None, process_set=global_process_set):
    """``root_rank``'s picklable ``obj`` on every rank (``root_rank``: a world rank)."""
    _root(root_rank, process_set)
    name = name or "broadcast_object"
    if rank() == root_rank:
        payload = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)
        length = torch.tensor([payload.numel()], dtype=torch.int64)
    else:
        length = torch.zeros(1, dtype=torch.int64)
    broadcast_(length, root_rank, name + ".sz", process_set)
    if rank() != root_rank:
        payload = torch.empty(int(length), dtype=torch.uint8)
    broadcast_(payload, root_rank, name + ".t", process_set)
    return obj if rank() == root_rank else pickle.loads(payload.numpy().tobytes())


def allgather_object(obj, name=None, process_set=global_process_set) -> list:
    """Every rank's picklable ``obj``, in rank order."""
    name = name or "allgather_object"
    payload = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)
    lengths = synchronize(allgather_async(torch.tensor([payload.numel()]), name + ".sz",
                                          process_set))
    gathered = synchronize(allgather_async(payload, name + ".t", process_set)).numpy().tobytes()
    offsets = [0] + torch.cumsum(lengths, 0).tolist()
    return [pickle.loads(gathered[a:b]) for a, b in zip(offsets[:-1], offsets[1:])]


def _named_tensors(params) -> list:
    if isinstance(params, dict):
        return sorted(params.items())
    params = list(params)
    if all(isinstance(p, tuple) and len(p) == 2 for p in params):
        return params
    if all(isinstance(p, torch.Tensor) for p in params):
        return [(None, p) for p in params]
    raise ValueError("params must be model.state_dict(), model.named_parameters() or a list "
                     "of tensors")


def broadcast_parameters(params, root_rank=0, process_set=global_process_set) -> None:
    """Overwrite parameters (a ``state_dict``, ``named_parameters()`` or tensors) with
    ``root_rank``'s, in place."""
    handles = [broadcast_async_(p.data if isinstance(p, torch.nn.Parameter) else p, root_rank,
                                name=name, process_set=process_set)
               for name, p in _named_tensors(params)]
    for handle in handles:
        synchronize(handle)


def broadcast_optimizer_state(optimizer, root_rank=0, process_set=global_process_set,
                              model=None) -> None:
    """Give every rank ``root_rank``'s optimizer state (momenta, steps, hyperparameters).
    An optimizer without state gets it first, as Horovod does: zero gradients for the
    parameters that train, then one step of the wrapped optimizer."""
    if isinstance(optimizer, torch.optim.LBFGS):
        raise ValueError("cannot broadcast torch.optim.LBFGS state")
    if not optimizer.state_dict()["state"]:
        sparse = {id(p) for m in (model.modules() if model is not None else ())
                  if isinstance(m, torch.nn.Embedding) and m.sparse for p in m.parameters()}
        for group in optimizer.param_groups:
            for p in group["params"]:
                if p.requires_grad:
                    p.grad = torch.zeros_like(p)
                    if isinstance(optimizer, torch.optim.SparseAdam) or id(p) in sparse:
                        p.grad = p.grad.to_sparse()
        # A DistributedOptimizer's own step() would reduce: step the wrapped class's.
        step = getattr(optimizer, "_wrapped_step", optimizer.step)
        step()
    state = optimizer.state_dict() if rank() == root_rank else None
    state = broadcast_object(state, root_rank, "broadcast_optimizer_state", process_set)
    if rank() != root_rank:
        optimizer.load_state_dict(state)
