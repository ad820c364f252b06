"""One small interface over the two engines that move data between ranks (chapter 9).

=================  ==========================  =====================================================
class              arrays                      engine
=================  ==========================  =====================================================
``NcclComm``       CuPy (one GPU per rank)     NCCL through ``cupy.cuda.nccl``: collectives are GPU
                                               kernels enqueued on a stream; nothing waits on the host
``MPIComm``        NumPy (CPU ranks)           MPI through ``mpi4py`` (non-blocking calls + a deadline)
``LocalComm``      either                      a run of one rank: every collective is the identity
=================  ==========================  =====================================================

The operations (all in place or into a given output, sums over ranks):

* ``all_reduce(buf)``: every rank ends with Σ_r buf_r.
* ``reduce_scatter(send, recv)``: ``send`` holds ``world`` equal pieces; rank r ends with Σ piece r.
* ``all_gather(send, recv)``: ``recv`` = the ranks' ``send`` pieces, in rank order.
* ``sendrecv(send, dst, recv, src)``: one point-to-point exchange (the ring all-reduce's step).
* ``broadcast(buf, root)``, ``barrier()``, ``abort()``.

Every call takes ``stream=`` (NCCL: the stream it is enqueued on; default the current stream) and
returns at once on NCCL; on MPI it waits, polling, at most ``timeout`` seconds, then raises
``DistError`` naming the operation (a rank died or hangs) instead of waiting forever. ``start_all_reduce``
is the non-blocking form the bucketed gradient reduction uses (``dist/ddp.py``).
"""

from __future__ import annotations

import sys
import time
import weakref

import numpy as np

from .. import backend
from .env import DistError

DEFAULT_TIMEOUT = 300.0  # seconds a rank waits for the others before giving up


class Communicator:
    """The interface (see the module docstring). ``rank``, ``world_size``, ``backend``, ``xp``."""

    backend = "?"

    def __init__(self, rank: int, world_size: int, xp, timeout: float = DEFAULT_TIMEOUT):
        self.rank, self.world_size, self.xp, self.timeout = int(rank), int(world_size), xp, float(timeout)

    def __repr__(self):
        return f"{type(self).__name__}(rank {self.rank} of {self.world_size})"

    @staticmethod
    def _check_pieces(send, recv, world, what):
        if send.size != world * recv.size:
            raise ValueError(f"{what}: the full buffer has {send.size} elements, not {world} x {recv.size}")
        if send.dtype != recv.dtype:
            raise TypeError(f"{what}: dtypes differ ({send.dtype} and {recv.dtype})")

    def start_all_reduce(self, buf, *, stream=None):
        """Begin ``all_reduce(buf)``; returns a handle whose ``wait()`` orders/finishes it."""
        self.all_reduce(buf, stream=stream)
        return _Done()


class _Done:
    def wait(self):
        pass


class LocalComm(Communicator):
    """World size 1: the collectives of one rank (copies where an output is separate)."""

    backend = "local"

    def __init__(self, xp=np):
        super().__init__(0, 1, xp)

    def all_reduce(self, buf, *, stream=None):
        return buf

    def reduce_scatter(self, send, recv, *, stream=None):
        self._check_pieces(send, recv, 1, "reduce_scatter")
        recv[...] = send.reshape(recv.shape)
        return recv

    def all_gather(self, send, recv, *, stream=None):
        self._check_pieces(recv, send, 1, "all_gather")
        recv[...] = send.reshape(recv.shape)
        return recv

    def sendrecv(self, send, dst, recv, src, *, stream=None):
        recv[...] = send
        return recv

    def broadcast(self, buf, root=0, *, stream=None):
        return buf

    def barrier(self):
        pass

    def abort(self, reason: str = ""):
        pass


# --------------------------------------------------------------------------- MPI (CPU ranks)


def mpi_module():
    """``mpi4py.MPI``, or a one-line error naming the extra that brings it."""
    try:
        from mpi4py import MPI
    except ImportError:
        raise DistError("training on several CPU ranks needs MPI: pip install 'llmgpu[dist]' (mpi4py and the "
                        "mpich wheel, which brings mpiexec)") from None
    return MPI


_LIVE_NCCL = weakref.WeakSet()  # this process's NCCL communicators (abort_run ends them)


def abort_run(code: int = 2) -> None:
    """After an error on one rank of a run of several: end the run now instead of leaving the other ranks waiting
    in a collective. This process's NCCL communicators are aborted (so it exits without waiting for its peers;
    the launcher, ``torchrun`` or ``llmgpu train --nproc``, stops the others when it exits), and an MPI run is
    stopped with MPI_Abort (every rank ends at once)."""
    for c in list(_LIVE_NCCL):
        c.abort()
    abort_mpi(code)


