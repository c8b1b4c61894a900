"""OpenAI's generation routes proper: POST /v1/completions and /v1/chat/completions
(the generate runner only; a pooling server names the flag that would serve them)."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import Response

from pagedserve.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest
from pagedserve.entrypoints.openai.protocol_fields import check_request_id
from pagedserve.entrypoints.openai.routers.generation import generate
from pagedserve.entrypoints.openai.server_state import ServerStateDep
from pagedserve.entrypoints.openai.serving_engine import OpenAIError
from pagedserve.errors import InvalidRequestError

router = APIRouter()


def _header_request_id(body: CompletionRequest | ChatCompletionRequest, request: Request) -> None:
    """vLLM's X-Request-Id: a request's header names its answer ("<kind>-<id>"), over the
    body's request_id as in vLLM (it was ignored: a proxy's trace id matched nothing here)."""
    header = request.headers.get("x-request-id")
    if header is not None:
        try:
            body.request_id = check_request_id(header)
        except InvalidRequestError as e:
            raise OpenAIError(f"the X-Request-Id header: {e}", param="X-Request-Id") from None


@router.post("/v1/completions")
async def completions(body: CompletionRequest, request: Request, state: ServerStateDep) -> Response:
    _header_request_id(body, request)
    return await generate(state, lambda model: model.completion, body, request)


@router.post("/v1/chat/completions")
async def chat_completions(body: ChatCompletionRequest, request: Request, state: ServerStateDep) -> Response:
    _header_request_id(body, request)
    return await generate(state, lambda model: model.chat, body, request, chat="messages" if body.chat_template is None else None)
