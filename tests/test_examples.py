"""The main job: data-parallel training on 3 ranks reaches one process's accuracy."""
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(300)

ROOT = Path(__file__).resolve().parents[1]


def train(ranks: int, *args: str) -> str:
    env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    out = subprocess.run([sys.executable, "-m", "pycoll.launch.pycollrun", "-np", str(ranks),
                          "python", str(ROOT / "examples" / "train_digits.py"), *args],
                         env=env, capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stdout + out.stderr
    return out.stdout


def final_accuracy(output: str) -> float:
    return float(re.search(r"final test accuracy ([\d.]+)%", output).group(1))


def test_data_parallel_matches_one_process():
    single, parallel = train(1, "--epochs", "6"), train(3, "--epochs", "6")
    assert "replicas identical on all 3 ranks: yes" in parallel
    assert final_accuracy(single) > 90
    assert abs(final_accuracy(parallel) - final_accuracy(single)) <= 1.0
    assert len(re.findall(r"^epoch", parallel, re.M)) == 6
