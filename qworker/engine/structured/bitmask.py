"""Token bitmasks: [rows, ceil(vocab / 32)] int32, bit j of word w allowing token 32 * w + j
(llguidance's and xgrammar's layout). Whole-tensor operations only: no Python loop over rows or
over the vocabulary."""

from __future__ import annotations

import numpy as np
import torch


def num_mask_words(vocab_size: int) -> int:
    return (vocab_size + 31) // 32


def allowed_counts(bitmask: np.ndarray) -> np.ndarray:
    """bitmask: [R, W] int32 -> [R] int64, how many tokens each row allows."""
    return np.bitwise_count(bitmask.view(np.uint32)).sum(axis=1, dtype=np.int64)


def first_allowed(bitmask: np.ndarray) -> np.ndarray:
    """bitmask: [R, W] int32 -> [R] int64, each row's lowest allowed token id (rows allow at
    least one)."""
    words = bitmask.view(np.uint32)
    word_index = (words != 0).argmax(axis=1)
    word = words[np.arange(words.shape[0]), word_index].astype(np.int64)
    # Lowest set bit: log2 of (w & -w), exact for powers of two below 2**32 in float64.
    low_bit = np.log2((word & -word).astype(np.float64)).astype(np.int64)
    return word_index.astype(np.int64) * 32 + low_bit


def disallowed_tokens(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """bitmask: [R, W] int32 on the logits' device -> [R, vocab_size] bool, True where a token is
    not allowed."""
    if bitmask.device.type == "cpu":
        # One pass over 64 x 6 kB on the CPU (~0.3 ms for a 64-row SmolLM2 batch); the uint8 bits
        # are viewed as bool, not copied.
        unpacked = np.unpackbits(np.invert(bitmask.numpy()).view(np.uint8), axis=1, bitorder="little")
        return torch.from_numpy(unpacked[:, :vocab_size]).view(torch.bool)
    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    bits = (bitmask.unsqueeze(-1) >> shifts) & 1  # [R, W, 32]
    return bits.flatten(1)[:, :vocab_size] == 0


def apply_token_bitmask_(logits: torch.Tensor, row_index: torch.Tensor, bitmask: torch.Tensor) -> None:
    """logits: [N, vocab] float; row_index: [R] int64 rows of logits that are constrained (in
    increasing order); bitmask: [R, W] int32. Disallowed tokens of those rows become -inf, in place."""
    assert bitmask.dtype == torch.int32, f"bitmask must be int32, got {bitmask.dtype}"
    assert bitmask.shape[0] == row_index.shape[0], f"{bitmask.shape[0]} masks, {row_index.shape[0]} rows"
    vocab = logits.shape[-1]
    assert bitmask.shape[1] * 32 >= vocab, f"bitmask of {bitmask.shape[1]} words for a vocabulary of {vocab}"
    disallowed = disallowed_tokens(bitmask, vocab).to(logits.device, non_blocking=True)
    minus_inf = torch.tensor(float("-inf"), dtype=logits.dtype, device=logits.device)
    # torch.where in place: 1.4 ms for 64 x 49,152 on a 2-core EPYC, against 6 ms for an indexed
    # masked_fill (gather, fill, scatter).
    if row_index.shape[0] == logits.shape[0]:
        torch.where(disallowed, minus_inf, logits, out=logits)
        return
    rows = logits.index_select(0, row_index)
    torch.where(disallowed, minus_inf, rows, out=rows)
    logits.index_copy_(0, row_index, rows)
