"""Offline throughput: qworker against transformers' static batching, same requests, same dtype.

    python scripts/bench_offline.py [--workload ../shared/workloads/offline-mixed.json]
                                    [--num-requests N] [--hf-batch-size 32] [--skip-hf]

Both systems run in this one process on the same requests (random prompt token ids, outputs
forced to their sampled length with ignore_eos). Prints output tokens/s for each and the ratio.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from tqdm import tqdm

from qworker import LLM, SamplingParams
from qworker.bench.workload import BenchRequest, generate_requests, load_workload

DEFAULT_WORKLOAD = Path(__file__).resolve().parents[2] / "shared" / "workloads" / "offline-mixed.json"


def run_qworker(llm: LLM, requests: list[BenchRequest]) -> dict[str, float]:
    engine = llm.llm_engine
    for r in requests:
        engine.add_request(
            r.request_id,
            {"prompt_token_ids": r.prompt_token_ids},
            SamplingParams(max_tokens=r.output_len, temperature=0.0, ignore_eos=True),
        )
    peak_blocks = 0
    num_output_tokens = 0
    steps = 0
    progress = tqdm(total=sum(r.output_len for r in requests), desc="qworker output tokens", mininterval=5)
    start = time.perf_counter()
    while engine.has_unfinished_requests():
        for out in engine.step():
            num_output_tokens += len(out.new_token_ids)
            progress.update(len(out.new_token_ids))
        steps += 1
        peak_blocks = max(peak_blocks, engine.kv_stats().num_used_blocks)
    elapsed = time.perf_counter() - start
    progress.close()
    block_size = engine.config.block_size
    # A contiguous cache reserves prompt + max_tokens slots per request for its whole life.
    contiguous_slots = sum(r.prompt_len + r.output_len for r in requests)
    return {
        "seconds": elapsed,
        "output_tokens": num_output_tokens,
        "output_throughput": num_output_tokens / elapsed,
        "steps": steps,
        "peak_kv_blocks": peak_blocks,
        "peak_kv_slots": peak_blocks * block_size,
        "contiguous_reservation_slots": contiguous_slots,
        "preemptions": engine.scheduler.num_preemptions,
    }


def run_hf_static(
    model_path: Path, requests: list[BenchRequest], batch_size: int, dtype: torch.dtype
) -> dict[str, float]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype).eval()
    pad_id = 0
    num_useful_tokens = 0
    start = time.perf_counter()
    with torch.inference_mode():
        for i in range(0, len(requests), batch_size):
            batch = requests[i : i + batch_size]
            width = max(r.prompt_len for r in batch)
            input_ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
            mask = torch.zeros((len(batch), width), dtype=torch.long)
            for row, r in enumerate(batch):
                input_ids[row, width - r.prompt_len :] = torch.tensor(r.prompt_token_ids)
                mask[row, width - r.prompt_len :] = 1
            # A static batch runs until its longest request is done.
            longest = max(r.output_len for r in batch)
            model.generate(
                input_ids,
                attention_mask=mask,
                max_new_tokens=longest,
                min_new_tokens=longest,
                do_sample=False,
                pad_token_id=pad_id,
            )
            num_useful_tokens += sum(r.output_len for r in batch)
    elapsed = time.perf_counter() - start
    return {
        "seconds": elapsed,
        "output_tokens": num_useful_tokens,
        "output_throughput": num_useful_tokens / elapsed,
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--workload", type=Path, default=DEFAULT_WORKLOAD)
    parser.add_argument("--num-requests", type=int, default=None)
    parser.add_argument("--hf-batch-size", type=int, default=32)
    parser.add_argument("--skip-hf", action="store_true")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--json", type=Path, default=None)
    # auto: bf16 where the CPU has bf16 hardware (AMX / AVX512-BF16), else fp32; both systems use it.
    parser.add_argument("--dtype", default="auto")
    args = parser.parse_args()

    spec = load_workload(args.workload)
    if args.num_requests:
        spec = spec.with_overrides(num_requests=args.num_requests)
    start = time.perf_counter()
    llm = LLM(
        "smollm2",
        dtype=args.dtype,
        block_size=args.block_size,
        max_num_batched_tokens=args.max_num_batched_tokens,
    )
    startup = time.perf_counter() - start
    engine = llm.llm_engine
    requests = generate_requests(
        spec, engine.model_config.vocab_size, excluded_token_ids=sorted(engine.eos_token_ids)
    )
    print(
        f"workload {spec.name}: {len(requests)} requests, "
        f"{sum(r.prompt_len for r in requests)} prompt / {sum(r.output_len for r in requests)} output tokens"
    )
    print(
        f"dtype {engine.dtype}, qworker startup {startup:.1f}s, "
        f"attention backend {engine.attention_backend_name}, {engine.num_kv_blocks} KV blocks"
    )
    qw = run_qworker(llm, requests)
    qw["startup_seconds"] = startup
    print(
        f"qworker:   {qw['output_throughput']:8.1f} output tok/s  ({qw['seconds']:.1f}s, "
        f"{qw['steps']} steps, {qw['preemptions']} preemptions)"
    )
    share = qw["peak_kv_slots"] / qw["contiguous_reservation_slots"]
    print(
        f"  KV: peak {qw['peak_kv_slots']} slots in use vs {qw['contiguous_reservation_slots']} for a "
        f"contiguous prompt+max_tokens reservation ({share:.1%})"
    )
    result = {"workload": spec.name, "num_requests": len(requests), "qworker": qw}
    if not args.skip_hf:
        from qworker.model.loader import resolve_model

        dtype = engine.dtype
        del llm, engine
        hf = run_hf_static(resolve_model("smollm2").path, requests, args.hf_batch_size, dtype)
        print(
            f"hf-static: {hf['output_throughput']:8.1f} output tok/s  ({hf['seconds']:.1f}s, "
            f"batch {args.hf_batch_size})"
        )
        ratio = qw["output_throughput"] / hf["output_throughput"]
        print(f"ratio qworker / hf-static: {ratio:.2f}x")
        result.update(hf_static=hf, ratio=ratio)
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
