"""OpenAI request fields whose rules are OpenAI's own, for protocol.py's request models
and the Responses API's: the Predicted Outputs object, the fields this server accepts
only where they ask for nothing it cannot do, the hints it accepts without effect
(docs/serving.md, "Accepted without effect"), and the OpenAI fields it has nothing
behind, refused by name."""

from __future__ import annotations

import re
from typing import Any

from pydantic import Field

from pagedserve.errors import InvalidRequestError
from pagedserve.sampling_params import StructuredOutputsParams
from pagedserve.utils import same_value

# OpenAI's bounds on a request's metadata.
MAX_METADATA_PAIRS = 16
MAX_METADATA_KEY_CHARS = 64
MAX_METADATA_VALUE_CHARS = 512
# OpenAI's bound on safety_identifier; the same for prompt_cache_key, which has none stated.
MAX_HINT_CHARS = 128
# vLLM's request_id (an answer's id) has no stated bound: this one keeps ids and log lines sane.
MAX_REQUEST_ID_CHARS = 256
# OpenAI's rule for function names and json_schema format names (the Responses API's).
FUNCTION_NAME = re.compile(r"[a-zA-Z0-9_-]{1,64}")
# A tool's name on chat (and what Anthropic's and Ollama's requests become): it reaches the
# prompt and the tool parsers, where "<tool_call>", a quote or a line break forged the
# format.  OpenAI's letters plus the separators of namespaced names (MCP's "server.tool",
# "ns:tool"), which Ollama and vLLM take, at Anthropic's length.
TOOL_NAME = re.compile(r"[a-zA-Z0-9_.:/-]{1,128}")
TOOL_NAME_RULE = "1 to 128 letters, digits, '_', '-', '.', ':' or '/'"


class RefusedFieldError(InvalidRequestError):
    """A refusal of a field the client sent, by the name it sent (never renamed as the
    engine's own names are: chat's "prompt" error is about its messages, but a `prompt`
    field sent to chat is Responses' stored prompt)."""


# OpenAI fields (chat completions, Responses) that ask for something this server has
# nothing behind.  They are not modelled, so they arrive among a body's extra fields;
# any of them set (not null) is refused by name rather than ignored.
UNSUPPORTED_FIELDS: dict[str, str] = {
    "audio": "this server outputs text only (no audio)",
    "moderation": "this server runs no moderation model",
    "conversation": "this server keeps no conversations: send the conversation in input (or previous_response_id, "
                    "with --enable-responses-store)",
    "prompt": "this server keeps no prompt templates: send the instructions and input themselves",
    "context_management": "this server does not compact a conversation's context",
    "background_options": "background responses are not supported",
    "mm_processor_kwargs": "the image processors here take no per-request settings",  # (vLLM's fields)
    "media_io_kwargs": "images are decoded here with no per-request settings",
}


# vLLM's request fields for what this server does not do, each refused by name unless at a
# value that asks for nothing (they are not modelled either).  spaces_between_special_tokens
# asks for nothing of a fast tokenizer (vLLM's fast detokenizer does not read it either).
VLLM_NEUTRAL_FIELDS: dict[str, tuple[tuple[Any, ...], str]] = {
    "use_beam_search": ((False,), "beam search is served on /v1/completions and /v1/chat/completions, not here"),
    "length_penalty": ((1.0,), "it weighs beam search's candidates, and beam search is not served on this route"),
    "early_stopping": ((False,), "it ends beam searches early, and beam search is not served on this route"),
    "logits_processors": (([],), "this server loads no custom logits processors"),
    "vllm_xargs": (({},), "no custom logits processor here reads it"),
    "return_tokens_as_token_ids": ((False,), "logprobs name tokens by their text here (chat's `bytes` are each "
                                             "token's own bytes)"),
    "return_token_ids": ((False,), "answers carry text; /tokenize gives a text's token ids"),
    "spaces_between_special_tokens": ((True, False), "it must be true or false (either has no effect: vLLM's fast "
                                                     "detokenizer does not read it)"),
}


