"""BSP, ASP, SSP(3), FluentPS(3) and SaPS training the digits MLP with stragglers.

    python bench/ps_stragglers.py [--settings a,b] [--policies bsp asp ssp:3 fluentps:3 saps]
                                [--workers 4 --servers 2 --link 50us,1.25GB/s --step-ms 20]
                                [--slowdown RANK:FACTOR[@START-END],...] [--repeat 1]

Runs examples/ps_digits.py once per policy and setting (``--repeat`` times with seeds
0, 1, ..., as reproduce.py's SaPS experiment; medians; interleaved) under ``pycollrun
--servers S --link L --slowdown ...``:

- (a) the last worker slowed 3x for the whole run;
- (b) the last two workers slowed 4x from 0.5 s to 3.5 s of training (windows count from
  the training start, the curves' zero), a longer training: 50 ms a step, learning rate
  0.03, 20 epochs, so that every scheme is still short of the target when the window
  opens (on the loaded 2-core VM the fastest reached 90% at 1.7-1.8 s, BSP at 4.5-6.3 s) and
  the stragglers recover while training goes on; a quiet machine's shorter steps
  (50 ms of emulated compute against a few of overhead) change that little;
- ``--slowdown SPEC``: one setting of your own instead (with the command line's knobs).

Every step also sleeps ``--step-ms`` inside ``pycoll.slowdown()``: the compute of a model
bigger than the digits MLP, so that a slowed worker is a straggler through this machine's
noise (the MLP's own step is a millisecond against several of protocol and emulation).
A setting's own knobs (b's) win over the command line's.
Prints per setting and policy: time to the target test accuracy, final accuracy, total
time, delayed pulls, the time a worker is blocked in ``pull()`` per step (mean over
workers: SaPS's against ASP's shows that nobody's pull waits), the applied staleness
(median / p90 / p99 / max over every update of every run, and the slowed workers' 90th
percentile: their median is low, as they go on alone once the others have done their
epochs), SaPS's flags (in training time), discounted and dropped updates, and the load
average the runs saw; writes the JSON rows and a PNG of test accuracy against time (a
panel per setting) to --out.
"""
import argparse
import json
import os
import statistics

from jobs import ROOT, run_job

POLICIES = ("bsp", "asp", "ssp:3", "fluentps:3", "saps")
LINK, STEP_MS = "50us,1.25GB/s", 20.0


TRANSIENT = dict(step_ms=50.0, lr=0.03, epochs=20)     # (b): training outlasts the window


def settings(workers: int) -> dict:
    """Name -> (title, --slowdown spec, knobs of ``run`` it sets); workers are ranks
    0..W-1; windows count from the training start."""
    last = workers - 1
    return {"a": (f"worker {last} slowed 3x", f"{last}:3", {}),
            "b": (f"workers {last - 1}, {last} slowed 4x at 0.5-3.5 s of training",
                  f"{last - 1}:4@0.5-3.5,{last}:4@0.5-3.5", TRANSIENT)}


def run(policy: str, slowdown: str, *, servers=2, workers=4, link=LINK, step_ms=STEP_MS,
        epochs=10, hidden=1024, batch_size=64, lr=0.1, seed=0) -> dict:
    """One training of the digits MLP under ``policy``; ps_digits.py's JSON, with the
    1-minute load average before and after the run (``load``)."""
    flags = ["--servers", str(servers), "--slowdown", slowdown] + (["--link", link] if link else [])
    before = os.getloadavg()[0]
    out = run_job(servers + workers, "ps_digits.py",
                  ["--policy", policy, "--epochs", epochs, "--hidden", hidden, "--lr", lr,
                   "--batch-size", batch_size, "--step-ms", step_ms, "--seed", seed],
                  flags=flags)
    out["load"] = [before, os.getloadavg()[0]]
    return out


def time_to(curve, target):
    return next((t for t, acc in curve if acc >= target), float("inf"))


def quantile(histogram: dict, q: float):
    """The ``q`` quantile of a ``{staleness: count}`` histogram (None if empty)."""
    from pycoll.ps.saps import percentile
    return percentile(histogram, q)


def staleness(out: dict, slowed) -> dict:
    """Applied staleness of one run: median, p99 and max over every update, and the
    90th percentile of the slowed workers' updates."""
    from pycoll.ps.saps import merged
    per_worker = out["stragglers"]["staleness"]
    every = merged(per_worker)
    theirs = merged({w: h for w, h in per_worker.items() if int(w) in slowed})
    return dict(median=quantile(every, 0.5), p99=quantile(every, 0.99), max=quantile(every, 1),
                slowed_p90=quantile(theirs, 0.9), histogram=every)


