"""Stage roofline: the decode step of the e2e model (Llama-3.2-1B shape, bf16, on the GPU) at
batch 1, 8, 64, 256 and context 128 and 1,024, against its floor (roofline.py) at a copy bandwidth
and a bf16 matmul rate measured in this run; and the candidate fixes' switches A/B'd on the same
steps, each variant with its own freshly captured graphs.

Per row: `replay_ms` (the captured model forward, inputs copied in), `logits_ms` (lm head +
argmax, eager: outside the graph), `step_ms` = one timed replay + logits + argmax (what the floor
is compared with: its bytes include the lm head), `eager_ms` (the same step without graphs).
"""

from __future__ import annotations

from typing import Any

from qworker.bench.gpu_check.decode_probe import probe_for, switches, time_ms
from qworker.bench.gpu_check.report import Report
from qworker.bench.gpu_check.roofline import DecoderShape, decode_step_cost, roofline_row
from qworker.bench.gpu_check.sizes import Sizes

# The A/B: the baseline (every switch at its default) and one candidate per switch.
VARIANTS: dict[str, dict[str, str]] = {
    "baseline": {"QWORKER_DECODE_SPLITS": "fill", "QWORKER_KV_WRITE": "token"},
    "splits=wave": {"QWORKER_DECODE_SPLITS": "wave", "QWORKER_KV_WRITE": "token"},
    "kv_write=token_kv": {"QWORKER_DECODE_SPLITS": "fill", "QWORKER_KV_WRITE": "token_kv"},
}


def measure_copy_gbps(sizes: Sizes) -> float:
    """Device-to-device copy: bytes read + written per second (as scripts/bench_triton_kernels.py)."""
    import torch

    nbytes = sizes.copy_mib * 2**20
    src = torch.empty(nbytes, dtype=torch.uint8, device=sizes.device).random_(0, 255)
    dst = torch.empty_like(src)
    ms = time_ms(lambda: dst.copy_(src), max(3, sizes.roofline_iters), sizes.device)
    return 2 * nbytes / (ms * 1e-3) / 1e9


def measure_matmul_tflops(sizes: Sizes) -> float:
    """[n, n] @ [n, n] in the e2e dtype: 2 n^3 FLOPs per call."""
    import torch

    n = sizes.matmul_n
    dtype = getattr(torch, sizes.e2e_dtype)
    a = torch.randn((n, n), device=sizes.device).to(dtype)
    b = torch.randn((n, n), device=sizes.device).to(dtype)
    ms = time_ms(lambda: a @ b, max(3, sizes.roofline_iters), sizes.device)
    return 2 * n**3 / (ms * 1e-3) / 1e12


def stage_roofline(sizes: Sizes, report: Report) -> dict[str, Any]:
    import torch

    copy_gbps = measure_copy_gbps(sizes)
    matmul_tflops = measure_matmul_tflops(sizes)
    result = report.partial
    result.update(copy_gbps=copy_gbps, matmul_tflops=matmul_tflops, rows=[], ab=[])
    probe = probe_for(sizes)
    shape = DecoderShape.from_hf(sizes.e2e_model)
    batches, iters = tuple(sizes.roofline_batches), sizes.roofline_iters
    baseline_steps: dict[tuple[int, int], float] = {}
    for variant, values in VARIANTS.items():
        with switches(values):
            graphs = probe.graphs(batches)
            for context in sizes.roofline_contexts:
                for batch in batches:
                    inputs = probe.inputs(batch, context)

                    def step(inputs: Any = inputs, graphs: Any = graphs) -> Any:
                        return probe.logits_argmax(graphs.run(inputs))

                    step_ms = time_ms(step, iters, sizes.device)
                    if variant != "baseline":
                        base = baseline_steps[(batch, context)]
                        result["ab"].append(
                            {"variant": variant, "batch": batch, "context": context, "step_ms": step_ms,
                             "baseline_ms": base, "speedup": base / step_ms}
                        )  # fmt: skip
                        continue
                    baseline_steps[(batch, context)] = step_ms
                    replay_ms = time_ms(
                        lambda inputs=inputs, graphs=graphs: graphs.run(inputs), iters, sizes.device
                    )
                    with torch.inference_mode():  # the graphs' buffers are inference tensors
                        hidden = graphs.run(inputs).clone()
                    logits_ms = time_ms(
                        lambda hidden=hidden: probe.logits_argmax(hidden), iters, sizes.device
                    )
                    eager_ms = time_ms(
                        lambda inputs=inputs: probe.logits_argmax(probe.eager_hidden(inputs)),
                        iters,
                        sizes.device,
                    )
                    cost = decode_step_cost(shape, batch, context, probe.dtype_bytes)
                    result["rows"].append(
                        {"batch": batch, "context": context, "step_ms": step_ms, "replay_ms": replay_ms,
                         "logits_ms": logits_ms, "eager_ms": eager_ms,
                         **roofline_row(cost, step_ms, copy_gbps, matmul_tflops)}
                    )  # fmt: skip
            del graphs
    result["limits"] = limit_verdicts(result["rows"])
    return result


def limit_verdicts(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The issue's acceptance: within 1.5x of the floor at batch 64 and 256, 2x at batch 1."""
    wanted = {1: 2.0, 64: 1.5, 256: 1.5}
    verdicts = []
    for row in rows:
        if row["batch"] in wanted:
            limit = wanted[row["batch"]]
            verdicts.append(
                {"batch": row["batch"], "context": row["context"], "over_floor": row["over_floor"],
                 "limit": limit, "met": row["over_floor"] <= limit}
            )  # fmt: skip
    return verdicts
