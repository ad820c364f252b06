#!/usr/bin/env bash
# Several NCCL ranks on one GPU, for chapter 9's tests: NCCL 2.30 lets ranks of one communicator share a GPU
# (NCCL_MULTI_RANK_GPU_ENABLE=1, experimental; about two ranks a GPU unless NCCL_MAX_CTAS lowers each rank's
# CTAs; NVLink SHARP off). Images with an older NCCL refuse a duplicate GPU, so this builds NCCL 2.30 from source for
# the GPU in the machine and makes CuPy load it. Ranks sharing a GPU share its SMs and bandwidth: this runs the code
# paths for real, it measures no scaling.
#
#   bash tools/recipes/nccl_multirank.sh build [SRC]   build NCCL (SRC: a source .tar.gz or directory; default
#                                                      $NCCL_SRC, else ../shared/vendor/nccl-*-src.tar.gz, else
#                                                      .nccl/nccl-*-src.tar.gz) into .nccl/, timed (.nccl/build.json)
#   eval "$(bash tools/recipes/nccl_multirank.sh env)" the variables: LD_PRELOAD of the built libnccl.so.2 (CuPy's
#                                                      NCCL module then uses it), NCCL_MULTI_RANK_GPU_ENABLE=1,
#                                                      NCCL_NVLS_ENABLE=0, NCCL_MAX_CTAS (default 16: 4 ranks fit)
#   bash tools/recipes/nccl_multirank.sh test [OUT]    checks CuPy sees the new NCCL, then the multi-rank GPU tests
#                                                      (tests/test_dist_multirank_gpu.py, tests/test_dist_gpu.py);
#                                                      log and JUnit XML in OUT (default gpu_results/nccl_multirank)
#
# The build needs nvcc and make; JOBS (default: every core) and ARCH (default: the GPU's, e.g. 90) adjust it. A
# build already in .nccl/ is kept (delete .nccl/ to rebuild).
set -euo pipefail
cd "$(dirname "$0")/../.."
ROOT=$PWD
DEST=$ROOT/.nccl
LIB=$DEST/lib/libnccl.so.2
WANT=23000  # NCCL 2.30.0, the first that lets ranks share a GPU

arch() {
  if [ -n "${ARCH:-}" ]; then echo "$ARCH"; return; fi
  local cap
  cap=$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader 2>/dev/null | head -n 1 | tr -d ' .')
  echo "${cap:-90}"
}

find_source() {
  local src=${1:-${NCCL_SRC:-}}
  if [ -z "$src" ]; then
    for c in ../shared/vendor/nccl-*-src.tar.gz "$DEST"/nccl-*-src.tar.gz; do
      if [ -e "$c" ]; then src=$c; break; fi
    done
  fi
  [ -n "$src" ] && [ -e "$src" ] || { echo "nccl_multirank: no NCCL source (give a .tar.gz or directory, or NCCL_SRC)" >&2; exit 2; }
  echo "$src"
}

build() {
  if [ -e "$LIB" ]; then echo "nccl_multirank: $LIB is built already (delete .nccl/ to rebuild)"; return; fi
  command -v nvcc >/dev/null || { echo "nccl_multirank: the build needs nvcc (the CUDA toolkit)" >&2; exit 2; }
  local src tree a jobs t0 t1
  src=$(find_source "${1:-}")
  mkdir -p "$DEST"
  if [ -d "$src" ]; then
    tree=$src
  else
    tar -xzf "$src" -C "$DEST"
    tree=$(find "$DEST" -maxdepth 2 -name makefiles -type d -printf '%h\n' | head -n 1)
  fi
  a=$(arch)
  jobs=${JOBS:-$(nproc)}
  echo "nccl_multirank: building $(basename "$tree") for sm_$a with $jobs jobs (log: $DEST/build.log)"
  t0=$(date +%s)
  make -C "$tree" -j"$jobs" src.build BUILDDIR="$DEST/build" \
    NVCC_GENCODE="-gencode=arch=compute_$a,code=sm_$a" > "$DEST/build.log" 2>&1 \
    || { tail -n 30 "$DEST/build.log" >&2; echo "nccl_multirank: the build failed" >&2; exit 1; }
  t1=$(date +%s)
  mkdir -p "$DEST/lib"
  cp -P "$DEST"/build/lib/libnccl.so* "$DEST/lib/"
  printf '{"source": "%s", "arch": "sm_%s", "jobs": %s, "cores": %s, "seconds": %s, "date": "%s", "host": "%s"}\n' \
    "$(basename "$src")" "$a" "$jobs" "$(nproc)" "$((t1 - t0))" "$(date -u +%F)" "$(hostname)" > "$DEST/build.json"
  echo "nccl_multirank: built in $((t1 - t0)) s: $LIB"
}

env_lines() {
  [ -e "$LIB" ] || { echo "nccl_multirank: no $LIB: run 'bash tools/recipes/nccl_multirank.sh build' first" >&2; exit 2; }
  echo "export LD_PRELOAD=$LIB${LD_PRELOAD:+:$LD_PRELOAD}"
  echo "export NCCL_MULTI_RANK_GPU_ENABLE=1 NCCL_NVLS_ENABLE=0 NCCL_MAX_CTAS=${NCCL_MAX_CTAS:-16}"
}

check() {
  python3 - "$WANT" <<'EOF'
import sys
from cupy.cuda import nccl
v = nccl.get_version()
print(f"nccl_multirank: CuPy's NCCL is {v // 10000}.{v // 100 % 100}.{v % 100} ({v})")
sys.exit(0 if v >= int(sys.argv[1]) else 1)
EOF
}

case "${1:-}" in
  build) build "${2:-}" ;;
  env) env_lines ;;
  test)
    OUT=${2:-gpu_results/nccl_multirank}
    mkdir -p "$OUT"
    eval "$(env_lines)"
    check || { echo "nccl_multirank: CuPy does not load the NCCL of $LIB" >&2; exit 1; }
    export PYTHONPATH=$ROOT:${PYTHONPATH:-}
    python3 -m pytest -q -rs -p no:cacheprovider --junitxml "$OUT/junit.xml" \
      tests/test_dist_multirank_gpu.py tests/test_dist_gpu.py 2>&1 | tee "$OUT/pytest.log"
    exit "${PIPESTATUS[0]}"
    ;;
  *) sed -n '2,20p' "$0"; exit 2 ;;
esac
