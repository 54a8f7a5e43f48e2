"""The tensor adapter: what it accepts, and the errors that say how to fix the rest."""
import subprocess
import sys

import numpy as np
import pytest

import fakegpu
from pycoll import tensors
from pycoll.tensors import as_buffer

ml_dtypes = pytest.importorskip("ml_dtypes")
torch = pytest.importorskip("torch")

pytestmark = pytest.mark.timeout(60)


@pytest.mark.parametrize("dtype", ["float16", "float32", "float64", "int8", "int16", "int32",
                                   "int64", "uint8", "uint16", "uint32", "uint64"])
def test_numpy_torch_and_cuda_interface_agree(dtype):
    a = np.arange(12).astype(dtype).reshape(3, 4)
    t = torch.from_numpy(a)
    f = fakegpu.FakeCudaArray(a)
    for buf, device in ((as_buffer(a), "cpu"), (as_buffer(t), "cpu"), (as_buffer(f), "cuda")):
        assert (buf.ptr, buf.nbytes, buf.dtype, tuple(buf.shape)) == \
               (a.ctypes.data, a.nbytes, dtype, (3, 4))
        assert buf.device == device and buf.count == 12


def test_bfloat16_from_torch_and_ml_dtypes():
    t = torch.zeros(5, dtype=torch.bfloat16)
    a = np.zeros(5, ml_dtypes.bfloat16)
    assert as_buffer(t).dtype == as_buffer(a).dtype == "bfloat16"
    assert as_buffer(t).nbytes == as_buffer(a).nbytes == 10


@pytest.mark.parametrize("name", tensors.FLOAT8)
def test_float8_from_torch_ml_dtypes_and_dlpack(name):
    t = torch.zeros(5, dtype=getattr(torch, name))
    a = np.zeros(5, getattr(ml_dtypes, name))
    for x in (t, a, DLPackOnly(t)):
        buf = as_buffer(x)
        assert (buf.dtype, buf.nbytes, buf.shape) == (name, 5, (5,))


def test_ml_dtypes_is_imported_only_when_its_dtypes_are_met():
    """Importing ml_dtypes costs half a second a process: pycoll leaves it to the user's
    script, and knows its dtypes when they come (or makes them, for numpy results)."""
    script = """if True:
        import sys
        import numpy as np
        import pycoll
        from pycoll import tensors
        assert "ml_dtypes" not in sys.modules
        import ml_dtypes
        for name in ("bfloat16",) + tensors.FLOAT8:
            a = np.zeros(3, getattr(ml_dtypes, name))
            assert tensors.as_buffer(a).dtype == name
            assert tensors.numpy_dtype(name) == a.dtype
        assert tensors.numpy_dtype("float32") == np.float32
    """
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr

class DLPackOnly:
    def __init__(self, inner):
        self.inner = inner

    def __dlpack__(self, **kwargs):
        return self.inner.__dlpack__(**kwargs)


def test_views_with_offsets_and_torch_requires_grad():
    t = torch.arange(10, dtype=torch.float32)
    view = t[3:]
    assert as_buffer(view).ptr == t.data_ptr() + 12
    assert as_buffer(np.arange(10.0)[3:]).nbytes == 56
    p = torch.nn.Parameter(torch.ones(4))
    assert as_buffer(p).ptr == p.data_ptr()


def test_buffer_protocol_objects():
    buf = as_buffer(bytearray(8))
    assert buf.dtype == "uint8" and buf.nbytes == 8 and not buf.readonly
    assert as_buffer(b"abc").readonly
    assert isinstance(tensors.clone(bytearray(b"ab")), np.ndarray)


def test_empty_and_zero_dim():
    assert as_buffer(np.zeros((0, 3), np.float32)).nbytes == 0
    assert as_buffer(torch.zeros(0)).nbytes == 0
    assert as_buffer(torch.tensor(2.0)).shape == ()


@pytest.mark.parametrize("make", [
    lambda: np.zeros((4, 4), np.float32)[:, ::2],
    lambda: torch.zeros(4, 4).t(),
    lambda: fakegpu_view(),
])
def test_non_contiguous_is_refused_with_the_fix(make):
    with pytest.raises(ValueError, match="contiguous"):
        as_buffer(make())


def fakegpu_view():
    arr = fakegpu.FakeCudaArray(np.zeros((4, 4), np.float32))
    cai = dict(arr.__cuda_array_interface__, shape=(4, 2), strides=(16, 8))
    return type("Strided", (), {"__cuda_array_interface__": cai})()


@pytest.mark.parametrize("x", [np.zeros(3, np.complex64), torch.zeros(3, dtype=torch.complex64),
                               np.zeros(3, np.longdouble),
                               torch.zeros(3, dtype=torch.float8_e4m3fnuz)])
def test_unsupported_dtype_names_the_supported_ones(x):
    with pytest.raises(TypeError, match="supported: float16.*uint8, bool.*float8_e5m2"):
        as_buffer(x)


