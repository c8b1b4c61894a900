"""xgrammar: grammars compiled ahead into per-state token masks (fast masks, slow
compiles for bounded repetitions such as a string's maxLength)."""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from typing import Any

import torch
import xgrammar as xgr

from pagedserve.structured_output.limits import SCHEMA_MAPS, is_lark, tag_schemas

# xgrammar errors start with "[HH:MM:SS] /path/file.cc:LINE: "; the client needs the rest.
_XGRAMMAR_PREFIX = re.compile(r"^\[[\d:]+\]\s+\S+:\d+:\s*")

# JSON-schema keywords xgrammar 0.2 compiles as if they were absent (oneOf: as anyOf): its
# output broke the schema it was asked for ([1, 2, 2] under uniqueItems, any JSON under
# allOf), so each is refused by name (the guidance backend enforces or refuses them itself).
XGRAMMAR_IGNORES = ("allOf", "oneOf", "not", "if", "then", "else", "uniqueItems", "contains", "minContains", "maxContains",
                    "multipleOf", "dependentRequired", "dependentSchemas", "dependencies", "unevaluatedProperties",
                    "unevaluatedItems")
# The string formats it enforces (any other was accepted, and not enforced).
XGRAMMAR_FORMATS = ("date", "time", "date-time", "duration", "email", "hostname", "ipv4", "ipv6", "uri",
                    "uri-reference", "uri-template", "uuid", "json-pointer", "relative-json-pointer")
# Keywords whose value holds one subschema / a list of them / a name -> subschema map.
_ONE = ("items", "additionalProperties", "propertyNames", "additionalItems", "contentSchema")
_MANY = ("prefixItems", "anyOf", "oneOf")  # (and limits.SCHEMA_MAPS: a name -> subschema map)
# A regex's counted repetitions, nested ones multiplied ((.{0,1000}){0,300}: 300,000), at
# most this many: xgrammar compiles a count in time growing with its square (10,000: 8.7
# s; 20,000: 40 s, on a Zen 5), and a nested pair's token masks grew slower with every
# token (the 6th took 50 s on the engine thread, every other request waiting).
MAX_PATTERN_REPEAT = 1000
_COUNT = re.compile(r"\{(\d+)(?:,(\d*))?\}")
_NAME = re.compile(r"[a-zA-Z_][\w-]*")  # a GBNF rule's name
_RULE = re.compile(r"^[ \t]*([a-zA-Z_][\w-]*)[ \t]*::=", re.M)
# What xgrammar reads beside a $ref (annotations); any other keyword there it dropped.
_BESIDE_REF = frozenset({"$ref", "$defs", "definitions", "description", "title", "$comment", "examples", "default",
                         "$schema", "$id"})
_LOOKAROUND = ("(?=", "(?!", "(?<=", "(?<!")


def repetition_product(regex: str, quoted: bool = False, rules: Callable[[str], int] | None = None) -> int:
    """The largest product of counted repetitions ({m}, {m,n}, {m,}: their largest count)
    nested in `regex`, 1 for none: what its automaton holds, a few states each.  Escapes
    and character classes are stepped over, and with `quoted` (a GBNF grammar) its quoted
    strings; `rules`: a rule name's own product (a count over a rule multiplies its counts).
    What this misreads is the compiler's to refuse."""
    stack = [1]  # the largest product inside each open group (the last: the innermost)
    i, n = 0, len(regex)
    while i < n:
        c = regex[i]
        if c == "\\":
            i += 2
            inner = 1
        elif quoted and c == '"':  # (GBNF's strings; it has no '...' ones)
            end = i + 1
            while end < n and regex[end] != c:
                end += 2 if regex[end] == "\\" else 1
            i, inner = end + 1, 1
        elif quoted and c == "#":  # a comment, to the line's end
            end = regex.find("\n", i)
            i, inner = (n if end < 0 else end + 1), 1
        elif c == "[":
            i = regex.find("]", i + 2 if regex[i + 1:i + 2] in ("]", "^") else i + 1)
            i = n if i < 0 else i + 1
            inner = 1
        elif c == "(":
            stack.append(1)
            i += 1
            continue
        elif c == ")" and len(stack) > 1:
            inner = stack.pop()
            i += 1
        elif rules is not None and (name := _NAME.match(regex, i)) is not None:
            i, inner = name.end(), rules(name.group())
        else:
            i += 1
            inner = 1
        count = _COUNT.match(regex, i)
        if count is not None:
            low, high = count.groups()
            inner *= max(int(low), int(high) if high else 0)
            i = count.end()
        stack[-1] = max(stack[-1], inner)
    return max(stack)


def grammar_repetition_product(grammar: str) -> int:
    """repetition_product of a GBNF grammar, a rule's counts multiplied into every count
    over a reference to it (root ::= x{0,300} with x ::= [^\n]{0,1000}: 300,000; each rule
    read alone, it passed at 1,000 and stalled the engine)."""
    heads = list(_RULE.finditer(grammar))
    bodies = {m.group(1): grammar[m.end():heads[k + 1].start() if k + 1 < len(heads) else len(grammar)]
              for k, m in enumerate(heads)}
    products: dict[str, int] = {}
    for root in bodies:  # each rule after those it names (no recursion: a chain of 500 rules is fine)
        stack = [(root, False)]
        while stack:
            name, ready = stack.pop()
            if ready:
                products[name] = repetition_product(bodies[name], quoted=True, rules=lambda n: products.get(n, 1))
            elif name not in products:
                products[name] = 1  # (a rule inside its own expansion: recursion, not a count)
                stack.append((name, True))
                stack += [(ref, False) for ref in _NAME.findall(bodies[name]) if ref in bodies and ref not in products]
    return max([repetition_product(grammar, quoted=True), *products.values()])


