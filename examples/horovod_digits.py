"""A Horovod training script on pycoll: digits MLP, ``import pycoll.torch as hvd``.

    pycollrun -np 4 python examples/horovod_digits.py
    pycollrun -np 4 python examples/horovod_digits.py --synthetic   # throughput benchmark

The script is Horovod's usual recipe with only the import changed: broadcast the
initial state from rank 0, wrap the optimizer in ``DistributedOptimizer`` (gradients
are averaged while backward runs), shard the data by rank. Each rank takes its share
of every global batch, so any number of ranks trains the same model as one process.
``--synthetic`` trains a wider MLP on random data and prints samples per second.
"""
import argparse
import time

import torch
from torch.nn.functional import cross_entropy

import pycoll.torch as hvd
from digits import accuracy, load, mlp


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--epochs", type=int, default=20)
    parser.add_argument("--batch-size", type=int, default=64, help="global batch size")
    parser.add_argument("--lr", type=float, default=0.2)
    parser.add_argument("--synthetic", action="store_true",
                        help="random data, wider model: print training throughput")
    parser.add_argument("--hidden", type=int, default=None,
                        help="hidden units (default 64, or 8192 with --synthetic)")
    parser.add_argument("--steps", type=int, default=50, help="steps timed with --synthetic")
    parser.add_argument("--compression", choices=["none", "fp16", "bf16"], default="none")
    args = parser.parse_args()

    hvd.init()
    torch.set_num_threads(1)                          # ranks share the cores
    rank, size = hvd.rank(), hvd.size()
    model = mlp(seed=rank, hidden=args.hidden or (8192 if args.synthetic else 64))
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)   # rank 0's start for all
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters(),
                                         compression=getattr(hvd.Compression, args.compression))
    loss_fn = torch.nn.CrossEntropyLoss()
    if args.synthetic:
        return throughput(model, optimizer, loss_fn, args, rank, size)

    data = load()
    for epoch in range(1, args.epochs + 1):
        order = torch.randperm(len(data.x_train), generator=torch.Generator().manual_seed(epoch))
        loss_sum = torch.zeros(1, dtype=torch.float64)
        for start in range(0, len(order), args.batch_size):
            batch = order[start:start + args.batch_size]
            mine = batch[rank::size]
            optimizer.zero_grad()
            loss = cross_entropy(model(data.x_train[mine]), data.y_train[mine],
                                 reduction="sum")
            # the gradients are averaged over ranks: scale so that their average is the
            # gradient of the mean loss over the global batch, even when shards differ
            (loss * size / len(batch)).backward()
            optimizer.step()
            loss_sum += loss.item()
        loss_total = hvd.allreduce(loss_sum, op=hvd.Sum, name="loss").item()
        if rank == 0:
            print(f"epoch {epoch:3d}  loss {loss_total / len(order):.4f}  "
                  f"test accuracy {100 * accuracy(model, data):.2f}%", flush=True)
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    identical = hvd.allreduce(torch.tensor([int(torch.equal(hvd.broadcast(flat, 0), flat))]),
                              op=hvd.Min).item() == 1
    if rank == 0:
        print(f"replicas identical on all {size} ranks: {'yes' if identical else 'NO'}")


def throughput(model, optimizer, loss_fn, args, rank, size):
    x = torch.randn(args.batch_size, 64)
    y = torch.randint(0, 10, (args.batch_size,))

    def step():
        optimizer.zero_grad()
        loss_fn(model(x), y).backward()
        optimizer.step()
    for _ in range(3):
        step()
    hvd.barrier()
    start = time.perf_counter()
    for _ in range(args.steps):
        step()
    elapsed = hvd.allreduce(torch.tensor([time.perf_counter() - start]), op=hvd.Max).item()
    if rank == 0:
        params = sum(p.numel() for p in model.parameters())
        print(f"{size} ranks, {params / 1e6:.2f} M params, {args.batch_size} samples/rank/step: "
              f"{1e3 * elapsed / args.steps:.2f} ms/step, "
              f"{args.steps * args.batch_size * size / elapsed:.0f} samples/s")


if __name__ == "__main__":
    main()
