"""The batch-invariant mode on the Triton path (the CUDA wiring), run by the engine on a tiny random
Llama: every matmul through the invariant Triton matmul, attention through the invariant Triton
attention, the Triton norm/rotary/SiLU ops. A prompt's greedy tokens and top-3 logprobs are the
same bits alone, with the others, and in prefill chunks of 13 tokens with padded decode-graph
batches and a prefix-cache hit.

Without a GPU the engine runs on the CPU and the kernels under TRITON_INTERPRET=1 (set by
conftest.py before any kernel is imported); decode graphs there are the same padded static buffers
run eagerly. With a GPU the same tests run on CUDA, graphs captured.
"""

from __future__ import annotations

import pytest
import torch

from qworker.engine.sampling_params import SamplingParams
from qworker.model.batch_invariant import (
    TritonInvariantWeight,
    make_batch_invariant,
)
from qworker.model.triton_attention import TritonAttentionBackend
from tests.conftest import run_to_completion, tiny_engine, tiny_hf_model

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = pytest.mark.timeout(300)

# Past one 32-key tile of the attention (TILE_N), so that the tile boundaries matter.
PROMPT_LENGTHS = (1, 9, 35, 38)
GREEDY = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True, logprobs=3)


def prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(7)
    # The last two share their first 32 tokens (8 blocks of 4): a prefix-cache hit for the second.
    shared = torch.randint(3, 256, (32,), generator=gen).tolist()
    out = [torch.randint(3, 256, (n,), generator=gen).tolist() for n in PROMPT_LENGTHS]
    out[3] = shared + out[3][32:]
    out[2] = shared + out[2][32:]
    return out


def signatures(engine, indices: list[int]) -> dict[int, tuple]:  # type: ignore[no-untyped-def]
    """Prompt index -> (token ids, per position ((token, logprob bits, rank), ...))."""
    all_prompts = prompts()
    ids = {
        engine.add_request(f"r{i}-{id(engine)}", {"prompt_token_ids": all_prompts[i]}, GREEDY): i
        for i in indices
    }
    outs = run_to_completion(engine)
    result = {}
    for request_id, index in ids.items():
        completion = outs[request_id].outputs[0]
        positions = tuple(
            tuple((token, float(lp.logprob).hex(), lp.rank) for token, lp in entry.items())
            for entry in completion.logprobs or ()
        )
        result[index] = (tuple(completion.token_ids), positions)
    return result


@pytest.fixture(scope="module")
def model():  # type: ignore[no-untyped-def]
    return tiny_hf_model("llama", seed=3, intermediate_size=96)


def invariant_engine(model, dtype: str, **args):  # type: ignore[no-untyped-def]
    return tiny_engine(
        model, attention_backend="triton", device=DEVICE, dtype=dtype, batch_invariant=True, **args
    )


# fp32: every difference in a sum's order shows in the logprobs (bf16 rounding hides most of them;
# the kernel tests cover bf16 row by row).
@pytest.mark.parametrize("dtype", ["float32"])
def test_alone_together_chunked_graphs_and_cache_hits_give_equal_bits(model, dtype: str) -> None:
    engine = invariant_engine(model, dtype)
    runner = engine.runner
    assert isinstance(runner.backend, TritonAttentionBackend)
    assert runner.backend.attention.__name__ == "invariant_paged_attention"
    assert runner.backend.supports_cuda_graphs
    assert isinstance(runner.model.lm_head_packed, TritonInvariantWeight)
    assert runner.model.ops.name == "triton"
    everything = list(range(len(PROMPT_LENGTHS)))
    together = signatures(engine, everything)
    # One engine for the rest (prompt 2 run there alone is the "alone" run): prefill chunks of 13
    # tokens (chunk, 8-token query-block and 32-key tile boundaries fall in different places),
    # pure-decode steps through the padded graph buffers (sizes 1, 2, 4: 3 sequences run padded
    # to 4), and prefix caching: prompt 2 first, then prompt 3 reads their shared 32 tokens from
    # the cache.
    other = invariant_engine(
        model, dtype, max_num_batched_tokens=13, max_num_seqs=4, enable_prefix_caching=True
    )
    if DEVICE == "cpu":
        other.runner.enable_cuda_graphs(allow_cpu=True)
    graphs = other.runner.cuda_graphs
    assert graphs is not None
    assert signatures(other, [2]) == {2: together[2]}
    assert other.kv_stats().num_prefix_cache_hits == 0
    assert signatures(other, [0, 1, 3]) == {i: together[i] for i in (0, 1, 3)}
    assert other.kv_stats().num_prefix_cache_hits >= 32
    assert graphs.num_runs > 0


def test_cuda_with_the_torch_backend_is_refused(model) -> None:
    # The torch ops and attention are not checked to be batch-invariant on CUDA: a clear error, not
    # a silent non-invariant run (the model is not moved; the check comes first).
    torch_model = tiny_engine(model, attention_backend="torch").runner.model
    with pytest.raises(ValueError, match="Triton attention backend"):
        make_batch_invariant(torch_model, torch.device("cuda"))


def test_moe_runs_its_experts_through_the_invariant_matmul_without_graphs() -> None:
    # The fused-MoE kernel tiles by the token count: the mode takes the per-expert path, whose
    # host-side expert counts rule out graph capture.
    from qworker.model.moe import SparseMoe
    from qworker.model.tiny_families import tiny_family_model

    engine = tiny_engine(
        tiny_family_model("qwen3_moe", seed=1),
        attention_backend="triton",
        device=DEVICE,
        batch_invariant=True,
    )
    assert not engine.runner.backend.supports_cuda_graphs
    assert engine.runner.cuda_graphs is None
    moes = [m for m in engine.runner.model.modules() if isinstance(m, SparseMoe)]
    assert moes and all(m._fused_moe is None and m._is_fused_moe_looked_up for m in moes)
    assert all(isinstance(w, TritonInvariantWeight) for m in moes for part in m.experts.packed for w in part)
    params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True, logprobs=2)
    prompts = [list(range(3, 37)), [7, 8, 9]]

    def run(indices: list[int]) -> list[tuple]:
        ids = [
            engine.add_request(f"m{len(indices)}-{i}", {"prompt_token_ids": prompts[i]}, params)
            for i in indices
        ]
        outs = run_to_completion(engine)
        return [
            (
                outs[r].outputs[0].token_ids,
                [[(t, lp.logprob) for t, lp in e.items()] for e in outs[r].outputs[0].logprobs],
            )
            for r in ids
        ]

    # Together, the 34-token prompt and the 3-token one are 37 rows: two 32-row matmul tiles, as
    # the 34 rows alone; the together run's first request must be the alone run's bits.
    together = run([0, 1])
    assert len(together) == 2 and together[:1] == run([0])
