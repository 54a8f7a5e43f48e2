"""pycoll.overlap: the planner and the partition primitives in-process; allreduce
training with each schedule at every rank count; the parameter server's schedules
through whole jobs (tests/overlap_job.py)."""

from dataclasses import replace

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from pycoll import _C, config  # noqa: E402
from pycoll.overlap import plan as planner  # noqa: E402
from pycoll.overlap import schedule as sched  # noqa: E402
from pycoll.overlap.plan import Piece, Profile, Tensor  # noqa: E402
from ps_launch import run_ps_job  # noqa: E402

pytestmark = pytest.mark.timeout(120)

# Many small layers and two large ones (rows of 4 KiB).
TENSORS = [Tensor(64, 256, 0), Tensor(1, 256, 0)] + \
    [Tensor(16, 64, l) for l in range(1, 9)] + [Tensor(512, 4096, 9), Tensor(1, 4096, 9)]
ORDER = list(range(10))


def _profile(alpha, beta, compute=1e-3):
    return Profile([compute] * 10, [2 * compute] * 10, alpha, beta)


def test_pieces_split_large_tensors_at_rows_and_cover_every_byte_once():
    items = planner.pieces(TENSORS, ORDER, grain=64 << 10)
    big = [p for p in items if p.tensor == 10]
    assert len(big) == 32 and all(p.hi - p.lo == 16 for p in big)       # 64 KiB of 4 KiB rows
    planner.check_cover([tuple(items)], TENSORS)
    with pytest.raises(ValueError, match="twice"):
        planner.check_cover([tuple(items), (items[0],)], TENSORS)
    with pytest.raises(ValueError, match="missing"):
        planner.check_cover([tuple(items[1:])], TENSORS)
    one_row = planner.pieces([Tensor(3, 1 << 20, 0)], [0], grain=1024)
    assert [(p.lo, p.hi) for p in one_row] == [(0, 1), (1, 2), (2, 3)]   # never under a row


@pytest.mark.parametrize("alpha,beta", [(50e-6, 1.25e9), (50e-6, 125e6), (1e-3, 1e9)])
def test_plan_merges_small_layers_splits_large_ones_and_beats_both_baselines(alpha, beta):
    with config.overriding(ipart_grain=64 << 10):
        grain = config.get("ipart_grain")
    profile = _profile(alpha, beta)
    best = planner.choose(TENSORS, ORDER, profile, grain)
    planner.check_cover(best.parts, TENSORS)
    items = planner.pieces(TENSORS, ORDER, grain)
    default = planner.simulate([tuple(items)], TENSORS, ORDER, profile)
    layerwise = planner.simulate(planner.by_layer(items, TENSORS), TENSORS, ORDER, profile)
    assert best.predicted_s <= min(default, layerwise)
    total = sum(t.rows * t.row_bytes for t in TENSORS)
    # Default is backward + everything's transfer + forward (the docstring's formula).
    assert default == pytest.approx(30e-3 + alpha + total / beta)
    assert best.parts[0] == tuple(p for p in items if TENSORS[p.tensor].layer == 0)
    assert [p for part in best.parts for p in part] == items            # runs, in order


def test_the_parameter_servers_push_and_pull_are_two_pipelined_stages():
    profile = Profile([1e-3] * 10, [2e-3] * 10, 50e-6, 125e6, stages=2)
    items = planner.pieces(TENSORS, ORDER, grain=64 << 10)
    total = sum(t.rows * t.row_bytes for t in TENSORS)
    one = planner.simulate([tuple(items)], TENSORS, ORDER, profile)
    assert one == pytest.approx(30e-3 + 2 * (50e-6 + total / 125e6))   # push, then pull
    # Two partitions of the large tensor alone (backward ends with it): the first's pull
    # overlaps the second's push, so the transfers take three halves, not four.
    big = [Tensor(512, 4096, 0)]
    halves = planner.pieces(big, [0], grain=1 << 20)
    flat = Profile([0.0], [0.0], 0.0, 1e9, stages=2)
    assert planner.simulate([tuple(halves)], big, [0], flat) == pytest.approx(2 * 2**21 / 1e9)
    assert planner.simulate([(halves[0],), (halves[1],)], big, [0], flat) == \
        pytest.approx(3 * 2**20 / 1e9)
    assert planner.choose(TENSORS, ORDER, profile, 64 << 10).predicted_s < one


