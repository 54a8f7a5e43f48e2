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

Sizing, per point (``sizing``), in the cluster's time: the link model's communication
for the model's bytes (allreduce: the emulated ring's time at ``--workers`` ranks; PS:
every worker's bytes through the servers' links, one direction) is ``--ratio`` (RATIO,
0.7) of a step's nominal compute (the sleeps: a small layer's forward ``ms``, a large
one's 4 ``ms``, backward twice forward, so 3 x 58 ``ms`` a step with 48 small layers).
Why not 1, where hiding all communication would gain most (2x over default for
allreduce): there no schedule can reach the bound. The link can start on a step's bytes
only once backward makes them (the large layers' after a sixth of backward: they sit
near the output), and the next forward needs each layer's before it runs, so the link
has less than a step to carry a step's communication; the planner's own model puts the
best plan at 1.19-1.46x the bound at ratio 1 (docs/benchmarks.md). At 0.7 hiding it all
still gains up to 1.7x over default (allreduce; 2.4x on the PS, whose pulls follow all
pushes), and the bound is within reach. With either side much larger every schedule is
near the bound. The model is the same at every point (``--small`` 48 small layers of
16 KiB, large layers 64 x ``--width``, 8192: 4.81 MiB; about 100 tensors, as many as
ResNet-50 has), so a fast link means little compute per layer beside the link's
latency: a small layer's forward is 0.052 ms at allreduce 10 Gb/s (9.1 ms of compute and
6.4 of communication a step), 0.499 ms at 1 Gb/s (87 / 61 ms); PS 10 Gb/s 0.133 ms (23 /
16 ms), 1 Gb/s 1.326 ms (231 / 161 ms).

