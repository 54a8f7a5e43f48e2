"""pycoll._C kernels against numpy (ml_dtypes for bfloat16), on the CPU and, where a GPU
and the CUDA build are at hand, on the device."""
import ctypes

import ml_dtypes
import numpy as np
import pytest

from pycoll import _C

pytestmark = pytest.mark.timeout(60)

DTYPES = {
    "float16": np.dtype(np.float16),
    "bfloat16": np.dtype(ml_dtypes.bfloat16),
    "float32": np.dtype(np.float32),
    "float64": np.dtype(np.float64),
    "int8": np.dtype(np.int8),
    "int16": np.dtype(np.int16),
    "int32": np.dtype(np.int32),
    "int64": np.dtype(np.int64),
    "uint8": np.dtype(np.uint8),
    "uint16": np.dtype(np.uint16),
    "uint32": np.dtype(np.uint32),
    "uint64": np.dtype(np.uint64),
    "bool": np.dtype(np.bool_),     # numpy's add and multiply of bools are or and and, as pycoll's
}
FLOATS = ["float16", "bfloat16", "float32", "float64"]
OPS = {"sum": np.add, "prod": np.multiply, "min": np.minimum, "max": np.maximum}
LENGTHS = [0, 1, 7, 1023, 100003]
OFFSETS = [(0, 0), (1, 3)]  # byte offsets of (inout/dst, src): aligned, and odd


def arith(dtype):
    """The type pycoll does arithmetic in: float32 for 16-bit floats, else the dtype."""
    return np.dtype(np.float32) if dtype.itemsize == 2 and dtype.kind not in "iu" else dtype


def place(arr, offset):
    """A copy of arr that starts `offset` bytes into a uint8 buffer (unaligned for odd offsets)."""
    buf = np.zeros(arr.nbytes + offset + 1, np.uint8)
    view = buf[offset:offset + arr.nbytes].view(arr.dtype)
    view[...] = arr
    return view


def ptr(arr):
    return arr.ctypes.data


def random(name, n, seed):
    rng = np.random.default_rng(seed)
    dtype = DTYPES[name]
    if name in FLOATS:
        x = (rng.standard_normal(n) * 4).astype(np.float32).astype(dtype)
        specials = np.array([np.nan, np.inf, -np.inf, -0.0, 0.0, 1.0, -1.0, 3e38, 1e-40], np.float64)
        with np.errstate(over="ignore"):
            specials = specials.astype(np.float32).astype(dtype)
        m = min(n, len(specials))
        x[:m] = np.roll(specials, seed)[:m]
        return x
    if name == "bool":
        return rng.integers(0, 2, n).astype(bool)
    info = np.iinfo(dtype)
    return rng.integers(info.min, info.max, n, dtype=dtype, endpoint=True)


def assert_same(actual, expected):
    """Equal values, NaN where NaN, same dtype; floats compared exactly (no tolerance)."""
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    if expected.dtype in (DTYPES["float16"], DTYPES["bfloat16"]):
        actual, expected = actual.astype(np.float32), expected.astype(np.float32)
    np.testing.assert_array_equal(actual, expected)


def ref_scale(x, factor):
    a = arith(x.dtype)
    return (x.astype(a) * a.type(factor)).astype(x.dtype)


# ---- basics -------------------------------------------------------------------------------

def test_has_cuda_is_bool_and_cpu_works_either_way():
    assert isinstance(_C.has_cuda(), bool)
    a, b = np.arange(5, dtype=np.float32), np.ones(5, np.float32)
    _C.reduce(ptr(a), ptr(b), 5, "float32", "sum")
    assert_same(a, np.arange(1, 6, dtype=np.float32))
    if _C.has_cuda():
        n = _C.cuda_device_count()  # never raises, 0 without a driver or GPU
        assert isinstance(n, int) and n >= 0
    else:
        assert not hasattr(_C, "cuda_reduce")


@pytest.mark.parametrize("name", DTYPES)
def test_itemsize(name):
    assert _C.itemsize(name) == DTYPES[name].itemsize


