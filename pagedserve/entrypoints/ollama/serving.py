"""Ollama's /api/chat, /api/generate and /api/embed as translations, not second paths:
each body becomes the OpenAI request that asks for the same answer (chat, completion
for `raw` prompts, embeddings), which that handler prepares, starts and answers; the
answer, or its stream of chunks, is re-said in Ollama's shape (NDJSON lines of
`message` or `response` fragments, then one `done` line with the counts and the
nanosecond timings Ollama reports)."""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any

from pydantic import ValidationError

from pagedserve.engine.async_llm import RequestStream
from pagedserve.entrypoints.ollama.protocol import (
    NO_CHAT_TEMPLATE_HERE,
    SAMPLING_OPTIONS,
    OllamaChatRequest,
    OllamaEmbeddingsRequest,
    OllamaEmbedRequest,
    OllamaGenerateRequest,
    OllamaGenerating,
)
from pagedserve.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest
from pagedserve.entrypoints.openai.protocol_fields import part_key_error, renamed_text
from pagedserve.entrypoints.openai.protocol_pooling import EmbeddingRequest
from pagedserve.entrypoints.openai.serving_chat import OpenAIServingChat
from pagedserve.entrypoints.openai.serving_completion import OpenAIServingCompletion
from pagedserve.entrypoints.openai.serving_engine import OpenAIError, PreparedRequest
from pagedserve.entrypoints.openai.serving_pooling import OpenAIServingEmbedding
from pagedserve.entrypoints.openai.streaming import sse_dicts
from pagedserve.entrypoints.openai.tool_parsers import arguments_object
from pagedserve.errors import InvalidRequestError
from pagedserve.multimodal.image import BASE64_TEXT
from pagedserve.outputs import EngineOutput

_DONE_REASONS = {"tool_calls": "stop"}  # Ollama says "stop" when a turn ends in tool calls


def now_iso() -> str:
    return datetime.now(timezone.utc).isoformat().replace("+00:00", "Z")


@dataclass
class Timing:
    """When a request arrived, got its model, and saw its first and last token (ns)."""

    arrived: int = field(default_factory=time.perf_counter_ns)
    loaded: int = 0
    first_token: int = 0

    def mark_loaded(self) -> None:
        self.loaded = time.perf_counter_ns()

    def summary(self, prompt_tokens: int, output_tokens: int) -> dict[str, int]:
        end = time.perf_counter_ns()
        first = self.first_token or end
        return {"total_duration": end - self.arrived, "load_duration": self.loaded - self.arrived,
                "prompt_eval_count": prompt_tokens, "prompt_eval_duration": first - self.loaded,
                "eval_count": output_tokens, "eval_duration": end - first}


class TimedStream:
    """A request's stream that notes when its first token came (the engine's own time
    of it), for Ollama's prompt and eval durations; iterated and closed as the stream."""

    def __init__(self, inner: RequestStream, timing: Timing) -> None:
        self.inner, self.timing = inner, timing

    def __aiter__(self) -> TimedStream:
        return self

    async def __anext__(self) -> EngineOutput:
        out = await self.inner.__anext__()
        first = out.metrics.first_token_time if out.metrics is not None else None
        if not self.timing.first_token and first is not None:
            self.timing.first_token = time.perf_counter_ns() - int(max(time.time() - first, 0) * 1e9)
        return out

    def close(self) -> None:
        self.inner.close()


def timed(streams: list[RequestStream], timing: Timing) -> list[RequestStream]:
    return [TimedStream(s, timing) for s in streams]  # type: ignore[misc]  # (the stream's surface)


@dataclass
class PreparedOllama:
    openai_request: Any
    prepared: PreparedRequest


def _tool_calls(calls: list[dict[str, Any]] | None) -> list[dict[str, Any]]:
    """OpenAI's tool calls (arguments as JSON text) in Ollama's shape (an object)."""
    out = []
    for call in calls or []:
        function = call.get("function") or {}
        out.append({"function": {"name": function.get("name", ""),
                                 "arguments": arguments_object(function.get("arguments") or "{}")}})
    return out


