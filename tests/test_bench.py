"""``llmgpu bench`` (chapter 8): the MFU formula, the results table, the llmgpu runner on NumPy, the
PyTorch reference model (when PyTorch is installed), and a whole quick run writing JSON."""

import argparse
import dataclasses
import json
import math
from dataclasses import replace

import numpy as np
import pytest

from llmgpu import bench, torch_reference
from llmgpu.model import GPT, GPTConfig
from llmgpu.perf.timing import mfu

pytestmark = pytest.mark.ch8

SMALL = GPTConfig(n_layer=2, n_head=2, n_embd=32, vocab_size=61, block_size=16)


# --------------------------------------------------------------------------- FLOPs and MFU


def test_flops_per_token_gpt2_small():
    cfg = GPTConfig.preset("gpt2")
    # 124,439,808 parameters; the position embedding (1024 x 768) costs no FLOPs
    assert cfg.flop_parameters() == 124_439_808 - 1024 * 768
    want = 6 * (124_439_808 - 1024 * 768) + 12 * 12 * 768 * 1024
    assert cfg.flops_per_token(1024) == pytest.approx(want, rel=1e-15)
    padded = replace(cfg, pad_vocab_to=64)
    assert padded.flop_parameters() - cfg.flop_parameters() == (50304 - 50257) * 768


def test_flop_parameters_agree_with_the_model():
    for cfg in (SMALL, GPTConfig.preset("gpt2"), replace(SMALL, pad_vocab_to=64)):
        assert cfg.flop_parameters() == cfg.num_parameters() - cfg.block_size * cfg.n_embd
        assert GPT(cfg, xp=np, init=False).num_parameters() == cfg.num_parameters()


def test_mfu():
    cfg = GPTConfig.preset("gpt2")
    fpt = cfg.flops_per_token(1024)
    # 500 K tokens/s at 800 TFLOP/s
    assert mfu(fpt, 500_000, 800.0) == pytest.approx(fpt * 5e5 / 8e14)
    assert 0.5 < mfu(fpt, 500_000, 800.0) < 0.6  # ~855 MFLOP per token
    assert math.isnan(mfu(fpt, 1.0, 0.0))


# --------------------------------------------------------------------------- the table


def test_format_results():
    rows = [
        {"mode": "llmgpu", "batch": 64, "seq": 1024, "dtype": "bf16", "ms_per_step": 120.0,
         "tokens_per_s": 546_133.0, "mfu": 0.41, "peak_memory_bytes": 30 * 2**30,
         "gpu_clocks": {"sm_mhz": 1620.0}},
        {"mode": "torch-eager", "skipped": "PyTorch is not installed"},
        {"mode": "llmgpu-graph", "error": "GraphCaptureError: cuBLAS refused"},
        {"mode": "torch-compile", "batch": 64, "seq": 1024, "dtype": "bf16", "ms_per_step": 133.0,
         "tokens_per_s": 492_000.0, "mfu": 0.37, "peak_memory_bytes": None},
    ]
    text = bench.format_results(rows, ceiling_tflops=790.0)
    lines = text.splitlines()
    assert lines[0].split()[0] == "mode"
    ours = next(ln for ln in lines if ln.startswith("llmgpu "))
    assert "64 x 1024" in ours and "546,133" in ours and "41.0%" in ours and "30.00" in ours and "1.11x" in ours
    assert ours.split()[-1] == "1620" and "median SM clock" in text
    assert "skipped: PyTorch is not installed" in text and "FAILED: GraphCaptureError" in text
    comp = next(ln for ln in lines if ln.startswith("torch-compile"))
    assert "1.00x" in comp and comp.split()[-3] == "-" and comp.split()[-1] == "-"  # no peak memory, no clock
    assert "6·N + 12·L·C·T" in text and "790" in text
    assert "vs compile" in lines[0]
    assert "1.11x" not in bench.format_results(rows[:1])  # no torch.compile row: no ratio
    assert "median SM clock" not in bench.format_results(rows[1:])  # no clock readings: no footnote


