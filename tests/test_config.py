"""The configuration table: precedence, parsing, and the README's copy of it."""
from pathlib import Path

import pytest

from pycoll import config

pytestmark = pytest.mark.timeout(30)


@pytest.fixture(autouse=True)
def no_overrides():
    """Each test starts from the environment and defaults; what it set is undone."""
    with config.overriding():
        config._overrides.clear()
        config.reload()
        yield
    config.reload()


def test_precedence_keyword_then_environment_then_default(monkeypatch):
    assert config.get("timeout") == config.KNOBS["timeout"].default
    monkeypatch.setenv("PYCOLL_TIMEOUT", "12.5")
    assert config.get("timeout") == config.KNOBS["timeout"].default     # read once
    config.reload()
    assert config.get("timeout") == 12.5
    config.configure(timeout=3)
    assert config.get("timeout") == 3


def test_horovods_variables_where_pycolls_are_unset(monkeypatch):
    monkeypatch.setenv("HOROVOD_FUSION_THRESHOLD", "33554432")
    monkeypatch.setenv("HOROVOD_CYCLE_TIME", "3.5")
    monkeypatch.setenv("PYCOLL_CYCLE_TIME_MS", "0")
    monkeypatch.setenv("HOROVOD_STALL_CHECK_TIME_SECONDS", "-1")
    monkeypatch.setenv("HOROVOD_TIMELINE", "/tmp/horovod-timeline.json")
    config.reload()
    assert config.get("fusion_threshold") == 32 * 2**20
    assert config.get("timeline") == "/tmp/horovod-timeline.json"
    monkeypatch.setenv("HOROVOD_TIMELINE", "DYNAMIC")      # Horovod's suite: start_timeline
    config.reload()
    assert config.get("timeline") is None
    for horovods, ours in (("TRACE", "debug"), ("info", "info"), ("fatal", "error")):
        monkeypatch.setenv("HOROVOD_LOG_LEVEL", horovods)
        config.reload()
        assert config.get("log_level") == ours
    monkeypatch.setenv("HOROVOD_LOG_LEVEL", "loud")
    config.reload()
    with pytest.raises(ValueError, match="HOROVOD_LOG_LEVEL='loud': expected one of debug"):
        config.get("log_level")
    assert config.get("cycle_time_ms") == 0.0                 # PYCOLL_'s comes first
    with pytest.raises(ValueError, match="HOROVOD_STALL_CHECK_TIME_SECONDS='-1': expected"):
        config.get("stall_warning_s")


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


@pytest.mark.parametrize("name, text, accepted", [
    ("timeout", "inf", "positive, finite number of seconds"),
    ("timeout", "nan", "positive, finite number of seconds"),
    ("timeout", "0", "positive, finite number of seconds"),
    ("timeout", "-3", "positive, finite number of seconds"),
    ("fusion_threshold", "-1", "whole number of bytes >= 0"),
    ("chunk_bytes", "0", "whole number of bytes >= 1"),
    ("cycle_time_ms", "-0.5", "milliseconds >= 0"),
    ("stall_warning_s", "inf", "positive, finite number of seconds"),
    ("servers", "0", "server ranks >= 1"),
    ("partial_cache_after", "two", "whole number of uses >= 0"),
    ("log_level", "loud", "one of debug, info, warning, error"),
    ("slowdown", "1:0.5", "FACTOR >= 1"),
    ("slowdown", "one:3", "RANK:FACTOR"),
])
def test_settings_out_of_range_are_refused_when_read(monkeypatch, name, text, accepted):
    knob = config.KNOBS[name]
    with pytest.raises(ValueError, match=f"pycoll option {name}={text!r}: .*{accepted}"):
        config.configure(**{name: text})
    monkeypatch.setenv(knob.env, text)
    with pytest.raises(ValueError, match=f"{knob.env}={text!r}: .*{accepted}"):
        config.reload()             # watchers read some knobs at once: they raise there
        config.get(name)


def test_keyword_values_are_checked_like_text():
    with pytest.raises(ValueError, match=r"timeout=inf: expected a positive"):
        config.configure(timeout=float("inf"))
    with pytest.raises(ValueError, match=r"fusion_threshold=-5: expected a whole number"):
        config.configure(fusion_threshold=-5)
    with pytest.raises(ValueError, match=r"timeout=True: expected a positive"):
        config.configure(timeout=True)
    config.configure(timeout=7, fusion_threshold=0)
    assert (config.get("timeout"), config.get("fusion_threshold")) == (7.0, 0)
