"""``llmgpu bench``'s FP8 modes (issue 37, chapter 5b): llmgpu-fp8-graph (the fast step with FP8 GEMMs) against
torch-compile-fp8 (torchao's float8 training + torch.compile): the options that reach the model, the one-line reasons
where FP8 cannot run, the layers torchao converts, the table's "vs fp8" column and the ratios. PyTorch and torchao
are faked where they are absent; the real ones run in the GPU test at the end."""

import argparse
import json
import math
import sys
import types
from dataclasses import replace

import numpy as np
import pytest

from llmgpu import bench, bench_fp8, torch_reference
from llmgpu.model import GPT, FastOptions, GPTConfig
from llmgpu.model.options import FP8_LINEARS, FP8_ONLY_GPT2

pytestmark = pytest.mark.ch8

SMALL = GPTConfig(n_layer=2, n_head=2, n_embd=32, vocab_size=61, block_size=16)


def _args(**kw):
    ns = bench.add_arguments(argparse.ArgumentParser()).parse_args([])
    for k, v in kw.items():
        setattr(ns, k, v)
    return ns


# --------------------------------------------------------------------------- modes and flags


def test_fp8_modes_are_offered_but_not_default():
    assert {"llmgpu-fp8-graph", "torch-compile-fp8"} <= set(bench.MODES)
    assert bench.DEFAULT_MODES == ("llmgpu", "llmgpu-fast-graph", "torch-eager", "torch-compile")
    p = bench.add_arguments(argparse.ArgumentParser())
    assert p.parse_args([]).fp8_recipe is None  # "current" where llmgpu-fp8-graph runs; a note where it does not
    assert p.parse_args(["--fp8-recipe", "delayed"]).fp8_recipe == "delayed"
    with pytest.raises(SystemExit):
        p.parse_args(["--fp8-recipe", "hybrid"])


# --------------------------------------------------------------------------- the llmgpu side


class _RecordingModel(GPT):
    """The book GPT standing in for FastGPT (whose FP8 step is the lead's): it keeps the options it was given."""

    built: list = []

    def __init__(self, config, *, options=None, **kw):
        super().__init__(config, **kw)
        self.options = options
        self.kernel_choices = types.SimpleNamespace(as_dict=dict)
        _RecordingModel.built.append(options)


def test_run_llmgpu_names_the_fp8_step_and_records_its_recipe(monkeypatch):
    monkeypatch.setattr(bench, "fast_model_class", lambda config: _RecordingModel)
    _RecordingModel.built.clear()
    opts = FastOptions(fp8="delayed")
    r = bench.run_llmgpu(SMALL, batch=2, seq=8, steps=1, warmup=0, dtype="fp32", xp=np, fast=True, options=opts)
    assert _RecordingModel.built == [opts]
    assert r["mode"] == "llmgpu-fp8" and r["fp8_recipe"] == "delayed" and math.isfinite(r["final_loss"])
    plain = bench.run_llmgpu(SMALL, batch=2, seq=8, steps=1, warmup=0, dtype="fp32", xp=np, fast=True,
                             options=FastOptions())
    assert plain["mode"] == "llmgpu-fast" and "fp8_recipe" not in plain  # the bf16 rows as they were


def _fake_run_llmgpu(calls, tokens):
    def run(cfg, batch, seq, steps, *, options=None, graph=False, fast=False, **kw):
        calls.append({"options": options, "graph": graph, "fast": fast, "dtype": kw["dtype"]})
        fp8 = options.fp8 if options else "off"
        mode = "llmgpu" + ("-fp8" if fp8 != "off" else "-fast" if fast else "") + ("-graph" if graph else "")
        row = {"framework": "llmgpu", "mode": mode, "batch": batch, "seq": seq, "dtype": kw["dtype"],
               "ms_per_step": 1.0, "tokens_per_s": tokens[mode], "final_loss": 4.0, "peak_memory_bytes": None,
               "vocab": cfg.padded_vocab_size, "timed_window": [0.0, 1.0]}
        return {**row, "fp8_recipe": fp8} if fp8 != "off" else row
    return run


