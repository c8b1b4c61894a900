"""Anthropic's Messages API shapes (`POST /v1/messages`, `/v1/messages/count_tokens`),
as the official `anthropic` client sends and reads them.  Requests are checked here
for their shape only (an image block's source also for its media type, as Anthropic does); serving_messages.py translates them into OpenAI chat requests,
so every check on their content (sampling ranges, templates, tools, limits) is the
chat path's, made once."""

from __future__ import annotations

import base64
import binascii
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from pagedserve.engine.chat_utils import messages_hold_image
from pagedserve.entrypoints.openai.protocol import OpenAIBaseModel, RequestBody
from pagedserve.entrypoints.openai.protocol_fields import part_key_error
from pagedserve.errors import InvalidRequestError
from pagedserve.utils import is_int

# Where a request speaks Anthropic's API, errors come in Anthropic's shape.
ANTHROPIC_PATH_PREFIX = "/v1/messages"


class AnthropicMessage(OpenAIBaseModel):
    """A turn: role and content only, as Anthropic defines it (another key, `name` say,
    is refused by name as Anthropic refuses it: it was dropped without a word)."""

    model_config = ConfigDict(extra="forbid")

    role: Literal["user", "assistant"]
    # A string, or content blocks ({"type": "text" | "tool_use" | "tool_result", ...}):
    # each block's fields are read, and refused by name, in serving_messages.py.
    content: str | list[dict[str, Any]]


# Each content block's keys as Anthropic defines them: any other is refused by name, as
# Anthropic refuses it.  A past answer's `citations` are kept out of the prompt (accepted
# without effect); the keys of NEUTRAL_BLOCK_KEYS only at a value that asks for nothing.
BLOCK_KEYS = {
    "text": ("type", "text", "cache_control", "citations"),
    "image": ("type", "source", "cache_control", "transformations"),
    "tool_use": ("type", "id", "name", "input", "cache_control", "caller", "toolset_name"),
    "tool_result": ("type", "tool_use_id", "content", "is_error", "cache_control", "toolset_name"),
    "thinking": ("type", "thinking", "signature"),
    "redacted_thinking": ("type", "data"),
}
NEUTRAL_BLOCK_KEYS: dict[str, tuple[tuple[Any, ...], str]] = {
    "caller": (({"type": "direct"},), "tools here are called by the model only (no code execution)"),
    "toolset_name": ((), "this server connects to no MCP servers"),
    "transformations": (([],), "images are read as sent (no transformations)"),
}


def block_key_error(block: dict[str, Any]) -> str | None:
    """What is wrong with a block's keys (None: nothing, or a type not read here)."""
    kind = block.get("type")
    if not isinstance(kind, str) or kind not in BLOCK_KEYS:
        return None
    if not isinstance(block.get("citations"), (list, type(None))):
        return "citations must be a list"
    return part_key_error(block, f"a {kind} block", BLOCK_KEYS[kind], NEUTRAL_BLOCK_KEYS)


class AnthropicTool(OpenAIBaseModel):
    """A client tool.  Its other keys (server tools' `type`s, beta fields) are refused by
    name in serving_messages.check_tools; `strict` is what a call's grammar always does
    here, `cache_control` what the prefix cache always does."""

    name: str
    description: str | None = None
    input_schema: dict[str, Any] | None = None  # (required of a client tool: check_tools)
    type: str | None = None  # "custom" (a client tool) or a server tool's, refused
    strict: bool | None = None
    cache_control: dict[str, Any] | None = None