def check_regex(regex: str, what: str, quoted: bool = False) -> None:
    """ValueError where xgrammar would take `regex` (a pattern, a regex request, a GBNF
    grammar: `quoted`) in unbounded time: nested counts past MAX_PATTERN_REPEAT."""
    product = grammar_repetition_product(regex) if quoted else repetition_product(regex)
    if product > MAX_PATTERN_REPEAT:
        raise ValueError(f"{what}: its counted repetitions, nested ones multiplied, come to {product}, more than the "
                         f"{MAX_PATTERN_REPEAT} the xgrammar backend compiles and masks in bounded time")


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
        for key in XGRAMMAR_IGNORES:  # (a discriminated oneOf's branches exclude each other: anyOf's meaning)
            if key in node and not (key == "uniqueItems" and node[key] is False) \
                    and not (key == "oneOf" and "discriminator" in node):
                raise ValueError(f"{at}: the xgrammar backend does not enforce {key!r} (the guidance backend "
                                 "enforces it or refuses it by name)")
        fmt, pattern = node.get("format"), node.get("pattern")
        if fmt is not None and fmt not in XGRAMMAR_FORMATS:
            raise ValueError(f"{at}: the xgrammar backend does not enforce format {str(fmt)[:40]!r}; it enforces "
                             + ", ".join(XGRAMMAR_FORMATS))
        if (fmt is not None or pattern is not None) and ("minLength" in node or "maxLength" in node):
            raise ValueError(f"{at}: the xgrammar backend drops minLength/maxLength beside a "
                             f"{'format' if fmt is not None else 'pattern'}; write the length into a pattern")
        keyed = node.get("patternProperties")
        for where, regex in [(f"{at}.pattern", pattern)] + [
                (f"{at}.patternProperties[{key[:40]!r}]", key) for key in (keyed if isinstance(keyed, dict) else {})]:
            if not isinstance(regex, str):
                continue
            if any(look in regex for look in _LOOKAROUND):
                raise ValueError(f"{where}: the xgrammar backend drops a pattern's look-around")
            check_regex(regex, where)
        _check_ref(node, at)
        required, properties = node.get("required"), node.get("properties") or {}
        missing = [name for name in required if name not in properties] if isinstance(required, list) else []
        if missing:  # (closed, it could not be met; open, xgrammar dropped it: {"joi": 100})
            raise ValueError(f"{at}: required property {str(missing[0])[:40]!r} is not among its properties: the "
                             "xgrammar backend does not enforce it (list it in properties)")
        stack += [(node[k], f"{at}.{k}") for k in _ONE if k in node]
        stack += [(v, f"{at}.{k}[{i}]") for k in _MANY if isinstance(node.get(k), list) for i, v in enumerate(node[k])]
        stack += [(v, f"{at}.{k}.{name}") for k in SCHEMA_MAPS if isinstance(node.get(k), dict) for name, v in node[k].items()]


def _check_ref(node: dict[str, Any], at: str) -> None:
    """A $ref xgrammar resolves as this check reads it: to the root or a $defs (definitions)
    entry, which the walk covers (another JSON pointer skipped every check), with no
    keyword beside it but annotations (xgrammar dropped them: an enum beside a $ref)."""
    ref = node.get("$ref")
    if not isinstance(ref, str):
        return
    if ref != "#" and not re.fullmatch(r"#/(\$defs|definitions)/[^/]+", ref):
        raise ValueError(f"{at}: $ref {ref[:60]!r}: the xgrammar backend takes '#', '#/$defs/NAME' or "
                         "'#/definitions/NAME' (the guidance backend resolves any pointer)")
    beside = sorted(set(node) - _BESIDE_REF)
    if beside:
        raise ValueError(f"{at}: the xgrammar backend drops {beside[0][:40]!r} beside a $ref (put it in the "
                         "schema the $ref names)")


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
                check_regex(spec, "the regex")
                return c.compile_regex(spec)
            if kind == "choice":
                # (as written: an emoji's JSON escape, a surrogate pair, compiled as six bytes of garbage)
                return c.compile_grammar("root ::= " + " | ".join(json.dumps(s, ensure_ascii=False)
                                                                   for s in json.loads(spec)))
            if kind == "structural_tag":
                for schema in tag_schemas(json.loads(spec)):
                    check_schema(schema, "a tool's parameters")
                return c.compile_structural_tag(spec)
            if is_lark(spec):
                raise ValueError("a Lark grammar needs --structured-outputs-backend guidance (xgrammar reads GBNF)")
            check_regex(spec, "the grammar", quoted=True)
            return c.compile_grammar(spec)
        except (RuntimeError, ValueError) as e:
            text = str(e).strip()
            raise ValueError(_XGRAMMAR_PREFIX.sub("", text.splitlines()[0]) if text else type(e).__name__) from None

    def new_matcher(self, compiled: Any) -> XgrammarMatcher:
        return XgrammarMatcher(compiled, self._stop_token_ids)

    def fill_bitmask(self, bitmask: torch.Tensor, rows: list[tuple[Any, int]]) -> None:
        for matcher, row in rows:
            matcher._m.fill_next_token_bitmask(bitmask, row)
