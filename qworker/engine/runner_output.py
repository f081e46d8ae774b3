"""What one runner step produced, for the scheduler to take (vLLM's ModelRunnerOutput)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from qworker.engine.sampler import PositionLogprobs


@dataclass
class RunnerOutput:
    """The sampled token of each request whose chunk reached its end, the logprobs of those tokens
    for requests asking them, and new prompt logprobs in order of position for requests asking
    them."""

    sampled: dict[str, int] = field(default_factory=dict)
    logprobs: dict[str, PositionLogprobs] = field(default_factory=dict)
    prompt_logprobs: dict[str, list[PositionLogprobs]] = field(default_factory=dict)
    # Pooling requests whose last chunk ran: the pooler's head output, 1-D float32 on the CPU.
    pooled: dict[str, torch.Tensor] = field(default_factory=dict)
