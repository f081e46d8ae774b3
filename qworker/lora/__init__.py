"""LoRA adapters served per request (docs/lora.md): `LoRARequest` (vLLM's name and fields), the
PEFT adapter reader and its checks (`peft_adapter.py`), the host-memory LRU, background loader
and device-slot table (`manager.py`), and the adapter layers that add each adapter's delta for
its own tokens (`layers.py`; the CUDA kernel is `qworker_kernels.triton_sgmv`).

Sits between the model and the engine: imports torch, safetensors and `qworker.model`, never the
engine or anything of the worker. `qworker.lora.request` imports nothing but the standard
library, so that requests and the scheduler can name adapters without torch.
"""

from qworker.lora.request import LoRARequest

__all__ = ["LoRARequest"]
