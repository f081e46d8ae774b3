"""CUDA graphs for decode steps.

A decode step of a small model is mostly kernel-launch overhead: a 1B Llama issues about 10
launches per layer, each costing tens of microseconds of Python and driver time, against a few
milliseconds of GPU work. So pure-decode steps (every sequence brings one query token) replay a
graph captured once per batch size in `capture_sizes`; a batch of n runs in the graph of the
smallest captured size >= n, its extra rows padding. Mixed steps (prefill chunks) and batches
larger than the largest size run eagerly.

What a graph needs and how it is met here:
- Fixed addresses: every input lives in a static buffer sized for the largest batch; a step copies
  its tensors in (device-to-device) and the graph reads views of the buffers. Block tables have a
  fixed width of cdiv(max_model_len, block_size) columns.
- Fixed launch parameters: the attention metadata inside the graph says max_query_len = 1 and
  max_seq_len = max_model_len, so the split-K decode kernel's grid does not depend on the step.
- No host syncs inside: the Triton backend reads only device tensors (the host lists of the
  metadata are left empty in the graph, and no backend that supports graphs reads them).
- Padding rows must not touch real data: they write their K/V into a padding block that the
  runner allocates past the block pool's blocks (never handed to a request), attend to it with
  seq_len 1, and use token 0 at position 0.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Sequence

import torch

from qworker.engine.step_inputs import StepInputs
from qworker.model.attention import AttentionMetadata
from qworker.utils import cdiv

# (input_ids [n] int64, positions [n] int64, meta) -> hidden [n, hidden]: the model over the KV cache.
Forward = Callable[[torch.Tensor, torch.Tensor, AttentionMetadata], torch.Tensor]

# Decode batch sizes with a graph: small sizes one by one (latency-bound), then steps of 16.
_CAPTURE_SIZES = (1, 2, 4, 8, *range(16, 257, 16))


def capture_sizes(max_num_seqs: int) -> list[int]:
    """Batch sizes to capture: those of `_CAPTURE_SIZES` below max_num_seqs, then max_num_seqs
    itself when it is within the largest (a decode batch never exceeds it)."""
    sizes = [s for s in _CAPTURE_SIZES if s < max_num_seqs]
    if max_num_seqs <= _CAPTURE_SIZES[-1]:
        sizes.append(max_num_seqs)
    return sizes


class DecodeCudaGraphs:
    """Captured decode graphs of one model forward over one KV cache, one per batch size.

    `capture=False` keeps everything but the capture itself: run() executes the forward eagerly on
    the same padded static buffers. That lets the CPU tests check the padding and buffer logic.
    """

    def __init__(
        self,
        forward: Forward,
        *,
        block_size: int,
        max_model_len: int,
        max_num_seqs: int,
        padding_block_id: int,
        device: torch.device,
        capture: bool = True,
        sizes: Sequence[int] | None = None,
    ) -> None:
        assert not capture or device.type == "cuda", f"CUDA graphs need a CUDA device, got {device}"
        self._model_forward = forward
        self.block_size = block_size
        self.padding_block_id = padding_block_id
        self.device = device
        # `sizes`: capture only these (benchmarks that time a few batch sizes); default: capture_sizes.
        self.sizes = sorted(set(sizes)) if sizes is not None else capture_sizes(max_num_seqs)
        self.max_batch_size = self.sizes[-1]
        self.max_blocks_per_seq = cdiv(max_model_len, block_size)
        self._is_captured = False
        self.num_runs = 0  # steps served, for stats
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._outputs: dict[int, torch.Tensor] = {}  # bs -> [bs, hidden], written by the graph
        self._metas: dict[int, AttentionMetadata] = {}

        n = self.max_batch_size
        with torch.inference_mode():  # the runner works in inference mode; so do the buffers
            self._input_ids = torch.zeros(n, dtype=torch.int64, device=device)  # [n]
            self._positions = torch.zeros(n, dtype=torch.int64, device=device)  # [n]
            self._slot_mapping = torch.zeros(n, dtype=torch.int64, device=device)  # [n]
            self._seq_lens = torch.zeros(n, dtype=torch.int32, device=device)  # [n]
            # [n, max_blocks_per_seq]: a step fills the first columns of its rows; later columns
            # keep stale but valid block ids that the kernels never read (they stop at seq_len).
            self._block_tables = torch.zeros((n, self.max_blocks_per_seq), dtype=torch.int32, device=device)
            # Every row is one query token: query_start_loc is 0, 1, ..., n for good.
            self._query_start_loc = torch.arange(n + 1, dtype=torch.int32, device=device)  # [n + 1]
            self._fill_padding(0, n)
        for bs in self.sizes:
            self._metas[bs] = AttentionMetadata(
                slot_mapping=self._slot_mapping[:bs],
                block_tables=self._block_tables[:bs],
                seq_lens=self._seq_lens[:bs],
                query_start_loc=self._query_start_loc[: bs + 1],
                num_decode_seqs=bs,
                # Host lists would be frozen at capture time; graph-capable backends never read them.
                seq_lens_list=[],
                query_lens_list=[],
                block_ids_list=[],
                block_size=block_size,
                max_query_len=1,
                # Fixes the split-K decode grid for every replay (short contexts leave splits empty).
                max_seq_len=max_model_len,
            )
        if capture:
            self.capture()

    # -- capture -------------------------------------------------------------------------------

    def _forward(self, bs: int) -> torch.Tensor:
        return self._model_forward(self._input_ids[:bs], self._positions[:bs], self._metas[bs])

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture one graph per size, largest first, all in one memory pool (only one graph
        replays at a time, so their intermediates may share memory)."""
        assert not self._is_captured, "graphs are already captured"
        # Every row is a padding row while capturing: warm-up runs only write the padding block.
        self._fill_padding(0, self.max_batch_size)
        pool = torch.cuda.graph_pool_handle()
        current = torch.cuda.current_stream(self.device)
        for bs in reversed(self.sizes):
            # Warm up on a side stream first: compiles the Triton kernels for this shape and sets
            # up cuBLAS workspaces, neither of which may happen during capture.
            stream = torch.cuda.Stream(self.device)
            stream.wait_stream(current)
            with torch.cuda.stream(stream):
                for _ in range(2):
                    self._forward(bs)
            current.wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self._outputs[bs] = self._forward(bs)
            self._graphs[bs] = graph
        torch.cuda.synchronize(self.device)
        self._is_captured = True

    # -- replay --------------------------------------------------------------------------------

    def can_run(self, inputs: StepInputs) -> bool:
        """True for a pure-decode step that fits a captured size and the block-table width."""
        meta = inputs.meta
        num_seqs = meta.query_start_loc.shape[0] - 1
        return (
            meta.max_query_len == 1
            and 0 < num_seqs <= self.max_batch_size
            and meta.block_tables.shape[1] <= self.max_blocks_per_seq
        )

    def padded_size(self, num_seqs: int) -> int:
        return self.sizes[bisect.bisect_left(self.sizes, num_seqs)]

    def run(self, inputs: StepInputs) -> torch.Tensor:
        """Run the step's model forward in the graph of its padded size -> hidden [num_seqs, hidden].

        The returned tensor is a view of the graph's output buffer: use it before the next run."""
        meta = inputs.meta
        n = meta.query_start_loc.shape[0] - 1
        bs = self.padded_size(n)
        width = meta.block_tables.shape[1]
        self._input_ids[:n].copy_(inputs.input_ids)
        self._positions[:n].copy_(inputs.positions)
        self._slot_mapping[:n].copy_(meta.slot_mapping)
        self._seq_lens[:n].copy_(meta.seq_lens)
        self._block_tables[:n, :width].copy_(meta.block_tables)
        if bs > n:  # a previous, larger batch may have left real rows there
            self._fill_padding(n, bs)
        self.num_runs += 1
        if self._is_captured:
            self._graphs[bs].replay()
            return self._outputs[bs][:n]
        return self._forward(bs)[:n]

    def _fill_padding(self, start: int, end: int) -> None:
        """Rows [start, end) become padding rows: token 0 at position 0, whose K/V go to slot 0 of
        the padding block, attending to that slot alone."""
        self._input_ids[start:end] = 0
        self._positions[start:end] = 0
        self._slot_mapping[start:end] = self.padding_block_id * self.block_size
        self._seq_lens[start:end] = 1
        self._block_tables[start:end, 0] = self.padding_block_id
