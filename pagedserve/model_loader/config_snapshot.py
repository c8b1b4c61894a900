"""A model's transformers config, saved once as the attribute values it has and read back
without transformers' config classes.

Why: importing a transformers config class (LlamaConfig and the rest, transformers 5)
imports its validators, which import activations, kernel hubs, the weight-conversion
machinery and torch.distributed.tensor: ~1.1 s and ~30-60 MB of every start (Zen 4), for
a handful of numbers.  The model code only reads attributes of the config (it calls none
of its methods), so for the files start-up reads again and again (registered models'
converted directories, GGUF files, and the HF directories that
models/registry.snapshots_allowed admits) the first start builds the config with
transformers as before and saves every public attribute's value (properties and aliases
included); every start, the first too, gets a `ConfigSnapshot` holding those values.  The
key is the source file's identity, the transformers version and the source of the code that derived the
config (`cached_config`), so a change to any of them builds it again.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import logging
import os
from collections.abc import Callable
from typing import Any

import torch

from pagedserve.model_loader.sources import cache_dir, content_cache_key, file_cache_key, publish_cache_json

logger = logging.getLogger(__name__)


class ConfigSnapshot:
    """The public attributes of a transformers config, as plain values (nested configs as
    snapshots of their own).  A missing attribute raises AttributeError, as on the config;
    one the config has but whose value could not be saved (library internals such as
    views and class tables) raises LookupError, so that no `getattr(config, name, default)`
    quietly takes the default where the config had a value."""

    def __init__(self, values: dict[str, Any], unsaved: list[str] | tuple[str, ...] = ()) -> None:
        self.__dict__.update(values)
        self.__dict__[_UNSAVED] = frozenset(unsaved)

    def __getattr__(self, name: str) -> Any:  # only for names not in __dict__
        if name != _UNSAVED and name in self.__dict__.get(_UNSAVED, ()):
            raise LookupError(f"the model config's {name!r} was not saved (config_snapshot.py); "
                              "delete the cache's configs/ directory after adding its type to _encode")
        raise AttributeError(name)

    def saved_attributes(self) -> dict[str, Any]:
        """The saved attributes by name."""
        return {k: v for k, v in self.__dict__.items() if k != _UNSAVED}

    def __repr__(self) -> str:
        return f"ConfigSnapshot(model_type={self.__dict__.get('model_type')!r})"


_UNSAVED = "_unsaved_attributes"


def _encode(value: Any) -> Any:
    """`value` as JSON, every container tagged so that `_decode` gives back the same
    types (tuples, non-string keys, dtypes, nested configs); TypeError when it cannot."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, torch.dtype):
        return {"dtype": str(value).removeprefix("torch.")}
    if type(value) in (list, tuple, set, frozenset):
        return {type(value).__name__: [_encode(v) for v in value]}
    if type(value) is dict:
        return {"items": [[_encode(k), _encode(v)] for k, v in value.items()]}
    if hasattr(value, "to_dict") and hasattr(value, "model_type"):  # a nested PretrainedConfig
        values, unsaved = snapshot_values(value)
        return {"config": {"values": values, "unsaved": unsaved}}
    raise TypeError(f"cannot save a {type(value).__name__}")


def _decode(value: Any) -> Any:
    if not isinstance(value, dict):
        return value
    (tag, body), = value.items()
    if tag == "dtype":
        return getattr(torch, body)
    if tag in _SEQUENCES:
        return _SEQUENCES[tag](_decode(v) for v in body)
    if tag == "items":
        return {_decode(k): _decode(v) for k, v in body}
    if tag == "config":
        return _snapshot(body)
    raise ValueError(f"unknown tag {tag!r}")


_SEQUENCES: dict[str, Any] = {"list": list, "tuple": tuple, "set": set, "frozenset": frozenset}


def _snapshot(saved: dict[str, Any]) -> ConfigSnapshot:
    return ConfigSnapshot({k: _decode(v) for k, v in saved["values"].items()}, saved["unsaved"])