def flags(out: dict) -> list:
    """SaPS's flags, times in seconds of training (the curve's clock)."""
    shift = out.get("setup_s", 0.0)
    return [dict(worker=f["worker"], flagged=round(f["flagged_s"] - shift, 2),
                 unflagged=None if f["unflagged_s"] is None else round(f["unflagged_s"] - shift, 2))
            for f in out["stragglers"].get("flags", [])]


def summarize(setting: str, policy: str, runs: list, slowed, target: float) -> dict:
    from pycoll.ps.saps import merged
    median = statistics.median
    view = [r["stragglers"] for r in runs]
    stale = [staleness(r, slowed) for r in runs]
    pooled = merged({str(i): s["histogram"] for i, s in enumerate(stale)})   # every run's
    return dict(
        setting=setting, policy=policy,
        time_to_target_s=median(time_to(r["curve"], target) for r in runs),
        time_to_target_range=[f(time_to(r["curve"], target) for r in runs) for f in (min, max)],
        final_accuracy=median(r["final"] for r in runs),
        seconds=median(r["seconds"] for r in runs),
        delayed_pulls=median(sum(s["delayed_pulls"] for s in r["servers"]) for r in runs),
        staleness_median=quantile(pooled, 0.5), staleness_p90=quantile(pooled, 0.9),
        staleness_p99=quantile(pooled, 0.99), staleness_max=quantile(pooled, 1),
        slowed_staleness_p90=median(s["slowed_p90"] or 0 for s in stale),
        pull_wait_ms=median(1e3 * statistics.mean(r["pull_wait_s"]) for r in runs),
        staleness_histogram=pooled,
        load=[min(r["load"][0] for r in runs), max(max(r["load"]) for r in runs)],
        flags=flags(runs[0]),
        discounted=median(sum(v.get("discounted", [0])) for v in view),
        dropped=median(sum(v.get("dropped", [0])) for v in view))


def flag_text(flag: dict) -> str:
    end = "end" if flag["unflagged"] is None else f"{flag['unflagged']:.2f}"
    return f"w{flag['worker']} {flag['flagged']:.2f}-{end}"


def slowed_workers(spec: str) -> set:
    return {int(item.split(":")[0]) for item in spec.split(",") if item.strip()}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--servers", type=int, default=2)
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--settings", default="a,b", help="comma-separated: a, b")
    parser.add_argument("--slowdown", help="RANK:FACTOR[@START-END],...: one setting of your own")
    parser.add_argument("--link", default=LINK, help="pycollrun --link ('' for none)")
    parser.add_argument("--step-ms", type=float, default=STEP_MS)
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--repeat", type=int, default=1)
    parser.add_argument("--policies", nargs="+", default=list(POLICIES),
                        help="e.g. ssp:3 fluentps:3 saps:bound=12,window=8")
    parser.add_argument("--target", type=float, default=0.90)
    parser.add_argument("--out", default=str(ROOT / "bench" / "results"))
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    known = settings(args.workers)
    chosen = {"custom": (f"slowdown {args.slowdown}", args.slowdown, {})} if args.slowdown \
        else {name: known[name] for name in args.settings.split(",")}
    knobs = dict(servers=args.servers, workers=args.workers, link=args.link,
                 step_ms=args.step_ms, epochs=args.epochs, hidden=args.hidden,
                 batch_size=args.batch_size)
    results = {name: {p: [] for p in args.policies} for name in chosen}
    for seed in range(args.repeat):        # interleaved: machine noise hits all alike
        for name, (_, spec, own) in chosen.items():
            for policy in args.policies:
                results[name][policy].append(run(policy, spec, seed=seed, **{**knobs, **own}))
    rows = [summarize(name, policy, runs, slowed_workers(chosen[name][1]), args.target)
            for name, by_policy in results.items() for policy, runs in by_policy.items()]
    print(f"{args.workers} workers, {args.servers} servers, link {args.link or 'none'}, "
          f"median of {args.repeat}")
    for name, (title, spec, own) in chosen.items():
        mine = {**knobs, **own}
        print(f"\n({name}) {title}: --slowdown {spec}, {mine['step_ms']:g} ms emulated "
              f"compute per step, {mine['epochs']} epochs"
              + (f", learning rate {own['lr']:g}" if "lr" in own else ""))
        mine = [r for r in rows if r["setting"] == name]
        print(f"load average (1 min) during the runs: {min(r['load'][0] for r in mine):.1f}-"
              f"{max(r['load'][1] for r in mine):.1f}")
        print(f"{'policy':<12} {'t to ' + format(args.target, '.0%'):>9} {'(min-max)':>11} "
              f"{'final acc':>9} "
              f"{'total s':>8} {'delayed':>8} {'pull ms':>8} {'staleness med/p90/p99/max':>26} "
              f"{'slowed p90':>10}  SaPS")
        for r in mine:
            saps = ""
            if r["policy"].startswith("saps"):
                saps = (f"discounted {r['discounted']:.0f}, dropped {r['dropped']:.0f}; flags "
                        + (", ".join(flag_text(f) for f in r["flags"]) or "none"))
            low, high = r["time_to_target_range"]
            print(f"{r['policy']:<12} {r['time_to_target_s']:9.2f} {f'({low:.2f}-{high:.2f})':>11} "
                  f"{r['final_accuracy']:9.2%} "
                  f"{r['seconds']:8.2f} {r['delayed_pulls']:8.0f} {r['pull_wait_ms']:8.2f} "
                  f"{r['staleness_median']:>10}/{r['staleness_p90']}/{r['staleness_p99']}/"
                  f"{r['staleness_max']:<6} "
                  f"{r['slowed_staleness_p90']:>10}  {saps}")
        verdict(mine, args.target)
    with open(os.path.join(args.out, "ps_stragglers.json"), "w") as f:
        json.dump(dict(rows=rows, runs=results, args=vars(args)), f)
    plot(results, chosen, args)
    print("wrote", os.path.join(args.out, "ps_stragglers.json"), "and ps_stragglers.png")


