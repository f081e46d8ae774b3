"""Roofline arithmetic for one decode step of a Llama-shaped model: the bytes it must read, the
FLOPs it must do, and the floor those put on its time at a measured copy bandwidth and matmul
rate. Pure arithmetic (no torch), unit-tested against hand-computed values in
tests/unit/test_gpu_check_roofline.py; the `roofline` stage (roofline_stage.py) times the steps.

A decode step at batch B, every sequence at context C (its seq_len: the cached tokens plus the new
one), of a model with L layers, hidden H, intermediate I, vocabulary V, NH query heads and NKV
KV heads of size D, in a dtype of E bytes:

  weight bytes   E * (L * (H * (NH + 2 NKV) D + NH D H + 3 H I + 2 H) + H + V H + B H)
                 (qkv, o, gate+up, down, two norms per layer; the final norm; the lm head; the B
                 embedding rows gathered: with tied embeddings the lm head is the embedding
                 matrix, read once as the lm head)
  KV read bytes  E * B * C * L * 2 * NKV * D      (every row reads K and V of its C tokens)
  KV write bytes E * B * L * 2 * NKV * D          (the new token's K and V)
  FLOPs          2 * B * (L * (H * (NH + 2 NKV) D + NH D H + 3 H I) + V H)   (matmuls)
                 + 4 * B * L * NH * D * C                                   (QK^T and PV)

Activations (a few MB even at batch 256), norms' and rotary's arithmetic and the sampler are left
out: the floor is what no implementation can avoid. The floor is max(bytes / bandwidth, FLOPs /
rate) (perfect overlap) and the binding limit is whichever term is larger; `serial_ms` is their
sum (no overlap), the issue's "FLOPs plus the weight reads" figure.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class DecoderShape:
    num_layers: int
    hidden_size: int
    intermediate_size: int
    vocab_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int

    @classmethod
    def from_hf(cls, config: dict[str, Any]) -> DecoderShape:
        """From Hugging Face Llama config keys (head_dim defaults to hidden / heads, as there)."""
        heads = config["num_attention_heads"]
        return cls(
            num_layers=config["num_hidden_layers"],
            hidden_size=config["hidden_size"],
            intermediate_size=config["intermediate_size"],
            vocab_size=config["vocab_size"],
            num_heads=heads,
            num_kv_heads=config.get("num_key_value_heads", heads),
            head_dim=config.get("head_dim") or config["hidden_size"] // heads,
        )

    def layer_matmul_params(self) -> int:
        """Weights of one layer's four projections: qkv, o, gate+up, down."""
        h, d = self.hidden_size, self.head_dim
        qkv = h * (self.num_heads + 2 * self.num_kv_heads) * d
        o = self.num_heads * d * h
        mlp = 3 * h * self.intermediate_size
        return qkv + o + mlp

    def matmul_params(self) -> int:
        """Every weight a decode token multiplies: the layers' projections and the lm head."""
        return self.num_layers * self.layer_matmul_params() + self.vocab_size * self.hidden_size


@dataclass(frozen=True)
class StepCost:
    weight_bytes: int
    kv_read_bytes: int
    kv_write_bytes: int
    flops: int

    @property
    def bytes_read(self) -> int:
        return self.weight_bytes + self.kv_read_bytes


def decode_step_cost(shape: DecoderShape, batch: int, context: int, dtype_bytes: int) -> StepCost:
    """The bytes and FLOPs of one decode step (module docstring) at `batch` rows of `context` tokens."""
    s = shape
    norms = 2 * s.hidden_size * s.num_layers + s.hidden_size
    weight_elems = s.matmul_params() + norms + batch * s.hidden_size
    kv_per_token = s.num_layers * 2 * s.num_kv_heads * s.head_dim
    attention_flops = 4 * batch * s.num_layers * s.num_heads * s.head_dim * context
    return StepCost(
        weight_bytes=dtype_bytes * weight_elems,
        kv_read_bytes=dtype_bytes * batch * context * kv_per_token,
        kv_write_bytes=dtype_bytes * batch * kv_per_token,
        flops=2 * batch * s.matmul_params() + attention_flops,
    )


def roofline_row(cost: StepCost, measured_ms: float | None, copy_gbps: float, matmul_tflops: float) -> dict:
    """The floor at `copy_gbps` (GB/s, 1e9 bytes) and `matmul_tflops` (1e12 FLOP/s), which limit
    binds, and the fraction of it the measured time reaches (1.0: at the floor)."""
    memory_ms = cost.bytes_read / (copy_gbps * 1e9) * 1e3
    compute_ms = cost.flops / (matmul_tflops * 1e12) * 1e3
    floor_ms = max(memory_ms, compute_ms)
    row: dict[str, Any] = {
        "weight_bytes": cost.weight_bytes,
        "kv_read_bytes": cost.kv_read_bytes,
        "gflops": cost.flops / 1e9,
        "memory_ms": memory_ms,
        "compute_ms": compute_ms,
        "floor_ms": floor_ms,
        "serial_ms": memory_ms + compute_ms,
        "binding": "bandwidth" if memory_ms >= compute_ms else "compute",
    }
    if measured_ms is not None:
        row["fraction_of_floor"] = floor_ms / measured_ms
        row["over_floor"] = measured_ms / floor_ms
    return row
