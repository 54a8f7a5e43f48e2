"""The configuration table: precedence, parsing, and the README's copy of it."""
from pathlib import Path

import pytest

from pycoll import config

pytestmark = pytest.mark.timeout(30)


@pytest.fixture(autouse=True)
def no_overrides():
    """Emptied in place and refilled after: _C's short path holds these very dicts."""
    saved = dict(config._overrides), dict(config._from_environment)
    config._overrides.clear()
    config._from_environment.clear()
    yield
    for table, contents in zip((config._overrides, config._from_environment), saved):
        table.clear()
        table.update(contents)


def test_precedence_keyword_then_environment_then_default(monkeypatch):
    assert config.get("timeout") == config.KNOBS["timeout"].default
    monkeypatch.setenv("PYCOLL_TIMEOUT", "12.5")
    assert config.get("timeout") == config.KNOBS["timeout"].default     # read once
    config.reload()
    assert config.get("timeout") == 12.5
    config.configure(timeout=3)
    assert config.get("timeout") == 3


def test_bad_values_name_the_variable(monkeypatch):
    monkeypatch.setenv("PYCOLL_CUDA_AWARE_MPI", "maybe")
    with pytest.raises(ValueError, match="PYCOLL_CUDA_AWARE_MPI='maybe'"):
        config.get("cuda_aware_mpi")
    with pytest.raises(TypeError, match="unknown pycoll option 'fusion'"):
        config.configure(fusion=1)
    with pytest.raises(ValueError, match="RANK:FACTOR"):
        config.parse_slowdown("1=3")


def test_readme_lists_every_knob():
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    for knob in config.KNOBS.values():
        assert f"`{knob.env}` | `{knob.flag}`" in readme, knob.env
