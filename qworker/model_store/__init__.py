"""Where model weights come from besides a local path: a Hugging Face directory under an S3 prefix,
downloaded once into the cache (`qworker.model_store.s3`).

Imported by `qworker.model.loader.resolve_model` only when a model is named by a remote URL, so
that importing the engine loads no boto3. This package knows nothing of the engine.
"""

from __future__ import annotations

from pathlib import Path

from qworker.errors import ModelDownloadError

__all__ = ["ModelDownloadError", "fetch_model", "is_remote_model", "remote_model_name"]

REMOTE_SCHEMES = ("s3://",)


def is_remote_model(model: str) -> bool:
    return model.startswith(REMOTE_SCHEMES)


def fetch_model(url: str, models_dir: Path, config_name: str = "config.json") -> Path:
    """The local directory holding the complete model at `url`, downloaded into `models_dir` on
    first use (`config_name`: the file it must hold; adapter_config.json for a LoRA adapter).
    Raises ConnectError when the store cannot be reached or refuses the credentials,
    ModelDownloadError when what it holds is not a usable model."""
    from qworker.model_store.s3 import download_s3_model

    return download_s3_model(url, models_dir, config_name)


def remote_model_name(url: str) -> str:
    """A short name for the model at `url`: the last part of its prefix (the bucket for none)."""
    location = url.split("?", 1)[0].split("://", 1)[-1].rstrip("/")
    return location.rsplit("/", 1)[-1]
