"""The shared decoder of models/llama.py: what each family switches on, and its checks."""

from __future__ import annotations

import pytest
import torch
import transformers

from pagedserve.forward_context import set_forward_context
from pagedserve.models.llama import AttentionFlags, LlamaForCausalLM, head_dim_of
from pagedserve.models.qwen2 import Qwen2ForCausalLM
from pagedserve.models.qwen3 import Qwen3ForCausalLM

SMALL = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=1, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=64)


def test_each_family_sets_its_attention_flags():
    llama = transformers.LlamaConfig(**SMALL)
    assert LlamaForCausalLM.attention_flags(llama) == AttentionFlags()
    assert LlamaForCausalLM.attention_flags(transformers.LlamaConfig(**SMALL, attention_bias=True)) == \
        AttentionFlags(qkv_bias=True, o_bias=True)
    assert Qwen2ForCausalLM.attention_flags(transformers.Qwen2Config(**SMALL)) == AttentionFlags(qkv_bias=True)
    assert Qwen3ForCausalLM.attention_flags(transformers.Qwen3Config(**SMALL)) == AttentionFlags(qk_norm=True)


def test_modules_follow_the_flags():
    m = Qwen3ForCausalLM(transformers.Qwen3Config(**SMALL, head_dim=16))
    attn = m.model.layers[0].self_attn
    assert attn.qk_norm and attn.qkv_proj.bias is None and attn.head_dim == 16
    assert attn.qkv_proj.weight.shape == ((4 + 2 * 2) * 16, 32)
    q2 = Qwen2ForCausalLM(transformers.Qwen2Config(**SMALL)).model.layers[0].self_attn
    assert q2.qkv_proj.bias is not None and q2.o_proj.bias is None and not q2.qk_norm
    assert head_dim_of(transformers.LlamaConfig(**SMALL)) == 8


def test_unsupported_activation_is_refused():
    with pytest.raises(ValueError, match="unsupported hidden_act 'gelu'"):
        LlamaForCausalLM(transformers.LlamaConfig(**SMALL, hidden_act="gelu"))


def test_unsupported_activation_is_refused_for_moe_experts_too():
    """Every layer sparse: the dense MLP's check never ran, and the experts computed SiLU."""
    from pagedserve.models.qwen3_moe import Qwen3MoeForCausalLM

    moe = dict(SMALL, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16)
    Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(**moe))
    with pytest.raises(ValueError, match="unsupported hidden_act 'gelu'"):
        Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(**moe, hidden_act="gelu"))


def test_forward_without_a_cache_is_causal_over_the_flat_batch():
    """With no forward context, attention treats the tokens as one causal sequence (the
    profile run's mode): a token's hidden state ignores later tokens."""
    torch.manual_seed(0)
    m = LlamaForCausalLM(transformers.LlamaConfig(**SMALL)).eval()
    for p in m.parameters():
        torch.nn.init.normal_(p, std=0.2)
    ids = torch.tensor([3, 9, 27, 5])
    with torch.no_grad(), set_forward_context(None):
        full = m(ids, torch.arange(4))
        prefix = m(ids[:2], torch.arange(2))
        logits = m.compute_logits(full)
    torch.testing.assert_close(full[:2], prefix)
    assert logits.shape == (4, 64) and logits.dtype == torch.float32


def test_load_weights_names_missing_and_stray_tensors():
    m = LlamaForCausalLM(transformers.LlamaConfig(**SMALL))
    weights = dict(transformers.LlamaForCausalLM(transformers.LlamaConfig(**SMALL)).state_dict())
    m.load_weights(weights.items())
    del weights["model.layers.0.self_attn.k_proj.weight"]
    with pytest.raises(ValueError, match=r"missing 1 tensor\(s\): model.layers.0.self_attn.k_proj.weight"):
        m.load_weights(weights.items())
    weights["model.layers.0.self_attn.k_proj.weight"] = torch.zeros(16, 32)
    weights["model.layers.7.mlp.up_proj.weight"] = torch.zeros(48, 32)
    with pytest.raises(ValueError, match="model.layers.7.mlp.up_proj.weight"):
        m.load_weights(weights.items())
