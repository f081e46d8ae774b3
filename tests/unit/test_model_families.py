"""Every model family, token-exact with transformers in float32.

Each family is a tiny random model built from transformers' own config class, with odd shapes:
head dims 48 and 80 (the C kernels run) and 40 (not a multiple of 16: the fallback path), GQA 1
and 4, three or four layers, four experts with top-2 for the MoE families, and a sliding window
of 8 or 12, shorter than most prompts, for the families that have one. Saved with
save_pretrained (one of them sharded) and loaded through qworker's loader, each runs the same
prompts in the parity tests' scheduler configurations: default, small prefill chunks, forced
preemption, block sizes 1 and 32, and prefix caching with cached prefixes, and must give
transformers' greedy `generate` tokens.
"""

from __future__ import annotations

import copy
import json
import random
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from qworker.config import EngineConfig
from qworker.engine.llm_engine import LLMEngine
from qworker.engine.sampling_params import SamplingParams
from qworker.errors import CheckpointError, UnsupportedModelError
from qworker.model.loader import SAFETENSORS_INDEX, load_hf_config, load_state_dict
from qworker.model.registry import SUPPORTED_MODEL_TYPES
from qworker.model.tiny_families import FAMILIES, WINDOW, randomize, tiny_family_config, tiny_family_model
from tests.conftest import run_to_completion

pytestmark = pytest.mark.timeout(300)

MAX_TOKENS = 8
# Lengths from shorter than the window to five windows; two share a 20-token prefix (the prefix
# cache then hits in the second round).
PROMPT_LENS = (3, 13, 27, 40)

SHARDED = "qwen3_moe"

# The parity tests' scheduler configurations; prefix caching is on in all of them (the default),
# and "prefix_cache_hits" runs the prompts twice so that the second round reads cached blocks.
CONFIGURATIONS: dict[str, dict[str, Any]] = {
    "default": {},
    "small_chunks": {"max_num_batched_tokens": 5},
    "preemption": {"num_kv_blocks": 14},
    "block_size_1": {"block_size": 1, "num_kv_blocks": 256},
    "block_size_32": {"block_size": 32, "num_kv_blocks": 16},
    "prefix_cache_hits": {"enable_prefix_caching": True},
}


def prompts() -> list[list[int]]:
    rng = random.Random(0)
    ids = [[rng.randrange(3, 256) for _ in range(n)] for n in PROMPT_LENS]
    ids.append(ids[2][:20] + [rng.randrange(3, 256) for _ in range(9)])
    return ids


def hf_greedy(model: Any, prompt: list[int]) -> list[int]:
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            max_new_tokens=MAX_TOKENS,
            min_new_tokens=MAX_TOKENS,
            do_sample=False,
            pad_token_id=0,
        )
    return out[0, len(prompt) :].tolist()


class Family:
    """One family's saved checkpoint, as qworker loads it, and transformers' tokens."""

    def __init__(self, model_type: str, root: Path) -> None:
        self.model_type = model_type
        self.path = root / model_type
        model = tiny_family_model(model_type)
        save_args = {"max_shard_size": "100KB"} if model_type == SHARDED else {}
        model.save_pretrained(self.path, **save_args)
        self.expected = [hf_greedy(model, p) for p in prompts()]
        self.hf_config = load_hf_config(self.path)
        self.state_dict = load_state_dict(self.path)

    def engine(self, **engine_args: Any) -> LLMEngine:
        args: dict[str, Any] = dict(model=str(self.path), dtype="float32", device="cpu", num_kv_blocks=128)
        args["block_size"] = 4
        args.update(engine_args)
        return LLMEngine(
            EngineConfig(**args), hf_config=self.hf_config, state_dict=self.state_dict, tokenizer=None
        )


@pytest.fixture(scope="module")
def families(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Family]:
    root = tmp_path_factory.mktemp("families")
    return {model_type: Family(model_type, root) for model_type in FAMILIES}


