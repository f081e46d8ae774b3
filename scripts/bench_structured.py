"""Structured output, measured on SmolLM2 (a thin driver over qworker.engine).

    OMP_NUM_THREADS=2 .venv/bin/python scripts/bench_structured.py [--out result.json]

1. The schema set (tests/data/schemas/test + bench, JSONSchemaBench): the share the backend
   accepts, compile time p50/p99 (a cold compile each), the cost of a cache hit.
2. Every accepted schema generated greedily on SmolLM2: the share that ends with `stop` (and
   validates with `jsonschema`) and the share cut at `length` (a valid prefix).
3. Overhead: 64 concurrent jobs with distinct schemas (fast-forward off), against the same jobs
   unconstrained with the same token counts (ignore_eos, max_tokens = the constrained output's
   length), so both runs have the same batch at every step. Also the time spent in grammar code
   per step (masks, matcher advance, mask application), timed around those functions.
4. Fast-forward: the same 64 jobs with fast-forward on and off: wall time, steps, forced tokens.

`--compare-objects --dtype float32 --max-tokens 384` runs 1 and 2 only, twice: objects open (JSON
Schema as written, `disable_additional_properties: false`) and closed (the default), and names the
schemas that finish in one and not the other (issue 43 item 4).

Figures depend on the machine: the output names it (lscpu model, flags). Run it alone.
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import jsonschema

import qworker.engine.llm_engine as llm_engine_module
import qworker.engine.runner as runner_module
import qworker.engine.sampler as sampler_module
from qworker.config import EngineConfig
from qworker.engine.llm_engine import LLMEngine
from qworker.engine.sampling_params import SamplingParams
from qworker.engine.structured import StructuredOutputError, StructuredOutputs
from qworker.engine.structured.backend import LLGuidanceBackend
from qworker.engine.structured.compiler import GrammarCompiler

SCHEMA_DIRS = [Path(__file__).parents[1] / "tests" / "data" / "schemas" / d for d in ("test", "bench")]


def machine() -> dict[str, Any]:
    lscpu = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    fields = dict(line.split(":", 1) for line in lscpu.splitlines() if ":" in line)
    flags = fields.get("Flags", "").split()
    return {
        "cpu": fields.get("Model name", platform.processor()).strip(),
        "cpus": fields.get("CPU(s)", "").strip(),
        "bf16_flags": [f for f in flags if "bf16" in f or f.startswith("amx")],
        "note": "2-core machine shared with other engineers' processes while this ran",
    }


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def load_schemas() -> dict[str, dict]:
    out = {}
    for folder in SCHEMA_DIRS:
        for path in sorted(folder.glob("*.json")):
            out.setdefault(path.name, json.loads(path.read_text()))
    return out


def compile_set(engine: LLMEngine, schemas: dict[str, dict]) -> tuple[dict[str, Any], list[str]]:
    backend = LLGuidanceBackend(
        engine.tokenizer, engine.model_config.vocab_size, sorted(engine.eos_token_ids)
    )
    backend.compile(StructuredOutputs(json={"type": "object"}))  # builds the tokenizer once
    times, accepted, refused = [], [], {}
    for name, schema in schemas.items():
        started = time.perf_counter()
        try:
            backend.compile(StructuredOutputs(json=schema))
            accepted.append(name)
        except StructuredOutputError as exc:
            refused[name] = str(exc).split(": ", 1)[-1].strip()[:120]
        times.append(time.perf_counter() - started)
    compiler = GrammarCompiler(backend)
    spec = StructuredOutputs(json=schemas[accepted[0]])
    compiler.compile_now(spec)
    hits = []
    for _ in range(1000):
        started = time.perf_counter()
        compiled = compiler.compile_now(StructuredOutputs.from_value({"json": schemas[accepted[0]]}))
        compiled.new_matcher()
        hits.append(time.perf_counter() - started)
    compiler.close()
    reasons: dict[str, int] = defaultdict(int)
    for reason in refused.values():
        reasons[reason.split(":")[0][:60]] += 1
    return {
        "num_schemas": len(schemas),
        "num_accepted": len(accepted),
        "accepted_share": round(len(accepted) / len(schemas), 3),
        "compile_ms_p50": round(1000 * percentile(times, 0.5), 2),
        "compile_ms_p99": round(1000 * percentile(times, 0.99), 2),
        "compile_ms_max": round(1000 * max(times), 2),
        "cache_hit_ms_p50": round(1000 * percentile(hits, 0.5), 4),
        "cache_hit_ms_p99": round(1000 * percentile(hits, 0.99), 4),
        "refused_reasons": dict(reasons),
    }, accepted


def prompt(engine: LLMEngine, schema: dict) -> dict:
    about = str(schema.get("description") or schema.get("title") or "a record")[:200]
    return {
        "prompt_token_ids": engine.apply_chat_template([{"role": "user", "content": f"JSON for: {about}"}])
    }


def run(engine: LLMEngine, jobs: list[tuple[dict, SamplingParams]]) -> tuple[dict, float, int]:
    started, steps = time.perf_counter(), engine.num_steps
    for i, (p, params) in enumerate(jobs):
        engine.add_request(f"job-{i}", p, params)
    outputs = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                outputs[out.request_id] = out.output
    return outputs, time.perf_counter() - started, engine.num_steps - steps


def generation_set(
    engine: LLMEngine,
    schemas: dict[str, dict],
    accepted: list[str],
    max_tokens: int,
    closed_objects: bool | None = None,
) -> dict:
    """Greedy outputs of the accepted schemas. `closed_objects`: each request's
    structured_outputs.disable_additional_properties (None: the engine's default, closed)."""
    constraint: dict[str, Any] = {}
    if closed_objects is not None:
        constraint["disable_additional_properties"] = closed_objects
    jobs = [
        (
            prompt(engine, schemas[n]),
            SamplingParams(
                max_tokens=max_tokens, temperature=0, structured_outputs={"json": schemas[n], **constraint}
            ),
        )
        for n in accepted
    ]
    outputs, seconds, _ = run(engine, jobs)
    num_stop = num_valid = num_length = 0
    finished = []
    for i, name in enumerate(accepted):
        completion = outputs[f"job-{i}"].outputs[0]
        if completion.finish_reason == "stop":
            num_stop += 1
            finished.append(name)
            try:
                jsonschema.validators.validator_for(schemas[name])(schemas[name]).validate(
                    json.loads(completion.text)
                )
                num_valid += 1
            except (ValueError, jsonschema.ValidationError):
                pass
        else:
            num_length += 1
    return {
        "max_tokens": max_tokens,
        "num_jobs": len(accepted),
        "stop_share": round(num_stop / len(accepted), 3),
        "stop_valid": f"{num_valid}/{num_stop}",
        "length_share": round(num_length / len(accepted), 3),
        "seconds": round(seconds, 1),
        "finished": finished,
    }


class GrammarTimer:
    """Time spent in the grammar code of each step, by wrapping the functions the engine calls."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self._saved: list[tuple[Any, str, Any]] = []

    def wrap(self, module: Any, name: str) -> None:
        original = getattr(module, name)

        def timed(*args: Any, **kwargs: Any) -> Any:
            started = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - started

        self._saved.append((module, name, original))
        setattr(module, name, timed)

    def __enter__(self) -> GrammarTimer:
        self.wrap(runner_module, "fill_masks")
        self.wrap(sampler_module, "apply_token_bitmask_")
        self.wrap(llm_engine_module, "consume")
        self.wrap(llm_engine_module, "forced_tokens")
        return self

    def __exit__(self, *exc: object) -> None:
        for module, name, original in self._saved:
            setattr(module, name, original)


def speed(
    engine: LLMEngine, schemas: dict[str, dict], accepted: list[str], num_jobs: int, max_tokens: int
) -> dict:
    names = accepted[:num_jobs]
    constrained = [
        (
            prompt(engine, schemas[n]),
            SamplingParams(max_tokens=max_tokens, temperature=0, structured_outputs={"json": schemas[n]}),
        )
        for n in names
    ]
    run(engine, constrained[:4])  # warm-up: compiles cached, kernels built
    engine.structured.enable_fast_forward = False
    with GrammarTimer() as timer:
        masked, masked_s, masked_steps = run(engine, constrained)
    lengths = [len(masked[f"job-{i}"].outputs[0].token_ids) for i in range(len(names))]
    plain = [
        (p, SamplingParams(max_tokens=n, temperature=0, ignore_eos=True))
        for (p, _), n in zip(constrained, lengths, strict=True)
    ]
    _, plain_s, plain_steps = run(engine, plain)
    engine.structured.enable_fast_forward = True
    forced_before = engine.structured.num_fast_forward_tokens
    ff, ff_s, ff_steps = run(engine, constrained)
    num_forced = engine.structured.num_fast_forward_tokens - forced_before
    same = sum(
        ff[f"job-{i}"].outputs[0].token_ids == masked[f"job-{i}"].outputs[0].token_ids
        for i in range(len(names))
    )
    return {
        "num_jobs": len(names),
        "max_tokens": max_tokens,
        "num_tokens": sum(lengths),
        "masked_s": round(masked_s, 2),
        "masked_steps": masked_steps,
        "unconstrained_s": round(plain_s, 2),
        "unconstrained_steps": plain_steps,
        "overhead_wall_share": round(masked_s / plain_s - 1, 3),
        "grammar_s": round(timer.seconds, 2),
        "grammar_share_of_step_time": round(timer.seconds / masked_s, 3),
        "grammar_ms_per_step": round(1000 * timer.seconds / max(1, masked_steps), 2),
        "fast_forward_s": round(ff_s, 2),
        "fast_forward_steps": ff_steps,
        "fast_forward_tokens": num_forced,
        "fast_forward_speedup": round(masked_s / ff_s, 3),
        "fast_forward_same_tokens": f"{same}/{len(names)} (dtype {engine.dtype})",
    }


def heavy_schemas(num: int) -> dict[str, dict]:
    """Schema-heavy outputs: objects whose keys and most values the schema fixes (enums of one),
    with one free integer each: most of each output is forced."""
    out = {}
    for i in range(num):
        properties: dict[str, Any] = {
            f"field_{k}_of_record_{i}": {"enum": [f"value-{k}-{i}"]} for k in range(8)
        }
        properties["count"] = {"type": "integer", "minimum": 0, "maximum": 999}
        out[f"heavy-{i}"] = {
            "type": "object",
            "properties": properties,
            "required": list(properties),
            "additionalProperties": False,
        }
    return out


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--max-tokens", type=int, default=128, help="per job of the schema set")
    parser.add_argument("--num-jobs", type=int, default=64, help="concurrent jobs of the speed checks")
    parser.add_argument("--speed-max-tokens", type=int, default=96)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--skip-generation", action="store_true", help="compile checks and speed only")
    parser.add_argument(
        "--compare-objects",
        action="store_true",
        help="the schema set generated twice, objects open (JSON Schema as written) then closed "
        "(disable_additional_properties, the default), then stop: compile checks and generation only",
    )
    parser.add_argument("--out", type=Path)
    parser.add_argument(
        "--heavy",
        action="store_true",
        help="speed checks only, on schema-heavy generated schemas (heavy_schemas)",
    )
    args = parser.parse_args()
    # No prefix caching: every run computes its prompts, so the runs compare.
    config = EngineConfig(
        model="smollm2",
        dtype=args.dtype,
        num_kv_blocks=4096,
        max_num_seqs=256,
        max_num_batched_tokens=2048,
        enable_prefix_caching=False,
    )
    engine = LLMEngine(config)
    result: dict[str, Any] = {"machine": machine(), "dtype": str(engine.dtype)}
    if args.heavy:
        heavy = heavy_schemas(args.num_jobs)
        result["speed_heavy"] = speed(engine, heavy, list(heavy), args.num_jobs, args.speed_max_tokens)
        print(json.dumps(result, indent=2), flush=True)
        if args.out is not None:
            args.out.write_text(json.dumps(result, indent=2) + "\n")
        return
    schemas = load_schemas()
    result["compile"], accepted = compile_set(engine, schemas)
    print(json.dumps(result, indent=2), flush=True)
    if args.compare_objects:
        for name, closing in (("generation_open_objects", False), ("generation_closed_objects", True)):
            result[name] = generation_set(engine, schemas, accepted, args.max_tokens, closing)
            print(json.dumps(result[name], indent=2), flush=True)
        opened = set(result["generation_open_objects"]["finished"])
        closed = set(result["generation_closed_objects"]["finished"])
        result["finished_only_closed"] = sorted(closed - opened)
        result["finished_only_open"] = sorted(opened - closed)
        print(json.dumps({k: result[k] for k in ("finished_only_closed", "finished_only_open")}, indent=2))
        if args.out is not None:
            args.out.write_text(json.dumps(result, indent=2) + "\n")
        engine.structured.close()
        return
    if not args.skip_generation:
        result["generation"] = generation_set(engine, schemas, accepted, args.max_tokens)
        print(json.dumps(result["generation"], indent=2), flush=True)
    result["speed"] = speed(engine, schemas, accepted, args.num_jobs, args.speed_max_tokens)
    print(json.dumps(result["speed"], indent=2), flush=True)
    if args.out is not None:
        args.out.write_text(json.dumps(result, indent=2) + "\n")
    engine.structured.close()


if __name__ == "__main__":
    main()
