"""Injected faults end in a clear error within seconds, never in a hang.

Each test runs a small job under pycollrun and reads what the user would see.
"""
import os
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

pytestmark = pytest.mark.timeout(120)

PRELUDE = """
import os, signal, sys, time
import numpy as np
import pycoll
pycoll.init()
rank, size = pycoll.rank(), pycoll.size()
"""


def job(tmp_path, body: str, ranks: int = 3, **env):
    script = tmp_path / "job.py"
    script.write_text(PRELUDE + textwrap.dedent(body))
    environ = {k: v for k, v in os.environ.items() if not k.startswith(("PYCOLL_", "OMPI_COMM"))}
    environ.update({"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1",
                    "PYCOLL_TIMEOUT": "4", "PYCOLL_CHECK": "1", **env})
    out = subprocess.run([sys.executable, "-m", "pycoll.launch.pycollrun", "-np", str(ranks),
                          "python", str(script)], env=environ, capture_output=True, text=True,
                         timeout=90)
    return out.returncode, out.stdout + out.stderr


def test_rank_that_skips_a_collective_and_goes_on(tmp_path):
    code, text = job(tmp_path, """
        if rank != 1:
            pycoll.allreduce(np.ones(3), name="skipped")
        pycoll.barrier(name="after")
    """)
    assert code != 0
    assert "ranks submitted different collectives" in text
    assert "rank 0: allreduce #0 'skipped'" in text and "rank 1: barrier #0 'after'" in text


def test_rank_that_skips_a_collective_and_stalls(tmp_path):
    code, text = job(tmp_path, """
        if rank == 1:
            time.sleep(60)
        pycoll.allreduce(np.ones(3), name="grads")
    """, PYCOLL_STALL_WARNING_S="1")
    assert code != 0
    assert "CollectiveTimeout" in text and "ranks [1] did not join within 4 s" in text
    assert "has waited 1 s for ranks [1]" in text            # the stall warning came first


def test_without_checks_a_stalled_job_ends_instead_of_hanging(tmp_path):
    code, text = job(tmp_path, """
        if rank == 1:
            time.sleep(60)
        pycoll.allreduce(np.ones(3), name="grads")
    """, PYCOLL_CHECK="0", PYCOLL_STALL_WARNING_S="1")
    assert code != 0
    assert text.count("grads has run for") == 2             # the stall warning, once a waiting rank
    assert "grads has not completed after" in text and "PYCOLL_CHECK=1" in text


def test_mismatched_shapes_raise_on_every_rank(tmp_path):
    code, text = job(tmp_path, """
        try:
            pycoll.allreduce(np.ones(3 + (rank == 2)), name="w")
        except pycoll.CollectiveMismatch as error:
            print(f"rank {rank} caught: {str(error).splitlines()[3]}", flush=True)
        pycoll.barrier()                                    # still usable afterwards
        print(f"rank {rank} usable", flush=True)
    """)
    assert code == 0, text
    for r in range(3):
        assert f"rank {r} caught:   rank 2: allreduce #0 'w' dtype=float64 shape=(4,)" in text
        assert f"rank {r} usable" in text


def test_killed_worker_ends_the_job_and_is_named(tmp_path):
    code, text = job(tmp_path, """
        if rank == 1:
            os.kill(os.getpid(), signal.SIGKILL)
        pycoll.allreduce(np.ones(3))
        time.sleep(30)
    """)
    assert code != 0
    assert "rank 1" in text and "signal 9" in text


