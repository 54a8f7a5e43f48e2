"""Train the digits MLP through pycoll's parameter server.

    pycollrun -np 6 --servers 2 python examples/ps_digits.py --policy fluentps:3
    pycollrun -np 6 --servers 2 --slowdown 3:3 python examples/ps_digits.py --policy ssp:3

The last ``--servers`` ranks hold the parameters and run SGD with momentum on the
gradients workers push; each worker trains on its own share of the training set,
pulling the parameters before each forward pass and pushing gradients after backward
(``pycoll.ps.TorchWorker``). Worker 0 logs test accuracy against wall-clock time.
"""
import argparse
import json
import time

import torch

import pycoll
import pycoll.ps as ps
from digits import accuracy, load, mlp


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--policy", default="bsp", help="bsp, asp, ssp:S, fluentps:S or saps")
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--batch-size", type=int, default=16, help="per worker")
    parser.add_argument("--lr", type=float, default=0.1)
    parser.add_argument("--momentum", type=float, default=0.9)
    parser.add_argument("--eval-every", type=int, default=5, help="iterations (worker 0)")
    parser.add_argument("--hidden", type=int, default=64, help="MLP hidden width")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--step-ms", type=float, default=0.0,
                        help="emulated compute per step (a sleep inside pycoll.slowdown(), as "
                             "a GPU would take for a bigger model): stragglers then show "
                             "through this machine's noise")
    parser.add_argument("--json", help="worker 0 writes the accuracy curve and counters here")
    args = parser.parse_args()

    torch.set_num_threads(1)                      # ranks share the cores
    # Set up before init: --slowdown windows and SaPS's flag times count from init.
    data, model = load(), mlp(args.seed, args.hidden)
    ps.init(policy=args.policy, optimizer=ps.SGD(lr=args.lr, momentum=args.momentum))
    initialized = time.perf_counter()
    rank, size = pycoll.rank(), pycoll.size()
    x_train, y_train = data.x_train[rank::size], data.y_train[rank::size]
    worker = ps.TorchWorker(model)                # worker 0's initial values seed the servers
    loss_fn = torch.nn.CrossEntropyLoss()
    pycoll.barrier()
    start, curve, step = time.perf_counter(), [], 0
    for epoch in range(1, args.epochs + 1):
        order = torch.randperm(len(x_train), generator=torch.Generator().manual_seed(epoch))
        for first in range(0, len(order), args.batch_size):
            batch = order[first:first + args.batch_size]
            worker.pull()                         # the parameters asked for by the last push
            model.zero_grad()
            with pycoll.slowdown():               # heterogeneity emulation (--slowdown)
                loss_fn(model(x_train[batch]), y_train[batch]).backward()
                time.sleep(args.step_ms / 1e3)
            worker.push()                         # gradients out, new parameters on their way
            step += 1
            if rank == 0 and step % args.eval_every == 0:
                worker.pull()
                curve.append((time.perf_counter() - start, accuracy(model, data)))
        if rank == 0:
            print(f"epoch {epoch:3d}  test accuracy {100 * curve[-1][1]:.2f}%  "
                  f"({time.perf_counter() - start:.2f} s)", flush=True)
    worker.pull()
    pycoll.barrier()                              # every worker's last push is in
    worker.fetch()
    final, elapsed = accuracy(model, data), time.perf_counter() - start
    stats = ps.counters()
    if rank == 0:
        curve.append((elapsed, final))
        servers = stats["servers"]
        print(f"final test accuracy {100 * final:.2f}% ({args.policy}, {size} workers, "
              f"{len(servers)} servers, {elapsed:.2f} s); delayed pulls "
              f"{sum(s['delayed_pulls'] for s in servers)}", flush=True)
        print(ps.straggler_line(stats), flush=True)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(dict(policy=args.policy, workers=size, curve=curve, final=final,
                               seconds=elapsed, setup_s=start - initialized, servers=servers,
                               stragglers=stats["stragglers"]), f)


if __name__ == "__main__":
    main()
