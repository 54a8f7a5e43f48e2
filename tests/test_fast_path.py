"""The blocking collectives' short path: host tensors straight to MPI, in _C.

It must give what the general path gives, and step aside (to the general path, which
raises on bad input) whenever it cannot keep the engine's order or read the tensor.
"""
import numpy as np
import pytest
import torch

import pycoll
from pycoll import _C, collectives, config, tensors

pytestmark = [pytest.mark.mpi, pytest.mark.timeout(120)]


@pytest.fixture
def short_runs(settings, monkeypatch, pycoll_world):
    """PYCOLL_CHECK off (the suite's default turns it on, and it disables the short
    path); how many collectives the short path has run since."""
    settings(check=False)
    start = _C.short_path_runs()
    return lambda: _C.short_path_runs() - start


def test_mpi_was_found():
    assert collectives._MPI_FROM_C == ""


@pytest.mark.parametrize("kind", ["numpy", "torch"])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32", "float64", "int8",
                                   "int32", "int64", "uint8"])
@pytest.mark.parametrize("op", [pycoll.Sum, pycoll.Average, pycoll.Min, pycoll.Max,
                                pycoll.Product])
def test_short_path_equals_the_general_one(settings, group, short_runs, kind, dtype, op, monkeypatch):
    arg, rank, size = group
    if op is pycoll.Average and dtype not in ("float16", "bfloat16", "float32", "float64"):
        pytest.skip("Average of integers is refused")
    if kind == "numpy" and dtype == "bfloat16":
        pytest.skip("numpy has no bfloat16")
    values = np.arange(1, 8) % 3 + rank % 2 + 1         # small: products stay exact
    make = ((lambda: torch.tensor(values).to(getattr(torch, dtype))) if kind == "torch"
            else (lambda: values.astype(dtype)))
    short_in, short_out = make(), pycoll.allreduce(make(), op=op, group=arg)
    assert pycoll.allreduce_(short_in, op=op, group=arg) is short_in
    assert short_runs() == 2
    settings(check=True)    # the general path
    general = pycoll.allreduce(make(), op=op, group=arg)
    assert short_runs() == 2
    for result in (short_in, short_out):
        assert type(result) is type(general) and result.dtype == general.dtype
        assert (result == general).all()


def test_short_path_keeps_the_issue_order(group, short_runs):
    """A blocking call made while an async one is still unsent runs after it."""
    arg, rank, size = group
    x = np.full(3, rank + 1.0)
    pending = pycoll.allreduce_async_(x, op=pycoll.Sum, group=arg)     # sits in the open batch
    pycoll.allreduce_(x, op=pycoll.Product, group=arg)
    assert short_runs() == 0
    assert pending.is_completed()
    np.testing.assert_array_equal(x, (size * (size + 1) / 2) ** size)
    pycoll.allreduce_(x, op=pycoll.Min, group=arg)
    assert short_runs() == 1


def test_what_the_short_path_leaves_to_the_general_one(settings, group, short_runs, monkeypatch):
    arg, rank, size = group
    big = np.ones(1024, np.float32)
    settings(chunk_bytes=1024)        # in pieces
    np.testing.assert_array_equal(pycoll.allreduce(big, op=pycoll.Sum, group=arg), size)
    np.testing.assert_array_equal(pycoll.allreduce(bytearray(3), op=pycoll.Sum, group=arg), 0)
    assert short_runs() == 0
    with pytest.raises(ValueError, match="contiguous"):
        pycoll.allreduce_(np.ones((4, 4))[:, 0], group=arg)
    with pytest.raises(ValueError, match="contiguous"):
        pycoll.allreduce_(torch.ones(4, 4).t(), group=arg)
    readonly = np.ones(4)
    readonly.flags.writeable = False
    with pytest.raises(ValueError, match="read-only"):
        pycoll.allreduce_(readonly, group=arg)
    with pytest.raises(TypeError, match="Average of int32"):
        pycoll.allreduce(np.ones(4, np.int32), group=arg)
    for op in ("bogus", [pycoll.Sum]):                                  # [..]: unhashable
        with pytest.raises(ValueError, match="unknown reduction"):
            pycoll.allreduce(np.ones(4), op=op, group=arg)
    assert short_runs() == 0