def test_complex_is_refused_with_its_real_view():
    for x in (np.zeros(3, np.complex64), torch.zeros(3, dtype=torch.complex128)):
        with pytest.raises(TypeError, match=r"x.view\(x.real.dtype\).*torch.view_as_real"):
            as_buffer(x)
    assert as_buffer(np.zeros(3, np.complex64).view(np.float32)).count == 6


@pytest.mark.parametrize("x", [np.ones(3, ">f4"), np.ones(3, ">i8"),
                               fakegpu.FakeCudaArray(np.ones(3, ">f8"))])
def test_swapped_byte_order_is_refused(x):
    """MPI would add the bytes of big-endian floats as little-endian ones: a wrong sum."""
    with pytest.raises(TypeError, match="this machine's byte order.*newbyteorder"):
        as_buffer(x)


@pytest.mark.parametrize("x", [np.array([True, False, True]),
                               torch.tensor([True, False, True]),
                               fakegpu.FakeCudaArray(np.array([True, False, True]))])
def test_bool_is_read_as_bytes(x):
    b = as_buffer(x)
    assert (b.dtype, b.nbytes, tuple(b.shape)) == ("bool", 3, (3,))


def test_unsupported_object():
    with pytest.raises(TypeError, match="numpy array, a torch tensor"):
        as_buffer([1, 2, 3])


def test_read_only_refused_for_writes_only():
    a = np.zeros(3)
    a.flags.writeable = False
    assert as_buffer(a).readonly
    with pytest.raises(ValueError, match="read-only"):
        as_buffer(a, writable=True)


def test_outputs_keep_the_kind_of_the_input():
    for x in (np.zeros((2, 3), np.float32), torch.zeros(2, 3, dtype=torch.bfloat16),
              fakegpu.FakeCudaArray(np.zeros((2, 3), np.int8))):
        for y in (tensors.empty_like(x, (5, 3)), tensors.clone(x)):
            assert type(y) is type(x) and y.dtype == x.dtype
        assert tuple(tensors.empty_like(x, (5, 3)).shape) == (5, 3)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int8])
def test_large_torch_outputs_are_whole_tensors_of_their_own(dtype):
    """Past 4 MiB a torch output is _C.host_block's (huge-page) memory seen as a tensor:
    it must be an ordinary, writable, contiguous tensor of its own, and an empty one stays
    empty."""
    x = torch.zeros(2, dtype=dtype)
    shape = (2**22 // x.element_size() + 3, 2)
    a, b = tensors.empty_like(x, shape), tensors.empty_like(x, shape)
    for y in (a, b):
        assert type(y) is torch.Tensor and y.dtype == dtype and tuple(y.shape) == shape
        assert y.is_contiguous() and not y.requires_grad
    a.fill_(1)
    b.fill_(2)
    assert a.data_ptr() != b.data_ptr() and int(a[-1, -1]) == 1 and int(b[0, 0]) == 2
    assert tuple(tensors.empty_like(x, (0, 2**22)).shape) == (0, 2**22)


@pytest.mark.parametrize("kind", ["numpy", "torch"])
def test_large_outputs_reuse_the_memory_of_dead_ones_only(kind):
    """A large output's memory goes to the next one once nothing refers to it, through
    any view (numpy's views of views skip the arrays in between); never while it lives."""
    x = np.zeros(2, np.float32) if kind == "numpy" else torch.zeros(2)
    address = (lambda y: y.ctypes.data) if kind == "numpy" else (lambda y: y.data_ptr())
    shape = (2**20 + 5,)                                   # just over 4 MiB of float32
    first = tensors.empty_like(x, shape)
    first_at = address(first)
    view = first[1:][2:]
    del first
    second = tensors.empty_like(x, shape)
    assert address(second) != first_at                     # the view still holds it
    view[0] = 7
    second[...] = 1
    assert float(view[0]) == 7
    del view, second
    third = tensors.empty_like(x, shape)
    assert first_at in (address(third), address(tensors.empty_like(x, shape)))


@pytest.mark.parametrize("kind", ["numpy", "torch"])
def test_views_like_cuts_one_buffer_in_order_by_runs_of_shapes(kind):
    shapes = [(3,), (3,), (2, 2), (2, 2), (2, 2), (), (), (0,), (0,), (5,), (1, 3)]
    make = (lambda s: np.zeros(s, np.float32)) if kind == "numpy" else \
        (lambda s: torch.zeros(s, dtype=torch.float32))
    xs = [make(s) for s in shapes]
    sizes = [as_buffer(x).nbytes for x in xs]
    views, base = tensors.views_like(xs[0], sum(sizes), tensors.shape_runs(xs))
    assert [tuple(v.shape) for v in views] == shapes
    assert all(type(v) is type(xs[0]) and v.dtype == xs[0].dtype for v in views)
    at = base
    for view, nbytes in zip(views, sizes):      # back to back, in the order of xs
        buf = as_buffer(view, writable=True)
        assert buf.ptr == at or nbytes == 0
        at += nbytes
    for i, view in enumerate(views):            # one buffer: writes land in their own view
        view[...] = i
    assert [float(np.asarray(v).sum()) for v in views] == \
        [i * max(1, int(np.prod(s))) * (0 not in s) for i, s in enumerate(shapes)]
