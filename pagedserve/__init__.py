"""pagedserve: PagedAttention, prefix caching and continuous batching in a small codebase.

Exports are lazy so that `import pagedserve.core...` never pulls in torch.
"""

from __future__ import annotations

from typing import Any

__version__ = "0.1.0"

_EXPORTS = {
    "LLM": "pagedserve.entrypoints.llm",
    "SamplingParams": "pagedserve.sampling_params",
    "BeamSearchParams": "pagedserve.sampling_params",
    "PoolingParams": "pagedserve.pooling_params",
    "PoolingRequestOutput": "pagedserve.outputs",
    "EmbeddingRequestOutput": "pagedserve.outputs",
    "ScoringRequestOutput": "pagedserve.outputs",
    "ClassificationRequestOutput": "pagedserve.outputs",
    "RequestOutput": "pagedserve.outputs",
    "CompletionOutput": "pagedserve.outputs",
    "Logprob": "pagedserve.outputs",
    "EngineArgs": "pagedserve.engine.arg_utils",
    "LLMEngine": "pagedserve.engine.llm_engine",
    "LoRARequest": "pagedserve.lora.request",
    "TextPrompt": "pagedserve.inputs",
    "TokensPrompt": "pagedserve.inputs",
    "PromptType": "pagedserve.inputs",
}

__all__ = list(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        import importlib

        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'pagedserve' has no attribute {name!r}")
