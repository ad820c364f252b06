"""Probe: do Llama's weight-gradient GEMMs run faster with cuBLASLt's K split than with the heuristic's pick?

    python tools/probes/probe_wgrad_splitk.py [--runs smollm-360m:32,smollm-135m:64] [--seq 1024] [--splits 2,3,4,6,8]
        [--candidates 8] [--reps 30] [--min-speedup 1.03] [--step smollm-360m:32] [--json PATH]

For each ``preset:batch`` of ``--runs`` and each weight gradient of a Llama block (``attn.qkv``: the stacked q|k|v
rows, ``attn.proj``, ``mlp.gate,up``: the stacked 2·ffn rows, ``mlp.down``), the fast step's call
``wgrad_gemm(dy, x, out=dW, beta=1)`` (bf16 operands, fp32 ``dW``, K = batch·seq tokens) is timed (CUDA-event
medians) with: the heuristic's first choice (what runs without a table entry), each of its first ``--candidates``
algorithms as the heuristic configured them, and the first and the fastest candidate with K split ``s`` ways
(``LtPlan.use_split_k``) for every ``s`` of ``--splits`` and each reduction scheme ("inplace", "compute_type").
Every configuration is also checked: the same bits on two runs (``repeatable``), ``beta = 1`` honoured, and its
distance from the heuristic's result (``rel_vs_heuristic``, max-abs relative: a reordered fp32 sum, ~1e-6). The
probe prints the winners (at least ``--min-speedup`` faster alone) as a ``llmgpu.gemm.lt_splitk`` table
``(splits, reduction, base)``, ready to become ``DEFAULT_TABLE``, and with ``--step`` times that fast training step
(eager, bf16) without and with the table, alternating, since issue 19 found per-GEMM savings that the step did not
keep. Question: issue 36's ``attn.qkv wgrad`` at 63 % of
the GEMM rate (one wave of ~47 tiles for 132 SMs).
"""

from __future__ import annotations

import argparse
import sys

import numpy as np

from llmgpu import backend
from llmgpu.gemm import cublaslt, lt_splitk
from llmgpu.gemm.ksplit import wgrad_gemm
from llmgpu.model.llama_config import LlamaConfig
from llmgpu.perf import timing

SCHEMES = ("inplace", "compute_type")


def wgrad_shapes(cfg: LlamaConfig) -> dict:
    """Name -> (M, N) of each weight gradient ``dW [M, N]`` of one Llama block, as the fast step stacks them."""
    C, F = cfg.n_embd, cfg.ffn_dim
    return {"attn.qkv": ((cfg.n_head + 2 * cfg.n_kv_head) * cfg.head_dim, C), "attn.proj": (C, C),
            "mlp.gate,up": (2 * F, C), "mlp.down": (C, F)}


def parse_runs(text: str) -> list:
    """'smollm-360m:32,smollm-135m:64' -> [('smollm-360m', 32), ...]; ValueError on a malformed item."""
    runs = []
    for item in filter(None, (s.strip() for s in text.split(","))):
        name, sep, batch = item.partition(":")
        if not sep or not batch.isdigit() or int(batch) < 1:
            raise ValueError(f"--runs items are preset:batch (e.g. smollm-360m:32), got {item!r}")
        LlamaConfig.preset(name)  # unknown preset: its own clear error
        runs.append((name, int(batch)))
    if not runs:
        raise ValueError("--runs names no preset:batch")
    return runs


def algo_config(lt, algo_ptr: int) -> dict:
    """The configuration attributes of a cublasLtMatmulAlgo_t that say what it is (id, tile, split, scheme, stages)."""
    rec = {}
    CA = lt.MatmulAlgoConfigAttribute
    for attr in (CA.ID, CA.TILE_ID, CA.SPLITK_NUM, CA.REDUCTION_SCHEME, CA.STAGES_ID, CA.CLUSTER_SHAPE_ID):
        try:
            buf = np.zeros(1, dtype=lt.get_matmul_algo_config_attribute_dtype(attr))
            written = np.zeros(1, dtype=np.uint64)
            lt.matmul_algo_config_get_attribute(algo_ptr, int(attr), buf.ctypes.data, buf.itemsize,
                                                written.ctypes.data)
            rec[attr.name.lower()] = int(buf[0])
        except Exception:  # an attribute this cuBLASLt does not know
            continue
    try:
        rec["tile"] = lt.MatmulTile(rec["tile_id"]).name
    except Exception:
        pass
    return rec