def abort_mpi(code: int = 2) -> None:
    """After an error on one rank of an MPI run: stop every rank now (MPI_Abort). Exiting normally would run
    MPI_Finalize, which can wait forever for a rank that hangs. Nothing outside a multi-rank MPI run."""
    MPI = sys.modules.get("mpi4py.MPI")
    if MPI is not None and MPI.Is_initialized() and not MPI.Is_finalized() and MPI.COMM_WORLD.Get_size() > 1:
        sys.stderr.flush()
        MPI.COMM_WORLD.Abort(code)


def _why_no_peer() -> str:
    """Why a collective did not complete: the ranks of this ``--nproc`` run that are stopped, where there are (a
    hung rank is otherwise not named under MPI: mpiexec kills it with the others), else the two possibilities."""
    from .launch import stopped_ranks

    stopped = stopped_ranks()
    if not stopped:
        return "another rank died or hangs"
    who = ", ".join(f"rank {r} (pid {pid})" for r, pid in stopped)
    return f"{who} {'is' if len(stopped) == 1 else 'are'} stopped (SIGSTOP or a debugger)"


class MPIComm(Communicator):
    """MPI collectives on NumPy arrays, each with a deadline (see the module docstring)."""

    backend = "mpi"

    def __init__(self, comm=None, timeout: float = DEFAULT_TIMEOUT):
        MPI = self.MPI = mpi_module()
        self.comm = comm or MPI.COMM_WORLD
        super().__init__(self.comm.Get_rank(), self.comm.Get_size(), np, timeout)

    def _wait(self, req, what: str):
        """Poll ``req`` until it completes or the deadline passes (MPI's Wait would block forever)."""
        deadline = time.monotonic() + self.timeout
        spins = 0
        while not req.Test():
            if time.monotonic() > deadline:
                raise DistError(f"rank {self.rank}: {what} did not complete within {self.timeout:.0f} s: "
                                + _why_no_peer())
            spins += 1
            if spins > 100:
                time.sleep(0.0005)

    @staticmethod
    def _buf(a):
        if not (isinstance(a, np.ndarray) and a.flags.c_contiguous):
            raise TypeError(f"MPI collectives take contiguous NumPy arrays, got {type(a).__name__}")
        return a

    def _msg(self, a):
        """(buffer, MPI datatype): fp32/fp64/int32 natively; other dtypes (bf16) as raw bytes (no reduction)."""
        MPI = self.MPI
        types = {np.dtype(np.float32): MPI.FLOAT, np.dtype(np.float64): MPI.DOUBLE, np.dtype(np.int32): MPI.INT}
        a = self._buf(a)
        if a.dtype in types:
            return [a, types[a.dtype]]
        return [a.view(np.uint8), MPI.BYTE]

    def _summable(self, a, what):
        """A reduction's (buffer, MPI datatype); MPI has no sum of raw bytes, so other dtypes are a TypeError."""
        msg = self._msg(a)
        if msg[1] is self.MPI.BYTE:
            raise TypeError(f"{what} over MPI sums float32, float64 and int32 buffers, got {a.dtype}: reduce a "
                            "float32 copy (NCCL sums bf16 and fp16 itself)")
        return msg

    def start_all_reduce(self, buf, *, stream=None):
        msg = self._summable(buf, "all_reduce")
        if self.world_size == 1:
            return _Done()
        req = self.comm.Iallreduce(self.MPI.IN_PLACE, msg, op=self.MPI.SUM)
        return _MPIWork(self, req, "all_reduce")

    def all_reduce(self, buf, *, stream=None):
        self.start_all_reduce(buf).wait()
        return buf

    def reduce_scatter(self, send, recv, *, stream=None):
        self._check_pieces(send, recv, self.world_size, "reduce_scatter")
        req = self.comm.Ireduce_scatter_block(self._summable(send, "reduce_scatter"), self._msg(recv),
                                              op=self.MPI.SUM)
        self._wait(req, "reduce_scatter")
        return recv

    def all_gather(self, send, recv, *, stream=None):
        self._check_pieces(recv, send, self.world_size, "all_gather")
        req = self.comm.Iallgather(self._msg(np.ascontiguousarray(send)), self._msg(recv))
        self._wait(req, "all_gather")
        return recv

    def sendrecv(self, send, dst, recv, src, *, stream=None):
        reqs = [self.comm.Irecv(self._msg(recv), source=src, tag=7),
                self.comm.Isend(self._msg(np.ascontiguousarray(send)), dest=dst, tag=7)]
        for r in reqs:
            self._wait(r, f"sendrecv with ranks {dst}/{src}")
        return recv

    def broadcast(self, buf, root=0, *, stream=None):
        self._wait(self.comm.Ibcast(self._msg(buf), root=root), "broadcast")
        return buf

    def barrier(self):
        self._wait(self.comm.Ibarrier(), "barrier")

    def abort(self, reason: str = ""):
        self.comm.Abort(1)