# Each generation route's fields sent to the other: refused by name there (a client that
# sent max_completion_tokens to /v1/completions had an answer of its default 16 tokens).
_CHAT_TURNS = "a chat field: /v1/completions completes its prompt as sent (/v1/chat/completions renders messages)"
CHAT_FIELDS: dict[str, str] = {  # (refused on /v1/completions)
    "max_completion_tokens": "the Completions API's limit is max_tokens",
    "top_logprobs": "the Completions API asks for logprobs with logprobs: N",
    **dict.fromkeys(("messages", "tools", "tool_choice", "parallel_tool_calls", "functions", "function_call",
                     "chat_template", "chat_template_kwargs", "add_generation_prompt", "continue_final_message",
                     "documents", "include_reasoning"), _CHAT_TURNS),
    **dict.fromkeys(("store", "metadata", "reasoning_effort", "verbosity", "modalities", "web_search_options"),
                    "a Chat Completions field, which the Completions API does not have"),
}
COMPLETION_FIELDS: dict[str, str] = {  # (refused on /v1/chat/completions)
    "suffix": "a Completions field (and fill-in-the-middle is not served)",
}
# Cohere's rerank fields for what the pooling routes do not do (refused there by name).
RERANK_FIELDS: dict[str, str] = {
    "max_tokens_per_doc": "documents are read whole here (truncate_prompt_tokens cuts every text)",
    "max_chunks_per_doc": "documents are read whole here, not in chunks",
    "rank_fields": "documents are text here, with no fields to rank by",
}
# Unmodelled fields every OpenAI route refuses or accepts at a neutral value: not logged as
# unknown (each route adds those it refuses itself: serving_engine.OpenAIServing.OWN_REFUSALS).
KNOWN_EXTRA_FIELDS = frozenset(UNSUPPORTED_FIELDS) | frozenset(VLLM_NEUTRAL_FIELDS)


def part_key_error(part: dict[str, Any], kind: str, keys: tuple[str, ...],
                   neutral: dict[str, tuple[tuple[Any, ...], str]]) -> str | None:
    """What is wrong with the keys of a content part or input item of type `kind` (None:
    nothing): one its API does not define for it (`keys`; refused by name, as OpenAI's and
    Anthropic's APIs refuse it), or one of `neutral` (name -> (values asking for nothing,
    why)) set to anything else; a key set to null is absent.  The one rule for nested
    objects' keys."""
    for key, value in part.items():
        if value is None:  # (null asks for nothing: the SDKs send back an answer's unset fields so)
            continue
        if key not in keys:
            return f"{str(key)[:100]!r} is not a field of {kind}"
        if key in neutral and value is not None and not same_value(value, neutral[key][0]):
            return f"{key} is not supported: {neutral[key][1]}"
    return None


def refuse_vllm_fields(extra: dict[str, Any] | None) -> None:
    """vLLM's fields of VLLM_NEUTRAL_FIELDS set to anything but a neutral value: refused by name."""
    for name, (neutral, why) in VLLM_NEUTRAL_FIELDS.items():
        value = (extra or {}).get(name)
        if value is not None and not same_value(value, neutral):
            raise InvalidRequestError(f"{name}={value!r:.60} is not supported: {why}", param=name)


def refuse_unsupported_fields(extra: dict[str, Any] | None, unsupported: dict[str, str] = UNSUPPORTED_FIELDS) -> None:
    """A body's extra (unmodelled) fields: those the API defines for what this server never
    does (`unsupported`: name -> why; OpenAI's by default) are refused by name (the others
    are logged as unknown, serving_engine.py)."""
    for name, why in unsupported.items():
        if (extra or {}).get(name) is not None:
            raise RefusedFieldError(f"{name} is not supported: {why}", param=name)


# OpenAI's object-valued hints, accepted without effect (docs/serving.md): each key's
# values (`str`: any string of at most MAX_HINT_CHARS; `bool`: true or false), and the
# (key, value) pairs refused by name, as asking for what this server does not do.
HintKeys = dict[str, tuple[Any, ...] | type]
PROMPT_CACHE_OPTIONS: HintKeys = {"mode": ("implicit", "explicit"), "ttl": ("30m", "12h"), "prewarm": bool,
                                  "comparison_response_id": str}
PROMPT_CACHE_REFUSED = {("prewarm", True): "prewarming a cache without an answer is not supported"}


def check_object_hint(name: str, value: dict[str, Any] | None, keys: HintKeys,
                      refused: dict[tuple[str, Any], str] | None = None) -> None:
    """`value` (an object-valued hint) holds only `keys`, each with one of its values."""
    for key, v in (value or {}).items():
        if key not in keys:
            raise InvalidRequestError(f"{name} takes {', '.join(keys)}, not {key[:40]!r}", param=name)
        if isinstance(v, (str, bool)) and (key, v) in (refused or {}):
            raise InvalidRequestError(f"{name}.{key} {v!r} is not supported: {(refused or {})[(key, v)]}",
                                      param=name)
        allowed = keys[key]
        if v is None or (isinstance(v, str) and len(v) <= MAX_HINT_CHARS if allowed is str
                         else isinstance(v, bool) if allowed is bool else v in allowed):
            continue
        shown = "a string" if allowed is str else "true or false" if allowed is bool else ", ".join(map(str, allowed))
        raise InvalidRequestError(f"{name}.{key} must be {shown}, not {repr(v)[:40]}", param=name)


