"""One prepared check of the GPU path, for a machine with an NVIDIA GPU (run by scripts/gpu_check.sh).

A thin driver over qworker.bench.gpu_check (one module per stage; its docstring lists them). Every
stage is recorded in OUT/gpu_check.json (rewritten after every stage, so a kill keeps what
finished) and summarized in OUT/gpu_check.md. Only torch, triton, transformers and numpy are
needed. `--cpu-smoke` runs every stage with tiny sizes on the CPU under TRITON_INTERPRET=1 (CUDA
graphs there: the same padded static buffers, run eagerly).

    python scripts/gpu_check.py OUT_DIR [--cpu-smoke] [--budget-s S] [--stages kernels,bench,...]

Each stage has its own time limit (qworker.bench.gpu_check.run.REGISTRY; on the GPU they add up to
300 s): a stage past it is stopped, recorded as "timed out" with what it measured so far, and the
next one starts. --budget-s caps the whole run (default: the sum of the chosen stages' limits).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

# Imports neither torch nor triton: TRITON_INTERPRET can still be set below.
from qworker.bench.gpu_check.run import STAGES, run_check

REPO = Path(__file__).resolve().parents[1]


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("out_dir", nargs="?", default="gpu_out", type=Path)
    parser.add_argument(
        "--cpu-smoke", action="store_true", help="tiny sizes on the CPU under TRITON_INTERPRET=1"
    )
    parser.add_argument(
        "--budget-s", type=float, default=None, help="cap on the whole run (default: the stages' limits)"
    )
    parser.add_argument(
        "--stages", default=",".join(STAGES), help=f"comma-separated subset of {STAGES}, run in that order"
    )
    args = parser.parse_args()
    stages = [s.strip() for s in args.stages.split(",") if s.strip()]
    unknown = sorted(set(stages) - set(STAGES))
    if unknown:
        parser.error(f"unknown stages {unknown}; choose from {STAGES}")
    if args.cpu_smoke:
        os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported: read when kernels are decorated
    import torch

    if not args.cpu_smoke and not torch.cuda.is_available():
        print(
            "gpu_check: no CUDA device. Use --cpu-smoke for the CPU run of the same stages.", file=sys.stderr
        )
        return 2
    return run_check(args.out_dir, repo=REPO, cpu_smoke=args.cpu_smoke, budget_s=args.budget_s, stages=stages)


if __name__ == "__main__":
    sys.exit(main())
