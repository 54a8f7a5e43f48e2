"""Training benchmarks' jobs: an example script run under pycollrun, its JSON read back.

Not under MPI itself (no mpi4py import): the scripts that use it start one job after
another, each its own ``pycollrun``.
"""
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Optional, Sequence

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"


def run_job(ranks: int, script: str, args: Sequence[str], flags: Sequence[str] = (),
            env: Optional[dict] = None, timeout: float = 900) -> dict:
    """``pycollrun -np RANKS FLAGS python examples/SCRIPT ARGS --json PATH``; the JSON
    the script wrote. ``env`` adds variables (``PYCOLL_LINK`` and the like). Raises
    ``RuntimeError`` with the job's output if it fails."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "result.json"
        cmd = [sys.executable, "-m", "pycoll.launch.pycollrun", "-np", str(ranks), *flags,
               "python", str(EXAMPLES / script), *map(str, args), "--json", str(path)]
        done = subprocess.run(cmd, cwd=EXAMPLES, capture_output=True, text=True, timeout=timeout,
                              env={**os.environ, "OMPI_ALLOW_RUN_AS_ROOT": "1",
                                   "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1", **(env or {})})
        if done.returncode:
            raise RuntimeError(f"{' '.join(cmd)} failed ({done.returncode}):\n"
                               f"{done.stdout[-3000:]}{done.stderr[-3000:]}")
        return json.loads(path.read_text())
