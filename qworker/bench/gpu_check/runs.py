"""Models, systems and runs for the GPU check's parity and e2e stages: everything measured goes
through qworker.bench's run loop and metrics, on requests from its workload generator."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from qworker.bench.gpu_check.sizes import Sizes
from qworker.bench.metrics import summarize
from qworker.bench.run import RunLimits, RunResult
from qworker.bench.run_loop import run_system
from qworker.bench.system import System
from qworker.bench.workload import BenchRequest, generate_requests, parse_workload
from qworker.testing.tiny_model import tiny_llama_model

PERCENTILES = (99.0,)


def build_hf_model(shape: dict[str, Any], dtype: Any, device: Any, widen: float | None = None) -> Any:
    """A random Llama of `shape` (over qworker.testing.tiny_model.TINY_LLAMA), initialised on the device
    (fast for 1B parameters). `widen`: near-uniform random logits make greedy picks near-ties."""
    return tiny_llama_model(seed=0, widen=widen, dtype=dtype, device=device, **shape)


def engine_system(label: str, hf_model: Any, sizes: Sizes, graphs: bool, **overrides: Any) -> Any:
    """qworker's engine on the HF model's weights, continuous admission; `graphs`: decode steps
    replay CUDA graphs (on the CPU smoke run: the same padded buffers, uncaptured)."""
    from qworker.bench.qworker_engine import QworkerEngineSystem
    from qworker.config import EngineConfig
    from qworker.engine.llm_engine import LLMEngine

    args: dict[str, Any] = dict(model="random-llama", device=sizes.device, attention_backend="triton")
    args.update(overrides)
    config = EngineConfig(**args)
    engine = LLMEngine(config, hf_config=hf_model.config, state_dict=hf_model.state_dict())
    if graphs:
        engine.runner.enable_cuda_graphs(allow_cpu=sizes.device == "cpu")
    return QworkerEngineSystem(label, config, engine=engine)


def hf_system(label: str, hf_model: Any, batch_size: int, sizes: Sizes) -> System:
    from qworker.bench.hf_generate import HFGenerateSystem

    system = HFGenerateSystem(
        label, None, batch_size, dtype=hf_model.dtype, device=sizes.device, model=hf_model, pad_token_id=0
    )
    system.prepare()
    return system


def measure(
    system: System, requests: list[BenchRequest], limits: RunLimits
) -> tuple[dict[str, Any], RunResult]:
    """One run through the bench's loop; its row: vLLM bench-serve keys plus the system's counters."""
    result = run_system(system, requests, limits=limits, keep_token_ids=True)
    summary = summarize(result.records, result.duration_s, percentiles=PERCENTILES)
    row = {"system": system.label, **summary, **result.meta}
    return row, result


def token_lists(result: RunResult, requests: Sequence[BenchRequest]) -> list[list[int]]:
    assert result.token_ids is not None, "the run did not keep token ids"
    return [result.token_ids[r.request_id] for r in requests]


def uniform_requests(
    name: str, num_requests: int, vocab_size: int, prompt: tuple[int, int], output: tuple[int, int], seed: int
) -> list[BenchRequest]:
    """All at once, uniform prompt and output lengths: a workload spec through the bench's generator."""
    spec = parse_workload(
        {
            "name": name,
            "num_requests": num_requests,
            "prompt_len": {"dist": "uniform", "min": prompt[0], "max": prompt[1]},
            "output_len": {"dist": "uniform", "min": output[0], "max": output[1]},
            "seed": seed,
        }
    )
    return generate_requests(spec, vocab_size)


def ratio(a: float, b: float) -> float:
    return a / b if b > 0 else float("nan")
