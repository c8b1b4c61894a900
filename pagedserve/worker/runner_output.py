"""What the model runner hands back to the engine each step (plain Python data)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class LogprobsEntry:
    """Logprobs of one sampled token, from the raw (unprocessed, temperature 1) model
    distribution: the sampled token's logprob and rank (1 = most likely), and the
    `logprobs` most likely tokens, best first."""

    token_id: int
    logprob: float
    rank: int
    topk_token_ids: list[int]
    topk_logprobs: list[float]


def logprobs_entries(tokens: list[int], logprobs: list[float], ranks: list[int], top_ids: list[list[int]] | None,
                     top_lps: list[list[float]] | None, ks: list[int | None]) -> list[LogprobsEntry | None]:
    """One entry per row from a sampler's logprob lists (host), each cut to its row's k
    top logprobs (None where the row asked for none)."""
    return [None if k is None else LogprobsEntry(tokens[i], logprobs[i], ranks[i],
                                                 top_ids[i][:k] if k and top_ids else [],
                                                 top_lps[i][:k] if k and top_lps else [])
            for i, k in enumerate(ks)]


NO_TOKEN_LEFT = ("the request's constraints (grammar or response format, allowed_token_ids, logit_bias, "
                 "bad_words, min_tokens, a spent thinking_token_budget's end tag) together allow no token at this point")


@dataclass
class ModelRunnerOutput:
    req_ids: list[str]  # every request scheduled this step, in batch order
    # Only requests whose prompt is fully computed after this step get a token.
    sampled_token_ids: dict[str, list[int]] = field(default_factory=dict)
    # One entry per sampled token: a list where a step emitted several (speculative decoding).
    logprobs: dict[str, LogprobsEntry | list[LogprobsEntry]] = field(default_factory=dict)
    # Requests whose logits were not a distribution: they fail, the rest go on.  The value
    # is the client's error message when their own constraints excluded every token
    # (NO_TOKEN_LEFT), None when the model's logits were not finite (a server error).
    invalid_req_ids: dict[str, str | None] = field(default_factory=dict)
    # Requests that asked for prompt logprobs: (index of the first prompt token covered,
    # one entry per prompt token from there) for the prompt positions this step computed.
    prompt_logprobs: dict[str, tuple[int, list[LogprobsEntry]]] = field(default_factory=dict)
    # Pooling requests whose prompt this step completed: their result (a float32 CPU tensor,
    # layers/pooler.py); empty on tensor-parallel ranks > 0.
    pooler_output: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def empty(cls) -> ModelRunnerOutput:
        return cls(req_ids=[])
