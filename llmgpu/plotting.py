"""Every plot of the book and of ``llmgpu train``: bars against a ceiling line, rate-vs-size curves,
the roofline, step breakdowns, fusion speed-ups and loss curves.

Kept in one module so every chapter draws measurements the same way and notebook cells stay short.
matplotlib is imported on first use.

This module is long because it is every plot of the book in one place (the reason above); each function is one
figure and stays short.
"""

from __future__ import annotations

import numpy as np


def _saved(ax, png_path, own: bool):
    """``png_path`` after writing the figure there (closed when this function made it), else ``ax``."""
    if png_path is None:
        return ax
    ax.figure.tight_layout()
    ax.figure.savefig(png_path, dpi=120)
    if own:
        _plt().close(ax.figure)
    return png_path


def _plt():
    import matplotlib

    if matplotlib.get_backend().lower() in ("", "agg") or not _in_notebook():
        matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt

    return plt


def _in_notebook() -> bool:
    try:
        from IPython import get_ipython

        return get_ipython() is not None
    except ImportError:
        return False


def bars_vs_ceiling(labels, values, *, ceiling=None, ceiling_label="ceiling", ylabel="GB/s", title="",
                    ax=None, colors=None, annotate_pct=True):
    """Horizontal-free bar chart with an optional dashed ceiling line and % of ceiling on each bar."""
    plt = _plt()
    if ax is None:
        _, ax = plt.subplots(figsize=(max(5.0, 0.9 * len(labels) + 2), 3.6))
    xs = range(len(labels))
    ax.bar(xs, values, color=colors or "#4c72b0")
    ax.set_xticks(list(xs), labels, rotation=20, ha="right")
    ax.set_ylabel(ylabel)
    if title:
        ax.set_title(title)
    if ceiling:
        ax.axhline(ceiling, color="#c44e52", ls="--", lw=1.5, label=f"{ceiling_label}: {ceiling:,.0f} {ylabel}")
        ax.legend(loc="upper left", fontsize=8)
        ax.set_ylim(0, max(max(values), ceiling) * 1.15)
    for x, v in zip(xs, values):
        txt = f"{v:,.0f}" if v >= 10 else f"{v:.2g}"
        if ceiling and annotate_pct:
            txt += f"\n{100 * v / ceiling:.0f}%"
        ax.annotate(txt, (x, v), ha="center", va="bottom", fontsize=8)
    ax.figure.tight_layout()
    return ax


def rate_vs_size(rows, *, x="size", y="tflops", group="method", ylabel="TFLOP/s", xlabel="size", title="",
                 ax=None, logy=True):
    """One line per ``group`` value: ``y`` against ``x`` (rows are dicts)."""
    plt = _plt()
    if ax is None:
        _, ax = plt.subplots(figsize=(6.5, 4))
    groups = list(dict.fromkeys(r[group] for r in rows))
    for g in groups:
        pts = sorted((r[x], r[y]) for r in rows if r[group] == g)
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=g)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    if logy:
        ax.set_yscale("log")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    if title:
        ax.set_title(title)
    ax.figure.tight_layout()
    return ax



def spread_positions(targets, gap: float, lo: float = 0.0, hi: float = 1.0) -> list[float]:
    """Positions for labels in one column: each as near its target as the others allow, neighbours at least ``gap``
    apart, all within [lo, hi] (the gap shrinks when the column is too short for all), in the order of
    ``targets``. A forward pass pushes labels up past their lower neighbour, a backward pass pulls them under
    the top and their upper neighbour."""
    order = sorted(range(len(targets)), key=lambda i: targets[i])
    if len(order) > 1:
        gap = min(gap, (hi - lo) / (len(order) - 1))
    pos = [min(max(targets[i], lo), hi) for i in order]
    for j in range(1, len(pos)):
        pos[j] = max(pos[j], pos[j - 1] + gap)
    for j in range(len(pos) - 1, -1, -1):
        pos[j] = min(pos[j], hi if j == len(pos) - 1 else pos[j + 1] - gap)
    rank = {i: j for j, i in enumerate(order)}
    return [pos[rank[i]] for i in range(len(targets))]


