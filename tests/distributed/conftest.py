"""Tiny random Llama / Qwen3 checkpoints for the tensor-parallel tests.

vocab_size is odd on purpose: with tp=2 the last rank's vocabulary shard is padded,
so every parity test also checks the padding is invisible.
"""

from __future__ import annotations

import os

import pytest
import torch

VOCAB = 509  # not a multiple of 2: the last vocabulary shard is padded


def make_checkpoint(arch: str, path: str, num_kv_heads: int, **overrides) -> None:
    import transformers

    common = dict(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=num_kv_heads, max_position_embeddings=512,
        # A wide init keeps greedy decoding away from near-ties that rounding could flip.
        initializer_range=0.15, tie_word_embeddings=False, rms_norm_eps=1e-6,
    )
    common.update(overrides)
    if arch == "llama":
        cfg, cls = transformers.LlamaConfig(**common), transformers.LlamaForCausalLM
    elif arch == "qwen3":
        cfg, cls = transformers.Qwen3Config(**common, head_dim=32), transformers.Qwen3ForCausalLM
    else:
        raise ValueError(arch)
    torch.manual_seed(0)
    cls(cfg).eval().save_pretrained(path)


@pytest.fixture(scope="session")
def tp_checkpoint(tmp_path_factory):
    """tp_checkpoint(arch, num_kv_heads, **overrides) -> model directory (made once per session)."""
    made: dict[tuple, str] = {}

    def get(arch: str, num_kv_heads: int, **overrides) -> str:
        key = (arch, num_kv_heads, tuple(sorted(overrides.items())))
        if key not in made:
            path = str(tmp_path_factory.mktemp(f"tp-{arch}-kv{num_kv_heads}"))
            make_checkpoint(arch, path, num_kv_heads, **overrides)
            made[key] = path
        return made[key]

    return get


def process_alive(pid: int) -> bool:
    """True while `pid` exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False
    except OSError:
        return os.path.exists(f"/proc/{pid}")