def test_bad_input_leaves_the_group_usable():
    import pycoll
    pycoll.init()
    bad = [(ValueError, "needs a contiguous tensor",
            lambda: pycoll.allreduce(np.zeros((4, 4))[:, ::2])),
           (ValueError, "read-only", lambda: pycoll.allreduce_(np.frombuffer(b"abcd", np.uint8))),
           (TypeError, "does not support dtype complex64",
            lambda: pycoll.allreduce(np.zeros(3, np.complex64))),
           (TypeError, "Average of bool tensors is not defined",
            lambda: pycoll.allreduce(np.zeros(3, bool))),
           (TypeError, "Average of int32 tensors would truncate",
            lambda: pycoll.allreduce(np.zeros(3, np.int32), op=pycoll.Average)),
           (ValueError, "root must be a rank", lambda: pycoll.broadcast(np.zeros(3), root=-1)),
           (ValueError, "alltoall splits must be",
            lambda: pycoll.alltoall(np.zeros(3), splits=[5] * pycoll.size())),
           (TypeError, "group must be None, a pycoll.Group or an mpi4py communicator",
            lambda: pycoll.allreduce(np.zeros(3), group="everyone")),
           (ValueError, "unknown reduction 'mean'",
            lambda: pycoll.allreduce(np.zeros(3), op="mean"))]
    for kind, message, call in bad:
        with pytest.raises(kind, match=message):
            call()
    np.testing.assert_array_equal(pycoll.allreduce(np.ones(3), op=pycoll.Sum), pycoll.size())


def test_exit_lets_queued_collectives_finish_and_leaves_unsent_ones(tmp_path):
    """At exit a batch already on its way completes before MPI is finalized; a batch
    nobody sent (rank 0's, with no partner on rank 1) is dropped instead of hanging."""
    code, text = job(tmp_path, """
        x = np.full(1 << 20, rank, np.float32)
        pycoll.flush()
        work = pycoll.allreduce_async_(x, op=pycoll.Sum)
        pycoll.flush()                       # queued, never waited for
        if rank == 0:
            pycoll.allreduce_async_(np.ones(4), op=pycoll.Sum)    # open, never sent
        print(f"rank {rank} leaves", flush=True)
    """, ranks=2)
    assert code == 0, text
    assert "rank 0 leaves" in text and "rank 1 leaves" in text
    assert "collectives still running at exit" not in text


def test_partial_allreduce_retry_after_a_timeout_is_refused_not_mixed(tmp_path):
    """Late chunks of a failed round must never be summed into a retry: the group is
    broken on every member (fail-stop), and other groups stay usable."""
    code, text = job(tmp_path, """
        x = np.full(1 << 16, rank + 1.0)
        for attempt in ("first", "retry"):
            if attempt == "first" and rank == 2:
                time.sleep(3)                   # past the others' PYCOLL_TIMEOUT
            try:
                pycoll.partial_allreduce(x, [0, 1, 2], op=pycoll.Sum)
                print(f"rank {rank} {attempt}: ok", flush=True)
            except (pycoll.CollectiveTimeout, pycoll.GroupBroken) as error:
                print(f"rank {rank} {attempt}: {type(error).__name__}", flush=True)
        if rank < 2:
            y = pycoll.partial_allreduce(x, [0, 1], op=pycoll.Sum)
            print(f"rank {rank} pair: {y[0]:g}", flush=True)
    """, PYCOLL_TIMEOUT="2", PYCOLL_CHECK="0")
    assert code == 0, text
    for r in range(3):
        assert f"rank {r} first: CollectiveTimeout" in text, text
        assert f"rank {r} retry: GroupBroken" in text, text
    assert "rank 0 pair: 3" in text and "rank 1 pair: 3" in text


def test_partial_allreduce_small_round_names_the_late_rank_and_pairs_stay_in_step(tmp_path):
    """The direct exchange (small tensors): a member that comes past the timeout is named
    by the others, who refuse the group afterwards; every pair of its ranks still agrees
    on its tags, so other groups of the same ranks work."""
    code, text = job(tmp_path, """
        from mpi4py import MPI
        x = np.full(3, rank + 1.0)
        if rank == 2:
            time.sleep(3)                       # past the others' PYCOLL_TIMEOUT
        for attempt in ("first", "retry"):
            try:
                pycoll.partial_allreduce(x, [0, 1, 2], op=pycoll.Sum)
                print(f"rank {rank} {attempt}: ok", flush=True)
            except (pycoll.CollectiveTimeout, pycoll.GroupBroken) as error:
                print(f"rank {rank} {attempt}: {type(error).__name__}: {error}", flush=True)
        MPI.COMM_WORLD.Barrier()                # the late rank's retry waits out its timeout
        for pair in ([0, 1], [0, 2], [1, 2]):
            if rank in pair:
                y = pycoll.partial_allreduce(x, pair, op=pycoll.Sum)
                print(f"rank {rank} pair {pair}: {y[0]:g}", flush=True)
    """, PYCOLL_TIMEOUT="2", PYCOLL_CHECK="0")
    assert code == 0, text
    for r in (0, 1):
        assert f"rank {r} first: CollectiveTimeout" in text, text
        assert f"rank {r} waited for rank 2" in text, text
        assert f"rank {r} retry: GroupBroken" in text, text
    for pair in ([0, 1], [0, 2], [1, 2]):
        for r in pair:
            assert f"rank {r} pair {pair}: {sum(pair) + 2:g}" in text, text


