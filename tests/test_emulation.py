"""--link and --slowdown windows: the model, and that transfers take their modelled time.

Timing tests assert lower bounds tightly (a transfer never beats its model) and upper
bounds generously: ranks oversubscribe a 2-core machine that other jobs share. The exact
figures are bench/emulation.py's.
"""
import math
import os
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

from pycoll import _C, config, emulation, hetero

pytestmark = pytest.mark.timeout(120)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LATENCY, BANDWIDTH = 2e-3, 100e6          # slow enough that real transfers are negligible
LINK = "2ms,100MB/s"


# ---------------------------------------------------------------- the model, no MPI

@pytest.mark.parametrize("text, seconds", [("50us", 50e-6), ("1.5ms", 1.5e-3), ("2s", 2.0),
                                           ("100ns", 1e-7), ("0", 0.0), ("0.5 ms", 5e-4)])
def test_latency_units(text, seconds):
    assert emulation.parse_latency(text) == pytest.approx(seconds)


@pytest.mark.parametrize("text, rate", [("1.25GB/s", 1.25e9), ("10Gb/s", 1.25e9),
                                        ("10Gbit/s", 1.25e9), ("100MiB/s", 100 * 2**20),
                                        ("125MB/s", 125e6), ("1e9B/s", 1e9), ("56Gbps", 7e9)])
def test_bandwidth_units(text, rate):
    assert emulation.parse_bandwidth(text) == pytest.approx(rate)


def test_link_entries():
    links = emulation.parse_link("50us,1.25GB/s,3:1ms,125MB/s, 5:0,1GB/s")
    assert links.default == pytest.approx((50e-6, 1.25e9))
    assert links.of(0) == links.default and links.of(3) == pytest.approx((1e-3, 125e6))
    assert links.of(5) == pytest.approx((0.0, 1e9)) and sorted(links) == [3, 5]
    alone = emulation.parse_link("3:1ms,125MB/s")        # rank 3 alone: the others are ideal
    assert alone and alone.of(0) == (0.0, math.inf) and alone.of(3)[0] == pytest.approx(1e-3)
    for off in ("", "off", "none", "0"):
        assert emulation.parse_link(off) is None
    assert emulation.parse_link((1e-3, 1e6)) == emulation.Links((1e-3, 1e6))


@pytest.mark.parametrize("text, words", [("50us", "LATENCY,BANDWIDTH"),
                                         ("50,1GB/s", "latency '50'"),
                                         ("50us,fast", "bandwidth 'fast'"),
                                         ("50us,0GB/s", "positive"),
                                         ("50us,1GB/s,60us,1GB/s", "two entries without a rank"),
                                         ("x:50us,1GB/s", "not a rank")])
def test_link_errors_say_what_is_wrong(text, words):
    with pytest.raises(ValueError, match=words):
        emulation.parse_link(text)


def test_link_knob_from_the_environment(monkeypatch):
    try:
        monkeypatch.setenv("PYCOLL_LINK", "1ms,1GB/s")
        config.reload()
        assert config.get("link") == emulation.Links((1e-3, 1e9))
        monkeypatch.setenv("PYCOLL_LINK", "1ms")
        with pytest.raises(ValueError, match="PYCOLL_LINK='1ms'"):
            config.reload()             # watchers read the link at once: they raise there
            config.get("link")
    finally:
        monkeypatch.delenv("PYCOLL_LINK")
        config.reload()


def test_collective_costs():
    a, b, B = 1e-4, 1e9, 8e6
    assert emulation.collective_time("allreduce", 4, B, a, b) == pytest.approx(6 * (a + B / 4e9))
    assert emulation.collective_time("allgather", 4, B, a, b) == pytest.approx(3 * (a + B / 4e9))
    assert emulation.collective_time("reduce_scatter", 3, B, a, b) == pytest.approx(2 * (a + B / 3e9))
    assert emulation.collective_time("broadcast", 5, B, a, b) == pytest.approx(3 * (a + B / b))
    assert emulation.collective_time("barrier", 4, 0, a, b) == pytest.approx(2 * a)
    assert emulation.collective_time("allreduce", 1, B, a, b) == 0
    assert emulation.transfer_time(B, a, b) == pytest.approx(a + B / b)
    with pytest.raises(ValueError, match="no cost model"):
        emulation.collective_time("gossip", 2, B, a, b)


