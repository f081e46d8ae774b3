"""Where one engine step's time goes: matmuls, attention, norms, rotary, activation, sampling, the
runner's input tensors, the scheduler, and the rest (Python, detokenizing, bookkeeping).

It loads the engine, adds a workload's requests all at once (default: `offline-mixed`) and times
  - prefill: the first step (a full token budget of prompt tokens), and
  - decode: the first few steps after every prompt is prefilled, when every request decodes.
Each category is timed by wrapping the functions that do its work with a wall clock (the model
calls them through `self.ops`, `nn.Linear` and the attention backend, so the wrappers see every
call; they add about a microsecond each). Times are medians over `--repeats` steps of each kind;
decode steps differ slightly (one more token of context each).

    .venv/bin/python scripts/profile_step.py --dtype bfloat16
    .venv/bin/python scripts/profile_step.py --torch-profile 20   # also torch.profiler's top ops

`--num-seqs 1,32,256` measures instead the host time outside the model forward per decode step
(scheduling, input tensors, sampling, detokenizing, bookkeeping): step wall time minus the time in
the decoder forward and the lm_head (the sampler's share shown apart), median over `--repeats`
steps with that many sequences all decoding (greedy, 16-token random prompts). `--model tiny`
runs it on a tiny random Llama with the SmolLM2 tokenizer, so that the forward is small and the
host part dominates.

    .venv/bin/python scripts/profile_step.py --model tiny --num-seqs 1,32,256 --repeats 30
    .venv/bin/python scripts/profile_step.py --model tiny --num-seqs 32 --penalties   # their cost
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections import defaultdict
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import torch
from torch import nn

from qworker.bench.qworker_engine import sampling_params_for
from qworker.bench.workload import load_workload, requests_for_model
from qworker.config import EngineConfig
from qworker.engine.llm_engine import LLMEngine
from qworker.model import attention as attention_module
from qworker.model.ops import ModelOps

CATEGORIES = (
    "matmul",
    "lm_head",
    "attention: kv write",
    "attention: decode kernel",
    "attention: prefill",
    "attention: invariant (kv write + kernel)",
    "norm",
    "rotary",
    "activation",
    "sampling",
    "prepare inputs",
    "schedule",
)


class Timers:
    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self.depth = 0

    def wrap(self, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            # Only the outermost timed call counts: the lm_head's F.linear is not also a matmul.
            if self.depth:
                return fn(*args, **kwargs)
            self.depth += 1
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds[name] += time.perf_counter() - start
                self.depth -= 1

        return timed


def instrument(engine: LLMEngine, timers: Timers) -> None:
    runner = engine.runner
    model = runner.model
    ops = model.ops
    wrapped = ModelOps(
        name=ops.name,
        rms_norm=timers.wrap("norm", ops.rms_norm),
        fused_add_rms_norm=timers.wrap("norm", ops.fused_add_rms_norm),
        apply_rotary=timers.wrap("rotary", ops.apply_rotary),
        silu_and_mul=timers.wrap("activation", ops.silu_and_mul),
    )
    for module in model.modules():
        if hasattr(module, "ops"):
            module.ops = wrapped
        if isinstance(module, nn.Linear):
            module.forward = timers.wrap("matmul", module.forward)
    model.compute_logits = timers.wrap("lm_head", model.compute_logits)
    backend = runner.backend
    if getattr(backend, "_decode_kernel", None) is not None:
        backend._decode_kernel = timers.wrap("attention: decode kernel", backend._decode_kernel)
    attention_module.write_kv_cache_torch = timers.wrap(
        "attention: kv write", attention_module.write_kv_cache_torch
    )
    if getattr(backend, "_kv_writer", None) is not None:
        backend._kv_writer = timers.wrap("attention: kv write", backend._kv_writer)
    attention_module._prefill_attention = timers.wrap(
        "attention: prefill", attention_module._prefill_attention
    )
    prefill_kernel = getattr(backend, "_prefill_kernel", None)
    if prefill_kernel is not None:
        backend._prefill_kernel = SimpleNamespace(
            supports=prefill_kernel.supports,
            paged_prefill_attention=timers.wrap("attention: prefill", prefill_kernel.paged_prefill_attention),
        )
    if type(backend).__name__ == "InvariantAttentionBackend":  # --batch-invariant: one call per layer
        backend.forward = timers.wrap("attention: invariant (kv write + kernel)", backend.forward)
    runner.sampler.sample = timers.wrap("sampling", runner.sampler.sample)
    runner.prepare_inputs = timers.wrap("prepare inputs", runner.prepare_inputs)
    engine.scheduler.schedule = timers.wrap("schedule", engine.scheduler.schedule)


def timed_step(engine: LLMEngine, timers: Timers) -> tuple[dict[str, float], int, int]:
    timers.seconds.clear()
    num_running = len(engine.scheduler.running)
    start = time.perf_counter()
    outputs = engine.step()
    total = time.perf_counter() - start
    parts = dict(timers.seconds)
    parts["total"] = total
    parts["other (python, detokenize, bookkeeping)"] = total - sum(timers.seconds.values())
    return parts, num_running, len(outputs)


def summarize(steps: list[dict[str, float]]) -> dict[str, float]:
    keys = ["total", *CATEGORIES, "other (python, detokenize, bookkeeping)"]
    return {k: statistics.median(s.get(k, 0.0) for s in steps) * 1000 for k in keys}


def print_table(title: str, ms: dict[str, float]) -> None:
    total = ms["total"]
    print(f"\n{title}: {total:.1f} ms")
    for key, value in ms.items():
        if key != "total" and value > 0:
            print(f"  {key:<42} {value:8.1f} ms  {100 * value / total:5.1f}%")


def tiny_engine_with_smollm2_tokenizer(config: EngineConfig) -> LLMEngine:
    """A tiny random Llama (qworker.testing) with SmolLM2's vocabulary and tokenizer."""
    from qworker.model.loader import load_tokenizer, resolve_model
    from qworker.testing.tiny_model import tiny_llama_model

    model = tiny_llama_model(seed=0, vocab_size=49152, max_position_embeddings=1024, tie_word_embeddings=True)
    tokenizer = load_tokenizer(resolve_model("smollm2").path)
    return LLMEngine(config, hf_config=model.config, state_dict=model.state_dict(), tokenizer=tokenizer)


