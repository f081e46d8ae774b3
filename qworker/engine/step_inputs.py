"""What the runner hands the model for one step: the step's tensors and which rows are sampled.

Its own module because the runner builds it and the decode CUDA graphs read it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from qworker.engine.scheduler_output import ScheduledRequest
from qworker.model.attention import AttentionMetadata
from qworker.model.pooler import PoolingStep


@dataclass
class StepInputs:
    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    meta: AttentionMetadata
    # [num_sampled] rows of the hidden states whose next token is sampled
    logits_indices: torch.Tensor
    sampled_requests: list[ScheduledRequest]
    # Prompt logprobs: [P] rows of the hidden states whose logits score the next prompt token,
    # [P] those tokens, and per request asking (its id, its k, how many rows are its own).
    prompt_logits_indices: torch.Tensor | None = None
    prompt_target_ids: torch.Tensor | None = None
    prompt_logprobs_rows: list[tuple[str, int, int]] = field(default_factory=list)
    # Which tokens run which LoRA slot (qworker.lora.layers.LoRAStepMeta); None: no adapter.
    lora: Any = None
    # The pooling requests' gathers; None: none in this step.
    pooling: PoolingStep | None = None
