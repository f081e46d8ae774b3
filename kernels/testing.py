"""Kernel-against-reference checks that need no pytest: input builders, case lists, tolerances
and one comparison, shared by the kernel tests and scripts/gpu_check.py.

Nothing here imports a Triton kernel at load time. `reference_checks` takes the kernel modules as
arguments (default: this package's, imported when called), because Triton reads TRITON_INTERPRET
when a kernel is decorated: a caller that sets it imports the kernels after that.
"""

from __future__ import annotations

import importlib
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, replace
from types import ModuleType
from typing import Any

import torch

# atol = rtol per dtype: what separates a kernel from its plain-torch reference (summation order,
# roundings), with room to spare; a masking or indexing bug is orders of magnitude larger.
TOLERANCES = {torch.float32: 1e-4, torch.float16: 3e-3, torch.bfloat16: 2e-2}
KERNEL_MODULES = (
    "triton_paged_attention",
    "triton_kv_cache",
    "triton_rmsnorm",
    "triton_activation",
    "triton_rotary",
    "triton_fused_moe",
)


@dataclass
class PagedBatch:
    """Inputs of the paged attention kernels. Blocks are in a random order and every slot that no
    sequence owns holds NaN, so a masking bug shows up as NaN rather than as a small error."""

    q: torch.Tensor  # [num_tokens, num_heads, head_dim]
    k_cache: torch.Tensor  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor
    block_tables: torch.Tensor  # [num_seqs, max_blocks] int32
    query_start_loc: torch.Tensor  # [num_seqs + 1] int32
    seq_lens: torch.Tensor  # [num_seqs] int32
    scale: float

    @property
    def varlen_args(self) -> tuple[Any, ...]:
        """The arguments of paged_attention (and its reference)."""
        return (
            self.q,
            self.k_cache,
            self.v_cache,
            self.block_tables,
            self.query_start_loc,
            self.seq_lens,
            self.scale,
        )

    @property
    def decode_args(self) -> tuple[Any, ...]:
        """The arguments of paged_decode_attention (and its reference): one query token per sequence."""
        return (self.q, self.k_cache, self.v_cache, self.block_tables, self.seq_lens, self.scale)


def cpu_flags() -> set[str]:
    """The CPU's feature flags from /proc/cpuinfo (empty where there is none): the kernel tests
    pick the code paths and build targets a machine can run by them."""
    try:
        with open("/proc/cpuinfo") as f:
            return next((set(line.split(":", 1)[1].split()) for line in f if line.startswith("flags")), set())
    except OSError:
        return set()


