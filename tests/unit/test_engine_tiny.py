"""Engine parity with transformers on tiny random Llama-family models (fast, CPU, float32)."""

from __future__ import annotations

import random

import pytest
import torch

from qworker.engine.sampling_params import SamplingParams
from qworker.errors import InvalidParamsError, InvalidRequestError, PromptTooLongError
from tests.conftest import (
    hf_greedy,
    run_to_completion,
    run_with_staggered_arrivals,
    tiny_engine,
    tiny_hf_model,
)

pytestmark = pytest.mark.timeout(180)

MAX_TOKENS = 12


def prompts(seed: int = 0, n: int = 6, vocab: int = 256) -> list[list[int]]:
    rng = random.Random(seed)
    lengths = [1, 3, 4, 5, 17, 40][:n]
    return [[rng.randrange(3, vocab) for _ in range(length)] for length in lengths]


@pytest.fixture(scope="module")
def references(tiny_llama) -> list[list[int]]:
    return [hf_greedy(tiny_llama, p, MAX_TOKENS) for p in prompts()]


def generate(engine, prompt_list, max_tokens=MAX_TOKENS, **params) -> list[list[int]]:
    sp = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, **params)
    ids = [engine.add_request(f"r{i}", {"prompt_token_ids": p}, sp) for i, p in enumerate(prompt_list)]
    outs = run_to_completion(engine)
    return [outs[i].outputs[0].token_ids for i in ids]


@pytest.mark.parametrize(
    "engine_args",
    [
        {},
        {"max_num_batched_tokens": 3},
        {"block_size": 1},
        {"block_size": 16},
        {"block_size": 32, "max_num_batched_tokens": 7},
        {"enable_chunked_prefill": False, "max_num_batched_tokens": 64},
        {"max_num_seqs": 2},
    ],
    ids=lambda a: ",".join(f"{k}={v}" for k, v in a.items()) or "default",
)
def test_greedy_matches_transformers(tiny_llama, references, engine_args) -> None:
    engine = tiny_engine(tiny_llama, **engine_args)
    assert generate(engine, prompts()) == references
    assert engine.kv_stats().num_used_blocks == 0


def test_torch_decode_fallback_matches_transformers(tiny_llama, references, monkeypatch) -> None:
    # Without the C kernel, decodes go through qworker_kernels' gather + SDPA fallback (the path
    # the torch backend also takes on CUDA and in fp16).
    monkeypatch.setenv("QWORKER_DISABLE_CPU_KERNEL", "1")
    engine = tiny_engine(tiny_llama, max_num_batched_tokens=7)
    assert engine.runner.backend._decode_kernel is None
    assert generate(engine, prompts()) == references


def test_preemption_gives_the_same_tokens(tiny_llama, references) -> None:
    # 16 blocks of 4 slots: the 40-token prompt alone takes 13 of them while it grows.
    engine = tiny_engine(tiny_llama, num_kv_blocks=16, block_size=4)
    assert generate(engine, prompts()) == references
    assert engine.scheduler.num_preemptions > 0


def test_requests_join_mid_decode(tiny_llama, references) -> None:
    engine = tiny_engine(tiny_llama, max_num_batched_tokens=8)
    sp = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    assert run_with_staggered_arrivals(engine, prompts(), sp, steps_between=3) == references


@pytest.mark.parametrize(
    "model_type,overrides",
    [
        ("qwen2", {}),  # qkv bias
        ("mistral", {"sliding_window": None}),
        ("llama", {"tie_word_embeddings": True, "num_key_value_heads": 4}),
        (
            "llama",
            {
                "num_key_value_heads": 1,
                "rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0},
            },
        ),
        (
            "llama",
            {
                "rope_parameters": {
                    "rope_type": "llama3",
                    "factor": 8.0,
                    "low_freq_factor": 1.0,
                    "high_freq_factor": 4.0,
                    "original_max_position_embeddings": 64,
                    "rope_theta": 500000.0,
                }
            },
        ),
    ],
    ids=["qwen2-bias", "mistral", "tied-mha", "rope-linear-mqa", "rope-llama3"],
)
def test_model_families(model_type, overrides) -> None:
    hf = tiny_hf_model(model_type, seed=1, **overrides)
    expected = [hf_greedy(hf, p, MAX_TOKENS) for p in prompts(seed=1)]
    engine = tiny_engine(hf, max_num_batched_tokens=16)
    assert generate(engine, prompts(seed=1)) == expected


