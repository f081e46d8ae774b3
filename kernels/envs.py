"""The QWORKER_* environment variables that the kernels read, each with its meaning, as vLLM's
`envs.py` lists VLLM_*. qworker/envs.py lists these again with the rest, so that one place
(and docs/configuration.md, checked against it by tests/unit/test_envs.py) names every variable.

This package does not import qworker, so the variable type lives here and qworker uses it too.
A variable is read when `get()` is called, not at import: the kernels' switches are read per
launch, so a test or an A/B (qworker/bench/gpu_check) can set them between calls. An empty value
counts as unset.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Generic, TypeVar

T = TypeVar("T")

TRUE_WORDS = ("1", "true", "yes", "on")
FALSE_WORDS = ("0", "false", "no", "off")


class EnvVarError(ValueError):
    """A QWORKER_* variable set to a value it cannot take."""


def parse_flag(raw: str) -> bool:
    """1/true/yes/on or 0/false/no/off, any case; anything else is an error (not a silent no)."""
    word = raw.strip().lower()
    if word in TRUE_WORDS:
        return True
    if word in FALSE_WORDS:
        return False
    raise ValueError(f"use one of {'/'.join(TRUE_WORDS)} or {'/'.join(FALSE_WORDS)}")


def parse_path(raw: str) -> Path:
    return Path(raw).expanduser()


def parse_str(raw: str) -> str:
    return raw.strip()


def parse_choice(*choices: str) -> Callable[[str], str]:
    def parse(raw: str) -> str:
        value = raw.strip().lower()
        if value not in choices:
            raise ValueError(f"use one of {', '.join(choices)}")
        return value

    return parse


@dataclass(frozen=True)
class EnvVar(Generic[T]):
    """One environment variable: its name, what it does (the docs' text), and how it is read."""

    name: str
    meaning: str
    parse: Callable[[str], T]
    default: T
    # Who reads it, for the docs: "kernels", "engine", "worker", "gateway", "cli", "bench", "tests".
    used_by: str

    def get(self) -> T:
        """The variable's value now, parsed; `default` when it is unset or empty."""
        raw = os.environ.get(self.name, "")
        if raw.strip() == "":
            return self.default
        try:
            return self.parse(raw)
        except ValueError as exc:
            raise EnvVarError(f"${self.name}={raw!r}: {exc}") from None

    def is_set(self) -> bool:
        return os.environ.get(self.name, "").strip() != ""


QWORKER_CACHE_DIR: EnvVar[Path | None] = EnvVar(
    "QWORKER_CACHE_DIR",
    "Folder for converted models, downloaded weights, compiled CPU kernels and the gateway's "
    "files (none: ~/.cache/qworker)",
    parse_path,
    None,
    "kernels, engine, gateway",
)
QWORKER_KV_WRITE: EnvVar[str | None] = EnvVar(
    "QWORKER_KV_WRITE",
    "Launch shape of the Triton KV-cache write: token (the default, one program per token) or "
    "token_kv (one per token and K/V); kept switchable until a GPU A/B decides",
    parse_str,
    None,
    "kernels",
)
QWORKER_DECODE_SPLITS: EnvVar[str | None] = EnvVar(
    "QWORKER_DECODE_SPLITS",
    "Split-K policy of the Triton decode attention: fill (the default) or wave; read per call",
    parse_str,
    None,
    "kernels",
)
QWORKER_INVARIANT_GEMM_AMX: EnvVar[bool] = EnvVar(
    "QWORKER_INVARIANT_GEMM_AMX",
    "0: the batch-invariant CPU GEMM takes its VDPBF16PS path even where AMX is available "
    "(for comparison; default 1)",
    parse_flag,
    True,
    "kernels",
)
QWORKER_INVARIANT_ATTENTION_AMX: EnvVar[bool] = EnvVar(
    "QWORKER_INVARIANT_ATTENTION_AMX",
    "0: the batch-invariant CPU attention takes its VDPBF16PS path even where AMX is available "
    "(for comparison; default 1)",
    parse_flag,
    True,
    "kernels",
)

KERNEL_ENV_VARS: tuple[EnvVar, ...] = (
    QWORKER_CACHE_DIR,
    QWORKER_KV_WRITE,
    QWORKER_DECODE_SPLITS,
    QWORKER_INVARIANT_GEMM_AMX,
    QWORKER_INVARIANT_ATTENTION_AMX,
)


def cache_dir() -> Path:
    """$QWORKER_CACHE_DIR, else ~/.cache/qworker (not created here)."""
    return QWORKER_CACHE_DIR.get() or Path.home() / ".cache" / "qworker"
