"""torch's own distributed tests on the "pycoll" backend, one MPI rank per test rank.

    pycollrun -np 3 python -m pytest -q tools/torch_suite.py [-k PATTERN]
    PYCOLL_TORCH_SUITE_AS=mpi pycollrun -np 3 python -m pytest -q tools/torch_suite.py

torch tests a backend with ``DistributedTest._DistTestBase``
(torch/testing/_internal/distributed/distributed_test.py, shipped in torch's wheel): its
harness forks the ranks itself, which an MPI backend cannot join, so here each
pycollrun rank runs the same tests in the same order, as Horovod's suite runs under
``horovodrun``. Nothing of the suite is copied or edited: pycoll registers as torch's
documented plugin backend (``DistTestCases.backend_feature``: "plugin", with the "ddp"
and "subgroup" features it has) before the suite is imported, the suite's file-based
barrier between tests becomes MPI's, and a rank's ``sys.exit`` with one of the suite's
skip codes (as its harness reads them from a forked rank) is that test's skip.

The suite gates many tests by backend name (all_to_all "only MPI", groups of ranks 1
and 2 only for MPI below 8 ranks; the coalesced collectives, sparse allreduce, barrier
timeouts and ``no_sync`` "only gloo"). ``PYCOLL_TORCH_SUITE_AS=mpi`` (or ``gloo``) runs it
as it tests torch's own MPI (or gloo) backend, with pycoll's process group in its place,
but for ``test_get_backend``, which compares the name, and, as gloo, the tests in
``_GLOO_ONLY`` below. The suite assumes 2 ranks or more, 3 as an MPI backend; torch
runs it at 3. It needs ``expecttest`` (requirements-dev.txt), which torch's test
utilities import.
"""
import atexit
import os
import shutil
import sys
import tempfile
import unittest

import pytest
from mpi4py import MPI

import torch.distributed as dist
from torch.testing._internal.common_distributed import TEST_SKIPS, DistTestCases

import pycoll.torch  # noqa: F401  (registers the backend)

_world = MPI.COMM_WORLD
_AS = os.environ.get("PYCOLL_TORCH_SUITE_AS", "pycoll")
if _AS not in ("pycoll", "mpi", "gloo"):
    pytest.exit(f"PYCOLL_TORCH_SUITE_AS is pycoll (the default), mpi or gloo, not {_AS!r}", 4)
_LEAST = 3 if _AS == "mpi" else 2      # the suite's own assumptions (its groups: ranks 1, 2)
if _world.size < _LEAST:
    pytest.exit(f"the suite tests the {_AS} backend at {_LEAST} or more ranks; this job has "
                f"{_world.size}", 4)
_temp = _world.bcast(tempfile.mkdtemp(prefix="pycoll-torch-suite-") if _world.rank == 0 else None)
if _world.rank == 0:
    for sub in ("test_dir", "init_dir"):     # no "barrier": _barrier below is MPI's
        os.mkdir(os.path.join(_temp, sub))
    atexit.register(shutil.rmtree, _temp, True)
_world.Barrier()
os.environ.update(BACKEND=_AS, WORLD_SIZE=str(_world.size), TEMP_DIR=_temp,
                  INIT_METHOD="pycoll://")
for feature in ("plugin", "ddp", "subgroup"):
    DistTestCases.backend_feature[feature] = DistTestCases.backend_feature[feature] | {"pycoll"}

from torch.testing._internal.common_utils import TestCase  # noqa: E402
from torch.testing._internal.distributed.distributed_test import DistributedTest  # noqa: E402


class TestPycoll(TestCase, DistributedTest._DistTestBase):
    """The suite's tests, the process group made once per process."""

    @classmethod
    def setUpClass(cls):
        super().setUpClass()
        if not dist.is_initialized():
            dist.init_process_group("pycoll", init_method="pycoll://")

    @property
    def rank(self) -> int:
        return _world.rank

    @property
    def world_size(self) -> str:          # the suite's harness keeps it as its env's text
        return os.environ["WORLD_SIZE"]

    @property
    def file_name(self) -> str:
        return os.path.join(_temp, "init_dir", "shared_init_file")

    def _barrier(self, *args, **kwargs):
        _world.Barrier()

    if _AS != "pycoll":
        @unittest.skip(f"it compares dist.get_backend() with {_AS!r}; pycoll's is 'pycoll'")
        def test_get_backend(self):
            pass

    def _callTestMethod(self, method):
        try:
            super()._callTestMethod(method)
        except SystemExit as exit:
            reason = next((s.message for s in TEST_SKIPS.values() if s.exit_code == exit.code), None)
            if reason is None:
                raise
            raise unittest.SkipTest(reason) from None


# As gloo, by name prefix: what pycoll cannot do as gloo does, and why.
_GLOO_ONLY = {
    "test_monitored_barrier": "torch's monitored_barrier runs on its own gloo process group only",
}
if _AS == "gloo":
    for _name in dir(TestPycoll):
        _reason = next((r for p, r in _GLOO_ONLY.items() if _name.startswith(p)), None)
        if _reason:
            setattr(TestPycoll, _name, unittest.skip(_reason)(getattr(TestPycoll, _name)))


if __name__ == "__main__":
    sys.exit("run it with: pycollrun -np 3 python -m pytest -q tools/torch_suite.py")
