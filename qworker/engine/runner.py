from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from qworker.engine.request import Request
from qworker.engine.sampler import Sampler, SamplingRow
from qworker.engine.scheduler import ScheduledRequest, SchedulerOutput
from qworker.model.attention import AttentionBackend, AttentionMetadata
from qworker.model.llama import LlamaForCausalLM

if TYPE_CHECKING:
    from qworker.engine.cuda_graphs import DecodeCudaGraphs


@dataclass
class StepInputs:
    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    meta: AttentionMetadata
    # [num_sampled] rows of the hidden states whose next token is sampled
    logits_indices: torch.Tensor
    sampled_requests: list[ScheduledRequest]


class ModelRunner:
    """Turns a scheduler plan into tensors, runs the model and samples the next tokens."""

    def __init__(
        self,
        model: LlamaForCausalLM,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        block_size: int,
        backend: AttentionBackend,
        sampler: Sampler,
        device: torch.device,
    ) -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.backend = backend
        self.sampler = sampler
        self.device = device
        self._generators: dict[str, torch.Generator] = {}
        # Set by the engine on CUDA unless enforce_eager: pure-decode steps replay a graph.
        self.cuda_graphs: DecodeCudaGraphs | None = None

    def prepare_inputs(self, plan: SchedulerOutput) -> StepInputs:
        # Decodes (one query token) first: the attention backend runs them as one batch.
        items = sorted(plan.scheduled, key=lambda item: len(item.token_ids) != 1)
        num_decode_seqs = sum(1 for item in items if len(item.token_ids) == 1)
        query_lens = np.fromiter((len(item.token_ids) for item in items), dtype=np.int64, count=len(items))
        starts = np.fromiter((item.start_position for item in items), dtype=np.int64, count=len(items))
        query_start_loc = np.zeros(len(items) + 1, dtype=np.int64)
        np.cumsum(query_lens, out=query_start_loc[1:])
        num_tokens = int(query_start_loc[-1])
        seq_lens = starts + query_lens

        input_ids = np.fromiter(
            (t for item in items for t in item.token_ids), dtype=np.int64, count=num_tokens
        )
        # positions: [T] = start of the token's seq + offset within its chunk
        seq_of_token = np.repeat(np.arange(len(items)), query_lens)
        positions = np.arange(num_tokens) - query_start_loc[:-1][seq_of_token] + starts[seq_of_token]

        max_blocks = max(len(item.block_ids) for item in items)
        block_tables = np.zeros((len(items), max_blocks), dtype=np.int32)
        for row, item in enumerate(items):
            block_tables[row, : len(item.block_ids)] = item.block_ids
        slot_mapping = (
            block_tables[seq_of_token, positions // self.block_size].astype(np.int64) * self.block_size
            + positions % self.block_size
        )
        sampled_rows = [row for row, item in enumerate(items) if item.needs_sample]
        logits_indices = query_start_loc[1:][sampled_rows] - 1

        device = self.device
        meta = AttentionMetadata(
            slot_mapping=torch.from_numpy(slot_mapping).to(device),
            block_tables=torch.from_numpy(block_tables).to(device),
            seq_lens=torch.from_numpy(seq_lens.astype(np.int32)).to(device),
            query_start_loc=torch.from_numpy(query_start_loc.astype(np.int32)).to(device),
            num_decode_seqs=num_decode_seqs,
            seq_lens_list=seq_lens.tolist(),
            query_lens_list=query_lens.tolist(),
            block_ids_list=[item.block_ids for item in items],
            block_size=self.block_size,
            max_query_len=int(query_lens.max()),
            max_seq_len=int(seq_lens.max()),
        )
        return StepInputs(
            input_ids=torch.from_numpy(input_ids).to(device),
            positions=torch.from_numpy(positions).to(device),
            meta=meta,
            logits_indices=torch.from_numpy(logits_indices).to(device),
            sampled_requests=[items[row] for row in sampled_rows],
        )

    @torch.inference_mode()
    def execute(self, plan: SchedulerOutput, requests: Mapping[str, Request]) -> dict[str, int]:
        """Run one step. Returns the sampled token of each request whose chunk reached its end."""
        for request_id in plan.finished_request_ids:
            self._generators.pop(request_id, None)
        if plan.is_empty:
            return {}
        inputs = self.prepare_inputs(plan)
        if self.cuda_graphs is not None and self.cuda_graphs.can_run(inputs):
            hidden = self.cuda_graphs.run(inputs)
        else:
            hidden = self.model(inputs.input_ids, inputs.positions, self.kv_caches, inputs.meta, self.backend)
        if not inputs.sampled_requests:
            return {}
        logits = self.model.compute_logits(hidden[inputs.logits_indices])
        rows = []
        for item in inputs.sampled_requests:
            request = requests[item.request_id]
            rows.append(
                SamplingRow(
                    params=request.sampling_params,
                    num_output_tokens=request.num_output_tokens,
                    generator=self._generator_for(request),
                )
            )
        token_ids = self.sampler.sample(logits, rows)
        return {
            item.request_id: token for item, token in zip(inputs.sampled_requests, token_ids, strict=True)
        }

    def _generator_for(self, request: Request) -> torch.Generator | None:
        seed = request.sampling_params.seed
        if seed is None or request.sampling_params.is_greedy:
            return None
        generator = self._generators.get(request.request_id)
        if generator is None:
            generator = torch.Generator(device=self.device)
            generator.manual_seed(seed)
            self._generators[request.request_id] = generator
        return generator
