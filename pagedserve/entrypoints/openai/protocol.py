"""Pydantic models for the OpenAI-compatible API (request bodies and response shapes).

Requests accept the OpenAI fields plus vLLM's sampling extras (top_k, min_p, ...); fields we
do not act on are accepted and ignored only when ignoring them cannot change the result (e.g.
`user`, and the chat fields listed in docs/serving.md, "Accepted without effect"), otherwise the
request is refused with a 400 naming the field (`check_unsupported`).  Each request converts
itself to `SamplingParams`, which does the range validation; `api_param` maps an engine-side
field name in an error back to the name this request used.  The pooling routes' models are in
protocol_pooling.py, the Responses API's body in protocol_responses.py.
"""

from __future__ import annotations

import time
import uuid
from typing import Any, ClassVar, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SerializerFunctionWrapHandler,
    model_serializer,
    model_validator,
)

from pagedserve.engine.chat_utils import check_continuation, messages_hold_image
from pagedserve.entrypoints.openai.protocol_fields import (
    CHAT_FIELDS,
    COMPLETION_FIELDS,
    as_sent,
    check_chat_message,
    check_chat_only_fields,
    check_hint_fields,
    check_sent_tool_calls,
    check_tool_definitions,
    constraint_of,
    omitted_if_none,
    prediction_text,
    refuse_unsupported_fields,
    refuse_vllm_fields,
)
from pagedserve.errors import InvalidRequestError
from pagedserve.sampling_params import SamplingParams, StructuredOutputsParams

# OpenAI's values of reasoning effort and verbosity (chat's fields, Responses' reasoning.effort and text.verbosity).
ReasoningEffort = Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"]
Verbosity = Literal["low", "medium", "high"]


def random_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


class OpenAIBaseModel(BaseModel):
    # Unknown fields are kept so that newer clients keep working (the serving layer refuses
    # the few it knows would change the output).  Strict: JSON `true` or "1" is not a
    # number, nor 1 a boolean (pydantic's lax mode coerced them).
    model_config = ConfigDict(extra="allow", strict=True)


class RequestBody(OpenAIBaseModel):
    """A top-level request body.  Its raw bytes were measured before parsing
    (`json_body.check_json_body`, in the body middleware): bounded in shape, and free of
    lone UTF-16 surrogates, which no tokenizer, template or grammar can take."""

    def image_field(self) -> str | None:  # the field that carries an image, if one does (read before a load)
        return None

    def brings_chat_template(self) -> bool:  # (its own, rendered in the sandbox's turn: PrepareThreads.run_for)
        return False


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
    model_config = ConfigDict(extra="forbid", strict=True)  # (another key was ignored)

    include_usage: bool | None = False
    continuous_usage_stats: bool | None = False
    include_obfuscation: bool | None = None  # OpenAI's padding of stream events: accepted without effect


class OpenAIRequestBody(RequestBody):
    """A generation request of OpenAI's API (completions, chat, Responses): OpenAI's caching,
    safety and tier hints, accepted without effect (check_openai_fields; others refused)."""

    prompt_cache_key: str | None = None
    prompt_cache_retention: Literal["in_memory", "in-memory", "24h"] | None = None
    prompt_cache_options: dict[str, Any] | None = None
    safety_identifier: str | None = None
    service_tier: Literal["auto", "default", "flex", "scale", "priority", "fast", "ultrafast"] | None = None

    def check_openai_fields(self) -> None:
        """OpenAI's fields for what this server lacks refused by name; the hints' shapes."""
        refuse_unsupported_fields(self.model_extra)
        refuse_vllm_fields(self.model_extra)
        check_hint_fields(self.prompt_cache_key, self.safety_identifier, self.prompt_cache_options)


