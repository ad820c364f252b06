"""The repository's measured results, and the one way the notebooks read them.

GPU runs write JSON into ``benchmarks/results/<chapter>/`` (``ch8/ch8_bench_fair.json``): the folder of the chapter
that reads or cites the file; ``archive/`` keeps lab history that no chapter reads (``benchmarks/README.md``).
A notebook asks for ``load_result("ch8/ch8_bench_fair")``: the path under ``benchmarks/results``, looked up from the
working directory upwards (a notebook runs in ``book/``), then in the checkout this package was imported from.
A missing or misplaced file is one error that says where it looked and where the file is instead.
"""

from __future__ import annotations

import json
from pathlib import Path

RESULTS = Path("benchmarks", "results")  # relative to a checkout's root
ARCHIVE = "archive"


def results_dir(start: str | Path | None = None) -> Path:
    """The checkout's ``benchmarks/results``: in ``start`` (default: the working directory) or the nearest of its
    parents that has one, else in the checkout beside this package. FileNotFoundError when neither has one (an
    installed wheel holds no results: they live in the repository)."""
    here = Path(start or Path.cwd()).resolve()
    checkout = Path(__file__).resolve().parents[1]
    for root in (here, *here.parents, checkout):
        if (root / RESULTS).is_dir():
            return root / RESULTS
    raise FileNotFoundError(f"no {RESULTS.as_posix()} folder in {here}, its parents or {checkout}: the results live "
                            "in the llmgpu repository; run from a checkout")


def load_result(name: str, *, start: str | Path | None = None) -> dict:
    """The JSON result ``benchmarks/results/<name>.json``, with ``name`` as ``"<chapter>/<file name>"``
    (``"ch8/ch8_bench_fair"``; a trailing ``.json`` is accepted). ``start``: where to look for the checkout
    (``results_dir``). FileNotFoundError when the file is not there (saying where it is if it sits in another
    chapter's folder), ValueError for a name that is not ``chapter/file``, points into ``archive/``, or a file
    that is not JSON."""
    parts = name.removesuffix(".json").split("/")
    if len(parts) != 2 or not all(parts) or ".." in parts:
        raise ValueError(f"load_result({name!r}): give the chapter's folder and the file, as 'ch8/ch8_bench_fair'")
    if parts[0] == ARCHIVE:
        raise ValueError(f"load_result({name!r}): {ARCHIVE}/ holds lab history that no chapter reads; move the file "
                         "into the folder of the chapter that reads it (benchmarks/README.md)")
    root = results_dir(start)
    path = root.joinpath(*parts).with_suffix(".json")
    if not path.is_file():
        elsewhere = sorted(p.relative_to(root).with_suffix("").as_posix() for p in root.glob(f"*/{path.name}"))
        hint = (f"it is in {' and '.join(elsewhere)}" if elsewhere else
                "no GPU run has written it in this checkout (benchmarks/README.md: which script writes what)")
        raise FileNotFoundError(f"load_result({name!r}): {path} does not exist; {hint}")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"load_result({name!r}): {path} is not JSON ({e})") from None