def test_format_results_keeps_its_columns_for_long_mode_names():
    """Chapter 8's table: modes longer than any fixed width (torch-compile-unpadded) keep every column aligned,
    and the notes under the table wrap at its width (the book's page holds ~100 characters)."""
    row = {"batch": 64, "seq": 1024, "dtype": "bf16", "ms_per_step": 109.15, "tokens_per_s": 600_410.0,
           "mfu": 0.647, "peak_memory_bytes": 33 * 2**30, "gpu_clocks": {"sm_mhz": 1658.0}}
    modes = ["llmgpu-fast-graph", "torch-compile", "torch-compile-unpadded", "llmgpu"]
    text = bench.format_results([{**row, "mode": m} for m in modes], ceiling_tflops=794.0)
    lines = text.splitlines()
    head, data = lines[0], [ln for ln in lines if ln.split()[0] in modes]
    assert len(data) == 4 and {len(ln) for ln in data} == {len(head)}  # every column ends where its header ends
    for name in ("tokens/s", "vs compile", "SM MHz"):
        end = head.index(name) + len(name)
        assert all(ln[end - 1] != " " and (end == len(ln) or ln[end] == " ") for ln in data), name
    assert max(len(ln) for ln in lines) == len(head) <= 100
    assert "6·N + 12·L·C·T" in text and "794 TFLOP/s" in text


# --------------------------------------------------------------------------- runners on NumPy


def test_run_llmgpu_on_numpy():
    r = bench.run_llmgpu(SMALL, batch=2, seq=16, steps=2, warmup=1, dtype="fp32", xp=np)
    assert r["framework"] == "llmgpu" and r["mode"] == "llmgpu"
    assert r["ms_per_step"] > 0 and r["tokens_per_s"] == pytest.approx(2 * 16 / (r["ms_per_step"] * 1e-3))
    assert math.isfinite(r["final_loss"]) and abs(r["final_loss"] - math.log(61)) < 1.0
    assert r["peak_memory_bytes"] is None  # no memory pool on NumPy
    with pytest.raises(ValueError, match="GPU"):
        bench.run_llmgpu(SMALL, batch=1, seq=8, steps=1, warmup=0, dtype="fp32", xp=np, graph=True)


def test_run_llmgpu_passes_the_fast_models_options():
    from llmgpu.model import FastOptions

    opts = FastOptions(attention_kernel="ours", lm_head_rows=5)
    step, model = bench.make_train_step(SMALL, 2, 8, dtype="fp32", xp=np, fast=True, options=opts)
    assert model.options is opts
    r = bench.run_llmgpu(SMALL, batch=2, seq=8, steps=1, warmup=0, dtype="fp32", xp=np, fast=True, options=opts)
    assert r["attention_kernel"] == "ours" and r["attention_kernels"] == {}  # NumPy: the reference, nothing resolved
    assert "attention_kernel" not in bench.run_llmgpu(SMALL, batch=2, seq=8, steps=1, warmup=0, dtype="fp32", xp=np)
    with pytest.raises(ValueError, match="options= are the fast model's"):
        bench.make_train_step(SMALL, 2, 8, dtype="fp32", xp=np, options=opts)
    assert bench.add_arguments(argparse.ArgumentParser()).parse_args(["--attention-kernel", "cudnn"]).attention_kernel \
        == "cudnn"


def _args(**kw):
    p = bench.add_arguments(argparse.ArgumentParser())
    ns = p.parse_args([])
    for k, v in kw.items():
        setattr(ns, k, v)
    return ns


def test_bench_main_quick_run_writes_json(tmp_path, capsys):
    out = tmp_path / "bench.json"
    rc = bench.bench_main(_args(device="cpu", preset="tiny", batch=2, seq=16, steps=1, warmup=0,
                                modes="llmgpu,torch-eager", json=str(out)))
    assert rc == 0
    text = capsys.readouterr().out
    assert "FLOPs per token" in text and "llmgpu" in text and f"wrote {out}" in text
    first = text.splitlines()[0]
    assert first.startswith("note: no GPU") and "need a GPU" in first  # a CPU run says so, first
    data = json.loads(out.read_text())
    assert data["gpu"] is False and "need a GPU" in data["note"]
    assert data["benchmark"] == "llmgpu bench" and data["batch"] == 2 and data["seq"] == 16
    assert "6·N" in data["mfu_definition"] and data["gemm_ceiling_tflops"] > 0 and "NumPy" in data["gemm_ceiling"]
    modes = [r["mode"] for r in data["results"]]
    assert modes == ["llmgpu", "torch-eager"]
    ours = data["results"][0]
    assert ours["tokens_per_s"] > 0 and ours["mfu"] > 0 and ours["flops_per_token"] == data["flops_per_token"]
    torch_row = data["results"][1]
    assert "tokens_per_s" in torch_row or "skipped" in torch_row or "error" in torch_row
    assert "date" in data and "device" in data  # the results header of llmgpu.perf.timing.save_results


