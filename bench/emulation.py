#!/usr/bin/env python
"""The emulated network against its model: pycoll's transfers under ``--link``, measured.

    python bench/emulation.py [--link 50us,1.25GB/s] [--ranks 4] [--sizes 4K,64K,1M,16M,64M]
        [--reps 5] [--jobs collectives,ps] [--arrive busy|idle] [--json PATH] [--plot PNG]

Runs each job twice under pycollrun, without and with ``--link``: the collectives job on
--ranks ranks (in-place allreduce and broadcast, allgather into a given output, and a
partial all-reduce of every rank on its point-to-point ring), and the parameter-server
job on --ranks workers and 1 server (ASP, no optimizer: pushes of one worker, then of all
at once; then pulls likewise). Every repetition starts all ranks at one instant (they
share this machine's clock); tables quote the median. By default the ranks spin to that
instant (``--arrive busy``), as ranks of a training loop arrive at a collective from
compute; ``--arrive idle`` sleeps to it. A call after a pause is slower for raw MPI and
pycoll alike: on the 16-core machine a 4 KiB allreduce took 5-6 us back to back, 12-13
after 2 ms spinning and 22-26 after 2 ms asleep (2026-11-28).

When a row starts, and its model with it:
  A collective cannot start before its last member has called it: the emulation charges
  the model from the latest member's call (``Paced`` stamps the call in the compiled
  path, ``emulation.called`` in the general one), so a collective row runs from the
  latest start to the latest end among the ranks. Everything a rank does from its call
  to its MPI calls (reading the arguments, the engine's token, the entry's bookkeeping)
  is real work, like the transfer: the modelled time overlaps it, so a call lasts max(its
  real work, the model) plus its return, with or without the compiled path. (Until
  2026-11-24 the compiled path charged the model from its entry, after that work: 4-13
  us a call at 2 ranks that no sleep could win back, and the general path from the call.)
  A PS row's requests are independent: each starts when its worker sends it, and the
  server's NIC takes them in turn from then. The row runs from the first start to the
  last end, and its model is computed from each repetition's own starts (``ps_model``),
  so a worker that wakes late is neither charged to the emulation nor hidden by it.

The model of each row (``pycoll.emulation``; alpha, beta the link's latency and bandwidth,
n ranks, B bytes):
  allreduce            2(n-1)(alpha + B/(n beta))     (ring)
  partial              2(n-1)(alpha + B/(n beta))     (pycoll's ring; up to 64 KiB its direct
                       alpha + (n-1)B/beta             exchange, PYCOLL_PARTIAL_DIRECT_BYTES)
  allgather            (n-1)(alpha + B/(n beta))      (B: the gathered result)
  broadcast            ceil(log2 n)(alpha + B/beta)
  ps push, pull        ``ps_model``: with W requests sent at once, 2 alpha + W B/beta + S,
                       or 2 alpha + B/beta + W P + S - P where the server is the bottleneck

A PS request is not a transfer alone: the worker's header and payload cross the server's
NIC (its ingress a FIFO: W pushers share it, incast), the server parses the request,
adds the pushed piece into its shard (or reads the shard out for a pull) and answers,
and the answer crosses back (a pull's data on the server's egress, FIFO too): one alpha
each way, the header's and answer's few bytes included. That processing is compute a
cluster pays too, and the emulation must not hide it (an update may not be visible to
other workers before its modelled arrival, so the server cannot apply a piece before
then). What can overlap does: the real copy runs while the modelled transfer elapses,
the server applies each payload piece (PYCOLL_CHUNK_BYTES) while the next is still
arriving, and it serves one request while the next one's bytes cross the link, so only
the last request's processing comes after the last transfer, unless the server is
slower than the link (small requests from several workers: then they queue at it, W
times its own part P). S is that processing, measured without a link in the same run:
the least time one worker's request of one piece took (this size, or the largest size
run that fits in one piece), the server's polling and the worker's hand-over included.
P, the server's own part of S: what each further simultaneous request added to the least
time without a link, (least of W - least of 1) / (W - 1), at most S. Where a row measures
over its model, the excess is the emulation's own: each paced message's release by its
thread.

Two times per row. "wall": the wall clock. "cluster": the wall clock less, per rank,
how long its threads waited for a core after the modelled end (``emulation.
count_core_waits``: Linux's per-thread run delay, read before the emulation's last sleep
to a modelled deadline and again once the thread is back on a core; only the part after
the deadline counts, and never more than the time since it). This machine runs 4-5
ranks on 2 cores; a cluster gives each rank its own, so a rank there is on a core at
its deadline and that wait is this machine's alone. Nothing else is taken off: not the
timer's wake-up latency, not waits before the deadline (the sleep absorbs them, or they
made the real transfer outlast its model, which shows in both columns), not waits of a
thread that does not sleep to a deadline (the PS caller's own wake-up). The count reads
procfs after each deadline, inside the paced call (about 1 us on the VM), so it is on
only where a job's ranks outnumber the cores; with a core each, the columns are one.

"checked" rows are those whose model exceeds the time without a link: there the
emulation must land within 10% of the model by cluster time ("ok"; the wall column's
count is printed too), elsewhere real work sets the time. The header also gives the
floor no sleeping can beat: how late the latest of the ranks wakes when all sleep to
one deadline, on the wall clock and less its wait for a core.
"""
import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
COLLECTIVES = ("allreduce", "allgather", "broadcast", "partial")
PS = ("ps push", "ps pull")


