"""Collectives on MPI through mpi4py.

Each collective is planned in the caller's thread (inputs checked, outputs allocated)
and handed to the engine, which runs it in issue order: ``allreduce`` runs it and
returns the result, ``allreduce_async`` returns a ``Work``. Trailing-underscore forms
work in place. CUDA buffers are staged through host memory unless the MPI is
CUDA-aware (PYCOLL_CUDA_AWARE_MPI=1).
"""
import functools
import itertools
import math
import operator
from contextlib import contextmanager, nullcontext
from typing import Any, Callable, List, NamedTuple, Optional, Sequence

import numpy as np
from mpi4py import MPI

from . import _C, config, emulation, runtime, tensors, timeline
from .ops import (Average, BitwiseAnd, BitwiseOr, BitwiseXor, Max, Min, Product,  # noqa: F401
                  ReduceOp, Sum, check_reduction, check_root, kernel_op, reduce_op)
from .tensors import ITEMSIZE, Buffer, as_buffer
from .work import CollectiveTimeout, Work, mpi_from_c, wait_request


_MPI_OPS = {Sum: MPI.SUM, Average: MPI.SUM, Min: MPI.MIN, Max: MPI.MAX, Product: MPI.PROD,
            BitwiseAnd: MPI.BAND, BitwiseOr: MPI.BOR, BitwiseXor: MPI.BXOR}
# bool travels as bytes of 0 or 1, where Max is logical or and Min logical and (MPI's own
# bool type takes only MPI's logical ops); _C.reduce's bool arithmetic gives the same.
_BOOL_OPS = {**_MPI_OPS, Sum: MPI.MAX, Product: MPI.MIN}
# float16 and bfloat16 travel as 16-bit words; MPI cannot reduce them, _C.reduce can.
_MPI_TYPES = {"float16": MPI.UINT16_T, "bfloat16": MPI.UINT16_T, "float32": MPI.FLOAT,
              "float64": MPI.DOUBLE, "int8": MPI.INT8_T, "int16": MPI.INT16_T,
              "int32": MPI.INT32_T, "int64": MPI.INT64_T, "uint8": MPI.UINT8_T,
              "bool": MPI.UINT8_T, "uint16": MPI.UINT16_T, "uint32": MPI.UINT32_T,
              "uint64": MPI.UINT64_T, "float8_e4m3fn": MPI.BYTE, "float8_e5m2": MPI.BYTE}
_half_ops: dict = {}


def mpi_op(op: ReduceOp, dtype: str):
    if dtype == "bool":
        return _BOOL_OPS[op]
    if dtype not in ("float16", "bfloat16"):
        return _MPI_OPS[op]
    reduction = kernel_op(op)
    if (dtype, reduction) not in _half_ops:
        def reduce_half(invec, inoutvec, datatype):
            inout = MPI.buffer(inoutvec)
            _C.reduce(inout.address, MPI.buffer(invec).address, inout.nbytes // 2, dtype,
                      reduction)
        _half_ops[dtype, reduction] = MPI.Op.Create(reduce_half, commute=True)
    return _half_ops[dtype, reduction]


_MAX_COUNT = 2**31 - 1            # MPI counts are C ints
_PIECE = 2**30                    # elements per MPI call for operations that can be split


def _pieces(nbytes: int, itemsize: int, chunk_bytes: int = 0):
    """``tensors.pieces`` of at most _PIECE elements, so counts fit MPI's C ints, and of at
    most ``chunk_bytes`` when given; an elementwise operation may be split anywhere."""
    limit = _PIECE * itemsize
    return tensors.pieces(nbytes, itemsize, min(limit, chunk_bytes) if chunk_bytes else limit)


def _check_counts(name: str, counts: Sequence[int], unit: str) -> None:
    if max(counts, default=0) > _MAX_COUNT:
        raise ValueError(f"{name}: one rank's part is {max(counts)} {unit}, beyond MPI's "
                         f"limit of 2^31-1; split the tensor and call {name} on the pieces")