def test_bench_main_rejects_unknown_modes():
    with pytest.raises(ValueError, match="unknown mode"):
        bench.bench_main(_args(device="cpu", modes="llmgpu,jax"))


# --------------------------------------------------------------------------- the PyTorch reference


def _torch_or_skip():
    return pytest.importorskip("torch", reason="PyTorch is not installed: the reference model is not tested here")


@pytest.mark.parametrize("pad", [0, 64])
def test_torch_reference_matches_llmgpu_model(pad):
    torch = _torch_or_skip()
    cfg = replace(SMALL, pad_vocab_to=pad)
    model = GPT(cfg, dtype="fp32", xp=np, seed=3)
    rng = np.random.default_rng(0)
    idx = rng.integers(0, cfg.vocab_size, (2, 16)).astype(np.int32)
    tgt = rng.integers(0, cfg.vocab_size, (2, 16)).astype(np.int32)
    _, loss = model.forward(idx, tgt)
    tm = torch_reference.build_torch_gpt(cfg, state_dict=model.state_dict(), device="cpu", mask_padded=True)
    assert tm.transformer.wte.weight is tm.lm_head.weight  # tied
    with torch.no_grad():
        tl = tm(torch.from_numpy(idx.astype(np.int64)), torch.from_numpy(tgt.astype(np.int64)))
    assert float(tl) == pytest.approx(float(loss), rel=1e-5)
    # and the gradients of one backward pass
    model.zero_grad()
    model.forward_backward(idx, tgt)
    tl = tm(torch.from_numpy(idx.astype(np.int64)), torch.from_numpy(tgt.astype(np.int64)))
    tl.backward()
    tg = dict(tm.named_parameters())
    for name in ("transformer.h.1.mlp.c_fc.weight", "transformer.h.0.attn.c_attn.bias", "transformer.wpe.weight",
                 "transformer.ln_f.weight"):
        ours = model.grads()[name]
        theirs = tg[name].grad.numpy()
        assert np.linalg.norm(ours - theirs) <= 1e-4 * np.linalg.norm(theirs) + 1e-7, name
    V = cfg.vocab_size  # the tied embedding / LM head is listed once, under its first name
    ours = model.grads()["transformer.wte.weight"][:V]
    theirs = tg["transformer.wte.weight"].grad.numpy()[:V]
    assert np.linalg.norm(ours - theirs) <= 1e-4 * np.linalg.norm(theirs)


def test_torch_reference_init_and_run_on_cpu():
    torch = _torch_or_skip()
    tm = torch_reference.build_torch_gpt(SMALL, device="cpu", seed=1)
    names = {n for n, _ in tm.named_parameters()}
    assert "transformer.h.0.mlp.c_proj.weight" in names and "lm_head.weight" not in names  # tied: listed once
    std = float(tm.transformer.h[0].mlp.c_proj.weight.std())
    assert std == pytest.approx(0.02 / math.sqrt(2 * SMALL.n_layer), rel=0.2)
    assert float(tm.transformer.h[0].attn.c_attn.bias.abs().max()) == 0.0
    r = torch_reference.run_torch(SMALL, 2, 16, steps=2, mode="eager", warmup=1, dtype="fp32", device="cpu")
    assert r["mode"] == "torch-eager" and r["tokens_per_s"] > 0 and math.isfinite(r["final_loss"])
    assert r["torch"] == torch.__version__
    with pytest.raises(ValueError, match="mode"):
        torch_reference.run_torch(SMALL, 2, 16, steps=1, mode="jit", device="cpu")


# --------------------------------------------------------------------------- GPU


@pytest.mark.gpu
def test_gpu_run_llmgpu_reports_memory(cp):
    r = bench.run_llmgpu(replace(SMALL, n_embd=64, n_head=4), batch=4, seq=16, steps=3, warmup=1, dtype="bf16")
    assert r["peak_memory_bytes"] >= r["static_memory_bytes"] > 0
    assert math.isfinite(r["final_loss"]) and r["tokens_per_s"] > 0