def test_calibration_makes_the_model_give_the_measured_step_time():
    items = planner.pieces(TENSORS, ORDER, grain=64 << 10)
    layerwise = planner.by_layer(items, TENSORS)
    profile = _profile(50e-6, 1.25e9)
    modelled = planner.simulate(layerwise, TENSORS, ORDER, profile)
    slower = planner.calibrate(layerwise, TENSORS, ORDER, profile, modelled + 0.1)
    assert slower.alpha > profile.alpha
    assert planner.simulate(layerwise, TENSORS, ORDER, slower) == pytest.approx(modelled + 0.1)
    assert planner.calibrate(layerwise, TENSORS, ORDER, profile, modelled / 2) == profile
    # Per-partition costs that large leave one partition the best plan.
    assert len(planner.choose(TENSORS, ORDER, slower, 64 << 10).parts) < len(layerwise)


def test_a_partitions_compute_cost_delays_backward_and_merges_partitions():
    """``cpu`` goes on the compute's time line (backward ends K * cpu later), where no
    transfer hides it, so a costly partition makes the planner merge."""
    items = planner.pieces(TENSORS, ORDER, grain=64 << 10)
    layerwise = planner.by_layer(items, TENSORS)
    free, costly = _profile(50e-6, 125e6), replace(_profile(50e-6, 125e6), cpu=2e-3)
    ready, end = planner.ready_times(layerwise, TENSORS, ORDER, costly)
    assert end == pytest.approx(20e-3 + len(layerwise) * 2e-3)
    assert ready[-1] == pytest.approx(2e-3 + 2e-3)           # the last layer's, issued first
    assert planner.simulate([tuple(items)], TENSORS, ORDER, costly) == \
        pytest.approx(planner.simulate([tuple(items)], TENSORS, ORDER, free) + 2e-3)
    many = planner.choose(TENSORS, ORDER, free, 64 << 10)
    few = planner.choose(TENSORS, ORDER, costly, 64 << 10)
    assert 1 < len(few.parts) < len(many.parts)


def test_priority_order_lets_what_the_next_forward_needs_overtake_the_backlog():
    """Four equal partitions, layer 3's ready first: K..1 sends the first layer's last,
    behind the backlog; by priority it overtakes what is still waiting, and the next
    forward overlaps the rest."""
    four = [Tensor(1, 1000, layer) for layer in range(4)]
    parts = [((Piece(i, 0, 1),)) for i in range(4)]
    profile = Profile([1.0] * 4, [0.5] * 4, 0.0, 1000 / 2.0)     # a transfer: 2 s
    issue = planner.by_priority(parts, four, [0, 1, 2, 3], profile)
    assert issue == [3, 0, 1, 2]            # 3 goes at 0.5; at 2.5 all are ready: 0 first
    # K..1: 0 arrives last, at 8.5, then four forwards.
    assert planner.simulate(parts, four, [0, 1, 2, 3], profile) == pytest.approx(12.5)
    # By priority: 0 arrives at 4.5, 1 at 6.5 (forward 0 ended at 5.5), 2 at 8.5, 3 is in.
    assert planner.simulate(parts, four, [0, 1, 2, 3], profile, issue) == pytest.approx(10.5)
    best = planner.choose(four, [0, 1, 2, 3], profile, 1000)
    assert best.issue == issue and best.predicted_s == pytest.approx(10.5)
    assert planner.Plan.from_json(best.to_json()) == best
    with pytest.raises(ValueError, match="is not an order"):
        planner.Plan(parts, [0, 1, 2, 3], issue=[3, 0, 1, 1])


def test_the_parameter_servers_pulls_go_most_urgent_first():
    """The PS's second stage (the server's answers) takes, whenever it frees, the
    partition with the lowest index among those pushed: 0 overtakes 1, which came first."""
    assert planner.urgent_first([1.5, 1.2, 1.0], [1.0] * 3) == [(2, 2.0), (0, 3.0), (1, 4.0)]
    # All ready at once, issued 2, 1, 0: pushes end at 4, 5 and 6; pulls: 2 at 4-8 (alone),
    # then 0 (pushed after 1, but needed first) at 8-9, then 1 at 9-10 (FIFO: 1 at 8-9 and
    # 0 at 9-10); forwards of 1 s each: 9-10, 10-11, 11-12 (FIFO: 10-11, 11-12, 12-13).
    three = [Tensor(1, 1000, 0), Tensor(1, 1000, 1), Tensor(1, 4000, 2)]
    parts = [(Piece(0, 0, 1),), (Piece(1, 0, 1),), (Piece(2, 0, 1),)]
    profile = Profile([1.0] * 3, [0.0] * 3, 0.0, 1000.0, stages=2)
    assert planner.simulate(parts, three, [0, 1, 2], profile) == pytest.approx(12.0)


