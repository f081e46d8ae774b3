"""Pooling: one vector per request out of its final-norm hidden states, gathered with tensor ops.

A pooling request's prompt may run in several chunks (chunked prefill). For each chunk of a step
the pooler keeps what the request needs of it: the running sum of its rows (mean pooling) or the
one row it pools (last token, CLS, a classifier's last non-pad token). At the request's last chunk
it applies the head (none for embeddings, the `score` Linear of a sequence classifier, or the
yes/no logits of a reranker) and hands back the vector. A request that starts again (preempted:
recomputed from its first token) starts from nothing here too.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import numpy as np
import torch

from qworker.model.decoder import DecoderForCausalLM


class PoolingHead(enum.Enum):
    # the pooled hidden state itself (embeddings)
    HIDDEN = "hidden"
    # a *ForSequenceClassification checkpoint's `score` Linear: [num_labels] logits
    CLASSIFIER = "classifier"
    # logit(yes) - logit(no) of the lm_head (Qwen3-Reranker): sigmoid of it is softmax([no, yes])[yes]
    YES_NO = "yes_no"


@dataclass(frozen=True)
class PoolingSpec:
    """What the runner makes of one pooling request's hidden states (plain data, in the plan)."""

    head: PoolingHead
    # The position whose hidden state is pooled; None: the mean over every position.
    pooled_position: int | None
    # With PoolingHead.YES_NO: the (no, yes) token ids.
    yes_no_token_ids: tuple[int, int] | None = None

    def needs_every_position(self, num_tokens: int) -> bool:
        """True when a prefix-cache hit would skip what it pools: the mean, or a position before
        the last (a hit never covers the last token, which is always computed)."""
        return self.pooled_position is None or self.pooled_position < num_tokens - 1


@dataclass(frozen=True)
class PoolingChunk:
    """One pooling request's chunk in a step: its rows [row_start, row_start + num_rows) of the
    step's hidden states hold positions [start_position, start_position + num_rows)."""

    request_id: str
    row_start: int
    start_position: int
    num_rows: int
    # The request's whole length: the chunk that ends there is its last.
    num_tokens: int


@dataclass
class PoolingStep:
    """The gathers of one step, built before the forward pass."""

    # Mean pooling: [M] rows of the hidden states, [M] the index of each row's chunk in `mean_ids`.
    mean_rows: torch.Tensor | None
    mean_segments: torch.Tensor | None
    mean_ids: list[str]
    # Position pooling: [P] rows, one per request whose pooled position is in this step.
    position_rows: torch.Tensor | None
    position_ids: list[str]
    # Requests whose last chunk runs in this step (their vectors are finished after it), each to
    # its whole length (the mean's divisor).
    finishing: dict[str, int]