class _SamplingFields(OpenAIRequestBody):
    """Fields shared by /v1/completions and /v1/chat/completions."""

    model: str | None = None
    request_id: str | None = None  # vLLM's: the answer's id is "<kind>-<request_id>" (check_request_id)
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int = 1
    best_of: int | None = None  # vLLM's (chat's too): taken where it equals n (SamplingParams' rule)
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
    # Structured outputs: OpenAI's response_format, vLLM's structured_outputs and guided_* (one per request).
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
    truncate_prompt_tokens: int | None = None  # vLLM's: keep the prompt's last k tokens (-1: max_model_len)
    # OpenAI's Predicted Outputs: {"type": "content", "content": text or text parts}, the
    # text expected back; the engine drafts from it (SamplingParams.prediction).
    prediction: dict[str, Any] | None = None
    thinking_token_budget: int | None = None  # vLLM's: reasoning tokens, then "</think>" (pagedserve/reasoning.py)
    use_beam_search: bool = False  # vLLM's: the n best beams (n the width; OpenAIServing.beam_search_params)
    length_penalty: float = 1.0  # vLLM's: a beam's score is its logprob over its length ** this
    early_stopping: bool | Literal["never"] = False  # vLLM's (and HF's): when a beam search ends early

    # vLLM's, not implemented here: refused when set (check_unsupported), as ignoring it changes the answer.
    REFUSED_FIELDS: ClassVar[tuple[str, ...]] = ("guided_whitespace_pattern",)
    # The fields that each constrain the output (the engine's "structured_outputs"; errors name the one used).
    STRUCTURED_FIELDS: ClassVar[tuple[str, ...]] = (
        "response_format", "structured_outputs", "guided_json", "guided_regex", "guided_choice", "guided_grammar")

    @model_validator(mode="before")
    @classmethod
    def _nulls_take_defaults(cls, data: Any) -> Any:
        """OpenAI's nullable fields of a default (n, echo) sent as null take it (a 400 said
        null was no integer)."""
        return {k: v for k, v in data.items() if v is not None or k not in ("n", "echo")} \
            if isinstance(data, dict) else data

    def _num_logprobs(self) -> int | None:
        raise NotImplementedError

    def requested_max_tokens(self) -> int | None:
        return self.max_tokens

    def api_params(self) -> dict[str, str]:
        """Engine-side names (SamplingParams fields, "prompt") this request spells differently."""
        return {"structured_outputs": (self.structured_fields() or ["structured_outputs"])[0]}

    def api_param(self, param: str | None) -> str | None:
        """The field of this request that an engine-side parameter name stands for."""
        return self.api_params().get(param, param) if param is not None else None

    def structured_fields(self) -> list[str]:
        """The constraining fields this request sets (response_format {"type": "text"} constrains
        nothing; one without a type, or text with other keys, is refused: constraint_of)."""
        return [f for f in self.STRUCTURED_FIELDS if getattr(self, f) is not None
                and not (f == "response_format" and self.response_format == {"type": "text"})]

    def check_unsupported(self, structured_outputs_backend: str) -> None:
        """Refuse fields that would silently change the output if ignored
        (`structured_outputs_backend`: the server's grammar library)."""
        self.check_openai_fields()
        for name in self.REFUSED_FIELDS:
            if getattr(self, name) not in (None, []):  # an empty list is a no-op
                raise InvalidRequestError(f"{name} is not supported by this server", param=name)
        if self.guided_decoding_backend not in (None, "auto", structured_outputs_backend):
            raise InvalidRequestError(f"guided_decoding_backend {self.guided_decoding_backend!r} is not available: "
                                      f"this server constrains with {structured_outputs_backend} (start it with "
                                      "--structured-outputs-backend to choose)", param="guided_decoding_backend")
        if self.stream_options is not None and not self.stream:
            raise InvalidRequestError("stream_options can only be set when stream is true", param="stream_options")
        if self.prompt_logprobs is not None and self.stream:
            raise InvalidRequestError("prompt_logprobs comes with the whole response: not with stream=true (for "
                                      "the echoed prompt's logprobs in a stream, use echo with logprobs)",
                                      param="prompt_logprobs")

    def structured_outputs_params(self) -> StructuredOutputsParams | None:
        """The one output constraint this request asks for, whichever field it used."""
        used = self.structured_fields()
        if len(used) > 1:
            raise InvalidRequestError(f"send one way of constraining the output, got {', '.join(used)}",
                                      param=used[1])
        if not used:
            return None
        return constraint_of(used[0], getattr(self, used[0]))

    def to_sampling_params(self, defaults: dict[str, Any] | None = None) -> SamplingParams:
        """`defaults`: the model's generation config for fields left unset (temperature, top_p,
        top_k, min_p, repetition_penalty); its max_tokens caps every answer, as vLLM's does
        (without one: to the context's end)."""
        defaults = defaults or {}
        try:
            return self._to_sampling_params(defaults)
        except InvalidRequestError as e:  # (a penalty the client never sent: where it came from, how to lift it)
            hint = (f" (repetition_penalty={defaults.get('repetition_penalty')!r} is this model's default, from its "
                    "generation config: send repetition_penalty 1.0 with the prediction, or serve with "
                    "--generation-config vllm)") if e.param == "prediction" and self.repetition_penalty is None \
                and "repetition_penalty" in str(e) else ""
            raise as_sent(e, self.api_param(e.param), hint) from None

    def _to_sampling_params(self, defaults: dict[str, Any]) -> SamplingParams:
        def pick(name: str, builtin: Any) -> Any:
            value = getattr(self, name)
            return defaults.get(name, builtin) if value is None else value

        limits = [n for n in (self.requested_max_tokens(), defaults.get("max_tokens")) if n is not None]
        return SamplingParams(
            n=self.n, best_of=self.best_of, temperature=pick("temperature", 1.0), top_p=pick("top_p", 1.0), top_k=pick("top_k", 0),
            min_p=pick("min_p", 0.0), seed=self.seed, presence_penalty=self.presence_penalty or 0.0,
            frequency_penalty=self.frequency_penalty or 0.0, repetition_penalty=pick("repetition_penalty", 1.0),
            stop=self.stop, stop_token_ids=self.stop_token_ids, include_stop_str_in_output=self.include_stop_str_in_output,
            ignore_eos=self.ignore_eos, max_tokens=min(limits, default=None),
            min_tokens=self.min_tokens, logprobs=self._num_logprobs(), prompt_logprobs=self.prompt_logprobs,
            skip_special_tokens=self.skip_special_tokens, logit_bias=self._logit_bias(),
            allowed_token_ids=self.allowed_token_ids, bad_words=self.bad_words,
            structured_outputs=self.structured_outputs_params(), prediction=prediction_text(self.prediction),
            thinking_token_budget=self.thinking_token_budget,
        )

    def _logit_bias(self) -> dict[int, float] | None:
        """OpenAI sends token ids as JSON object keys, so as strings."""
        if not self.logit_bias:
            return None
        # (int() took "1_7" and "１７" as 17, and refused 4,301 digits in Python's words)
        if not all(k.isascii() and k.isdigit() and len(k) <= 20 for k in self.logit_bias):
            raise InvalidRequestError("logit_bias keys must be token ids", param="logit_bias")
        return {int(k): v for k, v in self.logit_bias.items()}


