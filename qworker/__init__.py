"""qworker: a queue-driven LLM inference worker with a paged KV cache and continuous batching.

Imports are lazy so that `import qworker` for the engine never pulls in redis, boto3 or pydantic.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

_EXPORTS = {
    "LLM": "qworker.engine.llm",
    "SamplingParams": "qworker.engine.sampling_params",
    "LLMEngine": "qworker.engine.llm_engine",
    "EngineConfig": "qworker.config",
    "RequestOutput": "qworker.engine.outputs",
    "CompletionOutput": "qworker.engine.outputs",
    "Client": "qworker.jobs.client",
    "LoRARequest": "qworker.lora.request",
}

__all__ = [  # noqa: RUF022
    "LLM",
    "SamplingParams",
    "LLMEngine",
    "EngineConfig",
    "RequestOutput",
    "CompletionOutput",
    "Client",
    "LoRARequest",
]

if TYPE_CHECKING:
    from qworker.config import EngineConfig
    from qworker.engine.llm import LLM
    from qworker.engine.llm_engine import LLMEngine
    from qworker.engine.outputs import CompletionOutput, RequestOutput
    from qworker.engine.sampling_params import SamplingParams
    from qworker.jobs.client import Client
    from qworker.lora.request import LoRARequest


def __getattr__(name: str) -> Any:
    module_name = _EXPORTS.get(name)
    if module_name is None:
        raise AttributeError(f"module 'qworker' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(module_name), name)
