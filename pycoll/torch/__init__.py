"""Horovod's PyTorch API on pycoll, and the "pycoll" torch.distributed backend.

    import pycoll.torch as hvd          # a Horovod script runs by changing its import
    hvd.init()
    optimizer = hvd.DistributedOptimizer(optimizer, model.named_parameters())

    import pycoll.torch                 # or: DDP over MPI
    torch.distributed.init_process_group("pycoll", init_method="pycoll://")

Importing registers the "pycoll" backend and the ``pycoll://`` rendezvous and starts
nothing: no MPI call, no environment variable set. The ranks meet in
``init_process_group`` (or ``hvd.init()``).
"""
from .api import (Adasum, Average, HorovodInternalError, HostsUpdatedInterrupt, Max, Min,
                  Product, ProcessSet, Sum, add_process_set, align_names, allgather,
                  allgather_async, allgather_object, allreduce, allreduce_,
                  allreduce_async, allreduce_async_, alltoall, alltoall_async, barrier,
                  broadcast, broadcast_, broadcast_async, broadcast_async_,
                  broadcast_object, broadcast_optimizer_state, broadcast_parameters,
                  ccl_built, cross_rank, cross_size, cuda_built, ddl_built, gloo_built,
                  gloo_enabled, global_process_set, grouped_allgather,
                  grouped_allgather_async, grouped_allreduce, grouped_allreduce_,
                  grouped_allreduce_async, grouped_allreduce_async_,
                  grouped_reducescatter, grouped_reducescatter_async, init,
                  is_homogeneous, is_initialized, join, local_rank, local_size, mpi_built,
                  mpi_enabled, mpi_threads_supported, nccl_built, poll, rank,
                  reducescatter, reducescatter_async, remove_process_set, rocm_built,
                  shutdown, size, sparse_allreduce_async, start_timeline, stop_timeline,
                  synchronize)
from . import elastic
from .backend import ProcessGroupPycoll, register as _register
from .compression import Compression
from .optimizer import DistributedOptimizer
from .sync_batch_norm import SyncBatchNorm

_register()
