"""Content hashes of full KV blocks: the keys of the prefix cache.

A block's hash is chained: sha256(parent block's hash + the block's token ids), and the first
block's parent is a root hash derived from a per-engine salt. So two blocks have the same hash
only when they hold the same tokens after the same whole prefix, which is exactly when their KV
is the same.

What goes into the key, and why nothing else needs to:
- the block's token ids and, through the parent hash, every token before them;
- the block's position: implied by the chain (block i is the i-th link), and the block size is
  fixed per engine;
- the salt: the engine's model and dtype. One engine holds one model and one KV cache, so
  blocks of different models never meet; the salt keeps that true for a cache shared across
  engines later. Anything that changes a request's KV while the tokens stay the same goes into
  the root hash of that request's chain as extra keys (vLLM's `extra_keys`): a LoRA adapter's
  id, name and path (`LoRARequest.cache_key`), so that the same prompt under two adapters, or
  under an adapter and the base model, never shares a block.

Why sha256 rather than Python's builtin `hash` of a tuple: the cache is shared between jobs,
possibly from different users, and a collision would let one job attend to another job's KV.
The builtin hash is 64 bits and not collision resistant; sha256 is, and costs about 0.9 us per
16-token block on the CPUs here (against 0.1 us), once per block per request.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence

# 32 bytes of sha256 digest.
BlockHash = bytes


def root_block_hash(salt: str, extra_keys: Sequence[str] = ()) -> BlockHash:
    """The parent hash of every request's first block in an engine with this salt, for requests
    whose KV also depends on `extra_keys` (none: the base model's requests)."""
    root = hashlib.sha256(b"qworker prefix cache\0" + salt.encode()).digest()
    for key in extra_keys:
        root = hashlib.sha256(root + b"\0extra\0" + key.encode()).digest()
    return root


def hash_block_tokens(parent: BlockHash, token_ids: Sequence[int]) -> BlockHash:
    # Token ids as int64: vocabulary ids always fit, and the bytes never leave this process.
    return hashlib.sha256(parent + array("q", token_ids).tobytes()).digest()


def extend_block_hashes(
    block_hashes: list[BlockHash], token_ids: Sequence[int], block_size: int, root: BlockHash
) -> None:
    """Append the hashes of the full blocks of `token_ids` that `block_hashes` lacks.

    Token ids only ever grow at the end, so earlier hashes stay valid: each block is hashed once.
    """
    num_full_blocks = len(token_ids) // block_size
    parent = block_hashes[-1] if block_hashes else root
    for i in range(len(block_hashes), num_full_blocks):
        parent = hash_block_tokens(parent, token_ids[i * block_size : (i + 1) * block_size])
        block_hashes.append(parent)
