"""Pydantic models for the OpenAI-compatible API (request bodies and response shapes).

Requests accept the OpenAI fields plus vLLM's sampling extras (top_k, min_p, ...);
fields we do not act on are accepted and ignored only when ignoring them cannot change
the result (e.g. `user`), otherwise the request is refused with a 400 naming the field
(`check_unsupported`).  Each request converts itself to `SamplingParams`, which does
the range validation; `api_param` maps an engine-side field name in an error back to
the name this request used.
"""

from __future__ import annotations

import time
import uuid
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field

from pagedserve.errors import InvalidRequestError
from pagedserve.sampling_params import SamplingParams


def random_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


class OpenAIBaseModel(BaseModel):
    # Unknown fields are kept (not rejected) so that newer clients keep working; the
    # serving layer refuses the few it knows would change the output.
    model_config = ConfigDict(extra="allow")


# --------------------------------------------------------------------------- errors
class ErrorInfo(OpenAIBaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | int | None = None


class ErrorResponse(OpenAIBaseModel):
    error: ErrorInfo


# ------------------------------------------------------------------ request bodies
class StreamOptions(OpenAIBaseModel):
    include_usage: bool | None = False
    continuous_usage_stats: bool | None = False


class _SamplingFields(OpenAIBaseModel):
    """Fields shared by /v1/completions and /v1/chat/completions."""

    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int = 1
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float | None = 0.0
    frequency_penalty: float | None = 0.0
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    logit_bias: dict[str, float] | None = None
    # vLLM extras
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int = 0
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    priority: int = 0
    # Accepted by vLLM and not implemented here yet: refused when set (check_unsupported),
    # since ignoring any of them changes what the client gets.
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: Any = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_decoding_backend: str | None = None
    guided_whitespace_pattern: str | None = None
    prompt_logprobs: int | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    cache_salt: str | None = None

    REFUSED_FIELDS: ClassVar[tuple[str, ...]] = (
        "structured_outputs", "guided_json", "guided_regex", "guided_choice", "guided_grammar",
        "guided_decoding_backend", "guided_whitespace_pattern", "prompt_logprobs", "allowed_token_ids",
        "bad_words", "cache_salt", "logit_bias")

    def _num_logprobs(self) -> int | None:
        raise NotImplementedError

    def requested_max_tokens(self) -> int | None:
        return self.max_tokens

    def api_params(self) -> dict[str, str]:
        """Engine-side names (SamplingParams fields, "prompt") this request spells differently."""
        return {}

    def api_param(self, param: str | None) -> str | None:
        """The field of this request that an engine-side parameter name stands for."""
        return self.api_params().get(param, param) if param is not None else None

    def check_unsupported(self) -> None:
        """Refuse fields that would silently change the output if ignored."""
        for name in self.REFUSED_FIELDS:
            if getattr(self, name) not in (None, []):  # an empty list is a no-op; {} is not (a schema)
                raise InvalidRequestError(f"{name} is not supported by this server", param=name)
        if self.response_format is not None and self.response_format.get("type", "text") != "text":
            raise InvalidRequestError(
                f"response_format of type {self.response_format.get('type')!r} is not supported by this server "
                "(only 'text')", param="response_format")
        n_best = getattr(self, "best_of", None)
        if n_best is not None and n_best != self.n:
            raise InvalidRequestError(f"best_of must equal n (best_of={n_best}, n={self.n}); best_of > n is "
                                      "not supported", param="best_of")
        if self.stream_options is not None:
            if not self.stream:
                raise InvalidRequestError("stream_options can only be set when stream is true",
                                          param="stream_options")
            if self.stream_options.continuous_usage_stats:
                raise InvalidRequestError("stream_options.continuous_usage_stats is not supported by this server",
                                          param="stream_options")

    def to_sampling_params(self) -> SamplingParams:
        """Without max_tokens the request may run to the end of the context."""
        try:
            return self._to_sampling_params()
        except InvalidRequestError as e:
            raise InvalidRequestError(str(e), param=self.api_param(e.param)) from None

    def _to_sampling_params(self) -> SamplingParams:
        return SamplingParams(
            n=self.n,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=0 if self.top_k is None else self.top_k,
            min_p=0.0 if self.min_p is None else self.min_p,
            seed=self.seed,
            presence_penalty=self.presence_penalty or 0.0,
            frequency_penalty=self.frequency_penalty or 0.0,
            repetition_penalty=1.0 if self.repetition_penalty is None else self.repetition_penalty,
            stop=self.stop,
            stop_token_ids=self.stop_token_ids,
            include_stop_str_in_output=self.include_stop_str_in_output,
            ignore_eos=self.ignore_eos,
            max_tokens=self.requested_max_tokens(),
            min_tokens=self.min_tokens,
            logprobs=self._num_logprobs(),
            skip_special_tokens=self.skip_special_tokens,
        )


class CompletionRequest(_SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16  # OpenAI's default for the legacy endpoint
    echo: bool = False
    logprobs: int | None = None
    best_of: int | None = None
    suffix: str | None = None

    def _num_logprobs(self) -> int | None:
        return self.logprobs

    def check_unsupported(self) -> None:
        super().check_unsupported()
        if self.suffix:
            raise InvalidRequestError("suffix is not supported", param="suffix")
        if self.echo and self.logprobs is not None:
            raise InvalidRequestError("echo together with logprobs is not supported (no prompt logprobs)",
                                      param="echo")


class ChatMessage(OpenAIBaseModel):
    role: str
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: bool | None = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True
    chat_template: str | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None
    chat_template_kwargs: dict[str, Any] | None = None
    continue_final_message: bool = False

    REFUSED_FIELDS: ClassVar[tuple[str, ...]] = (*_SamplingFields.REFUSED_FIELDS, "tools", "chat_template_kwargs")

    def api_params(self) -> dict[str, str]:
        return {"prompt": "messages", "logprobs": "top_logprobs",
                "max_tokens": "max_completion_tokens" if self.max_completion_tokens is not None else "max_tokens"}

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def _num_logprobs(self) -> int | None:
        if self.top_logprobs is not None and not self.logprobs:
            raise InvalidRequestError("top_logprobs requires logprobs to be true", param="top_logprobs")
        return (self.top_logprobs or 0) if self.logprobs else None

    def check_unsupported(self) -> None:
        super().check_unsupported()
        if self.tool_choice not in (None, "none"):
            raise InvalidRequestError("tool_choice is not supported by this server (no tools)", param="tool_choice")
        if self.continue_final_message:
            raise InvalidRequestError("continue_final_message is not supported by this server",
                                      param="continue_final_message")
        if not self.messages:
            raise InvalidRequestError("messages must be a non-empty list", param="messages")


class TokenizeRequest(OpenAIBaseModel):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True


class DetokenizeRequest(OpenAIBaseModel):
    model: str | None = None
    tokens: list[int]


# ------------------------------------------------------------------- response shapes
class PromptTokensDetails(OpenAIBaseModel):
    cached_tokens: int = 0


class UsageInfo(OpenAIBaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails | None = None


class CompletionLogprobs(OpenAIBaseModel):
    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class CompletionChoice(OpenAIBaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class CompletionResponse(OpenAIBaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


class TopLogprob(OpenAIBaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatLogprobToken(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(OpenAIBaseModel):
    content: list[ChatLogprobToken] | None = None


class ChatResponseMessage(OpenAIBaseModel):
    role: str = "assistant"
    content: str | None = None


class ChatChoice(OpenAIBaseModel):
    index: int
    message: ChatResponseMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionResponse(OpenAIBaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo


class DeltaMessage(OpenAIBaseModel):
    role: str | None = None
    content: str | None = None


class ChatStreamChoice(OpenAIBaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionChunk(OpenAIBaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatStreamChoice]
    usage: UsageInfo | None = None


class ModelCard(OpenAIBaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "pagedserve"
    root: str | None = None
    max_model_len: int | None = None


class ModelList(OpenAIBaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard] = Field(default_factory=list)
