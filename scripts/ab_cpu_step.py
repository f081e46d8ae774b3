"""A/B of engine steps in one process: two engines on the same requests, stepped in turns, so that a
shared machine's load hits both alike. B is the engine as configured; A has some of the CPU
speed-ups switched off:

  --a torch-ops   the model's elementwise ops in plain torch instead of the C kernels
  --a unpacked    F.linear instead of the packed oneDNN weights
  --a sdpa        prefill attention through torch's SDPA, a sequence at a time, instead of the
                  C kernel
  --a kv-write    the KV-cache write by torch's index_copy_ instead of the C kernel's memcpy
  --a step-sharing  requests admitted in one step do not share the blocks another of them
                  fills in it (blocks cached only after the step), as before prefix caching
                  within a step; try it with --workload shared-prefix
  (torch-ops,unpacked,sdpa, the default, is the engine before the first round of them)
  --batch-invariant  B runs with EngineConfig.batch_invariant=True (with --a "": the mode's cost)

Both engines get `offline-mixed`'s requests (or --num-requests of them) all at once and run
--steps steps each (prefill steps first, then decode steps). It prints the median time of each
kind of step for A and B, and the ratio A / B (above 1: B is faster), and how many of the steps'
sampled tokens were equal.

    .venv/bin/python scripts/ab_cpu_step.py --a torch-ops,unpacked,sdpa --steps 60
"""

from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import replace

import torch

from qworker.bench.qworker_engine import sampling_params_for
from qworker.bench.workload import load_workload, requests_for_model
from qworker.config import EngineConfig
from qworker.engine.llm_engine import LLMEngine
from qworker.model.linear import Linear
from qworker.model.ops import TORCH_OPS

SWITCHES = ("torch-ops", "unpacked", "sdpa", "kv-write", "step-sharing")


def switch_off(engine: LLMEngine, switches: list[str]) -> None:
    model = engine.runner.model
    for module in model.modules():
        if "torch-ops" in switches and hasattr(module, "ops"):
            module.ops = TORCH_OPS
        if "unpacked" in switches and isinstance(module, Linear):
            module.packed.enabled = False
    if "unpacked" in switches:
        model.lm_head_packed.enabled = False
    if "sdpa" in switches:
        engine.runner.backend._prefill_kernel = None
    if "kv-write" in switches:
        engine.runner.backend._kv_writer = None
    if "step-sharing" in switches:
        engine.kv_cache_manager.cache_scheduled_blocks = lambda request, num_tokens: None  # type: ignore[method-assign]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--a", default="torch-ops,unpacked,sdpa", help=f"what A switches off: {SWITCHES}")
    parser.add_argument("--workload", default="offline-mixed")
    parser.add_argument("--num-requests", type=int, default=None)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--num-kv-blocks", type=int, default=None, help="per engine (default: the engine's)")
    parser.add_argument("--batch-invariant", action="store_true", help="B with batch_invariant=True")
    args = parser.parse_args()
    switches = [s for s in args.a.split(",") if s]
    assert all(s in SWITCHES for s in switches), f"--a takes {SWITCHES}"

    spec = load_workload(args.workload).with_overrides(num_requests=args.num_requests)
    requests = requests_for_model(spec, "smollm2")
    config = EngineConfig(dtype=args.dtype, device="cpu", num_kv_blocks=args.num_kv_blocks)
    engines = {"A": LLMEngine(config), "B": LLMEngine(replace(config, batch_invariant=args.batch_invariant))}
    switch_off(engines["A"], switches)
    for engine in engines.values():
        engine.add_request("warmup", {"prompt_token_ids": [33] * 64}, sampling_params_for(requests[0]))
        while engine.has_unfinished_requests():
            engine.step()
        for request in requests:
            engine.add_request(
                request.request_id,
                {"prompt_token_ids": request.prompt_token_ids},
                sampling_params_for(request),
            )
    times: dict[tuple[str, str], list[float]] = {}
    num_equal = num_tokens = 0
    for step in range(args.steps):
        tokens = {}
        # Alternate which engine goes first, so neither always follows the other's cache state.
        order = ("A", "B") if step % 2 == 0 else ("B", "A")
        for name in order:
            engine = engines[name]
            is_prefill = any(
                r.num_computed_tokens < r.num_prompt_tokens for r in engine.scheduler.running
            ) or bool(engine.scheduler.num_waiting)
            kind = "prefill" if is_prefill else "decode"
            start = time.perf_counter()
            outputs = engine.step()
            times.setdefault((name, kind), []).append(time.perf_counter() - start)
            tokens[name] = {o.request_id: o.new_token_ids for o in outputs}
        for request_id, token_ids in tokens["B"].items():
            num_tokens += 1
            num_equal += tokens["A"].get(request_id) == token_ids
    print(f"dtype {engines['B'].dtype}, {torch.get_num_threads()} threads, A = B with {switches} off")
    for kind in ("prefill", "decode"):
        a, b = times.get(("A", kind)), times.get(("B", kind))
        if not a or not b:
            continue
        ma, mb = statistics.median(a) * 1000, statistics.median(b) * 1000
        print(f"{kind:8s} steps {len(b):3d}: A {ma:8.1f} ms  B {mb:8.1f} ms  A/B {ma / mb:5.2f}")
    total_a = sum(sum(v) for (n, _), v in times.items() if n == "A")
    total_b = sum(sum(v) for (n, _), v in times.items() if n == "B")
    print(f"all {args.steps} steps: A {total_a:.2f} s  B {total_b:.2f} s  A/B {total_a / total_b:.2f}")
    print(f"sampled tokens equal in A and B: {num_equal}/{num_tokens}")
    computed = {name: e.scheduler.num_prompt_tokens_computed for name, e in engines.items()}
    print(f"prompt tokens computed: A {computed['A']}  B {computed['B']}")


if __name__ == "__main__":
    main()
