"""Collectives against numpy, at any number of ranks (run under mpiexec -n 1..4).

Every rank builds every rank's input from (dtype, shape, rank), so each can compute
the expected result itself: assertions hold at any size.
"""
import numpy as np
import pytest

import fakegpu
import pycoll
from pycoll import collectives, tensors

ml_dtypes = pytest.importorskip("ml_dtypes")
torch = pytest.importorskip("torch")

pytestmark = [pytest.mark.mpi, pytest.mark.timeout(120)]

DTYPES = ["float16", "bfloat16", "float32", "float64", "int8", "int16", "int32", "int64", "uint8"]
OPS = ["Sum", "Average", "Min", "Max", "Product"]
SHAPES = [(0,), (1,), (7,), (33, 5)]


def np_dtype(dtype):
    return ml_dtypes.bfloat16 if dtype == "bfloat16" else np.dtype(dtype)


def rank_input(dtype, shape, rank, op="Sum"):
    """Small integers, exact in every dtype, so sums and products are exact."""
    n = int(np.prod(shape))
    values = (np.arange(n) * 7 + rank * 3) % 5 - (0 if dtype == "uint8" else 2)
    if op == "Product":
        values = values % 2 + 1                       # 1 or 2: products stay exact
    return values.astype(np.float64).reshape(shape)


def expected_reduce(dtype, shape, size, op):
    xs = np.stack([rank_input(dtype, shape, r, op) for r in range(size)])
    return {"Sum": xs.sum(0), "Average": xs.mean(0), "Min": xs.min(0), "Max": xs.max(0),
            "Product": xs.prod(0)}[op]


def make(values, dtype, kind):
    host = values.astype(np_dtype(dtype))
    if kind == "numpy":
        return host
    if kind == "torch":
        if dtype == "bfloat16":
            return torch.from_numpy(values.astype(np.float32)).to(torch.bfloat16)
        return torch.from_numpy(host)
    if dtype == "bfloat16":
        pytest.skip("__cuda_array_interface__ has no bfloat16 typestr (CUDA torch uses DLPack)")
    return fakegpu.FakeCudaArray(host)


def to_numpy(x):
    if isinstance(x, fakegpu.FakeCudaArray):
        x = x.get()
    if isinstance(x, torch.Tensor):
        x = x.float() if x.dtype == torch.bfloat16 else x
        x = x.numpy()
    return np.asarray(x).astype(np.float64)


def assert_matches(result, expected, dtype):
    # float32 within an ulp or so (torch's assert_close: 1.3e-6): an Average of 3 or more
    # members rounds its float32 sum and scale once more than the float64 reference does.
    tol = {"float16": 1e-3, "bfloat16": 1e-2, "float32": 1e-6}.get(dtype, 1e-12)
    expected = expected.astype(np_dtype(dtype)).astype(np.float64)
    np.testing.assert_allclose(to_numpy(result), expected, rtol=tol, atol=tol)


@pytest.fixture
def fake_device(monkeypatch):
    copy = fakegpu.CountingStager()
    monkeypatch.setattr(tensors, "stager", copy)
    return copy


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_allreduce_every_dtype_and_op(group, dtype, op, shape):
    arg, rank, size = group
    x = make(rank_input(dtype, shape, rank, op), dtype, "numpy")
    if op == "Average" and dtype.startswith(("int", "uint")):
        with pytest.raises(TypeError, match="Average"):
            pycoll.allreduce(x, op=getattr(pycoll, op), group=arg)
        return
    before = x.copy()
    y = pycoll.allreduce(x, op=getattr(pycoll, op), group=arg)
    assert y.shape == x.shape and y.dtype == x.dtype
    assert_matches(y, expected_reduce(dtype, shape, size, op), dtype)
    np.testing.assert_array_equal(x, before)          # out of place leaves x alone
    assert pycoll.allreduce_(x, op=getattr(pycoll, op), group=arg) is x
    assert_matches(x, expected_reduce(dtype, shape, size, op), dtype)


@pytest.mark.parametrize("kind", ["torch", "fake_cuda"])
@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32", "int64"])
def test_allreduce_torch_and_cuda_arrays(group, kind, dtype, fake_device):
    arg, rank, size = group
    x = make(rank_input(dtype, (5, 3), rank), dtype, kind)
    y = pycoll.allreduce(x, op=pycoll.Sum, group=arg)
    assert type(y) is type(x)
    assert_matches(y, expected_reduce(dtype, (5, 3), size, "Sum"), dtype)
    pycoll.allreduce_async_(x, op=pycoll.Max, group=arg).wait()
    assert_matches(x, expected_reduce(dtype, (5, 3), size, "Max"), dtype)
    assert (fake_device.calls > 0) == (kind == "fake_cuda")   # staged through host memory


