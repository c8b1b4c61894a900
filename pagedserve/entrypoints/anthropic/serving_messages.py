"""POST /v1/messages (Anthropic's Messages API) as a translation, not a second path: the
request becomes an OpenAI chat request (system -> a system message, tool_use and
tool_result blocks -> tool_calls and tool messages, tools and tool_choice -> function
tools), which the chat handler prepares, starts and answers; its answer, or its
stream of chunks, is translated back into Anthropic's message and event sequence
(message_start, content_block_start/delta/stop per thinking, text or tool_use block,
message_delta with the stop reason and usage, message_stop)."""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any, Literal

from pagedserve.engine.async_llm import RequestStream
from pagedserve.entrypoints.anthropic.protocol import (
    AnthropicMessage,
    AnthropicTool,
    AnthropicToolChoice,
    AnthropicUsage,
    CountTokensRequest,
    MessagesRequest,
    MessagesResponse,
    Thinking,
    anthropic_error_body,
    block_key_error,
    image_source_url,
)
from pagedserve.entrypoints.openai.protocol import ChatCompletionRequest, ChatCompletionResponse
from pagedserve.entrypoints.openai.protocol_fields import (
    check_hint_strings,
    check_object_hint,
    refuse_unsupported_fields,
    refuse_vllm_fields,
    renamed_text,
)
from pagedserve.entrypoints.openai.serving_chat import OpenAIServingChat
from pagedserve.entrypoints.openai.serving_engine import OpenAIError, PreparedRequest
from pagedserve.entrypoints.openai.tool_parsers import arguments_object
from pagedserve.errors import InvalidRequestError

# Chat's names for the fields whose Anthropic names differ (errors name what the client sent).
_PARAM_NAMES = {"stop": "stop_sequences", "thinking_token_budget": "thinking.budget_tokens"}
_STOP_REASONS = {"length": "max_tokens", "tool_calls": "tool_use"}


@dataclass
class PreparedMessages:
    chat_request: ChatCompletionRequest
    prepared: PreparedRequest
    thinking: Thinking


def _field(where: str) -> str:
    """The request field a location names (`system[0].cache_control`: system)."""
    return where.split("[")[0].split(".")[0]


def _check_cache_control(value: Any, where: str) -> None:
    """A cache_control hint (top level, a tool's, a block's) held to Anthropic's values:
    what the prefix cache always does here."""
    param = _field(where)
    if value is not None and not isinstance(value, dict):
        raise OpenAIError(f"{where} must be an object such as {{'type': 'ephemeral'}}", param=param)
    try:
        check_object_hint(where, value, {"type": ("ephemeral",), "ttl": ("5m", "1h")})
    except InvalidRequestError as e:
        raise OpenAIError(str(e), param=param) from None


def _text_of(blocks: str | list[dict[str, Any]], where: str) -> str:
    """The text of a string or of text blocks (a system prompt, a tool result)."""
    if isinstance(blocks, str):
        return blocks
    if not isinstance(blocks, list):
        raise OpenAIError(f"{where} must be a string or a list of text blocks", param=_field(where))
    parts = []
    for i, block in enumerate(blocks):
        if not isinstance(block, dict) or block.get("type") != "text" or not isinstance(block.get("text"), str):
            raise OpenAIError(f"{where}[{i}]: only text blocks ({{'type': 'text', 'text': ...}}) are supported here",
                              param=_field(where))
        _check_block(block, f"{where}[{i}]")
        _check_text(block["text"], f"{where}[{i}]")
        parts.append(block["text"])
    return "\n".join(parts)


def _check_block(block: dict[str, Any], where: str) -> None:
    """A block's keys (those of a type this server reads) and its cache_control hint."""
    error = block_key_error(block)
    if error is not None:
        raise OpenAIError(f"{where}: {error}", param=_field(where))
    _check_cache_control(block.get("cache_control"), f"{where}.cache_control")


def _check_text(text: str, where: str) -> None:
    """Anthropic's rule on a text block: some text that is not whitespace."""
    if not text.strip():
        raise OpenAIError(f"{where}: text content blocks must " + ("be non-empty" if not text else
                                                                  "contain non-whitespace text"),
                          param=_field(where))


