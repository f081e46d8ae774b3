"""What a pooling request asks for (vLLM's PoolingParams): the task, and how its vector is finished.

A pooling request runs its prompt through the model once (prefill only, never decoded) and returns
one vector: an embedding ("embed"), class probabilities or logits ("classify"), or one relevance
score ("score"). docs/pooling.md lists which models do which.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal, get_args

from qworker.errors import InvalidParamsError

if TYPE_CHECKING:
    import torch

PoolingTask = Literal["embed", "classify", "score"]
POOLING_TASKS: tuple[str, ...] = get_args(PoolingTask)
# vLLM's truncate_prompt_tokens=-1: keep as many of the prompt's last tokens as the context holds.
TRUNCATE_TO_CONTEXT = -1


def _optional_bool(name: str, value: object) -> None:
    if value is not None and not isinstance(value, bool):
        raise InvalidParamsError(f"{name} must be true, false or null, got {value!r}")


def _optional_positive_int(name: str, value: object, *, allow: tuple[int, ...] = ()) -> None:
    if value is None or (value in allow and not isinstance(value, bool)):
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        extra = f" (or {', '.join(map(str, allow))})" if allow else ""
        raise InvalidParamsError(f"{name} must be a positive integer{extra}, got {value!r}")


@dataclass
class PoolingParams:
    """Pooling parameters, with vLLM's field names and meanings.

    - `normalize` (embed): L2-normalise the embedding; None takes the engine's
      `pooling_normalize` (true by default).
    - `dimensions` (embed): keep the first `dimensions` values (Matryoshka), then normalise them
      again; refused above the model's hidden size.
    - `truncate_prompt_tokens`: keep only the prompt's last k tokens (-1: as many as the context
      holds), as vLLM truncates.
    - `use_activation` (classify, score): softmax over the classes (sigmoid for a one-label
      classifier and for scores) unless False, which returns the raw logits.

    The checks here depend on the values alone; `check_model_limits` those that depend on the model.
    """

    task: PoolingTask = "embed"
    normalize: bool | None = None
    dimensions: int | None = None
    truncate_prompt_tokens: int | None = None
    use_activation: bool | None = None

    def __post_init__(self) -> None:
        if self.task not in POOLING_TASKS:
            raise InvalidParamsError(f"task must be one of {', '.join(POOLING_TASKS)}, got {self.task!r}")
        _optional_bool("normalize", self.normalize)
        _optional_bool("use_activation", self.use_activation)
        _optional_positive_int("dimensions", self.dimensions)
        _optional_positive_int(
            "truncate_prompt_tokens", self.truncate_prompt_tokens, allow=(TRUNCATE_TO_CONTEXT,)
        )
        if self.task != "embed":
            for name in ("normalize", "dimensions"):
                if getattr(self, name) is not None:
                    raise InvalidParamsError(f"{name} applies to task 'embed' only, not {self.task!r}")
        elif self.use_activation is not None:
            raise InvalidParamsError("use_activation applies to tasks 'classify' and 'score', not 'embed'")

    def check_model_limits(self, hidden_size: int) -> None:
        if self.dimensions is not None and self.dimensions > hidden_size:
            raise InvalidParamsError(
                f"dimensions {self.dimensions} is more than the model's hidden size ({hidden_size})"
            )

    def truncate(self, token_ids: list[int], max_model_len: int) -> list[int]:
        """The prompt's last `truncate_prompt_tokens` tokens (all of them when None)."""
        keep = self.truncate_prompt_tokens
        if keep is None:
            return token_ids
        if keep == TRUNCATE_TO_CONTEXT:
            keep = max_model_len
        return token_ids[-keep:]

    def finish(self, pooled: torch.Tensor, default_normalize: bool) -> torch.Tensor:
        """The request's vector from its pooled row (1-D float32): an embedding truncated and
        normalised, or class logits through their activation (the score task's one logit:
        sigmoid, as a one-label classifier)."""
        # Here, not at the top: the job side validates PoolingParams without loading torch.
        import torch

        if self.task == "embed":
            if self.dimensions is not None:
                pooled = pooled[: self.dimensions]
            normalize = self.normalize if self.normalize is not None else default_normalize
            return torch.nn.functional.normalize(pooled, dim=-1) if normalize else pooled
        if self.use_activation is False:
            return pooled
        if self.task == "score" or pooled.numel() == 1:
            return torch.sigmoid(pooled)
        return torch.softmax(pooled, dim=-1)
