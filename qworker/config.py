from __future__ import annotations

from dataclasses import dataclass
from enum import Enum


class SchedulingPolicy(str, Enum):
    FCFS = "fcfs"
    PRIORITY = "priority"


@dataclass
class EngineConfig:
    """Engine settings. Names follow vLLM's engine arguments where one exists."""

    model: str = "smollm2"
    block_size: int = 16
    # None: size the pool from `kv_cache_memory_gb` (CPU) or free device memory (GPU).
    num_kv_blocks: int | None = None
    kv_cache_memory_gb: float | None = None
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None
    enable_chunked_prefill: bool = True
    scheduling_policy: SchedulingPolicy = SchedulingPolicy.FCFS
    dtype: str = "auto"
    device: str = "auto"
    attention_backend: str = "auto"
    enforce_eager: bool = False
    seed: int = 0

    def __post_init__(self) -> None:
        self.scheduling_policy = SchedulingPolicy(self.scheduling_policy)
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ValueError(f"num_kv_blocks must be >= 1, got {self.num_kv_blocks}")
        if self.attention_backend not in ("auto", "torch", "triton"):
            raise ValueError(f"attention_backend must be auto|torch|triton, got {self.attention_backend!r}")