class Pooler:
    """The per-request pooling state across a request's chunks, and the step's gathers."""

    def __init__(self, model: DecoderForCausalLM, device: torch.device) -> None:
        self.model = model
        self.device = device
        self._specs: dict[str, PoolingSpec] = {}
        # Mean pooling: the sum of the rows computed so far, [hidden] float32.
        self._sums: dict[str, torch.Tensor] = {}
        # Position pooling: the pooled row once its chunk ran, [hidden] in the model dtype.
        self._kept: dict[str, torch.Tensor] = {}

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._specs

    def start(self, request_id: str, spec: PoolingSpec) -> None:
        """A request the runner takes (new, or recomputed after a preemption): nothing kept yet."""
        self.drop(request_id)
        self._specs[request_id] = spec

    def drop(self, request_id: str) -> None:
        self._specs.pop(request_id, None)
        self._sums.pop(request_id, None)
        self._kept.pop(request_id, None)

    def plan(self, chunks: list[PoolingChunk]) -> PoolingStep | None:
        """The step's gathers for its pooling chunks (None when it has none)."""
        if not chunks:
            return None
        mean_starts: list[int] = []
        mean_lens: list[int] = []
        mean_ids: list[str] = []
        position_rows: list[int] = []
        position_ids: list[str] = []
        finishing: dict[str, int] = {}
        for chunk in chunks:
            spec = self._specs[chunk.request_id]
            if spec.pooled_position is None:
                mean_starts.append(chunk.row_start)
                mean_lens.append(chunk.num_rows)
                mean_ids.append(chunk.request_id)
            elif chunk.start_position <= spec.pooled_position < chunk.start_position + chunk.num_rows:
                position_rows.append(chunk.row_start + spec.pooled_position - chunk.start_position)
                position_ids.append(chunk.request_id)
            if chunk.start_position + chunk.num_rows == chunk.num_tokens:
                finishing[chunk.request_id] = chunk.num_tokens
        mean_rows = mean_segments = None
        if mean_ids:
            lens = np.asarray(mean_lens, dtype=np.int64)
            segments = np.repeat(np.arange(len(lens)), lens)
            # [M]: each chunk's rows, start + offset within the chunk (no loop per token).
            offsets = np.arange(len(segments)) - np.repeat(np.cumsum(lens) - lens, lens)
            rows = np.asarray(mean_starts, dtype=np.int64)[segments] + offsets
            mean_rows = torch.from_numpy(rows).to(self.device)
            mean_segments = torch.from_numpy(segments).to(self.device)
        return PoolingStep(
            mean_rows=mean_rows,
            mean_segments=mean_segments,
            mean_ids=mean_ids,
            position_rows=(
                torch.tensor(position_rows, dtype=torch.int64, device=self.device) if position_rows else None
            ),
            position_ids=position_ids,
            finishing=finishing,
        )

    def pool(self, hidden: torch.Tensor, step: PoolingStep) -> dict[str, torch.Tensor]:
        """Take the step's rows out of `hidden` ([T, hidden] after the final norm); return the
        head's output for each request whose last chunk ran: 1-D float32 on the CPU (hidden
        size for HIDDEN, num_labels for CLASSIFIER, 1 for YES_NO)."""
        if step.mean_rows is not None and step.mean_segments is not None:
            # [chunks, hidden] float32: each chunk's row sum.
            sums = torch.zeros(len(step.mean_ids), hidden.shape[1], dtype=torch.float32, device=hidden.device)
            sums.index_add_(0, step.mean_segments, hidden[step.mean_rows].float())
            for i, request_id in enumerate(step.mean_ids):
                earlier = self._sums.get(request_id)
                self._sums[request_id] = sums[i] if earlier is None else earlier + sums[i]
        if step.position_rows is not None:
            kept = hidden[step.position_rows]
            for i, request_id in enumerate(step.position_ids):
                self._kept[request_id] = kept[i]
        if not step.finishing:
            return {}
        # Rows finished together that share a head (and, for YES_NO, its two tokens).
        groups: dict[tuple[PoolingHead, tuple[int, int] | None], list[tuple[str, torch.Tensor]]] = {}
        for request_id, num_tokens in step.finishing.items():
            spec = self._specs.pop(request_id)
            if spec.pooled_position is None:
                vector = self._sums.pop(request_id) / num_tokens
            else:
                vector = self._kept.pop(request_id)
            groups.setdefault((spec.head, spec.yes_no_token_ids), []).append((request_id, vector))
        results: dict[str, torch.Tensor] = {}
        for (head, yes_no), rows in groups.items():
            vectors = torch.stack([v for _, v in rows])  # [F, hidden]
            if head is PoolingHead.CLASSIFIER:
                out = self.model.compute_class_logits(vectors.to(hidden.dtype))
            elif head is PoolingHead.YES_NO:
                assert yes_no is not None, "a YES_NO request names its (no, yes) tokens"
                pair = torch.tensor(yes_no, dtype=torch.int64, device=hidden.device)
                logits = self.model.compute_token_logits(vectors.to(hidden.dtype), pair)  # [F, 2]
                out = (logits[:, 1] - logits[:, 0]).unsqueeze(1)
            else:
                out = vectors
            out = out.float().cpu()
            for i, (request_id, _) in enumerate(rows):
                results[request_id] = out[i]
        return results
