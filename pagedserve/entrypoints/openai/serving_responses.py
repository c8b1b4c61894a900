"""POST /v1/responses (OpenAI's Responses API, as vLLM serves it) as a translation onto
the chat handler, like entrypoints/anthropic: `instructions` and `input` items
(messages, function_call, function_call_output) become chat messages, function tools
and `text.format` become chat tools and response_format; the chat answer, or its
stream, comes back as output items (reasoning, message, function_call) and the typed
event sequence (response.created ... response.completed).

Responses are kept only with `--enable-responses-store` (vLLM keeps its store behind
VLLM_ENABLE_RESPONSES_API_STORE): then, unless a request says `store: false`, its
response and conversation are kept in a store bounded in entries and bytes, for
`GET /v1/responses/{id}` and for `previous_response_id`, which continues that
conversation.  Without it, `store: true` and `previous_response_id` are refused by name.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any, get_args

from pydantic import ValidationError

from pagedserve.engine.async_llm import RequestStream
from pagedserve.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    ChatCompletionResponse,
    ReasoningEffort,
    Verbosity,
)
from pagedserve.entrypoints.openai.protocol_fields import (
    FUNCTION_NAME,
    HintKeys,
    check_metadata,
    check_object_hint,
    json_schema_format_error,
    refuse_unsupported_fields,
    renamed_text,
)
from pagedserve.entrypoints.openai.protocol_responses import (
    CHAT_ONLY_FIELDS,
    ITEM_KEYS,
    PART_KEYS,
    RESPONSES_EXTRA_FIELDS,
    VLLM_CHAT_FIELDS,
    VLLM_REFUSED,
    ResponseOutput,
    ResponsesRequest,
    input_key_error,
    object_id,
    response_error,
)
from pagedserve.entrypoints.openai.responses_store import ResponseStore, input_items
from pagedserve.entrypoints.openai.serving_chat import OpenAIServingChat
from pagedserve.entrypoints.openai.serving_engine import OpenAIError, PreparedRequest
from pagedserve.errors import InvalidRequestError, PromptTooLongError

# Chat's names for fields whose Responses names differ.
_PARAM_NAMES = {"max_tokens": "max_output_tokens", "messages": "input", "response_format": "text"}
_TEXT_PARTS = tuple(kind for kind in PART_KEYS if kind != "input_image")


def _renamed(e: OpenAIError) -> OpenAIError:
    """A chat refusal in the Responses API's names, its text too (max_output_tokens)."""
    name = _PARAM_NAMES.get(e.param or "")
    if name is not None:
        e.message, e.param = renamed_text(e.message, e.param, name), name
    return e


@dataclass
class PreparedResponse:
    chat_request: ChatCompletionRequest
    prepared: PreparedRequest
    request: ResponsesRequest
    conversation: list[dict[str, Any]]  # the chat messages after the instructions, to store
    store: bool = False


