"""Packaging: environment.yml and pyproject.toml name the same packages; the CI workflows run commands that
exist; the README points inside the repository; `python -m build` gives a wheel with every kernel source and
an sdist whose tests run."""

import re
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest
import yaml

try:
    import tomllib
except ImportError:  # Python 3.10: the test extra brings tomli
    import tomli as tomllib

ROOT = Path(__file__).resolve().parent.parent
# conda-forge name -> the pip package it stands for in the cuda13 extra
CONDA_TO_PIP = {"cupy": "cupy-cuda13x", "cuda-nvrtc": "nvidia-cuda-nvrtc", "cuda-cudart-dev": "nvidia-cuda-runtime"}
CONDA_ONLY = {"python", "pip", "cuda-version"}


def _name(req: str) -> str:
    return re.split(r"[<>=!~\[; ]", req.strip(), maxsplit=1)[0].lower().replace("_", "-")


def test_environment_yml_matches_pyproject():
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    env = yaml.safe_load((ROOT / "environment.yml").read_text())
    conda = [d for d in env["dependencies"] if isinstance(d, str)]
    pip_section = next(d["pip"] for d in env["dependencies"] if isinstance(d, dict))
    conda_names = {_name(d.split("=")[0] if "=" in d and "<" not in d and ">" not in d else d) for d in conda}
    conda_as_pip = {CONDA_TO_PIP.get(n, n) for n in conda_names - CONDA_ONLY}
    extras = pyproject["optional-dependencies"]
    want = {_name(r) for r in pyproject["dependencies"]} | {_name(r) for r in extras["cuda13"]}
    assert conda_as_pip == want, f"environment.yml {sorted(conda_as_pip)} vs pyproject {sorted(want)}"
    # the book and test extras come through pip, from the project itself
    assert any(p.startswith("-e .[") and "book" in p and "test" in p for p in pip_section)


def test_jupyter_book_pinned_to_1x():
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    book = pyproject["optional-dependencies"]["book"]
    assert "jupyter-book==1.0.4.post1" in book


def test_nvrtc_pinned_to_13_0():
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert "nvidia-cuda-nvrtc==13.0.*" in pyproject["optional-dependencies"]["cuda13"]


# --------------------------------------------------------------------------- CI workflows

WORKFLOWS = ROOT / ".github" / "workflows"


def _workflow(name: str) -> dict:
    wf = yaml.safe_load((WORKFLOWS / name).read_text())
    # YAML 1.1 reads the key `on` as True
    wf["on"] = wf.pop(True, wf.get("on"))
    return wf


def _run_lines(wf: dict) -> list[str]:
    return [line.strip() for job in wf["jobs"].values() for step in job["steps"] if "run" in step
            for line in step["run"].splitlines() if line.strip()]


def _scripts_in(lines: list[str]) -> set[str]:
    return {m for line in lines for m in re.findall(r"(?:\.ci|tools)/[\w./-]+\.(?:sh|py)|\.ci/run", line)}


def _readme_block(heading: str) -> str:
    text = (ROOT / "README.md").read_text()
    section = text.split(f"## {heading}", 1)[1].split("\n## ", 1)[0]
    return "\n".join(re.findall(r"```bash\n(.*?)```", section, re.S))


def test_readme_test_command_exists():
    cmd = _readme_block("Set-up: two commands")
    assert "bash tools/test.sh" in cmd
    for script in _scripts_in(cmd.splitlines()) | {"tools/test.sh", ".ci/run"}:
        assert (ROOT / script).is_file(), f"the README runs {script}, which is not in the repository"
    assert "bash tools/test.sh" in (ROOT / ".ci" / "run").read_text()


def test_ci_workflow_runs_the_readme_test_command_on_310_to_313():
    wf = _workflow("ci.yml")
    assert {"push", "pull_request"} <= set(wf["on"])
    (job,) = wf["jobs"].values()
    assert job["runs-on"] == "ubuntu-latest"
    assert job["strategy"]["matrix"]["python-version"] == ["3.10", "3.11", "3.12", "3.13"]
    readme_test = next(line for line in _readme_block("Set-up: two commands").splitlines() if "tools/test.sh" in line)
    assert readme_test.strip() in _run_lines(wf), "ci.yml must run the README's test command as written"
    for script in _scripts_in(_run_lines(wf)):
        assert (ROOT / script).is_file(), f"ci.yml runs {script}, which is not in the repository"


