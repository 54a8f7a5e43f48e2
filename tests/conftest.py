import contextlib
import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))    # fakegpu and helpers import as top-level
# The suite always runs with mismatch checks: a broken test fails loudly instead of hanging.
os.environ.setdefault("PYCOLL_CHECK", "1")


def pytest_configure(config):
    # Multi-rank output interleaves: keep it short on ranks other than 0.
    rank = int(os.environ.get("OMPI_COMM_WORLD_RANK", os.environ.get("PMI_RANK", "0")))
    if rank:
        config.option.verbose = -1


@pytest.fixture
def settings():
    """``settings(check=True, ...)``: pycoll's knobs overridden until the test ends."""
    from pycoll import config
    with contextlib.ExitStack() as stack:
        yield lambda **knobs: stack.enter_context(config.overriding(**knobs))


@pytest.fixture
def in_opposite_orders():
    """``in_opposite_orders(run)``: ``run(0)`` and ``run(1)`` (one group each) in two
    threads, entered in opposite orders on neighbouring ranks; their results, once both
    are done. Fails if either is still waiting after 60 s: the groups waited on each other."""
    import threading
    import time
    from mpi4py import MPI

    def both(run):
        rank, results, errors = MPI.COMM_WORLD.Get_rank(), {}, []

        def one(g):
            try:
                if (rank + g) % 2:
                    time.sleep(0.2)         # the other group's collective goes in first here
                results[g] = run(g)
            except BaseException as error:
                errors.append(error)
        threads = [threading.Thread(target=one, args=(g,)) for g in (0, 1)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(60)
        assert not any(t.is_alive() for t in threads), "the groups waited on each other"
        assert not errors, errors
        return results
    return both


@pytest.fixture(scope="session")
def pycoll_world():
    import pycoll
    pycoll.init()
    return pycoll.runtime.world()


_groups = {}


@pytest.fixture(params=["world", "user_comm", "subgroup"])
def group(request, pycoll_world):
    """The communicators collectives are bound to in the tests.

    world: pycoll's own; user_comm: an mpi4py communicator the user passes, with ranks
    reversed; subgroup: ``new_group`` of every rank but the last (all ranks at size 1).
    Yields ``(group_arg, rank, size)``; skips on ranks outside the group.
    """
    import pycoll
    from mpi4py import MPI
    kind = request.param
    if kind not in _groups:
        world = MPI.COMM_WORLD
        if kind == "world":
            _groups[kind] = None
        elif kind == "user_comm":
            _groups[kind] = world.Split(0, world.size - world.rank)
        else:
            _groups[kind] = pycoll.new_group(range(max(1, world.size - 1)))
    arg = _groups[kind]
    grp = pycoll.runtime.resolve(arg) if not isinstance(arg, pycoll.Group) else arg
    if not grp.is_member:
        pytest.skip("this rank is outside the subgroup")
    return arg, grp.rank(), grp.size()
