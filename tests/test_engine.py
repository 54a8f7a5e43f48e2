"""The engine: fused results equal unfused ones; order and completion under threads."""
import random
import threading

import numpy as np
import pytest

import pycoll
from pycoll import collectives, config

pytestmark = [pytest.mark.mpi, pytest.mark.timeout(120)]


@pytest.fixture
def threshold(monkeypatch, pycoll_world):
    def set_threshold(nbytes):
        monkeypatch.setitem(config._overrides, "fusion_threshold", nbytes)
    return set_threshold


@pytest.fixture
def fused_calls(monkeypatch):
    """How many fused MPI calls ran, and with how many tensors each."""
    calls = []
    real = collectives._allreduce_fused

    def spy(items):
        calls.append(len(items))
        real(items)
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
