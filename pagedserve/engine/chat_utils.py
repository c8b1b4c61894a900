"""Chat prompts: a conversation rendered with a chat template, then tokenized.

A function of the tokenizer and the default template only, so both an engine and a
front end that holds no engine (the data-parallel client, `engine/data_parallel.py`)
render a conversation the same way: the server, `LLM.chat` and the CLI all come here.

Two kinds of template, two places they run, one renderer (`chat_template.py`: what
transformers does, with jinja2 alone).  The default one (the server's --chat-template,
read from its file at start-up, else the model's) is trusted and rendered here,
in-process.  A template a request brings is text (never a path: only the server's flag
may name a file) written by whoever sent it, so it is rendered by `TemplateSandbox` in a
child process bounded in time and memory: a Jinja bomb costs that process, and the
request gets a 400 naming the limit.
"""

from __future__ import annotations

import json
import logging
import os
import select
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any, Protocol

from pagedserve.chat_template import iterates_content, join_text_parts, render_chat_template
from pagedserve.engine.special_text import HiddenSpecials, hide_special_text, text_strings
from pagedserve.errors import ImageInputError, InvalidRequestError, OverloadedError, PromptTooLongError
from pagedserve.request_limits import (
    MAX_PROMPT_CHARS,
    MAX_REQUEST_TEMPLATE_CHARS,
    REQUEST_TEMPLATE_MEMORY_BYTES,
    REQUEST_TEMPLATE_SECONDS,
    TEMPLATE_QUEUE_SECONDS,
)

logger = logging.getLogger("pagedserve")
_WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "template_worker.py")
_WORKER_START_SECONDS = 30.0  # jinja2 and the renderer: ~0.1 s warm (Zen 4, AVX-512, native bf16)


