"""BSP, ASP, SSP(3) and FluentPS(3) training the digits MLP, one worker slowed 3x.

    python bench/ps_training.py [--servers 2 --workers 4 --slow 3:3 --repeat 1]

Runs examples/ps_digits.py once per policy (and ``--repeat`` times, medians) under
``pycollrun --servers S --slowdown RANK:F`` and prints, per policy: time to 90% test
accuracy, final accuracy, delayed pull requests, bytes moved; writes the JSON rows and
a PNG of test accuracy against wall-clock time to --out.
"""
import argparse
import json
import os
import statistics

from jobs import ROOT, run_job
POLICIES = ("bsp", "asp", "ssp:3", "fluentps:3")


def run(policy, args, seed: int = 0) -> dict:
    """One training of the digits MLP under ``policy``; ps_digits.py's JSON."""
    return run_job(args.servers + args.workers, "ps_digits.py",
                   ["--policy", policy, "--epochs", args.epochs, "--hidden", args.hidden,
                    "--batch-size", args.batch_size, "--seed", seed],
                   flags=["--servers", str(args.servers), "--slowdown", args.slow])


def time_to(curve, target):
    return next((t for t, acc in curve if acc >= target), float("inf"))


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--servers", type=int, default=2)
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--slow", default="3:3", help="RANK:FACTOR (workers are ranks 0..W-1)")
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
            updates=sum(s["updates"] for s in servers) // len(runs)))
    print(f"{args.workers} workers, {args.servers} servers, slowdown {args.slow}, "
          f"median of {args.repeat}")
    print(f"{'policy':<12} {'t to ' + format(args.target, '.0%'):>9} {'final acc':>9} "
          f"{'total s':>8} {'delayed pulls':>13} {'MB moved':>9}")
    for r in rows:
        print(f"{r['policy']:<12} {r['time_to_target_s']:9.2f} {r['final_accuracy']:9.2%} "
              f"{r['seconds']:8.2f} {r['delayed_pulls']:13.0f} {r['megabytes']:9.1f}")
    for policy, runs in results.items():           # the spread behind each median
        print(f"  {policy:<10} t to target per run: "
              + " ".join(f"{time_to(r['curve'], args.target):.2f}" for r in runs)
              + "; delayed pulls per run: "
              + " ".join(str(sum(s["delayed_pulls"] for s in r["servers"])) for r in runs))
    by_name = {r["policy"]: r for r in rows}
    ssp, fluent = by_name.get("ssp:3"), by_name.get("fluentps:3")
    if ssp and fluent:
        print(f"FluentPS vs SSP: delayed pulls x{fluent['delayed_pulls'] / max(1, ssp['delayed_pulls']):.2f}, "
              f"time to {args.target:.0%} x{fluent['time_to_target_s'] / ssp['time_to_target_s']:.2f}")
    with open(os.path.join(args.out, "ps_training.json"), "w") as f:
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
           title=f"digits MLP, {args.workers} workers + {args.servers} servers, "
                 f"worker {args.slow.replace(':', ' slowed ')}x")
    ax.legend()
    fig.tight_layout()
    fig.savefig(os.path.join(args.out, "ps_training.png"), dpi=120)
    print("wrote", os.path.join(args.out, "ps_training.json"), "and ps_training.png")


if __name__ == "__main__":
    main()
