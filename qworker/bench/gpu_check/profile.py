"""Stage profile: torch.profiler traces of one decode step of the e2e model (batch
`profile_batch` at context `profile_context`), graph-replayed and eager, each with its lm head and
greedy argmax, written to the output folder:
  OUT/profile_graphs.json, OUT/profile_eager.json   chrome traces (chrome://tracing, Perfetto)
  OUT/profile_graphs.txt,  OUT/profile_eager.txt    key_averages tables, by device time
The stage's record keeps the top rows of each table, so the report says where the step's time goes.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from qworker.bench.gpu_check.decode_probe import probe_for
from qworker.bench.gpu_check.report import Report
from qworker.bench.gpu_check.sizes import Sizes

NUM_TOP = 12


def stage_profile(sizes: Sizes, report: Report, out_dir: Path) -> dict[str, Any]:
    import torch
    from torch.profiler import ProfilerActivity, profile

    probe = probe_for(sizes)
    batch, context = sizes.profile_batch, sizes.profile_context
    graphs = probe.graphs((batch,))
    inputs = probe.inputs(batch, context)
    on_gpu = sizes.device == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_gpu else [])
    sort_by = "self_cuda_time_total" if on_gpu else "self_cpu_time_total"
    steps = {
        "graphs": lambda: probe.logits_argmax(graphs.run(inputs)),
        "eager": lambda: probe.logits_argmax(probe.eager_hidden(inputs)),
    }
    result: dict[str, Any] = report.partial
    result.update(batch=batch, context=context, files=[], top={})
    for mode, step in steps.items():
        with torch.inference_mode():
            step()  # warm: compiles and cuBLAS handles outside the trace
            if on_gpu:
                torch.cuda.synchronize()
            with profile(activities=activities) as prof:
                step()
                if on_gpu:
                    torch.cuda.synchronize()
        trace = out_dir / f"profile_{mode}.json"
        table_path = out_dir / f"profile_{mode}.txt"
        prof.export_chrome_trace(str(trace))
        averages = prof.key_averages()
        table_path.write_text(averages.table(sort_by=sort_by, row_limit=40))
        result["files"] += [trace.name, table_path.name]
        result["top"][mode] = top_rows(averages, on_gpu)
    return result


def top_rows(averages: Any, on_gpu: bool) -> list[dict[str, Any]]:
    """The NUM_TOP events with the most self time on the device (on the CPU run: the host)."""

    def self_us(event: Any) -> float:
        if on_gpu:
            return float(
                getattr(event, "self_device_time_total", getattr(event, "self_cuda_time_total", 0.0))
            )
        return float(event.self_cpu_time_total)

    events = sorted(averages, key=self_us, reverse=True)[:NUM_TOP]
    return [{"name": e.key[:80], "calls": e.count, "self_us": self_us(e)} for e in events]
