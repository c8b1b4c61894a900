"""The pooling routes' shared bound on a request's prompt tokens."""

from __future__ import annotations

import pytest

from pagedserve.entrypoints.openai import serving_pooling
from pagedserve.entrypoints.openai.serving_engine import OpenAIError, TokenizedPrompt
from pagedserve.entrypoints.openai.serving_pooling import OpenAIServingPooling


def test_the_total_token_bound_stops_tokenizing_at_the_first_prompt_past_it(monkeypatch) -> None:
    """Prompts are taken one at a time: the request is refused at the first prompt past
    the bound, the rest never tokenized (all 2,048 inputs of a 16 MiB body were, first)."""
    monkeypatch.setattr(serving_pooling, "MAX_POOLING_REQUEST_TOKENS", 10)
    made: list[int] = []

    def prompts(n: int, size: int):
        for i in range(n):
            made.append(i)
            yield TokenizedPrompt(None, [1] * size)

    with pytest.raises(OpenAIError, match=r"more than 10 tokens in all \(its first 3 hold 12\)") as e:
        OpenAIServingPooling.check_total_tokens(prompts(100, 4), "input")
    assert len(made) == 3 and e.value.param == "input"
    made.clear()
    assert len(OpenAIServingPooling.check_total_tokens(prompts(2, 5), "input")) == 2 and len(made) == 2