def test_a_pace_group_says_what_is_wrong():
    with pytest.raises(ValueError, match="world rank 5 must be among the members once"):
        _C.PaceGroup(1, [0, 1], 5, None)
    with pytest.raises(ValueError, match="world rank 1 must be among the members once"):
        _C.PaceGroup(1, [0, 1, 1], 1, None)
    group = _C.PaceGroup(7, [2, 0, 3], 0, "owner")
    assert (group.size, group.count, group.owner) == (3, 0, "owner")
    with pytest.raises(ValueError, match="no cost model for collective 'gossip'"):
        group.enter("gossip", 4, 0.0)
    assert group.count == 0                            # nothing entered
    with pytest.raises(TypeError, match="is not a PaceEntry"):
        _C.pace_leave(group)


def test_without_a_link_nothing_is_wrapped(settings):
    settings(link=None)
    thing, run = object(), lambda: 1
    assert emulation.p2p(thing) is thing
    assert emulation.timed("allreduce", thing, 8, run) is run


def test_sleep_until_is_on_time_and_sleeps():
    cpu = time.thread_time()          # this thread's: numpy's own threads spin a while
    for delay in (0.0002, 0.002, 0.02):
        start = time.monotonic()
        emulation.sleep_until(start + delay)
        late = time.monotonic() - start - delay
        assert 0 <= late < 0.02, (delay, late)
    assert time.thread_time() - cpu < 0.01            # 22 ms waited, mostly asleep


def test_nap_ends_when_the_emulation_releases_a_request(settings, monkeypatch):
    """A poller's nap (the parameter server's) under a link ends at the emulation's
    release, not after its full length; without a link it is a plain sleep."""
    settings(link=LINK)
    emulation.nap(0.0)                  # the releases of earlier tests, seen
    threading.Timer(0.05, _C.link_released).start()
    start = time.monotonic()
    emulation.nap(60.0)
    assert time.monotonic() - start < 30
    _C.link_released()                  # while the poller tested: its next nap ends at once
    start = time.monotonic()
    emulation.nap(60.0)
    assert time.monotonic() - start < 30
    settings(link=None)
    slept, me, sleep = [], threading.get_ident(), time.sleep
    monkeypatch.setattr(time, "sleep", lambda s: slept.append(s) if threading.get_ident() == me
                        else sleep(s))
    threading.Timer(0.01, _C.link_released).start()      # no link: not looked at
    emulation.nap(0.25)
    assert slept == [0.25]


def test_link_wait_completes_requests_at_their_dues_and_returns_on_a_record():
    """The emulation thread's wait (csrc/link.cpp): each generalized request completes at
    its due, not before, and wakes the nappers; a readable descriptor ends the wait."""
    from mpi4py import MPI
    from pycoll.work import mpi_from_c
    assert mpi_from_c() == ""
    held = [MPI.Grequest.Start(lambda status: None, lambda: None, lambda done: None)
            for _ in range(3)]
    read, write = os.pipe()
    napped = []
    napper = threading.Thread(target=lambda: napped.append((_C.link_nap(0.0), _C.link_nap(60.0))))
    napper.start()
    start = time.monotonic()
    dues = [start + 0.02, start + 0.04, start + 30.0]
    releases = [(due, MPI._handleof(g)) for due, g in zip(dues, held)]
    done, ready, error = _C.link_wait(releases, [read], start + 0.06)
    assert (done, ready, error) == (2, [], 0)
    assert time.monotonic() >= start + 0.06
    assert [g.Test() for g in held] == [True, True, False]
    napper.join(30)
    assert napped[0][1] is True
    threading.Timer(0.02, os.write, (write, b"!")).start()
    done, ready, error = _C.link_wait(releases[2:], [read], math.inf)
    assert (done, ready, error) == (0, [0], 0)
    assert not held[2].Test()
    assert _C.link_wait(releases[2:], [], time.monotonic()) == (0, [], 0)     # until passed
    held[2].Complete()
    held[2].Wait()
    os.close(read)
    os.close(write)