# --------------------------------------------------------------------------- the scale table and the fair settings


def test_largest_batch_halves_on_oom_only():
    from llmgpu import bench_scale

    calls = []

    def run(b):
        calls.append(b)
        if b > 8:
            raise MemoryError(f"out of memory at batch {b}")
        return {"batch": b}

    b, r, tried = bench_scale.largest_batch(run, 64, log=lambda *_: None)
    assert b == 8 and r == {"batch": 8} and calls == [64, 32, 16, 8] and tried == [(64, "OOM"), (32, "OOM"),
                                                                               (16, "OOM")]
    assert bench_scale.largest_batch(run, 64, min_batch=16, log=lambda *_: None)[0] is None

    def broken(b):
        raise RuntimeError("not a memory problem")

    with pytest.raises(RuntimeError, match="not a memory"):
        bench_scale.largest_batch(broken, 4, log=lambda *_: None)
    assert bench_scale.is_oom(RuntimeError("CUDA out of memory. Tried to allocate 2 GiB"))
    assert not bench_scale.is_oom(ValueError("bad shape"))
    # the start estimate grows with the memory and shrinks with the model
    gpt2, d48 = GPTConfig.preset("gpt2", pad_vocab_to=64), GPTConfig.preset("d48", pad_vocab_to=64)
    e = [bench_scale.estimated_batch(gpt2, 1024, g * 2**30) for g in (20, 40, 80, 140)]
    assert e == sorted(e) and e[0] >= 8 and e[-1] <= bench_scale.MAX_BATCH
    assert bench_scale.estimated_batch(d48, 1024, 140 * 2**30) < e[-1]
    assert bench_scale.estimated_batch(d48, 1024, 140 * 2**30, checkpoint_every=1) > \
        bench_scale.estimated_batch(d48, 1024, 140 * 2**30)


def test_scale_table_on_the_cpu_with_checkpointing_where_needed(tmp_path, monkeypatch, capsys):
    """Two presets through `llmgpu bench --preset a,b`; llmgpu 'runs out of memory' above batch 2 without
    checkpointing (min batch 4): the table falls back to --checkpoint-every 1; the JSON merges by preset."""
    from llmgpu import bench_scale, cli

    real = bench_scale.run_llmgpu

    def fake(cfg, b, seq, *a, checkpoint_every=0, **kw):
        if b > 2 and not checkpoint_every:
            raise MemoryError("out of memory (simulated)")
        return real(cfg, b, seq, *a, checkpoint_every=checkpoint_every, **kw)

    monkeypatch.setattr(bench_scale, "run_llmgpu", fake)
    out = tmp_path / "scale.json"
    out.write_text(json.dumps({"presets": {"d48": {"preset": "d48", "kept": True}}}))
    rc = cli.main(["bench", "--device", "cpu", "--preset", "tiny,d6", "--seq", "16", "--batch", "4", "--steps", "1",
                   "--warmup", "0", "--compile-mode", "none", "--checkpoint-every", "1", "--min-batch", "4",
                   "--json", str(out)])
    assert rc == 0
    text = capsys.readouterr().out
    assert "batch 4: out of memory" in text and "4c1" in text and "ratio" in text
    data = json.loads(out.read_text())
    assert set(data["presets"]) == {"tiny", "d6", "d48"} and data["presets"]["d48"]["kept"]
    row = data["presets"]["tiny"]
    assert row["llmgpu"]["batch"] == 4 and row["llmgpu"]["checkpoint_every"] == 1
    assert row["llmgpu"]["tried"] == [[4, "OOM"]] and row["llmgpu"]["mfu"] > 0
    assert row["flops_per_token"] == GPTConfig.preset("tiny", block_size=128).flops_per_token(16)
    t = row["torch"]
    assert t.get("mode") == "torch-eager" or "skipped" in t
    from llmgpu.plotting import plot_scale_table

    png = tmp_path / "scale.png"
    plot_scale_table({k: v for k, v in data["presets"].items() if k != "d48"}, png)
    assert png.stat().st_size > 1000


