"""OpenAI's generation routes proper: POST /v1/completions and /v1/chat/completions
(the generate runner only; a pooling server names the flag that would serve them)."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import Response

from pagedserve.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest
from pagedserve.entrypoints.openai.routers.generation import generate
from pagedserve.entrypoints.openai.server_state import ServerStateDep

router = APIRouter()


@router.post("/v1/completions")
async def completions(body: CompletionRequest, request: Request, state: ServerStateDep) -> Response:
    return await generate(state, lambda model: model.completion, body, request)


@router.post("/v1/chat/completions")
async def chat_completions(body: ChatCompletionRequest, request: Request, state: ServerStateDep) -> Response:
    return await generate(state, lambda model: model.chat, body, request)
