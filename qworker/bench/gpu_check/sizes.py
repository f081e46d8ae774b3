"""Everything that differs between the GPU run and the CPU smoke run of the GPU check: model
shapes (random weights, built in code), request counts and lengths, kernel cases."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from qworker.testing.tiny_model import TINY_LLAMA

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
    # roofline / profile / consistency (decode_probe.py: synthetic decode steps on the e2e model)
    roofline_batches: tuple[int, ...]
    roofline_contexts: tuple[int, ...]
    roofline_iters: int  # timed repeats of each step
    copy_mib: int  # the bandwidth probe's buffer
    matmul_n: int  # the matmul-rate probe: [n, n] @ [n, n] in the e2e dtype
    profile_batch: int
    profile_context: int
    consistency_batches: tuple[int, ...]  # not captured sizes, mostly: replays pad them
    consistency_context: int
    # serving (serving.py): nano-vllm's protocol and the packaged workloads, scaled
    nano_num_requests: int
    nano_lengths: tuple[int, int]  # input and output lengths, uniform in [min, max]
    serving_kv_cache_gb: float
    shared_prefix_num_requests: int
    shared_prefix_len: int | None  # None: the spec's own 512
    poisson_num_requests: int
    poisson_rates: tuple[float, ...]  # raised in order until p99 TTFT passes 2 s
    features_num_requests: int  # offline-mixed requests for the plain / logprobs / n=4 runs
    serving_hf_batch: int


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
    # Engine-level decode steps (scheduler and sampler included); the roofline stage has the rest.
    decode_batches=(1, 256),
    decode_prompt_len=128,
    decode_output_len=32,
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
    roofline_batches=(1, 8, 64, 256),
    roofline_contexts=(128, 1024),
    roofline_iters=20,
    copy_mib=1024,
    matmul_n=8192,
    profile_batch=64,
    profile_context=1024,
    consistency_batches=(1, 3, 5, 13, 50, 200),
    consistency_context=200,
    nano_num_requests=256,
    nano_lengths=(100, 1024),
    serving_kv_cache_gb=16.0,
    shared_prefix_num_requests=1024,
    shared_prefix_len=None,
    poisson_num_requests=512,
    poisson_rates=(64.0, 128.0, 256.0, 512.0, 1024.0),
    features_num_requests=128,
    serving_hf_batch=16,
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
    roofline_batches=(1, 3),
    roofline_contexts=(8, 40),
    roofline_iters=1,
    copy_mib=8,
    matmul_n=128,
    profile_batch=3,
    profile_context=20,
    consistency_batches=(3, 5),  # captured sizes 1, 2, 4, 5: batch 3 replays padded to 4
    consistency_context=20,
    nano_num_requests=3,
    nano_lengths=(4, 12),
    serving_kv_cache_gb=0.01,
    shared_prefix_num_requests=3,
    shared_prefix_len=16,
    poisson_num_requests=3,
    poisson_rates=(50.0, 1000.0),
    features_num_requests=1,  # n = 4 fills max_num_seqs 4
    serving_hf_batch=2,
)
