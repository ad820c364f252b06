"""Chapter 9 with several NCCL ranks on one GPU (NCCL 2.30's ``NCCL_MULTI_RANK_GPU_ENABLE=1``; the recipe is
tools/recipes/nccl_multirank.sh): N ranks against one rank at the same global batch (bf16 fast step as a CUDA graph
with its collectives inside, fp32 book step; DP, ZeRO-1, ZeRO-2; two micro-batches a rank; an active clip), our ring
against NCCL's all-reduce, a killed rank and a stopped rank, a ZeRO run resumed on another number of ranks.

Ranks that share a GPU share its SMs and its memory bandwidth: these tests show that the code is right with real
NCCL collectives between real processes, never how fast it would be on N GPUs. Where several ranks cannot share the
GPU (an older NCCL, the variable unset) the tests skip and say why; on a machine with N GPUs they run one rank each.

Tolerances. The ranks sum the same per-micro-batch gradients as the one rank, in another order (each rank its
share, then the collective), so they differ from it by rounding only, which the optimizer then carries along. The
yardstick is measured in the same run: the one rank with its micro-batches in another order. The N-rank run must stay
within a few times that run's distance from the reference; the first step, before any weight differs, much closer.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from dist_helpers import losses, rank_pid, wait_for_steps

ROOT = Path(__file__).resolve().parents[1]
WORKER = ROOT / "tests" / "workers" / "dist_gpu.py"
ENV = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
           NCCL_NVLS_ENABLE="0",  # NVLink multicast stays off on the lent machines
           OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")  # Open MPI (the GPU image's) as root


def _ranks_fit(cp, world: int):
    """Skip, saying why, unless ``world`` ranks can each have a GPU or share the ones there are."""
    from llmgpu.dist import ranks_may_share_gpus

    if cp.cuda.runtime.getDeviceCount() >= world:
        return
    why = ranks_may_share_gpus()
    if why:
        pytest.skip(f"{world} NCCL ranks on {cp.cuda.runtime.getDeviceCount()} GPU(s): {why}")
    if world > 2 and not os.environ.get("NCCL_MAX_CTAS"):
        pytest.skip(f"{world} ranks on one GPU: NCCL shares a GPU between about 2 ranks unless NCCL_MAX_CTAS lowers "
                    "each rank's channels (tools/recipes/nccl_multirank.sh sets it)")


def _worker(tmp_path, world: int, mode: str) -> dict:
    from llmgpu.dist.launch import RANK_DIR_VAR, _launch_gpu

    d = tmp_path / "ranks"
    d.mkdir()
    out = tmp_path / f"{mode}.json"
    said = []
    rc = _launch_gpu(world, [sys.executable, str(WORKER), mode, str(out)], dict(ENV, **{RANK_DIR_VAR: str(d)}),
                     str(d), lambda *a, **k: said.append(a[0]))
    assert rc == 0, said
    res = json.loads(out.read_text())
    assert res["world"] == world
    return res


@pytest.mark.gpu
@pytest.mark.parametrize("world", [2, 4])
def test_n_ranks_on_one_gpu_train_like_one_rank(cp, tmp_path, world):
    _ranks_fit(cp, world)
    from llmgpu.train import fast_path_available

    if not fast_path_available(cp, "bf16")[0]:
        pytest.skip(f"fast path unavailable: {fast_path_available(cp, 'bf16')[1]}")
    res = _worker(tmp_path, world, "equal")
    cases = {(c["fast"], c["zero"]): c for c in res["cases"]}
    assert set(cases) == {(f, z) for f in (True, False) for z in (0, 1, 2)}
    for (fast, zero), c in cases.items():
        name = f"{'bf16 graph' if fast else 'fp32 book'} step, ZeRO-{zero}"
        ref, got, alt = (np.array(c[k]) for k in ("loss_ref", "loss", "loss_reordered"))
        assert np.isfinite(got).all() and np.isfinite(ref).all(), name
        assert c["clipped"] >= 1, f"{name}: the clip never acted, so it was not tested"
        if fast:  # the collectives inside the graph, replayed every step
            assert c["graph"] and c["graph_kernels"] > 0 and c["steps"] >= 50, name
        # step 1: the same weights and data, so the same micro-batch losses; only their mean is summed in another
        # order (one rounding of a few fp32 terms), and the norm sums the same gradient terms in another order
        assert abs(got[0] - ref[0]) <= 4e-7 * abs(ref[0]), (name, got[0], ref[0])
        assert abs(c["norm"][0] - c["norm_ref"][0]) <= (1e-5 if not fast else 1e-4) * c["norm_ref"][0], name
        # the whole run: rounding only, so within a few times what reordering the micro-batches does on one rank
        # (plus one fp32 ulp of the loss, for runs where the reordering happened to change nothing)
        floor = 1.2e-7 * np.abs(ref).max()
        assert np.abs(got - ref).max() <= 4 * np.abs(alt - ref).max() + floor, (name, np.abs(got - ref).max(),
                                                                               np.abs(alt - ref).max())
        assert c["max_rel_dw"] <= 4 * c["max_rel_dw_reordered"] + 1e-6, (name, c["max_rel_dw"],
                                                                         c["max_rel_dw_reordered"])


@pytest.mark.gpu
@pytest.mark.parametrize("world", [2, 4])
def test_our_ring_against_nccls_all_reduce_on_one_gpu(cp, tmp_path, world):
    _ranks_fit(cp, world)
    res = _worker(tmp_path, world, "ring")
    assert {(c["dtype"], c["n"]) for c in res["cases"]} == {(d, n) for d in ("float32", "bfloat16")
                                                            for n in (1, 1001, 65_537, 1_000_003)}
    for c in res["cases"]:
        assert c["finite"], c
        if world == 2:  # a sum of two addends does not depend on their order: bit for bit
            assert c["bitwise"], c
        # W - 1 additions, each rounded once: |error| <= (W - 1) u sum|x| per element (u: 2^-24 fp32, 2^-8 bf16; the
        # relative error of the sum itself has no bound where the addends cancel, as one element may)
        u = 2.0**-24 if c["dtype"] == "float32" else 2.0**-8
        assert c["ring_err_l1"] <= (world - 1) * u and c["nccl_err_l1"] <= (world - 1) * u, c
        if c["n"] >= 1001:  # over many elements: norm-wise, and no worse than NCCL's own order
            tol = 1e-6 if c["dtype"] == "float32" else 1e-2
            assert c["ring_rel"] <= tol and c["nccl_rel"] <= tol, c
            assert c["ring_rel"] <= 2 * c["nccl_rel"] + u, c


def _train(*args, timeout=300):
    return subprocess.run([sys.executable, "-m", "llmgpu", "train", "--device", "gpu", "--dtype", "fp32", "--no-fast",
                           "--batch", "4", "--seq", "64", "--eval-every", "0", "--sample-tokens", "0", "--log-every",
                           "1", "--no-plot", "--no-progress", "--warmup", "0", "--schedule", "constant",
                           "--dist-backend", "nccl", *map(str, args)],
                          env=ENV, capture_output=True, text=True, timeout=timeout)


@pytest.mark.gpu
def test_a_zero_run_resumes_on_another_number_of_gpu_ranks(cp, tmp_path):
    """2 ranks (ZeRO-1) for 3 steps, then 1 rank to step 6; 1 rank for 3 steps, then 2 ranks (ZeRO-2) to step 6: both
    as one rank for 6 steps at the same global batch (grad-accum 2 on one rank). fp32, where the only difference is
    the order the ranks sum the gradients in (the CPU twin in test_dist.py measures 2e-6 after 6 steps)."""
    _ranks_fit(cp, 2)
    one = _train("--steps", 6, "--grad-accum", 2, "--out", tmp_path / "one")
    assert one.returncode == 0, one.stderr[-1500:]
    ref = losses(tmp_path / "one")
    two = _train("--nproc", 2, "--zero", 1, "--steps", 3, "--out", tmp_path / "two")
    assert two.returncode == 0, two.stderr[-1500:]
    res = _train("--resume", tmp_path / "two", "--steps", 6, "--grad-accum", 2)
    assert res.returncode == 0, res.stderr[-1500:]
    assert "saved on 2 rank(s) and continues on 1" in res.stderr
    back = _train("--steps", 3, "--grad-accum", 2, "--out", tmp_path / "back")
    assert back.returncode == 0, back.stderr[-1500:]
    res = _train("--nproc", 2, "--zero", 2, "--resume", tmp_path / "back", "--steps", 6, "--grad-accum", 1)
    assert res.returncode == 0, res.stderr[-1500:]
    assert "saved on 1 rank(s) and continues on 2" in res.stderr
    for run in ("two", "back"):
        np.testing.assert_allclose(losses(tmp_path / run), ref, rtol=0, atol=1e-5, err_msg=run)
        meta = json.loads((tmp_path / run / "checkpoint" / "meta.json").read_text())
        assert meta["step"] == 6 and meta["world_size"] == (1 if run == "two" else 2)


def _start_long_run(out, timeout_s):
    args = [sys.executable, "-m", "llmgpu", "train", "--nproc", "2", "--device", "gpu", "--steps", "1000000",
            "--preset", "tiny", "--no-fast", "--batch", "2", "--seq", "64", "--eval-every", "0", "--no-progress",
            "--log-every", "1",
            "--dist-backend", "nccl", "--dist-timeout", str(timeout_s), "--out", str(out)]
    return subprocess.Popen(args, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _running_ranks(cp, out, timeout_s):
    """Two GPU ranks training in ``out`` (NCCL, ``--dist-timeout timeout_s``), once they have logged 3 steps:
    (the launcher's process, [rank 0's PID, rank 1's])."""
    _ranks_fit(cp, 2)
    p = _start_long_run(out, timeout_s)
    wait_for_steps(out, 3, deadline_s=180, proc=p)
    return p, [rank_pid(str(out), r) for r in (0, 1)]


def _gone(pid: int) -> bool:
    return not Path(f"/proc/{pid}").exists()


@pytest.mark.gpu
@pytest.mark.skipif(sys.platform != "linux", reason="finds the ranks through /proc")
def test_a_killed_gpu_rank_ends_the_run_and_is_named(cp, tmp_path):
    p, pids = _running_ranks(cp, tmp_path / "killed", 30)
    os.kill(pids[1], signal.SIGKILL)
    t = time.monotonic()
    _, stderr = p.communicate(timeout=120)
    assert time.monotonic() - t < 30, "the other rank waited for the dead one"
    assert p.returncode == 128 + signal.SIGKILL, p.returncode  # the shell's code (it was 1)
    assert "llmgpu: rank 1 was killed by signal 9; stopping the other ranks" in stderr, stderr[-800:]
    assert all(_gone(pid) for pid in pids), "a rank outlived the run"


@pytest.mark.gpu
@pytest.mark.skipif(sys.platform != "linux", reason="finds the ranks through /proc")
def test_a_stopped_gpu_rank_ends_the_run_within_the_timeout_and_is_named(cp, tmp_path):
    """SIGSTOP on rank 1: rank 0 waits at most --dist-timeout for the step's collectives, aborts its NCCL
    communicator and says so; the launcher names the stopped rank and kills it. No process is left."""
    p, pids = _running_ranks(cp, tmp_path / "stopped", 8)
    os.kill(pids[1], signal.SIGSTOP)
    t = time.monotonic()
    try:
        _, stderr = p.communicate(timeout=120)
    finally:
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    assert time.monotonic() - t < 8 + 25, "not ended within the timeout (plus the log interval and the grace)"
    assert p.returncode != 0
    assert re.search(rf"llmgpu: error: rank 0: waited 8 s for .*: rank 1 \(pid {pids[1]}\) is stopped", stderr), \
        stderr[-800:]
    assert f"llmgpu: rank 1 (pid {pids[1]}) is stopped (SIGSTOP or a debugger)" in stderr, stderr[-800:]
    assert all(_gone(pid) for pid in pids), "a rank outlived the run"


def test_the_gpu_workers_ring_mode_dry_runs_on_cpu_ranks(tmp_path):
    """The worker itself, checked where CI can: its ring mode under mpiexec on 2 CPU ranks (fp32, MPI's sum)."""
    from llmgpu.dist import DistError

    try:
        from llmgpu.dist.launch import find_mpiexec

        mpiexec = find_mpiexec()
    except (ImportError, DistError) as e:
        if os.environ.get("CI"):
            raise
        pytest.skip(f"needs mpi4py and mpiexec: {e}")
    out = tmp_path / "ring.json"
    p = subprocess.run([mpiexec, "-n", "2", sys.executable, str(WORKER), "ring", str(out), "cpu"],
                       env=dict(ENV, LLMGPU_DEVICE="cpu"), capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-1500:]
    res = json.loads(out.read_text())
    assert res["world"] == 2 and [c["n"] for c in res["cases"]] == [1, 1001, 65_537, 1_000_003]
    assert all(c["bitwise"] and c["ring_rel"] <= 1e-6 and c["ring_err_l1"] <= 2.0**-24 for c in res["cases"]), \
        res["cases"]
