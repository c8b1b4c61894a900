"""Multi-LoRA serving: adapters in PEFT's format, picked per request, batched across adapters."""

from pagedserve.lora.request import LoRARequest

__all__ = ["LoRARequest"]