def test_the_server_sends_waiting_answers_most_urgent_first():
    """Within the credit answers go at once; past it they wait and go by priority
    (smaller first, then in the order answered) as the credit frees."""
    from mpi4py import MPI

    from pycoll.ps import server as srv, wire
    from pycoll.ps.optim import Shard
    from pycoll.ps.policy import make

    sent = []

    class Comm:
        def Get_attr(self, _):
            return 1 << 20

        def Isend(self, buf, dest, tag):
            if tag % wire.TAGS_PER_SLOT == wire.tags(0)[1] % wire.TAGS_PER_SLOT:    # data
                sent.append(dest)
            return None

    with config.overriding(ps_reply_credit=100):
        server = srv.Server(Comm(), MPI.COMM_SELF, 0, 8, make("bsp"), None, None, 10.0)
    shard = Shard("float32", 20, 0, 20)                  # 80 bytes an answer

    def answer(worker, priority):
        req = wire.Request(wire.PULL, 0, 1, 0, 0.0, (), b"", 0, 0, 1.0, 0.0, priority)
        server._answer(srv._Pull(srv._Call(worker, req), [shard], 0, 0.0, 0.0))

    answer(0, 5.0)
    answer(1, 3.0)                         # 80 bytes in flight, under the credit: sent
    for worker, priority in ((2, 9.0), (3, 1.0), (4, 1.0), (5, 0.0)):
        answer(worker, priority)           # 160 in flight: they wait
    assert sent == [0, 1]
    server.sending = []                    # the two complete
    server._send_queued()
    assert sent == [0, 1, 5, 3]            # 5 (0.0), then the first of the two at 1.0
    server.sending = []
    server._send_queued()
    assert sent == [0, 1, 5, 3, 4, 2]
    with config.overriding(ps_reply_credit=0):           # 0: every answer at once
        server = srv.Server(Comm(), MPI.COMM_SELF, 0, 8, make("bsp"), None, None, 10.0)
    for worker, priority in ((6, 2.0), (7, 1.0)):
        answer(worker, priority)
    assert sent[-2:] == [6, 7] and not server.queued


def test_only_iparts_pulls_carry_priorities_layerwise_is_answered_in_arrival_order():
    """iPart's PS partitions ask for their answers by forward index; layerwise's all ask
    alike, so the server answers them in arrival order, as a plain PS does."""
    from pycoll.overlap.transports import ParameterServer

    params = [torch.zeros(2, 3), torch.zeros(4)]
    items = [Piece(0, 0, 2), Piece(1, 0, 4)]
    for urgent, expected in ((True, [1, 0]), (False, [0, 0])):
        asked = []

        def push_pull(names, values, outs, priority):
            asked.append(priority)
        transport = ParameterServer(params, ["w", "b"], items, push_pull, None, urgent=urgent)
        for k in (1, 0):
            transport.issue(k, (items[k],))
        assert asked == expected


def test_a_profiled_plan_that_measured_faster_than_the_best_model_is_kept():
    profile = _profile(50e-6, 125e6)
    best = planner.choose(TENSORS, ORDER, profile, 64 << 10)
    items = planner.pieces(TENSORS, ORDER, 64 << 10)
    one = planner.Plan([tuple(items)], ORDER)
    slow = planner.choose(TENSORS, ORDER, profile, 64 << 10, measured=[(one, 2 * best.predicted_s)])
    assert slow.parts == best.parts and slow.predicted_s == best.predicted_s
    fast = planner.choose(TENSORS, ORDER, profile, 64 << 10, version=3,
                          measured=[(one, best.predicted_s / 2)])
    assert fast.parts == one.parts and fast.predicted_s == best.predicted_s / 2
    assert fast.version == 3


