"""The benchmarks run under mpiexec, check their results and write sane JSON and plots."""
import json
import os
import re
import subprocess
import sys

import pytest

pytestmark = pytest.mark.timeout(300)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCH = os.path.join(ROOT, "bench", "collectives.py")
FUSION = os.path.join(ROOT, "bench", "fusion.py")
MPIEXEC = os.path.join(os.path.dirname(sys.executable), "mpiexec")
OPS = ("allreduce", "allgather", "broadcast", "reduce_scatter", "alltoall")


def run_bench(script, *args, ranks=2):
    """``script`` under mpiexec with ``ranks`` ranks; its stdout (asserts exit code 0)."""
    if not os.path.exists(MPIEXEC):
        pytest.skip(f"no mpiexec beside {sys.executable}")
    pytest.importorskip("torch")
    env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    # Under an mpiexec'd pytest the child must not inherit this rank's MPI identity.
    env = {k: v for k, v in env.items() if not k.startswith(("OMPI_COMM_", "PMIX_", "PMI_"))}
    proc = subprocess.run(
        [MPIEXEC, "-n", str(ranks), "--oversubscribe", sys.executable, script, *map(str, args)],
        capture_output=True, text=True, env=env, timeout=240, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout


@pytest.fixture(scope="module")
def small_sweep(tmp_path_factory):
    """One 2-rank run of every op up to 4 KiB with --check; (stdout, JSON, PNG path)."""
    tmp = tmp_path_factory.mktemp("bench")
    out, png = tmp / "rows.json", tmp / "plots" / "busbw.png"     # --plot makes plots/
    stdout = run_bench(BENCH, "--max-bytes", "4096", "--iters", "3", "--target-ms", "1",
                       "--warmup", "1",
                       "--batches", "2", "--check", "--json", out, "--plot", png)
    return stdout, json.loads(out.read_text()), png


def test_header_and_tables(small_sweep):
    stdout, _, _ = small_sweep
    lines = stdout.splitlines()
    assert lines[0].startswith("# pycoll") and "2 ranks" in lines[0] and "torch" in lines[0]
    assert lines[1].startswith("# memcpy: ") and "GB/s" in lines[1]
    assert "# targets (allreduce medians" in stdout
    for op in OPS:
        assert f"# {op} " in stdout
    assert "size(B)" in stdout and "busbw" in stdout and "pyc/mpi" in stdout
    assert "torch-pycoll time(us)" in stdout and "gloo/tpc" in stdout
    assert "FAIL" not in stdout and "check OK" in stdout


def test_json_rows(small_sweep):
    _, data, _ = small_sweep
    assert data["meta"]["ranks"] == 2 and data["meta"]["check_ok"] is True
    rows = data["rows"]
    for op in OPS:
        impls = {r["impl"] for r in rows if r["op"] == op}
        assert impls == {"pycoll", "mpi4py", "gloo", "torch-pycoll"}, (op, impls)
    for r in rows:
        assert r["check"] is True, r
        assert r["time_us"] > 0 and r["bytes"] == r["count"] * 4 and r["dtype"] == "float32"
        assert r["algbw"] == pytest.approx(r["bytes"] / r["time_us"] / 1e3)


@pytest.mark.parametrize("op, factor", [("allreduce", 1.0), ("allgather", 0.5),
                                        ("broadcast", 1.0), ("reduce_scatter", 0.5),
                                        ("alltoall", 0.5)])
def test_busbw(small_sweep, op, factor):
    # 2 ranks: 2(n-1)/n = 1 for allreduce, (n-1)/n = 1/2 for the splitting ops.
    _, data, _ = small_sweep
    row = next(r for r in data["rows"] if r["op"] == op and r["bytes"] == 4096)
    assert row["busbw"] == pytest.approx(row["algbw"] * factor)


def test_sizes_split_across_ranks(small_sweep):
    # 4 B cannot give 2 ranks an element each: skipped for the ops that split the buffer.
    _, data, _ = small_sweep
    smallest = {op: min(r["bytes"] for r in data["rows"] if r["op"] == op) for op in OPS}
    assert smallest == {"allreduce": 4, "broadcast": 4, "allgather": 16,
                        "reduce_scatter": 16, "alltoall": 16}


def test_json_meta(small_sweep):
    stdout, data, _ = small_sweep
    meta = data["meta"]
    assert meta["memcpy_gbps"] > 0 and meta["cpus"] >= 1 and meta["host"]
    assert meta["targets"]["allreduce_4B_1KiB_max_pycoll_minus_mpi4py_us"] is not None
    assert meta["targets"]["allreduce_64MiB_pycoll_over_mpi4py"] is None     # not run
    assert len(meta["load_average"]) == 2 and min(meta["load_average"]) >= 0
    assert "; load average " in stdout


def test_pycoll_on_the_numpy_arrays_checks_out():
    stdout = run_bench(BENCH, "--max-bytes", "1024", "--iters", "0", "--check", "--no-gloo",
                       "--numpy")
    assert "pycoll on the numpy arrays" in stdout and "check OK" in stdout


def test_plot(small_sweep):
    _, _, png = small_sweep
    assert png.exists() and png.stat().st_size > 1000
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# ---------------------------------------------------------------- bench/fusion.py

@pytest.fixture(scope="module")
def fusion_run(tmp_path_factory):
    """bench/fusion.py at 2 ranks, shrunk (ResNet-50 list x 1/100, 50 x 4 KiB, 256 KiB),
    each form with Average on torch and numpy, --check (Sum and Average) at thresholds that split the lists (4 KiB: every tensor alone) or not, chunks
    that cut tensors and cycle times, --parts; (stdout, JSON)."""
    out = tmp_path_factory.mktemp("fusion") / "fusion.json"
    stdout = run_bench(FUSION, "--scale", "0.01", "--small-count", "50", "--iters", "2",
                       "--batches", "2", "--warmup", "1", "--target-ms", "5",
                       "--large-bytes", "256K", "--thresholds", "4K,64K,16M",
                       "--chunks", "1000,16M", "--cycles", "0,1", "--ops", "average",
                       "--kinds", "torch,numpy", "--check", "--parts", "--json", out)
    return stdout, json.loads(out.read_text())


def test_fusion_output(fusion_run):
    stdout, _ = fusion_run
    assert stdout.startswith("# pycoll") and "# memcpy: " in stdout
    assert "# in use: fusion_threshold " in stdout
    for knob in ("fusion_threshold", "chunk_bytes", "cycle_time_ms"):
        assert f"# best {knob}: " in stdout
    assert "pycoll/mpi4py-concat" in stdout and "mpi4py-per-tensor/pycoll" in stdout
    assert "mpi4py-per-tensor/pycoll-grouped" in stdout
    assert "pycoll-grouped-new/mpi4py-concat" in stdout
    assert "worst grouped form/mpi4py-concat" in stdout and "/floor" in stdout
    assert "rank 0:" in stdout and "rank 1:" in stdout and "check OK" in stdout
    assert stdout.count("# load average: ") == 1 and "; load average: " in stdout
    parts = stdout.split("# parts of a grouped pass over 50 tensors")[1].splitlines()[1:3]
    for kind, line in zip(("torch", "numpy"), parts):
        assert line.startswith(f"#   {kind}: read ") and "new buffer+views" in line
        assert "pycoll-grouped-new average" in line
        assert re.search(r"; allreduce_async_ issued \d+\.\d\d us a call$", line), line


def test_fusion_json(fusion_run):
    _, data = fusion_run
    meta, rows = data["meta"], data["rows"]
    assert meta["ranks"] == 2 and meta["check_ok"] is True and meta["memcpy_gbps"] > 0
    assert [m["rank"] for m in meta["memory"]] == [0, 1]
    assert all(m["peak_rss_mib"] > 0 for m in meta["memory"])
    main = {(r["case"], r["impl"]) for r in rows if r["section"] == "main"}
    forms = ("pycoll", "pycoll-grouped", "pycoll-grouped-new")
    every_form = [f"{f}:average:{kind}" for f in forms for kind in ("torch", "numpy")]
    assert main == {(c, i) for c in ("resnet50", "small", "large")
                    for i in every_form + ["mpi4py-concat", "mpi4py-per-tensor",
                                           "gloo-per-tensor", "gloo-concat"]}
    for r in rows:
        assert r["time_us"] > 0 and r["bytes"] > 0
    resnet = next(r for r in rows if r["case"] == "resnet50")
    assert resnet["tensors"] == 161
    small = next(r for r in rows if r["case"] == "small")
    assert small["tensors"] == 50 and small["bytes"] == 50 * 4096
    sweep = [r for r in rows if r["section"] == "sweep" and r["knob"] == "fusion_threshold"]
    assert sorted({r["value"] for r in sweep}) == [4096, 65536, 16 << 20]
    assert {(r["knob"], r["value"]) for r in rows if r["section"] == "sweep"} >= {
        ("chunk_bytes", 1000), ("chunk_bytes", 16 << 20), ("cycle_time_ms", 0), ("cycle_time_ms", 1)}
    # configure(fusion_threshold=...) takes effect: at 4 KiB every 4 KiB tensor goes alone,
    # at 16 MiB the whole list is one batch.
    batches = {(r["case"], r["value"]): r["mpi_batches"] for r in sweep}
    assert batches["small", 4096] == 50 and batches["small", 16 << 20] == 1
    assert batches["resnet50", 4096] > batches["resnet50", 65536] > batches["resnet50", 16 << 20]



@pytest.mark.timeout(560)
def test_reproduce_smoke_run_is_resumable_and_writes_its_report(tmp_path):
    """``bench/reproduce.py --tiny``: every experiment once, a report with each paper's
    headline beside the measured number; a second run reuses the runs on disk."""
    pytest.importorskip("torch")
    pytest.importorskip("sklearn")
    command = [sys.executable, os.path.join(ROOT, "bench", "reproduce.py"), "--tiny",
               "--out", str(tmp_path)]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OMPI_COMM_", "PMIX_", "PMI_"))}
    first = subprocess.run(command, capture_output=True, text=True, env=env, timeout=480)
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    report = (tmp_path / "tiny" / "README.md").read_text()
    for paper in ("FluentPS", "R²SP", "Ripples", "iPart", "SaPS"):
        row = next(line for line in report.splitlines() if line.startswith(f"| {paper}"))
        assert "reproduced" in row                    # a verdict, whichever it is
    for plot in ("fluentps", "r2sp", "ripples", "ripples-cluster", "ipart", "saps"):
        assert (tmp_path / "tiny" / f"{plot}.png").stat().st_size > 0
    # Ripples at a realistic size (shrunk): every scheme with its real CPU share
    cluster = report.split("## Ripples / Prague at a realistic model size")[1].split("\n## ")[0]
    assert "real CPU share (%)" in cluster and "vs AD-PSGD" in cluster
    for scheme in ("allreduce", "adpsgd", "ripples-static", "ripples-random", "ripples-generator"):
        assert f"| rank 3 slowed 4x | {scheme} |" in cluster
    assert "applied staleness median/p99/max" in report and "blocked in pull" in report
    assert "| rank 3 slowed 4x | ps (asp) |" in report              # Ripples' PS baseline
    assert "allreduce 2 workers | ipart |" in report                # iPart's sweep
    runs = sorted(tmp_path.glob("tiny/*/*.json"))
    assert len(runs) == 8 and all(json.loads(p.read_text())["_run"]["seed"] == 0 for p in runs)
    stamps = [p.stat().st_mtime_ns for p in runs]
    again = subprocess.run(command, capture_output=True, text=True, env=env, timeout=60)
    assert again.returncode == 0, again.stderr[-3000:]
    assert [p.stat().st_mtime_ns for p in runs] == stamps          # nothing was run again


# ---------------------------------------------------------------- bench/emulation.py

def test_emulation_bench_smoke(tmp_path):
    """bench/emulation.py shrunk: 2 ranks, two sizes, one repetition, a slow link; every
    op has a row with its model, and the table and the plot are written."""
    out, png = tmp_path / "emulation.json", tmp_path / "emulation.png"
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("OMPI_COMM_", "PMIX_", "PMI_", "PYCOLL_"))}
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "emulation.py"),
                           "--ranks", "2", "--sizes", "4K,256K", "--reps", "1",
                           "--link", "1ms,100MB/s", "--json", str(out), "--plot", str(png)],
                          capture_output=True, text=True, env=env, timeout=240, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "clus/mod" in proc.stdout and "checked rows within 10%" in proc.stdout
    data = json.loads(out.read_text())
    assert data["meta"]["link"] == "1ms,100MB/s" and data["meta"]["ranks"] == 2
    assert data["meta"]["arrive"] == "busy"      # ranks spin to each start by default
    seen = {(r["op"], r["pushers"]) for r in data["rows"]}
    assert seen == {("allreduce", None), ("allgather", None), ("broadcast", None),
                    ("partial", None), ("ps push", 1), ("ps push", 2), ("ps pull", 1),
                    ("ps pull", 2)}
    for r in data["rows"]:
        assert r["model_ms"] > 0 and r["measured_ms"] > 0 and r["real_ms"] > 0
        # The cluster time takes only waits after the modelled end off the wall time.
        assert 0.9 * (r["model_ms"] - r["server_ms"]) <= r["cluster_ms"] <= r["measured_ms"], r
        ps = r["op"].startswith("ps")
        assert (r["server_ms"] > 0) == ps, r          # a PS row's model has the server's S
        # Never faster than the link's part of the model (S can overlap the latency).
        assert r["measured_ms"] >= 0.9 * (r["model_ms"] - r["server_ms"]), r
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # Ranks asleep to each start, the collectives alone.
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "emulation.py"),
                           "--ranks", "2", "--sizes", "4K", "--reps", "1", "--jobs", "collectives",
                           "--arrive", "idle", "--link", "1ms,100MB/s", "--json", str(out)],
                          capture_output=True, text=True, env=env, timeout=240, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    data = json.loads(out.read_text())
    assert data["meta"]["arrive"] == "idle"
    assert {r["op"] for r in data["rows"]} == {"allreduce", "allgather", "broadcast", "partial"}
    assert all(r["measured_ms"] >= 0.9 * r["model_ms"] for r in data["rows"]), data["rows"]


