"""Horovod's PyTorch API (``horovod.torch``) over pycoll's collectives.

Async calls return an int handle, as in Horovod; ``synchronize(handle)`` returns the
output and ``poll(handle)`` says whether it is ready. A handle stands for a pycoll
``Work`` plus what is left to do when it finishes (the postscale, a copy). Names are
optional; a name may not be reused while an operation with it is still pending.
``allreduce`` and ``alltoall`` are differentiable, as Horovod's are.
"""
import itertools
import os
import pickle
import threading
from typing import Any, Callable, Dict, Iterable, Optional

import torch

import pycoll
from pycoll import Average, Max, Min, Product, Sum, runtime  # noqa: F401  (Horovod's ops)

from .compression import Compression


# ---------------------------------------------------------------- process sets

class ProcessSet:
    """A subset of ranks that operations may run on (``process_set=``): Horovod's
    process sets on a ``pycoll.Group``. ``ranks=None`` is every rank."""

    def __init__(self, ranks: Optional[Iterable[int]] = None):
        self.ranks = None if ranks is None else sorted(int(r) for r in ranks)
        self._group: Optional[pycoll.Group] = None

    @property
    def group(self) -> pycoll.Group:
        if self.ranks is None:
            return runtime.world()
        if self._group is None:
            raise ValueError(f"{self} is not registered; call pycoll.torch.add_process_set() "
                             "on its ranks first (or pass it to init(process_sets=...))")
        return self._group

    def included(self) -> bool:
        return self.ranks is None or pycoll.rank() in self.ranks

    def rank(self) -> int:
        """This process's rank within the set; -1 outside it."""
        return self.group.rank()

    def size(self) -> int:
        return self.group.size()

    def __repr__(self) -> str:
        return f"ProcessSet(ranks={'all' if self.ranks is None else self.ranks})"


global_process_set = ProcessSet()


def add_process_set(process_set) -> ProcessSet:
    """Register a process set (a ``ProcessSet`` or a list of ranks) and return it.
    Only its members need to call this."""
    if not isinstance(process_set, ProcessSet):
        process_set = ProcessSet(process_set)
    if process_set.ranks is not None and process_set._group is None:
        process_set._group = pycoll.new_group(process_set.ranks)
    return process_set


def remove_process_set(process_set: ProcessSet) -> None:
    if process_set is global_process_set:
        raise ValueError("the global process set cannot be removed")
    process_set._group = None


def _group(process_set: ProcessSet) -> pycoll.Group:
    if not isinstance(process_set, ProcessSet):
        raise TypeError(f"process_set must be a pycoll.torch.ProcessSet, got "
                        f"{type(process_set).__name__}")
    group = process_set.group
    if not group.is_member:
        raise ValueError(f"rank {pycoll.rank()} is not in {process_set}; only its members may "
                         "run operations on it")
    return group


# ---------------------------------------------------------------- start / ranks

def init(comm=None, process_sets=None) -> None:
    """Start pycoll (idempotent). ``comm``: an mpi4py communicator, or a list of world
    ranks to run on; ``process_sets``: sets to register now."""
    from mpi4py import MPI
    if isinstance(comm, (list, tuple)):
        ranks, world = sorted(comm), MPI.COMM_WORLD
        if world.rank not in ranks:
            raise ValueError(f"rank {world.rank} is not in init's ranks {ranks}")
        members = world.Get_group().Incl(ranks)
        comm = world.Create_group(members)
        members.Free()
    pycoll.init(comm)
    for process_set in process_sets or ():
        add_process_set(process_set)


def shutdown() -> None:
    _handles.clear()
    pycoll.shutdown()


is_initialized, rank, size = pycoll.is_initialized, pycoll.rank, pycoll.size
local_rank, local_size = pycoll.local_rank, pycoll.local_size


# ---------------------------------------------------------------- overlap

