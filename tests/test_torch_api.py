"""pycoll.torch's Horovod API and DistributedOptimizer, at any rank count."""
import pytest

torch = pytest.importorskip("torch")

import pycoll  # noqa: E402
import pycoll.torch as hvd  # noqa: E402

pytestmark = [pytest.mark.mpi, pytest.mark.timeout(120)]


@pytest.fixture(scope="module", autouse=True)
def started():
    hvd.init()
    torch.manual_seed(0)


def rank_tensor(rank, shape=(5,), dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(100 * seed + rank)
    return torch.randint(1, 4, shape, generator=g).to(dtype)


def stacked(size, **kw):
    return torch.stack([rank_tensor(r, **kw) for r in range(size)])


def test_ranks():
    assert 0 <= hvd.rank() < hvd.size() == pycoll.size()
    assert 0 <= hvd.local_rank() < hvd.local_size() <= hvd.size()
    assert hvd.is_initialized()


@pytest.mark.parametrize("op, reduce", [(hvd.Sum, lambda s: s.sum(0)),
                                        (hvd.Average, lambda s: s.mean(0)),
                                        (hvd.Min, lambda s: s.min(0).values),
                                        (hvd.Max, lambda s: s.max(0).values),
                                        (hvd.Product, lambda s: s.prod(0))])
def test_allreduce_ops(op, reduce):
    r, n = hvd.rank(), hvd.size()
    x = rank_tensor(r)
    torch.testing.assert_close(hvd.allreduce(x, op=op), reduce(stacked(n)))
    assert torch.equal(x, rank_tensor(r))                     # input untouched
    y = rank_tensor(r)
    assert hvd.allreduce_(y, op=op) is y
    torch.testing.assert_close(y, reduce(stacked(n)))


def test_average_flag_and_scale_factors():
    r, n = hvd.rank(), hvd.size()
    total = stacked(n).sum(0)
    torch.testing.assert_close(hvd.allreduce(rank_tensor(r), average=False), total)
    out = hvd.allreduce(rank_tensor(r), op=hvd.Sum, prescale_factor=0.5, postscale_factor=3.0)
    torch.testing.assert_close(out, total * 1.5)
    with pytest.raises(ValueError, match="not both"):
        hvd.allreduce(rank_tensor(r), average=True, op=hvd.Sum)


def test_async_handles_synchronize_and_poll():
    r, n = hvd.rank(), hvd.size()
    xs = [rank_tensor(r, seed=s) for s in range(6)]
    handles = [hvd.allreduce_async_(x, name=f"grad.{i}", op=hvd.Sum) for i, x in enumerate(xs)]
    assert all(isinstance(h, int) for h in handles)
    outs = [hvd.synchronize(h) for h in handles]
    for s, (x, out) in enumerate(zip(xs, outs)):
        assert out is x
        torch.testing.assert_close(x, stacked(n, seed=s).sum(0))
    h = hvd.allreduce_async(rank_tensor(r), op=hvd.Max)
    while not hvd.poll(h):                  # poll sends the pending batch, so this ends
        pass
    torch.testing.assert_close(hvd.synchronize(h), stacked(n).max(0).values)
    for used in (hvd.synchronize, hvd.poll):
        with pytest.raises(ValueError, match="unknown handle"):
            used(h)


def test_reused_pending_name_is_refused():
    """Reusing a name while its operation runs is refused. The last rank submits only
    after the others have tried (an operation finishes once every rank submitted it), so
    the refusal cannot race the completion."""
    r, n = hvd.rank(), hvd.size()
    if n == 1:
        pytest.skip("a lone rank's operation may finish before the second try")
    if r == n - 1:
        pycoll.barrier()
    h = hvd.allreduce_async(rank_tensor(r), name="weights")
    if r != n - 1:
        with pytest.raises(ValueError, match="'weights' is still running"):
            hvd.allreduce_async(rank_tensor(r), name="weights")
        pycoll.barrier()
    hvd.synchronize(h)
    hvd.synchronize(hvd.allreduce_async(rank_tensor(r), name="weights"))   # free again


def test_wrong_root_and_unsupported_dtype_are_refused():
    with pytest.raises(ValueError, match="root_rank must be a rank of the process set"):
        hvd.broadcast(torch.ones(2), root_rank=hvd.size())
    with pytest.raises(ValueError, match="root_rank must be a rank of the process set"):
        hvd.broadcast_object("x", root_rank=-1)
    with pytest.raises(TypeError, match="does not support dtype"):
        hvd.allreduce(torch.ones(2, dtype=torch.complex64))
    with pytest.raises(TypeError, match="does not support dtype"):
        hvd.allgather(torch.ones(2, dtype=torch.float8_e4m3fnuz))
    hvd.barrier()


def test_bool_tensors():
    """bool (a mask, a flag): gathered as bytes; Sum and Max are any rank's True."""
    r, n = hvd.rank(), hvd.size()
    flags = torch.tensor([r == 0, True, False])
    assert torch.equal(hvd.allgather(flags), torch.tensor([[k == 0, True, False] for k in range(n)]).reshape(-1))
    assert hvd.allreduce(flags, op=hvd.Max).tolist() == [True, True, False]
    assert hvd.allreduce(flags, op=hvd.Min).tolist() == [n == 1, True, False]


def test_grouped_allreduce():
    r, n = hvd.rank(), hvd.size()
    xs = [rank_tensor(r, (3,), seed=1), rank_tensor(r, (2, 2), torch.float64, seed=2)]
    outs = hvd.grouped_allreduce(xs, op=hvd.Sum)
    torch.testing.assert_close(outs[0], stacked(n, shape=(3,), seed=1).sum(0))
    torch.testing.assert_close(outs[1], stacked(n, shape=(2, 2), dtype=torch.float64,
                                                seed=2).sum(0))
    ys = [rank_tensor(r, seed=3)]
    assert hvd.grouped_allreduce_(ys, op=hvd.Average)[0] is ys[0]
    torch.testing.assert_close(ys[0], stacked(n, seed=3).mean(0))


def test_allgather_broadcast_alltoall_reducescatter():
    r, n = hvd.rank(), hvd.size()
    gathered = hvd.allgather(torch.full((r + 1, 2), float(r)))        # uneven dim 0
    assert torch.equal(gathered, torch.cat([torch.full((k + 1, 2), float(k)) for k in range(n)]))
    root = n - 1
    assert torch.equal(hvd.broadcast(rank_tensor(r), root_rank=root), rank_tensor(root))
    x = rank_tensor(r)
    hvd.broadcast_(x, root_rank=0)
    assert torch.equal(x, rank_tensor(0))
    # rank r sends d + 1 rows of value 10 r + d to rank d
    send = torch.cat([torch.full((d + 1,), 10. * r + d) for d in range(n)])
    out, received = hvd.alltoall(send, splits=[d + 1 for d in range(n)])
    assert received.tolist() == [r + 1] * n
    assert torch.equal(out, torch.cat([torch.full((r + 1,), 10. * s + r) for s in range(n)]))
    assert hvd.alltoall(torch.arange(2. * n)).shape == (2 * n,)
    mine = hvd.reducescatter(stacked(n, shape=(2 * n, 3)).sum(0) * 0 + rank_tensor(r, (2 * n, 3)),
                             op=hvd.Sum)
    torch.testing.assert_close(mine, stacked(n, shape=(2 * n, 3)).sum(0)[2 * r:2 * r + 2])


def test_allreduce_and_alltoall_are_differentiable():
    r, n = hvd.rank(), hvd.size()
    x = rank_tensor(r).requires_grad_()
    (hvd.allreduce(x, op=hvd.Sum) * (r + 1)).sum().backward()
    torch.testing.assert_close(x.grad, torch.full((5,), n * (n + 1) / 2))
    y = torch.arange(float(n)).requires_grad_()
    out = hvd.alltoall(y)
    (out * (r + 1)).sum().backward()
    torch.testing.assert_close(y.grad, torch.arange(1., n + 1))


def test_objects():
    r, n = hvd.rank(), hvd.size()
    assert hvd.broadcast_object({"a": [r]} if r == 0 else None, root_rank=0) == {"a": [0]}
    assert hvd.allgather_object(("r", r, "x" * r)) == [("r", k, "x" * k) for k in range(n)]


def test_broadcast_parameters_and_optimizer_state():
    r = hvd.rank()
    torch.manual_seed(r)
    model = torch.nn.Linear(4, 3)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01 * (r + 1))
    if r == 0:                                         # only the root has state yet
        model(torch.randn(2, 4)).sum().backward()
        optimizer.step()
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    assert torch.equal(hvd.broadcast(flat, 0), flat)
    assert optimizer.param_groups[0]["lr"] == 0.01
    state = optimizer.state[model.weight]
    assert torch.equal(hvd.broadcast(state["exp_avg"], 0), state["exp_avg"])


