"""What the timeline costs: small allreduces with the timeline off and recording.

    pycollrun -np 2 python bench/timeline_cost.py

Blocking ``allreduce_`` (the compiled short path while no timeline or report is
configured; "stopped": configured but not recording, so the general path) and ``allreduce_async_`` + ``wait`` (the engine's path), on the same buffers,
off and recording interleaved batch by batch (``setup`` switches before each batch),
raw mpi4py beside them; medians of several batches. What the hooks cost when nothing is
configured is the "off" column against a build without them (README: the timeline).
"""
import argparse
import os
import tempfile

import numpy as np
from mpi4py import MPI

import pycoll
from pycoll import timeline
from harness import interleave, machine, machine_line, median


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--iters", type=int, default=2000)
    parser.add_argument("--batches", type=int, default=7)
    args = parser.parse_args()
    path = os.path.join(tempfile.gettempdir(), f"pycoll-bench-trace-{os.getppid()}.json")
    pycoll.init(timeline=path, timeline_max_events=10_000)     # bounded: batches are long
    comm = MPI.COMM_WORLD

    def off():
        timeline.stop()
        pycoll.configure(timeline=None)        # the short path is back

    def stopped():                             # configured (no short path), not recording
        pycoll.configure(timeline=path)
        timeline.stop()

    def recording():
        pycoll.configure(timeline=path)
        timeline.start()
    if comm.rank == 0:
        print(machine_line("timeline cost, allreduce (Sum, float32, in place)", machine()))
        print(f"{'bytes':>6} {'mpi4py':>7} {'off':>7} {'stopped':>8} {'on':>7} "
              f"{'on/stopped':>10} {'async off':>10} {'async on':>9} {'on/off':>7}   "
              "(us per call)")
    for nbytes in (4, 1024):
        a = np.zeros(nbytes // 4, np.float32)
        blocking = lambda: pycoll.allreduce_(a, op=pycoll.Sum)      # noqa: E731
        queued = lambda: pycoll.allreduce_async_(a, op=pycoll.Sum).wait()    # noqa: E731
        times = interleave(
            {"mpi4py": lambda: comm.Allreduce(MPI.IN_PLACE, a), "off": blocking,
             "stopped": blocking, "on": blocking, "async off": queued, "async on": queued},
            args.iters, warmup=100, batches=args.batches,
            setup={"mpi4py": off, "off": off, "stopped": stopped, "on": recording,
                   "async off": off, "async on": recording})
        us = {name: median(t) * 1e6 for name, t in times.items()}
        if comm.rank == 0:
            print(f"{nbytes:>6} {us['mpi4py']:>7.2f} {us['off']:>7.2f} {us['stopped']:>8.2f} "
                  f"{us['on']:>7.2f} {us['on'] / us['stopped']:>10.2f} {us['async off']:>10.2f} "
                  f"{us['async on']:>9.2f} {us['async on'] / us['async off']:>7.2f}", flush=True)
    off()                                       # no trace written at exit
    if comm.rank == 0:
        hooks_off(us["async off"], 100 * args.iters)


def hooks_off(async_us: float, n: int) -> None:
    """What the hooks cost while nothing is configured, timed alone: an async allreduce
    of one tensor passes two ``if timeline.on`` tests (queued, run) and one ``phase``
    ("in MPI"); a blocking one on the short path none."""
    import timeit
    assert not timeline.on
    test = min(timeit.repeat("timeline.on", globals=globals(), number=n, repeat=5)) / n
    phase = min(timeit.repeat('with timeline.phase("in MPI"): pass', globals=globals(),
                              number=n, repeat=5)) / n
    empty = min(timeit.repeat("pass", number=n, repeat=5)) / n
    test, phase = test - empty, phase - empty
    added = 2 * test + phase
    print(f"hooks while off: 'if timeline.on' {test * 1e9:.0f} ns, 'with timeline.phase()' "
          f"{phase * 1e9:.0f} ns; per async allreduce {added * 1e9:.0f} ns = "
          f"{100 * added / (async_us * 1e-6):.2f}% of its {async_us:.1f} us", flush=True)


if __name__ == "__main__":
    main()