class TemplateSandbox:
    """Renders request-supplied chat templates in a child process (template_worker.py),
    one at a time: at most `seconds` of wall time and `memory_bytes` of address space
    each, the rendered text at most the caller's `max_chars`.  A render past a limit, or
    any failure of the exchange, stops the child (the next render starts a new one, so
    no reply can reach the wrong caller) and raises InvalidRequestError naming the limit;
    the server process is never at risk."""

    def __init__(self, seconds: float = REQUEST_TEMPLATE_SECONDS,
                 memory_bytes: int = REQUEST_TEMPLATE_MEMORY_BYTES) -> None:
        self.seconds = seconds
        self.memory_bytes = memory_bytes
        self._lock = threading.Lock()
        self._proc: subprocess.Popen | None = None
        self._chunks: list[bytes] = []
        self.num_restarts = 0  # children stopped at a limit (for tests and logs)

    def render(self, template: str, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
               add_generation_prompt: bool, continue_final_message: bool, kwargs: dict[str, Any],
               max_chars: int, join_text: bool = False) -> str:
        """`join_text`: the messages' text parts are joined into one string unless the
        template iterates over content (decided in the child: parsing is the template's
        work, bounded there)."""
        req = {"template": template, "messages": messages, "tools": tools, "kwargs": kwargs,
               "add_generation_prompt": add_generation_prompt, "continue_final_message": continue_final_message,
               "max_chars": max_chars, "join_text": join_text}
        try:
            line = json.dumps(req) + "\n"
        except (TypeError, ValueError, RecursionError) as e:  # (arguments parsed for the template, nested deep)
            raise InvalidRequestError(f"the conversation cannot be given to a request's chat_template: {e}",
                                      param="chat_template") from None
        if not self._lock.acquire(timeout=TEMPLATE_QUEUE_SECONDS):
            raise OverloadedError("requests' own chat templates are rendered one at a time and others are "
                                  "waiting; retry shortly")
        try:
            reply, code = self._exchange(line)
        finally:
            self._lock.release()
        if reply is None:
            why = (f"rendering took longer than {self.seconds:g} s" if code is None
                   else f"the rendering process died (exit status {code})")
            raise InvalidRequestError(f"chat_template: {why}, the limit for a request's own template",
                                      param="chat_template")
        if reply.get("limit") == "size":
            raise prompt_too_long(reply["length"], max_chars, "chat_template")
        if "error" in reply:
            raise InvalidRequestError(f"chat_template: {reply['error']}", param="chat_template")
        try:
            reply["text"].encode()
        except UnicodeEncodeError as e:  # ("%c" % 55296: the tokenizer's TypeError was a 500)
            raise InvalidRequestError(f"chat_template: it wrote a lone surrogate (U+{ord(e.object[e.start]):04X}), "
                                      "which is not text", param="chat_template") from None
        return reply["text"]

    def _exchange(self, line: str) -> tuple[dict[str, Any] | None, int | None]:
        """(the child's reply or None, its exit status if it died).  Holding the lock."""
        try:
            proc = self._ensure_started()
            try:
                proc.stdin.write(line.encode())
                proc.stdin.flush()
            except BrokenPipeError:
                pass  # it died: the read below says so
            reply = self._read_line(time.monotonic() + self.seconds)
        except BaseException:
            self._stop()  # whatever went wrong, no half-read reply stays for the next caller
            raise
        code = None if self._proc is None else self._proc.poll()
        if reply is None or "limit" in reply:  # past a limit (or dead): never reuse this child
            self._stop()
            self.num_restarts += 1
        return reply, code

    def _ensure_started(self) -> subprocess.Popen:
        if self._proc is not None and self._proc.poll() is None:
            return self._proc
        self._stop()
        env = {k: v for k, v in os.environ.items() if k in ("PATH", "LANG", "LC_ALL", "HOME", "TMPDIR")}
        env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", TRANSFORMERS_VERBOSITY="error")
        self._proc = subprocess.Popen(
            [sys.executable, "-I", _WORKER, str(self.memory_bytes)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL, env=env, cwd="/")
        self._chunks = []
        ready = self._read_line(time.monotonic() + _WORKER_START_SECONDS)
        if not ready or not ready.get("ready"):
            self._stop()
            raise RuntimeError("the chat template sandbox process did not start")
        return self._proc

    def _read_line(self, deadline: float) -> dict[str, Any] | None:
        """The child's next reply, or None if it died or missed the deadline (poll, not
        select: descriptors past 1024 are fine)."""
        fd = self._proc.stdout.fileno()
        poller = select.poll()
        poller.register(fd, select.POLLIN | select.POLLHUP | select.POLLERR)
        while not self._chunks or b"\n" not in self._chunks[-1]:
            left = deadline - time.monotonic()
            if left <= 0 or not poller.poll(left * 1000):
                return None
            chunk = os.read(fd, 1 << 20)
            if not chunk:
                return None
            self._chunks.append(chunk)
        data = b"".join(self._chunks)
        line, _, rest = data.partition(b"\n")
        self._chunks = [rest] if rest else []
        return json.loads(line)

    def _stop(self) -> None:
        if self._proc is not None:
            self._proc.kill()
            self._proc.wait()
            for pipe in (self._proc.stdin, self._proc.stdout):
                try:
                    pipe.close()
                except OSError:
                    pass
            self._proc = None
        self._chunks = []

    def close(self) -> None:
        with self._lock:
            self._stop()


_SANDBOX: TemplateSandbox | None = None
_SANDBOX_LOCK = threading.Lock()


# The refusal of a chat for a model without a chat template (the server also says it
# before loading such a model: ServerState.lease).
NO_CHAT_TEMPLATE = ("this model has no chat template (a base model: it serves completions); give one with "
                    "`--chat-template FILE` (pagedserve serve, generate or chat), the request field "
                    "`chat_template` (Jinja text), or offline `LLM(..., chat_template=FILE)`")


def template_sandbox() -> TemplateSandbox:
    """The process's one sandbox (its child starts with the first request template)."""
    global _SANDBOX
    with _SANDBOX_LOCK:
        if _SANDBOX is None:
            _SANDBOX = TemplateSandbox()
        return _SANDBOX


def prompt_char_limit(longest_token_chars: int | None, max_model_len: int) -> int:
    """The most characters a prompt of max_model_len tokens can have: the vocabulary's
    longest token (its stored form is at least as long as the text it decodes to; None:
    no tokenizer) times max_model_len, capped at MAX_PROMPT_CHARS."""
    if longest_token_chars is None:
        return MAX_PROMPT_CHARS
    return min(MAX_PROMPT_CHARS, max(1, longest_token_chars) * max_model_len)


def prompt_too_long(length: int, max_chars: int, param: str, at_least: bool = False) -> PromptTooLongError:
    """`at_least`: `length` is where rendering stopped, past the bound."""
    return PromptTooLongError(f"the prompt is {'at least ' if at_least else ''}{length} characters, more than the "
                              f"{max_chars} that max_model_len tokens of this model can spell", param=param)


def check_prompt_chars(text: str, max_chars: int, param: str = "prompt") -> None:
    """Text longer than any max_model_len-token prompt can spell is refused before the
    tokenizer spends seconds on it (the one check of prompt text size)."""
    if len(text) > max_chars:
        raise prompt_too_long(len(text), max_chars, param)


# Where only a prompt's last tokens run, its text is tokenized from this many characters
# before the part that holds them, and again from a prime number of characters further:
# where the two agree past the margin, they are the whole text's tokens there
# (tokenizations meet within a few tokens of any start, except inside a long run of one
# character, which is grouped from where it starts: the prime keeps the two starts out of
# step with any grouping's period).
CUT_MARGIN_CHARS = 4096
_FARTHER_CHARS = 4099


def encode_for_cut(encode: Callable[[str, bool], list[int]], text: str, max_chars: int, add_special_tokens: bool,
                   param: str = "prompt") -> list[int]:
    """Ids whose last tokens are the whole `text`'s last tokens, as many as
    truncate_prompt_tokens can keep (at most max_model_len, spanning at most max_chars
    characters: the longest token's times as many).  Tokenizing a whole 16 MB prompt to
    keep its last 10 tokens held the interpreter's lock for 7 s: every request and /health
    froze.  Text whose end tokenizes differently from the two starts is refused."""
    if len(text) <= max_chars + CUT_MARGIN_CHARS + _FARTHER_CHARS:
        return encode(text, add_special_tokens)
    # (with the tokenizer's special tokens: a prefix falls in the margin, a suffix (BERT's
    # [SEP], an EOS) ends the ids, as the whole text's)
    near, far = (encode(text[-(max_chars + m):], add_special_tokens)
                 for m in (CUT_MARGIN_CHARS, CUT_MARGIN_CHARS + _FARTHER_CHARS))
    keep = len(near) - len(encode(text[-(max_chars + CUT_MARGIN_CHARS):-max_chars], False))  # (past the margin)
    agreed = next((i for i, (a, b) in enumerate(zip(reversed(near), reversed(far), strict=False)) if a != b),
                  len(near))
    if agreed < keep:
        raise InvalidRequestError(f"the prompt is {len(text)} characters and its end tokenizes differently from "
                                  "where it is read (a long run of one character?): truncate_prompt_tokens cannot "
                                  f"cut it; send at most {max_chars} characters", param=param)
    return near[-keep:]


def encode_text(tokenizer: Any, text: str, max_chars: int, add_special_tokens: bool = True,
                param: str = "prompt", cut: bool = False) -> list[int]:
    """Prompt text to token ids, bounded first: a completion prompt, in the engine or the
    server (a rendered chat is bounded by render_chat).  `cut`: only its last tokens will
    run (truncate_prompt_tokens), so text past what max_model_len tokens can spell is
    read from its end (encode_for_cut) rather than refused."""
    def encoded(piece: str, special: bool) -> list[int]:
        return list(tokenizer.encode(piece, add_special_tokens=special))

    if cut:
        return encode_for_cut(encoded, text, max_chars, add_special_tokens, param)
    check_prompt_chars(text, max_chars, param)
    return encoded(text, add_special_tokens)


def render_chat(tokenizer: Any, default_template: str | None, messages: list[dict[str, Any]],
                chat_template: str | None = None, add_generation_prompt: bool = True, *,
                tools: list[dict[str, Any]] | None = None, chat_template_kwargs: dict[str, Any] | None = None,
                continue_final_message: bool = False, max_chars: int = MAX_PROMPT_CHARS,
                content_parts: bool = False, cut: bool = False, documents: list[dict[str, str]] | None = None) -> str:
    """Render one conversation to prompt text with `chat_template` (a request's own
    Jinja text: rendered in the sandbox), else `default_template` (--chat-template,
    else the tokenizer's).  `tools` (OpenAI's function definitions) and
    `chat_template_kwargs` (e.g. Qwen3's enable_thinking) and `documents` (vLLM's: a RAG
    template's sources, e.g. [{"title": ..., "text": ...}]) reach the template;
    `continue_final_message` leaves the last message open for the model to go on with
    (an assistant's prefill, or any role's, as HF renders it).  The text is at most
    `max_chars` characters; with `cut` (only its last tokens will run:
    truncate_prompt_tokens), at most MAX_PROMPT_CHARS, as encode_text's."""
    max_chars = MAX_PROMPT_CHARS if cut else max_chars
    if tokenizer is None:
        raise ValueError("this model has no tokenizer, so chat templates cannot be applied")
    if not isinstance(messages, list) or not messages or not all(
        isinstance(m, dict) and isinstance(m.get("role"), str) for m in messages
    ):
        raise ValueError("messages must be a non-empty list of {'role': ..., 'content': ...} dicts")
    check_continuation(continue_final_message, add_generation_prompt)
    own = bool(chat_template)  # ("" is no template: the default renders)
    if own and (not isinstance(chat_template, str) or len(chat_template) > MAX_REQUEST_TEMPLATE_CHARS):
        raise InvalidRequestError(f"chat_template must be Jinja template text of at most "
                                  f"{MAX_REQUEST_TEMPLATE_CHARS} characters", param="chat_template")
    # Content parts as a list for a template that iterates over them, else text joined
    # (a request's template is read in the sandbox, which joins them unless it iterates).
    parts = content_parts or own or bool(default_template) and iterates_content(default_template)
    messages = [_normalise_message(m, parts) for m in messages]
    kwargs = dict(chat_template_kwargs or {})
    reserved = {"tools", "chat_template", "add_generation_prompt", "continue_final_message", "tokenize",
                "messages", "documents", "conversations", "max_output_chars"} & set(kwargs)
    if reserved:
        raise InvalidRequestError(f"chat_template_kwargs may not set {', '.join(sorted(reserved))}",
                                  param="chat_template_kwargs")
    # The template's variables: the special tokens (bos_token, ...), then the request's kwargs.
    variables = {**{k: v for k, v in tokenizer.special_tokens_map.items() if isinstance(v, (str, list))}, **kwargs}
    if documents is not None:
        variables["documents"] = documents
    if own:
        return template_sandbox().render(chat_template, messages, tools, add_generation_prompt,
                                         continue_final_message, variables, max_chars, join_text=not content_parts)
    if not default_template:
        raise ValueError(NO_CHAT_TEMPLATE)
    try:
        text = render_chat_template(default_template, messages, tools=tools,
                                    add_generation_prompt=add_generation_prompt,
                                    continue_final_message=continue_final_message, max_output_chars=max_chars,
                                    **variables)
    except Exception as e:  # jinja2 errors come in many types; the user needs the message
        raise ValueError(f"applying the chat template failed: {e}") from e
    if len(text) > max_chars:  # (rendering stopped there)
        raise prompt_too_long(len(text), max_chars, "messages", at_least=True)
    return text


def check_continuation(continue_final_message: bool, add_generation_prompt: bool) -> None:
    """vLLM's rule: the last message is continued or a new one is prompted, not both.  (A
    last message of any role is continued, as HF's apply_chat_template and vLLM do.)"""
    if continue_final_message and add_generation_prompt:
        raise InvalidRequestError("continue_final_message and add_generation_prompt cannot both be true "
                                  "(set add_generation_prompt to false)", param="continue_final_message")


def encode_chat(tokenizer: Any, default_template: str | None, messages: list[dict[str, Any]],
                chat_template: str | None = None, add_generation_prompt: bool = True,
                **kwargs: Any) -> dict[str, Any]:
    """Chat prompt as {'prompt', 'prompt_token_ids'} (kwargs: render_chat's, which bounds
    the text).  The template already holds any BOS text, so the tokenizer must not add
    special tokens a second time; a special token's string in a message stays text
    (special_text.py)."""
    add_special_tokens = kwargs.pop("add_special_tokens", False)
    messages, hidden = hide_client_text(tokenizer, messages, kwargs)
    text = render_chat(tokenizer, default_template, messages, chat_template, add_generation_prompt, **kwargs)
    ids = encode_rendered(tokenizer, hidden, text, kwargs.get("max_chars", MAX_PROMPT_CHARS), add_special_tokens,
                          kwargs.get("cut", False))
    return {"prompt": hidden.shown(text), "prompt_token_ids": ids}


# What a client sends that a chat template may write into the prompt, besides the messages.
CLIENT_TEXT_FIELDS = ("tools", "documents", "chat_template_kwargs")
# The special-string scan's bound, in prompt character bounds: what a client sends may be
# longer than what its template renders (keys, past reasoning a template drops), which the
# rendered text's own check judges; this one only keeps the scan's cost bounded.
SCAN_BOUND_FACTOR = 4


def hide_client_text(tokenizer: Any, messages: Any, kwargs: dict[str, Any]) -> tuple[Any, HiddenSpecials]:
    """The messages and, in `kwargs` (render_chat's), the tools, documents and template
    kwargs with each special token string a client wrote hidden (special_text.py): a
    template renders all of them, and a document's text forged a system turn.  Text far
    past the prompt's character bound (render_chat's, SCAN_BOUND_FACTOR times) is refused
    before the scan, which costs more than the rendered text's check (10 MB of "<" took
    10 s to refuse, of "a" 0.4 s)."""
    limit = MAX_PROMPT_CHARS if kwargs.get("cut") else kwargs.get("max_chars", MAX_PROMPT_CHARS)
    values = (messages, *(kwargs.get(name) for name in CLIENT_TEXT_FIELDS))
    total = sum(map(len, text_strings(values)))  # (what the scan reads: images were taken out before)
    if total > SCAN_BOUND_FACTOR * limit:
        raise PromptTooLongError(f"the request's text (messages, tools, documents, template kwargs) is {total} "
                                 f"characters, more than the {SCAN_BOUND_FACTOR * limit} allowed ({SCAN_BOUND_FACTOR}x "
                                 f"the {limit} that max_model_len tokens of this model can spell)", param="messages")
    (messages, *hidden_values), hidden = hide_special_text(tokenizer, values)
    kwargs.update({name: v for name, v in zip(CLIENT_TEXT_FIELDS, hidden_values, strict=True) if v is not None})
    return messages, hidden


def encode_rendered(tokenizer: Any, hidden: HiddenSpecials, text: str, max_chars: int, add_special_tokens: bool,
                    cut: bool) -> list[int]:
    """A rendered chat's ids (its hidden special strings as plain text: special_text.py);
    with `cut` (truncate_prompt_tokens), read from its end as a completion's (encode_for_cut)."""
    def encode(piece: str, special: bool) -> list[int]:
        return hidden.encode(tokenizer, piece, special)

    return encode_for_cut(encode, text, max_chars, add_special_tokens, "messages") if cut else \
        encode(text, add_special_tokens)


# Content parts that carry an image: OpenAI's image_url, the Responses API's input_image,
# and HF's/vLLM's offline {"type": "image", "image": ...} and vLLM's {"type": "image_pil",
# "image_pil": ...}.
IMAGE_PART_TYPES = ("image_url", "input_image", "image", "image_pil")
# OpenAI's image_url.detail values (a resolution hint for its own models: accepted without
# effect here, where the checkpoint's processor decides the resolution).
IMAGE_DETAILS = ("auto", "low", "high")


def holds_image(content: Any) -> bool:
    """Whether a message's content carries an image part, at its top level or in an
    Anthropic tool_result's own content: what a server reads before it loads a model,
    so that a text model is not loaded only to refuse an image (entrypoints' lease)."""
    if not isinstance(content, list):
        return False
    for part in content:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in IMAGE_PART_TYPES or (kind == "tool_result" and holds_image(part.get("content"))):
            return True
    return False


class HasContent(Protocol):
    content: Any  # a message's: text, or a list of content parts


def messages_hold_image(messages: Iterable[HasContent] | None) -> bool:
    """Whether any of a request's messages (OpenAI's or Anthropic's) carries an image."""
    return any(holds_image(m.content) for m in messages or ())


def take_images(messages: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], list[Any]]:
    """Each image part replaced by {"type": "image"} (what vision models' chat templates
    render as their placeholder), and the images' sources in order (a URL, or what an
    offline caller put there: a PIL image, bytes)."""
    sources: list[Any] = []
    out = []
    for message in messages:
        content = message.get("content") if isinstance(message, dict) else None
        if not isinstance(content, list):
            out.append(message)
            continue
        parts = []
        for part in content:
            kind = part.get("type") if isinstance(part, dict) else None
            if kind == "image_embeds":
                raise ImageInputError("image_embeds content parts are not supported: send the image itself "
                                      "(the server runs the model's own vision tower)", param="messages")
            if kind not in IMAGE_PART_TYPES:
                parts.append(part)
                continue
            source = part.get(kind) if kind != "input_image" else part.get("image_url")
            detail = source.get("detail") if isinstance(source, dict) else part.get("detail")
            if detail is not None and detail not in IMAGE_DETAILS:
                raise ImageInputError(f"an image's detail must be one of {', '.join(IMAGE_DETAILS)}, got "
                                      f"{str(detail)[:50]!r}", param="messages")
            if isinstance(source, dict):
                source = source.get("url")
            if source is None and kind == "image":
                source = part.get("url")
            if source is None:
                raise ImageInputError(f"an {kind} content part needs its image (e.g. "
                                          "{'type': 'image_url', 'image_url': {'url': 'data:image/png;base64,...'}})",
                                          param="messages")
            sources.append(source)
            parts.append({"type": "image"})
        out.append({**message, "content": parts})
    return out, sources