def _text_of(content: Any, where: str, images: bool = False) -> str | list[dict[str, Any]]:
    """A content's text; with `images` (a message's content), input_image parts too: then
    chat's content parts, text and image_url (a data: URL, or an allowed http(s) one)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise OpenAIError(f"{where} must be a string or a list of text parts", param="input")
    parts: list[dict[str, Any]] = []
    for i, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else type(part).__name__
        if not (images and kind == "input_image" or isinstance(kind, str) and kind in _TEXT_PARTS):
            raise OpenAIError(f"{where}[{i}]: {repr(kind)[:100]} parts are not supported (text"
                              f"{' and input_image' if images else ''})", param="input")
        _check_keys(part, kind, f"{where}[{i}]")
        if kind == "input_image":
            if not isinstance(part.get("image_url"), str):
                raise OpenAIError(f"{where}[{i}]: an input_image needs its image_url (a data: URL; file_id is not "
                                  "supported)", param="input")
            detail = {} if part.get("detail") is None else {"detail": part["detail"]}  # (checked as chat's)
            parts.append({"type": "image_url", "image_url": {"url": part["image_url"], **detail}})
            continue
        if not isinstance(part.get("text"), str):
            raise OpenAIError(f"{where}[{i}]: an {kind} part needs its text (a string)", param="input")
        parts.append({"type": "text", "text": part["text"]})
    if any(p["type"] == "image_url" for p in parts):
        return parts
    return "\n".join(p["text"] for p in parts)


def _check_keys(part: dict[str, Any], kind: str, where: str) -> None:
    error = input_key_error(part, kind)
    if error is not None:
        raise OpenAIError(f"{where}: {error}", param="input")


def _chat_messages(req: ResponsesRequest) -> list[dict[str, Any]]:
    """The input items as chat messages (the instructions are not among them)."""
    messages: list[dict[str, Any]] = []
    if isinstance(req.input, str):
        return [{"role": "user", "content": req.input}]
    ids: set[str] = set()  # (input_items pages by id: a repeated one sent its pager round in a loop)
    for i, item in enumerate(req.input):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise OpenAIError(f"{where} must be an object", param="input")
        if item.get("id") is not None:
            key = item["id"] if isinstance(item["id"], str) else json.dumps(item["id"])
            if key in ids:
                raise OpenAIError(f"{where}: Duplicate item found with id {key[:100]}: each input item's id must be "
                                  "unique", param="input")
            ids.add(key)
        kind = item.get("type", "message")
        if isinstance(kind, str) and kind in ITEM_KEYS:
            _check_keys(item, kind, where)
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise OpenAIError(f"{where}.role must be user, system, developer or assistant", param="input")
            messages.append({"role": "system" if role == "developer" else role,
                             "content": _text_of(item.get("content"), f"{where}.content", images=True)})
        elif kind == "function_call":
            if not all(isinstance(item.get(k), str) for k in ("call_id", "name", "arguments")):
                raise OpenAIError(f"{where}: a function_call needs string call_id, name and arguments", param="input")
            call = {"id": item["call_id"], "type": "function",
                    "function": {"name": item["name"], "arguments": item["arguments"]}}
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant" and "tool_calls" in last:
                last["tool_calls"].append(call)  # parallel calls: one assistant turn
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            if not isinstance(item.get("call_id"), str):
                raise OpenAIError(f"{where}: a function_call_output needs its call_id", param="input")
            messages.append({"role": "tool", "tool_call_id": item["call_id"],
                             "content": _text_of(item.get("output", ""), f"{where}.output")})
        elif kind == "reasoning":
            continue  # an earlier answer's reasoning: not shown to the model again (as vLLM)
        else:
            raise OpenAIError(f"{where}: {repr(kind)[:100]} items are not supported (messages, function_call, "
                              "function_call_output and reasoning are)", param="input")
    return messages


def _text_format(text: dict[str, Any] | None) -> dict[str, Any] | None:
    """`text` ({"format": ..., "verbosity": ...}) as chat's response_format; verbosity is
    accepted without effect, as chat's."""
    text = text or {}
    try:
        check_object_hint("text", {k: v for k, v in text.items() if k != "format"},  # (format: below)
                          {"format": (), "verbosity": get_args(Verbosity)})
    except InvalidRequestError as e:
        raise OpenAIError(str(e), param="text") from None
    fmt = text.get("format")
    if fmt is not None and not isinstance(fmt, dict):
        raise OpenAIError("text.format must be an object", param="text")
    if fmt is None or fmt.get("type") == "text":
        return None
    if fmt.get("type") == "json_object":
        return {"type": "json_object"}
    if fmt.get("type") == "json_schema" and (error := json_schema_format_error(fmt)) is not None:
        raise OpenAIError(f"text.format json_schema {error}", param="text")
    if fmt.get("type") == "json_schema" and isinstance(fmt.get("schema"), dict):
        return {"type": "json_schema", "json_schema": {"name": fmt.get("name") or "output", "schema": fmt["schema"],
                                                       "strict": fmt.get("strict")}}
    raise OpenAIError('text.format must be {"type": "text"}, {"type": "json_object"} or {"type": "json_schema", '
                      '"name": NAME, "schema": {...}, "strict": true or false}', param="text")


