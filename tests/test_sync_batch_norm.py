"""hvd.SyncBatchNorm against torch's BatchNorm on every rank's batch together, at any rank count."""
import pytest

torch = pytest.importorskip("torch")

import pycoll.torch as hvd  # noqa: E402

pytestmark = [pytest.mark.mpi, pytest.mark.timeout(120)]


@pytest.fixture(scope="module", autouse=True)
def started():
    hvd.init()


def batches(sizes, shape, seed=0, dtype=torch.float32):
    """One batch per rank (dim 0 of ``sizes[r]``), the same on every rank."""
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(b, *shape, generator=g) * 3 + 1).to(dtype) for b in sizes]


def both(bn_class, **kw):
    """A SyncBatchNorm and the torch BatchNorm it must match, with the same parameters."""
    sync, reference = hvd.SyncBatchNorm(**kw), bn_class(**kw)
    if reference.affine:
        with torch.no_grad():
            for p in (*sync.parameters(), *reference.parameters()):
                p.copy_(torch.linspace(0.5, 2.0, p.numel()))
    return sync, reference


def forward_backward(module, x, w):
    """Output and gradients of the loss ``(module(x) * w).sum()``."""
    x = x.clone().requires_grad_()
    out = module(x)
    (out * w).sum().backward()
    grads = [p.grad.clone() for p in module.parameters()]
    return out.detach(), x.grad, grads


def split_sizes(n):
    """Uneven batches; from 3 ranks one rank has none."""
    return [0 if (n > 2 and r == 1) else r + 2 for r in range(n)]


@pytest.mark.parametrize("bn_class, shape", [(torch.nn.BatchNorm1d, (4,)),
                                             (torch.nn.BatchNorm1d, (4, 3)),
                                             (torch.nn.BatchNorm2d, (3, 2, 5)),
                                             (torch.nn.BatchNorm3d, (2, 2, 2, 3))])
@pytest.mark.parametrize("affine", [True, False])
def test_training_matches_one_batchnorm_over_all_batches(bn_class, shape, affine):
    check_against_batchnorm(bn_class, shape, affine, "cpu")


def check_against_batchnorm(bn_class, shape, affine, device):
    r, n = hvd.rank(), hvd.size()
    sync, reference = (m.to(device) for m in both(bn_class, num_features=shape[0], affine=affine))
    for step in range(2):
        xs = [x.to(device) for x in batches(split_sizes(n), shape, seed=step)]
        start, end = sum(len(x) for x in xs[:r]), sum(len(x) for x in xs[:r + 1])
        w = batches([sum(map(len, xs))], shape, seed=10 + step)[0].to(device)
        out, grad_in, grads = forward_backward(sync, xs[r], w[start:end])
        ref_out, ref_grad_in, ref_grads = forward_backward(reference, torch.cat(xs), w)
        torch.testing.assert_close(out, ref_out[start:end], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(grad_in, ref_grad_in[start:end],
                                   rtol=1e-4, atol=1e-5)
        for grad, ref in zip(grads, ref_grads):   # this rank's share; summed, the whole
            torch.testing.assert_close(hvd.allreduce(grad, op=hvd.Sum), ref, rtol=1e-4, atol=1e-4)
        for p in (*sync.parameters(), *reference.parameters()):
            p.grad = None
    torch.testing.assert_close(sync.running_mean, reference.running_mean)
    torch.testing.assert_close(sync.running_var, reference.running_var)
    assert int(sync.num_batches_tracked) == 2
    sync.eval()
    reference.eval()
    x = batches([3], shape, seed=9)[0].to(device)
    torch.testing.assert_close(sync(x), reference(x))          # running statistics, locally


@pytest.mark.parametrize("options", [{"momentum": None}, {"track_running_stats": False}],
                         ids=["cumulative", "no running stats"])
def test_momentum_none_and_no_running_stats(options):
    r, n = hvd.rank(), hvd.size()
    sync, reference = both(torch.nn.BatchNorm1d, num_features=3, **options)
    for step, training in enumerate([True, True, False]):
        sync.train(training)
        reference.train(training)
        xs = batches([2] * n, (3,), seed=step)
        with torch.no_grad():
            torch.testing.assert_close(sync(xs[r]), reference(torch.cat(xs))[2 * r:2 * r + 2],
                                       rtol=1e-5, atol=1e-5)
    if reference.track_running_stats:
        torch.testing.assert_close(sync.running_var, reference.running_var)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64])
def test_other_dtypes(dtype):
    r, n = hvd.rank(), hvd.size()
    sync = hvd.SyncBatchNorm(4, dtype=torch.float64 if dtype == torch.float64 else None)
    reference = torch.nn.BatchNorm1d(4, dtype=torch.float64)
    xs = batches([3] * n, (4,), dtype=dtype)
    x = xs[r].clone().requires_grad_()
    out = sync(x)
    out.sum().backward()
    assert out.dtype == x.grad.dtype == dtype
    expected = reference(torch.cat(xs).double())[3 * r:3 * r + 3]
    tolerance = {torch.float16: 1e-2, torch.bfloat16: 5e-2, torch.float64: 1e-7}[dtype]
    torch.testing.assert_close(out.double(), expected, rtol=tolerance, atol=tolerance)


def test_distributed_optimizer_trains_as_one_process_on_the_whole_batch():
    r, n = hvd.rank(), hvd.size()

    def model(norm):
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Conv2d(2, 4, 3), norm(4), torch.nn.ReLU(),
                                   torch.nn.Flatten(), torch.nn.Linear(16, 1))

    distributed = model(hvd.SyncBatchNorm)
    optimizer = hvd.DistributedOptimizer(torch.optim.SGD(distributed.parameters(), lr=0.1),
                                         named_parameters=distributed.named_parameters())
    reference = model(torch.nn.BatchNorm2d)
    reference_optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
    for step in range(3):
        xs = batches([2] * n, (2, 4, 4), seed=step)
        optimizer.zero_grad()
        distributed(xs[r]).square().mean().backward()
        optimizer.step()
        reference_optimizer.zero_grad()
        reference(torch.cat(xs)).square().mean().backward()
        reference_optimizer.step()
    for p, q in zip(distributed.state_dict().values(), reference.state_dict().values()):
        torch.testing.assert_close(p, q, rtol=1e-4, atol=1e-5)


def test_convert_sync_batchnorm_keeps_parameters_and_statistics():
    net = torch.nn.Sequential(torch.nn.Conv2d(2, 3, 1), torch.nn.BatchNorm2d(3),
                              torch.nn.Sequential(torch.nn.BatchNorm1d(5, affine=False)))
    net[1].running_mean.fill_(2.0)
    net.eval()
    converted = hvd.SyncBatchNorm.convert_sync_batchnorm(net)
    assert isinstance(converted[1], hvd.SyncBatchNorm)
    assert isinstance(converted[2][0], hvd.SyncBatchNorm) and converted[2][0].weight is None
    assert converted[1].weight is net[1].weight
    assert torch.equal(converted[1].running_mean, torch.full((3,), 2.0))
    assert not converted[1].training
    assert isinstance(converted[0], torch.nn.Conv2d)


def test_bad_input_is_refused_on_every_rank():
    with pytest.raises(ValueError, match="at least 2 dims"):
        hvd.SyncBatchNorm(3)(torch.ones(3))
    if hvd.size() > 1:            # torch's BatchNorm refuses one value per channel too
        one = torch.ones(1, 3) if hvd.rank() == 0 else torch.ones(0, 3)
        with pytest.raises(ValueError, match="more than 1 value per channel"):
            hvd.SyncBatchNorm(3)(one)
