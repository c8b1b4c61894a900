"""OpenAI request fields whose rules are OpenAI's own, for protocol.py's request models:
the Predicted Outputs object, and the chat fields this server accepts only where they
ask for nothing it cannot do (docs/serving.md, "Accepted without effect")."""

from __future__ import annotations

from typing import Any

from pagedserve.errors import InvalidRequestError

# OpenAI's bounds on a request's metadata.
MAX_METADATA_PAIRS = 16
MAX_METADATA_KEY_CHARS = 64
MAX_METADATA_VALUE_CHARS = 512


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
    meta = metadata or {}
    if len(meta) > MAX_METADATA_PAIRS or any(len(k) > MAX_METADATA_KEY_CHARS or len(v) > MAX_METADATA_VALUE_CHARS
                                             for k, v in meta.items()):
        raise InvalidRequestError(f"metadata takes at most {MAX_METADATA_PAIRS} pairs, keys of at most "
                                  f"{MAX_METADATA_KEY_CHARS} characters and values of at most "
                                  f"{MAX_METADATA_VALUE_CHARS}", param="metadata")
