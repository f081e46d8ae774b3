"""How many prompts give the same first N greedy tokens in qworker as in transformers, per model
family, on the tiny random models of qworker.model.tiny_families (both sides in the same dtype).

In fp32 every prompt must match (tests/unit/test_model_families.py asserts it); in bf16 rounding
differs between any two implementations, so this counts the matching prompts and prints where each
one first diverges.

    OMP_NUM_THREADS=1 .venv/bin/python scripts/parity_families.py --dtype bfloat16 --max-tokens 32
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
from pathlib import Path

import torch

from qworker import LLM, SamplingParams
from qworker.model.tiny_families import FAMILIES, save_with_tokenizer, tiny_family_model

# Random token prompts, from shorter than the families' windows (8 and 12) to many windows long.
PROMPT_LENS = (3, 5, 9, 13, 17, 24, 31, 40, 57, 80, 101, 130)


def parity_prompts(seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 256) for _ in range(n)] for n in PROMPT_LENS]


def first_difference(want: list[int], have: list[int]) -> int | None:
    index = next((i for i, (a, b) in enumerate(zip(want, have, strict=False)) if a != b), None)
    if index is None and len(want) != len(have):
        index = min(len(want), len(have))
    return index


def count_family(model_type: str, dtype: torch.dtype, max_tokens: int, root: Path) -> dict[str, object]:
    model = tiny_family_model(model_type)
    path = save_with_tokenizer(model, root / model_type)
    model = model.to(dtype)
    prompts = parity_prompts()
    expected = []
    with torch.inference_mode():
        for ids in prompts:
            out = model.generate(
                torch.tensor([ids]),
                attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                max_new_tokens=max_tokens,
                min_new_tokens=max_tokens,
                do_sample=False,
                pad_token_id=0,
            )
            expected.append(out[0, len(ids) :].tolist())
    llm = LLM(str(path), dtype=str(dtype).removeprefix("torch."), device="cpu", num_kv_blocks=512)
    params = SamplingParams(max_tokens=max_tokens, min_tokens=max_tokens, temperature=0.0)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    first_diff = [
        first_difference(want, list(o.outputs[0].token_ids)) for want, o in zip(expected, outs, strict=True)
    ]
    return {
        "model_type": model_type,
        "num_prompts": len(prompts),
        "num_same": sum(d is None for d in first_diff),
        # Per prompt: the first output position that differs (None: all the same).
        "first_diff": first_diff,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--families", default=",".join(FAMILIES), help="comma-separated model types")
    args = parser.parse_args()
    dtype = {"bfloat16": torch.bfloat16, "float32": torch.float32}[args.dtype]
    with tempfile.TemporaryDirectory() as tmp:
        for model_type in args.families.split(","):
            row = count_family(model_type, dtype, args.max_tokens, Path(tmp))
            row.update(dtype=args.dtype, max_tokens=args.max_tokens, torch_threads=torch.get_num_threads())
            print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
