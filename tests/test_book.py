"""The book's configuration: MathJax ships with the book, so formulas render without network."""

import pathlib
import posixpath

import pytest

yaml = pytest.importorskip("yaml")

ROOT = pathlib.Path(__file__).resolve().parents[1]


def sphinx_config():
    return yaml.safe_load((ROOT / "_config.yml").read_text())["sphinx"]["config"]


def local_mathjax(cfg):
    """The file in the repository that the built pages load as MathJax, or None if there is none.

    Sphinx reads a relative ``mathjax_path`` as relative to ``_static`` of the HTML output. That
    directory is filled from ``_static`` (Jupyter Book adds it when it exists) and any
    ``html_static_path``; ``html_extra_path`` folders are copied to the output root.
    """
    path = cfg.get("mathjax_path", "")
    if not path or "://" in path or path.startswith("//"):
        return None
    in_output = posixpath.normpath(posixpath.join("_static", path))
    candidates = []
    if in_output.startswith("_static/"):
        inside = in_output[len("_static/"):]
        for d in ["_static", *cfg.get("html_static_path", [])]:
            candidates.append(ROOT / d / inside)
    for d in cfg.get("html_extra_path", []):
        candidates.append(ROOT / d / in_output)
    return next((c for c in candidates if c.is_file()), None)


def test_mathjax_path_is_local_and_exists():
    cfg = sphinx_config()
    path = cfg.get("mathjax_path")
    assert path, "_config.yml sets no sphinx.config.mathjax_path: MathJax would come from a CDN"
    assert "://" not in path, f"mathjax_path {path!r} is a URL: the book would need network"
    found = local_mathjax(cfg)
    assert found is not None, f"mathjax_path {path!r} points at no file in the repository"
    assert found.stat().st_size > 500_000, f"{found} is too small to be a MathJax component"
    assert "MathJax" in found.read_text(encoding="utf-8", errors="replace")[:200_000]


def test_mathjax_fonts_next_to_the_script():
    found = local_mathjax(sphinx_config())
    assert found is not None
    if "chtml" in found.name:  # CommonHTML output loads its web fonts relative to the script
        fonts = found.parent / "output" / "chtml" / "fonts" / "woff-v2"
        assert len(list(fonts.glob("MathJax_*.woff"))) >= 20, f"no MathJax fonts in {fonts}"


def test_mathjax_not_in_static():
    # Jupyter Book adds every .js file under the static paths to every page: MathJax there would
    # load twice on pages with math and on every page without.
    cfg = sphinx_config()
    for d in ["_static", *cfg.get("html_static_path", [])]:
        assert not list((ROOT / d).rglob("tex-*.js")), f"a MathJax component under {d}/"


def test_local_mathjax_detects_a_missing_file():
    cfg = dict(sphinx_config())
    cfg["mathjax_path"] = "../mathjax/no-such-component.js"
    assert local_mathjax(cfg) is None


def _css_rules(text: str) -> dict:
    """selector -> declarations of a flat stylesheet (comments dropped; @media blocks are left out)."""
    import re

    text = re.sub(r"/\*.*?\*/", "", text, flags=re.S)
    text = re.sub(r"@media[^{]*\{(?:[^{}]*\{[^}]*\})*\s*\}", "", text)
    return {sel.strip(): body.strip() for sels, body in re.findall(r"([^{}]+)\{([^}]*)\}", text)
            for sel in sels.split(",")}


def test_code_and_outputs_wrap_instead_of_running_off_the_page():
    """Every <pre> of a chapter (input code, printed outputs, the prose's code blocks) wraps at the article's edge:
    at 1280 px 69 blocks were wider than the page (2026-12-05, headless Chromium), their ends behind a scroll bar."""
    rules = _css_rules((ROOT / "_static" / "llmgpu.css").read_text())
    wrap = rules["article.bd-article pre"]
    assert "white-space: pre-wrap" in wrap and "overflow-wrap: anywhere" in wrap
    assert not any("white-space: pre;" in body or "overflow-x" in body for body in rules.values())
    assert _css_rules("a, b { x: 1; } /* c { y: 2; } */ @media (w) { d { z: 3; } }") == {"a": "x: 1;", "b": "x: 1;"}