def test_send_recv_timeout_breaks_point_to_point_only(tmp_path):
    """torch send/recv: a receive that times out is cancelled and later ones raise
    GroupBroken (its message may still come); collectives on the group go on."""
    code, text = job(tmp_path, """
        import datetime, torch, torch.distributed as dist
        import pycoll.torch
        dist.init_process_group("pycoll", init_method="pycoll://",
                                timeout=datetime.timedelta(seconds=1))
        if rank == 1:
            got = torch.zeros(2)
            start = time.monotonic()
            try:
                dist.recv(got, src=0)           # rank 0 never sends
            except pycoll.CollectiveTimeout:
                print(f"timed out after {time.monotonic() - start:.0f} s", flush=True)
            try:
                dist.recv(got, src=0)
            except pycoll.GroupBroken as error:
                print("then:", str(error).split(";")[0], flush=True)
        t = torch.ones(1)
        dist.all_reduce(t)
        print(f"rank {rank} allreduce {t.item():g}", flush=True)
    """, ranks=2)
    assert code == 0, text
    assert "timed out after 1 s" in text
    assert "then: pycoll: send/recv on <pycoll.Group ranks=[0, 1]> are broken" in text
    assert "rank 0 allreduce 2" in text and "rank 1 allreduce 2" in text


@pytest.mark.parametrize("check", ["0", "1"])
def test_a_torch_groups_timeout_is_pycolls_and_waits_hold_their_deadline(tmp_path, check):
    """init_process_group(timeout=20 s) over PYCOLL_TIMEOUT=2: rank 0 works for 8 s while
    the other waits in a barrier, as gloo lets it (pycoll's checks used to end the job at
    2 s, its watchdog at 7); and an async allreduce's wait(timeout) raises on time even where the
    engine would run a waited-for operation in the caller's thread."""
    code, text = job(tmp_path, """
        import datetime, torch, torch.distributed as dist
        import pycoll.torch, pycoll.torch.api
        pycoll.torch.api.overlap_pays = lambda tensor: True     # the engine's path
        dist.init_process_group("pycoll", timeout=datetime.timedelta(seconds=20))
        start = time.monotonic()
        if rank == 0:
            time.sleep(8)                       # rank 0 evaluates
        dist.barrier()
        print(f"rank {rank} passed the barrier at {time.monotonic() - start:.0f} s", flush=True)
        if rank == 1:
            time.sleep(3)
        work = dist.all_reduce(torch.ones(1), async_op=True)
        start = time.monotonic()
        try:
            work.wait(timeout=datetime.timedelta(seconds=1))
        except pycoll.CollectiveTimeout as error:
            print(f"rank {rank} timed out after {time.monotonic() - start:.0f} s: {error}",
                  flush=True)
            work.wait()
        print(f"rank {rank} done", flush=True)
    """, ranks=2, PYCOLL_CHECK=check, PYCOLL_TIMEOUT="2")
    assert code == 0, text
    for r in (0, 1):
        assert f"rank {r} passed the barrier at 8 s" in text and f"rank {r} done" in text
    # worded as gloo's ("Timed out"), which torch's suite and users' log checks look for
    assert "rank 0 timed out after 1 s: pycoll: torch.allreduce did not complete within " \
           "the timeout of 1 s" in text, text


