"""The workbench's floor plan: tools/ grouped by role with a README each; benchmarks/results/ by chapter with an
archive no chapter reads; llmgpu.results.load_result, the notebooks' one way to read a result; every tool and
result the repository names by path is where the path says."""

from __future__ import annotations

import fnmatch
import json
import re
from pathlib import Path

import pytest

from llmgpu import results
from llmgpu.results import load_result, results_dir

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
NOTEBOOKS = sorted((ROOT / "book").glob("*.ipynb"))
# the repository's results and notebooks are not in the sdist (MANIFEST.in): these tests belong to a checkout
in_a_checkout = pytest.mark.skipif(not (RESULTS.is_dir() and NOTEBOOKS),
                                   reason="benchmarks/results and book/ are in a checkout, not in the sdist")


@pytest.fixture
def checkout(tmp_path):
    """A stand-in checkout: benchmarks/results/{ch8,ch3,archive} and a book/ folder to run from."""
    res = tmp_path / "benchmarks" / "results"
    for d in ("ch8", "ch3", "archive"):
        (res / d).mkdir(parents=True)
    (tmp_path / "book").mkdir()
    payload = {"results": [{"mode": "llmgpu", "tokens_per_s": 1.5e5}], "seed": 7}
    (res / "ch8" / "ch8_bench.json").write_text(json.dumps(payload))
    (res / "ch3" / "probe.json").write_text(json.dumps({"us": 89.6}))
    (res / "archive" / "old.json").write_text("{}")
    return tmp_path, payload


def test_load_result_reads_from_the_folder_a_notebook_runs_in(checkout, monkeypatch):
    root, payload = checkout
    monkeypatch.chdir(root / "book")  # a notebook runs in book/: the results are found one level up
    assert results_dir() == (root / "benchmarks" / "results").resolve()
    assert load_result("ch8/ch8_bench") == payload
    assert load_result("ch8/ch8_bench.json") == payload  # the file name as written in the prose works too
    assert load_result("ch3/probe", start=root) == {"us": 89.6}


@pytest.mark.parametrize("name", ["ch8_bench", "ch8/sub/ch8_bench", "../ch8/ch8_bench", "ch8/", "/ch8_bench", ""])
def test_a_name_is_a_chapter_and_a_file(checkout, name):
    root, _ = checkout
    with pytest.raises(ValueError, match="give the chapter's folder and the file"):
        load_result(name, start=root)


def test_the_archive_is_not_read(checkout):
    root, _ = checkout
    with pytest.raises(ValueError, match="archive/ holds lab history that no chapter reads"):
        load_result("archive/old", start=root)


def test_a_missing_result_says_where_it_looked(checkout):
    root, _ = checkout
    with pytest.raises(FileNotFoundError) as e:
        load_result("ch8/ch8_nothing", start=root)
    msg = str(e.value)
    assert "ch8_nothing.json does not exist" in msg and str(root) in msg and "benchmarks/README.md" in msg


def test_a_misplaced_result_says_where_it_is(checkout):
    root, _ = checkout
    with pytest.raises(FileNotFoundError, match="it is in ch3/probe"):
        load_result("ch8/probe", start=root)


def test_a_result_that_is_not_json(checkout):
    root, _ = checkout
    (root / "benchmarks" / "results" / "ch8" / "broken.json").write_text('{"rows": [1, 2')
    with pytest.raises(ValueError, match="broken.json is not JSON"):
        load_result("ch8/broken", start=root)


def test_no_checkout_anywhere(tmp_path, monkeypatch):
    """Neither the working directory's parents nor the package's own checkout hold results (an installed wheel)."""
    monkeypatch.setattr(results, "__file__", str(tmp_path / "site-packages" / "llmgpu" / "results.py"))
    with pytest.raises(FileNotFoundError, match="the results live in the llmgpu repository"):
        results_dir(tmp_path)


@in_a_checkout
def test_the_package_checkout_is_the_fallback(tmp_path):
    """From a folder outside any checkout, the results of the checkout this package was imported from."""
    assert results_dir(tmp_path) == RESULTS


# --------------------------------------------------------------------------- the repository's results


def _code(nb: Path) -> str:
    return "\n".join("".join(c["source"]) for c in json.loads(nb.read_text())["cells"] if c["cell_type"] == "code")


@in_a_checkout
def test_results_live_in_chapter_folders_and_the_archive():
    loose = [p.name for p in RESULTS.iterdir() if p.is_file()]
    assert not loose, f"files directly in benchmarks/results (give each its chapter's folder): {loose}"
    folders = {p.name for p in RESULTS.iterdir()}
    assert folders and all(re.fullmatch(r"ch\d+b?|archive", f) for f in folders), folders
    names = [p.name for p in RESULTS.glob("*/*")]
    twice = sorted({n for n in names if names.count(n) > 1})
    assert not twice, f"result names in two folders (a bare name in the prose must point at one file): {twice}"


@in_a_checkout
def test_every_result_a_notebook_loads_is_there():
    """Each load_result("...") of a notebook, f-strings expanded over the files they can match."""
    loaded = 0
    for nb in NOTEBOOKS:
        code = _code(nb)
        assert '"benchmarks" / "results"' not in code and "benchmarks/results/" not in code.replace(
            "no results in benchmarks/results/", ""), f"{nb.name} builds a result path by hand: use load_result"
        for fstring, name in re.findall(r'load_result\((f?)"([^"]+)"', code):
            pattern = re.sub(r"(\{[^}]*\})+", "*", name) + ".json" if fstring else name + ".json"
            assert list(RESULTS.glob(pattern)), f"{nb.name}: load_result({name!r}) matches no result file"
            assert not pattern.startswith("archive/"), f"{nb.name} reads {name} from the archive"
            loaded += 1
    assert loaded >= 25  # chapters 2b, 3, 8 and 9 read their results through it


