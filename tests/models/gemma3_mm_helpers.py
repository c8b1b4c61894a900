"""A tiny random Gemma3ForConditionalGeneration checkpoint (SigLIP tower, projector, Gemma 3
decoder) with a Gemma-like tokenizer, chat template and PIL image processor, built
in-process; and the test-side pieces that put image rows into a prompt's embeddings."""

from __future__ import annotations

import functools
from typing import Any

import numpy as np
import torch

from tests.models.models_helpers import randomize

SPECIALS = ["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>", "<start_of_image>",
            "<end_of_image>", "<image_soft_token>"]
_CORPUS = [
    "hello world, describe the image please. what is in this picture?",
    "the quick brown fox jumps over the lazy dog; compare the two images.",
    "user model: answer politely and briefly.",
]
# Gemma 3's template in spirit: image parts render as the placeholder, roles as turns.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{%- for message in messages -%}"
    "{%- set role = 'model' if message['role'] == 'assistant' else message['role'] -%}"
    "{{ '<start_of_turn>' + role + '\n' }}"
    "{%- if message['content'] is string -%}{{ message['content'] | trim }}"
    "{%- else -%}{%- for item in message['content'] -%}"
    "{%- if item['type'] == 'image' -%}{{ '<start_of_image>' }}"
    "{%- elif item['type'] == 'text' -%}{{ item['text'] | trim }}{%- endif -%}"
    "{%- endfor -%}{%- endif -%}"
    "{{ '<end_of_turn>\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<start_of_turn>model\n' }}{%- endif -%}"
)
MM_TOKENS = 4
IMAGE_SIZE = 32
VOCAB = 320


@functools.lru_cache(maxsize=1)
def _backend() -> Any:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tk = Tokenizer(models.BPE(unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tk.train_from_iterator(_CORPUS * 5, trainer)
    # Gemma's tokenizer puts <bos> in front of every encoded text.
    tk.post_processor = processors.TemplateProcessing(
        single="<bos> $A", pair="<bos> $A $B", special_tokens=[("<bos>", SPECIALS.index("<bos>"))])
    return tk


def make_tokenizer() -> Any:
    from transformers import PreTrainedTokenizerFast

    tok = PreTrainedTokenizerFast(
        tokenizer_object=_backend(), bos_token="<bos>", eos_token="<eos>", pad_token="<pad>", unk_token="<unk>",
        extra_special_tokens={"boi_token": "<start_of_image>", "eoi_token": "<end_of_image>",
                              "image_token": "<image_soft_token>"})
    tok.chat_template = CHAT_TEMPLATE
    return tok


def make_image_processor() -> Any:
    from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil

    return Gemma3ImageProcessorPil(size={"height": IMAGE_SIZE, "width": IMAGE_SIZE})


def make_hf_gemma3_mm(tok: Any, **text_overrides: Any) -> torch.nn.Module:
    """A float32 HF Gemma3ForConditionalGeneration with every parameter random and large
    enough to matter (norm scales, biases, the projector), its token ids the tokenizer's."""
    import transformers

    text = transformers.Gemma3TextConfig(**{
        **dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, head_dim=16, layer_types=["sliding_attention", "full_attention"],
               sliding_window=64, max_position_embeddings=512, rms_norm_eps=1e-6, query_pre_attn_scalar=16,
               bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id),
        **text_overrides})
    vision = transformers.SiglipVisionConfig(
        hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=2, image_size=IMAGE_SIZE,
        patch_size=8, vision_use_head=False, layer_norm_eps=1e-6)
    config = transformers.Gemma3Config(
        text_config=text.to_dict(), vision_config=vision.to_dict(), mm_tokens_per_image=MM_TOKENS,
        image_token_index=tok.convert_tokens_to_ids("<image_soft_token>"),
        boi_token_index=tok.convert_tokens_to_ids("<start_of_image>"),
        eoi_token_index=tok.convert_tokens_to_ids("<end_of_image>"),
        bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    config.architectures = ["Gemma3ForConditionalGeneration"]
    torch.manual_seed(0)
    model = transformers.Gemma3ForConditionalGeneration(config).to(torch.float32).eval()
    randomize(model, is_scale=lambda name: "norm" in name and name.endswith("weight"))
    return model


def save_checkpoint(path: str) -> torch.nn.Module:
    """Write the checkpoint (weights, config, tokenizer, preprocessor_config.json) to `path`."""
    tok = make_tokenizer()
    model = make_hf_gemma3_mm(tok)
    model.save_pretrained(path)
    tok.save_pretrained(path)
    make_image_processor().save_pretrained(path)
    return model


def random_image(seed: int, size: tuple[int, int] = (50, 40)) -> Any:
    """A PIL RGB image of random pixels (width, height) = size, not square, so the
    processor's resize matters."""
    from PIL import Image

    pixels = np.random.RandomState(seed).randint(0, 256, (size[1], size[0], 3), dtype=np.uint8)
    return Image.fromarray(pixels)


def put_image_rows(embeds: torch.Tensor, images: list[Any], rows: list[torch.Tensor]) -> torch.Tensor:
    """`embeds` [T, hidden] with each image's span (ImageFeature) replaced by its rows
    (where embed_mask says, all of the span when it is None): what the runner does."""
    out = embeds.clone()
    for feature, image_rows in zip(images, rows, strict=True):
        positions = torch.arange(feature.offset, feature.end)
        if feature.embed_mask is not None:
            positions = positions[torch.tensor(feature.embed_mask, dtype=torch.bool)]
        assert len(positions) == feature.num_embeds == image_rows.shape[0]
        out[positions] = image_rows.to(out.dtype)
    return out
