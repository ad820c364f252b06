"""The HIP compile check (tools/checks/hip_compile_check.py): the portable kernels compile for an AMD GPU
(gfx90a) with hipcc, the NVIDIA-only ones are listed with their reason. Skipped without hipcc; the
whole check runs in tools/test.sh."""

from __future__ import annotations

import shutil

import pytest
from repo_tools import load_tool

from llmgpu.kernels import loader

hip = load_tool("checks/hip_compile_check")

needs_hipcc = pytest.mark.skipif(shutil.which("hipcc") is None,
                                 reason="no hipcc on PATH (apt-get install hipcc): the HIP compile check needs it")


def test_nvidia_only_files_exist_and_say_why():
    assert set(hip.NVIDIA_ONLY) <= set(loader.available())
    assert all(len(why) > 20 for why in hip.NVIDIA_ONLY.values())


def test_every_instantiation_is_referenced():
    tu = hip.translation_unit("cast")
    assert all(f"&{e}" in tu for e in loader.name_expressions("cast"))


@needs_hipcc
@pytest.mark.parametrize("name", ["cast", "gelu", "grad_norm"])  # gelu: its inline PTX has a HIP fallback
def test_portable_kernels_compile_for_gfx90a(name):
    ok, log, _ = hip.compile_file(name)
    assert ok, log


@needs_hipcc
def test_an_nvidia_only_kernel_does_not():
    ok, log, _ = hip.compile_file("spin")
    assert not ok and "asm" in log


def test_no_hipcc_is_exit_code_2(monkeypatch, capsys):
    monkeypatch.setattr(hip, "hipcc", lambda: None)
    assert hip.main([]) == 2
    assert "no hipcc" in capsys.readouterr().err
