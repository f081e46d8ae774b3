"""Quantized inference (opt-in: `EngineConfig.quantization`; the default runs the checkpoint's own
bf16/fp32 weights, token-exact as before). docs/quantization.md has the modes and their costs.

- scheme.py              which quantization a start runs: the option and the checkpoint's
                         `quantization_config` -> a QuantizationPlan, or one line naming what is
                         supported (no torch import: EngineConfig and the CLI read it)
- int8_linear.py         Int8Linear: W8A8 (per-channel int8 weights, per-token dynamic int8
                         activations, int32 sums) on the CPU through oneDNN, on CUDA through
                         qworker_kernels.triton_int8_matmul
- compressed_tensors.py  the reader of compressed-tensors W8A8 checkpoints (llmcompressor's and
                         vLLM's format): int8 weights and their scales, fused as the decoder fuses
- decoder.py             which of a decoder's layers are quantized: the attention and MLP
                         projections; embeddings, lm_head, norms and MoE experts stay unquantized
"""

from qworker.quantization.scheme import QuantizationPlan, QuantizationSource, resolve_quantization

__all__ = ["QuantizationPlan", "QuantizationSource", "resolve_quantization"]
