"""Pooling in the engine (issue 40): embeddings, classification and scores against transformers.

On SmolLM2 the reference is sentence-transformers' `encode` with `Pooling(pooling_mode=
"lasttoken" | "mean")`, normalised and not, with its chat-template wrapping off (sentence-
transformers 6 renders plain text through the tokenizer's chat template when the tokenizer has
one; the engine embeds the text as given, so the test checks both tokenize it alike). On the tiny
random models, whose vocabulary no tokenizer matches, it is the same math written out on
transformers' own hidden states: `last_hidden_state` (after the final norm), then the last token,
the mean over every token or the first (CLS), then L2 normalisation where asked. Everything runs
in float32 and must agree within 1e-5 (relative to the reference vector's norm).

Each engine runs its pooling requests together with greedy generation requests in the same
steps, with a small step budget so that long prompts are chunked and short ones packed; the
generated tokens must equal those of the generation requests run alone.
"""

from __future__ import annotations

import random
from typing import Any

import pytest
import torch

from qworker.config import EngineConfig
from qworker.engine.kv_cache_manager import KVCacheManager
from qworker.engine.llm import LLM
from qworker.engine.llm_engine import LLMEngine
from qworker.engine.pooling_params import PoolingParams
from qworker.engine.request import Request
from qworker.engine.sampling_params import SamplingParams
from qworker.engine.scheduler import Scheduler
from qworker.errors import InvalidConfigError, InvalidParamsError, PromptTooLongError, UnsupportedTaskError
from qworker.model.loader import load_hf_config, load_state_dict, load_tokenizer, resolve_model
from qworker.model.pooler import PoolingHead, PoolingSpec
from qworker.model.tiny_families import save_with_tokenizer, tiny_family_model
from qworker.testing.tiny_model import tiny_llama_config, tiny_llama_model
from tests.conftest import run_to_completion

pytestmark = pytest.mark.timeout(300)

ATOL = 1e-5
POOLINGS = ("LAST", "MEAN", "CLS")
# Lengths from 1 token to several step budgets: chunked (> BUDGET) and packed (many short ones).
PROMPT_LENS = (1, 3, 8, 13, 21, 40, 57)
BUDGET = 24
GEN_PROMPTS = ([5, 6, 7, 8], [9, 10, 11])
GEN_PARAMS = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


def reference_pool(hidden: torch.Tensor, pooling: str, normalize: bool) -> torch.Tensor:
    """sentence-transformers' Pooling(pooling_mode=...) on one unpadded sequence: [T, H] -> [H]."""
    vector = {"LAST": hidden[-1], "MEAN": hidden.mean(0), "CLS": hidden[0]}[pooling]
    return torch.nn.functional.normalize(vector, dim=-1) if normalize else vector


def assert_vectors_close(got: torch.Tensor, expected: torch.Tensor) -> None:
    """Within ATOL of each other relative to the expected vector's norm: absolute for normalised
    vectors; SmolLM2's raw hidden states reach the hundreds, where fp32 rounding alone is 1e-5."""
    scale = max(1.0, float(expected.norm()))
    assert got.dtype == torch.float32 and got.shape == expected.shape
    torch.testing.assert_close(got / scale, expected / scale, atol=ATOL, rtol=0)


def hidden_states(base_model: Any, token_ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return base_model(torch.tensor([token_ids])).last_hidden_state[0].float()


def tiny_prompts(seed: int, vocab: int = 256) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(n)] for n in PROMPT_LENS]


def engine_for(model: Any, pooling: str, **overrides: Any) -> LLMEngine:
    config = EngineConfig(
        model=f"tiny-{model.config.model_type}",
        dtype=overrides.pop("dtype", "float32"),
        device="cpu",
        num_kv_blocks=overrides.pop("num_kv_blocks", 128),
        max_num_batched_tokens=overrides.pop("max_num_batched_tokens", BUDGET),
        pooling_type=pooling,
        **overrides,
    )
    return LLMEngine(config, hf_config=model.config, state_dict=model.state_dict(), tokenizer=None)


