"""BeamSearchStream (the server's use_beam_search) with a scripted next-token source."""

from __future__ import annotations

import asyncio

import pytest

from pagedserve.engine.beam_search import BeamSearchStream
from pagedserve.outputs import Logprob
from pagedserve.sampling_params import BeamSearchParams

EOS = 2


async def _next_tokens(ids: list[int]) -> dict[int, Logprob]:
    """After the prompt, token 7 then the end token are the likeliest."""
    if ids[-1] == 7:
        return {EOS: Logprob(-0.1), 8: Logprob(-3.0), 9: Logprob(-4.0), 5: Logprob(-5.0)}
    return {7: Logprob(-0.2), 8: Logprob(-2.0), 9: Logprob(-3.0), 5: Logprob(-4.0)}


@pytest.mark.parametrize("include", [False, True])
def test_an_ending_end_token_is_shown_only_when_the_request_includes_stop_strings(include) -> None:
    """include_stop_str_in_output was accepted beside use_beam_search and did nothing: the
    end token's text was always cut (without beam search it is kept)."""
    stream = BeamSearchStream("r", None, [1], BeamSearchParams(beam_width=2, max_tokens=4), _next_tokens, {EOS},
                              64, lambda ids: " ".join(map(str, ids)), include_stop=include)

    async def first() -> object:
        return await stream.__anext__()

    best = asyncio.run(first()).outputs[0]
    assert best.token_ids == [7, EOS] and best.finish_reason == "stop"
    assert best.text == ("7 2" if include else "7")
