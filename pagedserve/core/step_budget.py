"""A step's token budget from a time target (`max_step_ms`), for CPUs.

Every running stream waits for the whole step, so one step that prefills sixteen
prompts makes every decode wait seconds on a CPU.  A token budget cannot say how long
a step takes (that depends on the model, the dtype and the CPU); a time target can, once
the cost of a token is known.  The engine reports each step's token count and duration;
a least-squares fit of  seconds = base + per_token x tokens  over recent steps
(exponentially forgotten, so it follows the machine's load) turns the target into a
token count.  Long prompts then prefill in chunks that fit beside the decodes, which
keep flowing.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class StepTimeBudget:
    target_s: float
    max_tokens: int  # max_num_batched_tokens: never more than the token budget allows
    decay: float = 0.9  # weight of the past per observed step
    _w: float = 0.0
    _t: float = 0.0  # weighted sums of tokens, seconds, tokens^2, tokens x seconds
    _s: float = 0.0
    _tt: float = 0.0
    _ts: float = 0.0

    def observe(self, tokens: int, seconds: float) -> None:
        """One finished step: `tokens` scheduled, `seconds` from launch to results."""
        if tokens <= 0 or seconds <= 0:
            return
        d = self.decay
        self._w = d * self._w + 1
        self._t = d * self._t + tokens
        self._s = d * self._s + seconds
        self._tt = d * self._tt + tokens * tokens
        self._ts = d * self._ts + tokens * seconds

    def cost(self) -> tuple[float, float] | None:
        """(base seconds, seconds per token) of the fit, or None before any step."""
        if self._w == 0:
            return None
        mean_t, mean_s = self._t / self._w, self._s / self._w
        var = self._tt / self._w - mean_t * mean_t
        if var > 1e-9 * max(1.0, mean_t * mean_t):
            per_token = (self._ts / self._w - mean_t * mean_s) / var
            if per_token > 0:
                return max(0.0, mean_s - per_token * mean_t), per_token
        return 0.0, mean_s / mean_t  # steps all of one size (or a noisy fit): all of it per token

    def token_budget(self, min_tokens: int) -> int:
        """Tokens the next step may schedule: what fits the target, at least `min_tokens`
        (the running decodes and some prefill progress), at most max_tokens."""
        fit = self.cost()
        if fit is None:
            return self.max_tokens
        base, per_token = fit
        fits = int((self.target_s - base) / per_token + 1e-6)  # (float dust must not cost a token)
        return max(min(min_tokens, self.max_tokens), min(fits, self.max_tokens))
