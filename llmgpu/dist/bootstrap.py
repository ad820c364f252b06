"""Starting a distributed run: pick the GPU, create the communicator, check that the ranks agree.

NCCL needs every rank to hold the same 128-byte unique id, created by rank 0, before the communicator
exists. Two ways to hand it out:

* **MPI** (launched by ``mpiexec``/``mpirun``/``srun``): a broadcast over ``MPI.COMM_WORLD`` (mpi4py).
* **A rendezvous** at ``MASTER_ADDR:MASTER_PORT`` otherwise (torchrun, ``llmgpu train --nproc``): rank 0
  listens on a TCP socket, each other rank connects, says its rank and receives the id. We use the standard
  library's sockets, not CuPy's ``cupyx.distributed`` TCP store (a private module whose interface may change)
  nor torch's store (a 2 GB dependency for 128 bytes); it carries only the id, never training data, and it
  has a deadline: rank 0 names the ranks that did not arrive, the others say whom they could not reach.

CPU ranks use MPI for everything (``MPIComm``), so they need an MPI launcher.
"""

from __future__ import annotations

import hashlib
import json
import os
import socket
import struct
import time

import numpy as np

from .. import backend
from .comm import DEFAULT_TIMEOUT, LocalComm, MPIComm, NcclComm, mpi_module, nccl_module
from .env import DistEnv, DistError, from_environ

MAGIC = b"llmgpu-rdzv1"


def init_process_group(xp=None, env: DistEnv | None = None, *, timeout: float = DEFAULT_TIMEOUT):
    """The communicator of this process: ``LocalComm`` for one rank, ``MPIComm`` for CPU ranks, ``NcclComm``
    for GPU ranks (after selecting the GPU of the local rank). ``xp``: the backend the run trains on."""
    env = env or from_environ()
    xp = xp if xp is not None else backend.default_xp()
    if env.world_size == 1:
        return LocalComm(xp)
    if xp is np:
        if not env.uses_mpi:
            raise DistError(f"{env.world_size} CPU ranks started by {env.launcher} have no MPI to talk through: start "
                            "them with mpiexec (llmgpu train --nproc N does)")
        comm = MPIComm(timeout=timeout)
        if comm.world_size != env.world_size:
            raise DistError(f"MPI has {comm.world_size} ranks but {env.launcher} announced {env.world_size}")
        return comm
    select_device(env)
    nccl = nccl_module()
    uid = nccl.get_unique_id() if env.rank == 0 else None
    if env.uses_mpi:
        uid = mpi_module().COMM_WORLD.bcast(uid, root=0)
    else:
        uid = rendezvous(env, uid, timeout=timeout)
    return NcclComm(uid, env.rank, env.world_size, timeout=timeout)


MULTI_RANK_NCCL = 23000  # NCCL 2.30.0: several ranks of one communicator may share a GPU (experimental)


def ranks_may_share_gpus() -> str | None:
    """None when several ranks may share one GPU, else why not. NCCL 2.30 allows it, experimentally, with
    ``NCCL_MULTI_RANK_GPU_ENABLE=1`` (about two ranks a GPU by default, ``NCCL_MAX_CTAS`` lowers each rank's
    channels; NVLink SHARP is off then): enough to run chapter 9's code paths for real on one GPU, never to
    measure scaling (the ranks share one GPU's SMs and memory bandwidth). Older NCCLs refuse a duplicate GPU."""
    if os.environ.get("NCCL_MULTI_RANK_GPU_ENABLE") != "1":
        return "NCCL_MULTI_RANK_GPU_ENABLE=1 is not set"
    version = nccl_module().get_version()
    if version < MULTI_RANK_NCCL:
        return (f"NCCL {version // 10000}.{version // 100 % 100}.{version % 100} refuses several ranks on one GPU "
                "(NCCL 2.30 or newer does: tools/recipes/nccl_multirank.sh builds it)")
    return None


def select_device(env: DistEnv) -> int:
    """Make the local rank's GPU current (``local_rank`` modulo the visible GPUs); returns its index. More local
    ranks than GPUs need ``ranks_may_share_gpus``."""
    cp = backend.require_gpu()
    n = cp.cuda.runtime.getDeviceCount()
    if env.local_world_size > n:
        why = ranks_may_share_gpus()
        if why:
            raise DistError(f"{env.local_world_size} ranks on this node but {n} visible GPU(s): one rank per GPU "
                            f"({why})")
    dev = env.local_rank % n
    cp.cuda.Device(dev).use()
    return dev


# --------------------------------------------------------------------------- the TCP rendezvous


