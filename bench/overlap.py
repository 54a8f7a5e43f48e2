"""default, layerwise and iPart schedules: step time on emulated links, PS and allreduce.

    python bench/overlap.py [--workers 4 --servers 1 --link 50us,1.25GB/s --link 50us,125MB/s]

Runs examples/overlap_train.py (many small layers and two large ones, compute emulated
by sleeping, so overlap shows on a few cores) once per link and mode, each job training
with every schedule ``--rounds`` times in turn: ``--workers`` workers + ``--servers``
servers under BSP, and ``--workers``-rank allreduce. ``--layout end`` (the default) puts
the large layers before the output layer, like the fully-connected layers of VGG-16 and
AlexNet (the models of the iPart and ByteScheduler papers): their gradients are ready
early in backward and needed late in forward, the overlap those papers exploit.
``--layout middle`` puts them mid-way, where neither backward nor forward has much
compute left to hide their transfer behind.

Sizing, per point (``sizing``): a step's nominal compute (the sleeps: a small layer's
forward ``ms``, a large one's 4 ``ms``, backward twice forward, so 3 x 34 ``ms`` a step
with 24 small layers) is set equal to the link model's communication for the model's
bytes (allreduce: the emulated ring's time at ``--workers`` ranks; PS: every worker's
bytes through the servers' links, one direction). Only where the two are equal does
hiding all communication halve the step (allreduce) or more (the PS, whose pulls follow
all pushes); with either much larger every schedule is near the bound. The large
layers' width is ``--width`` (4096) unless that would need ``ms`` under ``MIN_MS`` (0.25
ms; below it the hooks' own CPU time is not small beside it): then ``ms`` is
``MIN_MS`` and the two large layers are widened until their bytes take that compute on
the link. With the defaults: allreduce 10 Gb/s 64x39887 (20.03 MiB, 25.5 ms each way),
allreduce 1 Gb/s 64x4096 (2.41 MiB; 0.301 ms, 30.7 ms), PS 10 Gb/s 64x14603 (7.59 MiB,
25.5 ms), PS 1 Gb/s 64x4096 (2.41 MiB; 0.795 ms, 81.1 ms). ``--fixed-width`` keeps
``--width`` at every point (the runs before 2026-11-24's fourth pass: compute then
outweighs the 10 Gb/s links); ``--ms`` fixes ``ms`` (and the width).

Honest emulation: the sleeps burn no CPU, so the 2 shared cores must not stand in for
the cluster's compute. The model's real work is kept small (examples/overlap_train.py:
one-row batches through matrix-vector kernels, one autograd node per layer, a fused
optimizer) and measured: "w cpu" is a worker's real CPU per step (every thread,
``time.process_time``; the workers' mean) and "s cpu" the server's, and each point's
line gives it with no communication. What remains is mostly communication's own CPU
(MPI's copies, the engine, the PS threads' polling) and, per step, 84 wake-ups from the
sleeps (20-80 us of CPU each on this VM); at allreduce 10 Gb/s the real allreduce of 20
MiB on 4 ranks sharing 2 cores takes longer than the emulated link, so that point
measures this machine as much as the link.

Prints per schedule the median step time, the exposed communication per step, the
scaling efficiency (compute / step, 1.0 being perfect scaling), the partitions and
iPart's step by its own model (calibrated to the profiled steps) with the alpha and cpu
(per partition, ms) it fitted, iPart's speedups over default and layerwise, step /
overlap bound, and the ceiling of any schedule's gain over default (default's serial
step by the model / the bound: 2x for allreduce where compute = comm, 3x for the PS,
whose pulls follow all pushes), and the real CPU per step. Compute is the step time of the same training with no
communication, measured in the same job on every rank at once; communication is the
link model's time for a step's bytes (allreduce: the emulated ring's cost; PS: every
worker's bytes through the servers' links, one direction); the bound is their maximum.
Writes bench/results/overlap.json and overlap.png.
"""
import argparse
import json
import os
import statistics

from jobs import ROOT, run_job

from pycoll.emulation import collective_time, parse_link

SCHEDULES = ("default", "layerwise", "ipart")
LINKS = ("50us,1.25GB/s", "50us,125MB/s")            # 10 Gb/s and 1 Gb/s
MIN_MS = 0.25


