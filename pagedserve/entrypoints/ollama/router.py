"""Ollama's native API on the server's port: /api/chat, /api/generate, /api/embed (and
the older /api/embeddings), /api/tags, /api/ps, /api/show, /api/version.  Generation
and embeddings are translations onto the OpenAI handlers (serving.py); the model list
and details come from the server's model pool.  /api/pull, /api/push, /api/create,
/api/copy and /api/delete answer with an error that says how models are added here.
Errors take Ollama's shape, {"error": "..."} (http_utils.error_response)."""

from __future__ import annotations

import asyncio
import hashlib
from datetime import datetime, timedelta, timezone
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

import pagedserve
from pagedserve.entrypoints.ollama.protocol import (
    OllamaChatRequest,
    OllamaEmbeddingsRequest,
    OllamaEmbedRequest,
    OllamaGenerateRequest,
    OllamaShowRequest,
)
from pagedserve.entrypoints.ollama.serving import (
    OllamaEmbedding,
    OllamaServing,
    Timing,
    check_request,
    now_iso,
)
from pagedserve.entrypoints.openai.http_utils import NDJSONResponse, route_path
from pagedserve.entrypoints.openai.model_pool import ServedModel
from pagedserve.entrypoints.openai.routers.generation import generate
from pagedserve.entrypoints.openai.server_state import ModelHandlers, ServerState, ServerStateDep
from pagedserve.entrypoints.openai.serving_engine import OpenAIError
from pagedserve.lora.request import LoRARequest
from pagedserve.model_loader.model_facts import UNKNOWN, model_details

router = APIRouter()

NOT_HERE = ("this server does not download, create or change models: it serves the ones given on its command line "
            "(`pagedserve serve MODEL [MODEL ...]`, registered names, HF directories, GGUF files) and in "
            "--models-dir, loading each on first use")


def _ollama(model: ModelHandlers, timing: Timing) -> OllamaServing:
    return OllamaServing(model.chat, model.completion, timing)


@router.post("/api/chat")
async def chat(body: OllamaChatRequest, request: Request, state: ServerStateDep) -> Response:
    timing = Timing()
    state.check_up()
    check_request(body, splits_reasoning=state.splits_reasoning)  # (before the model is leased)
    if not body.messages:  # Ollama: an empty chat loads (or, with keep_alive 0, unloads) the model
        return await _load_only(state, request, body.model, body.keep_alive_seconds(), chat=True)
    return await generate(state, lambda model: _ollama(model, timing), body, request,
                          keep_alive=body.keep_alive_seconds(), chat="messages", stream_class=NDJSONResponse)


@router.post("/api/generate")
async def generate_route(body: OllamaGenerateRequest, request: Request, state: ServerStateDep) -> Response:
    timing = Timing()
    state.check_up()  # (before the model is leased, as Ollama parses options before scheduling)
    check_request(body, await state.has_chat_template(state.model_for(body.model)), state.splits_reasoning)
    if not body.prompt:  # (as Ollama: raw or not, an empty prompt loads or unloads)
        return await _load_only(state, request, body.model, body.keep_alive_seconds(), chat=False)
    return await generate(state, lambda model: _ollama(model, timing), body, request,
                          keep_alive=body.keep_alive_seconds(), stream_class=NDJSONResponse)


async def _load_only(state: ServerState, request: Request, model: str, keep_alive: Any, chat: bool) -> JSONResponse:
    """A request with nothing to generate: load the model, or unload it with keep_alive 0
    (a model not loaded stays so)."""
    unloading = keep_alive == 0
    if unloading:
        state.check_up()
        await state.models.unload(state.model_for(model), asked=True)
    else:
        (await state.lease(model, "generate", "/api/chat" if chat else "/api/generate", keep_alive,
                           client=request)).release()
    body: dict[str, Any] = {"model": model, "created_at": now_iso(), "done": True,
                            "done_reason": "unload" if unloading else "load"}
    body.update({"message": {"role": "assistant", "content": ""}} if chat else {"response": ""})
    return JSONResponse(body)


@router.post("/api/embed")
async def embed(body: OllamaEmbedRequest, request: Request, state: ServerStateDep) -> Response:
    return await _embed(body, request, state, {"model": body.model, "embeddings": []})


@router.post("/api/embeddings")
async def embeddings(body: OllamaEmbeddingsRequest, request: Request, state: ServerStateDep) -> Response:
    return await _embed(body, request, state, {"embedding": []})


async def _embed(body: OllamaEmbedRequest | OllamaEmbeddingsRequest, request: Request, state: ServerState,
                 nothing: dict[str, Any]) -> Response:
    """Embeddings; an empty input only loads the model (Ollama's preload) and answers `nothing`."""
    timing = Timing()
    body.check_options()
    if body.empty():
        (await state.lease(body.model, "pooling", route_path(request.scope), body.keep_alive_seconds(),
                           client=request)).release()
        return JSONResponse(nothing)
    return await generate(state, lambda model: OllamaEmbedding(model.embedding, timing), body, request,
                          runner="pooling", keep_alive=body.keep_alive_seconds())


def _digest(model: ServedModel[Any]) -> str:
    return hashlib.sha256(f"{model.spec.name}\0{model.spec.source}".encode()).hexdigest()