def test_ops_named_by_their_value_take_the_short_path(group, short_runs):
    arg, rank, size = group
    np.testing.assert_array_equal(pycoll.allreduce(np.ones(4), op="sum", group=arg), size)
    np.testing.assert_array_equal(pycoll.allreduce_(torch.ones(4), op="average", group=arg), 1)
    assert short_runs() == 2


def test_blocking_call_inside_a_batch_takes_the_general_path(group, short_runs):
    """Its group's engine is running the batch: the short path may not take its gate."""
    arg, rank, size = group
    inner = pycoll.runtime.resolve(arg).engine.submit(
        lambda: pycoll.allreduce(np.ones(2), op=pycoll.Sum, group=arg), "callback")
    np.testing.assert_array_equal(inner.wait(timeout=60), size)
    assert short_runs() == 0


def test_bind_refuses_an_unknown_handle_size_and_keeps_its_binding(short_runs):
    assert "handles of 3 bytes" in _C.mpi_bind("/nowhere/MPI.so", 3)
    assert pycoll.allreduce_(np.ones(2), op=pycoll.Sum)[0] == pycoll.size()
    assert short_runs() == 1


def test_groups_in_turn_each_average_over_their_own_size(short_runs):
    """The short path remembers the group it used last; the next one must not inherit
    its communicator or size."""
    world = pycoll.size()
    first = pycoll.new_group([0])
    for _ in range(3):
        x = torch.full((3,), float(pycoll.rank()))
        np.testing.assert_allclose(pycoll.allreduce(x), (world - 1) / 2)
        if pycoll.rank() == 0:
            np.testing.assert_array_equal(pycoll.allreduce(x, group=first), 0)
            np.testing.assert_array_equal(pycoll.allreduce_(x + 5, group=first), 5)
    assert short_runs() == (9 if pycoll.rank() == 0 else 3)


def _every_collective(kind, arg, rank, size):
    """Calls of each collective but allreduce in its forms, on fresh rank-tagged tensors:
    uneven rows, out=, list splits."""
    tensor = torch.tensor if kind == "torch" else np.array

    def x(rows, fill=rank):
        return tensor((np.arange(rows * 3).reshape(rows, 3) + 100 * fill).astype(np.float32))

    rows = 2 * size + 1                           # reduce_scatter's first rank gets more
    mine = rows // size + (rank < rows % size)
    splits = [r + 1 for r in range(size)]         # alltoall: rank r gets r + 1 rows from each
    return [
        lambda: pycoll.broadcast(x(3), root=size - 1, group=arg),
        lambda: pycoll.broadcast_(x(3), root=0, group=arg),
        lambda: pycoll.reduce_scatter(x(rows), op=pycoll.Average, group=arg),
        lambda: pycoll.reduce_scatter(x(rows), op=pycoll.Sum, group=arg, out=x(mine, 0)),
        lambda: pycoll.reduce_scatter(x(2 * size), op=pycoll.Sum, group=arg),    # even
        lambda: pycoll.allgather(x(rank + 1), group=arg),
        lambda: pycoll.allgather(x(2), group=arg, out=x(2 * size, 0)),
        lambda: pycoll.alltoall(x(2 * size), group=arg),
        lambda: pycoll.alltoall(x(sum(splits)), splits=splits, group=arg),
        lambda: pycoll.alltoall(x(sum(splits)), splits=splits, group=arg,
                                out=x(size * (rank + 1), 0)),
    ]


@pytest.mark.parametrize("kind", ["numpy", "torch"])
def test_every_collective_takes_the_short_path_and_equals_the_general_one(settings, group,
                                                                          short_runs, kind):
    calls = _every_collective(kind, *group)
    short = [call() for call in calls]
    assert short_runs() == len(calls)
    settings(check=True)    # the general path
    general = [call() for call in calls]
    assert short_runs() == len(calls)
    for got, want in zip(short, general):
        got, want = (got, want) if isinstance(got, tuple) else ((got,), (want,))
        for a, b in zip(got, want):
            assert type(a) is type(b) and a.dtype == b.dtype and tuple(a.shape) == tuple(b.shape)
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_every_collective_keeps_the_issue_order(group, short_runs):
    """Each steps aside while an async allreduce issued before it is still unsent."""
    arg, rank, size = group
    for call in _every_collective("numpy", arg, rank, size):
        pending = pycoll.allreduce_async_(np.ones(2), op=pycoll.Sum, group=arg)
        call()
        assert pending.is_completed()
    assert short_runs() == 0


