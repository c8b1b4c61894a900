"""Gemma 3 (text): `Gemma3ForCausalLM`, the decoder of the 270M/1B models and the text
tower of the larger ones.

What differs from the Llama decoder, and why it is its own file rather than flags:
  * interleaved layer types: most layers attend over a sliding window of
    `sliding_window` tokens (`layer_types`, or every `sliding_window_pattern`-th layer
    global), each type with its own RoPE base (`rope_parameters` per layer type in
    transformers 5; `rope_local_base_freq` / `rope_theta` before).  Their KV lives in
    separate KV-cache groups, so sliding layers hold O(window) blocks per request
    (worker/kv_cache.py, core/kv_cache_manager.py);
  * four norms per layer (before and after attention, before and after the MLP), each
    Gemma's RMSNorm, which scales by (1 + weight);
  * per-head q/k norms (as Qwen3), the attention scale query_pre_attn_scalar^-1/2;
  * embeddings multiplied by sqrt(hidden_size) (rounded to the weights' dtype, as HF
    does), a GELU-tanh gated MLP, and optional tanh soft-capping of the final logits.
Attention-score soft-capping (Gemma 2) is refused (models/registry.py): no backend
implements it.
"""

from __future__ import annotations

from collections.abc import Iterable
from types import SimpleNamespace
from typing import Any

import torch
from torch import nn

from pagedserve.layers.activation import GeluTanhAndMul
from pagedserve.layers.attention import Attention
from pagedserve.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from pagedserve.layers.layernorm import GemmaRMSNorm
from pagedserve.layers.linear import QKVParallelLinear, RowParallelLinear
from pagedserve.layers.rotary_embedding import RotaryEmbedding, get_rope
from pagedserve.models.llama import LlamaForCausalLM, LlamaMLP, head_dim_of
from pagedserve.models.utils import load_named_weights

SLIDING, FULL = "sliding_attention", "full_attention"


def gemma3_layer_types(config: Any) -> list[str]:
    """Each layer's attention type: `layer_types`, else every `sliding_window_pattern`-th
    layer global (Gemma 3's default pattern is 6)."""
    types = getattr(config, "layer_types", None)
    if types:
        if len(types) != config.num_hidden_layers or not set(types) <= {SLIDING, FULL}:
            raise ValueError(f"layer_types must give {config.num_hidden_layers} entries of {SLIDING!r} or {FULL!r}, "
                             f"got {types!r}")
        return list(types)
    pattern = int(getattr(config, "sliding_window_pattern", None) or getattr(config, "_sliding_window_pattern", 6))
    return [FULL if (i + 1) % pattern == 0 else SLIDING for i in range(config.num_hidden_layers)]


def gemma3_rope_view(config: Any, layer_type: str) -> Any:
    """A config-like object whose rope fields are this layer type's, for get_rope."""
    params = getattr(config, "rope_parameters", None) or {}
    if layer_type in params:
        rope = dict(params[layer_type] or {})
    elif layer_type == SLIDING:  # transformers 4.x: the local base and no scaling
        rope = {"rope_type": "default", "rope_theta": float(getattr(config, "rope_local_base_freq", 10000.0))}
    else:
        rope = dict(getattr(config, "rope_scaling", None) or {})
        rope.setdefault("rope_theta", float(getattr(config, "rope_theta", 1000000.0)))
    return SimpleNamespace(rope_parameters=rope, max_position_embeddings=config.max_position_embeddings,
                           partial_rotary_factor=None, rope_freq_factors=None)


class Gemma3Attention(nn.Module):
    def __init__(self, config: Any, rotary_emb: RotaryEmbedding, sliding_window: int | None) -> None:
        super().__init__()
        total_heads = config.num_attention_heads
        total_kv_heads = getattr(config, "num_key_value_heads", None) or total_heads
        self.head_dim = head_dim_of(config)
        bias = bool(getattr(config, "attention_bias", False))
        self.qkv_proj = QKVParallelLinear(config.hidden_size, self.head_dim, total_heads, total_kv_heads, bias=bias)
        self.num_heads = self.qkv_proj.num_heads
        self.num_kv_heads = self.qkv_proj.num_kv_heads
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.o_proj = RowParallelLinear(total_heads * self.head_dim, config.hidden_size, bias=bias)
        self.q_norm = GemmaRMSNorm(self.head_dim, eps=config.rms_norm_eps)
        self.k_norm = GemmaRMSNorm(self.head_dim, eps=config.rms_norm_eps)
        self.rotary_emb = rotary_emb
        scale = float(getattr(config, "query_pre_attn_scalar", None) or self.head_dim) ** -0.5
        self.attn = Attention(self.num_heads, self.head_dim, scale, self.num_kv_heads, sliding_window)

    def forward(self, rope: tuple[torch.Tensor, torch.Tensor], hidden: torch.Tensor) -> torch.Tensor:
        t = hidden.shape[0]
        q, k, v = self.qkv_proj(hidden).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = self.q_norm(q.reshape(t, self.num_heads, self.head_dim)).view(t, self.q_size)
        k = self.k_norm(k.reshape(t, self.num_kv_heads, self.head_dim)).view(t, self.kv_size)
        q = self.rotary_emb.rotate(rope, q, self.num_heads)
        k = self.rotary_emb.rotate(rope, k, self.num_kv_heads)
        return self.o_proj(self.attn(q.flatten(1), k.flatten(1), v))