def check_hint_strings(*named: tuple[str, str | None]) -> None:
    """String-valued hints, accepted without effect: each (name, value) at most MAX_HINT_CHARS."""
    for name, value in named:
        if value is not None and len(value) > MAX_HINT_CHARS:
            raise InvalidRequestError(f"{name} is {len(value)} characters, more than {MAX_HINT_CHARS}", param=name)


def check_hint_fields(prompt_cache_key: str | None, safety_identifier: str | None,
                      prompt_cache_options: dict[str, Any] | None) -> None:
    """OpenAI's caching and safety hints, accepted without effect, held to their shape:
    strings of at most MAX_HINT_CHARS; prompt_cache_options' keys and values."""
    check_hint_strings(("prompt_cache_key", prompt_cache_key), ("safety_identifier", safety_identifier))
    check_object_hint("prompt_cache_options", prompt_cache_options, PROMPT_CACHE_OPTIONS, PROMPT_CACHE_REFUSED)


def renamed_text(message: str, old: str | None, new: str | None) -> str:
    """An error's text naming field `old` as `new` where it starts with the name (the one
    rule every API's translation uses: "max_tokens must be ..." of max_completion_tokens)."""
    if old and new and old != new and message.startswith(f"{old} "):
        return new + message[len(old):]
    return message


def as_sent(e: InvalidRequestError, param: str | None, hint: str = "") -> InvalidRequestError:
    """The engine's refusal `e` under the request's own name for its field (`param`), in its text too."""
    return InvalidRequestError(renamed_text(str(e), e.param, param) + hint, param=param)


def check_request_id(request_id: str) -> str:
    """A client's request_id (vLLM's field, echoed in the answer's id): printable, at
    most MAX_REQUEST_ID_CHARS characters, so it cannot forge a log line."""
    if not 0 < len(request_id) <= MAX_REQUEST_ID_CHARS or not request_id.isprintable():
        raise InvalidRequestError(f"request_id must be 1 to {MAX_REQUEST_ID_CHARS} printable characters",
                                  param="request_id")
    return request_id


TEXT_PART_KEYS = ("type", "text")  # a chat text part's (a message's content, a prediction's)
# A chat image part's keys and its image_url object's (OpenAI's; vLLM's `uuid` names an
# image for its cache, in place of sending it again: images are cached by content here).
IMAGE_PART_KEYS = ("type", "image_url", "uuid")
IMAGE_URL_KEYS = ("url", "detail")
IMAGE_PART_NEUTRAL = {"uuid": ((), "images are cached here by their content, not by a client's id: send the "
                                   "image itself")}


def prediction_text(prediction: dict[str, Any] | None) -> str | None:
    """OpenAI's `prediction` ({"type": "content", "content": text or text parts}) as its
    text, the parts joined; the engine bounds and tokenizes it (SamplingParams.prediction)."""
    if prediction is None:
        return None
    if prediction.get("type") != "content" or set(prediction) != {"type", "content"}:
        raise InvalidRequestError('prediction must be {"type": "content", "content": ...}', param="prediction")
    content = prediction["content"]
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text"
                                         and isinstance(p.get("text"), str) for p in content):
        for k, part in enumerate(content):
            if (error := part_key_error(part, "a text part", TEXT_PART_KEYS, {})) is not None:
                raise InvalidRequestError(f"prediction.content[{k}]: {error}", param="prediction")
        return "".join(p["text"] for p in content)
    raise InvalidRequestError('prediction.content must be a string or a list of {"type": "text", "text": ...} parts',
                              param="prediction")


