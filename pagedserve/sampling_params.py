"""Per-request sampling knobs, with vLLM's field names, defaults and validation.

Validation happens here, at construction and again when the engine accepts the
request (a caller may have changed a field since), so that a bad value is refused
before a request enters the engine and can never disturb other requests.  This is
the one place the ranges are written: the offline API raises the error as it is, the
server turns it into a 400 whose `param` names the field.  Every float must be
finite: a NaN temperature once reached the sampler and stopped the whole engine.
"""

from __future__ import annotations

import copy
import enum
import functools
import inspect
import json
import math
from collections.abc import Callable
from dataclasses import InitVar, dataclass, field
from typing import Any

from pagedserve.errors import InvalidRequestError
from pagedserve.request_limits import (
    MAX_ALLOWED_TOKEN_IDS,
    MAX_BAD_WORD_CHARS,
    MAX_BAD_WORDS,
    MAX_STOP_STRING_CHARS,
    MAX_STOP_STRINGS,
    MAX_TOKEN_ID_LIST,
)
from pagedserve.utils import is_int, is_number, same_value

_GREEDY_EPS = 1e-5
RANDOM_SEED = -1  # a seed that asks for none
# torch.Generator.manual_seed takes 64-bit values; n > 1 children add their index.
_SEED_RANGE = (-(2**63), 2**63 - 1)


class RequestOutputKind(enum.Enum):
    """What a request's outputs carry while it runs (vLLM's, here as there)."""

    CUMULATIVE = 0  # everything so far, every step (the contract's default)
    DELTA = 1  # only what is new since the previous output (text, token ids, logprobs)
    FINAL_ONLY = 2  # one output, when the request finishes (what LLM.generate needs)


@dataclass
class StructuredOutputsParams:
    """Constrain the output to a language (vLLM's names): exactly one of a JSON schema
    (a dict, a JSON string or a pydantic model class), any JSON object, a regular
    expression, a choice among strings, an EBNF/GBNF grammar, or an xgrammar structural
    tag (free text in which tagged parts follow schemas: how tool calls are kept valid).
    The output then matches it, or is a prefix of a match if max_tokens runs out first."""

    json: Any = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    structural_tag: Any = None
    # The constraint starts once this token has been generated (the end of a reasoning
    # block, "</think>": set by the server's --reasoning-parser, as vLLM lets a model think
    # before its structured answer); None: from the first token.
    after_token: int | None = None

    KINDS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")

    def validate(self) -> None:
        if self.json is False:  # (JSON Schema's `false`: it was read as no schema at all)
            raise InvalidRequestError("the JSON schema `false` admits no value; the output would be empty",
                                      param="structured_outputs")
        kinds = [k for k in self.KINDS if getattr(self, k) not in (None, False)]
        if len(kinds) != 1:
            raise InvalidRequestError("structured_outputs needs exactly one of json, regex, choice, grammar, "
                                      f"json_object or structural_tag, got {kinds or 'none'}",
                                      param="structured_outputs")
        if self.regex is not None and not isinstance(self.regex, str):
            raise InvalidRequestError("structured_outputs.regex must be a string", param="structured_outputs")
        if self.grammar is not None and not isinstance(self.grammar, str):
            raise InvalidRequestError("structured_outputs.grammar must be a string", param="structured_outputs")
        if self.choice is not None and (not isinstance(self.choice, list) or not self.choice
                                        or not all(isinstance(c, str) for c in self.choice)):
            raise InvalidRequestError("structured_outputs.choice must be a non-empty list of strings",
                                      param="structured_outputs")
        if self.structural_tag is not None and not isinstance(self.structural_tag, (str, dict)):
            raise InvalidRequestError("structured_outputs.structural_tag must be a JSON object (or its text)",
                                      param="structured_outputs")
        if self.json_object not in (None, True, False):
            raise InvalidRequestError("structured_outputs.json_object must be true or false", param="structured_outputs")
        if self.after_token is not None and (not is_int(self.after_token) or self.after_token < 0):
            raise InvalidRequestError("structured_outputs.after_token must be a token id", param="structured_outputs")
        self.schema_text()  # a schema that cannot be serialised is refused here

    def schema_text(self) -> str | None:
        """The JSON schema as text (the compile cache's key), or None for other kinds."""
        schema = self.json
        if schema is None:
            return None
        if isinstance(schema, str):
            return schema
        if isinstance(schema, type) and hasattr(schema, "model_json_schema"):  # a pydantic model class
            schema = schema.model_json_schema()
        try:
            return json.dumps(schema)  # key order kept: it is the order the fields are generated in
        except (TypeError, ValueError) as e:
            raise InvalidRequestError(f"structured_outputs.json is not a JSON schema: {e}",
                                      param="structured_outputs") from None

    @property
    def key(self) -> tuple[str, str]:
        """(kind, spec): equal keys compile to the same grammar."""
        if self.json is not None:
            return ("json", self.schema_text() or "")
        if self.regex is not None:
            return ("regex", self.regex)
        if self.choice is not None:
            return ("choice", json.dumps(self.choice))
        if self.grammar is not None:
            return ("grammar", self.grammar)
        if self.structural_tag is not None:
            tag = self.structural_tag
            return ("structural_tag", tag if isinstance(tag, str) else json.dumps(tag))
        return ("json_object", "")