def test_a_pulls_priority_must_be_a_finite_number():
    import pycoll.ps as ps
    for bad in (float("nan"), float("inf"), "first"):
        with pytest.raises(ValueError, match="priority must be a finite number"):
            ps.pull("w", priority=bad)


def test_a_replan_keeps_the_running_plan_unless_the_new_one_is_clearly_faster():
    profile = _profile(50e-6, 125e6)
    best = planner.choose(TENSORS, ORDER, profile, 64 << 10)
    items = planner.pieces(TENSORS, ORDER, 64 << 10)
    one = planner.Plan([tuple(items)], ORDER)                   # far slower: replaced
    assert planner.choose(TENSORS, ORDER, profile, 64 << 10, current=one).parts == best.parts
    same = planner.choose(TENSORS, ORDER, profile, 64 << 10, version=4, current=best)
    assert (same.parts, same.issue, same.version) == (best.parts, best.issue, 4)
    # A profile 5% off (noise) models another plan a little faster: the running one stays.
    noisy = _profile(50e-6, 125e6, compute=1.05e-3)
    assert planner.choose(TENSORS, ORDER, noisy, 64 << 10).parts != best.parts
    assert planner.choose(TENSORS, ORDER, noisy, 64 << 10, current=best).parts == best.parts


def test_refine_splits_a_large_layer_from_the_small_ones_backward_finishes_later():
    """Layers 1-4 are small and finish backward after the large layer 5: merged with
    them, its transfer waits for them; local search gives it a partition of its own."""
    tensors = [Tensor(16, 256, layer) for layer in range(5)] + [Tensor(256, 4096, 5)] + \
        [Tensor(16, 256, layer) for layer in range(6, 9)]
    order = list(range(9))
    profile = Profile([1e-3] * 9, [2e-3] * 9, 1e-3, 125e6 / 4, stages=2)
    layers = planner.by_layer(planner.pieces(tensors, order, 1 << 30), tensors)
    merged = [layers[0], sum(layers[1:6], ()), sum(layers[6:], ())]
    refined = planner.refine(merged, tensors, order, profile)
    planner.check_cover(refined, tensors)
    assert [[tensors[p.tensor].layer for p in part] for part in refined] == \
        [[0], [1, 2], [3, 4], [5], [6, 7, 8]]

    def best(parts):
        return min(planner.simulate(parts, tensors, order, profile, issue) for issue in
                   (planner.reverse(parts), planner.by_priority(parts, tensors, order, profile)))
    assert best(refined) < best(merged)


class _Recording:
    """A transport that only records what the schedule asks of it."""
    stages = 1

    def __init__(self, pieces):
        self.log = []

    def adopt(self, plan):
        pass

    def issue(self, k, part):
        self.log.append(("issue", k))
        return k

    def complete(self, k, handle):
        self.log.append(("complete", k))


def test_partitions_go_in_the_plans_issue_order_and_forward_waits_for_its_own():
    model = torch.nn.Sequential(*[torch.nn.Linear(4, 4) for _ in range(4)])
    s = sched.Schedule(model, list(model.parameters()), "layerwise", _Recording, lambda t: t)
    try:
        s._install(planner.Plan(s.plan.parts, s.plan.order, issue=[3, 0, 1, 2]))
        model(torch.ones(2, 4)).sum().backward()
        s.step()                                   # the end of backward: the rest go
        assert [k for what, k in s.transport.log if what == "issue"] == [3, 0, 1, 2]
        s.transport.log.clear()
        model[0](torch.ones(2, 4))                 # layer 0 waits for partition 0 only
        assert s.transport.log == [("complete", 0)]
        s.finish()                                 # the others, in issue order
        assert s.transport.log == [("complete", 0), ("complete", 3), ("complete", 1),
                                   ("complete", 2)]
    finally:
        s.remove()


class _Probing(_Recording):
    def probe(self, nbytes):
        return 1e-4 + nbytes / 1e9


def test_ipart_profiles_one_partition_then_layerwise_then_plans():
    model = torch.nn.Sequential(*[torch.nn.Linear(4, 4) for _ in range(4)])
    with config.overriding(ipart_profile_steps=2):
        s = sched.Schedule(model, list(model.parameters()), "ipart", _Probing, lambda t: t)
    try:
        plans = []
        for _ in range(6):
            plans.append(len(s.plan.parts))
            model(torch.ones(2, 4)).sum().backward()
            s.step()
        assert plans == [1, 1, 1, 4, 4, 4]               # a step to settle, two profiled
        assert s.plan.version == 1 and s.plan.predicted_s > 0
        planner.check_cover(s.plan.parts, s.tensors)
    finally:
        s.remove()


