"""Ollama's native API bodies (`/api/chat`, `/api/generate`, `/api/embed`, ...), as its
official clients send them, and how each field maps onto the OpenAI request the same
engine answers (`options` -> sampling, `format` -> structured outputs).

Every field Ollama defines is either honoured or refused by name; docs/serving.md has
the table.  Hardware and loading hints (`num_gpu`, `num_thread`, `use_mmap`, ...) are
the operator's here (the server's flags), so they are accepted without effect, as
OpenAI's no-op fields are.  Unknown fields are kept and logged once, as on the OpenAI
routes, so newer clients keep working.
"""

from __future__ import annotations

from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict, Field, field_validator

from pagedserve.entrypoints.openai.model_pool import UNSET, parse_keep_alive
from pagedserve.entrypoints.openai.protocol import RequestBody
from pagedserve.entrypoints.openai.serving_engine import OpenAIError

OLLAMA_PATH_PREFIX = "/api/"

# options -> the OpenAI/vLLM sampling field it sets.
SAMPLING_OPTIONS = {"temperature": "temperature", "top_k": "top_k", "top_p": "top_p", "min_p": "min_p",
                    "seed": "seed", "stop": "stop", "presence_penalty": "presence_penalty",
                    "frequency_penalty": "frequency_penalty", "repeat_penalty": "repetition_penalty"}
# Loading and hardware hints: the server's flags decide these (accepted, no effect).
HARDWARE_OPTIONS = frozenset({"numa", "num_batch", "num_gpu", "main_gpu", "low_vram", "f16_kv", "logits_all",
                              "vocab_only", "use_mmap", "use_mlock", "embedding_only", "num_thread"})
# Sampling options of Ollama's that change nothing at the value given here (their
# neutral value, or with no repeat penalty to shape): any other value is refused.
NEUTRAL_OPTIONS: dict[str, tuple[Any, ...]] = {"typical_p": (1, 1.0), "tfs_z": (1, 1.0), "mirostat": (0,),
                                               "num_keep": (), "penalize_newline": (), "repeat_last_n": ()}


class OllamaModel(RequestBody):
    """What every Ollama body has: the model's name, and maybe how long to keep it."""

    model_config = ConfigDict(extra="allow", strict=False)  # Ollama's clients send 0.7 and 1 alike
    model: str = Field(min_length=1, max_length=1024)
    keep_alive: float | int | str | None = None

    def keep_alive_seconds(self) -> Any:
        """The request's keep_alive in seconds (None: forever), or UNSET."""
        if self.keep_alive is None:
            return UNSET
        try:
            return parse_keep_alive(self.keep_alive)
        except ValueError as e:
            raise OpenAIError(str(e), param="keep_alive") from None


class OllamaGenerating(OllamaModel):
    stream: bool = True
    options: dict[str, Any] | None = None
    format: str | dict[str, Any] | None = None
    think: bool | str | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None

    @field_validator("options")
    @classmethod
    def _options_bounded(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        if value is not None and len(value) > 64:
            raise ValueError("options has more than 64 entries")
        return value

    def refused_fields(self) -> None:
        """Ollama fields this server does not honour, refused by name."""
        if self.think not in (None, False):
            raise OpenAIError("think: the models served here do not think; leave it unset or false", param="think")
        if self.logprobs or self.top_logprobs:
            raise OpenAIError("logprobs and top_logprobs are not served on Ollama's routes yet; ask "
                              "/v1/chat/completions for them", param="logprobs")

    def sampling(self) -> dict[str, Any]:
        """The OpenAI request fields `options` and `format` set."""
        body: dict[str, Any] = {}
        for name, value in (self.options or {}).items():
            if value is None or name in HARDWARE_OPTIONS or name == "num_ctx":
                continue
            if name in SAMPLING_OPTIONS:
                body[SAMPLING_OPTIONS[name]] = value
            elif name == "num_predict":
                if not isinstance(value, int) or isinstance(value, bool):
                    raise OpenAIError("options.num_predict must be an integer", param="options")
                if value == 0:  # (a request for nothing: named here, not as the max_tokens it maps to)
                    raise OpenAIError("options.num_predict must be at least 1, or negative for no limit",
                                      param="options")
                if value > 0:  # -1: until the end; -2: until the context is full (both: no limit here)
                    body["max_tokens"] = value
            elif name in NEUTRAL_OPTIONS:
                if name in ("num_keep", "penalize_newline", "repeat_last_n"):
                    continue  # shape only a repeat penalty; checked below
                if value not in NEUTRAL_OPTIONS[name]:
                    raise OpenAIError(f"options.{name}={value!r:.50} is not supported here (only its neutral "
                                      f"value, {NEUTRAL_OPTIONS[name][0]})", param="options")
            else:
                raise OpenAIError(f"options.{name[:100]} is not an option this server knows", param="options")
        if body.get("repetition_penalty") not in (None, 1, 1.0) and any(
                (self.options or {}).get(k) is not None for k in ("repeat_last_n", "penalize_newline", "num_keep")):
            raise OpenAIError("options.repeat_last_n, penalize_newline and num_keep are not supported: the repeat "
                              "penalty here covers the whole context, as vLLM's repetition_penalty does",
                              param="options")
        body.update(self.response_format())
        return body

    def num_ctx(self) -> int | None:
        value = (self.options or {}).get("num_ctx")
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
            raise OpenAIError("options.num_ctx must be a positive integer", param="options")
        return value

    def response_format(self) -> dict[str, Any]:
        if self.format in (None, ""):
            return {}
        if self.format == "json":
            return {"response_format": {"type": "json_object"}}
        if isinstance(self.format, dict):
            return {"response_format": {"type": "json_schema", "json_schema": {"name": "format",
                                                                               "schema": self.format}}}
        raise OpenAIError(f"format must be \"json\" or a JSON schema, got {self.format!r:.100}", param="format")


class OllamaChatRequest(OllamaGenerating):
    messages: list[dict[str, Any]] = Field(default_factory=list)
    tools: list[dict[str, Any]] | None = None


class OllamaGenerateRequest(OllamaGenerating):
    prompt: str | None = None
    suffix: str | None = None
    system: str | None = None
    template: str | None = None
    context: list[int] | None = None
    raw: bool | None = None
    images: list[Any] | None = None


class OllamaEmbedRequest(OllamaModel):
    stream: ClassVar[bool] = False
    input: str | list[str] = ""
    truncate: bool = True
    options: dict[str, Any] | None = None
    dimensions: int | None = None


class OllamaEmbeddingsRequest(OllamaModel):
    """The older /api/embeddings: one prompt, one embedding."""

    stream: ClassVar[bool] = False
    prompt: str = ""
    options: dict[str, Any] | None = None


class OllamaShowRequest(BaseModel):
    model_config = ConfigDict(extra="allow")
    model: str | None = Field(default=None, max_length=1024)
    name: str | None = Field(default=None, max_length=1024)  # the older field
    verbose: bool | None = None

    def model_name(self) -> str:
        name = self.model or self.name
        if not name:
            raise OpenAIError("model is required", param="model")
        return name


def ollama_error_body(message: str) -> dict[str, str]:
    return {"error": message}
