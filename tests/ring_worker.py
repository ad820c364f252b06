"""Run by tests/test_ring.py as N ranks: our ring all-reduce against the engine's own all-reduce.

    mpiexec -n 3 python tests/ring_worker.py cpu     # MPI ranks on NumPy: against MPI's Allreduce
    (RANK=.. WORLD_SIZE=.. MASTER_ADDR/PORT=..) python tests/ring_worker.py gpu   # NCCL: against ncclAllReduce

Every rank checks its own result and exits non-zero on the first mismatch.
"""

import sys

import numpy as np

from llmgpu import backend
from llmgpu.dist import init_process_group
from llmgpu.dist.ring import RingAllReduce

device = sys.argv[1] if len(sys.argv) > 1 else "cpu"
xp = np if device == "cpu" else backend.require_gpu()
comm = init_process_group(xp, timeout=60)
N, r = comm.world_size, comm.rank
sizes = sorted({1, 2, 3, N - 1, N, N + 1, 5, 7, 16, 100, 1001, 4097, 65537} - {0})
dtypes = (np.float32, np.float64, backend.bfloat16) if xp is np else (np.float32, backend.bfloat16, np.float16)
cases = 0


def reference(a):
    """The engine's all-reduce of ``a`` (fp32), a copy."""
    out = a.astype(np.float32)
    comm.all_reduce(out)
    return backend.to_numpy(out)


for chunks in (1, 3, 4):
    ring = RingAllReduce(comm, chunks)  # one object for every size: its receive buffer is reused
    for n in sizes:
        for dtype in dtypes:
            rng = np.random.default_rng(1000 * n + 10 * r + chunks)
            # small integers: every order of summation gives the same float, so the check is exact
            ints = rng.integers(-8, 9, size=n).astype(np.float32)
            got = ring(backend.to_device(ints.astype(dtype), xp))
            assert np.array_equal(backend.to_numpy(got).astype(np.float32), reference(ints)), (N, r, chunks, n, dtype)
            if np.dtype(dtype).itemsize >= 4:  # random values: equal to rounding (the order of the sum differs)
                x = rng.standard_normal(n).astype(dtype)
                got = backend.to_numpy(ring(backend.to_device(x.copy(), xp)))
                want = backend.to_device(x.copy(), xp)
                want = backend.to_numpy(comm.all_reduce(want))
                np.testing.assert_allclose(got, want, rtol=1e-5 if dtype == np.float32 else 1e-12, atol=1e-5)
            cases += 1
# a 2-D buffer is summed as its flat view; a buffer on a side stream is ordered by that stream
x = backend.to_device(np.arange(12, dtype=np.float32).reshape(3, 4) * (r + 1), xp)
if xp is np:
    RingAllReduce(comm)(x)
else:
    s = xp.cuda.Stream(non_blocking=True)
    with s:
        x *= 1.0  # work queued on s before the ring
    RingAllReduce(comm)(x, stream=s)
    s.synchronize()
assert np.array_equal(backend.to_numpy(x), np.arange(12, dtype=np.float32).reshape(3, 4) * (N * (N + 1) // 2))
comm.barrier()
if r == 0:
    print(f"ring all-reduce on {N} {comm.backend} ranks equals the engine's all-reduce: {cases} cases")
