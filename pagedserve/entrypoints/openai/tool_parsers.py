"""Tool calls in the model's own format: one parser per format, chosen with
`--tool-call-parser` (vLLM's names), used when `tool_choice` is "auto".

A parser knows four things about its format: how to find the calls in a finished
answer (`extract`), how much of a running answer is certainly plain text, so a stream
can send it before a call may begin (`text_before_calls`), where the format has a
clear opening, a structural tag that makes every call the model opens well-formed for
its tool's parameter schema (the constraint `auto` runs under; plain text outside calls
stays free), and how to tell a model about the tools in that format when its chat
template does not render them (`tools_system_prompt`).  Without `--tool-call-parser`,
`default_tool_parser` picks the format the model's vocabulary points to.

- hermes (Qwen2.5/3, Hermes): `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`,
  possibly several, after optional text.
- pythonic (Llama 3.2 and 4): the whole answer is `[f(x=1), g(y="a")]` (PythonicToolParser).
- llama3_json (Llama 3.x): the whole answer is `{"name": ..., "parameters": {...}}` (or
  several joined by ";"), optionally after `<|python_tag|>`; known only once the answer
  ends (text may follow what parses as a call), so a stream sends its calls at the end.

Arguments are always a JSON object (or JSON text of one); anything else is not a call.
"""

from __future__ import annotations

import json
import re
from collections.abc import Collection
from dataclasses import dataclass, field
from typing import Any

from pagedserve.errors import InvalidRequestError


@dataclass
class ParsedToolCall:
    name: str
    arguments: str  # JSON text of the arguments object


