"""Draw a pycoll timeline (``--timeline`` trace) with matplotlib: a lane per rank and
thread, each span a bar, the phases nested inside an operation drawn thinner on top of it,
async spans (time in the queue, PS requests, pulls waiting at a server) on a lane of their
own. For a picture in a document; ui.perfetto.dev is for
exploring.

    python bench/plot_timeline.py trace.json docs/timeline.png [--title TEXT]
"""
import argparse
import collections
import json

COLORS = {"step": "#f0f0f0", "op": "#c6dbef", "checked": "#fdae6b", "packed": "#74c476", "in MPI": "#3182bd",
          "unpacked": "#31a354", "compute": "#bcbddc", "emulated": "#d9d9d9",
          "queued": "#fee391", "ps": "#fc9272", "ps wait": "#de2d26"}


def color(event) -> str:
    return COLORS.get(event["name"]) or COLORS.get(event.get("cat"), "#969696")


def lanes(events):
    """{(pid, lane name): [spans]}: X events by thread; async b/e pairs on one lane."""
    names = {(e["pid"], e["tid"]): e["args"]["name"] for e in events
             if e["ph"] == "M" and e["name"] == "thread_name"}
    out = collections.defaultdict(list)
    begun = {}
    for e in sorted((e for e in events if e["ph"] in "Xbe"), key=lambda e: e["ts"]):
        if e["ph"] == "X":
            out[e["pid"], names.get((e["pid"], e["tid"]), str(e["tid"]))].append(
                (e["ts"], e["dur"], e))
        elif e["ph"] == "b":
            begun[e["id"]] = e
        elif e["id"] in begun:
            first = begun.pop(e["id"])
            out[e["pid"], "queue, PS"].append((first["ts"], e["ts"] - first["ts"], first))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("trace")
    parser.add_argument("png")
    parser.add_argument("--title", default="pycoll timeline")
    args = parser.parse_args()
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch
    with open(args.trace) as f:
        events = json.load(f)["traceEvents"]
    by_lane = lanes(events)
    order = sorted(by_lane, key=lambda k: (k[0], k[1] == "queue, PS", k[1]))
    start = min(ts for spans in by_lane.values() for ts, _, _ in spans)
    fig, ax = plt.subplots(figsize=(12, 0.55 * len(order) + 1.5))
    for y, key in enumerate(order):
        depth = []                          # ends of the enclosing spans on this lane
        for ts, dur, e in by_lane[key]:
            while depth and depth[-1] <= ts + 0.01:      # ends rounded to 1 ns
                depth.pop()
            height = 0.8 * 0.6 ** len(depth) if key[1] != "queue, PS" else 0.5
            step = e.get("cat") == "step"
            ax.barh(y, max(dur, 1.0) / 1e3, left=(ts - start) / 1e3, height=height,
                    color=color(e), edgecolor="white" if step else "none", linewidth=2)
            if step:
                ax.text((ts - start) / 1e3, y - 0.3, " " + e["name"], fontsize=7, va="top")
            if key[1] != "queue, PS":
                depth.append(ts + dur)
    ax.set_yticks(range(len(order)))
    ax.set_yticklabels([f"rank {pid} {lane}" for pid, lane in order])
    ax.invert_yaxis()
    ax.set_xlabel("ms (rank 0's clock)")
    ax.set_title(args.title)
    shown = {color(e): e["name"] if e["name"] in COLORS else e.get("cat")
             for spans in by_lane.values() for _, _, e in spans}
    ax.legend(handles=[Patch(color=c, label=label) for c, label in shown.items()],
              loc="upper center", bbox_to_anchor=(0.5, -0.12 - 0.5 / len(order)),
              ncol=6, fontsize=8, frameon=False)
    fig.tight_layout()
    fig.savefig(args.png, dpi=110)


if __name__ == "__main__":
    main()
