"""`LoRARequest`: which adapter a request runs with, as vLLM names it."""

from __future__ import annotations

from dataclasses import dataclass

from qworker.errors import InvalidRequestError


@dataclass(frozen=True)
class LoRARequest:
    """An adapter for one request: `lora_name` (a label), `lora_int_id` (the adapter's identity in
    the engine, >= 1: requests with the same id share one loaded copy and its cached KV blocks)
    and `lora_path` (a local directory as PEFT's `save_pretrained` writes it:
    adapter_config.json and adapter_model.safetensors)."""

    lora_name: str
    lora_int_id: int
    lora_path: str

    def __post_init__(self) -> None:
        if not isinstance(self.lora_name, str) or not self.lora_name:
            raise InvalidRequestError(f"lora_name must be a non-empty string, got {self.lora_name!r}")
        if (
            isinstance(self.lora_int_id, bool)
            or not isinstance(self.lora_int_id, int)
            or self.lora_int_id < 1
        ):
            raise InvalidRequestError(f"lora_int_id must be an integer >= 1, got {self.lora_int_id!r}")
        if not isinstance(self.lora_path, str) or not self.lora_path:
            raise InvalidRequestError(f"lora_path must be a non-empty string, got {self.lora_path!r}")

    @property
    def adapter_id(self) -> int:
        """vLLM's name for lora_int_id."""
        return self.lora_int_id

    @property
    def cache_key(self) -> str:
        """What a request's cached KV blocks are keyed by besides its tokens (block_hash.py): the
        adapter's id, name and files."""
        return f"lora\0{self.lora_int_id}\0{self.lora_name}\0{self.lora_path}"
