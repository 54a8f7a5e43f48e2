"""R²SP: the coordinator's decisions in-process on a simulated clock (release order and
spacing, patience, batch adaptation, weights, one worker); whole jobs through pycollrun
for the N-1 staleness bound, sample-weighted updates, batch sizes adapted from the
Pacer's reports, one worker, and a worker that dies holding its turn (tests/r2sp_job.py
holds the jobs), with PYCOLL_CHECK on and off."""
import math

import pytest

from pycoll.ps import policy as pol
from pycoll.ps.r2sp import AdaptiveBatchSampler, Coordinator, R2SP, split
from ps_launch import run_ps_job

pytestmark = pytest.mark.timeout(120)


def simulate(speeds, rounds, base=32, comm=0.002, policy=None, stop=None, short=0):
    """Workers computing ``batch / speed`` seconds and communicating ``comm`` per
    iteration (the first half pushing), gated by a Coordinator, on a simulated clock:
    a released worker holds its push for the answer's ``delay_s``. ``stop``: a worker
    that pushes but never asks again after its release number ``stop[1]``. ``short``:
    every that many pushes a worker computes a quarter batch (an epoch's remainder).
    Returns (coordinator, releases as (worker, time, answer), pushes as (worker, start,
    end))."""
    n = len(speeds)
    coord = Coordinator(policy or R2SP(), n, timeout=1e9)
    ask_at = {w: 0.0005 * w for w in range(n)}
    push_at = {}
    samples, releases, pushes, now = [base] * n, [], [], 0.0
    done = [base] * n                     # in the iteration each computes or computed last
    while len(releases) < rounds * n:
        due = coord.next_due(now)
        now = min(min(ask_at.values(), default=math.inf), min(push_at.values(), default=math.inf),
                  math.inf if due is None else due)
        assert now < math.inf, "nothing can happen: the gate is stuck"
        for w in sorted(w for w, t in push_at.items() if t <= now):
            del push_at[w]
            coord.pushing(w, now, now)
            coord.pushed(w, comm / 2, now + comm / 2)
            pushes.append((w, now, now + comm / 2))
            remainder = short and coord.turns[w] % short == 0
            done[w] = max(1, samples[w] // 4) if remainder else samples[w]
            if stop is None or (w, coord.turns[w]) != stop:
                ask_at[w] = now + comm + done[w] / speeds[w]
        for w in sorted(w for w, t in ask_at.items() if t <= now):
            del ask_at[w]
            compute = done[w] / speeds[w]
            coord.ask(w, done[w], comm + compute, now, compute_s=compute)
        for w, answer in coord.poll(now):
            releases.append((w, now, answer))
            samples[w] = answer["batch"]
            push_at[w] = now + answer["delay_s"]
    return coord, releases, pushes


def test_policy_knobs_and_errors():
    p = pol.make("r2sp:safety=1.5,patience=2,warmup=3,adapt=0,batch=0.5-2,window=3")
    assert isinstance(p, R2SP) and p.turns and not p.rounds and p.wait_for(None, 0) == 0
    assert (p.safety, p.patience, p.warmup, p.adapt, p.batch, p.window) == \
        (1.5, 2.0, 3, False, (0.5, 2.0), 3)
    assert pol.make("r2sp").adapt and pol.make("r2sp").coordinator(1, 4, 10) is None
    assert not pol.make("asp").turns and pol.make("asp").coordinator(0, 4, 10) is None
    with pytest.raises(ValueError, match="cannot read 'speed=2'"):
        pol.make("r2sp:speed=2")
    with pytest.raises(ValueError, match="safety must be >= 1"):
        R2SP(safety=0.5)
    with pytest.raises(ValueError, match="0 < low <= 1 <= high"):
        R2SP(batch=(2, 4))


def missed_updates(releases, pushes, n):
    """Per push after a worker's first: (other workers' pushes since its previous push at
    most per worker, in all, the turns it lost in between)."""
    out = []
    for w in range(n):
        mine = [start for who, start, _ in pushes if who == w]
        lost = [a["lost"] for who, _, a in releases if who == w]
        for k in range(1, len(mine)):
            between = [who for who, start, _ in pushes if mine[k - 1] < start < mine[k]]
            most = max((between.count(x) for x in set(between)), default=0)
            out.append((most, len(between), lost[k]))
    return out


def test_pushes_go_round_robin_one_at_a_time_spaced_by_the_gap():
    coord, releases, pushes = simulate([1000.0] * 4, rounds=30)
    order = [w for w, _, _ in releases]
    assert order == [i % 4 for i in range(len(order))]
    assert [w for w, _, _ in pushes] == order[:len(pushes)]      # they arrive in turn
    assert all(b[1] >= a[2] for a, b in zip(pushes, pushes[1:]))  # never two at once
    warm = 4 * (coord.policy.warmup + 1)             # turns are spaced once P is known
    period = coord.period()
    assert period == pytest.approx(0.002 + 0.032, rel=0.05)      # comm + compute
    gaps = [b[1] - a[1] for a, b in zip(pushes[warm:], pushes[warm + 1:])]
    assert min(gaps) >= period / (1.2 * 4) - 1e-9                 # never closer than the gap
    assert sum(gaps) / len(gaps) == pytest.approx(period / 4, rel=0.05)   # N a period
    assert all(a["weight"] == 1.0 for _, _, a in releases)        # equal batches
    assert coord.out_of_turn == 0 and sum(coord.skipped) == 0
    assert max(coord.longest_wait) < period                        # less than one period
    assert all(most == 1 and total == 3 for most, total, _ in
               missed_updates(releases, pushes, 4)[4:])            # N-1 stale, exactly


def test_a_worker_waits_at_most_a_period_then_the_late_one_loses_its_turn():
    policy = R2SP(adapt=False)
    coord, releases, pushes = simulate([1000.0, 1000.0, 1000.0], rounds=12, policy=policy,
                                       stop=(1, 5))                 # worker 1 gone after turn 5
    fifth = [t for w, t, _ in releases if w == 1][4]
    after = [w for w, t, _ in releases if t > fifth]
    assert 1 not in after and len(after) > 8                         # the others go on
    assert coord.out_of_turn >= 1 and coord.skipped[1] >= 2
    assert coord.missed[1] >= 2                                      # then passed over
    assert max(coord.longest_wait) <= coord.period() * policy.patience * 1.01   # <= a period
    assert coord.overdue(releases[-1][1]) is None                    # within the timeout
    coord.timeout, later = 0.05, releases[-1][1] + 1.0
    for w in (0, 2):                                                 # the others are back
        if w not in coord.waiting:
            coord.ask(w, 32, 0.034, later)
    text = coord.overdue(later)
    assert "worker 1 (world rank 1)" in text and "may have died" in text


def test_a_worker_that_lost_turns_misses_n_minus_1_updates_per_round():
    """Worker 2 is sometimes too slow to ask within a period: released out of turn or
    passed over, it loses turns, and the others' pushes since its last count N-1 for
    every round it lost, and no more."""
    n, speeds = 4, [1000.0, 1000.0, 1000.0, 1000.0]
    coord = Coordinator(R2SP(adapt=False), n, timeout=1e9)
    rounds, pushes, releases = 0, [], []
    now, ask_at, push_at = 0.0, {w: 0.0 for w in range(n)}, {}
    while len(releases) < 60:
        due = coord.next_due(now)
        now = min(list(ask_at.values()) + list(push_at.values())
                  + ([due] if due is not None else []))
        for w in sorted(w for w, t in push_at.items() if t <= now):
            del push_at[w]
            coord.pushing(w, now, now)
            coord.pushed(w, 0.001, now + 0.001)
            pushes.append((w, now, now + 0.001))
            late = 0.08 if w == 2 and len(pushes) % 3 == 0 else 0.0     # every third
            ask_at[w] = now + 0.034 + late
        for w in sorted(w for w, t in ask_at.items() if t <= now):
            del ask_at[w]
            coord.ask(w, 32, 0.034, now)
        for w, answer in coord.poll(now):
            releases.append((w, now, answer))
            push_at[w] = now + answer["delay_s"]
    assert all(b[1] >= a[2] for a, b in zip(pushes, pushes[1:]))  # one at a time still
    seen = missed_updates(releases, pushes, n)
    assert coord.out_of_turn + sum(coord.skipped) > 0 and any(lost for *_, lost in seen)
    assert all(most <= 1 + lost and total <= (n - 1) * (1 + lost) for most, total, lost in seen)


def test_batch_adaptation_converges_for_fixed_slowdowns():
    speeds = [1000.0, 1000.0, 500.0, 250.0]                      # worker 2 2x, worker 3 4x slower
    coord, releases, _ = simulate(speeds, rounds=20, base=32, policy=R2SP(batch=(0.1, 4)))
    last = {w: a["batch"] for w, _, a in releases[-4:]}
    assert sum(last.values()) == 4 * 32                             # the global batch is kept
    for w in range(4):                                              # each round sums to it too
        assert last[w] == pytest.approx(128 * speeds[w] / sum(speeds), abs=1)
    compute = [last[w] / speeds[w] for w in range(4)]
    assert max(compute) / min(compute) < 1.1                        # iterations within 10%
    rounds = [releases[i:i + 4] for i in range(len(releases) - 4 * 10, len(releases), 4)]
    assert all(sum(a["batch"] for _, _, a in r) == 128 for r in rounds)
    fixed, *_ = simulate(speeds, rounds=20, policy=R2SP(adapt=False))
    assert fixed.batch == [32] * 4                                  # adapt=0: batches kept


def test_batch_adaptation_with_a_fixed_cost_and_short_batches():
    """Communication as long as the computing (it does not shrink with the batch), and
    every fifth batch an epoch's short remainder: the coordinator models each worker's
    time as fixed + per sample x batch, so one round after the warm-up every full batch
    is the one that equalizes iteration times, and stays so (a split by samples per
    busy second would take rounds to get there, and jump after every short batch)."""
    speeds, comm = [1000.0, 1000.0, 500.0, 1000.0], 0.03
    coord, releases, _ = simulate(speeds, rounds=30, comm=comm, short=5)
    exact = [128 * s / sum(speeds) for s in speeds]     # T - comm = 128 / sum(speeds)
    after = releases[4 * (coord.policy.warmup + 2):]
    assert all(abs(a["batch"] - exact[w]) <= 1 for w, _, a in after), \
        [(w, a["batch"]) for w, _, a in after]
    rounds = [after[i:i + 4] for i in range(0, len(after) - 3, 4)]
    assert all(sum(a["batch"] for _, _, a in r) == 128 for r in rounds)
    times = [comm + coord.batch[w] / speeds[w] for w in range(4)]
    assert max(times) / min(times) < 1.02


def test_batch_bounds_and_weights():
    coord, releases, _ = simulate([1000.0, 100.0], rounds=12, base=40,
                                  policy=R2SP(batch=(0.5, 1.5)))
    assert coord.batch == [60, 20]                                 # clamped at 1.5x and 0.5x
    weights = {w: a["weight"] for w, _, a in releases}              # each one's last
    assert weights == {0: pytest.approx(60 * 2 / 80), 1: pytest.approx(20 * 2 / 80)}


def test_split_sums_to_the_total_within_bounds():
    zero = [0.0] * 3
    assert split(100, zero, [1, 1, 0.5], [1, 1, 1], [100, 100, 100]) == [25, 25, 50]
    assert split(10, zero, [1, 1, 1], [1, 1, 1], [10, 10, 10]) in ([4, 3, 3], [3, 4, 3], [3, 3, 4])
    out = split(90, zero, [0.1, 1, 1], [10, 10, 10], [50, 50, 50])
    assert out == [50, 20, 20]
    assert sum(split(7, [0, 0], [0.3, 0.9], [1, 1], [7, 7])) == 7
    # A fixed cost per iteration: equal times, not shares in proportion to speed.
    out = split(120, [10.0, 10.0, 10.0], [1.0, 1.0, 2.0], [1] * 3, [120] * 3)
    assert out == [48, 48, 24]                    # each iteration 58


def test_one_worker_is_never_held():
    coord, releases, _ = simulate([1000.0], rounds=10)
    assert [w for w, _, _ in releases] == [0] * 10
    assert coord.gap() == 0 and sum(coord.wait_s) == 0
    assert all(a["weight"] == 1 and a["batch"] == 32 for _, _, a in releases)


def test_sampler_follows_the_batch_size():
    class Worker:
        batch_size = 3
    worker = Worker()
    batches = []
    for batch in AdaptiveBatchSampler(range(10), worker):
        batches.append(batch)
        worker.batch_size = 2
    assert batches == [[0, 1, 2], [3, 4], [5, 6], [7, 8], [9]]
    assert len(AdaptiveBatchSampler(range(10), worker)) == 5
    assert list(AdaptiveBatchSampler(range(5), worker, drop_last=True)) == [[0, 1], [2, 3]]


# ---------------------------------------------------------------- whole jobs
def job(np_, servers, *args, check="1", timeout_s=20, expect_ok=True):
    """``check``: PYCOLL_CHECK, "0" the default configuration users run."""
    return run_ps_job("r2sp_job.py", np_, servers, *args, flags=("--check", check),
                      timeout_s=timeout_s, expect_ok=expect_ok)


@pytest.mark.parametrize("check", ["1", "0"])
def test_gradients_miss_at_most_n_minus_1_updates_and_turns_go_round_robin(check):
    out = job(5, 2, "staleness", "r2sp:patience=3", check=check).stdout   # 3 workers, 2 servers
    assert out.count("missed at most") == 3 and "release order round robin" in out, out


@pytest.mark.parametrize("through, check", [("turns", "1"), ("torch", "0")])
def test_sample_weighted_updates_equal_the_reference(through, check):
    out = job(4, 1, "weighted", through, check=check).stdout
    assert out.count(f"sample-weighted updates through {through} match the reference") == 3, out


def test_batch_sizes_follow_the_workers_computing_through_the_pacer():
    out = job(4, 1, "adapt", check="0").stdout
    assert out.count("(worker 1 computes 2x slower)") == 3, out


def test_one_worker_trains_through_turns():
    out = job(2, 1, "staleness", "r2sp", check="0").stdout
    assert "worker 0: r2sp missed at most 0 updates (N-1 = 0) in turns it did not lose; " \
        "turns 20" in out, out


def test_a_worker_dying_while_holding_its_turn_ends_the_job_naming_it():
    out = job(4, 1, "dies", timeout_s=3, expect_ok=False)
    assert out.returncode != 0
    assert "worker 1: stopping while holding its turn" in out.stdout
    assert "R²SP turns waited for worker 1 (world rank 1)" in out.stderr, out.stderr[-3000:]