def message(ptr: int, nbytes: int, dtype: str = "uint8"):
    """An mpi4py message spec for raw memory."""
    return [MPI.buffer.fromaddress(ptr, nbytes), nbytes // ITEMSIZE[dtype], _MPI_TYPES[dtype]]


def _host(buf: Buffer, read: bool = True, write: bool = False):
    """A host pointer holding ``buf``'s bytes: its own, or a staging copy for CUDA memory."""
    if _direct(buf.device):
        _await_producer(buf)
        return nullcontext(buf.ptr)
    return staged(buf, read, write)


def _await_producer(buf: Buffer) -> None:
    """Before MPI reads or writes GPU memory itself (CUDA-aware MPI): the work queued on
    it when it was handed to pycoll is done."""
    if buf.ready is not None:
        buf.ready.synchronize()


@contextmanager
def staged(buf: Buffer, read: bool, write: bool):
    staging, stage = np.empty(buf.nbytes, np.uint8), tensors.stager(buf.device_id)
    if read and buf.nbytes:
        stage.copy(staging.ctypes.data, buf.ptr, buf.nbytes, buf.ready)
        stage.wait()
    yield staging.ctypes.data
    if write and buf.nbytes:
        stage.copy(buf.ptr, staging.ctypes.data, buf.nbytes, buf.ready)
        stage.wait()


def _scale(buf: Buffer, ptr: int, count: int, factor: float) -> None:
    """Average's division of ``count`` elements of ``buf`` at ``ptr``, where MPI left
    them: on the host, or on the tensor's own GPU when a CUDA-aware MPI worked on GPU
    memory (on pycoll's stream for that device: no context is made on another GPU)."""
    if buf.device == "cpu" or not config.get("cuda_aware_mpi"):
        _C.scale(ptr, count, buf.dtype, factor)
        return
    stage = tensors.stager(buf.device_id)
    if not stage.scales:
        raise RuntimeError("Average of GPU tensors with PYCOLL_CUDA_AWARE_MPI=1 needs pycoll "
                           "built with its CUDA kernels (PYCOLL_WITH_CUDA=1 pip install pycoll)")
    stage.scale([ptr], [count * ITEMSIZE[buf.dtype]], buf.dtype, factor)
    stage.wait(stage.mark())


def _same_kind(inputs: Sequence[Buffer]) -> None:
    devices = {(b.device, b.device_id) for b in inputs}
    if len(devices) > 1:
        raise ValueError(f"tensors of one collective must share a device, got {sorted(devices)}")


# ---------------------------------------------------------------- planners
# Each returns (name, thunk). Checks and allocation happen here, in the caller's
# thread, so bad input raises at the call and nothing is queued.

class _Allreduce(NamedTuple):
    """One tensor's allreduce, ready to run alone or fused with others of its key."""
    src: Buffer
    dst: Buffer
    out: Any
    op: ReduceOp
    grp: runtime.Group
    name: str


def _allreduce_item(x, op, group, name, inplace) -> _Allreduce:
    return _planned_item(x, reduce_op(op), runtime.resolve(group), name or "allreduce", inplace)


# _Allreduce((fields)), without NamedTuple's Python __new__: a step's every gradient is one.
_new_item = functools.partial(tuple.__new__, _Allreduce)


def _planned_item(x, op: ReduceOp, grp: runtime.Group, name: str, inplace) -> _Allreduce:
    src = as_buffer(x, writable=inplace)
    check_reduction(op, src.dtype)
    if inplace:
        return _new_item((src, src, x, op, grp, name))
    out = tensors.empty_like(x, src.shape)
    return _new_item((src, as_buffer(out, writable=True), out, op, grp, name))


@emulation.modelled("allreduce", lambda item: (item.grp.comm, item.dst.nbytes))
def _allreduce_one(item: _Allreduce):
    """In MPI's hands directly, no copy, in pieces of PYCOLL_CHUNK_BYTES: each is reduced
    and scaled while it is in cache. CUDA memory without a CUDA-aware MPI is staged."""
    src, dst, grp, op = item.src, item.dst, item.grp, item.op
    if config.get("check"):         # before building agree()'s arguments: this is hot
        grp.agree("allreduce", item.name, dtype=src.dtype, shape=src.shape, op=op.value)
    if not _direct(src.device):
        _reduce_staged(_Many.of([item]), [0])
        return item.out
    if src.device != "cpu":
        _await_producer(dst)            # dst is handed over last: its event covers src's
    reduction, itemsize = mpi_op(op, src.dtype), ITEMSIZE[src.dtype]
    chunk = config.get("chunk_bytes")
    pieces = (((0, dst.nbytes),) if dst.nbytes <= chunk and dst.nbytes <= _PIECE  # usual case
              else _pieces(dst.nbytes, itemsize, chunk))
    for offset, nbytes in pieces:
        send = MPI.IN_PLACE if src.ptr == dst.ptr else message(src.ptr + offset, nbytes, src.dtype)
        with timeline.phase("in MPI"):
            grp.comm.Allreduce(send, message(dst.ptr + offset, nbytes, dst.dtype), reduction)
        if op is Average:
            _scale(dst, dst.ptr + offset, nbytes // itemsize, 1.0 / grp.size())
    return item.out


# Not "" where _C cannot call MPI: the short path is then off, and every allreduce goes
# through mpi4py.
_MPI_FROM_C = mpi_from_c()


def _short_route(op, x) -> tuple:
    """How ``x`` (a host tensor the short path has read) goes to MPI, reduced by ``op``
    (None: not reduced): (datatype handle, op handle or 0, itemsize, average, dtype, the
    CPU kernels' op name or None). Raises as the general path would for an unknown op or
    one the dtype cannot take. The short path and the partial all-reduce's entry ask once
    per (op, x.dtype) and keep the answer."""
    dtype = as_buffer(x).dtype
    if op is None:
        return MPI._handleof(_MPI_TYPES[dtype]), 0, ITEMSIZE[dtype], False, dtype, None
    op = reduce_op(op)                  # "sum" is ReduceOp.SUM's key too
    check_reduction(op, dtype)
    return (MPI._handleof(_MPI_TYPES[dtype]), MPI._handleof(mpi_op(op, dtype)), ITEMSIZE[dtype],
            op is Average, dtype, kernel_op(op))


class _Many(NamedTuple):
    """Same-key allreduces as parallel lists (addresses and byte sizes), the form packing
    wants: a fused batch, or a grouped call read in one pass (``tensors.host_pointers``)."""
    srcs: List[int]
    dsts: List[int]
    sizes: List[int]
    dtype: str
    device: str
    op: ReduceOp
    grp: runtime.Group
    item: Callable[[int], _Allreduce]       # the i-th as an _Allreduce, to send it alone
    device_id: int = 0
    ready: Any = None           # GPU memory: the event of the last tensor handed over

    @classmethod
    def of(cls, items: List[_Allreduce]) -> "_Many":
        first, last = items[0].src, items[-1].dst
        return cls([it.src.ptr for it in items], [it.dst.ptr for it in items],
                   [it.src.nbytes for it in items], first.dtype, first.device, items[0].op,
                   items[0].grp, items.__getitem__, first.device_id, last.ready)


@emulation.modelled("allreduce", lambda many, which: (many.grp.comm,
                                                     sum(many.sizes[i] for i in which)))
def _allreduce_fused(many: _Many, which: List[int]) -> None:
    """One reduction for tensors ``which`` of ``many``."""
    if config.get("check"):         # before building agree()'s arguments: this is hot
        items = [many.item(i) for i in which]
        many.grp.agree("fused allreduce", f"{items[0].name} and {len(items) - 1} more",
                       dtype=many.dtype, op=many.op.value,
                       shapes=[(it.name, it.src.shape) for it in items])
    _reduce_staged(many, which)


def _reduce_staged(many: _Many, which: List[int]) -> None:
    """Tensors ``which`` of ``many`` seen as one stream of bytes, reduced through the
    engine's staging buffer a piece of PYCOLL_CHUNK_BYTES at a time: pack, one MPI
    Allreduce, unpack (+ Average's scale). Each piece stays in cache from pack to unpack,
    and the buffer is one piece long. Destinations that lie back to back (the results of
    ``grouped_allreduce``, views of one bucket) are their own staging buffer: no unpack,
    and no pack either when they are the sources. GPU memory: ``_reduce_from_gpu``."""
    if len(which) == len(many.sizes):
        srcs, dsts, sizes = many.srcs, many.dsts, many.sizes
    else:
        srcs, dsts = [many.srcs[i] for i in which], [many.dsts[i] for i in which]
        sizes = [many.sizes[i] for i in which]
    dtype, grp, itemsize = many.dtype, many.grp, ITEMSIZE[many.dtype]
    scale = 1.0 / grp.size() if many.op is Average else 1.0
    reduction, engine, chunk = mpi_op(many.op, dtype), grp.engine, config.get("chunk_bytes")
    if many.device != "cpu":
        _reduce_from_gpu(many, srcs, dsts, sizes, _pieces(sum(sizes), itemsize, chunk),
                         reduction, scale)
        return
    contiguous = list(map(operator.add, dsts[:-1], sizes)) == dsts[1:]   # C loops, not Python's
    packed = contiguous and srcs == dsts         # views of one buffer, reduced in place
    limit = chunk if contiguous else min(chunk, _CACHED_PIECE * max(1, grp.size() - 1))
    for begin, nbytes in _pieces(sum(sizes), itemsize, limit):
        end = begin + nbytes
        piece = dsts[0] + begin if contiguous else engine.fusion_buffer(nbytes).ctypes.data
        if not packed:
            with timeline.phase("packed"):
                _C.pack(piece, srcs, sizes, begin, end)
        with timeline.phase("in MPI"):
            grp.comm.Allreduce(MPI.IN_PLACE, message(piece, nbytes, dtype), reduction)
        if contiguous:
            if scale != 1.0:
                _C.scale(piece, nbytes // itemsize, dtype, scale)
        else:
            with timeline.phase("unpacked"):
                _C.unpack(piece, dsts, sizes, dtype, scale, begin, end)


def _reduce_from_gpu(many: _Many, srcs, dsts, sizes, pieces, reduction, scale: float) -> None:
    """``_reduce_staged`` for GPU memory, pipelined through two pinned pieces: while MPI
    reduces one, the GPU copies the next one out, and the one before back (pycoll's copy
    stream runs them in order, so a piece's buffer is refilled only once it is copied
    back). Average's scale runs on the GPU once a piece is back, where the stager can: on
    the host it is a pass over every byte in the thread that feeds MPI."""
    stage, dtype = tensors.stager(many.device_id), many.dtype
    scale_on_gpu = scale != 1.0 and stage.scales     # else on the host, before the copy back
    room = max(nbytes for _, nbytes in pieces)
    halves = many.grp.engine.fusion_buffer(2 * room, device=many.device_id).ctypes.data
    at_piece = [halves + k % 2 * room for k in range(len(pieces))]

    def fetch(k: int):
        begin, nbytes = pieces[k]
        for i, offset, at, n in _segments(sizes, begin, begin + nbytes):
            stage.copy(at_piece[k] + at, srcs[i] + offset, n, many.ready)
        return stage.mark()

    arrived = fetch(0)
    for k, (begin, nbytes) in enumerate(pieces):
        following = fetch(k + 1) if k + 1 < len(pieces) else None
        stage.wait(arrived)
        with timeline.phase("in MPI"):
            many.grp.comm.Allreduce(MPI.IN_PLACE, message(at_piece[k], nbytes, dtype), reduction)
        if scale != 1.0 and not scale_on_gpu:
            _C.scale(at_piece[k], nbytes // ITEMSIZE[dtype], dtype, scale)
        back = list(_segments(sizes, begin, begin + nbytes))
        for i, offset, at, n in back:
            stage.copy(dsts[i] + offset, at_piece[k] + at, n)
        if scale_on_gpu:
            stage.scale([dsts[i] + offset for i, offset, _, _ in back], [n for *_, n in back],
                        dtype, scale)
        arrived = following
    stage.wait()


def _segments(sizes: Sequence[int], begin: int, end: int):
    """(tensor index, offset in it, offset in the piece, nbytes) of each tensor's share of
    bytes [begin, end) of the packed stream: where _C.pack cannot reach (GPU memory)."""
    pos = 0
    for i, size in enumerate(sizes):
        lo, hi = max(pos, begin), min(pos + size, end)
        if lo < hi:
            yield i, lo - pos, lo - begin, hi - lo
        pos += size


# Pieces that are packed and unpacked are at most this long per peer, so that each stays
# in a core's cache (2 MiB of L2 on every machine measured) from pack through MPI to
# unpack, and few enough: each is one more MPI call (at 2 ranks, 4 MiB in 8 allreduces
# took 0.55 ms against 0.43 in 2-4). 1,000 x 4 KiB through grouped_allreduce_ against the
# concatenated floor, numpy, 512 KiB / 2 MiB pieces (2026-11-27): AMD VM 2.37x / 1.78x at
# 2 ranks, 1.58x / 1.50x at 4 on 2 cores; 16-core Intel Xeon 2.12x / 2.32x at 2 ranks,
# 1.79x / 1.67x at 4 (docs/benchmarks.md, Fusion). Destinations back to back
# (grouped_allreduce's new buffer) need no unpack: they keep PYCOLL_CHUNK_BYTES. The short
# path cuts the same pieces.
_CACHED_PIECE = 2 * 1024 * 1024

# A tensor this large costs more to copy into the fusion buffer and back (2 x 256 KiB at
# 5-8 GB/s: 60-100 us) than to send by itself (10-30 us of call overhead here); with it,
# bench/fusion.py's ResNet-50 gradients took 41 ms instead of 63 ms at 2 ranks.
_ALONE_BYTES = 256 * 1024


def _allreduce_many(many: _Many) -> None:
    """Same-key allreduces: tensors of _ALONE_BYTES or more that MPI can read go by
    themselves, without a copy; the others are packed in fusion-threshold-sized groups
    (a group of one goes alone too). Every rank splits the list the same way."""
    threshold = config.get("fusion_threshold")
    direct = _direct(many.device)
    if max(many.sizes) < _ALONE_BYTES and sum(many.sizes) <= threshold:     # one group
        if len(many.sizes) > 1:
            _allreduce_fused(many, range(len(many.sizes)))
        else:
            _allreduce_one(many.item(0))
        return
    group: List[int] = []
    size = 0
    for i, nbytes in enumerate(many.sizes + [None]):
        if nbytes is not None and nbytes >= _ALONE_BYTES and direct:
            _allreduce_one(many.item(i))
            continue
        if group and (nbytes is None or size + nbytes > threshold):
            _allreduce_fused(many, group) if len(group) > 1 else _allreduce_one(many.item(group[0]))
            group, size = [], 0
        if nbytes is not None:
            group.append(i)
            size += nbytes


def _direct(device: str) -> bool:
    """Whether MPI can read memory on ``device`` where it is (else it is staged through
    host memory)."""
    return device == "cpu" or config.get("cuda_aware_mpi")


def _allreduce_queued(items: List[_Allreduce]) -> list:
    """A batch the engine fused. With PYCOLL_CYCLE_TIME_MS each rank cuts its batches by
    its own clock, so they may differ: the ranks send the longest prefix that all of them
    hold (one small MIN allreduce, Horovod's negotiation), and the engine queues the rest
    first. Without a cycle, batches are cut at the same places on every rank. Returns the
    outputs of those sent."""
    if config.get("cycle_time_ms"):
        count = np.array([len(items)], np.int64)
        items[0].grp.comm.Allreduce(MPI.IN_PLACE, count, MPI.MIN)
        items = items[:int(count[0])]
    _allreduce_many(_Many.of(items))
    return [item.out for item in items]


def _plan_grouped_allreduce(xs, op, group, name, inplace):
    name, op, grp = name or "grouped_allreduce", reduce_op(op), runtime.resolve(group)
    xs = list(xs)
    # Many small CPU tensors are read in one pass, not one as_buffer each: per tensor,
    # that is most of the cost (bench/fusion.py's 1,000 x 4 KiB case).
    host = tensors.host_pointers(xs) if not config.get("check") else None
    if host is not None:
        ptrs, sizes, dtype = host
        check_reduction(op, dtype)
        if inplace:
            outs, dsts = xs, ptrs
        else:                           # the results: views of one new buffer
            outs, base = tensors.views_like(xs[0], sum(sizes), tensors.shape_runs(xs))
            dsts = list(itertools.accumulate(sizes[:-1], initial=base))
        many = _Many(ptrs, dsts, sizes, dtype, "cpu", op, grp, lambda i: _Allreduce(
            as_buffer(xs[i]), as_buffer(outs[i], writable=True), outs[i], op, grp, f"{name}[{i}]"))

        def run_host():
            _allreduce_many(many)
            return list(outs)
        return grp, name, run_host
    items = [_planned_item(x, op, grp, f"{name}[{i}]", inplace) for i, x in enumerate(xs)]
    _same_kind([it.src for it in items])
    by_dtype: dict = {}
    for item in items:
        by_dtype.setdefault(item.src.dtype, []).append(item)

    def run():
        for same in by_dtype.values():
            _allreduce_many(_Many.of(same))
        return [item.out for item in items]
    return grp, name, run


# allgather, alltoall and reduce_scatter send every rank's sizes with their data, in one
# exchange (_C.carried_exchange; the rule is csrc/short_path.cpp's exchange()), and then
# move in a second round what did not fit. These are its kinds and the header's words:
# [largest part in bytes, signature, out='s bytes or -1, sizes...].
_ALLGATHER, _ALLTOALL, _REDUCE_SCATTER = 0, 1, 2
_SIZES = 3


def _exchange(kind: int, grp: runtime.Group, header: List[int], send: int, parts: List[int]):
    """(every rank's header, every rank's carried part as uint8 rows or None where a
    second round must move the data)."""
    blocks, complete = _C.carried_exchange(kind, grp, header, send, parts)
    blocks = blocks.reshape(grp.size(), -1)
    return blocks[:, :len(header)].tolist(), blocks[:, len(header):].view(np.uint8) if complete else None


def _unpack(carried, dst: int, counts: Sequence[int]) -> None:
    """The carried parts, ``counts[r]`` bytes from rank r, back to back at ``dst``."""
    into = np.frombuffer(MPI.buffer.fromaddress(dst, sum(counts)), np.uint8)
    for part, begin, count in zip(carried, _displacements(counts), counts):
        into[begin:begin + count] = part[:count]


def _plan_allgather(x, group, name, out=None):
    grp = runtime.resolve(group)
    src = as_buffer(x)
    given, out_word, out_error = _output(out, src.dtype, "allgather")
    name = name or "allgather"

    def run():
        rows = src.shape[0] if src.shape else 1
        row_shape = tuple(src.shape[1:])
        grp.agree("allgather", name, dtype=src.dtype, row_shape=row_shape)
        header = [src.nbytes, _C.row_signature(src.dtype, row_shape),
                  out_word, rows]
        with _host(src) as s:
            headers, carried = _exchange(_ALLGATHER, grp, header, s, [src.nbytes])
            _outs_usable(name, headers, out_error)
            counts = _allgather_counts(name, grp, src, headers)
            result = out if given is not None else tensors.empty_like(
                x, (sum(h[_SIZES] for h in headers),) + row_shape)
            dst = given or as_buffer(result, writable=True)
            with _host(dst, read=False, write=True) as d, timeline.phase("in MPI"):
                if carried is not None:
                    _unpack(carried, d, counts)
                elif len(set(counts)) == 1:     # every rank's the same (all see them): MPI's even call
                    grp.comm.Allgather(message(s, src.nbytes),
                                       [MPI.buffer.fromaddress(d, dst.nbytes), counts[0], MPI.BYTE])
                else:
                    grp.comm.Allgatherv(message(s, src.nbytes),
                                        [MPI.buffer.fromaddress(d, dst.nbytes), counts,
                                         _displacements(counts), MPI.BYTE])
        return result
    return grp, name, emulation.timed("allgather", grp.comm, src.nbytes, run)


def _allgather_counts(name: str, grp: runtime.Group, src: Buffer, headers) -> List[int]:
    """Each rank's bytes, from every rank's header; raises, on every rank (all see the
    same), where the ranks' rows differ in dtype or shape, an out= has the wrong size or a
    part is beyond MPI's counts."""
    rows, row_shape = (src.shape[0] if src.shape else 1), tuple(src.shape[1:])
    _, signatures, out_bytes, all_rows = zip(*headers)
    if len(set(signatures)) > 1:
        found = grp.comm.allgather((rows, row_shape, src.dtype))
        raise ValueError(f"{name}: tensors must agree in dtype and in every dim but the "
                         f"first; rank: (rows, other dims, dtype) = {dict(enumerate(found))}")
    row_bytes = math.prod(row_shape) * ITEMSIZE[src.dtype]
    counts = [r * row_bytes for r in all_rows]
    wrong = [r for r, nbytes in enumerate(out_bytes) if nbytes >= 0 and nbytes != sum(counts)]
    if wrong:
        raise ValueError(f"{name}: out= must hold the {sum(counts)} gathered bytes "
                         f"({sum(all_rows)} rows of {row_shape}); ranks {wrong} passed "
                         f"{[out_bytes[r] for r in wrong]} bytes")
    _check_counts(name, counts, "bytes")
    return counts


def _disagreed(kind: str, x, out, group, name, headers) -> None:
    """The short path's exchange found the ranks' ``headers`` in disagreement: the general
    path's error for ``kind``."""
    grp, src = runtime.resolve(group), as_buffer(x)
    name = name or kind
    _outs_usable(name, headers, None)
    if kind == "allgather":
        _allgather_counts(name, grp, src, headers)
    elif kind == "alltoall":
        _alltoall_received(name, grp, src, headers)
    else:
        _reduce_scatter_agreed(name, grp, src, headers)


# A header's word for out=: none, one that cannot take the result, else its bytes.
_NO_OUT, _BAD_OUT = -1, -2


def _output(out, dtype: str, what: str):
    """``out=`` (where an operation writes its result instead of a new tensor) as a
    Buffer, its header word, and the error it raises: a bad out= is raised after the
    exchange of sizes, on every rank (the others name its rank), not on its rank alone."""
    if out is None:
        return None, _NO_OUT, None
    try:
        dst = as_buffer(out, writable=True)
        if dst.dtype != dtype:
            raise TypeError(f"{what}: out= is {dst.dtype} but the input is {dtype}; pass a "
                            f"{dtype} tensor")
    except (TypeError, ValueError) as error:
        return None, _BAD_OUT, error
    return dst, dst.nbytes, None


def _outs_usable(name: str, headers, error) -> None:
    """Raise this rank's out= ``error``, or name the ranks whose out= cannot take the
    result (every rank sees the same headers)."""
    if error is not None:
        raise error
    bad = [r for r, h in enumerate(headers) if h[2] == _BAD_OUT]
    if bad:
        raise ValueError(f"{name}: the out= of ranks {bad} cannot take the result; see the "
                         f"error those ranks raised")


def _displacements(counts: Sequence[int]) -> List[int]:
    return [0, *itertools.accumulate(counts[:-1])] if counts else []


def _plan_broadcast(x, root, group, name, inplace):
    grp = runtime.resolve(group)
    check_root(root, grp)
    sends = grp.rank() == root          # and only sends: its tensor may be read-only, as in MPI
    src = as_buffer(x, writable=inplace and not sends)
    out = x if inplace else (tensors.clone(x) if sends else tensors.empty_like(x, src.shape))
    dst = src if inplace else as_buffer(out, writable=True)

    name = name or "broadcast"

    def run():
        grp.agree("broadcast", name, dtype=src.dtype, shape=src.shape, root=root)
        with _host(dst, read=sends, write=not sends) as d, timeline.phase("in MPI"):
            # typed, as mpi4py sends an array (MPI_BYTE x 4n took 1.20x mpi4py's MPI_FLOAT
            # x n at 64 MiB, 2 ranks)
            for offset, nbytes in _pieces(dst.nbytes, ITEMSIZE[dst.dtype]):
                grp.comm.Bcast(message(d + offset, nbytes, dst.dtype), root=root)
        return out
    return grp, name, emulation.timed("broadcast", grp.comm, dst.nbytes, run)


def _split_rows(rows: int, parts: int) -> List[int]:
    """``rows`` split as evenly as possible, the first ranks taking one more."""
    return [rows // parts + (r < rows % parts) for r in range(parts)]


def _plan_reduce_scatter(x, op, group, name, out=None):
    op, grp = reduce_op(op), runtime.resolve(group)
    src = as_buffer(x)
    check_reduction(op, src.dtype)
    if not src.shape:
        raise ValueError("reduce_scatter splits dim 0 across ranks; got a 0-d tensor")
    rows = _split_rows(src.shape[0], grp.size())
    shape = (rows[grp.rank()],) + tuple(src.shape[1:])
    # A wrong out= is found by every rank, in the exchange: not here, on this rank alone.
    given, out_word, out_error = _output(out, src.dtype, "reduce_scatter")
    row_count = src.count // src.shape[0] if src.shape[0] else 0
    itemsize = ITEMSIZE[src.dtype]

    name = name or "reduce_scatter"

    def run():
        grp.agree("reduce_scatter", name, dtype=src.dtype, shape=src.shape, op=op.value)
        counts = [r * row_count for r in rows]
        _check_counts(name, counts, "elements")
        parts = [c * itemsize for c in counts]
        header = [max(parts), _C.row_signature(f"{src.dtype}/{op.value}", src.shape[1:]),
                  out_word, src.shape[0]]
        with _host(src) as s:
            headers, carried = _exchange(_REDUCE_SCATTER, grp, header, s, parts)
            _outs_usable(name, headers, out_error)
            _reduce_scatter_agreed(name, grp, src, headers)
            result = out if given is not None else tensors.empty_like(x, shape)
            dst = given or as_buffer(result, writable=True)
            with _host(dst, read=False, write=True) as d, timeline.phase("in MPI"):
                if carried is not None:     # every rank's part for this one: reduced here
                    _unpack(carried[:1], d, [dst.nbytes])
                    for part in carried[1:]:
                        _C.reduce(d, part.ctypes.data, dst.count, src.dtype, kernel_op(op))
                elif len(set(counts)) == 1:     # every rank's the same: MPI's even call
                    grp.comm.Reduce_scatter_block(      # mpi4py's send count: one block's
                        [MPI.buffer.fromaddress(s, src.nbytes), counts[0], _MPI_TYPES[src.dtype]],
                        message(d, dst.nbytes, dst.dtype), mpi_op(op, src.dtype))
                else:
                    grp.comm.Reduce_scatter(message(s, src.nbytes, src.dtype),
                                            message(d, dst.nbytes, dst.dtype), counts,
                                            mpi_op(op, src.dtype))
                if op is Average:
                    _scale(dst, d, dst.count, 1.0 / grp.size())
        return result
    return grp, name, emulation.timed("reduce_scatter", grp.comm, src.nbytes, run)


def _reduce_scatter_agreed(name: str, grp: runtime.Group, src: Buffer, headers) -> None:
    """Raises, on every rank (all see the same headers), where the ranks' tensors differ
    in rows, dtype, op or the shape of a row, or an out= is not its rank's block."""
    _, signatures, out_bytes, all_rows = zip(*headers)
    if len(set(signatures)) > 1 or len(set(all_rows)) > 1:
        found = grp.comm.allgather((tuple(src.shape), src.dtype))
        raise ValueError(f"{name}: every rank's tensor must have the same shape and dtype, "
                         f"and the same op; rank: (shape, dtype) = {dict(enumerate(found))} "
                         f"(the op may differ too)")
    row_bytes = math.prod(src.shape[1:]) * ITEMSIZE[src.dtype]
    wanted = [r * row_bytes for r in _split_rows(all_rows[0], len(headers))]
    wrong = {r: (wanted[r], nbytes) for r, nbytes in enumerate(out_bytes)
             if nbytes >= 0 and nbytes != wanted[r]}
    if wrong:
        raise ValueError(f"{name}: out= must hold this rank's block of rows (of shape "
                         f"{tuple(src.shape[1:])}); rank: (bytes needed, bytes of its out=) = "
                         f"{wrong}; pass out= of that size, or none for a new tensor")


def _plan_alltoall(x, splits, group, name, out=None):
    grp = runtime.resolve(group)
    src = as_buffer(x)
    if not src.shape:
        raise ValueError("alltoall splits dim 0 across ranks; got a 0-d tensor")
    rows, n = src.shape[0], grp.size()
    if splits is None:
        if rows % n:
            raise ValueError(f"alltoall without splits needs dim 0 ({rows}) divisible by the "
                             f"number of ranks ({n}); pass splits=[rows for each rank]")
        splits = [rows // n] * n
    sent = np.asarray(splits).reshape(-1).tolist()     # Python ints: numpy's cost more here
    if len(sent) != n or min(sent) < 0 or sum(sent) != rows or sent != [int(r) for r in sent]:
        raise ValueError(f"alltoall splits must be {n} non-negative row counts summing to "
                         f"dim 0 ({rows}), got {sent}")
    given, out_word, out_error = _output(out, src.dtype, "alltoall")
    row_shape = tuple(src.shape[1:])
    row_bytes = math.prod(row_shape) * ITEMSIZE[src.dtype]
    send_counts = [int(r) * row_bytes for r in sent]
    # Every rank sends its splits and out='s size, so that each knows what every rank
    # receives and a wrong out= raises on all of them.
    header = [max(send_counts), _C.row_signature(src.dtype, row_shape),
              out_word] + [int(r) for r in sent]

    name = name or "alltoall"

    def run():
        grp.agree("alltoall", name, dtype=src.dtype, row_shape=row_shape)
        with _host(src) as s:
            headers, carried = _exchange(_ALLTOALL, grp, header, s, send_counts)
            _outs_usable(name, headers, out_error)
            received = _alltoall_received(name, grp, src, headers)
            recv_splits = np.array(received, np.int64)
            result = out if given is not None else tensors.empty_like(x, (sum(received),) + row_shape)
            dst = given or as_buffer(result, writable=True)
            recv_counts = [r * row_bytes for r in received]
            with _host(dst, read=False, write=True) as d, timeline.phase("in MPI"):
                if carried is not None:
                    _unpack(carried, d, recv_counts)
                elif len({r for h in headers for r in h[_SIZES:]}) == 1:    # every part the same
                    # MPI's own even call (the short path makes the same choice)
                    grp.comm.Alltoall([MPI.buffer.fromaddress(s, src.nbytes), send_counts[0], MPI.BYTE],
                                      [MPI.buffer.fromaddress(d, dst.nbytes), recv_counts[0], MPI.BYTE])
                else:
                    grp.comm.Alltoallv(
                        [MPI.buffer.fromaddress(s, src.nbytes), send_counts,
                         _displacements(send_counts), MPI.BYTE],
                        [MPI.buffer.fromaddress(d, dst.nbytes), recv_counts,
                         _displacements(recv_counts), MPI.BYTE])
        return result, recv_splits
    return grp, name, emulation.timed("alltoall", grp.comm, src.nbytes, run)


def _alltoall_received(name: str, grp: runtime.Group, src: Buffer, headers) -> List[int]:
    """This rank's received rows from each rank, out of every rank's header; raises, on
    every rank (all see the same), where the ranks' rows differ in dtype or shape, an out=
    has the wrong size or a part is beyond MPI's counts."""
    n, row_shape = len(headers), tuple(src.shape[1:])
    if len({h[1] for h in headers}) > 1:
        found = grp.comm.allgather((row_shape, src.dtype))
        raise ValueError(f"{name}: tensors must agree in dtype and in every dim but the "
                         f"first; rank: (other dims, dtype) = {dict(enumerate(found))}")
    row_bytes = math.prod(row_shape) * ITEMSIZE[src.dtype]
    rank_rows = [sum(h[_SIZES + d] for h in headers) for d in range(n)]
    wrong = [d for d, h in enumerate(headers) if 0 <= h[2] != rank_rows[d] * row_bytes]
    if wrong:
        found = {d: (rank_rows[d], rank_rows[d] * row_bytes, headers[d][2]) for d in wrong}
        raise ValueError(f"{name}: out= must hold the rows each rank receives (rows of shape "
                         f"{row_shape}); rank: (rows received, bytes needed, bytes of its out=) "
                         f"= {found}; pass out= of that size, or none for a new tensor")
    _check_counts(name, [r * row_bytes for h in headers for r in h[_SIZES:]]
                  + [r * row_bytes for r in rank_rows], "bytes")
    return [h[_SIZES + grp.rank()] for h in headers]


def _plan_barrier(group, name, timeout):
    grp, name = runtime.resolve(group), name or "barrier"

    def run():
        limit = config.get("timeout")   # past it the engine's watchdog would end the job
        if timeout is not None:
            limit = min(timeout, limit)
        grp.agree("barrier", name, None if timeout is None else limit)
        # Polled, not MPI_Barrier: past its deadline the engine leaves it and goes on to
        # the next operation (a blocking barrier that a rank skipped would hold the engine,
        # and the process's exit, until PYCOLL_TIMEOUT).
        with timeline.phase("in MPI"):
            if not wait_request(grp.comm.Ibarrier(), limit):
                raise CollectiveTimeout(
                    f"pycoll: {name} did not complete within the timeout of {limit:g} s: not "
                    f"every rank of its group ({grp.size()}) reached it; the others skipped "
                    "it, are late or died (a rank that comes later passes it)")
    return grp, name, emulation.timed("barrier", grp.comm, 0, run)


# The blocking collectives' short path, in C (csrc/short_path.cpp): contiguous host
# tensors, while their group's engine is idle, go straight to MPI, with the same calls as the
# planners above make. At small sizes the general path's planning and mpi4py's argument
# handling cost several times the communication. These are the functions and handles it
# uses; runtime binds the world and its gate (another group's is read from the group).
_C.short_path_setup(ndarray=np.ndarray, is_torch=tensors.is_torch, find_route=_short_route,
                    resolve=runtime.resolve, empty_like=tensors.empty_like,
                    huge_paged=tensors.HUGE_PAGED,
                    empty=np.empty, counts_dtype=np.dtype(np.int64),
                    failed=_disagreed, views=tensors.views_like,
                    staging=lambda group, nbytes:
                        runtime.resolve(group).engine.fusion_buffer(nbytes),
                    alone_bytes=_ALONE_BYTES, cached_piece=_CACHED_PIECE,
                    mpi_error=MPI.Exception,
                    in_place=int(MPI.IN_PLACE), byte=MPI._handleof(MPI.BYTE),
                    int64=MPI._handleof(MPI.INT64_T))
# Mismatch checks (ranks compare what they submit) and the timeline and report happen on
# the general path only. Under --link the short path is paced as the general path's
# collectives are, by the group's emulation.group.
def _short_path_pace(group):
    return emulation.group(runtime.resolve(group).comm)


config.watch(lambda: _C.short_path_settings(not config.get("check") and not timeline.configured(),
                                            config.get("chunk_bytes"),
                                            config.get("fusion_threshold"),
                                            *((_short_path_pace,) if config.get("link") else ())))


# ---------------------------------------------------------------- public API

def _run(plan) -> object:
    grp, name, thunk = plan
    return grp.engine.run(thunk, name)


def _submit(plan) -> Work:
    grp, name, thunk = plan
    return grp.engine.submit(thunk, name)


def _submit_allreduce(x, op, group, name, inplace) -> Work:
    """Plan an async allreduce and queue it, fusable with those of its key (dtype, device,
    op, communicator). Inline: a step's every gradient takes this path."""
    op, grp, name = reduce_op(op), runtime.resolve(group), name or "allreduce"
    if inplace:             # _planned_item's usual case, without a call (0.07 us of 2)
        src = as_buffer(x, writable=True)
        check_reduction(op, src.dtype)
        item = _new_item((src, src, x, op, grp, name))
    else:
        item = _planned_item(x, op, grp, name, inplace)
        src = item[0]       # item.src: a NamedTuple's field by name costs more
    return grp.engine.submit_fusable((src.dtype, src.device, op, grp), src.nbytes, item,
                                     _allreduce_queued, name)


def allreduce(x, op=Average, group=None, name: Optional[str] = None):
    """Reduce ``x`` over the ranks of ``group``; a new tensor holds the result."""
    out = _C.allreduce_now(x, False, op, group, name)
    if out is not None:
        return out
    emulation.called()
    item = _allreduce_item(x, op, group, name, inplace=False)
    return item.grp.engine.run(lambda: _allreduce_one(item), item.name)


def allreduce_(x, op=Average, group=None, name: Optional[str] = None):
    """``allreduce`` into ``x`` itself; returns ``x``."""
    if _C.allreduce_now(x, True, op, group, name) is not None:
        return x
    emulation.called()
    item = _allreduce_item(x, op, group, name, inplace=True)
    return item.grp.engine.run(lambda: _allreduce_one(item), item.name)


def allreduce_async(x, op=Average, group=None, name: Optional[str] = None) -> Work:
    """Start an allreduce; consecutive async allreduces are fused (PYCOLL_FUSION_THRESHOLD)."""
    return _submit_allreduce(x, op, group, name, False)


def allreduce_async_(x, op=Average, group=None, name: Optional[str] = None) -> Work:
    return _submit_allreduce(x, op, group, name, True)


def flush() -> None:
    """Start the pending fused batches (of every group) now instead of when a result is
    waited for."""
    for engine in runtime.engines():
        engine.flush()


def grouped_allreduce(xs, op=Average, group=None, name: Optional[str] = None) -> list:
    """Allreduce a list of tensors in one fused call per dtype; new tensors (views of one
    new buffer where the list was read in one pass)."""
    got = _C.grouped_allreduce_now(xs, False, op, group, name)
    return got if got is not None else _run(_plan_grouped_allreduce(xs, op, group, name, False))


def grouped_allreduce_(xs, op=Average, group=None, name: Optional[str] = None) -> list:
    got = _C.grouped_allreduce_now(xs, True, op, group, name)
    return got if got is not None else _run(_plan_grouped_allreduce(xs, op, group, name, True))


def grouped_allreduce_async(xs, op=Average, group=None, name: Optional[str] = None) -> Work:
    return _submit(_plan_grouped_allreduce(xs, op, group, name, inplace=False))


def grouped_allreduce_async_(xs, op=Average, group=None, name: Optional[str] = None) -> Work:
    return _submit(_plan_grouped_allreduce(xs, op, group, name, inplace=True))


def allgather(x, group=None, name: Optional[str] = None, out=None):
    """Concatenate every rank's ``x`` along dim 0 (dim-0 sizes may differ); into ``out``
    (contiguous, of the total size) if given, else a new tensor."""
    got = _C.allgather_now(x, out, group, name)
    return got if got is not None else _run(_plan_allgather(x, group, name, out))


def allgather_async(x, group=None, name: Optional[str] = None, out=None) -> Work:
    return _submit(_plan_allgather(x, group, name, out))


def broadcast(x, root: int = 0, group=None, name: Optional[str] = None):
    """``root``'s ``x`` on every rank, as a new tensor."""
    got = _C.broadcast_now(x, False, root, group, name)
    return got if got is not None else _run(_plan_broadcast(x, root, group, name, inplace=False))


def broadcast_(x, root: int = 0, group=None, name: Optional[str] = None):
    """Overwrite ``x`` with ``root``'s; returns ``x``."""
    if _C.broadcast_now(x, True, root, group, name) is not None:
        return x
    return _run(_plan_broadcast(x, root, group, name, inplace=True))


def broadcast_async(x, root: int = 0, group=None, name: Optional[str] = None) -> Work:
    return _submit(_plan_broadcast(x, root, group, name, inplace=False))


def broadcast_async_(x, root: int = 0, group=None, name: Optional[str] = None) -> Work:
    return _submit(_plan_broadcast(x, root, group, name, inplace=True))


def reduce_scatter(x, op=Average, group=None, name: Optional[str] = None, out=None):
    """Reduce ``x`` and give each rank its block of dim 0 (first ranks get the extra rows);
    into ``out`` (contiguous, of the block's size) if given, else a new tensor."""
    got = _C.reduce_scatter_now(x, op, out, group, name)
    return got if got is not None else _run(_plan_reduce_scatter(x, op, group, name, out))


def reduce_scatter_async(x, op=Average, group=None, name: Optional[str] = None,
                         out=None) -> Work:
    return _submit(_plan_reduce_scatter(x, op, group, name, out))


def alltoall(x, splits=None, group=None, name: Optional[str] = None, out=None):
    """Send row block ``splits[r]`` of ``x`` to rank r; returns (result, received splits).
    The result is ``out`` (contiguous, of the received size: every rank checks every
    rank's, so a wrong one raises on all) if given, else a new tensor."""
    got = _C.alltoall_now(x, splits, out, group, name)
    return got if got is not None else _run(_plan_alltoall(x, splits, group, name, out))


def alltoall_async(x, splits=None, group=None, name: Optional[str] = None, out=None) -> Work:
    return _submit(_plan_alltoall(x, splits, group, name, out))


def barrier(group=None, name: Optional[str] = None, timeout: Optional[float] = None) -> None:
    """Return once every rank of ``group`` has called it; ``CollectiveTimeout`` if they
    have not within ``timeout`` s (default and at most PYCOLL_TIMEOUT). A rank that comes
    later still passes the barrier that this one left."""
    _run(_plan_barrier(group, name, timeout))


def barrier_async(group=None, name: Optional[str] = None,
                  timeout: Optional[float] = None) -> Work:
    return _submit(_plan_barrier(group, name, timeout))
