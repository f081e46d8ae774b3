from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from qworker.config import EngineConfig
from qworker.engine.llm_engine import LLMEngine, Prompt
from qworker.engine.outputs import RequestOutput
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

    def _run(self, request_ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        engine = self.llm_engine
        pending = set(request_ids)
        finished: dict[str, RequestOutput] = {}
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