ROOFLINE_LABEL_PT = 7


def roofline_plot(rows, peak_tflops: float, peak_gbps: float, *, ax=None, path=None, title=None):
    """Log-log roofline: one point per kernel at (FLOP/byte, achieved TFLOP/s) under the roofs.

    ``rows``: dicts with ``name``, ``flops`` and ``bytes`` per call, and ``ms`` per call (or
    ``tflops`` directly); rows without positive flops and bytes are skipped (no place on a log axis).
    The roofs: ``peak_gbps · intensity`` (memory-bound) and ``peak_tflops`` (compute-bound), meeting
    at the ridge point ``peak_tflops / peak_gbps`` FLOP/byte. The kernels' names stand in a column right of the
    plot, at their point's height as far as the column allows, each joined to its point by a thin line: a
    step's GEMMs sit close together, and names written next to their points would cover each other.
    Returns the axes; saves to ``path``.
    """
    if peak_tflops <= 0 or peak_gbps <= 0:
        raise ValueError("peak_tflops and peak_gbps must be positive")
    plt = _plt()
    pts = []
    for r in rows:
        fl, by = r.get("flops"), r.get("bytes")
        if not fl or not by or fl <= 0 or by <= 0:
            continue
        tf = r.get("tflops")
        if tf is None:
            tf = fl / (r["ms"] * 1e-3) / 1e12
        if tf > 0:
            pts.append((r.get("name", r.get("op", "?")), fl / by, tf))
    if ax is None:  # tall enough for a column of every name
        _, ax = plt.subplots(figsize=(9, max(4.6, 1.4 + len(pts) * 1.3 * ROOFLINE_LABEL_PT / 72 / 0.85)))
    ridge = peak_tflops * 1e3 / peak_gbps  # (TFLOP/s · 1e12) / (GB/s · 1e9) FLOP per byte
    xs = [p[1] for p in pts] + [ridge]
    lo, hi = min(xs) / 4, max(xs) * 4
    grid = np.geomspace(lo, hi, 200)
    ax.plot(grid, np.minimum(peak_tflops, grid * peak_gbps / 1e3), color="#c44e52", lw=1.8,
            label=f"roof: {peak_gbps:,.0f} GB/s, {peak_tflops:,.0f} TFLOP/s")
    ax.axvline(ridge, color="#c44e52", ls=":", lw=1)
    ax.annotate(f"ridge {ridge:.0f} FLOP/B", (ridge, peak_tflops), textcoords="offset points", xytext=(-4, -12),
                ha="right", fontsize=8, color="#c44e52")
    ax.set_xscale("log")
    ax.set_yscale("log")
    y_lo = min([p[2] for p in pts] + [peak_tflops]) / 3
    y_hi = max([p[2] for p in pts] + [peak_tflops]) * 2.5  # a ceiling measured low leaves points above its roof
    ax.set_xlim(lo, hi)
    ax.set_ylim(y_lo, y_hi)
    if pts:
        ax.scatter([p[1] for p in pts], [p[2] for p in pts], s=24, color="#4c72b0", zorder=3)
        height_pt = ax.figure.get_figheight() * ax.get_position().height * 72
        frac = [np.log(y / y_lo) / np.log(y_hi / y_lo) for _, _, y in pts]
        for (name, x, y), f in zip(pts, spread_positions(frac, 1.3 * ROOFLINE_LABEL_PT / height_pt)):
            ax.annotate(name, (x, y), xytext=(1.03, f), textcoords="axes fraction", fontsize=ROOFLINE_LABEL_PT,
                        va="center", ha="left", annotation_clip=False,
                        arrowprops={"arrowstyle": "-", "color": "0.6", "lw": 0.5, "shrinkA": 1, "shrinkB": 3})
    ax.set_xlabel("arithmetic intensity (FLOP / byte)")
    ax.set_ylabel("achieved TFLOP/s")
    ax.set_title(title or "roofline")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8, loc="upper left")  # above the memory roof: no kernel can be there
    ax.figure.tight_layout()
    if path is not None:
        ax.figure.savefig(path, dpi=120)
    return ax