@pytest.mark.parametrize("op", ["Sum", "Average"])
def test_gpu_tensors_are_staged_a_chunk_at_a_time(settings, group, fake_device, monkeypatch, op):
    """Host staging for GPU memory is two PYCOLL_CHUNK_BYTES pieces (one travels while
    the next is copied), whatever the tensor size."""
    arg, rank, size = group
    settings(chunk_bytes=400)
    x = make(rank_input("float32", (1000,), rank, op), "float32", "fake_cuda")
    y = pycoll.allreduce(x, op=getattr(pycoll, op), group=arg)
    assert_matches(y, expected_reduce("float32", (1000,), size, op), "float32")
    assert fake_device.calls == 2 * 10                # 4000 B: 10 pieces in and out
    xs = [make(rank_input("float32", (n,), rank, op), "float32", "fake_cuda") for n in (30, 1, 170)]
    for w in [pycoll.allreduce_async_(x, op=getattr(pycoll, op), group=arg) for x in xs]:
        w.wait()
    for x in xs:
        assert_matches(x, expected_reduce("float32", x.shape, size, op), "float32")


@pytest.mark.parametrize("scales", [True, False])
@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_staged_average_scales_on_the_gpu_where_the_stager_can(settings, group, fake_device,
                                                                monkeypatch, scales, dtype):
    """Average's division of a staged result runs on the GPU after the copy back (every
    byte once), or on the host before it with a stager that cannot scale; same results."""
    arg, rank, size = group
    fake_device.scales = scales
    settings(chunk_bytes=256)
    xs = [make(rank_input(dtype, (n,), rank, "Average"), dtype, "fake_cuda") for n in (100, 7, 300)]
    for w in [pycoll.allreduce_async_(x, group=arg) for x in xs]:
        w.wait()
    for x in xs:
        assert_matches(x, expected_reduce(dtype, x.shape, size, "Average"), dtype)
    scaled = 407 * np.dtype(dtype).itemsize if scales and size > 1 else 0  # 1 rank: x 1
    assert fake_device.scaled_bytes == scaled
    pycoll.allreduce_(xs[0], op=pycoll.Sum, group=arg)
    assert fake_device.scaled_bytes == scaled                               # Sum: no scale


@pytest.mark.parametrize("op", ["Sum", "Average"])
def test_cuda_aware_mpi_gets_gpu_memory_and_averages_on_the_gpu(settings, group, fake_device,
                                                                monkeypatch, op):
    """With PYCOLL_CUDA_AWARE_MPI=1 nothing is staged, and Average's division runs as a
    CUDA kernel on the GPU memory (here a host stand-in that records its calls)."""
    arg, rank, size = group
    settings(cuda_aware_mpi=True)
    x = fakegpu.FakeCudaArray(rank_input("float32", (5, 3), rank, op).astype(np.float32),
                              device=1)               # not device 0: the scale must follow it
    monkeypatch.setattr(fakegpu, "empty", lambda shape, dtype: fakegpu.FakeCudaArray(
        np.empty(shape, dtype), device=1))
    y = pycoll.allreduce(x, op=getattr(pycoll, op), group=arg)
    assert_matches(y, expected_reduce("float32", (5, 3), size, op), "float32")
    assert fake_device.calls == 0                      # MPI read the GPU memory itself
    assert fake_device.scaled_bytes == (60 if op == "Average" else 0)
    assert fake_device.devices <= {1}


def test_async_work_contract(group):
    arg, rank, size = group
    works = [pycoll.allreduce_async(np.full(100, rank + i, np.float32), op=pycoll.Sum, group=arg)
             for i in range(10)]
    results = [w.wait(timeout=60) for w in works]
    for i, (w, y) in enumerate(zip(works, results)):
        assert w.is_completed() and w.exception() is None
        np.testing.assert_array_equal(y, sum(r + i for r in range(size)))


