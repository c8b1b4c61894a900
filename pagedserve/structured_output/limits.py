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
from dataclasses import dataclass
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
        names = _anchors(doc)  # (one pass over the document for both checks)
        _check_schema_depth(doc, names, tag=kind == "structural_tag")
        for schema in tag_schemas(doc) if kind == "structural_tag" else [doc]:
            _check_ref_loops(schema, names)
        _check_property_counts(doc)
    elif kind == "grammar":
        rules = sum(1 for line in _lines(spec) if _RULE_HEAD.match(line))
        if rules > MAX_GRAMMAR_RULES:
            raise _refuse(f"the grammar has {rules} rules, more than the {MAX_GRAMMAR_RULES} allowed")


# A schema's keywords whose value maps names to subschemas (every walk of a schema's
# subschemas reads them here), and those whose value is data.
SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_VALUES = ("const", "enum", "default", "examples")


def _check_property_counts(root: Any) -> None:
    """Refuse minProperties/maxProperties on an object open to keys past its listed ones:
    both grammar libraries let such a key repeat, and a JSON object with a key twice has
    fewer properties than the grammar counted ({"a": 0, ",": 0, ",": 0} under 3 and 3)."""
    stack = [root]
    while stack:
        node = stack.pop()
        if isinstance(node, list):
            stack += node
            continue
        if not isinstance(node, dict):
            continue
        # (schemas only: a property named maxProperties, an enum's or default's objects, are not)
        stack += [v for k, v in node.items() if k not in SCHEMA_MAPS and k not in _VALUES]
        stack += [v for k in SCHEMA_MAPS if isinstance(node.get(k), dict) for v in node[k].values()]
        extra = node.get("additionalProperties")
        closed = (extra is False or extra is None and "properties" in node) and "patternProperties" not in node
        if not closed and ("minProperties" in node or "maxProperties" in node):
            raise _refuse("minProperties/maxProperties need a closed object (its properties listed, no "
                          "patternProperties, additionalProperties false or unset): keys past the listed ones may "
                          "repeat in the output")


def _check_schema_depth(root: Any, names: dict[str, Any], tag: bool = False) -> None:
    """Walk the schema as a compiler expands it: dicts and lists nested, and each $ref
    followed as one more level.  The depth reached must stay within MAX_SCHEMA_DEPTH;
    each (node, scope) is measured once, at most MAX_SCHEMA_NODES.

    A ref is resolved every way a compiler might resolve it (over-counting only makes
    the bound stricter; under-counting lets a chain through to the compiler): as a `$anchor`
    or `$id` name, and as a JSON pointer against each base of its `_Scope`.  A ref back
    to a schema already on the path is recursion, which compilers expand lazily, so the
    walk stops there.  `tag`: the document is a structural tag, whose compiler takes each
    schema it holds as a document of its own (`tag_schemas`), measured from level 0."""
    own_documents = {id(schema) for schema in tag_schemas(root)} if tag else set()
    height: dict[tuple[int, ...], int] = {}
    on_path: set[int] = set()

    def too_deep() -> InvalidRequestError:
        return _refuse(f"the schema nests deeper than {MAX_SCHEMA_DEPTH} levels of JSON objects and arrays (a "
                       "subschema under `properties` is two: about 64 nested objects; each $ref followed counts)")

    def walk(node: Any, level: int, scope: _Scope) -> int:
        """The height below `node`, found at `level`; raises past the bounds."""
        if level > MAX_SCHEMA_DEPTH:
            raise too_deep()
        refs: list[Any] = []
        if isinstance(node, dict):
            scope = scope.entering(node)
            ref = node.get("$ref")
            if isinstance(ref, str):
                refs = _targets(ref, scope, names)
        key = (id(node), *scope.key())
        if key in height:
            if level + height[key] > MAX_SCHEMA_DEPTH:
                raise too_deep()
            return height[key]
        if len(height) >= MAX_SCHEMA_NODES:
            raise _refuse(f"the schema has more than {MAX_SCHEMA_NODES} subschemas")
        on_path.add(id(node))
        below = 0
        for child in (node if isinstance(node, list) else node.values()):
            if not isinstance(child, (dict, list)) or id(child) in on_path:
                continue
            if id(child) in own_documents:  # compiled on its own: its depth starts again
                walk(child, 0, _Scope(child, child, child))
                below = max(below, 1)
            else:
                below = max(below, 1 + walk(child, level + 1, scope))
        for target in refs:
            if id(target) not in on_path:
                below = max(below, 1 + walk(target, level + 1, scope))
        on_path.discard(id(node))
        height[key] = below
        return below

    if isinstance(root, (dict, list)):
        walk(root, 0, _Scope(root, root, root))


