"""The int8 (W8A8) engine on the tiny Llama: the same greedy tokens as itself in one batch under
chunked prefill, preemption and prefix caching; prompt logprobs within a documented bound of
fp32's; a compressed-tensors W8A8 file (written by compressed-tensors itself) holding the integers
and scales that quantize-at-load computes, and running to the same tokens; other schemes refused
at load in one line."""

from __future__ import annotations

import copy
import random

import pytest
import torch

from qworker.engine.sampling_params import SamplingParams
from qworker.errors import CheckpointError, InvalidConfigError
from qworker.quantization.int8_linear import Int8Linear, has_onednn_int8, quantize_weight
from qworker.testing.tiny_model import tiny_llama_model
from tests.conftest import run_to_completion, tiny_engine

pytestmark = [
    pytest.mark.timeout(120),
    pytest.mark.skipif(not has_onednn_int8(), reason="this torch has no oneDNN int8 matmul"),
]

MAX_TOKENS = 12
# |int8 - fp32| of a prompt token's logprob on the tiny model (widen=4), teacher-forced on the
# 40-token prompt: measured 0.044 at most (0.12 on another 40-token prompt), with the AVX2 EPYC's
# 7-bit activations; 8-bit activations (VNNI, AMX, CUDA) halve the activation step.
LOGPROB_BOUND = 0.3


def prompts() -> list[list[int]]:
    rng = random.Random(0)
    return [[rng.randrange(3, 256) for _ in range(n)] for n in (1, 3, 4, 5, 17, 40)]


def generate(engine, prompt_list) -> list[list[int]]:
    sp = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    ids = [engine.add_request(f"r{i}", {"prompt_token_ids": p}, sp) for i, p in enumerate(prompt_list)]
    outs = run_to_completion(engine)
    return [outs[i].outputs[0].token_ids for i in ids]


@pytest.fixture(scope="module")
def hf_model():
    # Widened: random init's near-uniform logits make greedy picks near-ties.
    return tiny_llama_model(widen=4.0)


@pytest.fixture(scope="module")
def int8_tokens(hf_model) -> list[list[int]]:
    return generate(tiny_engine(hf_model, quantization="int8"), prompts())


@pytest.fixture(scope="module")
def w8a8_dir(hf_model, tmp_path_factory):
    """The tiny model written as a compressed-tensors W8A8 checkpoint by compressed-tensors: min-max
    weight scales (compressed-tensors' calculate_qparams, as llmcompressor's W8A8 without
    calibration), format int-quantized, lm_head ignored."""
    ct = pytest.importorskip("compressed_tensors")
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import (
        QuantizationConfig,
        QuantizationScheme,
        apply_quantization_config,
    )
    from compressed_tensors.quantization.quant_scheme import PRESET_SCHEMES
    from compressed_tensors.quantization.utils import calculate_qparams

    model = copy.deepcopy(hf_model)
    scheme = QuantizationScheme(targets=["Linear"], **PRESET_SCHEMES["W8A8"])
    apply_quantization_config(
        model, QuantizationConfig(config_groups={"group_0": scheme}, ignore=["lm_head"])
    )
    for module in model.modules():
        if getattr(module, "quantization_scheme", None) is None:
            continue
        weight = module.weight.data
        scale, zero_point = calculate_qparams(
            weight.amin(1, keepdim=True), weight.amax(1, keepdim=True), module.quantization_scheme.weights
        )
        module.weight_scale.data.copy_(scale)
        module.weight_zero_point.data.copy_(zero_point)
    compressor = ModelCompressor.from_pretrained_model(model, quantization_format="int-quantized")
    compressor.compress_model(model)
    path = tmp_path_factory.mktemp("w8a8")
    model.save_pretrained(path)
    compressor.update_config(str(path))
    assert ct.__version__
    return path


def w8a8_engine(path, **engine_args):
    from transformers import AutoConfig

    from qworker.config import EngineConfig
    from qworker.engine.llm_engine import LLMEngine
    from qworker.model.loader import load_state_dict

    args = dict(model=str(path), dtype="float32", device="cpu", num_kv_blocks=64, block_size=4, **engine_args)
    return LLMEngine(
        EngineConfig(**args),
        hf_config=AutoConfig.from_pretrained(path),
        state_dict=load_state_dict(path),
        tokenizer=None,
    )


@pytest.mark.parametrize(
    "engine_args",
    [{"max_num_batched_tokens": 3}, {"num_kv_blocks": 16, "block_size": 4}],
    ids=["chunked-prefill", "preemption"],
)
def test_int8_gives_its_own_tokens_whatever_the_schedule(hf_model, int8_tokens, engine_args) -> None:
    engine = tiny_engine(hf_model, quantization="int8", **engine_args)
    assert generate(engine, prompts()) == int8_tokens
    if "num_kv_blocks" in engine_args:
        assert engine.scheduler.num_preemptions > 0


def test_int8_with_prefix_cache_hits(hf_model, int8_tokens) -> None:
    engine = tiny_engine(hf_model, quantization="int8", enable_prefix_caching=True)
    assert generate(engine, prompts()) == int8_tokens
    assert generate(engine, prompts()) == int8_tokens
    assert engine.kv_stats().num_prefix_cache_hits > 0


