"""partial_allreduce against numpy for every subset of ranks, at any number of ranks.

Every rank walks the same list of subsets in the same order and joins those it is in, so
groups that share ranks are issued in one order everywhere (what a group generator
guarantees). Inputs come from (dtype, shape, rank) as in test_collectives.py.
"""
import itertools

import numpy as np
import pytest

import pycoll
from pycoll import config, partial
import fakegpu
from test_collectives import DTYPES, OPS, assert_matches, make, np_dtype, rank_input

torch = pytest.importorskip("torch")

pytestmark = [pytest.mark.mpi, pytest.mark.timeout(120)]


def subsets(size):
    return [s for k in range(1, size + 1) for s in itertools.combinations(range(size), k)]


def expected(dtype, shape, ranks, op):
    xs = np.stack([rank_input(dtype, shape, r, op) for r in ranks])
    return {"Sum": xs.sum(0), "Average": xs.mean(0), "Min": xs.min(0), "Max": xs.max(0),
            "Product": xs.prod(0)}[op]


@pytest.fixture(params=["p2p", "cached"])
def path(settings, request, monkeypatch, pycoll_world):
    """p2p: the ring on every call; cached: a communicator per group from its first use."""
    settings(partial_cache_after=0 if request.param == "p2p" else 1)
    return request.param


@pytest.fixture
def small_chunks(settings):
    settings(chunk_bytes=8)                  # PYCOLL_CHUNK_BYTES: many chunks per block


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_every_subset_every_dtype_and_op(pycoll_world, path, small_chunks, dtype, op):
    rank = pycoll.rank()
    for shape in [(0,), (1,), (5, 7)]:
        x = rank_input(dtype, shape, rank, op).astype(np_dtype(dtype))
        for ranks in subsets(pycoll.size()):
            if rank not in ranks:
                continue
            if op == "Average" and dtype.startswith(("int", "uint")):
                with pytest.raises(TypeError, match="Average"):
                    pycoll.partial_allreduce(x, ranks, op=getattr(pycoll, op))
                continue
            before = x.copy()
            y = pycoll.partial_allreduce(x, ranks, op=getattr(pycoll, op))
            assert y.shape == x.shape and y.dtype == x.dtype
            assert_matches(y, expected(dtype, shape, ranks, op), dtype)
            np.testing.assert_array_equal(x, before)          # out of place leaves x alone


def test_large_tensor_in_place_async_and_torch(pycoll_world, path):
    rank, size = pycoll.rank(), pycoll.size()
    ranks = list(range(size))[::-1]                  # any order names the same group
    x = torch.arange(300_001, dtype=torch.float32) * (rank + 1)     # 5 chunks a block at 1 rank
    assert pycoll.partial_allreduce_(x, ranks, op=pycoll.Sum) is x
    torch.testing.assert_close(x, torch.arange(300_001, dtype=torch.float32) * (size * (size + 1) / 2))
    work = pycoll.partial_allreduce_async(torch.full((3,), float(rank)), ranks)
    torch.testing.assert_close(work.wait(timeout=60), torch.full((3,), (size - 1) / 2))


@pytest.mark.parametrize("cuda_aware", [False, True])
def test_gpu_memory_is_staged_for_the_ring(settings, pycoll_world, path, monkeypatch, cuda_aware):
    """The ring reduces with the CPU kernels, so GPU memory goes through host memory even
    when the MPI is CUDA-aware."""
    settings(cuda_aware_mpi=cuda_aware)
    copies = fakegpu.CountingStager()
    monkeypatch.setattr(pycoll.tensors, "stager", copies)
    rank, ranks = pycoll.rank(), tuple(range(pycoll.size()))
    x = make(rank_input("float32", (7, 3), rank, "Average"), "float32", "fake_cuda")
    y = pycoll.partial_allreduce(x, ranks, op=pycoll.Average)
    assert_matches(y, expected("float32", (7, 3), ranks, "Average"), "float32")
    assert (copies.calls > 0) == (len(ranks) > 1)      # a group of one moves nothing