def greedy(engine: LLMEngine, prompt_list: list[list[int]], tag: str) -> list[list[int]]:
    # min_tokens masks EOS as transformers' min_new_tokens does.
    params = SamplingParams(max_tokens=MAX_TOKENS, min_tokens=MAX_TOKENS, temperature=0.0)
    ids = [
        engine.add_request(f"{tag}-{i}", {"prompt_token_ids": p}, params) for i, p in enumerate(prompt_list)
    ]
    outs = run_to_completion(engine)
    return [outs[i].outputs[0].token_ids for i in ids]


def test_every_registered_family_is_tested() -> None:
    assert set(FAMILIES) | {"gemma3"} == set(SUPPORTED_MODEL_TYPES)


@pytest.mark.parametrize("configuration", list(CONFIGURATIONS))
@pytest.mark.parametrize("model_type", list(FAMILIES))
def test_greedy_tokens_equal_transformers(
    families: dict[str, Family], model_type: str, configuration: str
) -> None:
    family = families[model_type]
    engine = family.engine(**CONFIGURATIONS[configuration])
    got = greedy(engine, prompts(), "first")
    assert got == family.expected
    if configuration == "preemption":
        assert engine.scheduler.num_preemptions > 0
    if configuration == "prefix_cache_hits":
        before = engine.kv_stats().num_prefix_cache_hits
        assert greedy(engine, prompts(), "second") == family.expected
        if engine.model_config.is_prefix_cacheable:
            assert engine.kv_stats().num_prefix_cache_hits > before
        else:  # longrope: blocks are not shared (see ModelConfig.is_prefix_cacheable)
            assert engine.kv_stats().num_prefix_cache_queries == 0


@pytest.mark.parametrize(
    ("model_type", "change"),
    [
        ("qwen3", {"sliding_window": WINDOW + 1}),
        ("mixtral", {"sliding_window": 13}),
        ("gemma2", {"sliding_window": WINDOW - 1}),
        ("gemma2", {"attn_logit_softcapping": None}),
        ("gemma3_text", {"sliding_window": WINDOW + 1}),
        ("mistral", {"sliding_window": WINDOW + 1}),
        ("qwen2", {"sliding_window": WINDOW - 1}),
    ],
    ids=lambda v: v if isinstance(v, str) else ",".join(f"{k}={x}" for k, x in v.items()),
)
def test_the_parity_prompts_would_catch_a_window_off_by_one_or_a_missing_cap(
    families: dict[str, Family], model_type: str, change: dict[str, Any]
) -> None:
    """A window one token wider or narrower (or no soft-cap) changes the tokens: the parity
    checks above see the window's edge, not just that some window is there."""
    family = families[model_type]
    hf_config = copy.deepcopy(family.hf_config)
    for key, value in change.items():
        setattr(hf_config, key, value)
    engine = LLMEngine(
        EngineConfig(model="changed", dtype="float32", device="cpu", num_kv_blocks=128, block_size=4),
        hf_config=hf_config,
        state_dict=family.state_dict,
        tokenizer=None,
    )
    assert greedy(engine, prompts(), "changed") != family.expected


def test_the_sharded_checkpoint_is_read_through_its_index(families: dict[str, Family]) -> None:
    path = families[SHARDED].path
    weight_map = json.loads((path / SAFETENSORS_INDEX).read_text())["weight_map"]
    assert len(set(weight_map.values())) > 1
    # A stray file beside the shards (Mistral ships consolidated.safetensors) is not read.
    shutil.copy(path / sorted(set(weight_map.values()))[0], path / "consolidated.safetensors")
    try:
        assert set(load_state_dict(path)) == set(weight_map)
    finally:
        (path / "consolidated.safetensors").unlink()