def _normalise_message(message: dict[str, Any], content_parts: bool = False) -> dict[str, Any]:
    """The one place messages are normalised for chat templates: OpenAI-style content
    parts [{"type": "text", "text": ...}] become one string, joined with newlines as vLLM
    does for a template that reads content as a string; no content is "" (an assistant
    turn that only called tools); tool-call
    arguments sent as JSON text become the objects that templates render; an answer sent
    back with its `refusal` (and no content) says that refusal.  With
    `content_parts` (vision models, and templates that iterate over parts, as SmolVLM's
    and Gemma 3's do: chat_template.iterates_content), every content becomes a list of
    text and image parts instead.  OpenAI's
    deprecated functions turns become tools': an assistant's `function_call` a tool call,
    a `function` message (its result) a `tool` message."""
    message = {**_from_legacy_functions(message)}
    content = message.get("content")
    if not content and isinstance(message.get("refusal"), str):  # (an answer that refused: what it said)
        content = message["content"] = message["refusal"]
    if content_parts and isinstance(content, str):
        content = [{"type": "text", "text": content}]
    if content is None:
        message["content"] = [] if content_parts else ""
    elif isinstance(content, list):
        for part in content:
            if isinstance(part, dict) and part.get("type") == "image" and len(part) == 1:
                continue  # an image's place (take_images): {"type": "image"} renders the placeholder
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise ValueError(f"only text and image content parts are supported, got {str(part)[:200]}")
        message["content"] = [{"type": "text", "text": p["text"]} if p.get("type") == "text" else {"type": "image"}
                              for p in content]
        if not content_parts:
            message = join_text_parts(message)
    calls = message.get("tool_calls")
    if isinstance(calls, list):
        message["tool_calls"] = [_tool_call_for_template(c) for c in calls]
    return message


def _from_legacy_functions(message: dict[str, Any]) -> dict[str, Any]:
    """An assistant turn's `function_call` as its one tool call, and a `function` role
    message as the `tool` result answering it (by the function's name)."""
    call = message.get("function_call")
    if message.get("role") == "assistant" and isinstance(call, dict) and not message.get("tool_calls"):
        rest = {k: v for k, v in message.items() if k != "function_call"}
        return {**rest, "tool_calls": [{"id": f"call_{call.get('name')}", "type": "function", "function": call}]}
    if message.get("role") == "function":
        return {**message, "role": "tool", "tool_call_id": f"call_{message.get('name')}"}
    return message


def _tool_call_for_template(call: Any) -> Any:
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("arguments"), str):
        return call
    try:
        arguments = json.loads(function["arguments"])
    except (ValueError, RecursionError):  # (a client's text nested past the parser's depth: kept as text)
        return call
    return {**call, "function": {**function, "arguments": arguments}}
