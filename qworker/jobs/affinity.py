"""A job's affinity key: what a queue with affinity lanes hashes to choose the job's lane, so that
jobs sharing a key are pulled by the worker that already holds their prefix (docs/queues.md,
"Affinity lanes").

Precedence: the job's own `affinity` (an eval task id, a tenant, a system-prompt id), else its
LoRA adapter (`adapter:<name>`: the workers that hold an adapter pull its jobs before others load
it), else a key derived from the start of its prompt. The producer derives it, and it holds no tokenizer (the
base install has none), so the derivation hashes text:

- a `prompt`: its first `AFFINITY_PREFIX_CHARS` characters;
- `messages`: each message as `role`, a newline, its content (tool calls as their JSON), and a
  blank line, joined in order; the first `AFFINITY_PREFIX_CHARS` characters of that. Any chat
  template renders the same messages to the same text, so equal leading messages give equal keys;
- `prompt_token_ids`: the first `AFFINITY_PREFIX_TOKENS` ids.

2,048 characters are about 512 tokens of English (about 4 characters a token): 32 KV blocks of
16 tokens, enough that a shared few-shot block, RAG document or long system prompt decides the
key, and short enough that the hash costs nothing next to the JSON encoding. Jobs that share
less than that (a one-line system prompt, then different questions) get different keys and
spread over the lanes, as they should: their shared part is a block or two, cheap to recompute
on any worker. A prompt shorter than one KV block (`MIN_PREFIX_CHARS`, 16 tokens of about 4
characters; `MIN_PREFIX_TOKENS` ids) gets no key: there is nothing worth caching to follow.
"""

from __future__ import annotations

import hashlib
import json

from qworker.jobs.job import Job

AFFINITY_PREFIX_CHARS = 2048
AFFINITY_PREFIX_TOKENS = 512
# One KV block (16 tokens) at about 4 characters a token.
MIN_PREFIX_CHARS = 64
MIN_PREFIX_TOKENS = 16
# A derived key says what it came from, so that it never equals a key a producer chose.
_DERIVED_TEXT = "prefix:"
_DERIVED_TOKENS = "prefix-ids:"
_ADAPTER = "adapter:"


def prompt_start(job: Job) -> str | list[int]:
    """The part of the job's prompt that a derived key hashes (see the module's docstring)."""
    if job.prompt_token_ids is not None:
        return job.prompt_token_ids[:AFFINITY_PREFIX_TOKENS]
    if job.prompt is not None:
        return job.prompt[:AFFINITY_PREFIX_CHARS]
    parts: list[str] = []
    size = 0
    for message in job.messages or []:
        calls = [call.model_dump() for call in message.tool_calls or []]
        content = message.content or ""
        if calls:
            content += json.dumps(calls, sort_keys=True, separators=(",", ":"))
        parts.append(f"{message.role}\n{content}\n\n")
        size += len(parts[-1])
        if size >= AFFINITY_PREFIX_CHARS:
            break
    return "".join(parts)[:AFFINITY_PREFIX_CHARS]


def derived_affinity(job: Job) -> str | None:
    """The key derived from the start of the job's prompt; None for a prompt shorter than a block."""
    start = prompt_start(job)
    if isinstance(start, list):
        if len(start) < MIN_PREFIX_TOKENS:
            return None
        payload = b"".join(int(t).to_bytes(8, "little", signed=True) for t in start)
        return _DERIVED_TOKENS + hashlib.blake2b(payload, digest_size=16).hexdigest()
    if len(start) < MIN_PREFIX_CHARS:
        return None
    digest = hashlib.blake2b(start.encode("utf-8", "surrogatepass"), digest_size=16).hexdigest()
    return _DERIVED_TEXT + digest


def affinity_key(job: Job) -> str | None:
    """The job's affinity key: its own, else its adapter's, else one derived from its prompt,
    else None."""
    if job.affinity is not None:
        return job.affinity
    if job.lora is not None:
        return _ADAPTER + job.lora
    return derived_affinity(job)
