"""Tiny random HF models of every supported architecture, built in-process."""

from __future__ import annotations

from typing import Any

import torch

COMMON = dict(
    vocab_size=320, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-6,
)

# name -> (config class name, overrides)
TINY_CASES: dict[str, tuple[str, dict[str, Any]]] = {
    "llama": ("LlamaConfig", {}),
    "llama3-rope-tied": ("LlamaConfig", dict(
        tie_word_embeddings=True, rope_theta=500000.0,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 256})),  # wavelength 168 falls in the smoothed band
    "llama-linear-rope-bias": ("LlamaConfig", dict(
        rope_scaling={"rope_type": "linear", "factor": 4.0}, attention_bias=True, mlp_bias=True)),
    "mistral": ("MistralConfig", dict(head_dim=16, sliding_window=128)),
    "qwen2": ("Qwen2Config", {}),
    "qwen2-tied": ("Qwen2Config", dict(tie_word_embeddings=True)),
    "qwen3": ("Qwen3Config", dict(head_dim=32)),
}


def make_hf_model(case: str, **overrides: Any) -> torch.nn.Module:
    """A float32 HF model with every parameter random (biases and norm scales too, so they matter)."""
    import transformers

    cls_name, case_overrides = TINY_CASES[case]
    config = getattr(transformers, cls_name)(**{**COMMON, **case_overrides, **overrides})
    config.architectures = [cls_name.replace("Config", "ForCausalLM")]
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    randomize(model)
    return model


def randomize(model: torch.nn.Module, is_scale: Any = lambda name: "norm" in name,
              std_of: Any = lambda name: None) -> None:
    """Every parameter random and big enough to matter: norm scales (`is_scale`) near 1,
    the rest normal with std 0.15 (vectors 0.05), or `std_of(name)` where it says."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if is_scale(name):
                p.uniform_(0.5, 1.5)
            else:
                p.normal_(0.0, std_of(name) or (0.15 if p.dim() > 1 else 0.05))


def our_logits(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """Our model's logits for one sequence: with no attention metadata, Attention treats
    the flattened batch as one causal sequence."""
    from pagedserve.forward_context import set_forward_context

    with torch.no_grad(), set_forward_context(None):
        return model.compute_logits(model(ids, torch.arange(len(ids))))


def hf_logits(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(ids[None]).logits[0].float()
