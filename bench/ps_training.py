"""BSP, ASP, SSP(3), FluentPS(3) and R²SP training the digits MLP, one worker slowed 3x.

    python bench/ps_training.py [--servers 2 --workers 4 --slow 3:3 --repeat 1]
    python bench/ps_training.py --servers 1 --slow none --link 100us,100MB/s \
        --compute-ms 0.1 --name r2sp-link           # R²SP's setting: a contended link

Runs examples/ps_digits.py once per policy (and ``--repeat`` times, medians) under
``pycollrun --servers S --slowdown RANK:F [--link L]`` and prints, per policy: time to
90% test accuracy (and its speed-up over BSP's), final accuracy, delayed pull requests,
bytes moved, pushes in flight at the servers (mean, max), the spread of the gaps between
pushes arriving (coefficient of variation), and the per-worker iteration times (median
over each worker's second half; under R²SP without the wait for its turn) with their
max/min; writes the JSON rows and a PNG of test accuracy against wall-clock time to --out.
"""
import argparse
import json
import os
import statistics

from jobs import ROOT, run_job
POLICIES = ("bsp", "asp", "ssp:3", "fluentps:3", "r2sp")


def run(policy, args, seed: int = 0) -> dict:
    """One training of the digits MLP under ``policy``; ps_digits.py's JSON."""
    flags = ["--servers", str(args.servers)]
    flags += ["--slowdown", args.slow] if args.slow != "none" else []
    flags += ["--link", args.link] if args.link else []
    return run_job(args.servers + args.workers, "ps_digits.py",
                   ["--policy", policy, "--epochs", args.epochs, "--hidden", args.hidden,
                    "--batch-size", args.batch_size, "--seed", seed,
                    "--compute-ms", args.compute_ms, "--lr", args.lr,
                    "--momentum", args.momentum], flags=flags)


def iteration_times(result) -> list:
    """Per worker: the median iteration time of its second half; under R²SP the
    coordinator's (the work between its release and its next turn: no wait for a turn)."""
    r2sp = result["servers"][0].get("r2sp")
    if r2sp:
        return [w["work_s"] for w in r2sp["workers"]]
    return result["iteration_s"]


