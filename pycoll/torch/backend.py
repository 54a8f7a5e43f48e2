"""The "pycoll" torch.distributed backend: a Python ``ProcessGroup`` over pycoll.

    import pycoll.torch                     # registers the backend; no MPI call
    torch.distributed.init_process_group("pycoll", init_method="pycoll://")
    model = torch.nn.parallel.DistributedDataParallel(model)

``pycoll://`` is a rendezvous over MPI, made when the process group is (any torch
backend may use it); torch's own ``env://`` (the default) works too where its variables
are set, as pycollrun sets them.

Every collective is issued to pycoll's engine as an async operation, followed by a
small completion step queued behind it: the engine runs operations in issue order, so
when the step runs the operation is done, and the step copies results into torch's
output tensors. The ``torch.futures.Future`` that ``get_future()`` returns (the one DDP
waits on) is completed by a callback thread, never by the engine's: a future runs its
callbacks in the thread that completes it, and DDP communication hooks issue collectives
there and may wait for them (PowerSGD does), which on the engine's thread would wait for
the engine itself.
Collectives of CPU tensors on a rank with no core to spare for overlap
(``runtime.overlap_pays``) run blocking in the caller's thread instead, and return a
completed Work: there the engine's thread would only time-slice with DDP's backward, and
the hand-offs to it and back cost more than a small collective.

Collectives pycoll has no primitive for are built from one that moves no more data
than needed: ``scatter`` is an alltoall in which only the root sends; ``reduce`` and
``gather`` are an allreduce and an allgather whose result only the root keeps.
Point-to-point ``send``/``recv`` are MPI ``Isend``/``Irecv`` on the group's private
communicator, made with the group (so only the two peers take part in a send), posted
from the calling thread (MPI_THREAD_MULTIPLE) and completed by one polling thread, so
they never block the engine's collectives.

Fail-stop: a send or receive that times out is cancelled and leaves the group broken
(every later operation on it raises, naming the failure), as NCCL aborts its
communicator: a late message must never be taken for a later one's.
"""
import atexit
import datetime
import operator
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from typing import Callable, List, Optional, Sequence
from urllib.parse import parse_qsl, urlparse

import torch
import torch.distributed as dist
from torch.distributed.rendezvous import register_rendezvous_handler

import pycoll
from pycoll import emulation, runtime
from pycoll.engine import gone_ranks
from pycoll.ops import check_root
from pycoll.tensors import as_buffer
from pycoll.work import lazy

from . import api

BACKEND = "pycoll"


def reduce_op(op) -> "pycoll.ReduceOp":
    """torch.distributed's ReduceOp -> pycoll's; a clear error for the others."""
    kind = getattr(op, "op", op)                  # ReduceOp wraps a RedOpType
    table = {dist.ReduceOp.SUM: pycoll.Sum, dist.ReduceOp.AVG: pycoll.Average,
             dist.ReduceOp.MIN: pycoll.Min, dist.ReduceOp.MAX: pycoll.Max,
             dist.ReduceOp.PRODUCT: pycoll.Product, dist.ReduceOp.BAND: pycoll.BitwiseAnd,
             dist.ReduceOp.BOR: pycoll.BitwiseOr, dist.ReduceOp.BXOR: pycoll.BitwiseXor}
    for torch_op, ours in table.items():
        if kind == torch_op:
            return ours
    raise ValueError(f"the pycoll backend reduces with SUM, AVG, MIN, MAX, PRODUCT, BAND, BOR "
                     f"and BXOR; got {op}")


def _seconds(timeout) -> Optional[float]:
    """torch's Work.wait timeout (a timedelta; zero means none) -> seconds or None."""
    if isinstance(timeout, datetime.timedelta):
        timeout = timeout.total_seconds()
    return timeout or None


# A future runs its callbacks in the thread that completes it, and DDP hooks may wait there
# for a collective of their own: each completion goes to an idle thread of this pool, or to
# a new one while all are busy (a nested wait holds one).
_callbacks = ThreadPoolExecutor(max_workers=64, thread_name_prefix="pycoll-torch-callbacks")


