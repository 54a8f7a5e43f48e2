"""Train a model of many small layers and a few large ones under overlap schedules.

    pycollrun -np 4 --link 50us,125MB/s python examples/overlap_train.py
    pycollrun -np 5 --servers 1 --link 50us,125MB/s python examples/overlap_train.py --ps

Each layer's compute is emulated (``--ms`` of sleep per small layer's forward, four
times that for a large one, twice forward per backward), so the ranks overlap
communication with compute as a cluster would even on a machine with few cores. The
real work is kept small beside the sleeps, so that the cores do not stand in for the
cluster's compute: one-row batches through matrix-vector kernels (``_Layer``; a wide
layer costs a read of its weight and a write of its gradient), a fused optimizer, and
each step's real CPU time (``time.process_time``, every thread) measured. Each of
``--schedules`` trains a fresh model for ``--steps`` steps, ``--rounds`` times in turn
(machine noise hits them alike), after "local": the same steps with no communication,
every rank at once (the compute a step takes on this machine). Rank 0 prints and writes
(``--json``) per schedule the median step time, exposed communication and real CPU
per step (workers' mean, and servers') over the second half of each run's steps.
"""
import argparse
import json
import statistics
import time

import torch

import pycoll


class _Layer(torch.autograd.Function):
    """relu(W x + b) for one row x, then ``seconds`` of sleep (2x in backward): the
    compute a cluster node does, emulated. Matrix-vector kernels and one autograd node
    per layer keep the real CPU small beside the sleep, even for a wide weight: a read
    of the weight and a write of its whole gradient (16-row batches through ``Linear``
    and an unfused SGD, before: 1.7x the CPU at 20 MiB)."""

    @staticmethod
    def forward(ctx, x, weight, bias, seconds):
        y = torch.relu(torch.addmv(bias, weight, x[0]))
        ctx.seconds = seconds
        ctx.save_for_backward(x, weight, y)
        time.sleep(seconds)
        return y.unsqueeze(0)

    @staticmethod
    def backward(ctx, grad):
        x, weight, y = ctx.saved_tensors
        g = grad[0] * (y > 0)
        time.sleep(2 * ctx.seconds)
        into = torch.mv(weight.t(), g).unsqueeze(0) if ctx.needs_input_grad[0] else None
        return into, torch.outer(g, x[0]), g, None


class Layer(torch.nn.Linear):
    """A Linear whose compute takes ``seconds`` forward (2x backward) on a cluster node."""

    def __init__(self, n_in, n_out, seconds):
        super().__init__(n_in, n_out)
        self.seconds = seconds

    def forward(self, x):
        return _Layer.apply(x, self.weight, self.bias, self.seconds)


LAYOUTS = ("end", "middle")


def model(small: int, width: int, ms: float, layout: str = "end"):
    """The first layer, ``small`` small layers and the output layer (64 wide), and two
    large ones (64 x ``width``, ``width`` x 64) before the output layer ("end": VGG's and
    AlexNet's fully-connected layers, the models of iPart's and ByteScheduler's papers) or
    after the middle small layer ("middle")."""
    if layout not in LAYOUTS:
        raise ValueError(f"overlap_train: layout {layout!r} is not one of {LAYOUTS}")
    torch.manual_seed(0)
    large = [Layer(64, width, 4 * ms / 1000), Layer(width, 64, 4 * ms / 1000)]
    layers = [Layer(64, 64, ms / 1000)]
    for i in range(small):
        layers.append(Layer(64, 64, ms / 1000))
        if layout == "middle" and i == small // 2:
            layers += large
    if layout == "end":
        layers += large
    layers.append(Layer(64, 8, ms / 1000))
    return torch.nn.Sequential(*layers)


def sgd(params):
    # One fused kernel over every parameter: the optimizer's CPU stays small.
    return torch.optim.SGD(params, lr=0.01, momentum=0.9, fused=True)


