"""LoRA adapters for tests, made with peft (not shipped): random A and B (`init_lora_weights=False`,
so B is not zero), saved with `save_pretrained`, and peft's unmerged PeftModel as the reference."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import torch

from qworker.lora import LoRARequest

ALL_LINEAR = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def make_adapter(base: Any, directory: Path, *, seed: int, widen: float = 2.0, **lora_config: Any) -> Path:
    """Save a random LoRA adapter of `base` (a transformers model, left unchanged) to `directory`.
    `widen` scales A and B, so that the adapters change greedy tokens."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    model = get_peft_model(copy.deepcopy(base), LoraConfig(init_lora_weights=False, **lora_config))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.mul_(widen)
    model.save_pretrained(directory)
    return directory


def peft_greedy(
    base: Any, adapter_dir: Path | None, prompts: list[list[int]], max_tokens: int
) -> list[list[int]]:
    """Greedy tokens of `base` with the adapter (peft's unmerged PeftModel), one prompt at a time."""
    from peft import PeftModel

    model = (
        base if adapter_dir is None else PeftModel.from_pretrained(copy.deepcopy(base), adapter_dir).eval()
    )
    outputs = []
    with torch.no_grad():
        for prompt in prompts:
            out = model.generate(
                input_ids=torch.tensor([prompt]),
                attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                max_new_tokens=max_tokens,
                min_new_tokens=max_tokens,
                do_sample=False,
                pad_token_id=0,
            )
            outputs.append(out[0, len(prompt) :].tolist())
    return outputs


def lora_request(path: Path, lora_int_id: int) -> LoRARequest:
    return LoRARequest(f"adapter-{lora_int_id}", lora_int_id, str(path))


def edit_adapter(
    source: Path, target: Path, *, config: dict[str, Any] | None = None, tensors: Any = None
) -> Path:
    """A copy of the adapter at `source` with its config updated by `config` and its tensors
    passed through `tensors` (a function of the dict of tensors returning the new dict)."""
    from safetensors.torch import load_file, save_file

    target.mkdir(parents=True, exist_ok=True)
    adapter_config = json.loads((source / "adapter_config.json").read_text())
    adapter_config.update(config or {})
    (target / "adapter_config.json").write_text(json.dumps(adapter_config))
    weights = load_file(str(source / "adapter_model.safetensors"))
    if tensors is not None:
        weights = tensors(weights)
    save_file(weights, str(target / "adapter_model.safetensors"))
    return target
