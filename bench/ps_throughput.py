"""Push+pull throughput of pycoll.ps against raw mpi4py Send/Recv of the same bytes.

    pycollrun -np 3 --servers 2 python bench/ps_throughput.py [--mib 64] [--batches 5]

One worker, S servers. Raw: the worker sends each server its 1/S of the tensor and
receives it back (Isend/Irecv to all servers at once), the servers add 1 in between;
PS: ``push_pull`` of one key of the same size, which the layout splits over the servers
(ASP, no optimizer: the servers add the push, then answer the pull). The machine is
shared and noisy, so raw and PS run in alternating batches (``--repeat`` round trips
each, after one untimed warm-up); the ratio reported is the median over batches of
each batch's raw/PS ratio of medians. At the end the worker idles for ``--idle``
seconds and the servers report the CPU time they used meanwhile.
"""
import argparse
import json
import statistics
import time

import numpy as np
from mpi4py import MPI

import pycoll
import pycoll.ps as ps


def raw_round_trips(comm, servers, x, repeat):
    """The same bytes by hand; the servers add 1 to what they receive and send it back."""
    parts = np.array_split(x, len(servers))
    back = [np.empty_like(p) for p in parts]
    times = []
    if comm.rank in servers:
        buf = np.empty_like(parts[servers.index(comm.rank)])
        for _ in range(repeat + 1):
            comm.Recv(buf, 0, 7)
            buf += 1.0                       # the server's add, as the PS does
            comm.Send(buf, 0, 8)
        return times
    for _ in range(repeat + 1):
        start = time.perf_counter()
        reqs = [comm.Isend(p, s, 7) for p, s in zip(parts, servers)]
        reqs += [comm.Irecv(b, s, 8) for b, s in zip(back, servers)]
        MPI.Request.Waitall(reqs)
        times.append(time.perf_counter() - start)
    return times[1:]


def ps_round_trips(x, repeat, idle):
    """One PS session: ``repeat`` timed push_pulls; with ``idle``, then the servers'
    CPU use while the worker does nothing for that many seconds."""
    if ps.init(policy="asp", exit_servers=False) is not None:
        return None, None                    # a server: served until the worker shut down
    ps.init_params({"w": x})
    grad, out = np.ones_like(x), np.empty_like(x)
    times = []
    for _ in range(repeat + 1):
        start = time.perf_counter()
        ps.push_pull("w", grad, out).wait()
        times.append(time.perf_counter() - start)
    cpu = None
    if idle:
        before = ps.counters()["servers"]
        time.sleep(idle)
        after = ps.counters()["servers"]
        cpu = [(a["cpu_s"] - b["cpu_s"]) / idle for a, b in zip(after, before)]
    ps.shutdown()
    return times[1:], cpu


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--mib", type=float, default=64)
    parser.add_argument("--batches", type=int, default=5, help="raw/PS alternations")
    parser.add_argument("--repeat", type=int, default=7, help="round trips per batch")
    parser.add_argument("--idle", type=float, default=3.0)
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args()
    comm = MPI.COMM_WORLD
    nservers = pycoll.config.get("servers")
    if comm.size != nservers + 1:
        raise SystemExit(f"run with one worker: pycollrun -np {nservers + 1} --servers {nservers}")
    count = int(args.mib * 2**20) // 4
    x = np.ones(count, np.float32)
    servers = list(range(1, comm.size))
    batches = []
    for batch in range(args.batches):
        comm.Barrier()
        raw = raw_round_trips(comm, servers, x, args.repeat)
        comm.Barrier()
        last = batch == args.batches - 1
        times, idle = ps_round_trips(x, args.repeat, args.idle if last else 0)
        if comm.rank == 0:
            batches.append(dict(raw_s=statistics.median(raw), ps_s=statistics.median(times)))
    if comm.rank != 0:
        return
    for b in batches:
        b["ratio"] = b["raw_s"] / b["ps_s"]
    nbytes = 2 * x.nbytes                   # out and back
    t_raw = statistics.median(b["raw_s"] for b in batches)
    t_ps = statistics.median(b["ps_s"] for b in batches)
    rows = dict(mib=args.mib, servers=nservers, batches=batches, raw_s=t_raw, ps_s=t_ps,
                raw_gbps=nbytes / t_raw / 1e9, ps_gbps=nbytes / t_ps / 1e9,
                ratio=statistics.median(b["ratio"] for b in batches), idle_server_cpu=idle)
    print(f"{args.batches} alternating batches of {args.repeat} round trips; per-batch "
          "ps/raw: " + " ".join(f"{b['ratio']:.2f}" for b in batches))
    print(f"{'MiB':>6} {'servers':>7} {'raw ms':>8} {'ps ms':>8} {'raw GB/s':>9} "
          f"{'ps GB/s':>8} {'ps/raw':>7}")
    print(f"{args.mib:6g} {nservers:7d} {1e3 * t_raw:8.2f} {1e3 * t_ps:8.2f} "
          f"{rows['raw_gbps']:9.2f} {rows['ps_gbps']:8.2f} {rows['ratio']:7.2f}")
    print("idle server CPU use (fraction of a core over "
          f"{args.idle:g} s): " + ", ".join(f"{u:.4f}" for u in idle))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