def _with_images(text: str, images: Any, where: str) -> str | list[dict[str, Any]]:
    """A message's content with Ollama's `images` (base64 strings, no data: prefix) as
    image parts before its text, the order Ollama's templates use."""
    if not images:
        return text
    if not isinstance(images, list) or not all(isinstance(b, str) for b in images):
        raise OpenAIError(f"{where}.images must be a list of base64 strings", param="images")
    for j, b in enumerate(images):
        # Base64's alphabets only: a URL's ":" or a file name's "." is named here.  (A "/"
        # may lead: every JPEG's base64 starts "/9j/".)  A path never reaches a file read.
        if not BASE64_TEXT.fullmatch(b):
            raise OpenAIError(f"{where}.images[{j}] must be the image file's bytes in base64 (no data: URL, "
                              "URL or path)", param="images")
    # The media type is only a label: the image's own bytes say what it is (multimodal/image.py).
    return [*({"type": "image_url", "image_url": {"url": f"data:image/*;base64,{b}"}} for b in images),
            {"type": "text", "text": text}]


def _openai_tool_call(call: Any, where: str, call_id: str) -> dict[str, Any]:
    """One of an assistant turn's tool calls, Ollama's shape ({"function": {"name": ...,
    "arguments": {...}}}) as OpenAI's (arguments as JSON text); any other shape is named."""
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise OpenAIError(f'{where} must be {{"function": {{"name": NAME, "arguments": {{...}}}}}}', param="messages")
    arguments = function.get("arguments")
    if arguments is not None and not isinstance(arguments, dict):
        raise OpenAIError(f"{where}.function.arguments must be an object", param="messages")
    return {"id": call_id, "type": "function",
            "function": {"name": function["name"], "arguments": json.dumps(arguments or {})}}


ROLES = ("system", "user", "assistant", "tool")  # Ollama's message roles
# A message's keys: Ollama's, and OpenAI's `name` and `tool_call_id` that clients written
# for OpenAI send (taken as OpenAI's route takes them); any other is refused by name
# (Ollama drops it: a misspelled `contents` was an empty turn).
MESSAGE_KEYS = ("role", "content", "thinking", "images", "tool_calls", "tool_name", "name", "tool_call_id")


def check_request(req: OllamaChatRequest | OllamaGenerateRequest, has_template: bool = True,
                  splits_reasoning: bool | None = None) -> None:
    """The request's fields checked before its model is leased (a bad request loads,
    unloads and keeps nothing): all that needs no model, which a chat without messages
    or a generate without a prompt (a load or unload) must pass too, as Ollama's do.
    `has_template`: the model's files hold a chat template; `splits_reasoning`: the
    server has a reasoning parser (None: known once the model is loaded).  What needs
    the model (the prompt's length against num_ctx, the format's grammar) is checked in
    OllamaServing.prepare."""
    if splits_reasoning is False:
        _check_think(req)
    req.num_predict()  # (each checks its option's value)
    req.num_ctx()
    if isinstance(req, OllamaChatRequest):
        translated = chat_request(req.model_copy(update={"messages": [*req.messages, {"role": "user", "content": "x"}]}))
    else:
        translated = generate_request(req.model_copy(update={"prompt": "x"}), has_template=has_template)
    try:
        translated.to_sampling_params()  # (the ranges the engine checks)
    except InvalidRequestError as e:
        raise as_ollama(OpenAIError(str(e), param=e.param)) from None


def _check_think(req: OllamaGenerating) -> None:
    """`think` on a server without a reasoning parser."""
    if req.think not in (None, False):
        raise OpenAIError("think: this server splits no thinking off its answers (start it with "
                          "--reasoning-parser for a thinking model); leave it unset or false", param="think")