def plot_step_breakdown(steps: dict, *, top: int = 16, ax=None, title=None):
    """Grouped horizontal bars of milliseconds per op, one colour per step: ``steps`` maps a label
    (``"book"``, ``"fast"``) to the rows of ``profile_step`` / ``OpTimer.rows``. Shows the ``top`` ops by
    their largest time in any step; the legend gives each step's total."""
    plt = _plt()
    labels = list(steps)
    ms = {lab: {r["op"]: r["total_ms"] for r in rows if r.get("depth", 0) == 0} for lab, rows in steps.items()}
    ops = sorted({op for d in ms.values() for op in d}, key=lambda op: -max(d.get(op, 0.0) for d in ms.values()))
    ops = ops[:top]
    if ax is None:
        _, ax = plt.subplots(figsize=(8, 0.32 * len(ops) * max(1, len(labels)) + 1.2))
    yy = np.arange(len(ops))
    h = 0.8 / max(1, len(labels))
    for j, lab in enumerate(labels):
        total = sum(ms[lab].values())
        ax.barh(yy + (j - (len(labels) - 1) / 2) * h, [ms[lab].get(op, 0.0) for op in ops], height=h,
                label=f"{lab}: {total:.2f} ms in regions")
    ax.set_yticks(yy, ops, fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("ms per step")
    ax.set_title(title or "time per op")
    ax.legend(fontsize=8, loc="lower right")
    ax.grid(True, axis="x", alpha=0.3)
    ax.figure.tight_layout()
    return ax


def plot_fusions(rows, ax=None, title=None):
    """Grouped horizontal bars: separate vs fused time per comparison, speed-up printed at the bar."""
    plt = _plt()
    names = list(dict.fromkeys(r["comparison"] for r in rows))
    if ax is None:
        _, ax = plt.subplots(figsize=(8, 0.7 * len(names) + 1.2))
    yy = np.arange(len(names))
    for off, variant, color in ((-0.2, "separate", "#9aa5b1"), (0.2, "fused", "#2b7bba")):
        ms = [next(r["ms"] for r in rows if r["comparison"] == n and r["variant"] == variant) for n in names]
        ax.barh(yy + off, ms, height=0.38, color=color, label=variant)
        if variant == "fused":
            for y, n, m in zip(yy, names, ms):
                sp = next(r["speedup"] for r in rows if r["comparison"] == n and r["variant"] == "fused")
                ax.text(m, y + off, f"  {sp:.2f}×", va="center", fontsize=9)
    ax.set_yticks(yy, names)
    ax.invert_yaxis()
    ax.set_xlabel("ms (median)")
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0)  # beside the bars: they reach the edge
    if title:
        ax.set_title(title)
    return ax


def plot_losses(records, png_path=None, ax=None):
    """Training loss per step (and a moving average) with the validation points, from the records of a
    training log (``llmgpu.train.read_log(run_dir)``); saves a PNG when ``png_path`` is given."""
    recs = list(records)
    tr = [(r["step"], r["loss"]) for r in recs if r.get("type") == "train"]
    va = [(r["step"], r["val_loss"]) for r in recs if r.get("type") == "val"]
    plt = _plt()
    own = ax is None
    if own:
        fig, ax = plt.subplots(figsize=(7, 4))
    if tr:
        s, l_ = np.array(tr, dtype=float).T
        ax.plot(s, l_, color="#4c72b0", alpha=0.35, lw=1, label="train loss (per step)")
        w = max(1, len(l_) // 50)
        if w > 1:
            sm = np.convolve(l_, np.ones(w) / w, mode="valid")
            ax.plot(s[w - 1:], sm, color="#4c72b0", lw=2, label=f"train loss ({w}-step mean)")
    if va:
        s, v = np.array(va, dtype=float).T
        ax.plot(s, v, "o-", color="#c44e52", lw=2, ms=4, label="validation loss")
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats/token)")
    run = next((r for r in recs if r.get("type") == "run"), None)
    title = "training run"
    if run is not None and "config" in run:
        c = run["config"]
        title = (f"{run.get('parameters', 0) / 1e6:.1f}M parameters, {c.get('dtype')}, batch "
                 f"{c.get('batch')}x{c.get('seq')}x{c.get('grad_accum')}")
        if va:
            title += f": validation loss {va[0][1]:.2f} -> {va[-1][1]:.2f}"
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend()
    return _saved(ax, png_path, own)


