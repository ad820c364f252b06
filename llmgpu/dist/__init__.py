"""Training on several GPUs (chapter 9): processes, communicators, data parallelism, ZeRO, the ring.

=================  ===============================================================================
module             what it holds
=================  ===============================================================================
``env``            rank / world size / local rank from torchrun, SLURM, Open MPI or MPICH variables
``comm``           one interface over NCCL (CuPy arrays) and MPI (NumPy arrays), and a one-rank one
``bootstrap``      the GPU of the local rank, NCCL's unique id (MPI broadcast or a TCP rendezvous),
                   the check that every rank runs the same configuration
``seam``           ``GradSync``: the training step's gradient seam, every member with its one-process
                   default (``LocalGradSync``); the two below are its data-parallel subclasses
``ddp``            gradient buckets reduced during the backward pass (ZeRO stage 0)
``zero``           ZeRO stages 1 and 2: sharded optimizer state (and gradients)
``ring``           the ring all-reduce written by hand, and its cost model
``launch``         ``llmgpu train --nproc N``
=================  ===============================================================================
"""

from .bootstrap import check_same, init_process_group, ranks_may_share_gpus, rendezvous, select_device
from .comm import DEFAULT_TIMEOUT, Communicator, LocalComm, MPIComm, NcclComm, mpi_module, nccl_module
from .ddp import BUCKET_BYTES, DataParallelSync, plan_buckets
from .env import DistEnv, DistError, from_environ
from .ring import RingAllReduce, ring_all_reduce, ring_allreduce_seconds, simulate_ring_allreduce
from .seam import GradSync, LocalGradSync
from .zero import ZeroSync

__all__ = ["BUCKET_BYTES", "DEFAULT_TIMEOUT", "Communicator", "DataParallelSync", "DistEnv", "DistError", "GradSync",
           "LocalComm", "LocalGradSync", "MPIComm", "NcclComm", "ZeroSync", "check_same", "from_environ",
           "init_process_group", "mpi_module", "RingAllReduce", "nccl_module", "plan_buckets", "rendezvous",
           "ranks_may_share_gpus", "ring_all_reduce", "ring_allreduce_seconds", "select_device", "simulate_ring_allreduce"]
