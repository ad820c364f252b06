"""environment.yml (conda-forge readers) and pyproject.toml (pip) must name the same packages."""

import re
from pathlib import Path

import tomllib
import yaml

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