def run_mixed(
    engine: LLMEngine, prompts: list[list[int]], *, generation_first: bool = False
) -> tuple[dict, dict, list]:
    """Every prompt twice (normalised and not) and the generation requests, all added
    before the first step. Returns the pooled vectors, the generated tokens and each plan's
    (pooling ids, generation ids) among its scheduled requests."""
    if generation_first:
        for i, ids in enumerate(GEN_PROMPTS):
            engine.add_request(f"g{i}", {"prompt_token_ids": ids}, GEN_PARAMS)
    for i, ids in enumerate(prompts):
        engine.add_request(f"e{i}", {"prompt_token_ids": ids}, PoolingParams())
        engine.add_request(f"u{i}", {"prompt_token_ids": ids}, PoolingParams(normalize=False))
    if not generation_first:
        for i, ids in enumerate(GEN_PROMPTS):
            engine.add_request(f"g{i}", {"prompt_token_ids": ids}, GEN_PARAMS)
    plans = []
    schedule = engine.scheduler.schedule

    def recording_schedule():
        plan = schedule()
        ids = [item.request_id for item in plan.scheduled]
        plans.append(([r for r in ids if r[0] in "eu"], [r for r in ids if r[0] == "g"]))
        return plan

    engine.scheduler.schedule = recording_schedule  # type: ignore[method-assign]  # records, runs the real one
    try:
        outputs = run_to_completion(engine)
    finally:
        del engine.scheduler.schedule
    vectors = {rid: out.outputs.data for rid, out in outputs.items() if rid[0] in "eu"}
    tokens = {rid: out.outputs[0].token_ids for rid, out in outputs.items() if rid[0] == "g"}
    return vectors, tokens, plans


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def tiny_model(request):
    if request.param == "llama":
        return tiny_llama_model()
    return tiny_family_model("qwen3")


@pytest.mark.parametrize("pooling", POOLINGS)
def test_embeddings_equal_the_reference_mixed_chunked_and_packed(tiny_model, pooling) -> None:
    prompts = tiny_prompts(1)
    engine = engine_for(tiny_model, pooling)
    vectors, tokens, plans = run_mixed(engine, prompts)
    for i, ids in enumerate(prompts):
        hidden = hidden_states(tiny_model.model, ids)
        for prefix, normalize in (("e", True), ("u", False)):
            got = vectors[f"{prefix}{i}"]
            assert got.dtype == torch.float32 and got.shape == (tiny_model.config.hidden_size,)
            torch.testing.assert_close(got, reference_pool(hidden, pooling, normalize), atol=ATOL, rtol=0)
    # Pooling chunks and decodes shared steps; a long prompt ran in several chunks; and some step
    # packed several pooling requests.
    assert any(pool and gen for pool, gen in plans)
    assert sum(1 for pool, _ in plans if "e6" in pool) >= 3
    assert max(len(pool) for pool, _ in plans) >= 4
    # The generation requests got the tokens they get alone.
    alone = engine_for(tiny_model, pooling)
    for i, ids in enumerate(GEN_PROMPTS):
        alone.add_request(f"g{i}", {"prompt_token_ids": ids}, GEN_PARAMS)
    assert {rid: out.outputs[0].token_ids for rid, out in run_to_completion(alone).items()} == tokens
    # Prefill only: every block back in the pool, nothing decoded.
    assert engine.kv_stats().num_used_blocks == 0


def test_preempted_pooling_request_is_recomputed(tiny_model) -> None:
    """A pool too small for everything: the older generation requests' decodes preempt the
    pooling requests' chunks, which start again from their first token (mean pooling: their
    partial sums are dropped) and still give the reference vector."""
    prompts = tiny_prompts(2)[:5]
    engine = engine_for(tiny_model, "MEAN", num_kv_blocks=10, max_num_batched_tokens=8, block_size=4)
    long_generation = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    for i, ids in enumerate(GEN_PROMPTS):
        engine.add_request(f"g{i}", {"prompt_token_ids": ids}, long_generation)
    for _ in range(3):
        engine.step()
    for i, ids in enumerate(prompts):
        engine.add_request(f"u{i}", {"prompt_token_ids": ids}, PoolingParams(normalize=False))
    outputs = run_to_completion(engine)
    assert engine.scheduler.num_preemptions > 0
    for i, ids in enumerate(prompts):
        reference = reference_pool(hidden_states(tiny_model.model, ids), "MEAN", False)
        torch.testing.assert_close(outputs[f"u{i}"].outputs.data, reference, atol=ATOL, rtol=0)
    assert all(len(outputs[f"g{i}"].outputs[0].token_ids) == 24 for i in range(len(GEN_PROMPTS)))