def _call_from(obj: Any, args_key: str, names: Collection[str] | None, need_args: bool = False) -> ParsedToolCall | None:
    """A call from its parsed JSON: the name of one of the request's tools (`names`; None:
    any) and an arguments object (or JSON text of one, as some models write it); anything
    else is not a call (arguments are always an object's JSON text for the client,
    characters as the model wrote them, and strict JSON: no NaN or Infinity).  `need_args`:
    a format whose calls are the whole answer needs the arguments key, else a JSON answer
    that has a "name" (a person's, say) would read as a call of no arguments."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    if names is not None and obj["name"] not in names:
        return None  # (no such function: what the model wrote is text, never a call the client cannot make)
    if need_args and args_key not in obj and "arguments" not in obj:
        return None
    args = obj.get(args_key, obj.get("arguments", obj.get("parameters", {})))
    try:
        if isinstance(args, str):
            args = json.loads(args)
        if not isinstance(args, dict):
            return None
        return ParsedToolCall(obj["name"], json.dumps(args, ensure_ascii=False, allow_nan=False))
    except (ValueError, RecursionError):
        return None


@dataclass
class CallCursor:
    """Where a running answer's parse stopped: the calls complete before `pos`, which
    never change as the answer grows.  A stream's next parse resumes there, so each call
    is read once (parsing the whole answer at every delta was quadratic: 40 KB of calls
    held the event loop for 17 s); formats known only at the end do not use it."""

    pos: int = 0
    calls: list[ParsedToolCall] = field(default_factory=list)
    scan: int = 0  # where the next call may open (past text read as not a call)
    parts: list[str] = field(default_factory=list)  # the text before each call in `calls` (hermes)


_SPACE = re.compile(r"\s*")
_DECODER = json.JSONDecoder()  # (stateless: one for every parse)
_SEPARATORS = re.compile(r"[ \t\n\r,]*")  # (between a JSON array's items)
_CUT_NAME = re.compile(r'\{\s*"name"\s*:\s*')  # (a hermes call's head, up to its name)
_CUT_ARGUMENTS = re.compile(r'\s*,\s*"arguments"\s*:\s*')


class HermesToolParser:
    name = "hermes"
    OPEN, CLOSE = "<tool_call>", "</tool_call>"

    def extract(self, text: str, finished: bool = True, names: Collection[str] | None = None,
                cursor: CallCursor | None = None) -> tuple[str | None, list[ParsedToolCall]]:
        """The calls between the tags of the functions in `names` (None: any), and the text
        around them, before, between and after, as content (each piece trimmed, joined by
        newlines).  Each call's JSON is read by the JSON decoder, not up to the next closing
        tag, so an argument may hold "</tool_call>" (the structural tag lets it); one in one
        pass (a lazy regex was quadratic in openings left unclosed).  A tag not followed by
        "{" is text (a code sample), and so is a call of another function or of malformed
        JSON.  A finished answer's last call cut short (max_tokens, a stop string) is a call
        with the arguments it wrote (a prefix, as a named call's) when its name is one of
        `names`, else dropped: never markup in the content.  `cursor`: a running answer's
        parse so far, resumed and advanced."""
        cursor = cursor if cursor is not None else CallCursor()
        calls, parts, pos, scan = list(cursor.calls), list(cursor.parts), cursor.pos, max(cursor.scan, cursor.pos)
        end_of_text = len(text)
        while (start := text.find(self.OPEN, scan)) >= 0:
            body = _SPACE.match(text, start + len(self.OPEN)).end()
            if body < len(text) and text[body] != "{":
                scan = start + len(self.OPEN)  # (a tag in prose: text)
                continue
            close = text.find(self.CLOSE, body)
            if close < 0 and not finished:
                break  # (still being written: not read again at every delta)
            try:
                obj, end = _DECODER.raw_decode(text, body)
                after = _SPACE.match(text, end).end()
                # (closed; or a finished answer's cut inside or before its closing tag)
                done = text.startswith(self.CLOSE, after) or finished and self.CLOSE.startswith(text[after:])
            except (ValueError, RecursionError):  # (not JSON, not all of it, or nested past the parser's depth)
                obj, after, done = None, -1, False
            if not done and not finished:
                break  # a call still being written: read once it closes (one written wrongly, at the end)
            call = _call_from(obj, "arguments", names) if done else None
            if not done and close < 0:  # a finished answer's last call, cut short
                call, end_of_text = self._cut_call(text, body, names), start
                if call is None:
                    break
            if call is not None:
                calls.append(call)
                parts.append(text[pos:start])
                pos = scan = min(after + len(self.CLOSE), len(text)) if done else len(text)
                continue
            scan = min(after + len(self.CLOSE), len(text)) if done else close + len(self.CLOSE)  # not a call: text
        if not finished:  # (only complete calls were passed)
            cursor.pos, cursor.scan, cursor.calls, cursor.parts = pos, scan, calls, parts
        if not calls:
            return (text if end_of_text == len(text) else text[:end_of_text].rstrip() or None), []
        tail = text[pos:end_of_text] if finished else text[pos:pos + self.text_before_calls(text[pos:])]
        # The whitespace between text and a call is not content; the first piece's own
        # leading whitespace is, as a stream sent it before any call could be known.
        pieces = [parts[0].rstrip()] + [p.strip() for p in (*parts[1:], tail)]
        return "\n".join(p for p in pieces if p) or None, calls

    def _cut_call(self, text: str, body: int, names: Collection[str] | None) -> ParsedToolCall | None:
        """The call a cut answer began at `body` ('{"name": ..., "arguments": ' and what it
        wrote of them), if its name is whole and one of `names`."""
        head = _CUT_NAME.match(text, body)
        try:
            name, i = _DECODER.raw_decode(text, head.end()) if head else (None, 0)
        except ValueError:
            return None
        if not isinstance(name, str) or names is not None and name not in names:
            return None
        arguments = _CUT_ARGUMENTS.match(text, i)
        return ParsedToolCall(name, text[arguments.end():].rstrip() if arguments else "")

    def text_before_calls(self, text: str) -> int:
        """Characters of `text` that cannot belong to a call: up to the first opening
        tag, or up to a tail that could still become one, less the whitespace before it
        (not content if a call follows; `extract` drops it)."""
        i = text.find(self.OPEN)
        if i < 0:
            i = len(text)
            for k in range(min(len(self.OPEN) - 1, len(text)), 0, -1):
                if self.OPEN.startswith(text[-k:]):
                    i = len(text) - k
                    break
        return len(text[:i].rstrip())

    def tools_system_prompt(self, tools: list[dict[str, Any]]) -> str:
        listed = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
        return ("You can call functions to help answer. The functions, as JSON schemas:\n<tools>\n" + listed
                + "\n</tools>\nTo call one, answer with its name and arguments as a JSON object between the "
                  "tags, one call per pair:\n<tool_call>\n{\"name\": \"FUNCTION NAME\", \"arguments\": "
                  "{ARGUMENTS}}\n</tool_call>\nOtherwise answer in plain text.")

    def format_calls(self, calls: list[ParsedToolCall]) -> str:
        """Calls as the model writes them (a past assistant turn's, for a template that drops them)."""
        return "\n".join(f'{self.OPEN}\n{{"name": {json.dumps(c.name)}, "arguments": {c.arguments}}}\n{self.CLOSE}'
                         for c in calls)

    def structural_tag(self, tools: list[dict[str, Any]], one_call: bool = False) -> dict[str, Any] | None:
        """Free text, in which every opened call follows its tool's schema (`one_call`:
        nothing may follow the first call)."""
        tags = [{"type": "tag", "begin": f'{self.OPEN}\n{{"name": {json.dumps(t["name"])}, "arguments": ',
                 "content": {"type": "json_schema", "json_schema": tool_parameters(t.get("parameters"))},
                 "end": f"}}\n{self.CLOSE}"} for t in tools]
        return {"type": "structural_tag", "format": {"type": "triggered_tags", "triggers": [self.OPEN],
                                                      "tags": tags, "stop_after_first": one_call}}

    def answer_or_calls(self, tools: list[dict[str, Any]], schema: dict[str, Any],
                        one_call: bool = False) -> dict[str, Any] | None:
        """The constraint (StructuredOutputsParams' fields) of an answer in `schema` or
        calls, from the first token (tool_choice "auto" beside a response format)."""
        calls = self.structural_tag(tools, one_call)["format"]
        return {"structural_tag": {"type": "structural_tag", "format": {"type": "or", "elements": [
            {"type": "json_schema", "json_schema": schema}, {**calls, "at_least_one": True}]}}}


def required_calls(text: str, finished: bool, cursor: CallCursor) -> list[ParsedToolCall]:
    """The calls of a required answer, a JSON array of {"name", "parameters"}: when it is
    running, or was cut short (max_tokens, a stop string), the items it finished (a stream
    sends each once its object closes), read from `cursor` on; the internal array is never
    shown to the client as text."""
    items: list[Any] | None = None
    if finished:
        try:
            items = json.loads(text)
        except (ValueError, RecursionError):
            items = None
    if items is None:
        items, i = [], cursor.pos or text.find("[") + 1
        calls = list(cursor.calls)
        while 0 < i < len(text):
            i = _SEPARATORS.match(text, i).end()
            try:
                item, i = _DECODER.raw_decode(text, i)
            except (ValueError, RecursionError):
                break
            calls += _required_call(item)
        if not finished:
            cursor.pos, cursor.calls = i, calls
        return calls
    return [call for item in items for call in _required_call(item)] if isinstance(items, list) else []


def _required_call(item: Any) -> list[ParsedToolCall]:
    """One array item of a required answer as a call (none if it is not one)."""
    if isinstance(item, dict) and isinstance(item.get("name"), str):
        return [ParsedToolCall(item["name"], json.dumps(item.get("parameters", {})))]
    return []


def forced_tools_system_prompt(tools: list[dict[str, Any]], function: dict[str, Any] | None) -> str:
    """What the model is told of the tools under tool_choice "required" (`function` None)
    or a named function, where its template renders none: the grammar fixes the answer's
    form (a JSON array of {"name", "parameters"}, or the function's arguments alone); this
    says what the functions are for, without which it fills them blind."""
    if function is not None:
        return ("Answer by calling the function " + json.dumps(function["name"]) + ", given as a JSON schema:\n"
                + json.dumps(function, ensure_ascii=False) + "\nThe answer is its arguments, as a JSON object.")
    listed = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
    return ("Answer by calling one or more of these functions, given as JSON schemas:\n" + listed
            + "\nThe answer is a JSON array of calls, each {\"name\": FUNCTION NAME, \"parameters\": ARGUMENTS}.")


def sent_calls(tool_calls: Any) -> list[ParsedToolCall]:
    """The well-formed calls of a past assistant turn's `tool_calls`, as a client sent them
    (OpenAI's shape: {"function": {"name": ..., "arguments": JSON text}}); others are skipped."""
    calls = []
    for call in tool_calls if isinstance(tool_calls, list) else []:
        function = call.get("function") if isinstance(call, dict) else None
        if isinstance(function, dict) and isinstance(function.get("name"), str):
            args = function.get("arguments", "{}")
            calls.append(ParsedToolCall(function["name"], args if isinstance(args, str) else json.dumps(args)))
    return calls


def tool_parameters(schema: dict[str, Any] | None) -> dict[str, Any]:
    """A tool's arguments schema: a tool without `parameters` takes none (OpenAI: "omitting
    parameters defines a function with an empty parameter list"), not any object."""
    return schema or {"type": "object", "properties": {}, "additionalProperties": False}


def _whole_answer_held(text: str, opening: str, tag: str) -> int:
    """text_before_calls of a format whose calls are the whole answer: none of an answer
    that opens with `opening` or `tag` (or may still), all of any other."""
    head = text.lstrip()
    return 0 if not head or head.startswith((opening, tag)) or tag.startswith(head) else len(text)


def _whole_answer_prompt(tools: list[dict[str, Any]], how: str) -> str:
    """tools_system_prompt of a format whose calls are the whole answer: the tools, then `how` to call."""
    listed = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
    return (f"You can call functions to help answer. The functions, as JSON schemas:\n{listed}\nTo call {how}; "
            "otherwise answer in plain text.")


class Llama3JsonToolParser:
    name = "llama3_json"
    PYTHON_TAG = "<|python_tag|>"

    def extract(self, text: str, finished: bool = True,
                names: Collection[str] | None = None,
                cursor: CallCursor | None = None) -> tuple[str | None, list[ParsedToolCall]]:
        """The whole answer as calls (JSON objects joined by ";", each naming a function in
        `names`, None: any, and with its "parameters"), else plain text.  Only a
        finished answer says which: a running one that parses as calls may still go on
        with text, so a stream holds it back (text_before_calls) and sends no call yet."""
        body = text.strip().removeprefix(self.PYTHON_TAG).strip()
        if not body.startswith("{") or not finished:
            return text, []
        calls, i = [], 0
        while True:  # (object by object: a ";" inside an argument's string is not a separator)
            try:
                obj, i = _DECODER.raw_decode(body, i)
            except (ValueError, RecursionError):
                return text, []
            call = _call_from(obj, "parameters", names, need_args=True)
            if call is None:
                return text, []
            calls.append(call)
            rest = body[i:].lstrip()
            if not rest:
                return None, calls
            if not rest.startswith(";"):
                return text, []
            if not rest[1:].strip():  # (a trailing ";")
                return None, calls
            i = len(body) - len(rest[1:].lstrip())

    def text_before_calls(self, text: str) -> int:
        """An answer that may be a call (it opens with "{" or the python tag) is held back whole."""
        return _whole_answer_held(text, "{", self.PYTHON_TAG)

    def tools_system_prompt(self, tools: list[dict[str, Any]]) -> str:
        return _whole_answer_prompt(tools, 'one, answer with only a JSON object {"name": FUNCTION NAME, '
                                           '"parameters": ARGUMENTS}')

    def format_calls(self, calls: list[ParsedToolCall]) -> str:
        return ";".join(f'{{"name": {json.dumps(c.name)}, "parameters": {c.arguments}}}' for c in calls)

    def structural_tag(self, tools: list[dict[str, Any]], one_call: bool = False) -> dict[str, Any] | None:
        return None  # no opening to trigger on: the answer is free

    def answer_or_calls(self, tools: list[dict[str, Any]], schema: dict[str, Any],
                        one_call: bool = False) -> dict[str, Any] | None:
        """An answer in `schema` or one call: both are a JSON object, so one schema of either."""
        calls = [{"type": "object", "required": ["name", "parameters"], "additionalProperties": False,
                  "properties": {"name": {"const": t["name"]}, "parameters": tool_parameters(t.get("parameters"))}}
                 for t in tools]
        return {"json": {"anyOf": [schema, *calls]}}


class PythonicToolParser:
    """vLLM's pythonic (Llama 3.2 and 4, ToolACE): the whole answer is a Python list of
    calls with keyword arguments, `[get_weather(city="Paris"), get_time()]`, optionally
    between Llama 4's <|python_start|> and <|python_end|>.  Read with Python's parser,
    never run: each argument must be a literal (ast.literal_eval; JSON's true, false and
    null read as Python's).  Known only once the answer ends, as llama3_json's."""

    name = "pythonic"
    START, END = "<|python_start|>", "<|python_end|>"
    _JSON_NAMES = {"true": True, "false": False, "null": None}

    def extract(self, text: str, finished: bool = True,
                names: Collection[str] | None = None,
                cursor: CallCursor | None = None) -> tuple[str | None, list[ParsedToolCall]]:
        """The whole answer as calls of the functions in `names` (None: any), else plain text."""
        import ast

        body = text.strip().removeprefix(self.START).removesuffix(self.END).strip()
        if not body.startswith("[") or not finished:
            return text, []
        try:
            tree = ast.parse(body, mode="eval").body
            if not isinstance(tree, ast.List) or not tree.elts:
                return text, []
            calls = [self._call(node) for node in tree.elts]
            if names is not None and any(c.name not in names for c in calls):
                return text, []
        except (SyntaxError, ValueError, TypeError, RecursionError, MemoryError):
            return text, []
        return None, calls

    def _call(self, node: Any) -> ParsedToolCall:
        import ast

        if not isinstance(node, ast.Call) or node.args or not isinstance(node.func, ast.Name):
            raise ValueError("not a named call with keyword arguments")
        names = [k.arg for k in node.keywords]
        if None in names or len(set(names)) < len(names):  # (**kwargs; a name twice, which Python refuses)
            raise ValueError("not one value per keyword")
        args = {k.arg: self._value(k.value) for k in node.keywords}
        return ParsedToolCall(node.func.id, json.dumps(args, ensure_ascii=False, allow_nan=False))  # (1e999: none)

    def _value(self, node: Any) -> Any:
        import ast

        if isinstance(node, ast.Name) and node.id in self._JSON_NAMES:
            return self._JSON_NAMES[node.id]
        if isinstance(node, ast.List):
            return [self._value(e) for e in node.elts]
        if isinstance(node, ast.Dict):
            return {self._value(k): self._value(v) for k, v in zip(node.keys, node.values, strict=True)}
        value = ast.literal_eval(node)
        if isinstance(value, (tuple, set, complex, bytes)):  # (no JSON form)
            raise ValueError("not a JSON value")
        return value

    def text_before_calls(self, text: str) -> int:
        """An answer that may be calls (it opens with "[" or the start tag) is held back whole."""
        return _whole_answer_held(text, "[", self.START)

    def tools_system_prompt(self, tools: list[dict[str, Any]]) -> str:
        return _whole_answer_prompt(tools, "them, answer with only a Python list of calls with keyword arguments, "
                                           "e.g. [func_name(param=value), other_func()]")

    def format_calls(self, calls: list[ParsedToolCall]) -> str:
        def call(c: ParsedToolCall) -> str:
            try:
                args = json.loads(c.arguments or "{}")
            except (ValueError, RecursionError):
                args = None
            if not isinstance(args, dict):  # (no keywords to write: it was written as a call of none)
                raise InvalidRequestError(f"messages: the arguments of a past call of {c.name[:60]!r} are not a JSON "
                                          f"object ({c.arguments[:60]!r}), which the pythonic tool-call format "
                                          "writes as keyword arguments", param="messages")
            if all(k.isidentifier() for k in args):
                return c.name + "(" + ", ".join(f"{k}={v!r}" for k, v in args.items()) + ")"
            return f"{c.name}(**{args!r})"  # (a key no keyword can spell)

        return "[" + ", ".join(call(c) for c in calls) + "]"

    def structural_tag(self, tools: list[dict[str, Any]], one_call: bool = False) -> dict[str, Any] | None:
        return None  # no opening to trigger on: the answer is free

    def answer_or_calls(self, tools: list[dict[str, Any]], schema: dict[str, Any],
                        one_call: bool = False) -> dict[str, Any] | None:
        return None  # (Python calls and a JSON answer: no one grammar here)


TOOL_PARSERS: dict[str, type] = {p.name: p for p in (HermesToolParser, Llama3JsonToolParser, PythonicToolParser)}
ToolParser = HermesToolParser | Llama3JsonToolParser | PythonicToolParser


def get_tool_parser(name: str) -> ToolParser:
    if name not in TOOL_PARSERS:
        raise ValueError(f"unknown tool call parser {name!r}; choose one of {', '.join(sorted(TOOL_PARSERS))}")
    return TOOL_PARSERS[name]()


def default_tool_parser(tokenizer: Any) -> tuple[ToolParser, str]:
    """(the parser for tool_choice "auto" when --tool-call-parser is not given, why):
    llama3_json where the vocabulary has Llama 3's tool tokens, else hermes, the format
    most open chat models (Qwen, Hermes, SmolLM) were taught."""
    vocab = tokenizer.get_vocab() if tokenizer is not None else {}
    if "<|python_tag|>" in vocab or "<|eom_id|>" in vocab:
        return Llama3JsonToolParser(), "the vocabulary has Llama 3's <|python_tag|>"
    if "<tool_call>" in vocab:
        return HermesToolParser(), "the vocabulary has <tool_call>"
    return HermesToolParser(), "the most common format (no format-specific tokens in the vocabulary)"


def arguments_object(arguments: str) -> dict[str, Any]:
    """A call's arguments as an object (Anthropic's tool_use input, Ollama's arguments):
    whole, or, cut short (max_tokens), the members they completed, as Anthropic's client
    reads the same streamed partial_json; {} for arguments that are not an object."""
    try:
        value = json.loads(arguments)
    except (ValueError, RecursionError):
        return _partial_object(arguments, 0)[0]
    return value if isinstance(value, dict) else {}


def _partial_object(text: str, i: int) -> tuple[dict[str, Any], int]:
    """(the complete members of the JSON object at text[i:], cut anywhere; where it
    ended).  A member whose value is an object cut short keeps that object's complete
    members; any other cut value is left out."""
    out: dict[str, Any] = {}
    n = len(text)

    def skip(j: int) -> int:
        while j < n and text[j] in " \t\n\r":
            j += 1
        return j

    i = skip(i)
    if i >= n or text[i] != "{":
        return out, i
    i += 1
    while True:
        i = skip(i)
        if i < n and text[i] == "}":
            return out, i + 1
        try:
            key, i = _DECODER.raw_decode(text, i)
            i = skip(i)
            if not isinstance(key, str) or i >= n or text[i] != ":":
                return out, n
            i = skip(i + 1)
            if i < n and text[i] == "{":
                value, i = _partial_object(text, i)
                out[key] = value
            else:
                out[key], i = _DECODER.raw_decode(text, i)
        except (ValueError, RecursionError):
            return out, n
        i = skip(i)
        if i < n and text[i] == ",":
            i += 1
