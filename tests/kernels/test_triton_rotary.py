# TRITON_INTERPRET is set by conftest.py (on machines without a GPU) before this imports a kernel.
import pytest
import qworker_kernels.triton_rotary as rot
import torch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = pytest.mark.timeout(60)

TOLERANCE = {
    torch.float32: dict(atol=1e-5, rtol=1e-5),
    torch.float16: dict(atol=2e-3, rtol=2e-3),
    torch.bfloat16: dict(atol=2e-2, rtol=2e-2),
}


def rope_tables(
    max_position: int, rotary_dim: int, base: float = 10000.0
) -> tuple[torch.Tensor, torch.Tensor]:
    inv_freq = 1.0 / (base ** (torch.arange(0, rotary_dim, 2, dtype=torch.float32) / rotary_dim))
    angles = torch.outer(torch.arange(max_position, dtype=torch.float32), inv_freq)  # [max_pos, rot/2]
    return angles.cos().to(DEVICE), angles.sin().to(DEVICE)


def hf_apply_rotary_pos_emb(x: torch.Tensor, cos_half: torch.Tensor, sin_half: torch.Tensor) -> torch.Tensor:
    # transformers' Llama apply_rotary_pos_emb / rotate_half, in fp32, with the full-width tables
    # HF builds (the half tables repeated twice). x: [tokens, heads, head_dim].
    cos = torch.cat([cos_half, cos_half], dim=-1)[:, None, :]
    sin = torch.cat([sin_half, sin_half], dim=-1)[:, None, :]
    x = x.float()
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2 :]
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


@pytest.mark.parametrize(
    ("num_tokens", "num_heads", "num_kv_heads", "head_dim", "dtype"),
    [
        (1, 1, 1, 64, torch.float32),
        (7, 9, 3, 64, torch.float32),  # SmolLM2-135M: 9 heads, 3 KV heads
        (5, 8, 1, 128, torch.bfloat16),
        (6, 4, 4, 80, torch.float16),  # half = 40, not a power of two
    ],
)
def test_apply_rotary_matches_hf(
    num_tokens: int, num_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype
) -> None:
    cos, sin = rope_tables(64, head_dim)
    positions = torch.randint(0, 64, (num_tokens,), dtype=torch.int64).to(DEVICE)
    q = torch.randn((num_tokens, num_heads, head_dim), device=DEVICE).to(dtype)
    k = torch.randn((num_tokens, num_kv_heads, head_dim), device=DEVICE).to(dtype)
    q_expected = hf_apply_rotary_pos_emb(q, cos[positions], sin[positions]).to(dtype)
    k_expected = hf_apply_rotary_pos_emb(k, cos[positions], sin[positions]).to(dtype)
    q_ref, k_ref = rot.apply_rotary_reference(q.clone(), k.clone(), positions, cos, sin)
    q_out, k_out = rot.apply_rotary(q, k, positions, cos, sin)
    assert q_out is q and k_out is k, "must rotate in place"
    torch.testing.assert_close(q, q_expected, **TOLERANCE[dtype])
    torch.testing.assert_close(k, k_expected, **TOLERANCE[dtype])
    torch.testing.assert_close(q, q_ref, **TOLERANCE[dtype])
    torch.testing.assert_close(k, k_ref, **TOLERANCE[dtype])


def test_apply_rotary_on_fused_qkv_views() -> None:
    # q and k as strided slices of one [tokens, q_heads + 2 * kv_heads, head_dim] projection; v untouched.
    num_tokens, num_heads, num_kv_heads, head_dim = 4, 4, 2, 64
    cos, sin = rope_tables(16, head_dim)
    qkv = torch.randn((num_tokens, num_heads + 2 * num_kv_heads, head_dim), device=DEVICE)
    original = qkv.clone()
    q, k = qkv[:, :num_heads], qkv[:, num_heads : num_heads + num_kv_heads]
    positions = torch.tensor([0, 3, 15, 7], dtype=torch.int64, device=DEVICE)
    rot.apply_rotary(q, k, positions, cos, sin)
    torch.testing.assert_close(
        q, hf_apply_rotary_pos_emb(original[:, :num_heads], cos[positions], sin[positions])
    )
    k_original = original[:, num_heads : num_heads + num_kv_heads]
    torch.testing.assert_close(k, hf_apply_rotary_pos_emb(k_original, cos[positions], sin[positions]))
    assert torch.equal(qkv[:, num_heads + num_kv_heads :], original[:, num_heads + num_kv_heads :])