def test_core_waits_count_only_the_wait_after_the_deadline():
    """The cluster time's correction: of a thread's run delay (runnable, no core) only
    what came after the modelled deadline is counted, never more than the time since it."""
    woke, after = _C.core_wait_woke, _C.core_wait_after
    after(-math.inf)                                     # forget what came before

    def back(at, run_delay, deadline, before, awake=-1.0):   # this thread, at `at`
        woke(deadline, before, awake, at, run_delay)

    back(9.9, 5e-6, deadline=10.0, before=0.0)          # back before the deadline: nothing
    assert after(0.0, 9.9, 5e-6) == 0.0
    back(10.00005, 200e-6, deadline=10.0, before=0.0)   # waited 200 us, 50 of them after it
    assert after(0.0, 10.00005, 200e-6) == pytest.approx(50e-6)
    back(10.00005, 10e-6, deadline=10.0, before=0.0)    # waited 10 us, all after it
    # Awake from 30 us before the deadline (sleep_until's spin): 50 us of waits, of
    # which up to 30 may have come before it; at most the 40 us since it count.
    back(10.00004, 60e-6, deadline=10.0, before=10e-6, awake=9.99997)
    assert after(9.0, 10.001, 60e-6) == pytest.approx(30e-6)
    assert after(9.0, 10.001, 60e-6) == 0.0             # forgotten once read
    back(20.0001, 1.0, deadline=20.0, before=0.0)       # an earlier deadline's wait...
    back(20.0003, 1.0, deadline=20.0002, before=0.0)    # ...gives way to the latest's
    back(20.0004, 1.0, deadline=20.0001, before=0.0)    # and an earlier one stays out
    assert after(15.0, 20.0005, 1.0) == pytest.approx(100e-6)
    back(30.1, 1.0, deadline=30.0, before=0.0)
    assert after(31.0, 30.2, 1.0) == 0.0                # before ``since``: another run's
    back(40.1, 1.0, deadline=40.0, before=0.0)
    assert after(39.0, 40.05, 1.0) <= 0.05              # never more than the time since it
    back(50.0001, 100e-6, deadline=50.0, before=0.0)
    # this thread's waits since it woke, too
    assert after(49.0, 50.001, 300e-6) == pytest.approx(300e-6)


def test_sleep_until_counts_its_core_wait_when_asked():
    """Counted only after ``count_core_waits``; then at most how late the sleep ended."""
    was = _C.counting_core_waits()
    _C.count_core_waits(False)
    try:
        start = time.monotonic()
        emulation.sleep_until(start + 0.001)
        assert emulation.core_wait_after(-math.inf) == 0.0
        emulation.count_core_waits()
        assert _C.counting_core_waits()
        for _ in range(20):
            start = time.monotonic()
            emulation.sleep_until(start + 0.0005)
            waited = emulation.core_wait_after(start)
            assert 0.0 <= waited <= time.monotonic() - (start + 0.0005)
    finally:
        _C.count_core_waits(was)


