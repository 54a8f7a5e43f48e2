"""Horovod's semantics in pycoll.torch, one test per behaviour Horovod's own suite relies
on: name-matched negotiation (any submission order, the response cache, the stall
inspector), join, sparse allreduce, grouped allgather / reducescatter, Adasum, the
exceptions, build probes, integer arithmetic and process-set rules.

Horovod's ``test/parallel/test_torch.py`` itself is run outside the repository (its
licence and size); README "Differences from Horovod" lists what it shows.
"""
import re
import time

import pytest

torch = pytest.importorskip("torch")

import pycoll  # noqa: E402
import pycoll.torch as hvd  # noqa: E402
from pycoll import negotiation  # noqa: E402

pytestmark = [pytest.mark.mpi, pytest.mark.timeout(120)]


@pytest.fixture(scope="module", autouse=True)
def started():
    hvd.init()


@pytest.fixture(autouse=True)
def names_in_step():
    """Unnamed operations are named by a per-process count, as in Horovod, so a test
    whose ranks issue different numbers of operations (join, a name on one rank only)
    would leave later unnamed names out of step (in Horovod too): after each test the
    ranks align them."""
    yield
    hvd.align_names()


def values(rank, n=6, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(1000 * seed + rank)
    return torch.randint(-5, 6, (n,), generator=g).to(dtype)


def every_rank(**kw):
    return torch.stack([values(r, **kw) for r in range(hvd.size())])


# ---------------------------------------------------------------- negotiation

def test_names_match_across_submission_orders():
    """Each rank submits the same names in its own order (unused parameters, hooks that
    fire differently): all run in one agreed order, every result right."""
    r = hvd.rank()
    names = [f"order.{i}" for i in range(8)]
    order = names[r % len(names):] + names[:r % len(names)]
    if r % 2:
        order.reverse()
    handles = {name: hvd.allreduce_async(values(r, seed=int(name[-1])), name=name, op=hvd.Sum)
               for name in order}
    for name in names:
        torch.testing.assert_close(hvd.synchronize(handles[name]),
                                   every_rank(seed=int(name[-1])).sum(0))


def test_response_cache_repeats_without_new_entries():
    """After the first step the same names hit the cache: no entry is added."""
    def step():
        handles = [hvd.allreduce_async(values(hvd.rank(), seed=i), name=f"cached.{i}",
                                       op=hvd.Sum) for i in range(4)]
        return [hvd.synchronize(h) for h in handles]
    step()
    cache = negotiation.negotiator(hvd.global_process_set.group).cache
    entries = len(cache.bit)
    for _ in range(3):
        for i, out in enumerate(step()):
            torch.testing.assert_close(out, every_rank(seed=i).sum(0))
    assert len(cache.bit) == entries


def _request(name, shape=(3,)):
    return negotiation.Request(name, "allreduce", (("dtype", "float32"), ("shape", shape)),
                               joinable=True)


def test_coordinator_cache_and_stall_inspector(settings):
    """The coordinator alone (no MPI): full requests once, then bits that AND over the
    ranks; a name that only some ranks submit fails after PYCOLL_TIMEOUT, naming the
    ranks without it; different shapes under one name are a mismatch naming both."""
    cache = negotiation._Cache()
    coordinator = negotiation._Coordinator(cache, ranks=(0, 1, 2))
    answer = coordinator.decide([(0, (_request("a"),), False)] * 3)
    (response,) = answer.responses
    assert response.name == "a" and response.error is None
    cache.put(response, _request("a"))
    bit = cache.hit(_request("a"))
    assert bit is not None
    ready = coordinator.decide([(1 << bit, (), False)] * 3)
    assert ready.bits == 1 << bit and not ready.responses

    settings(timeout=0.2)
    waiting = [(1 << bit, (), False), (0, (), False), (1 << bit, (), False)]
    assert not coordinator.decide(waiting).responses
    time.sleep(0.3)
    (failed,) = coordinator.decide(waiting).responses
    assert failed.error[0] == "timeout"
    assert "ranks [0, 2] submitted 'a' but ranks [1] did not" in failed.error[1]

    shapes = [(0, (_request("b", (3,)),), False), (0, (_request("b", (4,)),), False),
              (0, (_request("b", (3,)),), False)]
    (mismatch,) = coordinator.decide(shapes).responses
    assert mismatch.error[0] == "mismatch" and "rank 1: (4,)" in mismatch.error[1]


def test_missing_name_fails_naming_the_ranks(settings):
    """A name submitted on rank 0 only: rank 0's synchronize raises HorovodInternalError
    naming the ranks that lack it; the others go on, and so does the group."""
    if hvd.size() == 1:
        pytest.skip("needs a rank that lacks the name")
    settings(timeout=2.0)
    r = hvd.rank()
    handle = hvd.allreduce_async(torch.ones(2), name="only.on.rank0") if r == 0 else None
    while True:    # every rank keeps cycling until rank 0's name has failed
        done = hvd.allreduce(torch.tensor([float(r == 0 and hvd.poll(handle))]),
                             name="missing.tick", op=hvd.Sum)
        if done.item():
            break
        time.sleep(0.05)
    if r == 0:
        missing = list(range(1, hvd.size()))
        with pytest.raises(hvd.HorovodInternalError, match=re.escape(f"ranks {missing} did not")):
            hvd.synchronize(handle)
    torch.testing.assert_close(hvd.allreduce(torch.ones(2), name="after.missing", op=hvd.Sum),
                               torch.full((2,), float(hvd.size())))


def test_mismatch_raises_on_every_rank_and_group_goes_on():
    r = hvd.rank()
    if hvd.size() == 1:
        pytest.skip("needs two ranks to differ")
    with pytest.raises(hvd.HorovodInternalError, match="different shape"):
        hvd.allreduce(torch.ones(2 + r), name="mismatched.shape")
    with pytest.raises(hvd.HorovodInternalError, match="different dtype"):
        hvd.allreduce(torch.ones(2, dtype=torch.float32 if r else torch.float64),
                      name="mismatched.dtype")
    torch.testing.assert_close(hvd.allreduce(torch.ones(2), name="after.mismatch", op=hvd.Sum),
                               torch.full((2,), float(hvd.size())))


# ---------------------------------------------------------------- join

def test_join_takes_part_with_zeros():
    """Rank r runs r + 1 steps, then joins: joined ranks add zeros (Average still
    divides by every rank), and join returns the last rank to join on every rank."""
    r, n = hvd.rank(), hvd.size()
    for step in range(r + 1):
        out = hvd.allreduce(torch.ones(3), name="join.step", op=hvd.Sum)
        torch.testing.assert_close(out, torch.full((3,), float(n - step)))
        mean = hvd.allreduce(torch.ones(3), name="join.mean", op=hvd.Average)
        torch.testing.assert_close(mean, torch.full((3,), (n - step) / n))
    assert hvd.join() == n - 1
    # Afterwards every rank takes part again.
    torch.testing.assert_close(hvd.allreduce(torch.ones(1), name="join.after", op=hvd.Sum),
                               torch.full((1,), float(n)))


def test_join_refuses_what_cannot_join():
    r, n = hvd.rank(), hvd.size()
    if n == 1:
        pytest.skip("needs a rank that has not joined")
    if r == 0:
        last = hvd.join()
        assert hvd.allgather(torch.tensor([last]), name="join.last").tolist() == [last] * n
        return
    if r == n - 1:
        with pytest.raises(hvd.HorovodInternalError, match="cannot run while ranks \\[0\\]"):
            hvd.broadcast(torch.ones(2), root_rank=n - 1, name="join.broadcast")
    hvd.barrier()  # the others meet here while rank 0 is joined (barrier joins)
    last = hvd.join()
    assert 0 < last < n
    assert hvd.allgather(torch.tensor([last]), name="join.last").tolist() == [last] * n


# ---------------------------------------------------------------- more of the API

def test_sparse_allreduce_equals_dense():
    r, n = hvd.rank(), hvd.size()
    for op in (hvd.Sum, hvd.Average):
        result = hvd.sparse_allreduce_async(_sparse_row(r).to_sparse(), name=f"sparse.{op.value}",
                                            op=op)()
        expected = torch.stack([_sparse_row(k) for k in range(n)]).sum(0)
        torch.testing.assert_close(result.to_dense(), expected / (n if op is hvd.Average else 1))


def _sparse_row(rank):
    dense = torch.zeros(6, 2)
    dense[rank % 6] = rank + 1.0
    dense[(rank + 3) % 6] = 1.0
    return dense


def test_sparse_as_dense_optimizer_matches_dense_training():
    """An embedding with sparse gradients trains under sparse_as_dense as its dense twin."""
    def train(sparse):
        torch.manual_seed(3)
        model = torch.nn.Embedding(10, 4, sparse=sparse)
        opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                       named_parameters=model.named_parameters(),
                                       sparse_as_dense=sparse)
        for step in range(3):
            opt.zero_grad()
            model(torch.tensor([hvd.rank() % 10, step])).sum().backward()
            opt.step()
        return model.weight.detach()
    torch.testing.assert_close(train(True), train(False))