def test_compression_round_trip_and_allreduce():
    x = torch.tensor([1.0, -2.5, 3.140625, 65504.0])
    for compression, dtype in ((hvd.Compression.fp16, torch.float16),
                               (hvd.Compression.bf16, torch.bfloat16)):
        compressed, context = compression.compress(x)
        assert compressed.dtype == dtype
        back = compression.decompress(compressed, context)
        assert back.dtype == torch.float32
        torch.testing.assert_close(back, x, rtol=1e-2, atol=0)
        ints, context = compression.compress(torch.ones(2, dtype=torch.int32))
        assert ints.dtype == torch.int32 and context is None
    r, n = hvd.rank(), hvd.size()
    out = hvd.allreduce(rank_tensor(r), op=hvd.Sum, compression=hvd.Compression.bf16)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, stacked(n).sum(0))


def test_process_set():
    r, n = hvd.rank(), hvd.size()
    ranks = list(range(0, n, 2))
    if ranks == list(range(n)):            # the global set's ranks, as in Horovod
        with pytest.raises(ValueError, match="duplicate process set"):
            hvd.add_process_set(ranks)
        return
    evens = hvd.add_process_set(ranks)
    if not evens.included():
        with pytest.raises(ValueError, match="not in ProcessSet"):
            hvd.allreduce(torch.ones(1), process_set=evens)
        return
    assert evens.rank() == ranks.index(r) and evens.size() == len(ranks)
    out = hvd.allreduce(rank_tensor(r), op=hvd.Sum, process_set=evens)
    torch.testing.assert_close(out, torch.stack([rank_tensor(k) for k in ranks]).sum(0))
    hvd.remove_process_set(evens)


