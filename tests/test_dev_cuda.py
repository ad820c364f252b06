"""dev/cuda keeps kernel experiments outside the package; these checks keep them from rotting.

The experiments are compiled exactly as the package's kernels are in CI (``llmgpu.kernels.compile_check``:
NVRTC, no GPU needed, errors and spills fail), and their scripts must at least start: on a machine
without a GPU they say so and exit 0, on a GPU they check the kernel against the package.
"""

import importlib
import json
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from llmgpu import backend
from llmgpu.kernels import launch, loader
from llmgpu.kernels.launch import SMLimits
from llmgpu.perf import timing as timing_mod

DEV_CUDA = Path(__file__).resolve().parents[1] / "dev" / "cuda"
EXPERIMENTS = sorted(DEV_CUDA.glob("*.cu"))


def test_experiments_exist():
    assert DEV_CUDA / "layernorm_forward_fast.cu" in EXPERIMENTS
    assert (DEV_CUDA / "README.md").is_file()


def _run_dev_script(name, *args):
    """Run ``dev/cuda/<name>`` with ``args``. Without a GPU it must print one line saying so and exit 0 (checked
    here; None returned); on a GPU the finished process, for the caller's own checks."""
    pytest.importorskip("cupy", reason="CuPy is not installed")
    r = subprocess.run([sys.executable, str(DEV_CUDA / name), *args], capture_output=True, text=True, timeout=600)
    if backend.gpu_unavailable_reason() is not None:
        assert r.returncode == 0 and len(r.stdout.splitlines()) == 1 and "no GPU" in r.stdout, r.stdout + r.stderr
        return None
    return r