def test_sleep_until_returns_on_time():
    """Asleep, then yielding: not before its deadline, and (this thread alone) soon after."""
    late = []
    for wait in (0.0, 50e-6, 500e-6, 2e-3):
        start = time.monotonic()
        emulation.sleep_until(start + wait)
        late.append(time.monotonic() - (start + wait))
    assert min(late) >= 0.0
    assert sorted(late)[len(late) // 2] < 0.05       # generous: a loaded machine's slice

# ---------------------------------------------------------------- slowdown windows

def test_slowdown_windows_parse():
    factors = config.parse_slowdown("1:3,2:2@1-2,2:4@3-,2:1.5")
    assert factors[1] == 3.0 and factors[2] == 4.0      # a windowed rank: its largest factor
    w = factors[2]
    assert [w.at(t) for t in (0, 1, 1.5, 2, 2.9, 3, 100)] == [1.5, 2, 2, 1.5, 1.5, 4, 4]
    assert config.parse_slowdown("0:2@0-1")[0].at(5) == 1.0
    for bad, words in [("1:2@3-1", "START < END"), ("1:2@x-3", "RANK:FACTOR"),
                       ("1:2@3", "@START-END"), ("1:0.5@1-2", "FACTOR >= 1")]:
        with pytest.raises(ValueError, match=words):
            config.parse_slowdown(bad)


def test_slowdown_window_starts_and_stops(settings, monkeypatch):
    settings(slowdown="0:4@0.3-0.6")
    monkeypatch.setattr(hetero, "_rank", lambda: 0)
    # The sleeps slowdown() asks for, recorded instead of slept (this thread's only), so
    # what is checked is the rule, not how this machine schedules threads.
    asked, me, sleep = [], threading.get_ident(), time.sleep
    monkeypatch.setattr(time, "sleep", lambda s: asked.append(s) if threading.get_ident() == me
                        else sleep(s))
    hetero.mark_start()
    seen = []
    while hetero.elapsed() < 0.9:
        del asked[:]
        with hetero.slowdown() as factor:
            end = time.monotonic() + 0.02
            while time.monotonic() < end:
                pass
        seen.append((round(hetero.elapsed(), 2), factor, list(asked)))
    before = [s for s in seen if s[0] < 0.3]
    inside = [s for s in seen if s[1] == 4.0]
    assert before and before[0][1] == 1.0 and inside and seen[-1][1] == 1.0, seen
    assert all(len(s[2]) == 1 and s[2][0] >= 3 * 0.02 for s in inside), seen   # (4 - 1) x 20 ms
    assert not any(s[2] for s in seen if s[1] == 1.0), seen
    assert hetero.slowdown_factor() == 1.0


def test_pycollrun_checks_link_ranks():
    launcher = [sys.executable, os.path.join(ROOT, "launch", "pycollrun.py")]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYCOLL_", "OMPI_COMM_", "PMIX_"))}
    for value, words in [("3:1ms,1GB/s", "does not exist"), ("1ms", "LATENCY,BANDWIDTH")]:
        out = subprocess.run(launcher + ["-np", "2", "--link", value, "python", "-c", "pass"],
                             capture_output=True, text=True, env=env, timeout=60)
        assert out.returncode == 2 and "--link" in out.stderr and words in out.stderr


# ---------------------------------------------------------------- under MPI

@pytest.fixture
def link(settings, pycoll_world):
    """Set the link knob for one test; ``link(text)`` sets another."""
    def use(text):
        settings(link=text)
    use(LINK)
    return use


def _timed(run):
    """(seconds run took from a common start, the end time on every rank)."""
    from mpi4py import MPI
    import pycoll
    pycoll.barrier()
    start = time.monotonic()
    result = run()
    end = time.monotonic()
    return end - start, MPI.COMM_WORLD.allgather(end), result


def _cost(kind, n, nbytes):
    return emulation.collective_time(kind, n, nbytes, LATENCY, BANDWIDTH)


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("kind", ["allreduce", "allgather", "broadcast", "reduce_scatter",
                                  "alltoall", "barrier", "grouped"])
def test_collectives_take_their_model_time_and_leave_together(link, kind):
    import pycoll
    n, r = pycoll.size(), pycoll.rank()
    x = np.full(n * 8192, r + 1.0, np.float32)                     # 32n KiB
    runs = {"allreduce": (lambda: pycoll.allreduce(x, op=pycoll.Sum), "allreduce", x.nbytes),
            "grouped": (lambda: pycoll.grouped_allreduce([x, x[:100]], op=pycoll.Sum),
                        "allreduce", x.nbytes + 400),
            "allgather": (lambda: pycoll.allgather(x), "allgather", n * x.nbytes),
            "broadcast": (lambda: pycoll.broadcast(x, root=n - 1), "broadcast", x.nbytes),
            "reduce_scatter": (lambda: pycoll.reduce_scatter(x, op=pycoll.Sum),
                               "reduce_scatter", x.nbytes),
            "alltoall": (lambda: pycoll.alltoall(x), "alltoall", x.nbytes),
            "barrier": (lambda: pycoll.barrier(), "barrier", 0)}
    run, model, nbytes = runs[kind]
    took, ends, result = _timed(run)
    cost = _cost(model, n, nbytes)
    assert took >= cost * 0.99, (kind, took, cost)
    assert took < 3 * cost + 0.25, (kind, took, cost)
    assert max(ends) - min(ends) < 0.3 * cost + 0.02, (kind, ends)      # they leave together
    total = n * (n + 1) / 2
    if kind == "allreduce":
        assert np.all(result == total)
    elif kind == "grouped":
        assert np.all(result[0] == total) and np.all(result[1] == total)
    elif kind == "broadcast":
        assert np.all(result == n)
    elif kind == "allgather":
        assert np.array_equal(result, np.repeat(np.arange(1.0, n + 1), x.size))


@pytest.mark.mpi(min_size=2)
def test_async_fused_allreduces_cost_one_model_per_batch(link):
    import pycoll
    n = pycoll.size()
    xs = [np.ones(1024, np.float32) for _ in range(10)]         # one 40 KiB batch
    took, _, works = _timed(lambda: [w.wait() for w in
                                     [pycoll.allreduce_async(x, op=pycoll.Sum) for x in xs]])
    assert all(np.all(y == n) for y in works)
    cost = _cost("allreduce", n, 40960)
    assert cost * 0.99 <= took < 3 * cost + 0.25, (took, cost)


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("kind", ["allreduce", "grouped", "broadcast", "allgather",
                                  "reduce_scatter", "alltoall"])
def test_the_short_path_runs_under_a_link_and_costs_its_model(link, settings, kind):
    """Default configuration (no checks): the C short path runs the collective between the
    emulation's enter and leave, so it costs its model and gives the general path's result."""
    import pycoll
    from pycoll import _C
    settings(check=False)
    n, r = pycoll.size(), pycoll.rank()
    x = np.full(4 * n, r + 1.0, np.float32)
    runs = {"allreduce": (lambda: pycoll.allreduce(x, op=pycoll.Sum), "allreduce", x.nbytes),
            "grouped": (lambda: pycoll.grouped_allreduce([x, x[:3]], op=pycoll.Sum),
                        "allreduce", x.nbytes + 12),
            "broadcast": (lambda: pycoll.broadcast(x, root=n - 1), "broadcast", x.nbytes),
            "allgather": (lambda: pycoll.allgather(x), "allgather", n * x.nbytes),
            "reduce_scatter": (lambda: pycoll.reduce_scatter(x, op=pycoll.Sum),
                               "reduce_scatter", x.nbytes),
            "alltoall": (lambda: pycoll.alltoall(x)[0], "alltoall", x.nbytes)}
    run, model, nbytes = runs[kind]
    before = _C.short_path_runs()
    took, ends, got = _timed(run)
    assert _C.short_path_runs() == before + 1, "the short path stepped aside"
    cost = _cost(model, n, nbytes)
    assert took >= cost * 0.99, (kind, took, cost)
    assert took < 3 * cost + 0.25, (kind, took, cost)
    assert max(ends) - min(ends) < 0.3 * cost + 0.02, (kind, ends)      # they leave together
    settings(link=None)                     # the same call without a link: the same result
    unpaced = run()
    assert _C.short_path_runs() == before + 2
    for a, b in zip(got if kind == "grouped" else [got], unpaced if kind == "grouped" else [unpaced]):
        assert np.array_equal(a, b), (kind, a, b)
    total = n * (n + 1) / 2
    expected = {"allreduce": np.full(4 * n, total), "broadcast": np.full(4 * n, n),
                "allgather": np.repeat(np.arange(1.0, n + 1), 4 * n),
                "reduce_scatter": np.full(4, total), "alltoall": np.repeat(np.arange(1.0, n + 1), 4),
                "grouped": np.full(4 * n, total)}[kind]
    assert np.array_equal(got[0] if kind == "grouped" else got, expected), (kind, got)


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("kind", ["allreduce", "allgather", "partial"])
def test_the_compiled_paths_charge_the_model_from_the_call(link, settings, monkeypatch, kind):
    """Default configuration (no checks): the compiled paths' model runs from the call, as
    the general path's does, not from when their own work before the MPI calls is done:
    the entry's time is taken in C before the emulation's group is even looked up."""
    import pycoll
    from pycoll import _C, partial
    settings(check=False, partial_cache_after=0)
    n = pycoll.size()
    x = np.ones(4 * n, np.float32)
    calls = {"allreduce": lambda: _C.allreduce_now(x, True, pycoll.Sum, None, None),
             "allgather": lambda: _C.allgather_now(x, None, None, None),
             "partial": lambda: _C.partial_now(x, True, list(range(n)), pycoll.Sum, None)}
    partial._state()                                # bound as by a first call
    seen, group = [], emulation.group

    def spy(*args, **kwargs):
        seen.append((time.monotonic(), group(*args, **kwargs)))
        return seen[-1][1]
    pycoll.barrier()
    monkeypatch.setattr(emulation, "group", spy)
    called = time.monotonic()
    assert calls[kind]() is not None, "the compiled path stepped aside under a link"
    (hooked, paced), = seen
    assert called <= paced.latest < hooked, (called, paced.latest, hooked)


@pytest.mark.mpi(min_size=2)
def test_per_rank_links_pace_the_group(link):
    import pycoll
    from mpi4py import MPI
    link("1ms,1GB/s,1:40ms,1GB/s")
    n, r = pycoll.size(), pycoll.rank()
    took, _, _ = _timed(lambda: pycoll.barrier())
    rounds = math.ceil(math.log2(n))
    assert took >= rounds * 0.040 * 0.99, took                      # rank 1 sets the pace
    if n >= 3:                                                      # a group without rank 1
        others = [q for q in range(n) if q != 1]
        group = pycoll.new_group(others)
        fastest = 0.0
        if r != 1:
            pycoll.barrier(group=group)
            fastest = min(_seconds(lambda: pycoll.barrier(group=group)) for _ in range(3))
        MPI.COMM_WORLD.Barrier()        # before the check: a rank failing it leaves no one behind
        assert fastest < 0.035, fastest                             # not rank 1's 40 ms


def _seconds(run) -> float:
    start = time.monotonic()
    run()
    return time.monotonic() - start


@pytest.fixture
def comm(link):
    """An emulated duplicate of COMM_WORLD (made while the link is set)."""
    from mpi4py import MPI
    c = emulation.p2p(MPI.COMM_WORLD.Dup())
    assert isinstance(c, emulation.Comm)
    yield c
    c.Barrier()
    c.Free()


def _together(comm) -> float:
    """Start every rank at one instant (ranks share this machine's monotonic clock): a
    barrier alone lets some leave milliseconds before others."""
    from mpi4py import MPI
    start = comm.allreduce(time.monotonic(), op=MPI.MAX) + 0.005
    emulation.sleep_until(start)
    return start


MESSAGE = 1 << 20                  # 10.5 ms at 100 MB/s


@pytest.mark.mpi(min_size=2)
def test_a_message_takes_latency_plus_bytes_over_bandwidth(comm):
    """Sender: done when its last byte has left; receiver: latency later. Every rank
    communicates first and asserts after, so a failed check never leaves a peer waiting."""
    from mpi4py import MPI
    r = comm.Get_rank()
    data = np.full(MESSAGE, r, np.uint8)
    transfer = emulation.transfer_time(MESSAGE, LATENCY, BANDWIDTH)
    times, statuses, released = [], [], []
    for blocking in (False, True):
        napper = threading.Thread(target=lambda: released.append(_C.link_nap(5.0)))
        if not blocking and r in (0, 1):       # a held request's release wakes nappers
            napper.start()
        start = _together(comm)
        status = MPI.Status()
        if r == 0:
            if blocking:
                comm.Send(data, dest=1, tag=3)
            else:
                comm.Isend(data, dest=1, tag=3).Wait()
        elif r == 1:
            if blocking:
                comm.Recv(data, source=MPI.ANY_SOURCE, tag=MPI.ANY_TAG, status=status)
            else:
                comm.Irecv(data, source=MPI.ANY_SOURCE, tag=MPI.ANY_TAG).Wait(status)
        times.append(time.monotonic() - start)
        if napper.ident:
            napper.join(10)
        statuses.append((status.Get_source(), status.Get_tag(), status.Get_count(MPI.BYTE)))
    if r == 0:
        assert min(times) >= MESSAGE / BANDWIDTH * 0.99, times          # its last byte left
    elif r == 1:
        assert min(times) >= transfer * 0.99 and max(times) < 3 * transfer + 0.25, times
        assert statuses == [(0, 3, MESSAGE)] * 2 and np.all(data == 0)
    assert all(released), "the held Isend/Irecv was released without waking nappers"


@pytest.mark.mpi(min_size=2)
def test_pickled_and_probed_messages_and_messages_to_oneself(comm):
    from mpi4py import MPI
    r, n = comm.Get_rank(), comm.Get_size()
    req = comm.irecv(source=(r - 1) % n, tag=5)
    start = _together(comm)
    comm.send({"from": r}, dest=(r + 1) % n, tag=5)
    got = req.wait()
    took = time.monotonic() - start
    listed, probed, status = None, np.empty(4), MPI.Status()
    if r == 0:
        comm.isend([1, 2, 3], dest=1, tag=6).wait()
        comm.Send(np.arange(4.0), dest=1, tag=7)
    elif r == 1:
        listed = comm.recv(source=0, tag=6)
        message = comm.improbe(0, 7, status)
        while message is None:
            message = comm.improbe(0, 7, status)
        message.Recv(probed)
    mine = np.arange(8.0) + r                                      # to itself: free
    back = np.empty(8)
    recv = comm.Irecv(back, source=r, tag=8)
    comm.Isend(mine, dest=r, tag=8).Wait()
    before = time.monotonic()
    recv.Wait()
    to_self = time.monotonic() - before
    assert got == {"from": (r - 1) % n} and took >= LATENCY * 0.99, (got, took)
    if r == 1:
        assert listed == [1, 2, 3] and status.Get_source() == 0
        assert np.array_equal(probed, np.arange(4.0))
    assert np.array_equal(back, mine) and to_self < 0.05


@pytest.mark.mpi(min_size=2)
def test_probed_messages_are_received_without_the_sweep(comm, monkeypatch):
    """The parameter server's way of receiving (Improbe, then the matched message's
    Irecv) completes when its record comes, not on the pass over every queue that runs
    each FALLBACK_S (off here): that pass cost each PS payload piece up to 10 ms."""
    from mpi4py import MPI
    from pycoll.work import wait_requests
    monkeypatch.setattr(emulation, "_FALLBACK_S", math.inf)
    r, n = comm.Get_rank(), comm.Get_size()
    sent = [comm.Isend(np.full(1024, 10 * r + i, np.int32), dest=(r + 1) % n, tag=11)
            for i in range(3)]
    inbox, received, status = [np.empty(1024, np.int32) for _ in range(3)], [], MPI.Status()
    for box in inbox:
        message = comm.Improbe((r - 1) % n, 11, status)
        deadline = time.monotonic() + 30
        while message is None and time.monotonic() < deadline:
            time.sleep(1e-4)
            message = comm.Improbe((r - 1) % n, 11, status)
        assert message is not None
        received.append(message.Irecv(box))
    pending = wait_requests(received + sent, 30.0)
    comm.Barrier()
    assert pending == [], pending
    assert [int(box[0]) for box in inbox] == [10 * ((r - 1) % n) + i for i in range(3)]


@pytest.mark.mpi(min_size=2)
def test_a_probed_messages_receive_completes_at_its_arrival_in_the_model(comm):
    """Posted before the modelled arrival, a matched message's Irecv is held until then;
    posted after it (the parameter server takes a payload piece once it has waited for
    the header), it completes with the real receive, without the emulation thread. Every
    rank communicates first and asserts after: a rank failing a check in the loop left the
    others waiting in the fixture's barrier, and the suite hung."""
    from mpi4py import MPI
    r, n = comm.Get_rank(), comm.Get_size()
    model = LATENCY + 4096 / BANDWIDTH
    seen = []
    for late in (0.0, 3 * model):
        box, status = np.empty(1024, np.int32), MPI.Status()
        start = _together(comm)
        sent = comm.Isend(np.full(1024, r, np.int32), dest=(r + 1) % n, tag=12)
        emulation.sleep_until(start + late)
        message = comm.Improbe((r - 1) % n, 12, status)
        while message is None:
            message = comm.Improbe((r - 1) % n, 12, status)
        posted = time.monotonic()
        request = message.Irecv(box)
        while not request.Test():
            pass
        done = time.monotonic()
        sent.Wait()                 # complete once its receiver has taken it: after ours
        seen.append((late, done - start, done - posted, type(request), box.copy()))
    comm.Barrier()
    for late, took, after_post, kind, box in seen:
        assert took >= model * 0.99, (late, took, model)
        if late:
            assert issubclass(kind, MPI.Request) and not issubclass(kind, MPI.Grequest)
            assert after_post < model, (after_post, model)          # no wait for a turn
        assert np.all(box == (r - 1) % n), (late, box[:4])


@pytest.mark.mpi(min_size=2)
def test_messages_of_one_source_and_tag_complete_in_order(comm, monkeypatch):
    """Receives of one source and tag complete in the order MPI matches them, each with
    its own message: the emulation takes a queue's receives in posting order, also in its
    pass over every queue (forced here on every wake-up), where one test of MPI can finish
    several."""
    from mpi4py import MPI
    monkeypatch.setattr(emulation, "_FALLBACK_S", 0.0)
    r, sizes = comm.Get_rank(), [(1 << 16) + 4096 * (i % 3) for i in range(24)]
    order, counts = [], []
    _together(comm)
    if r == 0:
        MPI.Request.Waitall([comm.Isend(np.full(size, i, np.uint8), dest=1, tag=9)
                             for i, size in enumerate(sizes)])
    elif r == 1:
        inbox = [np.empty(size, np.uint8) for size in sizes]
        requests = [comm.Irecv(box, source=0, tag=9) for box in inbox]
        status = MPI.Status()
        while len(order) < len(requests):
            index = MPI.Request.Waitany(requests, status)
            order.append(index)
            counts.append(status.Get_count(MPI.BYTE))
    comm.Barrier()
    if r == 1:
        assert order == list(range(len(sizes))), order
        assert counts == sizes and all(np.all(box == i) for i, box in enumerate(inbox))


@pytest.mark.mpi(min_size=2)
def test_a_cancelled_receive_completes(comm):
    from mpi4py import MPI
    request = comm.Irecv(np.empty(4), source=MPI.ANY_SOURCE, tag=99)
    request.Cancel()
    status = MPI.Status()
    request.Wait(status)
    assert status.Is_cancelled()


@pytest.mark.mpi(min_size=3)
def test_incast_serialises_at_the_receiver(comm):
    """One sender into rank 0, then all the others at once: they share its NIC in turn."""
    from mpi4py import MPI
    r, n = comm.Get_rank(), comm.Get_size()
    data = np.full(MESSAGE, r, np.uint8)
    inbox = [np.empty(MESSAGE, np.uint8) for _ in range(n)]
    times = []
    for senders in ([1], list(range(1, n))):
        start = _together(comm)
        if r == 0:
            MPI.Request.Waitall([comm.Irecv(inbox[s], source=s, tag=4) for s in senders])
        elif r in senders:
            comm.Isend(data, dest=0, tag=4).Wait()
        times.append(time.monotonic() - start)
    if r == 0:
        for senders, took in zip(([1], range(1, n)), times):
            serial = len(senders) * MESSAGE / BANDWIDTH + LATENCY
            assert serial * 0.99 <= took < 3 * serial + 0.25, (list(senders), took)
        assert all(np.all(inbox[s] == s) for s in range(1, n))


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("path", ["compiled", "python ring"])
@pytest.mark.parametrize("count", [1 << 10, 1 << 17])            # direct exchange, ring
def test_partial_allreduce_costs_its_model_and_is_exact(link, settings, monkeypatch, path, count):
    import pycoll
    from pycoll import partial
    from mpi4py import MPI
    settings(partial_cache_after=0)
    if path == "python ring":
        monkeypatch.setattr(partial._state(), "compiled", False)
        monkeypatch.setattr(partial._C, "partial_now", lambda *args: None)   # nor its entry
    n, r = pycoll.size(), pycoll.rank()
    x = np.full(count, r + 1.0, np.float32)
    start = _together(MPI.COMM_WORLD)
    y = pycoll.partial_allreduce(x, list(range(n)), op=pycoll.Sum)
    took = time.monotonic() - start
    MPI.COMM_WORLD.Barrier()
    assert np.all(y == n * (n + 1) / 2)
    kind = "direct" if x.nbytes <= config.get("partial_direct_bytes") else "allreduce"
    cost = _cost(kind, n, x.nbytes)
    assert cost * 0.99 <= took < 3 * cost + 0.25, (took, cost)


# ---------------------------------------------------------------- whole jobs

def _job(ranks, *args):
    """tests/emulation_job.py under pycollrun --link 1ms,100MB/s; its JSON line."""
    import json
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("PYCOLL_", "OMPI_COMM_", "PMIX_", "PMI_"))}
    env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    out = subprocess.run([sys.executable, os.path.join(ROOT, "launch", "pycollrun.py"), "-np",
                          str(ranks), "--link", "1ms,100MB/s", *args[:-1], "python",
                          os.path.join(ROOT, "tests", "emulation_job.py"), args[-1]],
                         capture_output=True, text=True, env=env, timeout=100, cwd=ROOT)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    return json.loads(next(line for line in out.stdout.splitlines() if line.startswith("{")))


