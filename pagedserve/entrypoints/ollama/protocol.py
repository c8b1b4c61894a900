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

from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, field_validator

from pagedserve.entrypoints.openai.model_pool import UNSET, parse_keep_alive, without_latest
from pagedserve.entrypoints.openai.protocol import RequestBody
from pagedserve.entrypoints.openai.serving_engine import OpenAIError

OLLAMA_PATH_PREFIX = "/api/"
# A chat on Ollama's routes for a model without a chat template (Ollama's clients send no
# template of their own: the request field `chat_template` is not read on these routes).
NO_CHAT_TEMPLATE_HERE = "has no chat template to put messages in: /api/generate completes its prompt as is"

# options -> the OpenAI/vLLM sampling field it sets.
SAMPLING_OPTIONS = {"temperature": "temperature", "top_k": "top_k", "top_p": "top_p", "min_p": "min_p",
                    "seed": "seed", "stop": "stop", "presence_penalty": "presence_penalty",
                    "frequency_penalty": "frequency_penalty", "repeat_penalty": "repetition_penalty"}
# Loading and hardware hints: the server's flags decide these (accepted, no effect).
HARDWARE_OPTIONS = frozenset({"numa", "num_batch", "num_gpu", "main_gpu", "low_vram", "f16_kv", "logits_all",
                              "vocab_only", "use_mmap", "use_mlock", "embedding_only", "num_thread"})
# Options that only shape the repeat penalty (refused beside one: sampling()).
REPEAT_SHAPING = ("repeat_last_n", "penalize_newline")
# Sampling options of Ollama's that change nothing at the value given here: their
# neutral value, any other refused; () for those that only shape another option (a
# repeat penalty, or mirostat, which is off here) or another feature (num_keep: the
# prompt tokens a context shift keeps, and no context shifts here, as `shift`): any value,
# no effect alone.
NEUTRAL_OPTIONS: dict[str, tuple[Any, ...]] = {"typical_p": (1, 1.0), "tfs_z": (1, 1.0), "mirostat": (0,),
                                               **dict.fromkeys(REPEAT_SHAPING, ()),
                                               "mirostat_tau": (), "mirostat_eta": (), "num_keep": ()}
KNOWN_OPTIONS = frozenset(SAMPLING_OPTIONS) | HARDWARE_OPTIONS | frozenset(NEUTRAL_OPTIONS) | {"num_ctx",
                                                                                               "num_predict"}
# Each option's type in Ollama's Go struct, which refuses a value of another type on every
# route (embeddings too); the rest are numbers (float32 there; an integer is one too).
INTEGER_OPTIONS = frozenset({"top_k", "seed", "num_ctx", "num_predict", "num_batch", "num_gpu", "main_gpu",
                             "num_thread", "repeat_last_n", "num_keep", "mirostat"})
BOOLEAN_OPTIONS = frozenset({"numa", "low_vram", "f16_kv", "logits_all", "vocab_only", "use_mmap", "use_mlock",
                             "embedding_only", "penalize_newline"})


def option_type_error(name: str, value: Any) -> str | None:
    """Why `value` cannot be option `name`'s, or None."""
    if name in BOOLEAN_OPTIONS:
        return None if isinstance(value, bool) else "must be true or false"
    if name == "stop":  # (a list in Ollama's struct; one string is taken too, as OpenAI's stop)
        return None if isinstance(value, str) or (isinstance(value, list) and all(isinstance(v, str) for v in value)) \
            else "must be a list of strings"
    if isinstance(value, bool) or not isinstance(value, int | float):
        return "must be a number"
    if name in INTEGER_OPTIONS and isinstance(value, float) and not value.is_integer():
        return "must be an integer"
    return None


def whole_number(name: str, value: Any) -> int:
    """An integer option's value: Go's decoder (Ollama's) takes 4096.0 as 4096 too."""
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if not isinstance(value, int) or isinstance(value, bool):
        raise OpenAIError(f"options.{name} must be an integer", param="options")
    return value


