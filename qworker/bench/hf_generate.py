"""Baselines on transformers `generate`: static batches (hf-static) and one request at a time
(hf-sequential, a batch of one).

The server loop is simulated in real time: when the server is idle it takes up to
`batch_size` requests that have arrived, in arrival order, and cannot start a batch before its
requests are there. A batch is left-padded and runs greedily until its longest request is done
(min_new_tokens = max_new_tokens = the batch's largest output length), so shorter requests ride
along to the end. Each request counts tokens only up to its own output length; its tokens'
times are the batch's step times (as a streaming server would send them) and it finishes when
the batch ends: that wait is what static batching costs.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from typing import Any

import torch
from transformers import StoppingCriteria

from qworker.bench.load import LoadGenerator
from qworker.bench.records import RequestRecord, RequestStatus
from qworker.bench.system import Finish, Progress, RunClock, RunLimits, RunResult, new_record, time_out_unsent
from qworker.bench.workload import BenchRequest


class _StepClock(StoppingCriteria):
    """A stopping criterion that never stops on its own: it records when each decoding step
    ends (transformers calls it once per generated token), and stops the batch at a deadline."""

    def __init__(self, clock: RunClock, batch_size: int, deadline: float | None) -> None:
        self.clock = clock
        self.batch_size = batch_size
        self.deadline = deadline
        self.step_times: list[float] = []

    def __call__(self, input_ids: torch.Tensor, scores: Any, **kwargs: Any) -> torch.Tensor:
        t = self.clock.now()
        self.step_times.append(t)
        stop = self.deadline is not None and t >= self.deadline
        return torch.full((input_ids.shape[0],), stop, dtype=torch.bool, device=input_ids.device)


class HFGenerateSystem:
    mode = "engine"

    def __init__(
        self,
        label: str,
        model_path: str | None,
        batch_size: int,
        dtype: torch.dtype = torch.bfloat16,
        device: str = "cpu",
        num_warmup_requests: int = 1,
        model: Any = None,
        pad_token_id: int | None = None,
    ) -> None:
        assert batch_size >= 1, f"bad batch size {batch_size}"
        self.label = label
        self.model_path = model_path
        self.batch_size = batch_size
        self.dtype = dtype
        self.device = torch.device(device)
        self.num_warmup_requests = num_warmup_requests
        self.model = model
        self.pad_token_id = pad_token_id
        self.startup_s: float | None = None

    def describe(self) -> dict[str, Any]:
        return {
            "kind": "hf-static" if self.batch_size > 1 else "hf-sequential",
            "batch_size": self.batch_size,
            "dtype": str(self.dtype),
            "device": str(self.device),
            "model_path": self.model_path,
            "startup_s": self.startup_s,
        }

    def prepare(self) -> None:
        clock = RunClock()
        if self.model is None:
            from transformers import AutoModelForCausalLM, AutoTokenizer

            assert self.model_path is not None, "a model path or a model is needed"
            self.model = (
                AutoModelForCausalLM.from_pretrained(self.model_path, dtype=self.dtype).to(self.device).eval()
            )
            tokenizer = AutoTokenizer.from_pretrained(self.model_path)
            if self.pad_token_id is None:
                self.pad_token_id = (
                    tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
                )
        if self.pad_token_id is None:
            self.pad_token_id = 0
        self.startup_s = clock.now()
        for _ in range(self.num_warmup_requests):
            self._generate([[33] * 64], 4, RunClock(), None)

    def close(self) -> None:
        self.model = None

    def _generate(
        self, prompts: list[list[int]], max_new_tokens: int, clock: RunClock, deadline: float | None
    ) -> _StepClock:
        # Left padding so that every row's next token is at the same position.
        width = max(len(p) for p in prompts)
        input_ids = torch.full((len(prompts), width), self.pad_token_id, dtype=torch.long)
        attention_mask = torch.zeros((len(prompts), width), dtype=torch.long)
        for row, prompt in enumerate(prompts):
            input_ids[row, width - len(prompt) :] = torch.tensor(prompt)
            attention_mask[row, width - len(prompt) :] = 1
        step_clock = _StepClock(clock, len(prompts), deadline)
        with torch.inference_mode():
            self.model.generate(
                input_ids.to(self.device),
                attention_mask=attention_mask.to(self.device),
                max_new_tokens=max_new_tokens,
                min_new_tokens=max_new_tokens,
                do_sample=False,
                temperature=None,
                top_p=None,
                top_k=None,
                pad_token_id=self.pad_token_id,
                stopping_criteria=[step_clock],
            )
        return step_clock

    def run(
        self,
        requests: Sequence[BenchRequest],
        max_concurrency: int | None,
        limits: RunLimits,
        progress: Progress,
    ) -> RunResult:
        assert self.model is not None, "prepare() first"
        by_id = {r.request_id: r for r in requests}
        load = LoadGenerator(requests, max_concurrency)
        deadline = limits.run_deadline(requests)
        records: list[RequestRecord] = []
        queue: deque[RequestRecord] = deque()
        clock = RunClock()
        num_batches = 0

        def finish(record: RequestRecord, status: RequestStatus, t: float, error: str | None = None) -> None:
            record.finish(status, t, error)
            load.on_finished(t)
            progress(1)

        while True:
            t = clock.now()
            for sent in load.poll(t):
                record = new_record(sent.request, sent.send_time)
                records.append(record)
                queue.append(record)
            if deadline is not None and t >= deadline:
                break
            if limits.request_timeout_s is not None:
                for record in [r for r in queue if t - r.arrival_time > limits.request_timeout_s]:
                    queue.remove(record)
                    finish(record, RequestStatus.TIMEOUT, t, "waited past the request timeout")
            if not queue:
                next_send = load.next_send_time()
                if next_send is None:
                    assert load.is_exhausted, "waiting on a finish with nothing outstanding"
                    break
                clock.sleep_until(next_send if deadline is None else min(next_send, deadline))
                continue
            batch = [queue.popleft() for _ in range(min(self.batch_size, len(queue)))]
            self._run_batch(batch, by_id, clock, deadline, limits, finish)
            num_batches += 1

        t = clock.now()
        for record in queue:
            finish(record, RequestStatus.TIMEOUT, t, "not started by the run's time limit")
        records.extend(time_out_unsent(load, t, progress))
        return RunResult(
            system=self.label,
            mode=self.mode,
            records=records,
            duration_s=clock.now(),
            meta={"num_batches": num_batches},
        )

    def _run_batch(
        self,
        batch: list[RequestRecord],
        by_id: dict[str, BenchRequest],
        clock: RunClock,
        deadline: float | None,
        limits: RunLimits,
        finish: Finish,
    ) -> None:
        start = clock.now()
        for record in batch:
            record.start_time = start
        prompts = [by_id[r.request_id].prompt_token_ids for r in batch]
        max_new_tokens = max(r.output_len for r in batch)
        try:
            steps = self._generate(prompts, max_new_tokens, clock, deadline)
        except Exception as exc:  # a model error fails the batch's requests, never the run
            t = clock.now()
            for record in batch:
                finish(record, RequestStatus.FAILED, t, f"{type(exc).__name__}: {exc}")
            return
        end = clock.now()
        for record in batch:
            for step_time in steps.step_times[: record.output_len]:
                record.add_chunk(step_time)
            if record.num_output_tokens < record.output_len:
                finish(record, RequestStatus.TIMEOUT, end, "batch stopped at the run's time limit")
            elif (
                limits.request_timeout_s is not None and end - record.arrival_time > limits.request_timeout_s
            ):
                finish(record, RequestStatus.TIMEOUT, end, "finished past the request timeout")
            else:
                finish(record, RequestStatus.COMPLETED, end)