GuidedDecodingParams = StructuredOutputsParams  # vLLM's older name


def vllm_kwargs(neutral: dict[str, tuple[tuple[Any, ...] | Callable[[Any, dict[str, Any]], bool], str]]
                ) -> Callable[[type], type]:
    """A params dataclass whose constructor takes vLLM's other keyword arguments at a value
    that asks for nothing here (`neutral`: name -> (such values, or a test of the value and
    the other arguments, and what the others ask for)),
    refuses them at any other by name, and answers an unknown one with the valid names
    (a vLLM script ported as it is fails clearly or runs as it did)."""
    def wrap(cls: type) -> type:
        init = cls.__init__
        names = [n for n in inspect.signature(init).parameters if n != "self"]  # (fields and InitVars)
        known = frozenset(names)

        @functools.wraps(init)
        def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
            for name in [k for k in kwargs if k not in known]:
                value = kwargs.pop(name)
                if name not in neutral:
                    raise TypeError(f"{cls.__name__}() got an unexpected keyword argument {name!r}; its arguments "
                                    f"are {', '.join(names)}")
                values, why = neutral[name]
                if not (values(value, kwargs) if callable(values) else same_value(value, values)):
                    raise InvalidRequestError(f"{name}={value!r:.60} is not supported here: {why}", param=name)
            init(self, *args, **kwargs)

        cls.__init__ = __init__
        return cls
    return wrap