# The texts that name tools and results by path: every such path must be right, so that a move cannot leave one behind.
TEXTS = ["README.md", "book/intro.md", "tools/**/*.md", "tools/**/*.sh", "tools/**/*.py", "benchmarks/*.py",
         "benchmarks/README.md", "dev/cuda/*.md", "dev/cuda/*.py", "dev/cuda/*.cu", "llmgpu/**/*.py",
         "llmgpu/kernels/*.cu", "llmgpu/kernels/*.cuh", "tools/checks/hip/*.h", "tests/*.py", ".ci/run",
         ".github/workflows/*.yml", "book/*.ipynb"]
SCRIPT = re.compile(r"(?<![\w./-])(tools/[\w/-]+\.(?:py|sh))")  # the scripts that moved (benchmarks/, dev/ did not)
RESULT = re.compile(r"(?<![\w./-])benchmarks/results/([\w*./<>{}-]*[\w*>}])")


def _texts():
    for pattern in TEXTS:
        for p in sorted(ROOT.glob(pattern)):
            if p.name == "test_workbench.py":
                continue
            text = p.read_text()
            if p.suffix == ".ipynb":  # the cells' sources: outputs are what the GPU run printed then
                text = "\n".join("".join(c["source"]) for c in json.loads(text)["cells"])
            yield p.relative_to(ROOT), text


def _missing_tools(texts) -> list[str]:
    return sorted({f"{rel}: {m}" for rel, text in texts for m in SCRIPT.findall(text) if not (ROOT / m).is_file()})


def _misplaced_results(texts) -> list[str]:
    """Result paths that do not point at their file: a file that sits in another folder, or a folder that is not
    there (a file the GPU has not written yet, such as ch9_allreduce_8gpu.json, needs only its folder)."""
    where = {p.name: p.parent.name for p in RESULTS.glob("*/*")}
    wrong = []
    for rel, text in texts:
        for m in RESULT.findall(text):
            folder, _, name = m.partition("/")
            if folder.startswith("<"):  # a placeholder: benchmarks/results/<chapter>/..., <name>.json
                continue
            if not name:  # a folder, or a file named without its folder
                inside = sorted({where[n] for n in where if fnmatch.fnmatch(n, m)})
                if inside or not (RESULTS / m).is_dir():
                    wrong.append(f"{rel}: benchmarks/results/{m} (the file is in {'/, '.join(inside) or 'no folder'}/)")
            elif not (RESULTS / folder).is_dir():
                wrong.append(f"{rel}: benchmarks/results/{m} (no folder {folder})")
            elif name in where and where[name] != folder:
                wrong.append(f"{rel}: benchmarks/results/{m} (the file is in {where[name]}/)")
    return sorted(set(wrong))


@in_a_checkout
def test_the_path_checks_see_a_stale_path():
    text = ("python tools/probe_gemm_k.py; tools/probes/probe_gemm_k.py; benchmarks/results/ch8_bench.json, "
            "benchmarks/results/ch8/ch8_bench.json, benchmarks/results/ch3/ch8_bench.json, "
            "benchmarks/results/ch42/x.json, benchmarks/results/ch9/ch9_allreduce_8gpu.json, "
            "benchmarks/results/<chapter>/")
    assert _missing_tools([("t", text)]) == ["t: tools/probe_gemm_k.py"]
    assert _misplaced_results([("t", text)]) == ["t: benchmarks/results/ch3/ch8_bench.json (the file is in ch8/)",
                                                 "t: benchmarks/results/ch42/x.json (no folder ch42)",
                                                 "t: benchmarks/results/ch8_bench.json (the file is in ch8/)"]


def test_every_named_tool_exists():
    missing = sorted(set(_missing_tools(_texts())))
    assert not missing, "tools named but not in the repository (moved?):\n" + "\n".join(missing)


@in_a_checkout
def test_every_named_result_path_is_where_it_says():
    wrong = set(_misplaced_results(_texts()))
    assert not wrong, "result paths that do not point at their file:\n" + "\n".join(sorted(wrong))


def test_tools_are_grouped_by_role_with_a_readme_each():
    tools = ROOT / "tools"
    top = (tools / "README.md").read_text()
    assert {p.name for p in tools.iterdir() if p.is_file()} == {"README.md", "test.sh", "gpu_check.sh"}
    # folders with files in them (a copy of the tree can keep an emptied old folder, or its __pycache__ alone)
    roles = sorted(p for p in tools.iterdir() if p.is_dir() and p.name != "__pycache__"
                   and any(f.is_file() and f.suffix != ".pyc" for f in p.rglob("*")))
    assert [p.name for p in roles] == ["checks", "maintenance", "probes", "recipes"]
    for role in roles:
        readme = (role / "README.md").read_text()
        assert f"`{role.name}/`" in top, f"tools/README.md does not name {role.name}/"
        scripts = [p.name for p in role.iterdir() if p.suffix in (".py", ".sh")]
        unnamed = [s for s in scripts if f"`{s}`" not in readme]
        assert scripts and not unnamed, f"tools/{role.name}/README.md does not name {unnamed}"
