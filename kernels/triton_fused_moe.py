"""Fused mixture-of-experts for CUDA: every expert of a layer in two grouped-GEMM launches.

fused_moe(hidden [T, H], w_gate_up [E, 2 * I, H], w_down [E, H, I], topk_weights [T, K] fp32,
topk_ids [T, K] int64) -> [T, H]: out[t] = sum_k topk_weights[t, k] * expert_{ids[t, k]}(hidden[t]),
with expert_e(x) = w_down[e] @ (silu(g) * u), g = the first I rows of w_gate_up[e] @ x, u = the rest.

The shape of vLLM's fused_moe: the T * K (token, expert) pairs are sorted by expert and each
expert's run is padded to a multiple of BLOCK_M (`align_pairs_to_experts`, torch ops on the
device, no host sync), so that every BLOCK_M-row tile of the sorted pairs belongs to one expert.
One program computes a tile of rows x BLOCK_N columns against that expert's weights, reading its
rows of the activations through the sorted pair ids (never a gathered copy). The first launch
computes gate and up tiles side by side and stores silu(gate) * up in the activation dtype; the
second multiplies by w_down, scales each row by its routing weight and stores fp32 rows per pair,
which one torch sum over K reduces.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from qworker_kernels.constants import FLOAT_DTYPES
from qworker_kernels.triton_common import _dot, dot_mode

__all__ = ["align_pairs_to_experts", "fused_moe", "fused_moe_reference"]

# Tile sizes: tl.dot needs at least 16 in every dimension. 64 x 64 x 32 at 4 warps is the common
# vLLM default for bf16 when no tuned config exists; decode batches (a few rows per expert) pad
# to BLOCK_M, so a smaller BLOCK_M serves them (below).
_BLOCK_N = 64
_BLOCK_K = 32


@triton.jit
def _fused_moe_kernel(
    out_ptr,  # [num_pairs, N]: GATED: silu(gate) * up in the activation dtype; else fp32
    a_ptr,  # GATED: hidden [T, K_DIM]; else the activations [num_pairs, K_DIM]
    w_ptr,  # [E, N or 2N, K_DIM]: GATED: gate rows 0..N-1, up rows N..2N-1
    topk_weights_ptr,  # [num_pairs] fp32 (read with MUL_ROUTED_WEIGHT)
    sorted_pair_ids_ptr,  # [max_padded] int32: pair ids grouped by expert; padding >= num_pairs
    block_expert_ids_ptr,  # [max_padded // BLOCK_M] int32: the expert of each row tile
    num_padded_ptr,  # [1] int32: rows of sorted_pair_ids in use
    num_pairs,
    N,
    K_DIM,
    stride_am,
    stride_we,
    stride_wn,
    stride_om,
    A_ROWS_PER_PAIR: tl.constexpr,  # GATED: pair p reads hidden row p // top_k; else row p
    GATED: tl.constexpr,
    MUL_ROUTED_WEIGHT: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_MODE: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    if pid_m * BLOCK_M >= tl.load(num_padded_ptr):
        return  # the grid is sized for the worst case padding; this tile holds no pairs

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pair = tl.load(sorted_pair_ids_ptr + offs_m)  # [BLOCK_M]
    row_valid = pair < num_pairs
    a_row = (pair // A_ROWS_PER_PAIR).to(tl.int64)
    expert = tl.load(block_expert_ids_ptr + pid_m).to(tl.int64)

    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_valid = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + a_row[:, None] * stride_am + offs_k[None, :]  # [BLOCK_M, BLOCK_K]
    # Weights read transposed: [BLOCK_K, BLOCK_N] tiles of w[expert] ([N, K_DIM], rows contiguous).
    w_ptrs = w_ptr + expert * stride_we + offs_n[None, :].to(tl.int64) * stride_wn + offs_k[:, None]
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K_DIM, BLOCK_K):
        k_valid = offs_k < K_DIM - k0
        a = tl.load(a_ptrs, mask=row_valid[:, None] & k_valid[None, :], other=0.0)
        w = tl.load(w_ptrs, mask=k_valid[:, None] & n_valid[None, :], other=0.0)
        acc += _dot(a, w, DOT_MODE)
        if GATED:  # the up projection: the same columns N rows further down
            w_up = tl.load(w_ptrs + N * stride_wn, mask=k_valid[:, None] & n_valid[None, :], other=0.0)
            acc_up += _dot(a, w_up, DOT_MODE)
        a_ptrs += BLOCK_K
        w_ptrs += BLOCK_K

    if GATED:
        acc = acc * tl.sigmoid(acc) * acc_up  # silu(gate) * up, in fp32
    if MUL_ROUTED_WEIGHT:
        acc = acc * tl.load(topk_weights_ptr + pair, mask=row_valid, other=0.0)[:, None]
    tl.store(
        out_ptr + pair.to(tl.int64)[:, None] * stride_om + offs_n[None, :],
        acc.to(out_ptr.dtype.element_ty),
        mask=row_valid[:, None] & n_valid[None, :],
    )


# ----------------------------------------------------------------------------------------------
# Launcher


def align_pairs_to_experts(
    topk_ids: torch.Tensor, num_experts: int, block_m: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """topk_ids [T, K] -> (sorted_pair_ids, block_expert_ids, num_padded), all int32, on the device,
    with no host sync.

    sorted_pair_ids [T * K + E * (block_m - 1)] lists the pairs (index t * K + k) of expert 0, then
    expert 1, ..., each run padded with T * K (past every pair: masked) to a multiple of block_m.
    block_expert_ids [len / block_m] is the expert of each block_m-row tile; num_padded [1] the
    rows in use (tiles past it are skipped).
    """
    num_pairs = topk_ids.numel()
    device = topk_ids.device
    flat = topk_ids.reshape(-1)
    order = torch.argsort(flat, stable=True)  # [num_pairs], pairs grouped by expert
    counts = torch.bincount(flat, minlength=num_experts)  # [E]
    padded = (counts + block_m - 1) // block_m * block_m
    padded_end = torch.cumsum(padded, 0)
    start_padded = padded_end - padded  # [E] first padded row of each expert
    start = torch.cumsum(counts, 0) - counts  # [E] first sorted pair of each expert
    sorted_expert = flat[order]
    rank = torch.arange(num_pairs, device=device) - start[sorted_expert]
    max_padded = num_pairs + num_experts * (block_m - 1)
    sorted_pair_ids = torch.full((max_padded,), num_pairs, dtype=torch.int32, device=device)
    sorted_pair_ids[start_padded[sorted_expert] + rank] = order.to(torch.int32)
    tile_starts = torch.arange(0, max_padded, block_m, device=device)
    # The expert whose padded run holds each tile; tiles past the last run are skipped by the kernel
    # (clamped so that they still name a real expert).
    block_expert_ids = torch.searchsorted(padded_end, tile_starts, right=True).clamp_(max=num_experts - 1)
    num_padded = padded_end[-1:].to(torch.int32)
    return sorted_pair_ids, block_expert_ids.to(torch.int32), num_padded


def _check_inputs(
    hidden: torch.Tensor,
    w_gate_up: torch.Tensor,
    w_down: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
) -> None:
    if hidden.dim() != 2:
        raise ValueError(f"hidden must be [T, H], got shape {tuple(hidden.shape)}")
    if hidden.dtype not in FLOAT_DTYPES:
        raise ValueError(f"hidden dtype must be one of {FLOAT_DTYPES}, got {hidden.dtype}")
    num_tokens, hidden_size = hidden.shape
    if w_gate_up.dim() != 3 or w_gate_up.shape[2] != hidden_size or w_gate_up.shape[1] % 2:
        raise ValueError(f"w_gate_up must be [E, 2 * I, H={hidden_size}], got {tuple(w_gate_up.shape)}")
    num_experts, inter = w_gate_up.shape[0], w_gate_up.shape[1] // 2
    if num_experts == 0 or inter == 0:
        raise ValueError(f"w_gate_up must have at least one expert and I >= 1, got {tuple(w_gate_up.shape)}")
    if w_down.shape != (num_experts, hidden_size, inter):
        raise ValueError(
            f"w_down must be [E, H, I] = {(num_experts, hidden_size, inter)}, got {tuple(w_down.shape)}"
        )
    for name, w in (("w_gate_up", w_gate_up), ("w_down", w_down)):
        if w.dtype != hidden.dtype:
            raise ValueError(f"{name} dtype {w.dtype} != hidden dtype {hidden.dtype}")
        if not w.is_contiguous():
            raise ValueError(f"{name} must be contiguous, got strides {w.stride()}")
    if hidden.stride(1) != 1 and hidden_size > 1:
        raise ValueError(f"hidden must be contiguous in H, got strides {hidden.stride()}")
    if topk_ids.dim() != 2 or topk_ids.shape[0] != num_tokens or topk_ids.dtype != torch.int64:
        raise ValueError(
            f"topk_ids must be [T={num_tokens}, K] int64, got {tuple(topk_ids.shape)} {topk_ids.dtype}"
        )
    if topk_weights.shape != topk_ids.shape or topk_weights.dtype != torch.float32:
        raise ValueError(
            f"topk_weights must be float32 shaped like topk_ids {tuple(topk_ids.shape)}, "
            f"got {tuple(topk_weights.shape)} {topk_weights.dtype}"
        )
    if not (topk_ids.is_contiguous() and topk_weights.is_contiguous()):
        raise ValueError("topk_ids and topk_weights must be contiguous")
    if topk_ids.shape[1] < 1 or topk_ids.shape[1] > num_experts:
        raise ValueError(f"top_k must be in [1, E={num_experts}], got {topk_ids.shape[1]}")
    for name, t in (
        ("w_gate_up", w_gate_up),
        ("w_down", w_down),
        ("topk_weights", topk_weights),
        ("topk_ids", topk_ids),
    ):
        if t.device != hidden.device:
            raise ValueError(f"{name} is on {t.device}, hidden on {hidden.device}")
    # An out-of-range id would read past the weights. Checking it syncs with the device, which a
    # CUDA graph capture cannot do; the router's top-k gives valid ids by construction.
    capturing = hidden.is_cuda and torch.cuda.is_current_stream_capturing()
    if not capturing and topk_ids.numel() and not bool(((topk_ids >= 0) & (topk_ids < num_experts)).all()):
        raise ValueError(f"topk_ids holds an expert id outside [0, {num_experts})")


def fused_moe(
    hidden: torch.Tensor,
    w_gate_up: torch.Tensor,
    w_down: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
) -> torch.Tensor:
    """hidden [T, H], w_gate_up [E, 2 * I, H] (gate rows first), w_down [E, H, I], topk_weights
    [T, K] float32, topk_ids [T, K] int64 -> [T, H] in hidden's dtype: the routing-weighted sum
    of each token's K experts, silu(gate) * up between the two projections. Accumulates in fp32;
    the activations between the two GEMMs are rounded to hidden's dtype. Raises ValueError on bad
    shapes, dtypes, strides, devices or expert ids."""
    _check_inputs(hidden, w_gate_up, w_down, topk_weights, topk_ids)
    num_tokens, hidden_size = hidden.shape
    num_experts, inter = w_gate_up.shape[0], w_gate_up.shape[1] // 2
    top_k = topk_ids.shape[1]
    num_pairs = num_tokens * top_k
    if num_tokens == 0:
        return torch.empty_like(hidden)
    # Decode batches leave each expert a few rows: small row tiles waste less padding.
    block_m = 16 if num_pairs <= 4 * num_experts * 16 else 64
    sorted_pair_ids, block_expert_ids, num_padded = align_pairs_to_experts(topk_ids, num_experts, block_m)
    num_tiles = block_expert_ids.shape[0]
    common = dict(
        BLOCK_M=block_m,
        BLOCK_N=_BLOCK_N,
        BLOCK_K=_BLOCK_K,
        DOT_MODE=dot_mode(hidden.dtype, hidden.device),
        num_warps=4,
    )

    activations = torch.empty((num_pairs, inter), dtype=hidden.dtype, device=hidden.device)
    _fused_moe_kernel[(num_tiles, triton.cdiv(inter, _BLOCK_N))](
        activations, hidden, w_gate_up, topk_weights, sorted_pair_ids, block_expert_ids, num_padded,
        num_pairs, inter, hidden_size,
        hidden.stride(0), w_gate_up.stride(0), w_gate_up.stride(1), activations.stride(0),
        A_ROWS_PER_PAIR=top_k, GATED=True, MUL_ROUTED_WEIGHT=False, **common,
    )  # fmt: skip
    per_pair = torch.empty((num_pairs, hidden_size), dtype=torch.float32, device=hidden.device)
    _fused_moe_kernel[(num_tiles, triton.cdiv(hidden_size, _BLOCK_N))](
        per_pair, activations, w_down, topk_weights, sorted_pair_ids, block_expert_ids, num_padded,
        num_pairs, hidden_size, inter,
        activations.stride(0), w_down.stride(0), w_down.stride(1), per_pair.stride(0),
        A_ROWS_PER_PAIR=1, GATED=False, MUL_ROUTED_WEIGHT=True, **common,
    )  # fmt: skip
    # [T, K, H] -> [T, H]: the K weighted expert outputs of each token, summed in fp32.
    return per_pair.view(num_tokens, top_k, hidden_size).sum(1).to(hidden.dtype)


# ----------------------------------------------------------------------------------------------
# Plain-torch reference


def fused_moe_reference(
    hidden: torch.Tensor,
    w_gate_up: torch.Tensor,
    w_down: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
) -> torch.Tensor:
    """Plain torch `fused_moe`, one (token, k) pair at a time per expert, in fp32, the activations
    rounded to hidden's dtype between the projections as the kernel rounds them."""
    inter = w_gate_up.shape[1] // 2
    out = torch.zeros(hidden.shape, dtype=torch.float32, device=hidden.device)
    for expert in range(w_gate_up.shape[0]):
        token, slot = torch.nonzero(topk_ids == expert, as_tuple=True)
        if token.numel() == 0:
            continue
        x = hidden[token].float()  # [n, H]
        gate_up = x @ w_gate_up[expert].float().T  # [n, 2 * I]
        gate, up = gate_up[:, :inter], gate_up[:, inter:]
        act = (torch.nn.functional.silu(gate) * up).to(hidden.dtype).float()
        y = act @ w_down[expert].float().T * topk_weights[token, slot, None]  # [n, H]
        out.index_add_(0, token, y)
    return out.to(hidden.dtype)
