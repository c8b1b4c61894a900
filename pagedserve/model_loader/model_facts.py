"""What a model is, read from its files without loading it: format, family, parameter
count, quantization, context length, chat template and the weights' size on disk.  What
Ollama's /api/tags, /api/ps and /api/show say of a model, and the server's first estimate
of its memory before a load has measured it (entrypoints/openai/model_pool.py).  A
model's files are the operator's; only these facts reach clients."""

from __future__ import annotations

import functools
import json
import logging
import os
import struct
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any

from pagedserve.model_loader.gguf_utils import open_gguf
from pagedserve.model_loader.sources import MODEL_NAMES, cache_dir, hf_hub_snapshot
from pagedserve.models.registry import check_config_file, names_vision_model

MAX_HEADER_BYTES = 64 << 20  # a safetensors header larger than this is not read
# A model whose files cannot be dated (not fetched yet, unreadable) shows the server's start.
logger = logging.getLogger(__name__)
STARTED_AT = datetime.now(timezone.utc).isoformat().replace("+00:00", "Z")


@dataclass(frozen=True)
class ModelFacts:
    format: str  # "gguf" or "safetensors"
    family: str
    parameter_count: int
    quantization: str
    context_length: int
    size: int  # bytes of weights on disk
    modified_at: str
    chat_template: str
    vision: bool = False  # a vision-language checkpoint (the engine's rule: models/registry.names_vision_model)

    def details(self) -> dict[str, Any]:
        return {"parent_model": "", "format": self.format, "family": self.family, "families": [self.family],
                "parameter_size": _human(self.parameter_count), "quantization_level": self.quantization}

    def model_info(self) -> dict[str, Any]:
        return {"general.architecture": self.family, "general.parameter_count": self.parameter_count,
                f"{self.family}.context_length": self.context_length}


def _human(n: int) -> str:
    if n <= 0:
        return "unknown"
    for unit, size in (("B", 10**9), ("M", 10**6), ("K", 10**3)):
        if n >= size:
            return f"{n / size:.2f}".rstrip("0").rstrip(".") + unit
    return str(n)