@pytest.mark.parametrize("recipe", ["current", "delayed"])
def test_bench_main_passes_the_recipe_to_the_fp8_step(recipe, monkeypatch, tmp_path, capsys):
    """Where FP8 can run (pretended: the GPU check answers None), llmgpu-fp8-graph is the fast step as a CUDA graph
    with FastOptions(fp8=--fp8-recipe), the attention settings kept; the JSON records the recipe and the ratios."""
    calls = []
    monkeypatch.setattr(bench_fp8, "fp8_unavailable_reason", lambda xp: None)
    monkeypatch.setattr(bench, "run_llmgpu", _fake_run_llmgpu(calls, {"llmgpu-fast-graph": 500.0,
                                                                      "llmgpu-fp8-graph": 600.0}))
    out = tmp_path / "b.json"
    rc = bench.bench_main(_args(device="cpu", preset="tiny", batch=2, seq=16, steps=1, warmup=0, dtype="bf16",
                                modes="llmgpu-fast-graph,llmgpu-fp8-graph", fp8_recipe=recipe, no_ceiling=True,
                                attention_kernel="ours", json=str(out)))
    assert rc == 0
    fast, fp8 = calls
    assert fast["options"].fp8 == "off" and fast["graph"] and fast["fast"]
    assert fp8["options"] == FastOptions(attention_kernel="ours", fp8=recipe) and fp8["graph"] and fp8["fast"]
    assert fp8["dtype"] == "bf16"
    text = capsys.readouterr().out
    assert f"llmgpu-fp8-graph (fp8 {recipe}) / llmgpu-fast-graph (bf16) tokens/s: 1.200" in text
    data = json.loads(out.read_text())
    assert data["fp8_recipe"] == recipe and data["llmgpu_fp8_over"] == {"llmgpu-fast-graph": pytest.approx(1.2)}
    rows = {r["mode"]: r for r in data["results"]}
    assert rows["llmgpu-fp8-graph"]["fp8_recipe"] == recipe and "fp8_recipe" not in rows["llmgpu-fast-graph"]
    assert data["llmgpu_best_mode"] == "llmgpu-fast-graph"  # the bf16 comparisons stay bf16 against bf16


@pytest.mark.parametrize("kw,needle", [  # this machine has no GPU: that is said first, whatever else is off
    ({"dtype": "fp32"}, "FP8 GEMMs need a GPU with FP8 tensor cores (sm_89+"),
    ({"dtype": "bf16"}, "FP8 GEMMs need a GPU with FP8 tensor cores (sm_89+"),
    ({"arch": "llama", "preset": "llama-tiny", "dtype": "bf16"}, "FP8 GEMMs need a GPU with FP8 tensor cores (sm_89+"),
])
def test_fp8_modes_that_cannot_run_are_skipped_with_one_line(kw, needle, capsys):
    rc = bench.bench_main(_args(device="cpu", batch=2, seq=16, steps=1, warmup=0, no_ceiling=True,
                                modes="llmgpu,llmgpu-fp8-graph,torch-compile-fp8", **{"preset": "tiny", **kw}))
    assert rc == 0  # the llmgpu row ran
    text = capsys.readouterr().out
    line = next(ln for ln in text.splitlines() if ln.startswith("llmgpu-fp8-graph "))
    assert line.split(None, 1)[1].startswith("skipped: ") and needle in line
    tline = next(ln for ln in text.splitlines() if ln.startswith("torch-compile-fp8 "))
    assert tline.split(None, 1)[1].startswith("skipped: ")
    if "torch" not in sys.modules:  # PyTorch absent: that is its reason; present: torchao's check says why
        assert "PyTorch is not installed" in tline
    else:
        assert needle in tline


def test_an_fp8_recipe_without_an_fp8_mode_is_said_to_be_ignored(capsys):
    args = dict(device="cpu", batch=2, seq=16, steps=1, warmup=0, no_ceiling=True, preset="tiny", modes="llmgpu")
    assert bench.bench_main(_args(fp8_recipe="delayed", **args)) == 0
    assert "note: --fp8-recipe delayed is ignored" in capsys.readouterr().out
    assert bench.bench_main(_args(**args)) == 0  # not given: nothing to say
    assert "--fp8-recipe" not in capsys.readouterr().out


def test_fp8_skip_reason_names_the_hardware_first_then_the_setting(monkeypatch):
    assert "none is in use" in bench_fp8.fp8_skip_reason("llmgpu-fp8-graph", "llama", "fp32", np, None)
    monkeypatch.setattr(bench_fp8, "fp8_unavailable_reason", lambda xp: None)  # as on a GPU with FP8 tensor cores
    why = lambda arch, dtype: bench_fp8.fp8_skip_reason("llmgpu-fp8-graph", arch, dtype, np, None)  # noqa: E731
    assert "--dtype bf16), not fp32" in why("gpt2", "fp32") and FP8_ONLY_GPT2 in why("llama", "bf16")
    assert why("gpt2", "bf16") is None
    assert bench_fp8.fp8_skip_reason("llmgpu-fast-graph", "llama", "fp32", np, None) is None  # not an FP8 mode