@pytest.mark.parametrize("check", ["0", "1"])
def test_a_paced_collective_one_rank_skips_times_out_on_time(tmp_path, check):
    """Under --link a group's first collective agrees on the group's id for the pacing: a
    rank alone there waits with a deadline and the GIL free, so that its wait(timeout)
    raises on time (a blocking agreement held the GIL and hung the process: torch's suite's
    barrier timeout as gloo under a link), and the agreement's own deadline names it."""
    code, text = job(tmp_path, """
        pair = pycoll.new_group([0, 1])
        pycoll.allreduce(np.ones(2))            # the world's pacing, agreed by both
        if rank == 0:
            work = pycoll.barrier_async(group=pair, name="alone")
            start = time.monotonic()
            for timeout in (1, None):
                try:
                    work.wait(timeout)
                except pycoll.CollectiveTimeout as error:
                    print(f"rank 0 timed out after {time.monotonic() - start:.0f} s: {error}",
                          flush=True)
        else:
            time.sleep(6)                       # meets rank 0 after its 1 s and 4 s waits
        total = pycoll.allreduce(np.ones(2), op=pycoll.Sum)
        print(f"rank {rank} then: {total[0]:g}", flush=True)
    """, ranks=2, PYCOLL_CHECK=check, PYCOLL_LINK="50us,1.25GB/s")
    assert code == 0, text
    assert "rank 0 timed out after 1 s: pycoll: alone did not complete within the timeout " \
           "of 1 s" in text, text
    assert "rank 0 timed out after 4 s: pycoll: the first collective paced by --link on a " \
           "group of 2 ranks: not every rank joined within 4 s" in text, text
    assert "rank 0 then: 2" in text and "rank 1 then: 2" in text


@pytest.mark.parametrize("wait", ["compiled", "python"])
def test_a_barrier_past_its_timeout_lets_the_engine_go_and_a_late_rank_pass(tmp_path, wait):
    """A barrier waits with a deadline (not in a blocking MPI_Barrier): past its timeout it
    raises and its engine runs what comes next; the barrier stays posted, so a rank that
    comes late passes it, and the ranks stay in step. Waited for in C, or from Python where
    _C found no MPI."""
    code, text = job(tmp_path, f"""
        if {wait == "python"}:              # _C answers as where it found no MPI
            pycoll._C.wait_request = lambda address, timeout: -2
        start = time.monotonic()
        if rank == 0:
            try:
                pycoll.barrier(name="waited", timeout=1)
            except pycoll.CollectiveTimeout as error:
                print(f"rank 0 timed out after {{time.monotonic() - start:.0f}} s: {{error}}",
                      flush=True)
        else:
            time.sleep(3)
            pycoll.barrier(name="waited")
            print(f"rank 1 passed at {{time.monotonic() - start:.0f}} s", flush=True)
        total = pycoll.allreduce(np.ones(2), op=pycoll.Sum)
        print(f"rank {{rank}} then: {{total[0]:g}}", flush=True)
    """, ranks=2, PYCOLL_CHECK="0")
    assert code == 0, text
    assert "rank 0 timed out after 1 s: pycoll: waited did not complete within the timeout " \
           "of 1 s: not every rank of its group (2) reached it" in text, text
    assert "rank 1 passed at 3 s" in text
    assert "rank 0 then: 2" in text and "rank 1 then: 2" in text


@pytest.mark.parametrize("check", ["0", "1"])
def test_a_torch_barrier_one_rank_skips_ends_on_time(tmp_path, check):
    """torch's barrier on a group with a timeout, which one rank skips: it raises at the
    group's timeout, as gloo's does, and the job then exits at once (a blocking barrier held
    the engine, and the exit, until PYCOLL_TIMEOUT)."""
    start = time.monotonic()
    code, text = job(tmp_path, """
        import datetime, torch.distributed as dist
        import pycoll.torch
        dist.init_process_group("pycoll")
        group = dist.new_group(timeout=datetime.timedelta(seconds=1))
        if rank == 0:
            start = time.monotonic()
            try:
                dist.barrier(group)
            except Exception as error:
                print(f"rank 0 timed out after {time.monotonic() - start:.0f} s: {error}",
                      flush=True)
        print(f"rank {rank} leaves", flush=True)
    """, ranks=2, PYCOLL_CHECK=check, PYCOLL_TIMEOUT="60")
    took = time.monotonic() - start
    assert code == 0, text
    assert took < 30, f"the job took {took:.0f} s to end"
    assert "rank 0 timed out after 1 s: pycoll: " in text and " timeout " in text, text
    assert "rank 0 leaves" in text and "rank 1 leaves" in text


