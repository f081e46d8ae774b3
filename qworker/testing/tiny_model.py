"""Tiny random Llama-family models for tests, scripts and the GPU check: the one definition of
their shape, built in code (nothing downloaded).

Engine-level: it needs torch and transformers only (imported when called), nothing of the worker,
so the engine's tests and `qworker.bench.gpu_check` use it on a machine without the worker's
libraries. `qworker.testing.worker_kit.write_tiny_model_dir` saves one with a tokenizer, for worker
processes.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch
    from transformers import PretrainedConfig, PreTrainedModel

# head_dim 16 (hidden 64 / 4 heads) and GQA 2: the smallest shapes every kernel takes.
TINY_LLAMA: dict[str, Any] = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    rms_norm_eps=1e-5,
    tie_word_embeddings=False,
    bos_token_id=1,
    eos_token_id=2,
)


def tiny_llama_config(model_type: str = "llama", **overrides: Any) -> PretrainedConfig:
    """TINY_LLAMA with `overrides`, as a transformers config of `model_type` (a Llama-family type)."""
    from transformers import AutoConfig

    return AutoConfig.for_model(model_type, **{**TINY_LLAMA, **overrides})


def tiny_llama_model(
    model_type: str = "llama",
    *,
    seed: int = 0,
    widen: float | None = None,
    dtype: torch.dtype | None = None,
    device: torch.device | str | None = None,
    **overrides: Any,
) -> PreTrainedModel:
    """A transformers model of tiny_llama_config(model_type, **overrides), randomly initialised
    from `seed` (on `device`: fast for large shapes), in eval mode. `widen` scales every matrix:
    random init gives near-uniform logits, where greedy picks are near-ties that rounding flips."""
    import torch
    from transformers import AutoModelForCausalLM

    config = tiny_llama_config(model_type, **overrides)
    torch.manual_seed(seed)
    with torch.device(device or "cpu"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype or torch.float32)
    model = model.eval()
    if widen is not None:
        with torch.no_grad():
            for p in model.parameters():
                if p.dim() > 1:
                    p.mul_(widen)
    return model