def test_disjoint_groups_run_at_the_same_time(pycoll_world, path):
    """Pairs (0,1), (2,3), ... each reduce at once, repeatedly, while other pairs do too."""
    rank, size = pycoll.rank(), pycoll.size()
    pair = [r for r in (rank - rank % 2, rank - rank % 2 + 1) if r < size]
    works = [pycoll.partial_allreduce_async(np.full(1000, rank * 10 + i, np.float64), pair,
                                            op=pycoll.Sum) for i in range(20)]
    for i, work in enumerate(works):
        np.testing.assert_array_equal(work.wait(timeout=60), sum(r * 10 + i for r in pair))


def test_bad_input_says_what_to_do(pycoll_world):
    rank, size = pycoll.rank(), pycoll.size()
    x = np.ones(4, np.float32)
    with pytest.raises(ValueError, match="distinct ranks"):
        pycoll.partial_allreduce(x, [rank, rank])
    with pytest.raises(ValueError, match="distinct ranks"):
        pycoll.partial_allreduce(x, [rank, size])
    if size > 1:
        with pytest.raises(ValueError, match="not in ranks"):
            pycoll.partial_allreduce(x, [r for r in range(size) if r != rank])
    with pytest.raises(TypeError, match="sequence of world ranks"):
        pycoll.partial_allreduce(x, "abc")
    with pytest.raises(ValueError, match="unknown reduction"):
        pycoll.partial_allreduce(x, [rank], op="mean")


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("check", [False, True], ids=["default", "checked"])
def test_ops_the_route_refuses_raise_and_the_pair_goes_on(settings, pycoll_world, check):
    """The compiled entry routes (op, dtype) through the short path's table, shared with
    the collectives: no op, an unknown one and Average of ints raise on both members as
    the general path says, and the pair's next round still matches."""
    settings(check=check, partial_cache_after=0)
    if pycoll.rank() > 1:
        return                                            # the group is ranks 0 and 1
    for op in (None, "mean"):
        with pytest.raises(ValueError, match="unknown reduction"):
            pycoll.partial_allreduce(np.ones(4, np.float32), [0, 1], op=op)
    with pytest.raises(TypeError, match="Average"):
        pycoll.partial_allreduce(np.ones(4, np.int32), [0, 1], op=pycoll.Average)
    np.testing.assert_array_equal(pycoll.partial_allreduce(np.ones(4, np.int32), [1, 0], op="max"), 1)
    np.testing.assert_array_equal(pycoll.partial_allreduce(np.ones(4, np.float32), [0, 1], op=pycoll.Sum),
                                  2)


@pytest.mark.mpi(min_size=2)
def test_mismatched_members_raise_on_every_member(settings, pycoll_world, path, monkeypatch):
    settings(check=True)
    rank = pycoll.rank()
    if rank > 1:
        return                                            # the group is ranks 0 and 1
    x = np.ones(4 + rank, np.float32)                     # rank 1 passes one more element
    with pytest.raises(pycoll.CollectiveMismatch, match="passed different tensors or ops"):
        pycoll.partial_allreduce(x, [0, 1], name="mismatched")
    np.testing.assert_array_equal(pycoll.partial_allreduce(np.ones(3), [0, 1], op=pycoll.Sum),
                                  2)                      # the pair is still usable


@pytest.mark.parametrize("direct_bytes", [0, 1 << 30], ids=["ring", "direct"])
def test_both_paths_give_every_member_the_same_bits(settings, pycoll_world, direct_bytes):
    """The ring (every size) and the direct exchange (every size): results close to numpy
    and identical, bit for bit, on every member of a group; GPU memory staged."""
    from mpi4py import MPI
    settings(partial_direct_bytes=direct_bytes, partial_cache_after=0)
    rank = pycoll.rank()
    rng = np.random.default_rng(rank)
    for ranks in subsets(pycoll.size()):
        for n, dtype, op in [(1, "float64", "Average"), (1001, "float32", "Sum"),
                             (3000, "float16", "Max"), (70_000, "int32", "Product")]:
            x = (rng.standard_normal(n) * 10).astype(np_dtype(dtype))
            y = pycoll.partial_allreduce(x, ranks, op=getattr(pycoll, op)) if rank in ranks else None
            mine = x if y is None else y
            xs, ys = zip(*MPI.COMM_WORLD.allgather((x, y)))
            assert all(ys[r].tobytes() == ys[ranks[0]].tobytes() for r in ranks)
            if y is not None:
                stack = np.stack([xs[r] for r in ranks])
                # Integer sums and products wrap in their own dtype, as MPI's do (numpy
                # would widen int32 to int64: 8 members' product overflows int32).
                integer = stack.dtype.kind in "iu" and op in ("Sum", "Product")
                wrap = {"dtype": stack.dtype} if integer else {}
                want = {"Average": np.mean, "Sum": np.sum, "Max": np.max,
                        "Product": np.prod}[op](stack, 0, **wrap)
                tol = {"float16": 1e-3, "float32": 1e-5}.get(dtype, 1e-12)    # relative to
                np.testing.assert_allclose(mine.astype(np.float64),           # |x| ~ 10 k
                                           want.astype(np.float64), rtol=tol, atol=tol * 40)
    copies = fakegpu.CountingStager()
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(pycoll.tensors, "stager", copies)
        ranks = tuple(range(pycoll.size()))
        x = make(rank_input("float32", (301,), rank, "Sum"), "float32", "fake_cuda")
        y = pycoll.partial_allreduce(x, ranks, op=pycoll.Sum)
        assert_matches(y, expected("float32", (301,), ranks, "Sum"), "float32")
        assert (copies.calls > 0) == (len(ranks) > 1)


