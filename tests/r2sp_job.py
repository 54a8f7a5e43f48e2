"""R²SP jobs the tests in test_r2sp.py launch: python r2sp_job.py MODE [args].

Each mode prints what the test checks; any failed check raises (the job exits non-zero).
"""
import os
import signal
import sys
import time

import numpy as np

import pycoll
import pycoll.ps as ps

DIM = (1 << 18) + 3          # over 1 MiB of float32: the layout splits it over the servers


def staleness(policy, steps=20):
    """Each worker adds exactly 1 to its own slot of two counters per push (weight 1:
    equal samples). Between two of a worker's pull answers, each other worker's slot may
    grow by at most 1 + the turns this worker lost in between (the turn's ``lost``: a
    worker late by more than ``patience`` periods, which only load on the machine makes
    here, loses its turn): its gradient missed at most (N-1)(1 + lost) updates. Worker 0
    also checks the coordinator's release order (round robin) and spacing (>= the gap)."""
    ps.init(policy=policy)
    rank, size = pycoll.rank(), pycoll.size()
    counts = {"a": np.zeros(size), "b": np.zeros(DIM)}
    ps.init_params(counts)
    seen = {k: v.copy() for k, v in counts.items()}
    rng = np.random.default_rng(rank)
    worst, weights = 0, set()
    for step in range(1, steps + 1):
        compute = (0.03 if rank == 0 else 0.02) * (1 + 0.5 * rng.random())  # worker 0 slower
        time.sleep(compute)
        answer = ps.turn(1, compute)
        weights.add(answer["weight"])
        one_hot = [np.zeros(len(v)) for v in counts.values()]
        for v in one_hot:
            v[rank] = size
        ps.push_pull(list(counts), one_hot, outs=list(counts.values()),
                     weight=answer["weight"]).wait()
        lost = answer["lost"]
        for key, now in counts.items():
            slots = now[:size]
            assert abs(slots[rank] - step) < 1e-9, (key, slots, step)       # own pushes all in
            others = np.delete(slots - seen[key][:size], rank)
            assert np.all(others <= 1 + lost + 1e-9), (key, step, lost, slots, seen[key][:size])
            if not lost:
                worst = max(worst, int(round(others.sum())))
            seen[key] = now.copy()
        if rank == 0 and step == steps // 2:         # every worker is still in the ring
            check_releases(ps.counters()["servers"][0]["r2sp"], size)
    assert weights == {1.0}, weights
    assert worst <= size - 1, worst
    stats = ps.counters()
    ps.turn(0)
    print(f"worker {rank}: {policy} missed at most {worst} updates (N-1 = {size - 1}) in "
          f"turns it did not lose; turns {stats['worker']['turns']}", flush=True)


def check_releases(r2sp, size):
    """Releases go round robin: after each, the ring's next workers that were not
    released lost their turns (a worker late by more than ``patience`` periods, which
    only load on the machine makes here, is released out of turn or passed over), and
    every push's slot at server 0 is at least the gap after the one before."""
    releases = r2sp["recent_releases"]    # worker, time, gap, in turn, slot, passed over
    for a, b in zip(releases, releases[1:]):
        ring = [(a[0] + step) % size for step in range(1, size + 1)]
        assert ring[:ring.index(b[0])] == b[5], (a, b)
    spaced = [(b[4] - a[4], b[2]) for a, b in zip(releases, releases[1:])]
    assert all(after >= gap - 1e-9 for after, gap in spaced), spaced
    assert r2sp["gap_s"] > 0 or size == 1
    print(f"release order round robin over {len(releases)} releases; slots >= gap apart "
          f"({1e3 * r2sp['gap_s']:.2f} ms, period {1e3 * r2sp['period_s']:.2f} ms)", flush=True)