def test_init_registers_all_of_its_process_sets_or_none():
    """Horovod's init(process_sets=...): a list with a duplicate (of another entry or of
    the global set) registers none, so the corrected list may follow; a later init binds a
    set over ranks registered already; the communicator init is given is the global set's."""
    from mpi4py import MPI
    r, n = hvd.rank(), hvd.size()
    with pytest.raises(ValueError, match="duplicate"):
        hvd.init(process_sets=[hvd.ProcessSet(range(n - 1, -1, -1))])
    if n == 1:
        return
    first, rest = hvd.ProcessSet([0]), hvd.ProcessSet(reversed(range(1, n)))
    with pytest.raises(ValueError, match="duplicate"):
        hvd.init(process_sets=[first, rest, hvd.ProcessSet([0])])
    assert first.process_set_id is None and rest.process_set_id is None
    hvd.init(comm=MPI.COMM_WORLD, process_sets=[first, rest])
    assert hvd.global_process_set.mpi_comm is MPI.COMM_WORLD
    assert rest.ranks == list(range(1, n)) and rest.size() == n - 1
    again = hvd.ProcessSet(range(1, n))
    hvd.init(process_sets=[again])
    assert again.process_set_id == rest.process_set_id
    if r:
        out = hvd.allreduce(rank_tensor(r), op=hvd.Sum, process_set=again)
        torch.testing.assert_close(out, stacked(n)[1:].sum(0))
    assert hvd.remove_process_set(first) and hvd.remove_process_set(again)
    assert not hvd.remove_process_set(rest)
    hvd.init(process_sets="dynamic")            # Horovod's: none now, added later
    later = hvd.add_process_set([0])
    assert later.ranks == [0] and hvd.remove_process_set(later)


# ---------------------------------------------------------------- DistributedOptimizer

def _model():
    torch.manual_seed(5)
    return torch.nn.Sequential(torch.nn.Linear(6, 12), torch.nn.ReLU(), torch.nn.Linear(12, 12),
                               torch.nn.ReLU(), torch.nn.Linear(12, 3))


