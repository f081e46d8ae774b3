"""The model runner owns the device: it picks the device and dtype, puts the model's weights there,
allocates the paged KV cache, and turns each scheduler plan into tensors, runs the model (eagerly or
by replaying a decode CUDA graph) and samples the next tokens."""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import replace

import numpy as np
import torch

from qworker.config import DTYPE_ALIASES, EngineConfig
from qworker.engine.cuda_graphs import DecodeCudaGraphs
from qworker.engine.input_batch import CachedRequestState, InputBatch
from qworker.engine.kv_cache_memory import kv_cache_budget_bytes
from qworker.engine.runner_output import RunnerOutput
from qworker.engine.sampler import Sampler, SamplingRow, TokenBitmask, compute_logprobs, skip_draws
from qworker.engine.scheduler_output import GrammarRows, ScheduledRequest, SchedulerOutput
from qworker.engine.step_inputs import StepInputs
from qworker.errors import InvalidConfigError
from qworker.lora.layers import LoRAModel, build_step_meta
from qworker.model.attention import AttentionMetadata, select_attention_backend
from qworker.model.config import ModelConfig
from qworker.model.decoder import DecoderForCausalLM
from qworker.model.ops import select_model_ops
from qworker.model.pooler import Pooler, PoolingChunk
from qworker.model.skip_init import skip_weight_init
from qworker.model.weights import load_checkpoint
from qworker.quantization.scheme import QuantizationPlan, QuantizationSource
from qworker.utils import cdiv

logger = logging.getLogger(__name__)


def resolve_device(device: str) -> torch.device:
    """`auto` is CUDA when available, else the CPU; any other name goes to torch.device, and must
    name a device this machine has (else InvalidConfigError)."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        resolved = torch.device(device)
    except RuntimeError:
        raise InvalidConfigError(f"device {device!r} is not a device name; use auto, cpu or cuda") from None
    if resolved.type == "cuda":
        if not torch.cuda.is_available():
            build = f"CUDA {torch.version.cuda}" if torch.version.cuda else "CPU only"
            raise InvalidConfigError(
                f"device {device!r}: torch finds no CUDA device here (torch {torch.__version__}, {build}); "
                "use --device cpu or auto"
            )
        if resolved.index is not None and resolved.index >= torch.cuda.device_count():
            raise InvalidConfigError(
                f"device {device!r}: this machine has {torch.cuda.device_count()} CUDA device(s)"
            )
    elif resolved.type != "cpu":
        raise InvalidConfigError(f"device {device!r} is not supported; use auto, cpu or cuda")
    return resolved


def cpu_has_fast_bf16() -> bool:
    """True when the CPU multiplies bf16 in hardware (AMX or AVX512-BF16)."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line for line in f if line.startswith("flags")), "")
    except OSError:
        return False
    return any(flag in flags.split() for flag in ("amx_bf16", "avx512_bf16"))


