"""Qwen3 (dense): the Llama decoder plus a per-head RMSNorm on q and k before RoPE."""

from __future__ import annotations

from typing import Any

from pagedserve.models.llama import AttentionFlags, LlamaForCausalLM


class Qwen3ForCausalLM(LlamaForCausalLM):
    @classmethod
    def attention_flags(cls, config: Any) -> AttentionFlags:
        bias = bool(getattr(config, "attention_bias", False))
        return AttentionFlags(qkv_bias=bias, o_bias=bias, qk_norm=True)