def test_grouped_allgather_and_reducescatter():
    r, n = hvd.rank(), hvd.size()
    rows = [torch.full((k + 1, 2), float(k)) for k in range(n)]
    a, b = hvd.grouped_allgather([rows[r], values(r).reshape(3, 2)], name="gag")
    torch.testing.assert_close(a, torch.cat(rows))
    torch.testing.assert_close(b, every_rank().reshape(n * 3, 2))
    full = [values(r, n=4 * n), values(r, n=2 * n, seed=1)]
    outs = hvd.grouped_reducescatter(full, name="grs", op=hvd.Sum)
    for out, length, seed in zip(outs, (4, 2), (0, 1)):
        total = every_rank(n=length * n, seed=seed).sum(0)
        torch.testing.assert_close(out, total[r * length:(r + 1) * length])


def _adasum_reference(vectors):
    """Horovod's tree: pairs (k, k ^ 2^level) combine, lower rank's vector first."""
    def combine(a, b):
        dot, aa, bb = float(a @ b), float(a @ a), float(b @ b)
        return (1 - dot / (2 * aa)) * a + (1 - dot / (2 * bb)) * b
    level = [v.double() for v in vectors]
    while len(level) > 1:
        level = [combine(level[i], level[i + 1]) for i in range(0, len(level), 2)]
    return level[0]


