# TRITON_INTERPRET is set by conftest.py (on machines without a GPU) before this imports a kernel.
"""The batch-invariant Triton attention: a token's output bits are the same alone or among 7 or 64
sequences, in a whole-prompt prefill, in chunks of 8, token by token (decode steps at the block,
chunk and tile edges), and after a prefix-cache hit (its prefix read from blocks another sequence
wrote), and for block sizes 4 and 16; close to the fp32 torch reference. Every cache slot no
sequence wrote holds NaN, so a read past a sequence's keys would show."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
import qworker_kernels.triton_invariant_attention as ia
import torch
from qworker_kernels.triton_common import DOT_FP32_IEEE, DOT_NATIVE

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = pytest.mark.timeout(120)

TOLERANCE = {torch.float32: dict(atol=1e-4, rtol=1e-4), torch.bfloat16: dict(atol=2e-2, rtol=2e-2)}
# (num_heads, num_kv_heads, head_dim): GQA 2 with a padded head_dim, and GQA 3 (SmolLM2's).
SHAPES = [(4, 2, 24), (3, 1, 16)]


@dataclass
class Store:
    """Sequences' q/k/v at every position, and a paged cache holding their K/V."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype
    block_size: int = 4
    num_blocks: int = 512
    seed: int = 0
    q: dict[str, torch.Tensor] = field(default_factory=dict)  # name -> [L, H, D]
    tables: dict[str, list[int]] = field(default_factory=dict)  # name -> block ids

    def __post_init__(self) -> None:
        self.gen = torch.Generator().manual_seed(self.seed)
        shape = (self.num_blocks, self.block_size, self.num_kv_heads, self.head_dim)
        self.k_cache = torch.full(shape, float("nan"), dtype=self.dtype)
        self.v_cache = torch.full(shape, float("nan"), dtype=self.dtype)
        self.free = torch.randperm(self.num_blocks, generator=self.gen).tolist()

    def random(self, length: int, heads: int) -> torch.Tensor:
        return torch.randn(length, heads, self.head_dim, generator=self.gen).to(self.dtype)

    def add(
        self,
        name: str,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        shared_blocks: list[int] = (),  # type: ignore[assignment]
    ) -> None:
        """q: [L, H, D], k/v: [L, KVH, D]; the first len(shared_blocks) blocks are someone else's
        (a prefix-cache hit: their K/V are already there and are not written again)."""
        length = q.shape[0]
        num = -(-length // self.block_size)
        table = list(shared_blocks) + [self.free.pop() for _ in range(num - len(shared_blocks))]
        for pos in range(len(shared_blocks) * self.block_size, length):
            block, slot = table[pos // self.block_size], pos % self.block_size
            self.k_cache[block, slot] = k[pos]
            self.v_cache[block, slot] = v[pos]
        self.q[name], self.tables[name] = q, table

    def new(self, name: str, length: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        q, k, v = (self.random(length, h) for h in (self.num_heads, self.num_kv_heads, self.num_kv_heads))
        self.add(name, q, k, v)
        return q, k, v

    def args(self, items: list[tuple[str, int, int]]) -> tuple[torch.Tensor, ...]:
        """One step: per sequence (name, start, end), the queries of positions [start, end) over
        keys [0, end)."""
        q = torch.cat([self.q[name][start:end] for name, start, end in items])
        lens = [end - start for _, start, end in items]
        query_start_loc = torch.tensor([0, *lens], dtype=torch.int32).cumsum(0).to(torch.int32)
        seq_lens = torch.tensor([end for _, _, end in items], dtype=torch.int32)
        width = max(len(self.tables[name]) for name, _, _ in items)
        tables = torch.zeros(len(items), width, dtype=torch.int32)
        for row, (name, _, end) in enumerate(items):
            used = self.tables[name][: -(-end // self.block_size)]
            tables[row, : len(used)] = torch.tensor(used, dtype=torch.int32)
        on = (q, self.k_cache, self.v_cache, tables, query_start_loc, seq_lens)
        return tuple(t.to(DEVICE) for t in on)

    def run(self, items: list[tuple[str, int, int]], **extras: object) -> list[torch.Tensor]:
        """The step's output, split per item: [end - start, H, D] each."""
        out = ia.invariant_paged_attention(*self.args(items), self.head_dim**-0.5, **extras).cpu()
        return list(out.split([end - start for _, start, end in items]))


def bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit for bit (torch.equal alone would take -0.0 for 0.0)."""
    as_int = {torch.bfloat16: torch.int16, torch.float32: torch.int32}
    return a.dtype == b.dtype and bool(torch.equal(a.view(as_int[a.dtype]), b.view(as_int[b.dtype])))


EXTRAS = [{}, {"sliding_window": 11, "logits_soft_cap": 5.0}]


# Each dtype once and the window/cap branch once: the bf16 plain run took no path these two miss.
@pytest.mark.parametrize(
    ("dtype", "extras"),
    [(torch.float32, EXTRAS[0]), (torch.bfloat16, EXTRAS[1])],
    ids=["fp32", "bf16-window-cap"],
)
def test_a_token_is_the_same_alone_and_among_7_and_64_sequences(dtype: torch.dtype, extras: dict) -> None:
    store = Store(3, 1, 16, dtype, block_size=8, num_blocks=1024, seed=1)
    store.new("target", 45)
    rng = torch.Generator().manual_seed(2)
    others = []
    for i in range(63):
        length = int(torch.randint(1, 30, (1,), generator=rng))
        store.new(f"o{i}", length)
        # Mixed traffic: decodes (one token) and prefill chunks of up to 8 tokens.
        chunk = 1 if i % 4 else int(torch.randint(1, min(length, 8) + 1, (1,), generator=rng))
        others.append((f"o{i}", length - chunk, length))
    decode = ("target", 44, 45)  # the last token as a decode step
    chunk = ("target", 30, 45)  # and as the end of a prefill chunk
    for item in (decode, chunk):
        (alone,) = store.run([item], **extras)
        for batch, places in ((7, (0, 6)), (64, (31,))):
            for where in places:
                items = others[: batch - 1]
                items.insert(where, item)
                got = store.run(items, **extras)[where]
                assert bits_equal(got, alone), (item, batch, where)


# A Latin square over dtype x shape x extras: every pair of the three meets once, in 4 of the 8
# runs.
WHOLE_CHUNKS_DECODE_CASES = [
    pytest.param(dtype, *SHAPES[s], EXTRAS[e], id=f"{name}-shape{s}-{'window-cap' if e else 'plain'}")
    for dtype, name, s, e in (
        (torch.float32, "fp32", 0, 0),
        (torch.float32, "fp32", 1, 1),
        (torch.bfloat16, "bf16", 0, 1),
        (torch.bfloat16, "bf16", 1, 0),
    )
]


@pytest.mark.parametrize(
    ("dtype", "num_heads", "num_kv_heads", "head_dim", "extras"), WHOLE_CHUNKS_DECODE_CASES
)
def test_whole_prefill_chunks_of_8_and_decode_give_equal_bits_close_to_the_reference(
    dtype: torch.dtype, num_heads: int, num_kv_heads: int, head_dim: int, extras: dict
) -> None:
    length = 37
    store = Store(num_heads, num_kv_heads, head_dim, dtype, seed=3)
    store.new("p", length)
    store.new("other", 50)
    (whole,) = store.run([("p", 0, length)], **extras)
    chunks = [
        store.run([("other", 49, 50), ("p", s, min(s + 8, length))], **extras)[1] for s in range(0, length, 8)
    ]
    # Decode steps at the edges of the 4-token blocks, the 8-token chunks and the 32-key tile
    # (12 launches, not 37: each position's decode is its own launch).
    decode_positions = [0, 1, 3, 4, 7, 8, 15, 16, 31, 32, 35, 36]
    decodes = [store.run([("p", t, t + 1)], **extras)[0] for t in decode_positions]
    assert bits_equal(torch.cat(chunks), whole)
    assert bits_equal(torch.cat(decodes), whole[decode_positions])
    args = store.args([("p", 0, length)])
    expected = ia.invariant_paged_attention_reference(*args, head_dim**-0.5, **extras).cpu()
    torch.testing.assert_close(whole, expected, **TOLERANCE[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_prefix_cache_hit_and_another_block_size_give_equal_bits(dtype: torch.dtype) -> None:
    prefix_blocks, length = 5, 33  # a 20-token prefix in 4-token blocks
    results = []
    for block_size in (4, 16):
        store = Store(4, 2, 24, dtype, block_size=block_size, seed=4)
        q, k, v = store.new("a", length)
        # b: a's first 20 positions, then its own; computed whole in its own blocks...
        qb, kb, vb = (torch.cat([t[:20], store.random(13, t.shape[1])]) for t in (q, k, v))
        store.add("b_whole", qb, kb, vb)
        (whole,) = store.run([("b_whole", 0, length)])
        if block_size == 4:
            # ...and as a prefix-cache hit: a's five prefix blocks, then only the suffix computed.
            store.add("b_hit", qb, kb, vb, shared_blocks=store.tables["a"][:prefix_blocks])
            hit = store.run([("a", 32, 33), ("b_hit", 20, length)])[1]
            assert bits_equal(hit, whole[20:])
        results.append(whole)
    assert bits_equal(results[0], results[1])


def test_bad_arguments_raise() -> None:
    store = Store(4, 2, 24, torch.float32)
    store.new("p", 5)
    q, k_cache, v_cache, tables, qsl, seq_lens = store.args([("p", 0, 5)])
    with pytest.raises(ValueError, match="query_start_loc"):
        ia.invariant_paged_attention(q, k_cache, v_cache, tables, qsl.long(), seq_lens, 0.2)
    with pytest.raises(ValueError, match="multiple"):
        ia.invariant_paged_attention(q[:, :3], k_cache, v_cache, tables, qsl, seq_lens, 0.2)
    with pytest.raises(ValueError, match="sliding_window"):
        ia.invariant_paged_attention(q, k_cache, v_cache, tables, qsl, seq_lens, 0.2, sliding_window=0)


POINTERS = {
    "out_ptr": "*bf16", "q_ptr": "*bf16", "k_cache_ptr": "*bf16", "v_cache_ptr": "*bf16",
    "block_tables_ptr": "*i32", "query_start_loc_ptr": "*i32", "seq_lens_ptr": "*i32",
}  # fmt: skip


def test_the_kernel_compiles_for_sm90_with_mma_and_without_spills(compile_for_sm90) -> None:
    # The tensor-core path (DOT_NATIVE) is what the interpreter cannot run: compile it for an H200
    # with the launcher's settings, SmolLM2's heads (9 / 3, head_dim 64) and a GQA-8, d-128 model.
    specs = []
    for pointer_dtype, ieee in (("bf16", False), ("fp32", True)):
        pointers = {name: t.replace("bf16", pointer_dtype) for name, t in POINTERS.items()}
        for heads, kv_heads, head_dim, extras in ((9, 3, 64, False), (32, 4, 128, True)):
            block_m, block_q = ia.launch_config(heads, kv_heads)
            specs.append(dict(
                kernel="_invariant_attention_kernel", num_warps=4, pointer_types=pointers,
                float_args=["scale_log2", "cap_scale", "cap_log2"],
                constexprs=dict(HEAD_DIM=head_dim, HEAD_DIM_PAD=head_dim, BLOCK_SIZE=16,
                                NUM_QUERIES_PER_KV=heads // kv_heads, BLOCK_M=block_m, BLOCK_Q=block_q,
                                TILE_N=ia.TILE_N, DOT_MODE=DOT_FP32_IEEE if ieee else DOT_NATIVE,
                                USE_WINDOW=extras, USE_SOFT_CAP=extras),
            ))  # fmt: skip
    for spec, result in zip(specs, compile_for_sm90("triton_invariant_attention", specs), strict=True):
        if spec["constexprs"]["DOT_MODE"] == DOT_NATIVE:  # fp32 "ieee" dots run on the FMA units
            assert result["ptx_has_mma"], f"tl.dot did not lower to MMA: {spec}"
        assert result["stack_bytes"] in (None, 0), f"register spills: {result}"