def gemma3_mlp(config: Any) -> LlamaMLP:
    """Llama's gated MLP with GELU-tanh in place of SiLU (no biases in Gemma 3)."""
    act = getattr(config, "hidden_activation", None) or getattr(config, "hidden_act", "gelu_pytorch_tanh")
    if act not in ("gelu_pytorch_tanh", "gelu_tanh"):
        raise ValueError(f"unsupported hidden_activation {act!r} for Gemma 3: only 'gelu_pytorch_tanh'")
    return LlamaMLP(config, act_fn=GeluTanhAndMul())


class Gemma3DecoderLayer(nn.Module):
    def __init__(self, config: Any, rotary_emb: RotaryEmbedding, sliding_window: int | None) -> None:
        super().__init__()
        eps = config.rms_norm_eps
        self.is_sliding = sliding_window is not None
        self.input_layernorm = GemmaRMSNorm(config.hidden_size, eps=eps)
        self.self_attn = Gemma3Attention(config, rotary_emb, sliding_window)
        self.post_attention_layernorm = GemmaRMSNorm(config.hidden_size, eps=eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(config.hidden_size, eps=eps)
        self.mlp = gemma3_mlp(config)
        self.post_feedforward_layernorm = GemmaRMSNorm(config.hidden_size, eps=eps)

    def forward(self, rope: tuple[torch.Tensor, torch.Tensor], hidden: torch.Tensor) -> torch.Tensor:
        attn = self.post_attention_layernorm(self.self_attn(rope, self.input_layernorm(hidden)))
        hidden = hidden + attn
        mlp = self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(hidden)))
        return hidden + mlp


class Gemma3Model(nn.Module):
    def __init__(self, config: Any) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        self.embed_scale = float(config.hidden_size) ** 0.5
        max_position = int(getattr(config, "max_position_embeddings", None) or 32768)
        hd = head_dim_of(config)
        types = gemma3_layer_types(config)
        window = int(config.sliding_window)
        # One cos/sin table per layer type, shared by that type's layers.
        self.rotary_local = get_rope(gemma3_rope_view(config, SLIDING), hd, max_position)
        self.rotary_global = get_rope(gemma3_rope_view(config, FULL), hd, max_position)
        self.layers = nn.ModuleList(
            Gemma3DecoderLayer(config, self.rotary_local, window) if kind == SLIDING
            else Gemma3DecoderLayer(config, self.rotary_global, None) for kind in types)
        self.norm = GemmaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids)
        hidden = hidden * torch.tensor(self.embed_scale, dtype=hidden.dtype)
        local, full = self.rotary_local.cos_sin(positions), self.rotary_global.cos_sin(positions)
        for layer in self.layers:
            hidden = layer(local if layer.is_sliding else full, hidden)
        return self.norm(hidden)


class Gemma3ForCausalLM(nn.Module):
    stacked_params = LlamaForCausalLM.stacked_params

    def __init__(self, config: Any) -> None:
        super().__init__()
        self.config = config
        self.model = Gemma3Model(config)
        # Gemma ties the LM head to the embedding (no lm_head tensor in its checkpoints).
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", True))
        tied = self.model.embed_tokens if self.tie_word_embeddings else None
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size, tied_to=tied)
        self.final_logit_softcapping = getattr(config, "final_logit_softcapping", None)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids, positions)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        logits = self.lm_head.compute_logits(hidden)
        cap = self.final_logit_softcapping
        if cap is not None and logits is not None:
            logits = torch.tanh(logits / cap) * cap
        return logits

    def _skip(self, name: str) -> bool:
        return "rotary_emb.inv_freq" in name or (self.tie_word_embeddings and name == "lm_head.weight")

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        return load_named_weights(self, weights, self.stacked_params, self._skip)