# Responses' object-valued hints, accepted without effect (docs/serving.md), and the
# values of theirs refused as asking for what this server does not do.
_HINTS: dict[str, HintKeys] = {
    "reasoning": {"effort": get_args(ReasoningEffort), "summary": ("auto", "concise", "detailed"),
                  "generate_summary": ("auto", "concise", "detailed"),
                  "context": ("auto", "current_turn", "all_turns"), "mode": str},
    "stream_options": {"include_obfuscation": bool},
    "image": {"context_compression": ("auto", "enabled", "disabled")},
    "access_programs": {"cyber": ("standard", "daybreak_blue", "daybreak_red")},
}
_REFUSED_HINTS: dict[tuple[str, Any], str] = {
    ("context_compression", "enabled"): "images in the context are never compressed here",
    ("cyber", "daybreak_blue"): "this server has no access programs",
    ("cyber", "daybreak_red"): "this server has no access programs",
}


def _history(req: ResponsesRequest, store: ResponseStore | None) -> list[dict[str, Any]]:
    """The conversation of the response `previous_response_id` names (empty without one);
    it and `store` need the server's store: refused here when it has none."""
    if store is None and req.store:
        raise OpenAIError("store is not supported: responses are not kept on this server (start it with "
                          "--enable-responses-store, or send the whole conversation in input)", param="store")
    if req.previous_response_id is None:
        return []
    if store is None:
        raise OpenAIError("previous_response_id is not supported: responses are not kept on this server "
                          "(start it with --enable-responses-store, or send the whole conversation in input)",
                          param="previous_response_id")
    found = store.get(req.previous_response_id)
    if found is None:
        raise OpenAIError(f"no stored response {req.previous_response_id[:100]!r} (never stored, or dropped from the "
                          "bounded store)", status=404, param="previous_response_id")
    return found[1]


def _refuse_unsupported(req: ResponsesRequest) -> None:
    """Fields that would ask for output this server never makes: refused rather than
    ignored; those accepted without effect held to OpenAI's shapes."""
    try:
        req.check_openai_fields()
        req.check_include()
        refuse_unsupported_fields(req.model_extra, {**VLLM_REFUSED, **CHAT_ONLY_FIELDS})
        check_metadata(req.metadata)
        for name, keys in _HINTS.items():
            check_object_hint(name, getattr(req, name), keys, _REFUSED_HINTS)
    except InvalidRequestError as e:
        raise OpenAIError(str(e), param=e.param) from None
    if req.stream_options is not None and not req.stream:
        raise OpenAIError("stream_options can only be set when stream is true", param="stream_options")
    if req.max_tool_calls is not None and req.max_tool_calls < 0:
        raise OpenAIError("max_tool_calls must be at least 0", param="max_tool_calls")
    if req.background:
        raise OpenAIError("background responses are not supported", param="background")
    if req.top_logprobs:
        raise OpenAIError("top_logprobs is not supported on /v1/responses (use /v1/chat/completions)",
                          param="top_logprobs")
    if req.prediction is not None:  # (a client that sent it expects it used: not ignored)
        raise OpenAIError("prediction is a Chat Completions and Completions field; OpenAI's Responses API has none "
                          "(send predicted outputs to /v1/chat/completions)", param="prediction")


_TOOL_KEYS = ("type", "name", "description", "parameters", "strict")


def _chat_tools(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]]:
    """Responses' flat function tools in chat's nested shape (only function tools exist
    here), each named by OpenAI's rule, once, with no key OpenAI's function tools lack."""
    out, names = [], set()
    for i, tool in enumerate(tools or []):
        if tool.get("type") != "function":
            raise OpenAIError(f"tools[{i}]: only function tools are supported ({repr(tool.get('type'))[:100]} is not)",
                              param="tools")
        name = tool.get("name")
        if not isinstance(name, str) or not FUNCTION_NAME.fullmatch(name):
            raise OpenAIError(f"tools[{i}].name must match ^[a-zA-Z0-9_-]{{1,64}}$, got {name!r:.80}", param="tools")
        if name in names:
            raise OpenAIError(f"tools[{i}]: tool names must be unique ({name!r} is given twice)", param="tools")
        names.add(name)
        if extra := [k for k in tool if k not in _TOOL_KEYS]:
            raise OpenAIError(f"tools[{i}].{extra[0][:60]} is not supported here", param="tools")
        out.append({"type": "function", "function": {k: tool[k] for k in _TOOL_KEYS[1:] if tool.get(k) is not None}})
    return out


