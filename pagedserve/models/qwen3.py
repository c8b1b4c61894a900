"""Qwen3 (dense): the Llama decoder plus a per-head RMSNorm on q and k before RoPE."""

from __future__ import annotations

from typing import Any

from pagedserve.models.llama import AttentionFlags, LlamaForCausalLM


class Qwen3ForCausalLM(LlamaForCausalLM):
    bias_flags = ("attention_bias",)

    @classmethod
    def attention_flags(cls, config: Any) -> AttentionFlags:
        bias = cls.config_bias(config, "attention_bias")
        return AttentionFlags(qkv_bias=bias, o_bias=bias, qk_norm=True)
