"""Model classes by the HF `architectures` name found in config.json."""

from __future__ import annotations

import importlib
import json
import os
from typing import Any

from torch import nn

from pagedserve.models.gemma3 import Gemma3ForCausalLM
from pagedserve.models.llama import LlamaForCausalLM, MistralForCausalLM
from pagedserve.models.phi3 import Phi3ForCausalLM
from pagedserve.models.qwen2 import Qwen2ForCausalLM
from pagedserve.models.qwen3 import Qwen3ForCausalLM
from pagedserve.models.qwen3_moe import Qwen3MoeForCausalLM

MODEL_REGISTRY: dict[str, type[nn.Module]] = {
    "Gemma3ForCausalLM": Gemma3ForCausalLM,
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": MistralForCausalLM,
    "Phi3ForCausalLM": Phi3ForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
    "Qwen3MoeForCausalLM": Qwen3MoeForCausalLM,
}

# For configs without `architectures` (e.g. built from GGUF metadata or by hand).
_BY_MODEL_TYPE = {
    "gemma3_text": "Gemma3ForCausalLM",
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "phi3": "Phi3ForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
}


# Vision-language families (image input: pagedserve/multimodal/), imported when used:
# architecture -> "module:class".  The class is built from the checkpoint's whole config
# (text_config, vision_config, ...); everything else reads its text config.
MULTIMODAL_REGISTRY: dict[str, str] = {
    "Idefics3ForConditionalGeneration": "pagedserve.models.idefics3:Idefics3ForConditionalGeneration",
    "SmolVLMForConditionalGeneration": "pagedserve.models.idefics3:Idefics3ForConditionalGeneration",
    "Gemma3ForConditionalGeneration": "pagedserve.models.gemma3_mm:Gemma3ForConditionalGeneration",
    "Qwen2VLForConditionalGeneration": "pagedserve.models.qwen2_vl:Qwen2VLForConditionalGeneration",
    "Qwen2_5_VLForConditionalGeneration": "pagedserve.models.qwen2_vl:Qwen2_5_VLForConditionalGeneration",
}


def supported_architectures() -> list[str]:
    return sorted([*MODEL_REGISTRY, *MULTIMODAL_REGISTRY])


# Config fields that change a model's math in families we do not implement them for:
# the value each must have (None: absent or None) for our model to compute what the
# checkpoint's own code computes.  Anything else is refused by name, never ignored.
_NEUTRAL_FIELDS: dict[str, tuple[Any, ...]] = {
    "attn_logit_softcapping": (None,),  # Gemma 2: tanh cap on attention scores
    "final_logit_softcapping": (None,),  # Gemma 2: tanh cap on the logits
    "query_pre_attn_scalar": (None,),  # Gemma 2/3: attention scale other than 1/sqrt(head_dim)
    "logit_scale": (None, 1.0),  # Cohere
    "embedding_multiplier": (None, 1.0),  # Granite's muP multipliers
    "residual_multiplier": (None, 1.0),
    "attention_multiplier": (None,),
    "logits_scaling": (None, 1.0),
    "use_bidirectional_attention": (None, False),  # Gemma 3 as an encoder (EmbeddingGemma): attends both ways
    "quantization_config": (None,),  # an HF-quantized checkpoint (fp8, GPTQ, AWQ...): its weights need their scales
}


# Fields a family implements itself (its model reads them), exempt from the check below.
_IMPLEMENTED_FIELDS: dict[str, tuple[str, ...]] = {
    "Gemma3ForCausalLM": ("query_pre_attn_scalar", "final_logit_softcapping"),
    "Gemma3ForConditionalGeneration": ("query_pre_attn_scalar", "final_logit_softcapping"),
}

# Families whose layers honour the config's sliding_window (KV-cache groups); for the
# others a window caps max_model_len (model_loader/loader.py).
SLIDING_WINDOW_ARCHITECTURES = ("Gemma3ForCausalLM", "Gemma3ForConditionalGeneration", "MistralForCausalLM")


def check_supported_config(hf_config: Any) -> None:
    """ValueError naming a config field whose effect the model's family here does not implement."""
    implemented = _IMPLEMENTED_FIELDS.get(resolve_architecture(hf_config), ())
    for name, neutral in _NEUTRAL_FIELDS.items():
        if name in implemented:
            continue
        value = getattr(hf_config, name, None)
        if value not in neutral:
            raise ValueError(f"the model config sets {name}={value!r}, which changes the model's math and is not "
                             f"implemented for {resolve_architecture(hf_config)}; refusing rather than computing "
                             "something else")


def resolve_architecture(hf_config: Any) -> str:
    """The one supported architecture name of `hf_config`, or ValueError naming what it has."""
    names = list(getattr(hf_config, "architectures", None) or [])
    if not names:
        model_type = getattr(hf_config, "model_type", None)
        if model_type in _BY_MODEL_TYPE:
            return _BY_MODEL_TYPE[model_type]
        names = [f"<none; model_type={model_type!r}>"]
    for name in names:
        if name in MODEL_REGISTRY or name in MULTIMODAL_REGISTRY:
            return name
    raise ValueError(
        f"unsupported model architecture {', '.join(map(str, names))}; "
        f"supported: {', '.join(sorted(MODEL_REGISTRY))}; with images: {', '.join(sorted(MULTIMODAL_REGISTRY))}"
    )


def check_config_file(directory: str) -> None:
    """ValueError naming an unsupported family where the directory's raw config.json
    names one (its architectures, else its model_type), read as JSON without transformers:
    before a load (entrypoints' model pool), or where transformers' own refusal of an
    unknown model_type advised upgrading it.  Nothing where the file cannot be read."""
    from types import SimpleNamespace

    try:
        with open(os.path.join(directory, "config.json"), encoding="utf-8") as f:
            raw = json.load(f)
    except (OSError, ValueError, RecursionError):
        return
    raw = raw if isinstance(raw, dict) else {}
    names = raw.get("architectures")
    resolve_architecture(SimpleNamespace(model_type=raw.get("model_type"), architectures=names if isinstance(
        names, list) and all(isinstance(n, str) for n in names) else None))


def multimodal_architecture(hf_config: Any) -> str | None:
    """The vision-language architecture a checkpoint's config names, or None."""
    for name in getattr(hf_config, "architectures", None) or ():
        if name in MULTIMODAL_REGISTRY:
            return name
    return None


def names_vision_model(directory: str) -> bool:
    """The model directory's config.json names a vision-language architecture (read as
    JSON: no transformers import).  Such models keep transformers' own config and
    tokenizer objects, which their image processors read."""
    try:
        with open(os.path.join(directory, "config.json"), encoding="utf-8") as f:
            names = json.load(f).get("architectures") or []
    except (OSError, ValueError, AttributeError, RecursionError):
        return False  # transformers reports what is wrong with it
    return any(name in MULTIMODAL_REGISTRY for name in names if isinstance(name, str))


def snapshots_allowed(directory: str, trust_remote_code: bool) -> bool:
    """Whether start-up may read this HF directory's config and tokenizer as snapshots
    (model_loader/config_snapshot.py, tokenizer_snapshot.py: no transformers objects):
    not when its remote code defines them, nor for a vision model."""
    return not trust_remote_code and not names_vision_model(directory)


def get_model_class(hf_config: Any) -> type[nn.Module]:
    check_supported_config(hf_config)
    name = resolve_architecture(hf_config)
    if name in MULTIMODAL_REGISTRY:
        module, cls = MULTIMODAL_REGISTRY[name].split(":")
        return getattr(importlib.import_module(module), cls)
    return MODEL_REGISTRY[name]