# --------------------------------------------------------------------------- the table and the ratios


ROW = {"batch": 64, "seq": 1024, "dtype": "bf16", "ms_per_step": 100.0, "mfu": 0.5, "peak_memory_bytes": 2**34,
       "gpu_clocks": {"sm_mhz": 1700.0}}


def test_table_gives_fp8_rows_their_ratio_to_torchao_and_to_torch_compile():
    rows = [{**ROW, "mode": "llmgpu-fast-graph", "tokens_per_s": 600_000.0},
            {**ROW, "mode": "llmgpu-fp8-graph", "tokens_per_s": 720_000.0, "fp8_recipe": "current"},
            {**ROW, "mode": "torch-compile", "tokens_per_s": 500_000.0},
            {**ROW, "mode": "torch-compile-fp8", "tokens_per_s": 600_000.0, "fp8_recipe": "torchao tensorwise"},
            {"mode": "torch-eager", "skipped": "PyTorch is not installed"}]
    text = bench.format_results(rows, ceiling_tflops=790.0)
    lines = text.splitlines()
    head = lines[0]
    assert "vs compile" in head and "vs fp8" in head and head.index("vs fp8") < head.index("SM MHz")
    data = {ln.split()[0]: ln for ln in lines[2:] if ln.split() and ln.split()[0] in {r["mode"] for r in rows}}
    assert {len(data[m]) for m in data if m != "torch-eager"} == {len(head)}  # the columns stay aligned
    end = head.index("vs fp8") + len("vs fp8")
    col = {m: data[m][:end].split()[-1] for m in data if m != "torch-eager"}
    assert col == {"llmgpu-fast-graph": "-", "torch-compile": "-", "llmgpu-fp8-graph": "1.20x",
                   "torch-compile-fp8": "1.00x"}
    assert "1.44x" in data["llmgpu-fp8-graph"]  # and its ratio to torch-compile (bf16), as every row has
    # no torch-compile-fp8 row that ran: the table of the bf16 modes, unchanged
    plain = bench.format_results([r for r in rows if r["mode"] != "torch-compile-fp8"], ceiling_tflops=790.0)
    assert "vs fp8" not in plain and plain.splitlines()[0] == bench.format_results(rows[:1]).splitlines()[0]


def test_fp8_ratios_compare_with_torchao_torch_compile_and_our_bf16_step(capsys):
    rows = [{"mode": "llmgpu-fp8-graph", "tokens_per_s": 660.0, "fp8_recipe": "delayed", "dtype": "bf16"},
            {"mode": "torch-compile-fp8", "tokens_per_s": 600.0, "fp8_recipe": "torchao tensorwise", "dtype": "bf16"},
            {"mode": "torch-compile", "tokens_per_s": 440.0, "dtype": "bf16"},
            {"mode": "llmgpu-fast-graph", "skipped": "why"}]
    got = bench_fp8.fp8_ratios(rows)
    assert got == pytest.approx({"torch-compile-fp8": 1.1, "torch-compile": 1.5})
    text = capsys.readouterr().out
    assert ("llmgpu-fp8-graph (fp8 delayed) / torch-compile-fp8 (torchao tensorwise) tokens/s: 1.100  <- the fair "
            "FP8 comparison") in text
    assert bench_fp8.fp8_ratios(rows[1:]) == {}  # no FP8 row of ours: nothing to compare


# --------------------------------------------------------------------------- the torchao side


def _fake_torch(capability=None, name="NVIDIA H100"):
    """Just what float8_unavailable_reason and convert_to_float8 touch: devices, the GPU's capability, nn.Linear."""
    cuda = types.SimpleNamespace(is_available=lambda: capability is not None,
                                 get_device_capability=lambda d=None: capability, get_device_name=lambda d=None: name)
    return types.SimpleNamespace(device=lambda d: types.SimpleNamespace(type=str(d).split(":")[0]), cuda=cuda,
                                 nn=types.SimpleNamespace(Linear=type("Linear", (), {})))


def _fake_torchao(monkeypatch, calls):
    f8 = types.ModuleType("torchao.float8")

    class Float8LinearConfig:
        @staticmethod
        def from_recipe_name(name):
            return ("config", name)

    def convert_to_float8_training(module, *, module_filter_fn=None, config=None):
        calls.append((config, [n for n, m in module.named_modules() if module_filter_fn(m, n)]))
        return module

    f8.Float8LinearConfig, f8.convert_to_float8_training = Float8LinearConfig, convert_to_float8_training
    pkg = types.ModuleType("torchao")
    pkg.float8 = f8
    monkeypatch.setitem(sys.modules, "torchao", pkg)
    monkeypatch.setitem(sys.modules, "torchao.float8", f8)


