"""SaPS: its rule in-process; whole jobs (servers + workers) through pycollrun, a few
seconds each (tests/saps_job.py holds the jobs)."""
import json

import pytest

from pycoll.ps import policy as pol
from pycoll.ps.saps import Detector, SaPS, percentile, stragglers, summary
from ps_launch import run_ps_job

pytestmark = pytest.mark.timeout(120)


def job(np_, servers, *args, flags=()):
    """``saps_job.py ARGS`` under pycollrun; the JSON its worker 0 reported."""
    out = run_ps_job("saps_job.py", np_, servers, *args, flags=flags, timeout_s=30)
    return json.loads(out.stdout.split("RESULT ", 1)[1].splitlines()[0])


# ---------------------------------------------------------------- in-process
def test_discount_and_drop_follow_the_documented_function():
    saps = SaPS()                                   # 4 workers: E = 3, T = 4.5, bound 12
    assert saps.limits(4) == (4.5, 12)
    expect = {0: 1, 3: 1, 4: 1, 5: 4.5 / 5, 9: 0.5, 12: 0.375, 13: 0, 100: 0}
    assert {s: saps.weight(s, 4) for s in expect} == pytest.approx(expect)
    assert saps.weight(4, 4, flagged=True) == 1                 # a straggler's fresh update
    assert saps.weight(5, 4, flagged=True) == 0                 # its stale one: dropped
    soft = SaPS(bound=6, threshold=1, power=2, drop_flagged=False)
    assert soft.limits(3) == (2, 6)
    assert [soft.weight(s, 3, flagged=True) for s in (2, 4, 6, 7)] == [1, 0.25, 1 / 9, 0]
    assert SaPS().limits(1) == (1.5, 4)                         # one worker: E = 1


def test_a_flagged_straggler_leaves_the_average():
    from mpi4py import MPI
    side = SaPS().server_side(MPI.COMM_SELF, 0, 4)          # the coordinator: T = 4.5, bound 12
    assert side.observe(0, 1) == 1
    assert [side.observe(3, 9) for _ in range(8)] == [0.5] * 8   # discounted until flagged,
    assert side.flagged == [False, False, False, True]
    assert side.observe(3, 9) == 0                           # then dropped; a fresh one counts
    assert side.observe(3, 4) == pytest.approx(4 / 3)
    assert side.observe(0, 2) == pytest.approx(4 / 3)        # the others average over N - 1
    assert side.observe(1, 9) == pytest.approx(0.5 * 4 / 3)
    assert side.observe(1, 13) == 0                          # the bound holds for everyone
    assert SaPS(drop_flagged=False).share(4, 1) == 1 and SaPS().share(4, 0) == 1
    assert SaPS().share(2, 2) == 2                           # never divides by zero


def test_the_bound_is_hard():
    for bound in (0, 1, 5):
        for flagged in (False, True):
            saps = SaPS(bound=bound, threshold=3)
            assert all(saps.weight(s, 8, flagged) == 0 for s in range(bound + 1, bound + 50))


def test_policy_names_and_bad_knobs():
    assert isinstance(pol.make("saps"), SaPS)
    saps = pol.make("saps:bound=12, window=4,threshold=2.5,drop_flagged=0")
    assert (saps.bound, saps.window, saps.threshold, saps.drop_flagged) == (12, 4, 2.5, False)
    assert pol.make("saps:7").bound == 7
    assert pol.make("saps").wait_for(pol.SyncState([9, 0], [True, True]), 0) <= 0  # never waits
    with pytest.raises(ValueError, match="unknown knob 'widow'"):
        pol.make("saps:widow=3")
    with pytest.raises(ValueError, match="bound=.x. is not a number"):
        pol.make("saps:bound=x")
    with pytest.raises(ValueError, match="window must be an integer >= 1"):
        SaPS(window=0)