def _safetensors_params(path: str) -> tuple[int, str]:
    """(parameter count, the dtype most weights have) from a .safetensors header."""
    with open(path, "rb") as f:
        (size,) = struct.unpack("<Q", f.read(8))
        if size > MAX_HEADER_BYTES:
            return 0, "unknown"
        header = json.loads(f.read(size))
    count, dtypes = 0, {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        n = 1
        for d in entry.get("shape", []):
            n *= d
        count += n
        dtypes[entry.get("dtype", "?")] = dtypes.get(entry.get("dtype", "?"), 0) + n
    return count, max(dtypes, key=dtypes.get) if dtypes else "unknown"


def _gguf_facts(path: str) -> tuple[str, int, str, int, str]:
    """(architecture, parameter count, file type, context length, chat template) of a GGUF file, read
    with the loader's own reader (gguf's GGUFReader decodes the whole embedded vocabulary:
    3 s of a server's start-up for SmolLM2's 49,152 tokens, on the event loop)."""
    from gguf import LlamaFileType

    reader = open_gguf(path)
    meta = reader.metadata
    arch = str(meta.get("general.architecture") or "unknown")
    count = sum(t.n_elements for t in reader.tensors)
    try:  # the file's declared type, as Ollama shows it ("Q4_K_M"); else its commonest tensor type
        quant = LlamaFileType(int(meta["general.file_type"])).name.removeprefix("MOSTLY_")
    except (KeyError, TypeError, ValueError):
        kinds: dict[str, int] = {}
        for t in reader.tensors:
            kinds[t.tensor_type.name] = kinds.get(t.tensor_type.name, 0) + t.n_elements
        quant = max(kinds, key=kinds.get) if kinds else "unknown"
    template = meta.get("tokenizer.chat_template")  # (the one a chat request is rendered with)
    return arch, count, quant, int(meta.get(f"{arch}.context_length") or 0), template if isinstance(template, str) else ""


def _directory_facts(path: str) -> tuple[str, int, str, int, str, int, bool]:
    config: dict[str, Any] = {}
    if os.path.isfile(os.path.join(path, "config.json")):
        with open(os.path.join(path, "config.json")) as f:
            config = json.load(f)
    count, dtype, size = 0, "unknown", 0
    for name in sorted(os.listdir(path)):
        if name.endswith(".safetensors"):
            c, dtype = _safetensors_params(os.path.join(path, name))
            count += c
        if name.endswith((".safetensors", ".bin")):
            size += os.path.getsize(os.path.join(path, name))
    template = ""
    tok_config, jinja = os.path.join(path, "tokenizer_config.json"), os.path.join(path, "chat_template.jinja")
    if os.path.isfile(jinja):  # (transformers 5 saves the template beside the config)
        with open(jinja) as f:
            template = f.read()
    elif os.path.isfile(tok_config):
        with open(tok_config) as f:
            value = json.load(f).get("chat_template")
        template = value if isinstance(value, str) else ""
    family = str(config.get("model_type") or "unknown")
    text = config.get("text_config")  # (a vision-language model's language model: its context, as the engine reads it)
    ctx = (text.get("max_position_embeddings") if isinstance(text, dict) else None) or \
        config.get("max_position_embeddings")
    return family, count, dtype, int(ctx or 0), template, size, names_vision_model(path)


UNKNOWN = ModelFacts("unknown", "unknown", 0, "unknown", 0, 0, STARTED_AT, "")


@functools.lru_cache(maxsize=256)
def _facts(path: str, mtime_ns: int) -> ModelFacts:
    """A model's facts, or UNKNOWN where its files cannot be read as a model's (any
    error: the files are an operator's, possibly broken); cached either way, so that a
    hostile file is read once."""
    try:
        return _read_facts(path, mtime_ns)
    except Exception as e:  # noqa: BLE001 - a broken file's facts are unknown, whatever broke
        logger.warning("cannot read the model facts of %s (%s: %s)", path, type(e).__name__, str(e)[:200])
        return UNKNOWN


def _read_facts(path: str, mtime_ns: int) -> ModelFacts:
    modified = datetime.fromtimestamp(mtime_ns / 1e9, timezone.utc).isoformat().replace("+00:00", "Z")
    if os.path.isfile(path):
        arch, count, quant, ctx, template = _gguf_facts(path)
        return ModelFacts("gguf", arch, count, quant, ctx, os.path.getsize(path), modified, template)
    family, count, dtype, ctx, template, size, vision = _directory_facts(path)
    gguf = [f for f in os.listdir(path) if f.endswith(".gguf")]
    if gguf:  # a registered model's original: its type and size, as the format says (not the conversion's)
        quant, size = _gguf_facts(os.path.join(path, gguf[0]))[2], os.path.getsize(os.path.join(path, gguf[0]))
    else:
        quant = dtype
    return ModelFacts("gguf" if gguf else "safetensors", family, count, quant, ctx, size, modified, template, vision)


def weights_estimate(source: str) -> int:
    """The bytes a model's files say its weights take (the ModelPool's estimate before a
    load); a ValueError where they are on this disk but cannot be read as a model's, or
    name a family not served here, so that nothing is unloaded to make room for a load
    that cannot succeed."""
    facts = model_details(source)
    if facts is UNKNOWN and source not in MODEL_NAMES and os.path.exists(source):
        raise ValueError(f"the files of {source} cannot be read as a model's")
    if source not in MODEL_NAMES and os.path.isdir(source):  # a family not served here is a sure failure,
        check_config_file(source)  # which unloaded the other models first
    return facts.size


def model_details(source: str) -> ModelFacts:
    """The facts of the model `source` names (registered name, directory or GGUF file);
    a registered model not fetched yet shows its registered config alone."""
    path = source
    registered = MODEL_NAMES.get(source)
    if registered is not None:
        path = os.path.join(cache_dir(), "models", source)
        if not os.path.isdir(path):
            cfg = registered.hf_config
            return ModelFacts("gguf", str(cfg.get("model_type", "unknown")), 0, "unknown",
                              int(cfg.get("max_position_embeddings", 0)), 0, STARTED_AT, "")
    try:
        if not os.path.exists(path):
            path = hf_hub_snapshot(source)  # a Hub id in the local cache
        return _facts(path, os.stat(path).st_mtime_ns)
    except (OSError, ValueError, KeyError, RecursionError):  # unreadable (or nested past JSON's depth): the name alone
        return UNKNOWN