def probe_shape(xp, name, m, n, k, cands, splits, reps):
    """Time and check every configuration of one wgrad problem; returns its record."""
    dy = xp.random.standard_normal((k, m), dtype=np.float32).astype(backend.bfloat16)
    x = xp.random.standard_normal((k, n), dtype=np.float32).astype(backend.bfloat16)
    out = xp.zeros((m, n), dtype=np.float32)

    def call():
        wgrad_gemm(dy, x, out=out, beta=1.0, gemm=cublaslt.lt_gemm)

    def result(fill):
        out.fill(fill)
        call()
        return out.copy()

    call()  # builds the plan (with today's table)
    key = cublaslt.plan_key(xp.cuda.Device().id, dy, x, True, False, out, None, "none", None, m, n, k, ())
    plan = cublaslt._PLANS[key]
    lt = cublaslt.lt_module()
    plan.ask_heuristic(cands)  # still runs candidate 0
    ref = result(0.0)
    scale = float(xp.abs(ref).max()) or 1.0
    flops = cublaslt.lt_flops(m, n, k)

    def timed():
        return timing.time_fn(call, xp=xp, warmup=2, reps=reps).median_ms

    def checked(row):  # the same bits twice, beta = 1 honoured, and the distance from the heuristic's pick
        r1, r2, half = result(0.0), result(0.0), result(0.5)
        row.update({"repeatable": bool(xp.array_equal(r1, r2)),
                    "rel_vs_heuristic": float(xp.abs(r1 - ref).max()) / scale,
                    "beta_ok": bool(float(xp.abs(half - (r1 + 0.5)).max()) <= 1e-5 * scale)})
        return row

    rows = []
    for i in range(plan.n_algos):
        try:
            plan.use(i)
        except IndexError:
            continue
        row = checked({"config": f"heuristic #{i}", "base": i, "splits": None, "reduction": None})
        ms = timed()
        rows.append({**row, "ms": ms, "tflops": flops / 1e9 / ms, "workspace": plan.ws_need,
                     **algo_config(lt, plan.algo_ptr)})
    heur_ms = rows[0]["ms"]
    best_cand = min(rows, key=lambda r: r["ms"])["base"]
    for base in sorted({0, best_cand}):
        for s in splits:
            for red in SCHEMES:
                row = {"config": f"#{base} split {s} {red}", "base": base, "splits": s, "reduction": red}
                try:
                    plan.use_split_k(s, red, base=base)
                except ValueError as e:
                    rows.append({**row, "error": str(e)[:300]})
                    continue
                checked(row)
                ms = timed()
                row.update({"ms": ms, "tflops": flops / 1e9 / ms, "speedup": heur_ms / ms, "workspace": plan.ws_need,
                            **algo_config(lt, plan.algo_ptr)})
                rows.append(row)
    plan.use(0)
    for r in rows:
        if "ms" in r:
            print(f"  {name:<12} [{m}x{n}] K={k}  {r['config']:<26} {r['ms']:.4f} ms  {r['tflops']:5.0f} TFLOP/s "
                  f"{heur_ms / r['ms']:.3f}x  tile {r.get('tile', '?')} split {r.get('splitk_num', '?')}"
                  f"  repeatable={r['repeatable']} beta_ok={r['beta_ok']} rel={r['rel_vs_heuristic']:.1e}",
                  flush=True)
        else:
            print(f"  {name:<12} [{m}x{n}] K={k}  {r['config']:<26} refused: {r['error'][:120]}", flush=True)
    return {"gemm": name, "M": m, "N": n, "K": k, "heuristic_ms": heur_ms, "heuristic_tflops": flops / 1e9 / heur_ms,
            "configs": rows}


# cublasLtReductionScheme_t values -> lt_plan.REDUCTIONS names (a heuristic candidate's own scheme)
SCHEME_NAMES = {1: "inplace", 2: "compute_type", 4: "output_type"}


def table_entry(row: dict):
    """The ``lt_splitk`` entry ``(splits, reduction, base)`` that reproduces one probed configuration, or None: a
    split configuration names itself; a heuristic candidate, its own split and scheme (no split: 1, "inplace", which
    ``use_split_k`` runs as scheme NONE)."""
    if row["splits"] is not None:
        return (row["splits"], row["reduction"], row["base"])
    splits = row.get("splitk_num")
    if splits is None:
        return None
    if splits == 1:
        return (1, "inplace", row["base"])
    scheme = SCHEME_NAMES.get(row.get("reduction_scheme"))
    return None if scheme is None else (splits, scheme, row["base"])


def winner(rec: dict, min_speedup: float):
    """The table entry for one probed problem: the fastest correct configuration, a split of a heuristic candidate or
    a later candidate as the heuristic configured it, that is at least ``min_speedup`` faster than the heuristic's
    first choice, or None."""
    ok = [r for r in rec["configs"] if "ms" in r and r["repeatable"] and r["beta_ok"] and r["rel_vs_heuristic"] < 1e-4
          and table_entry(r) is not None and table_entry(r) != (1, "inplace", 0)]
    if not ok:
        return None
    best = min(ok, key=lambda r: r["ms"])
    return table_entry(best) if rec["heuristic_ms"] >= min_speedup * best["ms"] else None


