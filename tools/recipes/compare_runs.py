"""Compare the loss curves of training runs (e.g. ``--dtype bf16`` against ``--dtype fp16`` or ``--dtype fp8``).

    python tools/recipes/compare_runs.py RUN_A RUN_B [...] [--png losses.png] [--json out.json]

For each run directory (``llmgpu train --out DIR``): its dtype (and FP8 recipe), steps, skipped steps (fp16 overflows
the loss scaler skipped), the mean loss of the first and the last ``--window`` steps, the final validation loss and
the training time; for every run after the first, the largest gap between its moving-average loss and the first
run's over the steps both logged. ``--png`` draws the curves (``llmgpu.plotting.plot_loss_comparison``).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from llmgpu.train import read_log  # noqa: E402


def summarize(records, window: int = 20) -> dict:
    tr = [r for r in records if r.get("type") == "train"]
    va = [r for r in records if r.get("type") == "val"]
    run = next((r for r in records if r.get("type") == "run"), {})
    end = next((r for r in reversed(records) if r.get("type") == "end"), {})
    recipe = run.get("config", {}).get("fp8_recipe")
    losses = np.array([r["loss"] for r in tr], dtype=float)
    w = max(1, min(window, len(losses)))
    return {"dtype": run.get("config", {}).get("dtype"), **({"fp8_recipe": recipe} if recipe else {}), "steps": len(tr),
            "skipped_steps": sum(bool(r.get("skipped")) for r in tr),
            "first_loss": float(losses[:w].mean()) if len(losses) else None,
            "last_loss": float(losses[-w:].mean()) if len(losses) else None,
            "final_val_loss": va[-1]["val_loss"] if va else None,
            "tokens_per_s": next((r["tokens_per_s"] for r in reversed(tr) if "tokens_per_s" in r), None),
            "train_time_s": end.get("train_time_s")}


def max_gap(a, b, window: int = 20) -> float | None:
    """The largest |moving-average loss difference| over the steps both runs logged."""
    la = {r["step"]: r["loss"] for r in a if r.get("type") == "train"}
    lb = {r["step"]: r["loss"] for r in b if r.get("type") == "train"}
    steps = sorted(set(la) & set(lb))
    if not steps:
        return None
    w = max(1, min(window, len(steps)))
    k = np.ones(w) / w
    d = np.convolve([la[s] for s in steps], k, "valid") - np.convolve([lb[s] for s in steps], k, "valid")
    return float(np.abs(d).max())


def _precision(s: dict) -> str:
    """A run's precision in words: its dtype, with the FP8 recipe ('fp8 current')."""
    return f"{s['dtype']} {s['fp8_recipe']}" if s.get("fp8_recipe") else str(s["dtype"])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("runs", nargs="+", type=Path)
    p.add_argument("--window", type=int, default=20)
    p.add_argument("--png", type=Path)
    p.add_argument("--json", type=Path)
    a = p.parse_args(argv)
    logs = {str(r): read_log(r) for r in a.runs}
    first = next(iter(logs.values()))
    out = {}
    for name, recs in logs.items():
        s = summarize(recs, a.window)
        if recs is not first:
            s["max_gap_to_first"] = max_gap(first, recs, a.window)
        s["curve"] = [[r["step"], r["loss"]] for r in recs if r.get("type") == "train"]  # (step, loss): to plot
        out[name] = s
        print(f"{name}: {_precision(s)}, {s['steps']} steps, {s['skipped_steps']} skipped, loss {s['first_loss']:.4f} "
              f"-> {s['last_loss']:.4f} (mean of {a.window})"
              + (f", val {s['final_val_loss']:.4f}" if s["final_val_loss"] is not None else "")
              + (f", max gap to the first run {s['max_gap_to_first']:.4f}" if "max_gap_to_first" in s else ""))
    if a.png:
        from llmgpu.plotting import plot_loss_comparison

        labels = {f"{Path(n).name} ({_precision(out[n])})": recs for n, recs in logs.items()}
        plot_loss_comparison(labels, a.png, smooth=a.window)
        print(f"wrote {a.png}")
    if a.json:
        a.json.write_text(json.dumps(out, indent=1) + "\n")
        print(f"wrote {a.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
