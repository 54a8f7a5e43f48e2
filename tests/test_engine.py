"""The engine: fused results equal unfused ones; order and completion under threads."""
import random
import threading
import time

import numpy as np
import pytest

import pycoll
from pycoll import collectives, config

pytestmark = [pytest.mark.mpi, pytest.mark.timeout(120)]


@pytest.fixture
def knob(settings, pycoll_world):
    return lambda name, value: settings(**{name: value})


@pytest.fixture
def threshold(knob):
    return lambda nbytes: knob("fusion_threshold", nbytes)


@pytest.fixture
def fused_calls(monkeypatch):
    """How many fused MPI calls ran, and with how many tensors each."""
    calls = []
    real = collectives._allreduce_fused

    def spy(many, which):
        calls.append(len(which))
        real(many, which)
    monkeypatch.setattr(collectives, "_allreduce_fused", spy)
    return calls


def tensors_for(rank, count=60):
    """Runs of one dtype (fused together), then another: only neighbours fuse."""
    rng = np.random.default_rng(7)
    dtypes = ["float32", "float64", "int32", "float16"]
    return [(rng.integers(-3, 4, int(rng.integers(0, 300))) + rank)
            .astype(dtypes[i * len(dtypes) // count]) for i in range(count)]


@pytest.mark.parametrize("nbytes", [1, 1024, 64 * 2**20])
def test_fused_results_equal_unfused(group, threshold, fused_calls, nbytes):
    arg, rank, size = group
    threshold(nbytes)
    xs = tensors_for(rank)
    works = [pycoll.allreduce_async(x, op=pycoll.Sum, group=arg) for x in xs]
    fused = [w.wait() for w in works]
    unfused = [pycoll.allreduce(x, op=pycoll.Sum, group=arg) for x in xs]
    for f, u in zip(fused, unfused):
        np.testing.assert_array_equal(f, u)
    if nbytes == 1:
        assert fused_calls == []                       # every tensor alone
    if nbytes == 64 * 2**20:
        assert fused_calls == [15, 15, 15, 15]          # one call per dtype


def expected_sums(size):
    return [sum(t.astype(np.float64) for t in ts)
            for ts in zip(*(tensors_for(r) for r in range(size)))]


@pytest.mark.parametrize("chunk", [8, 100, 2**20])
def test_pieces_of_chunk_bytes_give_the_same_results(group, knob, chunk):
    """Large allreduces travel in PYCOLL_CHUNK_BYTES pieces, cut anywhere but mid-element."""
    arg, rank, size = group
    knob("chunk_bytes", chunk)
    xs = tensors_for(rank)
    alone = [pycoll.allreduce(x, op=pycoll.Sum, group=arg) for x in xs]
    fused = [w.wait() for w in [pycoll.allreduce_async(x, op=pycoll.Sum, group=arg) for x in xs]]
    for a, f, want in zip(alone, fused, expected_sums(size)):
        np.testing.assert_array_equal(a, want)
        np.testing.assert_array_equal(f, want)
    y = np.arange(1001, dtype=np.float64) * (rank + 1)
    np.testing.assert_allclose(pycoll.allreduce(y, group=arg), np.arange(1001) * (size + 1) / 2)


@pytest.mark.parametrize("cycle_ms", [0.5, 20])
def test_cycle_time_batches_agree_across_ranks(group, knob, cycle_ms):
    """Each rank cuts batches by its own clock; rank 0 issues slowly, so its batches are
    shorter than the others' and the ranks must agree on a prefix every time."""
    arg, rank, size = group
    knob("cycle_time_ms", cycle_ms)
    xs = tensors_for(rank)
    works = []
    for i, x in enumerate(xs):
        works.append(pycoll.allreduce_async(x, op=pycoll.Sum, group=arg))
        if rank == 0 and i % 7 == 0:
            time.sleep(cycle_ms / 1e3 * 1.5)      # its open batch's cycle runs out
    waited = list(range(len(works)))
    random.Random(rank).shuffle(waited)           # wait out of order: moved Works too
    results = {i: works[i].wait(timeout=60) for i in waited}
    for i, want in enumerate(expected_sums(size)):
        np.testing.assert_array_equal(results[i], want)
    assert all(w.is_completed() for w in works)


def test_a_batch_leaves_when_its_cycle_ends(group, knob):
    """Nobody waits or flushes: without a cycle the batch stays, with one the cycle sends it."""
    arg, rank, size = group

    def issue_and_watch(seconds):
        xs = [np.full(10, rank, np.float32) for _ in range(4)]
        works = [pycoll.allreduce_async_(x, op=pycoll.Sum, group=arg) for x in xs]
        deadline = time.monotonic() + seconds
        while not all(w._done.is_set() for w in works) and time.monotonic() < deadline:
            time.sleep(0.01)                      # _done: is_completed() would flush
        sent = all(w._done.is_set() for w in works)
        for w in works:
            w.wait(timeout=60)
        for x in xs:
            np.testing.assert_array_equal(x, sum(range(size)))
        return sent

    assert not issue_and_watch(0.3)
    knob("cycle_time_ms", 5)
    assert issue_and_watch(30)


def test_thousand_small_tensors_make_few_calls(group, threshold, fused_calls):
    arg, rank, size = group
    threshold(1024 * 1024)
    xs = [np.full(1024, rank + i % 5, np.float32) for i in range(1000)]   # 4 KiB each
    works = [pycoll.allreduce_async_(x, op=pycoll.Average, group=arg) for x in xs]
    for w in works:
        w.wait()
    assert fused_calls == [256, 256, 256, 232]         # 1 MiB batches of 4 KiB tensors
    for i, x in enumerate(xs):
        np.testing.assert_allclose(x, np.mean([r + i % 5 for r in range(size)]), rtol=1e-6)


def test_large_tensors_skip_the_fusion_buffer(group, threshold, fused_calls):
    """Tensors of 256 KiB or more go to MPI by themselves, however the batch is cut."""
    arg, rank, size = group
    threshold(64 * 2**20)
    counts = [100, 70_000, 3, 5, 2**16, 9]                 # 2**16 float32: 256 KiB exactly
    xs = [np.full(n, rank + i, np.float32) for i, n in enumerate(counts)]
    for w in [pycoll.allreduce_async_(x, op=pycoll.Sum, group=arg) for x in xs]:
        w.wait()
    assert fused_calls == [4]
    for i, x in enumerate(xs):
        np.testing.assert_array_equal(x, sum(r + i for r in range(size)))


def test_grouped_allreduce_respects_the_threshold(group, threshold, fused_calls):
    arg, rank, size = group
    threshold(4096)
    xs = [np.full(300, rank, np.float32) for _ in range(10)]          # 1200 B each
    ys = pycoll.grouped_allreduce(xs, op=pycoll.Sum, group=arg)
    assert fused_calls == [3, 3, 3] and len(ys) == 10                 # + one alone
    for y in ys:
        np.testing.assert_array_equal(y, sum(range(size)))


def test_issue_order_is_run_order(group):
    arg, rank, size = group
    x = np.full(5, rank + 1, np.float64)
    works = [pycoll.allreduce_async_(x, op=pycoll.Sum, group=arg),
             pycoll.broadcast_async_(x, root=size - 1, group=arg),
             pycoll.allreduce_async_(x, op=pycoll.Product, group=arg)]
    gathered = pycoll.allgather_async(x, group=arg)
    total = size * (size + 1) / 2
    assert works[-1].wait() is x
    np.testing.assert_array_equal(x, total ** size)
    np.testing.assert_array_equal(gathered.wait(), np.full(5 * size, total ** size))
    assert all(w.is_completed() for w in works)


def test_many_threads_issue_and_wait(group):
    """Threads issue in turns (MPI needs one order on every rank), then wait at once."""
    arg, rank, size = group
    threads, per_thread = 6, 20
    turn = [0]
    cv = threading.Condition()
    works = {}
    errors = []

    def issue(t):
        try:
            for i in range(per_thread):
                with cv:
                    cv.wait_for(lambda: turn[0] % threads == t)
                    x = np.full(t * 10 + i + 1, rank * 1000 + t * 100 + i, np.int64)
                    works[t, i] = pycoll.allreduce_async(x, op=pycoll.Sum, group=arg)
                    turn[0] += 1
                    cv.notify_all()
        except BaseException as error:
            errors.append(error)

    def wait_all(t):
        try:
            keys = [(t, i) for i in range(per_thread)]
            random.Random(t).shuffle(keys)
            for t_, i in keys:
                expected = sum(r * 1000 + t_ * 100 + i for r in range(size))
                np.testing.assert_array_equal(works[t_, i].wait(timeout=60), expected)
        except BaseException as error:
            errors.append(error)

    for target in (issue, wait_all):
        pool = [threading.Thread(target=target, args=(t,)) for t in range(threads)]
        for th in pool:
            th.start()
        for th in pool:
            th.join(90)
    assert not errors, errors
    assert all(w.is_completed() and w.exception() is None for w in works.values())


def test_groups_run_side_by_side_from_threads(pycoll_world, in_opposite_orders):
    """Collectives on two groups from two threads, entered in opposite orders on
    neighbouring ranks: each group keeps its own order, as MPI and gloo allow, so
    neither waits for the other (one engine for the process deadlocked here)."""
    rank, size = pycoll.rank(), pycoll.size()
    groups = [pycoll.new_group(range(size)) for _ in range(2)]

    def run(g):
        x = np.full(4, rank + 1.0)
        for _ in range(3):
            pycoll.allreduce_(x, op=pycoll.Sum, group=groups[g])
            x /= size
        big = pycoll.allreduce(np.full(1 << 18, float(g)), op=pycoll.Sum, group=groups[g])
        root = pycoll.broadcast(np.full(3, float(rank)), root=size - 1, group=groups[g])
        gathered = pycoll.allgather(np.full(2, rank), group=groups[g])
        return x[0], big[-1], root[0], gathered.tolist()

    results = in_opposite_orders(run)
    for g in (0, 1):
        assert results[g] == ((size + 1) / 2, g * size, size - 1.0,
                              [r for r in range(size) for _ in range(2)])


def test_error_reaches_the_work_and_engine_goes_on(group, monkeypatch):
    arg, rank, size = group

    def broken(items):
        raise RuntimeError("injected")
    work = pycoll.runtime.engine().submit_fusable("k", 8, None, broken, "broken")
    with pytest.raises(RuntimeError, match="injected"):
        work.wait()
    assert isinstance(work.exception(), RuntimeError)
    np.testing.assert_array_equal(pycoll.allreduce(np.ones(3), op=pycoll.Sum, group=arg), size)


def test_blocking_call_from_a_running_batch_does_not_deadlock(group):
    """What a DDP comm hook's callback may do: a blocking collective inside a Work."""
    arg, rank, size = group
    inner = pycoll.runtime.engine().submit(
        lambda: pycoll.allreduce(np.ones(2), op=pycoll.Sum, group=arg), "callback")
    np.testing.assert_array_equal(inner.wait(timeout=60), size)


def test_a_waiting_caller_runs_what_the_idle_engine_holds(group):
    """A batch nobody has sent yet runs in the thread that waits for it (no thread
    switch), blocking calls inside it included, unless the wait has a deadline of its
    own, which must hold; one the engine's thread has taken finishes there."""
    arg, rank, size = group
    engine = pycoll.runtime.engine()
    ran_in = []

    def record(items):
        ran_in.append(threading.get_ident())
        return [pycoll.allreduce(x, op=pycoll.Sum, group=arg) for x in items]
    works = [engine.submit_fusable("record", 8, np.full(2, rank + i), record, "record")
             for i in range(3)]
    for i, w in enumerate(works):
        np.testing.assert_array_equal(w.wait(), sum(range(size)) + size * i)
    assert ran_in == [threading.get_ident()]
    work = engine.submit_fusable("record", 8, np.full(2, rank), record, "record")
    np.testing.assert_array_equal(work.wait(timeout=60), sum(range(size)))
    assert ran_in[-1] != threading.get_ident()

    started, release = threading.Event(), threading.Event()

    def hold(items):
        started.set()
        release.wait(60)
        ran_in.append(threading.get_ident())
        return items
    held = engine.submit(lambda: hold(None), "hold")
    started.wait(60)                        # the engine's thread runs it now
    threading.Timer(0.2, release.set).start()
    held.wait(timeout=60)
    assert ran_in[-1] != threading.get_ident()


def test_a_latch_is_a_one_shot_event():
    """work.Latch, the engines' and Works' event: set once (again is harmless), seen by
    every waiter, whichever thread waits first; a wait that runs out says it is not set."""
    from pycoll.work import Latch
    latch = Latch()
    started = time.monotonic()
    assert not latch.is_set() and latch.wait(0.05) is False and latch.wait(0) is False
    assert time.monotonic() - started >= 0.05
    seen = []
    waiters = [threading.Thread(target=lambda: seen.append(latch.wait(10))) for _ in range(4)]
    for waiter in waiters:
        waiter.start()
    time.sleep(0.05)
    latch.set()
    latch.set()
    for waiter in waiters:
        waiter.join(10)
    assert seen == [True] * 4 and latch.is_set()
    assert latch.wait() is True and latch.wait(0) is True
    racing = Latch()                    # a second set() while a waiter passes through
    threads = [threading.Thread(target=racing.set)] + [
        threading.Thread(target=lambda: seen.append(racing.wait(10))) for _ in range(8)]
    for thread in threads[::-1]:
        thread.start()
    threads.append(threading.Thread(target=racing.set))
    threads[-1].start()
    for thread in threads:
        thread.join(10)
    assert seen == [True] * 12 and racing.wait(0)


def test_the_gate_says_what_runs_since_when_and_among_whom():
    """The watchdog reads this: what waits for the group (among None), or for other ranks
    (a partial all-reduce on the world's engine), and nothing once the token is back. The
    start is read to the clock's tick (CLOCK_MONOTONIC_COARSE): the watchdog counts seconds."""
    from pycoll import _C
    gate = _C.Gate(lambda: None)
    before = time.monotonic()
    assert gate.running() is None and gate.claim("allreduce")
    name, start, among = gate.running()
    assert (name, among) == ("allreduce", None) and abs(start - before) < 0.05
    assert not gate.claim("second", (0, 1))         # held: the caller queues instead
    gate.running_as("partial_allreduce([0, 2])", (0, 2))
    assert gate.running()[::2] == ("partial_allreduce([0, 2])", (0, 2))
    gate.release()
    assert gate.running() is None and gate.claim("next", None) and gate.running()[2] is None
    gate.release()
    with pytest.raises(TypeError, match=r"takes \(name, among=None\)"):
        gate.claim("a", None, "extra")
