"""Workload specs (JSON; the project's own ship in qworker/bench/workloads/) and deterministic
request generation.

A spec and its seed always give the same requests. Prompt tokens, output lengths, the shared
prefix and arrival gaps each draw from their own random stream (spawned from the seed), so
overriding the rate or the number of requests changes nothing else: request i keeps its
prompt and output length whatever the rate, and only its arrival time moves.
"""

from __future__ import annotations

import functools
import hashlib
import json
import math
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from importlib import resources
from pathlib import Path
from typing import Any

import numpy as np

from qworker.bench.workloads import packaged_workloads

# Llama-family vocabularies start with control tokens (SmolLM2: ids 0-16); random prompts skip
# the low ids so they never contain an EOS or chat marker.
MIN_RANDOM_TOKEN_ID = 32

ARRIVAL_PROCESSES = ("all_at_once", "poisson", "gamma", "fixed_concurrency")
LENGTH_DISTS = ("fixed", "uniform", "lognormal", "jsonl")

Tokenize = Callable[[str], list[int]]
# The folder of qworker.bench that holds the packaged specs (package data).
PACKAGED_FOLDER = "workloads"


class WorkloadError(ValueError):
    """A workload spec that cannot be used as written."""


@dataclass(frozen=True)
class ArrivalSpec:
    """When requests are sent.

    poisson: exponential gaps at `rate` per second. gamma: gaps with shape `burstiness`
    (vLLM's meaning: 1 is Poisson, below 1 burstier, above 1 more regular). all_at_once: every
    request at t=0. fixed_concurrency: all at t=0, but at most `concurrency` outstanding (a
    closed loop: a request is sent when an earlier one finishes). `max_concurrency` caps the
    outstanding requests of any process, like vLLM's --max-concurrency.
    """

    process: str = "all_at_once"
    rate: float | None = None
    burstiness: float = 1.0
    concurrency: int | None = None
    max_concurrency: int | None = None

    @property
    def concurrency_limit(self) -> int | None:
        if self.process == "fixed_concurrency":
            return self.concurrency
        return self.max_concurrency


@dataclass(frozen=True)
class LengthSpec:
    """A token-length distribution, clipped to [min, max] when those are given."""

    dist: str
    value: int | None = None  # fixed
    min: int | None = None
    max: int | None = None
    median: float | None = None  # lognormal
    sigma: float | None = None  # lognormal
    path: str | None = None  # jsonl, resolved against the spec's folder
    field: str | None = None  # jsonl


@dataclass(frozen=True)
class WorkloadSpec:
    name: str
    num_requests: int
    arrival: ArrivalSpec
    prompt_len: LengthSpec
    output_len: LengthSpec
    shared_prefix_len: int = 0
    # Distinct prefixes of shared_prefix_len tokens; request i starts with prefix i % num_prefixes
    # (interleaved: a pool's workers see every prefix unless the queue routes them by affinity).
    num_prefixes: int = 1
    temperature: float = 0.0
    ignore_eos: bool = True
    seed: int = 0
    about: str = ""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def with_overrides(
        self, *, num_requests: int | None = None, rate: float | None = None, seed: int | None = None
    ) -> WorkloadSpec:
        """A copy with another request count, rate or seed.

        A rate turns any arrival process into Poisson (gamma, keeping the burstiness, when the
        spec is gamma) at that rate; `math.inf` means all at once, as vLLM's --request-rate inf.
        A concurrency cap in the spec is kept.
        """
        spec = self
        if num_requests is not None:
            if num_requests < 1:
                raise WorkloadError(f"num_requests must be >= 1, got {num_requests}")
            spec = replace(spec, num_requests=num_requests)
        if seed is not None:
            spec = replace(spec, seed=seed)
        if rate is not None:
            if not rate > 0:
                raise WorkloadError(f"rate must be > 0 (or inf), got {rate}")
            cap = spec.arrival.concurrency_limit
            if math.isinf(rate):
                arrival = ArrivalSpec("all_at_once", max_concurrency=cap)
            else:
                process = "gamma" if spec.arrival.process == "gamma" else "poisson"
                arrival = ArrivalSpec(
                    process, rate=rate, burstiness=spec.arrival.burstiness, max_concurrency=cap
                )
            spec = replace(spec, arrival=arrival)
        return spec


