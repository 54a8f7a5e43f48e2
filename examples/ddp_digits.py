"""DistributedDataParallel on the "pycoll" torch.distributed backend: digits MLP.

    pycollrun -np 4 python examples/ddp_digits.py
    pycollrun -np 4 python examples/ddp_digits.py --backend gloo      # the same on gloo
    pycollrun -np 4 python examples/ddp_digits.py --synthetic         # throughput benchmark

``import pycoll.torch`` registers the backend and the ``pycoll://`` rendezvous (over MPI,
for any backend), so ``init_process_group`` needs no set-up under pycollrun. Each rank
takes its share of every global batch; DDP averages the gradients, so any number of
ranks trains the same model as one process. ``--synthetic`` trains a wider MLP on
random data and prints samples per second.
"""
import argparse
import time

import torch
from torch.nn.functional import cross_entropy
import torch.distributed as dist

import pycoll.torch  # noqa: F401  (registers the "pycoll" backend)
from digits import accuracy, load, mlp


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--backend", default="pycoll")
    parser.add_argument("--epochs", type=int, default=20)
    parser.add_argument("--batch-size", type=int, default=64, help="global batch size")
    parser.add_argument("--lr", type=float, default=0.2)
    parser.add_argument("--synthetic", action="store_true",
                        help="random data, wider model: print training throughput")
    parser.add_argument("--hidden", type=int, default=None,
                        help="hidden units (default 64, or 8192 with --synthetic)")
    parser.add_argument("--steps", type=int, default=50, help="steps timed with --synthetic")
    args = parser.parse_args()

    dist.init_process_group(args.backend, init_method="pycoll://")
    torch.set_num_threads(1)                          # ranks share the cores
    rank, size = dist.get_rank(), dist.get_world_size()
    model = mlp(seed=0, hidden=args.hidden or (8192 if args.synthetic else 64))
    ddp = torch.nn.parallel.DistributedDataParallel(model)   # broadcasts rank 0's weights
    optimizer = torch.optim.SGD(ddp.parameters(), lr=args.lr, momentum=0.9)
    loss_fn = torch.nn.CrossEntropyLoss()
    if args.synthetic:
        throughput(ddp, optimizer, loss_fn, args, rank, size)
    else:
        train(ddp, model, optimizer, loss_fn, args, rank, size)
    dist.destroy_process_group()


def train(ddp, model, optimizer, loss_fn, args, rank, size):
    data = load()
    for epoch in range(1, args.epochs + 1):
        order = torch.randperm(len(data.x_train), generator=torch.Generator().manual_seed(epoch))
        loss_sum = torch.zeros(1, dtype=torch.float64)
        for start in range(0, len(order), args.batch_size):
            batch = order[start:start + args.batch_size]
            mine = batch[rank::size]
            optimizer.zero_grad()
            loss = cross_entropy(ddp(data.x_train[mine]), data.y_train[mine],
                                 reduction="sum")
            # the gradients are averaged over ranks: scale so that their average is the
            # gradient of the mean loss over the global batch, even when shards differ
            (loss * size / len(batch)).backward()
            optimizer.step()
            loss_sum += loss.item()
        dist.all_reduce(loss_sum)
        if rank == 0:
            print(f"epoch {epoch:3d}  loss {loss_sum.item() / len(order):.4f}  "
                  f"test accuracy {100 * accuracy(model, data):.2f}%", flush=True)
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    everyone = [torch.empty_like(flat) for _ in range(size)]
    dist.all_gather(everyone, flat)
    if rank == 0:
        identical = all(torch.equal(flat, other) for other in everyone)
        print(f"replicas identical on all {size} ranks: {'yes' if identical else 'NO'}")


def throughput(ddp, optimizer, loss_fn, args, rank, size):
    x = torch.randn(args.batch_size, 64)
    y = torch.randint(0, 10, (args.batch_size,))

    def step():
        optimizer.zero_grad()
        loss_fn(ddp(x), y).backward()
        optimizer.step()
    for _ in range(3):
        step()
    dist.barrier()
    start = time.perf_counter()
    for _ in range(args.steps):
        step()
    elapsed = torch.tensor([time.perf_counter() - start])
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
    if rank == 0:
        params = sum(p.numel() for p in ddp.parameters())
        print(f"{args.backend}: {size} ranks, {params / 1e6:.2f} M params, {args.batch_size} "
              f"samples/rank/step: {1e3 * elapsed.item() / args.steps:.2f} ms/step, "
              f"{args.steps * args.batch_size * size / elapsed.item():.0f} samples/s")


if __name__ == "__main__":
    main()
