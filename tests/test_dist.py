"""Chapter 9 on CPUs with a real MPI: launcher variables, buckets, the rendezvous, DP / ZeRO-1 / ZeRO-2 on 2 and
3 ranks against one rank at the same global batch, ``llmgpu train --nproc``, resume across world sizes, a
killed rank, a hung rank, ranks that disagree."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from dist_helpers import ENV, MPIEXEC, ROOT, losses, needs_mpi, rank_pid, wait_for_steps
from dist_helpers import run_worker as _mpi
from dist_helpers import train_cli as _train

from llmgpu.dist import DistError, LocalComm, from_environ, plan_buckets, rendezvous
from llmgpu.dist.env import DistEnv
from llmgpu.dist.launch import RANK_DIR_VAR, name_dead_rank, rank_errors, report_rank_error, strip_nproc
from llmgpu.model import GPT, GPTConfig
from llmgpu.optim.params import ALIGN, FlatParams

TINY = replace(GPTConfig.preset("tiny"), vocab_size=61, block_size=16, n_layer=3, n_embd=32, n_head=2)


# --------------------------------------------------------------------------- who am I


@pytest.mark.parametrize("env, want", [
    ({}, DistEnv()),
    ({"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "h",
      "MASTER_PORT": "29500"},
     DistEnv(3, 4, 1, 2, "torchrun", "h", 29500)),
    ({"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "2", "OMPI_COMM_WORLD_LOCAL_RANK": "1",
      "OMPI_COMM_WORLD_LOCAL_SIZE": "2"}, DistEnv(1, 2, 1, 2, "openmpi")),
    ({"SLURM_PROCID": "5", "SLURM_NTASKS": "8", "SLURM_LOCALID": "1", "SLURM_NTASKS_PER_NODE": "4(x2)"},
     DistEnv(5, 8, 1, 4, "slurm")),
    ({"PMI_RANK": "2", "PMI_SIZE": "3"}, DistEnv(2, 3, 2, 3, "mpich")),
])
def test_launcher_variables(env, want):
    assert from_environ(env) == want


@pytest.mark.parametrize("env, needle", [
    ({"RANK": "4", "WORLD_SIZE": "4"}, "rank must be in [0, 4)"),
    ({"RANK": "x", "WORLD_SIZE": "4"}, "RANK='x'"),
    ({"RANK": "0", "WORLD_SIZE": "2", "MASTER_PORT": "http"}, "MASTER_PORT"),
])
def test_bad_launcher_variables(env, needle):
    with pytest.raises(DistError, match=needle.replace("[", r"\[").replace("(", r"\(").replace(")", r"\)")):
        from_environ(env)


@pytest.mark.skipif(sys.platform != "linux", reason="signals and process groups as on Linux")
def test_the_gpu_launchers_watch_names_a_killed_rank_and_exits_as_the_shell_would(tmp_path):
    """The watcher of the GPU ranks (plain processes here): a rank killed by SIGKILL ends the run with 137, as a
    shell says it (it exited 1), named in one line; the rank still running is stopped."""
    from llmgpu.dist.launch import _Relay, _watch

    procs = [subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"]),
             subprocess.Popen([sys.executable, "-c", "import os, signal; os.kill(os.getpid(), signal.SIGKILL)"])]
    said = []
    try:
        rc = _watch(procs, lambda line, file=None: said.append(line), str(tmp_path), _Relay(lambda: []))
    finally:
        for p in procs:
            p.kill()
    assert rc == 128 + signal.SIGKILL
    assert said == ["llmgpu: rank 1 was killed by signal 9; stopping the other ranks"]
    assert procs[0].poll() is not None


def test_the_dead_rank_is_named_from_both_witnesses():
    ranks = {"100": "0", "101": "1", "102": "2"}
    hydra_1 = [("101", "9")]  # Hydra: 'PID 101 RUNNING AT ...', 'EXIT CODE: 9'
    assert name_dead_rank([("1", "101")], hydra_1, ranks, 9) == "rank 1 (pid 101) was killed by signal 9"
    assert name_dead_rank([("1", "101")], [], ranks, 9) == "rank 1 (pid 101) died"
    assert name_dead_rank([], [("rank", "2", "102", 137)], ranks, 9) == "rank 2 (pid 102) was killed by signal 9"
    # the watcher saw rank 0 end first (it exited on seeing its peer vanish), mpiexec names rank 1: both are said
    both = name_dead_rank([("0", "100")], hydra_1, ranks, 9)
    assert both.startswith("one of ranks 0, 1 died") and "exit code 9" in both
    assert name_dead_rank([("0", "100"), ("2", "102")], [], ranks, 9).startswith("one of ranks 0, 2 died")
    assert name_dead_rank([], [("555", "1")], ranks, 1) == "a rank exited with code 1"  # a PID of no rank


def test_a_ranks_error_line_is_left_for_the_launcher(tmp_path, monkeypatch):
    """mpiexec may drop a rank's last output when it tears the run down: the launcher prints what a rank left."""
    monkeypatch.delenv(RANK_DIR_VAR, raising=False)
    report_rank_error("llmgpu: error: nowhere to go")  # outside an --nproc run: nothing, no error
    assert not list(tmp_path.iterdir())
    monkeypatch.setenv(RANK_DIR_VAR, str(tmp_path))
    (tmp_path / "0").write_text("123")  # a rank's PID file is not an error line
    line = "llmgpu: error: rank 1: all_reduce did not complete within 4 s"
    report_rank_error(line + "\n")
    assert rank_errors(tmp_path) == [(str(os.getpid()), line)]