def test_adasum_is_the_algorithm():
    r, n = hvd.rank(), hvd.size()
    if n & (n - 1):
        with pytest.raises(NotImplementedError, match="power of 2"):
            hvd.allreduce(torch.ones(3), op=hvd.Adasum, name="adasum.refused")
        return
    vectors = [values(k, n=8) + 0.5 for k in range(n)]
    out = hvd.allreduce(vectors[r], op=hvd.Adasum, name="adasum")
    torch.testing.assert_close(out.double(), _adasum_reference(vectors), rtol=1e-6, atol=1e-6)
    if n > 1:   # parallel gradients average, orthogonal ones add
        same = hvd.allreduce(torch.ones(4), op=hvd.Adasum, name="adasum.same")
        torch.testing.assert_close(same, torch.ones(4))


def test_probes_tell_the_truth():
    assert hvd.mpi_built() and hvd.mpi_enabled()
    assert not hvd.gloo_built() and not hvd.gloo_enabled()
    assert hvd.nccl_built() == 0 and not hvd.ccl_built() and not hvd.ddl_built()
    assert not hvd.rocm_built()
    assert hvd.cuda_built() == pycoll.has_cuda()
    assert issubclass(hvd.HorovodInternalError, RuntimeError)


def test_integer_average_truncates_and_scales_in_float64():
    r, n = hvd.rank(), hvd.size()
    x = torch.tensor([r + 1, -(r + 1), 7], dtype=torch.int32)
    total = torch.tensor([n * (n + 1) // 2, -(n * (n + 1) // 2), 7 * n], dtype=torch.int64)
    out = hvd.allreduce(x, op=hvd.Average, name="int.avg")
    assert out.dtype == torch.int32
    assert torch.equal(out, torch.div(total, n, rounding_mode="trunc").to(torch.int32))
    scaled = hvd.allreduce(x, op=hvd.Sum, prescale_factor=1.5, postscale_factor=0.5,
                           name="int.scaled")
    expected = (torch.stack([(torch.tensor([k + 1, -(k + 1), 7]).double() * 1.5)
                             .to(torch.int32) for k in range(n)]).sum(0).double() * 0.5)
    assert torch.equal(scaled, expected.to(torch.int32))
    for dtype in (torch.uint16, torch.uint32, torch.uint64):     # torch cannot divide these
        u = torch.tensor([r + 1, 7], dtype=dtype)
        avg = hvd.allreduce(u, op=hvd.Average, name=f"uint.avg.{dtype}")
        assert avg.tolist() == [n * (n + 1) // 2 // n, 7]
        post = hvd.allreduce(u, op=hvd.Average, postscale_factor=2.0, name=f"uint.post.{dtype}")
        scaled = [int(total * (2.0 / n)) for total in (n * (n + 1) // 2, 7 * n)]  # float64
        assert post.dtype == dtype and post.tolist() == scaled


def test_process_set_broadcast_takes_a_world_root():
    r, n = hvd.rank(), hvd.size()
    if n < 2:
        pytest.skip("needs a set smaller than the world")
    ranks = list(range(1, n))
    upper = hvd.add_process_set(ranks)
    try:
        if r in ranks:
            got = hvd.broadcast(torch.full((2,), float(r)), root_rank=n - 1, name="ps.bcast",
                                process_set=upper)
            torch.testing.assert_close(got, torch.full((2,), float(n - 1)))
            with pytest.raises(ValueError, match="root_rank must be a rank of the process set"):
                hvd.broadcast(torch.ones(1), root_rank=0, process_set=upper)
    finally:
        hvd.remove_process_set(upper)


def test_broadcast_optimizer_state_with_frozen_parameter_and_no_names():
    """A parameter without a gradient keeps no state; an optimizer wrapped without
    named_parameters still trains (Horovod names its parameters itself)."""
    torch.manual_seed(hvd.rank())
    model = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.Linear(3, 1))
    model[0].bias.requires_grad_(False)
    opt = torch.optim.Adam(model.parameters(), lr=0.01 * (1 + hvd.rank()))
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(opt, root_rank=0)
    assert opt.param_groups[0]["lr"] == pytest.approx(0.01)
    assert model[0].weight in opt.state and model[0].bias not in opt.state
    dist = hvd.DistributedOptimizer(opt)
    model(torch.ones(2, 3) * hvd.rank()).sum().backward()
    dist.step()
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    gathered = hvd.allgather(flat.unsqueeze(0), name="frozen.params")
    assert all(torch.equal(row, gathered[0]) for row in gathered)
