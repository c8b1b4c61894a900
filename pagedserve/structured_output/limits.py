"""Bounds on what reaches a grammar compiler (request_limits.py has the numbers).

Grammar libraries are native code that recurses on the shape of what they compile:
llguidance overflowed its stack (exit 139, every request in flight lost) on a JSON
schema whose $ref chain was ~2,500 long, or a grammar of ~4,500 chained rules.  So a
spec is measured here, in linear time and without recursing past the bound, before any
compiler sees it (on a compile thread, like the compile), and compiles run on threads
with large stacks (the manager's) for the margin.  A spec past a bound is the client's
400, naming the bound.
"""

from __future__ import annotations

import json
import re
from typing import Any

from pagedserve.errors import InvalidRequestError
from pagedserve.request_limits import (
    MAX_GRAMMAR_CHARS,
    MAX_GRAMMAR_RULES,
    MAX_SCHEMA_CHARS,
    MAX_SCHEMA_DEPTH,
    MAX_SCHEMA_NODES,
)

# A rule's head at the start of a line (leading blanks already stripped): GBNF's
# `name ::=` or Lark's `name:` / `?name.2:`.  Matched line by line: a multi-line
# pattern with a leading \s* is quadratic on blank lines (40 KB of them took 15 s).
_RULE_HEAD = re.compile(r"[?!]?[A-Za-z_][\w.-]*(?:\.\d+)?[ \t]*(?:::=|:(?!:))")
_LARK_START = re.compile(r"(?:%llguidance\b|start[ \t]*:)")
_SCHEMA_KINDS = ("json", "structural_tag")


def _refuse(what: str) -> InvalidRequestError:
    return InvalidRequestError(f"structured outputs: {what}", param="structured_outputs")


def _lines(spec: str) -> list[str]:
    return [line.lstrip(" \t") for line in spec.splitlines()]


def is_lark(spec: str) -> bool:
    """Whether a grammar is Lark (else GBNF): a `start:` rule or `%llguidance` directive
    at the start of a line (llguidance's own test, in linear time)."""
    return any(_LARK_START.match(line) for line in _lines(spec))


def check_spec(kind: str, spec: str) -> None:
    """Raise InvalidRequestError if a (kind, spec) compile key is past a bound."""
    limit = MAX_SCHEMA_CHARS if kind in _SCHEMA_KINDS else MAX_GRAMMAR_CHARS
    if len(spec) > limit:
        raise _refuse(f"the {kind} is {len(spec)} characters, more than the {limit} allowed")
    if kind in _SCHEMA_KINDS:
        try:
            doc = json.loads(spec)
        except RecursionError:
            raise _refuse(f"the {kind} nests deeper than {MAX_SCHEMA_DEPTH} levels") from None
        except ValueError:
            return  # not JSON: the compiler says so
        _check_schema_depth(doc)
    elif kind == "grammar":
        rules = sum(1 for line in _lines(spec) if _RULE_HEAD.match(line))
        if rules > MAX_GRAMMAR_RULES:
            raise _refuse(f"the grammar has {rules} rules, more than the {MAX_GRAMMAR_RULES} allowed")


def _check_schema_depth(root: Any) -> None:
    """Walk the schema as a compiler expands it: dicts and lists nested, and each $ref
    followed as one more level.  A ref is resolved every way a compiler might resolve
    it: as a JSON pointer against the document and against its nearest `$id` resource,
    and as a `$anchor` or `$id` name (over-counting only makes the bound stricter).  A
    ref back to a schema already on the path is recursion, which compilers expand
    lazily, so the walk stops there.  The depth reached must stay within
    MAX_SCHEMA_DEPTH; each (node, resource) is measured once, at most MAX_SCHEMA_NODES."""
    names = _anchors(root)
    height: dict[tuple[int, int], int] = {}
    on_path: set[int] = set()

    def too_deep() -> InvalidRequestError:
        return _refuse(f"the schema nests deeper than {MAX_SCHEMA_DEPTH} levels (counting each $ref followed)")

    def walk(node: Any, level: int, resource: Any) -> int:
        """The height below `node`, found at `level`; raises past the bounds."""
        if level > MAX_SCHEMA_DEPTH:
            raise too_deep()
        key = (id(node), id(resource))
        if key in height:
            if level + height[key] > MAX_SCHEMA_DEPTH:
                raise too_deep()
            return height[key]
        if len(height) >= MAX_SCHEMA_NODES:
            raise _refuse(f"the schema has more than {MAX_SCHEMA_NODES} subschemas")
        on_path.add(id(node))
        children = list(node) if isinstance(node, list) else list(node.values())
        if isinstance(node, dict):
            if "$id" in node:
                resource = node
            ref = node.get("$ref")
            if isinstance(ref, str):
                children += _targets(ref, root, resource, names)
        below = 0
        for child in children:
            if isinstance(child, (dict, list)) and id(child) not in on_path:
                below = max(below, 1 + walk(child, level + 1, resource))
        on_path.discard(id(node))
        height[key] = below
        return below

    if isinstance(root, (dict, list)):
        walk(root, 0, root)


def _anchors(root: Any) -> dict[str, Any]:
    """`$anchor` and `$id` values (as written, and as "#name" for anchors) -> their schema."""
    names: dict[str, Any] = {}
    stack = [root]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            for key in ("$anchor", "$id", "$dynamicAnchor"):
                value = node.get(key)
                if isinstance(value, str):
                    names[value] = node
                    names["#" + value] = node
            stack.extend(v for v in node.values() if isinstance(v, (dict, list)))
        elif isinstance(node, list):
            stack.extend(v for v in node if isinstance(v, (dict, list)))
    return names


def _targets(ref: str, root: Any, resource: Any, names: dict[str, Any]) -> list[Any]:
    found = []
    base, _, fragment = ref.partition("#")
    if ref in names:
        found.append(names[ref])
    if base and base in names:
        found.append(_pointer(names[base], fragment))
    if not base:
        found += [_pointer(root, fragment), _pointer(resource, fragment)]
    return [t for t in found if isinstance(t, (dict, list))]


def _pointer(node: Any, fragment: str) -> Any:
    """A JSON pointer ("/$defs/x", "" for the node itself) into `node`, or None."""
    if fragment and not fragment.startswith("/"):
        return None
    for part in fragment.split("/")[1:]:
        part = part.replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return None
    return node
