"""The shape of a JSON request body, bounded before anything parses it.

Parsing and validating a body runs on the event loop (FastAPI's `json.loads`, then
pydantic), and neither lets go of the GIL: a 14 MiB body of five million empty lists
held the loop, and so `/health` and every stream, for seven seconds (three quarters of
it a Python walk looking for lone surrogates).  Here the raw bytes are measured with
regular expressions and `bytes.count`, which run in C over the whole body in tens of
milliseconds, so an oversized shape is refused before one Python object is made:

- structure: strings, and brackets, braces, commas and colons (about one per JSON
  value), each at most MAX_JSON_STRUCTURE, which bounds the objects `json.loads` and
  pydantic make;
- nesting: at most MAX_JSON_DEPTH levels of arrays and objects (a running count, in
  numpy);
- lone UTF-16 surrogates (`"\\ud800"` alone, or a surrogate's UTF-8-style bytes, which
  Python's parser lets through) are not Unicode text: no tokenizer,
  template or grammar can take them.  Valid pairs (how JSON encoders write emoji) are
  removed from a copy, and only a body with a lone one left is parsed to name where.

Text inside strings is taken out first, so brackets in a prompt (code, JSON pasted as
text) never count.  A body that is not JSON at all passes through to FastAPI, which
says so in its own words.
"""

from __future__ import annotations

import json
import re
import sys
from typing import Any

import numpy as np

from pagedserve.errors import InvalidRequestError
from pagedserve.request_limits import MAX_JSON_DEPTH, MAX_JSON_STRUCTURE

# A JSON string, taken whole (atomic runs: linear time on a body that is one long string);
# one never closed runs to the end (else a match was tried from each of its quotes to the
# end: 80 KB of \" held the event loop 40 s).
_STRING = re.compile(rb'"(?:[^"\\]++|\\.)*+(?:"|\\?\Z)', re.DOTALL)
_NOT_BRACKET = bytes(b for b in range(256) if b not in b"[]{}")  # (bytes.translate's deletions)
# Escaped backslashes and valid surrogate pairs, left to right, so what remains of a
# "\uD8xx".."\uDFxx" escape is a lone surrogate.
_NOT_LONE = re.compile(rb"\\\\|\\u[dD][89abAB][0-9a-fA-F]{2}\\u[dD][c-fC-F][0-9a-fA-F]{2}")
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F][0-9a-fA-F]{2}")
# A surrogate written as UTF-8 bytes (ED A0..BF xx): never valid UTF-8, paired or not.
_SURROGATE_BYTES = re.compile(rb"\xed[\xa0-\xbf]")
_SURROGATE = re.compile("[\ud800-\udfff]")
# Python converts integers of at most this many digits (4,300 unless PYTHONINTMAXSTRDIGITS
# says otherwise; 0: no limit, and none is checked here either).
_MAX_NUMBER_DIGITS = sys.get_int_max_str_digits()
# Digits to "0", all else to " ": a run of too many digits is then one substring search.
_DIGITS_TO_ZEROS = bytes(ord("0") if b in b"0123456789" else ord(" ") for b in range(256))
_NAMED_LONG_NUMBER = re.compile(rb'"([A-Za-z_][A-Za-z0-9_]{0,63})"\s*:\s*-?\d{%d}' % (_MAX_NUMBER_DIGITS + 1))


