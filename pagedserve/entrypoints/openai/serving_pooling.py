"""POST /v1/embeddings, /v1/score and /v1/rerank: pooling requests on a server started
with `--runner pooling`.

Each input becomes one engine request with PoolingParams, through the same front end,
scheduler and prefix cache as generation (a prefill with no decode); the answers are
read once every input's request is done.  Scores come from the reranker's classifier
tokens when the server has them, else from the cosine of the two texts' embeddings
(entrypoints/score_utils.py), each distinct text embedded once.
"""

from __future__ import annotations

import base64
from dataclasses import dataclass, field
from typing import Any

from pagedserve.engine.async_llm import RequestStream
from pagedserve.entrypoints.openai.protocol import PromptTokensDetails, UsageInfo
from pagedserve.entrypoints.openai.protocol_pooling import (
    EmbeddingData,
    EmbeddingRequest,
    EmbeddingResponse,
    RerankDocument,
    RerankRequest,
    RerankResponse,
    RerankResult,
    ScoreData,
    ScoreRequest,
    ScoreResponse,
)
from pagedserve.entrypoints.openai.serving_engine import (
    OpenAIError,
    OpenAIServing,
    PreparedRequest,
    TokenizedPrompt,
    merge_streams,
)
from pagedserve.entrypoints.score_utils import cosine, reranker_prompt, score_pairs
from pagedserve.errors import InvalidRequestError
from pagedserve.outputs import PoolingRequestOutput
from pagedserve.pooling_params import PoolingParams
from pagedserve.request_limits import MAX_EMBEDDING_INPUTS, MAX_POOLING_REQUEST_TOKENS


@dataclass
class PreparedScores(PreparedRequest):
    """A score or rerank request: with embeddings, the (first, second) prompt indices of
    each pair (distinct texts are embedded once); with a reranker, one prompt per pair."""

    pairs: list[tuple[int, int]] | None = None
    documents: list[str] = field(default_factory=list)


class OpenAIServingPooling(OpenAIServing):
    """What the pooling routes share: inputs to prompts, and collecting the results."""

    def prompt(self, item: str | list[int], truncate: int | None, add_special_tokens: bool = True) -> TokenizedPrompt:
        """One input as a prompt, its tokens cut to the last `truncate` (vLLM's
        truncate_prompt_tokens; -1: the last max_model_len)."""
        if isinstance(item, str):
            if not item:
                raise OpenAIError("inputs must not be empty strings", param="input")
            return self.truncated(TokenizedPrompt(item, self.tokenize(item, add_special_tokens)), truncate)
        return self.truncated(TokenizedPrompt(None, list(item)), truncate)

    @staticmethod
    def check_total_tokens(prompts: list[TokenizedPrompt], param: str) -> list[TokenizedPrompt]:
        """`prompts`, when their tokens (after truncation) sum to at most MAX_POOLING_REQUEST_TOKENS."""
        total = sum(len(p.token_ids) for p in prompts)
        if total > MAX_POOLING_REQUEST_TOKENS:
            raise OpenAIError(f"this request's prompts hold {total} tokens in all; at most "
                              f"{MAX_POOLING_REQUEST_TOKENS} are allowed per request", param=param)
        return prompts

    @staticmethod
    async def collect(streams: list[RequestStream]) -> list[PoolingRequestOutput]:
        finals: list[Any] = [None] * len(streams)
        async for i, out in merge_streams(streams):
            finals[i] = out
        assert all(isinstance(o, PoolingRequestOutput) for o in finals)
        return finals

    @staticmethod
    def usage(outs: list[PoolingRequestOutput]) -> UsageInfo:
        prompt = sum(len(o.prompt_token_ids) for o in outs)
        return UsageInfo(prompt_tokens=prompt, total_tokens=prompt, prompt_tokens_details=PromptTokensDetails(
            cached_tokens=sum(o.num_cached_tokens for o in outs)))


class OpenAIServingEmbedding(OpenAIServingPooling):
    id_prefix = "embd"

    def prepare(self, req: EmbeddingRequest) -> PreparedRequest:
        model = self.model_name(req.model)
        value = req.input
        if isinstance(value, str) or (value and all(isinstance(t, int) for t in value)):
            items: list = [value]
        else:
            items = list(value)
        if not items or any(isinstance(t, list) and not t for t in items):
            raise OpenAIError("input must not be empty", param="input")
        self.check_fanout(len(items), 1, "input", MAX_EMBEDDING_INPUTS)  # before tokenizing any of them
        # (checked by the engine when it accepts them: a bad field is a 400 naming it, before any output)
        params = PoolingParams(dimensions=req.dimensions, normalize=req.normalize)
        prompts = [self.prompt(t, req.truncate_prompt_tokens, req.add_special_tokens) for t in items]
        return PreparedRequest(model, self.check_total_tokens(prompts, "input"), params)

    async def full(self, req: EmbeddingRequest, prep: PreparedRequest, request_id: str,
                   streams: list[RequestStream]) -> EmbeddingResponse:
        outs = await self.collect(streams)
        data = [EmbeddingData(index=i, embedding=_encode(o.outputs.data, req.encoding_format))
                for i, o in enumerate(outs)]
        return EmbeddingResponse(id=request_id, model=prep.model, data=data, usage=self.usage(outs))