def test_longrope_tables_match_transformers_on_both_sides_of_the_original_context(
    families: dict[str, Family],
) -> None:
    """Greedy tokens of a tiny random model barely move with RoPE's factors, so the rotation
    itself is compared: transformers' short factors up to 16 positions, long ones past them."""
    from transformers import AutoModelForCausalLM
    from transformers.models.phi3.modeling_phi3 import apply_rotary_pos_emb

    from qworker.model.rotary import RotaryEmbedding

    config = families["phi3"].hf_config
    hf_rotary = AutoModelForCausalLM.from_config(config).model.rotary_emb
    ours = RotaryEmbedding(_model_config("phi3", config).rope_tables[0], 48, 256)
    torch.manual_seed(1)
    for seq_len in (10, 16, 17, 40):
        q, k = torch.randn(seq_len, 2, 48), torch.randn(seq_len, 2, 48)
        positions = torch.arange(seq_len)
        cos, sin = hf_rotary(q, positions[None])
        want_q, want_k = apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos, sin)
        got_q, got_k = ours(positions, q, k, torch.full((seq_len,), seq_len))
        torch.testing.assert_close(got_q, want_q[0].transpose(0, 1))
        torch.testing.assert_close(got_k, want_k[0].transpose(0, 1))
    # The two tables differ: the check above would catch a model that used one for both.
    assert not torch.allclose(ours.cos[:40], ours.cos[256:296])


def _model_config(model_type: str, hf_config: Any) -> Any:
    from qworker.model.registry import model_config_from_hf

    config = model_config_from_hf(hf_config)
    assert config.model_type == model_type
    return config


def test_gemma3_multimodal_checkpoint_runs_its_language_model(tmp_path: Path) -> None:
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration

    text = tiny_family_config("gemma3_text")
    vision = dict(
        hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
        image_size=28, patch_size=14,
    )  # fmt: skip
    config = Gemma3Config(text_config=text.to_dict(), vision_config=vision, mm_tokens_per_image=4)
    torch.manual_seed(0)
    model = randomize(Gemma3ForConditionalGeneration(config).eval(), "gemma3")
    model.save_pretrained(tmp_path)
    expected = [hf_greedy(model, p) for p in prompts()]
    hf_config = load_hf_config(tmp_path)
    assert hf_config.model_type == "gemma3"
    engine = LLMEngine(
        EngineConfig(model=str(tmp_path), dtype="float32", device="cpu", num_kv_blocks=128, block_size=4),
        hf_config=hf_config,
        state_dict=load_state_dict(tmp_path),
        tokenizer=None,
    )
    assert greedy(engine, prompts(), "mm") == expected


# -- bad checkpoints ---------------------------------------------------------------------------