def weighted(through="turns", rounds=5, n=1000):
    """Workers push fixed gradients of batches of 1, 2, ... samples under R²SP without
    adaptation; the servers' SGD must equal, after ``rounds`` rounds, the reference:
    each round one step along the sample-weighted mean gradient. ``through``: "turns"
    (``ps.turn``, then ``push_pull``) or "torch" (``TorchWorker``, whose push goes out
    with its turn from the communication thread)."""
    lr = 0.1
    ps.init(policy="r2sp:adapt=0", optimizer=ps.SGD(lr=lr))
    rank, size = pycoll.rank(), pycoll.size()
    w = np.linspace(-1, 1, n).astype(np.float64)
    start = w.copy()
    samples = rank + 1

    def gradient(worker):
        return np.random.default_rng(worker).standard_normal(n)
    if through == "torch":
        import torch
        model = torch.nn.Module()
        model.w = torch.nn.Parameter(torch.from_numpy(w.copy()))
        worker = ps.TorchWorker(model, batch_size=samples)
        for _ in range(rounds):
            worker.pull()
            model.zero_grad()
            (model.w * torch.from_numpy(gradient(rank))).sum().backward()   # grad: gradient
            worker.push()
            assert worker.batch_size == samples, worker.batch_size       # no adaptation
        worker.pull()
        assert ps.counters()["worker"]["turns"] >= rounds     # (the last pull asks anew)
    else:
        ps.init_params({"w": w})
        for _ in range(rounds):
            answer = ps.turn(samples, 0.001)
            assert answer["batch"] == samples, answer              # no adaptation: kept
            ps.push_pull("w", gradient(rank), outs=w, weight=answer["weight"]).wait()
    ps.turn(0)
    pycoll.barrier()
    ps.pull("w", w).wait()
    total = sum(r + 1 for r in range(size))
    mean = sum((r + 1) / total * gradient(r) for r in range(size))
    reference = start - lr * rounds * mean
    np.testing.assert_allclose(w, reference, rtol=1e-12, atol=1e-12)
    print(f"worker {rank}: sample-weighted updates through {through} match the reference "
          f"(batches 1..{size})", flush=True)


def adapt(steps=40):
    """Workers push through a ``Pacer``, as ``TorchWorker`` does (without torch, which
    takes long to import on a loaded machine), with batch sizes adapted; worker 1
    computes 2 ms a sample, the others 1 ms (sleeps), so the time model gives worker 1
    about half the others' batch: the Pacer's computing seconds reach the coordinator."""
    from pycoll.ps.r2sp import Pacer
    ps.init(policy="r2sp")
    rank, size = pycoll.rank(), pycoll.size()
    w = np.zeros(1000)
    ps.init_params({"w": w})
    pacer = Pacer(16)
    for _ in range(steps):
        pacer.start()                            # the parameters are in: computing starts
        n = pacer.batch_size
        time.sleep((0.002 if rank == 1 else 0.001) * n)
        turn, weight = pacer.turn(n)
        ps.push_pull("w", np.ones_like(w), outs=w, weight=weight, turn=turn).wait()
    pacer.start()                                # reports the last iteration
    pycoll.barrier()                     # every worker is still in the ring
    r2sp = ps.counters()["servers"][0]["r2sp"]
    ps.turn(0)
    batch = r2sp["plan"]                 # this round's split
    per_sample = [w["per_sample_s"] for w in r2sp["workers"]]
    others = [w for w in range(size) if w != 1]
    assert sum(batch) == 16 * size, batch                   # the global batch is kept
    assert batch[1] < 0.8 * min(batch[w] for w in others), batch      # about half
    assert per_sample[1] > max(per_sample[w] for w in others), per_sample
    print(f"worker {rank}: batches {batch} (worker 1 computes 2x slower)", flush=True)


def dies(seconds=30):
    """Worker 1 stops (SIGSTOP: hung, never exits) right after its third turn is granted,
    before it pushes; the others' turns must end in an error naming it."""
    ps.init(policy="r2sp")
    rank = pycoll.rank()
    x = np.zeros(1000, np.float32)
    ps.init_params({"x": x})
    deadline, step = time.monotonic() + float(seconds), 0
    while time.monotonic() < deadline:
        step += 1
        time.sleep(0.005)
        answer = ps.turn(16, 0.005)
        if rank == 1 and step == 3:
            print("worker 1: stopping while holding its turn", flush=True)
            os.kill(os.getpid(), signal.SIGSTOP)
        ps.push_pull("x", np.ones_like(x), outs=x, weight=answer["weight"]).wait()
    print("the job should have failed", flush=True)


if __name__ == "__main__":
    mode, args = sys.argv[1], sys.argv[2:]
    {"staleness": staleness, "weighted": weighted, "adapt": adapt, "dies": dies}[mode](*args)