def test_bad_names():
    a = np.zeros(4, np.float32)
    with pytest.raises(ValueError, match=r"float33.*float16, bfloat16, float32"):
        _C.reduce(ptr(a), ptr(a), 4, "float33", "sum")
    with pytest.raises(ValueError, match=r"'avg'.*sum, min, max, prod, band, bor, bxor"):
        _C.reduce(ptr(a), ptr(a), 4, "float32", "avg")
    with pytest.raises(ValueError, match="complex64"):
        _C.itemsize("complex64")
    with pytest.raises(ValueError, match="int8"):
        _C.scale(ptr(a), 4, "int8", 2.0)
    with pytest.raises(ValueError, match="float8"):
        _C.unpack(ptr(a), [ptr(a)], [16], "float8")
    for name in ("float8_e4m3fn", "float8_e5m2"):     # moved by the collectives, never reduced
        assert _C.itemsize(name) == 1
        with pytest.raises(ValueError, match=f"{name} is moved, not reduced: cast"):
            _C.reduce(ptr(a), ptr(a), 4, name, "sum")


def test_count_zero_is_noop_with_null_pointers():
    _C.reduce(0, 0, 0, "float32", "sum")
    _C.scale(0, 0, "float16", 0.5)
    _C.cast(0, 0, 0, "float32", "bfloat16")
    _C.pack(0, [], [])
    _C.pack(0, [0, 0], [0, 0])
    _C.unpack(0, [0], [0], "float64", 0.5)


# ---- reduce -------------------------------------------------------------------------------

@pytest.mark.parametrize("offsets", OFFSETS, ids=["aligned", "unaligned"])
@pytest.mark.parametrize("n", LENGTHS)
@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("name", DTYPES)
def test_reduce(name, op, n, offsets):
    a, b = random(name, n, 1), random(name, n, 2)
    with np.errstate(all="ignore"):
        expected = OPS[op](a, b)
    inout, src = place(a, offsets[0]), place(b, offsets[1])
    _C.reduce(ptr(inout), ptr(src), n, name, op)
    assert_same(inout, expected)
    assert_same(src, b)


@pytest.mark.parametrize("op, reference", [("band", np.bitwise_and), ("bor", np.bitwise_or),
                                           ("bxor", np.bitwise_xor)])
@pytest.mark.parametrize("name", ["int8", "int16", "int32", "int64", "uint8", "uint16", "uint32",
                                  "uint64", "bool"])
def test_bitwise_reduce(name, op, reference):
    a, b = random(name, 1023, 1), random(name, 1023, 2)
    inout = place(a, 1)
    _C.reduce(ptr(inout), ptr(b), len(a), name, op)
    assert_same(inout, reference(a, b))


@pytest.mark.parametrize("name", FLOATS)
def test_bitwise_reduce_refuses_floats(name):
    a = np.zeros(4, DTYPES[name])
    with pytest.raises(ValueError, match=f"band needs an integer or bool dtype, got {name}"):
        _C.reduce(ptr(a), ptr(a), 4, name, "band")


@pytest.mark.parametrize("name", ["float16", "bfloat16"])
def test_reduce_16bit_rounding_and_specials(name):
    dt = DTYPES[name]
    big = float(ml_dtypes.finfo(dt).max)
    a = np.array([big, 1.0, 1.0, np.nan, np.inf, np.inf, 2.0], np.float32).astype(dt)
    b = np.array([big, ml_dtypes.finfo(dt).eps / 2, ml_dtypes.finfo(dt).eps * 1.5, 1.0, -np.inf, 1.0, np.nan], np.float32).astype(dt)
    out = a.copy()
    _C.reduce(ptr(out), ptr(b), len(a), name, "sum")
    got = out.astype(np.float32)
    assert got[0] == np.inf                         # overflow -> inf
    assert got[1] == 1.0                            # tie rounds to even (1.0)
    assert got[2] == 1.0 + 2 * ml_dtypes.finfo(dt).eps    # tie rounds to even (1 + 2 eps)
    assert np.isnan(got[3]) and np.isnan(got[4]) and got[5] == np.inf and np.isnan(got[6])
    with np.errstate(all="ignore"):
        assert_same(out, (a.astype(np.float32) + b.astype(np.float32)).astype(dt))


@pytest.mark.parametrize("name", FLOATS)
@pytest.mark.parametrize("op", ["min", "max"])
def test_min_max_propagate_nan(name, op):
    dt = DTYPES[name]
    a = np.array([np.nan, 1.0, np.nan, -np.inf], np.float32).astype(dt)
    b = np.array([1.0, np.nan, np.nan, np.inf], np.float32).astype(dt)
    out = a.copy()
    _C.reduce(ptr(out), ptr(b), 4, name, op)
    got = out.astype(np.float64)
    assert np.isnan(got[:3]).all()
    assert got[3] == (-np.inf if op == "min" else np.inf)


