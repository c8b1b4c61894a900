"""The environment variables that set defaults, read in one place (vLLM's envs.py idea),
each with vLLM's own name beside ours where vLLM has one: a deployment moved from vLLM
keeps its settings (its API key above all: an unread VLLM_API_KEY left a server open).
Ours wins where both are set."""

from __future__ import annotations

import os

from pagedserve.utils import parse_bytes


def _first(*names: str) -> tuple[str, str] | None:
    """(name, value) of the first of `names` set to something other than blanks."""
    for name in names:
        value = os.environ.get(name, "").strip()
        if value:
            return name, value
    return None


def api_key() -> tuple[str, str] | None:
    """($PAGEDSERVE_API_KEY, else $VLLM_API_KEY) and its name; an empty variable is none (one
    of blanks is a key, which the server refuses by name: a typo, not "no key")."""
    for name in ("PAGEDSERVE_API_KEY", "VLLM_API_KEY"):
        if os.environ.get(name):
            return name, os.environ[name]
    return None


def cpu_kv_cache_space() -> int | None:
    """The CPU KV cache's budget in bytes when kv_cache_memory_bytes is unset, in place of a
    share of available memory: $PAGEDSERVE_CPU_KV_CACHE_SPACE ("2GiB"; the test suite sets
    1 GiB), else vLLM's $VLLM_CPU_KVCACHE_SPACE (GiB as a number; 0 is vLLM's "unset")."""
    found = _first("PAGEDSERVE_CPU_KV_CACHE_SPACE", "VLLM_CPU_KVCACHE_SPACE")
    if found is None:
        return None
    name, value = found
    if name == "PAGEDSERVE_CPU_KV_CACHE_SPACE":
        return parse_bytes(value, name)
    try:
        gib = float(value)
    except ValueError:
        raise ValueError(f"{name} must be a number of GiB, got {value!r:.40}") from None
    if not 0 <= gib < 2**20:
        raise ValueError(f"{name} must be a number of GiB >= 0, got {value!r:.40}")
    return int(gib * 2**30) or None


def torch_compile() -> bool | None:
    """$PAGEDSERVE_TORCH_COMPILE as the default of torch_compile (the test suite sets 0:
    compiles cost minutes)."""
    return _switch("PAGEDSERVE_TORCH_COMPILE")


def fused_kernels() -> bool | None:
    """$PAGEDSERVE_FUSED_KERNELS: 0 runs the torch elementwise ops instead of the fused
    kernels, to measure what they buy (only "0" was read: "off" left them on, unsaid)."""
    return _switch("PAGEDSERVE_FUSED_KERNELS")


def _switch(name: str) -> bool | None:
    """An on/off variable: 1/true/yes/on, 0/false/no/off, unset or blank None, else refused."""
    value = os.environ.get(name, "").strip().lower()
    if not value:
        return None
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"{name} must be 0 or 1, got {value!r}")
