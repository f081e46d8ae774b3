#!/usr/bin/env bash
# One prepared check of qworker's GPU path (see scripts/gpu_check.py for the stages).
#
#   scripts/gpu_check.sh [OUT_DIR] [extra gpu_check.py args]   # default OUT_DIR: ./gpu_out
#   scripts/gpu_check.sh /tmp/smoke --cpu-smoke                 # the same stages, tiny, on the CPU
#
# Needs only torch, triton and transformers (no `pip install`: the repository goes on PYTHONPATH).
# Writes OUT_DIR/gpu_check.json, OUT_DIR/gpu_check.md, OUT_DIR/bench_kernels.{json,log} and
# OUT_DIR/gpu_check.log. The whole run is held under 8 minutes: the Python script stops starting
# work after --budget-s (default 420 s) and this wrapper kills it at 470 s.
set -uo pipefail

OUT_DIR=${1:-./gpu_out}
shift || true
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
PYTHON=${PYTHON:-python3}
mkdir -p "$OUT_DIR"
OUT_DIR=$(cd "$OUT_DIR" && pwd)

# The import name of kernels/ is qworker_kernels (pyproject's package-dir); without an install, a
# symlink under that name provides it. PYTHONPATH comes before site-packages, so this working
# tree is what runs even where qworker is installed.
SHIM=$(mktemp -d)
trap 'rm -rf "$SHIM"' EXIT
ln -s "$REPO/kernels" "$SHIM/qworker_kernels"
export PYTHONPATH="$REPO:$SHIM${PYTHONPATH:+:$PYTHONPATH}"
export TOKENIZERS_PARALLELISM=false

cd "$REPO"
echo "gpu_check: repo $REPO, out $OUT_DIR, python $($PYTHON -c 'import sys; print(sys.version.split()[0])')"
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
timeout -k 10 470 "$PYTHON" -u scripts/gpu_check.py "$OUT_DIR" "$@" 2>&1 | tee "$OUT_DIR/gpu_check.log"
rc=${PIPESTATUS[0]}
if [ "$rc" = 124 ] || [ "$rc" = 137 ]; then
    echo "gpu_check: killed at the 470 s limit; $OUT_DIR/gpu_check.json holds the stages that finished"
fi
exit "$rc"
