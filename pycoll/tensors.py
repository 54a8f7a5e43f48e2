"""One adapter from numpy / torch / cupy / any array to a raw buffer description.

Tried in order: the buffer protocol (numpy and friends), then DLPack (torch, cupy,
jax), then ``__cuda_array_interface__`` (cupy, numba, and the fake GPU arrays of the
tests). Nothing is copied: a ``Buffer`` points into the caller's memory and keeps
the owner alive.
"""
import ctypes
import itertools
import math
import sys
import weakref
from typing import Any, Callable, List, NamedTuple, Optional, Tuple

import numpy as np

from . import _C, config

# The one dtype table. An index here is a dtype's code in the parameter server's messages:
# add at the end, never reorder. bool is a byte of 0 or 1: reduced, Sum and Max are any
# rank's True (logical or, as torch's gloo and NCCL backends give), Min and Product all.
# float8 (NCCL's two) is moved, never reduced: no reduction is defined for it.
DTYPES = ("float16", "bfloat16", "float32", "float64",
          "int8", "int16", "int32", "int64", "uint8", "bool",
          "uint16", "uint32", "uint64", "float8_e4m3fn", "float8_e5m2")
ITEMSIZE = {"float16": 2, "bfloat16": 2, "float32": 4, "float64": 8,
            "int8": 1, "int16": 2, "int32": 4, "int64": 8, "uint8": 1, "bool": 1,
            "uint16": 2, "uint32": 4, "uint64": 8, "float8_e4m3fn": 1, "float8_e5m2": 1}
FLOATS = ("float16", "bfloat16", "float32", "float64")
FLOAT8 = ("float8_e4m3fn", "float8_e5m2")

# DLPack's (type code, bits) -> our dtype name; codes: 0 int, 1 uint, 2 float, 4 bfloat,
# 6 bool, 10 float8_e4m3fn, 12 float8_e5m2.
_DLPACK_DTYPES = {(2, 16): "float16", (4, 16): "bfloat16", (2, 32): "float32",
                  (2, 64): "float64", (0, 8): "int8", (0, 16): "int16",
                  (0, 32): "int32", (0, 64): "int64", (1, 8): "uint8", (6, 8): "bool",
                  (1, 16): "uint16", (1, 32): "uint32", (1, 64): "uint64",
                  (10, 8): "float8_e4m3fn", (12, 8): "float8_e5m2"}
# numpy has no bfloat16 or float8 of its own: ml_dtypes' (JAX's) join the table on first
# sight (_numpy_dtype), not at import, which would cost every process half a second.
_NUMPY_DTYPES = {np.dtype(name): name for name in DTYPES
                 if name != "bfloat16" and name not in FLOAT8}
_DL_CPU, _DL_CUDA, _DL_CUDA_HOST, _DL_CUDA_MANAGED = 1, 2, 3, 13


class Buffer(NamedTuple):
    """Where a tensor's bytes live. ``owner`` keeps the memory alive. ``ready``: for GPU
    memory, an event recorded on the producer's stream when the tensor was handed to
    pycoll; pycoll touches the memory only after it (None: no GPU in this process)."""
    ptr: int
    nbytes: int
    dtype: str
    shape: Tuple[int, ...]
    device: str          # "cpu" or "cuda"
    device_id: int
    readonly: bool
    owner: Any
    ready: Any = None

    @property
    def count(self) -> int:
        return self.nbytes // ITEMSIZE[self.dtype]

    @property
    def is_cuda(self) -> bool:
        return self.device == "cuda"


def _describe(x) -> str:
    return f"{type(x).__module__}.{type(x).__qualname__}"


def _check_dtype(name: str, x) -> str:
    if name not in ITEMSIZE:
        fix = ("Pass its real view (numpy: x.view(x.real.dtype), torch: "
               "torch.view_as_real(x)), right for Sum, Average and the collectives that "
               "move data" if "complex" in name else "Cast the tensor first")
        raise TypeError(f"pycoll does not support dtype {name} (of a {_describe(x)}); "
                        f"supported: {', '.join(DTYPES)}. {fix}.")
    return name