def make_paged_batch(
    seqs: Sequence[tuple[int, int]],
    *,
    block_size: int,
    head_dim: int,
    num_heads: int,
    num_kv_heads: int,
    dtype: torch.dtype,
    device: torch.device | str = "cpu",
    seed: int = 0,
) -> PagedBatch:
    """A batch of sequences given as (cached prefix length, query length)."""
    gen = torch.Generator().manual_seed(seed)
    blocks_per_seq = [-(-(prefix + query) // block_size) for prefix, query in seqs]
    num_blocks = sum(blocks_per_seq) + 2  # + spares that no sequence owns
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.full(shape, float("nan"), dtype=dtype)
    v_cache = torch.full(shape, float("nan"), dtype=dtype)
    # Blocks scattered as a block pool hands them out; padding entries of the table are 0.
    physical = torch.randperm(num_blocks, generator=gen)
    block_tables = torch.zeros((len(seqs), max(blocks_per_seq) + 1), dtype=torch.int32)
    next_block = 0
    for s, ((prefix, query), n) in enumerate(zip(seqs, blocks_per_seq, strict=True)):
        ids = physical[next_block : next_block + n]
        next_block += n
        block_tables[s, :n] = ids.to(torch.int32)
        seq_len = prefix + query
        for pos in range(0, seq_len, block_size):
            count = min(block_size, seq_len - pos)
            block = int(ids[pos // block_size])
            k_cache[block, :count] = torch.randn((count, num_kv_heads, head_dim), generator=gen).to(dtype)
            v_cache[block, :count] = torch.randn((count, num_kv_heads, head_dim), generator=gen).to(dtype)
    query_lens = torch.tensor([query for _, query in seqs])
    query_start_loc = torch.zeros(len(seqs) + 1, dtype=torch.int32)
    query_start_loc[1:] = torch.cumsum(query_lens, 0)
    seq_lens = torch.tensor([prefix + query for prefix, query in seqs], dtype=torch.int32)
    q = torch.randn((int(query_lens.sum()), num_heads, head_dim), generator=gen).to(dtype)
    return PagedBatch(
        q=q.to(device),
        k_cache=k_cache.to(device),
        v_cache=v_cache.to(device),
        block_tables=block_tables.to(device),
        query_start_loc=query_start_loc.to(device),
        seq_lens=seq_lens.to(device),
        scale=head_dim**-0.5,
    )


def varlen_seqs(block_size: int) -> list[tuple[int, int]]:
    """(cached prefix, query len): contexts of 1, one block, one block + 1 and several blocks;
    chunks of 1, 7 and 64 tokens with and without a cached prefix."""
    return [
        (0, 1),
        (block_size - 1, 1),
        (block_size, 1),
        (3 * block_size + 5, 1),
        (0, 7),
        (max(0, block_size - 3), 7),
        (2 * block_size + 1, 64),
        (0, 64),
    ]


def decode_seqs(block_size: int) -> list[tuple[int, int]]:
    """Decode rows (one query token each) up to a 1000-token context."""
    return [(0, 1), (block_size - 1, 1), (block_size, 1), (999, 1), (5 * block_size + 2, 1)]


def attention_extras_cases(block_size: int) -> list[tuple[int | None, float | None]]:
    """(sliding_window, logits_soft_cap) pairs for the attention kernels. Against varlen_seqs and
    decode_seqs: a window of 1, one equal to the contexts of block_size + 1 (so shorter than
    others, and not a multiple of the block size), one longer than every context, a cap alone,
    and a cap with a window. Scores of a few units bend under a cap of 2.5 (see EXTRAS_SCALE)."""
    return [(1, None), (block_size + 1, None), (5000, None), (None, 2.5), (2 * block_size + 3, 2.5)]


# Softmax scale of the extras cases: randn q and k give scaled scores of about 3 units, so a cap of
# 2.5 changes most of them (the usual head_dim ** -0.5 gives scores near 1, where tanh is almost
# linear and a missing cap would hide inside the tolerance).
EXTRAS_SCALE_FACTOR = 3.0


@dataclass(frozen=True)
class MoeCase:
    """One fused-MoE input: T tokens of hidden size H, E experts of intermediate size I, top-k."""

    name: str
    num_tokens: int
    hidden_size: int
    intermediate_size: int
    num_experts: int
    top_k: int
    dtype: torch.dtype


def moe_cases(dtypes: Sequence[torch.dtype] = (torch.float32, torch.bfloat16)) -> list[MoeCase]:
    """Odd sizes (H and I not multiples of the 32/64 tiles), top-1 and top-2 of 4 to 8 experts,
    one token (a decode), a few, and enough that row tiles of 64 fill; every case in the first
    dtype, two in the others."""
    shapes = [
        (1, 48, 40, 4, 2),
        (7, 72, 24, 8, 2),
        (33, 48, 80, 6, 1),
        (70, 40, 48, 4, 2),
        (300, 40, 24, 4, 2),  # 600 pairs: row tiles of 64
    ]
    cases = []
    for dtype in dtypes:
        for t, h, i, e, k in shapes if dtype == dtypes[0] else shapes[1:3]:
            name = f"t{t}_h{h}_i{i}_e{e}_top{k}_{str(dtype).removeprefix('torch.')}"
            cases.append(MoeCase(name, t, h, i, e, k, dtype))
    return cases


def make_moe_inputs(
    case: MoeCase, device: torch.device | str = "cpu", seed: int = 0
) -> tuple[torch.Tensor, ...]:
    """(hidden, w_gate_up, w_down, topk_weights, topk_ids) as a router would give them: distinct
    experts per token, weights that sum to 1. Weights are scaled so that outputs stay near 1."""
    gen = torch.Generator().manual_seed(seed)
    t, h, i, e = case.num_tokens, case.hidden_size, case.intermediate_size, case.num_experts
    hidden = torch.randn(t, h, generator=gen)
    w_gate_up = torch.randn(e, 2 * i, h, generator=gen) * h**-0.5
    w_down = torch.randn(e, h, i, generator=gen) * i**-0.5
    logits = torch.randn(t, e, generator=gen)
    weights, ids = torch.topk(logits.softmax(-1), case.top_k, dim=-1)
    weights = weights / weights.sum(-1, keepdim=True)
    tensors = (hidden.to(case.dtype), w_gate_up.to(case.dtype), w_down.to(case.dtype), weights, ids)
    return tuple(x.to(device) for x in tensors)


@dataclass(frozen=True)
class CaseResult:
    kernel: str
    case: str
    dtype: str
    ok: bool
    max_abs_err: float | None = None
    atol: float | None = None  # None: the output must equal the reference exactly
    has_nan: bool = False

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def describe_failure(self) -> str:
        return f"{self.kernel} {self.case} {self.dtype}: max_abs_err {self.max_abs_err}, nan={self.has_nan}"


def compare(
    kernel: str, case: str, got: torch.Tensor, expected: torch.Tensor, exact: bool = False
) -> CaseResult:
    """The kernel's output against its reference, within TOLERANCES (or exactly)."""
    dtype_name = str(expected.dtype).removeprefix("torch.")
    has_nan = bool(got.isnan().any()) and not bool(expected.isnan().any())
    diff = (got.float() - expected.float()).abs()
    max_err = float(diff.max()) if diff.numel() else 0.0
    if exact:
        return CaseResult(kernel, case, dtype_name, torch.equal(got, expected), max_err, None, has_nan)
    tol = TOLERANCES[expected.dtype]
    ok = not has_nan and bool(torch.allclose(got.float(), expected.float(), atol=tol, rtol=tol))
    return CaseResult(kernel, case, dtype_name, ok, max_err, tol, has_nan)


def _extras_checks(
    pa: ModuleType, varlen: PagedBatch, decode: PagedBatch, name: str, max_seq_len: int
) -> Iterator[CaseResult]:
    """The attention kernels with each of attention_extras_cases, against their references."""
    block_size = varlen.k_cache.shape[1]
    for window, cap in attention_extras_cases(block_size):
        extras = {"sliding_window": window, "logits_soft_cap": cap}
        case = f"{name}_window{window}_cap{cap}"
        b = replace(varlen, scale=varlen.scale * EXTRAS_SCALE_FACTOR)
        got = pa.paged_attention(*b.varlen_args, max_query_len=64, max_seq_len=max_seq_len, **extras)
        yield compare("paged_attention", case, got, pa.paged_attention_reference(*b.varlen_args, **extras))
        d = replace(decode, scale=decode.scale * EXTRAS_SCALE_FACTOR)
        expected = pa.paged_decode_attention_reference(*d.decode_args, **extras)
        for num_splits in (None, 3):  # 3 splits of a window: some of them empty
            got = pa.paged_decode_attention(*d.decode_args, num_splits=num_splits, max_seq_len=1000, **extras)
            yield compare("paged_decode_attention", f"{case}_splits{num_splits}", got, expected)


def kernel_modules() -> dict[str, ModuleType]:
    """This package's Triton kernel modules, by file name."""
    return {name: importlib.import_module(f"qworker_kernels.{name}") for name in KERNEL_MODULES}


def reference_checks(
    device: torch.device | str,
    dtypes: Sequence[torch.dtype],
    block_sizes: Sequence[int],
    head_dims: Sequence[int],
    gqa_ratios: Sequence[int],
    norm_hidden_sizes: Sequence[int],
    modules: dict[str, ModuleType] | None = None,
) -> Iterator[CaseResult]:
    """Every Triton kernel against its reference, case by case (each case may compile a kernel,
    so a caller with a time budget can stop between cases). Attention covers the whole
    block size x head dim x GQA grid in the first dtype and its first point in the others."""
    mods = modules if modules is not None else kernel_modules()
    pa, kv = mods["triton_paged_attention"], mods["triton_kv_cache"]
    rn, act, rot = mods["triton_rmsnorm"], mods["triton_activation"], mods["triton_rotary"]
    fused_moe = mods["triton_fused_moe"]
    gen = torch.Generator().manual_seed(0)

    def randn(*shape: int, dtype: torch.dtype) -> torch.Tensor:
        return torch.randn(shape, generator=gen).to(dtype).to(device)

    for dtype in dtypes:
        grid = [(bs, hd, g) for bs in block_sizes for hd in head_dims for g in gqa_ratios]
        # Windows and soft-caps at the grid's two corners (the first and the last block size, head
        # dim and GQA ratio; each point, switch and split count is a compile), in the first dtype;
        # at the first corner in the others.
        extras_points = {grid[0], grid[-1]}
        for block_size, head_dim, gqa in grid if dtype == dtypes[0] else grid[:1]:
            shape = dict(block_size=block_size, head_dim=head_dim, num_heads=2 * gqa, num_kv_heads=2)
            name = f"bs{block_size}_hd{head_dim}_gqa{gqa}"
            seqs = varlen_seqs(block_size)
            b = make_paged_batch(seqs, dtype=dtype, device=device, **shape)
            got = pa.paged_attention(
                *b.varlen_args, max_query_len=64, max_seq_len=max(p + q for p, q in seqs)
            )
            yield compare("paged_attention", name, got, pa.paged_attention_reference(*b.varlen_args))
            d = make_paged_batch(decode_seqs(block_size), dtype=dtype, device=device, seed=1, **shape)
            expected = pa.paged_decode_attention_reference(*d.decode_args)
            # The automatic split count (partial results merged by the reduce kernel) and one split
            # (the kernel writes out directly); each count is a separate compile.
            for num_splits in (None, 1):
                got = pa.paged_decode_attention(*d.decode_args, num_splits=num_splits, max_seq_len=1000)
                yield compare("paged_decode_attention", f"{name}_splits{num_splits}", got, expected)
            if (block_size, head_dim, gqa) in extras_points:
                yield from _extras_checks(pa, b, d, name, max(p + q for p, q in seqs))

    for dtype in dtypes:
        num_blocks, block_size, kvh, hd, tokens = 12, 16, 8, 64, 37
        k, v = randn(tokens, kvh, hd, dtype=dtype), randn(tokens, kvh, hd, dtype=dtype)
        slots = torch.randperm(num_blocks * block_size, generator=gen)[:tokens].to(device)
        caches = [
            torch.zeros((num_blocks, block_size, kvh, hd), dtype=dtype, device=device) for _ in range(4)
        ]
        kv.write_kv_cache(k, v, caches[0], caches[1], slots)
        kv.write_kv_cache_reference(k, v, caches[2], caches[3], slots)
        yield compare("write_kv_cache.k", f"{tokens}tok", caches[0], caches[2], exact=True)
        yield compare("write_kv_cache.v", f"{tokens}tok", caches[1], caches[3], exact=True)

    for dtype in dtypes:
        for hidden in norm_hidden_sizes:
            x, res, w = (
                randn(33, hidden, dtype=dtype),
                randn(33, hidden, dtype=dtype),
                randn(hidden, dtype=dtype),
            )
            yield compare(
                "rms_norm", f"h{hidden}", rn.rms_norm(x, w, 1e-5), rn.rms_norm_reference(x, w, 1e-5)
            )
            out, res_out = rn.fused_add_rms_norm(x, res, w, 1e-5)
            ref_out, ref_res = rn.fused_add_rms_norm_reference(x, res, w, 1e-5)
            yield compare("fused_add_rms_norm", f"h{hidden}", out, ref_out)
            yield compare("fused_add_rms_norm.residual", f"h{hidden}", res_out, ref_res)
            gate_up = randn(17, 2 * hidden, dtype=dtype)
            yield compare(
                "silu_and_mul", f"i{hidden}", act.silu_and_mul(gate_up), act.silu_and_mul_reference(gate_up)
            )
        # Rotary on strided q/k views of a fused qkv buffer, as the model calls it.
        tokens, nh, kvh, hd, max_pos = 29, 32, 8, 64, 4096
        qkv = randn(tokens, (nh + 2 * kvh) * hd, dtype=dtype)
        positions = torch.randint(0, max_pos, (tokens,), generator=gen).to(device)
        angles = torch.rand((max_pos, hd // 2), generator=gen).to(device) * 6.3
        cos, sin = angles.cos(), angles.sin()
        ref = qkv.clone()
        for buf, fn in ((qkv, rot.apply_rotary), (ref, rot.apply_rotary_reference)):
            q, k, _ = buf.split([nh * hd, kvh * hd, kvh * hd], dim=-1)
            fn(q.view(tokens, nh, hd), k.view(tokens, kvh, hd), positions, cos, sin)
        yield compare("apply_rotary", "strided_qkv", qkv, ref)

    for case in moe_cases(dtypes):
        moe_args = make_moe_inputs(case, device=device)
        got = fused_moe.fused_moe(*moe_args)
        yield compare("fused_moe", case.name, got, fused_moe.fused_moe_reference(*moe_args))