def test_error_lines_that_mpiexec_glued_together_are_split_apart_again():
    """mpiexec merges the ranks' streams in chunks: one rank's error line could end in the next one's (then said
    twice on one line) or in MPICH's abort line, and the newline they lost came later as an empty line."""
    from llmgpu.dist.launch import unglued

    abort = "Abort(2) on node 0 (rank 0 in comm 0): application called MPI_Abort(MPI_COMM_WORLD, 2) - process 0\n"
    src = ["llmgpu: error: x does not existllmgpu: error: x does not exist\n", "\n", "a sample line\n", "\n",
           "llmgpu: error: bad setting " + abort, "\n", "the end"]
    assert list(unglued(src)) == ["llmgpu: error: x does not exist\n", "llmgpu: error: x does not exist\n",
                                  "a sample line\n", "\n", "llmgpu: error: bad setting\n", abort, "the end"]
    assert list(unglued(["plain\n", "\n"])) == ["plain\n", "\n"]  # nothing glued: nothing dropped


@needs_mpi
def test_more_cpu_ranks_than_cores_get_a_note(monkeypatch):
    from llmgpu.dist import launch as launch_module

    said = []
    monkeypatch.setattr(launch_module.os, "cpu_count", lambda: 1)
    rc = launch_module.launch(2, ["--version"], gpu=False, say=lambda line, **kw: said.append(line))
    assert rc == 0 and said[0] == ("llmgpu: note: 2 ranks on 1 CPU cores share them: a check of correctness, "
                                   "not of speed")


def test_zero_on_one_rank_says_there_is_nothing_to_shard(tmp_path):
    from llmgpu.train.config import TrainConfig
    from llmgpu.train.plan import plan_config, plan_model

    p = plan_config(TrainConfig(preset="tiny", device="cpu", zero=2, out=str(tmp_path / "z")), np)
    assert any("--zero 2 on one rank: nothing to shard" in n for n in plan_model(p, data_vocab=256,
                                                                                  data_tokenizer="bytes").notes)
    assert not any("nothing to shard" in n for n in plan_model(p, data_vocab=256, data_tokenizer="bytes",
                                                               world_size=2).notes)


def test_strip_nproc():
    assert strip_nproc(["train", "--nproc", "2", "--steps", "3", "--nproc=4"]) == ["train", "--steps", "3"]


# --------------------------------------------------------------------------- buckets


@pytest.mark.parametrize("world", [1, 2, 3, 8])
@pytest.mark.parametrize("bucket_bytes", [4096, 50_000, 10**9])
def test_buckets_cover_the_buffer(world, bucket_bytes):
    m = GPT(TINY, xp=np, param_multiple=world * ALIGN)
    P = m.params
    buckets, tensors = plan_buckets(P, bucket_bytes, world * ALIGN)
    assert buckets[0][0] == 0 and buckets[-1][1] == P.numel
    assert all(a[1] == b[0] for a, b in zip(buckets, buckets[1:]))  # contiguous, no gap, no overlap
    assert all((hi - lo) % (world * ALIGN) == 0 for lo, hi in buckets)  # N aligned pieces each
    assert P.decay_end in {lo for lo, _ in buckets}  # the decay split is a cut
    assert set().union(*map(set, tensors)) == set(P.names)
    for off in P.offsets.values():
        assert off % (world * ALIGN) == 0
    if bucket_bytes >= 10**9:
        assert len(buckets) == 2  # one per decay group