def test_parameter_server_pushes_share_the_servers_link():
    """The job turns the emulation's pass over every receive queue off: the server's
    payload pieces complete as their records come (they once waited for that pass)."""
    times = _job(3, "--servers", "1", "ps")
    one = (1 << 20) / 100e6                                 # 1 MiB at 100 MB/s
    assert one * 0.99 <= times["push_1"] < 3 * one + 0.25, times
    assert 2 * one * 0.99 <= times["push_all"] < 6 * one + 0.25, times       # incast
    assert 2 * one + 2e-3 <= times["pull_all"] * 1.01, times   # the server's egress, in turn


def test_partial_allreduce_of_groups_that_change_every_round_is_exact():
    """Ripples' pattern under --link: groups of 3 that change every round, tensors whose
    ring blocks end in a short chunk. Before the compiled exchange ran under --link, the
    Python ring forwarded chunks as the emulation released them, out of order: receives
    were truncated (MPI_ERR_TRUNCATE), or took the wrong chunk, and the job aborted."""
    times = _job(4, "partial")
    assert times["wrong"] == [], times
    assert min(times["fastest"]) >= 0.99, times                # never faster than the model
    assert max(times["slowest"][1:]) < 3, times                # the first round warms up


def test_torch_send_recv_is_paced():
    times = _job(2, "torch")
    model = emulation.transfer_time(1 << 20, 1e-3, 100e6)
    assert model * 0.99 <= times["recv"] < 3 * model + 0.25, times
