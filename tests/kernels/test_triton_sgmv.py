# TRITON_INTERPRET is set by conftest.py (on machines without a GPU) before this imports a kernel.
"""The SGMV LoRA kernels against their torch twin and against the engine's CPU path: segments of
mixed lengths (one longer than a row tile, one of a single token), slots out of order and a slot
with no tokens, widths that are not tile multiples, fp32 and bf16."""

from __future__ import annotations

import numpy as np
import pytest
import qworker_kernels.triton_sgmv as sgmv
import torch
from qworker_kernels.triton_common import DOT_NATIVE

from qworker.lora.layers import build_step_meta

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
pytestmark = pytest.mark.timeout(120)
TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 3e-2}


def make_case(
    dtype: torch.dtype, *, num_tokens: int = 29, k: int = 40, width: int = 48, n: int = 72, loras: int = 4
):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(num_tokens, k, generator=gen).to(DEVICE, dtype)
    a_t = (torch.randn(loras, k, width, generator=gen) * 0.2).to(DEVICE, dtype)
    b_t = (torch.randn(loras, width, n, generator=gen) * 0.2).to(DEVICE, dtype)
    out = torch.randn(num_tokens, n, generator=gen).to(DEVICE, dtype)
    # Slot 2 has 18 tokens (two row tiles), slot 0 one, slot 3 several, slot 1 none; -1 base.
    slots = np.full(num_tokens, -1, dtype=np.int64)
    slots[[3]] = 0
    slots[5:23] = 2
    slots[[0, 24, 26, 28]] = 3
    meta = build_step_meta(slots, loras, DEVICE, for_kernels=True)
    assert meta is not None and meta.segment_starts is not None and meta.segment_slots is not None
    index = (meta.token_indices, meta.segment_starts, meta.segment_slots)
    return out, x, a_t, b_t, index, meta.max_segment_len


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_add_lora_sgmv_matches_reference(dtype: torch.dtype) -> None:
    out, x, a_t, b_t, index, max_len = make_case(dtype)
    expected = out.clone()
    sgmv.add_lora_sgmv_reference(expected, x, a_t, b_t, *index)
    untouched = out.clone()
    sgmv.add_lora_sgmv(out, x, a_t, b_t, *index, max_len)
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(out.float(), expected.float(), atol=tol, rtol=tol)
    base_rows = [t for t in range(out.shape[0]) if t not in set(index[0].tolist())]
    assert torch.equal(out[base_rows], untouched[base_rows]), "a base-model token changed"


def test_shrink_alone_and_empty() -> None:
    _, x, a_t, _, index, max_len = make_case(torch.float32)
    h = sgmv.sgmv_shrink(x, a_t, *index, max_len)
    tokens, starts, slots = index
    for s, slot in enumerate(slots.tolist()):
        rows = slice(starts[s], starts[s + 1])
        torch.testing.assert_close(h[rows], x[tokens[rows]] @ a_t[slot], atol=1e-4, rtol=1e-4)
    empty = torch.zeros(0, dtype=torch.int64, device=DEVICE)
    assert sgmv.sgmv_shrink(
        x, a_t, empty, torch.zeros(1, dtype=torch.int64, device=DEVICE), empty, 0
    ).shape == (0, 48)


def test_matches_the_engine_cpu_path() -> None:
    """The CUDA path (kernels) and the CPU path (grouped matmuls, qworker/lora/layers.py) agree."""
    from qworker.lora.layers import LoRAContext, LoRALinear

    out, x, a_t, b_t, index, max_len = make_case(torch.float32)
    base = torch.nn.Linear(x.shape[1], out.shape[1], bias=False)
    layer = LoRALinear(base, 1, a_t.shape[0], a_t.shape[2], LoRAContext())
    layer.lora_a_t.copy_(a_t.cpu())
    layer.lora_b_t.copy_(b_t.cpu())
    layer.slot_is_set[:] = True
    slots = np.full(x.shape[0], -1, dtype=np.int64)
    tokens, starts, seg_slots = (t.cpu() for t in index)
    for s, slot in enumerate(seg_slots.tolist()):
        slots[tokens[starts[s] : starts[s + 1]].numpy()] = slot
    layer.context.meta = build_step_meta(slots, a_t.shape[0], torch.device("cpu"))
    with torch.no_grad():
        got = layer(x.cpu())
        expected = base(x.cpu())
    sgmv.add_lora_sgmv(expected, x.cpu(), a_t.cpu(), b_t.cpu(), tokens, starts, seg_slots, max_len)
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)


def _bad() -> dict[str, tuple[tuple, str]]:
    out, x, a_t, b_t, index, max_len = make_case(torch.float32)
    tokens, starts, slots = index
    return {
        "x_1d": ((out, x[0], a_t, b_t, *index, max_len), "x must be"),
        "a_dtype": ((out, x, a_t.double(), b_t, *index, max_len), "a_t dtype"),
        "a_features": ((out, x, a_t[:, :10], b_t, *index, max_len), "features"),
        "b_width": ((out, x, a_t, b_t[:, :16], *index, max_len), "b_t is"),
        "tokens_int32": ((out, x, a_t, b_t, tokens.int(), starts, slots, max_len), "token_indices"),
        "starts_len": ((out, x, a_t, b_t, tokens, starts[:-1], slots, max_len), "one entry more"),
        "out_rows": ((out[:3], x, a_t, b_t, *index, max_len), "rows"),
        "x_strided": ((out, x.t().contiguous().t(), a_t, b_t, *index, max_len), "contiguous"),
    }


@pytest.mark.parametrize("name", list(_bad()))
def test_rejects_bad_input(name: str) -> None:
    args, message = _bad()[name]
    with pytest.raises(ValueError, match=message):
        sgmv.add_lora_sgmv(*args)


def test_sgmv_kernels_compile_for_sm90_without_spills(compile_for_sm90) -> None:
    pointers = {
        "h_ptr": "*bf16", "x_ptr": "*bf16", "a_ptr": "*bf16", "out_ptr": "*bf16", "b_ptr": "*bf16",
        "token_ptr": "*i64", "seg_start_ptr": "*i64", "seg_slot_ptr": "*i64",
    }  # fmt: skip
    specs = [
        dict(kernel="_sgmv_shrink_kernel", pointer_types=pointers,
             constexprs=dict(DOT_MODE=DOT_NATIVE, BLOCK_M=sgmv.BLOCK_M, BLOCK_N=sgmv.BLOCK_N_SHRINK,
                             BLOCK_K=sgmv.BLOCK_K_SHRINK)),
        dict(kernel="_sgmv_expand_kernel", pointer_types=pointers,
             constexprs=dict(DOT_MODE=DOT_NATIVE, BLOCK_M=sgmv.BLOCK_M, BLOCK_N=sgmv.BLOCK_N_EXPAND,
                             BLOCK_K=sgmv.BLOCK_K_EXPAND)),
    ]  # fmt: skip
    for spec, result in zip(specs, compile_for_sm90("triton_sgmv", specs), strict=True):
        assert result["ptx_has_mma"], f"tl.dot did not lower to tensor-core MMA: {spec['kernel']}"
        assert result["stack_bytes"] in (None, 0), f"register spills: {result}"
