"""Importing pycoll.torch starts nothing: no MPI, no rendezvous variables; the ranks
meet in init_process_group (pycoll://) or hvd.init()."""
import os
import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("torch")

# As one rank of a 2-rank Open MPI job sees its environment: were MPI started at import,
# it would look for a launcher that is not there and fail or hang.
_LAUNCHED = {"OMPI_COMM_WORLD_SIZE": "2", "OMPI_COMM_WORLD_RANK": "1",
             "OMPI_COMM_WORLD_LOCAL_RANK": "1", "PMIX_RANK": "1"}
_RENDEZVOUS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
               "MASTER_PORT")


def test_import_runs_no_mpi_and_sets_no_variables():
    env = {k: v for k, v in os.environ.items()
           if k not in _RENDEZVOUS and not k.startswith(("OMPI_", "PMIX", "PMI_"))}
    code = textwrap.dedent(f"""
        import os, sys
        import pycoll.torch, torch.distributed as dist
        from torch.distributed.rendezvous import register_rendezvous_handler
        assert "mpi4py.MPI" not in sys.modules, "importing pycoll.torch started MPI"
        assert not [v for v in {_RENDEZVOUS!r} if v in os.environ], "variables were set"
        assert dist.Backend.PYCOLL == "pycoll"
        try:
            register_rendezvous_handler("pycoll", None)
        except RuntimeError as error:
            assert "already registered" in str(error)
        else:
            raise AssertionError("pycoll:// was not registered")
        print("ok")
    """)
    done = subprocess.run([sys.executable, "-c", code], env={**env, **_LAUNCHED},
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stdout + done.stderr