def test_pair_tags_agree_and_never_repeat_between_two_ranks():
    """3,000 random groups of 2-6 of 40 ranks, issued in one global order: both ends of
    every pair compute the same tag for a round, and a pair's rounds never share a tag
    (until the tag range wraps)."""
    rng = np.random.default_rng(0)
    for tag_ub, rounds in [(2**31 - 1, 3000), (3, 2000)]:
        shared = {r: partial.Counter() for r in range(40)}
        seen = {}                                   # (a, b) -> tags of their rounds, in order
        for _ in range(rounds):
            group = tuple(sorted(rng.choice(40, int(rng.integers(2, 7)), replace=False).tolist()))
            tags = {me: partial.pair_tags(shared[me], group, me, tag_ub) for me in group}
            for i, a in enumerate(group):
                for j, b in enumerate(group):
                    if a < b:
                        assert tags[a][j] == tags[b][i]
                        seen.setdefault((a, b), []).append(tags[a][j])
        for pair, used in seen.items():
            assert used == [n % (tag_ub + 1) for n in range(len(used))], pair
            assert all(0 <= t <= tag_ub for t in used)
        assert max(len(used) for used in seen.values()) > tag_ub + 1 or tag_ub > 2**30


@pytest.mark.parametrize("check", [False, True], ids=["default", "checked"])
def test_small_messages_every_group_in_place_and_out(settings, pycoll_world, check):
    """The small-message path (the direct exchange) as users run it (PYCOLL_CHECK=0) and
    checked: groups that change every call, never cached, numpy and torch, in place and
    out of place, each round's values its own (a message taken by the wrong round shows)."""
    settings(check=check, partial_cache_after=0)
    rank = pycoll.rank()
    for r in range(2):
        for i, ranks in enumerate(subsets(pycoll.size())):
            if rank not in ranks:
                continue
            for n in (1, 1024):
                base = float(r * 100 + i)
                x = np.full(n, base + rank, np.float32)
                want = sum(base + m for m in ranks)
                y = pycoll.partial_allreduce(x, list(ranks), op=pycoll.Sum)
                np.testing.assert_array_equal(y, want)
                np.testing.assert_array_equal(x, base + rank)          # out of place
                t = torch.full((n,), base + rank, dtype=torch.float64)
                assert pycoll.partial_allreduce_(t, ranks, op=pycoll.Average) is t
                torch.testing.assert_close(t, torch.full((n,), want / len(ranks),
                                                         dtype=torch.float64))


