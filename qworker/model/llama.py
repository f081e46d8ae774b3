from __future__ import annotations

import torch
from torch import nn

from qworker.model.attention import AttentionBackend, AttentionMetadata
from qworker.model.config import ModelConfig
from qworker.model.linear import Linear, PackedWeight, is_packing_available
from qworker.model.ops import TORCH_OPS, ModelOps


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float, ops: ModelOps = TORCH_OPS) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps
        self.ops = ops

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ops.rms_norm(x, self.weight, self.eps)

    def add_and_norm(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(x + residual), x + residual): the residual add fused into the norm."""
        return self.ops.fused_add_rms_norm(x, residual, self.weight, self.eps)


class RotaryEmbedding(nn.Module):
    def __init__(self, config: ModelConfig, max_positions: int, ops: ModelOps = TORCH_OPS) -> None:
        super().__init__()
        self.ops = ops
        positions = torch.arange(max_positions, dtype=torch.int64).float()
        freqs = torch.outer(positions, config.rope_inv_freq.float())
        # cos/sin: [max_positions, head_dim // 2]
        self.register_buffer("cos", freqs.cos() * config.rope_attention_scaling, persistent=False)
        self.register_buffer("sin", freqs.sin() * config.rope_attention_scaling, persistent=False)

    def forward(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # q: [T, H, D], k: [T, KVH, D]; rotate-half convention of HF Llama.
        return self.ops.apply_rotary(q, k, positions, self.cos, self.sin)


class LlamaAttention(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.num_heads = config.num_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        self.q_size = config.num_heads * config.head_dim
        self.kv_size = config.num_kv_heads * config.head_dim
        self.scale = config.head_dim**-0.5
        # q, k and v projections fused into one matmul: [hidden] -> [q_size + 2 * kv_size]
        self.qkv_proj = Linear(config.hidden_size, self.q_size + 2 * self.kv_size, bias=config.qkv_bias)
        self.o_proj = Linear(self.q_size, config.hidden_size, bias=False)

    def forward(
        self,
        positions: torch.Tensor,
        hidden: torch.Tensor,
        rotary: RotaryEmbedding,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        backend: AttentionBackend,
    ) -> torch.Tensor:
        num_tokens = hidden.shape[0]
        qkv = self.qkv_proj(hidden)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(num_tokens, self.num_heads, self.head_dim)
        k = k.view(num_tokens, self.num_kv_heads, self.head_dim)
        v = v.reshape(num_tokens, self.num_kv_heads, self.head_dim)
        q, k = rotary(positions, q, k)
        out = backend.forward(q, k, v, k_cache, v_cache, meta, self.scale)
        return self.o_proj(out.reshape(num_tokens, self.q_size))


class LlamaMLP(nn.Module):
    def __init__(self, config: ModelConfig, ops: ModelOps = TORCH_OPS) -> None:
        super().__init__()
        self.ops = ops
        # gate and up fused: [hidden] -> [2 * intermediate]
        self.gate_up_proj = Linear(config.hidden_size, 2 * config.intermediate_size, bias=False)
        self.down_proj = Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.ops.silu_and_mul(self.gate_up_proj(x)))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, ops: ModelOps = TORCH_OPS) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(config)
        self.mlp = LlamaMLP(config, ops)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, ops)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, ops)


class LlamaForCausalLM(nn.Module):
    """A Llama-family decoder (Llama, SmolLM2, Mistral, Qwen2) over a paged KV cache.

    `ops` picks the norm, rotary and activation implementations (see qworker.model.ops).
    """

    def __init__(self, config: ModelConfig, max_positions: int, ops: ModelOps = TORCH_OPS) -> None:
        super().__init__()
        self.config = config
        self.ops = ops
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(LlamaDecoderLayer(config, ops) for _ in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, ops)
        self.rotary = RotaryEmbedding(config, max_positions, ops)
        if config.tie_word_embeddings:
            self.lm_head_weight = self.embed_tokens.weight
        else:
            self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
            self.lm_head_weight = self.lm_head.weight
        self.lm_head_packed = PackedWeight(is_packing_available())

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        meta: AttentionMetadata,
        backend: AttentionBackend,
    ) -> torch.Tensor:
        """input_ids, positions: [T] -> hidden states [T, hidden] after the final norm."""
        hidden = self.embed_tokens(input_ids)
        # Each residual add is fused into the norm that follows it: hidden, residual [T, hidden].
        residual: torch.Tensor | None = None
        for layer, (k_cache, v_cache) in zip(self.layers, kv_caches, strict=True):
            if residual is None:
                residual, hidden = hidden, layer.input_layernorm(hidden)
            else:
                hidden, residual = layer.input_layernorm.add_and_norm(hidden, residual)
            hidden = layer.self_attn(positions, hidden, self.rotary, k_cache, v_cache, meta, backend)
            hidden, residual = layer.post_attention_layernorm.add_and_norm(hidden, residual)
            hidden = layer.mlp(hidden)
        if residual is None:
            return self.norm(hidden)
        return self.norm.add_and_norm(hidden, residual)[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        # hidden: [N, hidden] -> [N, vocab] in float32 for the sampler.
        return self.lm_head_packed.linear(hidden, self.lm_head_weight).float()

    def load_hf_state_dict(self, state_dict: dict[str, torch.Tensor]) -> None:
        """Load a Hugging Face Llama-style state dict, fusing q/k/v and gate/up."""
        own = {}
        prefix = "model."
        for name, tensor in state_dict.items():
            if "rotary_emb" in name:
                continue
            own[name.removeprefix(prefix)] = tensor
        fused: dict[str, torch.Tensor] = {}
        for i in range(self.config.num_layers):
            p = f"layers.{i}."
            attn, mlp = p + "self_attn.", p + "mlp."
            fused[attn + "qkv_proj.weight"] = torch.cat(
                [
                    own.pop(attn + "q_proj.weight"),
                    own.pop(attn + "k_proj.weight"),
                    own.pop(attn + "v_proj.weight"),
                ]
            )
            if self.config.qkv_bias:
                fused[attn + "qkv_proj.bias"] = torch.cat(
                    [
                        own.pop(attn + "q_proj.bias"),
                        own.pop(attn + "k_proj.bias"),
                        own.pop(attn + "v_proj.bias"),
                    ]
                )
            fused[mlp + "gate_up_proj.weight"] = torch.cat(
                [own.pop(mlp + "gate_proj.weight"), own.pop(mlp + "up_proj.weight")]
            )
        own.update(fused)
        if self.config.tie_word_embeddings:
            own.pop("lm_head.weight", None)
        missing, unexpected = self.load_state_dict(own, strict=False)
        missing = [m for m in missing if m != "lm_head_weight"]
        assert not missing, f"weights missing from checkpoint: {missing[:8]}"
        assert not unexpected, f"unexpected weights in checkpoint: {unexpected[:8]}"
