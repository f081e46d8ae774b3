"""qworker's engine in-process, with timestamps taken where tokens appear (after each step).

Two admission modes:
- continuous: a request joins the engine as soon as it arrives (the engine schedules it at the
  next step), which is how the worker feeds it;
- static: requests are added only when the engine is empty, at most `static_batch_size` at a
  time, and the next batch waits until the whole batch has drained. Same engine, same kernels;
  only the admission differs, so the pair isolates what continuous batching buys.
"""

from __future__ import annotations

import dataclasses
from collections import deque
from collections.abc import Mapping
from typing import Any

from qworker.bench.kv_usage import KVSample
from qworker.bench.records import RequestRecord, RequestStatus
from qworker.bench.run import Run
from qworker.bench.system import System
from qworker.bench.workload import BenchRequest
from qworker.config import EngineConfig
from qworker.engine.llm_engine import LLMEngine
from qworker.engine.sampling_params import SamplingParams
from qworker.errors import InvalidRequestError


def sampling_params_for(request: BenchRequest) -> SamplingParams:
    return SamplingParams(
        max_tokens=request.output_len,
        temperature=request.temperature,
        ignore_eos=request.ignore_eos,
        # A seed keeps sampled runs reproducible whatever shares the batch.
        seed=request.index if request.temperature > 0 else None,
    )


class QworkerEngineSystem(System):
    mode = "engine"

    def __init__(
        self,
        label: str,
        config: EngineConfig,
        static_batch_size: int | None = None,
        engine: LLMEngine | None = None,
        sampling_overrides: Mapping[str, Any] | None = None,
    ) -> None:
        assert static_batch_size is None or static_batch_size >= 1, f"bad batch size {static_batch_size}"
        # SamplingParams fields set on every request (logprobs=5, n=4: what each costs).
        self.sampling_overrides = dict(sampling_overrides or {})
        self.label = label
        self.config = config
        self.static_batch_size = static_batch_size
        self.engine = engine
        self._backlog: deque[tuple[RequestRecord, BenchRequest]] = deque()  # sent, not yet in the engine
        self._in_engine: dict[str, RequestRecord] = {}
        self._counters_before: dict[str, int] = {}

    def describe(self) -> dict[str, Any]:
        info: dict[str, Any] = {
            "kind": "qworker",
            "admission": "static" if self.static_batch_size else "continuous",
            "static_batch_size": self.static_batch_size,
            "engine_config": {k: str(v) for k, v in vars(self.config).items()},
        }
        if self.engine is not None:
            info.update(
                num_kv_blocks=self.engine.num_kv_blocks,
                attention_backend=self.engine.attention_backend_name,
                device=str(self.engine.device),
                dtype=str(self.engine.dtype),
                startup_s=getattr(self.engine, "startup_seconds", None),
            )
        return info

    def prepare(self) -> None:
        if self.engine is None:
            self.engine = LLMEngine(self.config)

    def close(self) -> None:
        self.engine = None

    def _engine(self) -> LLMEngine:
        assert self.engine is not None, "prepare() first"
        return self.engine

    def _counters(self) -> dict[str, int]:
        engine = self._engine()
        counters = {
            "num_preemptions": engine.scheduler.num_preemptions,
            "num_steps": engine.num_steps,
            # Prefill work: prompt tokens computed (prefix-cache hits are not) and the hits.
            "num_prompt_tokens_computed": engine.scheduler.num_prompt_tokens_computed,
            "num_prefix_cache_hit_tokens": engine.kv_stats().num_prefix_cache_hits,
        }
        graphs = engine.runner.cuda_graphs
        if graphs is not None:
            counters["num_graph_steps"] = graphs.num_runs
        return counters

    def begin(self, run: Run) -> None:
        assert not self._engine().has_unfinished_requests(), "the engine must start a run empty"
        self._backlog.clear()
        self._in_engine.clear()
        self._counters_before = self._counters()

    def submit(self, run: Run, record: RequestRecord, request: BenchRequest) -> None:
        self._backlog.append((record, request))

    def _admit(self, run: Run) -> None:
        if self.static_batch_size is None:
            count = len(self._backlog)
        elif not self._in_engine:
            count = min(self.static_batch_size, len(self._backlog))
        else:
            return
        engine = self._engine()
        for _ in range(count):
            record, request = self._backlog.popleft()
            try:
                engine.add_request(
                    record.request_id,
                    {"prompt_token_ids": request.prompt_token_ids},
                    dataclasses.replace(sampling_params_for(request), **self.sampling_overrides),
                )
            except InvalidRequestError as exc:
                run.finish(record, RequestStatus.FAILED, run.now(), f"{type(exc).__name__}: {exc}")
                continue
            self._in_engine[record.request_id] = record

    def advance(self, run: Run, wake: float | None) -> bool:
        had_backlog = bool(self._backlog)
        self._admit(run)
        if not self._in_engine:
            return had_backlog  # every admission failed: the next round takes more
        step_outputs = self._engine().step()
        t = run.now()
        for out in step_outputs:
            record = self._in_engine[out.request_id]
            if out.new_token_ids:
                run.emit(record, t, len(out.new_token_ids), out.new_token_ids)
            if out.finished:
                del self._in_engine[out.request_id]
                run.finish(record, RequestStatus.COMPLETED, t)
        run.kv_samples.append(self._kv_sample(t))
        return True

    def cancel(self, run: Run, record: RequestRecord) -> None:
        if self._in_engine.pop(record.request_id, None) is not None:
            self._engine().abort(record.request_id)
        else:
            self._backlog.remove(next(item for item in self._backlog if item[0] is record))

    def end(self, run: Run) -> None:
        after = self._counters()
        deltas = {key: after[key] - before for key, before in self._counters_before.items() if key in after}
        run.num_preemptions = deltas.pop("num_preemptions")
        run.meta.update(deltas)

    def _kv_sample(self, t: float) -> KVSample:
        engine = self._engine()
        stats = engine.kv_stats()
        # n > 1: the scheduler runs children `{id}#{i}` (parallel_sampling.child_id), each a sequence.
        running = [
            self._in_engine.get(r.request_id) or self._in_engine[r.request_id.rsplit("#", 1)[0]]
            for r in engine.scheduler.running
        ]
        return KVSample(
            t=t,
            num_used_blocks=stats.num_used_blocks,
            num_total_blocks=stats.num_total_blocks,
            block_size=stats.block_size,
            num_tokens_stored=stats.num_tokens_stored,
            num_empty_slots=stats.num_empty_slots,
            num_running=len(running),
            num_waiting=engine.scheduler.num_waiting,
            num_contiguous_slots=sum(r.prompt_len + r.output_len for r in running),
            num_max_model_len_slots=len(running) * engine.max_model_len,
        )
