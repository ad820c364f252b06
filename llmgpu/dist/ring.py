"""The ring all-reduce, written by hand (chapter 9): reduce-scatter, then all-gather, around a ring of ranks.

N ranks each hold a buffer; every rank must end with the elementwise sum. Cut each buffer into N
**segments**. Rank r talks to two neighbours only: it sends to r+1 and receives from r-1 (mod N).

* **Reduce-scatter**, N-1 steps. At step s rank r sends segment (r-s) mod N and receives segment
  (r-s-1) mod N, which it adds into its own copy. What a rank sends at step s+1 is what it just
  reduced at step s, so a segment gathers one more rank's contribution per step; after N-1 steps
  rank r holds the complete sum of segment (r+1) mod N.
* **All-gather**, N-1 steps. Each rank passes its complete segment on, and every received segment
  is copied, not added: at step s rank r sends segment (r+1-s) and receives segment (r-s).

Every rank sends 2(N-1) segments of n/N elements: 2(N-1)/N of the buffer, almost independent of N,
which is why the ring is *bandwidth optimal* (Patarasuk & Yuan, 2009); the price is 2(N-1) steps of
latency. ``ring_allreduce_seconds`` is that cost model; ``algbw``/``busbw`` are nccl-tests' rates.

The real thing (``RingAllReduce``) runs over ``comm.sendrecv`` (``dist/comm.py``: NCCL send/recv in one
group on GPUs, MPI on CPU ranks) and adds with our own kernel (``kernels/ring_reduce.cu``). Each segment
is cut into C **chunks** so that moving and adding overlap on a GPU; two streams, ordered by events::

    comm stream:     recv chunk 0 | recv chunk 1 | recv chunk 2 | ... (next step) wait red₀ | send+recv chunk 0 ...
    compute stream:      wait rcv₀ | add chunk 0 | wait rcv₁ | add chunk 1 | ...    rec red₀ ...

Chunk c of step s+1 sends what the add of chunk c at step s produced, and reuses chunk c's receive
buffer, so the comm stream waits for that add (event red_c) and for nothing else. On CPU ranks MPI's
calls block, so there the same schedule simply runs one chunk after another.

``simulate_ring_allreduce`` plays the same schedule (``ring_schedule``) on N NumPy buffers in one
process and records each step, for the book's drawings.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import numpy as np

from ..checks import FLOAT_DTYPES, GPU_DTYPES, array_module, check_array
from ..kernels import get_kernel
from ..kernels.launch import is_aligned, resident_grid

THREADS = 256
DEFAULT_CHUNKS = 4
GPU_ALIGN = 16  # elements: GPU chunk boundaries fall on multiples of 16 (16-byte aligned for every dtype)


# --------------------------------------------------------------------------- the schedule


@dataclass(frozen=True)
class RingStep:
    """One step of the ring: rank r sends segment ``send[r]`` to rank r+1 and receives segment ``recv[r]``
    from rank r-1; in the reduce-scatter phase (``reduce``) it adds what it received, else it copies it."""

    phase: str  # "reduce-scatter" or "all-gather"
    step: int  # 0 .. 2(N-1)-1 over both phases
    send: tuple
    recv: tuple

    @property
    def reduce(self) -> bool:
        return self.phase == "reduce-scatter"


def ring_schedule(n_ranks: int) -> list[RingStep]:
    """The 2(N-1) steps of a ring all-reduce over ``n_ranks`` ranks (none for one rank)."""
    N = int(n_ranks)
    if N < 1:
        raise ValueError(f"n_ranks must be >= 1, got {n_ranks}")
    steps = []
    for s in range(N - 1):
        steps.append(RingStep("reduce-scatter", s, tuple((r - s) % N for r in range(N)),
                              tuple((r - s - 1) % N for r in range(N))))
    for s in range(N - 1):
        steps.append(RingStep("all-gather", N - 1 + s, tuple((r + 1 - s) % N for r in range(N)),
                              tuple((r - s) % N for r in range(N))))
    return steps


def split_points(n: int, parts: int, align: int = 1) -> list[int]:
    """``parts + 1`` boundaries cutting ``range(n)`` into ``parts`` contiguous pieces of nearly equal size,
    every boundary but the last on a multiple of ``align``. A piece is empty only when n < parts·align."""
    units = -(-n // align)
    return [min(n, (i * units // parts) * align) for i in range(parts)] + [n]


@dataclass(frozen=True)
class RingLayout:
    """Where the segments and chunks of an ``n``-element buffer lie, for ``n_ranks`` ranks and ``chunks``
    chunks per segment (fewer when the buffer is too small to give every chunk an element)."""

    n: int
    n_ranks: int
    chunks: int
    align: int = 1
    segments: list = field(init=False)
    chunk_bounds: list = field(init=False)  # [segment][chunk] -> (lo, hi) in the buffer

    def __post_init__(self):
        units = -(-self.n // self.align)
        if units < self.n_ranks:
            raise ValueError(f"{self.n} elements cannot give each of {self.n_ranks} ranks a segment "
                             f"(pad the buffer to {self.n_ranks * self.align})")
        c = max(1, min(self.chunks, units // self.n_ranks))
        object.__setattr__(self, "chunks", c)
        seg = split_points(self.n, self.n_ranks, self.align)
        object.__setattr__(self, "segments", [(seg[k], seg[k + 1]) for k in range(self.n_ranks)])
        bounds = []
        for lo, hi in self.segments:
            cut = split_points(hi - lo, c, self.align)
            bounds.append([(lo + cut[j], lo + cut[j + 1]) for j in range(c)])
        object.__setattr__(self, "chunk_bounds", bounds)

    @property
    def max_chunk(self) -> int:
        return max(hi - lo for seg in self.chunk_bounds for lo, hi in seg)


# --------------------------------------------------------------------------- the reduction


def reduce_add(acc, incoming, *, stream=None):
    """``acc += incoming`` in place (same shape and dtype): one launch of ``ring_reduce_add`` on CuPy arrays
    (on ``stream``, default the current one), NumPy otherwise. 16-bit types are added in fp32 and rounded
    once, on both paths."""
    xp = array_module(acc=acc, incoming=incoming)
    if acc.size == 0 and incoming.size == 0:
        return acc
    check_array("acc", acc, dtypes=FLOAT_DTYPES)
    check_array("incoming", incoming, shape=acc.shape, dtype=acc.dtype, dtypes=None)
    if xp is np:
        if acc.dtype.itemsize == 2:
            acc[...] = (acc.astype(np.float32) + incoming.astype(np.float32)).astype(acc.dtype)
        else:
            acc += incoming
        return acc
    if acc.dtype not in GPU_DTYPES:
        raise TypeError(f"reduce_add on the GPU takes fp32, fp16 or bf16, got {acc.dtype}")
    n = acc.size
    kern = get_kernel("ring_reduce", "ring_reduce_add", acc.dtype)
    vec = int(is_aligned(16, acc, incoming))
    grid = resident_grid(kern, -(-n // (16 // acc.dtype.itemsize)), THREADS, xp)
    with stream if stream is not None else contextlib.nullcontext():
        kern((grid,), (THREADS,), (acc, incoming, np.int64(n), np.int32(vec)))
    return acc


# --------------------------------------------------------------------------- the simulation (one process)


@dataclass
class RingTrace:
    """What ``simulate_ring_allreduce`` did. ``result``: every rank's final buffer. ``steps``: the schedule.
    ``holds[k]``: after step k (``holds[0]``: before the first step), an N×N integer array whose entry
    [r, seg] is the bitmask of the ranks whose data rank r's copy of segment ``seg`` holds (all N bits:
    the complete sum). ``layout``: the segments and chunks; ``events``: one dict per chunk moved."""

    result: list
    steps: list
    holds: list
    layout: RingLayout
    events: list


def simulate_ring_allreduce(buffers, *, chunks: int = 1) -> RingTrace:
    """Run the ring all-reduce on N simulated ranks (``buffers``: N NumPy arrays of one shape and dtype;
    they are not modified) in one process, with the schedule and layout of the real ``RingAllReduce``."""
    bufs = [np.array(b, copy=True).reshape(-1) for b in buffers]
    N = len(bufs)
    if N == 0:
        raise ValueError("simulate_ring_allreduce needs at least one buffer")
    if len({(b.size, b.dtype) for b in bufs}) != 1:
        raise ValueError("every simulated rank must hold a buffer of the same size and dtype")
    shape = np.shape(buffers[0])
    n = bufs[0].size
    holds = np.array([[1 << r] * N for r in range(N)], dtype=np.int64)
    trace = RingTrace([], ring_schedule(N), [holds.copy()], None, [])
    if N == 1 or n == 0:
        trace.result = [b.reshape(shape) for b in bufs]
        return trace
    padded = n < N
    if padded:  # fewer elements than ranks: a zero tail gives every rank a segment
        bufs = [np.concatenate([b, np.zeros(N - n, b.dtype)]) for b in bufs]
    layout = trace.layout = RingLayout(bufs[0].size, N, chunks)
    for st in trace.steps:
        for c in range(layout.chunks):
            # every rank sends at once: take the outgoing chunks before anyone adds
            sent = [bufs[r][slice(*layout.chunk_bounds[st.send[r]][c])].copy() for r in range(N)]
            for r in range(N):
                left = (r - 1) % N
                lo, hi = layout.chunk_bounds[st.recv[r]][c]
                assert st.send[left] == st.recv[r]  # what the left neighbour sends is what r expects
                if st.reduce:
                    reduce_add(bufs[r][lo:hi], sent[left])
                else:
                    bufs[r][lo:hi] = sent[left]
                trace.events.append({"step": st.step, "phase": st.phase, "chunk": c, "rank": r, "from": left,
                                     "segment": st.recv[r], "lo": lo, "hi": hi, "reduce": st.reduce})
        h = trace.holds[-1].copy()
        for r in range(N):
            left = (r - 1) % N
            seg = st.recv[r]
            h[r, seg] = (h[r, seg] | trace.holds[-1][left, seg]) if st.reduce else trace.holds[-1][left, seg]
        trace.holds.append(h)
    trace.result = [b[:n].reshape(shape) for b in bufs]
    return trace


# --------------------------------------------------------------------------- the real thing


class RingAllReduce:
    """Our ring all-reduce over a communicator's point-to-point ``sendrecv``; ``ring(buf)`` sums ``buf`` over
    the ranks in place (any contiguous array: fp32/fp16/bf16 on GPUs, plus fp64 on CPU ranks) and returns it.

    ``chunks``: pieces per segment (GPU: the comm stream receives chunk c+1 while the compute stream, the
    caller's ``stream``, adds chunk c). Every rank must call it with the same size, dtype and ``chunks``.
    The receive buffer is kept between calls (one per dtype)."""

    def __init__(self, comm, chunks: int = DEFAULT_CHUNKS):
        if int(chunks) < 1:
            raise ValueError(f"chunks must be >= 1, got {chunks}")
        self.comm, self.chunks, self.xp = comm, int(chunks), comm.xp
        self.rank, self.world_size = comm.rank, comm.world_size
        self._gpu = self.xp is not np
        self._scratch: dict = {}
        if self._gpu and self.world_size > 1:
            cp = self.xp
            self.comm_stream = cp.cuda.Stream(non_blocking=True)
            ev = lambda: cp.cuda.Event(block=False, disable_timing=True)
            self._recv_ev = [ev() for _ in range(self.chunks)]
            self._red_ev = [ev() for _ in range(self.chunks)]
            self._start_ev, self._done_ev = ev(), ev()

    def __repr__(self):
        return f"RingAllReduce(rank {self.rank} of {self.world_size}, {self.chunks} chunks, {self.comm.backend})"

    def _work(self, n, dtype):
        w = self._scratch.get(dtype)
        if w is None or w.size < n:
            w = self._scratch[dtype] = self.xp.empty(n, dtype=dtype)
        return w

    def __call__(self, buf, *, stream=None):
        N = self.world_size
        if N == 1 or buf.size == 0:
            return buf
        if not buf.flags.c_contiguous:
            raise ValueError("the ring all-reduce takes a contiguous array")
        if self._gpu and buf.dtype not in GPU_DTYPES:
            raise TypeError(f"the ring all-reduce on GPUs takes fp32, fp16 or bf16, got {buf.dtype}")
        flat = buf.reshape(-1)
        align = GPU_ALIGN if self._gpu else 1
        if flat.size < N * align:  # too small for a segment per rank: run on a zero-padded copy
            on = stream if self._gpu and stream is not None else contextlib.nullcontext()
            with on:  # the copies go on the caller's stream, like the ring itself
                padded = self.xp.zeros(N * align, dtype=flat.dtype)
                padded[:flat.size] = flat
            self(padded, stream=stream)
            with on:
                flat[...] = padded[:flat.size]
            return buf
        layout = RingLayout(flat.size, N, self.chunks, align)
        work = self._work(layout.chunks * layout.max_chunk, flat.dtype)
        if self._gpu:
            self._run_gpu(flat, layout, work, stream)
        else:
            self._run_cpu(flat, layout, work)
        return buf

    def _incoming(self, work, layout, c, lo, hi):
        """Chunk c's receive buffer: its own region of ``work``, reused only by chunk c."""
        base = c * layout.max_chunk
        return work[base:base + hi - lo]

    def _run_cpu(self, flat, layout, work):
        r, N, comm = self.rank, self.world_size, self.comm
        right, left = (r + 1) % N, (r - 1) % N
        for st in ring_schedule(N):
            if not st.reduce:
                (s_lo, s_hi), (lo, hi) = layout.segments[st.send[r]], layout.segments[st.recv[r]]
                comm.sendrecv(flat[s_lo:s_hi], right, flat[lo:hi], left)
                continue
            for c in range(layout.chunks):
                s_lo, s_hi = layout.chunk_bounds[st.send[r]][c]
                lo, hi = layout.chunk_bounds[st.recv[r]][c]
                inc = self._incoming(work, layout, c, lo, hi)
                comm.sendrecv(flat[s_lo:s_hi], right, inc, left)
                reduce_add(flat[lo:hi], inc)

    def _run_gpu(self, flat, layout, work, stream):
        cp, comm = self.xp, self.comm
        r, N = self.rank, self.world_size
        right, left = (r + 1) % N, (r - 1) % N
        main = stream or cp.cuda.get_current_stream()
        side = self.comm_stream
        self._start_ev.record(main)  # the buffer's contents (and the last call's adds) are ready
        side.wait_event(self._start_ev)
        reduced = False  # whether the previous step recorded red_c events
        for st in ring_schedule(N):
            s_seg, r_seg = st.send[r], st.recv[r]
            if not st.reduce:
                if reduced:  # the first all-gather step sends what the last adds produced
                    for ev in self._red_ev[:layout.chunks]:
                        side.wait_event(ev)
                    reduced = False
                (s_lo, s_hi), (lo, hi) = layout.segments[s_seg], layout.segments[r_seg]
                comm.sendrecv(flat[s_lo:s_hi], right, flat[lo:hi], left, stream=side)  # one message per segment
                continue
            for c in range(layout.chunks):
                s_lo, s_hi = layout.chunk_bounds[s_seg][c]
                lo, hi = layout.chunk_bounds[r_seg][c]
                inc = self._incoming(work, layout, c, lo, hi)
                if reduced:  # chunk c to send was added at the last step, and its receive buffer is free
                    side.wait_event(self._red_ev[c])
                comm.sendrecv(flat[s_lo:s_hi], right, inc, left, stream=side)
                self._recv_ev[c].record(side)
                main.wait_event(self._recv_ev[c])
                reduce_add(flat[lo:hi], inc, stream=main)
                self._red_ev[c].record(main)
            reduced = True
        self._done_ev.record(side)
        main.wait_event(self._done_ev)


def ring_all_reduce(comm, buf, *, chunks: int = DEFAULT_CHUNKS, stream=None):
    """``buf`` summed over the ranks, in place, by our ring (a one-off ``RingAllReduce``)."""
    return RingAllReduce(comm, chunks)(buf, stream=stream)


# --------------------------------------------------------------------------- the cost model

# Rates as nccl-tests reports them (NVIDIA/nccl-tests, doc/PERFORMANCE.md): algorithm bandwidth
# algbw = S / t for a buffer of S bytes; bus bandwidth busbw = algbw · 2(N-1)/N for all-reduce (and
# · (N-1)/N for reduce-scatter and all-gather), the rate each link must sustain, which for a ring is
# comparable with the link's bandwidth whatever N is.
BUS_FACTORS = {"all_reduce": lambda N: 2 * (N - 1) / N, "reduce_scatter": lambda N: (N - 1) / N,
               "all_gather": lambda N: (N - 1) / N, "broadcast": lambda N: 1.0, "sendrecv": lambda N: 1.0}


def ring_allreduce_seconds(nbytes, n_ranks: int, link_bytes_per_s: float, latency_s: float = 0.0, *,
                           chunks: int = 1):
    """Predicted time of a ring all-reduce of ``nbytes`` over ``n_ranks`` ranks: each rank sends (and
    receives) 2(N-1)/N · nbytes over a link of ``link_bytes_per_s``, in 2(N-1) steps that each pay
    ``latency_s`` (times ``chunks``: every chunk is one more message). Works on arrays of sizes; 0 at N=1."""
    N = int(n_ranks)
    if N < 1:
        raise ValueError(f"n_ranks must be >= 1, got {n_ranks}")
    nbytes = np.asarray(nbytes, dtype=np.float64)
    if N == 1:
        return nbytes * 0.0
    return 2 * (N - 1) / N * nbytes / float(link_bytes_per_s) + 2 * (N - 1) * chunks * float(latency_s)


def algbw(nbytes, seconds):
    """Algorithm bandwidth, bytes per second: the buffer's size over the collective's time (nccl-tests)."""
    return np.asarray(nbytes, dtype=np.float64) / np.asarray(seconds, dtype=np.float64)


def busbw(nbytes, seconds, n_ranks: int, op: str = "all_reduce"):
    """Bus bandwidth, bytes per second: ``algbw`` times the collective's factor (2(N-1)/N for all-reduce)."""
    return algbw(nbytes, seconds) * BUS_FACTORS[op](int(n_ranks))


__all__ = ["BUS_FACTORS", "DEFAULT_CHUNKS", "RingAllReduce", "RingLayout", "RingStep", "RingTrace", "algbw", "busbw",
           "reduce_add", "ring_all_reduce", "ring_allreduce_seconds", "ring_schedule", "simulate_ring_allreduce",
           "split_points"]