def check_chat_only_fields(modalities: list[str] | None, web_search_options: dict[str, Any] | None,
                           store: bool | None, metadata: dict[str, str] | None) -> None:
    """Chat fields that ask for what this server never does are refused by name (audio
    output, a web search, a completion kept for later); metadata is held to OpenAI's
    bounds, though nothing reads it."""
    other = [m for m in modalities or () if m != "text"]
    if other:
        raise InvalidRequestError(f"modalities: this server outputs text only, not {repr(other[0])[:100]}",
                                  param="modalities")
    if web_search_options is not None:
        raise InvalidRequestError("web_search_options is not supported: this server cannot search the web",
                                  param="web_search_options")
    if store:
        raise InvalidRequestError("store is not supported on /v1/chat/completions: chat completions are not kept "
                                  "on this server (send store false, or leave it out)", param="store")
    check_metadata(metadata)


def check_metadata(metadata: dict[str, str] | None) -> None:
    """OpenAI's bounds on metadata (chat completions and Responses alike), though nothing reads it."""
    meta = metadata or {}
    if len(meta) > MAX_METADATA_PAIRS or any(len(k) > MAX_METADATA_KEY_CHARS or len(v) > MAX_METADATA_VALUE_CHARS
                                             for k, v in meta.items()):
        raise InvalidRequestError(f"metadata takes at most {MAX_METADATA_PAIRS} pairs, keys of at most "
                                  f"{MAX_METADATA_KEY_CHARS} characters and values of at most "
                                  f"{MAX_METADATA_VALUE_CHARS}", param="metadata")


def omitted_if_none() -> Any:
    """A stream delta's optional field, left out of the JSON while None: a delta says only
    what it adds, as OpenAI's and vLLM's do.  (The openai client's stream helper copies a
    tool call delta's `type` as it is: the `"type": null` of a named call's argument
    fragments broke its accumulation with an AssertionError.)"""
    return Field(default=None, exclude_if=lambda value: value is None)


# A chat message's keys by role, as OpenAI defines them (with the reasoning an answer
# sent back carries, vLLM's names); any other is refused by name, as OpenAI refuses it
# (one was dropped from the prompt).  Other roles (vLLM passes custom ones to the
# template) take role, content and name.
MESSAGE_KEYS = {"assistant": ("role", "content", "name", "tool_calls", "function_call", "refusal", "audio",
                              "annotations", "reasoning", "reasoning_content"),
                "tool": ("role", "content", "tool_call_id", "name")}
OTHER_MESSAGE_KEYS = ("role", "content", "name")


def check_chat_message(i: int, role: str, message: dict[str, Any]) -> None:
    """messages[i] (set keys only): its keys for its role and its text parts', a past
    answer's audio (text only here) and refusal (its text, where content is none)."""
    where = f"messages[{i}]"
    error = part_key_error(message, f"an {role[:50]} message" if role[:1] in "aeio" else f"a {role[:50]} message",
                           MESSAGE_KEYS.get(role, OTHER_MESSAGE_KEYS),
                           {"audio": ((), "this server outputs text only (no audio)"),  # (a past answer's
                            "annotations": (([],), "this server's answers carry none")})  # web citations)
    if error is None and role == "function" and not isinstance(message.get("name"), str):
        error = "a function message (the deprecated functions' result) needs the function's name"
    if error is None and message.get("refusal") is not None and (
            not isinstance(message["refusal"], str) or message.get("content") not in (None, "", [])):
        error = "refusal must be a string, and the turn's content none (a refusal is what the turn said)"
    for part in message.get("content") if isinstance(message.get("content"), list) else ():
        if error is None and isinstance(part, dict) and part.get("type") == "text":
            error = part_key_error(part, "a text part", TEXT_PART_KEYS, {})
        elif error is None and isinstance(part, dict) and part.get("type") == "image_url":
            error = part_key_error(part, "an image_url part", IMAGE_PART_KEYS, IMAGE_PART_NEUTRAL)
            if error is None and isinstance(part.get("image_url"), dict):
                error = part_key_error(part["image_url"], "an image_url", IMAGE_URL_KEYS, {})
    if error is not None:
        raise InvalidRequestError(f"{where}: {error}", param=where)


def check_sent_tool_calls(i: int, tool_calls: Any) -> None:
    """A past assistant turn's `tool_calls` (messages[i]), in OpenAI's shape: a list of
    {"function": {"name": NAME, "arguments": JSON text}} (`id` and `type` as the client
    wrote them).  One that is not was rendered as if absent, the call lost from the prompt."""
    if tool_calls is None:
        return
    where = f"messages[{i}].tool_calls"
    if not isinstance(tool_calls, list):
        raise InvalidRequestError(f"{where} must be a list of calls, got {type(tool_calls).__name__}", param=where)
    for j, call in enumerate(tool_calls):
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str) \
                or not isinstance(function.get("arguments", ""), (str, dict)):
            raise InvalidRequestError(f'{where}[{j}] must be {{"type": "function", "function": {{"name": NAME, '
                                      f'"arguments": JSON text}}}}, got {str(call)[:100]}', param=where)
        if not TOOL_NAME.fullmatch(function["name"]):  # (written into the prompt as the format's call)
            raise InvalidRequestError(f"{where}[{j}]: a function name must be {TOOL_NAME_RULE}, got "
                                      f"{function['name'][:80]!r}", param=where)