class PycollWork(dist.Work):
    """A torch Work over the engine's completion step (``done``; None once the operation
    has completed): ``wait(timeout)`` raises the operation's error or
    ``pycoll.CollectiveTimeout`` after ``timeout`` (default: the process group's);
    ``get_future()`` is what DDP uses."""

    def __init__(self, future: torch.futures.Future, done: Optional[pycoll.Work],
                 timeout: Optional[float] = None, on_timeout=None):
        super().__init__()
        self._future, self._done, self._timeout = future, done, timeout
        self._on_timeout = on_timeout

    def wait(self, timeout=None) -> bool:
        self.result(timeout)
        return True

    def is_completed(self) -> bool:
        return self._future.done()          # completed after the operation, as below

    def is_success(self) -> bool:
        return self.is_completed() and self.exception() is None

    def exception(self):
        return None if self._done is None else self._done.exception()

    def get_future(self) -> torch.futures.Future:
        return self._future

    def result(self, timeout=None):
        if self._done is None:
            return self._future.value()
        try:
            value = self._done.wait(_seconds(timeout) or self._timeout)
        except pycoll.CollectiveTimeout as error:
            if self._on_timeout is not None and not self._done.is_completed():  # ran out here
                self._on_timeout(error)
            raise
        # A callback thread completes the future just after: once wait() returns, the
        # future is done (gloo completes it first), so get_future().value() may follow.
        if not self._future.done():
            self._future.wait()
        return value

    def _source_rank(self) -> int:
        """recv_anysource's sender (torch's Work API)."""
        self.wait()
        return self._done.source


def _completion(group: pycoll.Group, works: Sequence[pycoll.Work],
                finish: Callable[[list], object], name: str, timeout: Optional[float] = None):
    """Queue on ``group``'s engine, behind ``works`` (its operations), the step that runs
    ``finish(results)`` and has the future completed with what it returns (the output
    tensors)."""
    future = torch.futures.Future()

    def step():
        try:
            value = finish([w.wait() for w in works])
        except BaseException as error:
            _callbacks.submit(future.set_exception, error)
            raise
        _callbacks.submit(future.set_result, value)
        return value
    return PycollWork(future, group.engine.submit(step, name), timeout)


def _completed(value) -> PycollWork:
    """The Work of an operation that has run already, with ``value`` as its result."""
    future = torch.futures.Future()
    future.set_result(value)
    return PycollWork(future, None)