class OpenAIServingScore(OpenAIServingPooling):
    """/v1/score and /v1/rerank: the same pairs, two response shapes."""

    id_prefix = "score"

    def prepare(self, req: ScoreRequest | RerankRequest) -> PreparedScores:
        rerank = isinstance(req, RerankRequest)
        model = self.model_name(req.model)
        if rerank:
            if not req.documents:
                raise OpenAIError("documents must not be empty", param="documents")
            if req.top_n is not None and req.top_n < 0:
                raise OpenAIError(f"top_n must be >= 0 (0: every document), got {req.top_n}", param="top_n")
            pairs = [(req.query, d) for d in req.documents]
        else:
            try:
                pairs = score_pairs(req.text_1, req.text_2)
            except InvalidRequestError as e:
                raise self.invalid(req, e) from None
        # The prompts it would start, counted before tokenizing any of them: a reranker's
        # pair is one; for embedding similarity, each distinct text once.
        field = "documents" if rerank else "text_2"
        truncate = req.truncate_prompt_tokens
        documents = list(req.documents) if rerank else []
        if self.engine.classifier_token_ids is not None:
            self.check_fanout(len(pairs), 1, field)
            if not all(isinstance(a, str) and isinstance(b, str) for a, b in pairs):
                raise OpenAIError("a reranker scores text: send strings, not token ids", param="text_1")
            if truncate is not None:  # (it keeps a prompt's last tokens: the document, not the query)
                raise OpenAIError("truncate_prompt_tokens would cut a reranker's prompt from its start (its instruction "
                                  "and query); send shorter documents", param="truncate_prompt_tokens")
            prompts = [self.prompt(reranker_prompt(a, b, req.instruction), None) for a, b in pairs]
            return PreparedScores(model, self.check_total_tokens(prompts, field), PoolingParams(task="classify"),
                                  documents=documents)
        if req.instruction is not None:
            raise OpenAIError("instruction is a reranker's (a server started with pooler_config "
                              "classifier_from_token); embedding similarity takes none", param="instruction")
        index: dict[Any, int] = {}
        for text in (t for pair in pairs for t in pair):
            index.setdefault(_key(text), len(index))
        self.check_fanout(len(index), 1, field)
        prompts = [self.prompt(list(t) if isinstance(t, tuple) else t, truncate) for t in index]
        return PreparedScores(model, self.check_total_tokens(prompts, field), PoolingParams(task="embed"), pairs=[(index[_key(a)], index[_key(b)]) for a, b in pairs],
                              documents=documents)

    async def full(self, req: ScoreRequest | RerankRequest, prep: PreparedScores, request_id: str,
                   streams: list[RequestStream]) -> ScoreResponse | RerankResponse:
        outs = await self.collect(streams)
        if prep.pairs is None:
            scores = [float(o.outputs.data[0]) for o in outs]
        else:
            scores = [cosine(outs[a].outputs.data, outs[b].outputs.data) for a, b in prep.pairs]
        usage = self.usage(outs)
        if isinstance(req, ScoreRequest):
            return ScoreResponse(id=request_id, model=prep.model, usage=usage,
                                 data=[ScoreData(index=i, score=s) for i, s in enumerate(scores)])
        ranked = sorted(range(len(scores)), key=lambda i: -scores[i])
        if req.top_n:
            ranked = ranked[: req.top_n]
        return RerankResponse(id=request_id, model=prep.model, usage=usage, results=[
            RerankResult(index=i, relevance_score=scores[i],
                         document=RerankDocument(text=prep.documents[i]) if req.return_documents else None)
            for i in ranked])


def _key(text: str | list[int]) -> str | tuple[int, ...]:
    return text if isinstance(text, str) else tuple(text)


def _encode(data: Any, encoding_format: str) -> list[float] | str:
    """An embedding as JSON floats, or as OpenAI's base64 of little-endian float32."""
    if encoding_format == "base64":
        return base64.b64encode(data.float().numpy().astype("<f4").tobytes()).decode("ascii")
    return data.tolist()

