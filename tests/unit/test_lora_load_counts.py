"""LoRA adapter load counts (issue 39's pool measure): LoRAManager counts each read of an
adapter's files into host memory (a miss of max_cpu_loras) and each copy into a device slot (a
miss of max_loras); the worker reports both and adds them to its Prometheus counters."""

from __future__ import annotations

from pathlib import Path

import pytest

from qworker.config import EngineConfig
from qworker.engine.llm_engine import LLMEngine
from qworker.engine.sampling_params import SamplingParams
from qworker.model.tiny_families import tiny_family_model
from qworker.worker.metrics import WorkerMetrics
from tests.conftest import run_to_completion
from tests.lora_support import lora_request, make_adapter

pytestmark = pytest.mark.timeout(120)

PARAMS = SamplingParams(max_tokens=2, temperature=0.0)


def test_host_and_slot_loads_are_counted(tmp_path: Path) -> None:
    base = tiny_family_model("llama")
    loras = [
        lora_request(make_adapter(base, tmp_path / f"a{i}", seed=i, r=4, target_modules=["q_proj"]), i + 1)
        for i in range(3)
    ]
    config = EngineConfig(
        model="tiny-llama", dtype="float32", device="cpu", num_kv_blocks=16,
        enable_lora=True, max_loras=1, max_cpu_loras=2,
    )  # fmt: skip
    engine = LLMEngine(config, hf_config=base.config, state_dict=dict(base.state_dict()))
    assert engine.adapter_loads() == (0, 0)
    counts = []
    # One request at a time. Host memory holds 2 adapters (least recently used evicted), the
    # device 1: a0 and a1 are read; a0 is still in host memory but must take the slot back;
    # a2 evicts a1 (a0 was used since); a1 is read again and evicts a0; a1 again loads nothing.
    for i, index in enumerate([0, 1, 0, 2, 1, 1]):
        engine.add_request(f"r{i}", {"prompt_token_ids": [5, 6, 7]}, PARAMS, lora_request=loras[index])
        outputs = run_to_completion(engine)
        assert outputs[f"r{i}"].error is None
        counts.append(engine.adapter_loads())
    assert counts == [(1, 1), (2, 2), (2, 3), (3, 4), (4, 5), (4, 5)]
    assert sorted(engine.loaded_adapter_names()) == ["adapter-2", "adapter-3"]

    # The worker passes the engine's totals at each stats write; the counters add what is new.
    metrics = WorkerMetrics()
    for host, slot in [(0, 0), (2, 3), (4, 5), (4, 5)]:
        metrics.observe_adapter_loads(host, slot)
    assert metrics.registry.get_sample_value("qworker_lora_adapter_loads_total") == 4
    assert metrics.registry.get_sample_value("qworker_lora_slot_loads_total") == 5
