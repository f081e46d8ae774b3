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
from typing import Any

import torch
from transformers import StoppingCriteria

from qworker.bench.records import RequestRecord, RequestStatus
from qworker.bench.run import Run, RunClock
from qworker.bench.system import System
from qworker.bench.workload import BenchRequest


class _StepClock(StoppingCriteria):
    """A stopping criterion that never stops on its own: it records when each decoding step
    ends (transformers calls it once per generated token), and stops the batch at a deadline."""

    def __init__(self, clock: RunClock, deadline: float | None) -> None:
        self.clock = clock
        self.deadline = deadline
        self.step_times: list[float] = []

    def __call__(self, input_ids: torch.Tensor, scores: Any, **kwargs: Any) -> torch.Tensor:
        t = self.clock.now()
        self.step_times.append(t)
        stop = self.deadline is not None and t >= self.deadline
        return torch.full((input_ids.shape[0],), stop, dtype=torch.bool, device=input_ids.device)


class HFGenerateSystem(System):
    mode = "engine"

    def __init__(
        self,
        label: str,
        model_path: str | None,
        batch_size: int,
        dtype: torch.dtype = torch.bfloat16,
        device: str = "cpu",
        model: Any = None,
        pad_token_id: int | None = None,
    ) -> None:
        assert batch_size >= 1, f"bad batch size {batch_size}"
        self.label = label
        self.model_path = model_path
        self.batch_size = batch_size
        self.dtype = dtype
        self.device = torch.device(device)
        self.model = model
        self.pad_token_id = pad_token_id
        self.startup_s: float | None = None
        self._queue: deque[tuple[RequestRecord, BenchRequest]] = deque()
        self._num_batches = 0

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

    def close(self) -> None:
        self.model = None

    def begin(self, run: Run) -> None:
        self._queue.clear()
        self._num_batches = 0

    def submit(self, run: Run, record: RequestRecord, request: BenchRequest) -> None:
        self._queue.append((record, request))

    def cancel(self, run: Run, record: RequestRecord) -> None:
        # Only queued requests can be unfinished between batches: a batch ends with all its own.
        self._queue.remove(next(item for item in self._queue if item[0] is record))

    def end(self, run: Run) -> None:
        run.meta["num_batches"] = self._num_batches

    def advance(self, run: Run, wake: float | None) -> bool:
        """One static batch of the requests that have arrived, in arrival order."""
        if not self._queue:
            return False
        batch = [self._queue.popleft() for _ in range(min(self.batch_size, len(self._queue)))]
        self._num_batches += 1
        start = run.now()
        for record, _ in batch:
            record.start_time = start
        try:
            prompts = [request.prompt_token_ids for _, request in batch]
            max_new_tokens = max(record.output_len for record, _ in batch)
            steps, new_tokens = self._generate(prompts, max_new_tokens, run)
        except Exception as exc:  # a model error fails the batch's requests, never the run
            t = run.now()
            for record, _ in batch:
                run.finish(record, RequestStatus.FAILED, t, f"{type(exc).__name__}: {exc}")
            return True
        end = run.now()
        for row, (record, _) in enumerate(batch):
            # A request counts only its own tokens; their times are the batch's step times.
            for step, step_time in enumerate(steps.step_times[: record.output_len]):
                run.emit(record, step_time, 1, new_tokens[row, step : step + 1].tolist())
            if record.num_output_tokens < record.output_len:
                run.finish(record, RequestStatus.TIMEOUT, end, "batch stopped at the run's time limit")
            else:
                run.finish(record, RequestStatus.COMPLETED, end)
        return True

    def _generate(
        self, prompts: list[list[int]], max_new_tokens: int, run: Run
    ) -> tuple[_StepClock, torch.Tensor]:
        """Greedy, until the batch's longest request is done. New tokens: [batch, num_steps]."""
        assert self.model is not None and self.pad_token_id is not None, "prepare() first"
        # Left padding so that every row's next token is at the same position.
        width = max(len(p) for p in prompts)
        input_ids = torch.full((len(prompts), width), self.pad_token_id, dtype=torch.long)
        attention_mask = torch.zeros((len(prompts), width), dtype=torch.long)
        for row, prompt in enumerate(prompts):
            input_ids[row, width - len(prompt) :] = torch.tensor(prompt)
            attention_mask[row, width - len(prompt) :] = 1
        step_clock = _StepClock(run.clock, run.deadline)
        with torch.inference_mode():
            sequences = self.model.generate(
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
        return step_clock, sequences[:, width:].cpu()