@pytest.mark.parametrize("path", EXPERIMENTS, ids=lambda p: p.name)
def test_experiment_compiles_for_sm90_without_spills(path):
    """A fresh process, as CI runs the compile check (see tests/test_kernels_loader.py for why)."""
    pytest.importorskip("cupy", reason="CuPy (with NVRTC) is not installed: pip install 'llmgpu[cuda13]'")
    n_declared = len(loader.expressions_in(path.read_text()))
    assert n_declared > 0, f"{path.name} declares no kernels (// llmgpu:kernel lines)"
    r = subprocess.run([sys.executable, "-m", "llmgpu.kernels.compile_check", "-a", "sm_90", str(path)],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    assert f"ok   {path.stem}.cu [sm_90]: {n_declared} kernels" in r.stdout.splitlines(), r.stdout


def test_layernorm_forward_fast_script_runs():
    """Without a GPU: one line saying so, exit 0. With one: small rows, checked against the package."""
    r = _run_dev_script("layernorm_forward_fast.py", "--rows", "1000", "--reps", "3", "--no-copy",
                        "--dtype", "fp32", "--dtype", "bf16", "--dtype", "fp16")
    if r is not None:
        assert r.returncode == 0 and "FAIL" not in r.stdout, r.stdout + r.stderr


def test_fp8_cast_wide_script_runs():
    """Without a GPU: one line saying so, exit 0. With one: small shapes (cut tiles too), bytes and amax checked."""
    r = _run_dev_script("fp8_cast_wide.py", "--shapes", "64x64,136x200,1000x768", "--reps", "3", "--no-copy",
                        "--dtype", "fp32", "--dtype", "bf16")
    if r is not None:
        assert r.returncode == 0 and "FAIL" not in r.stdout, r.stdout + r.stderr


def test_fp8_cast_transpose_regs_script_runs():
    """Without a GPU: one line saying so, exit 0. With one: the three step casts at small shapes, cut tiles included
    (R not a multiple of 256, C not of 64), checked against the package's cast."""
    r = _run_dev_script("fp8_cast_transpose_regs.py", "--cases", "dy:264x200,dgelu:520x72,gelu:8x8,dy:1024x768",
                        "--reps", "3", "--no-copy")
    if r is not None:
        assert r.returncode == 0 and "FAIL" not in r.stdout and "differs" not in r.stdout, r.stdout + r.stderr


def test_wgmma_probe_compiles_for_sm90a_with_wgmma():
    """The probe's wgmma exists on sm_90a only; for sm_80 / sm_90 (the test above) its body is a trap."""
    pytest.importorskip("cupy", reason="CuPy (with NVRTC) is not installed: pip install 'llmgpu[cuda13]'")
    path = DEV_CUDA / "wgmma_probe.cu"
    r = subprocess.run([sys.executable, "-m", "llmgpu.kernels.compile_check", "-a", "sm_90a", "-v", str(path)],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "ok   wgmma_probe.cu [sm_90a]: 4 kernels" in r.stdout, r.stdout
    regs = [int(m) for m in re.findall(r"wgmma_probe<\d, \d>\s+(\d+) regs", r.stdout)]
    assert len(regs) == 4 and min(regs) >= 32, r.stdout  # 32 accumulators live: the wgmma body is compiled in


def _dev_module(name: str):
    """A dev/cuda script imported as a module (the scripts import each other from their own directory)."""
    sys.path.insert(0, str(DEV_CUDA))
    try:
        return importlib.import_module(name)
    finally:
        sys.path.remove(str(DEV_CUDA))


def _probe():
    return _dev_module("wgmma_probe")


class _FakeCupy:
    """Enough of CuPy for the dev/cuda scripts' GPU paths to run on NumPy arrays with stand-in kernels."""

    asarray, full, asnumpy = staticmethod(np.asarray), staticmethod(np.full), staticmethod(np.asarray)
    empty = staticmethod(np.empty)

    class cuda:
        class Device:
            compute_capability = "90"
            attributes = {"MultiProcessorCount": 132}

            def synchronize(self):
                pass


class _FakeKernel:
    def __init__(self, body):
        self.body, self.max_dynamic_shared_size_bytes = body, None

    def __call__(self, grid, block, args, shared_mem=0):
        assert shared_mem <= 227 * 1024  # an H200 block's opt-in limit
        self.body(grid, block, args)


def _fake_gpu(monkeypatch, module, kernels):
    """The module's main() sees an sm_90 GPU: the fake CuPy above and ``kernels`` for compile_sm90a."""
    fake = _FakeCupy()
    monkeypatch.setattr(backend, "gpu_unavailable_reason", lambda *a, **k: None)
    monkeypatch.setattr(backend, "require_gpu", lambda *a, **k: fake)
    monkeypatch.setattr(backend, "device_info", lambda *a, **k: type("D", (), {"summary": lambda self: "fake sm_90"})())
    monkeypatch.setattr(module, "compile_sm90a", lambda cp, path: kernels)
    monkeypatch.setattr(launch, "device_limits", lambda *a: SMLimits())  # resident blocks: an H200's
    return fake


def _probe_kernels(w):
    return {f"wgmma_probe<{r}, {t}>": _FakeKernel(lambda g, b, args, r=r, t=t: w.emulate_launch(r, t, args))
            for r in (0, 1) for t in (0, 1)}


@pytest.mark.parametrize("nk", [1, 4])
def test_wgmma_probe_bookkeeping_on_the_cpu(nk):
    """Launched (``run``) on a stand-in kernel that follows the addressing model, every hypothesis expected to pass
    passes and every counter-hypothesis fails: the probe can tell them apart (what the GPU does is what
    dev/cuda/wgmma_probe.py finds out)."""
    w = _probe()
    rng = np.random.default_rng(nk)
    a = w.from_bits(w.bits(rng.standard_normal((w.M, 16 * nk))))
    b = w.from_bits(w.bits(rng.standard_normal((16 * nk, w.N))))
    ref = a.astype(np.float64) @ b.astype(np.float64)
    hyps = w.hypotheses(nk)
    assert sum(h[4] for h in hyps) >= 3 and sum(not h[4] for h in hyps) >= 2
    kernels = _probe_kernels(w)
    for h in hyps:
        res = w.judge(w.run(_FakeCupy(), kernels, a, b, h), ref)
        assert res["passed"] == h[4], (h[0], res)
        assert res["values_found"] == 1.0 or not h[4]


def test_wgmma_probe_main_on_a_stand_in_gpu(monkeypatch, tmp_path, capsys):
    """The script's GPU path end to end (hypotheses, launches, table, JSON) with the stand-in kernel."""
    w = _probe()
    _fake_gpu(monkeypatch, w, _probe_kernels(w))
    out = tmp_path / "probe.json"
    assert w.main(["--json", str(out)]) == 0
    text = capsys.readouterr().out
    rows = json.loads(out.read_text())["rows"]
    assert f"{len(rows)} of {len(rows)} as expected" in text and "FAIL" not in text
    assert {r["nk"] for r in rows} == {1, 4} and any(not r["expected_to_pass"] for r in rows)


def test_wgmma_probe_layouts_and_descriptor_bits():
    w = _probe()
    off = w.sw128_layout(16)
    assert sorted(off.ravel() // 2) == list(range(16 * 64))  # a permutation of the 2 KB
    assert off[0, 8] == 16 and off[1, 0] == 128 + 16 and off[1, 8] == 128 and off[9, 0] == 1024 + 128 + 16
    assert w.descriptor(2048, 16, 1024, w.SW128) == (128 | 1 << 16 | 64 << 32 | 1 << 62)
    with pytest.raises(AssertionError):
        w.descriptor(8, 16, 1024, 0)  # not a multiple of 16 bytes
    x = np.array([1.0, -2.5, 3.140625], np.float32)
    assert np.array_equal(w.from_bits(w.bits(x)), x)  # exact in bf16
    frags = w.a_fragments(np.arange(64 * 16, dtype=np.float32).reshape(64, 16) % 7)
    assert frags.shape == (1, 128, 4)


def test_wgmma_probe_script_runs():
    """Without a GPU: one line saying so, exit 0 (on a Hopper GPU it runs the probe)."""
    r = _run_dev_script("wgmma_probe.py")
    if r is not None:
        assert r.returncode in (0, 1) and "as expected" in r.stdout or "no sm_90 GPU" in r.stdout, r.stdout


def _wgmma_forward_exprs():
    from llmgpu.kernels import loader

    return [e for f in WGMMA_FORWARDS for e in loader.expressions_in((DEV_CUDA / f).read_text())]


WGMMA_FORWARDS = ("flash_fwd_wgmma.cu",)  # what dev/cuda/flash_fwd_wgmma.py compiles


@pytest.mark.parametrize("name", WGMMA_FORWARDS)
def test_flash_fwd_wgmma_compiles_for_sm90a_without_spills_or_serialized_wgmma(name):
    """Every instantiation without spills; D = 64 with 64-key tiles and two warpgroups: two blocks of 256 threads
    per SM (128 registers). And ptxas keeps the wgmma asynchronous: it serializes them (its C7514/C7515 notes)
    when it cannot follow the commit groups, undoing PIPE's overlap."""
    pytest.importorskip("cupy", reason="CuPy (with NVRTC) is not installed: pip install 'llmgpu[cuda13]'")
    from llmgpu.kernels import compile_check

    r = compile_check.compile_path(DEV_CUDA / name, "sm_90a")
    assert r.ok, r.log
    n = len(loader.expressions_in((DEV_CUDA / name).read_text()))
    assert len(r.kernels) == n >= 4 and not any(k.spills for k in r.kernels), r.kernels
    assert all(k.registers <= 128 for k in r.kernels if re.search(r", 64, \d, 64, 2>", k.expression)), r.kernels
    assert "serialized" not in r.log, r.log


def test_flash_fwd_wgmma_main_on_a_stand_in_gpu(monkeypatch, capsys):
    """The script's GPU path (launch arguments, the QKV views, the float64 checks, the NaN-row check) with a stand-in
    kernel that computes the reference: every check must pass, so a wrong check cannot fail the real kernel."""
    from llmgpu.ops import flash_reference

    ff = _dev_module("flash_fwd_wgmma")
    launched = []

    def body(grid, block, args):
        q, k, v, o, lse, H, T, scale, causal = args[:9]
        rows = block[0] // 2  # 64 query rows and 128 threads per warpgroup
        n_bh = q.shape[0] * q.shape[1]
        assert rows in (64, 128, 192) and int(args[9]) == n_bh
        assert grid[1] == -(-q.shape[2] // rows) and grid[0] * grid[2] >= n_bh > grid[0] * (grid[2] - 1)
        assert [int(x) for x in args[10:13]] == [s // q.dtype.itemsize for s in q.strides[:3]]
        r_o, r_lse = flash_reference.naive_forward(*(np.asarray(x, np.float64) for x in (q, k, v)), float(scale),
                                                    bool(causal))
        o[...], lse[...] = r_o.astype(o.dtype), r_lse
        launched.append(q.shape[-1])

    kernels = {e: _FakeKernel(body) for e in _wgmma_forward_exprs()}
    _fake_gpu(monkeypatch, ff, kernels)
    assert ff.main(["--no-time"]) == 0
    text = capsys.readouterr().out
    assert text.count("ok  ") == len(kernels) and "FAIL" not in text, text
    assert set(launched) == {64, 128}


@pytest.mark.parametrize("cudnn", [False, True])
def test_flash_fwd_wgmma_timing_on_a_stand_in_gpu(monkeypatch, capsys, cudnn):
    """The timing table's code path (smaller shapes, kernels that do nothing, a fixed clock), with and without cuDNN
    installed (its rows run the NumPy reference here)."""
    ff = _dev_module("flash_fwd_wgmma")
    monkeypatch.setattr(ff.fa.cudnn_attention, "unavailable_reason", lambda: None if cudnn else "not installed")
    kernels = {e: _FakeKernel(lambda g, b, a: None) for e in _wgmma_forward_exprs()}
    cp = _fake_gpu(monkeypatch, ff, kernels)
    monkeypatch.setattr(ff, "SPEED", [(64, 2, 2, 128), (128, 1, 2, 256)])
    monkeypatch.setattr(ff, "time_fn", lambda fn, **kw: (fn(), type("T", (), {"median_ms": 0.5})())[1])
    monkeypatch.setattr(ff.fl, "ours_forward", lambda *a, impl: None)
    rows = ff.timing(cp, kernels, "bf16", np.random.default_rng(0))
    kinds = {r["kernel"] for r in rows}
    assert {"wgmma PIPE=0 BN=64 WG=2", "wgmma PIPE=1 BN=128 WG=2", "ours (flash_fwd, mma.sync)"} <= kinds
    assert len(rows) == len([e for e in kernels if "bfloat16" in e]) + 2 * (1 + cudnn)  # + ours (and cuDNN) per D
    assert ("cuDNN" in kinds) == cudnn
    assert {r["D"] for r in rows} == {64, 128}
    assert all(r["tflops"] > 0 for r in rows) and "TFLOP/s" in capsys.readouterr().out


def test_flash_fwd_wgmma_script_runs():
    """Without a GPU: one line saying so, exit 0 (on a Hopper GPU it checks and times the kernel)."""
    r = _run_dev_script("flash_fwd_wgmma.py", "--no-time")
    if r is not None:
        assert r.returncode == 0 and "FAIL" not in r.stdout or "no sm_90 GPU" in r.stdout, r.stdout


def test_flash_tile_order_on_a_stand_in_gpu(monkeypatch, tmp_path, capsys):
    """dev/cuda/flash_tile_order.py's GPU path on NumPy: kernels stand in as functions of their inputs alone (so
    every group gives the same bits and every check passes), a fixed clock; then once more with a kernel whose
    output depends on the group, which the check must catch."""
    fo = _dev_module("flash_tile_order")
    fake = _FakeCupy()
    fake.get_default_memory_pool = lambda: type("P", (), {"free_all_blocks": lambda self: None})()
    monkeypatch.setattr(fo.backend, "gpu_unavailable_reason", lambda *a, **k: None)
    monkeypatch.setattr(fo.backend, "require_gpu", lambda *a, **k: fake)
    info = type("D", (), {"summary": lambda s: "fake", "l2_bytes": 60 * 2**20})
    monkeypatch.setattr(fo.backend, "device_info", lambda *a, **k: info())
    groups = {"flash_fwd": 3, "flash_bwd_dq_wide": 1, "flash_bwd_dkdv_wide": 100}  # chosen groups (beyond B·H: B·H)
    monkeypatch.setattr(fo.fl, "plan", lambda name, q: type("L", (), {"group": min(groups[name], q[..., 0, 0].size)})())
    monkeypatch.setattr(fo.cudnn_attention, "available", lambda: False)
    monkeypatch.setattr(fo, "SHAPES", [(2, 3, 64, 64), (1, 2, 128, 128)])
    monkeypatch.setattr(fo, "time_fn", lambda fn, **kw: (fn(), type("T", (), {"median_ms": 0.5})())[1])
    bias = {"value": 0.0}

    def forward(q, k, v, o, lse, scale, causal, impl="ours", group=None):
        o[...] = q + bias["value"] * (group or 0)
        lse[...] = q.sum(-1)

    def backward(do, q, k, v, o, lse, scale, causal, dq, dk, dv, only=None, group=None):
        dq[...], dk[...], dv[...] = do, do + q, do - q

    monkeypatch.setattr(fo.fl, "ours_forward", forward)
    monkeypatch.setattr(fo.fl, "ours_backward", backward)
    out = tmp_path / "order.json"
    assert fo.main(["--json", str(out), "--reps", "2"]) == 0
    text = capsys.readouterr().out
    result = json.loads(out.read_text())
    assert len(result["checks"]) == 6 and all(c["ok"] for c in result["checks"]), result["checks"]
    n_groups = {"B=2 H=3 T=64 D=64": 5 + 4 + 4, "B=1 H=2 T=128 D=128": 3 * 2}  # 1, 2, 4 (and 3) below B·H, B·H
    for shape, n in n_groups.items():
        rows = [r for r in result["rows"] if r["shape"] == shape]
        assert len(rows) == n and sum(r["plain"] for r in rows) == 3 and sum(r["chosen"] for r in rows) == 3
        assert all(r["tflops_rotating"] > 0 for r in rows)
    assert "plain   chosen  best" in text
    bias["value"] = 1e-3  # the forward now depends on the order: its checks fail, the backward's pass
    assert fo.main(["--reps", "2"]) == 1
    assert "FAIL fwd mma" in capsys.readouterr().out


def test_flash_tile_order_script_runs():
    """Without a GPU: one line saying so, exit 0."""
    r = _run_dev_script("flash_tile_order.py")
    if r is not None:
        assert r.returncode == 0 and "FAIL" not in r.stdout, r.stdout[-3000:]


def test_attention_layout_probe_script_runs():
    """Without a GPU: one line saying so, exit 0; on one, every layout's outputs agree with BHTD's."""
    r = _run_dev_script("attention_layout_probe.py", "--reps", "3")
    if r is not None:
        assert r.returncode == 0 and "FAIL" not in r.stdout and r.stdout.count("backward") == 6, r.stdout[-3000:]


# --------------------------------------------------------------------------- gemm_wgmma (issue 19)


def test_gemm_wgmma_compiles_for_sm90a_without_spills_or_serialized_wgmma():
    """Every epilogue, with and without the cluster, and the three parts alone: no spills, at most 224 registers
    (288 threads a block, one block per SM), and ptxas keeps the wgmma asynchronous (no C7514/C7515 serialization
    note). The math-only and no-epilogue parts keep their 128 accumulators (else ptxas dropped the wgmmas)."""
    pytest.importorskip("cupy", reason="CuPy (with NVRTC) is not installed: pip install 'llmgpu[cuda13]'")
    from llmgpu.kernels import compile_check

    r = compile_check.compile_path(DEV_CUDA / "gemm_wgmma.cu", "sm_90a")
    assert r.ok, r.log
    assert len(r.kernels) == 11 and not any(k.spills for k in r.kernels), r.kernels
    assert all(k.registers <= 224 for k in r.kernels), r.kernels
    regs = {k.expression: k.registers for k in r.kernels}
    assert regs["gemm_tma<0, 1, 2>"] >= 128 and regs["gemm_tma<0, 1, 3>"] >= 128, regs
    assert "serialized" not in r.log, r.log


def test_gemm_wgmma_script_runs():
    """Without a GPU: one line saying so, exit 0 (on a Hopper GPU it checks every variant against float64)."""
    r = _run_dev_script("gemm_wgmma.py", "--no-time")
    if r is not None:
        assert r.returncode == 0 and "FAIL" not in r.stdout, r.stdout + r.stderr


def _gemm_stand_in(var, *, drop_last_row=False):
    """A kernel computing what gemm_tma<EPI, CLUSTER, 0> must, in float64, from the arrays the tensor maps stand for
    (a part alone, PART != 0, writes nothing)."""
    from llmgpu.ops.gelu import gelu_backward_reference, gelu_forward_reference

    epi = var.epi

    def body(grid, block, args):
        a, bt, d, aux, bias, m, n, k = args
        assert block == (288,) and grid[0] <= 132 and grid[0] % var.cluster == 0, (grid, block)
        assert a.shape == (int(m), int(k)) and bt.shape == (int(n), int(k)) and d.shape == (int(m), int(n))
        if var.part:
            return
        acc = np.asarray(a, np.float64) @ np.asarray(bt, np.float64).T
        if epi in (1, 2):
            acc = acc + np.asarray(bias, np.float64)
        if epi == 2:
            aux[...] = acc.astype(aux.dtype)
            acc = gelu_forward_reference(acc)
        if epi == 3:
            acc = gelu_backward_reference(acc, np.asarray(aux, np.float64))
        rows = slice(0, -1) if drop_last_row else slice(None)
        d[rows] = acc[rows].astype(d.dtype)

    return body


def _gemm_on_a_stand_in_gpu(monkeypatch, broken=False):
    """gemm_wgmma.py with every instantiation of the .cu as a stand-in (``broken``: the first one leaves the last
    row of D unwritten), the fake GPU, and tensor maps that are the arrays themselves: (module, kernels, fake cp)."""
    gw = _dev_module("gemm_wgmma")
    exprs = loader.expressions_in((DEV_CUDA / "gemm_wgmma.cu").read_text())
    kernels = {e: _FakeKernel(_gemm_stand_in(gw.Variant.parse(e), drop_last_row=broken and i == 0))
               for i, e in enumerate(exprs)}
    cp = _fake_gpu(monkeypatch, gw, kernels)
    monkeypatch.setattr(gw, "tensor_map", lambda cp, x, box_rows: x)  # the kernel gets the array itself
    return gw, kernels, cp


def _fixed_clock(fn, **kw):
    """time_fn's stand-in: one call of fn, and 0.5 ms a call."""
    fn()
    return timing_mod.Timing(0.5, 0.5, 0.5, 1)


@pytest.mark.parametrize("broken", [False, True])
def test_gemm_wgmma_checks_on_a_stand_in_gpu(monkeypatch, capsys, broken):
    """The script's check path on NumPy: stand-in kernels that compute the float64 reference pass every check; one
    that leaves a row of D unwritten (NaN from the poisoned buffer) must fail, so the checks can fail."""
    gw, kernels, _ = _gemm_on_a_stand_in_gpu(monkeypatch, broken)
    monkeypatch.setattr(gw, "CHECK_SHAPES", [(256, 256, 64), (512, 768, 192)])  # NumPy-sized
    assert gw.main(["--no-time"]) == (1 if broken else 0)
    text = capsys.readouterr().out
    assert ("FAIL" in text) == broken, text
    assert text.count("ok  ") + text.count("FAIL") == len(gw.gemms(kernels)) * 3  # 2 shapes + the NaN row each
    assert len(gw.gemms(kernels)) == 8  # the parts alone write nothing: they are timed, not checked


def test_gemm_wgmma_timing_on_a_stand_in_gpu(monkeypatch, capsys):
    """The timing table's code path on NumPy (small shapes, a fixed clock): a row per kernel and epilogue, cuBLASLt's
    call (the NumPy reference of lt_gemm) beside ours, and ours compared with its output: the stand-ins compute the
    same function, so the comparison must come out at bf16 rounding."""
    gw, kernels, cp = _gemm_on_a_stand_in_gpu(monkeypatch)
    monkeypatch.setattr(gw, "TIME_SHAPES", [(512, 512, 128, (0, 1, 2, 3)), (256, 256, 64, (0,))])
    monkeypatch.setattr(gw, "time_fn", _fixed_clock)
    rows = gw.timing(cp, kernels, 132, np.random.default_rng(0), reps=1)
    ours = [r for r in rows if not r["kernel"].startswith("cuBLASLt")]
    assert len(rows) == 5 * 3 and len(ours) == 5 * 2  # (4 + 1 epilogues) x (cuBLASLt, ours, ours cluster 2)
    assert all(r["error_vs_cublaslt"] < 1e-2 for r in ours), ours
    assert all("aux_error_vs_cublaslt" in r for r in ours if r["epilogue"] == "gelu_aux_bias")
    assert "TFLOP/s" in capsys.readouterr().out


def test_gemm_wgmma_parts_on_a_stand_in_gpu(monkeypatch, capsys):
    """The parts' timing path on NumPy: every round times cuBLASLt and the four instantiations of the plain
    one-block kernel; the bytes the loads move are k-blocks x STAGE (the math-only part: STAGES per block)."""
    gw, kernels, cp = _gemm_on_a_stand_in_gpu(monkeypatch)
    monkeypatch.setattr(gw, "PARTS_SHAPES", [(1024, 512, 128)])  # 16 tiles of 2 k-blocks
    monkeypatch.setattr(gw, "time_fn", _fixed_clock)
    rows = gw.parts(cp, kernels, 132, np.random.default_rng(0), reps=1, rounds=2)
    assert len(rows) == 2 * 5 and [r["round"] for r in rows] == [0] * 5 + [1] * 5
    by = {r["kernel"]: r for r in rows if r["round"] == 1}
    stage = (128 + 256) * 64 * 2
    assert by["ours"]["loaded_bytes"] == by["ours: loads only"]["loaded_bytes"] == 16 * 2 * stage
    assert by["ours: math only"]["loaded_bytes"] == 16 * 3 * stage and by["ours: math only"]["load_tbps"] is None
    assert by["ours: loads only"]["load_tbps"] == pytest.approx(16 * 2 * stage / 0.5e-3 / 1e12)
    assert by["cuBLASLt none"]["loaded_bytes"] is None
    assert "loads only" in capsys.readouterr().out
