"""Parameter-server jobs the tests in test_ps.py launch: python ps_job.py MODE [args].

Each mode prints what the test checks; any failed check raises (the job exits non-zero).
"""
import os
import signal
import sys
import threading
import time

import numpy as np
from mpi4py import MPI

import pycoll
import pycoll.ps as ps

DIM = (1 << 18) + 3          # over 1 MiB of float32: the layout splits it over the servers


def grads_at(worker, step, w, b):
    """A gradient that depends on the parameters, so staleness would change the result."""
    rng = np.random.default_rng(1000 * step + worker)
    target = rng.standard_normal(DIM).astype(np.float32)
    return w - target, (b * b - rng.standard_normal(3)).astype(np.float64)


def bsp_equals_sgd(steps=6):
    sgd = ps.SGD(lr=0.1, momentum=0.9, weight_decay=0.01)
    ps.init(policy="bsp", optimizer=sgd)
    rank, size = pycoll.rank(), pycoll.size()
    w = np.zeros(DIM, np.float32) + rank           # only worker 0's values may count
    b = np.full(3, 0.5 + rank, np.float64)
    ps.init_params({"w": w, "b": b})
    ref_w, ref_b = np.zeros(DIM, np.float32), np.full(3, 0.5)   # one process, torch's SGD
    mom = [None, None]
    for step in range(steps):
        gw, gb = grads_at(rank, step, w, b)
        ps.push_pull(["w", "b"], [gw, gb], outs=[w, b]).wait()
        pairs = [grads_at(r, step, ref_w, ref_b) for r in range(size)]
        for i, (p, g) in enumerate(((ref_w, np.mean([q[0] for q in pairs], 0, dtype=np.float32)),
                                    (ref_b, np.mean([q[1] for q in pairs], 0)))):
            d = g + sgd.weight_decay * p
            mom[i] = d if mom[i] is None else sgd.momentum * mom[i] + d
            p -= sgd.lr * mom[i]
    np.testing.assert_allclose(w, ref_w, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(b, ref_b, rtol=1e-10)
    servers = {r.server for r in ps._client().keys["w"].ranges}
    print(f"worker {rank}: BSP matches synchronous SGD after {steps} steps; "
          f"w spans {len(servers)} servers; clock {ps.clock()}", flush=True)


def staleness(policy, steps=30):
    """Each worker adds exactly 1 to its own slot of two counters per push (the servers
    scale a push by 1/N); a pull at clock c must see every slot >= c - s."""
    ps.init(policy=policy)
    rank, size = pycoll.rank(), pycoll.size()
    bound = {"bsp": 0, "asp": None}.get(policy, None if ":" not in policy else int(policy.split(":")[1]))
    counts = {k: np.zeros(size) for k in ("a", "b")}
    ps.init_params(counts)
    one_hot = np.zeros(size)
    one_hot[rank] = size
    worst = 0
    rng = np.random.default_rng(rank)
    for clock in range(1, steps + 1):
        time.sleep((0.01 if rank == 0 else 0.002) * rng.random())   # worker 0 is slow
        ps.push_pull(["a", "b"], [one_hot, one_hot], outs=[counts["a"], counts["b"]]).wait()
        for seen in counts.values():
            assert abs(seen[rank] - clock) < 1e-9, (seen, clock)      # own pushes all in
            worst = max(worst, clock - int(round(seen.min())))
            assert bound is None or clock - seen.min() <= bound + 1e-9, (policy, clock, seen)
    stats = ps.counters()
    delayed = sum(s["delayed_pulls"] for s in stats["servers"])
    print(f"worker {rank}: {policy} max staleness {worst} (bound {bound}) "
          f"reported {stats['worker']['max_staleness']} delayed {delayed}", flush=True)


def dying_server(how):
    """The last rank (a server) is killed or stopped after 1 s; workers keep pulling."""
    world = MPI.COMM_WORLD
    if world.rank == world.size - 1:
        sig = signal.SIGKILL if how == "kill" else signal.SIGSTOP
        threading.Timer(1.0, os.kill, (os.getpid(), sig)).start()
    ps.init(policy="bsp")
    x = np.zeros(1000, np.float32)
    ps.init_params({"x": x})
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        ps.push_pull("x", np.ones_like(x), x).wait()
        time.sleep(0.01)
    print("the job should have failed", flush=True)


def checkpoint(directory, phase, steps=5):
    ps.init(policy="bsp", optimizer=ps.SGD(lr=0.5, momentum=0.5), checkpoint_dir=directory)
    rank = pycoll.rank()
    v = np.full(10, 7.0 if phase == "second" else 1.0, np.float32)
    ps.init_params({"v": v})
    if phase == "second":
        saved = np.load(os.path.join(directory, "v.npy"))
        np.testing.assert_array_equal(v, saved)
        assert ps.clock() == steps, ps.clock()
        print(f"worker {rank}: resumed at clock {ps.clock()}", flush=True)
    for _ in range(steps):
        ps.push_pull("v", v.copy(), v).wait()
    if phase == "first":
        ps.checkpoint()
        if rank == 0:
            np.save(os.path.join(directory, "v.npy"), v)
        print(f"worker {rank}: saved at clock {ps.clock()}", flush=True)


if __name__ == "__main__":
    mode, args = sys.argv[1], sys.argv[2:]
    {"bsp": bsp_equals_sgd, "staleness": staleness, "dying_server": dying_server,
     "checkpoint": checkpoint}[mode](*args)
