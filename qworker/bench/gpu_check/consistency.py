"""Stage consistency: are padded graph replays bit-identical to eager steps for the same rows, in
bf16 and fp32, per batch size, and if not, which difference between them is the cause?

For a decode batch of n rows at context C (`consistency_batches`, mostly sizes that are not
captured, so the replay pads them to the next captured size P, as serving does), the last hidden
states of the real rows are compared bit for bit:
  graph_vs_eager        the replay (P rows, split count from max_model_len) vs eager (n rows,
                        split count from C): what serving sees;
  capture               the replay vs eager on the same padded P rows with the same max_seq_len:
                        whether capturing changes anything (it should not);
  padding               eager on P padded rows vs eager on n rows, same max_seq_len (C): the
                        matmuls' M dimension (P vs n) alone;
  splits                eager on n rows with max_seq_len = max_model_len vs C: the split-K count
                        alone (a different reduction order in attention).
Each comparison gives bit-equality, the largest absolute difference, and whether the greedy
tokens (argmax of the logits) agree. Two models: the e2e model in bf16 and the parity model in
float32 (fp32 greedy parity must stay exact: a token difference there is a failure).
"""

from __future__ import annotations

from typing import Any

from qworker.bench.gpu_check.decode_probe import DecodeProbe, probe_for
from qworker.bench.gpu_check.report import Report
from qworker.bench.gpu_check.sizes import Sizes


def stage_consistency(sizes: Sizes, report: Report) -> dict[str, Any]:
    from qworker.engine.cuda_graphs import capture_sizes

    result = report.partial
    result["rows"] = []
    failures: list[str] = []
    # bf16 on the e2e model (the roofline stage's engine on the GPU), fp32 on the parity model.
    cases = [("e2e", "bfloat16"), ("parity", "float32")]
    for model, dtype in cases:
        probe = probe_for(sizes, model=model, dtype=dtype)
        # Only the sizes these batches pad to, of those serving captures (capture is the slow part).
        serving_sizes = capture_sizes(probe.max_batch)
        pad_to = {min(s for s in serving_sizes if s >= n) for n in sizes.consistency_batches}
        graphs = probe.graphs(tuple(sorted(pad_to)))
        for n in sizes.consistency_batches:
            row = compare(probe, graphs, n, sizes.consistency_context)
            result["rows"].append({"model": model, "dtype": dtype, **row})
            if dtype == "float32" and not row["graph_vs_eager_tokens_equal"]:
                failures.append(f"fp32 {model} batch {n}: greedy tokens differ between replay and eager")
    result["diagnosis"] = diagnose(result["rows"])
    result["failures"] = failures
    return result


def compare(probe: DecodeProbe, graphs: Any, n: int, context: int) -> dict[str, Any]:
    import dataclasses

    import torch

    inputs = probe.inputs(n, context, seed=n)
    size = graphs.padded_size(n)
    max_model_len = probe.runner.max_model_len
    with torch.inference_mode():
        replay = graphs.run(inputs).clone()
        eager = probe.eager_hidden(inputs)
        padded_same = probe.eager_hidden(probe.padded(inputs, size, max_model_len))[:n]
        padded_c = probe.eager_hidden(probe.padded(inputs, size, context))[:n]
        long_meta = dataclasses.replace(inputs.meta, max_seq_len=max_model_len)
        eager_long = probe.eager_hidden(dataclasses.replace(inputs, meta=long_meta))
        pairs = {
            "graph_vs_eager": (replay, eager),
            "capture": (replay, padded_same),
            "padding": (padded_c, eager),
            "splits": (eager_long, eager),
        }
        row: dict[str, Any] = {"batch": n, "padded_to": size, "context": context}
        for name, (a, b) in pairs.items():
            row[f"{name}_bit_equal"] = bool(torch.equal(a, b))
            row[f"{name}_max_abs"] = float((a.float() - b.float()).abs().max())
            row[f"{name}_tokens_equal"] = bool(torch.equal(probe.logits_argmax(a), probe.logits_argmax(b)))
    return row


def diagnose(rows: list[dict[str, Any]]) -> list[str]:
    """One line per model and dtype: bit-identical or not, and the causes the comparisons show."""
    lines = []
    for key in dict.fromkeys((r["model"], r["dtype"]) for r in rows):
        mine = [r for r in rows if (r["model"], r["dtype"]) == key]
        differ = [r["batch"] for r in mine if not r["graph_vs_eager_bit_equal"]]
        if not differ:
            batches = [r["batch"] for r in mine]
            lines.append(f"{key[0]} {key[1]}: replays bit-identical to eager at every batch {batches}")
            continue
        causes = [c for c in ("capture", "padding", "splits") if any(not r[f"{c}_bit_equal"] for r in mine)]
        lines.append(
            f"{key[0]} {key[1]}: replays differ from eager at batches {differ}; causes: "
            f"{', '.join(causes) or 'none alone (only their combination)'}"
        )
    return lines