def test_detector_flags_a_straggler_over_a_window_and_unflags_it():
    d = Detector(workers=3, limit=3.0, window=4)
    jitter = [2, 4, 1, 3, 5, 2, 4, 4, 4, 3, 2, 9]                # above 3 now and then
    for t, s in enumerate(jitter):
        assert not d.feed(0, s, t)
    assert [d.feed(2, 7, t) for t in range(4)] == [False, False, False, True]
    assert d.flagged == [False, False, True] and d.events == [[2, 3, None]]
    assert not d.feed(2, 2, 4) and not d.feed(2, 8, 5)           # one fast step: still flagged
    assert [d.feed(2, 1, t) for t in (6, 7, 8, 9)] == [False, False, False, True]
    assert d.flagged == [False, False, False] and d.events == [[2, 3, 9]]
    assert [d.feed(2, 6, t) for t in range(10, 14)][-1] and d.events[-1] == [2, 13, None]


def test_straggler_view_and_line():
    servers = [dict(policy="saps", staleness={"0": {"1": 3, "2": 1}, "1": {"7": 2}},
                    saps=dict(discounted=[0, 2], dropped=[0, 1], flagged=[1], limit=1.5,
                              bound=4, flags=[dict(worker=1, flagged_s=1.25,
                                                   unflagged_s=None)])),
               dict(policy="saps", staleness={"0": {"1": 1}, "1": {}},
                    saps=dict(discounted=[0, 1], dropped=[0, 3], flagged=[1], limit=1.5,
                              bound=4))]
    view = stragglers(servers)
    assert view["staleness"] == {"0": {"1": 4, "2": 1}, "1": {"7": 2}}
    assert view["discounted"] == [0, 3] and view["dropped"] == [0, 4]
    assert percentile({"1": 4, "2": 1}, 0.5) == 1 and percentile({"1": 4, "2": 1}, 1) == 2
    line = summary(view)
    assert line.startswith("stragglers: worker 1 flagged at 1.2 s (to the end)"), line
    assert "discounted 3, dropped 4 (bound 4)" in line and "max 7" in line
    asp = summary(stragglers([dict(policy="asp", staleness={"0": {"3": 2}})]))
    assert asp == "stragglers: not tracked by asp; applied staleness median 3, p99 3, max 3"


# ---------------------------------------------------------------- whole jobs
def test_discount_and_drop_are_applied_by_the_servers():
    out = job(4, 2, "weights", "4")                  # 2 workers, 2 servers, bound 4
    # N = 2: E = 1, T = 1.5; staleness 0..6 -> 1, 1, 1.5/2, 1.5/3, 1.5/4, dropped, dropped
    assert out["applied"] == pytest.approx([1, 1, 0.75, 0.5, 0.375, 0, 0], abs=1e-5)
    view = out["stragglers"]
    assert view["discounted"] == [3 * 2, 0] and view["dropped"] == [2 * 2, 0]   # per server
    assert max(int(s) for s in view["staleness"]["0"]) == 4


def test_applied_staleness_never_exceeds_the_bound_and_no_pull_waits(monkeypatch):
    monkeypatch.setenv("PYCOLL_CHECK", "0")        # as users run it (the suite's default is 1)
    out = job(4, 1, "straggler", "saps:bound=2", "10", "40", flags=["--slowdown", "2:6"])
    view = out["stragglers"]
    applied = [int(s) for h in view["staleness"].values() for s in h]
    assert applied and max(applied) <= 2, view
    assert sum(view["dropped"]) > 0, view           # the straggler's stale updates were
    assert out["delayed"] == 0 and out["refused"] == 0, out      # ... and nobody waited


def test_slowed_worker_is_flagged_then_unflagged_and_equal_workers_never():
    # 3 workers: worker 2 slowed 10x from 0.3 s to 2 s after init; 20 ms steps (and the
    # machine's overhead, which a loaded machine makes several times larger).
    out = job(5, 2, "straggler", "saps", "20", "100", flags=["--slowdown", "2:10@0.3-2"])
    flags = out["stragglers"]["flags"]
    assert [f["worker"] for f in flags] == [2], out           # equal workers: never
    assert flags[0]["flagged_s"] > 0.3 and flags[0]["unflagged_s"] > 2, out
    assert "worker 2 flagged at" in out["line"] and "unflagged at" in out["line"]