def test_pack_rows_round_trips_strided_and_partial_rows():
    a = np.arange(24, dtype=np.float32).reshape(6, 4)
    strided = np.arange(40, dtype=np.float64).reshape(10, 4)[::2, :3]  # rows 32 bytes apart
    args = ([a.ctypes.data, strided.ctypes.data], [16, 24], [16, 64], [1, 2], [4, 5])
    nbytes = _C.rows_nbytes(*args)
    assert nbytes == 3 * 16 + 3 * 24
    buf = np.zeros(nbytes, np.uint8)
    _C.pack_rows(buf.ctypes.data, *args)
    assert np.array_equal(buf[:48].view(np.float32), a[1:4].ravel())
    assert np.array_equal(buf[48:].view(np.float64), strided[2:5].ravel())
    a2, base = np.zeros_like(a), np.zeros((10, 4))
    _C.unpack_rows(buf.ctypes.data, [a2.ctypes.data, base.ctypes.data], [16, 24], [16, 64], [1, 2], [4, 5])
    assert np.array_equal(a2[1:4], a[1:4]) and not a2[[0, 4, 5]].any()
    assert np.array_equal(base[::2, :3][2:5], strided[2:5]) and not base[1::2].any()
    with pytest.raises(ValueError, match="lo > hi"):
        _C.pack_rows(buf.ctypes.data, [a.ctypes.data], [16], [16], [3], [2])
    with pytest.raises(ValueError, match="overlap"):
        _C.pack_rows(buf.ctypes.data, [a.ctypes.data], [16], [8], [0], [2])


def test_torch_pack_rows_takes_the_cuda_kernel_for_cuda_buffers(monkeypatch):
    """The CUDA path's Python side: device buffers go to cuda_pack_rows / cuda_unpack_rows
    on the current stream (the kernels themselves need a GPU: tests/test_gpu.py)."""
    calls = []

    class Stream:
        cuda_stream = 1234

    class DeviceBuffer:                 # what the scheduler reads of a CUDA tensor
        is_cuda, device = True, "cuda:0"

        def data_ptr(self):
            return 99
    monkeypatch.setattr(sched._C, "cuda_pack_rows", lambda *a: calls.append(("pack", a)), raising=False)
    monkeypatch.setattr(sched._C, "cuda_unpack_rows", lambda *a: calls.append(("unpack", a)), raising=False)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: Stream())
    t = torch.arange(12.0).reshape(3, 4)
    sched.pack_rows(DeviceBuffer(), [t], [Piece(0, 1, 3)])
    sched.unpack_rows(DeviceBuffer(), [t], [Piece(0, 0, 1)])
    assert calls == [("pack", (99, [t.data_ptr()], [16], [16], [1], [3], 1234)),
                     ("unpack", (99, [t.data_ptr()], [16], [16], [0], [1], 1234))]


def test_bad_schedule_and_missing_model_are_clear():
    with pytest.raises(ValueError, match="'default', 'layerwise', 'ipart'"):
        sched.check_schedule("bytescheduler")


def test_ps_schedules_are_bit_identical_under_bsp():
    """Two workers, two servers (keys split across them: the harder case of one job)."""
    out = run_ps_job("overlap_job.py", 4, 2, timeout_s=30, wall_s=100)
    assert out.stdout.count("schedules bit-identical") == 2, out.stdout


# ---------------------------------------------------------------- allreduce, multi-rank
class _Checked(torch.nn.Linear):
    """Asserts that its parameters' partitions completed before it runs; records reads."""
    schedule = None
    reads: list = []

    def forward(self, x):
        if _Checked.schedule is not None:
            assert all(_Checked.schedule.arrived(p) for p in self.parameters(recurse=False))
        _Checked.reads.append(self.weight.detach().sum().item())
        return super().forward(x)


def _net():
    torch.manual_seed(4)
    return torch.nn.Sequential(_Checked(6, 8), torch.nn.Tanh(), _Checked(8, 8), torch.nn.Tanh(),
                               _Checked(8, 256), torch.nn.Tanh(), _Checked(256, 3)).double()


