"""Ripples vs AD-PSGD vs AllReduce on the digits MLP, 8 workers, equal and one slowed 4x.

    python bench/ripples_training.py            # writes bench/results/ripples-training.{json,png}
    python bench/ripples_training.py --cluster  # a 20 MiB model on emulated 1 GbE (CLUSTER)

Runs ``examples/ripples_digits.py --scheme all`` twice under pycollrun (every scheme with
the same budget, model, data and emulated compute time per step): once with equal
workers, once with ``--slowdown 3:4`` (a budget of its own, ``--slowed-seconds``:
AllReduce then steps at the straggler's pace). ``--link`` emulates that network; ``--hidden`` widens the MLP
(75 x HIDDEN parameters: 65536 makes an 18.75 MiB model), or ``--model-mb`` picks the
width for a model of that many MiB. Prints time to the target test accuracy (mean of the
workers' own models), final accuracy (of the averaged model) and the speed-up of each
scheme over AllReduce in the same scenario; then where the time went (per worker: a
step's real forward/backward, its wait in ``sync.step``, and the real CPU seconds of the
whole run against its wall-clock seconds); then AD-PSGD's averagings and what they
waited for (lock round trips, requests queued behind another averaging at a passive, a
passive's service and its own update waiting for each other: ``ADPSGD.counters``);
plots accuracy against wall-clock time.

``--cluster`` sets the defaults of CLUSTER: on this 2-core machine a realistic model
size is meaningful only while real CPU stays a small share of a step, so the batch is
small, the emulated compute long (1 s) and the link 1 GbE, where a 20 MiB AllReduce of
8 workers costs about 0.3 s; flags given still win.
"""
import argparse
import json
import statistics
import sys
from pathlib import Path

from jobs import EXAMPLES, ROOT, run_job

sys.path.insert(0, str(EXAMPLES))
from ripples_digits import SCHEMES, time_to  # noqa: E402

SCENARIOS = {"equal workers": [], "rank 3 slowed 4x": ["--slowdown", "3:4"]}
# A 20 MiB model (69,905 hidden units) on 1 GbE: the AllReduce of 8 workers is modelled at
# 0.29 s against 1 s of compute, a group of 3's partial all-reduce 0.22 s, and a worker's
# real CPU (batch 8) is a few percent of a step.
CLUSTER = dict(model_mb=20.0, link="50us,125MB/s", step_time=1.0, batch_size=8, lr=0.1,
               eval_every=3, seconds=45.0, slowed_seconds=110.0, target=0.8)


def hidden_for(model_mb: float) -> int:
    """The MLP's width for a model of ``model_mb`` MiB of float32 (75 x HIDDEN + 10)."""
    if model_mb <= 0:
        raise ValueError(f"the model size must be a positive number of MiB, got {model_mb:g}")
    return max(1, round((model_mb * 2**20 / 4 - 10) / 75))


def run(ranks: int, flags, args, seconds: float, seed: int = 0) -> dict:
    """Every scheme once on ``ranks`` workers (pycollrun ``flags``); ripples_digits.py's JSON."""
    return run_job(ranks, "ripples_digits.py",
                   ["--scheme", "all", "--seconds", seconds, "--step-time", args.step_time,
                    "--group-size", args.group_size, "--hidden", args.hidden,
                    "--batch-size", args.batch_size, "--lr", args.lr,
                    "--eval-every", args.eval_every, "--seed", seed],
                   flags=[*flags, *(["--link", args.link] if args.link else [])],
                   timeout=len(SCHEMES) * (2 * seconds + 120))    # start-up and scoring too


def where_time_went(result: dict) -> dict:
    """A scheme's run, per step and per worker (medians over workers): real forward and
    backward, all of compute (emulated included), ``sync.step``; and real CPU seconds over
    wall seconds, per worker (``cpu share``) and summed over workers (``cores``)."""
    phases, steps = result["phases"], result["steps"]
    per_step = {k: statistics.median(p[k] / max(s, 1) for p, s in zip(phases, steps))
                for k in ("real compute", "compute", "sync")}
    wall = max(p["wall"] for p in phases)
    return {**per_step, "step": statistics.median(p["wall"] / max(s, 1) for p, s in zip(phases, steps)),
            "cpu share": statistics.median(p["cpu"] / p["wall"] for p in phases),
            "cores": sum(p["cpu"] for p in phases) / wall}


