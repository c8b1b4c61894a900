"""Tokenizers: from an HF directory, from a GGUF's embedded vocabulary, or none (dummy weights).

The chat template travels with the tokenizer (tokenizer_config / chat_template.jinja,
or the GGUF's `tokenizer.chat_template`); `model_config.chat_template` overrides it.
"""

from __future__ import annotations

import importlib.metadata
import json
import logging
import os
import shutil
from typing import Any

from pagedserve.config import ModelConfig
from pagedserve.model_loader.sources import cache_dir, file_cache_key, publish_cache_dir, resolve_source
from pagedserve.model_loader.tokenizer_snapshot import (
    CHECKED_FAST_TOKENIZERS,
    GENERIC_FAST_TOKENIZERS,
    cached_tokenizer,
)
from pagedserve.models.registry import snapshots_allowed

logger = logging.getLogger(__name__)

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def _has_tokenizer_files(path: str) -> bool:
    return os.path.isdir(path) and any(os.path.isfile(os.path.join(path, f)) for f in _TOKENIZER_FILES)


def load_tokenizer(model_config: ModelConfig) -> Any:
    """The HF tokenizer for the model (or for `model_config.tokenizer`), or None when there is none.

    Dummy-weight runs without a tokenizer take token-id prompts only.  A chat template
    override (`model_config.chat_template`: the template, or a path to a file holding it) is applied here.
    """
    explicit = model_config.tokenizer is not None
    name = model_config.tokenizer if explicit else model_config.model
    fmt = "auto" if explicit or model_config.load_format == "dummy" else model_config.load_format
    if not explicit and model_config.load_format == "dummy":
        local = os.path.abspath(os.path.expanduser(name))
        if not (os.path.isfile(local) or _has_tokenizer_files(local)):
            return None  # a registered config or a bare config directory: no tokenizer to load
    try:
        source = resolve_source(name, fmt)
    except ValueError as e:
        if not explicit:
            raise
        raise ValueError(f"tokenizer {name!r}: {e}") from None  # (it said "unknown model", naming the wrong flag)
    if source.registered is not None:  # registered names read the converted directory's tokenizer files
        source = resolve_source(name, "auto")
    if source.format == "gguf":
        tokenizer = gguf_tokenizer(source.path)
    elif source.registered is not None:
        tokenizer = saved_tokenizer(source.path)
    elif not _has_tokenizer_files(source.path):
        if explicit:
            raise ValueError(f"no tokenizer files ({', '.join(_TOKENIZER_FILES)}) in {source.path}")
        logger.warning("no tokenizer files in %s: only token-id prompts will work", source.path)
        return None
    else:
        try:
            if snapshot_candidate(source.path, model_config.trust_remote_code):
                # As a registered model's: the next start reads the snapshot, without transformers.
                tokenizer = saved_tokenizer(source.path)
            else:
                from transformers import AutoTokenizer

                tokenizer = AutoTokenizer.from_pretrained(source.path,
                                                          trust_remote_code=model_config.trust_remote_code)
        except Exception as e:
            raise ValueError(f"{source.path}: cannot load the tokenizer ({type(e).__name__}: {e})") from None
    if model_config.chat_template is not None:
        template = model_config.chat_template
        if os.path.isfile(template):
            with open(template) as f:
                template = f.read()
        tokenizer.chat_template = template
    return tokenizer


def load_chat_prompts(model: str, conversations: list[list[dict[str, str]]]) -> list[str]:
    """Each conversation rendered with the model's chat template, ready for generation."""
    tokenizer = load_tokenizer(ModelConfig(model=model))
    if tokenizer is None or not getattr(tokenizer, "chat_template", None):
        raise ValueError(f"model {model!r} has no tokenizer with a chat template")
    return [tokenizer.apply_chat_template(c, add_generation_prompt=True, tokenize=False) for c in conversations]


def snapshot_candidate(path: str, trust_remote_code: bool) -> bool:
    """An HF directory whose tokenizer may come from a snapshot: one with a
    tokenizer_config.json that models/registry.snapshots_allowed admits."""
    return os.path.isfile(os.path.join(path, "tokenizer_config.json")) and snapshots_allowed(path, trust_remote_code)


def saved_tokenizer(path: str) -> Any:
    """A tokenizer directory pagedserve wrote (a registered model's conversion, a GGUF's
    saved tokenizer), or an HF directory that snapshot_candidate admits.  A plain fast
    tokenizer comes from its snapshot when an earlier start saved one
    (tokenizer_snapshot.py: no transformers import), else by its class: never through
    AutoTokenizer, which would first import the model's config class to look for
    a tokenizer class there, ~1.1 s of start-up (model_loader/config_snapshot.py says why
    it costs that)."""
    with open(os.path.join(path, "tokenizer_config.json")) as f:
        named = json.load(f).get("tokenizer_class")
    if named in GENERIC_FAST_TOKENIZERS or named in CHECKED_FAST_TOKENIZERS:
        return cached_tokenizer(path, named)
    from transformers import AutoTokenizer

    # (snapshots are taken only without remote code; unsaid, transformers asks on stdin
    # whether to run a tokenizer_config.json's auto_map code, and runs it on "y")
    return AutoTokenizer.from_pretrained(path, trust_remote_code=False)


# How a GGUF's tokenizer is converted, in its cache key: 2, the file read apart from its
# folder's own tokenizer files (the first conversions beside such files lost its chat template).
GGUF_TOKENIZER_SCHEME = "2"


def gguf_tokenizer(path: str) -> Any:
    """The GGUF's embedded tokenizer, converted by transformers once per file: building a
    tokenizer from a large GGUF vocabulary takes seconds (9-11 s for Gemma 3's 262k
    tokens, real Zen 3), so the conversion is saved under the cache (as a registered
    model's conversion is) and later starts load it from there.  The key is the file's
    path, size and modification time, and the transformers version that converted it."""
    from pagedserve.model_loader.gguf_utils import load_gguf_tokenizer

    saved = os.path.join(cache_dir(), "tokenizers", file_cache_key(path, importlib.metadata.version("transformers"),
                                                                   GGUF_TOKENIZER_SCHEME))
    if os.path.isdir(saved):
        try:
            return saved_tokenizer(saved)
        except Exception as e:  # noqa: BLE001 - a damaged copy: convert again below
            logger.warning("cannot load the saved tokenizer %s (%s: %s); converting the GGUF's again",
                           saved, type(e).__name__, e)
            shutil.rmtree(saved, ignore_errors=True)
    tokenizer = load_gguf_tokenizer(path)
    try:
        publish_cache_dir(saved, tokenizer.save_pretrained)
    except OSError as e:  # an unwritable cache costs the next start the conversion, nothing else
        logger.warning("cannot save the converted tokenizer under %s (%s)", saved, e)
        return tokenizer
    return saved_tokenizer(saved)  # what later starts load (a snapshot, where one fits)
