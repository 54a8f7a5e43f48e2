"""Data-parallel training of a small MLP on scikit-learn's digits data set, with pycoll.

    pycollrun -np 4 python examples/train_digits.py

Every rank takes its share of each global batch. The loss is summed over the share
and divided by the global batch size, so summing gradients over ranks with one fused
``pycoll.grouped_allreduce_`` gives exactly the gradient one process would compute on
the whole batch: any number of ranks trains the same model.
"""
import argparse

import torch

import pycoll
from digits import accuracy, load, mlp


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--epochs", type=int, default=20)
    parser.add_argument("--batch-size", type=int, default=64, help="global batch size")
    parser.add_argument("--lr", type=float, default=0.2)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    pycoll.init()
    rank, size = pycoll.rank(), pycoll.size()
    torch.set_num_threads(1)          # ranks share the cores
    data = load()
    x_train, y_train = data.x_train, data.y_train
    model = mlp(args.seed)
    for p in model.parameters():              # one starting point, whatever each rank drew
        pycoll.broadcast_(p.data, root=0)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    loss_fn = torch.nn.CrossEntropyLoss(reduction="sum")

    for epoch in range(1, args.epochs + 1):
        order = torch.randperm(len(x_train), generator=torch.Generator().manual_seed(epoch))
        loss_sum = 0.0
        for start in range(0, len(order), args.batch_size):
            batch = order[start:start + args.batch_size]
            mine = batch[rank::size]
            optimizer.zero_grad()
            with pycoll.slowdown():           # heterogeneity emulation (pycollrun --slowdown)
                loss = loss_fn(model(x_train[mine]), y_train[mine])
                (loss / len(batch)).backward()
            pycoll.grouped_allreduce_([p.grad for p in model.parameters()], op=pycoll.Sum,
                                      name="gradients")
            optimizer.step()
            loss_sum += loss.item()
        loss_total = pycoll.allreduce(torch.tensor([loss_sum], dtype=torch.float64),
                                      op=pycoll.Sum).item()
        test_accuracy = accuracy(model, data)
        if rank == 0:
            print(f"epoch {epoch:3d}  loss {loss_total / len(x_train):.4f}  "
                  f"test accuracy {100 * test_accuracy:.2f}%", flush=True)

    flat = torch.cat([p.data.reshape(-1) for p in model.parameters()])
    identical = torch.equal(pycoll.broadcast(flat, root=0), flat)
    identical = pycoll.allreduce(torch.tensor([int(identical)]), op=pycoll.Min).item() == 1
    if rank == 0:
        print(f"replicas identical on all {size} ranks: {'yes' if identical else 'NO'}")
        print(f"final test accuracy {100 * test_accuracy:.2f}% ({size} ranks)")


if __name__ == "__main__":
    main()
