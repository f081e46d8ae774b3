"""Everything that differs between the GPU run and the CPU smoke run of the GPU check: model
shapes (random weights, built in code), request counts and lengths, kernel cases."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from qworker.testing import TINY_LLAMA

# Llama-3.2-1B's shape. Plain RoPE with its theta: llama3 rope scaling changes the tables, not
# the cost, and its config keys differ across transformers versions.
LLAMA_1B_SHAPE = dict(
    vocab_size=128256,
    hidden_size=2048,
    intermediate_size=8192,
    num_hidden_layers=16,
    num_attention_heads=32,
    num_key_value_heads=8,
    head_dim=64,
    max_position_embeddings=131072,
    rms_norm_eps=1e-5,
    rope_theta=500000.0,
    tie_word_embeddings=True,
    bos_token_id=128000,
    eos_token_id=128001,
)


@dataclass
class Sizes:
    """Everything that differs between the GPU run and the CPU smoke run."""

    device: str
    e2e_dtype: str
    e2e_model: dict[str, Any]
    e2e_max_model_len: int
    e2e_kv_cache_gb: float
    e2e_num_requests: int
    # (min, max) prompt and output lengths instead of the offline-mixed spec's own; None: its own.
    e2e_lengths: tuple[tuple[int, int], tuple[int, int]] | None
    e2e_max_num_seqs: int
    e2e_max_num_batched_tokens: int
    hf_batch_sizes: tuple[int, ...]
    decode_batches: tuple[int, ...]
    decode_prompt_len: int
    decode_output_len: int
    parity_model: dict[str, Any]
    parity_num_requests: int
    parity_max_prompt: int
    parity_max_output: int
    # The preemption run's block size: small enough that decodes cross block boundaries often.
    parity_preempt_block_size: int
    kernel_block_sizes: tuple[int, ...]
    kernel_head_dims: tuple[int, ...]
    kernel_gqa: tuple[int, ...]
    kernel_dtypes: tuple[str, ...]
    norm_hidden: tuple[int, ...]


GPU_SIZES = Sizes(
    device="cuda",
    e2e_dtype="bfloat16",
    e2e_model=LLAMA_1B_SHAPE,
    e2e_max_model_len=2048,
    e2e_kv_cache_gb=12.0,
    e2e_num_requests=1024,
    e2e_lengths=None,
    e2e_max_num_seqs=256,
    e2e_max_num_batched_tokens=4096,
    hf_batch_sizes=(32,),
    decode_batches=(1, 8, 64, 256),
    decode_prompt_len=128,
    decode_output_len=64,
    parity_model=dict(
        TINY_LLAMA,
        vocab_size=2048,
        hidden_size=512,
        intermediate_size=1024,
        num_hidden_layers=4,
        num_attention_heads=8,
        max_position_embeddings=1024,
    ),
    parity_num_requests=48,
    parity_max_prompt=300,
    parity_max_output=40,
    parity_preempt_block_size=16,
    kernel_block_sizes=(16, 32),
    kernel_head_dims=(64, 128),
    kernel_gqa=(1, 3, 8),
    kernel_dtypes=("bfloat16", "float16", "float32"),
    norm_hidden=(2048, 4096, 1000),
)

CPU_SMOKE_SIZES = Sizes(
    device="cpu",
    e2e_dtype="float32",
    e2e_model={**TINY_LLAMA, "tie_word_embeddings": True},
    e2e_max_model_len=128,
    e2e_kv_cache_gb=0.01,
    e2e_num_requests=6,
    e2e_lengths=((4, 24), (2, 6)),
    e2e_max_num_seqs=4,
    e2e_max_num_batched_tokens=32,
    hf_batch_sizes=(4,),
    decode_batches=(1, 3),
    decode_prompt_len=4,
    decode_output_len=3,
    parity_model=TINY_LLAMA,
    parity_num_requests=5,
    parity_max_prompt=20,
    parity_max_output=5,
    parity_preempt_block_size=4,
    kernel_block_sizes=(16,),
    kernel_head_dims=(64,),
    kernel_gqa=(1, 3),
    kernel_dtypes=("float32",),
    norm_hidden=(256, 100),
)