def test_seed_is_independent_of_batch(tiny_llama) -> None:
    sp = SamplingParams(max_tokens=10, temperature=1.0, top_p=0.9, top_k=50, seed=1234, ignore_eos=True)
    alone = tiny_engine(tiny_llama)
    alone.add_request("x", {"prompt_token_ids": [5, 6, 7]}, sp)
    expected = run_to_completion(alone)["x"].outputs[0].token_ids
    crowded = tiny_engine(tiny_llama)
    for i, p in enumerate(prompts()):
        crowded.add_request(f"o{i}", {"prompt_token_ids": p}, SamplingParams(max_tokens=10, temperature=1.0))
    crowded.add_request("x", {"prompt_token_ids": [5, 6, 7]}, sp)
    assert run_to_completion(crowded)["x"].outputs[0].token_ids == expected


def test_stop_token_ids_min_tokens_and_max_tokens(tiny_llama, references) -> None:
    reference = references[4]
    stop_token = reference[3]
    first = reference.index(stop_token)
    engine = tiny_engine(tiny_llama)
    engine.add_request(
        "s",
        {"prompt_token_ids": prompts()[4]},
        SamplingParams(max_tokens=MAX_TOKENS, temperature=0, stop_token_ids=[stop_token]),
    )
    engine.add_request(
        "m", {"prompt_token_ids": prompts()[4]}, SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)
    )
    outs = run_to_completion(engine)
    assert outs["s"].outputs[0].token_ids == reference[: first + 1]
    assert outs["s"].outputs[0].finish_reason == "stop"
    assert outs["s"].outputs[0].stop_reason == stop_token
    assert outs["m"].outputs[0].token_ids == reference[:5]
    assert outs["m"].outputs[0].finish_reason == "length"


def test_eos_stops_unless_ignored(tiny_llama) -> None:
    engine = tiny_engine(tiny_llama)
    # Make EOS the greedy pick by biasing its logit through the final norm's output: simplest is
    # to ask for eos as a stop token id; real EOS handling is covered on SmolLM2.
    eos = 2
    engine.eos_token_ids = {eos}
    logits_bias = torch.zeros(256)
    logits_bias[eos] = 1e4
    original = engine.runner.model.compute_logits
    engine.runner.model.compute_logits = lambda h: original(h) + logits_bias  # type: ignore[method-assign]
    engine.add_request("stop", [5, 6], SamplingParams(max_tokens=6, temperature=0))
    engine.add_request("min", [5, 6], SamplingParams(max_tokens=6, min_tokens=3, temperature=0))
    engine.add_request("ignore", [5, 6], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    outs = run_to_completion(engine)
    assert outs["stop"].outputs[0].token_ids == [eos]
    assert outs["stop"].outputs[0].finish_reason == "stop"
    min_ids = outs["min"].outputs[0].token_ids
    assert len(min_ids) == 4 and min_ids[-1] == eos and eos not in min_ids[:3]
    assert outs["ignore"].outputs[0].token_ids == [eos] * 4


def test_abort_frees_blocks_and_others_keep_running(tiny_llama, references) -> None:
    engine = tiny_engine(tiny_llama)
    sp = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    for i, p in enumerate(prompts()):
        engine.add_request(f"r{i}", {"prompt_token_ids": p}, sp)
    engine.step()
    engine.step()
    used_before = engine.kv_stats().num_used_blocks
    aborted = engine.abort("r5")
    assert aborted is not None and aborted.outputs[0].finish_reason == "abort"
    assert engine.kv_stats().num_used_blocks < used_before
    outs = run_to_completion(engine)
    assert [outs[f"r{i}"].outputs[0].token_ids for i in range(5)] == references[:5]
    assert engine.kv_stats().num_used_blocks == 0


@pytest.mark.parametrize(
    "prompt,params,error,match",
    [
        ({"prompt_token_ids": []}, {}, InvalidRequestError, "empty"),
        ("", {}, InvalidRequestError, "empty"),
        ({"prompt_token_ids": [5] * 600}, {}, PromptTooLongError, "context"),
        ({"prompt_token_ids": [5, 300]}, {}, InvalidRequestError, "outside the vocabulary"),
        ({"prompt_token_ids": [5, -1]}, {}, InvalidRequestError, "outside the vocabulary"),
    ],
)
def test_bad_prompts_raise_typed_errors(tiny_llama, references, prompt, params, error, match) -> None:
    engine = tiny_engine(tiny_llama)
    engine.add_request(
        "good",
        {"prompt_token_ids": prompts()[2]},
        SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True),
    )
    with pytest.raises(error, match=match):
        engine.add_request("bad", prompt, SamplingParams(**params))
    # The engine keeps serving the good request.
    assert run_to_completion(engine)["good"].outputs[0].token_ids == references[2]


