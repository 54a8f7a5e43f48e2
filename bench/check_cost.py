"""What PYCOLL_CHECK costs: small allreduces with and without the fingerprint exchange.

    pycollrun -np 4 python bench/check_cost.py

The same buffers, the two settings interleaved batch by batch (``setup`` switches the
knob before each batch), raw mpi4py beside them; medians of several batches.
"""
import argparse

import numpy as np
from mpi4py import MPI

import pycoll
from harness import interleave, machine, machine_line, median


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--iters", type=int, default=500)
    parser.add_argument("--batches", type=int, default=7)
    args = parser.parse_args()
    pycoll.init()
    comm = MPI.COMM_WORLD
    if comm.rank == 0:
        print(machine_line("PYCOLL_CHECK cost, allreduce (Sum, float32, in place)", machine()))
        print(f"{'bytes':>8} {'mpi4py us':>10} {'pycoll us':>10} {'+check us':>10} "
              f"{'check cost us':>14}")
    for nbytes in (4, 64, 1024, 16384):
        a = np.zeros(nbytes // 4, np.float32)
        times = interleave(
            {"mpi4py": lambda: comm.Allreduce(MPI.IN_PLACE, a),
             "pycoll": lambda: pycoll.allreduce_(a, op=pycoll.Sum),
             "check": lambda: pycoll.allreduce_(a, op=pycoll.Sum)},
            args.iters, warmup=50, batches=args.batches,
            setup={"mpi4py": lambda: None,
                   "pycoll": lambda: pycoll.configure(check=False),
                   "check": lambda: pycoll.configure(check=True)})
        us = {name: median(t) * 1e6 for name, t in times.items()}
        if comm.rank == 0:
            print(f"{nbytes:>8} {us['mpi4py']:>10.1f} {us['pycoll']:>10.1f} {us['check']:>10.1f} "
                  f"{us['check'] - us['pycoll']:>14.1f}", flush=True)


if __name__ == "__main__":
    main()
