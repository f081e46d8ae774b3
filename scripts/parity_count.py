"""How many of the parity prompts give the same first N greedy tokens in qworker as in transformers.

The prompts are the ones the fp32 parity tests use (tests/integration/test_parity_smollm2.py). In
fp32 every prompt must match (the tests assert it); in bf16 rounding differs between any two
implementations, so this counts the matching prompts and prints where each one first diverges.

    OMP_NUM_THREADS=1 .venv/bin/python scripts/parity_count.py --dtype bfloat16 --max-tokens 32

Twelve prompts make a coarse count: any change of rounding moves a few of them. `--random-prompts
N` adds N prompts of random token ids (seeded, 16-200 tokens), to compare two builds on more.
"""

from __future__ import annotations

import argparse
import json

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from qworker import LLM, SamplingParams
from qworker.model.loader import resolve_model
from tests.integration.test_parity_smollm2 import CHATS, RAW_PROMPTS


def prompt_token_ids(path: str) -> list[list[int]]:
    tokenizer = AutoTokenizer.from_pretrained(path)
    raw = [tokenizer.encode(p, add_special_tokens=False) for p in RAW_PROMPTS]
    chats = []
    for chat in CHATS:
        ids = tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=True)
        chats.append(list(ids["input_ids"] if hasattr(ids, "keys") else ids))
    return raw + chats


def random_prompts(num: int, vocab_size: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(0)
    lengths = torch.randint(16, 201, (num,), generator=generator).tolist()
    return [torch.randint(0, vocab_size, (n,), generator=generator).tolist() for n in lengths]


def transformers_greedy(path: str, prompts: list[list[int]], dtype: torch.dtype, n: int) -> list[list[int]]:
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()
    outs = []
    with torch.inference_mode():
        for ids in prompts:
            gen = model.generate(
                torch.tensor([ids]),
                attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                max_new_tokens=n,
                do_sample=False,
                temperature=None,
                top_p=None,
                top_k=None,
            )
            outs.append(gen[0, len(ids) :].tolist())
    return outs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--random-prompts", type=int, default=0, help="add this many random-token prompts")
    args = parser.parse_args()
    dtype = {"bfloat16": torch.bfloat16, "float32": torch.float32}[args.dtype]
    path = str(resolve_model("smollm2").path)
    prompts = prompt_token_ids(path)
    if args.random_prompts:
        prompts += random_prompts(args.random_prompts, AutoTokenizer.from_pretrained(path).vocab_size)
    expected = transformers_greedy(path, prompts, dtype, args.max_tokens)
    llm = LLM("smollm2", dtype=args.dtype, num_kv_blocks=max(400, 20 * len(prompts)))
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    got = [list(o.outputs[0].token_ids) for o in outs]
    first_diff = []
    for want, have in zip(expected, got, strict=True):
        # Both stop at EOS, so a shorter list is a difference too.
        index = next((i for i, (a, b) in enumerate(zip(want, have, strict=False)) if a != b), None)
        if index is None and len(want) != len(have):
            index = min(len(want), len(have))
        first_diff.append(index)
    num_same = sum(d is None for d in first_diff)
    print(
        json.dumps(
            {
                "dtype": args.dtype,
                "max_tokens": args.max_tokens,
                "torch_threads": torch.get_num_threads(),
                "num_prompts": len(prompts),
                "num_same": num_same,
                "num_same_of_first_12": sum(d is None for d in first_diff[:12]),
                # Per prompt: the first output position that differs (None: all the same).
                "first_diff": first_diff,
            }
        )
    )


if __name__ == "__main__":
    main()