@pytest.mark.parametrize("name", ["int8", "uint8", "int16", "int32", "int64"])
def test_integer_sum_prod_wrap(name):
    info = np.iinfo(DTYPES[name])
    a = np.array([info.max, info.min, info.max], DTYPES[name])
    b = np.array([1, -1 if info.min else 1, info.max], DTYPES[name])
    for op in ("sum", "prod"):
        out = a.copy()
        _C.reduce(ptr(out), ptr(b), 3, name, op)
        with np.errstate(all="ignore"):
            assert_same(out, OPS[op](a, b))


# ---- scale and cast -----------------------------------------------------------------------

@pytest.mark.parametrize("offset", [0, 1])
@pytest.mark.parametrize("n", LENGTHS)
@pytest.mark.parametrize("name", FLOATS)
def test_scale(name, n, offset):
    x = random(name, n, 3)
    buf = place(x, offset)
    _C.scale(ptr(buf), n, name, 1 / 3)
    with np.errstate(all="ignore"):
        assert_same(buf, ref_scale(x, 1 / 3))


def float32_specials():
    tiny16 = 2.0 ** -24
    values = [0.0, -0.0, 1.0, -1.0, np.inf, -np.inf, np.nan, -np.nan, 65504.0, 65519.99, 65520.0, 65536.0, 1e6,
              tiny16, tiny16 / 2, tiny16 * 0.75, tiny16 * 1.5, tiny16 * 2.5, 2.0 ** -14, 2.0 ** -14 * (1 - 2 ** -11),
              1 + 2.0 ** -11, 1 + 3 * 2.0 ** -11, 1 + 2.0 ** -8, 1 + 3 * 2.0 ** -8, 3.4e38, 1e-45, 1.17e-38]
    return np.array(values + [-v for v in values], np.float32)


def float32_random_bits(n=200003):
    return np.random.default_rng(5).integers(0, 2 ** 32, n, dtype=np.uint32).view(np.float32)


def assert_same_bits(actual, expected):
    """Bitwise equal except NaN, where both must be NaN (payloads may differ)."""
    an, en = np.isnan(actual.astype(np.float32)), np.isnan(expected.astype(np.float32))
    np.testing.assert_array_equal(an, en)
    ubits = {2: np.uint16, 4: np.uint32}[actual.itemsize]
    np.testing.assert_array_equal(actual.view(ubits)[~an], expected.view(ubits)[~en])


@pytest.mark.parametrize("offsets", OFFSETS, ids=["aligned", "unaligned"])
@pytest.mark.parametrize("name", ["float16", "bfloat16"])
def test_cast_from_float32(name, offsets):
    x = np.concatenate([float32_specials(), float32_random_bits(), np.linspace(-7e4, 7e4, 100003, dtype=np.float32)])
    src = place(x, offsets[1])
    dst = place(np.zeros(len(x), DTYPES[name]), offsets[0])
    _C.cast(ptr(dst), ptr(src), len(x), "float32", name)
    with np.errstate(all="ignore"):
        assert_same_bits(dst, x.astype(DTYPES[name]))


@pytest.mark.parametrize("offsets", OFFSETS, ids=["aligned", "unaligned"])
@pytest.mark.parametrize("name", ["float16", "bfloat16"])
def test_cast_to_float32_exhaustive(name, offsets):
    x = np.arange(2 ** 16, dtype=np.uint16).view(DTYPES[name])  # every bit pattern
    src = place(x, offsets[1])
    dst = place(np.zeros(len(x), np.float32), offsets[0])
    _C.cast(ptr(dst), ptr(src), len(x), name, "float32")
    assert_same_bits(dst, x.astype(np.float32))
    # and back: exact round trip for every non-NaN value
    back = np.zeros(len(x), DTYPES[name])
    _C.cast(ptr(back), ptr(dst), len(x), "float32", name)
    assert_same_bits(back, x)


@pytest.mark.parametrize("pair", [("float32", "float64"), ("float16", "bfloat16"), ("int32", "float32"),
                                  ("float32", "float32"), ("float64", "float16")])
def test_cast_unsupported_pairs(pair):
    a = np.zeros(8, np.float64)
    with pytest.raises(ValueError, match="float32 <-> float16"):
        _C.cast(ptr(a), ptr(a), 1, *pair)