def _chat_messages(system: str | list[dict[str, Any]] | None,
                   messages: list[AnthropicMessage]) -> list[dict[str, Any]]:
    """Anthropic's conversation as OpenAI chat messages."""
    out: list[dict[str, Any]] = []
    if system:  # ("" and [] are no system prompt, as Anthropic reads them: the template's default stays)
        out.append({"role": "system", "content": _text_of(system, "system")})
    tool_use_ids: set[str] = set()  # the calls made so far: a tool_result answers one of them
    unanswered: list[str] = []  # the previous assistant turn's tool_use ids: the next turn answers each
    for m, msg in enumerate(messages):
        previous = unanswered
        unanswered = [b["id"] for b in msg.content if isinstance(b, dict) and b.get("type") == "tool_use"
                      and isinstance(b.get("id"), str)] if msg.role == "assistant" and isinstance(msg.content, list) else []
        final_assistant = msg.role == "assistant" and m == len(messages) - 1  # (may be empty: nothing prefilled)
        if isinstance(msg.content, str):
            _check_answered(previous, msg, m)
            if not final_assistant:
                _check_text(msg.content, f"messages[{m}].content")
            out.append({"role": msg.role, "content": msg.content})
            continue
        if not msg.content and not final_assistant:
            raise OpenAIError(f"messages[{m}].content is an empty list (send a string or content blocks)",
                              param="messages")
        turn = _Turn()
        for b, block in enumerate(msg.content):
            turn.add(block, msg.role, f"messages[{m}].content[{b}]", tool_use_ids, out)
        _check_answered(previous, msg, m)  # (after the blocks: a tool_result naming no call says so first)
        if len(turn.parts) > len(turn.texts):  # images: the content stays parts
            out.append({"role": msg.role, "content": turn.parts})
        elif turn.texts or turn.calls or msg.role == "assistant":
            message: dict[str, Any] = {"role": msg.role, "content": "\n".join(turn.texts) if turn.texts else None}
            if turn.calls:
                message["tool_calls"] = turn.calls
            out.append(message)
    _check_answered(unanswered, None, len(messages))
    out = _merged(out)
    last = out[-1] if out else None
    if last is not None and last["role"] == "assistant" and isinstance(last.get("content"), str) \
            and last["content"] != last["content"].rstrip():
        raise OpenAIError("final assistant content cannot end with trailing whitespace", param="messages")
    return out


