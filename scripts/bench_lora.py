"""Offline throughput on SmolLM2 with 0, 1, 4 and 16 distinct LoRA adapters spread over the
requests (round robin), in one run, one after the other: the base model's engine
(enable_lora off) first and last, the adapter runs in between on one engine with a slot for
each adapter. Ratios are against the mean of the two base runs (the machine is shared).

Adapters: rank 16 (alpha 32) on every projection (q, k, v, o, gate, up, down), as peft saves
them; the first made with peft, the others the same tensors with new random values. They are
loaded (one short request each) before the timed runs, so the runs measure the steps.

    .venv/bin/python scripts/bench_lora.py --num-requests 32 --adapters 0,1,4,16
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from qworker.bench.qworker_engine import sampling_params_for
from qworker.bench.workload import load_workload, requests_for_model
from qworker.config import EngineConfig
from qworker.engine.llm_engine import LLMEngine
from qworker.engine.sampling_params import SamplingParams
from qworker.lora import LoRARequest
from qworker.model.loader import load_hf_config, load_state_dict, load_tokenizer, resolve_model

TARGETS = {
    "all": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
    "attn": ["q_proj", "k_proj", "v_proj", "o_proj"],
}


def make_adapters(path: Path, root: Path, count: int, rank: int, targets: list[str]) -> list[Path]:
    from peft import LoraConfig, get_peft_model
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    first = root / "adapter-0"
    config = LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=targets, init_lora_weights=False)
    get_peft_model(base, config).save_pretrained(first)
    del base  # host memory: the engines come next
    tensors = load_file(str(first / "adapter_model.safetensors"))
    dirs = [first]
    generator = torch.Generator().manual_seed(0)
    for i in range(1, count):
        target = root / f"adapter-{i}"
        target.mkdir()
        (target / "adapter_config.json").write_text((first / "adapter_config.json").read_text())
        fresh = {k: torch.randn(v.shape, generator=generator) * v.std() for k, v in tensors.items()}
        save_file(fresh, str(target / "adapter_model.safetensors"))
        dirs.append(target)
    return dirs


def run_once(engine: LLMEngine, requests: list[Any], loras: list[LoRARequest]) -> dict[str, float]:
    started = time.perf_counter()
    for r in requests:
        lora = loras[r.index % len(loras)] if loras else None
        engine.add_request(
            r.request_id, {"prompt_token_ids": r.prompt_token_ids}, sampling_params_for(r), lora_request=lora
        )
    output_tokens = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished and out.output is not None:
                assert out.output.error is None, out.output.error
                output_tokens += len(out.output.outputs[0].token_ids)
    elapsed = time.perf_counter() - started
    prompt_tokens = sum(r.prompt_len for r in requests)
    return {
        "duration_s": round(elapsed, 2),
        "completed": len(requests),
        "request_throughput": round(len(requests) / elapsed, 3),
        "output_throughput": round(output_tokens / elapsed, 1),
        "total_token_throughput": round((output_tokens + prompt_tokens) / elapsed, 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--workload", default="offline-mixed")
    parser.add_argument("--num-requests", type=int, default=32, help="the workload's first N requests")
    parser.add_argument("--adapters", default="0,1,4,16", help="adapter counts, in run order (0: the base)")
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--targets", choices=sorted(TARGETS), default="all")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--output-len", type=int, default=None, help="every request's output length")
    parser.add_argument("--kv-cache-mib", type=int, default=384, help="each engine's KV pool")
    parser.add_argument("--out", type=Path, default=None, help="write the table as JSON here")
    args = parser.parse_args()

    counts = [int(c) for c in args.adapters.split(",")]
    path = resolve_model("smollm2").path
    hf_config, state_dict, tokenizer = load_hf_config(path), load_state_dict(path), load_tokenizer(path)
    requests = requests_for_model(load_workload(args.workload), "smollm2")[: args.num_requests]
    if args.output_len is not None:
        requests = [replace(r, output_len=args.output_len) for r in requests]
    root = Path(tempfile.mkdtemp(prefix="bench-lora-"))
    dirs = make_adapters(path, root, max(counts), args.rank, TARGETS[args.targets])
    loras = [LoRARequest(f"adapter-{i}", i + 1, str(d)) for i, d in enumerate(dirs)]

    def engine(enable_lora: bool) -> LLMEngine:
        config = EngineConfig(
            model="smollm2",
            dtype=args.dtype,
            device="cpu",
            enable_lora=enable_lora,
            max_loras=max(max(counts), 1),
            max_lora_rank=args.rank,
            kv_cache_memory_bytes=args.kv_cache_mib * 2**20,
        )
        return LLMEngine(config, hf_config=hf_config, state_dict=state_dict, tokenizer=tokenizer)

    base_engine, lora_engine = engine(False), engine(True)
    warm = SamplingParams(max_tokens=1)
    for i, lora in enumerate(loras):
        lora_engine.add_request(f"warm-{i}", {"prompt_token_ids": [1, 2, 3]}, warm, lora_request=lora)
    base_engine.add_request("warm-base", {"prompt_token_ids": [1, 2, 3]}, warm)
    for e in (base_engine, lora_engine):
        while e.has_unfinished_requests():
            e.step()

    rows = []
    for count in [0, *[c for c in counts if c > 0], 0]:
        which = base_engine if count == 0 else lora_engine
        result = run_once(which, requests, loras[:count])
        rows.append({"adapters": count, **result})
        print(json.dumps(rows[-1]), flush=True)
    base = statistics.mean(r["output_throughput"] for r in rows if r["adapters"] == 0)
    for row in rows:
        row["output_throughput_vs_base"] = round(row["output_throughput"] / base, 3)
    lscpu = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    model_name = next(
        (line.split(":", 1)[1].strip() for line in lscpu.splitlines() if "Model name" in line), "?"
    )
    load = Path("/proc/loadavg").read_text().split()[:3] if Path("/proc/loadavg").exists() else []
    machine = {
        "cpu": model_name,
        "cores": torch.get_num_threads(),
        "dtype": str(base_engine.dtype),
        "loadavg": load,
        "python": platform.python_version(),
        "torch": torch.__version__,
    }
    print(f"machine: {json.dumps(machine)}")
    print(f"{'adapters':>8} {'output tok/s':>13} {'vs base':>8} {'duration s':>11}")
    for row in rows:
        print(
            f"{row['adapters']:>8} {row['output_throughput']:>13} {row['output_throughput_vs_base']:>8} "
            f"{row['duration_s']:>11}"
        )
    if args.out is not None:
        args.out.write_text(json.dumps({"machine": machine, "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
