"""The server's LoRA adapters: --lora-modules at start-up, loaded and unloaded at runtime.

A client picks an adapter by the request's `model` field; it never names a file.  Only
the operator does, on the command line or (with --allow-runtime-lora-updating, behind
the API key) through /v1/load_lora_adapter, as vLLM's VLLM_ALLOW_RUNTIME_LORA_UPDATING.
"""

from __future__ import annotations

import json
import logging
import os
import threading

from pagedserve.engine.protocol import EngineClient
from pagedserve.entrypoints.openai.model_pool import check_not_latest
from pagedserve.entrypoints.openai.serving_engine import OpenAIError
from pagedserve.lora.request import LoRARequest

logger = logging.getLogger("pagedserve")

# Adapters one server serves at most (names clients may use): each costs a dict entry
# here and in the engine, and its files are read when first used.
MAX_SERVED_LORAS = 1024
MAX_LORA_NAME_CHARS = 256
MAX_LORA_PATH_CHARS = 4096


def parse_lora_modules(items: list[str] | None, served_names: list[str]) -> dict[str, LoRARequest]:
    """`--lora-modules` values, vLLM's two forms: name=path, or a JSON object with name,
    path and optionally base_model_name.  Ids are 1, 2, ... in order.  ValueError names a
    malformed item, a duplicate name, or a name the base model is served under."""
    loras: dict[str, LoRARequest] = {}
    for item in items or []:
        base = None
        if item.lstrip().startswith("{"):
            try:
                spec = json.loads(item)
            except ValueError as e:
                raise ValueError(f"--lora-modules {item!r}: not valid JSON ({e})") from None
            if not isinstance(spec, dict) or not {"name", "path"} <= set(spec) or set(spec) - {
                    "name", "path", "base_model_name"}:
                raise ValueError(f"--lora-modules {item!r}: the JSON form takes name, path and optionally "
                                 "base_model_name")
            name, path, base = spec["name"], spec["path"], spec.get("base_model_name")
            check_base_model_name(base, served_names, f"--lora-modules {spec['name']!r:.300}: ")
        else:
            name, sep, path = item.partition("=")
            if not sep or not name or not path:
                raise ValueError(f"--lora-modules {item!r}: expected name=path or a JSON object")
        check_new_name(name, served_names, loras)
        if not isinstance(path, str) or not os.path.isdir(os.path.expanduser(path)):  # (found after the model loaded)
            raise ValueError(f"--lora-modules {name}: {path!r:.300} is not a directory (a PEFT adapter's)")
        loras[name] = LoRARequest(name, len(loras) + 1, path, base)
    return loras


def check_base_model_name(base: object, served_names: list[str], where: str = "") -> None:
    """An adapter's `base_model_name`, where given, is a name its base model is served under
    (the one model a server with adapters serves: any of its names).  /v1/models and Ollama's
    listings show it as the adapter's parent, which a client then asks for: a name served
    nowhere (vLLM passes it through) sent clients to a 404."""
    if base is not None and base not in served_names:
        raise ValueError(f"{where}base_model_name {base!r:.300} is not a name the base model is served under "
                         f"({', '.join(map(repr, served_names))})")


def check_new_name(name: object, served_names: list[str], loras: dict[str, LoRARequest],
                   replace: bool = False) -> None:
    """`name` may be given to a new adapter (`replace`: or to one replacing its namesake)."""
    if not isinstance(name, str) or not name or len(name) > MAX_LORA_NAME_CHARS:
        raise ValueError(f"a LoRA adapter's name must be 1 to {MAX_LORA_NAME_CHARS} characters, got {name!r:.300}")
    if not name.isprintable() or name != name.strip():
        raise ValueError(f"a LoRA adapter's name may not hold control characters or surrounding spaces, got {name!r}")
    check_not_latest(name, "LoRA adapter name")
    if name in served_names:
        raise ValueError(f"LoRA adapter name {name!r} is the base model's served name")
    if name in loras:
        if replace:
            return
        raise ValueError(f"a LoRA adapter named {name!r} is already loaded (load_inplace: true replaces it)")
    if len(loras) >= MAX_SERVED_LORAS:
        raise ValueError(f"this server already serves {MAX_SERVED_LORAS} LoRA adapters; unload one first")


