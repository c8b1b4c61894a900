"""The raw-bytes bounds on a JSON body's shape (entrypoints/openai/json_body.py): each
refusal names its bound, nothing within them is refused, and a hostile body costs
milliseconds (checked against the parser here, not timed: the server test asserts the
event loop's latency)."""

from __future__ import annotations

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pagedserve.entrypoints.openai.json_body import check_json_body, find_lone_surrogate
from pagedserve.errors import InvalidRequestError
from pagedserve.request_limits import MAX_JSON_DEPTH, MAX_JSON_STRUCTURE


def test_five_million_empty_lists_are_refused_by_count() -> None:
    body = b'{"pad": [' + b",".join([b"[]"] * 5_000_000) + b"]}"
    with pytest.raises(InvalidRequestError, match=f"at most {MAX_JSON_STRUCTURE}"):
        check_json_body(body)


def test_many_strings_are_refused_by_count() -> None:
    body = json.dumps({"messages": [{"role": "user", "content": "x"}] * 300_000}).encode()
    with pytest.raises(InvalidRequestError, match="JSON values"):
        check_json_body(body)


def test_nesting_past_the_bound_is_refused_and_within_it_passes() -> None:
    with pytest.raises(InvalidRequestError, match=f"deeper than {MAX_JSON_DEPTH}"):
        check_json_body(b"[" * (MAX_JSON_DEPTH + 1) + b"]" * (MAX_JSON_DEPTH + 1))
    check_json_body(b"[" * MAX_JSON_DEPTH + b"]" * MAX_JSON_DEPTH)
    # openings never closed: Python's parser recursed on them (a RecursionError, not a 400)
    with pytest.raises(InvalidRequestError, match=f"deeper than {MAX_JSON_DEPTH}"):
        check_json_body(b'{"a": ' + b"[" * 100_000)
    # closings first: never deeper than the openings that follow them
    check_json_body(b"]" * 1000 + b"[" * MAX_JSON_DEPTH)
    check_json_body(b'{"a": [{"b": [1, 2, {"c": []}]}], "d": {}}')


def test_brackets_and_quotes_inside_strings_never_count() -> None:
    text = '[[[{{{,,,::: "quoted" \\ ' * 100_000
    check_json_body(json.dumps({"prompt": text}).encode())
    check_json_body(json.dumps({"prompt": "[" * (MAX_JSON_DEPTH + 10)}).encode())


@pytest.mark.parametrize(("body", "where"), [
    (json.dumps({"messages": [{"role": "user", "content": "a\ud800b"}]}), "messages.0.content"),
    ('{"p": "\\udc00x"}', "p"),
    ('{"p": "\\ud83d"}', "p"),
    ('{"k\\ud800": 1}', "body"),
])
def test_a_lone_surrogate_is_refused_naming_where(body: str, where: str) -> None:
    with pytest.raises(InvalidRequestError, match=f"^{where} contains a lone UTF-16 surrogate"):
        check_json_body(body.encode())


@pytest.mark.parametrize("body", [
    json.dumps({"p": "\U0001F600 and \U0001F680"}),  # pairs, as json.dumps writes emoji
    '{"p": "\\\\ud800"}',  # an escaped backslash, then plain text
    '{"p": "\\\\\\\\ud800"}',
])
def test_valid_pairs_and_escaped_backslashes_pass(body: str) -> None:
    check_json_body(body.encode())


def test_text_that_is_not_json_is_left_to_the_parser() -> None:
    check_json_body(b"not json at all [[[")
    check_json_body(b'{"p": "\\ud800')  # cut short: FastAPI says it is not valid JSON


@given(st.recursive(st.none() | st.booleans() | st.integers() | st.text(max_size=8),
                    lambda c: st.lists(c, max_size=4) | st.dictionaries(st.text(max_size=4), c, max_size=4),
                    max_leaves=40))
def test_any_small_valid_body_passes_unless_it_holds_a_lone_surrogate(value) -> None:
    body = json.dumps(value).encode()
    if find_lone_surrogate(value) is None:
        check_json_body(body)
    else:
        with pytest.raises(InvalidRequestError, match="lone UTF-16 surrogate"):
            check_json_body(body)


def test_a_surrogate_written_as_bytes_is_refused() -> None:
    """`\\xed\\xa0\\x80` is U+D800 as UTF-8 would spell it: invalid UTF-8 that Python's
    JSON parser still turns into a lone surrogate."""
    with pytest.raises(InvalidRequestError, match="^prompt contains a lone UTF-16 surrogate"):
        check_json_body(b'{"prompt": "\xed\xa0\x80"}')
    check_json_body('{"prompt": "\ud7ff \ue000"}'.encode())  # the code points either side are text


def test_bytes_that_are_not_utf8_and_integers_python_will_not_convert_are_named() -> None:
    """Python's parser refuses both, and FastAPI answered "There was an error parsing the
    body", naming nothing; a UTF-16 body (which json.loads reads) and long digits in a
    string or a float's fraction still pass."""
    with pytest.raises(InvalidRequestError, match="more than 4300 digits") as e:
        check_json_body(b'{"model": "m", "max_tokens": ' + b"9" * 5000 + b"}")
    assert e.value.param == "max_tokens"
    with pytest.raises(InvalidRequestError, match=r"not UTF-8 text \(byte 12"):
        check_json_body(b'{"prompt": "\xff\xfe"}')
    for fine in (b'{"prompt": "' + b"9" * 5000 + b'"}', b'{"x": 1.' + b"0" * 4000 + b"}",
                 '{"prompt": "hi"}'.encode("utf-16")):
        check_json_body(fine)