def test_buckets_refuse_a_buffer_of_the_wrong_multiple():
    P = FlatParams({"a": (5, 3), "b": (7,)}, xp=np)
    with pytest.raises(ValueError, match="param_multiple=48"):
        plan_buckets(P, 4096, 48)


def test_local_comm_is_the_identity():
    c = LocalComm(np)
    x = np.arange(6, dtype=np.float32)
    out = np.empty(6, np.float32)
    assert c.all_reduce(x) is x and np.array_equal(c.reduce_scatter(x, out), x)
    assert np.array_equal(c.all_gather(x[:6], np.empty(6, np.float32)), x)


# --------------------------------------------------------------------------- the rendezvous


def _free_port():
    from llmgpu.dist.launch import free_port

    return free_port()


def test_rendezvous_hands_rank_0s_id_to_every_rank():
    port, world, got = _free_port(), 4, {}

    def rank(r):
        env = DistEnv(r, world, r, world, "torchrun", "127.0.0.1", port)
        got[r] = rendezvous(env, b"x" * 128 if r == 0 else None, timeout=20)

    ts = [threading.Thread(target=rank, args=(r,)) for r in (3, 1, 0, 2)]  # rank 0 need not be first
    for t in ts:
        t.start()
    for t in ts:
        t.join(30)
    assert got == {r: b"x" * 128 for r in range(world)}


def test_rendezvous_names_the_rank_that_did_not_arrive():
    port = _free_port()
    t = threading.Thread(target=rendezvous, args=(DistEnv(1, 3, 1, 3, "torchrun", "127.0.0.1", port), None),
                         kwargs={"timeout": 5})
    t.start()
    with pytest.raises(DistError, match=r"rank\(s\) \[2\] did not arrive"):
        rendezvous(DistEnv(0, 3, 0, 3, "torchrun", "127.0.0.1", port), b"id", timeout=2)
    t.join(10)


def test_rendezvous_without_rank_0_says_whom_it_could_not_reach():
    with pytest.raises(DistError, match="rank 1: could not reach rank 0 at 127.0.0.1"):
        rendezvous(DistEnv(1, 2, 1, 2, "torchrun", "127.0.0.1", _free_port()), None, timeout=1)


# --------------------------------------------------------------------------- N ranks = one rank (MPI)


@needs_mpi
@pytest.mark.parametrize("world, zero, accum", [(2, 0, 1), (3, 0, 2), (2, 1, 2), (3, 1, 1), (2, 2, 1), (3, 2, 3)])
def test_ranks_match_one_rank_at_the_same_global_batch(world, zero, accum):
    p = _mpi(world, zero, accum)
    assert p.returncode == 0, p.stderr[-2000:]
    res = json.loads(p.stdout.strip().splitlines()[-1])
    assert res["buckets"] > 2  # several buckets: the reduction is really cut up
    # the same losses and norms to fp32 rounding of the reduction order (measured: <= 5e-7 absolute)
    np.testing.assert_allclose(res["loss"], res["loss_ref"], rtol=0, atol=2e-6)
    np.testing.assert_allclose(res["norm"], res["norm_ref"], rtol=1e-5)
    # weights after 4 AdamW steps: Adam divides by sqrt(v), so an element whose gradient nearly cancels (sqrt v 70x
    # below the median) turns the reduction order's rounding into ~1e-3 of its update; measured <= 1.2e-7 to 3.9e-6
    # (ZeRO-1, 2 ranks, 2 micro-batches, OpenBLAS 0.3.31); a lost or doubled bucket moves weights by ~lr = 3e-3
    assert res["max_dw"] < 1e-5
    assert min(res["norm_ref"]) > 0.05  # the clip (0.05) was active: its sharded form is checked too


@needs_mpi
def test_ranks_with_different_models_stop_before_the_first_step():
    p = _mpi(2, 0, 1, "mismatch")
    assert p.returncode != 0
    assert "rank(s) [1] differ from rank 0 in their model (n_layer)" in p.stdout + p.stderr


