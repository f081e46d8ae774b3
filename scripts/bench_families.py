"""qworker against transformers' static batches on a tiny MoE (Qwen3-MoE, 8 experts, top-2) and a
tiny Gemma 3 (5 sliding-window layers to 1 global), through `qworker bench` on the same requests.

The models are random, sized so that the SmolLM2 tokenizer's ids fit (vocabulary 49,152), and
saved once as Hugging Face directories under --root; `qworker bench --model DIR` then runs both
systems and writes results.json and report.md per model under --out.

    OMP_NUM_THREADS=2 .venv/bin/python scripts/bench_families.py --num-requests 32
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

from qworker.model.tiny_families import save_with_tokenizer, tiny_family_model

VOCAB = 49152
BENCH_MODELS: dict[str, tuple[str, dict[str, Any]]] = {
    "tiny-qwen3-moe": (
        "qwen3_moe",
        dict(
            vocab_size=VOCAB, hidden_size=256, intermediate_size=512, moe_intermediate_size=256,
            num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
            num_experts=8, num_experts_per_tok=2, mlp_only_layers=[], max_position_embeddings=1024,
        ),
    ),
    "tiny-gemma3": (
        "gemma3_text",
        dict(
            vocab_size=VOCAB, hidden_size=256, intermediate_size=768, num_hidden_layers=6,
            num_attention_heads=4, num_key_value_heads=2, head_dim=64, query_pre_attn_scalar=64,
            sliding_window=128, layer_types=None, rope_parameters=None, max_position_embeddings=1024,
        ),
    ),
}  # fmt: skip


def model_dir(name: str, root: Path) -> Path:
    path = root / name
    if not (path / "config.json").is_file():
        # layer_types and rope_parameters None: Gemma 3's own pattern (five sliding-window
        # layers, then a global one) and RoPE bases (10,000 local, 1,000,000 global).
        model_type, overrides = BENCH_MODELS[name]
        save_with_tokenizer(tiny_family_model(model_type, **overrides), path)
    return path


# offline-mixed's shape at half its lengths: both systems finish on a shared 2-core machine.
WORKLOAD = {
    "name": "families-offline",
    "about": "Every request at t=0; prompts 32-256 and outputs 16-128 random tokens (ignore_eos).",
    "num_requests": 32,
    "arrival": {"process": "all_at_once"},
    "prompt_len": {"dist": "uniform", "min": 32, "max": 256},
    "output_len": {"dist": "uniform", "min": 16, "max": 128},
    "shared_prefix_len": 0,
    "temperature": 0.0,
    "ignore_eos": True,
    "seed": 0,
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--root", type=Path, default=Path("/tmp/qworker-bench-families"))
    parser.add_argument("--out", type=Path, default=Path("bench_out/families"))
    parser.add_argument(
        "--workload", default=None, help="a packaged workload or spec file (default: WORKLOAD)"
    )
    parser.add_argument("--num-requests", type=int, default=32)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--models", default=",".join(BENCH_MODELS))
    args = parser.parse_args()
    workload = args.workload
    if workload is None:
        args.out.mkdir(parents=True, exist_ok=True)
        workload = str(args.out / "families-offline.json")
        Path(workload).write_text(json.dumps(WORKLOAD, indent=2))
    for name in args.models.split(","):
        path = model_dir(name, args.root)
        out = args.out / name
        command = [
            sys.executable, "-m", "qworker", "bench", "--model", str(path), "--workload", workload,
            "--systems", "qworker,hf-static", "--num-requests", str(args.num_requests),
            "--dtype", args.dtype, "--out", str(out), "--no-compute-limit", "--no-plots", "--no-progress",
        ]  # fmt: skip
        print("$", " ".join(command), flush=True)
        subprocess.run(command, check=True)
        results = json.loads((out / "results.json").read_text())
        print(json.dumps({"model": name, "results": str(out / "results.json"), "keys": sorted(results)}))


if __name__ == "__main__":
    main()