def test_prefix_cache_hits_only_for_last_token_pooling() -> None:
    model = tiny_llama_model()
    prompt = tiny_prompts(3)[-1]  # 57 tokens: three full blocks of 16
    for pooling, expect_hit in (("LAST", True), ("MEAN", False), ("CLS", False)):
        engine = engine_for(model, pooling, max_num_batched_tokens=256)
        first = engine.add_request("a", {"prompt_token_ids": prompt}, PoolingParams(normalize=False))
        run_to_completion(engine)
        engine.add_request("b", {"prompt_token_ids": prompt}, PoolingParams(normalize=False))
        second = run_to_completion(engine)["b"]
        assert (second.num_cached_tokens == 48) is expect_hit, (pooling, first, second.num_cached_tokens)
        reference = reference_pool(hidden_states(model.model, prompt), pooling, False)
        torch.testing.assert_close(second.outputs.data, reference, atol=ATOL, rtol=0)


# -- packing (the scheduler alone) -----------------------------------------------------------


def pooling_request(request_id: str, num_tokens: int) -> Request:
    return Request(
        request_id,
        list(range(3, 3 + num_tokens)),
        SamplingParams(max_tokens=1),
        pooling=PoolingSpec(PoolingHead.HIDDEN, num_tokens - 1),
    )


def test_packing_takes_the_shortest_waiting_pooling_requests_first_and_keeps_fcfs() -> None:
    scheduler = Scheduler(KVCacheManager(256, 16, enable_prefix_caching=False), 64, 100)
    lengths = {"p0": 30, "p1": 60, "p2": 10, "p3": 25, "p4": 40, "p5": 5}
    for request_id, n in lengths.items():
        scheduler.add_request(pooling_request(request_id, n))
    scheduler.add_request(Request("gen", [3] * 50, SamplingParams(max_tokens=2)))
    scheduler.add_request(pooling_request("late", 2))
    plan = scheduler.schedule()
    # The oldest first (FCFS head), then the shortest whole prompts that fit (5 + 10 + 25 = 40
    # of the 70 left), then the oldest of the rest takes what remains (p1: 30 of its 60 tokens).
    assert [(i.request_id, len(i.token_ids)) for i in plan.scheduled] == [
        ("p0", 30), ("p5", 5), ("p2", 10), ("p3", 25), ("p1", 30),
    ]  # fmt: skip
    assert not any(item.needs_sample for item in plan.scheduled)
    # "late" (2 tokens) waits behind the generation request, which arrived before it.
    assert scheduler.num_waiting == 3


# -- SmolLM2 ----------------------------------------------------------------------------------

TEXTS = [
    "The quick brown fox jumps over the lazy dog.",
    "Embeddings map text to vectors.",
    "A queue worker can look at what is waiting and pack it by length, so that steps are full. " * 3,
    "Hi",
]


@pytest.fixture(scope="module")
def smollm2() -> dict[str, Any]:
    """SmolLM2's weights (read once); transformers' CausalLM of them and sentence-transformers'
    Transformer module (plain text: no chat template) as the references."""
    from sentence_transformers.sentence_transformer import modules as models
    from transformers import AutoModelForCausalLM

    path = resolve_model("smollm2").path
    word = models.Transformer(str(path), model_kwargs={"dtype": torch.float32})
    word = models.Transformer(
        str(path),
        model_kwargs={"dtype": torch.float32},
        modality_config={k: v for k, v in word.modality_config.items() if k != "message"},
        module_output_name=word.module_output_name,
    )
    return {
        "hf_config": load_hf_config(path),
        "state_dict": load_state_dict(path),
        "tokenizer": load_tokenizer(path),
        "hf": AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval(),
        "st_transformer": word,
    }


def sentence_transformers_vectors(smollm2: dict[str, Any], mode: str, normalize: bool) -> torch.Tensor:
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer import modules as models

    word = smollm2["st_transformer"]
    model = SentenceTransformer(
        modules=[word, models.Pooling(word.get_embedding_dimension(), pooling_mode=mode)], device="cpu"
    )
    features = model.preprocess(TEXTS)
    tokenizer = smollm2["tokenizer"]
    for text, ids, mask in zip(TEXTS, features["input_ids"], features["attention_mask"], strict=True):
        assert ids[mask.bool()].tolist() == tokenizer.encode(text, add_special_tokens=False)
    return model.encode(TEXTS, convert_to_tensor=True, normalize_embeddings=normalize).float()