@needs_mpi
def test_ranks_that_read_different_data_under_one_path_stop_before_the_first_step(tmp_path):
    """Two ranks, each in its own directory, both given --data d.txt (another node's copy of a file, or one rewritten
    in between): the configurations agree, the tokens do not. They trained on different data without a word."""
    args = [sys.executable, "-m", "llmgpu", "train", "--device", "cpu", "--preset", "tiny", "--batch", "2", "--seq",
            "16", "--steps", "2", "--eval-every", "0", "--sample-tokens", "0", "--no-plot", "--no-progress",
            "--data", "d.txt", "--out", str(tmp_path / "run")]
    for name, text in (("a", "the same start, then one ending " * 200), ("b", "the same start, then another " * 200)):
        (tmp_path / name).mkdir()
        (tmp_path / name / "d.txt").write_text(text)
    p = subprocess.run([MPIEXEC, "-n", "1", "-wdir", str(tmp_path / "a"), *args, ":",
                        "-n", "1", "-wdir", str(tmp_path / "b"), *args], env=ENV, capture_output=True, text=True,
                       timeout=120)
    assert p.returncode != 0 and not (tmp_path / "run" / "checkpoint").exists()
    assert "rank(s) [1] differ from rank 0 in their data (token counts or tokens) (train, val)" in p.stderr, p.stderr


def test_zero2_keeps_less_gradient_than_the_whole_buffer():
    from llmgpu.dist import ZeroSync
    from llmgpu.train.config import TrainConfig
    from llmgpu.train.step import TrainStep

    cfg = replace(TINY, n_layer=6)
    m = GPT(cfg, xp=np, param_multiple=ALIGN)
    before = m.params.grad.size
    sync = ZeroSync(LocalComm(np), m.params, stage=2, bucket_bytes=4096)
    st = TrainStep(m, TrainConfig(lr=1e-3), grad_sync=sync)
    blocks = [k for k in sync._block_of]
    assert len(blocks) == cfg.n_layer  # one bucket per block, in two slots
    assert m.params.grad.size < before - (cfg.n_layer - 2) * sync._slot_len + 1
    # one rank at stage 2 trains exactly like the plain step
    ref = GPT(cfg, xp=np, param_multiple=ALIGN)
    st_ref = TrainStep(ref, TrainConfig(lr=1e-3))
    x = np.random.default_rng(0).integers(0, cfg.vocab_size, size=(2, 2, 16)).astype(np.int32)
    for _ in range(3):
        a = st([(x[0], x[1]), (x[1], x[0])], 1e-3)
        b = st_ref([(x[0], x[1]), (x[1], x[0])], 1e-3)
    np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)


# --------------------------------------------------------------------------- llmgpu train --nproc


@needs_mpi
def test_nproc_2_trains_like_one_rank_and_resumes_on_another_world_size(tmp_path):
    one = _train("--steps", 6, "--grad-accum", 2, "--out", tmp_path / "one")
    assert one.returncode == 0, one.stderr[-1500:]
    two = _train("--nproc", 2, "--zero", 1, "--steps", 3, "--out", tmp_path / "two")
    assert two.returncode == 0, two.stderr[-1500:]
    assert not (tmp_path / "two" / "checkpoint.tmp").exists()
    res = _train("--resume", tmp_path / "two", "--steps", 6, "--grad-accum", 2)  # saved on 2 ranks, resumed on 1
    assert res.returncode == 0, res.stderr[-1500:]
    assert "saved on 2 rank(s) and continues on 1" in res.stderr
    np.testing.assert_allclose(losses(tmp_path / "two"), losses(tmp_path / "one"), rtol=0, atol=2e-6)
    meta = json.loads((tmp_path / "two" / "checkpoint" / "meta.json").read_text())
    assert meta["world_size"] == 1 and meta["step"] == 6