def overlap_pays(tensor: torch.Tensor) -> bool:
    """Whether communicating ``tensor`` from the engine's thread while torch computes can
    save time: on a GPU always; on the CPU unless this rank is bound to no more cores
    than torch computes with. A rank bound so (MPI binds ranks to cores when there are
    enough) has no core to overlap on: the engine's thread time-slices with compute, and
    the MPI library busy-polls while it waits for a peer whose engine thread is
    descheduled, burning the slices it gets (2 ranks on 2 cores: DistributedOptimizer
    1.3x slower than blocking allreduces after backward). There a blocking call from the
    caller's thread costs less; the engine runs it in that thread. Unbound ranks (more
    ranks than cores, where MPI also yields while it waits) overlap: at 4 ranks on 2
    cores that made DDP 1.4x faster than blocking."""
    if tensor.device.type != "cpu":
        return True
    return len(os.sched_getaffinity(0)) > torch.get_num_threads()


# ---------------------------------------------------------------- handles

class _Handles:
    """int handle -> (pycoll Work, finisher, name); names pending are unique."""

    def __init__(self):
        self._lock = threading.Lock()
        self._table: Dict[int, tuple] = {}
        self._names: set = set()
        self._next = itertools.count(1)

    def add(self, name: Optional[str], start: Callable[[], pycoll.Work],
            finish: Callable[[Any], Any]) -> int:
        with self._lock:
            if name is not None and name in self._names:
                raise ValueError(
                    f"an operation named {name!r} is still pending; a name may be reused only "
                    "after synchronize() on its handle. Give each pending operation its own name.")
            work = start()
            handle = next(self._next)
            self._table[handle] = (work, finish, name)
            if name is not None:
                self._names.add(name)
        return handle

    def pop(self, handle: int) -> tuple:
        with self._lock:
            if handle not in self._table:
                raise ValueError(f"unknown handle {handle!r}: it was synchronized already or "
                                 "never returned by an *_async call")
            work, finish, name = self._table.pop(handle)
            self._names.discard(name)
        return work, finish

    def get(self, handle: int) -> pycoll.Work:
        with self._lock:
            if handle not in self._table:
                raise ValueError(f"unknown handle {handle!r}: it was synchronized already or "
                                 "never returned by an *_async call")
            return self._table[handle][0]

    def clear(self) -> None:
        with self._lock:
            self._table.clear()
            self._names.clear()


_handles = _Handles()


def synchronize(handle: int):
    """Wait for the operation of ``handle``; its output (the tensor, or a list of them)."""
    work, finish = _handles.pop(handle)
    return finish(work.wait())


def poll(handle: int) -> bool:
    """Whether the operation of ``handle`` has finished (``synchronize`` won't block)."""
    return _handles.get(handle).is_completed()


# ---------------------------------------------------------------- allreduce

def _reduction(op, average) -> "pycoll.ReduceOp":
    """Horovod's ``average=`` (deprecated) and ``op=``: one of them, Average by default."""
    if op is not None and average is not None:
        raise ValueError("pass op= or the deprecated average=, not both")
    if average is not None:
        return Average if average else Sum
    return Average if op is None else op


def _scaled(tensor: torch.Tensor, factor: float, where: str) -> None:
    if factor != 1.0:
        if not tensor.is_floating_point():
            raise TypeError(f"{where} {factor} needs a floating-point tensor, got {tensor.dtype}")
        tensor.mul_(factor)


def _allreduce_start(tensor, inplace, name, op, prescale, postscale, process_set):
    """(start, finish) for an allreduce: start issues it, finish applies the postscale."""
    group = _group(process_set)
    if not inplace:
        tensor = tensor.detach().clone() if prescale != 1.0 else tensor.detach()
        inplace = prescale != 1.0
    _scaled(tensor, prescale, "prescale_factor")
    issue = pycoll.allreduce_async_ if inplace else pycoll.allreduce_async

    def finish(out):
        _scaled(out, postscale, "postscale_factor")
        return out
    return (lambda: issue(tensor, op=op, group=group, name=name)), finish


