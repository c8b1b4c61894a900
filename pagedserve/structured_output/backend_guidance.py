"""llguidance: grammars parsed lazily (an Earley parser over a derivative-based lexer),
masks computed on demand; compiling is building that parser, milliseconds.

Tool-call structural tags (xgrammar's "triggered_tags" format, which the tool parsers
produce, and vLLM's older {"structures", "triggers"} form) become a Lark grammar: free
text that may not contain a trigger, or, at a trigger, the tag's begin, its JSON
schema and its end.  A trigger the tokenizer has as one added token (Qwen's
`<tool_call>`) is matched as that token, the way the model writes it.
"""

from __future__ import annotations

import copy
import json
from typing import Any, Protocol

import llguidance
import torch
from llguidance.gbnf_to_lark import GbnfToLarkError, gbnf_to_lark

from pagedserve.structured_output.limits import SCHEMA_MAPS, is_lark

# Compact JSON with the separators json.dumps writes (what xgrammar emits too).
_JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


class RustBackedTokenizer(Protocol):
    """What the backend reads of a tokenizer (transformers' fast ones, and
    model_loader/tokenizer_snapshot.py's SnapshotTokenizer)."""

    backend_tokenizer: Any  # tokenizers.Tokenizer
    eos_token_id: int | None

    def get_added_vocab(self) -> dict[str, int]: ...


class GuidanceMatcher:
    """Terminated once it has accepted a stop token, as xgrammar's: llguidance stops as
    soon as nothing but a stop token may follow, and the stop token then still comes
    (so the last token of a finished output is the stop token, whichever backend ran)."""

    def __init__(self, matcher: llguidance.LLMatcher, stop_token_ids: frozenset[int]) -> None:
        self.matcher = matcher
        self._stop_token_ids = stop_token_ids
        self._ended = False

    def accept_token(self, token_id: int) -> bool:
        # A matcher whose lexer failed while masking (out of fuel) masks all but the stop
        # token and then accepts it: an empty answer that finished as "stop".  Refused here,
        # the request ends with the library's reason instead.
        ok = bool(self.matcher.consume_token(token_id)) and not self.matcher.is_error()
        self._ended = ok and token_id in self._stop_token_ids
        return ok

    def refusal(self) -> str | None:
        return _one_line(self.matcher.get_error()) if self.matcher.is_error() else None

    def is_terminated(self) -> bool:
        return self._ended


