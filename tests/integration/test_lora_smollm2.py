"""LoRA adapters on the real SmolLM2-135M-Instruct, token-exact in fp32 against peft's unmerged
PeftModel (greedy): two adapters made with peft (every projection at rank 16; q/v at rank 8 with
rsLoRA) and the base model, mixed in one batch with prefix caching on, the chat prompt under each
(no block shared across adapters), prefill chunks of 24 tokens."""

from __future__ import annotations

from typing import Any

import pytest

from qworker.config import EngineConfig
from qworker.engine.llm_engine import LLMEngine
from qworker.engine.sampling_params import SamplingParams
from tests.conftest import run_to_completion
from tests.lora_support import ALL_LINEAR, lora_request, make_adapter, peft_greedy

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

MAX_TOKENS = 8
PARAMS = SamplingParams(max_tokens=MAX_TOKENS, min_tokens=MAX_TOKENS, temperature=0.0)
ADAPTERS = [
    dict(r=16, lora_alpha=32, target_modules=ALL_LINEAR),
    dict(r=8, lora_alpha=8, target_modules=["q_proj", "v_proj"], use_rslora=True),
]


@pytest.fixture(scope="module")
def smollm2(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    import torch
    from transformers import AutoModelForCausalLM

    from qworker.model.loader import load_state_dict, load_tokenizer, resolve_model

    path = resolve_model("smollm2").path
    base = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    tokenizer = load_tokenizer(path)
    root = tmp_path_factory.mktemp("lora-smollm2")
    dirs = [make_adapter(base, root / f"a{i}", seed=20 + i, widen=1.0, **c) for i, c in enumerate(ADAPTERS)]
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Name three rivers of Europe and say which sea each reaches."}],
        add_generation_prompt=True,
        tokenize=False,
    )
    chat = tokenizer(text, add_special_tokens=False).input_ids
    prompts = [chat, tokenizer("The capital of France is").input_ids]
    expected = {None: peft_greedy(base, None, prompts, MAX_TOKENS)}
    for i, d in enumerate(dirs):
        expected[i] = peft_greedy(base, d, prompts, MAX_TOKENS)
        assert expected[i] != expected[None], f"adapter {i} changes nothing: a weak test"
    return dict(
        hf_config=base.config, state_dict=load_state_dict(path), tokenizer=tokenizer,
        dirs=dirs, prompts=prompts, expected=expected,
    )  # fmt: skip


def test_adapters_and_base_mixed_exact(smollm2: dict[str, Any]) -> None:
    config = EngineConfig(
        model="smollm2", dtype="float32", device="cpu", num_kv_blocks=64, max_num_batched_tokens=24,
        enable_lora=True, max_loras=2, enable_prefix_caching=True,
    )  # fmt: skip
    engine = LLMEngine(
        config,
        hf_config=smollm2["hf_config"],
        state_dict=smollm2["state_dict"],
        tokenizer=smollm2["tokenizer"],
    )
    jobs = [(p, a) for p in range(len(smollm2["prompts"])) for a in (0, None, 1)]
    for round_ in range(2):
        for j, (p, a) in enumerate(jobs):
            lora = lora_request(smollm2["dirs"][a], a + 1) if a is not None else None
            engine.add_request(
                f"r{round_}-{j}", {"prompt_token_ids": smollm2["prompts"][p]}, PARAMS, lora_request=lora
            )
        outputs = run_to_completion(engine)
        for j, (p, a) in enumerate(jobs):
            out = outputs[f"r{round_}-{j}"]
            assert out.error is None, out.error
            assert out.outputs[0].token_ids == smollm2["expected"][a][p], (round_, p, a)
            if round_ == 0 and p == 0:
                # The first request of each kind computes the chat prompt: no block from another adapter.
                assert out.num_cached_tokens == 0, (p, a)
    # The second round reads each adapter's own cached prefix of the chat prompt.
    assert engine.kv_stats().num_prefix_cache_hits > 0