@vllm_kwargs({
    "spaces_between_special_tokens": ((True, False), "it must be true or false (either has no effect: a fast "
                                                      "tokenizer's decode does not read it, nor does vLLM's)"),
    "logits_processors": ((None, []), "no custom logits processors are run here"),
    "extra_args": ((None, {}), "no custom logits processor reads it"),
    # (as the server's best_of: equal to n, or unset)
    "best_of": (lambda v, kw: v is None or is_int(v) and v == kw.get("n", 1),
                "best_of must equal n (best_of > n is not supported)"),
})
@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    max_tokens: int | None = 16
    min_tokens: int = 0
    logprobs: int | None = None
    # Top logprobs of every prompt token (0: just the prompt token's own), as vLLM.
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    # vLLM's: False returns token ids without text (text "", logprobs' decoded_token None),
    # the detokenizer's work skipped; stop strings need the text, so they are refused with it.
    detokenize: bool = True
    # Added to the logits of these token ids before sampling (OpenAI's logit_bias).
    logit_bias: dict[int, float] | None = None
    # Only these token ids may be sampled.
    allowed_token_ids: list[int] | None = None
    # Words (strings) the output may not contain; each is banned as the token sequences
    # the tokenizer makes of it, with and without a leading space (vLLM's semantics).
    bad_words: list[str] | None = None
    structured_outputs: StructuredOutputsParams | None = None
    # A predicted output (OpenAI's Predicted Outputs): the text (or token ids) the caller
    # expects back, e.g. the file being edited; the engine drafts from it (speculative
    # decoding, exact: the output is the one it would be without), so the text it
    # repeats comes several tokens a step.
    prediction: str | list[int] | None = None
    # vLLM's: keep only the prompt's last N tokens (-1: the last max_model_len); the
    # engine cuts it (InputProcessor, one rule with the server's field of that name).
    truncate_prompt_tokens: int | None = None
    # vLLM's: what AsyncLLM.generate yields while the request runs (LLM.generate returns
    # final outputs whatever it says, as vLLM's).
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    # vLLM's: at most this many tokens inside reasoning blocks ("<think>...</think>"), then
    # the end tag is forced (pagedserve/reasoning.py); None: no cap.
    thinking_token_budget: int | None = None
    # Filled by the engine from bad_words (it needs the tokenizer).
    bad_words_token_ids: list[list[int]] = field(default_factory=list, repr=False, compare=False)
    # Filled by the engine for thinking_token_budget: the vocabulary's start and end tag ids,
    # and whether the answer starts inside a block (reasoning.answer_starts_inside).
    thinking_tags: tuple[int, int, bool] | None = field(default=None, repr=False, compare=False)
    # vLLM's older name of structured_outputs (a GuidedDecodingParams), taken at construction.
    guided_decoding: InitVar[StructuredOutputsParams | None] = None

    def __post_init__(self, guided_decoding: StructuredOutputsParams | None = None) -> None:
        """vLLM's normal forms: `stop` and `stop_token_ids` as lists (a lone stop string in
        one, so `for s in params.stop` goes over strings), seed -1 as no seed (a random
        one: what -1 means to vLLM, llama.cpp and Ollama), and `guided_decoding` as
        `structured_outputs`."""
        if guided_decoding is not None:
            if self.structured_outputs is not None:
                raise InvalidRequestError("set structured_outputs or guided_decoding (its older name), not both",
                                          param="guided_decoding")
            self.structured_outputs = guided_decoding
        if self.stop_token_ids is None:
            self.stop_token_ids = []
        elif isinstance(self.stop_token_ids, (list, tuple)):
            self.stop_token_ids = list(self.stop_token_ids)
        if self.stop is None or isinstance(self.stop, (str, tuple)):
            self.stop = self.stop_strings
        if self.seed == RANDOM_SEED and is_int(self.seed):
            self.seed = None
        self.validate()

    def validate(self) -> None:
        """Raise InvalidRequestError (a ValueError) naming the first field out of range.
        The checks run in a fixed order (scalars, then lengths, logprobs, logit edits,
        structured outputs, stops, flags), so the field named is always the same one."""
        self._check_rules(_SCALAR_RULES)
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            # (the limit unnamed: each API has its own name for it, and the refusal names min_tokens)
            raise InvalidRequestError(f"min_tokens must be at most the request's token limit, got min_tokens="
                                      f"{self.min_tokens} over a limit of {self.max_tokens}", param="min_tokens")
        self._check_rules(_LOGPROBS_RULES)
        self._check_logit_edits()
        if self.structured_outputs is not None:
            if not isinstance(self.structured_outputs, StructuredOutputsParams):
                raise self._bad("structured_outputs", "a StructuredOutputsParams")
            self.structured_outputs.validate()
        self._check_stops()
        if not isinstance(self.output_kind, RequestOutputKind):
            raise self._bad("output_kind", "a RequestOutputKind (CUMULATIVE, DELTA or FINAL_ONLY)")
        for name in ("include_stop_str_in_output", "ignore_eos", "skip_special_tokens", "detokenize"):
            if not isinstance(getattr(self, name), bool):
                raise self._bad(name, "True or False")
        if not self.detokenize and self.stop_strings:
            raise InvalidRequestError("stop strings need detokenize=True (they are matched in the text)",
                                      param="detokenize")
        if self.prediction is not None:
            self._check_prediction()

    def _bad(self, name: str, allowed: str) -> InvalidRequestError:
        """The error for field `name`: what it must be, and (shortened) what it is."""
        got = repr(getattr(self, name))
        if len(got) > 200:  # a huge value is not echoed back whole
            got = f"{got[:200]}... ({len(got)} characters)"
        return InvalidRequestError(f"{name} must be {allowed}, got {got}", param=name)

    def _check_rules(self, rules: tuple[_FieldRule, ...]) -> None:
        for rule in rules:
            if not rule.ok(getattr(self, rule.name)):
                raise self._bad(rule.name, rule.allowed)

    def _check_logit_edits(self) -> None:
        """logit_bias, allowed_token_ids and bad_words: well formed and bounded in size
        (each becomes per-step work in the sampler)."""
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict) or not all(
                    is_int(t) and t >= 0 and _is_finite(b) for t, b in self.logit_bias.items()):
                raise self._bad("logit_bias", "a dict of non-negative token ids to finite numbers")
            if any(not -100 <= b <= 100 for b in self.logit_bias.values()):
                raise self._bad("logit_bias", "biases in [-100, 100] (OpenAI's range)")
            if len(self.logit_bias) > MAX_TOKEN_ID_LIST:
                raise self._bad("logit_bias", f"a dict of at most {MAX_TOKEN_ID_LIST} entries")
        if self.allowed_token_ids is not None:
            ids = self.allowed_token_ids
            if not isinstance(ids, list) or not ids or not all(is_int(t) and t >= 0 for t in ids):
                raise self._bad("allowed_token_ids", "a non-empty list of non-negative token ids")
            if len(ids) > MAX_ALLOWED_TOKEN_IDS:  # (a repeated id allows it once more: vLLM's take it)
                raise self._bad("allowed_token_ids", f"a list of at most {MAX_ALLOWED_TOKEN_IDS} token ids")
        if self.bad_words is not None:
            if not isinstance(self.bad_words, list) or not all(isinstance(w, str) and w.strip()
                                                               for w in self.bad_words):
                raise self._bad("bad_words", "a list of non-empty strings")
            if len(self.bad_words) > MAX_BAD_WORDS or any(len(w) > MAX_BAD_WORD_CHARS for w in self.bad_words):
                raise self._bad("bad_words", f"at most {MAX_BAD_WORDS} words of at most {MAX_BAD_WORD_CHARS} "
                                             "characters each")

    def _check_stops(self) -> None:
        """stop and stop_token_ids: checked after every step, so their count and length are bounded."""
        stops = self.stop_strings if isinstance(self.stop, (str, list, tuple, type(None))) else None
        if stops is None or not all(isinstance(s, str) and s for s in stops):
            raise self._bad("stop", "a non-empty string or a list of non-empty strings")
        if len(stops) > MAX_STOP_STRINGS or any(len(s) > MAX_STOP_STRING_CHARS for s in stops):
            raise self._bad("stop", f"at most {MAX_STOP_STRINGS} strings of at most {MAX_STOP_STRING_CHARS} "
                                    "characters each")
        if not isinstance(self.stop_token_ids, list) or not all(is_int(t) and t >= 0 for t in self.stop_token_ids):
            raise self._bad("stop_token_ids", "a list of non-negative integers")
        if len(self.stop_token_ids) > MAX_TOKEN_ID_LIST:
            raise self._bad("stop_token_ids", f"a list of at most {MAX_TOKEN_ID_LIST} entries")

    def _check_prediction(self) -> None:
        """A prediction is text or token ids, for one sequence (OpenAI refuses it with
        n > 1), on params whose drafts can be verified exactly: it is refused by name,
        never ignored, where it could not be used.  Its length is the engine's to bound
        (the prompt's character limit, max_model_len ids)."""
        pred = self.prediction
        if not isinstance(pred, str) and not (isinstance(pred, list) and all(is_int(t) and t >= 0 for t in pred)):
            raise self._bad("prediction", "a string, a list of non-negative token ids, or None")
        if self.n != 1:
            raise InvalidRequestError(f"prediction needs n = 1 (one predicted output per sequence), got n={self.n}",
                                      param="prediction")
        blocker = self._speculation_blocker()
        if blocker is not None:
            raise InvalidRequestError(
                f"prediction cannot be combined with {blocker}: predicted tokens are verified exactly only when "
                "each position samples from the distribution it would get one token at a time, which penalties, "
                "logit edits and output constraints change per position", param="prediction")

    def clone(self) -> SamplingParams:
        """A deep copy (vLLM's `clone`): the copy's lists and constraint are its own."""
        return copy.deepcopy(self)

    @property
    def stop_strings(self) -> list[str]:
        """`stop` as a list (derived, so a later change of `stop` is seen)."""
        stop = self.stop
        if stop is None:
            return []
        return [stop] if isinstance(stop, str) else list(stop)

    @property
    def is_greedy(self) -> bool:
        return self.temperature < _GREEDY_EPS

    @property
    def allows_speculation(self) -> bool:
        """Whether drafted tokens can be verified exactly for these params: every verified
        position must sample from the same processed distribution it would get one token
        at a time.  Penalties depend on the tokens before each position, and logit edits,
        grammars and a thinking budget's forced end tag are applied to the sampled row
        only, so requests using them decode
        one token per step.  (min_tokens is checked per request by the scheduler:
        once reached, it no longer changes the distribution.)"""
        return self._speculation_blocker() is None

    def _speculation_blocker(self) -> str | None:
        """The first field that rules out exact draft verification (allows_speculation), if any."""
        for name, used in (("presence_penalty", self.presence_penalty != 0.0),
                           ("frequency_penalty", self.frequency_penalty != 0.0),
                           ("repetition_penalty", self.repetition_penalty != 1.0),
                           ("logit_bias", bool(self.logit_bias)),
                           ("allowed_token_ids", self.allowed_token_ids is not None),
                           ("bad_words", bool(self.bad_words or self.bad_words_token_ids)),
                           ("thinking_token_budget", self.thinking_token_budget is not None),
                           # (named for every way a server request asks for one)
                           ("structured outputs (response_format, guided_*, or tool calls under a grammar: "
                            "tool_choice required, a named tool, or auto with a tool parser's format)",
                            self.structured_outputs is not None)):
            if used:
                return name
        return None