def test_tags_stay_unique_across_many_random_groups(settings, pycoll_world):
    """300 random groups of 2 to all ranks, the same list on every rank (as a group
    generator hands them out), small and ring-sized tensors, each round's values its own:
    every result is exact, and each pair of ranks has counted the same rounds on both
    ends (the tags of the next round agree)."""
    from mpi4py import MPI
    settings(partial_cache_after=0, partial_direct_bytes=1024, chunk_bytes=4096)  # ring: chunks
    rank, size = pycoll.rank(), pycoll.size()
    rng = np.random.default_rng(24)
    state = partial._state()
    before = dict(state.shared)
    rounds_with = partial.Counter()
    for r in range(300):
        k = int(rng.integers(min(2, size), size + 1))
        group = sorted(rng.choice(size, k, replace=False).tolist())
        n = int(rng.choice([1, 7, 3000]))                  # direct, direct, ring
        if rank not in group:
            continue
        x = np.full(n, r * 16.0 + rank)
        y = pycoll.partial_allreduce_(x, group, op=pycoll.Sum)
        np.testing.assert_array_equal(y, sum(r * 16.0 + m for m in group))
        rounds_with.update(m for m in group if m != rank)
    counted = {m: state.shared[m] - before.get(m, 0) for m in range(size) if m != rank}
    assert counted == {m: rounds_with[m] for m in counted}
    everyone = MPI.COMM_WORLD.allgather({m: state.shared[m] for m in range(size)})
    for a in range(size):
        for b in range(size):
            if a != b:
                assert everyone[a][b] == everyone[b][a], (a, b)


def test_one_piece_size_for_partial_rings_and_ps_payloads(settings):
    """tensors.pieces: every byte once, whole elements, at most PYCOLL_CHUNK_BYTES (at least
    one element); the parameter server's payload messages follow the same knob."""
    from pycoll import tensors
    from pycoll.ps import wire
    for nbytes, itemsize, limit in [(0, 4, 8), (10, 2, 4), (4000, 8, 1000), (12, 4, 3)]:
        cut = tensors.pieces(nbytes, itemsize, limit)
        assert [o for o, _ in cut] == list(itertools.accumulate([0] + [n for _, n in cut[:-1]]))
        assert sum(n for _, n in cut) == nbytes
        assert all(n % itemsize == 0 and n <= max(limit, itemsize) for _, n in cut)
    settings(chunk_bytes=1000)
    assert tensors.pieces(4000, 8) == tensors.pieces(4000, 8, 1000)
    assert tensors.piece_bytes(8) == 1000 and tensors.piece_bytes(3) == 999
    keys, items = [5000, 12, 3000], [4, 2, 8]
    assert wire.pieces(keys, items) == wire.pieces(keys, items, limit=1000)
    assert max(sum(hi - lo for _, lo, hi in m) for m in wire.pieces(keys, items)) == 1000


ALGORITHMS = {                               # settings that make each exchange take the call
    "direct": dict(partial_direct_bytes=1 << 20, partial_doubling_from=1 << 20),
    "doubling": dict(partial_direct_bytes=1 << 20, partial_doubling_from=2),
    "ring": dict(partial_direct_bytes=0, chunk_bytes=64),
}


@pytest.mark.parametrize("check", [False, True], ids=["default", "checked"])
@pytest.mark.parametrize("algorithm", list(ALGORITHMS))
def test_every_small_message_algorithm_vs_numpy(settings, pycoll_world, monkeypatch, algorithm,
                                                check):
    """Each exchange the size and group choose (direct, recursive doubling with and without
    members past a power of two, ring) on every subset, odd sizes included: results match
    numpy and are the same bits on every member. Unchecked, every blocking call on host
    memory of a group of two or more is the compiled entry's (the Python planner is never
    reached); checked, none is."""
    from mpi4py import MPI
    settings(check=check, partial_cache_after=0, **ALGORITHMS[algorithm])
    planned = []
    real_plan = partial._plan
    monkeypatch.setattr(partial, "_plan", lambda *a, **k: planned.append(1) or real_plan(*a, **k))
    rank = pycoll.rank()
    rng = np.random.default_rng(rank)
    calls = {True: 0, False: 0}                 # by whether the compiled entry may take them
    for ranks in subsets(pycoll.size()):
        for n, dtype, op in [(1, "float64", "Average"), (5, "float32", "Sum"),
                             (333, "float32", "Max"), (17, "int32", "Product"),
                             (64, "float16", "Min")]:
            x = (rng.standard_normal(n) * 4).astype(np_dtype(dtype))
            y = None
            if rank in ranks:
                t = torch.from_numpy(x.copy())
                y = pycoll.partial_allreduce(x, list(ranks), op=getattr(pycoll, op))
                assert pycoll.partial_allreduce_(t, ranks, op=getattr(pycoll, op)) is t
                np.testing.assert_array_equal(t.numpy(), y)       # torch in place, same bits
                calls[len(ranks) > 1 and not check] += 2
            xs, ys = zip(*MPI.COMM_WORLD.allgather((x, y)))
            assert all(ys[r].tobytes() == ys[ranks[0]].tobytes() for r in ranks)
            if y is not None:
                want = {"Average": np.mean, "Sum": np.sum, "Max": np.max, "Min": np.min,
                        "Product": np.prod}[op](np.stack([xs[r] for r in ranks]).astype(
                            np.float64 if dtype.startswith("float") else x.dtype), 0)
                tol = {"float16": 1e-3, "float32": 1e-5}.get(dtype, 1e-12)
                np.testing.assert_allclose(y.astype(np.float64), want.astype(np.float64),
                                           rtol=tol, atol=tol * 16)
    assert len(planned) == calls[False] and (calls[True] > 0) == (not check and pycoll.size() > 1)


