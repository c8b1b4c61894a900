"""Each vision-language family's prompt processor, by the checkpoint's architecture name
(the model classes are models/registry.py's MULTIMODAL_REGISTRY)."""

from __future__ import annotations

import importlib
from typing import Any

from pagedserve.multimodal.inputs import ImagePromptProcessor

PROMPT_PROCESSORS: dict[str, str] = {
    "Idefics3ForConditionalGeneration": "pagedserve.multimodal.idefics3:Idefics3ImagePrompts",
    "SmolVLMForConditionalGeneration": "pagedserve.multimodal.idefics3:Idefics3ImagePrompts",
    "Gemma3ForConditionalGeneration": "pagedserve.multimodal.gemma3:Gemma3ImagePrompts",
    "Qwen2VLForConditionalGeneration": "pagedserve.multimodal.qwen2_vl:Qwen2VLImagePrompts",
    "Qwen2_5_VLForConditionalGeneration": "pagedserve.multimodal.qwen2_vl:Qwen2VLImagePrompts",
}


def load_class(target: str) -> Any:
    module, name = target.split(":")
    return getattr(importlib.import_module(module), name)


def make_image_prompt_processor(architecture: str, model_dir: str, hf_mm_config: Any,
                                tokenizer: Any) -> ImagePromptProcessor:
    """The family's processor for one model: its HF image processor read from
    `model_dir` (preprocessor_config.json), its placeholder tokens from `tokenizer`."""
    target = PROMPT_PROCESSORS.get(architecture)
    if target is None:
        raise ValueError(f"{architecture} takes no images here; image input works with "
                         f"{', '.join(sorted(PROMPT_PROCESSORS))}")
    return load_class(target)(model_dir, hf_mm_config, tokenizer)