def test_group_generator_names_a_worker_that_never_leaves(tmp_path):
    code, text = job(tmp_path, """
        from pycoll.decentral import GroupGenerator
        gen = GroupGenerator(group_size=2)
        if rank == 2:
            time.sleep(5)                       # hangs: never leaves
        else:
            gen.leave()
            start = time.monotonic()
            try:
                gen.close()
                print(f"rank {rank} closed", flush=True)
            except pycoll.CollectiveTimeout as error:
                print(f"rank {rank} after {time.monotonic() - start:.0f} s: {error}", flush=True)
    """, PYCOLL_TIMEOUT="2")
    assert code == 0, text
    assert "rank 1 closed" in text
    assert "rank 0 after 2 s: pycoll: the group generator on rank 0 heard from no worker" in text
    assert "ranks [2] have not left" in text


def test_exit_under_a_stuck_collective_ends_the_job_with_a_message(tmp_path):
    """MPI is never finalized under the engine's thread while it is inside MPI."""
    code, text = job(tmp_path, """
        if rank == 0:
            pycoll.allreduce_async(np.ones(4), name="orphan")
            pycoll.flush()                      # rank 1 never joins it
        print(f"rank {rank} leaves", flush=True)
    """, ranks=2, PYCOLL_TIMEOUT="2", PYCOLL_CHECK="0")
    assert code != 0
    assert "orphan was still running at exit after PYCOLL_TIMEOUT (2 s)" in text


def test_groups_used_after_shutdown_are_refused(tmp_path):
    """Also on the compiled short path (PYCOLL_CHECK unset), which calls MPI directly."""
    code, text = job(tmp_path, """
        pair, world = pycoll.new_group([0, 1]), pycoll.runtime.world()
        pycoll.allreduce(np.ones(3), group=world)
        pycoll.shutdown()
        pycoll.init()                           # the old groups' handles are freed
        for what, group in (("pair", pair), ("world", world)):
            try:
                pycoll.allreduce(np.ones(3), group=group)
            except ValueError as error:
                print(f"rank {rank} {what}: {error}", flush=True)
        print(f"rank {rank} again: {pycoll.allreduce(np.ones(3), op=pycoll.Sum)[0]:g}", flush=True)
    """, ranks=2, PYCOLL_CHECK="0")
    assert code == 0, text
    for r in range(2):
        assert (f"rank {r} pair: <pycoll.Group ranks=[0, 1]> was released by pycoll.shutdown()"
                in text), text
        assert f"rank {r} world: <pycoll.Group ranks=[0, 1]> was released" in text
        assert f"rank {r} again: 2" in text


@pytest.mark.parametrize("leave, check", [("sys.exit(0)", "0"), ("pass", "1"),
                                          ("pycoll.shutdown()", "0")])
def test_a_rank_that_leaves_early_ends_the_job_within_seconds_naming_it(tmp_path, leave, check):
    """As gloo's ranks fail once a peer's process ends; before, the job waited PYCOLL_TIMEOUT.
    (sys.exit(3) ends the job at once here: pycollrun runs the script under mpi4py's
    runner; test_launcher runs it bare.)"""
    began = time.monotonic()
    code, text = job(tmp_path, f"""
        pycoll.allreduce(np.ones(3), name="step 0")
        if rank == 1:
            {leave}
        else:
            w = pycoll.allreduce_async(np.ones(3), name="step 1")
            pycoll.allreduce(np.ones(3), name="step 2") if rank == 0 else w.wait()
    """, PYCOLL_TIMEOUT="80", PYCOLL_CHECK=check)
    assert code != 0
    assert "step 1 waits for rank 1, which left pycoll without joining it" in text, text
    assert time.monotonic() - began < 40