def rewrite_checkpoint(source: Path, target: Path, edit: Any) -> Path:
    """A copy of the single-file checkpoint at `source` with edit(tensors) applied."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(source, target)
    tensors = load_file(str(target / "model.safetensors"))
    edit(tensors)
    save_file(tensors, str(target / "model.safetensors"))
    return target


def load_engine(path: Path) -> LLMEngine:
    return LLMEngine(
        EngineConfig(model=str(path), dtype="float32", device="cpu", num_kv_blocks=16),
        hf_config=load_hf_config(path),
        state_dict=load_state_dict(path),
        tokenizer=None,
    )


def test_a_missing_tensor_is_a_checkpoint_error_naming_it(
    families: dict[str, Family], tmp_path: Path
) -> None:
    path = rewrite_checkpoint(
        families["qwen3"].path, tmp_path / "m", lambda t: t.pop("model.layers.1.self_attn.k_norm.weight")
    )
    with pytest.raises(CheckpointError, match=r"missing 1 tensor.*layers\.1\.self_attn\.k_norm\.weight"):
        load_engine(path)
    path = rewrite_checkpoint(
        families["mixtral"].path,
        tmp_path / "e",
        lambda t: t.pop("model.layers.2.block_sparse_moe.experts.3.w3.weight"),
    )
    with pytest.raises(CheckpointError, match=r"layers\.2\.mlp\.experts\.3\.up_proj\.weight"):
        load_engine(path)


def test_a_wrong_shape_and_an_unexpected_tensor_are_checkpoint_errors(
    families: dict[str, Family], tmp_path: Path
) -> None:
    def narrow(t: dict[str, torch.Tensor]) -> None:
        t["model.layers.0.mlp.down_proj.weight"] = t["model.layers.0.mlp.down_proj.weight"][
            :, :-1
        ].contiguous()

    with pytest.raises(
        CheckpointError, match=r"wrong shape.*layers\.0\.mlp\.down_proj\.weight is \(96, 127\)"
    ):
        load_engine(rewrite_checkpoint(families["gemma2"].path, tmp_path / "s", narrow))

    def extra(t: dict[str, torch.Tensor]) -> None:
        t["model.layers.9.mlp.gate_proj.weight"] = torch.zeros(2, 2)

    with pytest.raises(CheckpointError, match=r"no place for.*layers\.9\.mlp\.gate_proj\.weight"):
        load_engine(rewrite_checkpoint(families["phi3"].path, tmp_path / "u", extra))


def test_an_unknown_model_type_lists_the_supported_ones(families: dict[str, Family], tmp_path: Path) -> None:
    shutil.copytree(families["llama"].path, tmp_path / "m")
    config = json.loads((tmp_path / "m" / "config.json").read_text())
    (tmp_path / "m" / "config.json").write_text(json.dumps({**config, "model_type": "gpt2"}))
    with pytest.raises(UnsupportedModelError, match=r"'gpt2' is not supported; qworker runs llama, .*phi3"):
        load_engine(tmp_path / "m")


def test_the_worker_exits_with_the_usage_code_on_a_bad_checkpoint(
    families: dict[str, Family], tmp_path: Path
) -> None:
    """As a user runs it: one line, exit code 2 (docs/WORKER.md), and it never says ready.

    The command runs in this process (click's runner: the exit code is the one `qworker` exits
    with); a subprocess cost a second import of torch and transformers and added nothing to the
    check. tests/unit/test_first_contact_errors.py runs `qworker worker` as a process."""
    import os

    from typer.testing import CliRunner

    from qworker import cli
    from qworker.cli_errors import EXIT_USAGE
    from qworker.model.loader import resolve_model

    path = rewrite_checkpoint(
        families["gemma3_text"].path,
        tmp_path / "m",
        lambda t: t.pop("model.layers.2.self_attn.q_norm.weight"),
    )
    tokenizer_dir = resolve_model("smollm2").path
    for name in os.listdir(tokenizer_dir):
        if name.startswith(("tokenizer", "special_tokens", "vocab", "merges", "chat_template")):
            shutil.copy(tokenizer_dir / name, path / name)
    proc = CliRunner().invoke(
        cli.app,
        ["worker", "--model", str(path), "--queue", "memory://bad-checkpoint", "--device", "cpu",
         "--dtype", "float32"],
    )  # fmt: skip
    assert proc.exception is None or isinstance(proc.exception, SystemExit), proc.exception
    assert proc.exit_code == EXIT_USAGE, proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.startswith("qworker: error: ")]
    assert len(errors) == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert "layers.2.self_attn.q_norm.weight" in errors[0]
    assert "ready" not in proc.stdout


def test_the_chat_template_comes_from_the_tokenizer(families: dict[str, Family], tmp_path: Path) -> None:
    from qworker import LLM
    from qworker.model.loader import load_tokenizer, resolve_model

    path = shutil.copytree(families["qwen3"].path, tmp_path / "m")
    tokenizer_dir = resolve_model("smollm2").path
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja"):
        if (tokenizer_dir / name).is_file():
            shutil.copy(tokenizer_dir / name, path / name)
    messages = [{"role": "user", "content": "What is the capital of Japan?"}]
    llm = LLM(str(path), dtype="float32", device="cpu", num_kv_blocks=64)
    expected = load_tokenizer(path).apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    expected = list(expected["input_ids"] if hasattr(expected, "keys") else expected)
    assert llm.llm_engine.apply_chat_template(messages) == expected
    assert len(expected) > 10


def test_qwen3_moe_layers_are_sparse_where_transformers_puts_its_moe_blocks() -> None:
    from transformers import AutoModelForCausalLM
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    hf_config = tiny_family_config(
        "qwen3_moe", num_hidden_layers=6, decoder_sparse_step=2, mlp_only_layers=[3]
    )
    hf_model = AutoModelForCausalLM.from_config(hf_config)
    want = [isinstance(layer.mlp, Qwen3MoeSparseMoeBlock) for layer in hf_model.model.layers]
    assert want == [False, True, False, False, False, True]
    assert [layer.is_moe for layer in _model_config("qwen3_moe", hf_config).layers] == want
