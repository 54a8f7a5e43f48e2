#!/usr/bin/env python
"""Collectives microbenchmark: pycoll against raw mpi4py and torch.distributed (gloo), and
torch.distributed on pycoll's backend.

    mpiexec -n 4 --oversubscribe python bench/collectives.py [--ops allreduce,alltoall]
        [--min-bytes 4] [--max-bytes 64M] [--step-factor 4] [--dtype float32]
        [--iters 20] [--target-ms 20] [--warmup 5] [--batches 5] [--check] [--json PATH]
        [--plot PNG]
        [--no-gloo] [--numpy]

Modelled on nccl-tests: one harness, and per collective a table entry saying how to lay
out its buffers, how each implementation calls it and what it must produce. The three
implementations share memory: numpy arrays for mpi4py, torch views of the same arrays
(torch.from_numpy) for pycoll and gloo (--numpy: pycoll gets the numpy arrays, to tell
torch's accessors from pycoll's own cost). Forms timed: in place, or into a given output
(out=), as mpi4py's calls reuse theirs, so that no row measures an allocation:

  allreduce       pycoll.allreduce_(t, op=Sum)          Allreduce(IN_PLACE)   dist.all_reduce
  allgather       pycoll.allgather(t, out=r)            Allgather             dist.all_gather_single
  broadcast       pycoll.broadcast_(t, root=0)          Bcast                 dist.broadcast
  reduce_scatter  pycoll.reduce_scatter(t, Sum, out=r)  Reduce_scatter_block  dist.reduce_scatter_single
  alltoall        pycoll.alltoall(t, out=r)             Alltoall              dist.all_to_all_single

torch-pycoll makes gloo's torch.distributed calls on a group of pycoll's backend
(dist.new_group(backend="pycoll")): what a torch user gets from pycoll in gloo's place.

Size is nccl-tests' size: the larger per-rank buffer (allgather's output, reduce_scatter's
and alltoall's input), rounded down to a multiple of ranks x itemsize where the op splits
it. algbw = size / time; busbw = algbw x 2(n-1)/n (allreduce), (n-1)/n (allgather,
reduce_scatter, alltoall) or 1 (broadcast). Time per op: mean over a batch, max over
ranks. A batch is --iters calls (fewer past 4 MiB), or as many as fill --target-ms (at
most 100 x --iters), whichever is more, so latency-bound sizes average thousands of calls
as OSU's latency tests do, not a handful. The table quotes the median of --batches
batches, the implementations interleaved batch by batch (in rotating order) so that
machine noise hits them alike.
--check then verifies every implementation against numpy on every rank (--iters 0: only).
The header gives the host's memcpy bandwidth, measured in the same run, as the physical
reference; after the allreduce table come the ratios issue 3 sets targets for; --plot
draws busbw against size, one panel per collective. Timing helpers: bench/harness.py.
"""
import argparse
import importlib
import math
import os
import sys
import time
from dataclasses import dataclass
from typing import Callable

import numpy as np
from mpi4py import MPI

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from harness import (MiB, comm, human_bytes, interleave, iters_for_time, machine,  # noqa: E402
                     machine_line, median, memcpy_gbps, memcpy_line, parse_bytes, pycoll,
                     setup_gloo, teardown_gloo, time_batch, write_json)

IMPLS = ("pycoll", "mpi4py", "gloo", "torch-pycoll")
DTYPES = ("float32", "float64", "int32", "int64")
torch = dist = None                              # set in main() by setup_gloo()
PYCOLL_GROUP = None                              # torch-pycoll's process group
NUMPY = False                                    # --numpy: pycoll gets the numpy arrays


class Bufs:
    """One op's buffers: numpy ``send``/``recv``, torch views ``tsend``/``trecv``, and what
    pycoll gets, ``psend``/``precv`` (the torch views, or with --numpy the arrays)."""

    def __init__(self, send: np.ndarray, recv: np.ndarray):
        self.send, self.recv = send, recv
        # Without torch (or with --numpy), pycoll gets the numpy arrays themselves.
        view = torch.from_numpy if torch is not None else (lambda a: a)
        self.tsend = view(send)
        self.trecv = self.tsend if recv is send else view(recv)
        self.psend, self.precv = (send, recv) if NUMPY else (self.tsend, self.trecv)


