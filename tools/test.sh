#!/usr/bin/env bash
# The project's test command (README, CI): install llmgpu with its extras into the active Python
# environment, then run every check that needs no GPU.
#   python3 -m venv .venv && . .venv/bin/activate && bash tools/test.sh
# Tests marked `gpu` are skipped with their reason on a machine without a GPU; tools/gpu_check.sh
# runs them (and everything else) on a GPU machine.
set -euo pipefail
cd "$(dirname "$0")/.."
step() { printf '\n==> %s\n' "$*"; }

step "install llmgpu[cuda13,test,book]"
python -m pip install -q --disable-pip-version-check -e ".[cuda13,test,book]"

step "ruff"
ruff check llmgpu tests benchmarks tools dev

step "kernel compile check (NVRTC, sm_80 + sm_90, no GPU needed)"
python -m llmgpu.kernels.compile_check

step "HIP compile check (hipcc, AMD gfx90a, no GPU needed)"
if command -v hipcc >/dev/null; then
    python tools/checks/hip_compile_check.py
else
    echo "skipped: no hipcc on PATH (apt-get install hipcc; .ci/run installs it where it can)"
fi

step "pytest"
python -m pytest -q

step "notebooks, top to bottom on this machine's backend (nbval --nbval-lax)"
python -m pytest -q --nbval-lax --nbval-current-env -p no:cacheprovider book/

step "book build (committed outputs, warnings are errors)"
rm -rf _build
jupyter-book build . -W -n --keep-going
echo "book: _build/html/index.html"
