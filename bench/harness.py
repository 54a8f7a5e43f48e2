"""What the bench/ scripts share: timing, the machine header, gloo set-up, JSON.

Timing follows nccl-tests: a batch is ``iters`` calls after a barrier, its time per call
is the mean over the batch on the slowest rank; implementations are interleaved batch by
batch in rotating order, so that noise from a shared machine hits them alike, and tables
quote the median over batches.
"""
import json
import os
import platform
import resource
import socket
import statistics
import sys
import time
from typing import Callable, Dict, List, Optional, Union

import mpi4py
import numpy as np
from mpi4py import MPI

try:
    import pycoll
except ImportError:                              # a checkout without pip install -e
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    import pycoll
from pycoll.work import wait_requests

comm = MPI.COMM_WORLD
MiB = 1 << 20


def parse_bytes(s: str) -> int:
    """``"4"``, ``"1K"``, ``"8M"``, ``"1G"`` (powers of 1024; a trailing B is allowed)."""
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    s = s.strip().upper().rstrip("B")
    return int(float(s[:-1]) * units[s[-1]]) if s[-1:] in units else int(s)


def human_bytes(n: float) -> str:
    for unit in ("", "K", "M", "G"):
        if n < 1024 or unit == "G":
            return f"{n:g} B" if not unit else f"{n:g} {unit}iB"
        n /= 1024


def setup_gloo(no_gloo: bool = False):
    """Import torch and start torch.distributed with gloo on the MPI ranks.

    Returns ``(torch, dist, note)``: the modules (None where unavailable) and a line saying
    what was skipped ("" when gloo is up)."""
    try:
        import torch
        import torch.distributed as dist
    except ImportError as e:
        return None, None, f"torch unavailable ({e}): pycoll runs on numpy arrays; gloo skipped"
    torch.set_num_threads(1)         # ranks already oversubscribe the cores
    if no_gloo:
        return torch, None, "gloo skipped (--no-gloo)"
    if not dist.is_available() or not dist.is_gloo_available():
        return torch, None, "gloo skipped: torch.distributed was built without gloo"
    hosts = comm.allgather(socket.gethostname())
    port = None
    if comm.rank == 0:               # a port free now on rank 0, shared with all ranks
        with socket.socket() as s:
            s.bind(("", 0))
            port = s.getsockname()[1]
    os.environ["MASTER_PORT"] = str(comm.bcast(port))
    os.environ["MASTER_ADDR"] = "127.0.0.1" if len(set(hosts)) == 1 else hosts[0]
    dist.init_process_group("gloo", rank=comm.rank, world_size=comm.size)
    return torch, dist, ""


def teardown_gloo(dist) -> None:
    if dist is not None and dist.is_initialized():
        dist.destroy_process_group()


# ---------------------------------------------------------------- timing

def time_batch(fn: Callable[[], object], iters: int, sleep_when_done: bool = False) -> float:
    """Seconds per call of ``fn``: the batch mean on the slowest rank (same on every rank).
    ``sleep_when_done``: a rank done with its batch (or with nothing to run) sleeps until
    the others are, rather than spinning in MPI on a core they need."""
    comm.Barrier()                   # every rank starts the batch together
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    mine = np.array([(time.perf_counter() - t0) / iters])
    if not sleep_when_done:
        return comm.allreduce(mine[0], op=MPI.MAX)
    slowest = np.empty(1)
    sleep_until_done(comm.Iallreduce(mine, slowest, op=MPI.MAX))
    return float(slowest[0])


def sleep_until_done(request, timeout: float = 600.0) -> None:
    """Wait for an MPI ``request`` sleeping, not spinning (ranks outnumber cores here):
    pycoll's one wait with a deadline."""
    if wait_requests([request], timeout):
        raise SystemExit(f"a rank did not reach the end of a batch within {timeout:.0f} s")


def iters_for_time(fn: Callable[[], object], target_s: float, max_iters: int) -> int:
    """How many calls of ``fn`` make a batch of about ``target_s`` (1..max_iters), from one
    timed call; every rank gets the same answer."""
    once = time_batch(fn, 1)
    return int(min(max_iters, max(1, round(target_s / max(once, 1e-9)))))


