"""Collectives, DistributedOptimizer and DDP on real CUDA tensors (torch), at any rank
count; skipped where torch sees no GPU. Ranks share the GPUs round-robin by local rank.

The same expectations as the CPU tests (whose helpers these reuse): every rank builds
every rank's input, results are exact or within float tolerance, training keeps the
replicas bit-identical and equal to one process on the whole batch.
"""
import numpy as np
import pytest

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")

import pycoll  # noqa: E402
import pycoll.torch as hvd  # noqa: E402
import test_sync_batch_norm  # noqa: E402
import test_torch_api  # noqa: E402
import test_torch_backend  # noqa: E402
from test_collectives import OPS, assert_matches, expected_reduce, rank_input  # noqa: E402

pytestmark = [pytest.mark.mpi, pytest.mark.timeout(300),
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

DTYPES = ["float16", "bfloat16", "float32", "float64", "int32", "int64", "uint8"]


@pytest.fixture(scope="module", autouse=True)
def gpu(pycoll_world):
    torch.cuda.set_device(pycoll.local_rank() % torch.cuda.device_count())
    return torch.device("cuda", torch.cuda.current_device())


def cuda(values: np.ndarray, dtype: str) -> torch.Tensor:
    return torch.from_numpy(values.astype(np.float64)).to(getattr(torch, dtype)).cuda()


def host(t: torch.Tensor) -> torch.Tensor:
    assert t.is_cuda
    return t.cpu()


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(0,), (7,), (33, 5)])
def test_allreduce(group, dtype, op, shape):
    arg, rank, size = group
    x = cuda(rank_input(dtype, shape, rank, op), dtype)
    if op == "Average" and dtype.startswith(("int", "uint")):
        with pytest.raises(TypeError, match="Average"):
            pycoll.allreduce(x, op=getattr(pycoll, op), group=arg)
        return
    expected = expected_reduce(dtype, shape, size, op)
    before = x.clone()
    assert_matches(host(pycoll.allreduce(x, op=getattr(pycoll, op), group=arg)), expected, dtype)
    assert torch.equal(x, before)
    pycoll.allreduce_async_(x, op=getattr(pycoll, op), group=arg).wait()
    assert_matches(host(x), expected, dtype)


