"""Chapter 9 benchmark: our ring all-reduce (llmgpu.dist.ring) against NCCL's own all-reduce, 4 KiB to 1 GiB.

For each message size (powers of 4) and dtype: the median over ``--reps`` timed calls (CUDA events on the
GPU, the host clock on CPU ranks; the slowest rank's median), algorithm bandwidth (bytes / time) and bus
bandwidth (algbw · 2(N-1)/N, nccl-tests' definitions), and the cost model's prediction
(``ring_allreduce_seconds`` with ``--link-GBps`` and ``--latency-us``). Before timing a size, the ring's
result is checked against the engine's all-reduce (exactly, on small integers); a mismatch exits 1.

At world size 1 the ring degenerates (nothing to send) and NCCL's all-reduce is a copy, so a single GPU
times NCCL's one-rank all-reduce and our ring's building block, the reduction kernel ``acc += incoming``
(bandwidth counted as 3 bytes per byte of message: two reads, one write). Ranks come from the launcher:

    python benchmarks/bench_ch9_allreduce.py                        # one GPU: world size 1, < 1 minute
    torchrun --nproc_per_node 8 benchmarks/bench_ch9_allreduce.py   # 8 GPUs (also mpiexec -n 8, srun)
    python benchmarks/bench_ch9_allreduce.py --nproc 4              # starts 4 local ranks itself
    mpiexec -n 2 python benchmarks/bench_ch9_allreduce.py --device cpu --max-bytes 1MiB   # CPU ranks (MPI)

Writes benchmarks/results/ch9/ch9_allreduce.json (world size 1) or ch9_allreduce_<N>gpu.json, with a PNG of the
bandwidth curves next to it, on GPUs; on CPU ranks only with ``--out``.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time

import _common
import numpy as np

from llmgpu import backend
from llmgpu.dist import NcclComm, from_environ, init_process_group, nccl_module
from llmgpu.dist.launch import find_mpiexec, free_port, strip_nproc
from llmgpu.dist.ring import RingAllReduce, busbw, reduce_add, ring_allreduce_seconds
from llmgpu.perf import timing

UNITS = {"": 1, "b": 1, "kib": 2**10, "kb": 2**10, "k": 2**10, "mib": 2**20, "mb": 2**20, "m": 2**20,
         "gib": 2**30, "gb": 2**30, "g": 2**30}


def parse_bytes(text: str) -> int:
    """'4KiB', '1MiB', '1GiB', '4096' -> bytes (powers of 1024)."""
    t = text.strip().lower()
    num = t.rstrip("kmgib")
    try:
        return int(float(num) * UNITS[t[len(num):]])
    except (KeyError, ValueError):
        raise SystemExit(f"bench_ch9_allreduce: cannot read a size from {text!r} (e.g. 4KiB, 1MiB, 1GiB)") from None


def sizes(lo: int, hi: int, factor: int) -> list[int]:
    out, s = [], lo
    while s <= hi:
        out.append(s)
        s *= factor
    return out


def spawn(nproc: int, argv: list[str], gpu: bool) -> int:
    """``--nproc N``: this script as N local ranks (torchrun's variables on GPUs, ``mpiexec`` on CPUs)."""
    cmd = [sys.executable, os.path.abspath(__file__), *strip_nproc(argv)]
    if not gpu:
        return subprocess.call([find_mpiexec(), "-n", str(nproc), *cmd])
    port = free_port()
    procs = [subprocess.Popen(cmd, env=dict(os.environ, RANK=str(r), WORLD_SIZE=str(nproc), LOCAL_RANK=str(r),
                                            LOCAL_WORLD_SIZE=str(nproc), MASTER_ADDR="127.0.0.1",
                                            MASTER_PORT=str(port))) for r in range(nproc)]
    while True:
        codes = [p.poll() for p in procs]
        if any(c not in (None, 0) for c in codes):  # one rank failed: the others would wait for it forever
            for p in procs:
                if p.poll() is None:
                    p.kill()
            return next(c for c in codes if c not in (None, 0))
        if all(c == 0 for c in codes):
            return 0
        time.sleep(0.2)


def _num(x, digits: int = 2) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def time_op(fn, xp, reps: int, warmup: int) -> float:
    """Median ms of ``fn()``: CUDA events on the current stream (GPU), the host clock (CPU, ``fn`` blocks); calls
    launched one after another, as a training step launches its all-reduce (``host_ahead=False``)."""
    return timing.time_fn(fn, xp=xp, warmup=warmup, reps=reps, host_ahead=False).median_ms


def slowest(comm, ms: float) -> float:
    """The largest of the ranks' medians (every rank waits for the slowest one)."""
    mine = backend.to_device(np.array([ms], dtype=np.float32), comm.xp)
    every = comm.xp.zeros(comm.world_size, dtype=np.float32)
    comm.all_gather(mine, every)
    return float(backend.to_numpy(every).max())


def environment(xp) -> dict:
    info = {"cupy": None, "nccl": None, "gpus": 0, "topology": None}
    if xp is not np:
        from cupy.cuda import nccl

        info.update(cupy=xp.__version__, nccl=nccl.get_version() if nccl.available else None,
                    gpus=xp.cuda.runtime.getDeviceCount())
        if shutil.which("nvidia-smi"):
            r = subprocess.run(["nvidia-smi", "topo", "-m"], capture_output=True, text=True, timeout=30)
            info["topology"] = r.stdout if r.returncode == 0 else r.stderr
    try:
        from mpi4py import MPI

        info["mpi"] = MPI.Get_library_version().splitlines()[0]
    except ImportError:
        info["mpi"] = None
    return info


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    ap = _common.parser(__doc__, reps=None, no_torch=False)
    ap.add_argument("--device", choices=("auto", "cpu", "gpu"), default="auto")
    ap.add_argument("--nproc", type=int, default=1, help="start N local ranks of this script and wait for them")
    ap.add_argument("--min-bytes", default="4KiB")
    ap.add_argument("--max-bytes", default=None, help="largest message (default 1GiB on GPUs, 1MiB on CPUs)")
    ap.add_argument("--factor", type=int, default=4, help="ratio of consecutive sizes (default 4)")
    ap.add_argument("--dtypes", default="fp32,bf16", help="NCCL's all-reduce in these dtypes (default fp32,bf16)")
    ap.add_argument("--ring-dtypes", default="fp32", help="our ring in these dtypes (default fp32)")
    ap.add_argument("--chunks", type=int, default=4, help="chunks per segment of our ring (default 4)")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--link-GBps", type=float, default=None, help="the cost model's link bandwidth (default: "
                    "450 GB/s on GPUs, one direction of H100/H200 NVLink 4; 5 GB/s on CPU ranks)")
    ap.add_argument("--latency-us", type=float, default=None, help="the cost model's latency per step "
                    "(default 5 us on GPUs, 20 us on CPU ranks)")
    args = ap.parse_args(argv)
    xp = backend.select_xp(args.device)
    gpu = xp is not np
    if args.nproc > 1:
        if from_environ().world_size > 1:
            raise SystemExit("bench_ch9_allreduce: --nproc inside a launched run: give one or the other")
        return spawn(args.nproc, argv, gpu)
    comm = init_process_group(xp, timeout=120)
    if gpu and comm.world_size == 1:  # one GPU still goes through NCCL (init_process_group would give LocalComm)
        nccl = nccl_module()
        comm = NcclComm(nccl.get_unique_id(), 0, 1, timeout=120)
    N, main_rank = comm.world_size, comm.rank == 0
    say = print if main_rank else (lambda *a, **k: None)
    say(f"device: {backend.device_info(xp).summary()}; {N} rank(s), {comm.backend}")
    reps = args.reps or (20 if gpu else 5)
    link = (args.link_GBps or (450.0 if gpu else 5.0)) * 1e9
    lat = (args.latency_us if args.latency_us is not None else (5.0 if gpu else 20.0)) * 1e-6
    hi = parse_bytes(args.max_bytes or ("16MiB" if args.quick else "1GiB" if gpu else "1MiB"))
    ring = RingAllReduce(comm, args.chunks)
    rows, ok = [], True
    dtypes = list(dict.fromkeys(_common.names(args.dtypes) + _common.names(args.ring_dtypes)))
    say(f"{'impl':<14} {'dtype':<5} {'bytes':>11} {'median ms':>10} {'algbw GB/s':>11} {'busbw GB/s':>11} "
        f"{'model ms':>9}")
    for nbytes in sizes(parse_bytes(args.min_bytes), hi, args.factor):
        for dtype in dtypes:
            dt = backend.resolve_dtype(dtype)
            n = nbytes // dt.itemsize
            rng = np.random.default_rng(comm.rank)
            host = rng.integers(-8, 9, size=n).astype(dt)  # small integers: any summation order is exact
            x = backend.to_device(host, xp)
            impls = []
            if dtype in _common.names(args.dtypes) and (gpu or dt != backend.bfloat16):  # MPI cannot sum bf16
                impls.append((comm.backend, lambda x=x: comm.all_reduce(x)))
            if dtype in _common.names(args.ring_dtypes):
                if N > 1:
                    want = comm.all_reduce(backend.to_device(host.astype(np.float32), xp))
                    got = ring(x.copy())
                    same = bool(np.array_equal(backend.to_numpy(got).astype(np.float32), backend.to_numpy(want)))
                    ok &= same
                    impls.append(("ring", lambda x=x: ring(x)))
                else:  # one rank: time the ring's reduction kernel instead of a ring with nothing to do
                    y = x.copy()
                    impls.append(("reduce kernel", lambda x=x, y=y: reduce_add(x, y)))
            for impl, fn in impls:
                ms = slowest(comm, time_op(fn, xp, reps, args.warmup))
                s = ms * 1e-3
                model = ring_allreduce_seconds(nbytes, N, link, lat, chunks=args.chunks) if N > 1 else None
                # one rank: no link, so no bus bandwidth; the engine's all-reduce is a no-op, so no algbw either
                noop = N == 1 and impl == comm.backend
                row = {"impl": impl, "dtype": dtype, "bytes": nbytes, "world_size": N, "median_ms": ms,
                       "algbw_GBps": None if noop else nbytes / s / 1e9,
                       "busbw_GBps": float(busbw(nbytes, s, N)) / 1e9 if N > 1 else None,
                       "model_ms": None if model is None else float(model) * 1e3,
                       "model_busbw_GBps": None if model is None else float(busbw(nbytes, model, N)) / 1e9}
                if impl == "reduce kernel":
                    row["kernel_GBps"] = 3 * nbytes / s / 1e9
                if impl == "ring":
                    row["correct"] = same
                rows.append(row)
                say(f"{impl:<14} {dtype:<5} {nbytes:>11,} {ms:>10.4f} {_num(row['algbw_GBps']):>11} "
                    f"{_num(row['busbw_GBps']):>11} {_num(row['model_ms'], 4):>9}")
    if not ok:
        say("bench_ch9_allreduce: the ring's result differs from the engine's all-reduce", file=sys.stderr)
    payload = {"benchmark": "ch9_allreduce", "world_size": N, "backend": comm.backend,
               "launcher": from_environ().launcher, "chunks": args.chunks, "reps": reps, "correct": ok,
               "cost_model": {"link_GBps": link / 1e9, "latency_us": lat * 1e6,
                              "formula": "2(N-1)/N * bytes / link + 2(N-1) * chunks * latency"},
               "busbw_definition": "algbw * 2(N-1)/N (nccl-tests doc/PERFORMANCE.md); none at N = 1 (no link)",
               **environment(xp), "rows": rows}
    default = _common.RESULTS_DIR / "ch9" / ("ch9_allreduce.json" if N == 1 else f"ch9_allreduce_{N}gpu.json")
    out = args.out or (default if gpu and not args.quick else None)
    if main_rank and _common.save(out, payload, xp):
        from llmgpu.plotting import plot_allreduce

        # one rank has no link (no bus bandwidth): its plot is the reduction kernel's algorithm bandwidth
        ax = plot_allreduce(rows, y="busbw_GBps" if N > 1 else "algbw_GBps",
                            title=f"all-reduce on {N} rank(s), {backend.device_info(xp).name}"
                            + ("" if N > 1 else ": the ring's reduction kernel"))
        png = out.with_suffix(".png")
        ax.figure.savefig(png, dpi=120)
        print(f"wrote {png}")
    comm.barrier()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