def rendezvous(env: DistEnv, payload: bytes | None, *, timeout: float = DEFAULT_TIMEOUT) -> bytes:
    """Rank 0 serves ``payload`` at MASTER_ADDR:MASTER_PORT to the other ranks; every rank returns it."""
    if env.master_addr is None or env.master_port is None:
        raise DistError(f"rank {env.rank}: {env.world_size} GPU ranks without MPI need MASTER_ADDR and MASTER_PORT "
                        "(set by torchrun and llmgpu train --nproc), or start them with mpiexec")
    addr = (env.master_addr, env.master_port)
    deadline = time.monotonic() + timeout
    if env.rank == 0:
        return _serve(addr, payload, env.world_size, deadline, timeout)
    return _fetch(addr, env.rank, deadline, timeout)


def _serve(addr, payload, world, deadline, timeout):
    try:
        srv = socket.create_server(("", addr[1]), reuse_port=False)
    except OSError as e:
        raise DistError(f"rank 0 cannot listen on port {addr[1]} for the rendezvous: {e.strerror}") from None
    arrived = {0}
    with srv:
        while len(arrived) < world:
            left = deadline - time.monotonic()
            if left <= 0:
                missing = sorted(set(range(world)) - arrived)
                raise DistError(f"rank 0: rank(s) {missing} did not arrive at {addr[0]}:{addr[1]} within "
                                f"{timeout:.0f} s")
            srv.settimeout(min(left, 1.0))
            try:
                conn, _ = srv.accept()
            except TimeoutError:
                continue
            with conn:
                conn.settimeout(10.0)
                try:
                    head = _recv_exact(conn, len(MAGIC) + 4)
                except (OSError, ConnectionError):
                    continue
                if head[:len(MAGIC)] != MAGIC:
                    continue  # not one of ours
                rank = struct.unpack("!i", head[len(MAGIC):])[0]
                conn.sendall(struct.pack("!i", len(payload)) + payload)
                arrived.add(rank)
    return payload


def _fetch(addr, rank, deadline, timeout):
    last = None
    while time.monotonic() < deadline:
        try:
            with socket.create_connection(addr, timeout=5.0) as s:
                s.sendall(MAGIC + struct.pack("!i", rank))
                n = struct.unpack("!i", _recv_exact(s, 4))[0]
                return _recv_exact(s, n)
        except (OSError, ConnectionError) as e:
            last = e
            time.sleep(0.2)
    raise DistError(f"rank {rank}: could not reach rank 0 at {addr[0]}:{addr[1]} within {timeout:.0f} s ({last})")


def _recv_exact(s, n):
    buf = b""
    while len(buf) < n:
        chunk = s.recv(n - len(buf))
        if not chunk:
            raise ConnectionError("the peer closed the connection")
        buf += chunk
    return buf


# --------------------------------------------------------------------------- agreement


def check_same(comm, what: str, value) -> None:
    """Raise ``DistError`` on every rank unless all ranks hold the same ``value`` (any JSON-able object):
    a mismatched configuration is an error before the first step, not a silent divergence. For a dict the error
    names the keys that differ (a second gather, on the failure path only: every rank takes it together)."""
    if comm.world_size == 1:
        return
    rows = _gathered_digests(comm, [value])
    differ = [r for r in range(comm.world_size) if not np.array_equal(rows[r], rows[0])]
    if not differ:
        return
    keys = ""
    if isinstance(value, dict):
        names = sorted(value, key=str)
        same_names = _gathered_digests(comm, [[str(k) for k in names]])
        if all(np.array_equal(r, same_names[0]) for r in same_names):  # the per-key gather needs one size everywhere
            per_key = _gathered_digests(comm, [value[k] for k in names])
            odd = [str(k) for i, k in enumerate(names) if any(not np.array_equal(per_key[r, i], per_key[0, i])
                                                              for r in differ)]
            keys = f" ({', '.join(odd)})"
        else:
            keys = " (other fields)"
    raise DistError(f"rank(s) {differ} differ from rank 0 in their {what}{keys}: every rank must run the same "
                    "configuration on the same data")


def _gathered_digests(comm, values: list) -> np.ndarray:
    """[world, len(values), 32]: every rank's SHA-256 of each of its ``values`` (JSON), through one all-gather."""
    mine = np.frombuffer(b"".join(hashlib.sha256(json.dumps(v, sort_keys=True, default=str).encode()).digest()
                                  for v in values), dtype=np.uint8)
    xp = comm.xp
    got = xp.zeros(comm.world_size * mine.size, dtype=np.uint8)
    comm.all_gather(backend.to_device(mine.copy(), xp), got)
    return backend.to_numpy(got).reshape(comm.world_size, len(values), 32)


__all__ = ["MULTI_RANK_NCCL", "check_same", "init_process_group", "ranks_may_share_gpus", "rendezvous", "select_device"]