def _numpy_dtype(dtype: np.dtype, x) -> str:
    """pycoll's name of numpy ``dtype`` (of ``x``), in this machine's byte order only: MPI
    would reduce the bytes of swapped numbers as if they were not."""
    if not dtype.isnative:
        raise TypeError(f"pycoll needs numbers in this machine's byte order, got dtype "
                        f"{dtype.str} (of a {_describe(x)}); pass "
                        f"x.astype(x.dtype.newbyteorder('='))")
    name = _NUMPY_DTYPES[dtype] = _check_dtype(dtype.name, x)
    return name


def _contiguous(shape, strides) -> bool:
    """C-contiguous? ``strides`` in elements; extents of 1 may have any stride."""
    if 0 in shape:
        return True
    expected = 1
    for extent, stride in zip(reversed(shape), reversed(strides)):
        if extent != 1 and stride != expected:
            return False
        expected *= extent
    return True


def _not_contiguous(x) -> ValueError:
    fix = ".contiguous()" if hasattr(x, "contiguous") else "numpy.ascontiguousarray(x)"
    return ValueError(f"pycoll needs a contiguous tensor, got a non-contiguous {_describe(x)}; "
                      f"pass {fix} (and copy the result back if you need it in place)")


def _from_numpy(a: np.ndarray) -> Buffer:
    name = _NUMPY_DTYPES.get(a.dtype) or _numpy_dtype(a.dtype, a)
    found = _C.address(a)
    if found is None:                   # not C-contiguous, or a dtype PEP 3118 cannot name
        if not a.flags.c_contiguous:
            raise _not_contiguous(a)
        found = a.__array_interface__["data"][0], not a.flags.writeable
    return Buffer(found[0], a.nbytes, name, a.shape, "cpu", 0, found[1], a)


def _from_torch(t) -> Buffer:
    """torch's own accessors: the same facts as its DLPack export, several times faster."""
    name = _TORCH_DTYPES.get(t.dtype) or _torch_dtype(t)
    if not t.is_contiguous():
        raise _not_contiguous(t)
    if t.is_cpu:
        return Buffer(t.data_ptr(), t.nbytes, name, tuple(t.shape), "cpu", 0, False, t)
    device = t.device
    if device.type != "cuda":
        raise TypeError(f"pycoll supports CPU and CUDA tensors; this one is on {device}. "
                        "Move it with .cpu() or .cuda().")
    index = device.index or 0
    stream = sys.modules["torch"].cuda.current_stream(index).cuda_stream
    return Buffer(t.data_ptr(), t.nbytes, name, tuple(t.shape), "cuda", index, False, t,
                  ready_event(stream, index))


def _torch_dtype(t) -> str:
    name = _TORCH_DTYPES[t.dtype] = _check_dtype(str(t.dtype).replace("torch.", ""), t)
    return name


_TORCH_DTYPES: dict = {}


def _from_dlpack(x) -> Buffer:
    if getattr(x, "requires_grad", False):
        x = x.detach()                      # torch refuses to export a tensor that needs grad
    capsule = x.__dlpack__()
    getptr = ctypes.pythonapi.PyCapsule_GetPointer
    getptr.restype, getptr.argtypes = ctypes.c_void_p, [ctypes.py_object, ctypes.c_char_p]
    managed = ctypes.cast(getptr(capsule, b"dltensor"), ctypes.POINTER(_DLTensor)).contents
    ndim = managed.ndim
    shape = tuple(managed.shape[i] for i in range(ndim))
    code, bits, lanes = managed.dtype.code, managed.dtype.bits, managed.dtype.lanes
    name = _DLPACK_DTYPES.get((code, bits)) if lanes == 1 else None
    if name is None:
        _check_dtype(str(getattr(x, "dtype", f"DLPack({code}, {bits}, {lanes})")), x)
    if managed.strides and not _contiguous(shape, [managed.strides[i] for i in range(ndim)]):
        raise _not_contiguous(x)
    device_type = managed.device.device_type
    if device_type in (_DL_CPU, _DL_CUDA_HOST):
        device = "cpu"
    elif device_type in (_DL_CUDA, _DL_CUDA_MANAGED):
        device = "cuda"
    else:
        raise TypeError(f"pycoll supports CPU and CUDA memory; this {_describe(x)} lives on "
                        f"DLPack device type {device_type}. Move it to the CPU or a CUDA GPU.")
    count = math.prod(shape)
    device_id = managed.device.device_id
    # The capsule stays in ``owner``: its destructor frees the export only after we are done.
    # Exported without a stream, so the legacy default stream orders the producer's work.
    return Buffer((managed.data or 0) + managed.byte_offset, count * ITEMSIZE[name], name,
                  shape, device, device_id, False, (x, capsule),
                  ready_event(0, device_id) if device == "cuda" else None)