@dataclass(frozen=True)
class BenchRequest:
    """One request of a workload: what to send and when (seconds after the run starts)."""

    request_id: str
    index: int
    prompt_token_ids: list[int] = field(repr=False)
    output_len: int
    arrival_s: float
    temperature: float = 0.0
    ignore_eos: bool = True

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_token_ids)


# -- parsing ---------------------------------------------------------------------------------


def _check_keys(where: str, data: dict[str, Any], allowed: set[str]) -> None:
    unknown = sorted(set(data) - allowed)
    if unknown:
        raise WorkloadError(f"{where}: unknown key(s) {unknown}; allowed: {sorted(allowed)}")


def _positive_int(where: str, value: Any, *, allow_zero: bool = False) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < (0 if allow_zero else 1):
        raise WorkloadError(f"{where} must be an integer >= {0 if allow_zero else 1}, got {value!r}")
    return value


def _parse_arrival(data: Any) -> ArrivalSpec:
    if not isinstance(data, dict):
        raise WorkloadError(f"arrival must be an object, got {data!r}")
    _check_keys("arrival", data, {"process", "rate", "burstiness", "concurrency", "max_concurrency"})
    process = data.get("process", "all_at_once")
    if process not in ARRIVAL_PROCESSES:
        raise WorkloadError(f"arrival.process must be one of {ARRIVAL_PROCESSES}, got {process!r}")
    rate = data.get("rate")
    burstiness = data.get("burstiness", 1.0)
    if process in ("poisson", "gamma"):
        if not isinstance(rate, (int, float)) or not rate > 0:
            raise WorkloadError(f"arrival.rate must be > 0 for {process}, got {rate!r}")
        if not isinstance(burstiness, (int, float)) or not burstiness > 0:
            raise WorkloadError(f"arrival.burstiness must be > 0, got {burstiness!r}")
        if process == "poisson" and burstiness != 1.0:
            # Keep the name honest: Poisson is gamma with shape 1.
            process = "gamma"
    concurrency = data.get("concurrency")
    if process == "fixed_concurrency":
        concurrency = _positive_int("arrival.concurrency", concurrency)
    max_concurrency = data.get("max_concurrency")
    if max_concurrency is not None:
        max_concurrency = _positive_int("arrival.max_concurrency", max_concurrency)
    return ArrivalSpec(
        process=process,
        rate=float(rate) if rate is not None else None,
        burstiness=float(burstiness),
        concurrency=concurrency,
        max_concurrency=max_concurrency,
    )


def _parse_length(name: str, data: Any, base_dir: Path | None) -> LengthSpec:
    if isinstance(data, int) and not isinstance(data, bool):
        data = {"dist": "fixed", "value": data}
    if not isinstance(data, dict):
        raise WorkloadError(f"{name} must be an integer or an object, got {data!r}")
    _check_keys(name, data, {"dist", "value", "min", "max", "median", "sigma", "path", "field"})
    dist = data.get("dist")
    if dist not in LENGTH_DISTS:
        raise WorkloadError(f"{name}.dist must be one of {LENGTH_DISTS}, got {dist!r}")
    lo = data.get("min")
    hi = data.get("max")
    if lo is not None:
        lo = _positive_int(f"{name}.min", lo)
    if hi is not None:
        hi = _positive_int(f"{name}.max", hi)
    if lo is not None and hi is not None and lo > hi:
        raise WorkloadError(f"{name}: min ({lo}) > max ({hi})")
    spec = LengthSpec(dist=dist, min=lo, max=hi)
    if dist == "fixed":
        spec = replace(spec, value=_positive_int(f"{name}.value", data.get("value")))
    elif dist == "uniform":
        if lo is None or hi is None:
            raise WorkloadError(f"{name}: uniform needs min and max")
    elif dist == "lognormal":
        median, sigma = data.get("median"), data.get("sigma")
        if not isinstance(median, (int, float)) or not median > 0:
            raise WorkloadError(f"{name}.median must be > 0, got {median!r}")
        if not isinstance(sigma, (int, float)) or not sigma >= 0:
            raise WorkloadError(f"{name}.sigma must be >= 0, got {sigma!r}")
        spec = replace(spec, median=float(median), sigma=float(sigma))
    else:  # jsonl
        path = data.get("path")
        if not isinstance(path, str) or not path:
            raise WorkloadError(f"{name}: jsonl needs a path")
        resolved = Path(path) if Path(path).is_absolute() or base_dir is None else base_dir / path
        if not resolved.is_file():
            raise WorkloadError(f"{name}: jsonl file {resolved} does not exist")
        spec = replace(spec, path=str(resolved), field=data.get("field", name))
    return spec