def model_bytes(small: int, width: int) -> int:
    """The parameters' bytes of examples/overlap_train.py's model (float32)."""
    return 4 * ((small + 1) * (64 * 64 + 64) + 2 * 64 * width + width + 64 + 64 * 8 + 8)


def sizing(mode, link, args):
    """(a small layer's forward in ms, the large layers' width) of a point: a step's
    compute (3 forwards' worth: one forward, a backward of two) equals its communication
    by the link model (see the docstring); or ``--ms`` and ``--width``."""
    if args.ms:
        return args.ms, args.width
    forwards = args.small + 2 + 2 * 4          # small layers count 1, large ones 4
    compute = 3 * forwards * MIN_MS / 1e3      # at the floor

    def comm(width):
        return communication(mode, link, model_bytes(args.small, width), args)
    if getattr(args, "fixed_width", False) or comm(args.width) >= compute:
        return max(MIN_MS, 1e3 * comm(args.width) / (3 * forwards)), args.width
    low, high = args.width, 2 * args.width     # comm grows with the width: bisect
    while comm(high) < compute:
        low, high = high, 2 * high
    while high - low > 1:
        middle = (low + high) // 2
        low, high = (middle, high) if comm(middle) < compute else (low, middle)
    return MIN_MS, high


def run(mode, link, args) -> dict:
    """One job: every schedule (after "local"), ``--rounds`` times; {schedule: row}."""
    ps = mode == "ps"
    flags = ["--link", link] + (["--servers", str(args.servers)] if ps else [])
    ranks = args.workers + (args.servers if ps else 0)
    ms, width = sizing(mode, link, args)
    out = run_job(ranks, "overlap_train.py",
                  ["--steps", args.steps, "--rounds", args.rounds, "--small", args.small,
                   "--width", width, "--ms", f"{ms:.4f}", "--layout", args.layout]
                  + (["--ps"] if ps else []), flags=flags)
    rows = {row["schedule"]: row for row in out["rows"]}
    if rows["default"]["bytes"] != model_bytes(args.small, width):
        raise RuntimeError("bench/overlap.py: model_bytes() no longer matches "
                           "examples/overlap_train.py's model; update it")
    return rows


def communication(mode, link, nbytes, args) -> float:
    """The link model's time for one step's bytes (see the docstring)."""
    latency, bandwidth = parse_link(link).default
    if mode == "allreduce":
        return collective_time("allreduce", args.workers, nbytes, latency, bandwidth)
    return latency + args.workers * nbytes / (args.servers * bandwidth)


def serial(mode, compute, comm) -> float:
    """Default's step by the model, nothing overlapped: compute, then the allreduce, or
    under BSP every push, then every pull (each ``comm``, the two directions of a link)."""
    return compute + (2 if mode == "ps" else 1) * comm