class AnthropicToolChoice(OpenAIBaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None


class MessagesBody(RequestBody):
    """What /v1/messages and /v1/messages/count_tokens both take: the prompt, and the
    fields checked alike on both (serving_messages.check_fields)."""

    model: str | None = None
    messages: list[AnthropicMessage]
    system: str | list[dict[str, Any]] | None = None
    tools: list[AnthropicTool] | None = None
    tool_choice: AnthropicToolChoice | None = None
    thinking: dict[str, Any] | None = None
    # {"format": {"type": "json_schema", "schema": ...}} (structured outputs), "effort".
    output_config: dict[str, Any] | None = None
    # Anthropic's automatic prompt caching: what the prefix cache always does here.
    cache_control: dict[str, Any] | None = None
    # vLLM's: blocks shared only with prompts of the same salt (one tenant's cache kept
    # from another's); taken here too (it was logged as unknown, and the cache shared).
    cache_salt: str | None = None
    # Accepted without effect (docs/serving.md): one speed, and attribution only; held to
    # Anthropic's values.
    speed: Literal["standard", "fast"] | None = None
    user_profile_id: str | None = None
    workspace_id: str | None = None

    def image_field(self) -> str | None:
        return "messages" if messages_hold_image(self.messages) else None


class MessagesRequest(MessagesBody):
    max_tokens: int = Field(ge=1)
    stop_sequences: list[str] | None = None
    stream: bool = False
    temperature: float | None = Field(default=None, ge=0.0, le=1.0, allow_inf_nan=False)  # (Anthropic's range)
    top_p: float | None = Field(default=None, allow_inf_nan=False)
    top_k: int | None = Field(default=None, ge=0)
    metadata: dict[str, Any] | None = None
    # Accepted without effect (docs/serving.md): one service tier and one region.
    service_tier: Literal["auto", "standard_only"] | None = None
    inference_geo: str | None = None


class CountTokensRequest(MessagesBody):
    pass


class AnthropicUsage(BaseModel):
    input_tokens: int
    output_tokens: int
    cache_read_input_tokens: int = 0
    cache_creation_input_tokens: int = 0


class MessagesResponse(BaseModel):
    model_config = ConfigDict(extra="forbid")

    id: str
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    model: str
    content: list[dict[str, Any]]
    stop_reason: str | None
    stop_sequence: str | None = None
    usage: AnthropicUsage


# HTTP status -> Anthropic's error type (docs.anthropic.com, "Errors").
_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                404: "not_found_error", 408: "timeout_error", 413: "request_too_large", 429: "rate_limit_error",
                503: "overloaded_error", 529: "overloaded_error"}


def anthropic_error_body(status: int, message: str) -> dict[str, Any]:
    """{"type": "error", "error": {"type", "message"}}: the body of an error response
    and the data of a stream's `error` event."""
    kind = _ERROR_TYPES.get(status, "invalid_request_error" if status < 500 else "api_error")
    return {"type": "error", "error": {"type": kind, "message": message}}


@dataclass(frozen=True)
class Thinking:
    """A request's `thinking`, checked.  `enabled` turns a hybrid model's thinking on
    (Qwen3's template reads enable_thinking) and holds it to `budget_tokens`
    (thinking_token_budget: the end tag is forced once they are spent); `adaptive` turns it
    on and leaves its length to the model; `disabled` turns it off and leaves thinking
    blocks out.  `display: "omitted"` keeps the blocks with their text left out, as
    Anthropic does.  Unset: whatever the model does, its reasoning (where
    --reasoning-parser splits it off) as thinking blocks."""

    type: Literal["enabled", "adaptive", "disabled"] | None = None
    budget_tokens: int | None = None
    display: Literal["summarized", "omitted"] = "summarized"

    @classmethod
    def parse(cls, thinking: dict[str, Any] | None, max_tokens: int | None) -> Thinking:
        if thinking is None:
            return cls()
        kind, display = thinking.get("type"), thinking.get("display") or "summarized"
        keys = {"enabled": {"type", "budget_tokens", "display"}, "adaptive": {"type", "display"},
                "disabled": {"type"}}
        if kind not in keys:
            raise InvalidRequestError(f"thinking.type must be 'enabled', 'adaptive' or 'disabled', got "
                                      f"{str(kind)[:40]!r}", param="thinking")
        if set(thinking) - keys[kind]:
            raise InvalidRequestError(f"thinking of type {kind!r} takes {', '.join(sorted(keys[kind]))}, got "
                                      f"{', '.join(sorted(set(thinking) - keys[kind]))[:200]}", param="thinking")
        if display not in ("summarized", "omitted"):
            raise InvalidRequestError(f"thinking.display must be 'summarized' or 'omitted', got {str(display)[:40]!r}",
                                      param="thinking")
        budget = thinking.get("budget_tokens")
        if kind == "enabled":
            # (Anthropic's floor of 1,024 is not held: small local models think in fewer tokens)
            if not is_int(budget) or budget < 1:
                raise InvalidRequestError(f"thinking.budget_tokens must be an integer >= 1, got {str(budget)[:40]}",
                                          param="thinking")
            if max_tokens is not None and budget >= max_tokens:
                raise InvalidRequestError(f"max_tokens must be greater than thinking.budget_tokens ({max_tokens} <= "
                                          f"{budget})", param="max_tokens")
        return cls(kind, budget, display)

    def chat_fields(self) -> dict[str, Any]:
        """The chat request's fields for it."""
        if self.type is None:
            return {}
        fields: dict[str, Any] = {"chat_template_kwargs": {"enable_thinking": self.type != "disabled"}}
        if self.budget_tokens is not None:
            fields["thinking_token_budget"] = self.budget_tokens
        return fields

    @property
    def blocks(self) -> Literal["shown", "omitted", "none"]:
        """How the answer carries its thinking blocks."""
        return "none" if self.type == "disabled" else "omitted" if self.display == "omitted" else "shown"


