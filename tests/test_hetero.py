"""pycoll.hetero: slowdown() makes the ranks named in the `slowdown` knob slower by sleeping."""
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from pycoll import config, hetero

pytestmark = pytest.mark.timeout(120)

ROOT = Path(__file__).resolve().parents[1]
BUSY = 0.1


def _busy(seconds=BUSY):
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


@pytest.fixture
def world(monkeypatch):
    """No MPI in sight: the rank comes from OMPI_COMM_WORLD_RANK."""
    monkeypatch.delitem(sys.modules, "mpi4py.MPI", raising=False)
    monkeypatch.setattr(config, "_from_environment", {})      # variables set below count
    for name in ("OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK", "PYCOLL_SLOWDOWN"):
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def _timed_block(**kwargs):
    wall, cpu = time.perf_counter(), time.process_time()
    with hetero.slowdown(**kwargs) as factor:
        _busy()
    return factor, time.perf_counter() - wall, time.process_time() - cpu


def test_named_rank_is_slowed_without_cpu(world):
    world.setenv("PYCOLL_SLOWDOWN", "1:3,2:1.5")
    world.setenv("OMPI_COMM_WORLD_RANK", "1")
    assert hetero.slowdown_factor() == 3.0
    factor, wall, cpu = _timed_block()
    assert factor == 3.0
    assert 2.5 <= wall / BUSY <= 4.0, wall
    assert cpu < 1.7 * BUSY, f"the sleep should cost no CPU: {cpu:.3f} s CPU for {wall:.3f} s"


def test_unnamed_rank_is_not_slowed(world):
    world.setenv("PYCOLL_SLOWDOWN", "1:3")
    world.setenv("OMPI_COMM_WORLD_RANK", "0")
    factor, wall, _ = _timed_block()
    assert factor == 1.0 and wall / BUSY < 1.5
    start = time.perf_counter()
    for _ in range(10000):
        with hetero.slowdown():
            pass
    assert (time.perf_counter() - start) / 10000 < 100e-6  # negligible


def test_rank_sources(world):
    world.setenv("PYCOLL_SLOWDOWN", "0:2,3:4")
    assert hetero.slowdown_factor() == 2.0  # no MPI, no variables: rank 0
    world.setenv("PMI_RANK", "3")
    assert hetero.slowdown_factor() == 4.0
    world.setenv("OMPI_COMM_WORLD_RANK", "5")
    assert hetero.slowdown_factor() == 1.0
    assert hetero.slowdown_factor(rank=3) == 4.0
    world.delenv("PYCOLL_SLOWDOWN")
    config.reload()                                  # variables are read once
    assert hetero.slowdown_factor(rank=3) == 1.0
    assert _timed_block(rank=0)[0] == 1.0


def test_exception_in_block_adds_no_sleep(world):
    world.setenv("PYCOLL_SLOWDOWN", "0:50")
    start = time.perf_counter()
    with pytest.raises(KeyError):
        with hetero.slowdown():
            _busy(0.02)
            raise KeyError("x")
    assert time.perf_counter() - start < 0.5


@pytest.mark.parametrize("value, words", [("1:x", "RANK:FACTOR"), ("1", "RANK:FACTOR"),
                                          ("1:0.5", "FACTOR >= 1"), ("-1:2", "RANK >= 0")])
def test_parse_errors_are_clear(world, value, words):
    world.setenv("PYCOLL_SLOWDOWN", value)
    with pytest.raises(ValueError, match="PYCOLL_SLOWDOWN") as err:
        hetero.slowdown_factor()
    assert words in str(err.value)


def _env():
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYCOLL_")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    return env


def test_does_not_import_mpi():
    code = ("import sys, pycoll.hetero as h; before = 'mpi4py.MPI' in sys.modules\n"
            "with h.slowdown(): pass\n"
            "print(before, 'mpi4py.MPI' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], env=dict(_env(), PYCOLL_SLOWDOWN="0:2"),
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    before, after = out.stdout.split()
    assert before == after


def test_under_pycollrun_with_mpi(tmp_path):
    """Two MPI ranks, --slowdown 1:3: rank 1 (from COMM_WORLD) is 3x slower, rank 0 is not."""
    prog = tmp_path / "prog.py"
    prog.write_text(textwrap.dedent(f"""
        import time
        from mpi4py import MPI
        from pycoll import hetero
        start = time.perf_counter()
        with hetero.slowdown():
            end = time.perf_counter() + {BUSY}
            while time.perf_counter() < end:
                pass
        print("rank", MPI.COMM_WORLD.Get_rank(), (time.perf_counter() - start) / {BUSY})
    """))
    out = subprocess.run([sys.executable, str(ROOT / "launch" / "pycollrun.py"), "-np", "2",
                          "--slowdown", "1:3", "python", str(prog)],
                         env=_env(), capture_output=True, text=True, timeout=90)
    assert out.returncode == 0, out.stderr
    ratios = {int(line.split()[1]): float(line.split()[2]) for line in out.stdout.splitlines()
              if line.startswith("rank ")}
    assert ratios[0] < 1.5 and 2.5 <= ratios[1] <= 4.0, ratios
