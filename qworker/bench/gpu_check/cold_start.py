"""GPU check stage `cold_start`: a worker's time to ready for a model with the shape of
Llama-3.2-1B (random bf16 weights saved as a Hugging Face directory), with CUDA-graph capture.

Each start is a fresh process (`python -m qworker.bench.gpu_check.cold_start --child ...`), so it
pays the CUDA context, the imports and the Triton compiles as a worker does. It builds the engine
through qworker.engine.startup.load_engine_in_phases, the path `qworker worker` takes, and
prints the phases as JSON:
  cold  an empty Triton cache and an empty qworker cache: every kernel compiles;
  warm  the same caches again (what a pod with the cache volume finds): kernels load from disk.
Queue connect is not part of it (the GPU machine has no queue libraries); first_request_s is one
short greedy request after ready, which compiles what capture did not (prefill shapes).

On the CPU smoke run: the smoke model on the CPU, no graph capture.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from qworker.bench.gpu_check.report import Report
from qworker.bench.gpu_check.runs import build_hf_model
from qworker.bench.gpu_check.sizes import Sizes

CHILD_TIMEOUT_S = 240
# The first request: 128 prompt tokens (fewer where the context is short), 16 new ones.
MAX_PROMPT_TOKENS = 128


def stage_cold_start(sizes: Sizes, report: Report) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="qworker-cold-") as tmp:
        root = Path(tmp)
        saved_at = time.perf_counter()
        model_dir = write_model_dir(root / "model", sizes)
        result: dict[str, Any] = {
            "model": "Llama-3.2-1B shape, random weights" if sizes.device == "cuda" else "smoke model",
            "dtype": sizes.e2e_dtype,
            "checkpoint_bytes": sum(p.stat().st_size for p in model_dir.glob("*.safetensors")),
            "save_s": round(time.perf_counter() - saved_at, 2),
        }
        env = {
            **os.environ,
            "TRITON_CACHE_DIR": str(root / "triton"),
            "QWORKER_CACHE_DIR": str(root / "qworker-cache"),
        }
        failures = []
        labels = ("cold", "warm")
        for i, label in enumerate(labels):
            if report.remaining() < 5:
                result[label] = {"skipped": "out of the stage's time"}
                continue
            # The cold start gets what is left less the warm one's share (a warm start is faster).
            share = 0.6 if i == 0 else 1.0
            timeout = min(CHILD_TIMEOUT_S, max(5.0, share * report.remaining()))
            start = run_child(model_dir, sizes, env, timeout)
            result[label] = start
            if "error" in start:
                failures.append(f"{label} start: {start['error'].strip().splitlines()[-1]}")
        if failures:
            result["failures"] = failures
        return result


def write_model_dir(target: Path, sizes: Sizes) -> Path:
    """The e2e model's shape as a Hugging Face directory: safetensors and a small word-level
    tokenizer (the engine loads one; the GPU machine has no tokenizer files)."""
    import torch
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace
    from transformers import PreTrainedTokenizerFast

    dtype = getattr(torch, sizes.e2e_dtype)
    model = build_hf_model(sizes.e2e_model, dtype, sizes.device)
    model.save_pretrained(target, safe_serialization=True)
    del model
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i for i in range(3, 256)}}
    backend = Tokenizer(WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = Whitespace()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, unk_token="<unk>", bos_token="<s>", eos_token="</s>"
    )
    tokenizer.save_pretrained(target)
    return target


def run_child(model_dir: Path, sizes: Sizes, env: dict[str, str], timeout_s: float) -> dict[str, Any]:
    command = [
        sys.executable,
        "-m",
        "qworker.bench.gpu_check.cold_start",
        "--child",
        str(model_dir),
        "--device",
        sizes.device,
        "--dtype",
        sizes.e2e_dtype,
        "--max-model-len",
        str(sizes.e2e_max_model_len),
        "--kv-cache-gb",
        str(sizes.e2e_kv_cache_gb),
        "--max-num-seqs",
        str(sizes.e2e_max_num_seqs),
    ]
    started = time.perf_counter()
    try:
        done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return {"error": f"no ready within {timeout_s:.0f}s"}
    wall_s = round(time.perf_counter() - started, 2)
    if done.returncode != 0:
        return {"error": f"exit {done.returncode}: {done.stderr[-2000:]}", "wall_s": wall_s}
    return {**json.loads(done.stdout.strip().splitlines()[-1]), "wall_s": wall_s}


def child_main(args: argparse.Namespace) -> None:
    """One start, in this fresh process: the phases to ready, then one request; JSON on stdout."""
    from qworker.startup import StartupTimings, process_age_s

    timings = StartupTimings()
    import torch

    from qworker.config import EngineConfig
    from qworker.engine.sampling_params import SamplingParams
    from qworker.engine.startup import describe_hardware, load_engine_in_phases

    if args.device == "cuda":
        torch.cuda.init()  # the CUDA context: part of a worker's import-to-ready time
    imported_at = process_age_s()
    if imported_at is not None:
        timings.record("import", imported_at)
    config = EngineConfig(
        model=args.model,
        dtype=args.dtype,
        device=args.device,
        max_model_len=args.max_model_len,
        kv_cache_memory_bytes=int(args.kv_cache_gb * 2**30),
        max_num_seqs=args.max_num_seqs,
    )
    engine = load_engine_in_phases(config, timings)
    timings.mark_ready()
    graphs = engine.runner.cuda_graphs
    started = time.perf_counter()
    num_prompt = min(MAX_PROMPT_TOKENS, args.max_model_len // 4)
    prompt = [3 + i % 200 for i in range(num_prompt)]  # ids every vocabulary here has
    engine.add_request("first", {"prompt_token_ids": prompt}, SamplingParams(max_tokens=16, temperature=0.0))
    while engine.has_unfinished_requests():
        engine.step()
    if args.device == "cuda":
        torch.cuda.synchronize()
    hardware = describe_hardware(engine)
    print(
        json.dumps(
            {
                "phases_s": {name: round(s, 3) for name, s in timings.seconds.items()},
                "to_ready_s": None if timings.to_ready_s is None else round(timings.to_ready_s, 3),
                "first_request_s": round(time.perf_counter() - started, 3),
                "graph_sizes": None if graphs is None else graphs.sizes,
                "device_name": hardware.device_name,
                "num_kv_blocks": hardware.num_kv_blocks,
            }
        ),
        flush=True,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description="one timed engine start (the cold_start stage's child)")
    parser.add_argument("--child", dest="model", required=True)
    parser.add_argument("--device", required=True)
    parser.add_argument("--dtype", required=True)
    parser.add_argument("--max-model-len", type=int, required=True)
    parser.add_argument("--kv-cache-gb", type=float, required=True)
    parser.add_argument("--max-num-seqs", type=int, required=True)
    child_main(parser.parse_args())


if __name__ == "__main__":
    main()
