"""The Llama decoder (Llama 2/3, SmolLM2, TinyLlama, Mistral) and the blocks Qwen2/Qwen3 reuse.

The three families differ only in the attention projections: Llama has optional
bias on q/k/v/o (`attention_bias`), Qwen2 always has bias on q/k/v but not o, and
Qwen3 adds a per-head RMSNorm on q and k before RoPE.  Those are three flags on one
attention module (`AttentionFlags`), chosen by each CausalLM class, instead of three
copies of the model.

Everything runs over a flattened batch: `input_ids` and `positions` are [T] for all
requests of a step together; attention layers find their per-step metadata in the
forward context.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from pagedserve.layers import fused_ops
from pagedserve.layers.activation import SiluAndMul
from pagedserve.layers.attention import Attention
from pagedserve.layers.decode_stack import DecodeStack, StackLayerSpec, build_decode_stack
from pagedserve.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from pagedserve.layers.layernorm import RMSNorm
from pagedserve.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from pagedserve.layers.rotary_embedding import RotaryEmbedding, get_rope
from pagedserve.models.utils import StackedMapping, direct_projections, load_named_weights


@dataclass(frozen=True)
class AttentionFlags:
    qkv_bias: bool = False
    o_bias: bool = False
    qk_norm: bool = False
    # The config's partial_rotary_factor rotates part of each head (Phi-3 / Phi-4-mini);
    # HF's Llama, Mistral and Qwen code ignores the field, and so does their family here.
    partial_rotary: bool = False


def head_dim_of(config: Any) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


class LlamaAttention(nn.Module):
    def __init__(self, config: Any, rotary_emb: RotaryEmbedding, flags: AttentionFlags,
                 sliding_window: int | None = None) -> None:
        super().__init__()
        total_heads = config.num_attention_heads
        total_kv_heads = getattr(config, "num_key_value_heads", None) or total_heads
        self.head_dim = head_dim_of(config)
        self.qkv_proj = QKVParallelLinear(config.hidden_size, self.head_dim, total_heads, total_kv_heads,
                                          bias=flags.qkv_bias)
        self.num_heads = self.qkv_proj.num_heads
        self.num_kv_heads = self.qkv_proj.num_kv_heads
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.o_proj = RowParallelLinear(total_heads * self.head_dim, config.hidden_size, bias=flags.o_bias)
        self.rotary_emb = rotary_emb
        self.qk_norm = flags.qk_norm
        if self.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, eps=config.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, eps=config.rms_norm_eps)
        self.attn = Attention(self.num_heads, self.head_dim, self.head_dim**-0.5, self.num_kv_heads, sliding_window)

    def forward(self, rope: tuple[torch.Tensor, torch.Tensor], hidden: torch.Tensor) -> torch.Tensor:
        """`rope`: this step's per-token (cos, sin) from `RotaryEmbedding.cos_sin`."""
        qkv = self.qkv_proj(hidden)
        norms = (self.q_norm, self.k_norm) if self.qk_norm else None
        q, k = self.rotary_emb.rotate_qk(rope, qkv, self.num_heads, self.num_kv_heads, norms)
        v = qkv[:, self.q_size + self.kv_size:]
        return self.o_proj(self.attn(q.flatten(1), k.flatten(1), v))