def _batches(size, steps=4, per_rank=3):
    g = torch.Generator().manual_seed(11)
    return (torch.randn(steps, per_rank * size, 6, generator=g),
            torch.randint(0, 3, (steps, per_rank * size), generator=g))


def _train(model, optimizer, xs, ys, rank, size, passes=1):
    """Each step: ``passes`` backward passes over halves of this rank's share, loss
    scaled so that the accumulated gradient is that of the mean over the global batch."""
    for x, y in zip(xs, ys):
        optimizer.zero_grad()
        x, y = x[rank::size], y[rank::size]
        for part in range(passes):
            xp, yp = x[part::passes], y[part::passes]
            loss = torch.nn.functional.cross_entropy(model(xp), yp, reduction="sum")
            (loss / len(x)).backward()
        optimizer.step()
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


@pytest.fixture(params=[True, False], ids=["overlap", "after-backward"])
def overlap(request, monkeypatch):
    """Both ways gradients travel: from the hooks while backward runs, and from step()
    (what ranks without a spare core do), whatever this machine's cores say."""
    monkeypatch.setattr(hvd.api, "overlap_pays", lambda tensor: request.param)
    return request.param


def test_overlap_needs_a_spare_core_on_the_cpu(monkeypatch):
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    monkeypatch.setattr(pycoll.runtime.os, "sched_getaffinity", lambda pid: {0, 1, 2})
    assert hvd.api.overlap_pays(torch.ones(2))                  # a core to spare
    monkeypatch.setattr(pycoll.runtime.os, "sched_getaffinity", lambda pid: {0, 1})
    assert not hvd.api.overlap_pays(torch.ones(2))              # bound to 2 cores
    assert hvd.api.overlap_pays(torch.ones(2, device="meta"))   # compute off the CPU


@pytest.mark.parametrize("options", [
    {}, {"groups": 2}, {"backward_passes_per_step": 2}, {"gradient_predivide_factor": 2.0},
    {"bucket": 1}, {"named": True},
], ids=lambda o: ",".join(o) or "default")
def test_distributed_optimizer_matches_one_process(settings, options, overlap, monkeypatch):
    r, n = hvd.rank(), hvd.size()
    options = dict(options)
    if options.pop("bucket", None):
        settings(fusion_threshold=1)   # every grad alone
    model = _model()
    if r:
        with torch.no_grad():                          # broadcast_parameters must fix this
            for p in model.parameters():
                p.add_(r)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    named = model.named_parameters() if options.pop("named", False) else None
    optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.3, momentum=0.9),
                                         named_parameters=named, **options)
    assert isinstance(optimizer, torch.optim.SGD)
    xs, ys = _batches(n)
    flat = _train(model, optimizer, xs, ys, r, n, options.get("backward_passes_per_step", 1))
    assert torch.equal(hvd.broadcast(flat, root_rank=0), flat)          # bit-identical
    reference = _model()
    expected = _train(reference, torch.optim.SGD(reference.parameters(), lr=0.3, momentum=0.9),
                      xs, ys, 0, 1)
    torch.testing.assert_close(flat, expected, rtol=1e-5, atol=1e-6)


def test_distributed_optimizer_errors():
    model = _model()
    named = list(model.named_parameters())
    with pytest.raises(ValueError, match="unique"):
        hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                 named_parameters=[("w", p) for _, p in named])
    with pytest.raises(ValueError, match="not in it"):
        hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                 named_parameters=named[:1])
    with pytest.raises(ValueError, match="not supported with op != Average"):
        hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), op=hvd.Sum,
                                 gradient_predivide_factor=2.0)
    optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    model(torch.randn(2, 6)).sum().backward()
    if hvd.size() > 1:              # at one rank, as in Horovod, no hooks: nothing to check
        with pytest.raises(AssertionError, match="zero_grad"):
            optimizer.zero_grad()
        with pytest.raises(AssertionError, match="backward_passes_per_step"):
            model(torch.randn(2, 6)).sum().backward()
    optimizer.synchronize()
    with optimizer.skip_synchronize():
        optimizer.step()