def train(schedule: str, args) -> dict:
    m = model(args.small, args.width, args.ms, args.layout)
    sched = None
    if schedule == "local":
        opt = sgd(m.parameters())
        begin, end = (lambda: None), opt.step
    elif args.ps:
        import pycoll.ps as ps
        ps.init(policy="bsp", optimizer=ps.SGD(lr=0.01, momentum=0.9))
        worker = ps.TorchWorker(m, schedule=schedule)
        sched, begin, end = worker.schedule, worker.pull, worker.push
    else:
        import pycoll.torch as hvd
        hvd.broadcast_parameters(m.state_dict(), root_rank=0)
        opt = hvd.DistributedOptimizer(sgd(m.parameters()),
                                       named_parameters=m.named_parameters(), model=m,
                                       schedule=schedule)
        sched, begin, end = opt._schedule, (lambda: None), opt.step
    x, y = torch.randn(1, 64), torch.randn(1, 8)
    times, waits, cpu = [], [], []
    for _ in range(args.steps):
        start, cpu_start = time.perf_counter(), time.process_time()
        begin()
        waits.append(time.perf_counter() - start)      # PS default: the pull, all exposed
        m.zero_grad()
        torch.nn.functional.mse_loss(m(x), y).backward()
        end()
        times.append(time.perf_counter() - start)
        cpu.append(time.process_time() - cpu_start)   # every thread of this process
    counters = sched.counters() if sched is not None else None
    warm = args.steps // 2                   # past iPart's profiling and planning
    if schedule == "local":
        pass
    elif args.ps:
        worker.fetch()
        ps.shutdown()
    else:
        opt.synchronize()                    # the last updates, still in flight
        sched.remove()
    return dict(step_s=statistics.median(times[warm:]), cpu_step_s=statistics.median(cpu[warm:]),
                exposed_s=statistics.median(counters["exposed_s"][warm - 1:] if counters
                                            else waits[warm:]),
                partitions=counters["partitions"] if counters else 1,
                predicted_s=counters["predicted_step_s"] if counters else 0.0,
                alpha_s=counters["alpha_s"] if counters else 0.0,
                cpu_s=counters["cpu_s"] if counters else 0.0)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--schedules", default="default,layerwise,ipart")
    parser.add_argument("--ps", action="store_true", help="train through pycoll.ps (BSP)")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--small", type=int, default=24, help="small layers (64x64)")
    parser.add_argument("--width", type=int, default=4096, help="the large layers' width")
    parser.add_argument("--ms", type=float, default=1.0, help="a small layer's forward, ms")
    parser.add_argument("--layout", choices=LAYOUTS, default="end",
                        help="where the two large layers sit: before the output layer or mid-way")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    torch.set_num_threads(1)
    schedules = args.schedules.split(",")
    from mpi4py import MPI
    world = MPI.COMM_WORLD
    if args.ps:
        import pycoll.ps as ps
        if world.rank >= world.size - pycoll.config.get("servers"):
            cpu = {s: [] for s in schedules}
            for _ in range(args.rounds):               # one job after another
                for s in schedules:
                    start = time.process_time()
                    ps.init(policy="bsp", optimizer=ps.SGD(lr=0.01, momentum=0.9),
                            exit_servers=False)
                    cpu[s].append((time.process_time() - start) / args.steps)
            world.gather(("server", {s: statistics.median(c) for s, c in cpu.items()}), root=0)
            return
    else:
        import pycoll.torch as hvd
        hvd.init()
    runs = {s: [] for s in ["local"] + schedules}
    for _ in range(args.rounds):
        for schedule in runs:
            runs[schedule].append(train(schedule, args))
    # Real CPU per step (every thread; the sleeps burn none): each rank's median over
    # rounds, the mean over workers, and over servers (whole jobs / steps).
    cpu = world.gather(("worker", {s: statistics.median(r["cpu_step_s"] for r in rs)
                                   for s, rs in runs.items()}), root=0)

    def mean_cpu(role, s):
        values = [by[s] for who, by in cpu or () if who == role and s in by]
        return statistics.mean(values) if values else 0.0
    probe = model(args.small, args.width, args.ms, args.layout)
    rows = [dict(schedule=s, ps=args.ps, workers=pycoll.size(),
                 step_s=statistics.median(r["step_s"] for r in rs),
                 exposed_s=statistics.median(r["exposed_s"] for r in rs),
                 partitions=rs[-1]["partitions"], predicted_s=rs[-1]["predicted_s"],
                 alpha_s=rs[-1]["alpha_s"], cpu_s=rs[-1]["cpu_s"],
                 cpu_step_s=mean_cpu("worker", s), server_cpu_step_s=mean_cpu("server", s),
                 compute_s=3 * sum(layer.seconds for layer in probe),
                 bytes=sum(p.numel() * p.element_size() for p in probe.parameters()))
            for s, rs in runs.items()]
    if pycoll.rank() == 0:
        for row in rows:
            print(json.dumps(row), flush=True)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(dict(rows=rows), f)


if __name__ == "__main__":
    main()
