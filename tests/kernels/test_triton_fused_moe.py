# TRITON_INTERPRET is set by conftest.py (on machines without a GPU) before this imports a kernel.
from __future__ import annotations

import pytest
import qworker_kernels.triton_fused_moe as moe
import torch
from qworker_kernels.testing import TOLERANCES, make_moe_inputs, moe_cases
from qworker_kernels.triton_common import DOT_NATIVE

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = pytest.mark.timeout(120)


@pytest.mark.parametrize("case", moe_cases(), ids=lambda c: c.name)
def test_fused_moe_matches_reference(case) -> None:
    args = make_moe_inputs(case, device=DEVICE)
    got = moe.fused_moe(*args)
    expected = moe.fused_moe_reference(*args)
    assert got.dtype == args[0].dtype and got.shape == args[0].shape
    tol = TOLERANCES[case.dtype]
    torch.testing.assert_close(got.float(), expected.float(), atol=tol, rtol=tol)


def test_align_pairs_to_experts_groups_and_pads() -> None:
    # 3 tokens x top-2 = pairs 0..5 with experts [2, 0], [2, 3], [0, 2]; expert 1 has none.
    ids = torch.tensor([[2, 0], [2, 3], [0, 2]], device=DEVICE)
    sorted_ids, block_experts, num_padded = moe.align_pairs_to_experts(ids, num_experts=4, block_m=4)
    pad = 6
    assert sorted_ids.tolist() == [1, 4, pad, pad, 0, 2, 5, pad, 3, pad, pad, pad] + [pad] * 6
    assert num_padded.tolist() == [12]
    assert block_experts.tolist()[:3] == [0, 2, 3]
    assert all(0 <= e < 4 for e in block_experts.tolist())


def test_unused_experts_and_one_token() -> None:
    # Every token on the same expert pair: the other experts' tiles are empty.
    reference = moe.fused_moe_reference
    gen = torch.Generator().manual_seed(5)
    hidden = torch.randn(5, 48, generator=gen).to(DEVICE)
    w_gate_up = (torch.randn(6, 64, 48, generator=gen) * 0.1).to(DEVICE)
    w_down = (torch.randn(6, 48, 32, generator=gen) * 0.1).to(DEVICE)
    ids = torch.tensor([[4, 1]] * 5, device=DEVICE)
    weights = torch.full((5, 2), 0.5, device=DEVICE)
    args = (hidden, w_gate_up, w_down, weights, ids)
    torch.testing.assert_close(moe.fused_moe(*args), reference(*args), atol=1e-4, rtol=1e-4)
    one = (hidden[:1], w_gate_up, w_down, weights[:1], ids[:1])
    torch.testing.assert_close(moe.fused_moe(*one), reference(*one), atol=1e-4, rtol=1e-4)
    empty = (hidden[:0], w_gate_up, w_down, weights[:0], ids[:0])
    assert moe.fused_moe(*empty).shape == (0, 48)


def _bad_inputs() -> dict[str, tuple[tuple, str]]:
    gen = torch.Generator().manual_seed(0)
    h = torch.randn(4, 32, generator=gen).to(DEVICE)
    wgu = torch.randn(3, 40, 32, generator=gen).to(DEVICE)
    wd = torch.randn(3, 32, 20, generator=gen).to(DEVICE)
    w = torch.rand(4, 2, generator=gen).to(DEVICE)
    ids = torch.randint(0, 3, (4, 2), generator=gen).to(DEVICE)
    return {
        "hidden_1d": ((h[0], wgu, wd, w, ids), "hidden must be"),
        "hidden_int": ((h.int(), wgu, wd, w, ids), "dtype"),
        "gate_up_odd": ((h, wgu[:, :39], wd, w, ids), "w_gate_up must be"),
        "gate_up_hidden": ((h, wgu[:, :, :16], wd, w, ids), "w_gate_up must be"),
        "down_shape": ((h, wgu, wd[:, :, :10], w, ids), "w_down must be"),
        "weight_dtype": ((h, wgu.double(), wd, w, ids), "w_gate_up dtype"),
        "weights_strided": ((h, wgu.transpose(1, 2).contiguous().transpose(1, 2), wd, w, ids), "contiguous"),
        "ids_int32": ((h, wgu, wd, w, ids.int()), "topk_ids must be"),
        "ids_rows": ((h, wgu, wd, w[:3], ids[:3]), "topk_ids must be"),
        "weights_bf16": ((h, wgu, wd, w.bfloat16(), ids), "topk_weights must be"),
        "weights_shape": ((h, wgu, wd, w[:, :1], ids), "topk_weights must be"),
        "top_k_too_big": ((h, wgu, wd, torch.rand(4, 4), torch.zeros(4, 4, dtype=torch.int64)), "top_k"),
        "id_out_of_range": ((h, wgu, wd, w, ids.clone().fill_(3)), "expert id"),
        "id_negative": ((h, wgu, wd, w, ids.clone().fill_(-1)), "expert id"),
    }


@pytest.mark.parametrize("name", list(_bad_inputs()))
def test_fused_moe_rejects_bad_input(name: str) -> None:
    args, message = _bad_inputs()[name]
    with pytest.raises(ValueError, match=message):
        moe.fused_moe(*args)


def test_fused_moe_kernel_compiles_for_sm90_without_spills(compile_for_sm90) -> None:
    pointers = {
        "out_ptr": "*bf16", "a_ptr": "*bf16", "w_ptr": "*bf16", "topk_weights_ptr": "*fp32",
        "sorted_pair_ids_ptr": "*i32", "block_expert_ids_ptr": "*i32", "num_padded_ptr": "*i32",
    }  # fmt: skip
    common = dict(BLOCK_N=64, BLOCK_K=32, DOT_MODE=DOT_NATIVE)
    specs = [
        dict(kernel="_fused_moe_kernel", pointer_types=pointers,
             constexprs=dict(common, A_ROWS_PER_PAIR=2, GATED=True, MUL_ROUTED_WEIGHT=False, BLOCK_M=block_m))
        for block_m in (16, 64)
    ] + [
        dict(kernel="_fused_moe_kernel", pointer_types={**pointers, "out_ptr": "*fp32"},
             constexprs=dict(common, A_ROWS_PER_PAIR=1, GATED=False, MUL_ROUTED_WEIGHT=True, BLOCK_M=64))
    ]  # fmt: skip
    for spec, result in zip(specs, compile_for_sm90("triton_fused_moe", specs), strict=True):
        assert result["ptx_has_mma"], f"tl.dot did not lower to tensor-core MMA: {spec}"
        assert result["stack_bytes"] in (None, 0), f"register spills: {result}"