# The image media types Anthropic's API takes (and the formats multimodal/image.py opens),
# each with how its file begins (WebP: RIFF, then its size, then WEBP).
IMAGE_MEDIA_TYPES = {"image/jpeg": (b"\xff\xd8\xff",), "image/png": (b"\x89PNG\r\n\x1a\n",),
                     "image/gif": (b"GIF87a", b"GIF89a"), "image/webp": (b"RIFF",)}


def _matches_media_type(data: str, media: str) -> bool:
    """Whether base64 `data` begins as a `media` file does (Anthropic refuses a mismatch;
    bytes that are no image at all are the decoder's to name)."""
    try:
        head = base64.b64decode(data[:16] + "=" * (-len(data[:16]) % 4))
    except (binascii.Error, ValueError):
        return True
    known = [magic for magics in IMAGE_MEDIA_TYPES.values() for magic in magics]
    return not any(head.startswith(m) for m in known) or any(head.startswith(m) for m in IMAGE_MEDIA_TYPES[media])


# An image block's source's keys, per source type (Anthropic's): any other refused by name.
IMAGE_SOURCE_KEYS = {"base64": ("type", "media_type", "data"), "url": ("type", "url")}


def image_source_url(source: Any, where: str) -> str:
    """An image block's source as a URL the chat handler reads: base64 data becomes a data:
    URL; a url source stays (fetched only from the server's allowed media domains)."""
    kind = source.get("type") if isinstance(source, dict) else None
    if isinstance(kind, str) and kind in IMAGE_SOURCE_KEYS and (error := part_key_error(source, f"a {kind} image source",
                                                              IMAGE_SOURCE_KEYS[kind], {})) is not None:
        raise InvalidRequestError(f"{where}: {error}", param="messages")
    if isinstance(source, dict) and source.get("type") == "base64" and isinstance(source.get("data"), str):
        media = source.get("media_type")
        if media not in IMAGE_MEDIA_TYPES:
            raise InvalidRequestError(f"{where}: an image source's media_type must be one of "
                                      f"{', '.join(IMAGE_MEDIA_TYPES)}, got {str(media)[:50]!r}", param="messages")
        if not _matches_media_type(source["data"], media):
            raise InvalidRequestError(f"{where}: the image does not match the provided media type {media}",
                                      param="messages")
        return f"data:{media};base64,{source['data']}"
    if isinstance(source, dict) and source.get("type") == "url" and isinstance(source.get("url"), str):
        return source["url"]
    raise InvalidRequestError(f"{where}: an image block needs a source of type base64 (media_type, data) or url",
                              param="messages")
