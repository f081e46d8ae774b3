from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any, cast

from qworker.config import EngineConfig
from qworker.engine.llm_engine import LLMEngine, Prompt
from qworker.engine.outputs import (
    ClassificationOutput,
    ClassificationRequestOutput,
    EmbeddingOutput,
    EmbeddingRequestOutput,
    PoolingRequestOutput,
    RequestOutput,
    ScoringOutput,
    ScoringRequestOutput,
)
from qworker.engine.pooling_params import PoolingParams
from qworker.engine.sampling_params import SamplingParams
from qworker.lora.request import LoRARequest


class LLM:
    """Offline generation with vLLM's API shape.

    >>> llm = LLM(model="smollm2")
    >>> out = llm.generate(["Hello"], SamplingParams(max_tokens=8, temperature=0.0))
    >>> out[0].outputs[0].text
    """

    def __init__(self, model: str = "smollm2", **engine_args: Any) -> None:
        self.llm_engine = LLMEngine(EngineConfig(model=model, **engine_args))
        self._counter = 0

    def get_tokenizer(self) -> Any:
        return self.llm_engine.tokenizer

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = False,
        priority: Sequence[int] | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Run every prompt to completion; outputs come back in the order of `prompts`.

        `lora_request`: one adapter for every prompt, or one per prompt (None: the base model),
        as vLLM takes it. A prompt whose adapter cannot be used gets a failed output (its
        `error` says why); the others complete."""
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, SamplingParams):
            params_list = [sampling_params] * len(prompts)
        else:
            params_list = list(sampling_params)
            if len(params_list) != len(prompts):
                raise ValueError(f"{len(params_list)} sampling params for {len(prompts)} prompts")
        if lora_request is None or isinstance(lora_request, LoRARequest):
            lora_list: list[LoRARequest | None] = [lora_request] * len(prompts)
        else:
            lora_list = list(lora_request)
            if len(lora_list) != len(prompts):
                raise ValueError(f"{len(lora_list)} LoRA requests for {len(prompts)} prompts")
        engine = self.llm_engine
        request_ids: list[str] = []
        try:
            for i, (prompt, params) in enumerate(zip(prompts, params_list, strict=True)):
                self._counter += 1
                request_ids.append(
                    engine.add_request(
                        f"gen-{self._counter}",
                        prompt,
                        params,
                        priority=priority[i] if priority else 0,
                        lora_request=lora_list[i],
                    )
                )
            return self._run(request_ids, use_tqdm)
        except BaseException:
            # A bad prompt or parameter raises before anything runs, and a failed step leaves
            # nothing behind: no request of this call stays in the engine for the next one.
            for request_id in request_ids:
                engine.abort(request_id)
            raise

    def chat(
        self,
        messages: list[dict[str, str]] | list[list[dict[str, str]]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = False,
    ) -> list[RequestOutput]:
        """Generate replies to conversations rendered with the model's chat template."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [
            {"prompt_token_ids": self.llm_engine.apply_chat_template(conv)}  # type: ignore[arg-type]
            for conv in conversations
        ]
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    # -- pooling (docs/pooling.md) -------------------------------------------------------------

    def encode(
        self,
        prompts: Prompt | Sequence[Prompt],
        pooling_params: PoolingParams | Sequence[PoolingParams] | None = None,
        use_tqdm: bool = False,
        truncate_prompt_tokens: int | None = None,
    ) -> list[PoolingRequestOutput]:
        """Pool every prompt (prefill only); outputs in the order of `prompts`. The task is the
        params' (embed unless they say otherwise); `truncate_prompt_tokens` sets theirs where
        they have none."""
        prompt_list: list[Prompt]
        if isinstance(prompts, (str, dict)) or (
            isinstance(prompts, Sequence) and prompts and isinstance(prompts[0], int)
        ):
            prompt_list = [cast(Prompt, prompts)]  # one prompt: text, a dict or token ids
        else:
            prompt_list = list(cast(Sequence[Prompt], prompts))
        if pooling_params is None or isinstance(pooling_params, PoolingParams):
            params_list = [pooling_params or PoolingParams()] * len(prompt_list)
        else:
            params_list = list(pooling_params)
            if len(params_list) != len(prompt_list):
                raise ValueError(f"{len(params_list)} pooling params for {len(prompt_list)} prompts")
        if truncate_prompt_tokens is not None:
            params_list = [
                p
                if p.truncate_prompt_tokens is not None
                else dataclasses.replace(p, truncate_prompt_tokens=truncate_prompt_tokens)
                for p in params_list
            ]
        engine = self.llm_engine
        request_ids: list[str] = []
        try:
            for prompt, params in zip(prompt_list, params_list, strict=True):
                self._counter += 1
                request_ids.append(engine.add_request(f"pool-{self._counter}", prompt, params))
            outputs = self._run(request_ids, use_tqdm)
        except BaseException:
            for request_id in request_ids:
                engine.abort(request_id)
            raise
        assert all(isinstance(o, PoolingRequestOutput) for o in outputs)
        return outputs  # type: ignore[return-value]  # checked above

    def _encode_task(
        self,
        task: str,
        prompts: Prompt | Sequence[Prompt],
        pooling_params: PoolingParams | None,
        use_tqdm: bool,
        truncate_prompt_tokens: int | None,
    ) -> list[PoolingRequestOutput]:
        params = pooling_params if pooling_params is not None else PoolingParams(task=task)  # type: ignore[arg-type]
        if params.task != task:
            params = dataclasses.replace(params, task=task)  # type: ignore[arg-type]
        return self.encode(prompts, params, use_tqdm, truncate_prompt_tokens)

    def embed(
        self,
        prompts: Prompt | Sequence[Prompt],
        pooling_params: PoolingParams | None = None,
        truncate_prompt_tokens: int | None = None,
        use_tqdm: bool = False,
    ) -> list[EmbeddingRequestOutput]:
        """One embedding per prompt (`.outputs.embedding`), as vLLM's LLM.embed."""
        return [
            EmbeddingRequestOutput(o.request_id, o.prompt_token_ids, EmbeddingOutput(o.outputs.data.tolist()))
            for o in self._encode_task("embed", prompts, pooling_params, use_tqdm, truncate_prompt_tokens)
        ]

    def classify(
        self,
        prompts: Prompt | Sequence[Prompt],
        pooling_params: PoolingParams | None = None,
        truncate_prompt_tokens: int | None = None,
        use_tqdm: bool = False,
    ) -> list[ClassificationRequestOutput]:
        """Class probabilities per prompt (`.outputs.probs`; logits with use_activation=False)."""
        return [
            ClassificationRequestOutput(
                o.request_id, o.prompt_token_ids, ClassificationOutput(o.outputs.data.tolist())
            )
            for o in self._encode_task("classify", prompts, pooling_params, use_tqdm, truncate_prompt_tokens)
        ]

    def score(
        self,
        data_1: str | Sequence[str],
        data_2: str | Sequence[str],
        pooling_params: PoolingParams | None = None,
        truncate_prompt_tokens: int | None = None,
        use_tqdm: bool = False,
    ) -> list[ScoringRequestOutput]:
        """One relevance score per (query, document) pair (`.outputs.score`), as vLLM's LLM.score:
        one query against each document, or the two lists pairwise."""
        queries = [data_1] if isinstance(data_1, str) else list(data_1)
        documents = [data_2] if isinstance(data_2, str) else list(data_2)
        if len(queries) == 1:
            queries = queries * len(documents)
        if len(queries) != len(documents) or not documents:
            raise ValueError(
                f"score takes 1 or {len(documents)} queries for {len(documents)} documents, "
                f"got {len(queries)}"
            )
        engine = self.llm_engine
        prompts = [
            {"prompt_token_ids": engine.score_prompt(q, d)} for q, d in zip(queries, documents, strict=True)
        ]
        return [
            ScoringRequestOutput(o.request_id, o.prompt_token_ids, ScoringOutput(float(o.outputs.data[0])))
            for o in self._encode_task("score", prompts, pooling_params, use_tqdm, truncate_prompt_tokens)
        ]

    def _run(self, request_ids: list[str], use_tqdm: bool) -> list[Any]:
        engine = self.llm_engine
        pending = set(request_ids)
        finished: dict[str, Any] = {}
        progress = None
        if use_tqdm:
            from tqdm.auto import tqdm

            progress = tqdm(total=len(request_ids), desc="Processed prompts", dynamic_ncols=True)
        try:
            while pending:
                for step_output in engine.step():
                    if step_output.finished and step_output.request_id in pending:
                        assert step_output.output is not None
                        finished[step_output.request_id] = step_output.output
                        pending.discard(step_output.request_id)
                        if progress is not None:
                            progress.update(1)
        finally:
            if progress is not None:
                progress.close()
        return [finished[request_id] for request_id in request_ids]