def _chat_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Ollama's messages as OpenAI's: tool calls' arguments as JSON text (with ids), a
    tool result's `tool_name` as its name, images as image parts, `thinking` as the
    reasoning templates read."""
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise OpenAIError(f"messages[{i}] must be an object", param="messages")
        if m.get("role") not in ROLES:
            raise OpenAIError(f"messages[{i}].role must be one of {', '.join(ROLES)}, got {m.get('role')!r:.50}",
                              param="messages")
        if (error := part_key_error(m, "a message", MESSAGE_KEYS, {})) is not None:
            raise OpenAIError(f"messages[{i}]: {error}", param="messages")
        if not isinstance(m.get("content"), (str, type(None))):  # (Ollama's content is text; images beside it)
            raise OpenAIError(f"messages[{i}].content must be a string", param="messages")
        message: dict[str, Any] = {"role": m.get("role"),
                                   "content": _with_images(m.get("content") or "", m.get("images"), f"messages[{i}]")}
        calls = m.get("tool_calls")
        if calls:
            if not isinstance(calls, list):
                raise OpenAIError(f"messages[{i}].tool_calls must be a list", param="messages")
            message["tool_calls"] = [_openai_tool_call(c, f"messages[{i}].tool_calls[{j}]", f"call_{i}_{j}")
                                     for j, c in enumerate(calls)]
        for key in ("name", "tool_call_id"):  # (OpenAI's: its route checks them)
            if m.get(key) is not None:
                message[key] = m[key]
        if m.get("role") == "tool" and m.get("tool_name"):
            message["name"] = m["tool_name"]
        if m.get("thinking") is not None:  # (an answer's thinking sent back: templates render it, as Ollama's)
            if not isinstance(m["thinking"], str):
                raise OpenAIError(f"messages[{i}].thinking must be a string", param="messages")
            message["reasoning_content"] = m["thinking"]
        out.append(message)
    return out


def _openai_body(req: OllamaGenerating, **body: Any) -> dict[str, Any]:
    req.refused_fields()
    body.update(model=req.model, stream=req.stream, **req.sampling())
    if req.cache_salt is not None:
        body["cache_salt"] = req.cache_salt
    if req.stream:
        body["stream_options"] = {"include_usage": True}
    return body


def _thinking(req: OllamaGenerating) -> dict[str, Any]:
    """A chat body's fields for Ollama's `think`: false asks the template for no thinking
    (Qwen3's enable_thinking) and leaves any reasoning out of the answer."""
    return {"include_reasoning": False, "chat_template_kwargs": {"enable_thinking": False}} if req.think is False else {}


def chat_request(req: OllamaChatRequest) -> ChatCompletionRequest:
    """A final assistant turn with text (and no tool calls) is continued, as Ollama does:
    the answer picks up where that text ends (continue_final_message)."""
    messages = _chat_messages(req.messages)
    body = _openai_body(req, messages=messages, **_thinking(req))
    last = messages[-1]
    if last["role"] == "assistant" and last["content"] and isinstance(last["content"], str) and \
            "tool_calls" not in last:
        body.update(continue_final_message=True, add_generation_prompt=False)
    if req.tools:
        body["tools"] = req.tools
    return _validated(ChatCompletionRequest, body)


def generate_request(req: OllamaGenerateRequest, has_template: bool) -> ChatCompletionRequest | CompletionRequest:
    """A raw prompt is a completion, as is any prompt to a base model (no chat template:
    Ollama's template is then the prompt itself); any other is the model's chat
    template around a user turn (and `system`)."""
    for name in ("suffix", "template", "context"):
        if getattr(req, name):
            why = {"suffix": "fill-in-the-middle is not served", "context": "send the conversation to /api/chat "
                   "instead of token context", "template": "Go templates are not rendered here; send the prompt "
                   "already formatted" + (" (raw: true needs no template)" if req.raw else " with raw: true")}[name]
            raise OpenAIError(f"{name}: {why}", param=name)
    if req.raw or not has_template:
        if req.images:
            raise OpenAIError("images: " + ("a raw prompt" if req.raw else "this model") + " has no chat template "
                              "to place images in", param="images")
        if req.system:
            raise OpenAIError("system: " + ("a raw prompt" if req.raw else "this model") + " has no chat template "
                              "to put it in", param="system")
        if req.think not in (None, False):
            raise OpenAIError("think: " + ("a raw prompt" if req.raw else "this model") + " is completed as it is, "
                              "with no thinking block to split off", param="think")
        # (max_tokens unset: Ollama's default runs to the end, not the legacy endpoint's 16)
        return _validated(CompletionRequest, _openai_body(req, prompt=req.prompt or "", max_tokens=None))
    messages = ([{"role": "system", "content": req.system}] if req.system else []) + \
        [{"role": "user", "content": _with_images(req.prompt or "", req.images, "request")}]
    return _validated(ChatCompletionRequest, _openai_body(req, messages=messages, **_thinking(req)))


# The OpenAI field each Ollama option or field became, back to the name the client sent.
_OLLAMA_NAMES = {**{openai: f"options.{name}" for name, openai in SAMPLING_OPTIONS.items()},
                 "max_tokens": "options.num_predict", "response_format": "format"}


def as_ollama(e: OpenAIError) -> OpenAIError:
    """An OpenAI field's refusal under the Ollama name the client sent (`options.top_p`)."""
    name = _OLLAMA_NAMES.get(e.param or "")
    if name is None:
        return e
    text = renamed_text(e.message, e.param, name)
    e.message = text if text != e.message else f"{name}: {e.message}"
    e.param = "options" if name.startswith("options.") else name
    return e


def _validated(cls: type[Any], body: dict[str, Any]) -> Any:
    """The translated body as the OpenAI request model; a field it refuses is named as
    the client sent it (`options.temperature`, `messages.0.role`), not pydantic's dump."""
    try:
        return cls.model_validate(body)
    except ValidationError as e:
        first = e.errors()[0]
        loc = [str(p) for p in first["loc"]]
        name = _OLLAMA_NAMES.get(loc[0], ".".join(loc)) if loc else "request"
        param = name.split(".")[0] if not name.startswith("options.") else "options"
        raise OpenAIError(f"{name}: {first['msg']}", param=param) from None
    except ValueError as e:
        raise OpenAIError(f"cannot translate the request: {e}", param="options") from None


class OllamaServing:
    """/api/chat and /api/generate over the chat handler (and the completion handler for
    raw prompts): same engine, tools, limits and structured outputs."""

    def __init__(self, chat: OpenAIServingChat, completion: OpenAIServingCompletion, timing: Timing) -> None:
        self.chat, self.completion, self.timing = chat, completion, timing
        timing.mark_loaded()  # (made once the request's model is leased: loaded)

    def warn_unknown_fields(self, req: OllamaGenerating) -> None:
        self.chat.warn_unknown_fields(req, known=frozenset())  # (OpenAI's and vLLM's fields are not read here)

    def _handler(self, openai_request: Any) -> Any:
        return self.completion if isinstance(openai_request, CompletionRequest) else self.chat

    def prepare(self, req: OllamaChatRequest | OllamaGenerateRequest) -> PreparedOllama:
        has_template = self.chat.engine.chat_template is not None
        if self.chat.reasoning_parser is None:
            _check_think(req)
        if isinstance(req, OllamaChatRequest) and not has_template:
            raise OpenAIError(f"model '{req.model[:200]}' {NO_CHAT_TEMPLATE_HERE}", param="messages")
        openai_request = chat_request(req) if isinstance(req, OllamaChatRequest) else \
            generate_request(req, has_template)
        handler = self._handler(openai_request)
        try:
            prepared = handler.prepare(openai_request)
        except OpenAIError as e:  # (a range the engine checks: named as the client sent it)
            raise as_ollama(e) from None
        # The answer's room: the model's context (or Ollama's num_ctx window) after the
        # prompt; num_predict past it stops where the context is full, as Ollama's does.
        prompt_len, num_ctx = len(prepared.prompts[0].token_ids), req.num_ctx()
        if num_ctx is not None and prompt_len >= num_ctx:
            raise OpenAIError(f"the prompt is {prompt_len} tokens, options.num_ctx is {num_ctx}", param="options")
        room = min(num_ctx or handler.max_model_len, handler.max_model_len) - prompt_len
        params, num_predict = prepared.params, req.num_predict()
        req.check_repeat_shaping(params.repetition_penalty, params.presence_penalty, params.frequency_penalty)
        if room >= 1:  # (a prompt that alone fills the context is the engine's to refuse)
            params.max_tokens = min(params.max_tokens or room, room, num_predict or room)
        return PreparedOllama(openai_request, prepared)

    async def start(self, req: Any, prep: PreparedOllama) -> tuple[str, list[RequestStream]]:
        request_id, streams = await self._handler(prep.openai_request).start(prep.openai_request, prep.prepared)
        return request_id, timed(streams, self.timing)

    def _done(self, req: Any, finish_reason: str | None, usage: dict[str, Any]) -> dict[str, Any]:
        return {"done": True, "done_reason": _DONE_REASONS.get(finish_reason or "stop", finish_reason or "stop"),
                **self.timing.summary(usage.get("prompt_tokens", 0), usage.get("completion_tokens", 0))}

    def _piece(self, req: Any, text: str, calls: list[dict[str, Any]] | None = None,
               thinking: str | None = None) -> dict[str, Any]:
        """One answer line: text, tool calls, and the reasoning a --reasoning-parser split
        off (Ollama's `thinking`, unless the request said think false)."""
        head = {"model": req.model, "created_at": now_iso()}
        if isinstance(req, OllamaChatRequest):
            message: dict[str, Any] = {"role": "assistant", "content": text}
            if thinking:
                message["thinking"] = thinking
            if calls:
                message["tool_calls"] = calls
            return {**head, "message": message}
        return {**head, "response": text, **({"thinking": thinking} if thinking else {})}

    async def full(self, req: Any, prep: PreparedOllama, request_id: str, streams: list[RequestStream]) -> dict:
        handler = self._handler(prep.openai_request)
        r = (await handler.full(prep.openai_request, prep.prepared, request_id, streams)).model_dump()
        (choice,) = r["choices"]
        thinking = None
        if "message" in choice:
            text, thinking = choice["message"].get("content") or "", choice["message"].get("reasoning")
            calls = _tool_calls(choice["message"].get("tool_calls"))
        else:
            text, calls = choice.get("text") or "", []
        return {**self._piece(req, text, calls, thinking), **self._done(req, choice.get("finish_reason"), r["usage"])}

    async def stream(self, req: Any, prep: PreparedOllama, request_id: str,
                     streams: list[RequestStream]) -> AsyncIterator[str]:
        """NDJSON: a line per text fragment, a line of tool calls once they are complete, then the done line
        (an in-band error as {"error": ...}, which Ollama's clients raise)."""
        handler = self._handler(prep.openai_request)
        frames = handler.stream(prep.openai_request, prep.prepared, request_id, streams)
        calls: dict[int, dict[str, Any]] = {}
        finish: str | None = None
        async for chunk in sse_dicts(frames):
            if "error" in chunk:
                yield json.dumps({"error": chunk["error"].get("message", "error")}) + "\n"
                return
            for choice in chunk.get("choices", []):
                delta = choice.get("delta") or {}
                text = delta.get("content") if "delta" in choice else choice.get("text")
                for call in delta.get("tool_calls") or []:
                    entry = calls.setdefault(call.get("index", 0), {"function": {"name": "", "arguments": ""}})
                    function = call.get("function") or {}
                    entry["function"]["name"] += function.get("name") or ""
                    entry["function"]["arguments"] += function.get("arguments") or ""
                if delta.get("reasoning"):
                    yield json.dumps({**self._piece(req, "", thinking=delta["reasoning"]), "done": False}) + "\n"
                if text:
                    yield json.dumps({**self._piece(req, text), "done": False}) + "\n"
                finish = choice.get("finish_reason") or finish
            usage = chunk.get("usage")
            if usage is not None and not chunk.get("choices"):
                if calls:  # a line of their own before the done line, where Ollama sends them
                    piece = self._piece(req, "", _tool_calls([calls[i] for i in sorted(calls)]))
                    yield json.dumps({**piece, "done": False}) + "\n"
                yield json.dumps({**self._piece(req, ""), **self._done(req, finish, usage)}) + "\n"


class OllamaEmbedding:
    """/api/embed (and the older /api/embeddings) over the embeddings handler."""

    def __init__(self, embedding: OpenAIServingEmbedding, timing: Timing) -> None:
        self.embedding, self.timing = embedding, timing
        timing.mark_loaded()

    def warn_unknown_fields(self, req: Any) -> None:
        self.embedding.warn_unknown_fields(req, known=frozenset())

    def prepare(self, req: OllamaEmbedRequest | OllamaEmbeddingsRequest) -> PreparedOllama:
        """(`options` were checked by the route, before an empty input's shortcut.)"""
        body: dict[str, Any] = {"model": req.model}
        num_ctx = min(req.num_ctx() or self.embedding.max_model_len, self.embedding.max_model_len)
        if isinstance(req, OllamaEmbedRequest):
            body["input"] = req.input
            if req.truncate:  # the window's last tokens, as Ollama keeps the context's (-1: max_model_len)
                body["truncate_prompt_tokens"] = num_ctx if num_ctx < self.embedding.max_model_len else -1
            if req.dimensions is not None:
                body["dimensions"] = req.dimensions
        else:  # the older route's vectors are not normalised (Ollama's own; /api/embed's are)
            body.update(input=req.prompt, normalize=False)
        openai_request = _validated(EmbeddingRequest, body)
        prepared = self.embedding.prepare(openai_request)
        longest = max(len(p.token_ids) for p in prepared.prompts)
        # (past the model's own limit the engine refuses, in vLLM's words)
        if num_ctx < self.embedding.max_model_len and longest > num_ctx:
            cut = "send truncate true" if isinstance(req, OllamaEmbedRequest) else "ask /api/embed with truncate true"
            raise OpenAIError(f"the input length ({longest} tokens) exceeds the context length (options.num_ctx "
                              f"{num_ctx}); {cut} to cut it", param="options")
        return PreparedOllama(openai_request, prepared)

    async def start(self, req: Any, prep: PreparedOllama) -> tuple[str, list[RequestStream]]:
        request_id, streams = await self.embedding.start(prep.openai_request, prep.prepared)
        return request_id, timed(streams, self.timing)

    async def full(self, req: Any, prep: PreparedOllama, request_id: str, streams: list[RequestStream]) -> dict:
        r = (await self.embedding.full(prep.openai_request, prep.prepared, request_id, streams)).model_dump()
        vectors = [item["embedding"] for item in r["data"]]
        if isinstance(req, OllamaEmbeddingsRequest):
            return {"embedding": vectors[0]}
        timing = self.timing.summary(r["usage"]["prompt_tokens"], 0)
        return {"model": req.model, "embeddings": vectors, "total_duration": timing["total_duration"],
                "load_duration": timing["load_duration"], "prompt_eval_count": r["usage"]["prompt_tokens"]}

    def stream(self, req: Any, prep: PreparedOllama, request_id: str,
               streams: list[RequestStream]) -> AsyncIterator[str]:
        raise NotImplementedError  # (embeddings never stream)
