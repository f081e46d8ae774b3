"""The GPU check's roofline arithmetic against values worked out by hand for qworker.testing.tiny_model's
TINY_LLAMA (L=2, H=64, I=128, V=256, NH=4, NKV=2, D=16), and the 1B shape's known size."""

from __future__ import annotations

import pytest

from qworker.bench.gpu_check.roofline import DecoderShape, decode_step_cost, roofline_row
from qworker.bench.gpu_check.sizes import LLAMA_1B_SHAPE
from qworker.testing.tiny_model import TINY_LLAMA

pytestmark = pytest.mark.timeout(30)


def test_tiny_llama_step_cost_by_hand() -> None:
    shape = DecoderShape.from_hf(TINY_LLAMA)
    assert shape.head_dim == 16  # hidden / heads, as transformers defaults it
    # qkv 64*(4+2*2)*16 = 8192, o 64*64 = 4096, gate+up+down 3*64*128 = 24576
    assert shape.layer_matmul_params() == 36864
    assert shape.matmul_params() == 2 * 36864 + 256 * 64 == 90112
    cost = decode_step_cost(shape, batch=3, context=10, dtype_bytes=4)
    # + norms 2*64*2 + 64 = 320, + 3 embedding rows of 64
    assert cost.weight_bytes == 4 * (90112 + 320 + 192) == 362496
    # K and V per token: 2 layers * 2 * 2 heads * 16 = 128 elements
    assert cost.kv_read_bytes == 4 * 3 * 10 * 128 == 15360
    assert cost.kv_write_bytes == 4 * 3 * 128
    assert cost.bytes_read == 377856
    # matmuls 2*3*90112 = 540672; QK^T + PV 4*3*2*4*16*10 = 15360
    assert cost.flops == 556032


def test_roofline_row_picks_the_binding_limit() -> None:
    cost = decode_step_cost(DecoderShape.from_hf(TINY_LLAMA), batch=3, context=10, dtype_bytes=4)
    # 1 GB/s: 0.377856 ms of reads; 1 GFLOP/s (0.001 TFLOP/s): 0.556032 ms of FLOPs
    row = roofline_row(cost, measured_ms=1.112064, copy_gbps=1.0, matmul_tflops=0.001)
    assert row["memory_ms"] == pytest.approx(0.377856)
    assert row["compute_ms"] == pytest.approx(0.556032)
    assert row["binding"] == "compute"
    assert row["floor_ms"] == pytest.approx(0.556032)
    assert row["serial_ms"] == pytest.approx(0.933888)
    assert row["fraction_of_floor"] == pytest.approx(0.5)
    assert row["over_floor"] == pytest.approx(2.0)
    fast_compute = roofline_row(cost, measured_ms=None, copy_gbps=1.0, matmul_tflops=1.0)
    assert fast_compute["binding"] == "bandwidth" and "fraction_of_floor" not in fast_compute


def test_llama_1b_batch_1_reads_its_2_5_gb_of_bf16_weights() -> None:
    shape = DecoderShape.from_hf(LLAMA_1B_SHAPE)
    cost = decode_step_cost(shape, batch=1, context=128, dtype_bytes=2)
    # Llama-3.2-1B: 1.236 B parameters with the embedding counted once (tied lm head)
    assert cost.weight_bytes / 2 == pytest.approx(1.2358e9, rel=1e-3)
    # K and V of 128 tokens: 16 layers * 2 * 8 heads * 64 * 2 bytes = 32 KiB per token
    assert cost.kv_read_bytes == 128 * 32768
    # At 1,024 tokens and batch 256 the KV reads (8.6 GB) outweigh the weights
    big = decode_step_cost(shape, batch=256, context=1024, dtype_bytes=2)
    assert big.kv_read_bytes > 3 * big.weight_bytes
