"""The blocking allreduce's short path: a host tensor straight to MPI_Allreduce, in _C.

It must give what the general path gives, and step aside (to the general path, which
raises on bad input) whenever it cannot keep the engine's order or read the tensor.
"""
import numpy as np
import pytest
import torch

import pycoll
from pycoll import _C, collectives, config

pytestmark = [pytest.mark.mpi, pytest.mark.timeout(120)]


@pytest.fixture
def short_runs(settings, monkeypatch, pycoll_world):
    """PYCOLL_CHECK off (the suite's default turns it on, and it disables the short
    path); how many allreduces the short path has run since."""
    settings(check=False)
    start = _C.short_path_runs()
    return lambda: _C.short_path_runs() - start


def test_mpi_was_found():
    assert collectives._MPI_FROM_C == ""


@pytest.mark.parametrize("kind", ["numpy", "torch"])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32", "float64", "int8",
                                   "int32", "int64", "uint8"])
@pytest.mark.parametrize("op", [pycoll.Sum, pycoll.Average, pycoll.Min, pycoll.Max,
                                pycoll.Product])
def test_short_path_equals_the_general_one(settings, group, short_runs, kind, dtype, op, monkeypatch):
    arg, rank, size = group
    if op is pycoll.Average and dtype not in ("float16", "bfloat16", "float32", "float64"):
        pytest.skip("Average of integers is refused")
    if kind == "numpy" and dtype == "bfloat16":
        pytest.skip("numpy has no bfloat16")
    values = np.arange(1, 8) % 3 + rank % 2 + 1         # small: products stay exact
    make = ((lambda: torch.tensor(values).to(getattr(torch, dtype))) if kind == "torch"
            else (lambda: values.astype(dtype)))
    short_in, short_out = make(), pycoll.allreduce(make(), op=op, group=arg)
    assert pycoll.allreduce_(short_in, op=op, group=arg) is short_in
    assert short_runs() == 2
    settings(check=True)    # the general path
    general = pycoll.allreduce(make(), op=op, group=arg)
    assert short_runs() == 2
    for result in (short_in, short_out):
        assert type(result) is type(general) and result.dtype == general.dtype
        assert (result == general).all()


def test_short_path_keeps_the_issue_order(group, short_runs):
    """A blocking call made while an async one is still unsent runs after it."""
    arg, rank, size = group
    x = np.full(3, rank + 1.0)
    pending = pycoll.allreduce_async_(x, op=pycoll.Sum, group=arg)     # sits in the open batch
    pycoll.allreduce_(x, op=pycoll.Product, group=arg)
    assert short_runs() == 0
    assert pending.is_completed()
    np.testing.assert_array_equal(x, (size * (size + 1) / 2) ** size)
    pycoll.allreduce_(x, op=pycoll.Min, group=arg)
    assert short_runs() == 1


def test_what_the_short_path_leaves_to_the_general_one(settings, group, short_runs, monkeypatch):
    arg, rank, size = group
    big = np.ones(1024, np.float32)
    settings(chunk_bytes=1024)        # in pieces
    np.testing.assert_array_equal(pycoll.allreduce(big, op=pycoll.Sum, group=arg), size)
    np.testing.assert_array_equal(pycoll.allreduce(bytearray(3), op=pycoll.Sum, group=arg), 0)
    assert short_runs() == 0
    with pytest.raises(ValueError, match="contiguous"):
        pycoll.allreduce_(np.ones((4, 4))[:, 0], group=arg)
    with pytest.raises(ValueError, match="contiguous"):
        pycoll.allreduce_(torch.ones(4, 4).t(), group=arg)
    readonly = np.ones(4)
    readonly.flags.writeable = False
    with pytest.raises(ValueError, match="read-only"):
        pycoll.allreduce_(readonly, group=arg)
    with pytest.raises(TypeError, match="Average of int32"):
        pycoll.allreduce(np.ones(4, np.int32), group=arg)
    for op in ("bogus", [pycoll.Sum]):                                  # [..]: unhashable
        with pytest.raises(ValueError, match="unknown reduction"):
            pycoll.allreduce(np.ones(4), op=op, group=arg)
    assert short_runs() == 0


def test_ops_named_by_their_value_take_the_short_path(group, short_runs):
    arg, rank, size = group
    np.testing.assert_array_equal(pycoll.allreduce(np.ones(4), op="sum", group=arg), size)
    np.testing.assert_array_equal(pycoll.allreduce_(torch.ones(4), op="average", group=arg), 1)
    assert short_runs() == 2


def test_blocking_call_inside_a_batch_takes_the_general_path(group, short_runs):
    arg, rank, size = group
    inner = pycoll.runtime.engine().submit(
        lambda: pycoll.allreduce(np.ones(2), op=pycoll.Sum, group=arg), "callback")
    np.testing.assert_array_equal(inner.wait(timeout=60), size)
    assert short_runs() == 0


def test_bind_refuses_an_unknown_handle_size_and_keeps_its_binding(short_runs):
    assert "handles of 3 bytes" in _C.mpi_bind("/nowhere/MPI.so", 3)
    assert pycoll.allreduce_(np.ones(2), op=pycoll.Sum)[0] == pycoll.size()
    assert short_runs() == 1


def test_groups_in_turn_each_average_over_their_own_size(short_runs):
    """The short path remembers the group it used last; the next one must not inherit
    its communicator or size."""
    world = pycoll.size()
    first = pycoll.new_group([0])
    for _ in range(3):
        x = torch.full((3,), float(pycoll.rank()))
        np.testing.assert_allclose(pycoll.allreduce(x), (world - 1) / 2)
        if pycoll.rank() == 0:
            np.testing.assert_array_equal(pycoll.allreduce(x, group=first), 0)
            np.testing.assert_array_equal(pycoll.allreduce_(x + 5, group=first), 5)
    assert short_runs() == (9 if pycoll.rank() == 0 else 3)