def test_timeline_cost_and_plot_smoke(tmp_path):
    out = run_bench(os.path.join(ROOT, "bench", "timeline_cost.py"), "--iters", "20",
                    "--batches", "1")
    rows = [line.split() for line in out.splitlines() if line.split()[:1] in (["4"], ["1024"])]
    assert len(rows) == 2 and all(len(row) == 9 for row in rows), out
    assert "hooks while off" in out, out
    from pycoll import timeline
    part = dict(rank=0, role="", threads={"1": "MainThread"}, dropped=0, started=1.0,
                events=[("X", "step 0", "step", 1.0, 0.01, 1, {}, 0),
                        ("X", "allreduce", "op", 1.002, 0.005, 1, {}, 0),
                        ("X", "in MPI", "phase", 1.003, 0.003, 1, {}, 0),
                        ("b", "queued", "queue", 1.001, 0, 0, {"op": "allreduce"}, 1),
                        ("e", "queued", "queue", 1.002, 0, 0, {}, 1)])
    trace, png = tmp_path / "trace.json", tmp_path / "trace.png"
    trace.write_text(json.dumps(timeline.trace([part])))
    subprocess.run([sys.executable, os.path.join(ROOT, "bench", "plot_timeline.py"), str(trace),
                    str(png)], check=True, timeout=120)
    assert png.stat().st_size > 1000


