"""The request body of OpenAI's Responses API (POST /v1/responses), and the output items
of its answer.  No handler reads the body as it is: serving_responses.py translates it
onto a ChatCompletionRequest, and its answers are plain dicts (ResponseOutput builds
their items), so it stands apart from protocol.py's chat models.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import Any, Literal

from pagedserve.engine.chat_utils import holds_image
from pagedserve.entrypoints.openai.protocol import OpenAIRequestBody
from pagedserve.entrypoints.openai.protocol_fields import KNOWN_EXTRA_FIELDS, part_key_error
from pagedserve.errors import InvalidRequestError

# OpenAI's `include` values whose data exists nowhere here (docs/serving.md): encrypted
# reasoning (a conversation's reasoning is never shown to the model again: input reasoning
# items are dropped, as vLLM drops them; agent clients send this with store false), the
# results of built-in tools (only function tools are taken), and input image URLs (the
# stored input items keep them as sent).  Its other value, output text logprobs, is refused.
INCLUDE_WITHOUT_EFFECT = ("reasoning.encrypted_content", "file_search_call.results", "web_search_call.results",
                          "web_search_call.action.sources", "code_interpreter_call.outputs",
                          "computer_call_output.output.image_url", "message.input_image.image_url")


# vLLM's extra fields of its Responses request that chat's handler does: passed on as they are.
VLLM_CHAT_FIELDS = ("seed", "stop", "top_k", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty",
                    "logit_bias", "ignore_eos", "skip_special_tokens", "include_stop_str_in_output", "priority",
                    "cache_salt", "structured_outputs", "min_tokens", "stop_token_ids", "bad_words")
# ...and those asking for what this server does not do, refused by name when set.
VLLM_REFUSED = {"request_id": "a response's id is the server's (it keys the response store)",
                "kv_transfer_params": "this server does no disaggregated prefill",
                "enable_response_messages": "answers carry output items only"}
# Chat Completions' names, which the Responses API spells otherwise: refused by name with
# the field to use (OpenAI answers "Unsupported parameter"; a client ported from chat sent
# max_tokens, and its answer ran to the end of the context).
CHAT_ONLY_FIELDS = {
    "max_tokens": "the Responses API's limit is max_output_tokens",
    "max_completion_tokens": "the Responses API's limit is max_output_tokens",
    "response_format": "the Responses API's is text.format",
    "messages": "the Responses API takes input (and instructions)",
    "n": "a response has one output",
    "logprobs": "the Responses API asks for them with include (output text logprobs: not served here)",
    "functions": "the Responses API takes tools",
    "function_call": "the Responses API takes tool_choice",
    "reasoning_effort": "the Responses API's is reasoning.effort",
    "verbosity": "the Responses API's is text.verbosity",
}
# The extra fields this route reads or refuses (any other is logged as unknown): its own,
# and those every OpenAI route refuses or accepts at a neutral value.
RESPONSES_EXTRA_FIELDS = (KNOWN_EXTRA_FIELDS | frozenset(VLLM_CHAT_FIELDS) | frozenset(VLLM_REFUSED)
                          | frozenset(CHAT_ONLY_FIELDS))


# Each input item's and content part's keys as OpenAI defines them: any other is refused
# by name, as OpenAI refuses it.  An earlier response's items sent back carry their id,
# status, phase, annotations and logprobs, and prompt_cache_breakpoint marks what the
# prefix cache always does here: accepted without effect.  NEUTRAL_INPUT_KEYS are refused
# unless at a value that asks for nothing.
ITEM_KEYS = {
    "message": ("type", "role", "content", "id", "status", "phase"),
    "function_call": ("type", "id", "call_id", "name", "arguments", "status", "caller", "namespace", "async"),
    "function_call_output": ("type", "id", "call_id", "output", "status", "caller", "name", "namespace"),
    "reasoning": ("type", "id", "summary", "content", "encrypted_content", "status"),
}
PART_KEYS = {
    "input_text": ("type", "text", "prompt_cache_breakpoint"),
    "output_text": ("type", "text", "annotations", "logprobs"),
    "text": ("type", "text"),
    "input_image": ("type", "image_url", "file_id", "detail", "prompt_cache_breakpoint"),
}
NEUTRAL_INPUT_KEYS: dict[str, tuple[tuple[Any, ...], str]] = {
    "caller": (({"type": "direct"},), "tools here are called by the model only (no code execution)"),
    "namespace": ((), "tools here have no namespaces"),
    "file_id": ((), "this server keeps no files: send the image as image_url (a data: URL)"),
}


def input_key_error(part: dict[str, Any], kind: str) -> str | None:
    """What is wrong with the keys of an input item or content part of type `kind` (one of
    ITEM_KEYS or PART_KEYS; None: nothing)."""
    item = kind in ITEM_KEYS
    return part_key_error(part, f"{'an' if kind[0] in 'aeiou' else 'a'} {kind} {'item' if item else 'part'}",
                          ITEM_KEYS[kind] if item else PART_KEYS[kind], NEUTRAL_INPUT_KEYS)


# A failed response's `error.code` takes OpenAI's values (its SDK's types list them); the
# server's own codes (request_timeout, ...) stay in the `error` event before it.
_RESPONSE_ERROR_CODES = {"server_overloaded": "rate_limit_exceeded", "rate_limit_exceeded": "rate_limit_exceeded",
                         "invalid_prompt": "invalid_prompt"}


def response_error(err: dict[str, Any]) -> dict[str, Any]:
    """A failed response's `error` for a stream's error event `err`."""
    return {"code": _RESPONSE_ERROR_CODES.get(err.get("code") or "", "server_error"), "message": err.get("message", "")}


class ResponsesRequest(OpenAIRequestBody):
    """POST /v1/responses (entrypoints/openai/serving_responses.py translates it)."""

    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Literal["none", "auto", "required"] | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    text: dict[str, Any] | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    stream: bool = False
    user: str | None = None
    metadata: dict[str, str] | None = None
    # store / previous_response_id need --enable-responses-store; background and
    # top_logprobs are refused when set (no background runs, no logprobs), include's values
    # are held to OpenAI's (check_include), and prediction (Chat Completions' field, which
    # OpenAI's Responses API does not have) is refused:
    store: bool | None = None
    previous_response_id: str | None = None
    background: bool | None = None
    include: list[str] | None = None
    top_logprobs: int | None = None
    prediction: Any = None
    # Accepted without effect (docs/serving.md says why; serving_responses.py checks their
    # shapes): reasoning's keys, truncation, text.verbosity, stream_options'
    # include_obfuscation, max_tool_calls (a bound on built-in tools: there are none),
    # image.context_compression other than "enabled" and access_programs' "standard".
    reasoning: dict[str, Any] | None = None
    truncation: Literal["auto", "disabled"] | None = None
    stream_options: dict[str, Any] | None = None
    max_tool_calls: int | None = None
    image: dict[str, Any] | None = None
    access_programs: dict[str, Any] | None = None

    def image_field(self) -> str | None:
        items = self.input if isinstance(self.input, list) else []
        return "input" if any(isinstance(item, dict) and holds_image(item.get("content")) for item in items) else None

    def check_include(self) -> None:
        for value in self.include or ():
            if value == "message.output_text.logprobs":
                raise InvalidRequestError("include message.output_text.logprobs: logprobs are not supported on "
                                          "/v1/responses (use /v1/chat/completions)", param="include")
            if value not in INCLUDE_WITHOUT_EFFECT:
                raise InvalidRequestError(f"include {value!r:.100} is not one of OpenAI's values ("
                                          f"{', '.join(INCLUDE_WITHOUT_EFFECT)}, message.output_text.logprobs)",
                                          param="include")


def object_id(prefix: str) -> str:
    """An id as OpenAI's Responses API writes them: resp_..., msg_..., fc_..."""
    return f"{prefix}_{uuid.uuid4().hex}"


