"""Stage kernels: every Triton kernel against its plain-torch reference (qworker_kernels.testing)."""

from __future__ import annotations

import time
from typing import Any

from qworker.bench.gpu_check.report import Report
from qworker.bench.gpu_check.sizes import Sizes


def stage_kernels(sizes: Sizes, report: Report) -> dict[str, Any]:
    import torch
    from qworker_kernels.testing import reference_checks

    deadline = report.until(report.remaining())  # mostly Triton compiles, one per shape and dtype
    cases: list[dict[str, Any]] = []
    failures: list[str] = []
    checks = reference_checks(
        sizes.device,
        dtypes=[getattr(torch, name) for name in sizes.kernel_dtypes],
        block_sizes=sizes.kernel_block_sizes,
        head_dims=sizes.kernel_head_dims,
        gqa_ratios=sizes.kernel_gqa,
        norm_hidden_sizes=sizes.norm_hidden,
    )
    for case in checks:
        cases.append(case.to_dict())
        if not case.ok:
            failures.append(case.describe_failure())
        if time.perf_counter() > deadline:
            failures.append("kernel checks cut short by the time budget")
            break
    return {"num_cases": len(cases), "num_failed": len(failures), "cases": cases, "failures": failures}