def test_scale_table_one_framework_per_command_merges_into_one_row(tmp_path, capsys):
    """`--modes llmgpu-fast` then `--modes torch-eager`: each command saves its side as soon as it is measured,
    the second keeps the first's side, and the ratio is taken from both."""
    from llmgpu import bench_scale, cli

    out = tmp_path / "scale.json"
    common = ["bench", "--device", "cpu", "--preset", "tiny", "--scale-table", "--seq", "16", "--batch", "2",
              "--steps", "1", "--warmup", "0", "--compile-mode", "none", "--json", str(out)]
    assert cli.main(common + ["--modes", "llmgpu-fast"]) == 0
    row = json.loads(out.read_text())["presets"]["tiny"]
    assert row["llmgpu"]["tokens_per_s"] > 0 and row["torch"]["skipped"] == "not measured"
    assert row["llmgpu_over_torch"] is None
    first = row["llmgpu"]
    assert first["date"] and first["gemm_ceiling_tflops"] > 0  # each side says when and against what it ran
    assert cli.main(common + ["--modes", "torch-eager"]) == 0
    data = json.loads(out.read_text())
    row = data["presets"]["tiny"]
    if row["torch"].get("tokens_per_s"):  # PyTorch installed
        assert row["llmgpu_over_torch"] == row["llmgpu"]["tokens_per_s"] / row["torch"]["tokens_per_s"]
        assert row["torch"]["date"] and data["torch"]
    assert row["llmgpu"] == first  # kept from the first command
    torch_version = data["torch"]
    assert cli.main(common + ["--modes", "llmgpu-fast"]) == 0  # measuring llmgpu again keeps the file's torch
    assert json.loads(out.read_text())["torch"] == torch_version
    assert "] tiny: L=" in capsys.readouterr().out  # progress lines carry the elapsed time
    with pytest.raises(ValueError, match="llmgpu"):
        bench_scale._sides(_args(modes="bogus"))


def test_scale_table_without_a_preset_measures_the_default_one(tmp_path, capsys):
    """``--scale-table`` alone: the preset bench measures by default (per its help), not an empty table; --json in a
    folder that does not exist yet is made."""
    from llmgpu import cli

    out = tmp_path / "new" / "scale.json"
    assert cli.main(["bench", "--device", "cpu", "--scale-table", "--seq", "16", "--batch", "2", "--steps", "1",
                     "--warmup", "0", "--compile-mode", "none", "--modes", "llmgpu-fast", "--json", str(out)]) == 0
    assert list(json.loads(out.read_text())["presets"]) == [bench.BENCH_DEFAULTS["cpu"]["preset"]]
    assert "tiny" in capsys.readouterr().out


@pytest.mark.parametrize("flags, needles", [
    (["--warmup", "-2"], ["--warmup must be >= 0, got -2"]),
    (["--vocab-size", "0"], ["--vocab-size must be >= 2, got 0"]),
    (["--seq", "100000"], ["--seq 100000 exceeds the model's block size 128 (the tiny preset's)", "--block-size"]),
    (["--block-size", "0"], ["--block-size must be >= 1"]),
    (["--scale-table", "--warmup", "-2"], ["--warmup must be >= 0"]),
    (["--scale-table", "--seq", "100000"], ["--seq 100000 exceeds the model's block size 128"]),
])  # fmt: skip
def test_bench_refuses_what_train_refuses_before_it_builds_a_model(flags, needles, monkeypatch, one_error_line):
    """The flags bench shares with train (``bench.TRAIN_FLAGS``) follow train's rules: one line, nothing built."""
    from llmgpu import bench_scale, cli

    def run_llmgpu(*a, **kw):
        raise AssertionError("a model was built")

    monkeypatch.setattr(bench, "run_llmgpu", run_llmgpu)
    monkeypatch.setattr(bench_scale, "run_llmgpu", run_llmgpu)
    one_error_line(cli.main(["bench", "--device", "cpu", "--preset", "tiny", "--steps", "1", "--batch", "2", *flags]),
                   *needles)


def test_bench_block_size_makes_room_for_a_longer_seq(tmp_path):
    out = tmp_path / "b.json"
    assert bench.bench_main(_args(device="cpu", preset="tiny", batch=1, seq=160, block_size=160, steps=1, warmup=0,
                                  modes="llmgpu", no_ceiling=True, json=str(out))) == 0
    assert json.loads(out.read_text())["model"]["block_size"] == 160


