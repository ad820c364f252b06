#!/usr/bin/env bash
# Wheels for a GPU machine without a package index (the lab's H200: Python 3.12, CuPy, CUDA 13 and
# nvidia-cudnn-cu13 already installed). Run this where pip can reach the index, in the repository:
#   bash tools/maintenance/gpu_wheels.sh [MORE_PACKAGES...]
# It downloads Python 3.12 manylinux x86_64 wheels into ./.whl: what tools/gpu_check.sh needs beyond the
# machine's own packages (nbval, nbclient, nbformat, ipykernel and their dependencies for the notebooks;
# nvmath-python and nvidia-cudnn-frontend for the fast path; pytest-xdist and execnet for `pytest -n 8`; torchao
# 0.18 for `llmgpu bench`'s torch-compile-fp8, PyTorch's FP8 training: the version that mode was written against,
# one abi3 wheel that declares no dependencies, torch being the machine's),
# then any MORE_PACKAGES. PACKAGES=... replaces the default list; SKIP=... (names) are not downloaded
# because the machine has them (default: numpy and the CUDA/CuPy wheels). Copy the repository with .whl/
# to the GPU machine; tools/gpu_check.sh installs .whl/*.whl first (pip --no-index --no-deps --target
# /tmp/site, put on PYTHONPATH), or install them by hand:
#   python3 -m pip install --no-index --no-deps --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
set -euo pipefail
cd "$(dirname "$0")/../.."
DEST=${WHL_DIR:-.whl}
PY=${PY_VERSION:-3.12}
PACKAGES=${PACKAGES:-"nbval nbclient nbformat ipykernel nvmath-python==1.0.* nvidia-cudnn-frontend>=1.32 pytest-xdist execnet
  torchao==0.18.*"}
# (cuDNN frontend 1.32 also pulls in the CUTLASS DSL, 2 x 92 MB, which its attention graphs do not load: the GPU runs
# of 2026-12-03 passed without it; the cuda-* bindings are on the machine's image)
SKIP=${SKIP:-"numpy cupy-cuda13x cupy-cuda12x nvidia-cuda-nvrtc nvidia-cuda-runtime nvidia-cudnn-cu13 nvidia-cudnn-cu12
  nvidia-cutlass-dsl nvidia-cutlass-dsl-libs-base nvidia-cutlass-dsl-libs-core nvidia-cutlass-dsl-libs-cu12
  nvidia-cutlass-dsl-libs-cu13 apache-tvm-ffi cuda-bindings cuda-core cuda-pathfinder"}
mkdir -p "$DEST"
# shellcheck disable=SC2086  # PACKAGES and $@ are lists of requirement strings
python3 -m pip download --disable-pip-version-check -q --dest "$DEST" --only-binary=:all: \
  --python-version "$PY" --implementation cp --abi "cp${PY/./}" --abi abi3 --abi none \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 --platform any \
  $PACKAGES "$@"
for name in $SKIP; do  # wheel file names spell the project with underscores
  rm -f "$DEST/${name//-/_}"-[0-9]*.whl
done
n=$(ls "$DEST"/*.whl | wc -l)
echo "$n wheels in $DEST ($(du -sh "$DEST" | cut -f1)); on the GPU machine: bash tools/gpu_check.sh"