def test_position_zero_is_identity() -> None:
    cos, sin = rope_tables(4, 64)
    q = torch.randn((3, 2, 64), device=DEVICE)
    k = torch.randn((3, 1, 64), device=DEVICE)
    q0, k0 = q.clone(), k.clone()
    rot.apply_rotary(q, k, torch.zeros(3, dtype=torch.int64, device=DEVICE), cos, sin)
    torch.testing.assert_close(q, q0)
    torch.testing.assert_close(k, k0)


def test_partial_rotary_leaves_tail_untouched() -> None:
    # A table narrower than head_dim // 2 rotates the first 2 * cos.shape[1] dims only.
    cos, sin = rope_tables(8, 32)
    q = torch.randn((2, 2, 64), device=DEVICE)
    k = torch.randn((2, 1, 64), device=DEVICE)
    q0 = q.clone()
    positions = torch.tensor([1, 5], dtype=torch.int64, device=DEVICE)
    rot.apply_rotary(q, k, positions, cos, sin)
    assert torch.equal(q[..., 32:], q0[..., 32:])
    torch.testing.assert_close(
        q[..., :32], hf_apply_rotary_pos_emb(q0[..., :32], cos[positions], sin[positions])
    )


def test_no_tokens_is_a_no_op() -> None:
    cos, sin = rope_tables(4, 64)
    q, k = torch.empty((0, 2, 64), device=DEVICE), torch.empty((0, 1, 64), device=DEVICE)
    rot.apply_rotary(q, k, torch.empty(0, dtype=torch.int64, device=DEVICE), cos, sin)


def _bad_inputs() -> dict[str, tuple[tuple, str]]:
    cos, sin = rope_tables(8, 64)
    q = torch.randn((3, 4, 64), device=DEVICE)
    k = torch.randn((3, 2, 64), device=DEVICE)
    pos = torch.zeros(3, dtype=torch.int64, device=DEVICE)
    return {
        "q_2d": ((q[:, 0], k, pos, cos, sin), "must be \\[num_tokens"),
        "token_mismatch": ((q, k[:2], pos, cos, sin), "differ"),
        "dtype_mismatch": ((q, k.half(), pos, cos, sin), "share a dtype"),
        "positions_int32": ((q, k, pos.int(), cos, sin), "int64"),
        "positions_length": ((q, k, pos[:2], cos, sin), "positions must be"),
        "cos_bf16": ((q, k, pos, cos.bfloat16(), sin.bfloat16()), "float32"),
        "cos_too_wide": ((q, k, pos, *rope_tables(8, 128)), "cos.shape\\[1\\]"),
        "sin_shape": ((q, k, pos, cos, sin[:4]), "cos and sin must be"),
        "q_strided_head_dim": (
            (torch.randn((3, 4, 128), device=DEVICE)[..., ::2], k, pos, cos, sin),
            "contiguous",
        ),
    }


@pytest.mark.parametrize("name", list(_bad_inputs()))
def test_apply_rotary_rejects_bad_input(name: str) -> None:
    args, message = _bad_inputs()[name]
    with pytest.raises(ValueError, match=message):
        rot.apply_rotary(*args)


def test_kernel_compiles_for_sm90(compile_for_sm90) -> None:
    pointers = {
        "q_ptr": "*bf16",
        "k_ptr": "*bf16",
        "positions_ptr": "*i64",
        "cos_ptr": "*fp32",
        "sin_ptr": "*fp32",
    }
    [result] = compile_for_sm90(
        "triton_rotary",
        [dict(kernel="_rotary_kernel", pointer_types=pointers, num_warps=4,
              constexprs=dict(NUM_HEADS=32, NUM_KV_HEADS=8, Q_HEADS_PAD=32, KV_HEADS_PAD=8, HALF=64,
                              HALF_PAD=64))],
    )  # fmt: skip
    assert result["stack_bytes"] in (None, 0), result
