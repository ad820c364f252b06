"""The package tree is the chapter map: floors that only look down, no import cycles, files of a readable size.

Read from the sources (``ast``), every ``import`` counted, also those inside functions.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1] / "llmgpu"

# Each floor imports only from floors below it (or from its own floor, without cycles).
FLOORS = [
    ("ground", ("backend", "checks", "testing", "plotting", "instrument", "results", "version")),
    ("kernels", ("kernels",)),
    ("ops/gemm", ("ops", "gemm")),
    ("optim", ("optim",)),
    ("amp", ("amp",)),
    ("model", ("model",)),
    ("perf", ("perf",)),
    ("dist", ("dist",)),
    ("interop", ("interop",)),  # Hugging Face directories, safetensors: above the model, below the trainer
    ("train", ("train",)),
    ("applications", ("torch_llama", "torch_reference", "bench", "bench_fp8", "bench_scale", "cli", "__main__")),
]
FLOOR_OF = {name: i for i, (_, names) in enumerate(FLOORS) for name in names}
# Files of a readable size: (globs under the repository root, most lines). A longer file says why at its top (its
# docstring, or its first 3000 characters): "This module / script / file is long because ...".
REPO = ROOT.parent
SIZE_RULES = [
    (("llmgpu/**/*.py",), 500),  # package modules
    (("tools/**/*.py", "tools/**/*.sh", "benchmarks/**/*.py", "dev/**/*.py"), 500),  # the workbench's scripts
    # a kernel file holds one layer's kernels from naive to fast, the progression its chapter walks through
    # (flash_attention.cu: 1054 lines, with the deterministic backward's variants)
    (("llmgpu/kernels/*.cu", "llmgpu/kernels/*.cuh", "dev/**/*.cu"), 1100),
]


def _module_name(path: Path) -> str:
    rel = path.relative_to(ROOT.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def _imports(path: Path) -> set[str]:
    """The llmgpu modules ``path`` imports (absolute names), wherever the import statement is."""
    mod = _module_name(path)
    pkg = mod if path.name == "__init__.py" else mod.rsplit(".", 1)[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name.startswith("llmgpu")}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = pkg.split(".")
                base = base[: len(base) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if not target.startswith("llmgpu"):
                continue
            for a in node.names:  # `from llmgpu.perf import timing` imports the module llmgpu.perf.timing
                sub = f"{target}.{a.name}"
                out.add(sub if (ROOT.parent / Path(*sub.split("."))).with_suffix(".py").exists()
                        or (ROOT.parent / Path(*sub.split("."))).is_dir() else target)
    return out - {mod}


def _graph():
    return {_module_name(p): _imports(p) for p in ROOT.rglob("*.py")}


def _floor(module: str) -> int:
    parts = module.split(".")
    return FLOOR_OF[parts[1]] if len(parts) > 1 else len(FLOORS)  # `llmgpu` itself: the top


def test_every_module_has_a_floor():
    for m in _graph():
        assert m == "llmgpu" or m.split(".")[1] in FLOOR_OF, f"{m} is on no floor: add it to FLOORS"


def test_floors_only_look_down():
    bad = [f"{m} ({FLOORS[_floor(m)][0]}) imports {d} ({FLOORS[_floor(d)][0] if _floor(d) < len(FLOORS) else 'top'})"
           for m, deps in _graph().items() for d in deps if _floor(d) > _floor(m)]
    assert not bad, "\n".join(bad)


def _parents(module: str) -> list[str]:
    """Importing a.b.c runs a/__init__ and a/b/__init__ first: those are edges too."""
    parts = module.split(".")
    return [".".join(parts[:i]) for i in range(2, len(parts))]


def test_no_import_cycles():
    g = _graph()
    edges = {m: {d for d in deps if d in g} | {p for d in deps for p in _parents(d) if p in g and p != m
                                                and not m.startswith(p + ".")}
             for m, deps in g.items()}
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(m):
        state[m] = 1
        stack.append(m)
        for d in sorted(edges[m]):
            if state.get(d) == 1:
                cycle = stack[stack.index(d):] + [d]
                pytest.fail("import cycle: " + " -> ".join(cycle))
            if d not in state:
                visit(d)
        stack.pop()
        state[m] = 2

    for m in sorted(edges):
        if m not in state:
            visit(m)


def test_model_does_not_import_chapter_8_tooling():
    for m, deps in _graph().items():
        if m.startswith(("llmgpu.model", "llmgpu.ops", "llmgpu.optim", "llmgpu.gemm")):
            assert not any(d.startswith("llmgpu.perf") for d in deps), f"{m} imports {deps}"


def _opening(path: Path) -> str:
    """What a file says at its top: a Python file's docstring (it may be long), else its first 3000 characters."""
    text = path.read_text()
    doc = ast.get_docstring(ast.parse(text)) if path.suffix == ".py" else None
    return (doc or "") + text[:3000]


def _oversized(globs, limit, root: Path = REPO) -> list[str]:
    files = sorted({p for g in globs for p in root.glob(g) if "__pycache__" not in p.parts})
    assert files, f"no files match {globs}"
    return [f"{p.relative_to(root)}: {n} lines (limit {limit})" for p in files
            if (n := p.read_text().count("\n")) > limit and "is long because" not in _opening(p)]


@pytest.mark.parametrize("globs,limit", SIZE_RULES, ids=["package", "scripts", "kernels"])
def test_files_stay_readable(globs, limit):
    long = _oversized(globs, limit)
    assert not long, "files over their limit without a reason at their top:\n" + "\n".join(long)


def test_the_size_rule_sees_a_long_file_without_a_reason(tmp_path):
    """The rule can fail: a long script fails it, the same script saying why at its top passes."""
    body = "x = 1\n" * 600
    (tmp_path / "work").mkdir()
    (tmp_path / "work" / "long.py").write_text('"""A probe."""\n' + body)
    (tmp_path / "work" / "short.sh").write_text("# a short script\n")
    assert _oversized(("work/*.py", "work/*.sh"), 500, tmp_path) == ["work/long.py: 601 lines (limit 500)"]
    (tmp_path / "work" / "long.py").write_text('"""A probe.\n\nThis script is long because it must be."""\n' + body)
    assert _oversized(("work/*.py", "work/*.sh"), 500, tmp_path) == []


def test_no_docstring_cites_a_file_outside_the_repository():
    for p in ROOT.rglob("*.py"):
        assert "DESIGN.md" not in p.read_text(), f"{p.relative_to(ROOT)} cites DESIGN.md, which is not in the repo"


def test_no_private_name_is_imported_from_another_module():
    bad = []
    for p in ROOT.rglob("*.py"):
        for node in ast.walk(ast.parse(p.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.level or (node.module or "").startswith("llmgpu")):
                bad += [f"{p.relative_to(ROOT)}: {a.name}" for a in node.names
                        if a.name.startswith("_") and not a.name.startswith("__")]
    assert not bad, "private helpers imported across modules (make them public or keep them home):\n" + "\n".join(bad)