def _start_long_run(out, *extra):
    args = [sys.executable, "-m", "llmgpu", "train", "--nproc", "3", "--device", "cpu", "--steps", "100000",
            "--batch", "2", "--seq", "32", "--eval-every", "0", "--no-progress", "--out", str(out), *extra]
    return subprocess.Popen(args, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


@needs_mpi
def test_a_refusal_on_rank_0_ends_every_rank_at_once_with_its_one_line(tmp_path):
    """Only rank 0 checks --out; its refusal must not leave rank 1 in a collective until --dist-timeout (which
    would then blame rank 1)."""
    assert _train("--steps", 1, "--out", tmp_path / "run").returncode == 0
    t = time.monotonic()
    p = _train("--nproc", 2, "--steps", 1, "--out", tmp_path / "run", "--dist-timeout", 60)
    assert time.monotonic() - t < 45 and p.returncode == 2
    assert [line for line in p.stderr.splitlines() if line.strip()] == [
        f"llmgpu: error: --out {tmp_path / 'run'} already holds a run: continue it with --resume {tmp_path / 'run'}, "
        "or give --overwrite to replace it"], p.stderr[-1500:]


@needs_mpi
@pytest.mark.skipif(sys.platform != "linux", reason="finds the ranks through /proc")
@pytest.mark.parametrize("sig, code", [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
def test_a_signal_to_the_launcher_stops_every_rank_after_one_checkpoint(tmp_path, sig, code):
    """SIGTERM/SIGINT to the launcher's own PID: every rank stops after the same step, rank 0 saves once, the
    exit code is the signal's, and no rank is left training after the launcher exits."""
    out = tmp_path / "sig"
    p = _start_long_run(out, "--zero", "1", "--log-every", "3")
    wait_for_steps(out, 4)
    ranks = [rank_pid(str(out), r) for r in range(3)]
    p.send_signal(sig)
    stdout, stderr = p.communicate(timeout=60)
    assert p.returncode == code, stderr[-1500:]
    end = time.monotonic() + 10  # Open MPI's launcher may return while its ranks finish exiting
    while [pid for pid in ranks if Path(f"/proc/{pid}").exists()] and time.monotonic() < end:
        time.sleep(0.1)
    assert not [pid for pid in ranks if Path(f"/proc/{pid}").exists()]
    summary = json.loads((out / "summary.json").read_text())
    meta = json.loads((out / "checkpoint" / "meta.json").read_text())
    assert summary["stop_reason"] == "interrupted" and summary["signal"] == signal.Signals(sig).name
    assert meta["step"] == summary["steps"] == _losses_steps(out)[-1]  # the checkpoint is of the last logged step
    assert not (out / "checkpoint.tmp").exists() and stderr.count("interrupted at step") == 1
    res = subprocess.run([sys.executable, "-m", "llmgpu", "train", "--resume", str(out), "--nproc", "3", "--device",
                          "cpu", "--steps", str(summary["steps"] + 2), "--no-progress"],
                         env=ENV, capture_output=True, text=True, timeout=180)
    assert res.returncode == 0, res.stderr[-1500:]  # and it continues


@needs_mpi
@pytest.mark.skipif(sys.platform != "linux", reason="finds the ranks through /proc")
def test_a_second_signal_to_the_launcher_kills_the_ranks_and_says_so(tmp_path):
    """The second Ctrl-C kills every rank at once: exit 130 and one line saying so, not exit 247 (-9) with
    "rank 0 died" as if a rank had failed."""
    out = tmp_path / "twice"
    p = _start_long_run(out, "--log-every", "1", "--batch", "16", "--seq", "128")  # steps of a few 100 ms
    wait_for_steps(out, 2, proc=p)
    ranks = [rank_pid(str(out), r) for r in range(3)]
    p.send_signal(signal.SIGINT)  # the ranks finish their step, then save...
    time.sleep(0.05)
    p.send_signal(signal.SIGINT)  # ...unless this comes first
    _, stderr = p.communicate(timeout=60)
    assert p.returncode == 130, stderr[-1500:]
    assert "llmgpu: a second SIGINT killed the ranks at once: the run keeps the last checkpoint it saved" in stderr
    assert "died" not in stderr and "exited with code" not in stderr, stderr[-1500:]
    end = time.monotonic() + 10
    while [pid for pid in ranks if Path(f"/proc/{pid}").exists()] and time.monotonic() < end:
        time.sleep(0.1)
    assert not [pid for pid in ranks if Path(f"/proc/{pid}").exists()]


@needs_mpi
@pytest.mark.skipif(sys.platform != "linux", reason="finds the ranks through /proc")
def test_a_second_signal_to_one_rank_ends_the_run_at_once(tmp_path):
    """Two SIGINTs to rank 1 alone: the second comes mid-step, where that rank stops at once. It closed its run as
    one process does, while rank 0 waited in the step's all-reduce: both hung until --dist-timeout (300 s)."""
    out = tmp_path / "one"
    # log syncs 20 steps apart: the first signal alone would stop the run only at the next one, seconds later
    p = _start_long_run(out, "--log-every", "20", "--batch", "16", "--seq", "128", "--save-every", "2")
    wait_for_steps(out, 5, proc=p)
    before = json.loads((out / "checkpoint" / "meta.json").read_text())["step"]
    r1 = rank_pid(str(out), 1)
    t = time.monotonic()
    os.kill(r1, signal.SIGINT)
    time.sleep(0.3)  # two signals closer together may reach Python's handler as one (then the run stops gracefully)
    os.kill(r1, signal.SIGINT)
    _, stderr = p.communicate(timeout=120)
    assert p.returncode == 130 and time.monotonic() - t < 60, stderr[-1500:]
    assert stderr.count("llmgpu: interrupted") == 1 and "Traceback" not in stderr, stderr[-1500:]  # said once
    assert re.search(r"llmgpu: interrupted: a second SIGINT stopped rank 1 at once (in|after) step \d+, and the run "
                     "with it: it keeps the last checkpoint it saved", stderr), stderr[-1500:]
    assert json.loads((out / "checkpoint" / "meta.json").read_text())["step"] >= before  # a whole checkpoint stays


def _losses_steps(run):
    return [json.loads(line)["step"] for line in open(Path(run) / "log.jsonl") if '"train"' in line]


@needs_mpi
def test_validation_is_the_same_on_any_number_of_ranks(tmp_path):
    """Validation reads eval_batches optimizer steps' worth of the same sequences, however the batch is split:
    2 ranks x batch 4 and 1 rank x 2 micro-batches of 4 report the same validation loss to fp32 rounding."""
    runs = {"one": ("--grad-accum", 2), "two": ("--nproc", 2)}
    for name, extra in runs.items():
        p = _train("--steps", 2, "--eval-every", 2, "--eval-batches", 3, "--out", tmp_path / name, *extra)
        assert p.returncode == 0, p.stderr[-1500:]
    val = {name: [json.loads(line)["val_loss"] for line in open(tmp_path / name / "log.jsonl") if '"val"' in line]
           for name in runs}
    assert len(val["one"]) == len(val["two"]) == 2  # steps 0 and 2
    np.testing.assert_allclose(val["two"], val["one"], rtol=2e-6)


@needs_mpi
@pytest.mark.slow
def test_two_ranks_drift_from_one_rank_only_as_rounding_does():
    """200 steps of 2 ranks against 1 rank at the same global batch (tests/workers/dist_drift.py).

    After the first step every gradient the update sees is bitwise the same except the tied embedding's: its
    two contributions (the LM head's and the lookup's) are added per micro-batch before the ranks' sum, after
    the previous micro-batch's on one rank, a rounding of ~1e-7. The losses then agree to ~1e-7 for many steps
    and grow to ~1e-3 later, because training amplifies any difference: one-rank runs that add the same sums in
    another order (the micro-batches reversed, or one micro-batch of 8) grow the same way to the same size."""
    p = subprocess.run([MPIEXEC, "-n", "2", sys.executable, str(ROOT / "tests" / "workers" / "dist_drift.py"), "200"],
                       env=ENV, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-2000:]
    res = json.loads(p.stdout.strip().splitlines()[-1])
    assert list(res["grad_differ"]) == ["transformer.wte.weight"]
    assert res["grad_differ"]["transformer.wte.weight"] < 1e-6
    loss = {k: np.array(v) for k, v in res["losses"].items()}
    rel = {k: np.abs(loss[k] - loss["ref"]) / np.abs(loss["ref"]) for k in ("ranks", "reversed", "whole")}
    for k, d in rel.items():
        assert d[:50].max() < 1e-5, (k, d[:50].max())  # a lost or doubled bucket would be ~lr: 1e-2 at once
    late = {k: d[100:].max() for k, d in rel.items()}
    twins = max(late["reversed"], late["whole"])
    assert twins > 1e-5, late  # the dynamics amplify rounding ...
    assert late["ranks"] < 5 * twins, late  # ... and the ranks' difference is of the same size as the twins'


@needs_mpi
@pytest.mark.skipif(sys.platform != "linux", reason="finds the ranks through /proc")
def test_a_killed_rank_stops_the_run_and_is_named(tmp_path):
    out = tmp_path / "killed"
    p = _start_long_run(out, "--dist-timeout", "60")
    wait_for_steps(out)
    os.kill(rank_pid(str(out), 1), signal.SIGKILL)
    t = time.monotonic()
    stdout, stderr = p.communicate(timeout=60)
    assert time.monotonic() - t < 30  # bounded: the others do not wait for the dead rank
    assert p.returncode == 128 + signal.SIGKILL, p.returncode  # the shell's code, not MPICH's 9
    # the rank is named; on a loaded machine the ranks may end too close together to order, and the line says so
    named = "llmgpu: rank 1 (pid" in stderr
    assert named or re.search(r"llmgpu: one of ranks [0-9, ]*\b1\b[0-9, ]* died", stderr), stderr[-500:]


@needs_mpi
@pytest.mark.skipif(sys.platform != "linux", reason="finds the ranks through /proc")
def test_a_hung_rank_makes_the_others_stop_within_the_timeout(tmp_path):
    out = tmp_path / "hung"
    p = _start_long_run(out, "--dist-timeout", "4")
    wait_for_steps(out)
    pid = rank_pid(str(out), 2)
    os.kill(pid, signal.SIGSTOP)
    try:
        t = time.monotonic()
        stdout, stderr = p.communicate(timeout=60)
    finally:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    assert time.monotonic() - t < 40
    assert p.returncode != 0
    # the rank that gave up says so in its one line, naming itself and the stopped rank; the launcher adds nothing
    assert re.search(rf"llmgpu: error: rank [01]: \w+ did not complete within 4 s: rank 2 \(pid {pid}\) is stopped "
                     r"\(SIGSTOP or a debugger\)", stderr), stderr[-500:]


def test_nccl_backend_on_cpu_is_one_clear_error(one_error_line):
    from llmgpu.cli import main

    one_error_line(main(["train", "--device", "cpu", "--dist-backend", "nccl", "--steps", "1"]),
                   "--dist-backend nccl needs the GPU")


def test_zero_stage_is_checked(one_error_line):
    from llmgpu.cli import main

    one_error_line(main(["train", "--device", "cpu", "--zero", "3"]), "--zero", "invalid choice")


def _stand_in_ranks(where, script, n=3):
    """``--nproc`` on GPUs watches its children itself: here stand-ins (``script`` reads RANK, and RANK_DIR for a
    directory of its own) under the launcher, in a new directory ``where``."""
    from llmgpu.dist.launch import _launch_gpu

    lines = []
    d = where / "ranks"
    d.mkdir(parents=True)
    env = dict(ENV, RANK_DIR=str(where), **{RANK_DIR_VAR: str(d)})
    rc = _launch_gpu(n, [sys.executable, "-c", script], env, str(d), lambda *a, **k: lines.append(a[0]))
    return rc, lines


def test_the_gpu_launcher_names_a_failed_rank_and_stops_the_others(tmp_path):
    rc, lines = _stand_in_ranks(tmp_path / "a", "pass")
    assert rc == 0 and not lines
    t = time.monotonic()
    rc, lines = _stand_in_ranks(tmp_path / "b", (
        "import os, sys, time\n"
        "open(os.path.join(os.environ['RANK_DIR'], 'pid' + os.environ['RANK']), 'w').write(str(os.getpid()))\n"
        "if os.environ['RANK'] == '1': time.sleep(0.5); sys.exit(3)\n"
        "time.sleep(60)"))
    assert time.monotonic() - t < 20 and rc == 3  # the others were stopped, not waited for
    assert lines == ["llmgpu: rank 1 exited with code 3; stopping the other ranks"]
    if sys.platform == "linux":
        assert not any(Path(f"/proc/{(tmp_path / 'b' / f'pid{r}').read_text()}").exists() for r in (0, 2))


def test_a_gpu_rank_that_refuses_the_run_ends_it_with_its_one_line(tmp_path):
    """A refusal on rank 0 (its error line, reported for the launcher) ends every rank; the launcher adds nothing."""
    t = time.monotonic()
    rc, lines = _stand_in_ranks(tmp_path, (
        "import os, sys, time\n"
        "from llmgpu.dist.launch import report_rank_error\n"
        "if os.environ['RANK'] == '0': report_rank_error('llmgpu: error: --out r holds a run'); sys.exit(2)\n"
        "time.sleep(60)"))
    assert rc == 2 and lines == [] and time.monotonic() - t < 20


@pytest.mark.skipif(sys.platform != "linux", reason="reads /proc and sends SIGSTOP")
def test_the_gpu_launcher_names_a_stopped_rank_and_leaves_no_process(tmp_path):
    """Rank 2 stops itself (SIGSTOP: a rank in a debugger, a frozen node); rank 0 times out waiting for it and says
    so. The launcher names the stopped rank, not the one that timed out, and kills every rank, the stopped one too."""
    t = time.monotonic()
    rc, lines = _stand_in_ranks(tmp_path, (
        "import os, signal, sys, time\n"
        "from llmgpu.dist.launch import report_rank_error\n"
        "open(os.path.join(os.environ['RANK_DIR'], 'pid' + os.environ['RANK']), 'w').write(str(os.getpid()))\n"
        "if os.environ['RANK'] == '2': os.kill(os.getpid(), signal.SIGSTOP)\n"
        "if os.environ['RANK'] == '0':\n"
        "    time.sleep(1.5); report_rank_error('llmgpu: error: rank 0: waited 1 s for the step'); sys.exit(2)\n"
        "time.sleep(60)"))
    assert rc == 2 and time.monotonic() - t < 20
    pid2 = (tmp_path / "pid2").read_text()
    assert lines == [f"llmgpu: rank 2 (pid {pid2}) is stopped (SIGSTOP or a debugger), so rank 0 could not finish its "
                     "collectives; stopping every rank"]
    assert not any(Path(f"/proc/{(tmp_path / f'pid{r}').read_text()}").exists() for r in (1, 2))


_TRAPS_SIGNALS = (
    "import os, signal, sys, time\n"
    "def stop(sig, frame):\n"
    "    open(os.path.join(os.environ['RANK_DIR'], f'saved{os.environ[\"RANK\"]}'), 'w').write(str(sig))\n"
    "    time.sleep(0.3); sys.exit(128 + sig)\n"
    "signal.signal(signal.SIGTERM, stop); signal.signal(signal.SIGINT, stop)\n"
    "open(os.path.join(os.environ['RANK_DIR'], 'up' + os.environ['RANK']), 'w').close()\n"
    "time.sleep(60)\n")


@pytest.mark.skipif(sys.platform != "linux", reason="sends POSIX signals")
@pytest.mark.parametrize("sig, code", [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
def test_the_gpu_launcher_passes_a_signal_to_every_rank_once(tmp_path, sig, code):
    """SIGTERM or SIGINT sent to the launcher's own PID reaches every rank exactly once (they run in a session of
    their own, so Ctrl-C in a terminal takes the same way); the launcher waits for them and exits with their code."""
    (tmp_path / "ranks").mkdir()
    launcher = ("import os, sys\nfrom llmgpu.dist.launch import _launch_gpu\n"
                f"sys.exit(_launch_gpu(2, [sys.executable, '-c', {_TRAPS_SIGNALS!r}], dict(os.environ), "
                f"{str(tmp_path / 'ranks')!r}, print))")
    p = subprocess.Popen([sys.executable, "-c", launcher], env=dict(ENV, RANK_DIR=str(tmp_path)))
    end = time.monotonic() + 60
    while not all((tmp_path / f"up{r}").exists() for r in range(2)):
        assert time.monotonic() < end and p.poll() is None, "the stand-in ranks never started"
        time.sleep(0.05)
    p.send_signal(sig)
    assert p.wait(timeout=30) == code
    assert [(tmp_path / f"saved{r}").read_text() for r in range(2)] == [str(int(sig))] * 2


def test_nproc_through_the_api_is_refused_not_ignored():
    from llmgpu.train import TrainConfig, Trainer
    from llmgpu.train.config import ConfigError

    with pytest.raises(ConfigError, match="a Trainer runs as one rank; start 2 ranks with llmgpu train --nproc 2"):
        Trainer(TrainConfig(device="cpu", nproc=2, steps=1))


@needs_mpi
def test_mpi_refuses_to_sum_what_it_cannot_sum():
    """MPI has no sum of raw bytes: a bf16 all-reduce or reduce-scatter is one TypeError, not MPI's error stack."""
    code = ("import numpy as np\nfrom llmgpu import backend\nfrom llmgpu.dist import MPIComm\nc = MPIComm()\n"
            "for f in (lambda x: c.all_reduce(x), lambda x: c.reduce_scatter(x, x.copy())):\n"
            "    try:\n        f(np.ones(4, backend.bfloat16))\n    except TypeError as e:\n        print(e)\n"
            "x = np.arange(4, dtype=np.float32)\nprint(c.all_reduce(x).tolist())\n")
    p = subprocess.run([sys.executable, "-c", code], env=ENV, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr[-1500:]
    lines = p.stdout.splitlines()
    assert lines[0] == ("all_reduce over MPI sums float32, float64 and int32 buffers, got bfloat16: reduce a float32 "
                        "copy (NCCL sums bf16 and fp16 itself)")
    assert lines[1].startswith("reduce_scatter over MPI sums") and lines[2] == "[0.0, 1.0, 2.0, 3.0]"
