"""bench_pooling.py's embedding table with the queue path added: the same corpus embedded by one
`qworker worker` process (SmolLM2, last-token pooling) that reads embed jobs from a private Redis
stream, against qworker's `LLM.embed` in this process and bench_pooling's other systems, in one
run. The queue row's time runs from the first job sent to the last result read (Client.submit_many,
Client.result), so it holds the producer, Redis, the worker's intake and packing, and the result
writes; `--texts-per-job` says how many texts each embed job carries (1: one job per document,
the worker packs them; more: fewer, larger jobs). The worker gets the engine options
`LLM.embed` gets, and runs while this process waits (its torch threads are the machine's).

    .venv/bin/python scripts/bench_pooling_queue.py --num-texts 300
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_pooling import Corpus, make_corpus, measure, print_table, systems

from qworker.engine.runner import resolve_dtype
from qworker.engine.startup import cpu_model_name
from qworker.jobs.client import Client
from qworker.jobs.pooling_job import PoolingJob, decode_vector
from qworker.model.loader import load_tokenizer, resolve_model
from qworker.testing.worker_kit import start_private_redis


@contextmanager
def queue_worker(args: argparse.Namespace) -> Iterator[str]:
    """A private redis-server and one `qworker worker` on it; yields the queue URL."""
    server = start_private_redis()
    url = f"{server.url.split('?')[0]}?stream=bench-embed&group=g&prefix=bench-embed"
    log = Path(tempfile.mkdtemp(prefix="bench-pooling-")) / "worker.log"
    command = [
        sys.executable, "-m", "qworker.cli", "worker", "--queue", url, "--model", args.model,
        "--name", "bench-embed-1", "--dtype", args.dtype, "--device", "cpu", "--pooling-type", "LAST",
        "--max-num-batched-tokens", str(args.max_num_batched_tokens),
        "--max-num-seqs", str(args.max_num_seqs),
    ]  # fmt: skip
    with open(log, "w") as out:
        # Its own group, killed whole however this script ends.
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 300
        while "worker bench-embed-1 ready" not in log.read_text():
            if process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the worker did not start:\n{log.read_text()[-2000:]}")
            time.sleep(0.2)
        yield url
    finally:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait(timeout=60)
        server.stop()


def queue_embed(url: str, texts_per_job: int) -> Callable[[Corpus], torch.Tensor]:
    client = Client(queue=url)

    def run(corpus: Corpus) -> torch.Tensor:
        jobs = [
            PoolingJob(task="embed", input=corpus.texts[start : start + texts_per_job])
            for start in range(0, len(corpus.texts), texts_per_job)
        ]
        job_ids = client.submit_many(jobs)
        vectors = []
        for result in client.results(job_ids, timeout=3600):
            assert result.pooled is not None, f"job {result.id}: {result.status} {result.error}"
            vectors.extend(decode_vector(item.data) for item in result.pooled)
        return torch.tensor(vectors)

    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--num-texts", type=int, default=300)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dtype", default="auto", help="auto: bf16 only on CPUs with bf16 hardware")
    parser.add_argument("--max-num-batched-tokens", type=int, default=4096)
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--texts-per-job", type=int, default=1)
    parser.add_argument(
        "--qworker-only", action="store_true", help="only the LLM.embed and queue rows (a quick check)"
    )
    args = parser.parse_args()
    # A SIGTERM (a timeout) unwinds, so that the worker and the Redis server are stopped too.
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(1))
    tokenizer = load_tokenizer(resolve_model(args.model).path)
    corpus = make_corpus(tokenizer, args.num_texts, args.seed)
    total = sum(corpus.num_tokens)
    print(
        f"{args.num_texts} texts, {total} input tokens "
        f"({min(corpus.num_tokens)}-{max(corpus.num_tokens)} each); "
        f"{cpu_model_name()}, {os.cpu_count()} CPUs, torch {torch.__version__}, "
        f"dtype {resolve_dtype(args.dtype, torch.device('cpu'))}, {args.texts_per_job} text(s) per queued job"
    )
    table = dict(systems(args))
    first = next(iter(table))
    rows = [measure(first, table.pop(first)(), corpus, None)]  # qworker LLM.embed: the reference
    with queue_worker(args) as url:
        name = f"qworker through a queue (1 worker, {args.texts_per_job}/job)"
        rows.append(measure(name, queue_embed(url, args.texts_per_job), corpus, rows[0].vectors))
    for name, build in table.items() if not args.qworker_only else ():
        rows.append(measure(name, build(), corpus, rows[0].vectors))
    print_table(rows, "LLM.embed")


if __name__ == "__main__":
    main()
