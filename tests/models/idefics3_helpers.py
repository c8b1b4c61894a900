"""A tiny random Idefics3 / SmolVLM checkpoint, built in-process with transformers: a
2-layer Llama decoder, a 1-layer vision tower on 32-pixel tiles of 8-pixel patches
(16 patches, 4 rows per tile after the 2x pixel shuffle), images split into tiles up to
64 pixels, the family's image tokens in a small BPE tokenizer, and SmolVLM's chat
template."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from tests.models.models_helpers import randomize

CHAT_TEMPLATE = (
    "<|im_start|>{% for message in messages %}{{ message['role'] | capitalize }}"
    "{% if message['content'][0]['type'] == 'image' %}{{ ':' }}{% else %}{{ ': ' }}{% endif %}"
    "{% for line in message['content'] %}{% if line['type'] == 'text' %}{{ line['text'] }}"
    "{% elif line['type'] == 'image' %}{{ '<image>' }}{% endif %}{% endfor %}<end_of_utterance>\n"
    "{% endfor %}{% if add_generation_prompt %}{{ 'Assistant:' }}{% endif %}"
)
IMAGE_TOKENS = ["<image>", "<fake_token_around_image>", "<global-img>", "<end_of_utterance>",
                *(f"<row_{r}_col_{c}>" for r in range(1, 5) for c in range(1, 5))]


def make_tokenizer() -> Any:
    from tests.engine.helpers import make_tokenizer as base

    tok = base()
    tok.add_special_tokens({"additional_special_tokens": IMAGE_TOKENS})
    tok.chat_template = CHAT_TEMPLATE
    return tok


def make_idefics3(path: Path, family: str = "idefics3") -> torch.nn.Module:
    """Save the checkpoint (weights, tokenizer, preprocessor config) in `path`; returns HF's model."""
    import transformers
    from transformers.models.idefics3.image_processing_pil_idefics3 import Idefics3ImageProcessorPil

    tok = make_tokenizer()
    text = dict(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024, rms_norm_eps=1e-6,
                tie_word_embeddings=False, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                pad_token_id=tok.pad_token_id)
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                  image_size=32, patch_size=8)
    config_cls = transformers.SmolVLMConfig if family == "smolvlm" else transformers.Idefics3Config
    model_cls = (transformers.SmolVLMForConditionalGeneration if family == "smolvlm"
                 else transformers.Idefics3ForConditionalGeneration)
    config = config_cls(text_config=text, vision_config=vision, scale_factor=2,
                        image_token_id=tok.convert_tokens_to_ids("<image>"), tie_word_embeddings=False)
    config.architectures = [model_cls.__name__]
    model = model_cls(config).eval()
    torch.manual_seed(0)
    randomize(model)
    model.save_pretrained(path)
    tok.save_pretrained(path)
    Idefics3ImageProcessorPil(size={"longest_edge": 64}, max_image_size={"longest_edge": 32},
                              do_image_splitting=True).save_pretrained(path)
    return model


def image(width: int, height: int, seed: int) -> Any:
    """A random RGB PIL image."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8))
