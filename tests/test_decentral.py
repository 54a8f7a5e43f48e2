"""pycoll.decentral: conflict-free schedules, the Group Generator's decisions, no deadlock
under random schedules and delays, and training under every policy.

Multi-rank tests hold at any size; the stress test also runs at 6 and 8 ranks from a
subprocess (``test_stress_at_6_and_8_ranks``).
"""
import heapq
import os
import random
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

import pycoll
from pycoll.decentral import (GroupBook, GroupGenerator, RandomGroups, StaticGroups,
                              random_partition, schedule_conflicts, static_schedule)

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.timeout(120)


# ------------------------------------------------------------------ schedules, no MPI

@pytest.mark.parametrize("n", [1, 2, 3, 4, 5, 8, 9, 16, 27])
@pytest.mark.parametrize("group_size", [1, 2, 3, 4])
def test_schedules_are_conflict_free(n, group_size):
    phases = static_schedule(n, group_size)
    assert phases and not schedule_conflicts(phases, n)
    assert all(len(g) <= group_size for phase in phases for g in phase)
    steps = [random_partition(n, group_size, seed=1, step=k) for k in range(20)]
    assert not schedule_conflicts(steps, n)
    assert steps == [random_partition(n, group_size, seed=1, step=k) for k in range(20)]
    if n > group_size >= 2:
        assert len(set(map(tuple, steps))) > 1          # random: the groups change


@pytest.mark.parametrize("n, group_size", [(8, 2), (9, 3), (16, 4)])
def test_butterfly_schedule_averages_exactly(n, group_size):
    values = np.arange(n, dtype=np.float64) ** 2
    for phase in static_schedule(n, group_size):
        for group in phase:
            values[list(group)] = values[list(group)].mean()
    np.testing.assert_allclose(values, (np.arange(n) ** 2).mean())


def test_conflict_checker_catches_overlap_and_gaps():
    assert schedule_conflicts([[(0, 1), (1, 2)]], 3)
    assert schedule_conflicts([[(0, 1)]], 3)
    assert not schedule_conflicts([[(0, 2), (1,)]], 3)


def simulate(periods, group_size=3, steps=300, tolerance=0.5, seed=0):
    """Workers with the given step periods request groups from a GroupBook; a group runs
    when its last member arrives. Returns per-worker waits, groups joined, each worker's
    groups in the order it ran them, and the book. Fails on a deadlock: groups that some
    member never reaches."""
    n = len(periods)
    book = GroupBook(n, group_size, seed, tolerance)
    ready = [(periods[w], w) for w in range(n)]        # (time, worker): a worker is ready
    heapq.heapify(ready)
    arrived, done = {}, [0] * n
    waits, order = [[] for _ in range(n)], [[] for _ in range(n)]

    def arrive(group, w, now):
        order[w].append(group)
        arrived.setdefault(group, {})[w] = now
        if len(arrived[group]) == len(group):          # the last member: the group runs
            start = max(arrived[group].values())
            for member, t in arrived.pop(group).items():
                waits[member].append(start - t)
                heapq.heappush(ready, (start + periods[member], member))

    while ready:
        now, w = heapq.heappop(ready)
        if done[w] == steps:
            for group in book.leave(w):                 # drain what others count on
                arrive(group, w, now)
            continue
        done[w] += 1
        group = book.request(w, now)
        if len(group) == 1:
            heapq.heappush(ready, (now + periods[w], w))
        else:
            arrive(group, w, now)
    assert not arrived, f"deadlock: groups {list(arrived)} never completed"
    return waits, [len(o) for o in order], order, book


def test_generator_orders_groups_globally_and_never_deadlocks():
    rng = random.Random(3)
    for trial in range(20):
        periods = [rng.uniform(1, 5) for _ in range(rng.randint(2, 9))]
        _, _, order, book = simulate(periods, group_size=rng.randint(2, 4), steps=60, seed=trial)
        for w, groups in enumerate(order):                # each worker: oldest group first
            assert groups == [g for g in book.issued if w in g]


def test_slow_worker_joins_fewer_groups_and_fast_ones_do_not_wait_for_it():
    periods = [1.0] * 7 + [4.0]                            # worker 7 is 4x slower
    waits, joined, _, book = simulate(periods, steps=200)
    fast = range(7)
    assert joined[7] < min(joined[w] for w in fast) / 2
    with_slow = [g for g in book.issued if 7 in g]
    assert with_slow, "the slow worker still takes part"
    # Fast workers hardly wait: partners are picked when due, the slow one rarely.
    assert np.mean([np.mean(waits[w]) for w in fast]) < 0.1 * 1.0