def test_tags_stay_unique_when_both_paths_and_cached_groups_mix(settings, pycoll_world):
    """150 random groups (the same list on every rank), each round taken by the compiled
    entry (blocking numpy), the general path (async, torch) or a group's cached
    communicator (from its 3rd use), in any mix across members: every result is exact, and
    every pair of ranks has counted the same rounds on both ends."""
    from mpi4py import MPI
    settings(partial_cache_after=3, partial_direct_bytes=256, partial_doubling_from=3,
             chunk_bytes=1024)
    rank, size = pycoll.rank(), pycoll.size()
    rng = np.random.default_rng(7)
    state = partial._state()
    for r in range(150):
        k = int(rng.integers(min(2, size), size + 1))
        group = sorted(rng.choice(size, k, replace=False).tolist())
        n = int(rng.choice([1, 50, 700]))               # direct / doubling, and the ring
        how = rng.integers(0, 2, size)                  # each member's own path
        if rank not in group:
            continue
        want = sum(r * 16.0 + m for m in group)
        if how[rank]:
            x = np.full(n, r * 16.0 + rank)
            np.testing.assert_array_equal(pycoll.partial_allreduce_(x, group, op=pycoll.Sum), want)
        else:
            work = pycoll.partial_allreduce_async(torch.full((n,), r * 16.0 + rank,
                                                             dtype=torch.float64), group,
                                                  op=pycoll.Sum)
            torch.testing.assert_close(work.wait(timeout=60),
                                       torch.full((n,), want, dtype=torch.float64))
    everyone = MPI.COMM_WORLD.allgather({m: state.shared[m] for m in range(size)})
    for a in range(size):
        for b in range(size):
            if a != b:
                assert everyone[a][b] == everyone[b][a], (a, b)


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("count, kind", [(64, "direct"), (4096, "allreduce")])
def test_the_compiled_entry_runs_under_a_link_and_costs_its_model(settings, pycoll_world, count,
                                                                    kind):
    """Default configuration (no checks): under --link a blocking partial all-reduce is
    still one compiled call (``_C.partial_now`` runs it rather than stepping aside), paced
    between the emulation's enter and leave: it costs at least its model's time and gives
    the result it gives without a link."""
    import time
    from mpi4py import MPI
    from pycoll import _C, emulation
    latency, bandwidth = 2e-3, 100e6
    settings(check=False, partial_cache_after=0, partial_direct_bytes=1024,
             link=f"{latency * 1e3:g}ms,{bandwidth / 1e6:g}MB/s")
    n, rank = pycoll.size(), pycoll.rank()
    ranks = list(range(max(2, n - 1)))              # at 3 ranks and more, one sits out
    x = np.full(count, rank + 1.0, np.float32)
    partial._state()                                # bound as by a first call
    MPI.COMM_WORLD.Barrier()
    if rank not in ranks:
        return
    start = time.monotonic()
    y = _C.partial_now(x, False, ranks, pycoll.Sum, None)
    took = time.monotonic() - start
    assert y is not None, "the compiled entry stepped aside under a link"
    cost = emulation.collective_time(kind, len(ranks), x.nbytes, latency, bandwidth)
    assert took >= cost * 0.99, (took, cost)
    settings(link=None)
    np.testing.assert_array_equal(y, pycoll.partial_allreduce(x, ranks, op=pycoll.Sum))
    np.testing.assert_array_equal(y, sum(m + 1.0 for m in ranks))
