"""Per-request sampling knobs, with vLLM's field names, defaults and validation.

Validation happens here, at construction and again when the engine accepts the
request (a caller may have changed a field since), so that a bad value is refused
before a request enters the engine and can never disturb other requests.  This is
the one place the ranges are written: the offline API raises the error as it is, the
server turns it into a 400 whose `param` names the field.  Every float must be
finite: a NaN temperature once reached the sampler and stopped the whole engine.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from pagedserve.errors import InvalidRequestError
from pagedserve.utils import is_int

_GREEDY_EPS = 1e-5
# torch.Generator.manual_seed takes 64-bit values; n > 1 children add their index.
_SEED_RANGE = (-(2**63), 2**63 - 1)


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
    skip_special_tokens: bool = True

    def __post_init__(self) -> None:
        if self.stop_token_ids is None:
            self.stop_token_ids = []
        elif isinstance(self.stop_token_ids, (list, tuple)):
            self.stop_token_ids = list(self.stop_token_ids)
        self.validate()

    def validate(self) -> None:
        """Raise InvalidRequestError (a ValueError) naming the first field out of range."""

        def bad(name: str, allowed: str) -> InvalidRequestError:
            return InvalidRequestError(f"{name} must be {allowed}, got {getattr(self, name)!r}", param=name)

        if not is_int(self.n) or self.n < 1:
            raise bad("n", "an integer >= 1")
        if not _is_finite(self.temperature) or self.temperature < 0:
            raise bad("temperature", "a finite number >= 0")
        if not _is_finite(self.top_p) or not 0 < self.top_p <= 1:
            raise bad("top_p", "a number in (0, 1]")
        if not is_int(self.top_k) or (self.top_k < 0 and self.top_k != -1):
            raise bad("top_k", "-1, 0 (disabled) or a positive integer")
        if not _is_finite(self.min_p) or not 0 <= self.min_p <= 1:
            raise bad("min_p", "a number in [0, 1]")
        if self.seed is not None and not (is_int(self.seed) and _SEED_RANGE[0] <= self.seed <= _SEED_RANGE[1]):
            raise bad("seed", "a 64-bit signed integer or None")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not _is_finite(value) or not -2 <= value <= 2:
                raise bad(name, "a number in [-2, 2]")
        if not _is_finite(self.repetition_penalty) or self.repetition_penalty <= 0:
            raise bad("repetition_penalty", "a finite number > 0")
        if self.max_tokens is not None and (not is_int(self.max_tokens) or self.max_tokens < 1):
            raise bad("max_tokens", "an integer >= 1 or None")
        if not is_int(self.min_tokens) or self.min_tokens < 0:
            raise bad("min_tokens", "an integer >= 0")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise InvalidRequestError(
                f"min_tokens must be <= max_tokens, got min_tokens={self.min_tokens}, "
                f"max_tokens={self.max_tokens}", param="min_tokens")
        if self.logprobs is not None and (not is_int(self.logprobs) or self.logprobs < 0):
            raise bad("logprobs", "an integer >= 0 or None")
        stops = self.stop_strings if isinstance(self.stop, (str, list, tuple, type(None))) else None
        if stops is None or not all(isinstance(s, str) and s for s in stops):
            raise bad("stop", "a non-empty string or a list of non-empty strings")
        if not isinstance(self.stop_token_ids, list) or not all(is_int(t) and t >= 0 for t in self.stop_token_ids):
            raise bad("stop_token_ids", "a list of non-negative integers")
        for name in ("include_stop_str_in_output", "ignore_eos", "skip_special_tokens"):
            if not isinstance(getattr(self, name), bool):
                raise bad(name, "True or False")

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


def _is_finite(x: object) -> bool:
    if isinstance(x, bool):
        return False
    return isinstance(x, int) or (isinstance(x, float) and math.isfinite(x))