@pytest.mark.parametrize("where, needle", [(".", "is a directory"), ("a.txt/b.json", "a.txt is not a directory"),
                                           ("a.txt", "exists and is not an earlier result")])
def test_bench_refuses_a_json_path_it_cannot_write_before_it_runs(tmp_path, monkeypatch, where, needle,
                                                                   one_error_line):
    from llmgpu import cli

    def bench_main(args):
        raise AssertionError("measured before the --json path was checked")

    monkeypatch.setattr(bench, "bench_main", bench_main)
    (tmp_path / "a.txt").write_text("a file")
    one_error_line(cli.main(["bench", "--device", "cpu", "--json", str(tmp_path / where)]), "--json", needle)


def test_bench_pads_both_frameworks_alike_by_default_and_takes_the_torch_options():
    a = _args()
    assert a.pad_vocab == 64 and a.compile_mode == "default" and a.sdpa == "auto"
    assert "torch-compile-unpadded" in bench.MODES and "torch-compile-unpadded" not in bench.DEFAULT_MODES
    p = bench.add_arguments(argparse.ArgumentParser())
    for m in torch_reference.COMPILE_MODES:
        assert p.parse_args(["--compile-mode", m]).compile_mode == m
    assert bench.wants_scale_table(_args(preset="gpt2,d24")) and not bench.wants_scale_table(_args(preset="gpt2"))
    assert bench.wants_scale_table(_args(preset="gpt2", scale_table=True))
    with pytest.raises(ValueError, match="scale table"):
        bench.bench_main(_args(device="cpu", preset="tiny,d6"))


def test_bench_compile_mode_none_skips_the_compile_rows(capsys):
    rc = bench.bench_main(_args(device="cpu", preset="tiny", batch=2, seq=16, steps=1, warmup=0,
                                modes="llmgpu,torch-compile", compile_mode="none", no_ceiling=True))
    assert rc == 0
    text = capsys.readouterr().out
    assert "skipped: --compile-mode none" in text or "skipped: PyTorch is not installed" in text


def test_torch_reference_checkpointing_compile_mode_and_sdpa_on_cpu():
    torch = _torch_or_skip()
    kw = dict(steps=2, mode="eager", warmup=0, dtype="fp32", device="cpu", seed=3)
    r0 = torch_reference.run_torch(SMALL, 2, 16, **kw)
    r1 = torch_reference.run_torch(SMALL, 2, 16, checkpoint_every=1, sdpa="math", **kw)
    assert r1["final_loss"] == pytest.approx(r0["final_loss"], rel=1e-6)  # recomputation changes no value
    assert r1["checkpoint_every"] == 1 and r1["sdpa_backend"] == "math" and r1["vocab"] == SMALL.padded_vocab_size
    with pytest.raises(ValueError, match="compile_mode"):
        torch_reference.run_torch(SMALL, 2, 16, steps=1, mode="compile", compile_mode="fastest", device="cpu")
    with pytest.raises(ValueError, match="SDPA"):
        torch_reference.sdpa_context(torch, "triton")
    pick = torch_reference.pick_sdpa_backend(SMALL, 2, 16, device="cpu")
    assert pick["backend"] is None and "CUDA" in pick["errors"]["all"]


@pytest.mark.gpu
def test_gpu_pick_sdpa_backend_times_flash_and_cudnn(cp):
    torch = _torch_or_skip()
    if not torch.cuda.is_available():
        pytest.skip("PyTorch has no CUDA device")
    cfg = GPTConfig.preset("gpt2")
    pick = torch_reference.pick_sdpa_backend(cfg, 4, 1024)
    assert pick["backend"] in ("flash", "cudnn")
    assert pick["ms"][pick["backend"]] == min(t for t in pick["ms"].values() if t is not None)
    assert torch_reference.pick_sdpa_backend(cfg, 4, 1024) is pick  # measured once


