"""Tiny random Qwen2-VL / Qwen2.5-VL checkpoints (config, weights, tokenizer with the
vision special tokens, Qwen2-VL-style chat template, preprocessor_config.json), built
by transformers in-process, and the small pieces the tests share."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from tests.engine.helpers import bpe_backend
from tests.models.models_helpers import randomize

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>",
            "<|image_pad|>", "<|video_pad|>"]
_CORPUS = [
    "hello world, the quick brown fox jumps over the lazy dog.",
    "Describe the image. What is in this picture? Compare the two images.",
    "user assistant system: answer politely and briefly.",
]
# Image parts render as Qwen2-VL's own template does.
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% if m['content'] is string %}{{ m['content'] }}{% else %}{% for part in m['content'] %}"
    "{% if part['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}{% endfor %}{% endif %}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
VOCAB_SIZE = 416  # >= the tokenizer's size
MIN_PIXELS, MAX_PIXELS = 28 * 28 * 4, 28 * 28 * 20
FAMILIES = ("qwen2_vl", "qwen2_5_vl")


def make_tokenizer() -> Any:
    from transformers import PreTrainedTokenizerFast

    tok = PreTrainedTokenizerFast(tokenizer_object=bpe_backend(tuple(SPECIALS), tuple(_CORPUS)), bos_token="<|endoftext|>", eos_token="<|im_end|>",
                                  pad_token="<|endoftext|>")
    tok.chat_template = CHAT_TEMPLATE
    assert len(tok) <= VOCAB_SIZE
    return tok


def make_image_processor() -> Any:
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    return Qwen2VLImageProcessorPil(min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS)


def make_config(family: str, tok: Any) -> Any:
    import transformers

    ids = {name: tok.convert_tokens_to_ids(token) for name, token in [
        ("image_token_id", "<|image_pad|>"), ("video_token_id", "<|video_pad|>"),
        ("vision_start_token_id", "<|vision_start|>"), ("vision_end_token_id", "<|vision_end|>")]}
    text = dict(vocab_size=VOCAB_SIZE, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-6,
                rope_parameters={"rope_type": "default", "mrope_section": [2, 3, 3], "rope_theta": 10000.0},
                bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    if family == "qwen2_vl":
        vision = dict(depth=2, embed_dim=32, hidden_size=64, num_heads=2, mlp_ratio=2, patch_size=14,
                      spatial_merge_size=2, temporal_patch_size=2)
        cls, arch = transformers.Qwen2VLConfig, "Qwen2VLForConditionalGeneration"
    else:
        # window 56 px = 2x2 merged rows: the 2x2 and 3x4 grids below have full and cut windows;
        # block 0 is windowed, block 1 attends over the whole image.
        vision = dict(depth=2, hidden_size=32, intermediate_size=48, num_heads=2, out_hidden_size=64,
                      patch_size=14, spatial_merge_size=2, temporal_patch_size=2, window_size=56,
                      fullatt_block_indexes=[1], hidden_act="silu")
        cls, arch = transformers.Qwen2_5_VLConfig, "Qwen2_5_VLForConditionalGeneration"
    config = cls(text_config=text, vision_config=vision, **ids)
    config.architectures = [arch]
    return config


def make_hf_model(family: str, tok: Any) -> torch.nn.Module:
    """A float32 HF model with every parameter random (biases and norm scales too, so they matter)."""
    import transformers

    config = make_config(family, tok)
    cls = (transformers.Qwen2VLForConditionalGeneration if family == "qwen2_vl"
           else transformers.Qwen2_5_VLForConditionalGeneration)
    torch.manual_seed(0)
    model = cls(config).to(torch.float32).eval()
    randomize(model, is_scale=lambda name: "norm" in name or "ln_q" in name,
              std_of=lambda name: 0.03 if "patch_embed" in name else None)
    return model


def save_checkpoint(path: str, family: str) -> torch.nn.Module:
    """Write a complete model directory to `path`; returns the HF model."""
    tok = make_tokenizer()
    model = make_hf_model(family, tok)
    model.save_pretrained(path)
    tok.save_pretrained(path)
    make_image_processor().save_pretrained(path)
    return model


def random_image(height: int, width: int, seed: int) -> Any:
    from PIL import Image

    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8))


def load_ours(path: str) -> torch.nn.Module:
    """Our model of `path` in float32, built straight from its composite config."""
    from transformers import AutoConfig

    from pagedserve.model_loader.weight_utils import iter_safetensors, safetensors_files
    from pagedserve.models.qwen2_vl import Qwen2_5_VLForConditionalGeneration, Qwen2VLForConditionalGeneration

    config = AutoConfig.from_pretrained(path)
    cls = (Qwen2VLForConditionalGeneration if config.architectures[0] == "Qwen2VLForConditionalGeneration"
           else Qwen2_5_VLForConditionalGeneration)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float32)
    try:
        model = cls(config)
    finally:
        torch.set_default_dtype(previous)
    with torch.no_grad():
        model.load_weights(iter_safetensors(safetensors_files(path)))
    return model.eval()


def prompt_text(tok: Any, num_images: int, question: str = "Describe the image.") -> str:
    content: list[dict[str, str]] = [{"type": "image"} for _ in range(num_images)]
    content.append({"type": "text", "text": question})
    return tok.apply_chat_template([{"role": "user", "content": content}], tokenize=False,
                                   add_generation_prompt=True)


def merged_embeds(model: Any, prompt: Any) -> torch.Tensor:
    """embed_input_ids of the prompt with each image's span replaced by its embed_images rows
    (what the model runner does)."""
    ids = torch.tensor(prompt.prompt_token_ids)
    embeds = model.embed_input_ids(ids).clone()
    rows = model.embed_images([image.data for image in prompt.images])
    for image, r in zip(prompt.images, rows, strict=True):
        embeds[image.offset:image.end] = r
    return embeds


def our_prompt_logits(model: Any, prompt: Any) -> torch.Tensor:
    from pagedserve.forward_context import set_forward_context

    ids = torch.tensor(prompt.prompt_token_ids)
    with torch.no_grad(), set_forward_context(None):
        hidden = model(ids, prompt.mrope_positions, inputs_embeds=merged_embeds(model, prompt))
        return model.compute_logits(hidden)


def hf_prompt_logits(hf: Any, prompt: Any) -> torch.Tensor:
    ids = torch.tensor(prompt.prompt_token_ids)[None]
    kwargs: dict[str, Any] = {}
    if prompt.images:
        kwargs = dict(
            pixel_values=torch.cat([im.data["pixel_values"] for im in prompt.images]),
            image_grid_thw=torch.cat([im.data["image_grid_thw"] for im in prompt.images]),
            mm_token_type_ids=(ids == hf.config.image_token_id).int(),
        )
    with torch.no_grad():
        return hf(input_ids=ids, **kwargs).logits[0].float()