Time dilation (``--sizing dilate``, the default): the sleeps burn no CPU, but the real
work (the hooks, autograd, MPI's copies, the engine, the PS threads) does, on 2 cores
shared by every rank, and does not scale with the cluster's time; sub-millisecond steps
would measure this machine, not the cluster. So each point runs k times slower than the
cluster, k = ``--real-ms`` / ``ms`` (at least 1): every sleep k times longer, the link's
latency k times longer and its bandwidth k times lower (``dilated``). Every ratio of the
cluster (compute to communication, latency to bytes, hence every schedule's speedup and
step / bound) is kept, a small layer sleeps at least ``--real-ms`` (2 ms) on this machine,
and the real CPU is small beside the emulated compute: k = 38.3, 4.0, 15.0, 1.51 at the
four points, whose steps then all take 348 ms of compute and 244 ms of link time (the
times printed are this machine's, k times the cluster's). The real work is also kept
small (examples/overlap_train.py: one-row batches through matrix-vector kernels, one
autograd node per layer, a fused optimizer) and measured: "w cpu" is a worker's real
CPU per step (every thread, ``time.process_time``; the workers' mean), "s cpu" the
server's, and each point's line gives the workers' with no communication. (Before
2026-11-27 the defaults were ratio 1, 24 small layers, width 4096, REAL_MS 1.)

The sizings before (``--sizing widen``, 2026-11-24's fourth pass): no dilation; ``ms``
at least ``MIN_MS`` (0.25) and, where that binds (10 Gb/s), the large layers widened
until their bytes take that compute on the link (allreduce 64x39887, 20.03 MiB; PS
64x14603, 7.59 MiB). Their real CPU per step matched or exceeded the slept compute (the
20 MiB allreduce of 4 ranks on 2 cores took longer than the emulated link). ``--sizing
fixed`` (before the fourth pass) keeps ``--width`` with ``ms`` at least ``MIN_MS``, so
compute outweighs the 10 Gb/s links. ``--ms`` fixes ``ms`` (and the width), undilated.

Prints per schedule the median step time, the exposed communication per step, the
scaling efficiency (compute / step, 1.0 being perfect scaling), the partitions and
iPart's step by its own model (calibrated to the profiled steps) with the alpha and cpu
(per partition, ms) it fitted, iPart's speedups over default and layerwise, step /
overlap bound, and the ceiling of any schedule's gain over default (default's serial
step by the model / the bound: 1.7x for allreduce at ratio 0.7, 2.4x for the PS, whose
pulls follow all pushes), and the real CPU per step. Compute is the step time of
the same training with no communication, measured in the same job on every rank at
once; communication is the link model's time for a step's bytes (allreduce: the
emulated ring's cost; PS: every worker's bytes through the servers' links, one
direction), times the dilation; the bound is their maximum.
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
MIN_MS = 0.25           # --sizing widen / fixed: a small layer's least forward, cluster ms
REAL_MS = 2.0           # --sizing dilate: a small layer's least forward on this machine, ms
RATIO = 0.7             # a step's communication / its compute, by the link model (docstring)


def model_bytes(small: int, width: int) -> int:
    """The parameters' bytes of examples/overlap_train.py's model (float32)."""
    return 4 * ((small + 1) * (64 * 64 + 64) + 2 * 64 * width + width + 64 + 64 * 8 + 8)


def sizing(mode, link, args):
    """(a small layer's forward in cluster ms, the large layers' width, the dilation) of
    a point (see the docstring's sizing), or ``--ms`` and ``--width`` undilated."""
    if args.ms:
        return args.ms, args.width, 1.0
    forwards = args.small + 2 + 2 * 4          # small layers count 1, large ones 4

    def comm(width):
        return communication(mode, link, model_bytes(args.small, width), args)
    balanced = 1e3 * comm(args.width) / (args.ratio * 3 * forwards)
    if args.sizing == "dilate":
        return balanced, args.width, max(1.0, args.real_ms / balanced)
    compute = 3 * forwards * MIN_MS / 1e3      # at the floor
    if args.sizing == "fixed" or comm(args.width) >= compute:
        return max(MIN_MS, balanced), args.width, 1.0
    low, high = args.width, 2 * args.width     # comm grows with the width: bisect
    while comm(high) < compute:
        low, high = high, 2 * high
    while high - low > 1:
        middle = (low + high) // 2
        low, high = (middle, high) if comm(middle) < compute else (low, middle)
    return MIN_MS, high, 1.0


def dilated(link: str, k: float) -> str:
    """``link`` slowed ``k`` times: latency times k, bandwidth over k."""
    latency, bandwidth = parse_link(link).default
    return f"{latency * k * 1e6:.6g}us,{bandwidth / k:.6g}B/s"


def run(mode, link, args) -> dict:
    """One job: every schedule (after "local"), ``--rounds`` times; {schedule: row}, each
    row with the point's ``dilation`` (its times are the machine's, k times the cluster's)."""
    ps = mode == "ps"
    ms, width, k = sizing(mode, link, args)
    flags = ["--link", dilated(link, k)] + (["--servers", str(args.servers)] if ps else [])
    ranks = args.workers + (args.servers if ps else 0)
    out = run_job(ranks, "overlap_train.py",
                  ["--steps", args.steps, "--rounds", args.rounds, "--small", args.small,
                   "--width", width, "--ms", f"{ms * k:.4f}", "--layout", args.layout]
                  + (["--ps"] if ps else []), flags=flags)
    rows = {row["schedule"]: dict(row, dilation=k) for row in out["rows"]}
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
        k = by["default"]["dilation"]           # the link ran k times slower: alpha and beta
        comm = k * communication(mode, link, by["default"]["bytes"], args)
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
    parser.add_argument("--small", type=int, default=48)
    parser.add_argument("--width", type=int, default=8192,
                        help="the large layers' (widened by --sizing widen: see above)")
    parser.add_argument("--sizing", choices=("dilate", "widen", "fixed"), default="dilate",
                        help="dilate: time slowed until a small layer sleeps REAL_MS; widen: "
                             "the large layers widened where MIN_MS binds (before 2026-11-24's "
                             "fifth pass); fixed: --width everywhere (before the fourth)")
    parser.add_argument("--layout", choices=("end", "middle"), default="end",
                        help="the two large layers before the output layer (VGG-like) or mid-way")
    parser.add_argument("--ms", type=float, default=0.0,
                        help="a small layer's forward, ms (0: sized by --ratio)")
    parser.add_argument("--real-ms", type=float, default=REAL_MS,
                        help="--sizing dilate: a small layer's least forward on this machine, ms")
    parser.add_argument("--ratio", type=float, default=RATIO,
                        help="communication / compute of a step, by the link model (1: equal)")
    parser.add_argument("--rounds", type=int, default=3, help="runs per schedule, in turn")
    parser.add_argument("--out", default=str(ROOT / "bench" / "results"))
    args = parser.parse_args()
    if not args.ratio > 0:
        parser.error(f"--ratio must be > 0 (communication / compute), got {args.ratio}")
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
        ms, width, k = sizing(mode, link, args)
        print(f"  {mode} {link}: width {width}, {by['default']['bytes'] / 2**20:.2f} MiB of "
              f"parameters, {ms:.3f} ms per small layer; dilation {k:.2f} (ran as "
              f"{dilated(link, k)}, {ms * k:.3f} ms; the times below are this machine's); "
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
              f"{r['ceiling']:7.2f} {1e3 * r['cpu_step_s']:6.1f} "
              f"{1e3 * r['server_cpu_step_s']:6.1f}")
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