# ---- pack / unpack ------------------------------------------------------------------------

def make_buffers(name, seed, count=40):
    rng = np.random.default_rng(seed)
    sizes = [0, 1, 0, 7, 1023, 100003, 0] + list(rng.integers(0, 3000, count - 7))
    return [place(random(name, int(n), seed + i), int(rng.integers(0, 4))) for i, n in enumerate(sizes)]


@pytest.mark.parametrize("offset", [0, 1, 3])
@pytest.mark.parametrize("name", ["uint8", "float16", "float64", "int32"])
def test_pack_unpack_round_trip(name, offset):
    bufs = make_buffers(name, 7)
    nbytes = [b.nbytes for b in bufs]
    packed = place(np.zeros(sum(nbytes), np.uint8), offset)
    _C.pack(ptr(packed), [ptr(b) for b in bufs], nbytes)
    np.testing.assert_array_equal(packed, np.concatenate([b.view(np.uint8) for b in bufs]))

    outs = [place(np.zeros(len(b), b.dtype), (i * 3) % 4) for i, b in enumerate(bufs)]
    _C.unpack(ptr(packed), [ptr(o) for o in outs], nbytes)  # default dtype uint8, scale 1
    for o, b in zip(outs, bufs):
        assert_same(o, b)


@pytest.mark.parametrize("window", [998, 4096, 65536])
@pytest.mark.parametrize("name", ["uint8", "float16", "float64"])
def test_pack_unpack_in_windows(name, window):
    """Windows [begin, end) of the packed stream, one at a time: what a chunked fused
    allreduce does, with tensors cut across window edges."""
    bufs = make_buffers(name, 5, count=12)
    nbytes = [b.nbytes for b in bufs]
    whole = np.concatenate([b.view(np.uint8) for b in bufs])
    step = max(window // bufs[0].itemsize, 1) * bufs[0].itemsize      # whole elements
    piece = np.zeros(step, np.uint8)
    outs = [np.zeros(len(b), b.dtype) for b in bufs]
    scale = 1.0 if name == "uint8" else 0.5
    for begin in range(0, len(whole), step):
        end = min(begin + step, len(whole))
        _C.pack(ptr(piece), [ptr(b) for b in bufs], nbytes, begin, end)
        np.testing.assert_array_equal(piece[:end - begin], whole[begin:end])
        _C.unpack(ptr(piece), [ptr(o) for o in outs], nbytes, name, scale, begin, end)
    with np.errstate(all="ignore"):
        for o, b in zip(outs, bufs):
            assert_same(o, b if scale == 1.0 else ref_scale(b, scale))


def test_unpack_window_must_fall_on_elements():
    a = np.zeros(4, np.float32)
    with pytest.raises(ValueError, match="element boundaries"):
        _C.unpack(ptr(a), [ptr(a)], [16], "float32", 1.0, 2, 16)


@pytest.mark.parametrize("offset", [0, 1])
@pytest.mark.parametrize("name", FLOATS)
def test_unpack_with_scale(name, offset):
    bufs = make_buffers(name, 11, count=12)
    nbytes = [b.nbytes for b in bufs]
    packed = place(np.concatenate([b.view(np.uint8) for b in bufs]), offset)
    outs = [place(np.zeros(len(b), b.dtype), i % 3) for i, b in enumerate(bufs)]
    _C.unpack(ptr(packed), [ptr(o) for o in outs], nbytes, name, 0.25)
    with np.errstate(all="ignore"):
        for o, b in zip(outs, bufs):
            assert_same(o, ref_scale(b, 0.25))


def test_unpack_errors():
    a = np.zeros(16, np.uint8)
    with pytest.raises(ValueError, match="float dtype"):
        _C.unpack(ptr(a), [ptr(a)], [8], "int32", 0.5)
    with pytest.raises(ValueError, match="multiple"):
        _C.unpack(ptr(a), [ptr(a)], [6], "float32")
    with pytest.raises(ValueError, match="length"):
        _C.unpack(ptr(a), [ptr(a)], [4, 4])
    with pytest.raises(ValueError, match="length"):
        _C.pack(ptr(a), [ptr(a), ptr(a)], [4])


def test_runs_without_gil_in_threads():
    """Kernels release the GIL: concurrent calls from threads are safe and correct."""
    from concurrent.futures import ThreadPoolExecutor

    pairs = [(np.full(1 << 20, i, np.float32), np.ones(1 << 20, np.float32)) for i in range(8)]
    with ThreadPoolExecutor(4) as pool:
        list(pool.map(lambda p: _C.reduce(ptr(p[0]), ptr(p[1]), len(p[0]), "float32", "sum"), pairs))
    for i, (a, _) in enumerate(pairs):
        assert (a == i + 1).all()


def test_python_threads_progress_during_a_long_kernel():
    """While one thread is inside a long kernel, another runs Python code; with the GIL
    held it could not run at all until the call returned."""
    import threading
    import time
    a, b = np.zeros(1 << 25, np.float32), np.ones(1 << 25, np.float32)     # 128 MiB each
    inside = threading.Event()
    ticks = []

    def count():
        inside.wait()
        while inside.is_set():
            ticks.append(time.perf_counter())
    counter = threading.Thread(target=count)
    counter.start()
    inside.set()
    time.sleep(0.01)                   # the counter is running
    start = time.perf_counter()
    _C.reduce(ptr(a), ptr(b), a.size, "float32", "sum")
    end = time.perf_counter()
    inside.clear()
    counter.join()
    assert (a == 1).all()
    assert sum(start < t < end for t in ticks) > 100, "no Python ran during the kernel"


# ---- CUDA: same checks on device memory (skipped without a GPU) -----------------------------

def _cuda_ready():
    if not (_C.has_cuda() and _C.cuda_device_count() > 0):
        return False
    try:
        import torch
        return torch.cuda.is_available()
    except ImportError:
        pass
    try:
        import cupy  # noqa: F401
        return True
    except ImportError:
        return False


cuda = pytest.mark.skipif(not _cuda_ready(), reason="needs the CUDA build, a GPU, and torch.cuda or cupy")


class Dev:
    """Raw device bytes holding a numpy array's bytes at a byte offset (torch.cuda or cupy)."""

    def __init__(self, arr, offset=0):
        self.dtype, self.n, self.offset = arr.dtype, len(arr), offset
        raw = np.zeros(arr.nbytes + offset + 1, np.uint8)
        raw[offset:offset + arr.nbytes] = arr.view(np.uint8)
        try:
            import torch
            self.mem = torch.from_numpy(raw).cuda()
            self.base = self.mem.data_ptr()
        except ImportError:
            import cupy
            self.mem = cupy.asarray(raw)
            self.base = self.mem.data.ptr

    @property
    def ptr(self):
        return self.base + self.offset

    def get(self):
        _C.cuda_synchronize()
        raw = self.mem.cpu().numpy() if hasattr(self.mem, "cpu") else self.mem.get()
        return raw[self.offset:self.offset + self.n * self.dtype.itemsize].view(self.dtype)


@cuda
@pytest.mark.parametrize("offsets", OFFSETS, ids=["aligned", "unaligned"])
@pytest.mark.parametrize("n", [0, 1, 7, 100003])
@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("name", DTYPES)
def test_cuda_reduce(name, op, n, offsets):
    a, b = random(name, n, 1), random(name, n, 2)
    with np.errstate(all="ignore"):
        expected = OPS[op](a, b)
    inout, src = Dev(a, offsets[0]), Dev(b, offsets[1])
    _C.cuda_reduce(inout.ptr, src.ptr, n, name, op)
    assert_same(inout.get(), expected)


@cuda
@pytest.mark.parametrize("offset", [0, 1])
@pytest.mark.parametrize("name", FLOATS)
def test_cuda_scale(name, offset):
    x = random(name, 100003, 3)
    d = Dev(x, offset)
    _C.cuda_scale(d.ptr, len(x), name, 1 / 3)
    with np.errstate(all="ignore"):
        assert_same(d.get(), ref_scale(x, 1 / 3))


@cuda
@pytest.mark.parametrize("offsets", OFFSETS, ids=["aligned", "unaligned"])
@pytest.mark.parametrize("name", ["float16", "bfloat16"])
def test_cuda_cast(name, offsets):
    x = np.concatenate([float32_specials(), float32_random_bits()])
    src, dst = Dev(x, offsets[1]), Dev(np.zeros(len(x), DTYPES[name]), offsets[0])
    _C.cuda_cast(dst.ptr, src.ptr, len(x), "float32", name)
    with np.errstate(all="ignore"):
        assert_same_bits(dst.get(), x.astype(DTYPES[name]))
    h = np.arange(2 ** 16, dtype=np.uint16).view(DTYPES[name])
    src, dst = Dev(h, offsets[1]), Dev(np.zeros(len(h), np.float32), offsets[0])
    _C.cuda_cast(dst.ptr, src.ptr, len(h), name, "float32")
    assert_same_bits(dst.get(), h.astype(np.float32))
    with pytest.raises(ValueError):
        _C.cuda_cast(dst.ptr, src.ptr, 1, "float32", "float64")


@cuda
@pytest.mark.parametrize("count", [40, 1300])  # 1300 > one launch's segment table
@pytest.mark.parametrize("offset", [0, 1])
@pytest.mark.parametrize("name", ["uint8", "float16", "float64"])
def test_cuda_pack_unpack(name, offset, count):
    bufs = make_buffers(name, 7, count=count)
    nbytes = [b.nbytes for b in bufs]
    devs = [Dev(b, i % 4) for i, b in enumerate(bufs)]
    packed = Dev(np.zeros(sum(nbytes), np.uint8), offset)
    _C.cuda_pack(packed.ptr, [d.ptr for d in devs], nbytes)
    np.testing.assert_array_equal(packed.get(), np.concatenate([b.view(np.uint8) for b in bufs]))

    outs = [Dev(np.zeros(len(b), b.dtype), (i * 3) % 4) for i, b in enumerate(bufs)]
    _C.cuda_unpack(packed.ptr, [o.ptr for o in outs], nbytes)
    for o, b in zip(outs, bufs):
        assert_same(o.get(), b)

    if name in FLOATS:
        _C.cuda_unpack(packed.ptr, [o.ptr for o in outs], nbytes, name, 0.25)
        with np.errstate(all="ignore"):
            for o, b in zip(outs, bufs):
                assert_same(o.get(), ref_scale(b, 0.25))
    with pytest.raises(ValueError):
        _C.cuda_unpack(packed.ptr, [outs[0].ptr], [nbytes[0]], "int32", 0.5)


@cuda
def test_cuda_streams_memcpy_and_pinned_memory():
    torch = pytest.importorskip("torch")

    stream = torch.cuda.Stream()
    x = np.arange(1 << 20, dtype=np.float32)
    n = x.nbytes
    pinned = _C.cuda_host_alloc(n, 0)
    try:
        ctypes.memmove(pinned, ptr(x), n)
        dev = Dev(np.zeros_like(x))
        _C.cuda_memcpy(dev.ptr, pinned, n, stream.cuda_stream)            # host -> device
        _C.cuda_scale(dev.ptr, len(x), "float32", 2.0, stream.cuda_stream)
        _C.cuda_reduce(dev.ptr, dev.ptr, len(x), "float32", "sum", stream.cuda_stream)
        _C.cuda_memcpy(pinned, dev.ptr, n, stream.cuda_stream)            # device -> host
        _C.cuda_synchronize(stream.cuda_stream)
        out = np.frombuffer((ctypes.c_char * n).from_address(pinned), np.float32).copy()
        assert_same(out, x * 4)
    finally:
        _C.cuda_host_free(pinned)
    for f in (lambda: _C.cuda_reduce(0, 0, 0, "float32", "sum"), lambda: _C.cuda_pack(0, [], []),
              lambda: _C.cuda_memcpy(0, 0, 0)):
        f()  # count 0: no-op


@cuda
def test_cuda_errors_raise_runtime_error():
    with pytest.raises(RuntimeError, match="CUDA"):
        _C.cuda_host_alloc(1 << 60, 0)  # out of memory


@cuda
def test_cuda_copy_waits_for_the_event_it_is_given():
    """pycoll's copy stream is non-blocking: the event is what orders a copy after the
    producer's work (here an add queued behind a long sleep on the GPU)."""
    torch = pytest.importorskip("torch")
    x = torch.zeros(1 << 20, device="cuda")
    device = x.device.index
    torch.cuda._sleep(50_000_000)
    x.add_(1)
    ready = _C.CudaEvent(torch.cuda.current_stream().cuda_stream, device)
    out = np.zeros(1 << 20, np.float32)
    _C.cuda_copy(ptr(out), x.data_ptr(), x.nbytes, device, ready)
    _C.cuda_synchronize(_C.cuda_copy_stream(device))
    assert ready.query() and ready.device == device
    assert_same(out, np.ones(1 << 20, np.float32))