# ---------------------------------------------------------------- bench/partial.py

def test_partial_bench_smoke(tmp_path):
    """bench/partial.py shrunk: 3 ranks, groups of 2 and 3, four sizes across both of the
    partial all-reduce's paths (each result checked); a row per size with its ratio."""
    out = tmp_path / "partial.json"
    stdout = run_bench(os.path.join(ROOT, "bench", "partial.py"), "--groups", "2,3",
                       "--max-bytes", "1M", "--step-factor", "64", "--target-ms", "1",
                       "--batches", "1", "--json", out, ranks=3)
    assert "# groups of 2 at 3 ranks" in stdout and "# groups of 3 at 3 ranks" in stdout
    assert "worst ratio" in stdout
    rows = json.loads(out.read_text())["rows"]
    assert [(r["group"], r["bytes"]) for r in rows] == [
        (k, n) for k in (2, 3) for n in (4, 256, 16384, 1 << 20)]
    assert all(r["partial_us"] > 0 and r["mpi_us"] > 0 and r["ratio"] > 0 for r in rows)


# ---------------------------------------------------------------- bench/ps_stragglers.py

def test_ps_stragglers_smoke(tmp_path):
    """bench/ps_stragglers.py shrunk: setting (a) with 2 workers, 1 server, 1 epoch, ASP
    and SaPS: a row per policy with its staleness distribution, the verdict, JSON, PNG."""
    pytest.importorskip("torch")
    pytest.importorskip("sklearn")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OMPI_COMM_", "PMIX_", "PMI_"))}
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "ps_stragglers.py"),
                           "--settings", "a", "--workers", "2", "--servers", "1", "--epochs", "1",
                           "--policies", "asp", "saps", "--out", str(tmp_path)],
                          capture_output=True, text=True, env=env, timeout=240, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "staleness med/p90/p99/max" in proc.stdout and "load average" in proc.stdout
    assert "blocked in pull" in proc.stdout, proc.stdout
    rows = json.loads((tmp_path / "ps_stragglers.json").read_text())["rows"]
    assert [r["policy"] for r in rows] == ["asp", "saps"]
    for r in rows:
        counts = sum(r["staleness_histogram"].values())
        assert counts > 0 and r["staleness_median"] <= r["staleness_p90"] <= r["staleness_max"]
    assert (tmp_path / "ps_stragglers.png").stat().st_size > 0