def plot_loss_comparison(runs: dict, png_path=None, ax=None, *, smooth: int = 20):
    """Training loss of several runs on one axis (``{label: read_log(run_dir)}``), each as its
    ``smooth``-step moving average, skipped steps (fp16 overflow) marked with an x: bf16 against fp16."""
    plt = _plt()
    own = ax is None
    if own:
        _, ax = plt.subplots(figsize=(7, 4))
    for label, recs in runs.items():
        tr = [(r["step"], r["loss"], r.get("skipped", False)) for r in recs if r.get("type") == "train"]
        if not tr:
            continue
        s, l_ = np.array([t[:2] for t in tr], dtype=float).T
        w = max(1, min(smooth, len(l_)))
        sm = np.convolve(l_, np.ones(w) / w, mode="valid")
        line, = ax.plot(s[w - 1:], sm, lw=2, label=f"{label} ({w}-step mean)")
        sk = [(t[0], t[1]) for t in tr if t[2]]
        if sk:
            ax.plot(*np.array(sk, dtype=float).T, "x", color=line.get_color(), ms=6,
                    label=f"{label}: {len(sk)} skipped steps")
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats/token)")
    ax.grid(alpha=0.3)
    ax.legend()
    return _saved(ax, png_path, own)


def plot_scale_table(table, png_path=None, *, title=None):
    """Chapter 8's scale table (``llmgpu bench --preset gpt2,d24,d36,d48``; its JSON's ``presets`` or a
    list of its rows): MFU and peak memory against parameters, llmgpu and PyTorch side by side, each point
    labelled with its batch (``cK``: checkpointing every K blocks)."""
    plt = _plt()
    rows = sorted(table.values() if isinstance(table, dict) else table, key=lambda r: r["parameters"])
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(10, 3.8))
    sides = (("llmgpu", "#4c72b0"), ("torch", "#dd8452"))
    mfu = lambda r: 100 * (r.get("mfu") or 0)  # noqa: E731
    gib = lambda r: r["peak_memory_bytes"] / 2**30 if r.get("peak_memory_bytes") else None  # noqa: E731
    for side, color in sides:
        other = next(s for s, _ in sides if s != side)
        pts = [(r["parameters"] / 1e6, r[side], r.get(other, {})) for r in rows if r.get(side, {}).get("tokens_per_s")]
        if not pts:
            continue
        label = pts[0][1].get("mode", side)
        a1.plot([x for x, _, _ in pts], [mfu(r) for _, r, _ in pts], "o-", color=color, label=label)
        mem = [(x, gib(r)) for x, r, _ in pts if gib(r) is not None]
        if mem:
            a2.plot(*zip(*mem), "o-", color=color, label=label)
        for x, r, o in pts:  # each point labelled with its batch on both panels (memory depends on it), centred
            k = r.get("checkpoint_every") or 0  # above the point where it is the higher of the two, else below (off
            tag = f"B={r['batch']}" + (f" c{k}" if k else "")  # the lines, which leave a point sideways)
            for ax, v, w in ((a1, mfu(r), mfu(o) if o.get("tokens_per_s") else None), (a2, gib(r), gib(o))):
                if v is not None:
                    above = w is None or v >= w
                    ax.annotate(tag, (x, v), textcoords="offset points", xytext=(0, 6 if above else -6), ha="center",
                                va="bottom" if above else "top", fontsize=7, color=color)
    ticks = [r["parameters"] / 1e6 for r in rows]
    names = [f"{r.get('preset', '')}\n{r['parameters'] / 1e6:,.0f}M" for r in rows]
    for ax, yl in ((a1, "MFU (%)"), (a2, "peak memory (GiB)")):
        ax.set_xscale("log")
        ax.set_xticks(ticks, names, fontsize=8)
        ax.minorticks_off()
        ax.margins(x=0.12, y=0.12)  # room for the outer points' labels
        ax.set_xlabel("parameters")
        ax.set_ylabel(yl)
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
    a1.set_ylim(bottom=0)
    a2.set_ylim(bottom=0)
    fig.suptitle(title or "largest power-of-two batch per model size", fontsize=10)
    fig.tight_layout()
    if png_path is not None:
        fig.savefig(png_path, dpi=120)
        plt.close(fig)
        return png_path
    return fig