def _steps(model, optimizer, size, rank, share, steps=4):
    """On the global batch of ``size`` ranks, this one's ``rank::share`` share."""
    g = torch.Generator().manual_seed(2)
    for _ in range(steps):
        x = torch.randn(4 * size, 6, generator=g, dtype=torch.float64)
        y = torch.randn(4 * size, 3, generator=g, dtype=torch.float64)
        optimizer.zero_grad()
        ((model(x[rank::share]) - y[rank::share]) ** 2).sum().div(len(x)).backward()
        optimizer.step()


@pytest.mark.mpi
@pytest.mark.parametrize("schedule", ["default", "layerwise", "ipart"])
def test_allreduce_schedules_equal_synchronous_training(schedule):
    import pycoll.torch as hvd
    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    with config.overriding(ipart_grain=1024, ipart_profile_steps=1):
        model = _net()
        optimizer = hvd.DistributedOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
            named_parameters=model.named_parameters(), op=hvd.Sum, model=model, schedule=schedule)
        _Checked.schedule, _Checked.reads = optimizer._schedule, []
        try:
            _steps(model, optimizer, size, rank, size)
        finally:
            _Checked.schedule = None
        optimizer.synchronize()
    reads = _Checked.reads
    reference = _net()
    _Checked.reads = []
    _steps(reference, torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9), size, 0, 1)
    for p, q in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(p.detach(), q.detach(), rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(reads, _Checked.reads, rtol=1e-12, atol=1e-12)
    plan = optimizer._schedule.plan
    if schedule == "ipart":
        assert plan.version == 1                                 # profiled, then planned
        assert len({p.tensor for part in plan.parts for p in part if p.hi - p.lo < 256}) >= 1
    assert hvd.allgather_object(plan.to_json()) == [plan.to_json()] * size
    planner.check_cover(plan.parts, optimizer._schedule.tensors)
    counters = optimizer._schedule.counters()
    assert len(counters["exposed_s"]) == 3 and all(e >= 0 for e in counters["exposed_s"])


@pytest.mark.mpi
def test_schedules_refuse_what_they_cannot_do():
    import pycoll.torch as hvd
    hvd.init()
    model = _net()
    sgd = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match="needs model="):
        hvd.DistributedOptimizer(sgd, schedule="ipart")
    with pytest.raises(ValueError, match="backward_passes_per_step"):
        hvd.DistributedOptimizer(sgd, model=model, schedule="layerwise", backward_passes_per_step=2)
    with pytest.raises(ValueError, match="not in the model"):
        hvd.DistributedOptimizer(sgd, model=torch.nn.Linear(2, 2), schedule="default")


def test_bench_dilation_keeps_the_clusters_ratios_and_sleeps_at_least_real_ms():
    """bench/overlap.py's sizing: communication = ``ratio`` x compute in the cluster's time;
    dilated, a small layer sleeps at least REAL_MS and the link's cost grows by the same k."""
    import argparse
    import itertools
    import os
    import sys
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "bench"))
    try:
        import overlap as bench
    finally:
        sys.path.pop(0)
    args = argparse.Namespace(workers=4, servers=1, small=24, width=4096, ms=0.0, sizing="dilate",
                              real_ms=bench.REAL_MS)
    forwards = 3 * (args.small + 2 + 2 * 4)
    for mode, link, ratio in itertools.product(("allreduce", "ps"), bench.LINKS, (1.0, 0.7)):
        args.ratio = ratio
        ms, width, k = bench.sizing(mode, link, args)
        comm = bench.communication(mode, link, bench.model_bytes(args.small, width), args)
        assert width == args.width and ratio * forwards * ms / 1e3 == pytest.approx(comm)
        assert k >= 1 and ms * k >= bench.REAL_MS * (1 - 1e-9)
        slow = bench.communication(mode, bench.dilated(link, k),
                                   bench.model_bytes(args.small, width), args)
        assert slow == pytest.approx(k * comm, rel=1e-5)
    fast, args.ratio = bench.LINKS[0], 1.0
    args.sizing = "widen"                     # the fourth pass's: 0.25 ms, wide large layers
    assert bench.sizing("allreduce", fast, args) == (bench.MIN_MS, 39887, 1.0)
    args.sizing = "fixed"
    assert bench.sizing("allreduce", fast, args)[1:] == (4096, 1.0)
