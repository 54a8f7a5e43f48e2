"""Jobs test_emulation.py launches under ``pycollrun --link``: python emulation_job.py MODE.

ps     (1 server, W workers): one worker pushes 1 MiB, then all at once, then all pull;
       worker 0 prints the slowest worker's seconds for each as JSON. The emulation's
       pass over every receive queue (_FALLBACK_S) is off.
torch  (2 ranks): torch.distributed send/recv of 1 MiB on the "pycoll" backend; rank 1
       prints its receive's seconds as JSON.
partial (any ranks): partial all-reduces of 1.6 MB in groups of 3 that change every round,
       as Ripples' group generator makes them; rank 0 prints the rounds whose result was
       wrong anywhere and each round's fastest and slowest time over its model, as JSON.
Every phase starts at one instant on every rank (they share this machine's clock).
"""
import json
import math
import random
import sys
import time

import numpy as np
from mpi4py import MPI

import pycoll
from pycoll import emulation

MESSAGE = 1 << 20


def together(comm) -> float:
    start = comm.allreduce(time.monotonic(), op=MPI.MAX) + 0.005
    emulation.sleep_until(start)
    return start


def ps_job():
    import pycoll.ps as ps
    # No pass over every receive queue: a paced message completes as its record comes.
    emulation._FALLBACK_S = math.inf
    ps.init(servers=1, policy="asp")              # servers serve here, then exit
    comm, rank, workers = MPI.COMM_WORLD, pycoll.rank(), pycoll.size()
    w = np.full(MESSAGE // 4, rank, np.float32)
    ps.init_params({"w": w})
    worlds = pycoll.runtime.world().comm
    times = {}
    for phase, pushers in (("push_1", [0]), ("push_all", range(workers))):
        start = together(worlds)
        if rank in pushers:
            ps.push("w", w).wait()
        times[phase] = worlds.allreduce(time.monotonic() - start, op=MPI.MAX)
    start = together(worlds)
    ps.pull("w", w).wait()
    times["pull_all"] = worlds.allreduce(time.monotonic() - start, op=MPI.MAX)
    if rank == 0:
        print(json.dumps(dict(times, workers=workers)), flush=True)
    ps.shutdown()
    del comm


def torch_job():
    import torch
    import torch.distributed as dist
    import pycoll.torch                         # noqa: F401  (registers the backend)
    dist.init_process_group("pycoll", init_method="pycoll://")
    rank = dist.get_rank()
    t = torch.full((MESSAGE // 4,), float(rank))
    dist.barrier()
    start = together(MPI.COMM_WORLD)
    if rank == 0:
        dist.send(t, 1)
    elif rank == 1:
        dist.recv(t, 0)
        assert bool((t == 0).all())
        print(json.dumps({"recv": time.monotonic() - start}), flush=True)
    dist.barrier()
    dist.destroy_process_group()


def partial_job():
    pycoll.init()
    world, rank, n = MPI.COMM_WORLD, pycoll.rank(), pycoll.size()
    count = 3 * (1 << 17) + 12345       # float32: ring blocks end in a short chunk
    base = np.arange(count, dtype=np.float32) % 1000
    latency, bandwidth = pycoll.config.get("link").of(0)
    wrong, fastest, slowest = [], [], []
    for step in range(12):
        order = list(range(n))
        random.Random(step).shuffle(order)
        mine = sorted(next(order[i:i + 3] for i in range(0, n, 3) if rank in order[i:i + 3]))
        x = base + 1000 * rank + step                  # where each element came from shows
        start = together(world)
        y = pycoll.partial_allreduce(x, mine, op=pycoll.Sum)
        took = time.monotonic() - start
        model = emulation.collective_time("allreduce", len(mine), x.nbytes, latency, bandwidth)
        ok = np.array_equal(y, len(mine) * (base + step) + 1000 * sum(mine))
        if not world.allreduce(ok, op=MPI.LAND):
            wrong.append(step)
        alone = len(mine) == 1                              # a group of one costs nothing
        fastest.append(world.allreduce(math.inf if alone else took / model, op=MPI.MIN))
        slowest.append(world.allreduce(0.0 if alone else took / model, op=MPI.MAX))
    if rank == 0:
        print(json.dumps({"wrong": wrong, "fastest": fastest, "slowest": slowest}), flush=True)


if __name__ == "__main__":
    {"ps": ps_job, "torch": torch_job, "partial": partial_job}[sys.argv[1]]()