def series_colors(n: int) -> list:
    """``n`` colours, all different: tab10 while they suffice (the default cycle, which repeats after ten), then
    tab20 (ten hues, dark and light), then evenly spaced along a continuous map."""
    from matplotlib import colormaps

    if n <= 20:
        return list(colormaps["tab10" if n <= 10 else "tab20"].colors[:n])
    return [colormaps["turbo"](x) for x in np.linspace(0.05, 0.95, n)]


def grouped_bars(values: dict, groups, series, *, ylabel="", title=None, ax=None, group_label=str, legend=True):
    """Vertical bars, one group per entry of ``groups`` (left to right), one bar per entry of ``series`` in each:
    ``values[(series, group)]`` is the height (a missing pair draws nothing). ``group_label(group)`` is the tick
    text; every series has its own colour (``series_colors``). Chapter 2b's TFLOP/s per attention shape and
    implementation."""
    plt = _plt()
    if ax is None:
        _, ax = plt.subplots(figsize=(8, 3.6))
    groups, series = list(groups), list(series)
    w = 0.8 / max(1, len(series))
    for j, (name, color) in enumerate(zip(series, series_colors(len(series)))):
        xs = [i for i, g in enumerate(groups) if (name, g) in values]
        ax.bar(np.array(xs) + (j - (len(series) - 1) / 2) * w, [values[name, groups[i]] for i in xs], w, label=name,
               color=color)
    ax.set_xticks(np.arange(len(groups)), [group_label(g) for g in groups], fontsize=8)
    ax.set_ylabel(ylabel)
    ax.grid(axis="y", alpha=0.3)
    if legend:
        ax.legend(fontsize=8)
    if title:
        ax.set_title(title)
    return ax


