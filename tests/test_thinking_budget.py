"""The thinking budget's state (pagedserve/reasoning.py; the server's reasoning parser is
tests/entrypoints/openai/test_reasoning.py's): where an answer starts, and the one bound it
keeps whatever the model does."""

from __future__ import annotations

import re

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pagedserve.reasoning import ThinkingBudget, answer_starts_inside

S, E, X = 7, 8, 1  # start tag, end tag, any other token
TURN = 9  # a special token: a template's turn marker


@pytest.mark.parametrize("prompt, inside", [
    ([1, 2, 3], False),  # Qwen3: the model opens the block itself
    ([1, S, 2], True),  # R1's templates open it in the prompt (or a continued message inside one)
    ([1, S, 2, E, 3], False),  # Qwen3 with enable_thinking false: an empty block closed
    ([S, 2, E, S], True),  # an earlier turn's block, then an open one
    ([TURN, 2, S, 3, TURN, TURN, 4], False),  # a user's text quoting "<think>", then the template's turns
])
def test_the_answer_starts_inside_a_block_where_the_prompt_left_one_open(prompt, inside) -> None:
    assert answer_starts_inside(prompt, S, E, {TURN}) is inside


def test_the_end_is_due_once_the_budget_is_spent_inside_a_block_and_the_pending_token_counts() -> None:
    state = ThinkingBudget(2, S, E)
    state.read([X, S, X])  # before the block: free; one token spent inside
    assert (state.inside, state.spent) == (True, 1) and not state.must_end()
    assert state.must_end(pending=X)  # the second, still on the device
    assert not state.must_end(pending=E)  # ...or the block closed there
    state.read([X])
    assert state.must_end()
    state.read([E, X, X, S])  # closed; another block opens with nothing left
    assert state.must_end() and state.spent == 2


def _thinking(tokens: list[int], opened: bool) -> tuple[int, bool]:
    """(tokens spent inside blocks, whether the sequence ends inside one), read off the
    sequence as text: a block is a start tag and what follows up to an end tag."""
    text = ("S" if opened else "") + "".join({S: "S", E: "E"}.get(t, "x") for t in tokens)
    blocks = re.findall(r"S([^E]*)", text)
    spent = sum(len(b) for b in blocks)
    return spent, re.search(r"S[^E]*$", text) is not None


@given(budget=st.integers(0, 6), opened=st.booleans(),
       picks=st.lists(st.sampled_from([S, E, X, X, X]), max_size=60))
def test_a_model_forced_at_each_due_end_never_thinks_past_its_budget(budget, opened, picks) -> None:
    """Whatever tokens the model would pick, replacing each pick by the end tag where one
    is due keeps the tokens inside blocks to the budget, and changes a pick only where
    the answer so far is inside a block with the budget spent."""
    state = ThinkingBudget(budget, S, E, inside=opened)
    out: list[int] = []
    for pick in picks:
        token = E if state.must_end() else pick
        if token != pick:
            assert _thinking(out, opened) == (budget, True), (out, pick)
        state.read([token])
        out.append(token)
    assert _thinking(out, opened)[0] <= budget
