"""Training step time: DDP over "pycoll" vs "gloo", Horovod's DistributedOptimizer, and
two loops without overlap, on one model and synthetic data, in the same run.

    pycollrun -np 2 python bench/torch_training.py [--width 1024 --depth 6] [--json out.json]
        [--device cuda]

Modes (each rank trains on its own batch, gradients averaged over the ranks):
  local        no communication at all: the compute floor the others are measured against
  ddp-pycoll   DistributedDataParallel on the "pycoll" backend
  ddp-gloo     DistributedDataParallel on gloo (same model, data, bucket size)
  hvd          pycoll.torch.DistributedOptimizer: allreduces start from gradient hooks
  fused-after  backward, then one fused grouped_allreduce_ of every gradient (no overlap)
  naive        backward, then a blocking allreduce_ per gradient (no overlap, no fusion)
Every mode gets the same model, data, bucket size and threads (torch.set_num_threads(1):
ranks share the cores). DDP runs with gradient_as_bucket_view (--no-bucket-view to
turn it off) on both backends: torch's advice for speed, and it drops two copies of
every gradient that are the same work whatever the backend, so the ratio shows the
backends rather than DDP's copies.
With --device cuda the ranks share the GPUs round-robin and pycoll stages gradients
through host memory (gloo does too); there the hooks overlap communication with backward.
Rounds run the modes in turn so machine noise hits all of them alike; a mode's time in
a round is the slowest rank's mean step; the table gives the median over rounds.
"""
import argparse
import json
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

import pycoll
import pycoll.torch as hvd

MODES = ("local", "ddp-pycoll", "ddp-gloo", "hvd", "fused-after", "naive")


def model(width: int, depth: int) -> torch.nn.Module:
    torch.manual_seed(0)
    layers = [torch.nn.Linear(64, width), torch.nn.ReLU()]
    for _ in range(depth - 2):
        layers += [torch.nn.Linear(width, width), torch.nn.ReLU()]
    return torch.nn.Sequential(*layers, torch.nn.Linear(width, 10))


def make_step(mode: str, args, gloo):
    """A zero-argument training step for ``mode`` on its own copy of the model."""
    net = model(args.width, args.depth).to(args.device)
    params = list(net.parameters())
    x = torch.randn(args.batch, 64, generator=torch.Generator().manual_seed(pycoll.rank()))
    x, y = x.to(args.device), torch.randint(0, 10, (args.batch,)).to(args.device)
    loss_fn = torch.nn.CrossEntropyLoss()
    if mode.startswith("ddp"):
        net = torch.nn.parallel.DistributedDataParallel(
            net, process_group=gloo if mode == "ddp-gloo" else None,
            device_ids=None if args.device == "cpu" else [torch.cuda.current_device()],
            bucket_cap_mb=args.bucket_mb, gradient_as_bucket_view=args.bucket_view)
    optimizer = torch.optim.SGD(params, lr=1e-3)
    if mode == "hvd":
        optimizer = hvd.DistributedOptimizer(optimizer)

    def step():
        optimizer.zero_grad()
        loss_fn(net(x), y).backward()
        if mode == "fused-after":
            pycoll.grouped_allreduce_([p.grad for p in params], op=pycoll.Average)
        elif mode == "naive":
            for p in params:
                pycoll.allreduce_(p.grad, op=pycoll.Average)
        optimizer.step()
    return step


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--depth", type=int, default=6, help="linear layers")
    parser.add_argument("--batch", type=int, default=32, help="samples per rank per step")
    parser.add_argument("--steps", type=int, default=5, help="steps per mode per round")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--bucket-mb", type=float, default=4.0,
                        help="DDP's bucket_cap_mb (compare with PYCOLL_FUSION_THRESHOLD)")
    parser.add_argument("--bucket-view", action=argparse.BooleanOptionalAction, default=True,
                        help="DDP's gradient_as_bucket_view, for both backends: it saves two "
                             "copies of every gradient that are the same work whatever the backend")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--json", metavar="PATH", help="write the results here")
    args = parser.parse_args()

    torch.set_num_threads(1)                  # ranks share the cores
    dist.init_process_group("pycoll", init_method="pycoll://")
    gloo = dist.new_group(backend="gloo")
    rank, size = dist.get_rank(), dist.get_world_size()
    if args.device == "cuda":
        torch.cuda.set_device(pycoll.local_rank() % torch.cuda.device_count())
    steps = {mode: make_step(mode, args, gloo) for mode in MODES}
    for step in steps.values():               # warm-up: buffers, buckets, first calls
        for _ in range(2):
            step()
    times = {mode: [] for mode in MODES}
    for _ in range(args.rounds):
        for mode, step in steps.items():
            pycoll.barrier()
            start = time.perf_counter()
            for _ in range(args.steps):
                step()
            if args.device == "cuda":
                torch.cuda.synchronize()
            mean = (time.perf_counter() - start) / args.steps
            times[mode].append(pycoll.allreduce(torch.tensor([mean]), op=pycoll.Max).item())
    median = {mode: statistics.median(t) for mode, t in times.items()}
    params = sum(p.numel() for p in model(args.width, args.depth).parameters())
    ratios = {"ddp-pycoll / ddp-gloo": median["ddp-pycoll"] / median["ddp-gloo"],
              "hvd / ddp-pycoll": median["hvd"] / median["ddp-pycoll"],
              "hvd / fused-after": median["hvd"] / median["fused-after"],
              "hvd / naive": median["hvd"] / median["naive"]}
    if rank == 0:
        print(f"# {size} ranks on {args.device}, MLP {args.depth} x {args.width} ({params / 1e6:.1f} M params, "
              f"{4 * params / 2**20:.0f} MiB of gradients), batch {args.batch}/rank, "
              f"median of {args.rounds} rounds x {args.steps} steps")
        print(f"{'mode':>12} {'step (ms)':>10}")
        for mode in MODES:
            print(f"{mode:>12} {1e3 * median[mode]:10.2f}")
        for name, value in ratios.items():
            print(f"{name:>24}: {value:.2f}")
        if args.json:
            os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
            with open(args.json, "w") as f:
                json.dump({"ranks": size, "params": params, "args": vars(args),
                           "median_step_s": median, "ratios": ratios, "rounds_s": times}, f,
                          indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
