"""Model loading: registered names and local paths -> resolved config, model and tokenizer.

    hf_config = load_model_config(model_config, device)  # fills hf_config, max_model_len, dtype
    model = get_model(model_config, device)               # nn.Module, eval mode, weights loaded
    tokenizer = load_tokenizer(model_config)              # transformers tokenizer or None
"""

from pagedserve.model_loader.loader import (
    derive_max_model_len,
    get_model,
    load_model_config,
    resolve_device,
    resolve_dtype,
)
from pagedserve.model_loader.sources import MODEL_NAMES, cache_dir, resolve_gguf_path, resolve_source
from pagedserve.model_loader.tokenizer import load_chat_prompts, load_tokenizer

__all__ = [
    "MODEL_NAMES",
    "cache_dir",
    "derive_max_model_len",
    "get_model",
    "load_chat_prompts",
    "load_model_config",
    "load_tokenizer",
    "resolve_device",
    "resolve_dtype",
    "resolve_gguf_path",
    "resolve_source",
]