def _check_outputs_answer_calls(conversation: list[dict[str, Any]]) -> None:
    """Each function_call_output answers an earlier function_call, and each function_call
    has its output (OpenAI's two refusals: "No tool call found for function call output
    with call_id ...", "No tool output found for function call ..."; without the second the
    model saw a call that was never answered)."""
    unanswered: dict[str, None] = {}  # (in order: the first is named)
    answered: set[str] = set()
    for m in conversation:
        unanswered.update((c.get("id"), None) for c in m.get("tool_calls") or () if isinstance(c, dict))
        if m.get("role") == "tool":
            if m.get("tool_call_id") not in unanswered and m.get("tool_call_id") not in answered:
                raise OpenAIError(f"No tool call found for function call output with call_id "
                                  f"{str(m.get('tool_call_id'))[:100]}.", param="input")
            unanswered.pop(m.get("tool_call_id"), None)
            answered.add(m.get("tool_call_id"))
    if unanswered:
        raise OpenAIError(f"No tool output found for function call {str(next(iter(unanswered)))[:100]}.",
                          param="input")


def _chat_tool_choice(choice: str | dict[str, Any] | None) -> str | dict[str, Any] | None:
    """A named function choice in chat's nested shape; the string modes are the same in both."""
    if not isinstance(choice, dict):
        return choice
    if choice.get("type") != "function" or not isinstance(choice.get("name"), str):
        raise OpenAIError('tool_choice must be "auto", "none", "required" or {"type": "function", "name": ...}',
                          param="tool_choice")
    return {"type": "function", "function": {"name": choice["name"]}}


def to_chat_request(req: ResponsesRequest, store: ResponseStore | None = None
                    ) -> tuple[ChatCompletionRequest, list[dict[str, Any]]]:
    """The chat request that asks for the same answer, and its conversation after the
    instructions (a previous response's conversation first)."""
    history = _history(req, store)
    _refuse_unsupported(req)
    conversation = [*history, *_chat_messages(req)]
    _check_outputs_answer_calls(conversation)
    system = [{"role": "system", "content": req.instructions}] if req.instructions is not None else []
    body: dict[str, Any] = {"model": req.model, "messages": [*system, *conversation], "stream": bool(req.stream)}
    if req.stream:
        body["stream_options"] = {"include_usage": True}
    tools = _chat_tools(req.tools)
    if tools:
        body["tools"] = tools
    choice = _chat_tool_choice(req.tool_choice)
    for name, value in (("tool_choice", choice), ("parallel_tool_calls", req.parallel_tool_calls),
                        ("max_tokens", req.max_output_tokens), ("temperature", req.temperature),
                        ("top_p", req.top_p), ("user", req.user), ("response_format", _text_format(req.text)),
                        *((name, (req.model_extra or {}).get(name)) for name in VLLM_CHAT_FIELDS)):
        if value is not None:
            body[name] = value
    try:
        return ChatCompletionRequest.model_validate(body), conversation
    except ValidationError as e:
        first = e.errors()[0] if e.errors() else {}
        raised = first.get("ctx", {}).get("error")
        name = raised.param if isinstance(raised, InvalidRequestError) else (first.get("loc") or (None,))[0]
        where = ".".join(str(x) for x in first.get("loc", ()))
        raise OpenAIError(f"cannot translate the request: {raised or f'{where}: ' + first.get('msg', '')}",
                          param=_PARAM_NAMES.get(str(name), str(name)) if name else "input") from None


