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

from collections.abc import Callable, Iterable
from types import SimpleNamespace
from typing import Any

import torch
from torch import nn

from pagedserve.layers import fused_ops
from pagedserve.layers.activation import GeluTanhAndMul
from pagedserve.layers.attention import Attention
from pagedserve.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from pagedserve.layers.layernorm import GemmaRMSNorm
from pagedserve.layers.linear import QKVParallelLinear, RowParallelLinear
from pagedserve.layers.rotary_embedding import RotaryEmbedding, get_rope
from pagedserve.models.llama import LlamaForCausalLM, LlamaMLP, head_dim_of
from pagedserve.models.utils import direct_projections, load_named_weights

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
    if rope.get("rope_type", rope.get("type")) == "longrope":  # (no Gemma 3 checkpoint uses it)
        raise ValueError(f"Gemma 3's {layer_type} rope parameters set rope_type 'longrope', which is not implemented "
                         "for Gemma 3 (its long-prompt rotation is read from a model-wide rope config only)")
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
        qkv = self.qkv_proj(hidden)
        q, k = self.norm_rotate(rope, qkv)
        return self.o_proj(self.attn(q.flatten(1), k.flatten(1), qkv[:, self.q_size + self.kv_size:]))

    def norm_rotate(self, rope: tuple[torch.Tensor, torch.Tensor], qkv: torch.Tensor
                    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The fused q|k|v projection -> q [T, H, D] and k [T, KVH, D], each head normed
        (Gemma's RMSNorm) and rotated: one fused kernel where there is one (CPU tensors)."""
        weights = (self.q_norm.weight, self.k_norm.weight)
        kernels = fused_ops.gemma_kernels_for(qkv, *rope, *weights)
        if kernels is not None:
            return kernels.norm_rope(qkv, *rope, self.num_heads, self.num_kv_heads, self.head_dim,
                                     self.rotary_emb.rotary_dim, weights, self.q_norm.eps, gemma=True)
        t = qkv.shape[0]
        q, k = qkv[:, :self.q_size], qkv[:, self.q_size: self.q_size + self.kv_size]
        q = self.q_norm(q.reshape(t, self.num_heads, self.head_dim)).view(t, self.q_size)
        k = self.k_norm(k.reshape(t, self.num_kv_heads, self.head_dim)).view(t, self.kv_size)
        return self.rotary_emb.rotate(rope, q, self.num_heads), self.rotary_emb.rotate(rope, k, self.num_kv_heads)


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
        # The same layer as direct kernel calls (bind_direct), or None.
        self.direct: Callable[[tuple[torch.Tensor, torch.Tensor], torch.Tensor], torch.Tensor] | None = None

    def bind_direct(self) -> bool:
        """Run this layer's eager forward as direct calls to its kernels, as
        LlamaDecoderLayer.bind_direct does and where it does (fused kernels for every norm,
        rotary and the gate; projections of one rank, adapters' products included):
        the calls `forward` makes, in its order, so outputs are identical, and a model
        whose layers all bind starts without torch.compile (Gemma 3 270M, the second
        shipped model).  Returns whether it bound."""
        attn, mlp = self.self_attn, self.mlp
        projections = direct_projections(attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
        if projections is None or not isinstance(mlp.act_fn, GeluTanhAndMul):
            return False
        norms = (self.input_layernorm, self.post_attention_layernorm, self.pre_feedforward_layernorm,
                 self.post_feedforward_layernorm)
        qk_weights = (attn.q_norm.weight, attn.k_norm.weight)
        rotary = attn.rotary_emb
        kernels = fused_ops.gemma_kernels_for(rotary.cos_sin_cache, *(n.weight for n in norms), *qk_weights)
        if kernels is None:
            return False
        norm, norm_rope, gelu_and_mul = kernels.gemma_rms_norm, kernels.norm_rope, kernels.gelu_tanh_and_mul
        (w_in, eps_in), (w_attn, eps_attn), (w_pre, eps_pre), (w_ff, eps_ff) = ((n.weight, n.eps) for n in norms)
        qkv_proj, o_proj, gate_up_proj, down_proj = projections
        attention = attn.attn.forward_eager
        heads, kv_heads, head_dim, rotary_dim = attn.num_heads, attn.num_kv_heads, attn.head_dim, rotary.rotary_dim
        qk_eps, v_start = attn.q_norm.eps, attn.q_size + attn.kv_size

        def direct(rope: tuple[torch.Tensor, torch.Tensor], hidden: torch.Tensor) -> torch.Tensor:
            qkv = qkv_proj(norm(hidden, w_in, eps_in))
            q, k = norm_rope(qkv, *rope, heads, kv_heads, head_dim, rotary_dim, qk_weights, qk_eps, gemma=True)
            attended = o_proj(attention(q.flatten(1), k.flatten(1), qkv[:, v_start:]))
            hidden = norm(attended, w_attn, eps_attn, hidden)
            return norm(down_proj(gelu_and_mul(gate_up_proj(norm(hidden, w_pre, eps_pre)))), w_ff, eps_ff, hidden)

        self.direct = direct
        return True

    def forward(self, rope: tuple[torch.Tensor, torch.Tensor], hidden: torch.Tensor) -> torch.Tensor:
        """Each sub-block's output is normed, then added to the residual stream (the norms' fused add)."""
        if self.direct is not None and not torch.compiler.is_compiling():
            return self.direct(rope, hidden)
        hidden = self.post_attention_layernorm(self.self_attn(rope, self.input_layernorm(hidden)), hidden)
        return self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(hidden)), hidden)


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

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Token embeddings times sqrt(hidden_size), the scale rounded to the weights'
        dtype first (HF's Gemma3TextScaledWordEmbedding).  A VLM puts its image rows into
        this output unscaled, as HF's masked_scatter after the embedding does."""
        hidden = self.embed_tokens(input_ids)
        return hidden * torch.tensor(self.embed_scale, dtype=hidden.dtype)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                inputs_embeds: torch.Tensor | None = None) -> torch.Tensor:
        """`inputs_embeds` (embed_input_ids' output, some rows replaced) stands in for the
        embedding of `input_ids` when given."""
        hidden = self.embed_input_ids(input_ids) if inputs_embeds is None else inputs_embeds
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

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                inputs_embeds: torch.Tensor | None = None) -> torch.Tensor:
        return self.model(input_ids, positions, inputs_embeds)

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_input_ids(input_ids)

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
