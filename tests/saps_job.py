"""SaPS jobs the tests in test_saps.py launch: python saps_job.py MODE [args].

Each mode checks what it can on worker 0 and prints one JSON line, ``RESULT {...}``, for
the test to check the rest; a failed check raises (the job exits non-zero).
"""
import json
import sys
import time

import numpy as np

import pycoll
import pycoll.ps as ps

BIG = (1 << 18) + 3          # over 1 MiB of float32: split over the servers


def report(**what) -> None:
    print("RESULT " + json.dumps(what), flush=True)


def weights(bound="4"):
    """Worker 0 alone pushes ones (servers add steps: no optimizer) claiming chosen
    versions; each push must move the parameters by weight(staleness) / N."""
    policy = ps.SaPS(bound=int(bound))
    ps.init(policy=policy)
    rank, size = pycoll.rank(), pycoll.size()
    w = np.zeros(BIG, np.float32)
    ps.init_params({"w": w})
    client = ps._client()
    applied = []
    if rank == 0:
        ones = np.ones(BIG, np.float32)
        for _ in range(6):                            # fresh pushes: versions 1..6
            ps.push_pull("w", ones, w).wait()
        for staleness in range(0, int(bound) + 3):
            claimed = [v - staleness for v in client.versions]
            client.versions[:] = claimed
            before = w.copy()
            ps.push_pull("w", ones, w).wait()
            change = (w - before) * size
            assert np.allclose(change, change[0]), "every server applies the same weight"
            expect = policy.weight(staleness, size)
            assert abs(change[0] - expect) < 1e-5, (staleness, change[0], expect)
            applied.append(float(change[0]))
    pycoll.barrier()
    stats = ps.counters()
    if rank == 0:
        report(applied=applied, servers=len(stats["servers"]), stragglers=stats["stragglers"])


def straggler(policy, step_ms="15", steps="60"):
    """Every worker sleeps ``step_ms`` per step inside ``pycoll.slowdown()`` (so
    ``--slowdown`` slows it), then push_pulls two keys (one on each of two servers);
    worker 0 reports the job's counters."""
    ps.init(policy=policy)
    rank = pycoll.rank()
    params = {"a": np.zeros(500, np.float32), "b": np.zeros(500, np.float32)}
    ps.init_params(params)
    pycoll.barrier()
    # --slowdown windows count from here, however long the set-up took on a loaded
    # machine: the flags (counted from init) come no earlier than the windows say.
    pycoll.hetero.mark_start()
    for _ in range(int(steps)):
        with pycoll.slowdown():
            time.sleep(float(step_ms) / 1e3)
        ps.push_pull(list(params), [np.ones(500, np.float32)] * 2, list(params.values())).wait()
    pycoll.barrier()
    stats = ps.counters()
    waited = stats["worker"]["pull_wait_s"]
    everyone = pycoll.allgather(np.array([stats["worker"]["refused_pulls"], waited]))
    if rank == 0:
        report(stragglers=stats["stragglers"], refused=float(everyone[0::2].sum()),
               delayed=sum(s["delayed_pulls"] for s in stats["servers"]),
               line=ps.straggler_line(stats))


if __name__ == "__main__":
    mode, args = sys.argv[1], sys.argv[2:]
    {"weights": weights, "straggler": straggler}[mode](*args)
