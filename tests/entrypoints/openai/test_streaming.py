"""ChoiceStream: cumulative outputs -> deltas that concatenate to the final text."""

from __future__ import annotations

from pagedserve.entrypoints.openai.streaming import ChoiceStream
from pagedserve.outputs import CompletionOutput


def out(text: str, n_tokens: int, finish: str | None = None) -> CompletionOutput:
    return CompletionOutput(index=0, text=text, token_ids=list(range(n_tokens)), finish_reason=finish)


def test_deltas_concatenate_and_finish_once():
    cs = ChoiceStream()
    assert cs.advance(out("He", 1)) == ("He", 0, 1)
    assert cs.advance(out("He", 2)) is None  # a token with no visible text yet: nothing to send
    assert cs.advance(out("Hello", 3)) == ("llo", 1, 3)
    assert cs.advance(out("Hello!", 4, "stop")) == ("!", 3, 4) and cs.done
    assert cs.advance(out("Hello!", 4, "stop")) is None  # nothing after the last chunk


def test_logprob_clients_get_a_chunk_per_token_even_without_text():
    cs = ChoiceStream()
    assert cs.advance(out("", 1), want_tokens=True) == ("", 0, 1)
    assert cs.advance(out("", 1), want_tokens=True) is None


def test_text_held_back_by_the_engine_is_not_held_back_twice():
    """The engine's running text already stops short of a possible stop string; a second
    hold-back here would delay text that is certain (it once did, by the stop length)."""
    cs = ChoiceStream()
    assert cs.advance(out("abc", 3)) == ("abc", 0, 3)
    assert cs.advance(out("abcd", 4, "stop")) == ("d", 3, 4)


def test_calls_are_held_to_their_choices_finishing_chunk():
    import asyncio

    from pagedserve.entrypoints.openai.streaming import calls_after_text

    def call(i: int) -> dict:
        return {"index": i, "id": f"call_{i}", "function": {"name": "f", "arguments": "{}"}}

    chunks = [{"choices": [{"index": 0, "delta": {"content": "a"}}, {"index": 1, "delta": {"tool_calls": [call(0)]}}]},
              {"choices": [{"index": 0, "delta": {"tool_calls": [call(0)]}}]},
              {"choices": [{"index": 0, "delta": {"tool_calls": [call(1)]}}]},
              {"choices": [{"index": 0, "delta": {"content": "b"}}, {"index": 1, "delta": {}, "finish_reason": "x"}]},
              {"choices": [{"index": 0, "delta": {}, "finish_reason": "tool_calls"}]}, {"choices": [], "usage": {}}]

    async def main() -> list[dict]:
        async def source():
            for c in chunks:
                yield c
        return [c async for c in calls_after_text(source())]

    out = asyncio.run(main())
    deltas = [(c["index"], c["delta"]) for chunk in out for c in chunk["choices"]]
    assert deltas == [(0, {"content": "a"}), (1, {}), (0, {}), (0, {}), (0, {"content": "b"}),
                      (1, {"tool_calls": [call(0)]}), (0, {"tool_calls": [call(0), call(1)]})]
    assert out[-1] == {"choices": [], "usage": {}}