def interleave(fns: Dict[str, Callable[[], object]], iters: Union[int, Dict[str, int]],
               warmup: int, batches: int,
               setup: Optional[Dict[str, Callable[[], object]]] = None,
               sleep_when_done: bool = False) -> Dict[str, List[float]]:
    """Seconds per call for each of ``fns``: ``batches`` batches each, the implementations
    interleaved batch by batch in rotating order, after ``warmup`` untimed calls each.
    ``setup[name]()`` runs (untimed) before each of that name's batches; ``sleep_when_done``
    as ``time_batch``'s."""
    names = list(fns)
    per = iters if isinstance(iters, dict) else dict.fromkeys(names, iters)
    setup = setup or {}
    for name in names:               # warm up: connections, caches, first-touch pages
        setup.get(name, lambda: None)()
        if warmup:
            time_batch(fns[name], warmup, sleep_when_done)
    times: Dict[str, List[float]] = {name: [] for name in names}
    for b in range(batches):
        for name in names[b % len(names):] + names[:b % len(names)]:
            setup.get(name, lambda: None)()
            times[name].append(time_batch(fns[name], per[name], sleep_when_done))
    return times


def median(xs):
    return statistics.median(xs) if xs else None


def paired_ratio(times: Dict[str, List[float]], a: str, b: str) -> Optional[float]:
    """``a``'s time over ``b``'s: the median of the per-batch ratios (``interleave``'s
    batch k of each ran in the same round). This VM's MPI transfers sometimes run 5x
    slower for seconds to minutes at a time; a ratio of medians taken across such a change
    compares one mode with the other, a batch with its own round does not."""
    pairs = [x / y for x, y in zip(times.get(a) or [], times.get(b) or []) if x and y]
    return statistics.median(pairs) if pairs else None


# ---------------------------------------------------------------- the machine

def memcpy_gbps(nbytes: int = 64 * MiB, reps: int = 10) -> float:
    """The host's memcpy bandwidth in GB/s (bytes copied per second, 1e9): numpy copyto of
    ``nbytes``, median of ``reps``, on rank 0 while the other ranks sleep (not spin) so it
    has a core to itself. Collective; every rank gets rank 0's figure."""
    gbps = None
    if comm.rank == 0:
        src = np.ones(nbytes, np.uint8)
        dst = np.empty_like(src)
        np.copyto(dst, src)          # first touch
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            np.copyto(dst, src)
            times.append(time.perf_counter() - t0)
        gbps = nbytes / statistics.median(times) / 1e9
        del src, dst
    sleep_until_done(comm.Ibarrier())
    return comm.bcast(gbps)


def memcpy_line(gbps: float, nbytes: int = 64 * MiB) -> str:
    return (f"# memcpy: {gbps:.2f} GB/s (numpy copyto of {human_bytes(nbytes)} on rank 0, "
            f"other ranks idle; median of 10) - the physical reference")


def rss_mib() -> float:
    """This process's resident set now, MiB (Linux /proc; else the peak)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / MiB
    except (OSError, ValueError, IndexError):
        return peak_rss_mib()


def peak_rss_mib() -> float:
    """This process's peak resident set so far, MiB (getrusage ru_maxrss)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / MiB if sys.platform == "darwin" else peak / 1024    # bytes on macOS, KiB on Linux


def reset_peak_rss() -> bool:
    """Lower the peak resident set (ru_maxrss too) to the current one, so that a later
    peak_rss_mib() covers only what follows (Linux: /proc/self/clear_refs); False where
    that is not possible."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def machine(torch=None) -> dict:
    """Where the numbers come from, for headers, plot titles and JSON."""
    return dict(host=platform.node(), cpus=os.cpu_count(), ranks=comm.size,
                mpi=MPI.Get_library_version().splitlines()[0].split(",")[0].strip(),
                mpi4py=mpi4py.__version__,
                torch=torch.__version__ if torch is not None else None,
                pycoll=pycoll.__version__)


def machine_line(title: str, m: dict) -> str:
    tv = f"torch {m['torch']}" if m["torch"] else "no torch"
    return (f"# pycoll {m['pycoll']} {title}: host {m['host']} ({m['cpus']} cpus), {m['mpi']}, "
            f"mpi4py {m['mpi4py']}, {m['ranks']} ranks, {tv}")


def write_json(path: str, meta: dict, rows: list) -> None:
    if os.path.dirname(path):
        os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        json.dump(dict(meta=meta, rows=rows), f, indent=1)