def test_gpu_workflow_runs_gpu_check_on_a_gpu_runner_and_uploads_results():
    wf = _workflow("gpu.yml")
    assert wf["on"]["push"]["branches"] == ["main"] and "workflow_dispatch" in wf["on"]
    (job,) = wf["jobs"].values()
    assert "gpu" in job["runs-on"] and "self-hosted" in job["runs-on"]
    lines = _run_lines(wf)
    assert any("tools/gpu_check.sh" in line for line in lines)
    for script in _scripts_in(lines):
        assert (ROOT / script).is_file(), f"gpu.yml runs {script}, which is not in the repository"
    gpu_check = (ROOT / "tools" / "gpu_check.sh").read_text()
    for step in ("tests", "nbval", "execute", "bench"):  # every step of the job is on by default
        assert step in re.search(r'STEPS=\$\{STEPS:-"([^"]*)"\}', gpu_check).group(1).split()
    upload = next(s for s in job["steps"] if s.get("uses", "").startswith("actions/upload-artifact"))
    assert upload.get("if") == "always()"
    paths = upload["with"]["path"].split()
    assert {"gpu_results/", "book/*.ipynb", "benchmarks/results/"} <= set(paths)


def test_extras_named_in_workflows_exist():
    extras = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"])
    for name in ("ci.yml", "gpu.yml"):
        for line in _run_lines(_workflow(name)):
            for group in re.findall(r'\.\[([\w,-]+)\]', line):
                assert set(group.split(",")) <= extras, f"{name}: unknown extra in {line!r}"


def test_readme_points_inside_the_repository():
    readme = (ROOT / "README.md").read_text()
    assert "../" not in readme, "the README must not point outside the repository"
    for script in sorted(set(re.findall(r"tools/[\w/-]+\.(?:sh|py)", readme))):
        assert (ROOT / script).is_file(), f"the README names {script}, which is not in the repository"
    assert "../shared" not in (ROOT / "tools" / "gpu_check.sh").read_text()


def test_fast_extras_bring_the_cudnn_runtime():
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    for cuda in ("13", "12"):
        names = {_name(r) for r in extras[f"fast-cuda{cuda}"]}
        assert f"nvidia-cudnn-cu{cuda}" in names
        assert any(r.startswith(f"llmgpu[cuda{cuda},fast]") for r in extras[f"fast-cuda{cuda}"])


# --------------------------------------------------------------------------- the release build


@pytest.fixture(scope="module")
def dists(tmp_path_factory):
    """sdist and wheel, as `python -m build` makes them (the wheel from the sdist), offline: no isolation."""
    pytest.importorskip("build", reason="the build package is not installed: pip install 'llmgpu[test]'")
    setuptools = pytest.importorskip("setuptools")
    if int(setuptools.__version__.split(".")[0]) < 77:
        pytest.skip(f"setuptools {setuptools.__version__} < 77 (pyproject.toml's build requirement)")
    out = tmp_path_factory.mktemp("dist")
    r = subprocess.run([sys.executable, "-m", "build", "--no-isolation", "--outdir", str(out), str(ROOT)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    (sdist,) = out.glob("llmgpu-*.tar.gz")
    (wheel,) = out.glob("llmgpu-*.whl")
    return sdist, wheel


def test_wheel_holds_every_kernel_source(dists):
    _, wheel = dists
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
    kernels = {p.relative_to(ROOT).as_posix() for p in (ROOT / "llmgpu").rglob("*") if p.suffix in (".cu", ".cuh")}
    assert kernels and kernels <= names, f"missing from the wheel: {sorted(kernels - names)}"
    modules = {p.relative_to(ROOT).as_posix() for p in (ROOT / "llmgpu").rglob("*.py")}
    assert modules <= names, f"missing from the wheel: {sorted(modules - names)}"
    assert not any(n.startswith(("tests/", "book/", "benchmarks/")) for n in names)


def test_sdist_can_run_the_tests(dists):
    sdist, _ = dists
    with tarfile.open(sdist) as t:
        top = t.getnames()[0].split("/")[0]
        names = {n.split("/", 1)[1] for n in t.getnames() if "/" in n}
    need = {"README.md", "LICENSE", "pyproject.toml", "environment.yml", "tests/conftest.py", "dev/cuda/README.md",
            "tools/test.sh", "tools/gpu_check.sh", ".ci/run", ".github/workflows/ci.yml", ".github/workflows/gpu.yml"}
    need |= {p.relative_to(ROOT).as_posix() for p in (ROOT / "tests").glob("*.py")}
    need |= {p.relative_to(ROOT).as_posix() for p in (ROOT / "llmgpu").rglob("*") if p.suffix in (".cu", ".cuh")}
    need |= {p.relative_to(ROOT).as_posix() for p in (ROOT / "dev" / "cuda").glob("*.cu")}
    assert need <= names, f"missing from {top}.tar.gz: {sorted(need - names)}"
    assert not any("__pycache__" in n for n in names)