def test_short_path_allgather_names_what_the_ranks_disagree_on(group, short_runs):
    arg, rank, size = group
    if size == 1:
        pytest.skip("needs two ranks to disagree")
    dtype = np.float32 if rank == 0 else np.float64
    with pytest.raises(ValueError, match="must agree in dtype"):
        pycoll.allgather(np.zeros((2, 3), dtype), group=arg)
    with pytest.raises(ValueError, match="out= must hold"):
        pycoll.allgather(np.zeros(2), group=arg, out=np.zeros(2 * size + 1))
    with pytest.raises(ValueError, match="out= must hold the rows each rank receives"):
        pycoll.alltoall(np.zeros(size), group=arg, out=np.zeros(size + (rank == 0)))
    with pytest.raises(ValueError, match="this rank's block"):
        pycoll.reduce_scatter(np.zeros((size, 2)), group=arg, out=np.zeros(2 + 2 * (rank == 0)))
    with pytest.raises(ValueError, match="same shape and dtype"):
        pycoll.reduce_scatter(np.zeros((size * (1 + (rank == 0)), 2)), group=arg)
    np.testing.assert_array_equal(pycoll.allgather(np.full(1, rank), group=arg), range(size))
    assert short_runs() == 1        # and the token came back after each error


def test_either_path_meets_the_other_whatever_the_capacity(group, short_runs):
    """allgather, alltoall and reduce_scatter send their sizes with their data in one
    exchange, and what did not fit the group's capacity (its last call's largest part, up
    to 4 KiB, 16 KiB for reduce_scatter) in a second: ranks on the short path (even ones)
    and on the general one (odd ones, through the async forms) meet as the rows grow (two
    rounds), repeat (one), shrink (one) and pass the carried size (700 rows of 8 float32:
    22 KiB a part)."""
    arg, rank, size = group

    def run(name, *args, **kwargs):
        if rank % 2:
            return getattr(pycoll, name + "_async")(*args, **kwargs).wait()
        return getattr(pycoll, name)(*args, **kwargs)
    sizes = (1, 3, 3, 2, 700, 700, 1)
    for rows in sizes:
        x = np.full((rows * size, 8), rank + 1.0, np.float32)
        gathered = run("allgather", x[:rows + rank % 2], group=arg)         # uneven
        np.testing.assert_array_equal(gathered[:, 0], np.concatenate(
            [np.full(rows + r % 2, r + 1.0) for r in range(size)]))
        y, received = run("alltoall", x, group=arg)
        np.testing.assert_array_equal(y[:, 0], np.repeat(np.arange(1.0, size + 1), rows))
        assert list(received) == [rows] * size
        out = np.empty((rows, 8), np.float32)
        assert run("reduce_scatter", x, op=pycoll.Sum, group=arg, out=out) is out
        assert (out == size * (size + 1) / 2).all()
    assert short_runs() == (0 if rank % 2 else 3 * len(sizes))


def test_every_collective_makes_one_mpi_call_where_its_sizes_ride_along(group, short_runs):
    """As many MPI calls as mpi4py's one: allreduce and broadcast always; allgather and
    alltoall once the group has carried parts of their size (up to 4 KiB), reduce_scatter
    up to 16 KiB. A larger part takes two (the sizes, then MPI's own call)."""
    arg, rank, size = group

    def calls(call):
        start = _C.mpi_calls()
        call()
        return _C.mpi_calls() - start

    def every(rows, width):
        x, out = np.ones((rows * size, width), np.float32), np.empty((rows, width), np.float32)
        gathered = np.empty((rows * size * size, width), np.float32)
        return {"allreduce_": lambda: pycoll.allreduce_(x, op=pycoll.Sum, group=arg),
                "broadcast_": lambda: pycoll.broadcast_(x, root=0, group=arg),
                "allgather": lambda: pycoll.allgather(x, group=arg, out=gathered),
                "alltoall": lambda: pycoll.alltoall(x, group=arg, out=np.empty_like(x)),
                "reduce_scatter": lambda: pycoll.reduce_scatter(x, op=pycoll.Sum, group=arg,
                                                                out=out)}
    small = every(2, 8)                     # 64-byte parts
    for name, call in small.items():
        calls(call)                         # the group learns the part's size
        assert (name, calls(call)) == (name, 1)
    large = every(1024, 8)                  # 32 KiB parts: past every capacity
    for name in ("allgather", "alltoall", "reduce_scatter"):
        assert (name, [calls(large[name]) for _ in range(2)]) == (name, [2, 2])
    assert short_runs() == 2 * len(small) + 6


