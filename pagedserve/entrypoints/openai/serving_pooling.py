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
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from pagedserve.engine.async_llm import RequestStream
from pagedserve.entrypoints.openai.protocol import PromptTokensDetails, UsageInfo
from pagedserve.entrypoints.openai.protocol_fields import RERANK_FIELDS
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
from pagedserve.entrypoints.score_utils import cosine, encode_reranker_pair, score_pairs
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

    # (and vLLM's older `additional_data`, which nothing read: accepted without effect)
    OWN_REFUSALS = frozenset(RERANK_FIELDS) | {"additional_data"}

    def prompt(self, item: str | list[int], truncate: int | None, add_special_tokens: bool = True,
               field: str = "input", label: str | None = None) -> TokenizedPrompt:
        """One input as a prompt, its tokens cut to the last `truncate` (vLLM's
        truncate_prompt_tokens; -1: the last max_model_len); `field`: where it came from,
        `label`: how an error names it among several (`input[2]`)."""
        if isinstance(item, str):
            if not item:
                raise OpenAIError(f"{field} must not hold empty strings", param=field)
            try:
                ids = self.tokenize(item, add_special_tokens, truncate is not None)
            except InvalidRequestError as e:  # (too long to tokenize: named as the client sent it)
                raise OpenAIError(f"{label}: {e}" if label else str(e), param=field) from None
            return self.truncated(TokenizedPrompt(item, ids), truncate)
        return self.truncated(TokenizedPrompt(None, list(item)), truncate)

    @staticmethod
    def check_total_tokens(prompts: Iterable[TokenizedPrompt], param: str) -> list[TokenizedPrompt]:
        """`prompts`, when their tokens (after truncation) sum to at most
        MAX_POOLING_REQUEST_TOKENS; taken one at a time, so that tokenizing stops at the
        first past the bound (a body of 2,048 long texts was tokenized whole first)."""
        out: list[TokenizedPrompt] = []
        total = 0
        for prompt in prompts:
            total += len(prompt.token_ids)
            if total > MAX_POOLING_REQUEST_TOKENS:
                raise OpenAIError(f"this request's prompts hold more than {MAX_POOLING_REQUEST_TOKENS} tokens in all "
                                  f"(its first {len(out) + 1} hold {total}); at most {MAX_POOLING_REQUEST_TOKENS} "
                                  "are allowed per request", param=param)
            out.append(prompt)
        return out

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
        params = self.params(req)
        if req.messages is not None:  # vLLM's chat form: the conversation as one prompt
            # (its add_special_tokens defaults to False, as chat's: the template writes them)
            prompt = self.render_chat(
                req.messages, req.chat_template, req.add_generation_prompt, None,
                chat_template_kwargs=req.chat_template_kwargs, continue_final_message=req.continue_final_message,
                add_special_tokens=req.add_special_tokens if "add_special_tokens" in req.model_fields_set else False)
            return PreparedRequest(model, [self.truncated(prompt, req.truncate_prompt_tokens)], params)
        value = req.input
        if isinstance(value, str) or (value and all(isinstance(t, int) for t in value)):
            items: list = [value]
        else:
            items = list(value)
        if not items or any(isinstance(t, list) and not t for t in items):
            raise OpenAIError("input must not be empty", param="input")
        if len(items) > MAX_EMBEDDING_INPUTS:  # before tokenizing any of them
            raise OpenAIError(f"input holds {len(items)} items; at most {MAX_EMBEDDING_INPUTS} are allowed per request",
                              param="input")
        prompts = (self.prompt(t, req.truncate_prompt_tokens, req.add_special_tokens,
                               label=f"input[{i}]" if len(items) > 1 else None) for i, t in enumerate(items))
        return PreparedRequest(model, self.check_total_tokens(prompts, "input"), params)

    def params(self, req: EmbeddingRequest) -> PoolingParams:
        try:
            req.check_pooling_fields()
            normalize = req.normalized()
        except InvalidRequestError as e:
            raise self.invalid(req, e) from None
        # (checked by the engine when it accepts them: a bad field is a 400 naming it, before any output)
        return PoolingParams(dimensions=req.dimensions, normalize=normalize)

    async def full(self, req: EmbeddingRequest, prep: PreparedRequest, request_id: str,
                   streams: list[RequestStream]) -> EmbeddingResponse:
        outs = await self.collect(streams)
        data = [EmbeddingData(index=i, embedding=_encode(o.outputs.data, req.encoding_format, req.endianness))
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
        try:
            if not rerank:
                pairs = score_pairs(req.text_1, req.text_2)
            req.check_pooling_fields()
            activated = req.activated()
        except InvalidRequestError as e:
            raise self.invalid(req, e) from None
        # The prompts it would start, counted before tokenizing any of them: a reranker's
        # pair is one; for embedding similarity, each distinct text once.
        names = ("query", "documents") if rerank else ("text_1", "text_2")
        documents = list(req.documents) if rerank else []
        if self.engine.classifier_token_ids is not None:
            prep = self._reranker_prompts(req, pairs, names)
            prep.params = PoolingParams(task="classify", use_activation=activated)
        else:
            if req.instruction is not None:
                raise OpenAIError("instruction is a reranker's (a server started with pooler_config "
                                  "classifier_from_token); embedding similarity takes none", param="instruction")
            if activated is False:
                raise OpenAIError("use_activation false asks for a classifier's raw logits; this server scores by "
                                  "the cosine of two embeddings, which has none", param="use_activation")
            prep = self._similarity_prompts(req, pairs, names)
        prep.model, prep.documents = model, documents
        return prep

    def _reranker_prompts(self, req: ScoreRequest | RerankRequest, pairs: list[tuple[Any, Any]],
                          names: tuple[str, str]) -> PreparedScores:
        """One reranker prompt per pair."""
        self.check_fanout(len(pairs), 1, names[1])
        if not all(isinstance(a, str) and isinstance(b, str) for a, b in pairs):
            raise OpenAIError("a reranker scores text: send strings, not token ids", param=names[0])
        if req.truncate_prompt_tokens is not None:  # (it keeps a prompt's last tokens: the document, not the query)
            raise OpenAIError("truncate_prompt_tokens would cut a reranker's prompt from its start (its instruction "
                              "and query); send shorter documents", param="truncate_prompt_tokens")
        for side, name in enumerate(names):
            if any(not pair[side] for pair in pairs):
                raise OpenAIError(f"{name} must not hold empty strings", param=name)
        if self.tokenizer is None:
            raise OpenAIError("this model has no tokenizer; a reranker scores text", param=names[0])
        limit = self.engine.max_prompt_chars
        for side, name in enumerate(names):  # (a text too long alone is named, not the first pair it is in)
            long = [i for i, pair in enumerate(pairs) if len(pair[side]) > limit]
            if long:
                one = all(pair[side] is pairs[0][side] for pair in pairs)  # (1:N: the one query)
                raise OpenAIError(f"{name if one else f'{name}[{long[0]}]'}: the text is {len(pairs[long[0]][side])} "
                                  f"characters, more than the {limit} that max_model_len tokens of this model can "
                                  "spell", param=name)

        def encoded(i: int, a: str, b: str) -> TokenizedPrompt:
            try:
                return TokenizedPrompt(*encode_reranker_pair(self.tokenizer, a, b, req.instruction, limit, names[1]))
            except InvalidRequestError as e:
                raise OpenAIError(f"{names[1]}[{i}]: {e}", param=names[1]) from None

        prompts = (encoded(i, a, b) for i, (a, b) in enumerate(pairs))
        return PreparedScores("", self.check_total_tokens(prompts, names[1]), PoolingParams(task="classify"),
                              labels=[(names[1], f"{names[1]}[{i}]") for i in range(len(pairs))])

    def _similarity_prompts(self, req: ScoreRequest | RerankRequest, pairs: list[tuple[Any, Any]],
                            names: tuple[str, str]) -> PreparedScores:
        """Each distinct text embedded once; the pairs as indices into those prompts."""
        first, field = names
        one_first = all(a is pairs[0][0] for a, _ in pairs)  # 1:N (score_pairs pairs the one text with each)
        index: dict[Any, int] = {}
        labels = []
        for j, (a, b) in enumerate(pairs):
            for text, label in ((a, (first, first if one_first else f"{first}[{j}]")), (b, (field, f"{field}[{j}]"))):
                if index.setdefault(_key(text), len(index)) == len(labels):
                    labels.append(label)
        self.check_fanout(len(index), 1, field)
        prompts = (self.prompt(list(t) if isinstance(t, tuple) else t, req.truncate_prompt_tokens, field=name,
                               label=label) for t, (name, label) in zip(index, labels, strict=True))
        return PreparedScores("", self.check_total_tokens(prompts, field), PoolingParams(task="embed"),
                              labels=labels, pairs=[(index[_key(a)], index[_key(b)]) for a, b in pairs])

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


def _encode(data: Any, encoding_format: str, endianness: str = "native") -> list[float] | str:
    """An embedding as JSON floats, or as OpenAI's base64 of float32, in `endianness`
    (vLLM's field; "native" is this machine's order, as OpenAI's client reads it)."""
    if encoding_format == "base64":
        order = {"native": "=", "big": ">", "little": "<"}[endianness]
        return base64.b64encode(data.float().numpy().astype(f"{order}f4").tobytes()).decode("ascii")
    return data.tolist()