def _from_cuda_array_interface(x) -> Buffer:
    cai = x.__cuda_array_interface__
    shape = tuple(cai["shape"])
    dtype = np.dtype(cai["typestr"])
    name = _numpy_dtype(dtype, x)
    strides = cai.get("strides")
    if strides is not None and not _contiguous(shape, [s / dtype.itemsize for s in strides]):
        raise _not_contiguous(x)
    ptr, readonly = cai["data"]
    count = math.prod(shape)
    device = _cuda_device_of(x)
    # "stream" (version 3) is the producer's: 1 and 2 are CUDA's names for the legacy and
    # per-thread default streams; without one, the legacy default stream orders everything.
    return Buffer(ptr or 0, count * dtype.itemsize, name, shape, "cuda", device,
                  bool(readonly), x, ready_event(cai.get("stream") or 0, device))


def _cuda_device_of(x) -> int:
    device = getattr(x, "device", None)
    index = getattr(device, "index", None) if device is not None else None
    if index is None:
        index = getattr(device, "id", 0)
    return int(index or 0)


def as_buffer(x, writable: bool = False) -> Buffer:
    """Describe ``x``'s memory; ``writable`` for in-place operations and outputs."""
    found = _C.host_buffer(x, _NUMPY_DTYPES, _TORCH_DTYPES, Buffer)  # most are read in C
    if found is not None:
        return found
    reader = _READERS.get(type(x)) or _reader(x)
    buf = reader(x)
    if writable and buf.readonly:
        raise ValueError(f"this {_describe(x)} is read-only and the operation writes into it; "
                         "use the out-of-place form or pass a writable copy")
    return buf


def _from_buffer_protocol(x) -> Buffer:
    return _from_numpy(np.asarray(memoryview(x)))


def _reader(x) -> Callable[[Any], Buffer]:
    """How to read objects of ``x``'s type, remembered by type: this choice sits on every
    collective's path."""
    if isinstance(x, np.ndarray):
        reader = _from_numpy
    elif type(x).__module__.startswith("torch"):
        reader = _from_torch
    elif _has_buffer_protocol(x):
        reader = _from_buffer_protocol
    elif hasattr(x, "__dlpack__"):
        reader = _from_dlpack
    elif hasattr(x, "__cuda_array_interface__"):
        reader = _from_cuda_array_interface
    else:
        raise TypeError(f"pycoll cannot read a {_describe(x)}: pass a numpy array, a torch "
                        "tensor, a cupy array or any object with the buffer protocol, "
                        "DLPack or __cuda_array_interface__")
    if reader is not _from_buffer_protocol:     # whether a buffer exports can depend on it
        _READERS[type(x)] = reader
    return reader


_READERS: dict = {}      # class -> reader


def is_torch(x) -> bool:
    """Whether ``x`` is read with torch's accessors (a TypeError for what pycoll cannot read)."""
    return (_READERS.get(type(x)) or _reader(x)) is _from_torch


