"""Per-request sampling knobs, with vLLM's field names, defaults and validation.

Validation happens here, at construction, so that a bad value is refused before a
request enters the engine and can never disturb other requests.
"""

from __future__ import annotations

from dataclasses import dataclass, field

_GREEDY_EPS = 1e-5


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
    # Normalised copy of `stop` as a list (filled in __post_init__).
    _stop_list: list[str] = field(default_factory=list, repr=False, compare=False)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self._stop_list = [self.stop]
        elif self.stop is None:
            self._stop_list = []
        else:
            self._stop_list = list(self.stop)
        if self.stop_token_ids is None:
            self.stop_token_ids = []
        else:
            self.stop_token_ids = list(self.stop_token_ids)
        self._validate()

    def _validate(self) -> None:
        def bad(name: str, allowed: str) -> ValueError:
            return ValueError(f"{name} must be {allowed}, got {getattr(self, name)!r}")

        if not _is_int(self.n) or self.n < 1:
            raise bad("n", "an integer >= 1")
        if not _is_num(self.temperature) or self.temperature < 0:
            raise bad("temperature", "a number >= 0")
        if not _is_num(self.top_p) or not 0 < self.top_p <= 1:
            raise bad("top_p", "in (0, 1]")
        if not _is_int(self.top_k) or (self.top_k < 0 and self.top_k != -1):
            raise bad("top_k", "-1, 0 (disabled) or a positive integer")
        if not _is_num(self.min_p) or not 0 <= self.min_p <= 1:
            raise bad("min_p", "in [0, 1]")
        if self.seed is not None and not _is_int(self.seed):
            raise bad("seed", "an integer or None")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not _is_num(value) or not -2 <= value <= 2:
                raise bad(name, "in [-2, 2]")
        if not _is_num(self.repetition_penalty) or self.repetition_penalty <= 0:
            raise bad("repetition_penalty", "a number > 0")
        if self.max_tokens is not None and (not _is_int(self.max_tokens) or self.max_tokens < 1):
            raise bad("max_tokens", "an integer >= 1 or None")
        if not _is_int(self.min_tokens) or self.min_tokens < 0:
            raise bad("min_tokens", "an integer >= 0")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(
                f"min_tokens must be <= max_tokens, got min_tokens={self.min_tokens}, "
                f"max_tokens={self.max_tokens}"
            )
        if self.logprobs is not None and (not _is_int(self.logprobs) or self.logprobs < 0):
            raise bad("logprobs", "an integer >= 0 or None")
        if not all(isinstance(s, str) and s for s in self._stop_list):
            raise bad("stop", "a non-empty string or a list of non-empty strings")
        if not all(_is_int(t) and t >= 0 for t in self.stop_token_ids):
            raise bad("stop_token_ids", "a list of non-negative integers")

    @property
    def stop_strings(self) -> list[str]:
        return self._stop_list

    @property
    def is_greedy(self) -> bool:
        return self.temperature < _GREEDY_EPS

    @property
    def all_stop_token_ids(self) -> set[int]:
        return set(self.stop_token_ids or ())


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_num(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)