class _MPIWork:
    def __init__(self, comm, req, what):
        self.comm, self.req, self.what = comm, req, what

    def wait(self):
        self.comm._wait(self.req, self.what)


# --------------------------------------------------------------------------- NCCL (one GPU per rank)


def nccl_module():
    """``cupy.cuda.nccl`` when NCCL is loadable, else a one-line error."""
    cp = backend.require_gpu()
    from cupy.cuda import nccl

    if not nccl.available:
        raise DistError(f"CuPy {cp.__version__} finds no NCCL library: pip install nvidia-nccl-cu13 (or -cu12, "
                        "as your CUDA) to train on several GPUs")
    return nccl


class NcclComm(Communicator):
    """NCCL collectives on CuPy arrays, enqueued on ``stream`` (default: the current stream).

    ``unique_id``: the 128-byte id rank 0 created (``nccl.get_unique_id()``) and the bootstrap handed to
    every rank. Create the communicator before any CUDA-graph capture; the collectives themselves capture.
    """

    backend = "nccl"

    def __init__(self, unique_id: bytes, rank: int, world_size: int, timeout: float = DEFAULT_TIMEOUT):
        self.nccl = nccl_module()
        cp = backend.require_gpu()
        super().__init__(rank, world_size, cp, timeout)
        self.comm = self.nccl.NcclCommunicator(world_size, unique_id, rank)
        _LIVE_NCCL.add(self)
        n = self.nccl
        self._types = {np.dtype(np.float32): n.NCCL_FLOAT32, np.dtype(np.float16): n.NCCL_FLOAT16,
                       np.dtype(backend.bfloat16): n.NCCL_BFLOAT16, np.dtype(np.float64): n.NCCL_FLOAT64,
                       np.dtype(np.int32): n.NCCL_INT32, np.dtype(np.uint8): n.NCCL_UINT8}

    def _stream(self, stream):
        return (stream or self.xp.cuda.get_current_stream()).ptr

    def _type(self, a):
        if not a.flags.c_contiguous:
            raise ValueError("NCCL takes contiguous arrays")
        try:
            return self._types[a.dtype]
        except KeyError:
            raise TypeError(f"NCCL: no datatype for {a.dtype}") from None

    def all_reduce(self, buf, *, stream=None):
        self.comm.allReduce(buf.data.ptr, buf.data.ptr, buf.size, self._type(buf), self.nccl.NCCL_SUM,
                            self._stream(stream))
        return buf

    def reduce_scatter(self, send, recv, *, stream=None):
        self._check_pieces(send, recv, self.world_size, "reduce_scatter")
        self.comm.reduceScatter(send.data.ptr, recv.data.ptr, recv.size, self._type(send), self.nccl.NCCL_SUM,
                                self._stream(stream))
        return recv

    def all_gather(self, send, recv, *, stream=None):
        self._check_pieces(recv, send, self.world_size, "all_gather")
        self.comm.allGather(send.data.ptr, recv.data.ptr, send.size, self._type(send), self._stream(stream))
        return recv

    def sendrecv(self, send, dst, recv, src, *, stream=None):
        s = self._stream(stream)
        self.nccl.groupStart()  # both halves of the exchange in one group: neither blocks the other
        self.comm.send(send.data.ptr, send.size, self._type(send), dst, s)
        self.comm.recv(recv.data.ptr, recv.size, self._type(recv), src, s)
        self.nccl.groupEnd()
        return recv

    def broadcast(self, buf, root=0, *, stream=None):
        self.comm.broadcast(buf.data.ptr, buf.data.ptr, buf.size, self._type(buf), root, self._stream(stream))
        return buf

    def barrier(self):
        one = self.xp.ones(1, dtype=np.float32)
        self.all_reduce(one)
        self.wait_device()

    def wait_device(self, stream=None, what: str = "the GPU"):
        """Wait for ``stream``'s work, collectives included, at most ``timeout`` seconds; NCCL errors and
        time-outs abort the communicator and raise ``DistError`` (a hung collective never returns by itself)."""
        cp = self.xp
        ev = cp.cuda.Event(block=False, disable_timing=True)
        ev.record(stream or cp.cuda.get_current_stream())
        deadline = time.monotonic() + self.timeout
        while not ev.done:
            try:
                self.comm.check_async_error()
            except Exception as e:
                self.abort()
                raise DistError(f"rank {self.rank}: NCCL reported an error while waiting for {what}: {e}") from None
            if time.monotonic() > deadline:
                self.abort()
                raise DistError(f"rank {self.rank}: waited {self.timeout:.0f} s for {what}: " + _why_no_peer())
            time.sleep(0.0002)

    def abort(self, reason: str = ""):
        try:
            self.comm.abort()
        except Exception:  # already torn down
            pass


__all__ = ["DEFAULT_TIMEOUT", "Communicator", "LocalComm", "MPIComm", "NcclComm", "abort_mpi", "abort_run", "mpi_module",
           "nccl_module"]