def test_wide_unsigned_and_float8_gpu_tensors(group):
    """uint32/64 reduced and float8 moved from GPU memory, as on the host (the staging
    path; the CUDA kernels' unsigned reductions where they run); float8 is not reduced."""
    arg, rank, size = group
    for dtype in (torch.uint32, torch.uint64):
        top = 2 ** (8 * dtype.itemsize) - 1
        x = torch.tensor([top - rank, rank], dtype=dtype).cuda()
        assert host(pycoll.allreduce(x, op=pycoll.Max, group=arg)).tolist() == [top, size - 1]
        fused = pycoll.grouped_allreduce([x, x[1:]], op=pycoll.Sum, group=arg)
        assert host(fused[1]).tolist() == [size * (size - 1) // 2]
    def patterns(r):
        return ((torch.arange(2 * size) * 37 + r * 11) % 256).to(torch.uint8)
    for dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        x = patterns(rank).cuda().view(dtype)
        got = pycoll.allgather(x, group=arg)
        assert torch.equal(host(got).view(torch.uint8),
                           torch.cat([patterns(r) for r in range(size)]))
        with pytest.raises(TypeError, match="is not defined.*cast"):
            pycoll.allreduce(x, op=pycoll.Sum, group=arg)


@pytest.mark.parametrize("op", ["Sum", "Average"])
@pytest.mark.parametrize("chunk", [None, 4096], ids=["default-chunk", "4KiB-chunks"])
def test_large_and_fused_allreduces(settings, group, op, chunk, monkeypatch):
    """Tensors above a chunk go through host staging piece by piece; small async ones
    are fused; all in one stream of issue order."""
    arg, rank, size = group
    if chunk:
        settings(chunk_bytes=chunk)
    shapes = [(3,), (5_000_001,), (1, 7), (100_000,), (2,), (70_000, 3)]
    xs = [cuda(rank_input("float32", s, rank, op), "float32") for s in shapes]
    works = [pycoll.allreduce_async_(x, op=getattr(pycoll, op), group=arg) for x in xs]
    for w in works:
        w.wait()
    for x, s in zip(xs, shapes):
        assert_matches(host(x), expected_reduce("float32", s, size, op), "float32")
    ys = pycoll.grouped_allreduce([cuda(rank_input("float32", s, rank, op), "float32")
                                   for s in shapes], op=getattr(pycoll, op), group=arg)
    for y, s in zip(ys, shapes):
        assert_matches(host(y), expected_reduce("float32", s, size, op), "float32")


def test_reads_wait_for_the_kernels_that_write_the_tensor(group):
    """The engine's thread copies a GPU tensor only after the work queued on it before
    the call: here an add queued behind a long sleep on the GPU."""
    arg, rank, size = group
    for _ in range(3):
        x = torch.zeros(1_000_000, device="cuda")
        torch.cuda._sleep(50_000_000)                  # tens of ms of GPU time
        x.add_(rank + 1)
        y = pycoll.allreduce_async(x, op=pycoll.Sum, group=arg).wait()
        assert torch.all(y == size * (size + 1) // 2)


def test_other_collectives(group):
    arg, rank, size = group
    rows = [r % 3 + 1 for r in range(size)]
    x = torch.full((rows[rank], 4), float(rank), device="cuda")
    gathered = pycoll.allgather(x, group=arg)
    assert gathered.is_cuda
    assert torch.equal(host(gathered), torch.cat([torch.full((n, 4), float(r))
                                                  for r, n in enumerate(rows)]))
    b = torch.arange(10, device="cuda", dtype=torch.float64) * (rank + 1)
    assert torch.equal(host(pycoll.broadcast(b, root=size - 1, group=arg)),
                       torch.arange(10, dtype=torch.float64) * size)
    pycoll.broadcast_(b, root=0, group=arg)
    assert torch.equal(host(b), torch.arange(10, dtype=torch.float64))
    full = torch.arange(2 * size + 1, device="cuda", dtype=torch.float32) + rank
    block = pycoll.reduce_scatter(full, op=pycoll.Sum, group=arg)
    everything = sum(torch.arange(2 * size + 1, dtype=torch.float32) + r for r in range(size))
    start = sum(2 + (r < 1) for r in range(rank))
    assert torch.equal(host(block), everything[start:start + block.shape[0]])
    splits = [(rank + r) % 2 + 1 for r in range(size)]
    sent = torch.full((sum(splits), 3), float(rank), device="cuda")
    received, received_splits = pycoll.alltoall(sent, splits=splits, group=arg)
    assert received_splits.tolist() == [(r + rank) % 2 + 1 for r in range(size)]
    assert torch.equal(host(received), torch.cat(
        [torch.full((n, 3), float(r)) for r, n in enumerate(received_splits.tolist())]))


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "after-backward"])
def test_distributed_optimizer_matches_one_process(overlap, monkeypatch):
    monkeypatch.setattr(hvd.api, "overlap_pays", lambda tensor: overlap)
    r, n = hvd.rank(), hvd.size()
    model = test_torch_api._model().cuda()
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    optimizer = hvd.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.3, momentum=0.9),
        named_parameters=model.named_parameters())
    xs, ys = (t.cuda() for t in test_torch_api._batches(n))
    flat = test_torch_api._train(model, optimizer, xs, ys, r, n)
    assert flat.is_cuda
    assert torch.equal(hvd.broadcast(flat, root_rank=0), flat)          # bit-identical
    reference = test_torch_api._model().cuda()
    expected = test_torch_api._train(
        reference, torch.optim.SGD(reference.parameters(), lr=0.3, momentum=0.9), xs, ys, 0, 1)
    torch.testing.assert_close(flat, expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("bn_class, shape", [(torch.nn.BatchNorm1d, (4,)),
                                             (torch.nn.BatchNorm2d, (3, 2, 5))])
def test_sync_batch_norm_matches_one_batchnorm(bn_class, shape):
    test_sync_batch_norm.check_against_batchnorm(bn_class, shape, True, "cuda")


def test_ddp_on_the_pycoll_backend(gpu):
    if not dist.is_initialized():
        dist.init_process_group("pycoll", init_method="pycoll://")
    rank, size = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(100 + rank)                   # DDP must broadcast rank 0's weights
    model = (test_torch_backend._model() if rank == 0 else torch.nn.Sequential(
        torch.nn.Linear(10, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))).cuda()
    ddp = torch.nn.parallel.DistributedDataParallel(model, device_ids=[gpu.index],
                                                    bucket_cap_mb=0.001)   # several buckets
    xs, ys = (t.cuda() for t in test_torch_backend._data(size))
    test_torch_backend._train(ddp, xs, ys, rank, size)
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    everyone = [torch.empty_like(flat) for _ in range(size)]
    dist.all_gather(everyone, flat)
    assert all(torch.equal(flat, other) for other in everyone)          # bit-identical
    reference = test_torch_backend._model().cuda()
    test_torch_backend._train(reference, xs, ys, 0, 1)
    torch.testing.assert_close(flat, torch.cat([p.detach().reshape(-1)
                                                for p in reference.parameters()]),
                               rtol=1e-5, atol=1e-6)


def test_send_recv_of_cuda_tensors(gpu):
    """Point to point on the pycoll backend stages CUDA memory the collectives' way: a
    tensor written by a kernel just before the send arrives whole, in the receiver's."""
    if not dist.is_initialized():
        dist.init_process_group("pycoll", init_method="pycoll://")
    rank, size = dist.get_rank(), dist.get_world_size()
    if size < 2:
        pytest.skip("needs a peer")
    if rank == 0:
        dist.send(torch.arange(1 << 20, dtype=torch.float32, device=gpu) * 2, dst=1)
    elif rank == 1:
        got = torch.zeros(1 << 20, dtype=torch.float32, device=gpu)
        dist.recv(got, src=0)
        assert torch.equal(host(got), torch.arange(1 << 20, dtype=torch.float32) * 2)
    dist.barrier()
