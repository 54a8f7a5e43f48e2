#!/usr/bin/env python
"""Tensor-fusion benchmark: many tensors allreduced by pycoll's engine, against the floor
(one raw MPI Allreduce of the same bytes pre-concatenated), one raw call per tensor and
torch.distributed gloo.

    pycollrun -np 4 python bench/fusion.py [--cases resnet50,small,large]
        [--thresholds 1M,4M,16M,64M,128M] [--chunks 1M,2M,4M,8M,64M] [--cycles 0,0.5,2]
        [--iters 20] [--target-ms 300] [--warmup 2] [--batches 5] [--small-count 1000]
        [--small-bytes 4K] [--large-bytes 64M] [--scale 1] [--ops sum,average]
        [--kinds torch,numpy] [--check] [--parts] [--json PATH] [--no-gloo]

Cases (float32, op Sum, each tensor its own allocation, zero-filled so that repeated
in-place sums stay finite):

  resnet50  ResNet-50's 161 gradient tensors (RESNET50_SHAPES below, torchvision's order,
            25,557,032 parameters), issued in reverse, the order backward produces them
  small     --small-count tensors of --small-bytes (1,000 x 4 KiB)
  large     one tensor of --large-bytes (64 MiB): no fusion, PYCOLL_CHUNK_BYTES pieces

Implementations, per pass over a case's tensors:

  pycoll             allreduce_async_(t, Sum) on every tensor, then wait on every Work: the
                     engine fuses them (PYCOLL_FUSION_THRESHOLD) and runs them on its thread
  pycoll-grouped     grouped_allreduce_(tensors, Sum): the same fusion, in one call
  pycoll-grouped-new grouped_allreduce(tensors, Sum): the same, the results a new list
                     (views of one new buffer)
  FORM:OP:KIND       each of those three forms with op OP (--ops) on KIND (--kinds: the
                     torch views or the numpy arrays themselves); the names above are
                     sum:torch
  mpi4py-concat      ONE Allreduce(IN_PLACE) of a buffer holding all the bytes: the floor
  mpi4py-per-tensor  one Allreduce(IN_PLACE) per tensor
  gloo-per-tensor    dist.all_reduce(t, async_op=True) on every tensor, then wait on all
  gloo-concat        dist.all_reduce of the pre-concatenated buffer

Time per pass: mean over a batch on the slowest rank; batches of about --target-ms (at
most --iters passes), implementations interleaved batch by batch; tables quote the median
of --batches batches, and each ratio the median of the per-batch ratios (bench/harness.py).
algbw = bytes / time, busbw = algbw x 2(n-1)/n.
Then one sweep per knob, the others at their defaults: pycoll on each case at each value
of --thresholds (PYCOLL_FUSION_THRESHOLD), --chunks (PYCOLL_CHUNK_BYTES) and --cycles
(PYCOLL_CYCLE_TIME_MS), set with pycoll.configure between batches and interleaved with the
floor; the number of MPI allreduces each made, and the best value over all cases: the
defaults in pycoll/config.py come from here. The header gives the host's memcpy
bandwidth measured in this run; the end, each rank's peak RSS and what pycoll's first
fused pass added to it, against the staging buffer (one chunk). --check compares
pycoll's fused results (Sum and Average, at the defaults and at every swept value) with
numpy on every rank.
--scale shrinks the ResNet-50 tensors (for tests; the shape list is checked at full size).
--parts first times the pieces of a grouped pass over the small case in one process, as
CPU time (at 1 rank MPI is a no-op, so a pass there is what it costs beyond MPI): reading
the list (tensors.host_pointers), packing and unpacking its bytes in one piece through a
buffer out of cache (_C.pack, _C.unpack), Average's scale, the new list's buffer (from
1 MiB a reused host block) and views (tensors.views_like), and each grouped form whole
(which packs and unpacks in pieces that stay in cache), and the issuing thread's CPU time
per allreduce_async_ call (the pycoll form's loop, its waits not counted). The header and the end give the load average: on a shared
machine it says what the times are worth.
"""
import argparse
import itertools
import math
import os
import sys
import time