def test_what_the_short_path_leaves_to_the_other_collectives_general_paths(group, short_runs):
    arg, rank, size = group
    with pytest.raises(ValueError, match="root must be a rank"):
        pycoll.broadcast(np.ones(2), root=size, group=arg)
    with pytest.raises(ValueError, match="0-d"):
        pycoll.reduce_scatter(np.float32(1.0) * np.ones(()), group=arg)
    with pytest.raises(ValueError, match="splits must be"):
        pycoll.alltoall(np.ones(size), splits=[2] * size, group=arg)
    with pytest.raises(TypeError, match="out= is float64"):
        pycoll.allgather(np.ones(2, np.float32), group=arg, out=np.ones(2 * size))
    with pytest.raises(ValueError, match="contiguous"):
        pycoll.alltoall(np.arange(4.0 * size)[::2], group=arg)
    assert short_runs() == 0


@pytest.mark.parametrize("kind", ["numpy", "torch"])
@pytest.mark.parametrize("op", [pycoll.Sum, pycoll.Average])
@pytest.mark.parametrize("inplace", [True, False])
@pytest.mark.parametrize("chunk_bytes", [4 * 2**20, 1000])      # one piece; many, cutting tensors
def test_grouped_allreduce_in_one_compiled_pass(settings, group, short_runs, kind, op, inplace,
                                                chunk_bytes):
    """A list that fuses into one group runs in _C. Odd ranks leave an async allreduce
    unsent first, so their grouped call takes the general path: both paths must cut it
    into the same MPI calls. Results out of place are views of one new buffer, cut by
    runs of equal shapes (0-d and empty ones included)."""
    arg, rank, size = group
    settings(chunk_bytes=chunk_bytes)
    shapes = [(5, 3), (700,), (1,), (1,), (2, 0), (30, 25), (30, 25), (4, 1, 2), (), (), (3,)]
    tensor = torch.tensor if kind == "torch" else np.array

    def inputs(fill):
        return [tensor((np.arange(np.prod(s)).reshape(s) % 7 + fill).astype(np.float32))
                for s in shapes]
    pending = pycoll.allreduce_async_(np.ones(2), op=pycoll.Sum, group=arg)
    if rank % 2 == 0:
        pending.wait()
    xs = inputs(rank)
    call = pycoll.grouped_allreduce_ if inplace else pycoll.grouped_allreduce
    ys = call(xs, op=op, group=arg)
    assert pending.is_completed()
    assert short_runs() == (rank % 2 == 0)
    want = [w / size if op is pycoll.Average else w for w in
            (sum(parts) for parts in zip(*[inputs(r) for r in range(size)]))]
    assert ys == xs if inplace else len(ys) == len(xs)
    for y, w, s in zip(ys, want, shapes):
        assert type(y) is type(xs[0]) and tuple(y.shape) == s and y.dtype == xs[0].dtype
        np.testing.assert_allclose(np.asarray(y), np.asarray(w, np.float32), rtol=1e-6)
    if not inplace:
        owner = ((lambda y: y.untyped_storage().data_ptr()) if kind == "torch"
                 else (lambda y: id(y.base)))
        assert len({owner(y) for y in ys}) == 1


