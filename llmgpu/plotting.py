"""The book's recurring plots: bars against a ceiling line, and rate-vs-size curves.

Kept in the package so every chapter draws measurements the same way and notebook cells stay short.
"""

from __future__ import annotations


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