def host_pointers(xs) -> Optional[Tuple[List[int], List[int], str]]:
    """(addresses, byte sizes, dtype) of writable, contiguous CPU tensors, all of one
    class and dtype, read in one pass in C, as the short path reads one: a grouped call
    over many small tensors spends most of its time reading them one by one. None when
    ``xs`` is not such a list: ``as_buffer`` then reads each and says what is wrong."""
    return _C.host_pointers(xs if type(xs) is list else list(xs))


def views_like(x, nbytes: int, runs) -> Tuple[list, int]:
    """One new buffer of ``nbytes`` bytes, of the kind and dtype of host tensor ``x``,
    cut into views by ``runs`` (``views_of``); the views and the buffer's address. From
    POOLED_GROUPED bytes the buffer is a ``_C.host_block``'s, as large results are."""
    x = as_array(x)
    itemsize = x.itemsize if hasattr(x, "itemsize") else x.element_size()
    flat = empty_like(x, (nbytes // itemsize,), POOLED_GROUPED)
    base = flat.data_ptr() if hasattr(flat, "data_ptr") else flat.ctypes.data
    return views_of(flat, runs), base


def shape_runs(xs) -> List[Tuple[int, Tuple[int, ...]]]:
    """(count, shape) of each run of consecutive ``xs`` of one shape, as ``views_of``
    takes them (the short path finds the same runs in C, without a shape per tensor)."""
    return [(sum(1 for _ in run), shape)
            for shape, run in itertools.groupby(tuple(x.shape) for x in xs)]


def views_of(flat, runs) -> list:
    """The one-dimensional ``flat`` (a new buffer no one else sees) cut, in order, into
    ``count`` views shaped ``shape`` for each (count, shape) of ``runs``. Each run is cut
    in one call: a view made one at a time costs more than the reduction of its bytes.
    torch's cut is ``unsafe_split_with_sizes``: its parts are not views for autograd,
    which they need not be (disjoint, of a base no one holds), and cost 0.25 us each
    against unbind's 0.39."""
    views: list = []
    start = 0
    torch_cut = hasattr(flat, "unsafe_split_with_sizes")
    for count, shape in runs:
        extent = math.prod(shape)
        block = flat[start:start + count * extent]
        if count == 1:
            views.append(block.reshape(shape))
        elif shape and torch_cut:
            rows = shape[0]
            views.extend(block.view((count * rows,) + tuple(shape[1:]))
                         .unsafe_split_with_sizes([rows] * count))
        elif shape:                     # numpy: a view of each row
            views.extend(block.reshape((count,) + tuple(shape)))
        else:                           # numpy would give scalars, not 0-d arrays
            views.extend(block[i:i + 1].reshape(()) for i in range(count))
        start += count * extent
    return views


def _has_buffer_protocol(x) -> bool:
    try:
        memoryview(x)
    # ValueError: numpy dtypes PEP 3118 cannot name; BufferError: JAX's bfloat16 (DLPack's)
    except (TypeError, ValueError, BufferError):
        return False
    return True


def as_array(x):
    """``x`` itself if it is an array, else (bytes, memoryview, ...) a numpy view of it."""
    return x if hasattr(x, "dtype") or not _has_buffer_protocol(x) else np.asarray(memoryview(x))


# Host results this large live in _C.host_block's memory: huge pages (torch's CPU
# allocator asks for none: a fresh 64 MiB output written by MPI's alltoall took 14-16 ms
# from numpy and 50-56 ms from torch.empty, nearly all of it page faults), and the memory
# of a result that died is reused by the next, with no pages to zero and map again.
HUGE_PAGED = 4 * 2**20
# grouped_allreduce's one buffer of results, from this size: torch's 3.9 MiB buffer for
# 1,000 x 4 KiB took 77 page faults a call at 2 ranks (none at 1 rank, nor numpy's), and
# a block reused is still in cache. A block is at most twice what it holds (2 MiB pages).
POOLED_GROUPED = 2**20


def _host_block(nbytes: int) -> np.ndarray:
    return np.frombuffer(_C.host_block(nbytes), np.uint8)


def _maker(x):
    """The module that makes results of ``x``'s kind (not torch's): numpy for numpy's and
    for host arrays whose module makes none (JAX's, immutable: results are numpy arrays);
    cupy and look-alikes for theirs."""
    if isinstance(x, (np.ndarray, np.generic)):
        return np
    module = sys.modules[type(x).__module__.split(".")[0]]
    if hasattr(module, "empty"):
        return module
    if as_buffer(x).device != "cpu":
        raise TypeError(f"pycoll cannot make a result like this {_describe(x)} (its module has "
                        "no empty()): use the in-place form, or pass torch.from_dlpack(x)")
    return np


def numpy_dtype(name: str) -> np.dtype:
    """numpy's dtype for pycoll's dtype ``name``; bfloat16 and float8 are ml_dtypes'."""
    if name == "bfloat16" or name in FLOAT8:
        try:
            import ml_dtypes
        except ImportError:
            raise TypeError(f"numpy has no {name} of its own: pip install ml_dtypes, or "
                            "use torch tensors") from None
        return np.dtype(getattr(ml_dtypes, name))
    return np.dtype(name)


def _numpy_dtype_of(x) -> np.dtype:
    """The dtype of numpy results for a foreign host array: its own where numpy knows it
    (JAX's bfloat16 is ml_dtypes'), else its DLPack type's."""
    try:
        return np.dtype(x.dtype)
    except (AttributeError, TypeError):
        return numpy_dtype(as_buffer(x).dtype)


def empty_like(x, shape, huge: int = HUGE_PAGED):
    """A new uninitialized array of ``x``'s kind (``_maker``'s), dtype and device, with
    ``shape``; on the host, from ``huge`` bytes, in a ``_C.host_block``."""
    x = as_array(x)
    if hasattr(x, "new_empty"):                                   # torch
        nbytes = math.prod(shape) * x.element_size()
        if x.is_cpu and nbytes >= huge:
            torch = sys.modules["torch"]
            return torch.from_numpy(_host_block(nbytes)).view(x.dtype).view(tuple(shape))
        return x.new_empty(tuple(shape))
    module = _maker(x)
    if module is np:
        dtype = x.dtype if isinstance(x, np.ndarray) else _numpy_dtype_of(x)
        nbytes = math.prod(shape) * dtype.itemsize
        if nbytes >= huge:
            return _host_block(nbytes).view(dtype).reshape(tuple(shape))
        return np.empty(tuple(shape), dtype=dtype)
    return module.empty(tuple(shape), dtype=x.dtype)              # cupy and look-alikes


def pieces(nbytes: int, itemsize: int = 1, limit: Optional[int] = None) -> List[Tuple[int, int]]:
    """The one cut of a long transfer: (offset, nbytes) of consecutive pieces covering
    ``nbytes`` bytes of ``itemsize``-byte elements, each at most ``limit`` bytes
    (PYCOLL_CHUNK_BYTES unless given) but at least one element, never cutting one. One
    empty piece for nothing. A piece is small enough to stay in cache while it is
    reduced or applied, and to travel while the next one is worked on."""
    step = piece_bytes(itemsize, limit)
    return [(offset, min(step, nbytes - offset)) for offset in range(0, max(nbytes, 1), step)]


def piece_bytes(itemsize: int = 1, limit: Optional[int] = None) -> int:
    """The size of ``pieces``' full pieces: ``limit`` (PYCOLL_CHUNK_BYTES unless given)
    rounded down to whole elements, at least one."""
    limit = config.get("chunk_bytes") if limit is None else limit
    return max(itemsize, limit // itemsize * itemsize)


def clone(x):
    """A copy of ``x`` of the same kind (the output of an out-of-place operation)."""
    x = as_array(x)
    if hasattr(x, "new_empty"):                                   # torch
        return x.detach().clone()
    if isinstance(x, (np.ndarray, np.generic)):     # a scalar's own copy is read-only
        return np.array(x)
    if _maker(x) is np:             # a host array of a kind that makes none: its bytes
        buf = as_buffer(x)
        out = empty_like(x, buf.shape)
        ctypes.memmove(out.ctypes.data, buf.ptr, buf.nbytes)
        return out
    return x.copy()


class _DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class _DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class _DLTensor(ctypes.Structure):
    """``DLManagedTensor`` begins with its ``DLTensor``: reading the capsule as one is safe."""
    _fields_ = [("data", ctypes.c_void_p), ("device", _DLDevice), ("ndim", ctypes.c_int32),
                ("dtype", _DLDataType), ("shape", ctypes.POINTER(ctypes.c_int64)),
                ("strides", ctypes.POINTER(ctypes.c_int64)), ("byte_offset", ctypes.c_uint64)]


def _gpu_present() -> bool:
    global _GPU
    if _GPU is None:
        _GPU = _C.has_cuda() and _C.cuda_device_count() > 0
    return _GPU


_GPU: Optional[bool] = None


def ready_event(stream: int, device: int):
    """An event on ``stream`` of ``device`` marking the producer's work so far (None
    without pycoll's CUDA build or a GPU: copies are then synchronous)."""
    return _C.CudaEvent(stream, device) if _gpu_present() else None


def pinned_empty(nbytes: int, device: int) -> np.ndarray:
    """Page-locked host memory for copies with GPU ``device`` where a GPU is present
    (staging copies run at full speed and asynchronously), else ordinary memory."""
    if not _gpu_present():
        return np.empty(nbytes, np.uint8)
    address = _C.cuda_host_alloc(nbytes, device)
    array = np.ctypeslib.as_array((ctypes.c_uint8 * nbytes).from_address(address))
    weakref.finalize(array, _C.cuda_host_free, address)
    return array


class _CudaStager:
    """Copies between host memory and one GPU on pycoll's own stream for it. Each copy
    waits only for the event it is given (a Buffer's ``ready``), so the copy of one
    gradient starts as soon as backward has written it, not after the rest of backward."""

    scales = True       # has ``scale``: on the GPU, in stream order

    def __init__(self, device: int):
        self.device, self.stream = device, _C.cuda_copy_stream(device)

    def copy(self, dst: int, src: int, nbytes: int, after=None) -> None:
        """Start the copy; it runs after ``after`` and after the copies started before."""
        _C.cuda_copy(dst, src, nbytes, self.device, after)

    def scale(self, ptrs: List[int], sizes: List[int], dtype: str, factor: float) -> None:
        """Start multiplying GPU memory ``ptrs[i]`` (``sizes[i]`` bytes) by ``factor``,
        after the copies started before."""
        _C.cuda_scale_async(ptrs, sizes, dtype, factor, self.device)

    def mark(self):
        """A token that ``wait`` takes: the copies started so far."""
        return _C.CudaEvent(self.stream, self.device)

    def wait(self, mark=None) -> None:
        """Until the copies before ``mark`` (default: all started so far) are done."""
        (mark or self.mark()).synchronize()      # an event knows its device


class _CupyStager:
    """Synchronous copies through cupy, for a pycoll built without its CUDA kernels (and
    so without a GPU scale: callers scale on the host before copying back)."""

    scales = False

    def __init__(self, device: int):
        try:
            import cupy
        except ImportError:
            raise RuntimeError("CUDA tensors need pycoll built with its CUDA kernels "
                               "(PYCOLL_WITH_CUDA=1 pip install pycoll) or cupy installed") from None
        self._runtime = cupy.cuda.runtime

    def copy(self, dst: int, src: int, nbytes: int, after=None) -> None:
        self._runtime.memcpy(dst, src, nbytes, self._runtime.memcpyDefault)

    def mark(self):
        return None

    def wait(self, mark=None) -> None:
        pass


def stager(device: int):
    """The copier between host memory and GPU ``device`` (one per device)."""
    found = _STAGERS.get(device)
    if found is None:
        found = _STAGERS[device] = (_CudaStager if _gpu_present() else _CupyStager)(device)
    return found


_STAGERS: dict = {}
