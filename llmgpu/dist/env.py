"""Who am I in a distributed run? Rank, world size and local rank from the launcher's environment.

One process per GPU (or per CPU rank). Every launcher announces the layout through environment
variables, each with its own names; this module reads them once, in a fixed order of precedence:

==============================  ================  =================  ==============================
launcher                        rank              world size         local rank (picks the GPU)
==============================  ================  =================  ==============================
torchrun / ``llmgpu --nproc``   ``RANK``          ``WORLD_SIZE``     ``LOCAL_RANK``
Open MPI ``mpirun``             ``OMPI_COMM_WORLD_RANK`` / ``_SIZE`` / ``_LOCAL_RANK``
SLURM ``srun``                  ``SLURM_PROCID``  ``SLURM_NTASKS``   ``SLURM_LOCALID``
MPICH / Hydra ``mpiexec``       ``PMI_RANK``      ``PMI_SIZE``       ``MPI_LOCALRANKID``
==============================  ================  =================  ==============================

A process that finds none of them is a run of one rank. ``MASTER_ADDR``/``MASTER_PORT`` (torchrun's
rendezvous point) are kept for the bootstrap (``dist/bootstrap.py``).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

# (launcher, rank, world size, local rank, local world size) variable names, in order of precedence
LAUNCHERS = (
    ("torchrun", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"),
    ("openmpi", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK",
     "OMPI_COMM_WORLD_LOCAL_SIZE"),
    ("slurm", "SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID", "SLURM_NTASKS_PER_NODE"),
    ("mpich", "PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS"),
)
MPI_LAUNCHERS = ("openmpi", "slurm", "mpich")  # launchers that start MPI processes


class DistError(RuntimeError):
    """A distributed run that cannot go on: a bad launch, a rank that did not arrive, a collective that timed
    out (printed by the CLI as one line, exit code 2)."""


@dataclass(frozen=True)
class DistEnv:
    """The process's place in the run. ``launcher``: 'single', 'torchrun', 'openmpi', 'slurm' or 'mpich'."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    local_world_size: int = 1
    launcher: str = "single"
    master_addr: str | None = None
    master_port: int | None = None

    @property
    def is_main(self) -> bool:
        """Rank 0: the one that prints, logs, plots and writes checkpoints."""
        return self.rank == 0

    @property
    def uses_mpi(self) -> bool:
        return self.launcher in MPI_LAUNCHERS


def _int(environ, name: str, launcher: str) -> int:
    raw = environ[name]
    try:
        return int(raw.split("(")[0])  # SLURM_NTASKS_PER_NODE may read '4(x2)'
    except ValueError:
        raise DistError(f"{name}={raw!r} (set by {launcher}) is not an integer") from None


def from_environ(environ=None) -> DistEnv:
    """The ``DistEnv`` the launcher's variables describe (a one-rank run when there are none)."""
    environ = os.environ if environ is None else environ
    for launcher, r, w, lr, lw in LAUNCHERS:
        if r not in environ or w not in environ:
            continue
        rank, world = _int(environ, r, launcher), _int(environ, w, launcher)
        local = _int(environ, lr, launcher) if lr in environ else rank
        local_world = _int(environ, lw, launcher) if lw in environ else world
        if world < 1 or not 0 <= rank < world:
            raise DistError(f"{launcher} says rank {rank} of world size {world}: the rank must be in [0, {world})")
        if not 0 <= local < max(local_world, 1):
            raise DistError(f"{launcher} says local rank {local} of {local_world} local ranks")
        port = environ.get("MASTER_PORT")
        if port is not None and not port.isdigit():
            raise DistError(f"MASTER_PORT={port!r} is not a port number")
        return DistEnv(rank, world, local, local_world, launcher, environ.get("MASTER_ADDR"),
                       int(port) if port else None)
    return DistEnv()


__all__ = ["LAUNCHERS", "DistEnv", "DistError", "from_environ"]