def allreduce_async_(tensor, average=None, name=None, op=None, prescale_factor=1.0,
                     postscale_factor=1.0, process_set=global_process_set) -> int:
    """Start reducing ``tensor`` in place; consecutive calls fuse in the engine."""
    start, finish = _allreduce_start(tensor, True, name, _reduction(op, average),
                                     prescale_factor, postscale_factor, process_set)
    return _handles.add(name, start, finish)


def allreduce_async(tensor, average=None, name=None, op=None, prescale_factor=1.0,
                    postscale_factor=1.0, process_set=global_process_set) -> int:
    start, finish = _allreduce_start(tensor, False, name, _reduction(op, average),
                                     prescale_factor, postscale_factor, process_set)
    return _handles.add(name, start, finish)


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
        if op not in (Sum, Average):
            raise RuntimeError(f"allreduce with op {op} has no gradient; only Sum and Average do")
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


def _grouped_start(tensors, inplace, name, op, prescale, postscale, process_set):
    group = _group(process_set)
    tensors = list(tensors) if inplace else [t.detach() for t in tensors]
    if prescale != 1.0:
        tensors = tensors if inplace else [t.clone() for t in tensors]
        inplace = True
        for t in tensors:
            _scaled(t, prescale, "prescale_factor")
    issue = pycoll.grouped_allreduce_async_ if inplace else pycoll.grouped_allreduce_async

    def finish(outs):
        for out in outs:
            _scaled(out, postscale, "postscale_factor")
        return outs
    return (lambda: issue(tensors, op=op, group=group, name=name)), finish


def grouped_allreduce_async_(tensors, average=None, name=None, op=None, prescale_factor=1.0,
                             postscale_factor=1.0, process_set=global_process_set) -> int:
    """One handle for a list of tensors reduced in place together (one fused call per dtype)."""
    return _handles.add(name, *_grouped_start(tensors, True, name, _reduction(op, average),
                                              prescale_factor, postscale_factor, process_set))


def grouped_allreduce_async(tensors, average=None, name=None, op=None, prescale_factor=1.0,
                            postscale_factor=1.0, process_set=global_process_set) -> int:
    return _handles.add(name, *_grouped_start(tensors, False, name, _reduction(op, average),
                                              prescale_factor, postscale_factor, process_set))


def grouped_allreduce_(tensors, average=None, name=None, op=None, prescale_factor=1.0,
                       postscale_factor=1.0, process_set=global_process_set) -> list:
    return synchronize(grouped_allreduce_async_(tensors, average, name, op, prescale_factor,
                                                postscale_factor, process_set))


def grouped_allreduce(tensors, average=None, name=None, op=None, prescale_factor=1.0,
                      postscale_factor=1.0, process_set=global_process_set) -> list:
    return synchronize(grouped_allreduce_async(tensors, average, name, op, prescale_factor,
                                               postscale_factor, process_set))


# ---------------------------------------------------------------- other collectives

def _async(name, issue: Callable[[], pycoll.Work], finish=lambda out: out) -> int:
    return _handles.add(name, issue, finish)


def allgather_async(tensor, name=None, process_set=global_process_set) -> int:
    group = _group(process_set)
    return _async(name, lambda: pycoll.allgather_async(tensor.detach(), group=group, name=name))


def allgather(tensor, name=None, process_set=global_process_set):
    """Every rank's ``tensor`` concatenated on dim 0 (dim-0 sizes may differ)."""
    return synchronize(allgather_async(tensor, name, process_set))


def _check_root(root_rank, group: pycoll.Group) -> None:
    if not isinstance(root_rank, int) or not 0 <= root_rank < group.size():
        raise ValueError(f"root_rank must be a rank in [0, {group.size()}), got {root_rank!r}")


def broadcast_async(tensor, root_rank, name=None, process_set=global_process_set) -> int:
    group = _group(process_set)
    _check_root(root_rank, group)
    return _async(name, lambda: pycoll.broadcast_async(tensor.detach(), root=root_rank,
                                                       group=group, name=name))


def broadcast_async_(tensor, root_rank, name=None, process_set=global_process_set) -> int:
    group = _group(process_set)
    _check_root(root_rank, group)
    return _async(name, lambda: pycoll.broadcast_async_(tensor.detach(), root=root_rank,
                                                        group=group, name=name),
                  lambda out: tensor)


