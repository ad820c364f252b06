"""Our ring all-reduce (chapter 9): the schedule, the one-process simulation, the cost model, the MPI ring
under ``mpiexec`` against MPI's all-reduce, and on GPUs the reduction kernel and the NCCL ring."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from llmgpu import backend
from llmgpu.dist import LocalComm, ring
from llmgpu.dist.ring import RingAllReduce, RingLayout, reduce_add, simulate_ring_allreduce

pytestmark = pytest.mark.ch9

ROOT = Path(__file__).resolve().parents[1]
WORKER = Path(__file__).with_name("ring_worker.py")


# --------------------------------------------------------------------------- schedule and layout


@pytest.mark.parametrize("N", [1, 2, 3, 4, 5, 8])
def test_schedule_neighbours_agree(N):
    steps = ring.ring_schedule(N)
    assert len(steps) == 2 * (N - 1)
    assert [s.reduce for s in steps] == [True] * (N - 1) + [False] * (N - 1)
    for st in steps:
        for r in range(N):
            assert st.send[(r - 1) % N] == st.recv[r]  # what the left neighbour sends is what r receives
        assert sorted(st.send) == list(range(N))  # every segment is on the wire once per step
    for s in range(1, N - 1):  # a rank forwards what it reduced the step before
        assert steps[s].send == steps[s - 1].recv


@pytest.mark.parametrize("n,parts,align", [(0, 3, 1), (1, 3, 1), (10, 3, 1), (1001, 4, 16), (64, 4, 16), (17, 2, 16)])
def test_split_points(n, parts, align):
    b = ring.split_points(n, parts, align)
    assert len(b) == parts + 1 and b[0] == 0 and b[-1] == n
    assert all(x <= y for x, y in zip(b, b[1:]))
    assert all(x % align == 0 for x in b[:-1])
    sizes = np.diff(b)
    if n >= parts * align:
        assert sizes.min() > 0


@pytest.mark.parametrize("n", [3, 7, 100, 1001, 65537])
@pytest.mark.parametrize("N,chunks", [(2, 1), (3, 4), (8, 3)])
def test_layout_covers_the_buffer_with_nonempty_chunks(n, N, chunks):
    if n < N:
        with pytest.raises(ValueError, match="pad"):
            RingLayout(n, N, chunks)
        return
    lay = RingLayout(n, N, chunks)
    flat = [b for seg in lay.chunk_bounds for b in seg]
    assert flat[0][0] == 0 and flat[-1][1] == n
    assert all(a[1] == b[0] for a, b in zip(flat, flat[1:]))
    assert all(hi > lo for lo, hi in flat)
    assert 1 <= lay.chunks <= chunks


# --------------------------------------------------------------------------- the simulation


@pytest.mark.parametrize("N", [1, 2, 3, 4, 5, 8])
@pytest.mark.parametrize("chunks", [1, 3])
def test_simulation_equals_the_sum(rng, N, chunks):
    for n in [1, 2, N - 1, N, N + 1, 7, int(rng.integers(10, 5000))]:
        if n < 1:
            continue
        bufs = [rng.standard_normal(n) for _ in range(N)]
        trace = simulate_ring_allreduce(bufs, chunks=chunks)
        want = np.sum(bufs, axis=0)
        assert len(trace.result) == N
        for got in trace.result:
            np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)
        assert len(trace.holds) == 2 * (N - 1) + 1
        assert (trace.holds[-1] == (1 << N) - 1).all()


def test_simulation_state_after_reduce_scatter():
    N = 4
    trace = simulate_ring_allreduce([np.full(8, 10.0**r) for r in range(N)])
    full = (1 << N) - 1
    h = trace.holds[N - 1]  # after the reduce-scatter phase
    for r in range(N):
        assert h[r, (r + 1) % N] == full  # rank r owns the complete segment r+1
        assert sum(h[r, s] == full for s in range(N)) == 1
    np.testing.assert_array_equal(trace.result[2], np.full(8, 1111.0))
    assert {e["segment"] for e in trace.events if e["rank"] == 0 and e["reduce"]} == {3, 2, 1}


def test_simulation_keeps_shape_dtype_and_inputs(rng):
    bufs = [rng.integers(-8, 9, size=(3, 5)).astype(backend.bfloat16) for _ in range(3)]
    before = [b.copy() for b in bufs]
    trace = simulate_ring_allreduce(bufs, chunks=2)
    assert trace.result[0].shape == (3, 5) and trace.result[0].dtype == backend.bfloat16
    np.testing.assert_array_equal(trace.result[1].astype(np.float32), np.sum([b.astype(np.float32) for b in bufs], 0))
    for b, c in zip(bufs, before):
        np.testing.assert_array_equal(b, c)
    with pytest.raises(ValueError, match="same size"):
        simulate_ring_allreduce([np.zeros(3), np.zeros(4)])


def test_reduce_add_numpy_rounds_16_bit_once(rng):
    a = rng.standard_normal(100).astype(backend.bfloat16)
    b = rng.standard_normal(100).astype(backend.bfloat16)
    want = (a.astype(np.float32) + b.astype(np.float32)).astype(backend.bfloat16)
    np.testing.assert_array_equal(reduce_add(a.copy(), b).view(np.uint16), want.view(np.uint16))
    with pytest.raises(ValueError):
        reduce_add(np.zeros(3, np.float32), np.zeros(4, np.float32))


def test_ring_on_one_rank_is_the_identity():
    x = np.arange(5, dtype=np.float32)
    assert RingAllReduce(LocalComm())(x) is x
    np.testing.assert_array_equal(x, np.arange(5, dtype=np.float32))


# --------------------------------------------------------------------------- the cost model


def test_cost_model():
    S, bw, lat = 2**30, 100e9, 5e-6
    assert ring.ring_allreduce_seconds(S, 1, bw, lat) == 0.0
    assert ring.ring_allreduce_seconds(S, 2, bw, lat) == pytest.approx(S / bw + 2 * lat)
    assert ring.ring_allreduce_seconds(S, 8, bw, lat) == pytest.approx(2 * 7 / 8 * S / bw + 14 * lat)
    t = ring.ring_allreduce_seconds(np.array([4, 2**30]), 4, bw, lat, chunks=4)
    assert t.shape == (2,) and t[0] == pytest.approx(2 * 3 * 4 * lat, rel=1e-3)  # tiny: latency-bound
    # large messages approach 2(N-1)/N bytes per link: busbw equals the link's bandwidth
    big = 2**34
    assert ring.busbw(big, ring.ring_allreduce_seconds(big, 8, bw, 0.0), 8) == pytest.approx(bw)
    assert ring.algbw(big, 2.0) == big / 2
    assert ring.busbw(big, 2.0, 4, "all_gather") == pytest.approx(big / 2 * 3 / 4)


# --------------------------------------------------------------------------- the MPI ring (CPU ranks)


def _mpiexec():
    try:
        import mpi4py  # noqa: F401
    except ImportError:
        return None, "mpi4py is not installed (pip install 'llmgpu[test]' brings mpi4py and mpich)"
    from llmgpu.dist import DistError
    from llmgpu.dist.launch import find_mpiexec

    try:  # the mpiexec of the MPI mpi4py loads (another MPI's would start singletons)
        return find_mpiexec(), None
    except DistError as e:
        return None, str(e)


def _mpi_env():
    # Open MPI (the GPU machine's mpiexec) refuses to start ranks as root unless told that it is meant
    return dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
                LLMGPU_DEVICE="cpu", OMP_NUM_THREADS="1", OMPI_ALLOW_RUN_AS_ROOT="1",
                OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")


@pytest.mark.parametrize("nproc", [2, 3])
def test_mpi_ring_equals_mpi_allreduce(nproc):
    mpiexec, why = _mpiexec()
    if mpiexec is None:
        pytest.skip(why)
    r = subprocess.run([mpiexec, "-n", str(nproc), sys.executable, str(WORKER), "cpu"], capture_output=True,
                       text=True, timeout=120, env=_mpi_env())
    assert r.returncode == 0, r.stdout + r.stderr
    assert f"on {nproc} mpi ranks equals the engine's all-reduce" in r.stdout, r.stdout


def test_bench_ch9_on_two_mpi_ranks(tmp_path):
    mpiexec, why = _mpiexec()
    if mpiexec is None:
        pytest.skip(why)
    out = tmp_path / "ch9.json"
    r = subprocess.run([mpiexec, "-n", "2", sys.executable, str(ROOT / "benchmarks" / "bench_ch9_allreduce.py"),
                        "--device", "cpu", "--max-bytes", "1MiB", "--reps", "3", "--warmup", "1", "--out", str(out)],
                       capture_output=True, text=True, timeout=120, env=_mpi_env())
    assert r.returncode == 0, r.stdout + r.stderr
    data = json.loads(out.read_text())
    assert data["world_size"] == 2 and data["backend"] == "mpi" and data["correct"]
    assert out.with_suffix(".png").stat().st_size > 1000
    rows = data["rows"]
    assert {r["impl"] for r in rows} == {"mpi", "ring"}
    assert sorted({r["bytes"] for r in rows}) == [4096, 16384, 65536, 262144, 1048576]
    for row in rows:
        assert row["busbw_GBps"] == pytest.approx(row["algbw_GBps"] * 2 * (2 - 1) / 2)
        assert row["model_ms"] > 0


# --------------------------------------------------------------------------- GPU


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("n,offset", [(1, 0), (7, 0), (4096, 0), (4097, 3), (1 << 20, 0), ((1 << 20) + 5, 1)])
def test_gpu_reduce_kernel_equals_numpy(cp, rng, dtype, n, offset):
    dt = backend.resolve_dtype(dtype)
    a = rng.standard_normal(n + offset).astype(dt)
    b = rng.standard_normal(n + offset).astype(dt)
    want = reduce_add(a[offset:].copy(), b[offset:])  # the NumPy path: fp32 add, one rounding
    da, db = cp.asarray(a), cp.asarray(b)
    cp.cuda.get_current_stream().synchronize()  # the copies above are on the current stream, not on s
    s = cp.cuda.Stream(non_blocking=True)
    reduce_add(da[offset:], db[offset:], stream=s)  # offset: misaligned pointers take the scalar path
    s.synchronize()
    got = cp.asnumpy(da[offset:])
    np.testing.assert_array_equal(got.view(np.uint8), want.view(np.uint8))
    np.testing.assert_array_equal(cp.asnumpy(da[:offset]), a[:offset])  # nothing before the view changed


@pytest.mark.gpu
def test_gpu_ring_at_world_size_one(cp):
    from llmgpu.dist import NcclComm, nccl_module

    nccl = nccl_module()
    comm = NcclComm(nccl.get_unique_id(), 0, 1)
    x = cp.arange(1000, dtype=cp.float32)
    RingAllReduce(comm)(x)
    np.testing.assert_array_equal(cp.asnumpy(x), np.arange(1000, dtype=np.float32))


@pytest.mark.gpu
@pytest.mark.parametrize("nproc", [2])
def test_gpu_nccl_ring_equals_nccl_allreduce(cp, nproc):
    if cp.cuda.runtime.getDeviceCount() < nproc:
        pytest.skip(f"needs {nproc} GPUs (one per rank; NCCL refuses two ranks on one GPU), "
                    f"this machine has {cp.cuda.runtime.getDeviceCount()}")
    from llmgpu.dist.launch import free_port

    port = free_port()
    procs = []
    for r in range(nproc):
        env = dict(os.environ, RANK=str(r), WORLD_SIZE=str(nproc), LOCAL_RANK=str(r), LOCAL_WORLD_SIZE=str(nproc),
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                   PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
        procs.append(subprocess.Popen([sys.executable, str(WORKER), "gpu"], env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True))
    outs = [p.communicate(timeout=300)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs), "\n".join(outs)
    assert f"on {nproc} nccl ranks equals the engine's all-reduce" in outs[0], outs[0]
