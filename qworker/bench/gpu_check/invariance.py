"""Stage invariance: the batch-invariant mode on the GPU.

1. The invariant Triton matmul (tensor-core path): one row in batches of 1, 7, 64 and 256, and
   inside a padded batch replayed from a CUDA graph, gives the same bits; against cuBLAS
   (F.linear), whose kernel choice by M is what the mode avoids, the stage also records whether
   the row changes there. The same for the Triton RMSNorm, add + RMSNorm and SiLU-and-mul that
   the mode keeps; and the invariant attention on one 300-token sequence, whole prefill vs
   8-token chunks vs decode steps (the default kernel's counts beside it, for information).
2. The engine with `batch_invariant=True` (SmolLM2-135M's shape, random weights: the GPU machine
   has no model files; bf16; CUDA graphs on): 64 prompts of varied length, greedy with top-5
   logprobs, all together (decode steps replay the graph of 64), probe prompts each alone, all
   again with a 64-token step budget (chunked prefill beside decodes, smaller graphs padded) and
   prefix caching on, and all again reading every full block from the prefix cache: every
   prompt's token ids and logprob bits must be the same in every run. Then, as information and only if the
   stage has time left, the same first runs with the mode off (the default kernels, eagerly), to
   show what the mode changes. On the CPU smoke run: the tiny parity model under TRITON_INTERPRET=1, four
   short prompts, graphs as padded buffers run eagerly, no mode-off runs.
Each run is recorded in the stage's partial result as it finishes, so a stage stopped at its
limit keeps what it checked; a run not started for want of time is listed as such.
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass
from typing import Any

from qworker.bench.gpu_check.report import Report
from qworker.bench.gpu_check.sizes import Sizes

ROW_COUNTS = (1, 7, 64, 256)
# SmolLM2-135M's widest projections (gate/up, down) and its LM head.
SHAPES = ((3072, 576), (576, 1536), (49152, 576))
# SmolLM2-135M (HuggingFaceTB/SmolLM2-135M-Instruct's config.json), over tiny_model.TINY_LLAMA.
SMOLLM2_SHAPE = dict(
    vocab_size=49152,
    hidden_size=576,
    intermediate_size=1536,
    num_hidden_layers=30,
    num_attention_heads=9,
    num_key_value_heads=3,
    head_dim=64,
    max_position_embeddings=8192,
    rms_norm_eps=1e-5,
    rope_theta=100000.0,
    tie_word_embeddings=True,
    bos_token_id=1,
    eos_token_id=2,
)


@dataclass(frozen=True)
class EngineCheck:
    num_prompts: int
    prompt_len: tuple[int, int]  # uniform, inclusive
    max_tokens: int
    num_probes: int  # prompts also run alone
    chunk_budget: int  # max_num_batched_tokens of the chunked run
    max_model_len: int
    kv_cache_gb: float


ENGINE_CHECKS = {
    "cuda": EngineCheck(64, (4, 300), 8, 2, 64, 512, 2.0),
    # The interpreter runs every program as numpy code: a few short prompts.
    "cpu": EngineCheck(4, (2, 24), 2, 1, 8, 128, 0.01),
}
# Seconds the stage keeps back for the runs after the one it may start.
_MIN_LEFT_S = 2.0


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
    result: dict[str, Any] = report.partial  # kept if the stage times out
    result.update(cases=cases, failures=failures)
    result["row_ops"] = _row_ops(device, failures)
    result["attention"] = _attention_layouts(device, failures)
    result["engine"] = _engine_invariance(sizes, report, failures)
    result["num_failed"] = len(failures)
    return result


def _row_ops(device: Any, failures: list[str]) -> list[dict[str, Any]]:
    """The Triton RMSNorm, add + RMSNorm and SiLU-and-mul the mode keeps: one row in batches of
    1, 7, 64 and 256 (bf16, SmolLM2's widths) gives the same bits."""
    import torch
    from qworker_kernels.triton_activation import silu_and_mul
    from qworker_kernels.triton_rmsnorm import fused_add_rms_norm, rms_norm

    gen = torch.Generator().manual_seed(1)
    hidden, inter = (576, 1536) if device.type == "cuda" else (64, 96)
    weight = (1 + 0.1 * torch.randn(hidden, generator=gen)).to(torch.bfloat16).to(device)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).to(torch.bfloat16).to(device)

    ops = {
        "rms_norm": (hidden, lambda x: rms_norm(x, weight, 1e-5)),
        # In place into the residual: each call gets fresh copies; both outputs are compared.
        "fused_add_rms_norm": (
            hidden,
            lambda x: torch.cat(fused_add_rms_norm(x, x.clone() * 0.5, weight, 1e-5)),
        ),
        "silu_and_mul": (2 * inter, silu_and_mul),
    }
    rows_out = []
    for name, (width, op) in ops.items():
        row = randn(1, width)
        alone = op(row.clone())
        equal = []
        for rows in ROW_COUNTS:
            batch = randn(rows, width)
            batch[rows // 2] = row[0]
            out = op(batch.clone())
            # fused_add_rms_norm returns [2 * rows, hidden]: the normed rows, then the sums.
            picked = (
                out[[rows // 2, rows + rows // 2]]
                if name == "fused_add_rms_norm"
                else out[rows // 2 : rows // 2 + 1]
            )
            equal.append(bool(torch.equal(picked, alone)))
        equal_at = dict(zip(ROW_COUNTS, equal, strict=True))
        rows_out.append({"op": name, "width": width, "equal_at": equal_at})
        if not all(equal):
            failures.append(f"{name}: a row differs with the batch size ({equal_at})")
    return rows_out


def _attention_layouts(device: Any, failures: list[str]) -> dict[str, Any]:
    """The invariant attention on one sequence (SmolLM2's heads, bf16, block size 16): whole-prompt
    prefill vs 8-token chunks vs one decode step per token, beside other sequences; and the
    default kernel's count of equal tokens for the same layouts, for comparison."""
    import torch
    from qworker_kernels.triton_invariant_attention import invariant_paged_attention
    from qworker_kernels.triton_paged_attention import paged_attention

    gen = torch.Generator().manual_seed(2)
    length = 300 if device.type == "cuda" else 20
    heads, kv_heads, head_dim, block = (9, 3, 64, 16) if device.type == "cuda" else (3, 1, 16, 16)
    num_blocks = -(-length // block) + 1  # the sequence's, then one for the other sequence

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).to(torch.bfloat16).to(device)

    q = randn(length, heads, head_dim)
    k_cache, v_cache = (
        randn(num_blocks, block, kv_heads, head_dim),
        randn(num_blocks, block, kv_heads, head_dim),
    )
    # Row 0: a 5-token neighbour in the last block; row 1: the sequence, its blocks scrambled.
    seq_table = torch.randperm(num_blocks - 1, generator=gen).to(torch.int32)
    other_table = torch.full_like(seq_table, num_blocks - 1)
    tables = torch.stack([other_table, seq_table]).to(device)
    other_q = randn(1, heads, head_dim)
    scale = head_dim**-0.5

    def step(kernel: Any, start: int, end: int) -> torch.Tensor:
        # The sequence's tokens [start, end) beside the neighbour's decode token: [end - start, H, D].
        qs = torch.cat([other_q, q[start:end]])
        qsl = torch.tensor([0, 1, 1 + end - start], dtype=torch.int32, device=device)
        lens = torch.tensor([5, end], dtype=torch.int32, device=device)
        return kernel(qs, k_cache, v_cache, tables, qsl, lens, scale)[1:]

    result: dict[str, Any] = {"length": length}
    for label, kernel in (("invariant", invariant_paged_attention), ("default", paged_attention)):
        whole = step(kernel, 0, length)
        chunks = torch.cat([step(kernel, s, min(s + 8, length)) for s in range(0, length, 8)])
        decodes = torch.cat([step(kernel, t, t + 1) for t in range(length)])
        equal = {
            "chunks_of_8": int((chunks == whole).flatten(1).all(1).sum()),
            "decode": int((decodes == whole).flatten(1).all(1).sum()),
        }
        result[label] = equal
        if label == "invariant" and min(equal.values()) != length:
            failures.append(f"invariant attention: tokens equal to the whole prefill of {length}: {equal}")
    return result


Signature = tuple[tuple[int, ...], tuple[tuple[tuple[int, str, int | None], ...], ...]]


class _Runs:
    """Runs prompts through one engine and records each run; a run is skipped (None) when the
    stage has too little time left to start it."""

    def __init__(self, engine: Any, check: EngineCheck, report: Report, record: dict[str, Any]) -> None:
        self.engine, self.check, self.report, self.record = engine, check, report, record
        record.setdefault("runs", [])

    def run(self, prompts: list[list[int]], name: str) -> list[Signature] | None:
        """Greedy with top-5 logprobs, all prompts added at once; signatures in prompt order."""
        from qworker.engine.sampling_params import SamplingParams

        if self.report.remaining() < _MIN_LEFT_S:
            self.record["runs"].append({"name": name, "status": "not run: the stage's time is spent"})
            return None
        params = SamplingParams(
            max_tokens=self.check.max_tokens, temperature=0.0, ignore_eos=True, logprobs=5
        )
        start = time.perf_counter()
        ids = [
            self.engine.add_request(f"{name}/{i}", {"prompt_token_ids": p}, params)
            for i, p in enumerate(prompts)
        ]
        done: dict[str, Any] = {}
        while self.engine.has_unfinished_requests():
            for out in self.engine.step():
                if out.finished:
                    done[out.request_id] = out.output
        signatures = [_signature(done[i]) for i in ids]
        self.record["runs"].append({"name": name, "seconds": round(time.perf_counter() - start, 3)})
        return signatures


def _signature(output: Any) -> Signature:
    completion = output.outputs[0]
    positions = tuple(
        tuple((token, float(lp.logprob).hex(), lp.rank) for token, lp in entry.items())
        for entry in completion.logprobs or ()
    )
    return tuple(completion.token_ids), positions


def _compare(
    got: list[Signature] | None, reference: list[Signature], name: str, failures: list[str]
) -> int | None:
    """Prompts of `got` equal to the reference (None when the run did not happen)."""
    if got is None:
        return None
    equal = sum(a == b for a, b in zip(got, reference, strict=True))
    if equal != len(reference):
        failures.append(f"engine, {name}: {len(reference) - equal} of {len(reference)} prompts differ")
    return equal


def _engine_invariance(sizes: Sizes, report: Report, failures: list[str]) -> dict[str, Any]:
    """Part 2 of the module docstring; appends to `failures`, returns the runs' record (also kept
    in report.partial as it grows)."""
    import torch

    from qworker.bench.gpu_check.runs import build_hf_model

    device = torch.device(sizes.device)
    check = ENGINE_CHECKS[device.type]
    shape = SMOLLM2_SHAPE if device.type == "cuda" else sizes.parity_model
    record: dict[str, Any] = report.partial.setdefault("engine", {})
    record.update(
        model="SmolLM2-135M shape, random weights" if device.type == "cuda" else "the parity model",
        dtype="bfloat16", num_prompts=check.num_prompts, max_tokens=check.max_tokens, equal={},
    )  # fmt: skip
    started = time.perf_counter()
    hf_model = build_hf_model(shape, torch.bfloat16, device)
    rng = random.Random(0)
    prompts = [
        [rng.randrange(3, shape["vocab_size"]) for _ in range(rng.randint(*check.prompt_len))]
        for _ in range(check.num_prompts)
    ]
    # The longest prompt and the shortest also run alone.
    by_length = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    probes = [by_length[-1], by_length[0]][: check.num_probes]
    engine = _engine(hf_model, sizes, check, batch_invariant=True)
    record["setup_s"] = round(time.perf_counter() - started, 2)
    record["graphs"] = engine.runner.cuda_graphs is not None
    if not record["graphs"]:
        failures.append("engine: CUDA graphs are off with batch_invariant on")
    runs = _Runs(engine, check, report, record)
    reference = runs.run(prompts, "together")
    if reference is None:
        return record
    equal = record["equal"]
    for probe in probes:
        name = f"prompt {probe} ({len(prompts[probe])} tokens) alone"
        alone = runs.run([prompts[probe]], name)
        equal[name] = _compare(alone, [reference[probe]], name, failures)
    # The step budget is the scheduler's, read at every step: the same engine (its graphs
    # captured once) runs the chunked layout. Prefix caching, off so far, goes on for it: nothing
    # is cached yet (the random prompts share no prefix), so it computes every token and fills the
    # cache, and the run after it reads every full block of every prompt from there.
    engine.scheduler.max_num_batched_tokens = check.chunk_budget
    engine.kv_cache_manager.enable_prefix_caching = True
    name = f"together, {check.chunk_budget}-token budget"
    equal[name] = _compare(runs.run(prompts, name), reference, name, failures)
    record["prefix_cache_hits_before"] = engine.kv_stats().num_prefix_cache_hits
    engine.scheduler.max_num_batched_tokens = sizes.e2e_max_num_batched_tokens
    name = "together, prefix-cache hits"
    equal[name] = _compare(runs.run(prompts, name), reference, name, failures)
    record["prefix_cache_hits"] = engine.kv_stats().num_prefix_cache_hits
    if engine.runner.cuda_graphs is not None:
        record["graph_replays"] = engine.runner.cuda_graphs.num_runs
    del engine, runs
    if device.type == "cuda" and report.remaining() > 4 * _MIN_LEFT_S:
        record["mode_off"] = _mode_off(hf_model, sizes, check, report, prompts, probes)
    record["total_s"] = round(time.perf_counter() - started, 2)
    return record


def _mode_off(
    hf_model: Any,
    sizes: Sizes,
    check: EngineCheck,
    report: Report,
    prompts: list[list[int]],
    probes: list[int],
) -> dict[str, Any]:
    """For information: the default kernels (split-K decode attention, cuBLAS) on the same runs,
    eagerly (no graph capture: it would take the time these runs need)."""
    off: dict[str, Any] = {"equal": {}, "graphs": False}
    engine = _engine(hf_model, sizes, check, batch_invariant=False, enforce_eager=True)
    runs = _Runs(engine, check, report, off)
    reference = runs.run(prompts, "together")
    if reference is None:
        return off
    for probe in probes:
        name = f"prompt {probe} alone"
        got = runs.run([prompts[probe]], name)
        off["equal"][name] = None if got is None else int(got[0] == reference[probe])
    engine.scheduler.max_num_batched_tokens = check.chunk_budget
    got = runs.run(prompts, f"together, {check.chunk_budget}-token budget")
    if got is not None:
        off["equal"]["chunked"] = sum(a == b for a, b in zip(got, reference, strict=True))
    return off


def _engine(
    hf_model: Any, sizes: Sizes, check: EngineCheck, *, batch_invariant: bool, enforce_eager: bool = False
) -> Any:
    from qworker.config import EngineConfig
    from qworker.engine.llm_engine import LLMEngine

    config = EngineConfig(
        model="random-smollm2", device=sizes.device, dtype="bfloat16", attention_backend="triton",
        batch_invariant=batch_invariant, max_num_seqs=check.num_prompts,
        max_num_batched_tokens=sizes.e2e_max_num_batched_tokens, max_model_len=check.max_model_len,
        kv_cache_memory_bytes=int(check.kv_cache_gb * 2**30), enable_prefix_caching=False,
        enforce_eager=enforce_eager,
    )  # fmt: skip
    engine = LLMEngine(config, hf_config=hf_model.config, state_dict=hf_model.state_dict())
    if sizes.device == "cpu" and not enforce_eager:
        engine.runner.enable_cuda_graphs(allow_cpu=True)  # the padded buffers, run eagerly
    return engine
