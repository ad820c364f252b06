"""Capture a sequence of GPU work into one CUDA graph with CuPy, and replay it (chapter 8).

A training step of GPT-2 small launches hundreds of kernels. Launched one by one from Python each
costs several microseconds of host time (chapter 8 measures about 6.6 µs per RawKernel launch on the
H200), and when the kernels are short the GPU waits for the host. A **CUDA graph** records the
launches once (stream capture) and replays the whole recording with a single call (1.0 µs per
kernel on the same machine): the host cost of the step shrinks to one launch.

What capture demands of the captured code (``fn``):

* **Static buffers.** A replay reruns the recorded kernels with the recorded pointers. Inputs must be
  written into the same arrays before each replay (``x[...] = batch``), and outputs are read from the
  arrays ``fn`` wrote during capture (``CapturedGraph.outputs``, rewritten by every replay).
* **No host synchronisation.** ``.item()``, ``float(x)``, ``cupy.asnumpy``, printing a device value or
  anything else that waits for the GPU fails while a stream is capturing.
* **No CuPy cuBLAS.** CuPy refuses its own cuBLAS calls on a capturing stream (``cupy.matmul``,
  ``a @ b``, ``llmgpu.gemm.gemm`` raise ``NotImplementedError``). Route the GEMMs of captured code
  through ``llmgpu.gemm.cublaslt.lt_gemm`` (cuBLASLt via nvmath-python), which captures.
* **Warm-up first.** Compiling a kernel, building a cuBLASLt plan or a cuDNN graph, allocating a
  workspace: all of that happens on the first call and must not happen under capture. ``capture``
  runs ``fn`` ``warmup`` times on the capture stream before recording.

Memory allocated by ``fn`` while capturing comes from a **private memory pool** owned by the
graph (as PyTorch does): blocks that ``fn`` frees during capture may be reused later in the same
capture, exactly as in the eager run, but never by anything outside the graph, since the replays keep
writing to them. The pool lives as long as the ``CapturedGraph``.
"""

from __future__ import annotations

import contextlib
import re

from .. import backend

CAPTURE_HINT = (
    "CuPy refuses its own cuBLAS calls (cupy.matmul, a @ b, llmgpu.gemm.gemm) while a stream is capturing: "
    "route the GEMMs of captured code through llmgpu.gemm.cublaslt.lt_gemm (cuBLASLt, pip install 'llmgpu[fast]'); "
    "also keep host synchronisation (.item(), float(x), cupy.asnumpy, printing device values) and first-time "
    "work (kernel compilation, plan building: run a warm-up) out of the captured code"
)


class GraphCaptureError(RuntimeError):
    """Stream capture of a callable failed; the message says why and what to change."""


class CapturedGraph:
    """A callable recorded once into a CUDA graph.

    ``replay(stream=None)`` (or calling the object) launches the whole recording on ``stream``
    (default: CuPy's current stream, so it is ordered after the copies that refreshed the inputs).
    ``outputs`` is what ``fn`` returned during capture: arrays that every replay rewrites.
    """

    def __init__(self, graph, outputs, stream, pool):
        self.graph = graph
        self.outputs = outputs
        self.stream = stream
        self.pool = pool  # private memory pool backing allocations made during capture
        self._counts = None

    def replay(self, stream=None):
        cp = backend.require_gpu()
        self.graph.launch(stream if stream is not None else cp.cuda.get_current_stream())
        return self.outputs

    __call__ = replay

    def upload(self, stream=None):
        """Upload the executable graph ahead of the first replay (keeps that cost out of timings)."""
        cp = backend.require_gpu()
        self.graph.upload(stream if stream is not None else cp.cuda.get_current_stream())

    def node_counts(self) -> dict:
        """Nodes of the graph by type, e.g. ``{'kernel': 412, 'memset': 3}`` (see ``graph_node_counts``)."""
        if self._counts is None:
            self._counts = graph_node_counts(self.graph)
        return dict(self._counts)

    def kernel_count(self) -> int:
        return self.node_counts().get("kernel", 0)

    def __repr__(self):
        return f"CapturedGraph(stream=0x{self.stream.ptr:x}, outputs={type(self.outputs).__name__})"