def test_group_division_keeps_a_busy_worker_out():
    book = GroupBook(3, group_size=3, seed=0, tolerance=10.0)
    for w in range(3):
        book.request(w, 0.0)
    assert book.request(0, 1.0) == (0,)          # nobody else's pace is known yet
    assert book.request(1, 1.0) == (0, 1)        # 0 is free and due: put in its buffer
    assert book.request(2, 1.0) == (1, 2)        # 0 owes (0, 1): divided off, not queued
    assert book.request(0, 1.5) == (0, 1)        # Group Buffer: served at once
    assert book.request(1, 2.0) == (1, 2)
    assert book.issued == [(0, 1), (1, 2)]
    assert book.leave(2) == [] and 2 not in book.active


# ------------------------------------------------------------------ multi-rank

def stress(policy: str, operations: int, seed: int = 0):
    """Groups from ``policy`` with random per-rank delays; each is a Sum the members check."""
    rank, size = pycoll.rank(), pycoll.size()
    rng = random.Random(seed * 100 + rank)
    shared = random.Random(seed)                  # the same draws on every rank
    done = 0
    if policy == "overlapping":
        # Random subsets (not partitions), issued in one global order, several in flight.
        works = []
        for _ in range(operations * size // 3):
            group = tuple(sorted(shared.sample(range(size), shared.randint(1, size))))
            length = shared.choice([1, 7, 100])
            if rank in group:
                works.append((group, pycoll.partial_allreduce_async(
                    np.full(length, rank + 1.0), group, op=pycoll.Sum)))
                if rng.random() < 0.3:
                    time.sleep(rng.random() * 1e-3)
            if len(works) > 4 or not works:
                continue
            expected_group, work = works.pop(0)
            assert np.all(work.wait(timeout=60) == sum(r + 1 for r in expected_group))
            done += 1
        for expected_group, work in works:
            assert np.all(work.wait(timeout=60) == sum(r + 1 for r in expected_group))
            done += 1
        return done
    source = {"generator": lambda: GroupGenerator(group_size=3, seed=seed),
              "random": lambda: RandomGroups(group_size=3, seed=seed),
              "static": lambda: StaticGroups(group_size=2, seed=seed)}[policy]()
    slow = 4.0 if rank == size - 1 else 1.0
    groups = []
    for _ in range(operations):
        time.sleep(rng.random() * 1e-3 * slow)
        groups.append(source.next_group())
        run = groups[-1]
        if len(run) > 1:
            y = pycoll.partial_allreduce(np.full(5, rank + 1.0), run, op=pycoll.Sum)
            assert np.all(y == sum(r + 1 for r in run)), (run, y)
            done += 1
    for run in source.leave():
        y = pycoll.partial_allreduce(np.full(5, rank + 1.0), run, op=pycoll.Sum)
        assert np.all(y == sum(r + 1 for r in run))
        done += 1
    source.close()
    return done


@pytest.mark.mpi
@pytest.mark.parametrize("policy", ["overlapping", "generator", "random", "static"])
def test_stress_random_schedules_and_delays(pycoll_world, policy):
    done = stress(policy, operations=250)
    total = pycoll.allreduce(np.array([done], np.int64), op=pycoll.Sum)[0]
    assert pycoll.size() == 1 or total > 0


def test_stress_at_6_and_8_ranks():
    """The stress test at 6 and 8 ranks (more than CI's 1-4), oversubscribed."""
    env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
               PYCOLL_TIMEOUT="60")
    for ranks in (6, 8):
        out = subprocess.run(
            [sys.executable, "-m", "pycoll.launch.pycollrun", "-np", str(ranks), "python",
             "-m", "pytest", "-p", "no:cacheprovider", "-q", "--with-mpi", "-m", "mpi",
             "-k", "stress", str(ROOT / "tests" / "test_decentral.py")],
            env=env, capture_output=True, text=True, timeout=110, cwd=ROOT)
        assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
        assert "4 passed" in out.stdout


@pytest.mark.mpi
def test_training_under_every_policy_matches_synchronous(pycoll_world):
    sys.path.insert(0, str(ROOT / "examples"))
    torch = pytest.importorskip("torch")
    import ripples_digits
    from digits import load
    torch.set_num_threads(1)
    args = ripples_digits.argparse.Namespace(
        seconds=0, steps=150, step_time=0.0, batch_size=16, lr=0.05, group_size=3,
        eval_every=50, seed=0)
    data = load()
    results = {s: ripples_digits.train(s, args, data) for s in ripples_digits.SCHEMES}
    if pycoll.rank() == 0:
        synchronous = results["allreduce"]["final_accuracy"]
        assert synchronous > 0.9
        for scheme, result in results.items():
            assert result["final_accuracy"] >= synchronous - 0.03, (scheme, result["final_accuracy"])


