"""Launching a parameter-server job script of tests/ under pycollrun, for the PS tests."""
import os
import subprocess
import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parent


def run_ps_job(script, np_, servers, *args, flags=(), timeout_s=20, wall_s=90, expect_ok=True):
    """``tests/SCRIPT ARGS`` on ``np_`` ranks, ``servers`` of them servers, with pycoll's
    timeout ``timeout_s``; the finished process (its exit checked if ``expect_ok``)."""
    env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    cmd = [sys.executable, "-m", "pycoll.launch.pycollrun", "-np", str(np_), "--servers",
           str(servers), "--timeout", str(timeout_s), *flags, "python", str(TESTS / script),
           *args]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=wall_s)
    if expect_ok:
        assert out.returncode == 0, out.stdout + out.stderr
    return out
