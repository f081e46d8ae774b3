"""The engine on the Triton backend (attention, KV write, RMSNorm, rotary, SiLU-and-mul kernels)
gives the same greedy tokens as on the torch backend, on a tiny random Llama.

Without a GPU the engine runs on the CPU and the kernels under TRITON_INTERPRET=1 (set by
conftest.py before any kernel is imported), where every program is numpy code: the model and the
prompts are kept tiny. With a GPU the same tests run the engine on CUDA, CUDA graphs included.
"""

import random

import pytest
import torch

from qworker.engine.sampling_params import SamplingParams
from qworker.model.tiny_families import WINDOW, tiny_family_model
from tests.conftest import hf_greedy, run_to_completion, tiny_engine, tiny_hf_model

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = pytest.mark.timeout(240)

# 4 tokens: 3 decode steps after the prefill, enough for the padded batch to shrink from 4 to 3.
MAX_TOKENS = 4
# qworker.testing.tiny_model.TINY_LLAMA (head_dim 16, GQA 2: the smallest shapes the kernels take), with an
# MLP width that is not a power of two.
MODEL_ARGS = dict(intermediate_size=96)


def prompts() -> list[list[int]]:
    rng = random.Random(1)
    # A single token, less than a block, more than two blocks of 4, and several blocks.
    return [[rng.randrange(3, 256) for _ in range(length)] for length in (1, 5, 9, 23)]


def generate(engine, order: tuple[int, ...] = (0, 1, 2, 3)) -> list[list[int]]:
    """The prompts' greedy tokens, in prompt order; `order` is the order they are added in."""
    sp = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    all_prompts = prompts()
    for i in order:
        engine.add_request(f"r{i}", {"prompt_token_ids": all_prompts[i]}, sp)
    outs = run_to_completion(engine)
    assert engine.kv_stats().num_used_blocks == 0
    return [outs[f"r{i}"].outputs[0].token_ids for i in range(len(all_prompts))]


def engine(model, backend: str, **args):
    return tiny_engine(model, attention_backend=backend, device=DEVICE, **args)


@pytest.fixture(scope="module")
def model():
    return tiny_hf_model("llama", seed=3, **MODEL_ARGS).to(DEVICE)


@pytest.fixture(scope="module")
def torch_tokens(model) -> list[list[int]]:
    tokens = generate(engine(model, "torch"))
    # The torch backend is the one checked against transformers; keep the chain explicit.
    assert tokens == [hf_greedy(model.cpu(), p, MAX_TOKENS) for p in prompts()]
    model.to(DEVICE)
    return tokens


@pytest.mark.parametrize(
    "engine_args",
    # The default engine's run (eager on the CPU, graphs on CUDA) is the one of
    # test_cuda_graphs_switch_off_and_back_on, which runs eagerly and then with the graphs.
    [
        # Chunked prefill: chunks of <= 5 tokens after a cached prefix, mixed with decodes.
        {"max_num_batched_tokens": 5},
        # Block size 16, chunks of 7: a chunk and its prefix straddle a block boundary.
        {"block_size": 16, "max_num_batched_tokens": 7},
    ],
    ids=lambda a: ",".join(f"{k}={v}" for k, v in a.items()) or "default",
)
def test_triton_backend_matches_torch(model, torch_tokens, engine_args) -> None:
    triton_engine = engine(model, "triton", **engine_args)
    assert triton_engine.attention_backend_name == "triton"
    assert triton_engine.runner.model.ops.name == "triton"
    assert generate(triton_engine) == torch_tokens


def test_triton_backend_with_preemption(model, torch_tokens) -> None:
    # 7 blocks of 4 slots: the 23-token prompt, added first, takes 6 and the 1-token one the 7th;
    # the first's 25th position needs an 8th, so the newer one is preempted (and resumed later).
    triton_engine = engine(model, "triton", num_kv_blocks=7, block_size=4)
    assert generate(triton_engine, order=(3, 0, 1, 2)) == torch_tokens
    assert triton_engine.scheduler.num_preemptions > 0


