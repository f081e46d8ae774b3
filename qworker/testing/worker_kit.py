"""Helpers for tests of the worker (and for anyone testing code that uses qworker's queue).

Tests use the Redis server at 127.0.0.1:6379 when one answers, else the embedded one, and give
every test its own stream, group and key prefix so that tests never see each other's jobs.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

LOCAL_REDIS_URL = "redis://127.0.0.1:6379/0"


def redis_base_url() -> str:
    import redis

    try:
        redis.Redis.from_url(LOCAL_REDIS_URL, socket_connect_timeout=0.5).ping()
        return LOCAL_REDIS_URL
    except redis.RedisError:
        from qworker.backends.redis.embedded import embedded_redis_url

        return embedded_redis_url()


def unique_url(base: str, tag: str = "test") -> str:
    """A queue-and-results URL with a stream, group and prefix no other test uses."""
    name = f"qwtest:{tag}:{uuid.uuid4().hex[:10]}"
    sep = "&" if "?" in base else "?"
    return f"{base}{sep}stream={name}&group=g&prefix={name}"


def cleanup(redis: Any, url: str) -> None:
    """Delete every key of a unique_url (stream, dead letters, results, deltas)."""
    from qworker.backends.connections import SINK_PARAMS, SOURCE_PARAMS, parse_url

    prefix = parse_url(url, SOURCE_PARAMS | SINK_PARAMS).params["prefix"]
    keys = list(redis.scan_iter(match=f"{prefix}*", count=1000))
    for i in range(0, len(keys), 500):
        redis.delete(*keys[i : i + 500])


def write_tiny_model_dir(target: Path, **config_overrides: Any) -> Path:
    """A tiny random Llama with the SmolLM2 tokenizer, saved as a Hugging Face directory, so that
    worker subprocesses start in seconds with `--model target`."""
    from qworker.model.loader import resolve_model
    from qworker.testing.tiny_model import tiny_llama_model

    if (target / "config.json").is_file():
        return target
    tokenizer_dir = resolve_model("smollm2").path
    # The SmolLM2 tokenizer's vocabulary; rms_norm_eps 1e-6 is what this model has always had
    # (LlamaConfig's default), so that tests keep the weights and outputs they were written with.
    args: dict[str, Any] = dict(
        vocab_size=49152,
        max_position_embeddings=1024,
        tie_word_embeddings=True,
        rms_norm_eps=1e-6,
    )
    model = tiny_llama_model(seed=0, **(args | config_overrides))
    target.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(target, safe_serialization=True)
    for name in os.listdir(tokenizer_dir):
        if name.startswith(("tokenizer", "special_tokens", "vocab", "merges", "chat_template")):
            shutil.copy(Path(tokenizer_dir) / name, target / name)
    return target


def spawn_worker(url: str, model_dir: Path, name: str, *extra_args: str, log_path: Path) -> subprocess.Popen:
    """Start `qworker worker` in a subprocess and wait until it says it is ready."""
    log = open(log_path, "w")  # noqa: SIM115 - the process owns it
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "qworker.cli",
            "worker",
            "--queue",
            url,
            "--model",
            str(model_dir),
            "--name",
            name,
            "--dtype",
            "float32",
            "--device",
            "cpu",
            *extra_args,
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
        env={**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"},
    )
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if f"worker {name} ready" in log_path.read_text():
            return process
        if process.poll() is not None:
            raise RuntimeError(f"worker {name} exited early:\n{log_path.read_text()[-3000:]}")
        time.sleep(0.1)
    process.kill()
    raise TimeoutError(f"worker {name} did not start:\n{log_path.read_text()[-3000:]}")
