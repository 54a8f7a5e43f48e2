"""The timeline (--timeline, --timeline-steps) and the straggler report (--report)."""
import json
import os
import re
import subprocess
import sys

import pytest

from pycoll import config, timeline

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "launch"))
import pycollrun  # noqa: E402


def test_steps_and_switches_parse():
    assert config.parse_steps("10-12") == (10, 12)
    assert config.parse_steps("3") == (3, 3)
    assert config.parse_steps("4-")[1] == float("inf")
    for bad in ("x", "5-2", "-1-3"):
        with pytest.raises(ValueError, match="A-B"):
            config.parse_steps(bad)
    args = pycollrun.parse_args(["-np", "2", "--report", "--check", "0", "python", "x.py",
                                 "--report"])
    assert args.knob_env == {"PYCOLL_REPORT": "1", "PYCOLL_CHECK": "0"}
    assert args.command == ["python", "x.py", "--report"]


def test_off_costs_a_shared_no_op():
    assert not timeline.on
    assert timeline.phase("in MPI") is timeline.phase("packed")


def _part(rank, ops, offset=0.0, compute=0.0):
    return dict(rank=rank, role="", events=[("X", "op", "op", 10.0 + offset, 0.5, 1, {}, 0)],
                threads={"1": "MainThread"}, dropped=0, started=10.0 + offset,
                ended=12.0 + offset, ops=[(n, s, a + offset, b + offset) for n, s, a, b in ops],
                totals=dict(compute=compute, collective=sum(b - a for _, _, a, b in ops)),
                ps=[], offset=offset)


def test_merge_aligns_clocks_and_blames_the_last_to_arrive():
    # Rank 1 arrives 0.3 s late at both allreduces; its clock runs 5 s ahead.
    parts = [_part(0, [("ar", 1, 10.1, 10.5), ("ar", 2, 11.0, 11.4)]),
             _part(1, [("ar", 1, 10.4, 10.5), ("ar", 2, 11.3, 11.4)], offset=5.0, compute=1.5),
             _part(2, [("ar", 1, 10.2, 10.5), ("ar", 2, 11.1, 11.4)])]
    events = timeline.trace(parts)["traceEvents"]
    assert {e["ts"] for e in events if e["ph"] == "X"} == {0.0}
    waited, waited_for = timeline.waits(parts)
    assert waited[0] == pytest.approx(0.6) and waited[2] == pytest.approx(0.4)
    assert waited[1] == 0 and set(waited_for) == {1}
    text = timeline.report(parts, {1: 3.0})
    assert "waited for most: rank 1 (1.00 s, 100%; --slowdown 1:3.0)" in text, text


def _job(ranks, *args):
    """tests/timeline_job.py under pycollrun; (its stdout, the trace's events)."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("PYCOLL_", "OMPI_COMM_", "PMIX_", "PMI_"))}
    env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    path = os.path.join(os.environ.get("TMPDIR", "/tmp"), f"pycoll-trace-{os.getpid()}.json")
    out = subprocess.run([sys.executable, os.path.join(ROOT, "launch", "pycollrun.py"), "-np",
                          str(ranks), "--timeline", path, *args[:-2], "python",
                          os.path.join(ROOT, "tests", "timeline_job.py"), *args[-2:]],
                         capture_output=True, text=True, env=env, timeout=120, cwd=ROOT)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    try:
        with open(path) as f:
            return out.stdout, json.load(f)["traceEvents"]      # valid JSON, or this fails
    finally:
        os.remove(path)


def _inside(events, outer, name):
    """The ``name`` spans on ``outer``'s track within it, in order."""
    end = outer["ts"] + outer["dur"]
    return sorted((e for e in events if e["name"] == name and e["ph"] == "X"
                   and (e["pid"], e["tid"]) == (outer["pid"], outer["tid"])
                   and outer["ts"] <= e["ts"] and e["ts"] + e["dur"] <= end + 1e-3),
                  key=lambda e: e["ts"])


def test_trace_of_every_rank_and_the_report_names_the_slowed_rank():
    out, events = _job(3, "--check", "1", "--slowdown", "1:4", "--report", "collectives", "4")
    assert {e["pid"] for e in events if e["ph"] == "X"} == {0, 1, 2}
    for rank in range(3):
        mine = [e for e in events if e["pid"] == rank]
        for k in range(4):
            loss = next(e for e in mine if e["name"] == f"loss.step{k}")
            checked, in_mpi = (_inside(mine, loss, name) for name in ("checked", "in MPI"))
            assert len(checked) == len(in_mpi) == 1
            assert checked[0]["ts"] + checked[0]["dur"] <= in_mpi[0]["ts"] + 1e-3
            fused = next(e for e in mine if e["name"] == f"grad0.step{k} and 2 more")
            assert fused["args"]["members"] == [f"grad{i}.step{k}" for i in range(3)]
            phases = [_inside(mine, fused, name) for name in ("checked", "packed", "in MPI",
                                                              "unpacked")]
            assert [len(p) for p in phases] == [1, 1, 1, 1]
            for before, after in zip(phases, phases[1:]):
                assert before[0]["ts"] + before[0]["dur"] <= after[0]["ts"] + 1e-3
            queued = [e for e in mine if e["name"] == "queued" and e["ph"] == "b"
                      and e["args"]["op"].endswith(f"step{k}")]
            assert len(queued) == 3
        slowed = [e for e in mine if e["name"] == "slowdown (emulated)"]
        assert len(slowed) == (4 if rank == 1 else 0)
        assert len([e for e in mine if e["name"] == "compute"]) == 4
    assert "waited for most: rank 1 (" in out, out


def test_steps_limit_the_recording():
    out, events = _job(2, "--timeline-steps", "2-3", "collectives", "6")   # checks off
    steps = {re.search(r"step(\d+)", e["name"]).group(1) for e in events
             if e["ph"] == "X" and ".step" in e["name"]}
    assert steps == {"2", "3"}, steps
    fused = [e for e in events if e["name"].startswith("grad0.step")]
    assert len(fused) == 4                                # 2 steps on 2 ranks
    for batch in fused:
        assert [len(_inside(events, batch, n)) for n in ("packed", "in MPI", "unpacked")] \
            == [1, 1, 1]


def test_parameter_server_on_the_timeline_and_in_the_report():
    out, events = _job(3, "--servers", "1", "--slowdown", "1:4", "--report", "--link",
                       "100us,1GB/s", "ps", "4")
    assert {e["pid"] for e in events if e["ph"] == "b" and e["name"] == "push_pull server 0"} \
        == {0, 1}
    names = {e["args"]["name"] for e in events if e["name"] == "process_name"}
    assert names == {"rank 0", "rank 1", "rank 2 (PS server 0)"}
    waits = [e for e in events if e["name"] == "pull waited" and e["ph"] == "b"]
    assert waits and all(e["pid"] == 2 and e["args"]["reason"] == "staleness" for e in waits)
    assert any(e["args"]["waited_for"] == [1] for e in waits)
    assert "waited for most: rank 1 (" in out, out
    assert "parameter server stragglers: not tracked by bsp; applied staleness" in out, out
    paced = {(e["pid"], e["name"]) for e in events if e.get("cat") == "emulated" and e["ph"] == "b"}
    assert {(0, "emulated send"), (2, "emulated receive")} <= paced, paced