def time_to(curve, target):
    return next((t for t, acc in curve if acc >= target), float("inf"))


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--servers", type=int, default=2)
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--slow", default="3:3",
                        help="RANK:FACTOR[,...] (workers are ranks 0..W-1), or none")
    parser.add_argument("--link", default="", help="pycollrun --link, e.g. 100us,100MB/s")
    parser.add_argument("--compute-ms", type=float, default=0.0,
                        help="emulated compute per sample (ps_digits.py --compute-ms)")
    parser.add_argument("--name", default="ps_training", help="JSON and PNG file names")
    parser.add_argument("--lr", type=float, default=0.1)
    parser.add_argument("--momentum", type=float, default=0.9, help="the servers' SGD's")
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--repeat", type=int, default=1)
    parser.add_argument("--policies", default=",".join(POLICIES),
                        help="comma-separated, e.g. ssp:3,fluentps:3")
    parser.add_argument("--target", type=float, default=0.90)
    parser.add_argument("--out", default=str(ROOT / "bench" / "results"))
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    policies = args.policies.split(",")
    results = {p: [] for p in policies}
    for i in range(args.repeat):           # interleaved: machine noise hits all alike
        for policy in policies:
            results[policy].append(run(policy, args))
    rows = []
    for policy, runs in results.items():
        servers = [s for r in runs for s in r["servers"]]
        rows.append(dict(
            policy=policy,
            time_to_target_s=statistics.median(time_to(r["curve"], args.target) for r in runs),
            final_accuracy=statistics.median(r["final"] for r in runs),
            seconds=statistics.median(r["seconds"] for r in runs),
            delayed_pulls=statistics.median(
                sum(s["delayed_pulls"] for s in r["servers"]) for r in runs),
            megabytes=statistics.median(
                sum(s["bytes_in"] + s["bytes_out"] for s in r["servers"]) for r in runs) / 1e6,
            updates=sum(s["updates"] for s in servers) // len(runs),
            in_flight_mean=statistics.median(
                statistics.mean(s["pushes_in_flight_mean"] for s in r["servers"]) for r in runs),
            in_flight_max=max(s["pushes_in_flight_max"] for s in servers),
            push_gap_cv=statistics.median(
                statistics.mean(s.get("push_gap_cv", 0.0) for s in r["servers"]) for r in runs),
            iteration_s=iteration_times(runs[0]),
            iteration_spread=statistics.median(
                max(iteration_times(r)) / min(iteration_times(r)) for r in runs)))
    bsp = next((r["time_to_target_s"] for r in rows if r["policy"] == "bsp"), None)
    for r in rows:
        r["speedup_vs_bsp"] = bsp / r["time_to_target_s"] if bsp else None
    print(f"{args.workers} workers, {args.servers} servers, slowdown {args.slow}, link "
          f"{args.link or 'none'}, compute {args.compute_ms} ms/sample, median of {args.repeat}")
    print(f"{'policy':<12} {'t to ' + format(args.target, '.0%'):>9} {'vs BSP':>7} "
          f"{'final acc':>9} {'total s':>8} {'delayed pulls':>13} {'MB moved':>9} "
          f"{'in flight':>9} {'max':>4} {'gap cv':>7} {'iter max/min':>12}")
    for r in rows:
        speedup = f"{r['speedup_vs_bsp']:.2f}x" if r["speedup_vs_bsp"] else "-"
        print(f"{r['policy']:<12} {r['time_to_target_s']:9.2f} {speedup:>7} "
              f"{r['final_accuracy']:9.2%} {r['seconds']:8.2f} {r['delayed_pulls']:13.0f} "
              f"{r['megabytes']:9.1f} {r['in_flight_mean']:9.2f} {r['in_flight_max']:4d} "
              f"{r['push_gap_cv']:7.2f} {r['iteration_spread']:12.2f}")
    for policy, runs in results.items():           # the spread behind each median
        print(f"  {policy:<10} t to target per run: "
              + " ".join(f"{time_to(r['curve'], args.target):.2f}" for r in runs)
              + "; delayed pulls per run: "
              + " ".join(str(sum(s["delayed_pulls"] for s in r["servers"])) for r in runs)
              + "; iteration ms per worker (run 1): "
              + " ".join(f"{1e3 * t:.1f}" for t in iteration_times(runs[0])))
        r2sp = runs[0]["servers"][0].get("r2sp")
        if r2sp:
            gap = statistics.median(r[2] for r in r2sp["recent_releases"])
            print(f"  {'':<10} R²SP period {1e3 * (r2sp['period_s'] or 0):.1f} ms, gap "
                  f"{1e3 * gap:.1f} ms, push {1e3 * (r2sp['push_s'] or 0):.1f} ms, turn "
                  f"latency {1e3 * (r2sp['lead_s'] or 0):.1f} ms, out of turn "
                  f"{r2sp['out_of_turn']}; per worker mean batch / turn wait per turn / "
                  "time model, fixed + per sample (ms): " + " ".join(
                      f"{w['mean_batch']:.0f}/{1e3 * w['turn_wait_s'] / max(1, w['turns']):.1f}/"
                      f"{1e3 * (w['fixed_s'] or 0):.1f}+{1e3 * (w['per_sample_s'] or 0):.3f}"
                      for w in r2sp["workers"]))
    by_name = {r["policy"]: r for r in rows}
    ssp, fluent = by_name.get("ssp:3"), by_name.get("fluentps:3")
    if ssp and fluent:
        print(f"FluentPS vs SSP: delayed pulls x{fluent['delayed_pulls'] / max(1, ssp['delayed_pulls']):.2f}, "
              f"time to {args.target:.0%} x{fluent['time_to_target_s'] / ssp['time_to_target_s']:.2f}")
    with open(os.path.join(args.out, f"{args.name}.json"), "w") as f:
        json.dump(dict(rows=rows, runs=results, args=vars(args)), f)
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7, 4))
    for policy, runs in results.items():
        t, acc = zip(*runs[0]["curve"])
        ax.plot(t, [100 * a for a in acc], label=policy)
    ax.axhline(100 * args.target, color="grey", lw=0.8, ls="--")
    ax.set(xlabel="wall-clock time (s)", ylabel="test accuracy (%)", ylim=(0, 100),
           title=f"digits MLP, {args.workers} workers + {args.servers} servers"
           + (f", worker {args.slow.replace(':', ' slowed ')}x" if args.slow != "none" else "")
           + (f", link {args.link}" if args.link else ""))
    ax.legend()
    fig.tight_layout()
    fig.savefig(os.path.join(args.out, f"{args.name}.png"), dpi=120)
    print("wrote", os.path.join(args.out, f"{args.name}.json"), f"and {args.name}.png")


if __name__ == "__main__":
    main()