def _is_finite(x: object) -> bool:
    if isinstance(x, bool):
        return False
    return isinstance(x, int) or (isinstance(x, float) and math.isfinite(x))


def _optional_count(x: object) -> bool:
    return x is None or (is_int(x) and x >= 0)


@dataclass(frozen=True)
class _FieldRule:
    """One scalar field's rule: `ok(value)`, and what the error says the field must be."""

    name: str
    ok: Callable[[Any], bool]
    allowed: str


# Sampling runs in float32: a temperature past its largest value was inf (the logits NaN,
# the draw out of the vocabulary), and a repetition penalty of 1e-50 was 0 (the logits
# inf); within these bounds logits of any magnitude a model writes (|l| < 1e8) stay finite.
_FLOAT32_MAX = 3.4028234663852886e38
_PENALTY_RANGE = (1e-30, 1e30)
# In the order they are checked: the first field out of range is the one named.
_SCALAR_RULES = (
    _FieldRule("n", lambda v: is_int(v) and v >= 1, "an integer >= 1"),
    _FieldRule("temperature", lambda v: _is_finite(v) and 0 <= v <= _FLOAT32_MAX,
               "a number in [0, 3.4e38] (float32's range: a larger one turned the logits into NaN)"),
    _FieldRule("top_p", lambda v: _is_finite(v) and 0 < v <= 1, "a number in (0, 1]"),
    _FieldRule("top_k", lambda v: is_int(v) and (v >= 0 or v == -1), "-1, 0 (disabled) or a positive integer"),
    _FieldRule("min_p", lambda v: _is_finite(v) and 0 <= v <= 1, "a number in [0, 1]"),
    _FieldRule("seed", lambda v: v is None or (is_int(v) and _SEED_RANGE[0] <= v <= _SEED_RANGE[1]),
               "a 64-bit signed integer or None"),
    _FieldRule("presence_penalty", lambda v: _is_finite(v) and -2 <= v <= 2, "a number in [-2, 2]"),
    _FieldRule("frequency_penalty", lambda v: _is_finite(v) and -2 <= v <= 2, "a number in [-2, 2]"),
    _FieldRule("repetition_penalty", lambda v: _is_finite(v) and _PENALTY_RANGE[0] <= v <= _PENALTY_RANGE[1],
               "a number in [1e-30, 1e30] (the float32 logits it divides or multiplies stay finite)"),
    _FieldRule("max_tokens", lambda v: v is None or (is_int(v) and v >= 1), "an integer >= 1 or None"),
    _FieldRule("min_tokens", lambda v: is_int(v) and v >= 0, "an integer >= 0"),
    _FieldRule("truncate_prompt_tokens", lambda v: v is None or (is_int(v) and (v >= 1 or v == -1)),
               "-1, a positive integer or None"),
    _FieldRule("thinking_token_budget", _optional_count, "an integer >= 0 or None"),
)
_LOGPROBS_RULES = (
    _FieldRule("logprobs", _optional_count, "an integer >= 0 or None"),
    _FieldRule("prompt_logprobs", _optional_count, "an integer >= 0 or None"),
)


