"""The server's own routes: /health (503 until the engine serves, for orchestrators),
/version, /metrics (Prometheus), /load (vLLM's), /start_profile and /stop_profile (vLLM's), and the models it serves (OpenAI's list and retrieve,
the base model's names and its LoRA adapters)."""

from __future__ import annotations

import asyncio
import datetime
import os
import time
from typing import Literal

from fastapi import APIRouter
from fastapi.responses import JSONResponse, Response
from pydantic import Field

import pagedserve
from pagedserve.entrypoints.openai.protocol import OpenAIBaseModel
from pagedserve.entrypoints.openai.server_state import ServerState, ServerStateDep
from pagedserve.entrypoints.openai.serving_engine import OpenAIError

router = APIRouter()


class ModelCard(OpenAIBaseModel):
    """One model of /v1/models (OpenAI's shape; root, parent and max_model_len are vLLM's)."""

    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "pagedserve"
    root: str | None = None
    parent: str | None = None  # a LoRA adapter's base model
    max_model_len: int | None = None


class ModelList(OpenAIBaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard] = Field(default_factory=list)


@router.api_route("/health", methods=["GET", "HEAD"])
async def health(state: ServerStateDep) -> Response:
    """200 once the engine serves, else 503 (HEAD too: load balancers probe with it)."""
    state.check_up()
    return Response(status_code=200)


@router.api_route("/ping", methods=["GET", "HEAD", "POST"])
async def ping(state: ServerStateDep) -> Response:
    """vLLM's (SageMaker's) liveness route: /health's answer."""
    return await health(state)


@router.api_route("/version", methods=["GET", "HEAD"])
async def version() -> dict:
    return {"version": pagedserve.__version__}


@router.api_route("/metrics", methods=["GET", "HEAD"])
async def metrics(state: ServerStateDep) -> Response:
    from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

    return Response(generate_latest(state.registry), media_type=CONTENT_TYPE_LATEST)


@router.api_route("/load", methods=["GET", "HEAD"])
async def load(state: ServerStateDep) -> dict:
    """vLLM's: the requests at work, with --enable-server-load-tracking."""
    if state.server_load is None:
        raise OpenAIError("/load needs the server started with --enable-server-load-tracking", status=404)
    return {"server_load": state.server_load}


@router.post("/start_profile")
async def start_profile(state: ServerStateDep) -> JSONResponse:
    """vLLM's: a torch profile of the engines starts (engine/profiler.py; at most
    PROFILE_SECONDS, then it stops itself)."""
    try:
        await asyncio.to_thread(state.profiler.start)
    except RuntimeError as e:  # off, or one running
        raise OpenAIError(str(e), status=404 if state.profiler.directory is None else 409) from None
    return JSONResponse({"status": "profiling"})


@router.post("/stop_profile")
async def stop_profile(state: ServerStateDep) -> JSONResponse:
    """The profile ends; its trace's file name in the server's trace directory."""
    try:
        path = await asyncio.to_thread(state.profiler.stop)
    except RuntimeError as e:
        raise OpenAIError(str(e), status=404 if state.profiler.directory is None else 409) from None
    return JSONResponse({"status": "stopped", "trace": os.path.basename(path)})


def model_card(state: ServerState, name: str) -> ModelCard:
    """A served name's card; an adapter's names its base model as parent.  A model not
    loaded shows the max_model_len its config and the server's flags give (files are
    read: call it off the event loop)."""
    base = state.model_for(name)
    handlers = state.models.handlers(base)
    max_model_len = state.models.expected_max_model_len(base) if handlers is None else handlers.max_model_len
    lora = state.lora_adapters.loras.get(name)
    if lora is not None:  # (its path on the server's disk is not the client's business)
        return ModelCard(id=name, root=name, parent=lora.base_model_name or base, max_model_len=max_model_len)
    return ModelCard(id=name, root=base, max_model_len=max_model_len)


def both_apis(card: ModelCard) -> dict:
    """A model as OpenAI's and Anthropic's clients both read it (the path is the same):
    OpenAI's card plus Anthropic's type, display_name and RFC 3339 created_at."""
    created = datetime.datetime.fromtimestamp(card.created, datetime.timezone.utc)
    return {**card.model_dump(), "type": "model", "display_name": card.id,
            "created_at": created.isoformat().replace("+00:00", "Z")}


@router.api_route("/v1/models", methods=["GET", "HEAD"])
async def models(state: ServerStateDep) -> JSONResponse:
    """Every servable model (loaded or not) and LoRA adapter; the list in both APIs'
    shapes (Anthropic's pages: has_more, first_id, last_id)."""
    state.check_up()
    names = [*state.models.names(), *state.lora_adapters.loras]
    data = await asyncio.to_thread(lambda: [both_apis(model_card(state, name)) for name in names])
    return JSONResponse({**ModelList().model_dump(exclude={"data"}), "data": data, "has_more": False,
                         "first_id": names[0] if names else None, "last_id": names[-1] if names else None})


@router.api_route("/v1/models/{model_id:path}", methods=["GET", "HEAD"])
async def model(model_id: str, state: ServerStateDep) -> JSONResponse:
    """OpenAI's retrieve (`client.models.retrieve`) and Anthropic's; ids may contain
    slashes (org/name)."""
    state.check_up()
    card = await asyncio.to_thread(model_card, state, model_id)  # (a 404 naming it when it is not served)
    return JSONResponse(both_apis(card))