# --penalties: what every sequence sets then (engine/penalties.py's whole path: the output-token
# counts, the prompt mask of the repetition penalty, and a bias).
PENALTIES = {
    "presence_penalty": 0.5,
    "frequency_penalty": 0.5,
    "repetition_penalty": 1.1,
    "logit_bias": {7: 1.0},
}


def host_time_per_decode_step(
    engine: LLMEngine, num_seqs: int, repeats: int, penalties: bool = False
) -> dict[str, float]:
    """Median ms per decode step with `num_seqs` sequences decoding: the whole step, the model
    forward (decoder and lm_head), and the rest (host time outside the forward). With
    `penalties`, every sequence sets PENALTIES."""
    from qworker.engine.sampling_params import SamplingParams

    runner = engine.runner
    forward_s = [0.0]
    sample_s = [0.0]

    def timed(fn: Callable[..., Any], seconds: list[float]) -> Callable[..., Any]:
        def run(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                seconds[0] += time.perf_counter() - start

        return run

    runner._forward = timed(runner._forward, forward_s)  # type: ignore[method-assign]
    runner.model.compute_logits = timed(runner.model.compute_logits, forward_s)  # type: ignore[method-assign]
    runner.sampler.sample = timed(runner.sampler.sample, sample_s)  # type: ignore[method-assign]
    params = SamplingParams(
        max_tokens=repeats + 8, temperature=0.0, ignore_eos=True, **(PENALTIES if penalties else {})
    )
    for i in range(num_seqs):
        prompt = [100 + (i * 7919 + j * 104729) % 48000 for j in range(16)]
        engine.add_request(f"s{num_seqs}-{i}", {"prompt_token_ids": prompt}, params)
    while any(r.num_computed_tokens < r.num_prompt_tokens for r in engine.scheduler.requests.values()):
        engine.step()
    engine.step()  # the first all-decode step settles the allocator
    totals, forwards, samples = [], [], []
    for _ in range(repeats):
        forward_s[0] = sample_s[0] = 0.0
        start = time.perf_counter()
        engine.step()
        totals.append(time.perf_counter() - start)
        forwards.append(forward_s[0])
        samples.append(sample_s[0])
    while engine.has_unfinished_requests():
        engine.step()
    del runner._forward, runner.model.compute_logits, runner.sampler.sample
    hosts = [t - f for t, f in zip(totals, forwards, strict=True)]
    return {
        "step_ms": statistics.median(totals) * 1000,
        "forward_ms": statistics.median(forwards) * 1000,
        "host_ms": statistics.median(hosts) * 1000,
        # Of the host time: the sampler (greedy argmax over [num_seqs, vocab] logits here).
        "sample_ms": statistics.median(samples) * 1000,
        "host_without_sample_ms": statistics.median(h - s for h, s in zip(hosts, samples, strict=True))
        * 1000,
    }


def main_host_time(args: argparse.Namespace) -> None:
    config = EngineConfig(model=args.model, dtype=args.dtype, device="cpu", num_kv_blocks=args.num_kv_blocks)
    engine = tiny_engine_with_smollm2_tokenizer(config) if args.model == "tiny" else LLMEngine(config)
    result: dict[str, Any] = {
        "model": args.model,
        "dtype": str(engine.dtype),
        "threads": torch.get_num_threads(),
        "penalties": PENALTIES if args.penalties else None,
    }
    for num_seqs in (int(n) for n in args.num_seqs.split(",")):
        result[str(num_seqs)] = figures = host_time_per_decode_step(
            engine, num_seqs, args.repeats, penalties=args.penalties
        )
        print(
            f"{num_seqs:4d} seqs: step {figures['step_ms']:8.2f} ms, "
            f"forward {figures['forward_ms']:8.2f} ms, "
            f"host outside the forward {figures['host_ms']:7.2f} ms "
            f"(sampler {figures['sample_ms']:6.2f}, the rest {figures['host_without_sample_ms']:6.2f})",
            flush=True,
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workload", default="offline-mixed")
    parser.add_argument("--num-requests", type=int, default=None)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--torch-profile", type=int, default=0, help="also print torch.profiler's top N ops")
    parser.add_argument("--json", default=None, help="write the medians here")
    parser.add_argument("--batch-invariant", action="store_true", help="EngineConfig.batch_invariant=True")
    parser.add_argument("--num-seqs", default=None, help="e.g. 1,32,256: host time per decode step instead")
    parser.add_argument("--model", default="smollm2", help="with --num-seqs: smollm2 or tiny")
    parser.add_argument("--num-kv-blocks", type=int, default=4096, help="with --num-seqs")
    parser.add_argument(
        "--penalties",
        action="store_true",
        help="with --num-seqs: every sequence sets penalties and a logit bias",
    )
    args = parser.parse_args()
    if args.num_seqs is not None:
        main_host_time(args)
        return

    spec = load_workload(args.workload).with_overrides(num_requests=args.num_requests)
    requests = requests_for_model(spec, "smollm2")
    engine = LLMEngine(EngineConfig(dtype=args.dtype, device="cpu", batch_invariant=args.batch_invariant))
    # Warm-up: the kernels build and the allocator settles on a short request.
    engine.add_request("warmup", {"prompt_token_ids": [33] * 64}, sampling_params_for(requests[0]))
    while engine.has_unfinished_requests():
        engine.step()
    timers = Timers()
    instrument(engine, timers)
    for request in requests:
        engine.add_request(
            request.request_id, {"prompt_token_ids": request.prompt_token_ids}, sampling_params_for(request)
        )
    prefill_steps, decode_steps = [], []
    profiled: dict[str, Any] = {}
    num_requests = len(requests)
    while engine.has_unfinished_requests() and len(decode_steps) < args.repeats:
        plan_is_decode = engine.scheduler.num_waiting == 0 and all(
            r.num_computed_tokens >= r.num_prompt_tokens for r in engine.scheduler.running
        )
        kind = "decode" if plan_is_decode else "prefill"
        # The torch.profiler step comes after the first timed step of its kind, so that the
        # timed prefill step is the first (a full budget of prompt tokens).
        is_timed = prefill_steps if kind == "prefill" else decode_steps
        if args.torch_profile and kind not in profiled and is_timed:
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
                engine.step()
            profiled[kind] = prof.key_averages().table(
                sort_by="self_cpu_time_total", row_limit=args.torch_profile
            )
            continue
        parts, num_running, _ = timed_step(engine, timers)
        if kind == "prefill" and len(prefill_steps) < args.repeats and not prefill_steps:
            prefill_steps.append(parts)
        elif kind == "decode" and num_running >= num_requests * 0.9:
            decode_steps.append(parts)
    result = {
        "dtype": str(engine.dtype),
        "torch_threads": torch.get_num_threads(),
        "prefill_first_step_ms": summarize(prefill_steps),
        "decode_step_ms": summarize(decode_steps),
        "decode_num_seqs": num_requests,
    }
    print(f"dtype {result['dtype']}, {result['torch_threads']} threads, {num_requests} requests")
    print_table("prefill step (the first: a full budget of prompt tokens)", result["prefill_first_step_ms"])
    print_table(
        f"decode step (every request decoding, median of {len(decode_steps)})", result["decode_step_ms"]
    )
    for kind, table in profiled.items():
        print(f"\ntorch.profiler, one {kind} step:\n{table}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