def test_int8_with_batch_invariant_is_bit_stable_across_batches(hf_model) -> None:
    # The int8 layers are invariant by construction (per-row scales, exact int32 sums); the rest
    # of the model takes the batch-invariant kernels as usual.
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=2)

    def run(engine, prompt_list):
        ids = [
            engine.add_request(f"r{i}", {"prompt_token_ids": p}, params) for i, p in enumerate(prompt_list)
        ]
        outs = run_to_completion(engine)
        completion = outs[ids[-1]].outputs[0]
        return completion.token_ids, [{t: e.logprob for t, e in d.items()} for d in completion.logprobs]

    alone = run(tiny_engine(hf_model, quantization="int8", batch_invariant=True), prompts()[-1:])
    engine = tiny_engine(hf_model, quantization="int8", batch_invariant=True, max_num_batched_tokens=5)
    assert isinstance(engine.runner.model.layers[0].self_attn.qkv_proj, Int8Linear)
    assert run(engine, prompts()) == alone


def test_int8_logprobs_are_close_to_fp32s(hf_model) -> None:
    prompt = prompts()[-1]
    params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0)
    logprobs = {}
    for name, args in (("fp32", {}), ("int8", {"quantization": "int8"})):
        engine = tiny_engine(hf_model, **args)
        engine.add_request("r", {"prompt_token_ids": prompt}, params)
        entries = run_to_completion(engine)["r"].prompt_logprobs
        logprobs[name] = torch.tensor([entries[i][prompt[i]].logprob for i in range(1, len(prompt))])
    difference = (logprobs["int8"] - logprobs["fp32"]).abs()
    assert 0 < difference.max() <= LOGPROB_BOUND, difference.max()


def test_a_compressed_tensors_file_holds_what_quantize_at_load_computes(
    hf_model, w8a8_dir, int8_tokens
) -> None:
    from safetensors.torch import load_file

    tensors = load_file(str(w8a8_dir / "model.safetensors"))
    original = hf_model.state_dict()
    quantized = [n[: -len(".weight_scale")] for n in tensors if n.endswith(".weight_scale")]
    assert len(quantized) == 7 * 2 and not any("lm_head" in n for n in quantized)
    for name in quantized:
        weight_int8, scale = quantize_weight(original[name + ".weight"])
        assert torch.equal(tensors[name + ".weight"], weight_int8), name
        assert torch.equal(tensors[name + ".weight_scale"].reshape(-1), scale), name
    assert tensors["lm_head.weight"].dtype == torch.float32

    # Read without the option (the file says W8A8), fused as the decoder fuses.
    engine = w8a8_engine(w8a8_dir)
    assert engine.quantization == "int8"
    qkv = engine.runner.model.layers[0].self_attn.qkv_proj
    assert isinstance(qkv, Int8Linear)
    parts = [f"model.layers.0.self_attn.{p}_proj" for p in "qkv"]
    assert torch.equal(qkv.weight, torch.cat([tensors[p + ".weight"] for p in parts]))
    assert torch.equal(qkv.weight_scale, torch.cat([tensors[p + ".weight_scale"].reshape(-1) for p in parts]))
    assert isinstance(engine.runner.model.layers[1].mlp.gate_up_proj, Int8Linear)
    assert (
        engine.runner.model.lm_head is not None and engine.runner.model.lm_head.weight.dtype == torch.float32
    )
    # The same integers and scales: the same tokens as quantizing the float checkpoint at load.
    assert generate(engine, prompts()) == int8_tokens


def _group(weights: dict, inputs: dict | None = None) -> dict:
    return {"g": {"targets": ["Linear"], "weights": weights, "input_activations": inputs}}


INT4_GROUPS = {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": 128}
FP8_CHANNEL = {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "channel", "dynamic": False}
FP8_TOKEN = {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "token", "dynamic": True}
UNSUPPORTED = {
    "awq": {"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True},
    "gptq": {"quant_method": "gptq", "bits": 4, "group_size": 128},
    "unknown": {"quant_method": "mystery"},
    "w4a16": {
        "quant_method": "compressed-tensors", "format": "pack-quantized",
        "config_groups": _group(INT4_GROUPS),
    },
    "fp8": {
        "quant_method": "compressed-tensors", "format": "float-quantized",
        "config_groups": _group(FP8_CHANNEL, FP8_TOKEN),
    },
}  # fmt: skip


@pytest.mark.parametrize("name", sorted(UNSUPPORTED))
def test_other_schemes_are_refused_at_load_in_one_line(hf_model, name) -> None:
    config = copy.deepcopy(hf_model.config)
    config.quantization_config = UNSUPPORTED[name]
    from qworker.config import EngineConfig
    from qworker.engine.llm_engine import LLMEngine

    with pytest.raises(CheckpointError, match="compressed-tensors W8A8 int8") as err:
        LLMEngine(EngineConfig(model="tiny", device="cpu", num_kv_blocks=8), hf_config=config, state_dict={})
    assert "\n" not in str(err.value)


def test_lora_over_int8_is_refused(hf_model) -> None:
    with pytest.raises(InvalidConfigError, match="enable_lora with quantization=int8 is not supported"):
        tiny_engine(hf_model, quantization="int8", enable_lora=True)