import numpy as np
from mpi4py import MPI

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from collectives import pattern  # noqa: E402
from harness import (MiB, comm, human_bytes, interleave, iters_for_time, machine,  # noqa: E402
                     machine_line, median, memcpy_gbps, memcpy_line, paired_ratio, parse_bytes,
                     peak_rss_mib, pycoll, reset_peak_rss, rss_mib, setup_gloo,
                     teardown_gloo, write_json)

# ResNet-50 (torchvision.models.resnet50) parameters in model.parameters() order: conv
# weights (out, in, kh, kw), batch-norm weight and bias (c,), fc weight and bias.
RESNET50_SHAPES = [
    # stem: conv1, bn1
    (64, 3, 7, 7), (64,), (64,),
    # layer1.0 (+downsample)
    (64, 64, 1, 1), (64,), (64,), (64, 64, 3, 3), (64,), (64,), (256, 64, 1, 1), (256,),
    (256,), (256, 64, 1, 1), (256,), (256,),
    # layer1.1
    (64, 256, 1, 1), (64,), (64,), (64, 64, 3, 3), (64,), (64,), (256, 64, 1, 1), (256,),
    (256,),
    # layer1.2
    (64, 256, 1, 1), (64,), (64,), (64, 64, 3, 3), (64,), (64,), (256, 64, 1, 1), (256,),
    (256,),
    # layer2.0 (+downsample)
    (128, 256, 1, 1), (128,), (128,), (128, 128, 3, 3), (128,), (128,), (512, 128, 1, 1),
    (512,), (512,), (512, 256, 1, 1), (512,), (512,),
    # layer2.1
    (128, 512, 1, 1), (128,), (128,), (128, 128, 3, 3), (128,), (128,), (512, 128, 1, 1),
    (512,), (512,),
    # layer2.2
    (128, 512, 1, 1), (128,), (128,), (128, 128, 3, 3), (128,), (128,), (512, 128, 1, 1),
    (512,), (512,),
    # layer2.3
    (128, 512, 1, 1), (128,), (128,), (128, 128, 3, 3), (128,), (128,), (512, 128, 1, 1),
    (512,), (512,),
    # layer3.0 (+downsample)
    (256, 512, 1, 1), (256,), (256,), (256, 256, 3, 3), (256,), (256,), (1024, 256, 1, 1),
    (1024,), (1024,), (1024, 512, 1, 1), (1024,), (1024,),
    # layer3.1
    (256, 1024, 1, 1), (256,), (256,), (256, 256, 3, 3), (256,), (256,), (1024, 256, 1, 1),
    (1024,), (1024,),
    # layer3.2
    (256, 1024, 1, 1), (256,), (256,), (256, 256, 3, 3), (256,), (256,), (1024, 256, 1, 1),
    (1024,), (1024,),
    # layer3.3
    (256, 1024, 1, 1), (256,), (256,), (256, 256, 3, 3), (256,), (256,), (1024, 256, 1, 1),
    (1024,), (1024,),
    # layer3.4
    (256, 1024, 1, 1), (256,), (256,), (256, 256, 3, 3), (256,), (256,), (1024, 256, 1, 1),
    (1024,), (1024,),
    # layer3.5
    (256, 1024, 1, 1), (256,), (256,), (256, 256, 3, 3), (256,), (256,), (1024, 256, 1, 1),
    (1024,), (1024,),
    # layer4.0 (+downsample)
    (512, 1024, 1, 1), (512,), (512,), (512, 512, 3, 3), (512,), (512,), (2048, 512, 1, 1),
    (2048,), (2048,), (2048, 1024, 1, 1), (2048,), (2048,),
    # layer4.1
    (512, 2048, 1, 1), (512,), (512,), (512, 512, 3, 3), (512,), (512,), (2048, 512, 1, 1),
    (2048,), (2048,),
    # layer4.2
    (512, 2048, 1, 1), (512,), (512,), (512, 512, 3, 3), (512,), (512,), (2048, 512, 1, 1),
    (2048,), (2048,),
    # fc
    (1000, 2048), (1000,),
]
RESNET50_PARAMS = 25_557_032
assert len(RESNET50_SHAPES) == 161, len(RESNET50_SHAPES)
assert sum(math.prod(s) for s in RESNET50_SHAPES) == RESNET50_PARAMS