@dataclass
class ResponseOutput:
    """What one response holds so far: its output items and usage."""

    reasoning: str = ""
    text: str = ""
    calls: list[dict[str, Any]] = field(default_factory=list)  # call_id, name, arguments
    finish_reason: str | None = None
    usage: dict[str, Any] | None = None
    ids: dict[str, str] = field(default_factory=dict)  # item kind -> its id

    def item_id(self, kind: str) -> str:
        if kind not in self.ids:
            self.ids[kind] = object_id({"reasoning": "rs", "message": "msg", "function_call": "fc"}[kind.split(":")[0]])
        return self.ids[kind]

    def chat_message(self) -> dict[str, Any]:
        """The answer as the assistant turn of a chat (its reasoning left out, as vLLM)."""
        message: dict[str, Any] = {"role": "assistant", "content": self.text or None}
        if self.calls:
            message["tool_calls"] = [{"id": c["call_id"], "type": "function",
                                      "function": {"name": c["name"], "arguments": c["arguments"]}}
                                     for c in self.calls]
        return message

    def done_status(self) -> str:
        """A finished item's status: "incomplete" where max_output_tokens cut the answer."""
        return "incomplete" if self.finish_reason == "length" else "completed"

    def items(self, done: bool = True) -> list[dict[str, Any]]:
        """The output items; done, all completed but the last, which max_output_tokens may cut."""
        status = "completed" if done else "in_progress"
        out: list[dict[str, Any]] = []
        if self.reasoning:
            out.append(self.reasoning_item(status))
        if self.text:
            out.append(self.message_item(status))
        out += [self.call_item(i, status) for i in range(len(self.calls))]
        if done and out:
            out[-1]["status"] = self.done_status()
        return out

    def reasoning_item(self, status: str) -> dict[str, Any]:
        return {"type": "reasoning", "id": self.item_id("reasoning"), "summary": [], "status": status,
                "content": [{"type": "reasoning_text", "text": self.reasoning}]}

    def message_item(self, status: str) -> dict[str, Any]:
        return {"type": "message", "id": self.item_id("message"), "role": "assistant", "status": status,
                "content": [{"type": "output_text", "text": self.text, "annotations": [], "logprobs": []}]}

    def call_item(self, i: int, status: str) -> dict[str, Any]:
        c = self.calls[i]
        return {"type": "function_call", "id": self.item_id(f"function_call:{i}"), "call_id": c["call_id"],
                "name": c["name"], "arguments": c["arguments"], "status": status}