def smollm2_engine(smollm2: dict[str, Any], **overrides: Any) -> LLMEngine:
    config = EngineConfig(
        model="smollm2",
        dtype="float32",
        device="cpu",
        num_kv_blocks=64,
        max_num_batched_tokens=32,
        **overrides,
    )
    return LLMEngine(
        config,
        hf_config=smollm2["hf_config"],
        state_dict=smollm2["state_dict"],
        tokenizer=smollm2["tokenizer"],
    )


@pytest.mark.parametrize("pooling", ["LAST", "MEAN"])
def test_smollm2_embeddings_equal_the_reference(smollm2, pooling) -> None:
    """Text inputs, normalised and not, beside a generation request, in chunks of 32 tokens, equal
    to sentence-transformers' encode; with MEAN also `dimensions` and `truncate_prompt_tokens`.
    (CLS is the tiny models' alone: one SmolLM2 engine costs seconds on the 2-core test machine.)"""
    engine = smollm2_engine(smollm2, pooling_type=pooling)
    tokenizer = smollm2["tokenizer"]
    for i, text in enumerate(TEXTS):
        engine.add_request(f"e{i}", text, PoolingParams())
        engine.add_request(f"u{i}", text, PoolingParams(normalize=False))
    engine.add_request("g", "Once upon a time", GEN_PARAMS)
    long_ids = tokenizer.encode(TEXTS[2], add_special_tokens=False)
    if pooling == "MEAN":
        engine.add_request("d", TEXTS[2], PoolingParams(dimensions=64))
        engine.add_request("t", TEXTS[2], PoolingParams(truncate_prompt_tokens=7, normalize=False))
    outputs = run_to_completion(engine)
    assert len(outputs["g"].outputs[0].token_ids) == GEN_PARAMS.max_tokens
    for prefix, normalize in (("e", True), ("u", False)):
        expected = sentence_transformers_vectors(
            smollm2, {"LAST": "lasttoken", "MEAN": "mean"}[pooling], normalize
        )
        for i in range(len(TEXTS)):
            assert_vectors_close(outputs[f"{prefix}{i}"].outputs.data, expected[i])
    if pooling == "MEAN":
        full = reference_pool(hidden_states(smollm2["hf"].model, long_ids), "MEAN", False)
        assert_vectors_close(outputs["d"].outputs.data, torch.nn.functional.normalize(full[:64], dim=-1))
        assert outputs["t"].prompt_token_ids == long_ids[-7:]
        last7 = reference_pool(hidden_states(smollm2["hf"].model, long_ids[-7:]), "MEAN", False)
        assert_vectors_close(outputs["t"].outputs.data, last7)
    with pytest.raises(InvalidParamsError, match="dimensions 577 is more than the model's hidden size"):
        engine.add_request("x", TEXTS[0], PoolingParams(dimensions=577))


def test_pooling_params_checks_name_the_field() -> None:
    with pytest.raises(InvalidParamsError, match="dimensions"):
        PoolingParams(dimensions=0)
    with pytest.raises(InvalidParamsError, match="truncate_prompt_tokens"):
        PoolingParams(truncate_prompt_tokens=0)
    with pytest.raises(InvalidParamsError, match="normalize applies to task 'embed' only"):
        PoolingParams(task="score", normalize=True)
    with pytest.raises(InvalidParamsError, match="task must be one of embed, classify, score"):
        PoolingParams(task="rerank")  # type: ignore[arg-type]  # the check under test


def test_smollm2_yes_no_reranker_order_equals_transformers(smollm2) -> None:
    """The Qwen3-Reranker form on SmolLM2's lm_head (--convert classify): score =
    softmax([logit(no), logit(yes)])[yes] at the last token, against transformers' CausalLM."""
    engine = smollm2_engine(smollm2, convert="classify")
    assert engine.supported_tasks == ("generate", "classify", "score")
    query = "What is the capital of France?"
    documents = ["Paris is the capital of France.", "Bananas are yellow.", "France's capital city is Paris."]
    tokenizer = smollm2["tokenizer"]
    no_id, yes_id = tokenizer.convert_tokens_to_ids("no"), tokenizer.convert_tokens_to_ids("yes")
    expected = []
    for i, document in enumerate(documents):
        ids = engine.score_prompt(query, document)
        assert tokenizer.decode(ids).endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
        engine.add_request(f"s{i}", {"prompt_token_ids": ids}, PoolingParams(task="score"))
        with torch.no_grad():
            logits = smollm2["hf"](torch.tensor([ids])).logits[0, -1]
        expected.append(torch.softmax(logits[[no_id, yes_id]], dim=-1)[1].item())
    outputs = run_to_completion(engine)
    scores = [outputs[f"s{i}"].outputs.data.item() for i in range(len(documents))]
    assert scores == pytest.approx(expected, abs=ATOL)
    assert sorted(range(3), key=lambda i: -scores[i]) == sorted(range(3), key=lambda i: -expected[i])
    with pytest.raises(UnsupportedTaskError, match="smollm2 cannot do task 'embed'"):
        engine.add_request("e", TEXTS[0], PoolingParams())