def check_tool_definitions(names: list[str], parameters: list[dict[str, Any] | None], field: str) -> None:
    """OpenAI's rules on function tools: names of TOOL_NAME's letters, each once (a
    named tool_choice or a call could not tell two apart), parameters a JSON schema of
    type "object" (a call's arguments are an object) where a type is given."""
    seen: set[str] = set()
    for i, (name, schema) in enumerate(zip(names, parameters, strict=True)):
        if not TOOL_NAME.fullmatch(name):
            raise InvalidRequestError(f"{field}[{i}]: a function name must be {TOOL_NAME_RULE}, got {name[:80]!r}",
                                      param=field)
        if name in seen:
            raise InvalidRequestError(f"{field}[{i}]: function names must be unique ({name[:100]!r} is given twice)",
                                      param=field)
        seen.add(name)
        kind = (schema or {}).get("type", "object")
        if kind != "object":
            raise InvalidRequestError(f"{field}[{i}]: the parameters of function {name[:100]!r} must be a JSON schema "
                                      f'of type "object", got type {str(kind)[:40]!r}', param=field)


def json_schema_format_error(spec: dict[str, Any]) -> str | None:
    """What is wrong with a json_schema format's fields besides its schema (chat's
    response_format.json_schema, the Responses API's text.format), as OpenAI holds them;
    None: nothing.  A missing name is taken as "output"."""
    name, description = spec.get("name") or "output", spec.get("description") or ""
    if set(spec) - {"type", "name", "schema", "strict", "description"} or not isinstance(name, str) \
            or not FUNCTION_NAME.fullmatch(name) or not isinstance(spec.get("strict", False), (bool, type(None))) \
            or not isinstance(description, str):
        return "takes name (^[a-zA-Z0-9_-]{1,64}$), schema, strict (true or false) and description (a string) only"
    return None


def constraint_of(field: str, value: Any) -> StructuredOutputsParams:
    """The output constraint a request's constraining field asks for: OpenAI's
    response_format (json_object, json_schema; vLLM's structural_tag, the tag itself in
    its `format` form or the older structures/triggers), vLLM's structured_outputs, or a
    guided_* field."""
    if field == "response_format":
        kind = value.get("type")
        keys = {"text": ("type",), "json_object": ("type",), "json_schema": ("type", "json_schema")}.get(
            kind if isinstance(kind, str) else "")  # (a list is no key: the schema fuzz's 500)
        if keys is not None and (error := part_key_error(value, f"a {kind} response_format", keys, {})):
            raise InvalidRequestError(f"response_format: {error}", param=field)
        if kind == "json_object":
            return StructuredOutputsParams(json_object=True)
        if kind == "json_schema":
            spec = value.get("json_schema")
            if not isinstance(spec, dict) or not isinstance(spec.get("schema"), (dict, bool)):  # (OpenAI's: required)
                raise InvalidRequestError("response_format.json_schema must be an object with a 'schema'",
                                          param=field)
            if (error := json_schema_format_error(spec)) is not None:
                raise InvalidRequestError(f"response_format.json_schema {error}", param=field)
            return StructuredOutputsParams(json=spec["schema"])
        if kind == "structural_tag":
            return StructuredOutputsParams(structural_tag=value)
        raise InvalidRequestError(f"response_format type must be 'text', 'json_object', 'json_schema' or "
                                  f"'structural_tag', got {kind!r}", param=field)
    if field == "structured_outputs":
        if not isinstance(value, dict):
            raise InvalidRequestError("structured_outputs must be an object", param=field)
        unknown = set(value) - set(StructuredOutputsParams.KINDS)
        if unknown:
            *kinds, last = StructuredOutputsParams.KINDS
            raise InvalidRequestError(f"structured_outputs takes {', '.join(kinds)} or {last}, not "
                                      f"{', '.join(sorted(unknown))}", param=field)
        return StructuredOutputsParams(**value)
    return StructuredOutputsParams(**{field.removeprefix("guided_"): value})
