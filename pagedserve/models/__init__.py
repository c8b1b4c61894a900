"""Model families; look them up by HF architecture name with `get_model_class`."""

from pagedserve.models.registry import MODEL_REGISTRY, get_model_class, supported_architectures

__all__ = ["MODEL_REGISTRY", "get_model_class", "supported_architectures"]
