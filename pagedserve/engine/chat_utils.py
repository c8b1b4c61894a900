"""Chat prompts: a conversation rendered with a chat template, then tokenized.

A function of the tokenizer and the default template only, so both an engine and a
front end that holds no engine (the data-parallel client, `engine/data_parallel.py`)
render a conversation the same way: the server, `LLM.chat` and the CLI all come here.
"""

from __future__ import annotations

import json
from typing import Any

from pagedserve.engine.arg_utils import read_chat_template


def render_chat(tokenizer: Any, default_template: str | None, messages: list[dict[str, Any]],
                chat_template: str | None = None, add_generation_prompt: bool = True, *,
                tools: list[dict[str, Any]] | None = None, chat_template_kwargs: dict[str, Any] | None = None,
                continue_final_message: bool = False) -> str:
    """Render one conversation to prompt text with `chat_template` (a Jinja string or a
    file), else `default_template` (--chat-template, else the tokenizer's).  `tools`
    (OpenAI's function definitions) and `chat_template_kwargs` (e.g. Qwen3's
    enable_thinking) reach the template; `continue_final_message` leaves the last
    (assistant) message open for the model to go on with."""
    if tokenizer is None:
        raise ValueError("this model has no tokenizer, so chat templates cannot be applied")
    if not isinstance(messages, list) or not messages or not all(
        isinstance(m, dict) and isinstance(m.get("role"), str) for m in messages
    ):
        raise ValueError("messages must be a non-empty list of {'role': ..., 'content': ...} dicts")
    if continue_final_message and (add_generation_prompt or messages[-1]["role"] != "assistant"):
        raise ValueError("continue_final_message needs a final assistant message and no generation prompt")
    messages = [_normalise_message(m) for m in messages]
    template = read_chat_template(chat_template) or default_template
    if not template:
        raise ValueError("the model has no chat template; pass chat_template=... (a Jinja string or file)")
    kwargs = dict(chat_template_kwargs or {})
    reserved = {"tools", "chat_template", "add_generation_prompt", "continue_final_message", "tokenize"} & set(kwargs)
    if reserved:
        raise ValueError(f"chat_template_kwargs may not set {', '.join(sorted(reserved))}")
    try:
        return tokenizer.apply_chat_template(
            messages, chat_template=template, tokenize=False, add_generation_prompt=add_generation_prompt,
            tools=tools, continue_final_message=continue_final_message, **kwargs)
    except Exception as e:  # jinja2 errors come in many types; the user needs the message
        raise ValueError(f"applying the chat template failed: {e}") from e


def encode_chat(tokenizer: Any, default_template: str | None, messages: list[dict[str, Any]],
                chat_template: str | None = None, add_generation_prompt: bool = True,
                **kwargs: Any) -> dict[str, Any]:
    """Chat prompt as {'prompt', 'prompt_token_ids'} (kwargs: render_chat's).  The
    template already holds any BOS text, so the tokenizer must not add special tokens a
    second time."""
    text = render_chat(tokenizer, default_template, messages, chat_template, add_generation_prompt, **kwargs)
    return {"prompt": text, "prompt_token_ids": list(tokenizer.encode(text, add_special_tokens=False))}


def _normalise_message(message: dict[str, Any]) -> dict[str, Any]:
    """The one place messages are normalised for chat templates: OpenAI-style content
    parts [{"type": "text", "text": ...}] become one string, joined with newlines as vLLM
    does; no content is "" (an assistant turn that only called tools); tool-call
    arguments sent as JSON text become the objects that templates render."""
    content = message.get("content")
    message = {**message}
    if content is None:
        message["content"] = ""
    elif isinstance(content, list):
        texts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise ValueError(f"only text content parts are supported, got {part!r}")
            texts.append(part["text"])
        message["content"] = "\n".join(texts)
    calls = message.get("tool_calls")
    if isinstance(calls, list):
        message["tool_calls"] = [_tool_call_for_template(c) for c in calls]
    return message


def _tool_call_for_template(call: Any) -> Any:
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("arguments"), str):
        return call
    try:
        arguments = json.loads(function["arguments"])
    except ValueError:
        return call
    return {**call, "function": {**function, "arguments": arguments}}