def test_the_headline_table_states_the_targets_ratios(tmp_path, capsys):
    """tools/recipes/headline_table.py, the table headline_runs.sh ends with, on files as llmgpu bench writes them."""
    from repo_tools import load_tool

    table = load_tool("recipes/headline_table")
    row = lambda mode, tps: {"mode": mode, "tokens_per_s": tps, "ms_per_step": 1e5 / tps,  # noqa: E731
                             "peak_memory_bytes": 2**30}
    runs = {"pair": {"preset": "d36", "results": [row("llmgpu-fast-graph", 100.0), row("llmgpu-fp8-graph", 125.0)]},
            "torchao": {"preset": "d36", "results": [row("torch-compile-fp8", 90.0)]},
            "llama": {"preset": "smollm-360m", "results": [row("llmgpu-fast-graph", 111.0),
                                                           row("torch-compile", 100.0),
                                                           {"mode": "torch-eager", "error": "out of memory"}]}}
    paths = []
    for name, d in runs.items():
        paths.append(tmp_path / f"{name}.json")
        paths[-1].write_text(json.dumps(d))
    rows = table.timed_rows(paths)
    assert ("smollm-360m", "torch-eager") not in rows  # a mode that did not run has no row
    assert table.ratio(rows, "d36", "llmgpu-fp8-graph") == (pytest.approx(1.25), "our FP8 over our bf16")
    assert table.ratio(rows, "d36", "torch-compile-fp8")[0] == pytest.approx(125 / 90)  # ours over torchao's
    assert table.ratio(rows, "smollm-360m", "llmgpu-fast-graph")[0] == pytest.approx(1.11)
    assert table.ratio(rows, "d36", "llmgpu-fast-graph") is None  # no torch.compile row for d36 among the files
    assert table.main([str(p) for p in paths]) == 0
    out = capsys.readouterr().out
    assert "1.250x our FP8 over our bf16" in out and "1.389x our FP8 over torchao" in out and "1.110x ours" in out
    empty = tmp_path / "empty.json"
    empty.write_text(json.dumps({"preset": "d36", "results": [{"mode": "llmgpu-fp8-graph", "skipped": "no GPU"}]}))
    assert table.main([str(empty)]) == 1 and "no timed rows" in capsys.readouterr().err


def test_float8_unavailable_reasons_are_one_line(monkeypatch):
    why = torch_reference.float8_unavailable_reason
    assert FP8_ONLY_GPT2 in why(_fake_torch((9, 0)), "cuda", arch="llama")
    assert "--dtype bf16), not fp32" in why(_fake_torch((9, 0)), "cuda", dtype="fp32")
    assert "sm_89+" in why(_fake_torch(None), "cpu") and "none is in use" in why(_fake_torch(None), "cpu")
    assert "NVIDIA A100 is sm_80" in why(_fake_torch((8, 0), "NVIDIA A100"), "cuda")
    monkeypatch.setitem(sys.modules, "torchao", None)  # not installed
    monkeypatch.setitem(sys.modules, "torchao.float8", None)
    got = why(_fake_torch((9, 0)), "cuda")
    assert "torchao's float8 training is not importable" in got and "pip install torchao" in got
    _fake_torchao(monkeypatch, [])
    assert why(_fake_torch((9, 0)), "cuda") is None and why(_fake_torch((8, 9)), None) is None
    for r in (why(_fake_torch(None), "cpu"), got):
        assert "\n" not in r


def _reference_linear_names(cfg):
    """The reference's linear layers by name: llmgpu's parameter names (the reference loads them strictly, the same
    nanoGPT names) of every 2-D weight, and the untied LM head's."""
    names = [k[:-len(".weight")] for k, v in GPT(cfg, xp=np, init=False).state_dict().items()
             if k.endswith(".weight") and v.ndim == 2 and ".h." in k]
    return names + ["lm_head"]


def test_the_fp8_filter_takes_qkv_and_the_mlp_not_the_attention_projection_or_the_head():
    cfg = replace(SMALL, n_layer=3)
    names = _reference_linear_names(cfg)
    chosen = [n for n in names if torch_reference.is_fp8_linear(n)]
    assert len(chosen) == len(FP8_LINEARS) * cfg.n_layer
    assert {n.split(".", 3)[3] for n in chosen} == {"attn.c_attn", "mlp.c_fc", "mlp.c_proj"}
    assert not any(n.endswith("attn.c_proj") or n == "lm_head" for n in chosen)
    assert not torch_reference.is_fp8_linear("transformer.h.0.attn.c_proj")  # the projection after attention


