"""Stage invariance: the batch-invariant Triton matmul on the GPU (tensor-core path): one row in
batches of 1, 7, 64 and 256, and inside a padded batch replayed from a CUDA graph, gives the same
bits; against cuBLAS (F.linear), whose kernel choice by M is what the mode avoids, the stage also
records whether the row changes there."""

from __future__ import annotations

from typing import Any

from qworker.bench.gpu_check.report import Report
from qworker.bench.gpu_check.sizes import Sizes

ROW_COUNTS = (1, 7, 64, 256)
# SmolLM2-135M's widest projections (gate/up, down) and its LM head.
SHAPES = ((3072, 576), (576, 1536), (49152, 576))


def stage_invariance(sizes: Sizes, report: Report) -> dict[str, Any]:
    import torch
    import torch.nn.functional as F
    from qworker_kernels.triton_invariant_matmul import invariant_linear

    device = torch.device(sizes.device)
    failures: list[str] = []
    cases: list[dict[str, Any]] = []
    gen = torch.Generator().manual_seed(0)
    for dtype in (torch.bfloat16, torch.float32):
        for n, k in SHAPES if device.type == "cuda" else ((96, 64),):
            weight = (torch.randn(n, k, generator=gen) * 0.05).to(dtype).to(device)
            row = torch.randn(1, k, generator=gen).to(dtype).to(device)
            alone = invariant_linear(row, weight)
            library_alone = F.linear(row, weight)
            case: dict[str, Any] = {
                "dtype": str(dtype),
                "n": n,
                "k": k,
                "invariant": True,
                "library_invariant": True,
            }
            for rows in ROW_COUNTS:
                batch = torch.randn(rows, k, generator=gen).to(dtype).to(device)
                batch[rows - 1] = row[0]
                if not torch.equal(invariant_linear(batch, weight)[rows - 1], alone[0]):
                    case["invariant"] = False
                    failures.append(f"{dtype} {n}x{k}: the row differs at M={rows}")
                if not torch.equal(F.linear(batch, weight)[rows - 1], library_alone[0]):
                    case["library_invariant"] = False
            if device.type == "cuda":
                # A padded decode batch from a CUDA graph: static input of 64 rows, 5 of them real.
                static = torch.zeros(64, k, dtype=dtype, device=device)
                invariant_linear(static, weight)  # compile outside the capture
                torch.cuda.synchronize(device)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    static_out = invariant_linear(static, weight)
                static.zero_()
                static[:5] = torch.randn(5, k, generator=gen).to(dtype).to(device)
                static[2] = row[0]
                graph.replay()
                torch.cuda.synchronize(device)
                case["graph_invariant"] = bool(torch.equal(static_out[2], alone[0]))
                if not case["graph_invariant"]:
                    failures.append(f"{dtype} {n}x{k}: the row differs in the replayed padded graph")
            cases.append(case)
    return {"cases": cases, "num_failed": len(failures), "failures": failures}
