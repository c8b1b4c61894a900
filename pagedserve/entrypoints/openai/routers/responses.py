"""OpenAI's Responses API: POST /v1/responses (translated onto the chat handler by
serving_responses.py), and, with --enable-responses-store, GET /v1/responses/{id} and
its cancel (which can only say that a finished response cannot be cancelled)."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from pagedserve.entrypoints.openai.protocol_responses import ResponsesRequest
from pagedserve.entrypoints.openai.routers.generation import generate
from pagedserve.entrypoints.openai.server_state import ServerState, ServerStateDep
from pagedserve.entrypoints.openai.serving_engine import OpenAIError
from pagedserve.entrypoints.openai.serving_responses import OpenAIServingResponses

router = APIRouter()


@router.post("/v1/responses")
async def responses(body: ResponsesRequest, request: Request, state: ServerStateDep) -> Response:
    """OpenAI's Responses API, translated onto the chat handler (serving_responses.py)."""
    return await generate(state, lambda model: OpenAIServingResponses(model.chat, state.responses_store), body,
                          request)


def stored_response(state: ServerState, response_id: str) -> dict:
    """A kept response, or a 404 that says why there is none (no store, or not in it)."""
    state.check_up()
    if state.responses_store is None:
        raise OpenAIError("responses are not kept on this server (start it with --enable-responses-store)",
                          status=404, param="response_id")
    found = state.responses_store.get(response_id)
    if found is None:
        raise OpenAIError(f"no stored response {response_id[:100]!r}", status=404, param="response_id")
    return found[0]


@router.get("/v1/responses/{response_id}")
async def get_response(response_id: str, state: ServerStateDep) -> JSONResponse:
    return JSONResponse(stored_response(state, response_id))


@router.post("/v1/responses/{response_id}/cancel")
async def cancel_response(response_id: str, state: ServerStateDep) -> JSONResponse:
    stored_response(state, response_id)
    raise OpenAIError("only background responses can be cancelled, and this server runs none in the "
                      "background: this one has finished", param="response_id")
