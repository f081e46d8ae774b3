"""Tiny random models of every family, built from transformers' own config classes with odd
shapes, for the family tests (tests/unit/test_model_families.py), the bf16 parity count
(scripts/parity_families.py) and the family benchmarks (scripts/bench_families.py).

Shapes: head dims 48 and 80 (the C kernels run) and 40 (not a multiple of 16: the fallback path),
GQA 1 and 4, three or four layers, four experts with top-2 for the MoE families, and a sliding
window of 8 or 12 for the families that have one. Needs torch and transformers only.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

WINDOW = 8

COMMON: dict[str, Any] = dict(
    vocab_size=256,
    max_position_embeddings=256,
    rms_norm_eps=1e-6,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
    tie_word_embeddings=False,
)

# model_type -> transformers config kwargs. Comments name what each one exercises.
FAMILIES: dict[str, dict[str, Any]] = {
    # q/k norms; head_dim 48, GQA 4; a window on layers 1 and 2 (max_window_layers=1).
    "qwen3": dict(
        hidden_size=96, intermediate_size=160, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=1, head_dim=48, use_sliding_window=True, sliding_window=WINDOW,
        max_window_layers=1, tie_word_embeddings=True,
    ),
    # head_dim 40 (fallback path), GQA 1; MoE on layers 0 and 2, a dense MLP on layer 1.
    "qwen3_moe": dict(
        hidden_size=80, intermediate_size=96, moe_intermediate_size=48, num_hidden_layers=3,
        num_attention_heads=2, num_key_value_heads=2, head_dim=40, num_experts=4,
        num_experts_per_tok=2, decoder_sparse_step=1, mlp_only_layers=[1], norm_topk_prob=True,
    ),
    # Every layer MoE, a window of 12 on every layer; head_dim 48, GQA 1.
    "mixtral": dict(
        hidden_size=96, intermediate_size=64, num_hidden_layers=3, num_attention_heads=2,
        num_key_value_heads=2, head_dim=48, num_local_experts=4, num_experts_per_tok=2,
        sliding_window=12,
    ),
    # Soft-capping, query_pre_attn_scalar, sandwich norms, GeGLU, windowed and global layers.
    "gemma2": dict(
        hidden_size=96, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=1, head_dim=48, query_pre_attn_scalar=32, sliding_window=WINDOW,
        attn_logit_softcapping=5.0, final_logit_softcapping=3.0, tie_word_embeddings=True,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
    ),
    # q/k norms, local and global RoPE bases; head_dim 80, GQA 1.
    "gemma3_text": dict(
        hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=2,
        num_key_value_heads=2, head_dim=80, query_pre_attn_scalar=64, sliding_window=WINDOW,
        layer_types=["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"],
        rope_parameters={
            "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
            "full_attention": {"rope_type": "default", "rope_theta": 1_000_000.0},
        },
        tie_word_embeddings=True,
    ),
    # Fused qkv and gate_up in the checkpoint; longrope past 16 positions; partial rotary 3/4.
    "phi3": dict(
        hidden_size=96, intermediate_size=128, num_hidden_layers=3, num_attention_heads=2,
        num_key_value_heads=2, partial_rotary_factor=0.75, original_max_position_embeddings=16,
        rope_parameters={
            "rope_type": "longrope", "rope_theta": 10_000.0,
            "short_factor": [1.0 + 0.05 * i for i in range(18)],
            "long_factor": [1.0 + 4.0 * i for i in range(18)],
            "original_max_position_embeddings": 16,
        },
    ),
    # A window on every layer (head_dim 16).
    "mistral": dict(
        hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, sliding_window=WINDOW,
    ),
    # q/k/v biases; a window on layers 1 and 2; head_dim 48, GQA 4.
    "qwen2": dict(
        hidden_size=192, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=1, use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1,
    ),
    "llama": dict(
        hidden_size=96, intermediate_size=128, num_hidden_layers=3, num_attention_heads=2,
        num_key_value_heads=2, attention_bias=True,
    ),
}  # fmt: skip
# Sharper attention where a feature only shows with large scores (Gemma 2's soft-cap).
QK_SCALE = {"gemma2": 3.0}

# Sharper attention where a feature only shows with large scores (Gemma 2's soft-cap).
QK_SCALE = {"gemma2": 3.0}


def tiny_family_config(model_type: str, **overrides: Any) -> Any:
    """The transformers config of the tiny `model_type` model."""
    from transformers import AutoConfig

    return AutoConfig.for_model(model_type, **{**COMMON, **FAMILIES[model_type], **overrides})


def randomize(model: Any, model_type: str, seed: int = 0) -> Any:
    """Widen a randomly initialised model in place: random init gives near-uniform logits, where
    greedy picks are near-ties that rounding flips. Norm weights get some spread around their
    identity (1 for Llama's, 0 for Gemma's offsets)."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() > 1:
                p.mul_(3.0)
                if name.endswith(("q_proj.weight", "k_proj.weight")):
                    p.mul_(QK_SCALE.get(model_type, 1.0))
            elif "norm" in name:
                p.add_(torch.randn(p.shape, generator=generator) * 0.3)
    return model


def tiny_family_model(model_type: str, seed: int = 0, **overrides: Any) -> Any:
    """A transformers model of tiny_family_config(model_type), float32, eval mode."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_family_config(model_type, **overrides), dtype=torch.float32)
    return randomize(model.eval(), model_type, seed)


TOKENIZER_FILES = ("tokenizer", "special_tokens", "vocab", "merges", "chat_template")


def save_with_tokenizer(model: Any, target: Path) -> Path:
    """save_pretrained(model) plus SmolLM2's tokenizer files, so that `LLM(target)` and `qworker
    bench --model target` load it like any Hugging Face directory (token ids past the model's
    vocabulary are then never produced by the model; prompts must stay inside it)."""
    from qworker.model.loader import resolve_model

    model.save_pretrained(target)
    tokenizer_dir = resolve_model("smollm2").path
    for source in tokenizer_dir.iterdir():
        if source.name.startswith(TOKENIZER_FILES):
            shutil.copy(source, target / source.name)
    return target