FORMS = ("pycoll", "pycoll-grouped", "pycoll-grouped-new")
IMPLS = FORMS + ("mpi4py-concat", "mpi4py-per-tensor", "gloo-per-tensor", "gloo-concat")


def form_name(form: str, op: str, kind: str) -> str:
    """pycoll's ``form`` with ``op`` on ``kind``: Sum on torch keeps the form's own name."""
    return form if (op, kind) == ("sum", "torch") else f"{form}:{op}:{kind}"
torch = dist = None                              # set in main() by setup_gloo()


class Case:
    """One list of tensors: numpy ``arrays`` (each its own allocation) with torch views
    ``tensors`` in issue order, and a pre-concatenated ``flat`` buffer of the same bytes."""

    def __init__(self, name: str, counts, label: str):
        self.name, self.label = name, label
        self.arrays = [np.empty(c, np.float32) for c in counts]
        self.flat = np.empty(sum(counts), np.float32)
        for a in self.arrays + [self.flat]:
            a[...] = 0               # touch every page now, so RSS counts the data
        view = torch.from_numpy if torch is not None else (lambda a: a)
        self.tensors = [view(a) for a in self.arrays]
        self.tflat = view(self.flat)
        self.nbytes = self.flat.nbytes

    def pycoll(self, op=None, kind="torch"):
        works = [pycoll.allreduce_async_(t, op=op or pycoll.Sum) for t in self.of(kind)]
        for w in works:
            w.wait()

    def pycoll_grouped(self, op=None, kind="torch"):
        pycoll.grouped_allreduce_(self.of(kind), op=op or pycoll.Sum)

    def pycoll_grouped_new(self, op=None, kind="torch"):
        return pycoll.grouped_allreduce(self.of(kind), op=op or pycoll.Sum)

    def of(self, kind: str) -> list:
        return self.tensors if kind == "torch" else self.arrays

    def form(self, name: str):
        """The call of pycoll's form ``name`` (FORMS, or FORM:OP:KIND)."""
        form, op, kind = (name.split(":") + ["sum", "torch"])[:3]
        run = {"pycoll": self.pycoll, "pycoll-grouped": self.pycoll_grouped,
               "pycoll-grouped-new": self.pycoll_grouped_new}[form]
        return lambda: run(pycoll.ReduceOp(op), kind)

    def fns(self, impls) -> dict:
        def mpi_concat():
            comm.Allreduce(MPI.IN_PLACE, self.flat, op=MPI.SUM)

        def mpi_per_tensor():
            for a in self.arrays:
                comm.Allreduce(MPI.IN_PLACE, a, op=MPI.SUM)

        def gloo_per_tensor():
            works = [dist.all_reduce(t, async_op=True) for t in self.tensors]
            for w in works:
                w.wait()

        def gloo_concat():
            dist.all_reduce(self.tflat)
        every = {"mpi4py-concat": mpi_concat,
                 "mpi4py-per-tensor": mpi_per_tensor, "gloo-per-tensor": gloo_per_tensor,
                 "gloo-concat": gloo_concat}
        return {i: every[i] if i in every else self.form(i) for i in impls}


