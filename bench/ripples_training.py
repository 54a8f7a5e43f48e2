"""Ripples vs AD-PSGD vs AllReduce on the digits MLP, 8 workers, equal and one slowed 4x.

    python bench/ripples_training.py            # writes bench/results/ripples-training.{json,png}

Runs ``examples/ripples_digits.py --scheme all`` twice under pycollrun (every scheme with
the same budget, model, data and emulated compute time per step): once with equal
workers, once with ``--slowdown 3:4``. ``--link`` emulates that network; ``--hidden`` widens
the MLP (75 x HIDDEN parameters: 65536 makes an 18.75 MiB model), or ``--model-mb`` picks
the width for a model of that many MiB. Prints time to 90% test accuracy (mean of the
workers' own models), final accuracy (of the averaged model) and the speed-up of each
scheme over AllReduce in the same scenario; plots accuracy against wall-clock time.
"""
import argparse
import json
import sys
from pathlib import Path

from jobs import EXAMPLES, ROOT, run_job

sys.path.insert(0, str(EXAMPLES))
from ripples_digits import time_to  # noqa: E402

SCENARIOS = {"equal workers": [], "rank 3 slowed 4x": ["--slowdown", "3:4"]}


def run(ranks: int, flags, args, seed: int = 0) -> dict:
    """Every scheme once on ``ranks`` workers (pycollrun ``flags``); ripples_digits.py's JSON."""
    return run_job(ranks, "ripples_digits.py",
                   ["--scheme", "all", "--seconds", args.seconds, "--step-time", args.step_time,
                    "--group-size", args.group_size, "--hidden", args.hidden, "--seed", seed],
                   flags=[*flags, *(["--link", args.link] if args.link else [])])


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--ranks", type=int, default=8)
    parser.add_argument("--seconds", type=float, default=10.0, help="budget per scheme")
    parser.add_argument("--step-time", type=float, default=0.03)
    parser.add_argument("--group-size", type=int, default=3)
    parser.add_argument("--target", type=float, default=0.9)
    parser.add_argument("--hidden", type=int, default=64, help="the MLP's width (model size)")
    parser.add_argument("--model-mb", type=float,
                        help="instead of --hidden: the width that makes a model of this many MiB")
    parser.add_argument("--link", help="emulated network, pycollrun's --link (e.g. 50us,1.25GB/s)")
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "ripples-training"))
    args = parser.parse_args()
    if args.model_mb is not None:
        if args.model_mb <= 0:
            parser.error(f"--model-mb must be a positive number of MiB, got {args.model_mb:g}")
        args.hidden = max(1, round((args.model_mb * 2**20 / 4 - 10) / 75))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)

    results = {name: run(args.ranks, flags, args) for name, flags in SCENARIOS.items()}
    rows = []
    print(f"{args.ranks} workers, digits MLP ({(75 * args.hidden + 10) * 4 / 2**20:.3g} MiB of float32), "
          f"{args.step_time * 1000:g} ms emulated compute per step, {args.seconds:g} s per "
          f"scheme, group size {args.group_size}, link {args.link or 'none'}")
    print(f"| scenario | scheme | time to {args.target:.0%} (s) | vs AllReduce | final accuracy | steps per worker |")
    print("|---|---|---|---|---|---|")
    for scenario, result in results.items():
        base = time_to(next(r for r in result["results"] if r["scheme"] == "allreduce")["curve"],
                       args.target)
        for r in result["results"]:
            t = time_to(r["curve"], args.target)
            ratio = f"{base / t:.2f}x" if t and base else "-"
            rows.append({"scenario": scenario, "scheme": r["scheme"], "time_to_target": t,
                         "speedup_vs_allreduce": base / t if t and base else None,
                         "final_accuracy": r["final_accuracy"], "steps": r["steps"]})
            print(f"| {scenario} | {r['scheme']} | {'not reached' if t is None else f'{t:.2f}'} | "
                  f"{ratio} | {100 * r['final_accuracy']:.2f}% | "
                  f"{min(r['steps'])}-{max(r['steps'])} |")
    out.with_suffix(".json").write_text(json.dumps({"args": vars(args), "rows": rows,
                                                    "runs": results}))
    plot(results, args, out.with_suffix(".png"))
    print(f"wrote {out.with_suffix('.json')} and {out.with_suffix('.png')}")


def plot(results, args, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, len(results), figsize=(6 * len(results), 4.2), sharey=True)
    for ax, (scenario, result) in zip(axes, results.items()):
        for r in result["results"]:
            t, acc = zip(*r["curve"])
            ax.plot(t, [100 * a for a in acc], label=r["scheme"])
        ax.axhline(100 * args.target, color="grey", lw=0.8, ls=":")
        ax.set(title=f"{args.ranks} workers, {scenario}", xlabel="wall-clock time (s)",
               ylim=(50, 100))
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("test accuracy (%), mean of workers' models")
    axes[-1].legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