def _check_ref_loops(root: Any, names: dict[str, Any]) -> None:
    """Refuse a subschema the root reaches (through schema keywords and $refs, not the
    $defs it never uses) whose $refs only loop: nothing validates against it, yet the
    grammar lets an answer start it (a property's key) and then fail mid-stream.
    `names`: the document's anchors (_anchors)."""
    verdicts: dict[int, bool] = {}
    seen: set[int] = set()
    stack: list[tuple[Any, _Scope]] = [(root, _Scope(root, root, root))]
    while stack:
        node, scope = stack.pop()
        if id(node) in seen or not isinstance(node, (dict, list)):
            continue
        seen.add(id(node))
        if isinstance(node, list):
            stack.extend((child, scope) for child in node)
            continue
        scope = scope.entering(node)
        if isinstance(node.get("$ref"), str):
            _check_not_only_refs_back(node, scope, names, verdicts)
            stack.extend((target, scope) for target in _targets(node["$ref"], scope, names))
        stack.extend((child, scope) for key, child in node.items() if key not in ("$defs", "definitions"))


def _check_not_only_refs_back(node: dict, scope: _Scope, names: dict[str, Any], verdicts: dict[int, bool]) -> None:
    """Refuse `node` if its $ref chain (each link resolved one way only) comes back to a
    schema already on it: a loop of $refs that never reaches a schema of its own, so
    nothing validates against it.  Each schema's verdict is found once (`verdicts`)."""
    chain: list[int] = []
    current: Any = node
    verdict = False
    while isinstance(current, dict) and isinstance(current.get("$ref"), str) and len(chain) <= MAX_SCHEMA_DEPTH:
        if id(current) in verdicts:
            verdict = verdicts[id(current)]
            break
        if id(current) in chain:
            verdict = True
            break
        chain.append(id(current))
        scope = scope.entering(current)
        targets = _targets(current["$ref"], scope, names)
        if len(targets) != 1:
            break
        current = targets[0]
    for schema in chain:
        verdicts[schema] = verdict
    if verdict:
        raise _refuse(f"the $ref {node['$ref'][:100]!r} leads only through $refs back to itself: that subschema "
                      "admits no value (JSON Schema forbids a loop of $refs alone)")


@dataclass(frozen=True)
class _Scope:
    """What a "#..." pointer in a schema may be resolved against: the document the
    compiler was given (JSON Schema's answer, and llguidance's), the nearest schema with
    an `$id` (a resource of its own, for compilers that honour it), and the nearest
    schema holding `$defs` or `definitions` (what its author wrote "#/$defs/..."
    against: a tool's parameters embedded in a larger document, as tool_choice
    "required" builds it, are resolved against the whole document by the compiler,
    which then cannot find them; the walk must still see the chain, so that the answer
    is the depth bound, not a missing pointer or a 36-second compile).  The document is
    carried apart from the others, so a decoy `$defs` or `$id` on every link of a
    chain cannot hide it."""

    document: Any
    resource: Any
    definitions: Any

    def entering(self, node: dict) -> _Scope:
        resource = node if "$id" in node else self.resource
        definitions = node if ("$defs" in node or "definitions" in node) else self.definitions
        if resource is self.resource and definitions is self.definitions:
            return self
        return _Scope(self.document, resource, definitions)

    def key(self) -> tuple[int, int, int]:
        return id(self.document), id(self.resource), id(self.definitions)

    def bases(self) -> list[Any]:
        return list({id(b): b for b in (self.document, self.resource, self.definitions)}.values())


def tag_schemas(tag: Any) -> list[Any]:
    """The JSON schemas a structural tag holds, found only where its format puts
    them (xgrammar's nested formats: a "json_schema" format's `json_schema`, through
    `format`, `content`, `tags` and `elements`; vLLM's older form: each of
    `structures`' `schema`), never inside a schema: a schema that merely looks like a
    format must not restart the count of the schema it is part of."""
    found: list[Any] = []
    stack = [tag]
    while stack:
        node = stack.pop()
        if isinstance(node, list):
            stack.extend(node)
            continue
        if not isinstance(node, dict):
            continue
        schema = node.get("json_schema")
        if node.get("type") in ("json_schema", "qwen_xml_parameter") and isinstance(schema, (dict, list)):
            found.append(schema)
        for key in ("format", "content", "tags", "elements"):
            stack.append(node.get(key))
        structures = node.get("structures")
        for structure in structures if isinstance(structures, list) else []:
            if isinstance(structure, dict) and isinstance(structure.get("schema"), (dict, list)):
                found.append(structure["schema"])
    return found


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


def _targets(ref: str, scope: _Scope, names: dict[str, Any]) -> list[Any]:
    found = []
    base, _, fragment = ref.partition("#")
    if ref in names:
        found.append(names[ref])
    if base and base in names:
        found.append(_pointer(names[base], fragment))
    if not base:
        found += [_pointer(b, fragment) for b in scope.bases()]
    return list({id(t): t for t in found if isinstance(t, (dict, list))}.values())


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