def _merged(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Consecutive user (or assistant) turns of text as one turn, as Anthropic combines
    them (a chat template would otherwise render each as a turn of its own).  A run's
    texts are joined once it ends: joined at each turn, 52,000 one-line turns (a 16 MB
    body) took 81 s of a core before the prompt's size was judged."""
    out: list[dict[str, Any]] = []
    texts: list[str] = []
    run = False  # whether out[-1] is a run of turns, its content "\n".join(texts) once it ends
    for message in messages:
        prev = out[-1] if out else None
        if prev is not None and prev["role"] == message["role"] in ("user", "assistant") \
                and not prev.get("tool_calls") and (run or isinstance(prev["content"], str)) \
                and isinstance(message["content"], (str, type(None))):
            if not run:
                texts, run = [prev["content"]] if prev["content"] else [], True
            texts += [message["content"]] if message["content"] else []
            out[-1] = message  # (its other keys, a call, are the run's: a call ends it)
            continue
        if run:
            out[-1], run = {**out[-1], "content": "\n".join(texts)}, False
        out.append(message)
    if run:
        out[-1] = {**out[-1], "content": "\n".join(texts)}
    return out


def _check_answered(tool_use_ids: list[str], msg: AnthropicMessage | None, m: int) -> None:
    """Anthropic's rule: each tool_use of an assistant turn has its tool_result in the
    next message (`msg`, the m-th; None: the conversation ended there)."""
    if not tool_use_ids:
        return
    answered = {b.get("tool_use_id") for b in msg.content if isinstance(b, dict) and b.get("type") == "tool_result"} \
        if msg is not None and msg.role == "user" and isinstance(msg.content, list) else set()
    missing = [i for i in tool_use_ids if i not in answered]
    if missing:
        raise OpenAIError(f"messages[{m - 1}]: tool_use ids were found without tool_result blocks immediately after: "
                          f"{', '.join(i[:100] for i in missing[:5])}; each tool_use block needs its tool_result "
                          "block in the next message", param="messages")


@dataclass
class _Turn:
    """One Anthropic message's blocks, gathered as chat's: its texts, its parts (text and
    images, in order, for a message with an image) and its tool calls."""

    texts: list[str] = field(default_factory=list)
    parts: list[dict[str, Any]] = field(default_factory=list)
    calls: list[dict[str, Any]] = field(default_factory=list)

    def add(self, block: dict[str, Any], role: str, where: str, tool_use_ids: set[str],
            out: list[dict[str, Any]]) -> None:
        """One block; a tool_result becomes its own tool message in `out` at once."""
        kind = block.get("type")
        _check_block(block, where)
        if kind == "text":
            if not isinstance(block.get("text"), str):
                raise OpenAIError(f"{where}: a text block's text must be a string", param="messages")
            _check_text(block["text"], where)
            self.texts.append(block["text"])
            self.parts.append({"type": "text", "text": block["text"]})
        elif kind == "image" and role == "user":
            try:
                url = image_source_url(block.get("source"), where)
            except InvalidRequestError as e:
                raise OpenAIError(str(e), param=e.param) from None
            self.parts.append({"type": "image_url", "image_url": {"url": url}})
        elif kind == "tool_use" and role == "assistant":
            if not isinstance(block.get("id"), str) or not isinstance(block.get("name"), str) \
                    or not isinstance(block.get("input"), dict):
                raise OpenAIError(f"{where}: a tool_use block needs a string id and name and an object input",
                                  param="messages")
            if block["id"] in tool_use_ids:
                raise OpenAIError(f"{where}: tool_use ids must be unique ({block['id'][:100]!r} is given twice)",
                                  param="messages")
            tool_use_ids.add(block["id"])
            self.calls.append({"id": block["id"], "type": "function", "function": {
                "name": block["name"], "arguments": json.dumps(block.get("input", {}))}})
        elif kind == "tool_result" and role == "user":
            if not isinstance(block.get("tool_use_id"), str):
                raise OpenAIError(f"{where}: a tool_result block needs its tool_use_id", param="messages")
            if self.parts:  # (Anthropic's rule: the prompt writes the results first, so text before one moved)
                raise OpenAIError(f"{where}: tool_result blocks must come before any other content of their "
                                  "message", param="messages")
            if block["tool_use_id"] not in tool_use_ids:
                raise OpenAIError(f"{where}: tool_use_id {block['tool_use_id'][:100]!r} answers no earlier "
                                  "tool_use block", param="messages")
            if not isinstance(block.get("is_error", False), bool):
                raise OpenAIError(f"{where}.is_error must be true or false", param="messages")
            result = _text_of(block.get("content", ""), f"{where}.content")
            out.append({"role": "tool", "tool_call_id": block["tool_use_id"],
                        "content": f"Error: {result}" if block.get("is_error") else result})
        elif isinstance(kind, str) and kind in THINKING_BLOCKS and role == "assistant":  # (a list is no key)
            # An earlier answer's thinking, sent back as Anthropic's clients do: checked, and
            # left out of the prompt (Anthropic leaves earlier turns' thinking out of the context).
            if not isinstance(block.get(THINKING_BLOCKS[kind]), str):
                raise OpenAIError(f"{where}: a {kind} block needs its {THINKING_BLOCKS[kind]} (a string)",
                                  param="messages")
        else:
            raise OpenAIError(f"{where}: {repr(kind)[:100]} blocks are not supported in {role} messages (this server "
                              "reads text, image and tool_result in user turns, text, tool_use and thinking in "
                              "assistant turns)", param="messages")


# An assistant turn's thinking blocks, as a client sends an earlier answer back: the key holding each one's text.
THINKING_BLOCKS = {"thinking": "thinking", "redacted_thinking": "data"}


# Anthropic's fields for what this server has nothing behind: refused by name (they are
# not modelled, so they arrive among a body's extra fields), never ignored.
UNSUPPORTED_FIELDS = {
    "mcp_servers": "this server connects to no MCP servers",
    "container": "this server runs no code-execution containers",
    "context_management": "this server does not edit a conversation's context",
    "diagnostics": "this server reports no prompt-cache diagnostics",
}
_EFFORTS = ("low", "medium", "high", "xhigh", "max")
MAX_USER_ID_CHARS = 256  # Anthropic's bound on metadata.user_id


def check_fields(req: MessagesRequest | CountTokensRequest) -> None:
    """Fields this server has nothing behind refused by name; those accepted without
    effect held to Anthropic's values."""
    try:
        refuse_unsupported_fields(req.model_extra, UNSUPPORTED_FIELDS)
        refuse_vllm_fields(req.model_extra)  # (vLLM's OpenAI fields: logged as unknown, use_beam_search ignored)
        _check_cache_control(req.cache_control, "cache_control")
        check_object_hint("output_config", {k: v for k, v in (req.output_config or {}).items() if k != "format"},
                          {"format": (), "effort": _EFFORTS})  # (its format: _output_config)
        check_hint_strings(("user_profile_id", req.user_profile_id), ("workspace_id", req.workspace_id))
        if not isinstance(req, MessagesRequest):
            return
        check_hint_strings(("inference_geo", req.inference_geo))
    except InvalidRequestError as e:
        raise OpenAIError(str(e), param=e.param) from None
    meta = req.metadata or {}
    if set(meta) - {"user_id"} or not isinstance(meta.get("user_id", ""), (str, type(None))) \
            or len(meta.get("user_id") or "") > MAX_USER_ID_CHARS:
        raise OpenAIError(f"metadata takes user_id alone, a string of at most {MAX_USER_ID_CHARS} characters",
                          param="metadata")


ANTHROPIC_TOOL_NAME = re.compile(r"[a-zA-Z0-9_-]{1,128}")  # Anthropic's rule for tool names


def check_tools(tools: list[AnthropicTool]) -> None:
    """Client tools only, each named as Anthropic names them (once), with an object
    input_schema; any other key (a server tool's type, beta fields) refused by name."""
    seen: set[str] = set()
    for i, tool in enumerate(tools):
        if tool.type not in (None, "custom"):
            raise OpenAIError(f"tools[{i}]: server tools ({tool.type[:60]!r}) are not supported: this server runs "
                              "client tools only (name, description, input_schema)", param="tools")
        if tool.model_extra:
            raise OpenAIError(f"tools[{i}].{next(iter(tool.model_extra))[:60]} is not supported here", param="tools")
        if not ANTHROPIC_TOOL_NAME.fullmatch(tool.name):
            raise OpenAIError(f"tools[{i}].name must match ^[a-zA-Z0-9_-]{{1,128}}$, got {tool.name[:60]!r}",
                              param="tools")
        if tool.name in seen:
            raise OpenAIError(f"tools[{i}]: tool names must be unique ({tool.name!r} is given twice)", param="tools")
        seen.add(tool.name)
        if tool.input_schema is None or tool.input_schema.get("type") != "object":
            raise OpenAIError(f"tools[{i}].input_schema must be a JSON schema of type \"object\"", param="tools")
        _check_cache_control(tool.cache_control, f"tools[{i}].cache_control")


def to_chat_request(req: MessagesRequest | CountTokensRequest, stream: bool = False) -> ChatCompletionRequest:
    """The OpenAI chat request that asks for the same answer."""
    check_fields(req)
    messages = _chat_messages(req.system, req.messages)
    try:
        thinking = Thinking.parse(req.thinking, req.max_tokens if isinstance(req, MessagesRequest) else None)
    except InvalidRequestError as e:
        raise OpenAIError(str(e), param=e.param) from None
    body: dict[str, Any] = {"model": req.model, **_prefilled(messages), **thinking.chat_fields()}
    if req.cache_salt is not None:
        body["cache_salt"] = req.cache_salt
    if not req.tools and any(m.get("tool_calls") or m["role"] == "tool" for m in messages):
        raise OpenAIError("requests which include tool_use or tool_result blocks must define tools", param="tools")
    if req.tools:
        check_tools(req.tools)
        body["tools"] = [{"type": "function", "function": {"name": t.name, "description": t.description,
                                                           "parameters": t.input_schema}} for t in req.tools]
    if req.tool_choice is not None:
        body.update(_tool_choice(req.tool_choice))
    if isinstance(req, MessagesRequest):
        body.update(max_tokens=req.max_tokens, stream=stream)
        if stream:  # (usage on every chunk: message_start says the prompt's cached tokens)
            body["stream_options"] = {"include_usage": True, "continuous_usage_stats": True}
        for name in ("temperature", "top_p", "top_k"):
            if getattr(req, name) is not None:
                body[name] = getattr(req, name)
        if req.stop_sequences:
            if not all(stop.strip() for stop in req.stop_sequences):
                raise OpenAIError("stop_sequences: each stop sequence must contain non-whitespace",
                                  param="stop_sequences")
            body["stop"] = req.stop_sequences
        if req.metadata and req.metadata.get("user_id") is not None:
            body["user"] = req.metadata["user_id"]
    if req.output_config:  # (count_tokens checks its format as /v1/messages does)
        body.update(_output_config(req.output_config))
    try:
        return ChatCompletionRequest.model_validate(body)
    except ValueError as e:  # a tool's schema that is not one, a message chat refuses
        raise OpenAIError(f"cannot translate the request: {e}", param="messages") from None


def _prefilled(messages: list[dict[str, Any]]) -> dict[str, Any]:
    """The chat body's messages, continuing a final assistant turn as Anthropic does: the
    answer picks up where its text ends and holds only what follows (an empty one
    prefills nothing)."""
    last = messages[-1] if messages else None
    if last is None or last["role"] != "assistant" or last.get("tool_calls"):
        return {"messages": messages}
    if not last.get("content"):
        return {"messages": messages[:-1]}
    return {"messages": messages, "continue_final_message": True, "add_generation_prompt": False}


def _tool_choice(choice: AnthropicToolChoice) -> dict[str, Any]:
    """Anthropic's tool_choice as chat's tool_choice (and parallel_tool_calls)."""
    if choice.name is not None and choice.type != "tool":
        raise OpenAIError(f'tool_choice {{"type": "{choice.type}"}} takes no name (only type "tool" names a tool)',
                          param="tool_choice")
    out: dict[str, Any] = {}
    if choice.type == "tool":
        if choice.name is None:
            raise OpenAIError('tool_choice {"type": "tool"} needs the tool\'s name', param="tool_choice")
        out["tool_choice"] = {"type": "function", "function": {"name": choice.name}}
    else:
        out["tool_choice"] = {"auto": "auto", "any": "required", "none": "none"}[choice.type]
    if choice.disable_parallel_tool_use:
        out["parallel_tool_calls"] = False
    return out


def _output_config(config: dict[str, Any]) -> dict[str, Any]:
    """output_config's chat fields: its format as a json_schema response_format.  Its
    effort is how long a reasoning model thinks: nothing here reads it (thinking's
    budget_tokens bounds that), so it is accepted as a no-op (its keys and effort's
    values: check_fields)."""
    fmt = config.get("format")
    if fmt is None:
        return {}
    if not isinstance(fmt, dict) or fmt.get("type") != "json_schema" or not isinstance(fmt.get("schema"), dict):
        raise OpenAIError('output_config.format must be {"type": "json_schema", "schema": {...}}',
                          param="output_config")
    return {"response_format": {"type": "json_schema", "json_schema": {"name": "output", "schema": fmt["schema"]}}}


class AnthropicServingMessages:
    """The Messages endpoint over the chat handler (same engine, tools and limits)."""

    def __init__(self, chat: OpenAIServingChat) -> None:
        self.chat = chat

    def warn_unknown_fields(self, req: MessagesRequest | CountTokensRequest) -> None:
        # (those refused by name are not unknown; chat's own fields are not read here)
        self.chat.warn_unknown_fields(req, known=frozenset(UNSUPPORTED_FIELDS))

    @staticmethod
    def _renamed(e: OpenAIError) -> OpenAIError:
        """An error of the chat path in Anthropic's names: its param and the message's
        first word (Anthropic's error body carries no param)."""
        if e.param in _PARAM_NAMES:
            e.message, e.param = renamed_text(e.message, e.param, _PARAM_NAMES[e.param]), _PARAM_NAMES[e.param]
        return e

    def prepare(self, req: MessagesRequest) -> PreparedMessages:
        chat_request = to_chat_request(req, stream=req.stream)
        thinking = Thinking.parse(req.thinking, req.max_tokens)  # (to_chat_request checked it)
        self._check_thinking(thinking)
        try:
            return PreparedMessages(chat_request, self.chat.prepare(chat_request), thinking)
        except OpenAIError as e:
            raise self._renamed(e) from None

    def _check_thinking(self, thinking: Thinking) -> None:
        if thinking.type in ("enabled", "adaptive") and self.chat.reasoning_parser is None:
            raise OpenAIError(f"thinking of type {thinking.type!r} needs a thinking model served with "
                              "--reasoning-parser (qwen3, deepseek_r1), which splits its thinking into blocks",
                              param="thinking")

    def count_tokens(self, req: CountTokensRequest) -> int:
        """The prompt's length as the chat path renders it (tools included); the request
        checked as /v1/messages checks it."""
        chat_request = to_chat_request(req)
        self._check_thinking(Thinking.parse(req.thinking, None))
        try:
            prepared = self.chat.prepare(chat_request)
        except OpenAIError as e:
            raise self._renamed(e) from None
        return len(prepared.prompts[0].token_ids)

    async def start(self, req: MessagesRequest, prep: PreparedMessages) -> tuple[str, list[RequestStream]]:
        try:
            _, streams = await self.chat.start(prep.chat_request, prep.prepared)
        except OpenAIError as e:
            raise self._renamed(e) from None
        return f"msg_{uuid.uuid4().hex[:24]}", streams  # (Anthropic's ids: msg_...)

    async def full(self, req: MessagesRequest, prep: PreparedMessages, message_id: str,
                   streams: list[RequestStream]) -> MessagesResponse:
        r: ChatCompletionResponse = await self.chat.full(prep.chat_request, prep.prepared, message_id, streams)
        (choice,) = r.choices
        content: list[dict[str, Any]] = []
        shown = prep.thinking.blocks
        if choice.message.reasoning_content and shown != "none":  # a --reasoning-parser split it off
            content.append({"type": "thinking", "signature": "",
                            "thinking": choice.message.reasoning_content if shown == "shown" else ""})
        if choice.message.content:
            content.append({"type": "text", "text": choice.message.content})
        for call in choice.message.tool_calls or []:
            content.append({"type": "tool_use", "id": _tool_use_id(call.id), "name": call.function.name,
                            "input": arguments_object(call.function.arguments)})
        reason, sequence = _stop_reason(choice.finish_reason, choice.stop_reason)
        return MessagesResponse(id=message_id, model=r.model, content=content, stop_reason=reason,
                                stop_sequence=sequence, usage=AnthropicUsage(**anthropic_usage(r.usage.model_dump())))

    async def stream(self, req: MessagesRequest, prep: PreparedMessages, message_id: str,
                     streams: list[RequestStream]) -> AsyncIterator[str]:
        """The chat handler's chunks, read back and re-said as Anthropic's events."""
        events = EventWriter(message_id, prep.prepared.model, len(prep.prepared.prompts[0].token_ids),
                             prep.thinking.blocks)
        async for chunk in self.chat.chunks(prep.chat_request, prep.prepared, message_id, streams, calls_last=True):
            for event in events.on_chunk(chunk):
                yield event


def anthropic_usage(usage: dict[str, Any]) -> dict[str, int]:
    """Anthropic's usage from a chat usage dict: input_tokens leaves out the prompt's
    tokens read from the (prefix) cache, which cache_read_input_tokens counts."""
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    return {"input_tokens": usage["prompt_tokens"] - cached, "output_tokens": usage["completion_tokens"],
            "cache_read_input_tokens": cached, "cache_creation_input_tokens": 0}


def _tool_use_id(call_id: str) -> str:
    return "toolu_" + call_id.removeprefix("call_").removeprefix("call-")


def _stop_reason(finish_reason: str | None, stop_reason: Any) -> tuple[str | None, str | None]:
    """Anthropic's (stop_reason, stop_sequence) for the engine's finish."""
    if finish_reason == "stop":
        return ("stop_sequence", stop_reason) if isinstance(stop_reason, str) else ("end_turn", None)
    return _STOP_REASONS.get(finish_reason, finish_reason), None


def _event(kind: str, data: dict[str, Any]) -> str:
    return f"event: {kind}\ndata: {json.dumps({'type': kind, **data})}\n\n"


class EventWriter:
    """Turns one choice's chat chunks into Anthropic's stream events: a content block
    per run of text and per tool call, opened and closed around their deltas.
    message_start waits for the first chunk whose usage counts a token (the first with
    the answer's content; the role's comes before it, as OpenAI's chat stream sends it),
    and its usage splits the prompt into input and cache-read tokens as the final
    message_delta's does."""

    def __init__(self, message_id: str, model: str, input_tokens: int,
                 thinking: Literal["shown", "omitted", "none"] = "shown") -> None:
        self.message_id, self.model, self.input_tokens = message_id, model, input_tokens
        self.thinking = thinking  # (Thinking.blocks: shown, without their text, or left out)
        self.started = False
        self.index = -1
        self.open: str | None = None  # "thinking", "text" or "tool_use"
        self.finish: tuple[str | None, str | None] | None = None

    def _close(self) -> list[str]:
        if self.open is None:
            return []
        self.open = None
        return [_event("content_block_stop", {"index": self.index})]

    def _open(self, block: dict[str, Any]) -> list[str]:
        out = self._close()
        self.index += 1
        self.open = block["type"]
        return out + [_event("content_block_start", {"index": self.index, "content_block": block})]

    def _text_deltas(self, delta: dict[str, Any]) -> list[str]:
        """A chunk's reasoning (a thinking block's, its text where shown) and content."""
        out: list[str] = []
        if delta.get("reasoning_content") and self.thinking != "none":
            if self.open != "thinking":
                out += self._open({"type": "thinking", "thinking": "", "signature": ""})
            if self.thinking == "shown":
                out.append(_event("content_block_delta", {"index": self.index, "delta": {
                    "type": "thinking_delta", "thinking": delta["reasoning_content"]}}))
        if delta.get("content"):
            if self.open != "text":
                out += self._open({"type": "text", "text": ""})
            out.append(_event("content_block_delta", {"index": self.index, "delta": {
                "type": "text_delta", "text": delta["content"]}}))
        return out

    def on_chunk(self, chunk: dict[str, Any]) -> list[str]:
        out: list[str] = []
        usage = chunk.get("usage")
        if not self.started:
            if (usage is None or not usage["completion_tokens"]) and "error" not in chunk:
                return out  # (the role's chunk: no content block to open yet)
            self.started = True
            start = ({**anthropic_usage(usage), "output_tokens": 0} if usage is not None
                     else {"input_tokens": self.input_tokens, "output_tokens": 0, "cache_read_input_tokens": 0})
            out.append(_event("message_start", {"message": {
                "id": self.message_id, "type": "message", "role": "assistant", "model": self.model, "content": [],
                "stop_reason": None, "stop_sequence": None, "usage": start}}))
            out.append(_event("ping", {}))  # (as Anthropic's streams have one after message_start)
        if "error" in chunk:
            err = chunk["error"]
            status = {"server_error": 500, "timeout_error": 408}.get(err.get("type"), 400)
            if err.get("code") in ("server_overloaded", "shutting_down", "engine_dead"):
                status = 503
            return out + [_event("error", {"error": anthropic_error_body(status, err.get("message", ""))["error"]})]
        for choice in chunk.get("choices", []):
            delta = choice.get("delta") or {}
            out += self._text_deltas(delta)
            for call in delta.get("tool_calls") or []:
                function = call.get("function") or {}
                if call.get("id"):  # a new call
                    out += self._open({"type": "tool_use", "id": _tool_use_id(call["id"]),
                                       "name": function.get("name", ""), "input": {}})
                if function.get("arguments"):
                    out.append(_event("content_block_delta", {"index": self.index, "delta": {
                        "type": "input_json_delta", "partial_json": function["arguments"]}}))
            if choice.get("finish_reason") is not None:
                self.finish = _stop_reason(choice["finish_reason"], choice.get("stop_reason"))
                out += self._close()
        if usage is not None and self.finish is not None and not chunk.get("choices"):
            reason, sequence = self.finish
            out.append(_event("message_delta", {"delta": {"stop_reason": reason, "stop_sequence": sequence},
                                                "usage": anthropic_usage(usage)}))
            out.append(_event("message_stop", {}))
        return out

