"""Train the digits MLP through pycoll's parameter server.

    pycollrun -np 6 --servers 2 python examples/ps_digits.py --policy fluentps:3
    pycollrun -np 6 --servers 2 --slowdown 3:3 python examples/ps_digits.py --policy ssp:3
    pycollrun -np 5 --servers 1 --link 100us,100MB/s --slowdown 3:2 \\
        python examples/ps_digits.py --policy r2sp --compute-ms 0.3
    pycollrun -np 6 --servers 2 --slowdown 3:3 python examples/ps_digits.py --policy saps \
        --step-ms 20

The last ``--servers`` ranks hold the parameters and run SGD with momentum on the
gradients workers push; each worker trains on its own share of the training set,
pulling the parameters before each forward pass and pushing gradients after backward
(``pycoll.ps.TorchWorker``). Worker 0 logs test accuracy against wall-clock time.
Under R²SP workers push in turn and each batch is as large as the worker's speed
allows (``pycoll.ps.AdaptiveBatchSampler``). Every worker runs the same number of
iterations, ``--epochs`` passes over its share at the first batch size (with batch sizes
that follow speed, iterations take the same time, so the workers finish together). ``--compute-ms`` adds that much emulated
accelerator time per sample and ``--step-ms`` per step (sleeps, which ``--slowdown``
stretches too). The end-of-run summary has a straggler line (SaPS's flags, staleness).
"""
import argparse
import itertools
import json
import math
import statistics
import time

import numpy as np
import torch

import pycoll
import pycoll.ps as ps
from digits import accuracy, load, mlp


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--policy", default="bsp", help="bsp, asp, ssp:S, fluentps:S, r2sp or saps")
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--batch-size", type=int, default=16, help="per worker (at first)")
    parser.add_argument("--lr", type=float, default=0.1)
    parser.add_argument("--momentum", type=float, default=0.9)
    parser.add_argument("--eval-every", type=int, default=5, help="iterations (worker 0)")
    parser.add_argument("--hidden", type=int, default=64, help="MLP hidden width")
    parser.add_argument("--compute-ms", type=float, default=0.0,
                        help="emulated compute per sample (ms), slept inside pycoll.slowdown()")
    parser.add_argument("--step-ms", type=float, default=0.0,
                        help="emulated compute per step (a sleep inside pycoll.slowdown(), as "
                             "a GPU would take for a bigger model): stragglers then show "
                             "through this machine's noise")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", help="worker 0 writes the accuracy curve and counters here")
    args = parser.parse_args()

    torch.set_num_threads(1)                      # ranks share the cores
    # Set up before init: SaPS's flag times count from init.
    data, model = load(), mlp(args.seed, args.hidden)
    ps.init(policy=args.policy, optimizer=ps.SGD(lr=args.lr, momentum=args.momentum))
    initialized = time.perf_counter()
    rank, size = pycoll.rank(), pycoll.size()
    train = torch.utils.data.TensorDataset(data.x_train[rank::size], data.y_train[rank::size])
    worker = ps.TorchWorker(model, batch_size=args.batch_size)   # worker 0 seeds the servers
    loss_fn = torch.nn.CrossEntropyLoss()
    def batches():                                # reshuffled passes over this worker's share
        for epoch in itertools.count(1):
            order = torch.randperm(len(train), generator=torch.Generator().manual_seed(epoch))
            yield from torch.utils.data.DataLoader(   # sizes follow worker.batch_size
                train, batch_sampler=ps.AdaptiveBatchSampler(order.tolist(), worker))

    per_epoch = math.ceil(len(train) / args.batch_size)
    pycoll.barrier()
    # --slowdown windows count from here, the curve's zero, however long the set-up took
    # (a loaded machine stretches it): every run's stragglers come at the same training time.
    pycoll.hetero.mark_start()
    start, curve, iterations = time.perf_counter(), [], []
    drawn = batches()
    for step in range(1, args.epochs * per_epoch + 1):
        began = time.perf_counter()
        worker.pull()                             # the parameters asked for by the last push
        x, y = next(drawn)                        # after pull: R²SP's newest batch size
        model.zero_grad()
        with pycoll.slowdown():                   # heterogeneity emulation (--slowdown)
            loss_fn(model(x), y).backward()
            time.sleep(args.compute_ms * 1e-3 * len(y) + args.step_ms * 1e-3)
        worker.push(len(y))                       # gradients out, new parameters on their way
        iterations.append((time.perf_counter() - began, len(y)))
        if rank == 0 and step % args.eval_every == 0:
            worker.pull()
            curve.append((time.perf_counter() - start, accuracy(model, data)))
        if rank == 0 and step % per_epoch == 0 and curve:
            print(f"epoch {step // per_epoch:3d}  test accuracy {100 * curve[-1][1]:.2f}%  "
                  f"({time.perf_counter() - start:.2f} s)", flush=True)
    pull_wait = worker.pull_wait_s / len(iterations)      # blocked in pull() per step
    worker.pull()
    if worker.pacer is not None:                 # R²SP
        ps.turn(0)                                # done: the others stop keeping our turn
    pycoll.barrier()                              # every worker's last push is in
    worker.fetch()
    final, elapsed = accuracy(model, data), time.perf_counter() - start
    stats = ps.counters()
    late = iterations[len(iterations) // 2:]      # after adapting: per worker
    mine = np.array([statistics.median(t for t, _ in late), statistics.mean(n for _, n in late),
                     pull_wait])
    everyone = pycoll.allgather(mine.reshape(1, 3)).tolist()
    if rank == 0:
        curve.append((elapsed, final))
        servers = stats["servers"]
        print(f"final test accuracy {100 * final:.2f}% ({args.policy}, {size} workers, "
              f"{len(servers)} servers, {elapsed:.2f} s); delayed pulls "
              f"{sum(s['delayed_pulls'] for s in servers)}; pushes in flight mean "
              f"{statistics.mean(s['pushes_in_flight_mean'] for s in servers):.2f}", flush=True)
        print("per worker, second half: iteration " + ", ".join(
            f"{1e3 * t:.1f} ms (batch {n:.0f})" for t, n, _ in everyone), flush=True)
        print("per worker, blocked in pull per step: " + ", ".join(
            f"{1e3 * w:.2f} ms" for _, _, w in everyone), flush=True)
        print(ps.straggler_line(stats), flush=True)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(dict(policy=args.policy, workers=size, curve=curve, final=final,
                               seconds=elapsed, setup_s=start - initialized, servers=servers,
                               stragglers=stats["stragglers"],
                               iteration_s=[t for t, _, _ in everyone],
                               batch=[n for _, n, _ in everyone],
                               pull_wait_s=[w for _, _, w in everyone]), f)


if __name__ == "__main__":
    main()