# -- classifiers ------------------------------------------------------------------------------


def tiny_classifier(num_labels: int, **overrides: Any) -> Any:
    from transformers import AutoModelForSequenceClassification

    torch.manual_seed(0)
    config = tiny_llama_config(num_labels=num_labels, pad_token_id=0, **overrides)
    model = AutoModelForSequenceClassification.from_config(config, dtype=torch.float32).eval()
    model.config.architectures = ["LlamaForSequenceClassification"]
    return model


def test_classification_logits_equal_transformers() -> None:
    model = tiny_classifier(3)
    engine = engine_for(model, "LAST")
    assert engine.supported_tasks == ("classify",)
    prompts = tiny_prompts(4)
    prompts[2] = prompts[2] + [0, 0]  # trailing pad tokens: transformers pools the last non-pad one
    for i, ids in enumerate(prompts):
        engine.add_request(f"p{i}", {"prompt_token_ids": ids}, PoolingParams(task="classify"))
        engine.add_request(
            f"l{i}", {"prompt_token_ids": ids}, PoolingParams(task="classify", use_activation=False)
        )
    for i, ids in enumerate(GEN_PROMPTS):
        with pytest.raises(UnsupportedTaskError, match=r"cannot do task 'generate'.*supports classify"):
            engine.add_request(f"g{i}", {"prompt_token_ids": ids}, GEN_PARAMS)
    outputs = run_to_completion(engine)
    for i, ids in enumerate(prompts):
        with torch.no_grad():
            logits = model(torch.tensor([ids])).logits[0]
        torch.testing.assert_close(outputs[f"l{i}"].outputs.data, logits, atol=ATOL, rtol=0)
        torch.testing.assert_close(
            outputs[f"p{i}"].outputs.data, torch.softmax(logits, -1), atol=ATOL, rtol=0
        )
    with pytest.raises(UnsupportedTaskError, match="tiny-llama cannot do task 'embed'"):
        engine.add_request("e", [5, 6], PoolingParams())
    with pytest.raises(UnsupportedTaskError, match="'score'"):
        engine.score_prompt("q", "d")


def test_cross_encoder_scores_through_llm_score(tmp_path) -> None:
    """A one-label classifier as a cross-encoder, through LLM.score and LLM.classify, against
    transformers on the tokenizer's text pair (SmolLM2's tokenizer: the model's vocabulary)."""
    model = tiny_classifier(1, vocab_size=49152)
    path = save_with_tokenizer(model, tmp_path / "cross-encoder")
    llm = LLM(str(path), dtype="float32", device="cpu", num_kv_blocks=64)
    assert llm.llm_engine.supported_tasks == ("classify", "score")
    tokenizer = llm.get_tokenizer()
    query = "how do queues work"
    documents = ["a queue holds jobs in order", "bananas", "workers take jobs from a queue", "x"]
    scores = [o.outputs.score for o in llm.score(query, documents)]
    expected = []
    for document in documents:
        with torch.no_grad():
            logit = model(torch.tensor([tokenizer(query, document)["input_ids"]])).logits[0, 0]
        expected.append(torch.sigmoid(logit).item())
    assert scores == pytest.approx(expected, abs=ATOL)
    assert sorted(range(4), key=lambda i: -scores[i]) == sorted(range(4), key=lambda i: -expected[i])
    probs = llm.classify(["a queue holds jobs in order"])[0].outputs.probs
    assert len(probs) == 1 and 0 < probs[0] < 1
    with pytest.raises(ValueError, match="1 or 4 queries"):
        llm.score(["a", "b"], documents)