def _listing(model: ServedModel[Any]) -> dict[str, Any]:
    info = model_details(model.spec.source)
    return {"name": model.spec.name, "model": model.spec.name, "modified_at": info.modified_at,
            "size": info.size, "digest": _digest(model), "details": info.details()}


def _adapter_listing(base: dict[str, Any], lora: LoRARequest) -> dict[str, Any]:
    """A LoRA adapter as Ollama lists a model made FROM its base with an ADAPTER: the
    base's listing (`base`), the base named its parent (the adapter's path is the server's)."""
    return {**base, "name": lora.lora_name, "model": lora.lora_name,
            "digest": hashlib.sha256(f"{lora.lora_name}\0{lora.lora_path}".encode()).hexdigest(),
            "details": {**base["details"], "parent_model": lora.base_model_name or base["name"]}}


def _all_listings(state: ServerState) -> list[dict[str, Any]]:
    """Every model's listing under each of its names (--served-model-name's aliases too, as
    /v1/models), then every adapter's over its base's (adapters serve beside the one model:
    ServerState.model_for)."""
    listings = {name: _listing(m) for name, m in state.models.models.items()}
    adapters = list(state.lora_adapters.loras.values())
    base = listings[state.model_for(adapters[0].lora_name)] if adapters else None
    named = [{**listings[name], "name": alias, "model": alias}
             for name, m in state.models.models.items() for alias in (name, *m.spec.aliases)]
    return [*named, *(_adapter_listing(base, lora) for lora in adapters if base is not None)]


@router.api_route("/api/tags", methods=["GET", "HEAD"])
async def tags(state: ServerStateDep) -> dict:
    """Every servable model, loaded or not, and every LoRA adapter (as /v1/models lists them)."""
    state.check_up()  # (the files' facts are read off the event loop: a broken file is slow to read)
    return {"models": await asyncio.to_thread(_all_listings, state)}


@router.api_route("/api/ps", methods=["GET", "HEAD"])
async def ps(state: ServerStateDep) -> dict:
    """The loaded models, their memory and when they unload."""
    state.check_up()
    out = []
    for model, handlers in state.models.loaded():
        listing = await asyncio.to_thread(_listing, model)
        ttl = state.models.expires_at_wall(model)
        expires = (datetime.now(timezone.utc) + timedelta(days=3650)) if ttl is None else \
            datetime.fromtimestamp(ttl, timezone.utc)
        size = model.footprint_bytes
        out.append({**listing, "size": size, "size_vram": size if handlers.engine_on_gpu else 0,
                    "expires_at": expires.isoformat().replace("+00:00", "Z"),
                    "context_length": handlers.max_model_len})
    return {"models": out}


@router.post("/api/show")
async def show(body: OllamaShowRequest, state: ServerStateDep) -> dict:
    """A model's details, architecture facts and chat template (read from its files;
    the model is not loaded for this)."""
    state.check_up()
    name = body.model_name()
    resolved = state.models.resolve(name)
    adapter = state.lora_adapters.loras.get(name) if resolved is None else None  # (its base's facts)
    if resolved is None and adapter is None:
        raise OpenAIError(f"model '{name[:200]}' not found", status=404, param="model")
    model = state.models.models[state.model_for(name)]
    info = await asyncio.to_thread(model_details, model.spec.source)
    handlers = model.loaded
    # (tools and vision need a chat template to place them in: a base model only completes)
    chat = bool(info.chat_template)
    runner = handlers.engine.runner if handlers is not None else state.runner  # (the server's: loaded or not)
    # (thinking: Ollama's clients send `think` only to a model that lists it)
    thinks = state.splits_reasoning if state.splits_reasoning is not None else \
        handlers is not None and handlers.chat.reasoning_parser is not None
    capabilities = ["embedding"] if runner == "pooling" else \
        ["completion", *(["tools"] if chat else []), *(["vision"] if info.vision and chat else []),
         *(["thinking"] if thinks and chat else [])]
    if info is UNKNOWN:  # unreadable files: its name alone, no invented architecture or capability
        capabilities = []
    details = info.details()
    if adapter is not None:
        details["parent_model"] = adapter.base_model_name or model.spec.name
    return {"modelfile": f"# served by pagedserve\nFROM {model.spec.name}\n" + (f"ADAPTER {name}\n" if adapter else ""),
            "parameters": "", "template": info.chat_template, "details": details,
            "model_info": {} if info is UNKNOWN else info.model_info(),
            "capabilities": capabilities, "modified_at": info.modified_at}


@router.api_route("/", methods=["GET", "HEAD"], include_in_schema=False)
async def up() -> Response:
    """Ollama's clients check a server with HEAD / (Ollama answers "Ollama is running").
    The dashboard's page takes / first where it is on (its router is included before)."""
    return Response("pagedserve is running", media_type="text/plain")


@router.api_route("/api/version", methods=["GET", "HEAD"])
async def version() -> dict:
    return {"version": pagedserve.__version__}


async def not_here(request: Request) -> Response:
    raise OpenAIError(f"{route_path(request.scope)} is not served: {NOT_HERE}", status=501, code="not_implemented")


for path, methods in (("/api/pull", ["POST"]), ("/api/push", ["POST"]), ("/api/create", ["POST"]),
                      ("/api/copy", ["POST"]), ("/api/delete", ["DELETE"]),
                      ("/api/blobs/{digest}", ["HEAD", "POST"])):
    router.add_api_route(path, not_here, methods=methods, include_in_schema=False)