@pytest.mark.parametrize("kind", ["numpy", "torch", "fake_cuda"])
def test_grouped_allreduce_mixed_dtypes(group, kind, fake_device):
    arg, rank, size = group
    specs = [("float32", (3, 4)), ("float64", (0,)), ("bfloat16", (7,)), ("float32", (1,)),
             ("float16", (129,))]
    xs = [make(rank_input(d, s, rank), d, kind) for d, s in specs]
    ys = pycoll.grouped_allreduce(xs, group=arg)
    for y, (d, s) in zip(ys, specs):
        assert_matches(y, expected_reduce(d, s, size, "Average"), d)
    pycoll.grouped_allreduce_async_(xs, op=pycoll.Sum, group=arg).wait()
    for x, (d, s) in zip(xs, specs):
        assert_matches(x, expected_reduce(d, s, size, "Sum"), d)


@pytest.mark.parametrize("kind", ["numpy", "torch"])
@pytest.mark.parametrize("op", ["Sum", "Average"])
def test_grouped_allreduce_read_in_one_pass(settings, group, kind, op, monkeypatch):
    """Without PYCOLL_CHECK, a list of CPU tensors of one kind and dtype is read in one
    pass (tensors.host_pointers). It must split and send exactly as the per-tensor path
    does, since odd ranks here pass a list that the one-pass reader refuses."""
    arg, rank, size = group
    settings(check=False)
    settings(fusion_threshold=3000)
    counts = [5, 700, 70_000, 1, 300, 0, 90_000, 2]          # two go alone (>= 256 KiB)
    xs = [make(rank_input("float32", (n,), rank, op), "float32", kind) for n in counts]
    if rank % 2:
        xs[3] = make(rank_input("float32", (1,), rank, op), "float32",
                     "torch" if kind == "numpy" else "numpy")
        assert tensors.host_pointers(xs) is None
    else:
        assert tensors.host_pointers(xs) is not None
    assert pycoll.grouped_allreduce_(xs, op=getattr(pycoll, op), group=arg) == xs
    for x, n in zip(xs, counts):
        assert_matches(x, expected_reduce("float32", (n,), size, op), "float32")


@pytest.mark.parametrize("kind", ["numpy", "torch"])
@pytest.mark.parametrize("op", ["Sum", "Average"])
def test_grouped_allreduce_results_are_views_of_one_new_buffer(settings, group, kind, op):
    """The new-list form read in one pass: results shaped like the inputs, in one new
    buffer (reduced there, no unpack), the inputs untouched; tensors of 256 KiB or more
    travel alone into their view."""
    arg, rank, size = group
    settings(check=False, fusion_threshold=3000)
    shapes = [(5, 3), (700,), (1,), (2, 0), (300, 250), (4, 1, 2)]
    xs = [make(rank_input("float32", s, rank, op), "float32", kind) for s in shapes]
    before = [to_numpy(x).copy() for x in xs]
    ys = pycoll.grouped_allreduce(xs, op=getattr(pycoll, op), group=arg)
    for x, y, s, b in zip(xs, ys, shapes, before):
        assert type(y) is type(x) and tuple(y.shape) == s
        assert_matches(y, expected_reduce("float32", s, size, op), "float32")
        np.testing.assert_array_equal(to_numpy(x), b)
    owner = (lambda y: y.untyped_storage().data_ptr()) if kind == "torch" else (lambda y: id(y.base))
    assert len({owner(y) for y in ys}) == 1


def test_one_pass_reader_refuses_what_it_cannot_read(monkeypatch):
    monkeypatch.setattr(tensors, "_TORCH_DTYPES", {})     # as in a process's first call
    assert tensors.host_pointers([torch.zeros(2), torch.zeros(3)]) is not None
    a = np.zeros(4, np.float32)
    assert tensors.host_pointers([]) is None
    assert tensors.host_pointers([a, a.astype(np.float64)]) is None        # two dtypes
    assert tensors.host_pointers([a, np.zeros(8, np.float32)[::2]]) is None  # strided
    a_ro = np.zeros(4, np.float32)
    a_ro.flags.writeable = False
    assert tensors.host_pointers([a, a_ro]) is None
    t = torch.zeros(4)
    assert tensors.host_pointers([t, torch.zeros(4, 2).t()]) is None      # not contiguous
    assert tensors.host_pointers([t, torch.zeros(4, dtype=torch.int32)]) is None
    ptrs, sizes, dtype = tensors.host_pointers([t, torch.zeros(3)])
    assert ptrs[0] == t.data_ptr() and sizes == [16, 12] and dtype == "float32"
    with pytest.raises(TypeError, match="cannot read"):
        tensors.host_pointers([object()])


