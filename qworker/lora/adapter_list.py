"""LoRA adapters by name: what a job's `lora` field (a worker) or a batch row's `model` (local
`qworker batch`) may name (docs/lora.md). The standard library, model_store for s3:// adapters,
and LoRARequest: no torch.

Two sources, both settings of the worker: `--lora-modules name=path,...` (vLLM's `--lora-modules`,
comma-separated here; a path is a local directory or an `s3://` prefix) and `--lora-dir` (a
local directory or an `s3://` prefix holding one adapter per subdirectory or sub-prefix, found
by name when a job first asks for it). An `s3://` adapter is downloaded once into the model cache
through qworker/model_store, with its checks, when a job first names it: in the worker's loop,
before the job enters the engine (seconds for a rank-16 adapter; later jobs find it cached). The
engine's own load (reading and checking the tensors) happens off its step loop.

Each name gets one `lora_int_id` for the life of the process (1, 2, ... in the order names are
first resolved), so that its jobs share one loaded copy and its cached KV blocks.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from qworker.errors import QworkerError, UnknownAdapterError
from qworker.lora.modules import NAME_PATTERN
from qworker.lora.request import LoRARequest

_REMOTE = ("s3://",)


@dataclass
class AdapterList:
    """Names to adapters. `models_dir` is where s3:// adapters are downloaded."""

    modules: dict[str, str] = field(default_factory=dict)
    lora_dir: str | None = None
    models_dir: Path | None = None
    _ids: dict[str, int] = field(default_factory=dict, init=False)
    _resolved: dict[str, LoRARequest] = field(default_factory=dict, init=False)

    @classmethod
    def of(cls, lora_modules: str | None, lora_dir: str | None) -> AdapterList:
        """The list a worker's --lora-modules and --lora-dir give (s3:// into the model cache)."""
        from qworker.envs import cache_dir
        from qworker.lora.modules import parse_lora_modules

        return cls(parse_lora_modules(lora_modules), lora_dir, cache_dir())

    @property
    def is_empty(self) -> bool:
        return not self.modules and self.lora_dir is None

    def known_names(self) -> list[str]:
        """The names a job may use: those of --lora-modules, and those found under --lora-dir."""
        names = set(self.modules) | set(self._resolved)
        if self.lora_dir is not None and not self.lora_dir.startswith(_REMOTE):
            root = Path(self.lora_dir)
            if root.is_dir():
                names |= {p.name for p in root.iterdir() if (p / "adapter_config.json").is_file()}
        return sorted(names)

    def resolve(self, name: str) -> LoRARequest:
        """The adapter a job's `lora` names; UnknownAdapterError naming the known ones."""
        cached = self._resolved.get(name)
        if cached is not None:
            return cached
        path = self._path_of(name)
        request = LoRARequest(name, self._id_of(name), path)
        self._resolved[name] = request
        return request

    def _id_of(self, name: str) -> int:
        return self._ids.setdefault(name, len(self._ids) + 1)

    def _path_of(self, name: str) -> str:
        where = self.modules.get(name)
        if where is None and self.lora_dir is not None and NAME_PATTERN.match(name):
            candidate = f"{self.lora_dir.rstrip('/')}/{name}"
            if candidate.startswith(_REMOTE) or (Path(candidate) / "adapter_config.json").is_file():
                where = candidate
        if where is None:
            known = self.known_names()
            listed = (
                ", ".join(repr(n) for n in known[:20]) if known else "none (no --lora-modules or --lora-dir)"
            )
            raise UnknownAdapterError(f"unknown LoRA adapter {name!r}; this worker has: {listed}")
        if where.startswith(_REMOTE):
            from qworker.model_store import fetch_model

            assert self.models_dir is not None, "an s3:// adapter needs the models cache directory"
            try:
                return str(fetch_model(where, self.models_dir, config_name="adapter_config.json"))
            except QworkerError as exc:  # unreachable store, refused credentials, not an adapter
                raise UnknownAdapterError(
                    f"LoRA adapter {name!r} cannot be fetched from {where}: {exc}"
                ) from None
        return where