def test_llm_embed_returns_vllm_shaped_outputs(tmp_path) -> None:
    model = tiny_llama_model(vocab_size=49152)
    llm = LLM(
        str(save_with_tokenizer(model, tmp_path / "tiny")), dtype="float32", device="cpu", num_kv_blocks=64
    )
    texts = ["hello world", "queues"]
    outputs = llm.embed(texts, truncate_prompt_tokens=1)
    assert [len(o.outputs.embedding) for o in outputs] == [64, 64]
    for text, output in zip(texts, outputs, strict=True):
        ids = llm.get_tokenizer().encode(text, add_special_tokens=False)
        assert output.prompt_token_ids == ids[-1:]
        reference = reference_pool(hidden_states(model.model, ids[-1:]), "LAST", True)
        torch.testing.assert_close(torch.tensor(output.outputs.embedding), reference, atol=ATOL, rtol=0)
    with pytest.raises(UnsupportedTaskError, match="cannot do task 'classify'"):
        llm.classify(texts)
    assert not llm.llm_engine.has_unfinished_requests()


# -- tasks, limits, abort ---------------------------------------------------------------------


def test_tasks_follow_runner_and_convert() -> None:
    model = tiny_llama_model()
    assert engine_for(model, "LAST").supported_tasks == ("generate", "embed")
    pooling_only = engine_for(model, "LAST", runner="pooling")
    assert pooling_only.supported_tasks == ("embed",)
    with pytest.raises(UnsupportedTaskError, match=r"tiny-llama cannot do task 'generate'.*supports embed"):
        pooling_only.add_request("g", [5, 6], GEN_PARAMS)
    generate_only = engine_for(model, "LAST", runner="generate")
    with pytest.raises(UnsupportedTaskError, match=r"cannot do task 'embed'.*supports generate"):
        generate_only.add_request("e", [5, 6], PoolingParams())
    with pytest.raises(InvalidConfigError, match="convert none"):
        engine_for(model, "LAST", runner="pooling", convert="none")
    with pytest.raises(InvalidConfigError, match="token 'no'"):
        engine_for(model, "LAST", convert="classify")  # no tokenizer: no yes/no tokens
    with pytest.raises(InvalidConfigError, match="cannot generate"):
        engine_for(tiny_classifier(2), "LAST", runner="generate")


def test_pooling_prompt_limits_and_abort() -> None:
    model = tiny_llama_model(max_position_embeddings=64)
    engine = engine_for(model, "MEAN", max_num_batched_tokens=8)
    # A pooling prompt may fill the context (no token is generated after it).
    engine.add_request("full", list(range(3, 67)), PoolingParams())
    with pytest.raises(PromptTooLongError, match="65 tokens; the model's context is 64"):
        engine.add_request("over", list(range(3, 68)), PoolingParams())
    engine.add_request("kept", list(range(3, 68)), PoolingParams(truncate_prompt_tokens=-1))
    engine.step()
    assert engine.kv_stats().num_used_blocks > 0
    assert engine.abort("full") is None
    outputs = run_to_completion(engine)
    assert set(outputs) == {"kept"} and outputs["kept"].prompt_token_ids == list(range(4, 68))
    assert engine.kv_stats().num_used_blocks == 0


# bf16 against the fp32 reference: bf16 keeps 8 bits of mantissa, so each of the model's sums is
# off by up to about 2^-8 of its size; on the tiny Llama the normalised embeddings measured at
# most 3e-3 from the fp32 ones per element (AVX2 EPYC), and the documented tolerance is 1e-2
# (docs/pooling.md, "Limits").
BF16_ATOL = 1e-2


@pytest.mark.parametrize("pooling", ("LAST", "MEAN"))
def test_bf16_embeddings_are_within_the_documented_tolerance(pooling) -> None:
    model = tiny_llama_model()
    prompts = tiny_prompts(3)
    engine = engine_for(model, pooling, dtype="bfloat16")
    for i, ids in enumerate(prompts):
        engine.add_request(f"e{i}", {"prompt_token_ids": ids}, PoolingParams())
    outputs = run_to_completion(engine)
    for i, ids in enumerate(prompts):
        got = outputs[f"e{i}"].outputs.data
        expected = reference_pool(hidden_states(model.model, ids), pooling, normalize=True)
        assert got.dtype == torch.float32
        torch.testing.assert_close(got, expected, atol=BF16_ATOL, rtol=0)
        # and not merely the fp32 vector: bf16 did run (its rounding shows)
        assert not torch.equal(got, expected)
