"""Pydantic models of the pooling routes (POST /v1/embeddings, /v1/score, /v1/rerank):
their request bodies and answers, kept apart from protocol.py's generation models
because only a server started with `--runner pooling` serves them (serving_pooling.py).
"""

from __future__ import annotations

import functools
import time
from typing import Any, ClassVar, Literal

from pydantic import Field, model_validator

from pagedserve.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    OpenAIBaseModel,
    RequestBody,
    UsageInfo,
)
from pagedserve.entrypoints.openai.protocol_fields import (
    RERANK_FIELDS,
    UNSUPPORTED_FIELDS,
    refuse_unsupported_fields,
    refuse_vllm_fields,
)
from pagedserve.errors import InvalidRequestError
from pagedserve.utils import same_value


# ------------------------------------------------------------------ request bodies
def _is_id(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def check_inputs_shape(value: Any, name: str) -> None:
    """An input field holds a string, strings, token ids (integers) or lists of them, said
    plainly when it does not (pydantic's union error read "Input should be a valid string"
    for a list of floats)."""
    if isinstance(value, str):
        return
    if isinstance(value, list):
        if all(isinstance(v, str) for v in value) or all(_is_id(v) for v in value):
            return
        for i, v in enumerate(value):
            if isinstance(v, list) and all(_is_id(t) for t in v):
                continue
            if not isinstance(v, (str, list)) and not _is_id(v):
                what = f"item {i} is {type(v).__name__} {v!r:.40}"
            elif isinstance(v, list):
                what = f"item {i} is a list that is not all token ids (integers)"
            else:
                what = f"item {i} is a {'string' if isinstance(v, str) else 'token id'} beside other kinds of item"
            break
        else:
            return
    else:
        what = f"it is {type(value).__name__}"
    raise InvalidRequestError(f"{name} must be a string, a list of strings, a list of token ids (integers) or a "
                              f"list of token-id lists; {what}", param=name)


class _PoolingFields(RequestBody):
    """What the pooling routes (/v1/embeddings, /v1/score, /v1/rerank) share: they never
    stream, and vLLM's extras."""

    stream: ClassVar[bool] = False
    model: str | None = None
    user: str | None = None
    # vLLM extras: keep only the last N tokens of each input (-1: the last max_model_len).
    truncate_prompt_tokens: int | None = None
    priority: int = 0
    cache_salt: str | None = None
    request_id: str | None = None  # vLLM's: the answer's id is "<kind>-<request_id>"
    mm_processor_kwargs: dict[str, Any] | None = None  # vLLM's; refused (the image processors take no settings)

    # The field the engine's "prompt" is (None: several fields make prompts).
    PROMPT_FIELD: ClassVar[str | None] = None
    ROUTE: ClassVar[str] = ""  # its path, for refusals naming it

    def api_param(self, param: str | None) -> str | None:
        return self.PROMPT_FIELD if param == "prompt" else param

    def check_pooling_fields(self) -> None:
        """OpenAI's and vLLM's fields for what this server lacks refused by name, as on
        the generation routes (vLLM's use_beam_search, OpenAI's audio were ignored here)."""
        for refused in (UNSUPPORTED_FIELDS, RERANK_FIELDS):
            refuse_unsupported_fields(self.model_extra, refused)
        refuse_vllm_fields(self.model_extra)
        refuse_other_routes_fields(self)
        if self.mm_processor_kwargs:
            raise InvalidRequestError("mm_processor_kwargs: the image processors here take no per-request settings",
                                      param="mm_processor_kwargs")


_CHAT_FORM_FIELDS = ("chat_template", "chat_template_kwargs", "add_generation_prompt", "continue_final_message")


class EmbeddingRequest(_PoolingFields):
    """POST /v1/embeddings: OpenAI's shape (one input or a batch, text or token ids), or
    vLLM's chat form (`messages`, rendered by the chat template, images included: one
    embedding of the conversation)."""

    PROMPT_FIELD: ClassVar[str | None] = "input"
    ROUTE: ClassVar[str] = "/v1/embeddings"

    input: str | list[str] | list[int] | list[list[int]] | None = None
    encoding_format: Literal["float", "base64"] = "float"
    # vLLM's chat form (its EmbeddingChatRequest), with its defaults: no generation prompt
    messages: list[ChatMessage] | None = None
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    add_generation_prompt: bool = False
    continue_final_message: bool = False

    dimensions: int | None = None
    normalize: bool | None = None  # vLLM extra: None keeps the server's pooler_config
    add_special_tokens: bool = True  # vLLM extra: text inputs tokenized with the model's BOS/EOS
    # vLLM extra: the dtype of base64 embeddings; float32 only here (another is refused by name)
    embed_dtype: Literal["float32"] = "float32"
    endianness: Literal["native", "big", "little"] = "native"  # vLLM extra: byte order of base64 floats
    use_activation: bool | None = None  # vLLM's newer name of `normalize` (both given: they must agree)

    @model_validator(mode="before")
    @classmethod
    def _input_shape(cls, data: Any) -> Any:
        if isinstance(data, dict):
            given = data.get("input") is not None
            if given == (data.get("messages") is not None):
                raise InvalidRequestError("give either input (texts or token ids) or messages (a conversation), not "
                                          + ("both" if given else "neither"), param="input")
            if given:
                check_inputs_shape(data["input"], "input")
                chat = [k for k in _CHAT_FORM_FIELDS if data.get(k) is not None]
                if chat:  # (they would do nothing)
                    raise InvalidRequestError(f"{', '.join(chat)}: the chat form's, for messages; not with input",
                                              param=chat[0])
            elif not isinstance(data["messages"], list) or not data["messages"]:
                raise InvalidRequestError("messages must be a non-empty list of chat messages", param="messages")
        return data

    def brings_chat_template(self) -> bool:
        return bool(self.chat_template)

    def api_param(self, param: str | None) -> str | None:
        return ("messages" if self.messages is not None else "input") if param == "prompt" else param

    def normalized(self) -> bool | None:
        """`normalize` and its newer name `use_activation` as one value (None: the server's)."""
        if None not in (self.normalize, self.use_activation) and self.normalize != self.use_activation:
            raise InvalidRequestError("normalize and use_activation are one setting (use_activation is vLLM's newer "
                                      "name): give one, or the same value", param="use_activation")
        return self.use_activation if self.use_activation is not None else self.normalize


class _ScoreFields(_PoolingFields):
    """vLLM's switch of a classifier's activation (`softmax` and `activation`: its older
    names): False answers the reranker's raw logit difference instead of its sigmoid."""

    use_activation: bool | None = None
    activation: bool | None = None
    softmax: bool | None = None

    def activated(self) -> bool | None:
        """The one value of use_activation and its older names (None: the default, on)."""
        given = {n: v for n, v in (("use_activation", self.use_activation), ("activation", self.activation),
                                   ("softmax", self.softmax)) if v is not None}
        if len(set(given.values())) > 1:
            raise InvalidRequestError(f"{' and '.join(given)} are one setting (use_activation; the others are its "
                                      "older names): give one, or the same value", param="use_activation")
        return next(iter(given.values()), None)


class ScoreRequest(_ScoreFields):
    """POST /v1/score (vLLM's shape): text_1 against each text_2, or two lists pairwise."""

    ROUTE: ClassVar[str] = "/v1/score"

    text_1: str | list[str] | list[int] | list[list[int]]
    text_2: str | list[str] | list[int] | list[list[int]]

    @model_validator(mode="before")
    @classmethod
    def _texts_shape(cls, data: Any) -> Any:
        for name in ("text_1", "text_2"):
            if isinstance(data, dict) and name in data:
                check_inputs_shape(data[name], name)
        return data
    instruction: str | None = None  # a reranker's task line (pagedserve extra)


class RerankRequest(_ScoreFields):
    """POST /v1/rerank (Jina's and Cohere's shape, as vLLM serves it)."""

    ROUTE: ClassVar[str] = "/v1/rerank"

    query: str
    documents: list[str]
    top_n: int | None = None  # None or 0: every document
    return_documents: bool = True
    instruction: str | None = None  # a reranker's task line (pagedserve extra)


_ROUTES: tuple[tuple[str, type[RequestBody]], ...] = (
    ("/v1/chat/completions", ChatCompletionRequest), ("/v1/completions", CompletionRequest),
    ("/v1/embeddings", EmbeddingRequest), ("/v1/score", ScoreRequest), ("/v1/rerank", RerankRequest))


@functools.cache
def _other_routes_fields(model: type[_PoolingFields]) -> dict[str, tuple[list[str], list[Any]]]:
    """Fields the other routes model and `model` does not: name -> (those routes, their
    defaults there; a field a route requires has none: any value asks for something)."""
    found: dict[str, tuple[list[str], list[Any]]] = {}
    for route, other in _ROUTES:
        for name, info in other.model_fields.items():
            if name not in model.model_fields:
                routes, defaults = found.setdefault(name, ([], []))
                routes.append(route)
                if not info.is_required():
                    defaults.append(info.get_default(call_default_factory=True))
    return found


def refuse_other_routes_fields(req: _PoolingFields) -> None:
    """A field of another route (max_tokens or stream on /v1/embeddings, dimensions on
    /v1/score) set to anything but null or that route's default is refused by name: it
    asked for something this route does not do (it was dropped with one log line)."""
    foreign = _other_routes_fields(type(req))
    for name, value in (req.model_extra or {}).items():
        if name in foreign and value is not None and not same_value(value, tuple(foreign[name][1])):
            raise InvalidRequestError(f"{name} is a field of {' and '.join(foreign[name][0])}; {req.ROUTE} does not "
                                      "read it", param=name)


# ------------------------------------------------------------------- response shapes
class EmbeddingData(OpenAIBaseModel):
    object: str = "embedding"
    index: int
    embedding: list[float] | str  # str: base64 of float32 (the request's endianness; native: little here)


class _ListResponse(OpenAIBaseModel):
    """vLLM's list answers of the pooling routes (the subclass adds `data`)."""

    id: str
    object: str = "list"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    usage: UsageInfo


class EmbeddingResponse(_ListResponse):
    data: list[EmbeddingData]


class ScoreData(OpenAIBaseModel):
    object: str = "score"
    index: int
    score: float


class ScoreResponse(_ListResponse):
    data: list[ScoreData]


class RerankDocument(OpenAIBaseModel):
    text: str


class RerankResult(OpenAIBaseModel):
    index: int
    relevance_score: float
    document: RerankDocument | None = None


class RerankResponse(OpenAIBaseModel):
    id: str
    model: str
    usage: UsageInfo
    results: list[RerankResult]