def capture(fn, *, warmup: int = 1, stream=None, private_pool: bool = True) -> CapturedGraph:
    """Record ``fn()`` into a CUDA graph on a non-default stream; returns a ``CapturedGraph``.

    ``warmup``: calls of ``fn`` on the capture stream before recording (compilation, plans,
    workspaces). ``stream``: the capture stream (default: a new non-blocking one). ``private_pool``:
    serve allocations made during capture from a pool owned by the graph (recommended; see the
    module docstring). The device is synchronised once before capture, so the recording sees all
    previously queued work completed.
    """
    cp = backend.require_gpu()
    if warmup < 0:
        raise ValueError(f"warmup must be >= 0, got {warmup}")
    s = stream if stream is not None else cp.cuda.Stream(non_blocking=True)
    if s.ptr == 0:
        raise ValueError("capture needs a non-default stream (the legacy default stream cannot capture)")
    cp.cuda.Device().synchronize()
    with s:
        for _ in range(warmup):
            try:
                fn()
            except Exception as e:
                raise GraphCaptureError(f"the warm-up call (outside capture) raised {type(e).__name__}: {e}") from e
    s.synchronize()
    pool = cp.cuda.MemoryPool() if private_pool else None
    alloc = cp.cuda.using_allocator(pool.malloc) if pool is not None else contextlib.nullcontext()
    outputs, inner, graph = None, None, None
    with s, alloc:
        s.begin_capture()
        try:
            outputs = fn()
        except BaseException as e:  # noqa: BLE001 - end the capture whatever happened, then report
            inner = e
        finally:
            try:
                graph = s.end_capture()
            except Exception as e2:
                if inner is None:
                    raise GraphCaptureError(f"ending the stream capture failed ({type(e2).__name__}: {e2}); "
                                            f"{CAPTURE_HINT}") from e2
    if inner is not None:
        if isinstance(inner, KeyboardInterrupt):
            raise inner
        raise GraphCaptureError(f"the captured callable raised {type(inner).__name__}: {inner}; {CAPTURE_HINT}") \
            from inner
    return CapturedGraph(graph, outputs, s, pool)


# --------------------------------------------------------------------------- inspecting a graph

_DOT_TYPES = ("KERNEL", "MEMSET", "MEMCPY", "HOST", "GRAPH", "EMPTY", "WAIT_EVENT", "EVENT_RECORD", "MEM_ALLOC",
              "MEM_FREE", "CONDITIONAL", "EXT_SEMAS_SIGNAL", "EXT_SEMAS_WAIT", "BATCH_MEM_OP")


def graph_node_counts(graph) -> dict:
    """Nodes of a ``cupy.cuda.Graph`` by type (``'kernel'``, ``'memset'``, ``'memcpy'``, ...).

    Uses ``cuda.bindings`` (cudaGraphGetNodes + cudaGraphNodeGetType) when importable; otherwise counts
    the node labels of ``graph.debug_dot_str()`` and adds ``'source': 'dot'`` (approximate).
    """
    try:
        from cuda.bindings import runtime as rt

        g = rt.cudaGraph_t(int(graph.graph))
        err, _, n = rt.cudaGraphGetNodes(g, 0)
        if int(err) != 0:
            raise RuntimeError(f"cudaGraphGetNodes: {err}")
        err, nodes, n = rt.cudaGraphGetNodes(g, n)
        if int(err) != 0:
            raise RuntimeError(f"cudaGraphGetNodes: {err}")
        counts: dict = {}
        for node in nodes[:n]:
            err, t = rt.cudaGraphNodeGetType(node)
            if int(err) != 0:
                raise RuntimeError(f"cudaGraphNodeGetType: {err}")
            name = t.name.replace("cudaGraphNodeType", "")
            name = re.sub(r"(?<!^)(?=[A-Z])", "_", name).lower()  # 'Kernel' -> 'kernel', 'MemAlloc' -> 'mem_alloc'
            counts[name] = counts.get(name, 0) + 1
        return counts
    except Exception:
        pass
    text = graph.debug_dot_str()
    counts = {}
    for label in re.findall(r'label="\{?\s*([A-Z_]+)', text):
        if label in _DOT_TYPES:
            key = label.lower()
            counts[key] = counts.get(key, 0) + 1
    counts["source"] = "dot"
    return counts


__all__ = ["CAPTURE_HINT", "CapturedGraph", "GraphCaptureError", "capture", "graph_node_counts"]