def pattern(rank: int, count: int, dtype) -> np.ndarray:
    """Rank-tagged small integers: exact in every dtype, sums included."""
    return ((np.arange(count) % 61) + 100 * rank).astype(dtype)


def world_sum(count, n, dtype):
    return sum(pattern(r, count, np.int64) for r in range(n)).astype(dtype)


def block(a: np.ndarray, i: int, n: int) -> np.ndarray:
    b = len(a) // n
    return a[i * b:(i + 1) * b]


@dataclass
class Coll:
    """A table entry. ``count`` is the size in elements; calls return their output or None
    (then the output is ``recv``); ``expected(count, n, rank, dtype)`` is rank's output."""
    send_recv: Callable      # (count, n) -> (send count, recv count); equal means in place
    bus: Callable            # n -> busbw / algbw
    pycoll: Callable
    mpi4py: Callable
    torch: Callable          # (bufs, group): gloo's on the default group, torch-pycoll's on pycoll's
    expected: Callable
    in_place: bool = False   # one buffer, any size; the others split the size across ranks


COLLS = {
    "allreduce": Coll(
        lambda c, n: (c, c), lambda n: 2 * (n - 1) / n,
        lambda b: pycoll.allreduce_(b.psend, op=pycoll.Sum),
        lambda b: comm.Allreduce(MPI.IN_PLACE, b.send, op=MPI.SUM),
        lambda b, g: dist.all_reduce(b.tsend, group=g),
        lambda c, n, r, dt: world_sum(c, n, dt), in_place=True),
    "allgather": Coll(
        lambda c, n: (c // n, c), lambda n: (n - 1) / n,
        lambda b: pycoll.allgather(b.psend, out=b.precv),
        lambda b: comm.Allgather(b.send, b.recv),
        lambda b, g: dist.all_gather_single(b.trecv, b.tsend, group=g),
        lambda c, n, r, dt: np.concatenate([pattern(j, c // n, dt) for j in range(n)])),
    "broadcast": Coll(
        lambda c, n: (c, c), lambda n: 1.0,
        lambda b: pycoll.broadcast_(b.psend, root=0),
        lambda b: comm.Bcast(b.send, root=0),
        lambda b, g: dist.broadcast(b.tsend, src=0, group=g),
        lambda c, n, r, dt: pattern(0, c, dt), in_place=True),
    "reduce_scatter": Coll(
        lambda c, n: (c, c // n), lambda n: (n - 1) / n,
        lambda b: pycoll.reduce_scatter(b.psend, op=pycoll.Sum, out=b.precv),
        lambda b: comm.Reduce_scatter_block(b.send, b.recv, op=MPI.SUM),
        lambda b, g: dist.reduce_scatter_single(b.trecv, b.tsend, group=g),
        lambda c, n, r, dt: block(world_sum(c, n, dt), r, n)),
    "alltoall": Coll(
        lambda c, n: (c, c), lambda n: (n - 1) / n,
        lambda b: pycoll.alltoall(b.psend, out=b.precv)[0],
        lambda b: comm.Alltoall(b.send, b.recv),
        lambda b, g: dist.all_to_all_single(b.trecv, b.tsend, group=g),
        lambda c, n, r, dt: np.concatenate([block(pattern(j, c, dt), r, n)
                                            for j in range(n)])),
}


def make_bufs(coll: Coll, count: int, n: int, dtype) -> Bufs:
    s, r = coll.send_recv(count, n)
    send = np.zeros(s, dtype)        # zeros: in-place Sum repeated stays finite
    return Bufs(send, send if coll.in_place else np.zeros(r, dtype))


def run(coll: Coll, impl: str, bufs: Bufs):
    out = (coll.torch(bufs, None) if impl == "gloo" else
           coll.torch(bufs, PYCOLL_GROUP) if impl == "torch-pycoll" else getattr(coll, impl)(bufs))
    return bufs.recv if out is None else out


def check(coll, impl, bufs, count, n, dtype) -> bool:
    """Run once on rank-tagged data; True on every rank iff every rank got numpy's answer."""
    bufs.send[:] = pattern(comm.rank, len(bufs.send), dtype)
    if bufs.recv is not bufs.send:
        bufs.recv[:] = -1            # stale output from another implementation must not pass
    out = np.asarray(run(coll, impl, bufs))
    ok = np.array_equal(out.reshape(-1), coll.expected(count, n, comm.rank, dtype))
    bufs.send[:] = 0
    return bool(comm.allreduce(ok, op=MPI.LAND))


def sizes(args):
    s = args.min_bytes
    while s <= args.max_bytes:
        yield s
        s = max(s + 1, int(s * args.step_factor))


def iters_for(nbytes: int, iters: int) -> int:
    # Full --iters up to 4 MiB, then about 4 MiB x iters of data per batch (at least 4),
    # so that the 64 MiB end of the sweep costs seconds, not minutes.
    return min(iters, max(4, iters * 4 * MiB // nbytes))


def header(args, note: str, mach: dict, memcpy: float) -> str:
    return (machine_line("collectives", mach) + f", dtype {args.dtype}, op sum\n"
            + memcpy_line(memcpy) + (f"\n# note: {note}" if note else ""))


def fmt(x, width, prec):
    return f"{'-':>{width}}" if x is None else f"{x:{width}.{prec}f}"


def print_table_head(op, impls, with_check):
    cols = "".join(f" | {i + ' time(us)':>16} {'algbw':>7} {'busbw':>7}" for i in impls)
    print(f"\n# {op}  (algbw, busbw in GB/s; ratios of times: >1 means the first is slower)")
    print(f"# {'size(B)':>10} {'count':>10} {'type':>8}{cols} | {'pyc/mpi':>7} "
          f"{'gloo/pyc':>8} {'gloo/tpc':>8}" + (" | check" if with_check else ""), flush=True)


def bench_op(op, args, impls, n, dtype, rows) -> bool:
    coll, itemsize, all_ok = COLLS[op], np.dtype(dtype).itemsize, True
    if comm.rank == 0:
        print_table_head(op, impls, args.check)
    for size in sizes(args):
        count = size // itemsize
        if not coll.in_place:
            count -= count % n
        if count == 0:               # too small to give every rank an element
            continue
        nbytes, bufs = count * itemsize, make_bufs(coll, count, n, dtype)
        times = {i: [] for i in impls}
        iters = dict.fromkeys(impls, iters_for(nbytes, args.iters))
        if args.iters:
            fns = {i: (lambda i=i: run(coll, i, bufs)) for i in impls}
            warmup = max(1, min(args.warmup, iters[impls[0]]))
            if args.target_ms:      # latency-bound sizes: many calls, not a handful
                for i in impls:
                    time_batch(fns[i], warmup)
                    iters[i] = max(iters[i], iters_for_time(fns[i], args.target_ms / 1e3,
                                                            100 * args.iters))
            times = interleave(fns, iters, warmup, args.batches)
        oks = {i: check(coll, i, bufs, count, n, dtype) for i in impls} if args.check else {}
        all_ok &= all(oks.values())
        t = {i: median(times[i]) for i in impls}
        cells = ""
        for impl in impls:
            alg = nbytes / t[impl] / 1e9 if t[impl] else None
            bus = alg * coll.bus(n) if alg is not None else None
            us = t[impl] and t[impl] * 1e6
            cells += f" | {fmt(us, 16, 1)} {fmt(alg, 7, 3)} {fmt(bus, 7, 3)}"
            rows.append(dict(op=op, bytes=nbytes, count=count, dtype=args.dtype, impl=impl,
                             time_us=us, algbw=alg, busbw=bus,
                             iters=iters[impl], batches_us=[x * 1e6 for x in times[impl]],
                             check=oks.get(impl)))

        def ratio(a, b):
            return t[a] / t[b] if t.get(a) and t.get(b) else None
        failed = [i for i in impls if not oks.get(i, True)]
        verdict = (" | " + ("OK" if not failed else "FAIL " + ",".join(failed))
                   if args.check else "")
        if comm.rank == 0:
            print(f"  {nbytes:>10} {count:>10} {args.dtype:>8}{cells} | "
                  f"{fmt(ratio('pycoll', 'mpi4py'), 7, 2)} {fmt(ratio('gloo', 'pycoll'), 8, 2)} "
                  f"{fmt(ratio('gloo', 'torch-pycoll'), 8, 2)}{verdict}", flush=True)
    return all_ok


def targets(rows) -> dict:
    """Issue 3's allreduce targets from this run's medians (None where a size was not run):
    64 MiB pycoll/mpi4py time (<= 1.05), the worst pycoll - mpi4py latency over 4 B..1 KiB
    in us (<= 10), gloo/pycoll time at 1 MiB (>= 5) and at 64 MiB (>= 2)."""
    t = {(r["bytes"], r["impl"]): r["time_us"] for r in rows if r["op"] == "allreduce"}

    def ratio(size, a, b):
        return t[size, a] / t[size, b] if t.get((size, a)) and t.get((size, b)) else None
    small = [t[s, "pycoll"] - t[s, "mpi4py"] for s in sorted({s for s, _ in t})
             if 4 <= s <= 1024 and t.get((s, "pycoll")) and t.get((s, "mpi4py"))]
    return {"allreduce_64MiB_pycoll_over_mpi4py": ratio(64 * MiB, "pycoll", "mpi4py"),
            "allreduce_4B_1KiB_max_pycoll_minus_mpi4py_us": max(small) if small else None,
            "allreduce_1MiB_gloo_over_pycoll": ratio(MiB, "gloo", "pycoll"),
            "allreduce_64MiB_gloo_over_pycoll": ratio(64 * MiB, "gloo", "pycoll")}


def short_path_lines(rows, ops) -> list:
    """Issue 27's targets for every collective, from this run's medians: the worst
    pycoll - mpi4py up to 64 KiB (<= +5 us) and the worst pycoll/mpi4py from 1 MiB
    (<= 1.1)."""
    lines = []
    for op in ops:
        t = {(r["bytes"], r["impl"]): r["time_us"] for r in rows if r["op"] == op}
        sizes = sorted({size for size, impl in t if impl == "pycoll" and (size, "mpi4py") in t})
        small = [t[s, "pycoll"] - t[s, "mpi4py"] for s in sizes if s <= 64 * 1024]
        large = [t[s, "pycoll"] / t[s, "mpi4py"] for s in sizes if s >= MiB]
        lines.append(f"# {op}: pycoll - mpi4py up to 64 KiB, worst "
                     + (f"{max(small):+.1f} us" if small else "-") + " (<= +5); "
                     + "pycoll/mpi4py from 1 MiB, worst "
                     + (f"{max(large):.2f}" if large else "-") + " (<= 1.10)")
    return lines


def targets_line(tg: dict) -> str:
    def f(x, spec):
        return "-" if x is None else format(x, spec)
    return ("# targets (allreduce medians, this run): "
            f"64 MiB pycoll/mpi4py {f(tg['allreduce_64MiB_pycoll_over_mpi4py'], '.3f')} (<= 1.05); "
            f"4 B-1 KiB pycoll - mpi4py max "
            f"{f(tg['allreduce_4B_1KiB_max_pycoll_minus_mpi4py_us'], '+.1f')} us (<= +10); "
            f"gloo/pycoll 1 MiB {f(tg['allreduce_1MiB_gloo_over_pycoll'], '.2f')} (>= 5), "
            f"64 MiB {f(tg['allreduce_64MiB_gloo_over_pycoll'], '.2f')} (>= 2)")


def plot(path: str, rows, ops, impls, mach: dict, memcpy: float, dtype: str) -> None:
    """A PNG of busbw against size (log x), one panel per collective, memcpy as reference."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter
    cols = min(3, len(ops))
    nrows = math.ceil(len(ops) / cols)
    fig, axes = plt.subplots(nrows, cols, figsize=(5.2 * cols, 3.9 * nrows), squeeze=False)
    for ax, op in zip(axes.flat, ops):
        for impl in impls:
            pts = sorted((r["bytes"], r["busbw"]) for r in rows
                         if r["op"] == op and r["impl"] == impl and r["busbw"] is not None)
            if pts:
                ax.plot(*zip(*pts), marker="o", markersize=3, label=impl)
        ax.axhline(memcpy, color="gray", linestyle="--", linewidth=1,
                   label=f"memcpy {memcpy:.1f} GB/s")
        ax.set_xscale("log", base=2)
        ax.xaxis.set_major_formatter(FuncFormatter(lambda x, _: human_bytes(x).replace(" ", "")))
        ax.set_title(op)
        ax.set_xlabel("size per rank")
        ax.set_ylabel("busbw (GB/s)")
        ax.grid(True, which="major", alpha=0.3)
        ax.legend(fontsize=8)
    for ax in list(axes.flat)[len(ops):]:
        ax.set_visible(False)
    fig.suptitle(f"pycoll {mach['pycoll']} vs mpi4py vs gloo, {dtype}: {mach['host']} "
                 f"({mach['cpus']} cores), {mach['ranks']} ranks, {mach['mpi']}")
    fig.tight_layout()
    if os.path.dirname(path):
        os.makedirs(os.path.dirname(path), exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--ops", default=",".join(COLLS), help="comma-separated, from: %(default)s")
    p.add_argument("--min-bytes", type=parse_bytes, default=4, help="e.g. 4, 1K, 8M")
    p.add_argument("--max-bytes", type=parse_bytes, default=64 * MiB)
    p.add_argument("--step-factor", type=float, default=4.0)
    p.add_argument("--dtype", choices=DTYPES, default="float32")
    p.add_argument("--iters", type=int, default=20, help="per batch, up to 4 MiB; 0: no timing")
    p.add_argument("--target-ms", type=float, default=20,
                   help="at least this long a batch, up to 100 x --iters calls; 0: --iters only")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--batches", type=int, default=5, help="median of this many batches")
    p.add_argument("--check", action="store_true", help="verify results; exit 1 on failure")
    p.add_argument("--json", metavar="PATH", help="write every row and the metadata")
    p.add_argument("--plot", metavar="PNG", help="write a plot of busbw against size")
    p.add_argument("--no-gloo", action="store_true", help="skip torch.distributed")
    p.add_argument("--numpy", action="store_true",
                   help="pycoll gets the numpy arrays mpi4py gets, not torch views of them")
    args = p.parse_args(argv)
    ops = [o.strip() for o in args.ops.split(",") if o.strip()]
    unknown = set(ops) - set(COLLS)
    if unknown or args.step_factor <= 1 or args.batches < 1 or args.min_bytes < 1:
        p.error(f"unknown ops {sorted(unknown)}" if unknown else
                "need --step-factor > 1, --batches >= 1, --min-bytes >= 1")

    global torch, dist, NUMPY, PYCOLL_GROUP
    torch, dist, note = setup_gloo(args.no_gloo)
    NUMPY = args.numpy
    if NUMPY:
        note = (note + "; " if note else "") + "pycoll on the numpy arrays (--numpy)"
    impls = IMPLS if dist is not None and dist.is_initialized() else IMPLS[:2]
    pycoll.init()
    if "torch-pycoll" in impls:
        importlib.import_module("pycoll.torch")     # registers the backend
        PYCOLL_GROUP = dist.new_group(backend="pycoll")
    n, rows, ok = comm.size, [], True
    t0, load0 = time.perf_counter(), os.getloadavg()
    mach, memcpy = machine(torch), memcpy_gbps()
    if comm.rank == 0:
        print(header(args, note, mach, memcpy), flush=True)
    for op in ops:
        ok &= bench_op(op, args, impls, n, np.dtype(args.dtype), rows)
    elapsed = time.perf_counter() - t0
    tg = targets(rows) if "allreduce" in ops and args.iters else None
    if comm.rank == 0:
        if tg:
            print("\n" + targets_line(tg))
        if args.iters:
            print("\n" + "\n".join(short_path_lines(rows, ops)))
        # the load decides what a 4-rank run on 2 cores measures: say what it was
        load = "; load average " + " -> ".join(f"{x[0]:.1f}" for x in (load0, os.getloadavg()))
        print(f"\n# {elapsed:.1f} s{load}" + ("" if not args.check else
              "; check " + ("OK" if ok else "FAILED")), flush=True)
        if args.json:
            meta = dict(mach, mpi=MPI.Get_library_version().strip(), memcpy_gbps=memcpy,
                        load_average=[load0[0], os.getloadavg()[0]],
                        impls=list(impls), note=note, args=vars(args), elapsed_s=elapsed,
                        check_ok=ok if args.check else None, targets=tg)
            write_json(args.json, meta, rows)
        if args.plot:
            plot(args.plot, rows, ops, impls, mach, memcpy, args.dtype)
            print(f"# plot: {args.plot}", flush=True)
    teardown_gloo(dist)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