def snapshot_values(config: Any) -> tuple[dict[str, Any], list[str]]:
    """Every public non-callable attribute of `config` (what `dir` lists: fields,
    properties, aliases), encoded, and the names of those whose value cannot be."""
    values: dict[str, Any] = {}
    unsaved: list[str] = []
    quiet = logging.getLogger("transformers")  # reading its deprecated aliases warns
    level = quiet.level
    quiet.setLevel(logging.ERROR)
    try:
        for name in dir(config):
            _read(config, name, values, unsaved)
    finally:
        quiet.setLevel(level)
    return values, unsaved


def _read(config: Any, name: str, values: dict[str, Any], unsaved: list[str]) -> None:
    """Add attribute `name` of `config` to `values` (encoded) or to `unsaved`, unless it is
    private, a method, or a property that raises for this config."""
    if name.startswith("_"):
        return
    try:
        value = getattr(config, name)
    except Exception:  # noqa: BLE001 - a property that does not apply to this config
        return
    if callable(value):
        return
    try:
        values[name] = _encode(value)
    except TypeError:
        unsaved.append(name)


def _same(back: Any, original: Any) -> bool:
    """Whether a value read back from its saved form is the original: same types all the
    way down (a str enum saved as its string would not be)."""
    if isinstance(back, ConfigSnapshot):
        return all(_same(v, getattr(original, k, None)) for k, v in back.saved_attributes().items())
    if type(back) in (list, tuple):
        return (type(back) is type(original) and len(back) == len(original)
                and all(_same(a, b) for a, b in zip(back, original, strict=True)))
    if type(back) is dict:
        return (type(original) is dict and list(back) == list(original)
                and all(_same(k, o) and _same(back[k], original[o]) for k, o in zip(back, original, strict=True)))
    return type(back) is type(original) and (back == original or (back != back and original != original))


def cached_config(source_file: str, build: Callable[[], Any], derived_by: str | None = None,
                  directory: str | None = None) -> Any:
    """The config of the model at `source_file` as a snapshot: the one an earlier start
    saved for the file as it is now, else `build()`'s (transformers), saved for the next
    start.  Every start gets a snapshot, so the first runs what later ones run (the
    compiled model's key, for one, records the config's class); only a config whose
    attributes do not all read back the same is returned as transformers built it.
    `derived_by`: the path of the module whose code turns the file into the config beyond
    transformers' own (its source is part of the key).

    `directory`: `source_file` is that HF directory's config.json, from which transformers
    derives the config alone: the snapshot is then keyed by the file's bytes, not its
    path, so a copied or moved model directory (and each test's fresh one, which cost a
    server 1.4 s of transformers import here) reads it, and the cache does not grow by a
    file per path; its `name_or_path` is `directory`'s, as transformers would set it.  A
    GGUF file, large, is keyed by path, size and modification time."""
    code = ""
    if derived_by is not None:
        with open(derived_by, "rb") as f:
            code = hashlib.sha256(f.read()).hexdigest()
    keyed = content_cache_key if directory is not None else file_cache_key
    key = keyed(source_file, importlib.metadata.version("transformers"), code)
    path = os.path.join(cache_dir(), "configs", f"{key}.json")
    try:
        with open(path) as f:
            snapshot = _snapshot(json.load(f))
        if directory is not None and "name_or_path" in snapshot.__dict__:
            snapshot.__dict__["name_or_path"] = directory  # (the copy it was saved from may be elsewhere)
        return snapshot
    except FileNotFoundError:
        pass
    except (OSError, ValueError, TypeError) as e:  # a torn or foreign file: build it again
        logger.warning("cannot read the saved model config %s (%s: %s); reading the model's again",
                       path, type(e).__name__, e)
    config = build()
    values, unsaved = snapshot_values(config)
    saved = {"values": values, "unsaved": unsaved}
    snapshot = _snapshot(json.loads(json.dumps(saved)))
    wrong = [k for k, v in snapshot.saved_attributes().items() if not _same(v, getattr(config, k))]
    if wrong:
        logger.info("model config of %s not saved for later starts (%s do not read back the same)",
                    source_file, ", ".join(wrong))
        return config
    publish_cache_json(path, saved, "model config")
    return snapshot
