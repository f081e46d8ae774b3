"""lm-evaluation-harness, unchanged and installed in the test environment: the `lm_eval --model
local-completions` command of docs/gateway.md, as written there (HOST, KEY and TASKS filled in),
runs a multiple-choice (loglikelihood) task and a generate_until task from local JSONL files
(tests/data/lm_eval) through the gateway (with API keys) and the SmolLM2 worker (fp32), with no
network and no tokenizer of its own (its remote backend reads /tokenizer_info and /tokenize). Its
loglikelihoods equal the sums of qworker's own prompt_logprobs for the same tokens to 1e-4."""

from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from qworker.gateway.tokenizer import GatewayTokenizer
from qworker.jobs.job import Job
from tests.gateway.conftest import API_KEY

TASKS_DIR = Path(__file__).parent.parent / "data" / "lm_eval"
DOCS = Path(__file__).resolve().parents[2] / "docs" / "gateway.md"


def documented_command(base_url: str, key: str, tasks: str) -> tuple[dict[str, str], list[str]]:
    """The lm_eval command of docs/gateway.md with its placeholders filled in: (its environment
    assignments, its argv)."""
    text = DOCS.read_text()
    block = text[text.index("OPENAI_API_KEY=KEY lm_eval") :].split("```", 1)[0]
    words = shlex.split(block.replace("\\\n", " "))
    filled = [
        w.replace("http://HOST:8000/v1", base_url).replace("=KEY", f"={key}").replace("TASKS", tasks)
        for w in words
    ]
    env = dict(w.split("=", 1) for w in filled[: filled.index("lm_eval")])
    return env, filled[filled.index("lm_eval") + 1 :]


def lm_eval_command() -> list[str]:
    script = Path(sys.executable).with_name("lm_eval")
    return [str(script)] if script.exists() else [shutil.which("lm_eval") or "lm_eval"]


def encode_pair(tokenizer: GatewayTokenizer, context: str, continuation: str) -> tuple[list[int], list[int]]:
    """lm-eval's TemplateLM._encode_pair for a causal model: trailing spaces of the context move
    to the continuation; the whole is encoded, and the continuation is what follows the context."""
    num_spaces = len(context) - len(context.rstrip())
    if num_spaces:
        context, continuation = context[:-num_spaces], context[-num_spaces:] + continuation
    whole = tokenizer.encode(context + continuation, add_special_tokens=False)
    context_ids = tokenizer.encode(context, add_special_tokens=False)
    return context_ids, whole[len(context_ids) :]


@pytest.mark.timeout(240)
def test_lm_eval_local_completions(gateway, worker, store, tmp_path):
    output = tmp_path / "out"
    documented_env, documented_args = documented_command(gateway.base_url, API_KEY, "qworker_mc,qworker_gen")
    assert documented_env == {"OPENAI_API_KEY": API_KEY}
    env = {
        **os.environ,
        **documented_env,
        "HF_DATASETS_OFFLINE": "1",
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "OMP_NUM_THREADS": "1",
        "HF_DATASETS_CACHE": str(tmp_path / "datasets"),
    }
    done = subprocess.run(
        [
            *lm_eval_command(),
            *documented_args,
            "--include_path",
            str(TASKS_DIR),
            "--log_samples",
            "--output_path",
            str(output),
        ],
        cwd=TASKS_DIR,  # the tasks' data_files are relative to it
        env=env,
        capture_output=True,
        text=True,
        timeout=220,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    [results_file] = output.glob("*/results_*.json")
    results = json.loads(results_file.read_text())["results"]
    assert 0.0 <= results["qworker_mc"]["acc,none"] <= 1.0
    assert "exact_match,none" in results["qworker_gen"]
    [generated] = output.glob("*/samples_qworker_gen_*.jsonl")
    gen_samples = [json.loads(line) for line in generated.read_text().splitlines()]
    assert len(gen_samples) == 2 and all(s["resps"][0][0] for s in gen_samples)

    # qworker's own prompt logprobs for the same tokens, submitted straight to the queue.
    tokenizer = GatewayTokenizer.load("smollm2", None, None)
    [scored] = output.glob("*/samples_qworker_mc_*.jsonl")
    pairs, lm_eval_logprobs = [], []
    for line in scored.read_text().splitlines():
        sample = json.loads(line)
        for key, response in zip(sorted(sample["arguments"]), sample["resps"], strict=True):
            args = sample["arguments"][key]
            pairs.append(encode_pair(tokenizer, args["arg_0"], args["arg_1"]))
            lm_eval_logprobs.append(float(response[0][0]))
    assert len(pairs) == 12
    jobs = [
        Job(prompt_token_ids=ctx + cont, params={"max_tokens": 1, "temperature": 0, "prompt_logprobs": 0})
        for ctx, cont in pairs
    ]
    job_results = store.results(store.submit_many(jobs), timeout=120)
    for (ctx, cont), result, reported in zip(pairs, job_results, lm_eval_logprobs, strict=True):
        assert result.status.value == "completed", result.error
        positions = result.prompt_logprobs[len(ctx) : len(ctx) + len(cont)]
        ours = sum(p.logprob for p in positions)
        assert ours == pytest.approx(reported, abs=1e-4), (ctx, cont)