class OllamaModel(RequestBody):
    """What every Ollama body has: the model's name, and maybe how long to keep it."""

    model_config = ConfigDict(extra="allow", strict=False)  # Ollama's clients send 0.7 and 1 alike
    model: str = Field(min_length=1, max_length=1024)
    keep_alive: float | int | str | None = None

    @field_validator("model")
    @classmethod
    def _untagged(cls, value: str) -> str:
        return without_latest(value)

    @field_validator("keep_alive", mode="before")
    @classmethod
    def _not_a_boolean(cls, value: Any) -> Any:
        if isinstance(value, bool):  # (a bool is an int to Python, not to Ollama's Go decoder)
            raise ValueError("keep_alive must be a duration such as \"5m\" or a number of seconds, not a boolean")
        return value

    def keep_alive_seconds(self) -> Any:
        """The request's keep_alive in seconds (None: forever), or UNSET."""
        if self.keep_alive is None:
            return UNSET
        try:
            return parse_keep_alive(self.keep_alive)
        except ValueError as e:
            raise OpenAIError(str(e), param="keep_alive") from None


class OllamaWithOptions(OllamaModel):
    """A body with Ollama's `options`: at most 64, each one Ollama defines."""

    options: dict[str, Any] | None = None

    @field_validator("options")
    @classmethod
    def _options_bounded(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        if value is not None and len(value) > 64:
            raise ValueError("options has more than 64 entries")
        return value

    def check_options(self) -> None:
        """Every option set (not null) is one Ollama defines, of its type; an option sent
        beside `options` instead of in it is refused by name (Ollama ignores it there: a
        client's temperature would have been dropped)."""
        misplaced = [name for name in self.model_extra or {} if name in KNOWN_OPTIONS]
        if misplaced:
            raise OpenAIError(f"{misplaced[0]} is an option: send it in options ({{\"options\": "
                              f"{{\"{misplaced[0]}\": ...}}}}), not beside it", param=misplaced[0])
        for name, value in (self.options or {}).items():
            if value is None:
                continue
            if name not in KNOWN_OPTIONS:
                raise OpenAIError(f"options.{name[:100]} is not an option this server knows", param="options")
            if (why := option_type_error(name, value)) is not None:
                raise OpenAIError(f"options.{name}: {why}, got {value!r:.50}", param="options")

    def num_ctx(self) -> int | None:
        """Ollama's context window for this request (None: the model's)."""
        value = (self.options or {}).get("num_ctx")
        if value is not None and whole_number("num_ctx", value) < 1:
            raise OpenAIError("options.num_ctx must be a positive integer", param="options")
        return None if value is None else int(value)


class OllamaGenerating(OllamaWithOptions):
    # (Go's decoder takes true, false or null, its default; pydantic's lax bool took "yes")
    stream: StrictBool = True
    format: Any = None  # "json" or a JSON schema (response_format says it plainly otherwise)
    # True or an effort level: the reasoning as `thinking` (no effort bounds it here); false: none.
    think: StrictBool | Literal["high", "medium", "low", "max"] | None = None
    logprobs: StrictBool | None = None
    top_logprobs: int | None = None
    # Ollama's: truncate (cut a history past num_ctx) and shift (slide the context when an
    # answer fills it) are accepted without effect: a prompt past the context is refused
    # and an answer stops where the context is full (done_reason "length").
    truncate: StrictBool | None = None
    shift: StrictBool | None = None
    # vLLM's (not Ollama's): blocks shared only with prompts of the same salt; it was
    # logged as unknown, and the cache shared.
    cache_salt: str | None = None

    @field_validator("stream", mode="before")
    @classmethod
    def _stream_default(cls, value: Any) -> Any:
        return True if value is None else value

    def refused_fields(self) -> None:
        """Ollama fields this server does not honour, refused by name."""
        for name in ("width", "height", "steps"):  # (Ollama's image-generation fields)
            if (self.model_extra or {}).get(name) is not None:
                raise OpenAIError(f"{name}: this server does not generate images", param=name)
        if self.logprobs or self.top_logprobs:
            raise OpenAIError("logprobs and top_logprobs are not served on Ollama's routes yet; ask "
                              "/v1/chat/completions for them", param="logprobs")

    def sampling(self) -> dict[str, Any]:
        """The OpenAI request fields `options` and `format` set (`num_predict` and
        `num_ctx` apply once the prompt's length is known: OllamaServing.prepare)."""
        self.check_options()
        body: dict[str, Any] = {}
        for name, value in (self.options or {}).items():
            if value is None or name in HARDWARE_OPTIONS or name in ("num_ctx", "num_predict"):
                continue
            if name in SAMPLING_OPTIONS:
                body[SAMPLING_OPTIONS[name]] = whole_number(name, value) if name in ("seed", "top_k") else value
            elif NEUTRAL_OPTIONS.get(name):
                if value not in NEUTRAL_OPTIONS[name]:
                    raise OpenAIError(f"options.{name}={value!r:.50} is not supported here (only its neutral "
                                      f"value, {NEUTRAL_OPTIONS[name][0]})", param="options")
        if (self.options or {}).get("repeat_last_n") == 0:  # (Ollama's: no repeat penalty at all)
            body.update(repetition_penalty=1.0, presence_penalty=0.0, frequency_penalty=0.0)
        self.check_repeat_shaping(body.get("repetition_penalty"), body.get("presence_penalty"),
                                  body.get("frequency_penalty"))
        body.update(self.response_format())
        return body

    def check_repeat_shaping(self, repetition: float | None, presence: float | None = None,
                             frequency: float | None = None) -> None:
        """The options that shape the repeat penalties (Ollama windows all three), refused
        beside one in effect (the request's, or the model's generation config's repeat
        penalty: OllamaServing.prepare checks that one): the penalties here cover the whole
        context (repeat_last_n -1, honoured; 0 turns them off, sampling())."""
        options = self.options or {}
        shaping = [k for k in REPEAT_SHAPING if options.get(k) is not None and not (k == "repeat_last_n"
                                                                                   and options[k] in (-1, 0))]
        if shaping and (repetition not in (None, 1, 1.0) or presence not in (None, 0, 0.0)
                        or frequency not in (None, 0, 0.0)):
            raise OpenAIError(f"options.{shaping[0]} is not supported beside a repeat, presence or frequency penalty "
                              "(the request's, or the model's generation config's): the penalties here cover the "
                              "whole context, as vLLM's do (repeat_last_n -1; 0 turns them off)", param="options")

    def num_predict(self) -> int | None:
        """Tokens to generate at most (None: until the end or the context is full, Ollama's
        -1 and -2); more than the context holds stops where it is full, as Ollama does."""
        value = (self.options or {}).get("num_predict")
        if value is None:
            return None
        value = whole_number("num_predict", value)
        if value == 0:  # (a request for nothing: named here, not as the max_tokens it maps to)
            raise OpenAIError("options.num_predict must be at least 1, or negative for no limit", param="options")
        return value if value > 0 else None

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

    @field_validator("messages", mode="before")
    @classmethod
    def _null_is_none(cls, value: Any) -> Any:
        return [] if value is None else value  # (Go reads a null list as empty: a load request)

    def image_field(self) -> str | None:
        return "messages" if any(isinstance(m, dict) and m.get("images") for m in self.messages) else None


class OllamaGenerateRequest(OllamaGenerating):
    prompt: str | None = None
    suffix: str | None = None
    system: str | None = None
    template: str | None = None
    context: list[int] | None = None
    raw: StrictBool | None = None
    images: list[Any] | None = None

    def image_field(self) -> str | None:
        return "images" if self.images else None


class OllamaEmbedRequest(OllamaWithOptions):
    """`options` are Ollama's (checked); of them only `num_ctx` bears on an embedding (the
    window an input must fit, or is cut to with `truncate`): embeddings do not sample."""

    stream: ClassVar[bool] = False
    input: str | list[str] = ""
    truncate: StrictBool = True
    dimensions: int | None = None

    def empty(self) -> bool:
        """Nothing to embed: Ollama loads the model and answers no embeddings."""
        return self.input in ("", [])


class OllamaEmbeddingsRequest(OllamaWithOptions):
    """The older /api/embeddings: one prompt, one embedding."""

    stream: ClassVar[bool] = False
    prompt: str = ""

    def empty(self) -> bool:
        return self.prompt == ""


class OllamaShowRequest(BaseModel):
    model_config = ConfigDict(extra="allow")
    model: str | None = Field(default=None, max_length=1024)
    name: str | None = Field(default=None, max_length=1024)  # the older field
    verbose: StrictBool | None = None

    def model_name(self) -> str:
        name = self.model or self.name
        if not name:
            raise OpenAIError("model is required", param="model")
        return without_latest(name)


def ollama_error_body(message: str) -> dict[str, str]:
    return {"error": message}