def _flat(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    return torch.cat([t.reshape(-1) for t in tensors]) if tensors else torch.empty(0)


# Results are written into the caller's tensors through detach(): a write of the backend,
# not an operation autograd records, so it reaches leaves that require grad, as gloo's
# writes from C++ do.

def _split_into(flat: torch.Tensor, outputs: Sequence[torch.Tensor]) -> None:
    """Copy consecutive pieces of ``flat`` into ``outputs`` (shapes from the outputs)."""
    offset = 0
    for out in outputs:
        n = out.numel()
        out.detach().copy_(flat[offset:offset + n].view(out.shape))
        offset += n


_is_sparse = operator.attrgetter("is_sparse")


def _dense(tensors: Sequence[torch.Tensor]) -> List[torch.Tensor]:
    """``tensors``, each strided one replaced by a contiguous copy (gloo takes strided
    tensors; pycoll reads contiguous memory): ``_write_back`` returns the results."""
    return [t if t.is_contiguous() else t.contiguous() for t in tensors]


def _write_back(tensors: Sequence[torch.Tensor], dense: Sequence[torch.Tensor]) -> list:
    for t, d in zip(tensors, dense):
        if d is not t:
            t.detach().copy_(d)
    return list(tensors)


def _as_real(tensor: torch.Tensor, op) -> torch.Tensor:
    """``tensor``, or a complex one's real view: complex numbers are reduced as their real
    and imaginary parts, which is right for SUM and AVG only (torch's all_reduce's rule,
    and gloo's reduce and reduce_scatter give the same)."""
    if not tensor.is_complex():
        return tensor
    if op not in (pycoll.Sum, pycoll.Average):
        raise ValueError(f"the pycoll backend reduces complex tensors with SUM or AVG "
                         f"only, not {op.name}, as torch's all_reduce")
    return torch.view_as_real(tensor)


def _one_tensor(tensors, what: str) -> torch.Tensor:
    if len(tensors) != 1:
        raise ValueError(f"the pycoll backend's {what} takes one tensor per process, "
                         f"got {len(tensors)}")
    return tensors[0]


class ProcessGroupPycoll(dist.ProcessGroup):
    """torch.distributed's collectives on a ``pycoll.Group``; ranks are group ranks."""

    def __init__(self, group: pycoll.Group, timeout: Optional[float] = None):
        super().__init__(group.rank(), group.size())
        self.group = group
        self._timeout = timeout or None           # seconds; None: PYCOLL_TIMEOUT
        # Made now, with the group, as every member does: made at the first send, it would
        # be a collective that the ranks not in that send never join.
        self._p2p_comm = emulation.p2p(group.engine.run(group.comm.Dup, "torch.p2p_comm"))
        self._p2p_failure: Optional[BaseException] = None
        self._group_name = ""

    def _complete(self, works, finish, name) -> PycollWork:
        return _completion(self.group, works, finish, name, self._timeout)

    def _run(self, now, queued, calls, finish, name, **kwargs) -> PycollWork:
        """Each of ``calls`` (positional arguments, a tensor first) to pycoll's async form
        ``queued``, with ``finish`` on their results queued behind them, where overlap pays
        for that tensor; else to its blocking form ``now`` in this thread, as allreduce
        does: on a rank with no core to spare the hand-offs to the engine's thread and
        back cost more than a small collective (85-270 us at 2 ranks, against 15)."""
        kwargs.update(group=self.group, name=name)
        if calls and not api.overlap_pays(calls[0][0]):
            return _completed(finish([now(*args, **kwargs) for args in calls]))
        return self._complete([queued(*args, **kwargs) for args in calls], finish, name)

    def getBackendName(self) -> str:
        return BACKEND

    # torch names every group (destroy_process_group, functional collectives look it up);
    # its ProcessGroup keeps the name in its registered backends, and this one has none.
    def _set_group_name(self, name: str) -> None:
        self._group_name = name

    @property
    def group_name(self) -> str:
        return self._group_name

    # torch's helpers ask a group which devices it serves (DCP's async_save wants "cpu",
    # state-dict broadcasts pick one) of the Backends registered with it, and a
    # ProcessGroup written in Python has none: the devices this one takes tensors on.
    @property
    def _device_types(self) -> List[torch.device]:
        cuda = [torch.device("cuda")] if torch.cuda.is_available() else []
        return [torch.device("cpu"), *cuda]

    # torch asks a group for the Backend serving a device, and whether it splits
    # (init_process_group(device_id=...) connects such a one at once). A ProcessGroup
    # written in Python has no Backend registered: this one serves every device itself, and
    # makes each new group's communicators with the group (torch binds the device to the
    # group it replaces with this one, so it splits nothing: DeviceMesh uses new_group).
    def _get_backend(self, device) -> "ProcessGroupPycoll":
        return self

    supports_splitting = False

    @property
    def _ranks(self) -> int:
        return self.group.size()

    # ------------------------------------------------------------ reductions
    def allreduce_coalesced(self, tensors, opts=None):
        op = reduce_op(opts.reduceOp if opts is not None else dist.ReduceOp.SUM)
        if any(map(_is_sparse, tensors)):
            return self._sparse_allreduce(tensors, op)
        dense = _dense(tensors)
        # Every call of DDP and dist.all_reduce comes here: no work for ops other than AVG.
        core = api.core_op(op, dense) if op is pycoll.Average else op
        if dense and not api.overlap_pays(dense[0]):
            pycoll.grouped_allreduce_(dense, op=core, group=self.group, name="torch.allreduce")
            return _completed(self._reduced(tensors, dense, op, core))
        work = pycoll.grouped_allreduce_async_(dense, op=core, group=self.group,
                                               name="torch.allreduce")
        return self._complete([work], lambda _: self._reduced(tensors, dense, op, core),
                              "torch.allreduce")

    # One method, not one calling the other: each is wrapped for torch.compile (below),
    # and a wrapper costs about 0.4 us a call on every DDP bucket and dist.all_reduce.
    allreduce = allreduce_coalesced

    def _reduced(self, tensors, dense, op, core) -> list:
        """``tensors`` once ``dense`` holds their reduction by ``core``, run for ``op``."""
        if core is not op:
            for t in dense:
                self._finish_reduce(t, op, core)
        return _write_back(tensors, dense)

    def _sparse_allreduce(self, tensors, op):
        """gloo's allreduce of sparse tensors (DDP's gradients of sparse embeddings): every
        rank's indices and values gathered, added where they meet, coalesced into the
        tensor; SUM only, as on gloo."""
        if op is not pycoll.Sum or not all(t.is_sparse for t in tensors):
            raise ValueError(f"the pycoll backend reduces sparse tensors with SUM only, not "
                             f"with {op.name} nor beside dense tensors, as gloo")
        works = []
        for t in tensors:
            t = t.coalesce()
            works += [pycoll.allgather_async(t._indices().t().contiguous(), group=self.group,
                                             name="torch.sparse_allreduce.indices"),
                      pycoll.allgather_async(t._values().contiguous(), group=self.group,
                                             name="torch.sparse_allreduce.values")]

        def finish(results):
            for t, indices, values in zip(tensors, results[0::2], results[1::2]):
                t.copy_(torch.sparse_coo_tensor(indices.t(), values, t.shape).coalesce())
            return list(tensors)
        return self._complete(works, finish, "torch.sparse_allreduce")

    def reduce(self, tensors, opts=None):
        tensor = _one_tensor(tensors, "reduce")
        op, root = reduce_op(opts.reduceOp), opts.rootRank
        check_root(root, self.group)
        real = _as_real(tensor.contiguous(), op)
        core = api.core_op(op, [real])

        def finish(results):
            if self.group.rank() == root:
                result = self._finish_reduce(results[0], op, core)
                tensor.detach().copy_(torch.view_as_complex(result) if tensor.is_complex()
                                      else result)
            return [tensor]
        return self._run(pycoll.allreduce, pycoll.allreduce_async, [(real,)], finish,
                         "torch.reduce", op=core)

    def _finish_reduce(self, out, op, core):
        """AVG of integer tensors ran as a SUM: divided here, truncated toward zero, as
        NCCL's AVG (and Horovod's Average) defines it."""
        return api.finish_reduce(out, op, core, 1.0, self._ranks)

    def reduce_scatter(self, outputs, input_lists, opts=None):
        op = reduce_op(opts.reduceOp if opts is not None else dist.ReduceOp.SUM)
        output, inputs = _one_tensor(outputs, "reduce_scatter"), _one_tensor(input_lists, "reduce_scatter")
        self._check_count(inputs, "reduce_scatter's input list")
        rows = _flat(inputs).view(self._ranks, -1)
        return self._reduce_scatter(output, rows, op)

    def reduce_scatter_single(self, output, input, opts=None):
        op = reduce_op(opts.reduceOp if opts is not None else dist.ReduceOp.SUM)
        if input.numel() != output.numel() * self._ranks:
            raise ValueError(f"reduce_scatter_tensor needs an input of {self._ranks} x the "
                             f"output's {output.numel()} elements, got {input.numel()}")
        return self._reduce_scatter(output, input.reshape(self._ranks, -1), op)

    _reduce_scatter_base = reduce_scatter_single

    def reduce_scatter_single_coalesced(self, outputs, inputs, opts=None):
        works = [self.reduce_scatter_single(o, i, opts) for o, i in zip(outputs, inputs)]
        return works[-1] if works else self.barrier()

    def _reduce_scatter(self, output, rows, op):
        # Straight into torch's output where it is contiguous: no copy.
        dest = output if output.is_contiguous() else torch.empty_like(
            output, memory_format=torch.contiguous_format)
        rows = _as_real(rows.contiguous(), op).view(self._ranks, -1)
        core = api.core_op(op, [rows])

        def finish(results):
            self._finish_reduce(results[0], op, core)
            if dest is not output:
                output.detach().copy_(dest)
            return [output]
        return self._run(pycoll.reduce_scatter, pycoll.reduce_scatter_async, [(rows,)], finish,
                         "torch.reduce_scatter", op=core, out=_as_real(dest, op))

    # ------------------------------------------------------------ data movement
    def broadcast(self, tensors, opts=None):
        root = opts.rootRank if opts is not None else 0
        check_root(root, self.group)
        dense = _dense(tensors)
        return self._run(pycoll.broadcast_, pycoll.broadcast_async_, [(t,) for t in dense],
                         lambda _: _write_back(tensors, dense), "torch.broadcast", root=root)

    def allgather(self, output_lists, inputs, opts=None):
        outputs, tensor = _one_tensor(output_lists, "allgather"), _one_tensor(inputs, "allgather")
        self._check_count(outputs, "all_gather's output list")

        def finish(results):
            _split_into(results[0], outputs)
            return [outputs]
        return self._run(pycoll.allgather, pycoll.allgather_async, [(tensor.reshape(-1),)], finish,
                         "torch.allgather")

    def all_gather_single(self, output, input, opts=None):
        if output.numel() != input.numel() * self._ranks:
            raise ValueError(f"all_gather_into_tensor needs an output of {self._ranks} x the "
                             f"input's {input.numel()} elements, got {output.numel()}")
        direct = output.is_contiguous()     # straight into torch's output: no copy

        def finish(results):
            if not direct:
                output.detach().copy_(results[0].view(output.shape))
            return [output]
        return self._run(pycoll.allgather, pycoll.allgather_async, [(input.reshape(-1),)], finish,
                         "torch.all_gather_into_tensor", out=output if direct else None)

    _allgather_base = all_gather_single

    def allgather_coalesced(self, output_lists, inputs, opts=None):
        """``output_lists[r][i]`` receives input ``i`` of rank ``r`` (torch's order)."""
        self._check_count(output_lists, "all_gather_coalesced's output list")
        for outs in output_lists:
            if len(outs) != len(inputs):
                raise ValueError(f"all_gather_coalesced needs one output per input ({len(inputs)}) "
                                 f"for every rank, got {len(outs)}")
        works = [self.allgather([[outs[i] for outs in output_lists]], [t], opts)
                 for i, t in enumerate(inputs)]
        return works[-1] if works else self.barrier()

    def all_gather_single_coalesced(self, outputs, inputs, opts=None):
        works = [self.all_gather_single(o, i, opts) for o, i in zip(outputs, inputs)]
        return works[-1] if works else self.barrier()

    def gather(self, output_lists, inputs, opts=None):
        root = opts.rootRank
        check_root(root, self.group)
        tensor = _one_tensor(inputs, "gather")
        outputs = output_lists[0] if self.group.rank() == root else []
        if outputs:
            self._check_count(outputs, "gather's output list")

        def finish(results):
            _split_into(results[0], outputs)
            return [outputs]
        return self._run(pycoll.allgather, pycoll.allgather_async, [(tensor.reshape(-1),)], finish,
                         "torch.gather")

    def scatter(self, outputs, input_lists, opts=None):
        root = opts.rootRank
        check_root(root, self.group)
        output = _one_tensor(outputs, "scatter")
        if self.group.rank() == root:
            inputs = _one_tensor(input_lists, "scatter")
            self._check_count(inputs, "scatter's input list")
            send, splits = _flat(inputs), [t.numel() for t in inputs]
        else:
            send, splits = output.new_empty(0), [0] * self._ranks
        return self._alltoall(send.reshape(-1), splits, [output], "torch.scatter")

    def alltoall(self, outputs, inputs, opts=None):
        self._check_count(inputs, "all_to_all's input list")
        self._check_count(outputs, "all_to_all's output list")
        return self._alltoall(_flat(inputs), [t.numel() for t in inputs], outputs,
                              "torch.all_to_all")

    def all_to_all_single(self, output, input, output_splits, input_splits, opts=None):
        splits, send = list(input_splits) if input_splits else None, input.contiguous()

        def finish(results):
            received, received_splits = results[0]
            if output_splits and list(received_splits) != list(output_splits):
                raise ValueError(f"all_to_all_single: expected rows {list(output_splits)} from "
                                 f"the ranks, received {list(received_splits)}")
            if received is not output:
                output.detach().copy_(received.view(output.shape))
            return [output]
        return self._run(pycoll.alltoall, pycoll.alltoall_async, [(send,)], finish,
                         "torch.all_to_all_single", splits=splits,
                         out=output if output.is_contiguous() else None)

    def _alltoall(self, send, splits, outputs, name):
        def finish(results):
            _split_into(results[0][0], outputs)
            return list(outputs)
        return self._run(pycoll.alltoall, pycoll.alltoall_async, [(send,)], finish, name,
                         splits=splits)

    def barrier(self, opts=None):
        work = pycoll.barrier_async(group=self.group, name="torch.barrier", timeout=self._timeout)
        return self._complete([work], lambda _: [], "torch.barrier")

    # ------------------------------------------------------------ point to point
    def send(self, tensors, dst, tag=0):
        tensor, comm, staging = _one_tensor(tensors, "send"), self._p2p(), ExitStack()
        request = comm.Isend(_message(tensor, staging, write=False), dest=dst, tag=tag)
        return self._watch(request, tensor, staging, f"send to rank {dst}", dst)

    def recv(self, tensors, src, tag=0):
        return self._recv(_one_tensor(tensors, "recv"), src, tag)

    def recv_anysource(self, tensors, tag=0):
        from mpi4py import MPI
        return self._recv(_one_tensor(tensors, "recv"), MPI.ANY_SOURCE, tag)

    def _recv(self, tensor, src, tag):
        comm, staging = self._p2p(), ExitStack()
        request = comm.Irecv(_message(tensor, staging, write=True), source=src, tag=tag)
        return self._watch(request, tensor, staging, "receive from " + (
            f"rank {src}" if src >= 0 else "any rank"), src)

    def _watch(self, request, tensor, staging: ExitStack, what: str,
               src_or_dst: int) -> PycollWork:
        """The Work of ``request``, which MPI runs on ``tensor``'s memory or on the staging
        copy that ``staging`` holds until the request is done (then closed: a received
        message is copied into the tensor); its peer ``src_or_dst`` (a group rank, or
        negative: any)."""
        work = pycoll.Work(f"torch {what} in {self.group}")

        def finish(status):
            staging.close()
            return [tensor]

        def timed_out(error):
            if self._p2p_failure is None:
                self._p2p_failure = error
            request.Cancel()        # the poller completes it, so its buffer outlives it
        future = torch.futures.Future()
        world = self.group.world_ranks
        # A receive from any rank waits in vain once every other member has left.
        peers = (world[src_or_dst],) if src_or_dst >= 0 else tuple(
            r for i, r in enumerate(world) if i != self.rank())
        _poller().watch(request, work, future, finish, staging, peers)
        return PycollWork(future, work, self._timeout, on_timeout=timed_out)

    def _p2p(self):
        """The group's own communicator for send/recv: their messages never match the
        engine's collectives."""
        from mpi4py import MPI
        if MPI.Query_thread() < MPI.THREAD_MULTIPLE:
            raise RuntimeError("send/recv on the pycoll backend need MPI_THREAD_MULTIPLE "
                               "(mpi4py's default); MPI was initialized with less")
        if self._p2p_failure is not None:
            raise pycoll.GroupBroken(f"pycoll: send/recv on {self.group} are broken since an earlier "
                               f"one failed ({self._p2p_failure}); its message may still "
                               "arrive and must not be taken for a later one's. Make a new "
                               "process group (or restart the job) to exchange messages again.")
        return self._p2p_comm

    # ------------------------------------------------------------ checks
    def _check_count(self, tensors, what: str) -> None:
        if len(tensors) != self._ranks:
            raise ValueError(f"{what} needs one tensor per rank ({self._ranks}), got {len(tensors)}")

    def shutdown(self) -> None:
        """torch's ``destroy_process_group``: what the group has queued finishes, then its
        communicators are released and its engine's thread ends (as every member does)."""
        if not self.group.freed:
            self._p2p_comm.Free()
            self.group.release()

    def __repr__(self) -> str:
        return f"ProcessGroupPycoll(rank={self.rank()}, size={self.size()}, {self.group})"


# torch.compile traces the Python it meets, and would trace into these methods (DDP's
# forward broadcasts buffers and waits) where gloo's are C++ calls it makes as they are:
# each runs as a call, outside the graph. Applied with the first group, not at import:
# the wrapper imports torch._dynamo (a second), which DDP imports anyway.
_CALLED_AS_THEY_ARE = {
    ProcessGroupPycoll: ("allreduce", "allreduce_coalesced", "reduce", "reduce_scatter",
                         "reduce_scatter_single", "_reduce_scatter_base",
                         "reduce_scatter_single_coalesced", "broadcast", "allgather",
                         "all_gather_single", "_allgather_base", "allgather_coalesced",
                         "all_gather_single_coalesced", "gather", "scatter", "alltoall",
                         "all_to_all_single", "barrier", "send", "recv", "recv_anysource"),
    PycollWork: ("wait", "is_completed", "is_success", "exception", "get_future", "result",
                 "_source_rank"),
}


def _disable_compiling() -> None:
    for cls, names in _CALLED_AS_THEY_ARE.items():
        for name in names:
            setattr(cls, name, torch.compiler.disable(getattr(cls, name)))


_outside_compiled_graphs = lazy(_disable_compiling)


def _message(tensor, staging: ExitStack, write: bool):
    """MPI's view of ``tensor`` (contiguous, as gloo and NCCL require for send and recv):
    its own memory on the host; GPU memory through the staging copy collectives use,
    entered on ``staging`` (it copies a received message back when closed)."""
    from mpi4py import MPI
    from pycoll.collectives import staged           # imports MPI: not at pycoll.torch's import
    buf = as_buffer(tensor, writable=write)
    ptr = buf.ptr if buf.device == "cpu" else \
        staging.enter_context(staged(buf, read=not write, write=write))
    return [MPI.buffer.fromaddress(ptr, buf.nbytes), MPI.BYTE]


class _Poller:
    """One thread that tests the pending send/recv requests and completes their Works;
    it sleeps (backing off to 1 ms) while they are pending and blocks when none is."""

    def __init__(self):
        self._pending: List[tuple] = []
        self._cv = threading.Condition()
        self._stopped = False
        self._thread = threading.Thread(target=self._loop, name="pycoll-torch-p2p", daemon=True)
        self._thread.start()
        atexit.register(self.stop)      # after mpi4py's: runs before MPI is finalized

    def watch(self, request, work: pycoll.Work, future, finish, keep, peers=()) -> None:
        """Complete ``work`` and ``future`` with ``finish(status)`` once ``request`` is
        done, keeping ``keep`` (the buffer MPI reads or writes) alive until then; or with
        an error once every one of its possible ``peers`` (world ranks) has left pycoll, as
        gloo's fail when a peer's process ends."""
        with self._cv:
            self._pending.append((request, work, future, finish, keep, peers, time.monotonic(), []))
            self._cv.notify()

    def stop(self) -> None:
        """End the thread, so that it is not inside MPI when MPI is finalized."""
        with self._cv:
            self._stopped = True
            self._cv.notify()
        self._thread.join(pycoll.config.get("timeout"))

    def _loop(self) -> None:
        from mpi4py import MPI
        pause, looked = 5e-5, time.monotonic()
        while True:
            with self._cv:
                while not self._pending and not self._stopped:
                    self._cv.wait()
                    pause = 5e-5
                if self._stopped:
                    return
                pending = list(self._pending)
            finished = []
            if time.monotonic() - looked > 1.0:     # as often as the engines' watchdog
                looked = time.monotonic()
                for request, work, _, _, _, peers, posted, gone in pending:
                    if peers and not gone and len(runtime.gone(peers, posted)) == len(peers):
                        gone.append(f"pycoll: {work.name} waits for {gone_ranks(sorted(peers))}")
                        request.Cancel()
            for entry in pending:
                status = MPI.Status()
                if entry[0].Test(status):
                    self._complete(status, *entry[1:4], *entry[7])
                    finished.append(entry)
            with self._cv:
                self._pending = [p for p in self._pending if p not in finished]
            pause = 5e-5 if finished else min(2 * pause, 1e-3)
            time.sleep(pause)

    @staticmethod
    def _complete(status, work: pycoll.Work, future, finish, why: str = "") -> None:
        try:
            if status.Is_cancelled():
                raise pycoll.CollectiveTimeout(why or f"pycoll: {work.name} was cancelled")
            value = finish(status)
        except BaseException as error:
            work.finish(error=error)
            _callbacks.submit(future.set_exception, error)
            return
        work.source = status.Get_source()
        work.finish(value)
        _callbacks.submit(future.set_result, value)


_poller = lazy(_Poller)


# ---------------------------------------------------------------- registration

def _create(options, backend_options=None) -> ProcessGroupPycoll:
    """torch's factory for the backend (extended API: it names the group's global ranks)."""
    pycoll.init()
    world = runtime.world()
    ranks = list(options.global_ranks_in_group) or list(range(options.group_size))
    if max(ranks, default=0) >= world.size():
        raise ValueError(
            f"torch.distributed has {max(ranks) + 1} or more ranks, MPI's world here "
            f"{world.size()}: the pycoll backend runs one process per MPI rank, so start the "
            f"job with pycollrun or mpirun (pycollrun -np N python script.py), not torchrun "
            f"or torch.multiprocessing")
    if options.group_size != len(ranks):
        raise ValueError(f"torch.distributed asked for a group of {options.group_size} ranks "
                         f"but named {len(ranks)}: {ranks}")
    # A communicator of its own even over every rank: torch's groups are independent (gloo
    # gives each its own context), so two over the same ranks may run in different orders
    # or threads, which one communicator would match across.
    group = pycoll.new_group(ranks)
    if tuple(group.ranks) != tuple(ranks) or group.rank() != options.group_rank:
        raise ValueError(
            f"torch.distributed's rank {options.group_rank} in ranks {ranks} is not pycoll's "
            f"(rank {group.rank()} in {list(group.ranks)}); leave RANK and WORLD_SIZE to "
            "pycoll under pycollrun, or set them to the MPI rank and size")
    timeout = _group_timeout(getattr(options, "timeout", None))
    if timeout is not None and timeout > pycoll.config.get("timeout"):
        # pycoll's own limits (the watchdog, the checks, blocking calls) must not end the
        # job before the group's: rank 0 may evaluate for minutes while the others wait.
        pycoll.config.configure(timeout=timeout)
    _outside_compiled_graphs()
    return ProcessGroupPycoll(group, timeout)


def _group_timeout(timeout) -> Optional[float]:
    """``init_process_group(timeout=...)`` in seconds; None (PYCOLL_TIMEOUT) when torch
    passes its own default, which the user did not choose."""
    from torch.distributed.constants import default_pg_timeout
    if timeout is None or timeout == default_pg_timeout:
        return None
    seconds = _seconds(timeout)
    if seconds is None or not 0 < seconds < float("inf"):
        raise ValueError(f"init_process_group's timeout must be a positive, finite timedelta; "
                         f"got {timeout!r}")
    return seconds


def _rendezvous(url: str, timeout: datetime.timedelta = None, **_):
    """torch's rendezvous for ``init_method="pycoll://"``: pycoll's rank and size, and a
    TCPStore that rank 0 opens on a port the OS picks and tells the others over MPI, so
    no MASTER_ADDR, MASTER_PORT, RANK or WORLD_SIZE is needed under any MPI launcher.
    Runs when the process group is made, collectively over pycoll's world."""
    from torch.distributed.constants import default_pg_timeout
    pycoll.init()
    rank, size = pycoll.rank(), pycoll.size()
    asked = dict(parse_qsl(urlparse(url).query))
    for key, ours in (("rank", rank), ("world_size", size)):
        if key in asked and int(asked[key]) != ours:
            raise ValueError(f"init_process_group(init_method='pycoll://') takes rank and size "
                             f"from MPI: this process is rank {rank} of {size}, but "
                             f"{key}={asked[key]} was given; leave rank and world_size unset")
    timeout = timeout or default_pg_timeout
    store = address = None
    if rank == 0:
        host = "127.0.0.1" if pycoll.local_size() == size else \
            socket.gethostbyname(socket.gethostname())
        store = dist.TCPStore(host, 0, size, True, timeout=timeout, wait_for_workers=False)
        address = (host, store.port)
    world = runtime.world().comm
    host, port = runtime.engine().run(lambda: world.bcast(address, root=0), "torch.rendezvous")
    if store is None:
        store = dist.TCPStore(host, port, size, False, timeout=timeout)
    yield store, rank, size
    raise RuntimeError("pycoll:// cannot rendezvous again: the MPI job's ranks are fixed")


def register() -> None:
    """The "pycoll" backend and the ``pycoll://`` rendezvous, through torch's public
    registration calls; nothing here talks to MPI."""
    if not hasattr(dist.Backend, BACKEND.upper()):
        dist.Backend.register_backend(BACKEND, _create, extended_api=True, devices=["cpu", "cuda"])
        register_rendezvous_handler(BACKEND, _rendezvous)
