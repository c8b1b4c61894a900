"""Bounds on what reaches a grammar compiler (request_limits.py has the numbers).

Grammar libraries are native code that recurses on the shape of what they compile:
llguidance overflowed its stack (exit 139, every request in flight lost) on a JSON
schema whose $ref chain was ~2,500 long, or a grammar of ~4,500 chained rules.  So a
spec is measured here, in Python and without recursion past the bound, before any
compiler sees it, and compiles run on threads with large stacks (the manager's) for
the margin.  A spec past a bound is the client's 400, naming the bound.
"""

from __future__ import annotations

import json
import re
from typing import Any

from pagedserve.errors import InvalidRequestError
from pagedserve.request_limits import MAX_GRAMMAR_CHARS, MAX_GRAMMAR_RULES, MAX_SCHEMA_DEPTH, MAX_SCHEMA_NODES

_RULE = re.compile(r"^\s*[?!]?[A-Za-z_][\w.-]*(?:\.\d+)?\s*(?:::=|:(?!:))", re.MULTILINE)
_DEFS = ("$defs", "definitions")


def _refuse(what: str) -> InvalidRequestError:
    return InvalidRequestError(f"structured outputs: {what}", param="structured_outputs")


def check_spec(kind: str, spec: str) -> None:
    """Raise InvalidRequestError if a (kind, spec) compile key is past a bound."""
    if len(spec) > MAX_GRAMMAR_CHARS:
        raise _refuse(f"the {kind} is {len(spec)} characters, more than the {MAX_GRAMMAR_CHARS} allowed")
    if kind in ("json", "structural_tag"):
        try:
            doc = json.loads(spec)
        except RecursionError:
            raise _refuse(f"the {kind} nests deeper than {MAX_SCHEMA_DEPTH} levels") from None
        except ValueError:
            return  # not JSON: the compiler says so
        _check_schema_depth(doc)
    elif kind == "grammar":
        rules = len(_RULE.findall(spec))
        if rules > MAX_GRAMMAR_RULES:
            raise _refuse(f"the grammar has {rules} rules, more than the {MAX_GRAMMAR_RULES} allowed")


def _check_schema_depth(root: Any) -> None:
    """Walk the schema as a compiler expands it: dicts and lists nested, and each local
    $ref ("#/...") followed as one more level (a ref back to a schema already on the
    path is recursion, which compilers expand lazily, so the walk stops there).  The
    depth reached must stay within MAX_SCHEMA_DEPTH.  Each dict's height is computed
    once (shared definitions cost one walk), and at most MAX_SCHEMA_NODES are walked."""
    height: dict[int, int] = {}
    on_path: set[int] = set()

    def too_deep() -> InvalidRequestError:
        return _refuse(f"the schema nests deeper than {MAX_SCHEMA_DEPTH} levels (counting each $ref followed)")

    def walk(node: Any, level: int, base: Any) -> int:
        """The height below `node`, found at `level`; raises past the bounds."""
        if level > MAX_SCHEMA_DEPTH:
            raise too_deep()
        key = id(node)
        if key in height:
            if level + height[key] > MAX_SCHEMA_DEPTH:
                raise too_deep()
            return height[key]
        if len(height) >= MAX_SCHEMA_NODES:
            raise _refuse(f"the schema has more than {MAX_SCHEMA_NODES} subschemas")
        on_path.add(key)
        below = 0
        children = node if isinstance(node, list) else list(node.values())
        if isinstance(node, dict):
            if any(isinstance(node.get(k), dict) for k in _DEFS):
                base = node  # refs below resolve against the schema that holds the definitions
            ref = node.get("$ref")
            target = _resolve(ref, base) if isinstance(ref, str) else None
            if isinstance(target, (dict, list)) and id(target) not in on_path:
                children = [target, *children]
        for child in children:
            if isinstance(child, (dict, list)) and id(child) not in on_path:
                below = max(below, 1 + walk(child, level + 1, base))
        on_path.discard(key)
        height[key] = below
        return below

    if isinstance(root, (dict, list)):
        walk(root, 0, root)


def _resolve(ref: str, base: Any) -> Any:
    """A local JSON pointer ("#/$defs/x") against `base`, or None."""
    if not ref.startswith("#"):
        return None
    node = base
    for part in ref[1:].split("/")[1:] if ref != "#" else []:
        part = part.replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return None
    return node