def test_grouped_bars_draws_one_bar_per_present_pair():
    """Chapter 2b's TFLOP/s bars: one group per shape, one bar per implementation that has a value there."""
    import matplotlib

    matplotlib.use("Agg")
    from llmgpu.plotting import grouped_bars

    vals = {("ours", "a"): 1.0, ("cudnn", "a"): 2.0, ("cudnn", "b"): 3.0}  # no "ours" at "b"
    ax = grouped_bars(vals, ["a", "b"], ["ours", "cudnn"], ylabel="TFLOP/s", group_label=str.upper)
    heights = sorted(p.get_height() for p in ax.patches)
    assert heights == [1.0, 2.0, 3.0]
    assert [t.get_text() for t in ax.get_xticklabels()] == ["A", "B"] and ax.get_legend() is not None
    assert grouped_bars(vals, ["a"], ["ours"], legend=False).get_legend() is None


@pytest.mark.parametrize("n", [3, 13, 27])
def test_grouped_bars_gives_every_series_its_own_colour(n):
    """Chapter 2b's wgmma tile shapes: 13 series, more than the ten colours of the default cycle."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from llmgpu.plotting import grouped_bars

    series = [f"variant {i}" for i in range(n)]
    ax = grouped_bars({(s, "g"): 1.0 + i for i, s in enumerate(series)}, ["g"], series)
    colours = [tuple(p.get_facecolor()) for p in ax.patches]
    assert len(colours) == n and len(set(colours)) == n
    legend = [tuple(h.get_facecolor()) for h in ax.get_legend().legend_handles]
    assert legend == colours  # the legend's swatches are the bars' colours
    plt.close(ax.figure)


def test_scale_table_tries_in_their_own_processes(tmp_path, monkeypatch):
    """On a GPU each try (framework, batch) runs in a fresh process (`python -m llmgpu.bench_scale`): here forced
    on the CPU. The result comes back whole; an out-of-memory exit halves the batch; any other failure says why."""
    import subprocess

    from llmgpu import bench_scale, cli

    cfg = GPTConfig.preset("tiny", block_size=16)
    spec = {"device": "cpu", "config": dataclasses.asdict(cfg), "seq": 16, "steps": 1, "dtype": "fp32", "seed": 0,
            "batch": 2, "checkpoint_every": 0, "warmup": 0}
    r = bench_scale.run_isolated("llmgpu", spec)
    assert r["batch"] == 2 and r["tokens_per_s"] > 0 and math.isfinite(r["final_loss"])
    with pytest.raises(RuntimeError, match="unknown kind"):
        bench_scale.run_isolated("jax", spec)

    real = subprocess.run
    calls = []

    def fake(cmd, **kw):  # the try at batch 4 'runs out of memory' in its process
        calls.append(json.loads(cmd[4])["batch"])
        if calls[-1] > 2:
            return subprocess.CompletedProcess(cmd, bench_scale.EXIT_OOM, "", "out of memory: simulated")
        return real(cmd, **kw)

    monkeypatch.setattr(bench_scale.subprocess, "run", fake)
    monkeypatch.setattr(bench_scale, "_isolated", lambda args, gpu: True)
    out = tmp_path / "scale.json"
    rc = cli.main(["bench", "--device", "cpu", "--preset", "tiny", "--scale-table", "--seq", "16", "--batch", "4",
                   "--steps", "1", "--warmup", "0", "--compile-mode", "none", "--modes", "llmgpu-fast",
                   "--json", str(out)])
    row = json.loads(out.read_text())["presets"]["tiny"]["llmgpu"]
    assert rc == 0 and calls == [4, 2] and row["batch"] == 2 and row["tried"] == [[4, "OOM"]]


def test_profile_step_tool_prints_and_saves_the_per_op_table(tmp_path, capsys):
    """tools/probes/profile_step.py (chapter 8's per-op table for any preset; on the GPU for d36 beside gpt2),
    on NumPy."""
    import runpy
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "tools" / "probes" / "profile_step.py"
    tool = runpy.run_path(str(path), run_name="tool")
    js = tmp_path / "p.json"
    assert tool["main"](["--preset", "tiny", "--batch", "2", "--seq", "16", "--reps", "1", "--top", "5",
                         "--device", "cpu", "--json", str(js)]) == 0
    text = capsys.readouterr().out
    assert "tiny (1M) fast step, B=2 T=16 fp32" in text and "calls  total ms" in text
    data = json.loads(js.read_text())
    assert data["preset"] == "tiny" and data["step"] == "fast" and len(data["rows"]) > 5
    assert abs(sum(r["pct_of_step"] for r in data["rows"] if r.get("depth", 0) == 0) - 100) < 25
