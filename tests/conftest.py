from __future__ import annotations

import os

import pytest
import torch

from qworker.testing.tiny_model import tiny_llama_model

# `make test` runs the suite in two pytest-xdist processes, one per core: each computes on one
# thread, as two torch pools of two threads each would oversubscribe the cores.
if os.environ.get("PYTEST_XDIST_WORKER"):
    torch.set_num_threads(1)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Files with slow tests first, each file's tests in their order: the two processes take
    whole files in this order, so the quick files fill the end of the run instead of one process
    idling while the other finishes a long file."""
    slow_files = {item.path for item in items if item.get_closest_marker("slow") is not None}
    items.sort(key=lambda item: item.path not in slow_files)


def tiny_hf_model(model_type: str = "llama", seed: int = 0, **overrides):
    """qworker.testing.tiny_model's tiny random model, widened, in fp32, for fast engine tests."""
    # Random init gives near-uniform logits; widened, greedy picks are not near-ties.
    return tiny_llama_model(model_type, seed=seed, widen=3.0, **overrides)


def tiny_engine(hf_model, **engine_args):
    from qworker.config import EngineConfig
    from qworker.engine.llm_engine import LLMEngine

    args = dict(model="tiny", dtype="float32", device="cpu", num_kv_blocks=64, block_size=4)
    args.update(engine_args)
    return LLMEngine(
        EngineConfig(**args), hf_config=hf_model.config, state_dict=hf_model.state_dict(), tokenizer=None
    )


def hf_greedy(hf_model, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    with torch.no_grad():
        out = hf_model.generate(
            torch.tensor([prompt_ids]),
            attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long),
            max_new_tokens=max_new_tokens,
            min_new_tokens=max_new_tokens,
            do_sample=False,
            pad_token_id=0,
        )
    return out[0, len(prompt_ids) :].tolist()


def run_to_completion(engine) -> dict[str, object]:
    outputs = {}
    for _ in range(100_000):
        if not engine.has_unfinished_requests():
            return outputs
        for step_output in engine.step():
            if step_output.finished:
                outputs[step_output.request_id] = step_output.output
    raise AssertionError("engine did not finish")


def run_with_staggered_arrivals(
    engine, prompts: list[list[int]], params, steps_between: int
) -> list[list[int]]:
    """Add one prompt, run `steps_between` steps, add the next, ... then run to the end: requests
    join while others decode. Returns each prompt's output token ids, in prompt order."""
    outputs: dict[str, list[int]] = {}
    pending = list(enumerate(prompts))
    while pending or engine.has_unfinished_requests():
        if pending:
            i, prompt = pending.pop(0)
            engine.add_request(f"r{i}", {"prompt_token_ids": prompt}, params)
        for _ in range(steps_between):
            for step_output in engine.step():
                if step_output.finished:
                    outputs[step_output.request_id] = step_output.output.outputs[0].token_ids
    return [outputs[f"r{i}"] for i in range(len(prompts))]


@pytest.fixture(scope="session")
def tiny_llama():
    return tiny_hf_model("llama")
