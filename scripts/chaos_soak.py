"""Chaos soak: worker processes on a private Redis (AOF on) serve short jobs while a chaos loop
SIGKILLs a worker (restarted a few seconds later), SIGTERMs one (restarted once it has drained)
and restarts Redis once; a producer submits at a steady rate with bursts. At the end it counts
results, lost, duplicated and pending jobs and dead letters, and checks memory growth; it exits 1
if any is wrong. The soak and its bookkeeping are tests/integration/chaos_soak.py (its docstring
says what each count and bound means); this script is its command line, one flag per field of
SoakSettings.

    .venv/bin/python scripts/chaos_soak.py                       # 10,000 jobs, about 20 minutes
    .venv/bin/python scripts/chaos_soak.py --num-jobs 500 --chaos-every-s 8
    .venv/bin/python scripts/chaos_soak.py --cluster              # on a 3-primary Redis Cluster
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests.integration.chaos_soak import SoakSettings, run_soak


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    for f in dataclasses.fields(SoakSettings):
        flag = "--" + f.name.replace("_", "-")
        if isinstance(f.default, bool):
            parser.add_argument(
                flag, action=argparse.BooleanOptionalAction, default=f.default, help=f.metadata.get("help")
            )
        else:
            parser.add_argument(flag, type=type(f.default), default=f.default, help=f.metadata.get("help"))
    args = parser.parse_args(argv)
    return run_soak(SoakSettings(**vars(args)))


if __name__ == "__main__":
    sys.exit(main())
