"""The trainer's side of data-parallel training (chapter 9): the communicator, the gradient seam, agreement.

Every rank runs the same ``Trainer.run`` loop on its own slice of every batch; the differences are here:
``connect`` makes the communicator ``--dist-backend`` asks for, ``gradient_seam`` the ``TrainStep`` seam
(``dist.DataParallelSync`` for ``--zero 0``, ``dist.ZeroSync`` for 1 and 2), and ``agree`` hands rank 0's
decisions that depend on its clock (the schedule fitted to ``--max-time``, stopping) to every rank, so the
ranks never disagree about how many collectives there will be. Only rank 0 prints and writes files.
"""

from __future__ import annotations

import signal

import numpy as np

from .. import backend
from ..dist import DataParallelSync, LocalComm, LocalGradSync, ZeroSync, check_same, from_environ, init_process_group
from ..dist.comm import MPIComm, NcclComm
from ..dist.env import DistEnv
from ..dist.launch import register_rank
from .config import ConfigError, TrainConfig


def connect(cfg: TrainConfig, xp):
    """The communicator of this process for ``cfg.dist_backend`` (see ``TrainConfig``)."""
    env = from_environ()
    register_rank(env.rank)  # for the --nproc launcher's error line (nothing outside such a run)
    refuse_nested_launch(cfg.nproc, env)
    refuse_unlaunched_nproc(cfg.nproc)
    if cfg.dist_backend == "nccl" and xp is np:
        raise ConfigError("--dist-backend nccl needs the GPU (NCCL moves CuPy arrays); CPU ranks use mpi")
    if cfg.dist_backend == "mpi" and xp is not np:
        raise ConfigError("--dist-backend mpi is the CPU ranks' engine; GPU ranks use nccl")
    if env.world_size == 1 and cfg.dist_backend != "auto":  # the distributed code path at world size 1
        if cfg.dist_backend == "mpi":
            return MPIComm(timeout=cfg.dist_timeout)
        from ..dist import nccl_module

        return NcclComm(nccl_module().get_unique_id(), 0, 1, timeout=cfg.dist_timeout)
    return init_process_group(xp, env, timeout=cfg.dist_timeout)


def refuse_nested_launch(nproc: int, env: DistEnv):
    """``--nproc N`` starts ranks; inside ranks a launcher already started it would start them again."""
    if nproc > 1 and env.world_size > 1:
        raise ConfigError(f"--nproc {nproc} inside a run a launcher already started ({env.launcher}, "
                          f"{env.world_size} ranks): give one or the other")


def refuse_unlaunched_nproc(nproc: int):
    """A ``Trainer`` does not start processes: ``nproc`` > 1 reaching it was not launched (the command line's
    ``--nproc`` starts the ranks, each with ``nproc`` 1)."""
    if nproc > 1:
        raise ConfigError(f"nproc={nproc}: a Trainer runs as one rank; start {nproc} ranks with llmgpu train --nproc "
                          f"{nproc}, torchrun, mpiexec or srun")


def distributed(comm) -> bool:
    """Whether the step goes through a collective engine (any world size), not the one-process seam."""
    return not isinstance(comm, LocalComm)


def gradient_seam(comm, cfg: TrainConfig, params):
    """The ``TrainStep`` seam of this run over the model's ``params`` (holding the weights to start from):
    ``LocalGradSync`` for one process, ``DataParallelSync`` for ``--zero 0``, ``ZeroSync`` for 1 and 2."""
    if cfg.zero:
        return ZeroSync(comm, params, stage=cfg.zero)
    if distributed(comm):
        return DataParallelSync(comm, params)
    return LocalGradSync(params)


def check_agreement(comm, cfg: TrainConfig, model_config: dict, step: int, corpus):
    """Every rank runs the same configuration from the same step on the same data (``corpus``'s ``fingerprint``,
    read only with several ranks); a ``DistError`` naming the odd ranks and what differs."""
    if comm.world_size == 1:
        return
    mine = {k: v for k, v in cfg.as_dict().items() if k not in ("out", "progress")}  # rank 0 alone writes
    check_same(comm, "training configuration", mine)
    check_same(comm, "model", model_config)
    check_same(comm, "starting step", step)
    check_same(comm, "data (token counts or tokens)", corpus.fingerprint())


def agree(comm, total_steps: int | None, time_up: bool, signum: int | None = None):
    """At a log sync: rank 0's schedule length and time-up decision, and the signal any rank was asked to stop by
    (``stop.StopRequests``; SIGTERM over SIGINT), the same on every rank (one tiny all-reduce). Returns
    ``(total_steps, time_up, signum)``."""
    if comm.world_size == 1:
        return total_steps, time_up, signum
    main = comm.rank == 0
    mine = [(0 if total_steps is None else total_steps + 1) if main else 0, int(time_up) if main else 0,
            int(signum == signal.SIGINT), int(signum == signal.SIGTERM)]
    buf = backend.to_device(np.array(mine, np.int32), comm.xp)
    comm.all_reduce(buf)
    if comm.xp is not np:
        comm.wait_device(what="the other ranks' schedule")
    t, up, sigint, sigterm = (int(x) for x in backend.to_numpy(buf))
    sig = signal.SIGTERM if sigterm else signal.SIGINT if sigint else None
    return (None if t == 0 else t - 1), bool(up), sig


def wait_for_ranks(comm, what: str):
    """Before a host read of device results: a GPU wait with the communicator's deadline (a hung collective
    never returns by itself); nothing on the CPU, where every MPI call has its own deadline."""
    if isinstance(comm, NcclComm):
        comm.wait_device(what=what)


__all__ = ["DistEnv", "agree", "check_agreement", "connect", "distributed", "gradient_seam", "refuse_nested_launch",
           "wait_for_ranks"]
