"""Qwen2 / Qwen2.5: the Llama decoder with bias on the q, k and v projections (none on o)."""

from __future__ import annotations

from typing import Any

from pagedserve.models.llama import AttentionFlags, LlamaForCausalLM


class Qwen2ForCausalLM(LlamaForCausalLM):
    bias_flags = ()  # (q, k and v always have one; o and the MLP never)

    @classmethod
    def attention_flags(cls, config: Any) -> AttentionFlags:
        return AttentionFlags(qkv_bias=True, o_bias=False)