def test_convert_to_float8_swaps_the_chosen_layers_with_the_tensorwise_recipe(monkeypatch):
    torch = _fake_torch((9, 0))
    calls = []
    _fake_torchao(monkeypatch, calls)
    cfg = replace(SMALL, n_layer=3)

    class Model:
        blocks = [None] * cfg.n_layer

        def __init__(self, names):
            self.names = names

        def named_modules(self):
            return [("", self)] + [(n, torch.nn.Linear()) for n in self.names]

    names = _reference_linear_names(cfg)
    assert torch_reference.convert_to_float8(torch, Model(names)) == 9
    (config, swapped), = calls
    assert config == ("config", "tensorwise") and swapped == [n for n in names if torch_reference.is_fp8_linear(n)]
    with pytest.raises(RuntimeError, match="chose 8 linear layers of the reference, not 9"):  # a renamed layer
        torch_reference.convert_to_float8(torch, Model([n for n in names if n != "transformer.h.2.mlp.c_fc"]))


def test_run_torch_refuses_fp8_where_it_cannot_run():
    torch = pytest.importorskip("torch", reason="PyTorch is not installed: run_torch is not tested here")
    if torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9):
        pytest.skip("this machine has FP8 tensor cores: test_gpu_torch_compile_fp8_trains runs instead")
    with pytest.raises(ValueError, match="FP8 GEMMs need a GPU"):
        torch_reference.run_torch(SMALL, 2, 16, steps=1, mode="eager", dtype="bf16", device="cpu", fp8=True)


@pytest.mark.gpu
def test_gpu_torch_compile_fp8_trains():
    """torchao's float8 training + torch.compile on the GPU (sm_89+): the real thing, a few steps of a small GPT-2
    whose linear sizes are multiples of 16 (torch._scaled_mm's rule), 3 layers per block converted."""
    torch = pytest.importorskip("torch", reason="PyTorch is not installed")
    why = torch_reference.float8_unavailable_reason(torch, "cuda")
    if why:
        pytest.skip(why)
    cfg = GPTConfig(n_layer=2, n_head=4, n_embd=128, vocab_size=512, block_size=64, pad_vocab_to=64)
    r = torch_reference.run_torch(cfg, 4, 64, steps=3, mode="compile", warmup=2, dtype="bf16", device="cuda", fp8=True)
    assert r["fp8_recipe"] == "torchao tensorwise" and r["fp8_layers"] == 3 * cfg.n_layer
    assert math.isfinite(r["final_loss"]) and r["tokens_per_s"] > 0
    # the same steps in bf16 without torchao (eager): FP8 follows them (the fixed batch is being learned: on the
    # H100 the loss went from log(512) = 6.2 to about 5 in these 5 steps)
    ref = torch_reference.run_torch(cfg, 4, 64, steps=3, mode="eager", warmup=2, dtype="bf16", device="cuda")
    assert abs(r["final_loss"] - ref["final_loss"]) < 0.05 * ref["final_loss"], (r["final_loss"], ref["final_loss"])


def test_the_scale_table_refuses_fp8_modes_rather_than_measure_bf16():
    from llmgpu import bench_scale

    with pytest.raises(ValueError, match="llmgpu-fp8-graph: the scale table measures the bf16 steps; FP8 runs one "
                                         "preset per command"):
        bench_scale.scale_main(_args(device="cpu", preset="tiny,d6", modes="llmgpu-fp8-graph"), np)
    assert bench_scale._sides(_args(modes="llmgpu-fast-graph,torch-compile")) == ("llmgpu", "torch")


def test_a_bench_where_no_mode_runs_is_one_error_line(tmp_path, one_error_line):
    """Every mode skipped (FP8 on a CPU): exit 2 with one line saying why, after the table and the JSON (which keep
    the reasons), not exit 1 without a word; ``--modes ,`` (no mode at all) is refused before anything runs."""
    from llmgpu import cli

    js = tmp_path / "b.json"
    one_error_line(cli.main(["bench", "--device", "cpu", "--preset", "tiny", "--batch", "2", "--seq", "16",
                             "--steps", "1", "--warmup", "0", "--no-ceiling", "--modes", "llmgpu-fp8-graph",
                             "--json", str(js)]),
                   "no mode ran: llmgpu-fp8-graph skipped (FP8 GEMMs need a GPU")
    assert json.loads(js.read_text())["results"][0]["skipped"]
    one_error_line(cli.main(["bench", "--device", "cpu", "--modes", ","]), "--modes ',' names no mode; choose from")