def test_prompt_larger_than_the_kv_pool_is_rejected(tiny_llama) -> None:
    engine = tiny_engine(tiny_llama, num_kv_blocks=4, block_size=4)
    with pytest.raises(PromptTooLongError, match="KV blocks"):
        engine.add_request("big", [5] * 20)


@pytest.mark.parametrize(
    "params,match",
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": -3}, "max_tokens"),
        ({"max_tokens": 10**9}, "max_tokens"),
        ({"temperature": -0.5}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -5}, "top_k"),
        ({"min_p": 2.0}, "min_p"),
        ({"min_tokens": 5, "max_tokens": 2}, "min_tokens"),
        ({"stop": [""]}, "stop"),
        ({"seed": "abc"}, "seed"),
    ],
)
def test_bad_sampling_params(params, match) -> None:
    with pytest.raises(InvalidParamsError, match=match):
        SamplingParams(**params)


def test_runner_sizes_the_kv_pool_from_memory(tiny_llama) -> None:
    # A block holds k and v for 2 layers x 4 slots x 2 KV heads x head_dim 16, fp32: 2048 bytes.
    engine = tiny_engine(tiny_llama, num_kv_blocks=None, kv_cache_memory_bytes=100 * 2048)
    assert engine.num_kv_blocks == engine.kv_stats().num_total_blocks == 100
    k_cache, v_cache = engine.runner.kv_caches[0]
    # One block past the pool: the padding block of CUDA-graph decode batches.
    assert k_cache.shape == v_cache.shape == (101, 4, 2, 16)
    assert engine.runner.padding_block_id == 100
    # Never more than every sequence at full length needs: 2 x 512 / 4 blocks.
    # 4 MiB: eight times what the cap needs, and within what any machine has free (a GiB was not,
    # on a loaded CI machine).
    capped = tiny_engine(tiny_llama, num_kv_blocks=None, kv_cache_memory_bytes=4 * 2**20, max_num_seqs=2)
    assert capped.num_kv_blocks == 256


def test_runner_owns_device_and_dtype(tiny_llama) -> None:
    engine = tiny_engine(tiny_llama)
    runner = engine.runner
    assert (
        (engine.device, engine.dtype) == (runner.device, runner.dtype) == (torch.device("cpu"), torch.float32)
    )
    assert next(runner.model.parameters()).dtype == torch.float32
    assert runner.cuda_graphs is None
    with pytest.raises(ValueError, match="does not support CUDA graphs"):
        runner.enable_cuda_graphs(allow_cpu=True)
    runner.disable_cuda_graphs()
    assert runner.cuda_graphs is None