# Beam search asks the engine for each beam's 2 x beam_width most likely next tokens.
MAX_BEAM_WIDTH = 10
MAX_LENGTH_PENALTY = 10.0  # (HF's and vLLM's examples use 0.6-2)


@vllm_kwargs({"temperature": ((0.0,), "beam search here ranks by the model's own logprobs (temperature 0)"),
              "include_stop_str_in_output": ((False,), "beams end at the end-of-sequence token, with no stop strings")})
@dataclass
class BeamSearchParams:
    """`LLM.beam_search` (vLLM's fields): the `beam_width` best continuations of up to
    `max_tokens` tokens by cumulative logprob, ranked by it over generated length **
    `length_penalty` (HF transformers' score); `early_stopping` is HF's (True, False or
    "never": when the search ends before max_tokens; engine/beam_search.py), which
    vLLM's servers once took too."""

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    length_penalty: float = 1.0
    early_stopping: bool | str = False

    def validate(self, max_logprobs: int) -> None:
        if not is_int(self.beam_width) or not 1 <= self.beam_width <= min(MAX_BEAM_WIDTH, max_logprobs // 2):
            raise InvalidRequestError(f"beam_width must be an integer in [1, {min(MAX_BEAM_WIDTH, max_logprobs // 2)}] "
                                      f"(each beam asks for 2 x beam_width logprobs), got {self.beam_width!r}",
                                      param="beam_width")
        if not is_int(self.max_tokens) or self.max_tokens < 1:
            raise InvalidRequestError(f"max_tokens must be a positive integer, got {self.max_tokens!r}",
                                      param="max_tokens")
        if not isinstance(self.ignore_eos, bool):
            raise InvalidRequestError(f"ignore_eos must be true or false, got {self.ignore_eos!r:.60}",
                                      param="ignore_eos")
        # (bounded: a beam's length ** 1000 overflowed, ** -1000 reached 0, after the whole search)
        if not is_number(self.length_penalty) or not -MAX_LENGTH_PENALTY <= self.length_penalty <= MAX_LENGTH_PENALTY:
            raise InvalidRequestError(f"length_penalty must be a number in [-{MAX_LENGTH_PENALTY}, "
                                      f"{MAX_LENGTH_PENALTY}], got {self.length_penalty!r:.40}", param="length_penalty")
        if not any(self.early_stopping is v for v in (True, False)) and self.early_stopping != "never":
            raise InvalidRequestError(f'early_stopping must be true, false or "never", got {self.early_stopping!r:.40}',
                                      param="early_stopping")