def table(results, args) -> list:
    rows = []
    for (mode, link), by in results.items():
        compute = by["local"]["step_s"]
        comm = communication(mode, link, by["default"]["bytes"], args)
        bound = max(compute, comm)
        for s in SCHEDULES:
            r = by[s]
            rows.append(dict(
                mode=mode, link=link, schedule=s, step_s=r["step_s"], compute_s=compute,
                comm_s=comm, exposed_s=r["exposed_s"], efficiency=compute / r["step_s"],
                partitions=r["partitions"], predicted_s=r["predicted_s"], alpha_s=r["alpha_s"],
                cpu_s=r["cpu_s"], cpu_step_s=r["cpu_step_s"],
                server_cpu_step_s=r["server_cpu_step_s"],
                local_cpu_step_s=by["local"]["cpu_step_s"],
                vs_default=by["default"]["step_s"] / r["step_s"],
                vs_layerwise=by["layerwise"]["step_s"] / r["step_s"],
                over_bound=r["step_s"] / bound, ceiling=serial(mode, compute, comm) / bound))
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--servers", type=int, default=1)
    parser.add_argument("--link", action="append", help=f"LATENCY,BANDWIDTH (default {LINKS})")
    parser.add_argument("--modes", default="allreduce,ps")
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--quick", action="store_true", help="10 steps, 1 round")
    parser.add_argument("--small", type=int, default=24)
    parser.add_argument("--width", type=int, default=4096,
                        help="the large layers' (widened where the link is fast: see above)")
    parser.add_argument("--fixed-width", action="store_true",
                        help="keep --width at every link (compute then outweighs fast links)")
    parser.add_argument("--layout", choices=("end", "middle"), default="end",
                        help="the two large layers before the output layer (VGG-like) or mid-way")
    parser.add_argument("--ms", type=float, default=0.0,
                        help="a small layer's forward, ms (0: compute = communication)")
    parser.add_argument("--rounds", type=int, default=2, help="runs per schedule, in turn")
    parser.add_argument("--out", default=str(ROOT / "bench" / "results"))
    args = parser.parse_args()
    links = args.link or list(LINKS)
    if args.quick:
        args.steps, args.rounds = 10, 1
    load = os.getloadavg()[0]
    results = {(mode, link): run(mode, link, args)
               for mode in args.modes.split(",") for link in links}
    rows = table(results, args)
    print(f"{args.workers} workers ({args.servers} server(s) for ps), {args.steps} steps, "
          f"median of {args.rounds} rounds; compute emulated (sleep), links emulated (--link); "
          f"load average {load:.1f} at the start, {os.getloadavg()[0]:.1f} at the end")
    for (mode, link), by in results.items():
        r = next(r for r in rows if (r["mode"], r["link"]) == (mode, link))
        print(f"  {mode} {link}: {sizing(mode, link, args)[0]:.3f} ms per small layer, "
              f"width {sizing(mode, link, args)[1]}, "
              f"{by['default']['bytes'] / 2**20:.2f} MiB of parameters, "
              f"compute {1e3 * r['compute_s']:.1f} ms/step (measured, no communication), "
              f"communication {1e3 * r['comm_s']:.1f} ms/step (link model); real CPU "
              f"{1e3 * r['local_cpu_step_s']:.1f} ms/step per worker with no communication")
    print(f"{'mode':<9} {'link':<14} {'schedule':<9} {'step ms':>8} {'exposed':>8} "
          f"{'eff':>5} {'parts':>5} {'model':>6} {'alpha':>5} {'cpu':>5} {'vs dflt':>7} "
          f"{'vs lw':>6} {'/bound':>6} {'ceiling':>7} {'w cpu':>6} {'s cpu':>6}")
    for r in rows:
        print(f"{r['mode']:<9} {r['link']:<14} {r['schedule']:<9} {1e3 * r['step_s']:8.1f} "
              f"{1e3 * r['exposed_s']:8.1f} {r['efficiency']:5.2f} {r['partitions']:5d} "
              f"{1e3 * r['predicted_s']:6.1f} {1e3 * r['alpha_s']:5.2f} {1e3 * r['cpu_s']:5.2f} "
              f"{r['vs_default']:7.2f} {r['vs_layerwise']:6.2f} {r['over_bound']:6.2f} "
              f"{r['ceiling']:7.2f} {1e3 * r['cpu_step_s']:6.1f} {1e3 * r['server_cpu_step_s']:6.1f}")
    print("targets: ipart vs default >= 1.5, vs layerwise >= 1.2, step / bound <= 1.15; "
          "ceiling: default's serial step by the model / bound, the most any schedule gains")
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "overlap.json"), "w") as f:
        json.dump(dict(rows=rows, args=vars(args), load=[load, os.getloadavg()[0]]), f, indent=1)
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    cases = list(results)
    fig, ax = plt.subplots(figsize=(8, 4))
    width = 0.8 / len(SCHEDULES)
    for i, s in enumerate(SCHEDULES):
        steps = [next(r["step_s"] for r in rows if (r["mode"], r["link"]) == c and r["schedule"] == s)
                 for c in cases]
        ax.bar([j + i * width for j in range(len(cases))], [1e3 * t for t in steps], width, label=s)
    for j, c in enumerate(cases):
        bound = next(max(r["compute_s"], r["comm_s"]) for r in rows if (r["mode"], r["link"]) == c)
        ax.hlines(1e3 * bound, j - width / 2, j + 2.5 * width, colors="k", linestyles="--",
                  label="overlap bound" if j == 0 else None)
    ax.set_xticks([j + width for j in range(len(cases))],
                  [f"{m}\n{link}" for m, link in cases], fontsize=8)
    ax.set(ylabel="step time (ms)", title=f"{args.workers} workers: default, layerwise, iPart")
    ax.legend()
    fig.tight_layout()
    fig.savefig(os.path.join(args.out, "overlap.png"), dpi=120)
    print("wrote", os.path.join(args.out, "overlap.json"), "and overlap.png")


if __name__ == "__main__":
    main()