def check_json_body(body: bytes) -> None:
    """Raise InvalidRequestError (a 400 naming the bound) if the body's shape is past a
    bound or it holds a lone surrogate; return at once for anything else."""
    # Quotes not escaped, in pairs: never more than the strings there are (a string ending
    # in an escaped backslash is missed), and cheap, so a body of a million short strings
    # is refused before the regular expression below walks them one by one.
    _check_count((body.count(b'"') - body.count(b'\\"')) // 2)
    structure = _STRING.sub(b'""', body)
    _check_count(sum(structure.count(c) for c in (b"[", b"{", b",", b":")))
    # (closings too, apart: a valid body has no more than its openings, counted above;
    # 15 MiB of "]" went on to the slower checks below)
    _check_count(structure.count(b"]") + structure.count(b"}"))
    _check_depth(structure)
    if _SURROGATE_BYTES.search(body) or _SURROGATE_ESCAPE.search(_NOT_LONE.sub(b"", body)):
        _raise_lone_surrogate(body)
    _check_text_and_numbers(body, structure)


def _check_text_and_numbers(body: bytes, structure: bytes) -> None:
    """Two things Python's JSON parser refuses with an error FastAPI turns into "There was
    an error parsing the body", naming nothing: bytes that are not UTF-8, and an integer
    of more digits than Python converts (its int_max_str_digits)."""
    try:
        if json.detect_encoding(body) == "utf-8":  # (json.loads takes UTF-16 and UTF-32 by their first bytes)
            body.decode("utf-8")
    except UnicodeDecodeError as e:
        raise InvalidRequestError(f"the request body is not UTF-8 text (byte {e.start}: {e.reason})",
                                  param=None) from None
    if _MAX_NUMBER_DIGITS and b"0" * (_MAX_NUMBER_DIGITS + 1) in structure.translate(_DIGITS_TO_ZEROS):
        named = _NAMED_LONG_NUMBER.search(body)
        raise InvalidRequestError(f"a number in the request body has more than {_MAX_NUMBER_DIGITS} digits",
                                  param=named.group(1).decode() if named else None)


def _check_count(count: int) -> None:
    if count > MAX_JSON_STRUCTURE:
        raise InvalidRequestError(
            f"the request body has at least {count} JSON values (counting strings, or brackets, braces, commas and "
            f"colons); at most {MAX_JSON_STRUCTURE} are allowed", param=None)


def _check_depth(structure: bytes) -> None:
    """The deepest point of the running count of openings less closings, any prefix past
    MAX_JSON_DEPTH refused, balanced or not (Python's parser recurses on an opening
    whether or not it is ever closed).  The count peaks just after an opening: the k-th
    (from 0) at offset p among the brackets stands at depth k + 1 - (p - k).  In C and
    numpy over the bytes: peeling innermost pairs once per level took 35 s on the event
    loop for 16 MiB of closing brackets."""
    brackets = np.frombuffer(structure.translate(None, _NOT_BRACKET), np.uint8)
    openings = np.flatnonzero((brackets == ord("[")) | (brackets == ord("{")))
    if openings.size and int((2 * np.arange(openings.size) + 1 - openings).max()) > MAX_JSON_DEPTH:
        raise InvalidRequestError(f"the request body nests arrays and objects deeper than {MAX_JSON_DEPTH} levels",
                                  param=None)


def _raise_lone_surrogate(body: bytes) -> None:
    """Name the field holding a lone surrogate (the body is bounded in size and shape by
    now, so parsing and walking it is cheap)."""
    try:
        data = json.loads(body)
    except ValueError:
        return  # not JSON: the parser's error says so
    path = find_lone_surrogate(data)
    if path is not None:
        raise InvalidRequestError(f"{path or 'body'} contains a lone UTF-16 surrogate, which is not valid Unicode "
                                  "text", param=path.split(".")[0] or None)


def find_lone_surrogate(data: Any) -> str | None:
    """The dotted path of the first string (value or key) holding a lone surrogate, "" for
    the body itself, or None.  Iterative: bodies may nest deeper than the recursion limit."""
    stack: list[tuple[Any, str]] = [(data, "")]
    while stack:
        value, path = stack.pop()
        if isinstance(value, str):
            if _SURROGATE.search(value):
                return path
        elif isinstance(value, dict):
            for k, v in value.items():
                stack.append((k, path))
                stack.append((v, f"{path}.{k}" if path else str(k)))
        elif isinstance(value, list):
            stack.extend((v, f"{path}.{i}") for i, v in enumerate(value))
    return None