@pytest.mark.parametrize("api", ["torch", "horovod"])
def test_uneven_steps_end_the_job_within_seconds_naming_the_rank(tmp_path, api):
    """One rank runs fewer steps: the others' next collective names it (torch's and
    Horovod's name-matched negotiation, where the coordinator waits for it)."""
    step = ("dist.all_reduce(torch.ones(4))" if api == "torch" else
            "hvd.allreduce(torch.ones(4), name=f'grad {s}')")
    began = time.monotonic()
    code, text = job(tmp_path, f"""
        import torch, torch.distributed as dist, pycoll.torch as hvd
        if {api == "torch"}:
            dist.init_process_group("pycoll")
        for s in range(2 if rank == 2 else 4):
            {step}
    """, PYCOLL_TIMEOUT="80", PYCOLL_CHECK="0")
    assert code != 0
    assert (("torch.allreduce waits for rank 2, which left pycoll" if api == "torch" else
             "waits for rank 2, which left pycoll without joining it (its script ended, or it "
             "called sys.exit or pycoll.shutdown) while ranks had ['grad 2'] pending")
            in text), text
    assert time.monotonic() - began < 50


def test_a_torch_recv_from_a_rank_that_left_fails_within_seconds_and_others_go_on(tmp_path):
    """As gloo's recv fails once its peer's process ends (a receive from any rank once
    every other has); before, it waited the group's timeout. Messages between the ranks
    still there go on."""
    code, text = job(tmp_path, """
        import torch, torch.distributed as dist
        import pycoll.torch
        dist.init_process_group("pycoll", init_method="pycoll://")
        got = torch.zeros(2)
        if rank == 0:
            start = time.monotonic()
            try:
                dist.recv(got, src=2)
            except pycoll.CollectiveTimeout as error:
                print(f"after {time.monotonic() - start:.0f} s: {error}", flush=True)
            dist.recv(got, src=1)
            print(f"rank 0 got {got[0].item():g}", flush=True)
            start = time.monotonic()
            try:
                dist.recv(got)          # from any rank, once both others have left
            except pycoll.CollectiveTimeout as error:
                print(f"after {time.monotonic() - start:.0f} s: {error}", flush=True)
        elif rank == 1:
            dist.send(torch.full((2,), 7.0), dst=0)
    """, PYCOLL_TIMEOUT="60", PYCOLL_CHECK="0")
    assert code == 0, text
    assert ("s: pycoll: torch receive from rank 2 in <pycoll.Group ranks=[0, 1, 2]> waits "
            "for rank 2, which left pycoll without joining it") in text, text
    assert "rank 0 got 7" in text
    assert ("s: pycoll: torch receive from any rank in <pycoll.Group ranks=[0, 1, 2]> waits "
            "for ranks 1, 2, which left pycoll without joining it") in text, text
    waits = [int(part.split(" s:")[0]) for part in text.split("after ")[1:]]
    assert len(waits) == 2 and max(waits) < 20, text


@pytest.mark.parametrize("check", ["0", "1"])
def test_a_rank_that_leaves_does_not_end_what_others_run_without_it(tmp_path, check):
    """Operations of the world's engine among other ranks (a new group, a partial
    all-reduce: compiled without checks, in Python with them) wait for a late member as
    long as PYCOLL_TIMEOUT allows, whoever has left."""
    code, text = job(tmp_path, """
        if rank < 2:
            time.sleep(7 * rank)
            pair = pycoll.new_group([0, 1])
            time.sleep(7 * rank)
            got = pycoll.partial_allreduce(np.ones(3), [0, 1], op=pycoll.Sum)
            got += pycoll.allreduce(np.ones(3), op=pycoll.Sum, group=pair)
            print(f"rank {rank} got {got[0]:g}", flush=True)
    """, PYCOLL_TIMEOUT="60", PYCOLL_CHECK=check)
    assert code == 0, text
    assert "rank 0 got 4" in text and "rank 1 got 4" in text