class GuidanceBackend:
    name = "guidance"

    def __init__(self, tokenizer: RustBackedTokenizer, vocab_size: int, stop_token_ids: list[int]) -> None:
        """`tokenizer`: transformers' fast tokenizer or our snapshot of one; its Rust
        tokenizer's JSON is what llguidance indexes (as llguidance.hf.from_tokenizer does,
        without importing transformers: a second of the first structured request)."""
        backend = copy.copy(tokenizer.backend_tokenizer)
        backend.no_padding()
        backend.no_truncation()
        self._tokenizer = llguidance.LLTokenizer(backend.to_str(), n_vocab=vocab_size,
                                                 eos_token=list(stop_token_ids) or tokenizer.eos_token_id)
        self._stop_token_ids = frozenset(stop_token_ids)
        self._added = dict(tokenizer.get_added_vocab())  # text -> id of tokens it never splits
        self._executor = llguidance.LLExecutor()

    def compile(self, kind: str, spec: str) -> llguidance.LLMatcher:
        """A matcher at the grammar's start, never advanced: requests get copies of it."""
        LLMatcher = llguidance.LLMatcher
        if kind == "json":
            grammar = LLMatcher.grammar_from_json_schema(_closed_objects(json.loads(spec)), defaults=_JSON_OPTIONS)
        elif kind == "json_object":
            grammar = LLMatcher.grammar_from_json_schema('{"type": "object"}', defaults=_JSON_OPTIONS)
        elif kind == "regex":
            grammar = LLMatcher.grammar_from_regex(spec)
        elif kind == "choice":
            grammar = LLMatcher.grammar_from_lark("start: " + " | ".join(_literal(c) for c in json.loads(spec)))
        elif kind == "structural_tag":
            grammar = LLMatcher.grammar_from_lark(structural_tag_lark(json.loads(spec), self._added))
        else:  # EBNF/GBNF ("root ::= ...", as xgrammar and llama.cpp write it) or Lark
            try:  # (llguidance's any_to_lark tests for Lark with a regex quadratic in blank lines)
                grammar = LLMatcher.grammar_from_lark(spec if is_lark(spec) else gbnf_to_lark(spec))
            except GbnfToLarkError as e:
                raise ValueError(str(e)) from None
        matcher = LLMatcher(self._tokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise ValueError(_one_line(matcher.get_error()))
        return matcher

    def new_matcher(self, compiled: llguidance.LLMatcher) -> GuidanceMatcher:
        return GuidanceMatcher(compiled.deep_copy(), self._stop_token_ids)

    def fill_bitmask(self, bitmask: torch.Tensor, rows: list[tuple[GuidanceMatcher, int]]) -> None:
        """Each row's mask written by llguidance straight into the [rows, words] int32 CPU
        tensor.  (Called as llguidance.torch does, without importing it: that module's
        import compiles a helper with torch.compile, which imports torch._dynamo, 2.5 s
        on a 2-core Zen 3 (AVX2 only), on the first structured request of every process.)"""
        if not (bitmask.dtype == torch.int32 and bitmask.is_cpu and bitmask.dim() == 2 and bitmask.is_contiguous()):
            raise ValueError("the grammar bitmask must be a contiguous 2-D int32 CPU tensor")
        row_bytes = bitmask.shape[1] * 4
        if len(rows) == 1:
            matcher, row = rows[0]
            matcher.matcher.unsafe_compute_mask_ptr(bitmask[row].data_ptr(), row_bytes)
        elif rows:  # in parallel, outside the GIL
            self._executor.unsafe_compute_mask_ptr([(m.matcher, r) for m, r in rows], bitmask.data_ptr(), row_bytes,
                                                   bitmask.shape[0])


_SUBSCHEMA = ("items", "additionalProperties", "not", "if", "then", "else", "contains", "propertyNames",
              "unevaluatedItems", "additionalItems")
_SUBSCHEMA_LISTS = ("anyOf", "allOf", "oneOf", "prefixItems")


def _closed_objects(schema: Any) -> Any:
    """The schema with `additionalProperties: false` on every object schema that lists
    its properties and says nothing of others: what xgrammar does by default and
    OpenAI's strict mode requires, so both backends generate the same language."""
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for key in _SUBSCHEMA:
        if isinstance(out.get(key), (dict, list)):
            out[key] = ([_closed_objects(s) for s in out[key]] if isinstance(out[key], list)
                        else _closed_objects(out[key]))
    for key in _SUBSCHEMA_LISTS:
        if isinstance(out.get(key), list):
            out[key] = [_closed_objects(s) for s in out[key]]
    for key in SCHEMA_MAPS:
        if isinstance(out.get(key), dict):
            out[key] = {name: _closed_objects(s) for name, s in out[key].items()}
    if "properties" in out and "additionalProperties" not in out and "unevaluatedProperties" not in out:
        out["additionalProperties"] = False
    return out


def _one_line(error: str) -> str:
    """llguidance's message without its source excerpts: the lines that say something
    ("regex parse error:", "error: unclosed character class"), joined."""
    lines = [ln.strip() for ln in error.splitlines()]
    said = [ln for i, ln in enumerate(lines) if ln and (i == 0 or ln.startswith("error"))]
    return " ".join(said)[:500]


def _literal(text: str) -> str:
    """A Lark string literal (JSON's escaping)."""
    return json.dumps(text, ensure_ascii=False)


def _regex_escape(text: str) -> str:
    return "".join("\\n" if ch == "\n" else "\\" + ch if ch in "\\.^$|?*+()[]{}/-&~" else ch for ch in text)


def _tags(tag: dict[str, Any]) -> tuple[list[str], list[tuple[str, Any, str]], bool]:
    """(triggers, [(begin, schema, end)], stop_after_first) of a structural tag."""
    fmt = tag.get("format") if tag.get("type") == "structural_tag" else None
    if isinstance(fmt, dict) and fmt.get("type") == "triggered_tags":
        tags = []
        for t in fmt.get("tags", []):
            content = t.get("content") or {}
            if content.get("type") != "json_schema":
                raise ValueError(f"the guidance backend takes tags whose content is a json_schema, got "
                                 f"{content.get('type')!r} (start the server with "
                                 "--structured-outputs-backend xgrammar for the others)")
            tags.append((t["begin"], content.get("json_schema", {}), t["end"]))
        return list(fmt.get("triggers", [])), tags, bool(fmt.get("stop_after_first", False))
    if "structures" in tag and "triggers" in tag:  # vLLM's older form
        return list(tag["triggers"]), [(s["begin"], s.get("schema", {}), s["end"]) for s in tag["structures"]], False
    raise ValueError("the guidance backend takes structural tags of format 'triggered_tags' (or vLLM's "
                     "{'structures', 'triggers'} form); start the server with --structured-outputs-backend "
                     "xgrammar for other formats")


def _answer_or_calls(tag: dict[str, Any]) -> tuple[dict[str, Any], Any] | None:
    """(the triggered-tags tag, the answer's JSON schema) of an "or" structural tag, the
    one the chat handler builds for tool_choice "auto" beside a response format (the
    answer in the schema, or calls); None for any other tag."""
    fmt = tag.get("format") if tag.get("type") == "structural_tag" else None
    if not isinstance(fmt, dict) or fmt.get("type") != "or":
        return None
    elements = fmt.get("elements")
    if (not isinstance(elements, list) or len(elements) != 2 or elements[0].get("type") != "json_schema"
            or elements[1].get("type") != "triggered_tags" or not elements[1].get("at_least_one")):
        raise ValueError("the guidance backend takes an 'or' structural tag of a json_schema and triggered_tags "
                         "with at_least_one (start the server with --structured-outputs-backend xgrammar for others)")
    return {"type": "structural_tag", "format": elements[1]}, elements[0].get("json_schema", {})


def structural_tag_lark(tag: dict[str, Any], added_tokens: dict[str, int]) -> str:
    """The Lark grammar of a tool-call structural tag (see the module docstring), or of
    an answer in a JSON schema or calls (_answer_or_calls): the schema's JSON, or calls
    from the first token on (free text between and after them), as xgrammar's."""
    try:
        answer = _answer_or_calls(tag)
        if answer is not None:
            tag, schema = answer
        triggers, tags, stop_after_first = _tags(tag)
    except (KeyError, TypeError, AttributeError) as e:
        raise ValueError(f"malformed structural tag: {e!r}") from None
    if not triggers or not tags:
        raise ValueError("a structural tag needs at least one trigger and one tag")
    text_triggers = [t for t in triggers if t not in added_tokens]
    tail = "/(.|\\n)*/" + "".join(f" & ~/(.|\\n)*{_regex_escape(t)}(.|\\n)*/" for t in text_triggers)
    # (with an answer, as xgrammar's at_least_one: the first call opens the output, no text before it)
    start = ("TAIL | call" if stop_after_first else "call* TAIL") if answer is None else \
        ("answer | " + ("first" if stop_after_first else "first call* TAIL"))
    lines = ["%llguidance {}", "start: " + start, f"TAIL: {tail}", "TEXT: /(.|\\n)*/"]
    if answer is not None:  # (compact JSON, objects closed: what a response_format's schema compiles to)
        lines.append(f"answer: %json {json.dumps(_closed_objects(schema))}")
    for i, (begin, tag_schema, end) in enumerate(tags):
        trigger = next((t for t in triggers if begin.startswith(t)), None)
        if trigger is None:
            raise ValueError(f"tag begin {begin!r} starts with none of the triggers {triggers}")
        if trigger in added_tokens:
            head, bare = f"TEXT <[{added_tokens[trigger]}]>", f"<[{added_tokens[trigger]}]>"
        else:
            lines.append(f"trig_{i}[lazy]: /(.|\\n)*{_regex_escape(trigger)}/")
            head, bare = f"trig_{i}", _literal(trigger)
        # (objects closed, as the answer's: what xgrammar's tags and the named call's schema take)
        body = [_with_added_tokens(begin[len(trigger):], added_tokens), f"%json {json.dumps(_closed_objects(tag_schema))}",
                _with_added_tokens(end, added_tokens)]
        lines += [f"call_{i}: {head} body_{i}", f"first_{i}: {bare} body_{i}",
                  f"body_{i}: " + " ".join(p for p in body if p)]
    lines.append("call: " + " | ".join(f"call_{i}" for i in range(len(tags))))
    lines.append("first: " + " | ".join(f"first_{i}" for i in range(len(tags))))
    return "\n".join(lines) + "\n"


def _with_added_tokens(text: str, added_tokens: dict[str, int]) -> str:
    """`text` as a sequence of Lark literals, with any added token in it as that token
    ("" for no text)."""
    parts: list[str] = []
    while text:
        hits = [(text.find(t), t) for t in added_tokens if t and t in text]
        if not hits:
            parts.append(_literal(text))
            break
        at, tok = min(hits, key=lambda h: (h[0], -len(h[1])))
        if at:
            parts.append(_literal(text[:at]))
        parts.append(f"<[{added_tokens[tok]}]>")
        text = text[at + len(tok):]
    return " ".join(parts)