def parse_workload(data: dict[str, Any], base_dir: Path | None = None) -> WorkloadSpec:
    """Validate a spec dict. Relative jsonl paths are taken from `base_dir`."""
    if not isinstance(data, dict):
        raise WorkloadError("a workload spec must be a JSON object")
    _check_keys(
        "workload",
        data,
        {
            "name",
            "about",
            "num_requests",
            "arrival",
            "prompt_len",
            "output_len",
            "shared_prefix_len",
            "num_prefixes",
            "temperature",
            "ignore_eos",
            "seed",
        },
    )
    for required in ("num_requests", "prompt_len", "output_len"):
        if required not in data:
            raise WorkloadError(f"workload: missing {required!r}")
    temperature = data.get("temperature", 0.0)
    if not isinstance(temperature, (int, float)) or temperature < 0:
        raise WorkloadError(f"temperature must be >= 0, got {temperature!r}")
    ignore_eos = data.get("ignore_eos", True)
    if not isinstance(ignore_eos, bool):
        raise WorkloadError(f"ignore_eos must be true or false, got {ignore_eos!r}")
    seed = data.get("seed", 0)
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise WorkloadError(f"seed must be a non-negative integer, got {seed!r}")
    num_prefixes = _positive_int("num_prefixes", data.get("num_prefixes", 1))
    if num_prefixes > 1 and not data.get("shared_prefix_len"):
        raise WorkloadError("num_prefixes > 1 needs a shared_prefix_len > 0 (the prefixes' length)")
    return WorkloadSpec(
        name=str(data.get("name", "workload")),
        about=str(data.get("about", "")),
        num_requests=_positive_int("num_requests", data["num_requests"]),
        arrival=_parse_arrival(data.get("arrival", {"process": "all_at_once"})),
        prompt_len=_parse_length("prompt_len", data["prompt_len"], base_dir),
        output_len=_parse_length("output_len", data["output_len"], base_dir),
        shared_prefix_len=_positive_int(
            "shared_prefix_len", data.get("shared_prefix_len", 0), allow_zero=True
        ),
        num_prefixes=num_prefixes,
        temperature=float(temperature),
        ignore_eos=ignore_eos,
        seed=seed,
    )


def load_workload(path_or_name: str | Path) -> WorkloadSpec:
    """A spec from a JSON file, or by the name of a packaged spec (`offline-mixed`).

    An existing file wins over a packaged name; relative jsonl paths in a file are taken from
    the file's folder.
    """
    path = Path(path_or_name)
    if path.is_file():
        return _parse_json(path.read_text(), str(path), base_dir=path.parent)
    name = str(path_or_name).removesuffix(".json")
    if name in packaged_workloads():
        entry = resources.files("qworker.bench") / PACKAGED_FOLDER / f"{name}.json"
        return _parse_json(entry.read_text(), f"packaged workload {name!r}", base_dir=None)
    raise WorkloadError(
        f"workload {str(path_or_name)!r} does not exist: not a file, nor a packaged workload "
        f"({', '.join(packaged_workloads())})"
    )


