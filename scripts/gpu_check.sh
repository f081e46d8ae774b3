#!/usr/bin/env bash
# One prepared check of qworker's GPU path (qworker/bench/gpu_check/ has one module per stage).
#
#   scripts/gpu_check.sh [OUT_DIR] [extra gpu_check.py args]   # default OUT_DIR: ./gpu_out
#   scripts/gpu_check.sh /tmp/smoke --cpu-smoke                 # the same stages, tiny, on the CPU
#
# Needs only torch, triton, transformers and numpy, plus pip and setuptools to install this working
# tree. The GPU machine has no package index and none of qworker's other dependencies, so the tree
# is installed the way any machine would get it, as a package, but without dependencies and
# without the network (`pip install --no-deps --no-index --no-build-isolation`) into a throwaway
# folder put first on PYTHONPATH: kernels/ is imported as qworker_kernels and the workload specs
# are found as package data exactly as in an installed qworker, nothing on the machine changes,
# and this working tree is what runs even where another qworker is installed. setuptools builds
# it in-tree (build/ and *.egg-info/, both git-ignored). Without pip or setuptools the script
# stops at once and says so (exit 3), before any stage runs.
#
# Writes OUT_DIR/gpu_check.json, OUT_DIR/gpu_check.md, OUT_DIR/bench_kernels.{json,log} and
# OUT_DIR/gpu_check.log, OUT_DIR/profile_{graphs,eager}.{json,txt}. The whole run is held under
# 5 minutes of stages: each stage has its own limit (qworker/bench/gpu_check/run.py, 300 s in all
# on the GPU; a stage past it is recorded as "timed out" and the next starts), and this wrapper
# kills the script at KILL_S (default 330 s: the stages, imports and the CUDA context).
set -uo pipefail

OUT_DIR=${1:-./gpu_out}
shift || true
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
PYTHON=${PYTHON:-python3}
mkdir -p "$OUT_DIR"
OUT_DIR=$(cd "$OUT_DIR" && pwd)

SITE=$(mktemp -d)
trap 'rm -rf "$SITE"' EXIT
if ! "$PYTHON" -c 'import importlib.util as u; assert u.find_spec("pip") and u.find_spec("setuptools")' 2>/dev/null; then
    echo "gpu_check: $PYTHON has no pip or no setuptools; both are needed to install $REPO" \
        "(without dependencies, offline). Run with PYTHON=<an interpreter that has them>." >&2
    exit 3
fi
if ! "$PYTHON" -m pip install --quiet --no-deps --no-index --no-build-isolation --target "$SITE" "$REPO" \
    >"$OUT_DIR/install.log" 2>&1; then
    cat "$OUT_DIR/install.log" >&2
    echo "gpu_check: could not install $REPO into $SITE (log above, also in $OUT_DIR/install.log)." >&2
    exit 3
fi
export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
export TOKENIZERS_PARALLELISM=false

cd "$REPO"
echo "gpu_check: repo $REPO, out $OUT_DIR, python $($PYTHON -c 'import sys; print(sys.version.split()[0])')"
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
case " $* " in
    *" --cpu-smoke "*) KILL_S=${KILL_S:-1500} ;;  # the interpreter: the smoke limits add up to 20 minutes
    *) KILL_S=${KILL_S:-330} ;;
esac
timeout -k 10 "$KILL_S" "$PYTHON" -u scripts/gpu_check.py "$OUT_DIR" "$@" 2>&1 | tee "$OUT_DIR/gpu_check.log"
rc=${PIPESTATUS[0]}
if [ "$rc" = 124 ] || [ "$rc" = 137 ]; then
    echo "gpu_check: killed at the $KILL_S s limit; $OUT_DIR/gpu_check.json holds the stages that finished"
fi
exit "$rc"