def grouped_bars_vs_ceiling(results: dict, keys, *, ceiling, title="", ceiling_label="copy ceiling",
                            xlabel="GB/s (minimum bytes / time)", ax=None, fontsize=12):
    """Horizontal bars, one group per key (e.g. ``("layernorm", "bwd")``, top to bottom), one bar per
    method that key has, each labelled with its % of the dashed ceiling line: ``results[key][method]`` is
    the value. Chapter 3's kernel summary.

    Horizontal so that the figure keeps one width (8 inches: drawn about 1:1 on a book page, the labels
    stay at their point size) and grows in height with the number of kernels.
    """
    plt = _plt()
    methods = list(dict.fromkeys(m for k in keys for m in results[k]))  # in first-seen order
    colors = {m: f"C{i}" for i, m in enumerate(methods)}
    bar_h, gap = 0.8, 0.7  # bar height and the space between groups, in bar units
    n_bars = sum(len(results[k]) for k in keys)
    own = ax is None
    if own:
        _, ax = plt.subplots(figsize=(8.0, 1.3 + 0.3 * n_bars + 0.15 * len(keys)), layout="constrained")
    y, ticks, seen = 0.0, [], set()
    top = max(ceiling, *(v for k in keys for v in results[k].values()))
    for k in keys:
        rows = [m for m in methods if m in results[k]]
        ys = y + np.arange(len(rows))
        for yy, m in zip(ys, rows):
            v = results[k][m]
            ax.barh(yy, v, bar_h, color=colors[m], label=None if m in seen else m)
            seen.add(m)
            pct = 100 * v / ceiling
            ax.text(v + 0.01 * top, yy, f"{pct:.0f}%" if pct >= 1 else f"{pct:.1g}%", va="center",
                    fontsize=fontsize - 2)
        ticks.append((ys.mean(), " ".join(map(str, k)) if isinstance(k, tuple) else str(k)))
        y = ys[-1] + 1 + gap
    ax.axvline(ceiling, color="k", ls="--", lw=1.2, label=f"{ceiling_label} {ceiling:,.0f} GB/s")
    ax.set_yticks([t for t, _ in ticks], [name for _, name in ticks], fontsize=fontsize)
    ax.invert_yaxis()  # the first key on top
    ax.tick_params(axis="x", labelsize=fontsize - 1)
    ax.set_xlabel(xlabel, fontsize=fontsize)
    ax.set_xlim(0, 1.14 * top)  # room for the % labels
    if title:
        ax.set_title(title, fontsize=fontsize + 1)
    if own:  # under the axes, outside the bars
        ax.figure.legend(loc="outside lower center", ncol=3, fontsize=fontsize - 1, frameon=False)
    else:
        ax.legend(fontsize=fontsize - 2, loc="lower right")
    return ax


# --------------------------------------------------------------------------- chapter 9: collectives and the ring

RANK_COLORS = ("#4c72b0", "#dd8452", "#55a868", "#c44e52", "#8172b3", "#937860", "#da8bc3", "#8c8c8c")


def draw_holds(holds, ax, *, title="", send=None, recv=None):
    """One picture of N ranks' buffers: row r is rank r, column s its segment s; the cell is cut into N thin
    stripes, stripe k in rank k's colour when the cell holds rank k's data (``holds[r, s]``: a bitmask), white
    when not, so a complete sum is every colour. ``send``/``recv`` (a segment per rank) outline the segment
    each rank sends (black) and the one it receives (red, dashed) in the step that follows."""
    from matplotlib.patches import Rectangle

    holds = np.asarray(holds)
    n_ranks, n_seg = holds.shape
    N = max(n_ranks, int(holds.max()).bit_length())
    for r in range(n_ranks):
        for s in range(n_seg):
            y = n_ranks - 1 - r
            for k in range(N):
                if holds[r, s] >> k & 1:
                    ax.add_patch(Rectangle((s + 0.05 + 0.9 * k / N, y + 0.1), 0.9 / N, 0.8, lw=0,
                                           color=RANK_COLORS[k % len(RANK_COLORS)]))
            ax.add_patch(Rectangle((s + 0.05, y + 0.1), 0.9, 0.8, fill=False, lw=0.6, ec="#999999"))
            if holds[r, s] == (1 << N) - 1 and N > 1:
                ax.text(s + 0.5, y + 0.5, "Σ", ha="center", va="center", color="white", fontsize=11,
                        fontweight="bold")
        for segs, kw in ((send, {"ec": "black", "lw": 2.2}), (recv, {"ec": "#c44e52", "lw": 2.2, "ls": "--"})):
            if segs is not None:
                ax.add_patch(Rectangle((segs[r] + 0.02, n_ranks - 1 - r + 0.05), 0.96, 0.9, fill=False, **kw))
    ax.set_xlim(0, n_seg)
    ax.set_ylim(0, n_ranks)
    ax.set_xticks(np.arange(n_seg) + 0.5, [f"seg {s}" for s in range(n_seg)], fontsize=7)
    ax.set_yticks(np.arange(n_ranks) + 0.5, [f"rank {r}" for r in reversed(range(n_ranks))], fontsize=7)
    ax.tick_params(length=0)
    for side in ax.spines.values():
        side.set_visible(False)
    if title:
        ax.set_title(title, fontsize=9)
    return ax