ADPSGD_WHILE_TRAINING = """
import time, torch, pycoll
from pycoll.decentral import ADPSGD
from torch.nn.utils import parameters_to_vector
pycoll.init()
torch.set_num_threads(1)
rank = pycoll.rank()
model = torch.nn.Sequential(*[torch.nn.Linear(4, 4) for _ in range(8)])
optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
sync = ADPSGD(model, seed=rank)
until = time.monotonic() + 3
while time.monotonic() < until:
    if rank % 2 == 0:                   # an active: averages with the passive, back to back
        for p in model.parameters():
            p.grad = torch.zeros_like(p)
        sync.step(optimizer)
    else:                               # the passive's training thread, while it serves
        model(torch.ones(2, 4)).sum().backward()
        parameters_to_vector(model.parameters())
sync.close()
print(f"rank {rank} done", flush=True)
"""


def test_adpsgd_passive_serves_while_its_training_thread_uses_the_model(tmp_path):
    """A passive's service thread writes the model while its training thread runs forward,
    backward and reads it: with torch's ``vector_to_parameters`` the two deadlocked
    (torch's autograd lock against the GIL) within seconds, every run."""
    script = tmp_path / "adpsgd.py"
    script.write_text(ADPSGD_WHILE_TRAINING)
    env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
               PYCOLL_TIMEOUT="30")
    try:
        out = subprocess.run([sys.executable, "-m", "pycoll.launch.pycollrun", "-np", "2",
                              "python", str(script)], env=env, capture_output=True,
                             text=True, timeout=60, cwd=ROOT)
    except subprocess.TimeoutExpired as hung:
        pytest.fail(f"the job hung: {hung.stdout} {hung.stderr}")
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "rank 0 done" in out.stdout and "rank 1 done" in out.stdout


@pytest.mark.mpi(min_size=2)
def test_adpsgd_averages_atomically_then_applies_the_gradient(pycoll_world):
    """Lian et al.'s order on an active: average with one random passive, then apply its own
    gradient (x_i <- (x_i + x_j) / 2 - lr * g): rank 0 (x = 0, g = 1, lr = 1) ends at 4
    when its passive held 10, and that passive at the average, 5; the other passives keep
    10. Only rank 0 steps, so no other averaging can come between."""
    torch = pytest.importorskip("torch")
    from pycoll.decentral import ADPSGD
    rank = pycoll.rank()
    model = torch.nn.Linear(1, 1, bias=False)
    with torch.no_grad():
        model.weight.fill_(0.0 if rank % 2 == 0 else 10.0)
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    sync = ADPSGD(model, seed=rank)
    if rank == 0:
        model.weight.grad = torch.ones_like(model.weight)
        sync.step(optimizer)
    sync.close()                        # a passive has served every averaging by then
    weights = pycoll.allgather(np.array([model.weight.item()]))
    want = [4.0] + [0.0 if r % 2 == 0 else 10.0 for r in range(1, pycoll.size())]
    (averaged,) = [r for r in range(1, pycoll.size(), 2) if weights[r] == 5.0]
    want[averaged] = 5.0
    np.testing.assert_array_equal(weights, want)


@pytest.mark.mpi(min_size=3)
def test_adpsgd_serializes_two_actives_at_one_passive(pycoll_world):
    """Actives 0 and 2 (x = 0 and 20) both average with passive 1 (x = 10) at once: the
    passive's lock makes the averagings one after the other, so the result is one of the
    two serial orders (0 first: 5, 12.5, 12.5; 2 first: 7.5, 7.5, 15), never a mix; the
    passive counts both."""
    torch = pytest.importorskip("torch")
    from pycoll.decentral import ADPSGD
    rank = pycoll.rank()
    model = torch.nn.Linear(1, 1, bias=False)
    with torch.no_grad():
        model.weight.fill_({0: 0.0, 2: 20.0}.get(rank, 10.0))
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    sync = ADPSGD(model, seed=rank)
    sync.rng.choice = lambda passives: 1            # every active picks rank 1
    if rank in (0, 2):
        model.weight.grad = torch.zeros_like(model.weight)
        sync.step(optimizer)
    sync.close()
    weights = pycoll.allgather(np.array([model.weight.item()]))[:3].tolist()
    assert weights in ([5.0, 12.5, 12.5], [7.5, 7.5, 15.0]), weights
    counters = pycoll.allgather(np.array([sync.counters()["averages"]]))
    assert counters[:3].tolist() == [1, 2, 1]
    assert all(c == 0 for c in counters[3:])
