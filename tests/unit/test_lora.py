"""LoRA adapters in the engine, token-exact in fp32 against peft's unmerged PeftModel (greedy).

Tiny random Llama and Qwen3 models, four adapters made with peft (q/v; every projection with
rsLoRA; k/o/up with a rank_pattern and an alpha_pattern; gate/up/down with rsLoRA), each alone,
all mixed with the base model in one batch, with prefill chunks of 5 tokens and with forced
preemption; prefix caching with the same prompt under two adapters (never a shared block);
more adapters at once than slots (FCFS among the requests that can run, none fails); each bad
adapter failing only its own requests; every family of the registry once (MoE experts refused).
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch

from qworker.config import EngineConfig
from qworker.engine.llm_engine import LLMEngine
from qworker.engine.sampling_params import SamplingParams
from qworker.errors import InvalidRequestError
from qworker.lora import LoRARequest
from qworker.model.tiny_families import FAMILIES, tiny_family_model
from tests.conftest import run_to_completion
from tests.lora_support import ALL_LINEAR, edit_adapter, lora_request, make_adapter, peft_greedy

pytestmark = pytest.mark.timeout(300)

MAX_TOKENS = 8
PROMPT_LENS = (5, 19, 40)  # the 40-token prompt fills two blocks of 16 below its last token
ADAPTERS: list[dict[str, Any]] = [
    dict(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"]),
    dict(r=16, lora_alpha=8, target_modules=ALL_LINEAR, use_rslora=True),
    dict(
        r=4, lora_alpha=8, target_modules=["k_proj", "o_proj", "up_proj"],
        rank_pattern={"o_proj": 8}, alpha_pattern={"up_proj": 32},
    ),
    dict(r=12, lora_alpha=24, target_modules=["gate_proj", "up_proj", "down_proj"], use_rslora=True),
]  # fmt: skip
PARAMS = SamplingParams(max_tokens=MAX_TOKENS, min_tokens=MAX_TOKENS, temperature=0.0)


def prompts() -> list[list[int]]:
    rng = random.Random(0)
    return [[rng.randrange(3, 256) for _ in range(n)] for n in PROMPT_LENS]


@dataclass
class Setup:
    model_type: str
    base: Any
    adapter_dirs: list[Path]
    # adapter index (None: the base model) -> peft's tokens per prompt
    expected: dict[int | None, list[list[int]]] = field(default_factory=dict)

    def request(self, index: int) -> LoRARequest:
        return lora_request(self.adapter_dirs[index], index + 1)

    def engine(self, **overrides: Any) -> LLMEngine:
        args: dict[str, Any] = dict(
            model=f"tiny-{self.model_type}", dtype="float32", device="cpu", num_kv_blocks=64,
            enable_lora=True, max_loras=len(ADAPTERS),
        )  # fmt: skip
        config = EngineConfig(**{**args, **overrides})
        state_dict = {k: v.clone() for k, v in self.base.state_dict().items()}
        return LLMEngine(config, hf_config=self.base.config, state_dict=state_dict)


_SETUPS: dict[str, Setup] = {}


def get_setup(model_type: str, root: Path) -> Setup:
    if model_type not in _SETUPS:
        base = tiny_family_model(model_type)
        dirs = [
            make_adapter(base, root / f"{model_type}-{i}", seed=10 + i, **config)
            for i, config in enumerate(ADAPTERS)
        ]
        setup = Setup(model_type, base, dirs)
        setup.expected[None] = peft_greedy(base, None, prompts(), MAX_TOKENS)
        for i, directory in enumerate(dirs):
            setup.expected[i] = peft_greedy(base, directory, prompts(), MAX_TOKENS)
            assert setup.expected[i] != setup.expected[None], f"adapter {i} changes nothing: a weak test"
        _SETUPS[model_type] = setup
    return _SETUPS[model_type]


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def setup(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Setup:
    return get_setup(request.param, tmp_path_factory.mktemp("lora"))


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> Setup:
    return get_setup("llama", tmp_path_factory.mktemp("lora-llama"))


def run(engine: LLMEngine, jobs: list[tuple[int, int | None]], setup: Setup) -> dict[str, Any]:
    """Add (prompt index, adapter index) jobs as requests j0, j1, ... and run them to the end."""
    for j, (p, a) in enumerate(jobs):
        lora = setup.request(a) if a is not None else None
        engine.add_request(f"j{j}", {"prompt_token_ids": prompts()[p]}, PARAMS, lora_request=lora)
    return run_to_completion(engine)


def assert_exact(outputs: dict[str, Any], jobs: list[tuple[int, int | None]], setup: Setup) -> None:
    for j, (p, a) in enumerate(jobs):
        out = outputs[f"j{j}"]
        assert out.error is None, out.error
        assert out.outputs[0].token_ids == setup.expected[a][p], f"prompt {p}, adapter {a}"


# -- exactness ---------------------------------------------------------------------------------


def test_each_adapter_alone(setup: Setup) -> None:
    engine = setup.engine()
    for a in [None, *range(len(ADAPTERS))]:
        jobs = [(p, a) for p in range(len(PROMPT_LENS))]
        assert_exact(run(engine, jobs, setup), jobs, setup)


MIXED_CONFIGS: dict[str, dict[str, Any]] = {
    "default": {},
    "small_chunks": {"max_num_batched_tokens": 5},
    "preemption": {"block_size": 4, "num_kv_blocks": 14},
}


@pytest.mark.parametrize("name", list(MIXED_CONFIGS))
def test_adapters_and_base_mixed_in_one_batch(setup: Setup, name: str) -> None:
    engine = setup.engine(**MIXED_CONFIGS[name])
    jobs = [(p, a) for p in range(len(PROMPT_LENS)) for a in [None, *range(len(ADAPTERS))]]
    assert_exact(run(engine, jobs, setup), jobs, setup)
    if name == "preemption":
        assert engine.scheduler.num_preemptions > 0


def test_prefix_cache_keys_include_the_adapter(setup: Setup) -> None:
    engine = setup.engine(enable_prefix_caching=True)
    p = 2  # 40 tokens: two full blocks to share
    # The same prompt under two adapters in one batch, then each again, then the base model.
    rounds: list[list[tuple[int, int | None]]] = [
        [(p, 0), (p, 1)],
        [(p, 1)],
        [(p, 0)],
        [(p, None)],
        [(p, None)],
    ]
    cached = []
    for jobs in rounds:
        outputs = run(engine, jobs, setup)
        assert_exact(outputs, jobs, setup)
        cached.append([outputs[f"j{j}"].num_cached_tokens for j in range(len(jobs))])
    # Adapter 1 never reads adapter 0's blocks, nor the base model either adapter's.
    assert cached == [[0, 0], [32], [32], [0], [32]]


# -- slots and loading -------------------------------------------------------------------------


def test_more_adapters_than_slots_fcfs_among_runnable(llama: Setup) -> None:
    engine = llama.engine(max_loras=1, max_cpu_loras=len(ADAPTERS))
    for a in range(3):  # loaded in host memory first, so that every request queues at once
        run(engine, [(0, a)], llama)
    admitted: list[str] = []
    schedule = engine.scheduler.schedule

    def recording_schedule():
        plan = schedule()
        admitted.extend(new.request_id for new in plan.new_requests)
        return plan

    engine.scheduler.schedule = recording_schedule  # type: ignore[method-assign]
    jobs = [(0, 0), (0, 1), (1, 2), (1, 0), (2, None), (2, 1)]
    assert_exact(run(engine, jobs, llama), jobs, llama)
    # Adapter 0 holds the one slot: its second request and the base one join it; adapter 1's
    # first request waits without holding blocks, then takes the slot with its second; then 2.
    assert admitted == ["j0", "j3", "j4", "j1", "j5", "j2"]


def test_loading_and_eviction_with_fewer_host_slots_than_adapters(llama: Setup) -> None:
    engine = llama.engine(max_loras=2, max_cpu_loras=2)
    jobs = [(p, a) for a in [*range(len(ADAPTERS)), None] for p in range(len(PROMPT_LENS))]
    random.Random(1).shuffle(jobs)
    assert_exact(run(engine, jobs, llama), jobs, llama)
    assert engine.lora is not None and len(engine.lora._host) <= 2


def test_n_greater_than_one_and_abort_while_loading(llama: Setup) -> None:
    engine = llama.engine()
    params = SamplingParams(n=2, max_tokens=MAX_TOKENS, min_tokens=MAX_TOKENS, temperature=0.0)
    engine.add_request("n2", {"prompt_token_ids": prompts()[1]}, params, lora_request=llama.request(3))
    engine.add_request("gone", {"prompt_token_ids": prompts()[0]}, PARAMS, lora_request=llama.request(2))
    engine.abort("gone")
    outputs = run_to_completion(engine)
    assert set(outputs) == {"n2"}
    assert [c.token_ids for c in outputs["n2"].outputs] == [llama.expected[3][1]] * 2


# -- bad adapters ------------------------------------------------------------------------------


def _rename(old: str, new: str):
    return lambda tensors: {k.replace(old, new): v for k, v in tensors.items()}


def _poison(value: float, which: str):
    def poison(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        name = next(k for k in sorted(tensors) if k.endswith(f"lora_{which}.weight"))
        tensors[name] = tensors[name].clone()
        tensors[name][0, 0] = value
        return tensors

    return poison


def _one_feature_less(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v[:, :-1].contiguous() for k, v in tensors.items()}


X = torch.zeros(4, 4)  # a tensor that is no LoRA weight


def bad_adapters(llama: Setup, root: Path) -> dict[str, tuple[Path, str]]:
    """name -> (adapter directory, what its requests' error says). Each from adapter 0 (q/v, r 8)."""
    good = llama.adapter_dirs[0]
    (root / "no-weights").mkdir()
    (root / "no-weights" / "adapter_config.json").write_text((good / "adapter_config.json").read_text())
    return {
        "missing": (root / "nowhere", "the adapter directory does not exist"),
        "no_weights": (root / "no-weights", "no adapter_model.safetensors"),
        "rank_over_limit": (
            make_adapter(llama.base, root / "r32", seed=1, r=32, lora_alpha=8, target_modules=["q_proj"]),
            "rank 32 is over max_lora_rank 16",
        ),
        "unknown_module": (
            edit_adapter(good, root / "fc1", tensors=_rename("self_attn.q_proj", "self_attn.fc1")),
            "has no such projection to adapt",
        ),
        "layer_past_the_model": (
            edit_adapter(good, root / "layer9", tensors=_rename("layers.0.", "layers.9.")),
            "the model has 3 layers",
        ),
        "wrong_shape": (
            edit_adapter(good, root / "shape", tensors=_one_feature_less),
            "the base model needs",
        ),
        "not_a_lora_tensor": (
            edit_adapter(good, root / "extra", tensors=lambda t: {**t, "base_model.model.lm_head.weight": X}),
            "not LoRA A/B weights",
        ),
        "nan": (edit_adapter(good, root / "nan", tensors=_poison(float("nan"), "B")), "NaN or inf"),
        "inf": (edit_adapter(good, root / "inf", tensors=_poison(float("inf"), "A")), "NaN or inf"),
        "dora": (edit_adapter(good, root / "dora", config={"use_dora": True}), "DoRA is not supported"),
        "not_lora": (edit_adapter(good, root / "ia3", config={"peft_type": "IA3"}), "only LORA adapters"),
    }  # fmt: skip


def test_bad_adapters_fail_only_their_own_requests(llama: Setup, tmp_path: Path) -> None:
    engine = llama.engine(max_loras=2, max_cpu_loras=4)
    cases = bad_adapters(llama, tmp_path)
    good_jobs = [(0, 1), (1, None), (2, 1), (2, None)]
    for j, (p, a) in enumerate(good_jobs):
        lora = llama.request(a) if a is not None else None
        engine.add_request(f"j{j}", {"prompt_token_ids": prompts()[p]}, PARAMS, lora_request=lora)
    for i, (name, (path, _)) in enumerate(cases.items()):
        lora = LoRARequest(name, 100 + i, str(path))
        engine.add_request(name, {"prompt_token_ids": prompts()[0]}, PARAMS, lora_request=lora)
    # The id of a loaded adapter with another adapter's files.
    clash = LoRARequest("clash", 2, str(llama.adapter_dirs[0]))
    engine.add_request("clash", {"prompt_token_ids": prompts()[1]}, PARAMS, lora_request=clash)
    outputs = run_to_completion(engine)
    assert_exact(outputs, good_jobs, llama)
    for name, (_, fragment) in [*cases.items(), ("clash", (None, "one id per adapter"))]:
        error = outputs[name].error
        assert error is not None and error.type == "LoRAAdapterError", (name, error)
        assert fragment in error.message and "\n" not in error.message, (name, error.message)
        assert outputs[name].outputs[0].token_ids == []
    assert engine.kv_stats().num_used_blocks == 0


def test_request_checks() -> None:
    assert LoRARequest("a", 1, "/x").adapter_id == 1
    for bad in [("", 1, "/x"), ("a", 0, "/x"), ("a", True, "/x"), ("a", 1, "")]:
        with pytest.raises(InvalidRequestError):
            LoRARequest(*bad)  # type: ignore[arg-type]


# -- the API -----------------------------------------------------------------------------------


def test_api_names_and_config(llama: Setup, tmp_path: Path) -> None:
    import qworker
    from qworker.cli_options import config_option_list
    from qworker.engine.llm import LLM
    from qworker.model.tiny_families import save_with_tokenizer

    assert qworker.LoRARequest is LoRARequest
    config = EngineConfig()
    assert (config.enable_lora, config.max_loras, config.max_lora_rank, config.max_cpu_loras) == (
        False,
        1,
        16,
        None,
    )
    assert config.num_cpu_loras == 1
    flags = {option.flag for option in config_option_list(EngineConfig)}
    assert {"--enable-lora", "--max-loras", "--max-lora-rank", "--max-cpu-loras"} <= flags
    for bad in [dict(max_loras=0), dict(max_lora_rank=65), dict(max_loras=2, max_cpu_loras=1)]:
        with pytest.raises(ValueError):
            EngineConfig(**bad)

    model_dir = save_with_tokenizer(llama.base, tmp_path / "model")
    llm = LLM(str(model_dir), dtype="float32", device="cpu", num_kv_blocks=32, enable_lora=True, max_loras=2)
    batch = [{"prompt_token_ids": p} for p in prompts()]
    outs = llm.generate(batch, PARAMS, lora_request=[llama.request(0), None, llama.request(1)])
    assert [o.outputs[0].token_ids for o in outs] == [
        llama.expected[0][0],
        llama.expected[None][1],
        llama.expected[1][2],
    ]
    outs = llm.generate(batch[:1], PARAMS, lora_request=llama.request(3))
    assert outs[0].outputs[0].token_ids == llama.expected[3][0]
    with pytest.raises(ValueError, match="2 LoRA requests for 3 prompts"):
        llm.generate(batch, PARAMS, lora_request=[None, None])

    plain = LLMEngine(
        EngineConfig(model="tiny", dtype="float32", device="cpu", num_kv_blocks=8),
        hf_config=llama.base.config,
        state_dict=dict(llama.base.state_dict()),
    )
    assert plain.runner.lora is None
    with pytest.raises(InvalidRequestError, match="without enable_lora"):
        plain.add_request("x", {"prompt_token_ids": [5, 6]}, PARAMS, lora_request=llama.request(0))


# -- every family ------------------------------------------------------------------------------

FAMILY_TARGETS = {
    "phi3": ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"],
    "mixtral": ["q_proj", "k_proj", "v_proj", "o_proj"],
    # peft turns gate_proj, up_proj and down_proj into target_parameters on the stacked experts.
    "qwen3_moe": ["q_proj", "k_proj", "v_proj", "o_proj"],
}


@pytest.mark.parametrize("model_type", [t for t in FAMILIES if t not in ("llama", "qwen3")])
def test_every_family(model_type: str, tmp_path: Path) -> None:
    base = tiny_family_model(model_type)
    targets = FAMILY_TARGETS.get(model_type, ALL_LINEAR)
    adapter = make_adapter(base, tmp_path / "a", seed=3, r=8, lora_alpha=16, target_modules=targets)
    prompt = prompts()[1]
    expected = peft_greedy(base, adapter, [prompt], MAX_TOKENS)[0]
    config = EngineConfig(model="tiny", dtype="float32", device="cpu", num_kv_blocks=16, enable_lora=True)
    engine = LLMEngine(
        config, hf_config=base.config, state_dict={k: v.clone() for k, v in base.state_dict().items()}
    )
    engine.add_request(
        "a", {"prompt_token_ids": prompt}, PARAMS, lora_request=LoRARequest("a", 1, str(adapter))
    )
    if model_type in ("mixtral", "qwen3_moe"):
        # The router and the experts: peft saves them as target_parameters.
        router = make_adapter(base, tmp_path / "router", seed=4, r=4, target_modules=["q_proj", "gate"])
        engine.add_request(
            "router", {"prompt_token_ids": prompt}, PARAMS, lora_request=LoRARequest("r", 2, str(router))
        )
    outputs = run_to_completion(engine)
    assert outputs["a"].error is None and outputs["a"].outputs[0].token_ids == expected
    if model_type in ("mixtral", "qwen3_moe"):
        error = outputs["router"].error
        assert error is not None and "MoE experts) is not supported" in error.message, error