def _parse_json(text: str, where: str, base_dir: Path | None) -> WorkloadSpec:
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise WorkloadError(f"{where} is not valid JSON: {exc}") from None
    return parse_workload(data, base_dir=base_dir)


# -- generation ------------------------------------------------------------------------------


def _clip(values: np.ndarray, spec: LengthSpec) -> np.ndarray:
    lo = spec.min if spec.min is not None else 1
    hi = spec.max if spec.max is not None else np.iinfo(np.int64).max
    return np.clip(values, lo, hi)


def _read_jsonl_field(spec: LengthSpec) -> list[Any]:
    assert spec.path is not None and spec.field is not None, "jsonl spec without path or field"
    values = []
    with open(spec.path) as f:
        for line_no, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise WorkloadError(f"{spec.path}:{line_no}: not JSON ({exc})") from None
            if not isinstance(row, dict) or spec.field not in row:
                raise WorkloadError(f"{spec.path}:{line_no}: no field {spec.field!r}")
            values.append(row[spec.field])
    if not values:
        raise WorkloadError(f"{spec.path}: no rows")
    return values


def _jsonl_items(spec: LengthSpec, n: int, tokenize: Tokenize | None) -> list[int | list[int]]:
    """Rows in file order, cycled to n. Each is a length (int) or token ids (from text or a list).

    File order (no resampling) keeps a row's prompt and output length paired when both specs
    read the same file.
    """
    raw = _read_jsonl_field(spec)
    items: list[int | list[int]] = []
    for value in raw:
        if isinstance(value, bool):
            raise WorkloadError(f"{spec.path}: {spec.field} value {value!r} is not a length, text or ids")
        if isinstance(value, int):
            items.append(value)
        elif isinstance(value, str):
            if tokenize is None:
                raise WorkloadError(f"{spec.path}: text in {spec.field!r} needs a tokenizer")
            items.append(tokenize(value))
        elif isinstance(value, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in value):
            items.append(list(value))
        else:
            raise WorkloadError(f"{spec.path}: {spec.field} value {value!r} is not a length, text or ids")
    return [items[i % len(items)] for i in range(n)]


def sample_lengths(spec: LengthSpec, n: int, rng: np.random.Generator) -> np.ndarray:
    """n lengths (>= 1) from a fixed, uniform or lognormal spec."""
    if spec.dist == "fixed":
        assert spec.value is not None, "fixed length without a value"
        values = np.full(n, spec.value, dtype=np.int64)
    elif spec.dist == "uniform":
        assert spec.min is not None and spec.max is not None, "uniform without min/max"
        values = rng.integers(spec.min, spec.max, size=n, endpoint=True)
    elif spec.dist == "lognormal":
        assert spec.median is not None and spec.sigma is not None, "lognormal without median/sigma"
        values = np.rint(rng.lognormal(math.log(spec.median), spec.sigma, size=n)).astype(np.int64)
    else:
        raise AssertionError(f"sample_lengths does not handle {spec.dist!r}")
    return np.maximum(_clip(values, spec), 1)


def _arrival_gaps(arrival: ArrivalSpec, n: int, rng: np.random.Generator) -> np.ndarray:
    if arrival.process in ("all_at_once", "fixed_concurrency"):
        return np.zeros(n)
    assert arrival.rate is not None, f"{arrival.process} without a rate"
    # Gamma gaps with shape k and mean 1/rate (vLLM's burstiness). Unit-mean draws scaled by the
    # rate, so the same seed gives the same pattern at every rate, only stretched.
    shape = arrival.burstiness
    unit = rng.gamma(shape, 1.0 / shape, size=n)
    return unit / arrival.rate


