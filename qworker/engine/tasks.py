"""Which tasks an engine serves (generate, embed, classify, score), from its checkpoint and its
config (vLLM's --runner and --convert), and what the runner pools for each pooling request.

| checkpoint                       | runner auto                        | runner pooling        |
|----------------------------------|------------------------------------|-----------------------|
| *ForCausalLM                     | generate, embed                    | embed                 |
| *ForCausalLM, convert classify   | generate, classify, score (yes/no) | classify, score       |
| *ForSequenceClassification       | classify (+ score with 1 label)    | the same              |

`convert embed` adds embed to a classifier; `convert none` takes pooling off a causal LM;
`runner generate` serves generation only (a classifier cannot generate). docs/pooling.md.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from qworker.config import ConvertKind, EngineConfig, PoolingType, RunnerKind
from qworker.errors import InvalidConfigError, UnsupportedTaskError
from qworker.model.config import ModelConfig
from qworker.model.pooler import PoolingHead, PoolingSpec

ALL_TASKS = ("generate", "embed", "classify", "score")
# The reranker's answer tokens (Qwen3-Reranker's model card: "yes" or "no").
YES_TOKEN, NO_TOKEN = "yes", "no"


def _token_id(tokenizer: Any, token: str, model: str) -> int:
    token_id = tokenizer.convert_tokens_to_ids(token) if tokenizer is not None else None
    if not isinstance(token_id, int) or token_id == getattr(tokenizer, "unk_token_id", None):
        raise InvalidConfigError(
            f"convert classify needs the token {token!r} in the tokenizer of {model} (the yes/no "
            "reranker form reads its logit)"
        )
    return token_id


@dataclass(frozen=True)
class ModelTasks:
    """The tasks one engine serves and how its pooling requests are pooled."""

    model: str
    supported: tuple[str, ...]
    pooling_type: PoolingType
    # How classify and score rows are computed; None when the engine does neither.
    classifier_head: PoolingHead | None
    # PoolingHead.YES_NO: the (no, yes) token ids.
    yes_no_token_ids: tuple[int, int] | None
    # A classifier pools its last token that is not this one (transformers' rule); None: the last.
    pad_token_id: int | None

    @classmethod
    def resolve(
        cls, config: EngineConfig, model_config: ModelConfig, hf_config: Any, tokenizer: Any
    ) -> ModelTasks:
        """The engine's tasks; InvalidConfigError for a runner/convert pair the checkpoint cannot do."""
        is_classifier = model_config.num_labels is not None
        runner, convert = config.runner, config.convert
        tasks: set[str] = set()
        head: PoolingHead | None = None
        yes_no: tuple[int, int] | None = None
        if is_classifier:
            if runner is RunnerKind.GENERATE:
                raise InvalidConfigError(
                    f"{config.model} is a sequence classifier ({hf_config.architectures[0]}): it cannot "
                    "generate; use --runner auto or pooling"
                )
            if convert is ConvertKind.NONE:
                raise InvalidConfigError(
                    f"{config.model} is a sequence classifier: --convert none leaves it no task"
                )
            head = PoolingHead.CLASSIFIER
            tasks.add("classify")
            if model_config.num_labels == 1:
                tasks.add("score")
            if convert is ConvertKind.EMBED:
                tasks.add("embed")
        else:
            if runner is not RunnerKind.POOLING:
                tasks.add("generate")
            if runner is not RunnerKind.GENERATE:
                if convert is ConvertKind.NONE and runner is RunnerKind.POOLING:
                    raise InvalidConfigError(
                        "--runner pooling with --convert none leaves a causal LM no task"
                    )
                if convert in (ConvertKind.AUTO, ConvertKind.EMBED):
                    tasks.add("embed")
                elif convert is ConvertKind.CLASSIFY:
                    head = PoolingHead.YES_NO
                    yes_no = (
                        _token_id(tokenizer, NO_TOKEN, config.model),
                        _token_id(tokenizer, YES_TOKEN, config.model),
                    )
                    tasks.update(("classify", "score"))
        pad = getattr(hf_config, "pad_token_id", None)
        return cls(
            model=config.model,
            supported=tuple(t for t in ALL_TASKS if t in tasks),
            pooling_type=config.pooling_type,
            classifier_head=head,
            yes_no_token_ids=yes_no,
            pad_token_id=pad if isinstance(pad, int) else None,
        )

    def check(self, task: str) -> None:
        if task not in self.supported:
            raise UnsupportedTaskError(
                f"model {self.model} cannot do task {task!r} as configured; it supports "
                f"{', '.join(self.supported) or 'nothing'} (see --runner and --convert in docs/pooling.md)"
            )

    def spec_for(self, task: str, token_ids: list[int]) -> PoolingSpec:
        """What the runner pools for a request of `task` (checked) on these tokens."""
        self.check(task)
        last = len(token_ids) - 1
        if task == "embed":
            position = {PoolingType.LAST: last, PoolingType.CLS: 0, PoolingType.MEAN: None}[self.pooling_type]
            return PoolingSpec(PoolingHead.HIDDEN, position)
        assert self.classifier_head is not None, f"task {task} is supported without a head"
        if self.classifier_head is PoolingHead.YES_NO:
            return PoolingSpec(PoolingHead.YES_NO, last, self.yes_no_token_ids)
        position = last
        if self.pad_token_id is not None:
            # transformers: the rightmost token that is not the pad token (position 0 if all are).
            not_pad = np.flatnonzero(np.asarray(token_ids) != self.pad_token_id)
            position = int(not_pad[-1]) if len(not_pad) else 0
        return PoolingSpec(PoolingHead.CLASSIFIER, position)