def resolve_dtype(dtype: str | torch.dtype, device: torch.device) -> torch.dtype:
    """`auto` is bf16 on accelerators and on CPUs with bf16 hardware, else fp32."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        if device.type != "cpu" or cpu_has_fast_bf16():
            return torch.bfloat16
        # Without AMX or AVX512-BF16, bf16 matmuls run a slow path: measured 7x slower than
        # fp32 on an AVX2-only EPYC (0.018 vs 0.136 TFLOP/s at 256x576x1536).
        return torch.float32
    if dtype not in DTYPE_ALIASES:
        raise ValueError(f"unknown dtype {dtype!r}; use auto, float32, bfloat16 or float16")
    return getattr(torch, DTYPE_ALIASES[dtype])


def _recompute_past_longrope_switch(
    item: ScheduledRequest, state: CachedRequestState, original_len: int
) -> ScheduledRequest:
    """A sequence whose prompt fit the original context computed its KV with longrope's short
    factors; the step that takes it past that context recomputes all of it with the long ones
    (from position 0, in the blocks it holds), as transformers drops its cache there."""
    if state.num_prompt_tokens <= original_len < item.num_tokens and 0 < item.start_position <= original_len:
        assert state.token_ids is not None, f"request {item.request_id}: the runner keeps no token ids"
        end = item.start_position + len(item.token_ids)
        return replace(item, token_ids=state.token_ids[:end], start_position=0)
    return item


class ModelRunner:
    """Owns the model on its device and the paged KV cache; runs one scheduler plan per step.

    `state_dict` holds a Hugging Face checkpoint's tensors (None leaves the random init, for tests).
    `eos_token_ids` are masked while a request is below its min_tokens. CUDA graphs are enabled at
    construction on CUDA with a backend that supports them, unless `config.enforce_eager`.
    `quantization` (qworker.quantization.resolve_quantization's plan; None: unquantized) swaps the
    decoder's projections for int8 ones after the checkpoint loads.
    """

    def __init__(
        self,
        config: EngineConfig,
        model_config: ModelConfig,
        max_model_len: int,
        *,
        state_dict: dict[str, torch.Tensor] | None = None,
        eos_token_ids: Iterable[int] = (),
        quantization: QuantizationPlan | None = None,
    ) -> None:
        self.device = resolve_device(config.device)
        self.dtype = resolve_dtype(config.dtype, self.device)
        if self.dtype is torch.bfloat16 and self.device.type == "cpu" and not cpu_has_fast_bf16():
            logger.warning(
                "bfloat16 on a CPU without AMX or AVX512-BF16: its matmuls run a slow path, 5-7x "
                "slower than float32 on AVX2-only EPYCs; --dtype auto picks float32 on this CPU"
            )
        self.block_size = config.block_size
        self.max_model_len = max_model_len
        self.max_num_seqs = config.max_num_seqs
        self.backend = select_attention_backend(config.attention_backend, self.device)
        ops = select_model_ops(self.backend.name, self.device)
        # A checkpoint overwrites every weight: no random draws for it (qworker/model/skip_init.py).
        with skip_weight_init(enabled=state_dict is not None):
            model = DecoderForCausalLM(model_config, max_positions=max_model_len, ops=ops)
        self.quantization = quantization
        checkpoint_int8 = None
        if quantization is not None:
            from qworker.quantization.compressed_tensors import split_w8a8_checkpoint
            from qworker.quantization.int8_linear import check_int8_device

            check_int8_device(self.device)
            if config.enable_lora:
                raise InvalidConfigError(
                    "enable_lora with quantization=int8 is not supported: the adapter layers take "
                    "float base weights; run LoRA on the unquantized model"
                )
            if quantization.source is QuantizationSource.COMPRESSED_TENSORS and state_dict is not None:
                state_dict, checkpoint_int8 = split_w8a8_checkpoint(state_dict, model_config)
        if state_dict is not None:
            load_checkpoint(model, state_dict, model_config)
        if quantization is not None:
            from qworker.quantization.decoder import quantize_decoder

            # Before the move to the model dtype: weights quantize from the checkpoint's values.
            quantize_decoder(model, checkpoint_int8)
        self.model = model.to(device=self.device, dtype=self.dtype).eval()
        if config.batch_invariant:
            from qworker.model.batch_invariant import make_batch_invariant

            self.backend = make_batch_invariant(self.model, self.device)
        # RoPE tables stay float32, as transformers computes them.
        self.model.rotary.float()
        # LoRA adapter layers (qworker/lora/layers.py); none at all with enable_lora off.
        self.lora: LoRAModel | None = None
        if config.enable_lora:
            if config.batch_invariant:
                raise InvalidConfigError(
                    "enable_lora with batch_invariant: the adapters' matmuls are not invariant"
                )
            self.lora = LoRAModel(self.model, config.max_loras, config.max_lora_rank)
            logger.info(
                "LoRA: %d slot(s) of rank %d, %.1f MiB",
                config.max_loras,
                config.max_lora_rank,
                self.lora.num_bytes / 2**20,
            )

        self.num_kv_blocks = config.num_kv_blocks or self._num_kv_blocks_from_memory(model_config, config)
        # One block more than the pool hands out: the padding rows of a CUDA-graph decode batch
        # write their K/V there.
        self.padding_block_id = self.num_kv_blocks
        # One allocation for every layer: [layers, 2 (k, v), blocks + 1, block_size, kv_heads, head_dim].
        # Zeroed: padding block ids in block tables point into it and must not hold NaNs.
        kv_cache = torch.zeros(
            (
                model_config.num_layers,
                2,
                self.num_kv_blocks + 1,
                self.block_size,
                model_config.num_kv_heads,
                model_config.head_dim,
            ),
            dtype=self.dtype,
            device=self.device,
        )
        # Per layer (k_cache, v_cache), each [blocks + 1, block_size, kv_heads, head_dim].
        self.kv_caches = [(kv_cache[i, 0], kv_cache[i, 1]) for i in range(model_config.num_layers)]

        self.input_batch = InputBatch(
            config.max_num_seqs,
            cdiv(max_model_len, self.block_size),
            keep_token_ids=self.model.config.longrope_original_len is not None,
        )
        # Pooling requests' kept rows and sums across their chunks (qworker/model/pooler.py).
        self.pooler = Pooler(self.model, self.device)
        self.sampler = Sampler(tuple(sorted(eos_token_ids)), seed=config.seed)
        self._generators: dict[str, torch.Generator] = {}
        self._decode_graphs: DecodeCudaGraphs | None = None
        self._is_cuda_graphs_enabled = False
        if self.device.type == "cuda" and self.backend.supports_cuda_graphs and not config.enforce_eager:
            self.enable_cuda_graphs()

    def _num_kv_blocks_from_memory(self, model_config: ModelConfig, config: EngineConfig) -> int:
        bytes_per_block = (
            2
            * model_config.num_layers
            * self.block_size
            * model_config.num_kv_heads
            * model_config.head_dim
            * self.dtype.itemsize
        )
        # kv_cache_memory_bytes, gpu_memory_utilization or the CPU default (kv_cache_memory.py).
        budget = kv_cache_budget_bytes(config, model_config, self.device, self.dtype)
        # Never more than every sequence at full length would need.
        cap = self.max_num_seqs * cdiv(self.max_model_len, self.block_size)
        return max(1, min(int(budget // bytes_per_block), cap))

    # -- CUDA graphs -------------------------------------------------------------------------

    @property
    def cuda_graphs(self) -> DecodeCudaGraphs | None:
        """The decode graphs that pure-decode steps replay now; None while steps run eagerly."""
        return self._decode_graphs if self._is_cuda_graphs_enabled else None

    def enable_cuda_graphs(self, *, allow_cpu: bool = False) -> DecodeCudaGraphs:
        """Replay pure-decode steps from CUDA graphs, capturing them on the first call.

        Needs an attention backend that supports graphs (triton). On a CPU device this raises
        unless `allow_cpu`: then the same padded static buffers are built but nothing is
        captured, and graph steps run eagerly through them (smoke runs under TRITON_INTERPRET).
        Returns the graphs now in use.
        """
        if not self.backend.supports_cuda_graphs:
            raise ValueError(f"the {self.backend.name} attention backend does not support CUDA graphs")
        is_cuda = self.device.type == "cuda"
        if not is_cuda and not allow_cpu:
            raise ValueError(
                f"CUDA graphs need a CUDA device, got {self.device} (allow_cpu runs them uncaptured)"
            )
        if self._decode_graphs is None:
            self._decode_graphs = DecodeCudaGraphs(
                self._forward,
                block_size=self.block_size,
                max_model_len=self.max_model_len,
                max_num_seqs=self.max_num_seqs,
                padding_block_id=self.padding_block_id,
                device=self.device,
                capture=is_cuda,
            )
        self._is_cuda_graphs_enabled = True
        return self._decode_graphs

    def disable_cuda_graphs(self) -> None:
        """Run every step eagerly. Captured graphs are kept: enable_cuda_graphs() reuses them."""
        self._is_cuda_graphs_enabled = False

    # -- one step ----------------------------------------------------------------------------

    def _forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        return self.model(input_ids, positions, self.kv_caches, meta, self.backend)

    def update_batch(self, plan: SchedulerOutput) -> None:
        """Drop the rows of requests that left or were preempted, and add the plan's new ones."""
        for request_id in plan.finished_request_ids:
            self.input_batch.remove(request_id)
            self._generators.pop(request_id, None)
            self.pooler.drop(request_id)
        for request_id in plan.preempted_request_ids:
            # Its generator stays: a seeded request resumes its random stream where it was.
            self.input_batch.remove(request_id)
            self.pooler.drop(request_id)  # recomputed from its first token
        for new in plan.new_requests:
            self.input_batch.add(new)
            if new.pooling is not None:
                self.pooler.start(new.request_id, new.pooling)
        if plan.lora_loads:
            assert self.lora is not None, "a plan fills LoRA slots on an engine without enable_lora"
            for slot, adapter in plan.lora_loads:
                self.lora.set_slot(slot, adapter)

    def prepare_inputs(self, plan: SchedulerOutput) -> StepInputs:
        """The step's tensors, from the plan and the rows of the input batch (`update_batch` has
        taken the plan)."""
        batch = self.input_batch
        pairs = [(item, batch.update(item)) for item in plan.scheduled]
        original_len = self.model.config.longrope_original_len
        if original_len is not None:
            pairs = [
                (_recompute_past_longrope_switch(item, state, original_len), state) for item, state in pairs
            ]
        # Decodes (one query token) first: the attention backend runs them as one batch.
        pairs.sort(key=lambda pair: len(pair[0].token_ids) != 1)
        items = [item for item, _ in pairs]
        states = [state for _, state in pairs]
        num_seqs = len(items)
        num_decode_seqs = sum(1 for item in items if len(item.token_ids) == 1)
        query_lens = np.fromiter((len(item.token_ids) for item in items), dtype=np.int64, count=num_seqs)
        starts = np.fromiter((item.start_position for item in items), dtype=np.int64, count=num_seqs)
        rows = np.fromiter((state.row for state in states), dtype=np.int64, count=num_seqs)
        query_start_loc = np.zeros(num_seqs + 1, dtype=np.int64)
        np.cumsum(query_lens, out=query_start_loc[1:])
        num_tokens = int(query_start_loc[-1])
        seq_lens = starts + query_lens

        if num_tokens == num_seqs:
            input_ids = np.fromiter((item.token_ids[0] for item in items), dtype=np.int64, count=num_tokens)
            positions = starts
            seq_of_token = np.arange(num_seqs)
        else:
            input_ids = np.fromiter(
                (t for item in items for t in item.token_ids), dtype=np.int64, count=num_tokens
            )
            # positions: [T] = start of the token's seq + offset within its chunk
            seq_of_token = np.repeat(np.arange(num_seqs), query_lens)
            positions = np.arange(num_tokens) - query_start_loc[:-1][seq_of_token] + starts[seq_of_token]

        # [num_seqs, max_blocks]: the rows' tables, gathered; columns past a row's blocks are 0.
        max_blocks = int(batch.num_blocks[rows].max())
        block_tables = batch.block_table[rows, :max_blocks]
        slot_mapping = (
            block_tables[seq_of_token, positions // self.block_size].astype(np.int64) * self.block_size
            + positions % self.block_size
        )
        sampled_rows = [row for row, item in enumerate(items) if item.needs_sample]
        logits_indices = query_start_loc[1:][sampled_rows] - 1

        # Rows for prompt logprobs: positions p of the chunk with p + 1 a prompt token not yet
        # scored (a recompute after preemption skips those already reported).
        prompt_indices: list[np.ndarray] = []
        prompt_targets: list[list[int]] = []
        prompt_rows: list[tuple[str, int, int]] = []
        for row, (item, state) in enumerate(zip(items, states, strict=True)):
            num_top = state.sampling_params.prompt_logprobs
            if num_top is None:
                continue
            first = max(item.start_position, state.num_scored_prompt_tokens)
            last = min(item.start_position + len(item.token_ids), state.num_prompt_tokens - 1)
            if first >= last:
                continue
            state.num_scored_prompt_tokens = last
            offset = int(query_start_loc[row]) - item.start_position
            prompt_indices.append(np.arange(first + offset, last + offset))
            prompt_targets.append(state.prompt_token_ids[first + 1 : last + 1])
            prompt_rows.append((item.request_id, num_top, last - first))

        device = self.device
        # Longrope picks its factors by each request's whole length (see AttentionMetadata).
        request_lens = None
        if self.model.has_long_rope:
            lens = [item.num_tokens for item in items]
            request_lens = torch.tensor(lens, dtype=torch.int32).to(device)
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
            request_lens=request_lens,
        )
        lora_meta = None
        if self.lora is not None:
            token_slots = batch.lora_slot[rows]
            if num_tokens != num_seqs:
                token_slots = token_slots[seq_of_token]
            lora_meta = build_step_meta(token_slots, self.lora.max_loras, device)
        pooling_chunks = [
            PoolingChunk(
                item.request_id,
                int(query_start_loc[row]),
                item.start_position,
                len(item.token_ids),
                item.num_tokens,
            )
            for row, item in enumerate(items)
            if item.request_id in self.pooler
        ]
        return StepInputs(
            pooling=self.pooler.plan(pooling_chunks),
            lora=lora_meta,
            input_ids=torch.from_numpy(input_ids).to(device),
            positions=torch.from_numpy(positions).to(device),
            meta=meta,
            logits_indices=torch.from_numpy(logits_indices).to(device),
            sampled_requests=[items[row] for row in sampled_rows],
            prompt_logits_indices=(
                torch.from_numpy(np.concatenate(prompt_indices)).to(device) if prompt_indices else None
            ),
            prompt_target_ids=(
                torch.tensor([t for ts in prompt_targets for t in ts], dtype=torch.int64, device=device)
                if prompt_targets
                else None
            ),
            prompt_logprobs_rows=prompt_rows,
        )

    @torch.inference_mode()
    def execute(self, plan: SchedulerOutput) -> RunnerOutput:
        """Run one step: sample the next token of each request whose chunk reached its end, with
        logprobs for requests asking them (raw: before temperature and any cut). An empty plan
        only updates the input batch."""
        self.update_batch(plan)
        output = RunnerOutput()
        if plan.is_empty:
            return output
        inputs = self.prepare_inputs(plan)
        graphs = self.cuda_graphs
        if self.lora is not None:
            self.lora.set_step(inputs.lora)
            if inputs.lora is not None:
                graphs = None  # graphs are captured without adapters
        if graphs is not None and graphs.can_run(inputs):
            hidden = graphs.run(inputs)
        else:
            hidden = self._forward(inputs.input_ids, inputs.positions, inputs.meta)
        if inputs.lora is not None:
            self.lora.set_step(None)  # type: ignore[union-attr]  # set above
        if inputs.prompt_logits_indices is not None and inputs.prompt_target_ids is not None:
            prompt_logits = self.model.compute_logits(hidden[inputs.prompt_logits_indices])
            num_top = [k for _, k, count in inputs.prompt_logprobs_rows for _ in range(count)]
            scored = compute_logprobs(prompt_logits, inputs.prompt_target_ids, num_top)
            start = 0
            for request_id, _, count in inputs.prompt_logprobs_rows:
                output.prompt_logprobs[request_id] = scored[start : start + count]
                start += count
        if inputs.pooling is not None:
            output.pooled = self.pooler.pool(hidden, inputs.pooling)
        if not inputs.sampled_requests:
            return output
        logits = self.model.compute_logits(hidden[inputs.logits_indices])
        batch_requests = self.input_batch.requests
        vocab_size = logits.shape[-1]
        rows = []
        for item in inputs.sampled_requests:
            state = batch_requests[item.request_id]
            adjustments = state.adjustments
            rows.append(
                SamplingRow(
                    params=state.sampling_params,
                    # The chunk reaches the last token, so the request has num_tokens now.
                    num_output_tokens=item.num_tokens - state.num_prompt_tokens,
                    generator=self._generator_for(item.request_id, state, vocab_size),
                    adjustments=adjustments,
                    output_token_ids=(
                        state.output_token_ids(item.num_tokens)
                        if adjustments is not None and adjustments.needs_output_tokens
                        else ()
                    ),
                )
            )
        # Rows asking logprobs: their raw distribution, before the sampler masks logits in place.
        logprob_rows = [i for i, row in enumerate(rows) if row.params.logprobs is not None]
        raw_logits = logits[logprob_rows] if logprob_rows else None
        token_bitmask = self._token_bitmask(inputs.sampled_requests, plan.grammar_rows)
        token_ids = self.sampler.sample(logits, rows, token_bitmask)
        output.sampled = {
            item.request_id: token for item, token in zip(inputs.sampled_requests, token_ids, strict=True)
        }
        if raw_logits is not None:
            chosen = torch.tensor([token_ids[i] for i in logprob_rows], dtype=torch.int64, device=self.device)
            num_top = [rows[i].params.logprobs or 0 for i in logprob_rows]
            for i, position in zip(logprob_rows, compute_logprobs(raw_logits, chosen, num_top), strict=True):
                output.logprobs[inputs.sampled_requests[i].request_id] = position
        return output

    def _token_bitmask(
        self, sampled: list[ScheduledRequest], grammar_rows: GrammarRows | None
    ) -> TokenBitmask | None:
        """The plan's grammar masks, placed at their rows among `sampled` (None when there are none)."""
        if grammar_rows is None:
            return None
        row_of = {item.request_id: i for i, item in enumerate(sampled)}
        # The sampler takes the rows in increasing order; the plan lists them in its own.
        row_index = np.array([row_of[request_id] for request_id in grammar_rows.request_ids], dtype=np.int64)
        order = np.argsort(row_index, kind="stable")
        bitmask = torch.from_numpy(np.ascontiguousarray(grammar_rows.bitmask[order])).to(
            self.device, non_blocking=True
        )
        return TokenBitmask(torch.from_numpy(row_index[order]).to(self.device), bitmask)

    def _generator_for(
        self, request_id: str, state: CachedRequestState, vocab_size: int
    ) -> torch.Generator | None:
        params = state.sampling_params
        seed = params.seed
        if seed is None or params.is_greedy:
            return None
        generator = self._generators.get(request_id)
        if generator is None:
            generator = torch.Generator(device=self.device)
            # SamplingParams keeps seeds within 64 bits; the mask keeps a seed set on the object
            # afterwards from overflowing the step (torch takes [-2**63, 2**64) and wraps
            # negatives the same way).
            generator.manual_seed(seed & 0xFFFF_FFFF_FFFF_FFFF)
            if state.num_resumed_tokens:
                # A resumed request: its earlier run drew once per token (no resumed request has
                # a grammar, whose forced tokens draw nothing), on a device of this kind.
                skip_draws(generator, state.num_resumed_tokens, vocab_size, self.device)
            self._generators[request_id] = generator
        return generator
