"""Synthetic pure-decode steps on the e2e model (Llama-3.2-1B shape on the GPU), for the roofline,
profile and consistency stages: B rows, each at context C on its own KV blocks, straight into the
engine's runner (no scheduler, no prefill: a decode step's cost depends on the context lengths and
block tables, not on what the cache holds, so the cache holds random values instead of prefilled
ones). Graphs are captured for the chosen batch sizes only (DecodeCudaGraphs(sizes=...)).

One engine per process and sizes (`probe_for`): the three stages share it, and with it the 1B
weights and the KV cache, instead of building them three times.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from qworker.bench.gpu_check.runs import build_hf_model
from qworker.bench.gpu_check.sizes import Sizes
from qworker.utils import cdiv

BLOCK_SIZE = 16


@contextlib.contextmanager
def switches(values: Mapping[str, str]) -> Iterator[None]:
    """Set the kernels' switch environment variables (QWORKER_DECODE_SPLITS, QWORKER_KV_WRITE)
    for the duration; the kernels read them per call, and a capture keeps what they read."""
    before = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in before.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@dataclass
class DecodeProbe:
    engine: Any  # LLMEngine, built with enforce_eager (graphs come from `graphs`)
    hf_config: Any
    dtype_bytes: int
    max_batch: int
    max_context: int

    @property
    def runner(self) -> Any:
        return self.engine.runner

    def graphs(self, sizes: tuple[int, ...]) -> Any:
        """Fresh decode graphs for `sizes` (captured on CUDA under the current switches)."""
        from qworker.engine.cuda_graphs import DecodeCudaGraphs

        runner = self.runner
        return DecodeCudaGraphs(
            runner._forward,
            block_size=runner.block_size,
            max_model_len=runner.max_model_len,
            max_num_seqs=runner.max_num_seqs,
            padding_block_id=runner.padding_block_id,
            device=runner.device,
            capture=runner.device.type == "cuda",
            sizes=sizes,
        )

    def inputs(self, batch: int, context: int, seed: int = 0) -> Any:
        """A pure-decode StepInputs: row i at seq_len `context` (its new token at position
        context - 1), on blocks [i * n, (i + 1) * n) with n = cdiv(context, BLOCK_SIZE)."""
        import torch

        from qworker.engine.step_inputs import StepInputs
        from qworker.model.attention import AttentionMetadata

        assert batch <= self.max_batch and context <= self.max_context, (batch, context)
        device = self.runner.device
        n = cdiv(context, BLOCK_SIZE)
        gen = torch.Generator().manual_seed(seed)
        block_tables = torch.arange(batch * n, dtype=torch.int32).view(batch, n)  # [batch, n]
        last = context - 1
        slot_mapping = block_tables[:, last // BLOCK_SIZE].to(torch.int64) * BLOCK_SIZE + last % BLOCK_SIZE
        meta = AttentionMetadata(
            slot_mapping=slot_mapping.to(device),
            block_tables=block_tables.to(device),
            seq_lens=torch.full((batch,), context, dtype=torch.int32, device=device),
            query_start_loc=torch.arange(batch + 1, dtype=torch.int32, device=device),
            num_decode_seqs=batch,
            seq_lens_list=[context] * batch,
            query_lens_list=[1] * batch,
            block_ids_list=block_tables.tolist(),
            block_size=BLOCK_SIZE,
            max_query_len=1,
            max_seq_len=context,
        )
        vocab = self.hf_config.vocab_size
        return StepInputs(
            input_ids=torch.randint(3, vocab, (batch,), generator=gen).to(device),
            positions=torch.full((batch,), last, dtype=torch.int64, device=device),
            meta=meta,
            logits_indices=torch.arange(batch, device=device),
            sampled_requests=[],
        )

    def padded(self, inputs: Any, size: int, max_seq_len: int) -> Any:
        """`inputs` with padding rows up to `size`, as a graph replay pads them (token 0 at position
        0 writing to the padding block, seq_len 1), and the attention's max_seq_len set (a graph
        has max_model_len there, which fixes its split count)."""
        import dataclasses

        import torch

        meta = inputs.meta
        n = meta.query_start_loc.shape[0] - 1
        pad = size - n
        device = self.runner.device
        pad_block = self.runner.padding_block_id
        tables = torch.zeros((size, meta.block_tables.shape[1]), dtype=torch.int32, device=device)
        tables[:n] = meta.block_tables
        tables[n:, 0] = pad_block
        padded_meta = dataclasses.replace(
            meta,
            slot_mapping=torch.cat(
                [
                    meta.slot_mapping,
                    torch.full((pad,), pad_block * BLOCK_SIZE, dtype=torch.int64, device=device),
                ]
            ),
            block_tables=tables,
            seq_lens=torch.cat([meta.seq_lens, torch.ones(pad, dtype=torch.int32, device=device)]),
            query_start_loc=torch.arange(size + 1, dtype=torch.int32, device=device),
            num_decode_seqs=size,
            seq_lens_list=[],
            query_lens_list=[],
            block_ids_list=[],
            max_seq_len=max_seq_len,
        )
        zeros = torch.zeros(pad, dtype=torch.int64, device=device)
        return dataclasses.replace(
            inputs,
            input_ids=torch.cat([inputs.input_ids, zeros]),
            positions=torch.cat([inputs.positions, zeros]),
            meta=padded_meta,
            logits_indices=torch.arange(size, device=device),
        )

    def eager_hidden(self, inputs: Any) -> Any:
        import torch

        with torch.inference_mode():
            return self.runner._forward(inputs.input_ids, inputs.positions, inputs.meta)

    def logits_argmax(self, hidden: Any) -> Any:
        """The rest of a greedy step: the lm head (float32 logits) and the argmax the sampler takes
        when every row is greedy (qworker.engine.sampler: no softmax then)."""
        import torch

        with torch.inference_mode():
            return self.runner.model.compute_logits(hidden).argmax(dim=-1)


_PROBES: dict[tuple[int, str, str], DecodeProbe] = {}


def probe_for(sizes: Sizes, *, model: str = "e2e", dtype: str | None = None) -> DecodeProbe:
    """An engine with room for the largest roofline / profile / consistency step, built once per
    (sizes, model, dtype). model: "e2e" (sizes.e2e_model) or "parity" (sizes.parity_model);
    dtype: a torch dtype name, default the e2e dtype."""
    dtype_name = dtype or sizes.e2e_dtype
    key = (id(sizes), model, dtype_name)
    if key not in _PROBES:
        import torch

        from qworker.config import EngineConfig
        from qworker.engine.llm_engine import LLMEngine

        torch_dtype = getattr(torch, dtype_name)
        shape = sizes.e2e_model if model == "e2e" else sizes.parity_model
        hf = build_hf_model(shape, torch_dtype, torch.device(sizes.device))
        max_batch = max(*sizes.roofline_batches, sizes.profile_batch, *sizes.consistency_batches)
        max_context = max(*sizes.roofline_contexts, sizes.profile_context, sizes.consistency_context)
        config = EngineConfig(
            model="random-llama",
            device=sizes.device,
            attention_backend="triton",
            dtype=dtype_name,
            max_model_len=max(sizes.e2e_max_model_len, max_context),
            max_num_seqs=max_batch,
            num_kv_blocks=max_batch * cdiv(max_context, BLOCK_SIZE),
            block_size=BLOCK_SIZE,
            enforce_eager=True,
        )
        engine = LLMEngine(config, hf_config=hf.config, state_dict=hf.state_dict())
        hf_config = hf.config
        del hf
        with torch.inference_mode():  # random K/V: what a decode reads does not change its cost
            for k_cache, v_cache in engine.runner.kv_caches:
                k_cache.normal_(0, 0.5)
                v_cache.normal_(0, 0.5)
        _PROBES[key] = DecodeProbe(
            engine=engine,
            hf_config=hf_config,
            dtype_bytes=torch_dtype.itemsize,
            max_batch=max_batch,
            max_context=max_context,
        )
    return _PROBES[key]


def release_probes() -> None:
    _PROBES.clear()


def time_ms(fn: Callable[[], object], iters: int, device: str) -> float:
    """Mean milliseconds per call of fn after one untimed call (CUDA events on the GPU)."""
    import torch

    with torch.inference_mode():
        fn()
        if device == "cuda":
            torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(iters):
                fn()
            end.record()
            end.synchronize()
            return start.elapsed_time(end) / iters
        t = time.perf_counter()
        for _ in range(iters):
            fn()
        return (time.perf_counter() - t) * 1e3 / iters
