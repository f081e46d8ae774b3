"""The long fuzz of a worker through its Redis stream: random entries in the stream's wire format
(random field names and values, bytes that are not UTF-8, empty and huge fields, JSON with random
types and extreme numbers in every parameter) interleaved with good jobs, served by a `qworker
worker --burst` subprocess on a tiny random Llama. Every entry must end with exactly one outcome
(a result, or one dead letter), every good job must complete, nothing may stay pending, and the
worker must exit 0.

    python scripts/fuzz_stream.py [--rounds 10] [--batches 60] [--seed N] [--redis redis://...]

Each round draws new entries (seed N, N+1, ...; a random N by default) and runs a fresh worker on
a fresh stream. A failing round prints its seed, the problems and the worker log's tail, and keeps
its stream for inspection. The test suite runs one fixed round (tests/integration/
test_poison_entries.py); the entry generator and the checks are tests/integration/stream_fuzz.py.
"""

from __future__ import annotations

import argparse
import random
import sys
import tempfile
import time
from pathlib import Path

import redis

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from qworker.backends.connections import SINK_PARAMS, SOURCE_PARAMS, parse_url
from qworker.testing.worker_kit import cleanup, redis_base_url, unique_url, write_tiny_model_dir
from tests.integration.stream_fuzz import check_outcomes, generate, run_burst_worker, write_entries


def run_round(redis_url: str, model_dir: Path, batches: int, seed: int, work_dir: Path) -> bool:
    url = unique_url(redis_url, tag=f"fuzz{seed}")
    params = parse_url(url, SOURCE_PARAMS | SINK_PARAMS).params
    r = redis.Redis.from_url(parse_url(url, SOURCE_PARAMS | SINK_PARAMS).connection_url)
    r.xgroup_create(params["stream"], params["group"], id="0", mkstream=True)
    entries = generate(batches, seed)
    message_ids = write_entries(r, params["stream"], entries)
    log_path = work_dir / f"worker-{seed}.log"
    started = time.monotonic()
    returncode = run_burst_worker(url, model_dir, log_path, timeout_s=1800)
    outcomes = check_outcomes(r, url, entries, message_ids)
    log = log_path.read_text()
    problems = list(outcomes.problems)
    if returncode != 0:
        problems.insert(0, f"the worker exited {returncode}")
    if "Traceback" in log:
        problems.insert(0, "the worker logged a traceback")
    print(
        f"seed {seed}: {len(entries)} entries in {time.monotonic() - started:.0f}s: "
        f"{outcomes.num_results} results ({outcomes.num_completed} completed, "
        f"{outcomes.num_good_completed} good), {outcomes.num_dead_lettered} dead letters; "
        f"errors {dict(outcomes.error_types)}",
        flush=True,
    )
    if problems:
        print(f"seed {seed} FAILED; stream {params['stream']} kept", *problems[:40], sep="\n  ")
        print("worker log, last lines:\n" + log[-4000:])
        return False
    cleanup(r, url)
    return True


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--batches", type=int, default=60, help="batches of about 13 entries per round")
    parser.add_argument("--seed", type=int, default=None, help="first round's seed (default: random)")
    parser.add_argument("--redis", default=None, help="Redis URL (default: 127.0.0.1:6379, else embedded)")
    args = parser.parse_args()
    seed = args.seed if args.seed is not None else random.randrange(2**32)
    redis_url = args.redis or redis_base_url()
    with tempfile.TemporaryDirectory(prefix="qworker-fuzz-") as tmp:
        work_dir = Path(tmp)
        model_dir = write_tiny_model_dir(work_dir / "tiny-llama")
        failed = [
            s
            for s in range(seed, seed + args.rounds)
            if not run_round(redis_url, model_dir, args.batches, s, work_dir)
        ]
    print(
        f"{args.rounds - len(failed)}/{args.rounds} rounds passed"
        + (f"; failed seeds {failed}" if failed else "")
    )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