class OpenAIServingResponses:
    """The Responses endpoint over the chat handler (same engine, tools and limits)."""

    def __init__(self, chat: OpenAIServingChat, store: ResponseStore | None = None) -> None:
        self.chat = chat
        self.store = store

    def warn_unknown_fields(self, req: ResponsesRequest) -> None:
        self.chat.warn_unknown_fields(req, known=RESPONSES_EXTRA_FIELDS)

    def prepare(self, req: ResponsesRequest) -> PreparedResponse:
        chat_request, conversation = to_chat_request(req, self.store)
        keep = self.store is not None and req.store is not False
        if keep and self.store is not None and not self.store.has_room(conversation, input_items(req)):
            # (it answered "store": true and was never kept: a chain on it broke with a 404)
            raise OpenAIError(f"the conversation is larger than the response store ({self.store.max_bytes} bytes) "
                              "can keep: send store: false, or a shorter conversation", param="store")
        auto = req.truncation == "auto"
        try:
            try:
                prepared: PreparedRequest | None = self.chat.prepare(chat_request)
            except OpenAIError as e:  # (a prompt too long by its characters, or with max_output_tokens)
                if not (auto and e.code == PromptTooLongError.code) or (req.max_output_tokens or 0) >= self.chat.max_model_len:
                    raise  # (no cut makes room for a budget the context cannot hold)
                prepared = None
            if auto and (prepared is None or not self._fits(prepared, req)):
                chat_request, prepared = self._truncated(req, chat_request, len(conversation))
        except OpenAIError as e:
            raise _renamed(e) from None
        return PreparedResponse(chat_request, prepared, req, conversation, keep)

    def _fits(self, prepared: PreparedRequest, req: ResponsesRequest) -> bool:
        return len(prepared.prompts[0].token_ids) + (req.max_output_tokens or 1) <= self.chat.max_model_len

    def _truncated(self, req: ResponsesRequest, chat_request: ChatCompletionRequest,
                   num_items: int) -> tuple[ChatCompletionRequest, PreparedRequest]:
        """truncation "auto": the conversation without as few of its first items as make it
        fit the context (OpenAI's rule; the instructions stay, and a tool result is never
        left without its call), found by bisection: log2(items) renders."""
        messages = chat_request.messages
        head, items = messages[: len(messages) - num_items], messages[len(messages) - num_items:]

        def attempt(k: int) -> tuple[ChatCompletionRequest, PreparedRequest] | None:
            rest = items[k:]
            while rest and rest[0].role == "tool":  # (its call was cut)
                rest = rest[1:]
            if not rest:
                return None
            shorter = chat_request.model_copy(update={"messages": [*head, *rest]})
            try:
                prepared = self.chat.prepare(shorter)
            except OpenAIError:
                return None  # (the context-length refusal of a prompt still too long)
            return (shorter, prepared) if self._fits(prepared, req) else None

        lo, hi, best = 1, len(items) - 1, None
        while lo <= hi:
            mid = (lo + hi) // 2
            if (found := attempt(mid)) is not None:
                best, hi = found, mid - 1
            else:
                lo = mid + 1
        if best is None:
            raise OpenAIError(f"truncation auto: even the conversation's last item does not fit the model's context "
                              f"({self.chat.max_model_len} tokens with max_output_tokens)", param="input")
        return best

    async def start(self, req: ResponsesRequest, prep: PreparedResponse) -> tuple[str, list[RequestStream]]:
        try:
            _, streams = await self.chat.start(prep.chat_request, prep.prepared)
        except OpenAIError as e:
            raise _renamed(e) from None
        return object_id("resp"), streams

    def reasoning_tokens(self, reasoning: str | None) -> int:
        """The tokens of the reasoning a --reasoning-parser split off (its text's, tokenized)."""
        return len(self.chat.tokenizer.encode(reasoning, add_special_tokens=False)) if reasoning else 0

    def response(self, response_id: str, prep: PreparedResponse, created: float, out: ResponseOutput,
                 done: bool = True) -> dict[str, Any]:
        """The response object (OpenAI's `Response`) for what `out` holds."""
        req = prep.request
        incomplete = done and out.finish_reason == "length"
        usage = None
        if out.usage is not None:
            cached = (out.usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
            usage = {"input_tokens": out.usage["prompt_tokens"], "output_tokens": out.usage["completion_tokens"],
                     "input_tokens_details": {"cached_tokens": cached, "cache_write_tokens": 0},  # (the SDK's)
                     "output_tokens_details": {"reasoning_tokens": self.reasoning_tokens(out.reasoning)},
                     "total_tokens": out.usage["prompt_tokens"] + out.usage["completion_tokens"]}
        status = ("incomplete" if incomplete else "completed") if done else "in_progress"
        return {
            "id": response_id, "object": "response", "created_at": int(created), "model": prep.prepared.model,
            "status": status, "completed_at": int(time.time()) if status == "completed" else None,
            "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None, "error": None,
            "output": out.items() if done else [], "usage": usage,
            "instructions": req.instructions, "max_output_tokens": req.max_output_tokens,
            "temperature": req.temperature, "top_p": req.top_p, "reasoning": req.reasoning or {"effort": None},
            "tools": [{**t, "strict": t.get("strict", True)} if t.get("type") == "function" else t  # (always, here)
                      for t in req.tools or []],
            "tool_choice": req.tool_choice if req.tool_choice is not None else "auto",
            "parallel_tool_calls": req.parallel_tool_calls is not False,
            "text": {"format": {"type": "text"}, **(req.text or {})}, "metadata": req.metadata or {},
            "previous_response_id": req.previous_response_id, "store": prep.store, "user": req.user,
            "truncation": req.truncation or "disabled",
            # The request's other settings, as OpenAI echoes them (accepted without effect;
            # service_tier: the tier that served it, this server's one).
            "background": False, "max_tool_calls": req.max_tool_calls, "top_logprobs": req.top_logprobs or 0,
            "service_tier": "default", "safety_identifier": req.safety_identifier,
            "prompt_cache_key": req.prompt_cache_key, "prompt_cache_retention": req.prompt_cache_retention,
            "prompt_cache_options": req.prompt_cache_options, "image": req.image, "access_programs": req.access_programs,
        }

    def finished(self, prep: PreparedResponse, response: dict[str, Any], out: ResponseOutput) -> dict[str, Any]:
        """Keep a finished response (when the store is on and the request allows it)."""
        if prep.store and self.store is not None and \
                not self.store.put(response, [*prep.conversation, out.chat_message()], input_items(prep.request)):
            response["store"] = False  # (its answer took it past the store's bytes: not kept, and said so)
        return response

    async def full(self, req: ResponsesRequest, prep: PreparedResponse, response_id: str,
                   streams: list[RequestStream]) -> dict[str, Any]:
        created = time.time()
        r: ChatCompletionResponse = await self.chat.full(prep.chat_request, prep.prepared, response_id, streams)
        (choice,) = r.choices
        out = ResponseOutput(reasoning=choice.message.reasoning_content or "", text=choice.message.content or "",
                      calls=[{"call_id": c.id, "name": c.function.name, "arguments": c.function.arguments}
                             for c in choice.message.tool_calls or []],
                      finish_reason=choice.finish_reason, usage=r.usage.model_dump())
        return self.finished(prep, self.response(response_id, prep, created, out), out)

    async def stream(self, req: ResponsesRequest, prep: PreparedResponse, response_id: str,
                     streams: list[RequestStream]) -> AsyncIterator[str]:
        """The chat handler's chunks, re-said as the Responses API's typed events."""
        events = _EventWriter(self, response_id, prep)
        yield events.emit("response.created", response=self.response(response_id, prep, events.created, events.out,
                                                                      done=False))
        yield events.emit("response.in_progress", response=self.response(response_id, prep, events.created,
                                                                          events.out, done=False))
        async for chunk in self.chat.chunks(prep.chat_request, prep.prepared, response_id, streams, calls_last=True):
            for event in events.on_chunk(chunk):
                yield event


class _EventWriter:
    """Turns one choice's chat chunks into output items opened, filled and closed in
    order (reasoning, then the message's text, then each function call)."""

    def __init__(self, serving: OpenAIServingResponses, response_id: str, prep: PreparedResponse) -> None:
        self.serving, self.response_id, self.prep = serving, response_id, prep
        self.created = time.time()
        self.out = ResponseOutput()
        self.sequence = 0
        self.open: str | None = None  # "reasoning", "message" or "function_call"
        self.index = -1  # the open item's output_index

    def emit(self, kind: str, **data: Any) -> str:
        event = {"type": kind, "sequence_number": self.sequence, **data}
        self.sequence += 1
        return f"event: {kind}\ndata: {json.dumps(event)}\n\n"

    def _close(self) -> list[str]:
        kind, self.open = self.open, None
        if kind is None:
            return []
        status = self.out.done_status()  # (an item closed before the end is completed)
        if kind in ("reasoning", "message"):  # an item of one content part: its text done, the part, the item
            item = self.out.reasoning_item(status) if kind == "reasoning" else self.out.message_item(status)
            part = item["content"][0]
            text_done = (self.emit("response.reasoning_text.done", item_id=item["id"], output_index=self.index,
                                   content_index=0, text=part["text"]) if kind == "reasoning" else
                         self.emit("response.output_text.done", item_id=item["id"], output_index=self.index,
                                   content_index=0, text=part["text"], logprobs=[]))
            return [text_done,
                    self.emit("response.content_part.done", item_id=item["id"], output_index=self.index,
                              content_index=0, part=part),
                    self.emit("response.output_item.done", output_index=self.index, item=item)]
        item = self.out.call_item(len(self.out.calls) - 1, status)
        return [self.emit("response.function_call_arguments.done", item_id=item["id"], output_index=self.index,
                          name=item["name"], arguments=item["arguments"]),
                self.emit("response.output_item.done", output_index=self.index, item=item)]

    def _open(self, kind: str, item: dict[str, Any]) -> list[str]:
        out = self._close()
        self.open, self.index = kind, self.index + 1
        out.append(self.emit("response.output_item.added", output_index=self.index, item=item))
        if kind in ("reasoning", "message"):  # (their one content part, empty: the deltas fill it)
            part = {"type": "reasoning_text", "text": ""} if kind == "reasoning" else \
                {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
            out.append(self.emit("response.content_part.added", item_id=item["id"], output_index=self.index,
                                 content_index=0, part=part))
        return out

    def on_chunk(self, chunk: dict[str, Any]) -> list[str]:
        out: list[str] = []
        if "error" in chunk:  # the error, then the response failed with it (where the SDK looks)
            err = chunk["error"]
            failed = self.serving.response(self.response_id, self.prep, self.created, self.out)
            failed.update(status="failed", output=[], error=response_error(err))
            return [self.emit("error", code=err.get("code"), message=err.get("message", ""), param=err.get("param")),
                    self.emit("response.failed", response=failed)]
        for choice in chunk.get("choices", []):
            delta = choice.get("delta") or {}
            if delta.get("reasoning_content"):
                if self.open != "reasoning":
                    out += self._open("reasoning", {**self.out.reasoning_item("in_progress"), "content": []})
                self.out.reasoning += delta["reasoning_content"]
                out.append(self.emit("response.reasoning_text.delta", item_id=self.out.item_id("reasoning"),
                                     output_index=self.index, content_index=0, delta=delta["reasoning_content"]))
            if delta.get("content"):
                if self.open != "message":
                    out += self._open("message", {**self.out.message_item("in_progress"), "content": []})
                self.out.text += delta["content"]
                out.append(self.emit("response.output_text.delta", item_id=self.out.item_id("message"),
                                     output_index=self.index, content_index=0, delta=delta["content"], logprobs=[]))
            for call in delta.get("tool_calls") or []:
                function = call.get("function") or {}
                if call.get("id"):  # a new call
                    out += self._close()
                    self.out.calls.append({"call_id": call["id"], "name": function.get("name", ""), "arguments": ""})
                    out += self._open("function_call", self.out.call_item(len(self.out.calls) - 1, "in_progress"))
                if function.get("arguments"):
                    self.out.calls[-1]["arguments"] += function["arguments"]
                    out.append(self.emit("response.function_call_arguments.delta",
                                         item_id=self.out.item_id(f"function_call:{len(self.out.calls) - 1}"),
                                         output_index=self.index, delta=function["arguments"]))
            if choice.get("finish_reason") is not None:
                self.out.finish_reason = choice["finish_reason"]
                out += self._close()
        if chunk.get("usage") is not None and not chunk.get("choices"):
            self.out.usage = chunk["usage"]
            final = self.serving.finished(self.prep, self.serving.response(self.response_id, self.prep, self.created,
                                                                           self.out), self.out)
            out.append(self.emit(f"response.{final['status']}", response=final))  # completed or incomplete
        return out
