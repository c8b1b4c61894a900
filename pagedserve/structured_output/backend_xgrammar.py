"""xgrammar: grammars compiled ahead into per-state token masks (fast masks, slow
compiles for bounded repetitions such as a string's maxLength)."""

from __future__ import annotations

import json
import re
from typing import Any

import torch
import xgrammar as xgr

from pagedserve.structured_output.limits import is_lark

# xgrammar errors start with "[HH:MM:SS] /path/file.cc:LINE: "; the client needs the rest.
_XGRAMMAR_PREFIX = re.compile(r"^\[[\d:]+\]\s+\S+:\d+:\s*")

# JSON-schema keywords xgrammar 0.2 compiles as if they were absent: its output broke the
# schema it was asked for ([1, 2, 2] under uniqueItems, any JSON under allOf), so each is
# refused by name (the guidance backend enforces or refuses them itself).
XGRAMMAR_IGNORES = ("allOf", "not", "if", "then", "else", "uniqueItems", "contains", "minContains", "maxContains",
                    "multipleOf", "dependentRequired", "dependentSchemas", "dependencies", "unevaluatedProperties",
                    "unevaluatedItems")
# The string formats it enforces (any other was accepted, and not enforced).
XGRAMMAR_FORMATS = ("date", "time", "date-time", "duration", "email", "hostname", "ipv4", "ipv6", "uri",
                    "uri-reference", "uri-template", "uuid", "json-pointer", "relative-json-pointer")
# Keywords whose value holds one subschema / a list of them / a name -> subschema map.
_ONE, _MANY, _MAP = ("items", "additionalProperties", "propertyNames"), ("prefixItems", "anyOf", "oneOf"), \
    ("properties", "patternProperties", "$defs", "definitions")
# A pattern's counted repetition compiles in time growing with the square of its count
# (10,000: 8.7 s; 20,000: 40 s, on a Zen 5): larger counts are refused.
MAX_PATTERN_REPEAT = 1000
_COUNTS = re.compile(r"\{(\d+)(?:,(\d*))?\}")
_LOOKAROUND = ("(?=", "(?!", "(?<=", "(?<!")


def tag_schemas(tag: Any) -> list[Any]:
    """The JSON schemas a structural tag holds (its "json_schema" formats, at any depth)."""
    found, stack = [], [tag]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            if node.get("type") == "json_schema" and isinstance(node.get("json_schema"), dict):
                found.append(node["json_schema"])
            stack += [v for k, v in node.items() if k != "json_schema" and isinstance(v, (dict, list))]
        elif isinstance(node, list):
            stack += node
    return found


def check_schema(schema: Any, where: str = "schema") -> None:
    """ValueError naming the first part of `schema` xgrammar would not enforce: a keyword
    it ignores, an unknown format, a length bound beside a format or pattern (dropped), a
    pattern's look-around (dropped) or huge count, a $ref outside the document, a required
    property a closed object cannot have."""
    stack = [(schema, where)]
    while stack:
        node, at = stack.pop()
        if not isinstance(node, dict):
            continue
        for key in XGRAMMAR_IGNORES:
            if key in node and not (key == "uniqueItems" and node[key] is False):
                raise ValueError(f"{at}: the xgrammar backend does not enforce {key!r} (the guidance backend "
                                 "enforces it or refuses it by name)")
        fmt, pattern = node.get("format"), node.get("pattern")
        if fmt is not None and fmt not in XGRAMMAR_FORMATS:
            raise ValueError(f"{at}: the xgrammar backend does not enforce format {str(fmt)[:40]!r}; it enforces "
                             + ", ".join(XGRAMMAR_FORMATS))
        if (fmt is not None or pattern is not None) and ("minLength" in node or "maxLength" in node):
            raise ValueError(f"{at}: the xgrammar backend drops minLength/maxLength beside a "
                             f"{'format' if fmt is not None else 'pattern'}; write the length into a pattern")
        if isinstance(pattern, str):
            if any(look in pattern for look in _LOOKAROUND):
                raise ValueError(f"{at}: the xgrammar backend drops a pattern's look-around")
            counts = [int(n) for m in _COUNTS.finditer(pattern) for n in m.groups() if n]
            if counts and max(counts) > MAX_PATTERN_REPEAT:
                raise ValueError(f"{at}: a pattern's repetition count of {max(counts)} is more than the "
                                 f"{MAX_PATTERN_REPEAT} the xgrammar backend compiles in bounded time")
        ref = node.get("$ref")
        if isinstance(ref, str) and not ref.startswith("#"):
            raise ValueError(f"{at}: $ref {ref[:60]!r} is outside the schema (only '#...' refs are resolved)")
        required, properties = node.get("required"), node.get("properties") or {}
        if isinstance(required, list) and node.get("additionalProperties", False) is False \
                and "patternProperties" not in node:
            missing = [name for name in required if name not in properties]
            if missing:
                raise ValueError(f"{at}: required property {str(missing[0])[:40]!r} is not among its properties "
                                 "(the object is closed: additionalProperties is false by default here)")
        stack += [(node[k], f"{at}.{k}") for k in _ONE if k in node]
        stack += [(v, f"{at}.{k}[{i}]") for k in _MANY if isinstance(node.get(k), list) for i, v in enumerate(node[k])]
        stack += [(v, f"{at}.{k}.{name}") for k in _MAP if isinstance(node.get(k), dict) for name, v in node[k].items()]


class XgrammarMatcher:
    def __init__(self, compiled: Any, stop_token_ids: list[int]) -> None:
        self._m = xgr.GrammarMatcher(compiled, override_stop_tokens=stop_token_ids or None)

    def accept_token(self, token_id: int) -> bool:
        return bool(self._m.accept_token(token_id))

    def refusal(self) -> str | None:
        return None  # (xgrammar says only True or False)

    def is_terminated(self) -> bool:
        return bool(self._m.is_terminated())


class XgrammarBackend:
    name = "xgrammar"

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: list[int]) -> None:
        self._stop_token_ids = stop_token_ids
        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size,
                                                  stop_token_ids=stop_token_ids or None)
        # Its own cache is off: the manager caches compiled grammars by spec, bounded.
        self._compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)

    def compile(self, kind: str, spec: str) -> Any:
        c = self._compiler
        try:
            if kind == "json":
                check_schema(json.loads(spec))
                return c.compile_json_schema(spec, any_whitespace=False)
            if kind == "json_object":  # OpenAI's json_object: an object, not any JSON value
                return c.compile_json_schema('{"type": "object"}', any_whitespace=False)
            if kind == "regex":
                return c.compile_regex(spec)
            if kind == "choice":
                return c.compile_grammar("root ::= " + " | ".join(json.dumps(s) for s in json.loads(spec)))
            if kind == "structural_tag":
                for schema in tag_schemas(json.loads(spec)):
                    check_schema(schema, "a tool's parameters")
                return c.compile_structural_tag(spec)
            if is_lark(spec):
                raise ValueError("a Lark grammar needs --structured-outputs-backend guidance (xgrammar reads GBNF)")
            return c.compile_grammar(spec)
        except (RuntimeError, ValueError) as e:
            text = str(e).strip()
            raise ValueError(_XGRAMMAR_PREFIX.sub("", text.splitlines()[0]) if text else type(e).__name__) from None

    def new_matcher(self, compiled: Any) -> XgrammarMatcher:
        return XgrammarMatcher(compiled, self._stop_token_ids)

    def fill_bitmask(self, bitmask: torch.Tensor, rows: list[tuple[Any, int]]) -> None:
        for matcher, row in rows:
            matcher._m.fill_next_token_bitmask(bitmask, row)
