"""The collectives benchmark runs under mpiexec, checks its results and writes sane JSON."""
import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.timeout(300)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCH = os.path.join(ROOT, "bench", "collectives.py")
MPIEXEC = os.path.join(os.path.dirname(sys.executable), "mpiexec")
OPS = ("allreduce", "allgather", "broadcast", "reduce_scatter", "alltoall")


@pytest.fixture(scope="module")
def small_sweep(tmp_path_factory):
    """One 2-rank run of every op up to 4 KiB with --check; (stdout, JSON)."""
    if not os.path.exists(MPIEXEC):
        pytest.skip(f"no mpiexec beside {sys.executable}")
    pytest.importorskip("torch")
    out = tmp_path_factory.mktemp("bench") / "rows.json"
    env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    # Under an mpiexec'd pytest the child must not inherit this rank's MPI identity.
    env = {k: v for k, v in env.items() if not k.startswith(("OMPI_COMM_", "PMIX_", "PMI_"))}
    proc = subprocess.run(
        [MPIEXEC, "-n", "2", "--oversubscribe", sys.executable, BENCH, "--max-bytes", "4096",
         "--iters", "3", "--warmup", "1", "--batches", "2", "--check", "--json", str(out)],
        capture_output=True, text=True, env=env, timeout=240, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout, json.loads(out.read_text())


def test_header_and_tables(small_sweep):
    stdout, _ = small_sweep
    lines = stdout.splitlines()
    assert lines[0].startswith("# pycoll") and "2 ranks" in lines[0] and "torch" in lines[0]
    for op in OPS:
        assert f"# {op} " in stdout
    assert "size(B)" in stdout and "busbw" in stdout and "pyc/mpi" in stdout
    assert "FAIL" not in stdout and "check OK" in stdout


def test_json_rows(small_sweep):
    _, data = small_sweep
    assert data["meta"]["ranks"] == 2 and data["meta"]["check_ok"] is True
    rows = data["rows"]
    for op in OPS:
        impls = {r["impl"] for r in rows if r["op"] == op}
        assert impls == {"pycoll", "mpi4py", "gloo"}, (op, impls)
    for r in rows:
        assert r["check"] is True, r
        assert r["time_us"] > 0 and r["bytes"] == r["count"] * 4 and r["dtype"] == "float32"
        assert r["algbw"] == pytest.approx(r["bytes"] / r["time_us"] / 1e3)


@pytest.mark.parametrize("op, factor", [("allreduce", 1.0), ("allgather", 0.5),
                                        ("broadcast", 1.0), ("reduce_scatter", 0.5),
                                        ("alltoall", 0.5)])
def test_busbw(small_sweep, op, factor):
    # 2 ranks: 2(n-1)/n = 1 for allreduce, (n-1)/n = 1/2 for the splitting ops.
    _, data = small_sweep
    row = next(r for r in data["rows"] if r["op"] == op and r["bytes"] == 4096)
    assert row["busbw"] == pytest.approx(row["algbw"] * factor)


def test_sizes_split_across_ranks(small_sweep):
    # 4 B cannot give 2 ranks an element each: skipped for the ops that split the buffer.
    _, data = small_sweep
    smallest = {op: min(r["bytes"] for r in data["rows"] if r["op"] == op) for op in OPS}
    assert smallest == {"allreduce": 4, "broadcast": 4, "allgather": 16,
                        "reduce_scatter": 16, "alltoall": 16}