def generate_requests(
    spec: WorkloadSpec,
    vocab_size: int,
    tokenize: Tokenize | None = None,
    excluded_token_ids: Sequence[int] = (),
) -> list[BenchRequest]:
    """The workload's requests, in arrival order; the first arrives at t=0."""
    if vocab_size <= MIN_RANDOM_TOKEN_ID:
        raise WorkloadError(f"vocab_size {vocab_size} too small for random prompts")
    n = spec.num_requests
    seeds = np.random.SeedSequence(spec.seed).spawn(5)
    prompt_rng, output_rng, token_rng, prefix_rng, arrival_rng = (np.random.default_rng(s) for s in seeds)
    allowed = np.setdiff1d(np.arange(MIN_RANDOM_TOKEN_ID, vocab_size), np.asarray(excluded_token_ids))

    def random_ids(rng: np.random.Generator, length: int) -> list[int]:
        return allowed[rng.integers(0, len(allowed), size=length)].tolist()

    # The first prefix is the one a single-prefix spec has always drawn; more follow it.
    prefixes = [random_ids(prefix_rng, spec.shared_prefix_len) for _ in range(spec.num_prefixes)]

    prompts: list[list[int]] = []
    if spec.prompt_len.dist == "jsonl":
        for item in _jsonl_items(spec.prompt_len, n, tokenize):
            if isinstance(item, int):
                prompts.append(random_ids(token_rng, int(_clip(np.array([item]), spec.prompt_len)[0])))
            else:
                ids = item[: spec.prompt_len.max] if spec.prompt_len.max is not None else item
                if not ids:
                    raise WorkloadError(f"{spec.prompt_len.path}: an empty prompt")
                prompts.append(list(ids))
    else:
        for length in sample_lengths(spec.prompt_len, n, prompt_rng):
            prompts.append(random_ids(token_rng, int(length)))

    if spec.output_len.dist == "jsonl":
        items = _jsonl_items(spec.output_len, n, tokenize)
        raw = np.array([item if isinstance(item, int) else len(item) for item in items], dtype=np.int64)
        output_lens = np.maximum(_clip(raw, spec.output_len), 1)
    else:
        output_lens = sample_lengths(spec.output_len, n, output_rng)

    gaps = _arrival_gaps(spec.arrival, n, arrival_rng)
    # The first request opens the run at t=0 (a gap before it would only add idle time).
    arrivals = np.concatenate([[0.0], np.cumsum(gaps[1:])]) if n else np.zeros(0)
    return [
        BenchRequest(
            request_id=f"{spec.name}-{i:05d}",
            index=i,
            prompt_token_ids=prefixes[i % spec.num_prefixes] + prompts[i],
            output_len=int(output_lens[i]),
            arrival_s=float(arrivals[i]),
            temperature=spec.temperature,
            ignore_eos=spec.ignore_eos,
        )
        for i in range(n)
    ]


@functools.lru_cache(maxsize=4)
def _model_vocabulary(model: str) -> tuple[int, Tokenize, tuple[int, ...]]:
    """(vocabulary size, tokenize, special token ids) of a model; loaded once per model."""
    from qworker.model.loader import load_hf_config, load_tokenizer, resolve_model

    model_path = resolve_model(model).path
    tokenizer = load_tokenizer(model_path)

    def tokenize(text: str) -> list[int]:
        return list(tokenizer.encode(text, add_special_tokens=False))

    special = tuple(getattr(tokenizer, "all_special_ids", []) or [])
    return load_hf_config(model_path).vocab_size, tokenize, special


def requests_for_model(spec: WorkloadSpec, model: str) -> list[BenchRequest]:
    """The spec's requests for a model (`smollm2`, a directory or a .gguf file): its vocabulary,
    its tokenizer for jsonl text, and none of its special tokens in random prompts."""
    vocab_size, tokenize, special = _model_vocabulary(model)
    return generate_requests(spec, vocab_size, tokenize, special)


def request_set_digest(requests: Sequence[BenchRequest], include_arrivals: bool = True) -> str:
    """A sha256 over prompts, output lengths (and arrival times): equal digests, equal requests."""
    h = hashlib.sha256()
    for r in requests:
        h.update(f"{r.request_id}|{r.output_len}|{r.temperature}|{r.ignore_eos}|".encode())
        if include_arrivals:
            h.update(f"{r.arrival_s:.6f}|".encode())
        h.update(np.asarray(r.prompt_token_ids, dtype=np.int64).tobytes())
    return h.hexdigest()