def make_cases(args) -> list:
    cases = []
    for name in args.cases:
        if name == "resnet50":
            counts = [max(1, round(math.prod(s) * args.scale)) for s in reversed(RESNET50_SHAPES)]
            label = (f"ResNet-50 gradients: {len(counts)} tensors, {sum(counts):,} float32"
                     + (f" (--scale {args.scale:g})" if args.scale != 1 else ""))
        elif name == "small":
            counts = [max(1, args.small_bytes // 4)] * args.small_count
            label = f"{args.small_count} tensors of {human_bytes(counts[0] * 4)}, float32"
        else:
            counts = [max(1, args.large_bytes // 4)]
            label = f"one tensor of {human_bytes(counts[0] * 4)}, float32"
        cases.append(Case(name, counts, label))
    return cases


def check(case: Case) -> bool:
    """pycoll's fused Sum and Average (async and grouped) against numpy, on every rank;
    zeros again after."""
    n, ok = comm.size, True
    for op, fused, kind in itertools.product(
            (pycoll.Sum, pycoll.Average),
            (case.pycoll, case.pycoll_grouped, case.pycoll_grouped_new), ("torch", "numpy")):
        for i, a in enumerate(case.arrays):
            a[...] = pattern(comm.rank, len(a), np.float32) + i % 7
        results = fused(op, kind) or case.arrays    # the new list, or the tensors in place
        for i, a in enumerate(np.asarray(r) for r in results):
            want = sum(pattern(r, len(a), np.float64) for r in range(n)) + n * (i % 7)
            if op is pycoll.Average:
                want = want / n
            # Sums of small integers are exact; Average's scaling may round (3 ranks).
            ok &= bool(np.allclose(a, want, rtol=1e-6, atol=0) if op is pycoll.Average
                       else np.array_equal(a, want))
        for a in case.arrays:
            a[...] = 0
    return bool(comm.allreduce(ok, op=MPI.LAND))


def cpu_ms(fn, batches: int = 15, per: int = 10) -> float:
    """CPU time (process_time) of one call of ``fn`` in ms: the fastest quartile of
    ``batches`` batches of ``per`` calls, so other processes' load counts little."""
    times = []
    for _ in range(batches):
        t0 = time.process_time()
        for _ in range(per):
            fn()
        times.append((time.process_time() - t0) / per)
    return sorted(times)[len(times) // 4] * 1e3


def issue_us(xs, batches: int = 15) -> float:
    """CPU time of the issuing thread per ``allreduce_async_`` call over ``xs`` in us (the
    waits after each pass not counted): the fastest quartile of ``batches`` passes."""
    times = []
    for _ in range(batches):
        t0 = time.thread_time()
        works = [pycoll.allreduce_async_(x, op=pycoll.Sum) for x in xs]
        times.append((time.thread_time() - t0) / len(xs))
        for work in works:
            work.wait()
    return sorted(times)[len(times) // 4] * 1e6


def parts(case: Case) -> None:
    """Where a grouped pass over ``case`` goes, piece by piece, in this process (rank 0
    prints; every rank runs the whole passes, which are collective)."""
    from pycoll import _C, tensors
    lines = []
    for kind in ("torch", "numpy"):
        xs = case.of(kind)
        ptrs, sizes, dtype = tensors.host_pointers(xs)
        total, buffer = sum(sizes), np.empty(sum(sizes), np.uint8)
        runs = tensors.shape_runs(xs)       # the short path finds them in C
        staging = buffer.ctypes.data
        timed = {}
        if comm.rank == 0:
            timed.update({
                "read": cpu_ms(lambda: tensors.host_pointers(xs)),
                "pack": cpu_ms(lambda: _C.pack(staging, ptrs, sizes, 0, total)),
                "unpack+scale": cpu_ms(
                    lambda: _C.unpack(staging, ptrs, sizes, dtype, 0.5, 0, total)),
                "scale": cpu_ms(lambda: _C.scale(staging, total // 4, dtype, 0.5)),
                "new buffer+views": cpu_ms(lambda: tensors.views_like(xs[0], total, runs))})
        for op in ("sum", "average"):
            for form in FORMS[1:]:
                timed[f"{form} {op}"] = cpu_ms(case.form(form_name(form, op, kind)), 10, 5)
        issue = issue_us(xs)
        lines.append(f"#   {kind:>5}: " + ", ".join(f"{k} {v:.3f}" for k, v in timed.items())
                     + f"; allreduce_async_ issued {issue:.2f} us a call")
    if comm.rank == 0:
        print(f"\n# parts of a grouped pass over {case.label}, CPU ms of rank 0 (fastest "
              f"quartile; at {comm.size} rank(s)):\n" + "\n".join(lines), flush=True)


def load_line() -> str:
    return "# load average: " + " ".join(f"{x:.2f}" for x in os.getloadavg())


def count_batches(fn) -> int:
    """How many MPI allreduces (fused batches, or tensors sent alone) ``fn`` made, from
    counting calls to pycoll's internals; None if they are not where this expects."""
    import pycoll.collectives as C
    names = ("_allreduce_fused", "_allreduce_one")
    if not all(callable(getattr(C, n, None)) for n in names):
        fn()
        return None
    calls, saved = [0], {n: getattr(C, n) for n in names}

    def counted(f):
        def g(*a, **k):
            calls[0] += 1
            return f(*a, **k)
        return g
    try:
        for n in names:
            setattr(C, n, counted(saved[n]))
        fn()
    finally:
        for n in names:
            setattr(C, n, saved[n])
    return comm.allreduce(calls[0], op=MPI.MAX) or None


def set_knob(name: str, value) -> None:
    pycoll.configure(**{name: value})
    got = pycoll.config.get(name)
    assert got == value, f"configure({name}={value}) did not take: {got}"


def fmt(x, width, prec):
    return f"{'-':>{width}}" if x is None else f"{x:{width}.{prec}f}"


def bench_case(case: Case, impls, args, rows) -> dict:
    n = comm.size
    fns = case.fns(impls)
    for fn in fns.values():          # warm up, then size each batch to --target-ms
        for _ in range(args.warmup):
            fn()
    iters = {i: iters_for_time(fns[i], args.target_ms / 1e3, args.iters) for i in impls}
    times = interleave(fns, iters, 0, args.batches)
    t = {i: median(times[i]) for i in impls}

    def ratio(a, b):
        return paired_ratio(times, a, b)
    if comm.rank == 0:
        print(f"\n# {case.name}: {case.label} ({case.nbytes / MiB:.1f} MiB), "
              f"fusion threshold {human_bytes(pycoll.config.get('fusion_threshold'))}")
        print(f"# {'impl':>34} {'time(ms)':>10} {'algbw':>7} {'busbw':>7} {'/pycoll':>8} "
              f"{'/floor':>7} {'iters':>5}")
    for i in impls:
        alg = case.nbytes / t[i] / 1e9
        rows.append(dict(section="main", case=case.name, impl=i, tensors=len(case.arrays),
                         bytes=case.nbytes, threshold=pycoll.config.get("fusion_threshold"),
                         time_us=t[i] * 1e6, algbw=alg, busbw=alg * 2 * (n - 1) / n,
                         iters=iters[i], batches_us=[x * 1e6 for x in times[i]]))
        if comm.rank == 0:
            print(f"  {i:>34} {t[i] * 1e3:10.3f} {alg:7.3f} {alg * 2 * (n - 1) / n:7.3f} "
                  f"{fmt(ratio(i, 'pycoll'), 8, 2)} {fmt(ratio(i, 'mpi4py-concat'), 7, 2)} "
                  f"{iters[i]:>5}")
    r = {"pycoll/mpi4py-concat": ratio("pycoll", "mpi4py-concat"),
         "mpi4py-per-tensor/pycoll": ratio("mpi4py-per-tensor", "pycoll"),
         "mpi4py-per-tensor/pycoll-grouped": ratio("mpi4py-per-tensor", "pycoll-grouped"),
         "pycoll-grouped/mpi4py-concat": ratio("pycoll-grouped", "mpi4py-concat"),
         "pycoll-grouped-new/mpi4py-concat": ratio("pycoll-grouped-new", "mpi4py-concat"),
         "gloo-per-tensor/pycoll": ratio("gloo-per-tensor", "pycoll"),
         "gloo-concat/pycoll": ratio("gloo-concat", "pycoll")}
    forms = [i for i in impls if i.split(":")[0] in FORMS[1:]]
    worst = max(forms, key=lambda i: ratio(i, "mpi4py-concat") or 0, default=None)
    r["worst grouped form/mpi4py-concat"] = ratio(worst, "mpi4py-concat") if worst else None
    if comm.rank == 0:
        target = {"resnet50": "pycoll/mpi4py-concat <= 1.15",
                  "small": "mpi4py-per-tensor/pycoll >= 5 (either pycoll); every grouped "
                           "form/mpi4py-concat <= 2",
                  "large": "pycoll/mpi4py-concat <= 1.05, gloo-concat/pycoll >= 2"
                  }.get(case.name, "")
        print("# ratios: " + "; ".join(f"{k} {fmt(v, 0, 2)}" for k, v in r.items())
              + (f" ({worst})" if worst else "")
              + (f"  (target: {target})" if target else ""), flush=True)
    return r


SWEEPS = {  # knob: (label of a value, how a value is parsed)
    "fusion_threshold": (human_bytes, parse_bytes),
    "chunk_bytes": (human_bytes, parse_bytes),
    "cycle_time_ms": (lambda v: f"{v:g} ms", float),
}


def sweep(cases, knob: str, values, args, rows) -> dict:
    """pycoll at each value of ``knob``, interleaved with the floor; the best value."""
    label = SWEEPS[knob][0]
    default = pycoll.config.get(knob)
    results = {}
    for case in cases:
        names = [f"pycoll@{label(v)}" for v in values]
        fns = {name: case.pycoll for name in names}
        fns["mpi4py-concat"] = case.fns(["mpi4py-concat"])["mpi4py-concat"]
        setup = {name: (lambda v=v: set_knob(knob, v)) for name, v in zip(names, values)}
        batches, iters = {}, {}
        for name, v in zip(names, values):
            set_knob(knob, v)
            batches[name] = count_batches(case.pycoll)     # also a warm-up pass
            for _ in range(max(0, args.warmup - 1)):
                case.pycoll()
            iters[name] = iters_for_time(case.pycoll, args.target_ms / 1e3, args.iters)
        case.fns(["mpi4py-concat"])["mpi4py-concat"]()
        iters["mpi4py-concat"] = iters_for_time(fns["mpi4py-concat"], args.target_ms / 1e3,
                                                args.iters)
        times = interleave(fns, iters, 0, args.batches, setup)
        t = {k: median(v) for k, v in times.items()}
        best = min(names, key=lambda k: t[k])
        floor = {name: paired_ratio(times, name, "mpi4py-concat") for name in names}
        vs_best = {name: paired_ratio(times, name, best) for name in names}
        results[case.name] = {v: vs_best[name] for name, v in zip(names, values)}
        if comm.rank == 0:
            print(f"\n# sweep {knob} {case.name}: {case.label}; floor (mpi4py-concat) "
                  f"{t['mpi4py-concat'] * 1e3:.3f} ms")
            print(f"# {knob:>18} {'time(ms)':>10} {'/floor':>7} {'/best':>6} "
                  f"{'batches':>7} {'iters':>5}")
        for name, v in zip(names, values):
            rows.append(dict(section="sweep", knob=knob, value=v, case=case.name,
                             impl="pycoll", tensors=len(case.arrays), bytes=case.nbytes,
                             time_us=t[name] * 1e6, floor_us=t["mpi4py-concat"] * 1e6,
                             mpi_batches=batches[name], iters=iters[name],
                             batches_us=[x * 1e6 for x in times[name]]))
            if comm.rank == 0:
                print(f"  {label(v):>18} {t[name] * 1e3:10.3f} "
                      f"{fmt(floor[name], 7, 3)} {fmt(vs_best[name], 6, 3)} "
                      f"{batches[name] if batches[name] else '-':>7} {iters[name]:>5}"
                      + ("  <- best" if name == best else ""), flush=True)
    set_knob(knob, default)
    # Overall: the geometric mean over cases of time / that case's best.
    score = {v: math.exp(sum(math.log(results[c][v]) for c in results) / len(results))
             for v in values}
    best = min(values, key=lambda v: score[v])
    summary = dict(per_case={c: label(min(results[c], key=results[c].get)) for c in results},
                   score={label(v): s for v, s in score.items()}, best=best)
    if comm.rank == 0:
        print(f"\n# best {knob}: "
              + ", ".join(f"{c} {b}" for c, b in summary["per_case"].items())
              + f"; over all cases (geometric mean of time/best): {label(best)} ("
              + ", ".join(f"{k} {v:.3f}" for k, v in summary["score"].items()) + ")",
              flush=True)
    return summary


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--cases", default="resnet50,small,large", help="comma-separated: %(default)s")
    p.add_argument("--thresholds", default="1M,4M,16M,64M,128M",
                   help="fusion thresholds to sweep, comma-separated; '' for none")
    p.add_argument("--chunks", default="1M,2M,4M,8M,64M",
                   help="chunk sizes to sweep, comma-separated; '' for none")
    p.add_argument("--cycles", default="0,0.5,2",
                   help="cycle times (ms) to sweep, comma-separated; '' for none")
    p.add_argument("--iters", type=int, default=20, help="most passes in a batch")
    p.add_argument("--target-ms", type=float, default=300, help="about this long a batch")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--batches", type=int, default=5, help="median of this many batches")
    p.add_argument("--small-count", type=int, default=1000)
    p.add_argument("--small-bytes", type=parse_bytes, default=4096)
    p.add_argument("--large-bytes", type=parse_bytes, default=64 * MiB)
    p.add_argument("--scale", type=float, default=1.0, help="ResNet-50 tensor sizes x this")
    p.add_argument("--ops", default="sum,average", help="pycoll's forms with each of these ops")
    p.add_argument("--kinds", default="torch,numpy", help="... on each of these kinds")
    p.add_argument("--check", action="store_true", help="verify results; exit 1 on failure")
    p.add_argument("--parts", action="store_true",
                   help="time the pieces of a grouped pass over the small case first")
    p.add_argument("--json", metavar="PATH", help="write every row and the metadata")
    p.add_argument("--no-gloo", action="store_true", help="skip torch.distributed")
    args = p.parse_args(argv)
    args.cases = [c.strip() for c in args.cases.split(",") if c.strip()]
    sweeps = {knob: [SWEEPS[knob][1](x) for x in text.split(",") if x.strip()]
              for knob, text in (("fusion_threshold", args.thresholds),
                                 ("chunk_bytes", args.chunks), ("cycle_time_ms", args.cycles))}
    if (set(args.cases) - {"resnet50", "small", "large"} or not args.cases or args.batches < 1
            or args.iters < 1 or args.scale <= 0 or args.large_bytes < 4
            or min(sweeps["fusion_threshold"] + sweeps["chunk_bytes"], default=1) < 1
            or min(sweeps["cycle_time_ms"], default=0) < 0):
        p.error("need --cases from resnet50,small,large, --batches >= 1, --iters >= 1, "
                "--scale > 0, --large-bytes >= 4, thresholds and chunks >= 1, cycles >= 0")

    global torch, dist
    torch, dist, note = setup_gloo(args.no_gloo)
    variants = [(op, kind) for op in args.ops.split(",") for kind in args.kinds.split(",")]
    if not variants or any(op not in ("sum", "average", "min", "max", "prod")
                           or kind not in ("torch", "numpy") for op, kind in variants):
        p.error("--ops from sum,average,min,max,prod and --kinds from torch,numpy")
    impls = [form_name(f, op, kind) for f in FORMS for op, kind in variants] + [
        i for i in IMPLS[len(FORMS):] if dist is not None and dist.is_initialized()
        or not i.startswith("gloo")]
    pycoll.init()
    t0 = time.perf_counter()
    defaults = {knob: pycoll.config.get(knob) for knob in SWEEPS}
    mach, memcpy = machine(torch), memcpy_gbps()
    if comm.rank == 0:
        print(machine_line("fusion", mach) + ", float32, op sum\n" + memcpy_line(memcpy)
              + "\n# in use: " + ", ".join(f"{k} {SWEEPS[k][0](v)}" for k, v in defaults.items())
              + (f"\n# note: {note}" if note else "") + "\n" + load_line(), flush=True)

    cases = make_cases(args)
    # Memory: what pycoll's first fused pass over every case adds to the resident set
    # (its staging buffer and anything else), before the other implementations run,
    # after a 4-byte warm-up has imported its modules and started its threads. The
    # peak is reset first, so memcpy's transient 2 x 64 MiB (rank 0) does not count.
    pycoll.allreduce_async_(np.zeros(1, np.float32)).wait()
    peak_reset = reset_peak_rss()
    rss_before = rss_mib()
    for case in cases:
        case.pycoll()
    pycoll_extra = peak_rss_mib() - rss_before

    if args.parts:
        parts(next((c for c in cases if c.name == "small"), None)
              or make_cases(argparse.Namespace(**{**vars(args), "cases": ["small"]}))[0])
    ok = True
    if args.check:
        for case in cases:
            ok &= check(case)
        for knob, values in sweeps.items():
            for v in values:
                set_knob(knob, v)
                for case in cases:
                    ok &= check(case)
            set_knob(knob, defaults[knob])

    rows, ratios = [], {}
    for case in cases:
        ratios[case.name] = bench_case(case, impls, args, rows)
    peak_main = peak_rss_mib()
    best = {knob: sweep(cases, knob, values, args, rows)
            for knob, values in sweeps.items() if values}
    peak_end = peak_rss_mib()
    elapsed = time.perf_counter() - t0

    mem = comm.gather(dict(rank=comm.rank, rss_before_mib=rss_before,
                           pycoll_extra_mib=pycoll_extra, peak_main_mib=peak_main,
                           peak_rss_mib=peak_end, peak_reset=peak_reset), root=0)
    if comm.rank == 0:
        data = sum(c.nbytes for c in cases) * 2 / MiB     # per-tensor arrays + flat copies
        print(f"\n# memory per rank (MiB; pycoll's staging buffer is one chunk, "
              f"{human_bytes(defaults['chunk_bytes'])}, swept up to "
              f"{human_bytes(max(sweeps['chunk_bytes'], default=defaults['chunk_bytes']))}; "
              f"benchmark data {data:.0f}; the bound is threshold + chunk = "
              f"{(defaults['fusion_threshold'] + defaults['chunk_bytes']) / MiB:g}): rss before "
              f"pycoll, + pycoll's first fused pass (after a 4-byte warm-up), "
              f"peak after the runs at the defaults, peak RSS at the end (ru_maxrss"
              + (", reset after the memcpy probe and set-up)" if all(m["peak_reset"] for m in mem)
                 else ", including the memcpy probe's 128 MiB on rank 0)"))
        for m in mem:
            print(f"#   rank {m['rank']}: {m['rss_before_mib']:8.1f} "
                  f"{m['pycoll_extra_mib']:+8.1f} {m['peak_main_mib']:8.1f} "
                  f"{m['peak_rss_mib']:8.1f}")
        print(f"\n# {elapsed:.1f} s; " + load_line()[2:] + ("" if not args.check else
              "; check " + ("OK" if ok else "FAILED")), flush=True)
        if args.json:
            meta = dict(mach, mpi=MPI.Get_library_version().strip(), memcpy_gbps=memcpy,
                        impls=list(impls), note=note, args=vars(args), elapsed_s=elapsed,
                        defaults=defaults, sweeps=sweeps, ratios=ratios, best=best,
                        memory=mem, check_ok=ok if args.check else None)
            write_json(args.json, meta, rows)
    teardown_gloo(dist)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
