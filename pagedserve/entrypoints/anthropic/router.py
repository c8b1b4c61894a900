"""Anthropic's Messages API: POST /v1/messages (translated onto the chat handler by
serving_messages.py) and /v1/messages/count_tokens.  Errors on these paths take
Anthropic's shape (http_utils.error_response, by ANTHROPIC_PATH_PREFIX)."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import Response

from pagedserve.entrypoints.anthropic.protocol import CountTokensRequest, MessagesRequest
from pagedserve.entrypoints.anthropic.serving_messages import AnthropicServingMessages
from pagedserve.entrypoints.openai.routers.generation import generate
from pagedserve.entrypoints.openai.server_state import ServerStateDep

router = APIRouter()


@router.post("/v1/messages")
async def messages(body: MessagesRequest, request: Request, state: ServerStateDep) -> Response:
    """Anthropic's Messages API, translated onto the chat handler (entrypoints/anthropic)."""
    return await generate(state, lambda model: AnthropicServingMessages(model.chat), body, request, chat="messages")


@router.post("/v1/messages/count_tokens")
async def count_tokens(body: CountTokensRequest, request: Request, state: ServerStateDep) -> dict:
    lease = await state.lease(body.model, chat="messages", client=request, images=body.image_field())
    try:
        serving = AnthropicServingMessages(lease.handlers.chat)
        serving.warn_unknown_fields(body)
        return {"input_tokens": await state.prepare.run(serving.count_tokens, body)}
    finally:
        lease.release()