class CompletionRequest(_SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16  # OpenAI's default for the legacy endpoint
    echo: bool = False
    logprobs: int | None = None
    suffix: str | None = None
    add_special_tokens: bool = True  # vLLM's: a text prompt tokenized with the model's BOS (and EOS)

    def _num_logprobs(self) -> int | None:
        return self.logprobs

    def requested_max_tokens(self) -> int | None:  # echo with 0: the prompt alone (one step runs, unshown)
        return 1 if self.prompt_only else self.max_tokens
    prompt_only = property(lambda self: self.echo and self.max_tokens == 0)  # (OpenAI's legacy prompt scoring)

    def check_unsupported(self, structured_outputs_backend: str) -> None:
        super().check_unsupported(structured_outputs_backend)
        refuse_unsupported_fields(self.model_extra, CHAT_FIELDS)
        if self.suffix:
            raise InvalidRequestError("suffix is not supported", param="suffix")

    def _to_sampling_params(self, defaults: dict[str, Any]) -> SamplingParams:
        if self.prompt_only and self.min_tokens:  # (it said max_tokens=1: the one step it runs)
            raise InvalidRequestError("min_tokens: an echo with max_tokens 0 scores the prompt and generates "
                                      "nothing", param="min_tokens")
        params = super()._to_sampling_params(defaults)
        if self.echo and self.logprobs is not None and (params.prompt_logprobs or -1) < self.logprobs:
            params.prompt_logprobs = self.logprobs  # echoed prompt tokens come with their k logprobs (k >= 0)
        return params


class ChatMessage(OpenAIBaseModel):
    # Other fields (an assistant's tool_calls, a tool's tool_call_id) reach the chat template.
    role: str
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None


class FunctionDefinition(OpenAIBaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)  # (another key was written into the prompt)

    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ChatCompletionTool(OpenAIBaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    type: Literal["function"] = "function"
    function: FunctionDefinition


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage]
    add_special_tokens: bool = False  # vLLM's: the tokenizer's special tokens too, beside the template's
    max_completion_tokens: int | None = None
    logprobs: bool | None = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    echo: bool = False  # vLLM's: the final assistant message put before the answer (serving_chat.echo_text)
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    documents: list[dict[str, str]] | None = None  # vLLM's: a RAG template's `documents` variable
    include_reasoning: bool = True  # vLLM's: false leaves the reasoning (--reasoning-parser) out
    tools: list[ChatCompletionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    # OpenAI's deprecated tools / tool_choice: mapped onto them (one call at most); the answer
    # in its shape (message.function_call, "function_call"; serving_chat.legacy_function_call).
    functions: list[FunctionDefinition] | None = None
    function_call: Literal["none", "auto"] | dict[str, Any] | None = None
    # Accepted without effect, held to OpenAI's values (clients send some; docs/serving.md):
    reasoning_effort: ReasoningEffort | None = None
    verbosity: Verbosity | None = None
    metadata: dict[str, str] | None = None
    store: bool | None = None  # false, or unset: nothing is stored; true is refused
    # Refused unless they ask for nothing this server cannot do: text output only, no web search.
    modalities: list[str] | None = None
    web_search_options: dict[str, Any] | None = None

    def brings_chat_template(self) -> bool:
        return bool(self.chat_template)

    def image_field(self) -> str | None:
        return "messages" if messages_hold_image(self.messages) else None

    @model_validator(mode="after")
    def _legacy_functions(self) -> ChatCompletionRequest:
        if self.functions is None and self.function_call is None:
            return self
        if self.tools is not None or self.tool_choice is not None:
            raise InvalidRequestError("send tools/tool_choice or the deprecated functions/function_call, not both",
                                      param="functions")
        if self.functions:
            self.tools = [ChatCompletionTool(function=f) for f in self.functions]
            self.parallel_tool_calls = False
        elif self.function_call not in (None, "none"):
            raise InvalidRequestError("function_call needs functions", param="function_call")
        call = self.function_call
        if isinstance(call, dict):
            if not isinstance(call.get("name"), str):
                raise InvalidRequestError('function_call must be "none", "auto" or {"name": NAME}',
                                          param="function_call")
            call = {"type": "function", "function": {"name": call["name"]}}
        self.tool_choice = call
        return self

    def api_params(self) -> dict[str, str]:
        legacy = {"tools": "functions", "tool_choice": "function_call"} if self.functions is not None else {}
        constraint = {}
        if not self.structured_fields() and self.tools:  # the grammar is the tools' (tool_choice)
            constraint = {"structured_outputs": legacy.get("tools", "tools")}
        return {**super().api_params(), **constraint, **legacy, "prompt": "messages", "logprobs": "top_logprobs",
                "max_tokens": "max_completion_tokens" if self.max_completion_tokens is not None else "max_tokens"}

    def requested_max_tokens(self) -> int | None:
        if None not in (self.max_tokens, self.max_completion_tokens) and self.max_tokens != self.max_completion_tokens:
            raise InvalidRequestError("send max_completion_tokens or its deprecated max_tokens, not both (they "
                                      "differ)", param="max_tokens")
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def _num_logprobs(self) -> int | None:
        if self.top_logprobs is not None and not self.logprobs:
            raise InvalidRequestError("top_logprobs requires logprobs to be true", param="top_logprobs")
        return (self.top_logprobs or 0) if self.logprobs else None

    def tool_mode(self) -> tuple[str, FunctionDefinition | None]:
        """("none" | "auto" | "required" | "named", the named function).  With tools and no
        tool_choice it is "auto", as in OpenAI's API."""
        choice = self.tool_choice
        check_tool_definitions([t.function.name for t in self.tools or []],
                               [t.function.parameters for t in self.tools or []], "functions" if self.functions else "tools")
        if not self.tools:
            if choice not in (None, "none"):
                raise InvalidRequestError("tool_choice needs tools", param="tool_choice")
            return "none", None
        if choice is None:
            return "auto", None
        if isinstance(choice, str):
            return choice, None
        function = choice.get("function")
        if choice.get("type") != "function" or not isinstance(function, dict) or not isinstance(
                function.get("name"), str):
            raise InvalidRequestError('tool_choice must be "none", "auto", "required" or '
                                      '{"type": "function", "function": {"name": NAME}}', param="tool_choice")
        name = function["name"]
        for tool in self.tools:
            if tool.function.name == name:
                return "named", tool.function
        raise InvalidRequestError(f"tool_choice names the function {name!r}, which is not among the tools",
                                  param="tool_choice")

    def check_unsupported(self, structured_outputs_backend: str) -> None:
        super().check_unsupported(structured_outputs_backend)
        if not self.messages:
            raise InvalidRequestError("messages must be a non-empty list", param="messages")
        check_continuation(self.continue_final_message, self.add_generation_prompt)
        check_chat_only_fields(self.modalities, self.web_search_options, self.store, self.metadata)
        refuse_unsupported_fields(self.model_extra, COMPLETION_FIELDS)
        for i, message in enumerate(self.messages):
            check_chat_message(i, message.role, message.model_dump(exclude_unset=True))
            if message.role == "assistant":
                check_sent_tool_calls(i, (message.model_extra or {}).get("tool_calls"))
        mode, _ = self.tool_mode()
        # (a response_format shapes text answers, and a forced call's turn has none: OpenAI
        # takes the pair; vLLM's own constraints on the whole output do not combine)
        if mode in ("required", "named") and (explicit := [f for f in self.structured_fields()
                                                           if f != "response_format"]):
            raise InvalidRequestError(f"tool_choice {mode!r} already constrains the output; drop {explicit[0]}",
                                      param=explicit[0])


# ------------------------------------------------------------------- response shapes
class PromptTokensDetails(OpenAIBaseModel):
    cached_tokens: int = 0


class CompletionTokensDetails(OpenAIBaseModel):
    """What a predicted output did: its tokens the verification kept and threw away."""

    accepted_prediction_tokens: int = 0
    rejected_prediction_tokens: int = 0


class UsageInfo(OpenAIBaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails | None = None
    # Only for a request with a prediction: every other usage keeps the shape it had.
    completion_tokens_details: CompletionTokensDetails | None = None

    @model_serializer(mode="wrap")
    def _drop_unset_details(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        data = handler(self)
        if data.get("completion_tokens_details", 0) is None:
            del data["completion_tokens_details"]
        return data


class CompletionLogprobs(OpenAIBaseModel):
    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)

    def extend(self, other: CompletionLogprobs) -> CompletionLogprobs:
        """These tokens, then `other`'s (whose text offsets already count these)."""
        return CompletionLogprobs(text_offset=self.text_offset + other.text_offset,
                                  token_logprobs=self.token_logprobs + other.token_logprobs,
                                  tokens=self.tokens + other.tokens, top_logprobs=self.top_logprobs + other.top_logprobs)


class PromptLogprob(OpenAIBaseModel):
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# vLLM's shape: per prompt token (None for the first), token id -> its logprob.
PromptLogprobs = list[dict[int, PromptLogprob] | None]


class CompletionChoice(OpenAIBaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    prompt_logprobs: PromptLogprobs | None = None


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


class FunctionCall(OpenAIBaseModel):
    name: str
    arguments: str


class ToolCall(OpenAIBaseModel):
    id: str = Field(default_factory=lambda: random_id("call"))
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatResponseMessage(OpenAIBaseModel):
    role: str = "assistant"
    content: str | None = None
    reasoning: str | None = None  # with --reasoning-parser (vLLM's current name)
    reasoning_content: str | None = None  # (the same: vLLM's older name, which clients still read)
    tool_calls: list[ToolCall] = Field(default_factory=list)
    function_call: FunctionCall | None = None  # (the deprecated functions' answer)


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
    prompt_logprobs: PromptLogprobs | None = None


class DeltaFunctionCall(OpenAIBaseModel):
    name: str | None = omitted_if_none()
    arguments: str | None = omitted_if_none()


class DeltaToolCall(OpenAIBaseModel):
    index: int
    id: str | None = omitted_if_none()
    type: Literal["function"] | None = omitted_if_none()
    function: DeltaFunctionCall


class DeltaMessage(OpenAIBaseModel):
    role: str | None = omitted_if_none()
    content: str | None = omitted_if_none()
    reasoning: str | None = omitted_if_none()
    reasoning_content: str | None = omitted_if_none()  # (the same, under vLLM's older name)
    tool_calls: list[DeltaToolCall] | None = omitted_if_none()
    function_call: DeltaFunctionCall | None = omitted_if_none()


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

