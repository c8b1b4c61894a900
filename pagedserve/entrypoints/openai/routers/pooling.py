"""The pooling routes (a server started with `--runner pooling`): OpenAI's
/v1/embeddings, and vLLM's score and rerank under each path vLLM serves them at (the
aliases stay out of the OpenAPI document)."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import Response

from pagedserve.entrypoints.openai.protocol_pooling import EmbeddingRequest, RerankRequest, ScoreRequest
from pagedserve.entrypoints.openai.routers.generation import generate
from pagedserve.entrypoints.openai.server_state import ServerStateDep

router = APIRouter()


@router.post("/v1/embeddings")
async def embeddings(body: EmbeddingRequest, request: Request, state: ServerStateDep) -> Response:
    return await generate(state, lambda model: model.embedding, body, request, runner="pooling")


async def score(body: ScoreRequest, request: Request, state: ServerStateDep) -> Response:
    return await generate(state, lambda model: model.score, body, request, runner="pooling")


async def rerank(body: RerankRequest, request: Request, state: ServerStateDep) -> Response:
    return await generate(state, lambda model: model.score, body, request, runner="pooling")


# vLLM's paths; the aliases stay out of the OpenAPI document (one entry per route).
router.add_api_route("/v1/score", score, methods=["POST"])
router.add_api_route("/score", score, methods=["POST"], include_in_schema=False)
router.add_api_route("/v1/rerank", rerank, methods=["POST"])
router.add_api_route("/rerank", rerank, methods=["POST"], include_in_schema=False)
router.add_api_route("/v2/rerank", rerank, methods=["POST"], include_in_schema=False)