def draw_collectives(n_ranks: int = 4):
    """All-reduce, reduce-scatter and all-gather as before/after pictures of ``n_ranks`` ranks (``draw_holds``)."""
    plt = _plt()
    N = n_ranks
    own = np.array([[1 << r] * N for r in range(N)])
    full = (1 << N) - 1
    cases = [("all-reduce", own, np.full((N, N), full)),
             ("reduce-scatter", own, np.diag([full] * N)),
             ("all-gather", np.diag([1 << r for r in range(N)]), np.array([[1 << s for s in range(N)]] * N))]
    fig, axes = plt.subplots(len(cases), 2, figsize=(6.4, 2.0 * len(cases)))
    for (name, before, after), (a0, a1) in zip(cases, axes):
        draw_holds(before, a0, title=f"{name}: before")
        draw_holds(after, a1, title=f"{name}: after")
    fig.tight_layout()
    return fig


def draw_ring_trace(trace, *, cols: int = 4):
    """Every state of a simulated ring all-reduce (``llmgpu.dist.ring.simulate_ring_allreduce``): the start,
    then each step's result; each panel outlines what the next step sends (black) and receives (red)."""
    plt = _plt()
    states = len(trace.holds)
    rows = -(-states // cols)
    N = trace.holds[0].shape[0]
    fig, axes = plt.subplots(rows, cols, figsize=(2.6 * cols, (0.42 * N + 0.9) * rows), squeeze=False)
    for k, ax in enumerate(axes.flat):
        if k >= states:
            ax.axis("off")
            continue
        nxt = trace.steps[k] if k < len(trace.steps) else None
        done = "start" if k == 0 else f"after step {k} ({trace.steps[k - 1].phase})"
        draw_holds(trace.holds[k], ax, title=done, send=nxt.send if nxt else None, recv=nxt.recv if nxt else None)
    fig.tight_layout()
    return fig


def plot_allreduce(rows, *, ax=None, y="busbw_GBps", model=True, title=None):
    """Bandwidth against message size, one line per (implementation, dtype, world size): ``rows`` as
    ``benchmarks/bench_ch9_allreduce.py`` writes them (``bytes``, ``impl``, ``dtype``, ``world_size``, ``y``,
    and ``model_busbw_GBps`` for the cost model's line when ``model``)."""
    plt = _plt()
    if ax is None:
        _, ax = plt.subplots(figsize=(7, 4))
    groups = {}
    for r in rows:
        if r.get(y) is not None:  # at world size 1 no bus bandwidth, and NCCL's all-reduce is a no-op
            groups.setdefault((r["impl"], r["dtype"], r["world_size"]), []).append(r)
    for (impl, dtype, world), rs in sorted(groups.items()):
        rs = sorted(rs, key=lambda r: r["bytes"])
        ls = "--" if impl in ("ring", "reduce kernel") else "-"  # ours dashed, the engine's solid
        ax.plot([r["bytes"] for r in rs], [r[y] for r in rs], ls, marker="o", ms=3,
                label=f"{impl} {dtype}, {world} rank{'s' if world > 1 else ''}")
    for world in sorted({r["world_size"] for r in rows}) if model and y == "busbw_GBps" else ():
        pts = sorted({(r["bytes"], r["model_busbw_GBps"]) for r in rows
                      if r["world_size"] == world and r.get("model_busbw_GBps")})
        if pts:
            ax.plot(*zip(*pts), ":", color="k", label=f"cost model, {world} ranks")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("message size (bytes)")
    ax.set_ylabel({"busbw_GBps": "bus bandwidth (GB/s)", "algbw_GBps": "algorithm bandwidth (GB/s)"}.get(y, y))
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8)
    if title:
        ax.set_title(title, fontsize=10)
    ax.figure.tight_layout()
    return ax