def step_with_table(xp, preset, batch, seq, table, reps, rounds=3):
    """Eager fast-step ms with the heuristic's GEMMs and with the split-K ``table``, alternating for ``rounds`` rounds
    (medians of ``reps`` steps each; the step is GPU-bound, so eager shows what a graph replay would)."""
    from llmgpu.bench import make_train_step

    settings = {"heuristic": {}, "split_k": table}
    cfg = LlamaConfig.preset(preset, pad_vocab_to=64)
    step, model = make_train_step(cfg, batch, seq, dtype="bf16", xp=xp, fast=True)
    got = {label: [] for label in settings}
    split_plans = {}  # label -> how many of the step's cached plans run split-K (0 would mean no key matched)
    try:
        for _ in range(rounds):
            for label, tab in settings.items():
                cublaslt.set_split_k(tab)
                got[label].append(timing.time_fn(step, xp=xp, warmup=2, reps=reps, host_ahead=False).median_ms)
                split_plans[label] = sum(1 for p in cublaslt._PLANS.values() if getattr(p, "split_k", None))
    finally:
        cublaslt.set_split_k(None)
        del model
    base = min(got["heuristic"])
    return {"preset": preset, "batch": batch, "seq": seq, "ms": got, "split_k_plans": split_plans,
            "speedup": {label: base / min(v) for label, v in got.items()}}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", default="smollm-360m:32,smollm-135m:64", help="preset:batch,... (default %(default)s)")
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--splits", default="2,3,4,6,8")
    ap.add_argument("--candidates", type=int, default=8)
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--min-speedup", type=float, default=1.03)
    ap.add_argument("--step", default="", help="preset:batch whose eager fast step is timed without and with the "
                                               "winners (e.g. smollm-360m:32; default: none)")
    ap.add_argument("--json")
    a = ap.parse_args(argv)
    try:
        runs = parse_runs(a.runs)
        step_run = parse_runs(a.step)[0] if a.step else None
        splits = sorted({int(s) for s in a.splits.split(",") if s.strip()})
        if not splits or min(splits) < 2:
            raise ValueError(f"--splits are integers >= 2, got {a.splits!r}")
    except ValueError as e:
        print(f"probe_wgrad_splitk: error: {e}", file=sys.stderr)
        return 2
    try:
        xp = backend.require_gpu()
    except backend.GPUUnavailableError as e:
        print(f"probe_wgrad_splitk: error: {e}", file=sys.stderr)
        return 2
    if not cublaslt.available():
        print(f"probe_wgrad_splitk: error: {cublaslt.unavailable_reason()}", file=sys.stderr)
        return 2
    print(backend.device_info(xp).summary(), flush=True)
    cublaslt.set_split_k({})  # measure against the heuristic, whatever DEFAULT_TABLE holds
    records, table = [], {}
    for preset, batch in runs:
        cfg = LlamaConfig.preset(preset)
        k = batch * a.seq
        for name, (m, n) in wgrad_shapes(cfg).items():
            rec = probe_shape(xp, name, m, n, k, a.candidates, splits, a.reps)
            rec.update(preset=preset, batch=batch)
            choice = winner(rec, a.min_speedup)
            rec["table_entry"] = choice
            if choice:
                table[lt_splitk.wgrad_key(m, n, k)] = choice
            records.append(rec)
            xp.get_default_memory_pool().free_all_blocks()
    cublaslt.set_split_k(None)
    print("\n# winners, as llmgpu.gemm.lt_splitk.DEFAULT_TABLE (problem_key -> (splits, reduction, base)):",
          flush=True)
    print("DEFAULT_TABLE = {" + "".join(f"\n    {k!r}: {v!r}," for k, v in table.items()) + "\n}", flush=True)
    step = None
    if step_run:
        step = step_with_table(xp, *step_run, a.seq, table, 10)
        for label, ms in step["ms"].items():
            print(f"step {step_run[0]} B={step_run[1]} {label:<22} {ms} ms ({step['speedup'][label]:.3f}x; "
                  f"{step['split_k_plans'][label]} plans split)", flush=True)
    if a.json:
        timing.save_results(a.json, {"probe": "wgrad_splitk", "seq": a.seq, "splits": splits,
                                     "min_speedup": a.min_speedup, "gemms": records,
                                     "table": lt_splitk.as_records(table), "step": step}, xp)
    return 0


if __name__ == "__main__":
    sys.exit(main())