def broadcast(tensor, root_rank, name=None, process_set=global_process_set):
    """``root_rank``'s tensor on every rank, as a new tensor."""
    return synchronize(broadcast_async(tensor, root_rank, name, process_set))


def broadcast_(tensor, root_rank, name=None, process_set=global_process_set):
    """Overwrite ``tensor`` with ``root_rank``'s; returns it."""
    return synchronize(broadcast_async_(tensor, root_rank, name, process_set))


def _splits_list(splits):
    if splits is None:
        return None
    return splits.tolist() if isinstance(splits, torch.Tensor) else list(splits)


def alltoall_async(tensor, splits=None, name=None, process_set=global_process_set) -> int:
    """Handle whose ``synchronize`` gives ``(output, received_splits)``."""
    group = _group(process_set)
    splits = _splits_list(splits)

    def finish(result):
        output, received = result
        return output, torch.as_tensor(received, dtype=torch.int32)
    return _async(name, lambda: pycoll.alltoall_async(tensor.detach(), splits=splits,
                                                      group=group, name=name), finish)


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


def reducescatter_async(tensor, name=None, op=Average, process_set=global_process_set,
                        prescale_factor=1.0, postscale_factor=1.0) -> int:
    group = _group(process_set)
    if prescale_factor != 1.0:
        tensor = tensor.detach().clone()
        _scaled(tensor, prescale_factor, "prescale_factor")

    def finish(out):
        _scaled(out, postscale_factor, "postscale_factor")
        return out
    return _async(name, lambda: pycoll.reduce_scatter_async(tensor.detach(), op=op, group=group,
                                                            name=name), finish)


def reducescatter(tensor, name=None, op=Average, process_set=global_process_set,
                  prescale_factor=1.0, postscale_factor=1.0):
    """This rank's block of dim 0 of the reduction (the first ranks get the extra rows)."""
    return synchronize(reducescatter_async(tensor, name, op, process_set, prescale_factor,
                                           postscale_factor))


def barrier(process_set=global_process_set) -> None:
    pycoll.barrier(group=_group(process_set))


# ---------------------------------------------------------------- objects and models

def broadcast_object(obj, root_rank=0, name=None, process_set=global_process_set):
    """``root_rank``'s picklable ``obj`` on every rank."""
    group = _group(process_set)
    _check_root(root_rank, group)
    name = name or "broadcast_object"
    payload = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8) \
        if group.rank() == root_rank else torch.empty(0, dtype=torch.uint8)
    length = torch.tensor([payload.numel()], dtype=torch.int64)
    pycoll.broadcast_(length, root=root_rank, group=group, name=name + ".size")
    if group.rank() != root_rank:
        payload = torch.empty(int(length), dtype=torch.uint8)
    pycoll.broadcast_(payload, root=root_rank, group=group, name=name)
    return obj if group.rank() == root_rank else pickle.loads(payload.numpy().tobytes())


def allgather_object(obj, name=None, process_set=global_process_set) -> list:
    """Every rank's picklable ``obj``, in rank order."""
    group = _group(process_set)
    name = name or "allgather_object"
    payload = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)
    lengths = pycoll.allgather(torch.tensor([payload.numel()]), group=group, name=name + ".sizes")
    gathered = pycoll.allgather(payload, group=group, name=name).numpy().tobytes()
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
                                name=None, process_set=process_set)
               for _, p in _named_tensors(params)]
    for handle in handles:
        synchronize(handle)


def broadcast_optimizer_state(optimizer, root_rank=0, process_set=global_process_set) -> None:
    """Give every rank ``root_rank``'s optimizer state (momenta, steps, hyperparameters)."""
    state = optimizer.state_dict() if _group(process_set).rank() == root_rank else None
    state = broadcast_object(state, root_rank, "broadcast_optimizer_state", process_set)
    if _group(process_set).rank() != root_rank:
        optimizer.load_state_dict(state)
