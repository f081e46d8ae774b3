"""`qworker demo`: the whole path on one machine, with nothing to set up.

Starts the embedded Redis server and a worker (on the main thread) on SmolLM2; a client thread
submits chat jobs of mixed lengths through the client, streams one live, and prints a table.
"""

from __future__ import annotations

import time
import uuid

from rich.console import Console
from rich.table import Table

from qworker.jobs.job import JobResult

QUESTIONS = [
    ("What is the capital of France?", 24),
    ("Explain in a few sentences why the sky is blue.", 96),
    ("Give me three tips for writing clean Python code.", 96),
    ("What is 12 times 7?", 16),
    ("Write a haiku about the ocean.", 40),
    ("What does a CPU cache do?", 64),
    ("Name three planets of the solar system.", 32),
    ("How do vaccines train the immune system?", 96),
    ("Translate 'good morning' into Spanish.", 16),
    ("What is the difference between a list and a tuple in Python?", 80),
    ("Suggest a name for a friendly robot.", 24),
    ("Why do leaves change colour in autumn?", 80),
    ("What is photosynthesis?", 64),
    ("Give a one-line definition of machine learning.", 32),
    ("How many days are there in a leap year?", 16),
    ("Describe a good breakfast in two sentences.", 48),
    ("What is the boiling point of water at sea level?", 24),
    ("List three uses of a paperclip.", 48),
    ("Why is sleep important?", 80),
    ("Write a short greeting for a new colleague.", 40),
]


def _row(result: JobResult) -> tuple[str, ...]:
    t = result.timings
    queued = f"{t.started_at - t.enqueued_at:.2f}" if t.started_at and t.enqueued_at else "-"
    ttft = f"{t.first_token_at - t.enqueued_at:.2f}" if t.first_token_at and t.enqueued_at else "-"
    tokens = result.usage.completion_tokens
    rate = "-"
    if t.first_token_at and t.finished_at and t.finished_at > t.first_token_at and tokens > 1:
        rate = f"{(tokens - 1) / (t.finished_at - t.first_token_at):.1f}"
    return (result.id, queued, ttft, str(tokens), rate, result.status.value)


def run_demo(num_jobs: int = 20, model: str = "smollm2") -> None:
    from qworker.backends.connections import open_sink, open_source
    from qworker.backends.redis.embedded import embedded_redis_url
    from qworker.config import EngineConfig
    from qworker.engine.llm_engine import LLMEngine
    from qworker.worker.loop import Worker, run_beside
    from qworker.worker.settings import WorkerSettings

    console = Console()
    started = time.perf_counter()
    redis_url = embedded_redis_url()
    # A stream of its own per run: leftovers of an interrupted demo never mix in.
    run_tag = uuid.uuid4().hex[:6]
    url = f"{redis_url}?stream=qworker:demo:{run_tag}&group=demo&prefix=qworker:demo:{run_tag}"
    console.print(f"[bold]embedded Redis[/] at {redis_url}")
    with console.status(f"loading {model}..."):
        engine = LLMEngine(EngineConfig(model=model))
    console.print(
        f"[bold]engine[/] {model} ready in {engine.startup_seconds:.1f}s ({engine.num_kv_blocks} KV blocks)"
    )
    settings = WorkerSettings(name=f"demo-worker-{run_tag}")
    worker = Worker(engine, open_source(url, consumer=settings.name), open_sink(url), settings)
    # The worker (so the engine) keeps the main thread; the client side only does I/O.
    run_beside(worker, lambda: _submit_stream_and_report(console, url, run_tag, num_jobs, started))


def _submit_stream_and_report(
    console: Console, url: str, run_tag: str, num_jobs: int, started: float
) -> None:
    from qworker.jobs.client import Client

    client = Client(queue=url)
    jobs = []
    for i in range(num_jobs):
        question, max_tokens = QUESTIONS[i % len(QUESTIONS)]
        jobs.append(
            {
                "id": f"demo-{run_tag}-{i:02d}",
                "messages": [{"role": "user", "content": question}],
                "params": {"max_tokens": max_tokens, "temperature": 0.0},
            }
        )
    job_ids = client.submit_many(jobs)
    console.print(f"[bold]submitted[/] {len(job_ids)} jobs\n")
    live_index = 1
    console.print(f"[bold cyan]{QUESTIONS[live_index][0]}[/]  (job {job_ids[live_index]}, streamed live)")
    for text in client.stream(job_ids[live_index], timeout=120):
        console.print(text, end="", markup=False, highlight=False)
    console.print("\n")

    results = client.results(job_ids, timeout=300)
    table = Table(title=f"{len(results)} jobs through the queue")
    for column in ("id", "queued s", "TTFT s", "tokens", "tok/s", "status"):
        table.add_column(column, justify="left" if column in ("id", "status") else "right")
    for result in results:
        table.add_row(*_row(result))
    console.print(table)
    total_tokens = sum(r.usage.completion_tokens for r in results)
    first = min(r.timings.enqueued_at or 0.0 for r in results)
    last = max(r.timings.finished_at or 0.0 for r in results)
    console.print(
        f"{sum(r.status.value == 'completed' for r in results)}/{len(results)} completed, "
        f"{total_tokens} tokens in {last - first:.1f}s ({total_tokens / max(last - first, 1e-9):.0f} tok/s), "
        f"demo total {time.perf_counter() - started:.1f}s"
    )
    client.close()
