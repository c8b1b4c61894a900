"""OpenAI's Responses API: POST /v1/responses (translated onto the chat handler by
serving_responses.py), and, with --enable-responses-store, GET and DELETE
/v1/responses/{id}, its input items, and its cancel (which can only say that a finished
response cannot be cancelled)."""

from __future__ import annotations

from typing import Literal

from fastapi import APIRouter, Query, Request
from fastapi.responses import JSONResponse, Response

from pagedserve.entrypoints.openai.protocol_responses import INCLUDE_WITHOUT_EFFECT, ResponsesRequest
from pagedserve.entrypoints.openai.routers.generation import generate
from pagedserve.entrypoints.openai.server_state import ServerState, ServerStateDep
from pagedserve.entrypoints.openai.serving_engine import OpenAIError
from pagedserve.entrypoints.openai.serving_responses import OpenAIServingResponses

router = APIRouter()


@router.post("/v1/responses")
async def responses(body: ResponsesRequest, request: Request, state: ServerStateDep) -> Response:
    """OpenAI's Responses API, translated onto the chat handler (serving_responses.py);
    an image in the conversation `previous_response_id` continues counts as the input's
    own (a text model is not loaded only to refuse it)."""
    store, previous = state.responses_store, body.previous_response_id
    images = "previous_response_id" if store is not None and previous and store.holds_image(previous) else None
    return await generate(state, lambda model: OpenAIServingResponses(model.chat, state.responses_store), body,
                          request, chat="input", images=images)


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


def check_query(request: Request, known: set[str]) -> None:
    """A GET's query parameters: `include` (the openai client sends `include[]`) takes the
    values POST accepts without effect (others refused, as there); any other parameter
    than `known` is refused by name, never ignored."""
    query = request.query_params
    included = query.getlist("include[]") + query.getlist("include")
    bad = [value for value in included if value not in INCLUDE_WITHOUT_EFFECT]
    if bad:
        raise OpenAIError(f"include value {bad[0][:100]!r} is not supported here (this server keeps no extra output "
                          f"to include; accepted without effect: {', '.join(INCLUDE_WITHOUT_EFFECT)})",
                          param="include")
    refused = sorted(set(query) - known - {"include", "include[]"})
    if refused:
        raise OpenAIError(f"unsupported query parameter(s) {', '.join(refused)[:200]}", param=refused[0][:100])


@router.api_route("/v1/responses/{response_id}", methods=["GET", "HEAD"])
async def get_response(response_id: str, request: Request, state: ServerStateDep) -> JSONResponse:
    if request.query_params.get("stream", "false").lower() != "false":
        raise OpenAIError("stream=true is not supported here: a stored response is returned whole (it finished "
                          "before it was stored)", param="stream")
    check_query(request, {"stream"})
    return JSONResponse(stored_response(state, response_id))


@router.delete("/v1/responses/{response_id}")
async def delete_response(response_id: str, state: ServerStateDep) -> JSONResponse:
    stored_response(state, response_id)
    assert state.responses_store is not None
    state.responses_store.delete(response_id)
    return JSONResponse({"id": response_id, "object": "response", "deleted": True})


@router.api_route("/v1/responses/{response_id}/input_items", methods=["GET", "HEAD"])
async def list_input_items(response_id: str, request: Request, state: ServerStateDep,
                           limit: int = Query(20, ge=1, le=100), order: Literal["asc", "desc"] = "desc",
                           after: str | None = None) -> JSONResponse:
    """A stored response's input items, OpenAI's list page (`after`: the id the page starts after)."""
    check_query(request, {"limit", "order", "after"})
    stored_response(state, response_id)
    assert state.responses_store is not None
    items = state.responses_store.input_items(response_id) or []
    if order == "desc":
        items = items[::-1]
    if after is not None:
        ids = [item["id"] for item in items]
        if after not in ids:
            raise OpenAIError(f"no input item {after[:100]!r} in this response", status=404, param="after")
        items = items[ids.index(after) + 1:]
    page = items[:limit]
    return JSONResponse({"object": "list", "data": page, "first_id": page[0]["id"] if page else None,
                         "last_id": page[-1]["id"] if page else None, "has_more": len(items) > limit})


@router.post("/v1/responses/{response_id}/cancel")
async def cancel_response(response_id: str, state: ServerStateDep) -> JSONResponse:
    stored_response(state, response_id)
    raise OpenAIError("only background responses can be cancelled, and this server runs none in the "
                      "background: this one has finished", param="response_id")