def verdict(rows, target) -> None:
    """SaPS against the fastest to the target and against SSP(3)'s final accuracy."""
    by = {r["policy"]: r for r in rows}
    saps = next((r for p, r in by.items() if p.startswith("saps")), None)
    if saps is None:
        return
    fastest = min(rows, key=lambda r: r["time_to_target_s"])
    ratio = saps["time_to_target_s"] / fastest["time_to_target_s"]
    print(f"SaPS: time to {target:.0%} x{ratio:.2f} the fastest ({fastest['policy']})", end="")
    ssp, fluent = by.get("ssp:3"), by.get("fluentps:3")
    if ssp:
        print(f"; final accuracy {saps['final_accuracy']:.2%} vs SSP(3)'s "
              f"{ssp['final_accuracy']:.2%}", end="")
    asp = by.get("asp")
    if asp:       # nobody's pull waits: SaPS's time blocked in pull() against ASP's
        print(f"; blocked in pull {saps['pull_wait_ms']:.2f} ms a step vs ASP's "
              f"{asp['pull_wait_ms']:.2f} ms (x{saps['pull_wait_ms'] / asp['pull_wait_ms']:.2f})",
              end="")
    print()
    if ssp and fluent:
        fewer = fluent["delayed_pulls"] / max(1, ssp["delayed_pulls"])
        print(f"FluentPS vs SSP: delayed pulls x{fewer:.2f}, "
              f"time to {target:.0%} x{fluent['time_to_target_s'] / ssp['time_to_target_s']:.2f}")


def plot(results, chosen, args) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, len(results), figsize=(6.5 * len(results), 4), squeeze=False)
    for ax, (name, by_policy) in zip(axes[0], results.items()):
        for policy, runs in by_policy.items():
            t, acc = zip(*runs[0]["curve"])
            ax.plot(t, [100 * a for a in acc], label=policy,
                    lw=2 if policy.startswith("saps") else 1)
        ax.axhline(100 * args.target, color="grey", lw=0.8, ls="--")
        ax.set(xlabel="wall-clock time (s)", ylabel="test accuracy (%)", ylim=(0, 100),
               title=f"({name}) {chosen[name][0]}")
        ax.grid(alpha=0.3)
        ax.legend(loc="lower right")
    fig.suptitle(f"digits MLP, {args.workers} workers + {args.servers} servers, link "
                 f"{args.link or 'none'}, {args.step_ms:g} ms/step")
    fig.tight_layout()
    fig.savefig(os.path.join(args.out, "ps_stragglers.png"), dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    main()