@pytest.mark.parametrize("kind", ["numpy", "torch"])
@pytest.mark.parametrize("inplace", [True, False])
def test_grouped_allreduce_in_cached_pieces(settings, group, short_runs, kind, inplace):
    """A list longer than collectives._CACHED_PIECE (per peer) is packed, reduced and
    unpacked a piece at a time in place (out of place, in PYCOLL_CHUNK_BYTES pieces of the new
    buffer); the compiled pass (even ranks) and the general path (odd ranks, an async
    allreduce unsent) cut the same pieces. The new list's one buffer is a host block
    (tensors.POOLED_GROUPED); torch's results are disjoint parts of it: writing one
    leaves the others."""
    arg, rank, size = group
    piece = collectives._CACHED_PIECE * max(1, size - 1)
    settings(fusion_threshold=4 * piece, chunk_bytes=4 * piece)   # the piece, not the chunk, cuts
    repeats = 2 * piece // (3 * 4 * 60000) + 1
    shapes = [(3,)] + [(120, 500), (60000,), (4, 15000)] * repeats + [(7, 2), (59999,), (1,), (60000,)]
    assert 2 * piece < sum(4 * np.prod(s) for s in shapes) < 4 * piece
    tensor = torch.from_numpy if kind == "torch" else np.asarray

    def inputs(r):
        return [tensor((np.arange(np.prod(s), dtype=np.float32).reshape(s) + i) % 251 + r)
                for i, s in enumerate(shapes)]
    pending = pycoll.allreduce_async_(np.ones(2), op=pycoll.Sum, group=arg)
    if rank % 2 == 0:
        pending.wait()
    xs = inputs(rank)
    ys = (pycoll.grouped_allreduce_ if inplace else pycoll.grouped_allreduce)(
        xs, op=pycoll.Average, group=arg)
    assert short_runs() == (rank % 2 == 0)
    for y, parts in zip(ys, zip(*[inputs(r) for r in range(size)])):
        np.testing.assert_allclose(np.asarray(y), sum(np.asarray(p, np.float64) for p in parts)
                                   / size, rtol=1e-6)
    if kind == "numpy" and not inplace:     # over tensors.POOLED_GROUPED: a reused block
        assert sum(y.nbytes for y in ys) >= tensors.POOLED_GROUPED
        base = ys[0]
        while isinstance(base, np.ndarray):
            base = base.base
        assert type(base).__name__ == "HostBlock"
    if kind == "torch" and not inplace:
        ys[1].fill_(-1)
        assert (ys[0] != -1).all() and (ys[2] != -1).all() and ys[4].sum() > 0
        assert not ys[1].requires_grad and ys[-4].add_(1).shape == (7, 2)


def test_grouped_lists_the_compiled_pass_leaves_to_the_general_path(settings, group, short_runs):
    """Lists that _allreduce_many splits (past the fusion threshold, or holding a tensor
    that goes alone), of mixed kinds or dtypes, and tuples."""
    arg, rank, size = group
    settings(fusion_threshold=3000)
    for xs in ([np.ones(500, np.float32), np.ones(500, np.float32)],
               [np.ones(2, np.float32), np.ones(2**16, np.float32)],
               [np.ones(2, np.float32), torch.ones(2)],
               [np.ones(2, np.float32), np.ones(2, np.float64)],
               (np.ones(2, np.float32), np.ones(3, np.float32))):
        for y in pycoll.grouped_allreduce(xs, op=pycoll.Sum, group=arg):
            np.testing.assert_array_equal(np.asarray(y), size)
    assert short_runs() == 0
    with pytest.raises(TypeError, match="Average of int32"):
        pycoll.grouped_allreduce_([np.ones(2, np.int32)], group=arg)
    assert short_runs() == 0


def test_the_compiled_tensor_reader_equals_the_python_one(pycoll_world, monkeypatch):
    """tensors.as_buffer reads contiguous host numpy and torch tensors in one compiled call
    (_C.host_buffer); with it refused, the Python readers must give the same Buffer."""
    read_only = np.arange(4.0)
    read_only.flags.writeable = False
    xs = [np.arange(12, dtype=np.float32).reshape(3, 4), np.zeros((), np.int64),
          np.zeros((0, 3), np.uint8), read_only, np.arange(10.0)[3:],
          torch.arange(6, dtype=torch.int32).reshape(2, 3), torch.zeros((), dtype=torch.bfloat16),
          torch.nn.Parameter(torch.ones(4)), torch.arange(10.0)[2:], torch.zeros(0, 5)]
    compiled = [tensors.as_buffer(x) for x in xs]
    names = tensors._NUMPY_DTYPES, tensors._TORCH_DTYPES, tensors.Buffer
    assert _C.host_buffer(xs[5], *names) == compiled[5]  # it ran
    assert _C.host_buffer(xs[0], *names) == compiled[0]
    monkeypatch.setattr(_C, "host_buffer", lambda *args: None)
    for x, got in zip(xs, compiled):
        want = tensors.as_buffer(x)
        assert type(got) is tensors.Buffer and got == want and type(got.shape) is tuple, x
