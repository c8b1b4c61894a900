"""Model classes by the HF `architectures` name found in config.json."""

from __future__ import annotations

from typing import Any

from torch import nn

from pagedserve.models.llama import LlamaForCausalLM, MistralForCausalLM
from pagedserve.models.phi3 import Phi3ForCausalLM
from pagedserve.models.qwen2 import Qwen2ForCausalLM
from pagedserve.models.qwen3 import Qwen3ForCausalLM

MODEL_REGISTRY: dict[str, type[nn.Module]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": MistralForCausalLM,
    "Phi3ForCausalLM": Phi3ForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
}

# For configs without `architectures` (e.g. built from GGUF metadata or by hand).
_BY_MODEL_TYPE = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "phi3": "Phi3ForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}


def supported_architectures() -> list[str]:
    return sorted(MODEL_REGISTRY)


def resolve_architecture(hf_config: Any) -> str:
    """The one supported architecture name of `hf_config`, or ValueError naming what it has."""
    names = list(getattr(hf_config, "architectures", None) or [])
    if not names:
        model_type = getattr(hf_config, "model_type", None)
        if model_type in _BY_MODEL_TYPE:
            return _BY_MODEL_TYPE[model_type]
        names = [f"<none; model_type={model_type!r}>"]
    for name in names:
        if name in MODEL_REGISTRY:
            return name
    raise ValueError(
        f"unsupported model architecture {', '.join(map(str, names))}; "
        f"supported: {', '.join(supported_architectures())}"
    )


def get_model_class(hf_config: Any) -> type[nn.Module]:
    return MODEL_REGISTRY[resolve_architecture(hf_config)]