def test_cuda_graphs_switch_off_and_back_on(model, torch_tokens, monkeypatch) -> None:
    """disable_cuda_graphs() makes every step eager; enable_cuda_graphs() brings back the same
    graphs (nothing captured twice), and pure-decode steps then go through DecodeCudaGraphs: 4
    sequences in the graph of 4, then 3 of them padded to 4 once the first finishes. On CUDA the
    engine captures real graphs; on the CPU the same static, padded buffers run eagerly
    (enable_cuda_graphs(allow_cpu=True)). The torch backend has no graphs to enable."""
    triton_engine = engine(model, "triton", max_num_seqs=4)
    runner = triton_engine.runner
    if DEVICE == "cpu":
        assert runner.cuda_graphs is None, "CUDA graphs must stay off on the CPU"
        with pytest.raises(ValueError, match="CUDA device"):
            runner.enable_cuda_graphs()
    graphs = runner.enable_cuda_graphs(allow_cpu=True)
    assert graphs.sizes == [1, 2, 4]
    runner.disable_cuda_graphs()
    assert runner.cuda_graphs is None
    assert generate(triton_engine) == torch_tokens
    assert graphs.num_runs == 0
    assert runner.enable_cuda_graphs(allow_cpu=True) is graphs
    assert runner.cuda_graphs is graphs
    padded_batches: list[tuple[int, int]] = []
    run = graphs.run

    def counting_run(inputs):
        num_seqs = inputs.meta.query_start_loc.shape[0] - 1
        padded_batches.append((num_seqs, graphs.padded_size(num_seqs)))
        return run(inputs)

    monkeypatch.setattr(graphs, "run", counting_run)
    # The 1-token prompt stops one token early: the batch of 4 shrinks to 3, padded to 4.
    ids = [
        triton_engine.add_request(
            f"r{i}",
            {"prompt_token_ids": p},
            SamplingParams(max_tokens=MAX_TOKENS - (i == 0), temperature=0.0, ignore_eos=True),
        )
        for i, p in enumerate(prompts())
    ]
    outs = run_to_completion(triton_engine)
    tokens = [outs[i].outputs[0].token_ids for i in ids]
    expected = [t[: MAX_TOKENS - (i == 0)] for i, t in enumerate(torch_tokens)]
    assert tokens == expected
    assert (4, 4) in padded_batches and (3, 4) in padded_batches, padded_batches
    with pytest.raises(ValueError, match="does not support CUDA graphs"):
        engine(model, "torch").runner.enable_cuda_graphs(allow_cpu=True)


@pytest.mark.parametrize("forced", ["triton", "torch"])
def test_env_var_decides_auto(model, monkeypatch, forced: str) -> None:
    # Only `auto`: an explicit attention_backend wins over the variable (tests/unit/test_envs.py).
    monkeypatch.setenv("QWORKER_ATTENTION_BACKEND", forced)
    forced_engine = engine(model, "auto")
    assert forced_engine.attention_backend_name == forced
    assert forced_engine.runner.backend.name == forced
    # The torch attention backend on the CPU runs the model's other ops in C when the compiled
    # kernels are available ("cpu"), in torch otherwise.
    expected_ops = {"triton"} if forced == "triton" else {"torch", "cpu"}
    assert forced_engine.runner.model.ops.name in expected_ops


@pytest.mark.parametrize(("variable", "requested"), [("torch", "triton"), ("triton", "torch")])
def test_an_explicit_backend_wins_over_the_env_var(model, monkeypatch, variable: str, requested: str) -> None:
    monkeypatch.setenv("QWORKER_ATTENTION_BACKEND", variable)
    assert engine(model, requested).runner.backend.name == requested


def test_auto_picks_by_device(model, monkeypatch) -> None:
    monkeypatch.delenv("QWORKER_ATTENTION_BACKEND", raising=False)
    expected = "triton" if DEVICE == "cuda" else "torch"
    assert engine(model, "auto").attention_backend_name == expected


@pytest.mark.skipif(DEVICE == "cuda", reason="the check is for the CPU without the interpreter")
def test_triton_on_cpu_without_interpreter_is_a_clear_error(model, monkeypatch) -> None:
    monkeypatch.delenv("TRITON_INTERPRET")
    monkeypatch.delenv("QWORKER_ATTENTION_BACKEND", raising=False)
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        engine(model, "triton")


@pytest.fixture(scope="module")
def gemma2():
    """Tiny Gemma 2: windowed (WINDOW keys) and global layers, attention soft-capping, query
    pre-attention scaling, head_dim 48, GQA 4; transformers' greedy tokens for its prompts."""
    model = tiny_family_model("gemma2")
    rng = random.Random(2)
    # Shorter than the window, and one, two and three windows long.
    prompt_list = [[rng.randrange(3, 256) for _ in range(n)] for n in (5, WINDOW + 1, 2 * WINDOW + 3, 23)]
    expected = [hf_greedy(model, p, MAX_TOKENS) for p in prompt_list]
    return model.to(DEVICE), prompt_list, expected


@pytest.mark.parametrize("engine_args", [{}, {"max_num_batched_tokens": 5}], ids=["default", "chunks_of_5"])
def test_windowed_soft_capped_layers_run_in_the_triton_kernels(gemma2, engine_args) -> None:
    model, prompt_list, expected = gemma2
    triton_engine = engine(model, "triton", **engine_args)
    # The kernels take both extras: no torch fallback wraps the backend.
    assert type(triton_engine.runner.backend).__name__ == "TritonAttentionBackend"
    sp = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    ids = [triton_engine.add_request(f"g{i}", {"prompt_token_ids": p}, sp) for i, p in enumerate(prompt_list)]
    outs = run_to_completion(triton_engine)
    assert [outs[i].outputs[0].token_ids for i in ids] == expected