class LoRAAdapters:
    """The served adapters by name (the dict the serving classes read), and the runtime
    load/unload that change it."""

    def __init__(self, loras: dict[str, LoRARequest] | None = None, allow_runtime_updating: bool = False) -> None:
        self.loras = loras if loras is not None else {}
        self.allow_runtime_updating = allow_runtime_updating
        self._next_id = max((r.lora_int_id for r in self.loras.values()), default=0) + 1
        self._lock = threading.Lock()

    def check_allowed(self) -> None:
        """The runtime routes answer 404 unless the server allows them (vLLM registers
        no such route then), whatever their body."""
        if not self.allow_runtime_updating:
            raise OpenAIError("loading and unloading LoRA adapters at runtime is off; start the server with "
                              "--allow-runtime-lora-updating", status=404, code="runtime_lora_updating_disabled")

    async def load(self, engine: EngineClient, served_names: list[str], name: object, path: object,
                   replace: bool = False, base: object = None) -> str:
        """Load the adapter at `path` as `name` (`replace`: in place of one so named);
        `base`: the base model's name its listings show as its parent."""
        self.check_allowed()
        try:
            check_base_model_name(base, served_names)
        except ValueError as e:
            raise OpenAIError(str(e), param="base_model_name") from None
        if not isinstance(path, str) or not path or len(path) > MAX_LORA_PATH_CHARS:
            raise OpenAIError(f"lora_path must be a directory path of 1 to {MAX_LORA_PATH_CHARS} characters",
                              param="lora_path")
        with self._lock:
            try:
                check_new_name(name, served_names, self.loras, replace)
            except ValueError as e:
                raise OpenAIError(str(e), param="lora_name") from None
            assert isinstance(name, str)
            request = LoRARequest(name, self._next_id, path, base)  # type: ignore[arg-type]
            self._next_id += 1
        try:
            await engine.add_lora(request)
        except ValueError as e:
            raise OpenAIError(f"LoRA adapter {name!r} could not be loaded: {e}", param="lora_path") from None
        with self._lock:
            old = self.loras.get(name)
            lost = old is not None and not replace  # loaded twice at once: the first to finish keeps the name
            if not lost:
                self.loras[name] = request
        if lost:
            await engine.remove_lora(request.lora_int_id)  # (no name leads to this copy: not kept in the engine)
            raise OpenAIError(f"a LoRA adapter named {name!r} is already loaded", param="lora_name")
        if old is not None:
            await engine.remove_lora(old.lora_int_id)  # (requests running with it finish with it)
        logger.info("LoRA adapter %r loaded from %s (id %d%s)", name, path, request.lora_int_id,
                    ", in place of the one so named" if old is not None else "")
        return f"Success: LoRA adapter '{name}' added successfully."

    async def unload(self, engine: EngineClient, name: object, lora_int_id: int | None = None) -> str:
        """Unload the adapter `name` (`lora_int_id`, vLLM's, when given, must be its id)."""
        self.check_allowed()
        with self._lock:
            request = self.loras.get(name) if isinstance(name, str) else None
            if request is not None and lora_int_id is not None and lora_int_id != request.lora_int_id:
                raise OpenAIError(f"LoRA adapter {name!r} has id {request.lora_int_id}, not {lora_int_id}",
                                  param="lora_int_id")
            if request is not None:
                del self.loras[name]
        if request is None:
            raise OpenAIError(f"no LoRA adapter named {name!r:.300} is loaded", status=404, param="lora_name",
                              code="model_not_found")
        await engine.remove_lora(request.lora_int_id)
        logger.info("LoRA adapter %r unloaded (id %d)", name, request.lora_int_id)
        return f"Success: LoRA adapter '{name}' removed successfully."
