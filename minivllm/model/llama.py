"""A Llama-family decoder from scratch: Llama, Mistral, Qwen2 and Qwen3 in one file.

The three families differ in two switches read from config.json:
* Qwen2 adds a bias to the q/k/v projections (``attention_bias``);
* Qwen3 RMS-normalises every query and key head before the rotary embedding (``qk_norm``).

Weights keep Hugging Face's names, except that q/k/v and gate/up are packed into one matrix
each (``qkv_proj``, ``gate_up_proj``): one matmul instead of three (or two). ``load_weights``
knows where each checkpoint tensor goes inside the packed ones.

With tensor parallelism (``tensor_parallel_size`` > 1) every projection is a parallel layer
(``parallel_layers.py``): each rank holds its share of the heads, of the MLP's features and of
the vocabulary, and computes only that; at size 1 the same layers are plain matmuls.

The forward pass takes a flattened batch (no padding) and returns hidden states; only the
rows that need a next token go through ``compute_logits`` (the lm_head is the largest matmul
of a small model: skipping it for prefill tokens saves most of a prompt's cost).
"""

from __future__ import annotations

import torch
from torch import nn

from minivllm.attention.backend import AttentionBackend, AttentionMetadata
from minivllm.model.config import ModelConfig
from minivllm.model.layers import RMSNorm, RotaryEmbedding, SiluAndMul
from minivllm.model.parallel_layers import (
    MergedColumnParallelLinear,
    ParallelLMHead,
    QKVParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
)


class Attention(nn.Module):
    """Grouped-query self-attention over the paged KV cache.

    ``kv_cache`` and ``backend`` are bound by the model runner once the cache is allocated.
    With tensor parallelism, ``num_heads`` / ``num_kv_heads`` are this rank's share.
    """

    def __init__(self, config: ModelConfig, rotary: RotaryEmbedding, layer_idx: int = 0) -> None:
        super().__init__()
        self.sliding_window = config.layer_sliding_window(layer_idx)  # None: full attention
        self.head_dim = config.head_dim
        self.qkv_proj = QKVParallelLinear(
            config.hidden_size, self.head_dim, config.num_attention_heads,
            config.num_key_value_heads, bias=config.attention_bias
        )
        self.num_heads = self.qkv_proj.num_heads
        self.num_kv_heads = self.qkv_proj.num_kv_heads
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.scale = self.head_dim**-0.5
        self.o_proj = RowParallelLinear(
            config.num_attention_heads * self.head_dim, config.hidden_size, bias=False
        )
        self.rotary_emb = rotary
        if config.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        else:
            self.q_norm = self.k_norm = None
        self.kv_cache: torch.Tensor | None = None
        self.backend: AttentionBackend | None = None

    def forward(
        self, positions: torch.Tensor, x: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        n = x.shape[0]
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(n, self.num_heads, self.head_dim)
        k = k.view(n, self.num_kv_heads, self.head_dim)
        v = v.view(n, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self.rotary_emb(positions, q, k)
        if self.sliding_window is None:
            out = self.backend.forward(q, k, v, self.kv_cache, meta, self.scale)
        else:
            out = self.backend.forward(q, k, v, self.kv_cache, meta, self.scale,
                                       sliding_window=self.sliding_window)
        return self.o_proj(out.view(n, self.q_size))


class MLP(nn.Module):
    """SwiGLU feed-forward: down(silu(gate(x)) * up(x))."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(
            config.hidden_size, [config.intermediate_size] * 2, bias=False)
        self.down_proj = RowParallelLinear(config.intermediate_size, config.hidden_size, bias=False)
        self.act_fn = SiluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))


class DecoderLayer(nn.Module):
    """Pre-norm block: x + attn(norm(x)), then + mlp(norm(.)), with the residual carried apart."""

    def __init__(self, config: ModelConfig, rotary: RotaryEmbedding, layer_idx: int = 0) -> None:
        super().__init__()
        self.self_attn = Attention(config, rotary, layer_idx)
        self.mlp = MLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self,
        positions: torch.Tensor,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual, hidden = hidden, self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(positions, hidden, meta)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


class DecoderModel(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        rotary = RotaryEmbedding(
            config.head_dim, config.max_position_embeddings, config.rope_theta, config.rope_scaling
        )
        self.layers = nn.ModuleList(
            DecoderLayer(config, rotary, i) for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, input_ids, positions, meta: AttentionMetadata) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids)
        residual = None
        for layer in self.layers:
            hidden, residual = layer(positions, hidden, residual, meta)
        hidden, _ = self.norm(hidden, residual)
        return hidden


class LlamaForCausalLM(nn.Module):
    # checkpoint name fragment -> (packed parameter, which shard)
    packed_modules = {
        "q_proj": ("qkv_proj", 0),
        "k_proj": ("qkv_proj", 1),
        "v_proj": ("qkv_proj", 2),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.model = DecoderModel(config)
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        return self.model(input_ids, positions, meta)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits over the whole vocabulary (gathered from every rank's range)."""
        return self.lm_head.compute_logits(hidden).float()

    def attention_layers(self) -> list[Attention]:
        return [layer.self_attn for layer in self.model.layers]

    def shard_sizes(self, packed: str) -> list[int]:
        """Rows of each checkpoint matrix packed into ``packed`` (the unsharded model's)."""
        c = self.config
        if packed == "qkv_proj":
            kv = c.num_key_value_heads * c.head_dim
            return [c.num_attention_heads * c.head_dim, kv, kv]
        return [c.intermediate_size, c.intermediate_size]


Qwen2ForCausalLM = LlamaForCausalLM  # the config's attention_bias switches q/k/v bias on
Qwen3ForCausalLM = LlamaForCausalLM  # the config's qk_norm switches per-head q/k norms on