def check_swiglu(config: Any) -> None:
    """The config's hidden_act must be SwiGLU's silu: dense MLPs and MoE experts alike
    compute nothing else (a Qwen3-MoE config with gelu loaded and answered with silu)."""
    act = getattr(config, "hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"unsupported hidden_act {act!r}: only 'silu' (SwiGLU) is implemented")


class LlamaMLP(nn.Module):
    def __init__(self, config: Any, intermediate_size: int | None = None, act_fn: nn.Module | None = None,
                 bias: bool = False) -> None:
        """`act_fn`: the gated activation of another family (Gemma's GELU-tanh), checked
        by its caller; None: the config's hidden_act, which must be SwiGLU's silu.
        `bias`: Llama's mlp_bias (every other family's HF code has none, whatever its
        config says)."""
        super().__init__()
        if act_fn is None:
            check_swiglu(config)
            act_fn = SiluAndMul()
        inter = intermediate_size or config.intermediate_size
        self.gate_up_proj = MergedColumnParallelLinear(config.hidden_size, [inter, inter], bias=bias)
        self.act_fn = act_fn
        self.down_proj = RowParallelLinear(inter, config.hidden_size, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: Any, rotary_emb: RotaryEmbedding, flags: AttentionFlags, mlp: nn.Module,
                 sliding_window: int | None = None) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.self_attn = LlamaAttention(config, rotary_emb, flags, sliding_window)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.mlp = mlp
        # The same layer as direct kernel calls (bind_direct), or None.
        self.direct: Callable[[tuple[torch.Tensor, torch.Tensor], torch.Tensor, torch.Tensor | None],
                              tuple[torch.Tensor, torch.Tensor]] | None = None
        # The same again for a C++ caller (layers/decode_stack.py), where bind_direct bound
        # C++ kernels only; else None.
        self.stack_spec: StackLayerSpec | None = None

    def bind_direct(self) -> bool:
        """Run this layer's eager forward as direct calls to its kernels, without the
        submodules' calls in between: on a small model on the CPU those calls (module
        dispatch, each layer's checks of which path it takes) were ~15% of a decode step
        once the elementwise work was fused (SmolLM2-135M; Zen 4, AVX-512 with native
        bf16).  Any dtype the fused kernels take: float32 (the default on AVX2 CPUs) too.  The calls are the ones `forward` makes, in its order, so outputs are
        identical; it applies only where each submodule's choice is fixed: the fused kernels take the norms and
        rotary, every projection is of one rank (LinearBase.direct_call: adapters' products
        included), the MLP is SwiGLU.  A model that gains adapters later must not bind (a
        compile's trace takes the module path regardless).  Returns whether it bound."""
        attn, mlp = self.self_attn, self.mlp
        if not (isinstance(mlp, LlamaMLP) and isinstance(mlp.act_fn, SiluAndMul)):
            return False
        linears = (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
        projections = direct_projections(*linears)
        if projections is None:
            return False
        norm_weights = (attn.q_norm.weight, attn.k_norm.weight) if attn.qk_norm else None
        norm_eps = attn.q_norm.eps if attn.qk_norm else 0.0
        ln1, ln2, rotary = self.input_layernorm, self.post_attention_layernorm, attn.rotary_emb
        kernels = fused_ops.kernels_for(ln1.weight, ln2.weight, rotary.cos_sin_cache, *(norm_weights or ()))
        if kernels is None:
            return False
        rms_norm, norm_rope, silu_and_mul = kernels.rms_norm, kernels.norm_rope, kernels.silu_and_mul
        qkv_proj, o_proj, gate_up_proj, down_proj = projections
        attention = attn.attn.forward_eager
        heads, kv_heads, head_dim, rotary_dim = attn.num_heads, attn.num_kv_heads, attn.head_dim, rotary.rotary_dim
        v_start = attn.q_size + attn.kv_size

        def direct(rope: tuple[torch.Tensor, torch.Tensor], hidden: torch.Tensor,
                   residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
            if residual is None:
                residual, hidden = hidden, rms_norm(hidden, ln1.weight, ln1.eps)
            else:
                hidden, residual = rms_norm(hidden, ln1.weight, ln1.eps, residual)
            qkv = qkv_proj(hidden)
            q, k = norm_rope(qkv, *rope, heads, kv_heads, head_dim, rotary_dim, norm_weights, norm_eps)
            hidden = o_proj(attention(q.flatten(1), k.flatten(1), qkv[:, v_start:]))
            hidden, residual = rms_norm(hidden, ln2.weight, ln2.eps, residual)
            return down_proj(silu_and_mul(gate_up_proj(hidden))), residual

        self.direct = direct
        qkv_w, o_w, gate_up_w, down_w = (linear.direct_quantized() for linear in linears)
        self.stack_spec = (StackLayerSpec((ln1.weight, ln1.eps), (ln2.weight, ln2.eps), qkv_w, o_w, gate_up_w, down_w,
                                          norm_weights, norm_eps, attn.attn, rotary_dim)
                           if fused_ops.is_cpu_set(kernels) and qkv_w and o_w and gate_up_w and down_w else None)
        return True

    def forward(self, rope: tuple[torch.Tensor, torch.Tensor], hidden: torch.Tensor,
                residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """The residual stream is carried separately; each norm adds the previous sub-block's output into it."""
        if self.direct is not None and not torch.compiler.is_compiling():
            return self.direct(rope, hidden, residual)
        if residual is None:
            residual = hidden
            hidden = self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(rope, hidden)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


class LlamaModel(nn.Module):
    def __init__(self, config: Any, flags: AttentionFlags,
                 make_mlp: Callable[[Any, int], nn.Module] = lambda config, layer: LlamaMLP(config),
                 sliding_window: int | None = None) -> None:
        """`make_mlp(config, layer index)`: each layer's feed-forward block (a mixture of
        experts on some layers of MoE families); `sliding_window`: every layer's (Mistral)."""
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        # One cos/sin table shared by every layer.
        max_position = int(getattr(config, "max_position_embeddings", None) or 8192)
        self.rotary_emb = rotary_emb = get_rope(config, head_dim_of(config), max_position, flags.partial_rotary)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config, rotary_emb, flags, make_mlp(config, i), sliding_window)
            for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.decode_stack: DecodeStack | None = None  # bind_decode_stack

    def bind_decode_stack(self) -> bool:
        """Run all-decode steps' layers as one C++ call (layers/decode_stack.py), where every
        layer bound direct calls to C++ kernels; other steps run the layers.  After
        bind_direct, with the KV cache allocated.  Returns whether it bound."""
        specs = [layer.stack_spec for layer in self.layers]
        complete = [spec for spec in specs if spec is not None]
        self.decode_stack = build_decode_stack(complete) if len(complete) == len(specs) else None
        return self.decode_stack is not None

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                inputs_embeds: torch.Tensor | None = None) -> torch.Tensor:
        """`inputs_embeds`: the step's embeddings when some are not tokens' (image rows)."""
        hidden = self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
        rope = self.rotary_emb.cos_sin(positions)  # gathered once, used by every layer
        stacked = (self.decode_stack.run(hidden, rope)
                   if self.decode_stack is not None and not torch.compiler.is_compiling() else None)
        if stacked is not None:
            hidden, residual = stacked
        else:
            residual = None
            for layer in self.layers:
                hidden, residual = layer(rope, hidden, residual)
        hidden, _ = self.norm(hidden, residual)
        return hidden


class LlamaForCausalLM(nn.Module):
    stacked_params: StackedMapping = [
        ("qkv_proj", "q_proj", "q"),
        ("qkv_proj", "k_proj", "k"),
        ("qkv_proj", "v_proj", "v"),
        ("gate_up_proj", "gate_proj", 0),
        ("gate_up_proj", "up_proj", 1),
    ]

    # The config's bias flags this family's HF code reads (Mistral's and Phi-3's read
    # none: a config that sets one loads there without biases, as HF loads it).
    bias_flags: tuple[str, ...] = ("attention_bias", "mlp_bias")

    @classmethod
    def config_bias(cls, config: Any, flag: str) -> bool:
        return flag in cls.bias_flags and bool(getattr(config, flag, False))

    @classmethod
    def attention_flags(cls, config: Any) -> AttentionFlags:
        bias = cls.config_bias(config, "attention_bias")
        return AttentionFlags(qkv_bias=bias, o_bias=bias)

    @classmethod
    def sliding_window(cls, config: Any) -> int | None:
        """Every layer's sliding window; None: full attention (a window in the config of
        a family without one here caps max_model_len instead)."""
        return None

    @classmethod
    def make_mlp(cls, config: Any, layer: int) -> nn.Module:
        """Layer `layer`'s feed-forward block."""
        return LlamaMLP(config, bias=cls.config_bias(config, "mlp_bias"))

    def __init__(self, config: Any) -> None:
        super().__init__()
        self.config = config
        self.model = LlamaModel(config, self.attention_flags(config), self.make_mlp, self.sliding_window(config))
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        tied = self.model.embed_tokens if self.tie_word_embeddings else None
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size, tied_to=tied)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """input_ids, positions: [T] over the flattened batch -> hidden states [T, hidden_size]."""
        return self.model(input_ids, positions)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, hidden_size] -> float32 logits [N, vocab_size]."""
        return self.lm_head.compute_logits(hidden)

    def _skip(self, name: str) -> bool:
        return "rotary_emb.inv_freq" in name or (self.tie_word_embeddings and name == "lm_head.weight")

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """HF-named (name, tensor) pairs -> parameters; ValueError names any missing or stray tensor."""
        return load_named_weights(self, weights, self.stacked_params, self._skip)


class MistralForCausalLM(LlamaForCausalLM):
    """Mistral is Llama's architecture with, in the 7B v0.1 configs, every layer attending
    over a sliding window (one sliding KV-cache group: blocks leave as the window moves)."""

    bias_flags = ()

    @classmethod
    def sliding_window(cls, config: Any) -> int | None:
        window = getattr(config, "sliding_window", None)
        return int(window) if window else None
