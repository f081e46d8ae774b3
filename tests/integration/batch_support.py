"""Shared parts of the `qworker batch` tests: a tiny model whose greedy outputs differ from row to
row, a mixed batch file, the reference texts from LLM.generate, and readers of output files."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from qworker.openai.format import BatchOutputLine
from qworker.testing.worker_kit import write_tiny_model_dir

MODEL_NAME = "tiny"
# The tiny random Llama's weights are near zero, so its greedy picks barely depend on the prompt
# (every row would say the same thing, and a mixed-up row would go unnoticed). Scaled up, its
# outputs differ from row to row: 194 distinct texts among 200 rows.
WEIGHT_SCALE = 6.0
ENGINE_ARGS = {"dtype": "float32", "device": "cpu", "num_kv_blocks": 512, "block_size": 16}
CHAT_URL = "/v1/chat/completions"
COMPLETIONS_URL = "/v1/completions"


def write_batch_model_dir(target: Path) -> Path:
    """write_tiny_model_dir, with its matrices scaled by WEIGHT_SCALE."""
    marker = target / "scaled"
    if marker.exists():
        return target
    from safetensors.torch import load_file, save_file

    write_tiny_model_dir(target)
    path = target / "model.safetensors"
    tensors = load_file(path)
    scaled = {name: t * WEIGHT_SCALE if t.dim() > 1 else t for name, t in tensors.items()}
    save_file({name: t.contiguous() for name, t in scaled.items()}, path, metadata={"format": "pt"})
    marker.write_text(str(WEIGHT_SCALE))
    return target


def batch_row(custom_id: str, url: str, body: dict[str, Any]) -> dict[str, Any]:
    return {"custom_id": custom_id, "method": "POST", "url": url, "body": body}


def mixed_rows(num_rows: int, max_tokens: tuple[int, int] = (3, 16), seed: int = 0) -> list[dict[str, Any]]:
    """Chat rows, text completions and token-id completions in turn, greedy, of varied lengths;
    every 7th row asks n=2, every 5th logprobs with 2 alternatives."""
    rng = random.Random(seed)
    rows = []
    for i in range(num_rows):
        body: dict[str, Any] = {"model": MODEL_NAME, "temperature": 0, "max_tokens": rng.randint(*max_tokens)}
        if i % 3 == 0:
            body["messages"] = [{"role": "user", "content": f"Question {i}: what is {rng.randint(1, 999)}?"}]
            rows.append(batch_row(f"row-{i}", CHAT_URL, body))
        elif i % 3 == 1:
            body["prompt"] = f"Story {i} begins with {rng.choice(['a cat', 'the sea', 'snow'])} and"
            rows.append(batch_row(f"row-{i}", COMPLETIONS_URL, body))
        else:
            body["prompt"] = [rng.randint(32, 49000) for _ in range(rng.randint(3, 40))]
            rows.append(batch_row(f"row-{i}", COMPLETIONS_URL, body))
        if i % 7 == 3:
            body["n"] = 2
        if i % 5 == 4:
            if "messages" in body:
                body.update(logprobs=True, top_logprobs=NUM_TOP_LOGPROBS)
            else:
                body["logprobs"] = NUM_TOP_LOGPROBS
    return rows


NUM_TOP_LOGPROBS = 2
# Logprobs from another batch composition differ in the last bits.
LOGPROB_TOLERANCE = 1e-3
Outcome = tuple[tuple[str, ...], tuple[str, ...], int, int, tuple[float, ...] | None]


def write_jsonl(path: Path, rows: Sequence[Any]) -> Path:
    path.write_text("".join((row if isinstance(row, str) else json.dumps(row)) + "\n" for row in rows))
    return path


def reference_outputs(model_dir: Path, rows: Sequence[dict[str, Any]]) -> dict[str, Outcome]:
    """custom_id -> outcome() from LLM.generate."""
    from qworker import LLM, SamplingParams

    llm = LLM(model=str(model_dir), **ENGINE_ARGS)
    engine = llm.llm_engine
    prompts: list[Any] = []
    params = []
    for row in rows:
        body = row["body"]
        if "messages" in body:
            prompts.append({"prompt_token_ids": engine.apply_chat_template(body["messages"])})
        elif isinstance(body["prompt"], str):
            prompts.append(body["prompt"])
        else:
            prompts.append({"prompt_token_ids": body["prompt"]})
        logprobs = NUM_TOP_LOGPROBS if body.get("logprobs") else None
        params.append(
            SamplingParams(
                max_tokens=body["max_tokens"], temperature=0.0, n=body.get("n", 1), logprobs=logprobs
            )
        )
    outputs = llm.generate(prompts, params)
    return {
        row["custom_id"]: (
            tuple(c.text for c in out.outputs),
            tuple(str(c.finish_reason) for c in out.outputs),
            len(out.prompt_token_ids),
            sum(len(c.token_ids) for c in out.outputs),
            (
                tuple(
                    p[t].logprob
                    for p, t in zip(out.outputs[0].logprobs, out.outputs[0].token_ids, strict=True)
                )
                if out.outputs[0].logprobs is not None
                else None
            ),
        )
        for row, out in zip(rows, outputs, strict=True)
    }


def read_output(path: Path) -> list[BatchOutputLine]:
    """Every line of an output file, validated against the output-line model."""
    return [BatchOutputLine.model_validate_json(line) for line in path.read_text().splitlines()]


def outcome(line: BatchOutputLine) -> Outcome:
    """(texts, finish reasons, prompt tokens, completion tokens, the sampled tokens' logprobs of
    choice 0 or None) of a 200 line."""
    assert line.response is not None and line.response.status_code == 200, line
    body: Any = line.response.body
    is_chat = body.object == "chat.completion"
    assert [c.index for c in body.choices] == list(range(len(body.choices)))
    texts = tuple(c.message.content if is_chat else c.text for c in body.choices)
    reasons = tuple(str(c.finish_reason) for c in body.choices)
    logprobs = body.choices[0].logprobs
    values: tuple[float, ...] | None = None
    if logprobs is not None:
        if is_chat:
            values = tuple(entry.logprob for entry in logprobs.content)
            assert all(len(entry.top_logprobs) == NUM_TOP_LOGPROBS for entry in logprobs.content)
        else:
            values = tuple(logprobs.token_logprobs)
            assert all(len(top) <= NUM_TOP_LOGPROBS for top in logprobs.top_logprobs)
    return texts, reasons, body.usage.prompt_tokens, body.usage.completion_tokens, values


def assert_matches_reference(
    lines: Sequence[BatchOutputLine],
    rows: Sequence[dict[str, Any]],
    reference: dict[str, tuple[str, str, int, int]],
) -> None:
    """One line per row, each with the reference's text, finish reason and token counts."""
    ids = [line.custom_id for line in lines]
    assert len(ids) == len(set(ids)), "a custom_id has more than one line"
    assert set(ids) == {row["custom_id"] for row in rows}
    for line in lines:
        got, expected = outcome(line), reference[line.custom_id]
        assert got[:4] == expected[:4], line.custom_id
        assert (got[4] is None) == (expected[4] is None), line.custom_id
        if got[4] is not None and expected[4] is not None:
            assert len(got[4]) == len(expected[4]), line.custom_id
            assert all(abs(a - b) < LOGPROB_TOLERANCE for a, b in zip(got[4], expected[4], strict=True)), (
                line.custom_id
            )
        body = line.response.body  # type: ignore[union-attr]
        kind = next(row["url"] for row in rows if row["custom_id"] == line.custom_id)
        assert body.object == ("chat.completion" if kind == CHAT_URL else "text_completion")


def batch_command(*args: str) -> list[str]:
    return [sys.executable, "-m", "qworker", "batch", *args]


def engine_flags(model_dir: Path, **overrides: Any) -> list[str]:
    args = {"model": str(model_dir), **ENGINE_ARGS, **overrides}
    flags = []
    for name, value in args.items():
        flags += [f"--{name.replace('_', '-')}", str(value)]
    return flags


def subprocess_env() -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


def run_batch_process(args: list[str], timeout_s: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(
        batch_command(*args), capture_output=True, text=True, timeout=timeout_s, env=subprocess_env()
    )
