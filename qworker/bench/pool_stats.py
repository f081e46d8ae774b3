"""What a pool of workers computed: prompt tokens computed pool-wide against the ideal, and each
worker's prefix-cache hit rate, from the stored results (queue mode: `usage.prompt_tokens_details
.cached_tokens` and `worker` of each job's result, kept on its RequestRecord).

The ideal is one cache that never forgets, shared by the whole pool: a request computes only the
prompt tokens past the longest run of whole KV blocks it shares with an earlier request (in arrival
order), and at least one token (an engine that holds the whole prompt still computes the last
one, for its logits). For the `pool-prefixes` workload that is each prefix once plus every
suffix: P * 1,024 + the suffixes' tokens. For prompts that share nothing it is every prompt token.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Any

from qworker.bench.records import RequestRecord
from qworker.bench.workload import BenchRequest

# EngineConfig's default block size: the ideal counts whole blocks of this many tokens.
IDEAL_BLOCK_SIZE = 16


def ideal_computed_prompt_tokens(requests: Sequence[BenchRequest], block_size: int = IDEAL_BLOCK_SIZE) -> int:
    """Prompt tokens a pool with one shared, unbounded prefix cache computes for `requests`."""
    seen: set[bytes] = set()
    total = 0
    for request in sorted(requests, key=lambda r: (r.arrival_s, r.index)):
        ids = request.prompt_token_ids
        chain = hashlib.blake2b(digest_size=16)
        cached = 0
        is_hit = True
        for start in range(0, len(ids) - len(ids) % block_size, block_size):
            chain.update(repr(ids[start : start + block_size]).encode())
            key = chain.copy().digest()
            if is_hit and key in seen:
                cached = start + block_size
            else:
                is_hit = False
                seen.add(key)
        total += len(ids) - min(cached, len(ids) - 1)
    return total


def pool_summary(
    records: Sequence[RequestRecord], ideal_computed: int | None = None
) -> dict[str, Any] | None:
    """Computed prompt tokens and hit rates of the completed requests whose results said what their
    worker's cache held; None when no record knows (engine mode, or an older worker)."""
    known = [r for r in records if r.is_completed and r.num_cached_tokens is not None]
    if not known:
        return None
    prompt = sum(r.prompt_len for r in known)
    cached = sum(min(r.num_cached_tokens or 0, r.prompt_len) for r in known)
    workers: dict[str, dict[str, Any]] = {}
    for r in sorted(known, key=lambda r: r.worker or ""):
        w = workers.setdefault(
            r.worker or "?", {"completed": 0, "prompt_tokens": 0, "cached_tokens": 0, "output_tokens": 0}
        )
        w["completed"] += 1
        w["prompt_tokens"] += r.prompt_len
        w["cached_tokens"] += min(r.num_cached_tokens or 0, r.prompt_len)
        w["output_tokens"] += r.num_output_tokens
    for w in workers.values():
        w["hit_rate"] = w["cached_tokens"] / w["prompt_tokens"] if w["prompt_tokens"] else None
    computed = prompt - cached
    complete = len(known) == len(records)
    return {
        "num_known": len(known),
        "prompt_tokens": prompt,
        "cached_tokens": cached,
        "prompt_tokens_computed": computed,
        "hit_rate": cached / prompt if prompt else None,
        # The ideal covers the whole request set: comparable only when every request is known.
        "ideal_prompt_tokens_computed": ideal_computed if complete else None,
        "computed_over_ideal": computed / ideal_computed if complete and ideal_computed else None,
        "workers": workers,
    }