def counters(result: dict) -> dict:
    """A scheme's ``sync.counters()`` summed over its workers."""
    total: dict = {}
    for phases in result["phases"]:
        for name, value in phases.get("counters", {}).items():
            total[name] = total.get(name, 0) + value
    return total


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--cluster", action="store_true",
                        help="a 20 MiB model on emulated 1 GbE: CLUSTER's defaults")
    parser.add_argument("--ranks", type=int, default=8)
    parser.add_argument("--seconds", type=float, default=10.0, help="budget per scheme")
    parser.add_argument("--slowed-seconds", type=float,
                        help="budget per scheme with the straggler (default: --seconds)")
    parser.add_argument("--step-time", type=float, default=0.03)
    parser.add_argument("--batch-size", type=int, default=16, help="per worker")
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--eval-every", type=int, default=5,
                        help="steps between the copies of a model that are scored")
    parser.add_argument("--group-size", type=int, default=3)
    parser.add_argument("--target", type=float, default=0.9)
    parser.add_argument("--hidden", type=int, default=64, help="the MLP's width (model size)")
    parser.add_argument("--model-mb", type=float,
                        help="instead of --hidden: the width that makes a model of this many MiB")
    parser.add_argument("--link", help="emulated network, pycollrun's --link (e.g. 50us,1.25GB/s)")
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "ripples-training"))
    if parser.parse_known_args()[0].cluster:
        parser.set_defaults(**CLUSTER)
    args = parser.parse_args()
    if args.model_mb is not None:
        try:
            args.hidden = hidden_for(args.model_mb)
        except ValueError as e:
            parser.error(str(e))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)

    budgets = {"equal workers": args.seconds, "rank 3 slowed 4x": args.slowed_seconds or args.seconds}
    results = {name: run(args.ranks, flags, args, budgets[name]) for name, flags in SCENARIOS.items()}
    rows = []
    print(f"{args.ranks} workers, digits MLP ({(75 * args.hidden + 10) * 4 / 2**20:.3g} MiB of float32), "
          f"batch {args.batch_size}, {args.step_time * 1000:g} ms emulated compute per step, "
          f"{' / '.join(f'{s:g}' for s in budgets.values())} s per scheme, group size "
          f"{args.group_size}, link {args.link or 'none'}")
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
                         "final_accuracy": r["final_accuracy"], "steps": r["steps"],
                         "time": where_time_went(r), "counters": counters(r)})
            print(f"| {scenario} | {r['scheme']} | {'not reached' if t is None else f'{t:.2f}'} | "
                  f"{ratio} | {100 * r['final_accuracy']:.2f}% | "
                  f"{min(r['steps'])}-{max(r['steps'])} |")
    print("\nWhere the time went (per step, median worker; real CPU of the whole run over its wall time):")
    print("| scenario | scheme | step (s) | compute (s) | real forward/backward (ms) | sync.step (s) "
          "| real CPU share of a worker | cores used (of all workers) |")
    print("|---|---|---|---|---|---|---|---|")
    for row in rows:
        w = row["time"]
        print(f"| {row['scenario']} | {row['scheme']} | {w['step']:.3f} | {w['compute']:.3f} | "
              f"{1000 * w['real compute']:.0f} | {w['sync']:.3f} | {100 * w['cpu share']:.1f}% | "
              f"{w['cores']:.2f} |")
    print("\nAD-PSGD's averagings (sums over workers; an active counts its own, a passive those it served):")
    for row in rows:
        if row["scheme"] == "adpsgd":
            c = row["counters"]
            n = c["averages"] // 2                  # each counted by its active and its passive
            print(f"- {row['scenario']}: {n} averagings; lock request to grant "
                  f"{1000 * c['lock wait s'] / max(n, 1):.1f} ms each on average "
                  f"(a round trip is 2 link latencies); {c['queued']} requests queued behind "
                  f"another averaging at a passive; passives' service waited for their own update "
                  f"{c['busy waits']} times ({c['busy wait s']:.2f} s), their updates for an "
                  f"averaging {c['update waits']} times ({c['update wait s']:.2f} s)")
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
               ylim=(0, 100))
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("test accuracy (%), mean of workers' models")
    axes[-1].legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
