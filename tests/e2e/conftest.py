"""Tiny random-weight checkpoints of each supported architecture, made with transformers."""

from __future__ import annotations

import pytest
import torch


def make_tiny_checkpoint(arch: str, path: str, **overrides):
    import transformers

    common = dict(
        vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        # A wide init keeps the next-token distribution peaked, so greedy decoding
        # is not a string of near-ties that any rounding difference would flip.
        initializer_range=0.15, tie_word_embeddings=False, rms_norm_eps=1e-6,
    )
    if arch == "llama":
        cfg = transformers.LlamaConfig(
            **common, rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                    "high_freq_factor": 4.0, "original_max_position_embeddings": 128},
        )
        cls = transformers.LlamaForCausalLM
    elif arch == "qwen2":
        common["tie_word_embeddings"] = True
        cfg = transformers.Qwen2Config(**common)
        cls = transformers.Qwen2ForCausalLM
    elif arch == "qwen3":
        cfg = transformers.Qwen3Config(**common, head_dim=64)  # 64: the CPU decode kernel takes it
        cls = transformers.Qwen3ForCausalLM
    elif arch == "qwen3_moe":
        # 8 experts, 2 per token; layer 0 sparse, layer 1 dense (mlp_only_layers).
        cfg = transformers.Qwen3MoeConfig(**common, head_dim=64, num_experts=8, num_experts_per_tok=2,
                                          moe_intermediate_size=48, decoder_sparse_step=1, mlp_only_layers=[1],
                                          norm_topk_prob=True)
        cls = transformers.Qwen3MoeForCausalLM
    elif arch == "phi3":
        # Phi-4-mini's shape of the rope: 3/4 of each head rotates, LongRoPE factors, an
        # original context (256) longer than the tests' sequences, so the short factors apply.
        rotary_half = 16 * 3 // 4 // 2  # head_dim 16 (64 / 4 heads)
        rope = {"rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.75,
                "short_factor": [1.0 + 0.1 * i for i in range(rotary_half)],
                "long_factor": [2.0 + 0.5 * i for i in range(rotary_half)],
                "original_max_position_embeddings": 256}
        common["max_position_embeddings"] = 1024
        cfg = transformers.Phi3Config(**common, rope_parameters=rope, original_max_position_embeddings=256,
                                      pad_token_id=0)
        cls = transformers.Phi3ForCausalLM
    elif arch == "gemma3":
        # Two sliding layers (window 24, shorter than most prompts plus their 32 new
        # tokens) and a global one: three KV-cache groups of one layer each.  A query
        # scalar other than head_dim, and final-logit soft-capping, so both count.
        common["num_hidden_layers"] = 3
        cfg = transformers.Gemma3TextConfig(
            **common, head_dim=64, sliding_window=24, query_pre_attn_scalar=32, final_logit_softcapping=30.0,
            layer_types=["sliding_attention", "sliding_attention", "full_attention"])
        cls = transformers.Gemma3ForCausalLM
    elif arch == "mistral":
        cfg = transformers.MistralConfig(**common, head_dim=64, sliding_window=24)  # every layer sliding
        cls = transformers.MistralForCausalLM
    else:
        raise ValueError(arch)
    for k, v in overrides.items():
        setattr(cfg, k, v)
    torch.manual_seed(0)
    model = cls(cfg).eval()
    model.save_pretrained(path)
    return cfg


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory):
    cache: dict[str, tuple[str, object]] = {}

    def get(arch: str):
        if arch not in cache:
            path = str(tmp_path_factory.mktemp(f"tiny-{arch}"))
            cache[arch] = (path, make_tiny_checkpoint(arch, path))
        return cache[arch]

    return get