@pytest.mark.parametrize("kind", ["numpy", "torch", "fake_cuda"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_allgather_uneven_rows(group, kind, dtype, fake_device):
    arg, rank, size = group
    rows = lambda r: (r * 2 + 1) % 4               # noqa: E731 - includes ranks with 0 rows
    x = make(rank_input(dtype, (rows(rank), 3), rank), dtype, kind)
    y = pycoll.allgather(x, group=arg)
    expected = np.concatenate([rank_input(dtype, (rows(r), 3), r) for r in range(size)])
    assert tuple(y.shape) == expected.shape
    assert_matches(y, expected, dtype)


def test_allgather_mismatched_row_shape_raises_on_every_rank(group):
    arg, rank, size = group
    if size < 2:
        pytest.skip("needs two ranks")
    x = np.zeros((2, 3 if rank else 4), np.float32)
    with pytest.raises(ValueError, match="every dim but the first|different collectives"):
        pycoll.allgather(x, group=arg)


@pytest.mark.parametrize("kind", ["numpy", "torch", "fake_cuda"])
def test_allgather_and_reduce_scatter_into_out(group, kind, fake_device):
    """out= receives the result in place of a new tensor (what all_gather_into_tensor and
    reduce_scatter_tensor hand over)."""
    arg, rank, size = group
    rows = lambda r: (r * 2 + 1) % 4               # noqa: E731 - includes ranks with 0 rows
    x = make(rank_input("float32", (rows(rank), 3), rank), "float32", kind)
    out = make(np.full((sum(rows(r) for r in range(size)), 3), -1.0), "float32", kind)
    assert pycoll.allgather(x, group=arg, out=out) is out
    assert_matches(out, np.concatenate([rank_input("float32", (rows(r), 3), r)
                                        for r in range(size)]), "float32")
    x = make(rank_input("float32", (2 * size + 1, 2), rank), "float32", kind)
    mine = 2 + (rank < 1)
    out = make(np.full((mine, 2), -1.0), "float32", kind)
    assert pycoll.reduce_scatter_async(x, op=pycoll.Sum, group=arg, out=out).wait() is out
    full = expected_reduce("float32", (2 * size + 1, 2), size, "Sum")
    start = 2 * rank + min(rank, 1)
    assert_matches(out, full[start:start + mine], "float32")


def test_a_wrong_out_raises(group):
    arg, rank, size = group
    x = np.ones((2, 3), np.float32)
    with pytest.raises(TypeError, match="out= is float64"):
        pycoll.allgather(x, group=arg, out=np.empty((2 * size, 3)))
    with pytest.raises(ValueError, match="this rank's block"):
        pycoll.reduce_scatter(np.ones((size, 3), np.float32), group=arg,
                              out=np.empty((2, 3), np.float32))
    # A size that is wrong on one rank raises on every rank: the ranks compare sizes first.
    out = np.empty((2 * size + (rank == size - 1), 3), np.float32)
    with pytest.raises(ValueError, match=f"ranks \\[{size - 1}\\]"):
        pycoll.allgather(x, group=arg, out=out)
    np.testing.assert_array_equal(pycoll.allgather(x, group=arg), np.ones((2 * size, 3)))
    # reduce_scatter's too: every rank checks every rank's out= in the exchange of sizes.
    out = np.empty((1 + (rank == size - 1), 3), np.float32)
    with pytest.raises(ValueError, match=f"this rank's block.*{{{size - 1}: \\(12, 24\\)}}"):
        pycoll.reduce_scatter(np.ones((size, 3), np.float32), op=pycoll.Sum, group=arg, out=out)
    np.testing.assert_array_equal(pycoll.reduce_scatter(np.ones((size, 3), np.float32),
                                                        op=pycoll.Sum, group=arg),
                                  np.full((1, 3), size))
    with pytest.raises(TypeError, match="out= is float64"):
        pycoll.alltoall(np.ones((size, 3), np.float32), group=arg, out=np.empty((size, 3)))
    wrong = f"out= must hold the rows each rank receives.*[{{ ]{size - 1}: \\("
    with pytest.raises(ValueError, match=wrong):
        pycoll.alltoall(np.ones((size, 3), np.float32), group=arg, out=np.empty(
            (size + (rank == size - 1), 3), np.float32))
    y, received = pycoll.alltoall(np.ones((size, 3), np.float32), group=arg)
    assert y.shape == (size, 3) and list(received) == [1] * size
    # An out= of the wrong dtype on one rank raises there and names that rank on the others.
    last = rank == size - 1
    error, match = (TypeError, "out= is float64") if last else (ValueError, f"out= of ranks \\[{size - 1}\\]")
    cases = [(lambda out: pycoll.allgather(x, group=arg, out=out), (2 * size, 3)),
             (lambda out: pycoll.reduce_scatter(np.ones((size, 3), np.float32), group=arg, out=out),
              (1, 3)),
             (lambda out: pycoll.alltoall(np.ones((size, 3), np.float32), group=arg, out=out),
              (size, 3))]
    for call, shape in cases:
        with pytest.raises(error, match=match):
            call(np.empty(shape, np.float64 if last else np.float32))
        call(np.empty(shape, np.float32))       # the group stays usable


@pytest.mark.parametrize("kind", ["numpy", "torch", "fake_cuda"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_broadcast_from_every_root(group, kind, dtype, fake_device):
    arg, rank, size = group
    for root in range(size):
        x = make(rank_input(dtype, (6, 2), rank), dtype, kind)
        assert_matches(pycoll.broadcast(x, root=root, group=arg),
                       rank_input(dtype, (6, 2), root), dtype)
        assert_matches(x, rank_input(dtype, (6, 2), rank), dtype)
        pycoll.broadcast_(x, root=root, group=arg)
        assert_matches(x, rank_input(dtype, (6, 2), root), dtype)


def bool_input(rank, kind):
    """Position i holds bit ``rank`` of i: any rank's True and every rank's are known."""
    return make((np.arange(16) >> rank) & 1 == 1, "bool", kind)


def as_bools(x):
    return to_numpy(x).astype(bool)


@pytest.mark.parametrize("kind", ["numpy", "torch", "fake_cuda"])
def test_bool_tensors(group, kind, fake_device):
    """bool reduces as torch's gloo and NCCL backends reduce it: Sum and Max are any rank's
    True, Min and Product every rank's; the other collectives move it as bytes."""
    arg, rank, size = group
    members = (1 << size) - 1
    bits = np.arange(16) & members
    for op, expected in (("Sum", bits != 0), ("Max", bits != 0), ("Min", bits == members),
                         ("Product", bits == members)):
        x = bool_input(rank, kind)
        y = pycoll.allreduce(x, op=getattr(pycoll, op), group=arg)
        assert type(y) is type(x) and y.dtype == x.dtype
        np.testing.assert_array_equal(as_bools(y), expected)
        pycoll.allreduce_async_(x, op=getattr(pycoll, op), group=arg).wait()
        np.testing.assert_array_equal(as_bools(x), expected)
        xs = [bool_input(rank, kind), bool_input(rank, kind)]
        for z in pycoll.grouped_allreduce(xs, op=getattr(pycoll, op), group=arg):
            np.testing.assert_array_equal(as_bools(z), expected)
    with pytest.raises(TypeError, match="Average of bool tensors is not defined"):
        pycoll.allreduce(bool_input(rank, kind), group=arg)
    np.testing.assert_array_equal(
        as_bools(pycoll.broadcast(bool_input(rank, kind), root=size - 1, group=arg)),
        as_bools(bool_input(size - 1, "numpy")))
    np.testing.assert_array_equal(as_bools(pycoll.allgather(bool_input(rank, kind), group=arg)),
                                  np.concatenate([bool_input(r, "numpy") for r in range(size)]))


@pytest.mark.parametrize("kind", ["numpy", "torch", "fake_cuda"])
@pytest.mark.parametrize("dtype", ["int8", "int32", "int64", "uint8", "bool"])
def test_bitwise_reductions(group, kind, dtype, fake_device):
    """BitwiseAnd, BitwiseOr and BitwiseXor of integer and bool tensors, as MPI's BAND, BOR
    and BXOR; floats are refused before anything is sent."""
    arg, rank, size = group
    inputs = [(np.arange(32) * (r + 3) + 5 * r) % 97 for r in range(size)]
    if dtype == "bool":
        inputs = [x % 2 == 1 for x in inputs]
    inputs = [x.astype(np_dtype(dtype)) for x in inputs]
    for op, reference in (("BitwiseAnd", np.bitwise_and), ("BitwiseOr", np.bitwise_or),
                          ("BitwiseXor", np.bitwise_xor)):
        expected = reference.reduce(np.stack(inputs), axis=0)
        x = make(inputs[rank], dtype, kind)
        y = pycoll.allreduce(x, op=getattr(pycoll, op), group=arg)
        np.testing.assert_array_equal(to_numpy(y).astype(expected.dtype), expected)
        pycoll.allreduce_async_(x, op=getattr(pycoll, op), group=arg).wait()
        np.testing.assert_array_equal(to_numpy(x).astype(expected.dtype), expected)
    with pytest.raises(TypeError, match="BitwiseOr of float32 tensors is not defined"):
        pycoll.allreduce(make(inputs[rank], "float32", kind), op=pycoll.BitwiseOr, group=arg)


@pytest.mark.parametrize("kind", ["numpy", "torch", "fake_cuda"])
def test_wide_unsigned_reduce_and_float8_moves(group, kind, fake_device):
    """uint16/32/64 reduce as MPI's unsigned types, beyond the signed range too, alone and
    fused; float8 (ml_dtypes', torch's) moves bit for bit, NaN patterns included, as on
    NCCL, and every reduction refuses it."""
    arg, rank, size = group
    host = {"numpy": lambda a: a, "torch": torch.from_numpy,
            "fake_cuda": fakegpu.FakeCudaArray}[kind]
    back = {"numpy": np.asarray, "torch": lambda t: t.numpy(),
            "fake_cuda": lambda f: f.get()}[kind]
    for dtype in ("uint16", "uint32", "uint64"):
        top = np.iinfo(dtype).max
        x = np.array([top - rank, rank, 1 + rank], dtype)
        np.testing.assert_array_equal(back(pycoll.allreduce(host(x), op=pycoll.Max, group=arg)),
                                      np.array([top, size - 1, size], dtype))
        fused = pycoll.grouped_allreduce([host(np.full(5, 1 + rank, dtype)), host(x[1:])],
                                         op=pycoll.Sum, group=arg)
        total = size * (size + 1) // 2
        np.testing.assert_array_equal(back(fused[0]), np.full(5, total, dtype))
        np.testing.assert_array_equal(back(fused[1]), np.array([total - size, total], dtype))
        with pytest.raises(TypeError, match=f"Average of {dtype} tensors would truncate"):
            pycoll.allreduce(host(x), op=pycoll.Average, group=arg)
    if kind == "fake_cuda":
        return                  # __cuda_array_interface__ has no float8 typestr (torch's: DLPack)
    patterns = lambda r: ((np.arange(2 * size) * 37 + r * 11) % 256).astype(np.uint8)  # noqa: E731
    for name in tensors.FLOAT8:
        x = (patterns(rank).view(getattr(ml_dtypes, name)) if kind == "numpy"
             else torch.from_numpy(patterns(rank)).view(getattr(torch, name)))
        bits = (lambda y: np.asarray(y).view(np.uint8)) if kind == "numpy" else \
            (lambda y: y.view(torch.uint8).numpy())
        np.testing.assert_array_equal(bits(pycoll.allgather(x, group=arg)),
                                      np.concatenate([patterns(r) for r in range(size)]))
        np.testing.assert_array_equal(bits(pycoll.broadcast(x, root=size - 1, group=arg)),
                                      patterns(size - 1))
        np.testing.assert_array_equal(bits(pycoll.alltoall(x, group=arg)[0]),
                                      np.concatenate([patterns(r)[2 * rank:2 * rank + 2]
                                                      for r in range(size)]))
        with pytest.raises(TypeError, match=f"Sum of {name} tensors is not defined.*cast"):
            pycoll.allreduce(x, op=pycoll.Sum, group=arg)


def test_broadcast_bad_root(group):
    arg, rank, size = group
    with pytest.raises(ValueError, match="root must be a rank"):
        pycoll.broadcast(np.zeros(3), root=size, group=arg)


class DLPackOnly:
    """A host array known by DLPack alone, of a kind whose module makes no arrays (as
    JAX's: its arrays are immutable, its module has no empty())."""

    def __init__(self, host: np.ndarray):
        self.host, self.dtype, self.shape = host, host.dtype, host.shape

    def __dlpack__(self, **kwargs):
        return self.host.__dlpack__(**kwargs)

    def __dlpack_device__(self):
        return self.host.__dlpack_device__()


def test_results_of_a_kind_pycoll_cannot_make_are_numpy_arrays(group):
    """Out-of-place results for a JAX-like array: numpy arrays, from every collective (it
    failed with "module 'jaxlib' has no attribute 'empty'")."""
    arg, rank, size = group
    dtype, shape = "float32", (2 * size, 3)

    def x():
        return DLPackOnly(make(rank_input(dtype, shape, rank), dtype, "numpy"))
    every = np.concatenate([rank_input(dtype, shape, r) for r in range(size)])
    results = {"allreduce": (pycoll.allreduce(x(), op=pycoll.Sum, group=arg),
                             expected_reduce(dtype, shape, size, "Sum")),
               "allgather": (pycoll.allgather(x(), group=arg), every),
               "broadcast": (pycoll.broadcast(x(), root=size - 1, group=arg),
                             rank_input(dtype, shape, size - 1)),
               "reduce_scatter": (pycoll.reduce_scatter(x(), op=pycoll.Sum, group=arg),
                                  expected_reduce(dtype, shape, size, "Sum")[2 * rank:2 * rank + 2]),
               "alltoall": (pycoll.alltoall(x(), group=arg)[0], every.reshape(size, 2 * size, 3)
                            [:, 2 * rank:2 * rank + 2].reshape(-1, 3))}
    for name, (got, expected) in results.items():
        assert type(got) is np.ndarray, name
        assert_matches(got, expected, dtype)


def test_broadcast_root_only_reads(group):
    """The root only sends, as in MPI's Bcast: a read-only tensor there (a numpy scalar,
    bytes' view), in place too, works. The root alone refused them, and the other ranks
    waited in the broadcast for it."""
    arg, rank, size = group
    for root in range(size):
        got = pycoll.broadcast(np.float32(rank + 0.5), root=root, group=arg)
        assert got.shape == () and got == np.float32(root + 0.5)
        sent = np.frombuffer(np.arange(3.0).tobytes(), np.float64)          # read-only
        x = sent if rank == root else np.zeros(3)
        assert pycoll.broadcast_(x, root=root, group=arg) is x
        np.testing.assert_array_equal(x, np.arange(3.0))


@pytest.mark.parametrize("op", ["Sum", "Average", "Max"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "int32"])
@pytest.mark.parametrize("rows", [0, 1, 7, 12])         # 12: even at 1-4 ranks (MPI's block call)
def test_reduce_scatter(group, op, dtype, rows):
    arg, rank, size = group
    x = make(rank_input(dtype, (rows, 2), rank), dtype, "numpy")
    if op == "Average" and dtype == "int32":
        with pytest.raises(TypeError, match="Average of int32 tensors would truncate"):
            pycoll.reduce_scatter(x, op=pycoll.Average, group=arg)
        return
    y = pycoll.reduce_scatter(x, op=getattr(pycoll, op), group=arg)
    full = expected_reduce(dtype, (rows, 2), size, op)
    counts = [rows // size + (r < rows % size) for r in range(size)]
    start = sum(counts[:rank])
    assert_matches(y, full[start:start + counts[rank]], dtype)


@pytest.mark.parametrize("kind", ["numpy", "torch", "fake_cuda"])
@pytest.mark.parametrize("uneven", [False, True])
def test_alltoall(group, kind, uneven, fake_device):
    arg, rank, size = group
    # rank s sends splits(s)[d] rows to rank d; row values encode (sender, receiver).
    splits = lambda s: [(s + d) % 3 if uneven else 2 for d in range(size)]   # noqa: E731

    def block(s, d):
        return np.full((splits(s)[d], 2), 10 * s + d, np.float64)
    x = make(np.concatenate([block(rank, d) for d in range(size)]), "float32", kind)
    y, received = pycoll.alltoall(x, splits=splits(rank) if uneven else None, group=arg)
    assert list(received) == [splits(s)[rank] for s in range(size)]
    assert_matches(y, np.concatenate([block(s, rank) for s in range(size)]), "float32")


@pytest.mark.parametrize("kind", ["numpy", "torch", "fake_cuda"])
@pytest.mark.parametrize("uneven", [False, True])
def test_alltoall_into_out(group, kind, uneven, fake_device):
    """out= receives the rows in place of a new tensor, as a training loop reuses one."""
    arg, rank, size = group
    splits = lambda s: [(s + d) % 3 if uneven else 2 for d in range(size)]   # noqa: E731
    x = make(np.concatenate([np.full((splits(rank)[d], 2), 10 * rank + d) for d in range(size)]),
             "float32", kind)
    out = make(np.full((sum(splits(s)[rank] for s in range(size)), 2), -1.0), "float32", kind)
    for _ in range(2):
        y, received = pycoll.alltoall(x, splits=splits(rank), group=arg, out=out)
        assert y is out and list(received) == [splits(s)[rank] for s in range(size)]
        assert_matches(out, np.concatenate([np.full((splits(s)[rank], 2), 10 * s + rank)
                                            for s in range(size)]), "float32")
    y, _ = pycoll.alltoall_async(x, splits=splits(rank), group=arg, out=out).wait()
    assert y is out


def test_alltoall_bad_splits(group):
    arg, rank, size = group
    with pytest.raises(ValueError, match="splits"):
        pycoll.alltoall(np.zeros((size + 1, 2)), splits=[1] * size, group=arg)
    x = np.zeros((2 * size, 2))
    for bad in ([2] * (size + 1), [-1, 3] + [2] * (size - 1), [1.5, 2.5] + [2] * (size - 2)):
        if len(bad) == size + 1 or size >= 2:
            with pytest.raises(ValueError, match="non-negative row counts"):
                pycoll.alltoall(x, splits=bad, group=arg)
    for splits in (torch.full((size,), 2), [2.0] * size):     # any sequence of row counts
        y, received = pycoll.alltoall(x, splits=splits, group=arg)
        assert y.shape == (2 * size, 2) and list(received) == [2] * size
    if size > 1:
        with pytest.raises(ValueError, match="divisible"):
            pycoll.alltoall(np.zeros((size + 1, 2)), group=arg)


def test_barrier(group):
    arg, rank, size = group
    pycoll.barrier(group=arg)
    pycoll.barrier_async(group=arg).wait(timeout=60)


LARGE = 17 * 2**20        # float32 elements: 68 MiB, above 64 MiB


def test_large_tensors(pycoll_world):
    rank, size = pycoll.rank(), pycoll.size()
    x = np.full(LARGE, rank + 1, np.float32)
    x[-1] = rank
    y = pycoll.allreduce(x, op=pycoll.Sum)
    assert y[0] == size * (size + 1) / 2 and y[-1] == size * (size - 1) / 2
    assert (y[:-1] == y[0]).all()
    del y
    g = pycoll.allgather(x[: LARGE // size])
    assert g.shape == (LARGE // size * size,) and g[-2] == size
    del g
    b = pycoll.broadcast(x, root=size - 1)
    assert b[0] == size and b[-1] == size - 1
    del b
    rs = pycoll.reduce_scatter(x, op=pycoll.Max)
    assert rs.size in (LARGE // size, LARGE // size + 1) and rs[0] == size
    del rs
    a, _ = pycoll.alltoall(x[: LARGE // size * size])
    assert a.size == LARGE // size * size and a[0] == 1 and a[-2] == size


def test_group_membership_and_rank_checks(pycoll_world):
    size = pycoll.size()
    with pytest.raises(ValueError, match="distinct ranks"):
        pycoll.new_group([0, 0])
    with pytest.raises(ValueError, match="distinct ranks"):
        pycoll.new_group([size])
    if size > 1:
        g = pycoll.new_group([0])
        if pycoll.rank() != 0:
            with pytest.raises(ValueError, match="not a member"):
                pycoll.allreduce(np.zeros(2), group=g)
        else:
            np.testing.assert_array_equal(pycoll.allreduce(np.ones(2), group=g), np.ones(2))


def test_counts_beyond_mpi_int_are_split_or_refused(group, monkeypatch, settings):
    """The real limit is 2^31 elements; shrunk here so the test needs no 8 GiB (in the
    general path: the short path's is compiled in)."""
    arg, rank, size = group
    settings(check=True)
    monkeypatch.setattr(collectives, "_PIECE", 7)
    x = np.arange(100, dtype=np.float32) + rank
    np.testing.assert_array_equal(pycoll.allreduce(x, op=pycoll.Sum, group=arg),
                                  sum(np.arange(100, dtype=np.float32) + r for r in range(size)))
    np.testing.assert_array_equal(pycoll.broadcast(x, root=0, group=arg), np.arange(100))
    monkeypatch.setattr(collectives, "_MAX_COUNT", 15)
    with pytest.raises(ValueError, match="beyond MPI's limit of 2\\^31-1; split the tensor"):
        pycoll.allgather(np.zeros(4, np.float32), group=arg)
    np.testing.assert_array_equal(pycoll.allreduce(np.ones(2), op=pycoll.Sum, group=arg), size)
