"""qworker's engine in-process, with timestamps taken where tokens appear (after each step).

Two admission modes:
- continuous: a request joins the engine as soon as it arrives (the engine schedules it at the
  next step), which is how the worker feeds it;
- static: requests are added only when the engine is empty, at most `static_batch_size` at a
  time, and the next batch waits until the whole batch has drained. Same engine, same kernels;
  only the admission differs, so the pair isolates what continuous batching buys.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from typing import Any

import numpy as np

from qworker.bench.kv_usage import KVSample
from qworker.bench.load import LoadGenerator
from qworker.bench.records import RequestRecord, RequestStatus
from qworker.bench.system import Finish, Progress, RunClock, RunLimits, RunResult, new_record, time_out_unsent
from qworker.bench.workload import BenchRequest
from qworker.config import EngineConfig
from qworker.engine.llm_engine import LLMEngine
from qworker.engine.sampling_params import SamplingParams
from qworker.errors import InvalidRequestError

WARMUP_PROMPT_LEN = 64
WARMUP_MAX_TOKENS = 4


def sampling_params_for(request: BenchRequest) -> SamplingParams:
    return SamplingParams(
        max_tokens=request.output_len,
        temperature=request.temperature,
        ignore_eos=request.ignore_eos,
        # A seed keeps sampled runs reproducible whatever shares the batch.
        seed=request.index if request.temperature > 0 else None,
    )


class QworkerEngineSystem:
    mode = "engine"

    def __init__(
        self,
        label: str,
        config: EngineConfig,
        static_batch_size: int | None = None,
        num_warmup_requests: int = 1,
        engine: LLMEngine | None = None,
    ) -> None:
        assert static_batch_size is None or static_batch_size >= 1, f"bad batch size {static_batch_size}"
        self.label = label
        self.config = config
        self.static_batch_size = static_batch_size
        self.num_warmup_requests = num_warmup_requests
        self.engine = engine

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
        engine = self.engine
        rng = np.random.default_rng(12345)
        vocab = engine.model_config.vocab_size
        for i in range(self.num_warmup_requests):
            ids = rng.integers(32, vocab, size=min(WARMUP_PROMPT_LEN, engine.max_model_len - 8)).tolist()
            params = SamplingParams(max_tokens=WARMUP_MAX_TOKENS, temperature=0.0, ignore_eos=True)
            engine.add_request(f"warmup-{i}", {"prompt_token_ids": ids}, params)
        while engine.has_unfinished_requests():
            engine.step()

    def close(self) -> None:
        self.engine = None

    def _kv_sample(self, t: float, by_id: dict[str, BenchRequest]) -> KVSample:
        engine = self.engine
        assert engine is not None, "prepare() first"
        stats = engine.kv_stats()
        running = engine.scheduler.running
        contiguous = sum(by_id[r.request_id].prompt_len + by_id[r.request_id].output_len for r in running)
        return KVSample(
            t=t,
            num_used_blocks=stats.num_used_blocks,
            num_total_blocks=stats.num_total_blocks,
            block_size=stats.block_size,
            num_tokens_stored=stats.num_tokens_stored,
            num_empty_slots=stats.num_empty_slots,
            num_running=len(running),
            num_waiting=engine.scheduler.num_waiting,
            num_contiguous_slots=contiguous,
            num_max_model_len_slots=len(running) * engine.max_model_len,
        )

    def run(
        self,
        requests: Sequence[BenchRequest],
        max_concurrency: int | None,
        limits: RunLimits,
        progress: Progress,
    ) -> RunResult:
        engine = self.engine
        assert engine is not None, "prepare() first"
        assert not engine.has_unfinished_requests(), "the engine must start a run empty"
        by_id = {r.request_id: r for r in requests}
        preemptions_before = engine.scheduler.num_preemptions
        load = LoadGenerator(requests, max_concurrency)
        deadline = limits.run_deadline(requests)
        records: list[RequestRecord] = []
        backlog: deque[RequestRecord] = deque()  # sent, not yet in the engine
        in_engine: dict[str, RequestRecord] = {}
        samples: list[KVSample] = []
        clock = RunClock()

        def finish(record: RequestRecord, status: RequestStatus, t: float, error: str | None = None) -> None:
            record.finish(status, t, error)
            load.on_finished(t)
            progress(1)

        def admit(record: RequestRecord, t: float) -> None:
            request = by_id[record.request_id]
            try:
                engine.add_request(
                    record.request_id,
                    {"prompt_token_ids": request.prompt_token_ids},
                    sampling_params_for(request),
                )
            except InvalidRequestError as exc:
                finish(record, RequestStatus.FAILED, t, f"{type(exc).__name__}: {exc}")
                return
            in_engine[record.request_id] = record

        while True:
            t = clock.now()
            for sent in load.poll(t):
                record = new_record(sent.request, sent.send_time)
                records.append(record)
                backlog.append(record)
            if deadline is not None and t >= deadline:
                break
            if limits.request_timeout_s is not None:
                self._expire(backlog, in_engine, t, limits.request_timeout_s, finish)
            if self.static_batch_size is None:
                while backlog:
                    admit(backlog.popleft(), t)
            elif not in_engine:
                for _ in range(min(self.static_batch_size, len(backlog))):
                    admit(backlog.popleft(), t)
            if in_engine:
                step_outputs = engine.step()
                t = clock.now()
                for out in step_outputs:
                    record = in_engine[out.request_id]
                    if out.new_token_ids:
                        record.add_chunk(t, len(out.new_token_ids))
                    if out.finished:
                        del in_engine[out.request_id]
                        finish(record, RequestStatus.COMPLETED, t)
                samples.append(self._kv_sample(t, by_id))
                continue
            if backlog:
                continue  # every admission failed; the next round takes more
            next_send = load.next_send_time()
            if next_send is None:
                assert load.is_exhausted, "waiting on a finish with nothing outstanding"
                break
            clock.sleep_until(next_send if deadline is None else min(next_send, deadline))

        # The deadline passed: whatever is left ran out of time.
        t = clock.now()
        for request_id, record in list(in_engine.items()):
            engine.abort(request_id)
            finish(record, RequestStatus.TIMEOUT, t, "still running at the run's time limit")
        for record in backlog:
            finish(record, RequestStatus.TIMEOUT, t, "not started by the run's time limit")
        records.extend(time_out_unsent(load, t, progress))
        return RunResult(
            system=self.label,
            mode=self.mode,
            records=records,
            duration_s=clock.now(),
            kv_samples=samples,
            num_preemptions=engine.scheduler.num_preemptions - preemptions_before,
        )

    def _expire(
        self,
        backlog: deque[RequestRecord],
        in_engine: dict[str, RequestRecord],
        t: float,
        timeout_s: float,
        finish: Finish,
    ) -> None:
        engine = self.engine
        assert engine is not None, "prepare() first"
        for request_id, record in list(in_engine.items()):
            if t - record.arrival_time > timeout_s:
                engine.abort(request_id)
                del in_engine[request_id]
                finish(record, RequestStatus.TIMEOUT, t, f"exceeded the {timeout_s}s request timeout")
        for record in [r for r in backlog if t - r.arrival_time > timeout_s]:
            backlog.remove(record)
            finish(record, RequestStatus.TIMEOUT, t, f"waited past the {timeout_s}s request timeout")