def parse_bytes(s: str) -> int:
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    s = s.strip().upper().rstrip("B")
    return int(float(s[:-1]) * units[s[-1]]) if s[-1:] in units else int(s)


def human(n: int) -> str:
    for unit, size in (("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            return f"{n / size:g} {unit}"
    return f"{n} B"


# ---------------------------------------------------------------- the jobs (under MPI)

def _max(comm, *values) -> list:
    """The largest of each value over the ranks, waited for without spinning: MPI's
    blocking Allreduce busy-polls, and a rank done early (or taking no part) would take a
    core from those still at work, which a cluster's ranks, a core each, never do."""
    import numpy as np
    from mpi4py import MPI
    from pycoll.work import wait_requests
    mine = np.array(values, np.float64)
    if wait_requests([comm.Iallreduce(MPI.IN_PLACE, mine, op=MPI.MAX)], 600.0):
        raise SystemExit("bench/emulation.py: a rank did not reach the end of a repetition "
                         "within 600 s")
    return mine.tolist()


def _every(comm, *values) -> list:
    """Each rank's ``values`` (a list per rank), waited for as ``_max`` waits."""
    import numpy as np
    from mpi4py import MPI
    from pycoll.work import wait_requests
    mine = np.array(values, np.float64)
    every = np.empty((comm.Get_size(), len(values)), np.float64)
    if wait_requests([comm.Iallgather(mine, every)], 600.0):
        raise SystemExit("bench/emulation.py: a rank did not reach the end of a repetition "
                         "within 600 s")
    return every.tolist()


def _together(comm, arrive: str) -> float:
    """Start every rank of ``comm`` at one instant (the latest clock, plus 2 ms); when this
    one did (on a loaded machine some start a fraction of a millisecond late). ``busy``:
    the ranks spin to it, yielding, as ranks arriving from compute would; ``idle``: they
    sleep to it."""
    from pycoll import emulation
    deadline = _max(comm, time.monotonic())[0] + 0.002
    if arrive == "idle":
        emulation.sleep_until(deadline)
    while time.monotonic() < deadline:
        os.sched_yield()
    return time.monotonic()


def _took(comm, begun: float, part: bool = True) -> tuple:
    """(wall, cluster) seconds from the latest start to the latest end among the ranks
    that take ``part``: the model's time runs from the last member's entry too, so a late
    wake-up is not counted against the emulation (nor in the time without a link). The
    cluster time ends each rank's part earlier by its threads' waits for a core after
    the modelled end (``emulation.core_wait_after``)."""
    from pycoll import emulation
    end = time.monotonic()
    waited = emulation.core_wait_after(begun)
    start, end, cluster = _max(comm, *([begun, end, end - waited] if part else [-math.inf] * 3))
    return end - start, cluster - start


def _spans(comm, begun: float, part: bool) -> list:
    """(start, end, cluster end) of each rank that takes ``part`` (a PS row's requests),
    relative to the earliest start: each request starts on its own and the model's FIFO
    at the server's NIC is fed from when each was sent."""
    from pycoll import emulation
    end = time.monotonic()
    waited = emulation.core_wait_after(begun)
    every = [row for row in _every(comm, float(part), begun, end, end - waited) if row[0]]
    first = min(row[1] for row in every)
    return [[t - first for t in row[1:]] for row in every]


def _wake_up(comm, reps: int = 30) -> tuple:
    """How late (s) the latest rank wakes when every rank sleeps to one deadline: on
    the wall clock, and less each rank's wait for a core (the cluster's)."""
    from pycoll import emulation
    late, cluster = [], []
    for _ in range(reps):
        deadline = _max(comm, time.monotonic())[0] + 0.002      # as _together's
        emulation.sleep_until(deadline)
        mine = time.monotonic() - deadline
        mine = _max(comm, mine, mine - emulation.core_wait_after(deadline - 1))
        late.append(mine[0])
        cluster.append(mine[1])
    return late, cluster


SMALL, SMALL_TIMES = 1 << 20, 5


def _reps(args, size: int) -> int:
    """Repetitions of a row: below SMALL, SMALL_TIMES as many. A small row's time is a few
    thread wake-ups, each 10-100 us on a loaded 2-core VM: medians of 3 moved 2x between
    runs, and its repetitions cost milliseconds."""
    return args.reps if size >= SMALL else SMALL_TIMES * args.reps


def collectives_job(args) -> list:
    import numpy as np
    import pycoll
    pycoll.init(partial_cache_after=0)           # the point-to-point ring every time
    comm, n, rank = pycoll.runtime.world().comm, pycoll.size(), pycoll.rank()
    late, cluster = _wake_up(comm)
    rows = [dict(op="wake-up", bytes=0, pushers=None, times=late, cluster=cluster)]
    for size in args.sizes:
        count = max(n, size // 4 // n * n)       # float32, a multiple of n for allgather
        x = np.empty(count, np.float32)
        gathered = np.empty(count, np.float32)
        part = x[:count // n]
        runs = {"allreduce": lambda: pycoll.allreduce_(x, op=pycoll.Sum),
                "allgather": lambda: pycoll.allgather(part, out=gathered),
                "broadcast": lambda: pycoll.broadcast_(x, root=0),
                "partial": lambda: pycoll.partial_allreduce_(x, list(range(n)), op=pycoll.Sum)}
        for op in COLLECTIVES:
            times = []
            for rep in range(_reps(args, size) + 1):            # the first warms up
                x.fill(rank + 1)
                begun = _together(comm, args.arrive)
                runs[op]()
                took = _took(comm, begun)
                if rep:
                    times.append(took)
            if op in ("allreduce", "partial") and not np.all(x == n * (n + 1) / 2):
                raise SystemExit(f"{op} of {size} B: wrong result")
            rows.append(dict(op=op, bytes=count * 4, pushers=None, times=[t[0] for t in times],
                             cluster=[t[1] for t in times]))
    return rows


def ps_job(args) -> list:
    import numpy as np
    import pycoll
    import pycoll.ps as ps
    ps.init(servers=1, policy="asp")             # the server serves here, then exits
    comm, workers, rank = pycoll.runtime.world().comm, pycoll.size(), pycoll.rank()
    keys = {f"k{size}": np.ones(size // 4, np.float32) for size in args.sizes}
    ps.init_params(keys)
    rows = []
    for size in args.sizes:
        name, value = f"k{size}", keys[f"k{size}"]
        for op, call in (("ps push", lambda: ps.push(name, value).wait()),
                         ("ps pull", lambda: ps.pull(name, value).wait())):
            for pushers in sorted({1, workers}):
                spans = []
                for rep in range(_reps(args, size) + 1):
                    begun = _together(comm, args.arrive)
                    if rank < pushers:
                        call()
                    took = _spans(comm, begun, rank < pushers)
                    if rep:
                        spans.append(took)
                rows.append(dict(op=op, bytes=value.nbytes, pushers=pushers, name=name,
                                 starts=[[s[0] for s in rep] for rep in spans],
                                 times=[max(s[1] for s in rep) for rep in spans],
                                 cluster=[max(s[2] for s in rep) for rep in spans]))
    ps.shutdown()
    return rows


def worker(args) -> None:
    from mpi4py import MPI
    from pycoll import emulation
    if MPI.COMM_WORLD.Get_size() > (os.cpu_count() or 1):
        emulation.count_core_waits()
    rows = (collectives_job if args.worker == "collectives" else ps_job)(args)
    if MPI.COMM_WORLD.Get_rank() == 0:
        with open(args.out, "w") as f:
            json.dump(rows, f)


# ---------------------------------------------------------------- the driver

def run_job(kind: str, args, link, out: str) -> list:
    ranks = args.ranks + (1 if kind == "ps" else 0)
    cmd = [sys.executable, os.path.join(ROOT, "launch", "pycollrun.py"), "-np", str(ranks)]
    if kind == "ps":
        cmd += ["--servers", "1"]
    if link:
        cmd += ["--link", link]
    cmd += ["python", os.path.abspath(__file__), "--worker", kind, "--out", out,
            "--sizes", ",".join(map(str, args.sizes)), "--reps", str(args.reps),
            "--arrive", args.arrive]
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("PYCOLL_", "OMPI_COMM_", "PMIX_", "PMI_"))}
    env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=1800)
    if proc.returncode:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    with open(out) as f:
        return json.load(f)


def model_time(op: str, n: int, nbytes: int, latency: float, bandwidth: float) -> float:
    """A collective row's model (see the docstring)."""
    from pycoll import emulation
    if op == "partial":
        from pycoll import config
        kind = "direct" if nbytes <= config.get("partial_direct_bytes") else "allreduce"
        return emulation.collective_time(kind, n, nbytes, latency, bandwidth)
    return emulation.collective_time(op, n, nbytes, latency, bandwidth)


def ps_model(op: str, starts: list, nbytes: int, name: str, latency: float,
             bandwidth: float, serving: float, each: float) -> float:
    """When the last of a PS row's requests, sent at ``starts`` (s after the first), ends
    on the emulated cluster: each crosses the server's NIC (a FIFO: the pushes' payloads on
    its ingress, the pulls' answers on its egress), the server serves one request at a
    time (``each`` s, while the next transfers), and the last answer crosses back; then
    what is left of S (``serving``) beside the server's own part."""
    from pycoll.ps import wire
    request = wire.HEADER.size + wire.ENTRY.itemsize + len(name)     # the header as sent
    answer = wire.META_LEN * 8
    inbound, outbound = (request + nbytes, answer) if op == "ps push" else \
        (request, answer + nbytes)
    ingress = busy = egress = -math.inf
    for start in sorted(starts):
        ingress = max(ingress, start) + inbound / bandwidth
        busy = max(busy, ingress + latency) + each
        egress = max(egress, busy) + outbound / bandwidth
    return egress + latency + serving - each


def server_times(real: list) -> dict:
    """(S, its server's part) of each PS row, by (op, bytes). S: the least time without a
    link of one worker's request of min(bytes, P), P the largest size run that fits in one
    payload piece (the least: this machine's load only adds to it, and S is in many rows'
    models). The server's part: what each further simultaneous request added to the least
    time without a link, (least of W - least of 1) / (W - 1), at most S."""
    from pycoll import tensors
    least = {(r["op"], r["bytes"], r["pushers"]): min(r["times"]) for r in real if r["op"] in PS}
    ones = {(op, b): t for (op, b, w), t in least.items() if w == 1}
    sizes = sorted({b for _, b in ones})
    if not sizes:
        return {}
    piece = max([b for b in sizes if b <= tensors.piece_bytes()] or sizes[:1])
    out = {}
    for op, b in ones:
        serving = ones[(op, min(b, piece))]
        more = [(w, t) for (o, size, w), t in least.items() if (o, size) == (op, b) and w > 1]
        each = max([(t - ones[(op, b)]) / (w - 1) for w, t in more] or [0.0])
        out[(op, b)] = (serving, min(serving, max(0.0, each)))
    return out


def combine(args, real: list, emulated: list) -> list:
    from pycoll import emulation
    latency, bandwidth = emulation.parse_link(args.link).of(0)
    server = server_times(real)
    rows = []
    for plain, paced in zip(real, emulated):
        assert (plain["op"], plain["bytes"], plain["pushers"]) == \
            (paced["op"], paced["bytes"], paced["pushers"])
        if paced["op"] == "wake-up":
            continue
        serving, each = server.get((paced["op"], paced["bytes"]), (0.0, 0.0))
        if paced["op"] in PS:
            model = statistics.median(
                ps_model(paced["op"], starts, paced["bytes"], paced["name"], latency, bandwidth,
                         serving, each) for starts in paced["starts"])
        else:
            model = model_time(paced["op"], args.ranks, paced["bytes"], latency, bandwidth)
        real_s, measured = statistics.median(plain["times"]), statistics.median(paced["times"])
        cluster = statistics.median(paced["cluster"])
        checked = model > real_s
        ratio = measured / model if model else math.inf
        cluster_ratio = cluster / model if model else math.inf
        rows.append(dict(op=paced["op"], bytes=paced["bytes"], pushers=paced["pushers"],
                         real_ms=real_s * 1e3, model_ms=model * 1e3, measured_ms=measured * 1e3,
                         cluster_ms=cluster * 1e3, server_ms=serving * 1e3,
                         server_each_ms=each * 1e3,
                         ratio=ratio, cluster_ratio=cluster_ratio, checked=checked,
                         ok_wall=(not checked) or abs(ratio - 1) <= 0.10,
                         ok=(not checked) or abs(cluster_ratio - 1) <= 0.10,
                         real_times=plain["times"], measured_times=paced["times"],
                         cluster_times=paced["cluster"]))
    return rows


def wake_up_us(runs: list) -> tuple:
    """The median wake-up floor (us) over the collectives jobs' measurements: on the wall
    clock, and less the waits for a core."""
    def median(column):
        late = [t for run in runs for r in run if r["op"] == "wake-up" for t in r[column]]
        return statistics.median(late) * 1e6 if late else math.nan
    return median("times"), median("cluster")


def print_table(args, rows: list, wake_us: tuple) -> None:
    print(f"# pycoll emulation: --link {args.link}; {args.ranks} ranks (PS: {args.ranks} "
          f"workers + 1 server); ranks arrive {args.arrive}; medians of {args.reps} (below "
          f"{human(SMALL)}: of {SMALL_TIMES * args.reps}); times in ms; load average "
          f"{os.getloadavg()[0]:.1f}")
    print(f"# the latest of {args.ranks} ranks sleeping to one deadline wakes {wake_us[0]:.0f} us "
          f"late (median), {wake_us[1]:.0f} us less its wait for a core")
    print(f"{'op':<10} {'W':>2} {'size':>9} {'no link':>9} {'S':>7} {'server':>7} {'model':>9} "
          f"{'wall':>9} {'wall/mod':>8} {'cluster':>9} {'clus/mod':>8}  within 10%")
    for r in rows:
        verdict = ("ok" if r["ok"] else "OUT") if r["checked"] else "- (real > model)"
        ps = r["op"] in PS
        serving = f"{r['server_ms']:7.3f} {r['server_each_ms']:7.3f}" if ps else " " * 15
        print(f"{r['op']:<10} {r['pushers'] or '':>2} {human(r['bytes']):>9} "
              f"{r['real_ms']:9.3f} {serving} {r['model_ms']:9.3f} {r['measured_ms']:9.3f} "
              f"{r['ratio']:8.3f} {r['cluster_ms']:9.3f} {r['cluster_ratio']:8.3f}  {verdict}")
    checked = [r for r in rows if r["checked"]]
    def worst(column):
        r = max(checked, key=lambda r: r[column])
        return f"{r['op']}{' x' + str(r['pushers']) if r['pushers'] else ''} " \
               f"{human(r['bytes'])} {r[column]:.2f}"
    print(f"# {sum(r['ok'] for r in checked)} of {len(checked)} checked rows within 10% of "
          f"the model by cluster time ({sum(r['ok_wall'] for r in checked)} by wall time)"
          + (f"; worst: cluster {worst('cluster_ratio')}, wall {worst('ratio')}"
             if checked else ""))


def plot(rows: list, path: str, title: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    panels = [(op, None) for op in COLLECTIVES] + [(op, None) for op in PS]
    fig, axes = plt.subplots(2, 3, figsize=(14, 8))
    for ax, (op, _) in zip(axes.flat, panels):
        groups = sorted({r["pushers"] for r in rows if r["op"] == op}, key=lambda p: p or 0)
        for k, pushers in enumerate(groups):
            mine = [r for r in rows if r["op"] == op and r["pushers"] == pushers]
            if not mine:
                continue
            x = [r["bytes"] for r in mine]
            label = f" ({pushers} pusher{'s' if pushers > 1 else ''})" if pushers else ""
            color = f"C{k}"
            ax.plot(x, [r["model_ms"] for r in mine], "-", color=color, label="model" + label)
            ax.plot(x, [r["measured_ms"] for r in mine], "o", color=color,
                    label="measured, --link" + label)
            ax.plot(x, [r["cluster_ms"] for r in mine], "+", color=color, markersize=10,
                    label="cluster time, --link" + label)
            ax.plot(x, [r["real_ms"] for r in mine], "x:", color=color, alpha=0.6,
                    label="no link" + label)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_title(op)
        ax.set_xlabel("bytes")
        ax.set_ylabel("ms")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(title)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=110)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--link", default="50us,1.25GB/s", help="the emulated link (10 GbE here)")
    p.add_argument("--ranks", type=int, default=4, help="ranks (PS: workers, plus 1 server)")
    p.add_argument("--sizes", default="4K,64K,1M,16M,64M", help="comma-separated, e.g. 4K,1M")
    p.add_argument("--reps", type=int, default=5, help="repetitions (median)")
    p.add_argument("--jobs", default="collectives,ps", help="which jobs: collectives, ps or both")
    p.add_argument("--arrive", choices=("busy", "idle"), default="busy",
                   help="how ranks wait for each repetition's start: spinning (from compute) "
                        "or asleep (a cold call)")
    p.add_argument("--json", metavar="PATH")
    p.add_argument("--plot", metavar="PNG")
    p.add_argument("--worker", choices=("collectives", "ps"), help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    args = p.parse_args()
    args.sizes = [parse_bytes(s) for s in args.sizes.split(",")]
    jobs = [j.strip() for j in args.jobs.split(",")]
    if not jobs or set(jobs) - {"collectives", "ps"}:
        p.error(f"--jobs {args.jobs!r}: name collectives, ps or both, comma-separated")
    if args.worker:
        worker(args)
        return
    rows, collectives = [], []
    with tempfile.TemporaryDirectory() as tmp:
        for kind in jobs:
            real = run_job(kind, args, None, os.path.join(tmp, f"{kind}-real.json"))
            paced = run_job(kind, args, args.link, os.path.join(tmp, f"{kind}-link.json"))
            rows += combine(args, real, paced)
            if kind == "collectives":
                collectives = [real, paced]
    wake_us = wake_up_us(collectives)
    print_table(args, rows, wake_us)
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(dict(meta=dict(link=args.link, ranks=args.ranks, reps=args.reps, arrive=args.arrive,
                                     cpus=os.cpu_count(), host=os.uname().nodename,
                                     load=os.getloadavg()[0], wake_up_us=wake_us[0],
                                     wake_up_cluster_us=wake_us[1]), rows=rows),
                      f, indent=1)
    if args.plot:
        plot(rows, args.plot, f"pycoll under --link {args.link}, {args.ranks} ranks: "
                              "measured against the alpha-beta model")


if __name__ == "__main__":
    main()
