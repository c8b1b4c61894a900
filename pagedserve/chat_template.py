"""Chat templates rendered as transformers renders them, with jinja2 alone: the one
renderer of the server's default template (engine/chat_utils.py), of the templates
requests bring (in the sandbox child, engine/template_worker.py) and of tokenizer
snapshots (model_loader/tokenizer_snapshot.py).

Why not transformers' renderer: importing any part of transformers costs ~0.5 s (its
package scans every model's module for names; Zen 4, AVX-512 with native bf16), and
neither a snapshot's start nor the sandbox child needs anything else from it.  The
environment and the conversation's preparation follow transformers' `apply_chat_template`
(transformers 4.5x-5.x): Jinja's immutable sandbox with trimmed blocks, the loopcontrols
extension and a `{% generation %}` block that renders its body, a `tojson` that escapes
neither HTML nor non-ASCII, `raise_exception`, `strftime_now`, a `dict` and a
`namespace` that refuse underscore names; messages without their None fields and with
their reasoning under each name templates read; `continue_final_message` cut where the
final message ends.  tests/test_chat_template.py renders both ways and compares.
"""

from __future__ import annotations

import dataclasses
import datetime
import functools
import json
import sys
from collections.abc import Mapping
from typing import Any

from pagedserve.request_limits import MAX_TEMPLATE_REPEAT

# Names a message's reasoning comes under; templates read the first, gpt-oss's `thinking`.
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")
# Appended to the final message's content to find where it ends in the rendered text.
_CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "


def text_part_indices(content: object) -> list[int]:
    """Where a message's content (a list of parts) holds text parts; [] for any other content."""
    if not isinstance(content, list):
        return []
    return [i for i, p in enumerate(content) if isinstance(p, dict) and isinstance(p.get("text"), str)]


def render_chat_template(template: str, messages: list[dict[str, Any]], *,
                         tools: list[dict[str, Any]] | None = None, add_generation_prompt: bool = False,
                         continue_final_message: bool = False, max_output_chars: int | None = None,
                         **variables: Any) -> str:
    """The prompt text of `messages` under `template`; `variables` (the tokenizer's special
    tokens, then chat_template_kwargs) are visible to the template by name.  Errors are
    jinja2's or ValueError, as with transformers.  `max_output_chars`: rendering stops once
    the text is longer (longer than any prompt may be, it is refused by the caller; a model's
    own template that loops on output grew memory without end)."""
    compiled = _compile(template)
    if tools is not None and not all(isinstance(t, dict) for t in tools):
        raise ValueError("tools must be JSON schemas (dicts)")
    chat = [_with_reasoning_aliases({k: v for k, v in _plain(m).items() if v is not None}) for m in messages]
    final = ""
    if continue_final_message:
        content = chat[-1].get("content") if chat else None
        # A list of parts (a vision model's messages) continues its last text part, as HF does.
        texts = text_part_indices(content)
        if not isinstance(content, str) and not texts:
            raise ValueError('continue_final_message is set but the final message has no "content" to continue')
        if "content" not in template:
            raise ValueError('continue_final_message is set to "content" but this is not an accepted field '
                             "in the chat_template")
        if not isinstance(content, str) and texts[-1] != len(content) - 1:
            # (what follows the continued text is cut from the prompt: an image's slot with it)
            after = content[-1].get("type") if isinstance(content[-1], dict) else type(content[-1]).__name__
            raise ValueError(f"continue_final_message is set but the final message ends with a part of type "
                             f"{str(after)[:40]!r} after its last text: the text to continue must come last")
        if isinstance(content, str):
            final = content
            chat[-1]["content"] = final + _CONTINUE_TAG
        else:
            parts = list(content)  # (copies: the caller's message stays as it was)
            final = parts[texts[-1]]["text"]
            parts[texts[-1]] = {**parts[texts[-1]], "text": final + _CONTINUE_TAG}
            chat[-1]["content"] = parts
    context = {"messages": chat, "tools": _plain(tools), "add_generation_prompt": add_generation_prompt,
               "documents": None, **_plain(variables)}
    if max_output_chars is None:
        text = compiled.render(**context)
    else:
        pieces, size = [], 0
        for piece in compiled.generate(**context):
            pieces.append(piece)
            size += len(piece)
            if size > max_output_chars:
                return "".join(pieces)
        text = "".join(pieces)
    if continue_final_message:
        tag = _CONTINUE_TAG.strip()
        if final.strip() not in text or tag not in text:
            raise ValueError("continue_final_message is set but the final message does not appear in the chat "
                             "after applying the chat template")
        at = text.rindex(tag)
        # A template that keeps spacing shows the whole tag; one that trims it loses the space.
        text = text[:at] if text[at:at + len(_CONTINUE_TAG)] == _CONTINUE_TAG else text[:at].rstrip()
    return text


def _with_reasoning_aliases(message: dict[str, Any]) -> dict[str, Any]:
    reasoning = next((message[k] for k in _REASONING_FIELDS if message.get(k) is not None), None)
    if reasoning is None:
        return message
    return {"thinking": reasoning, **message, "reasoning_content": reasoning}


def _plain(value: Any) -> Any:
    """A copy of `value` built from JSON types only, as transformers rebuilds what a
    template sees: no object with methods beyond those types' reaches the sandbox (a str
    subclass becomes a str, a dataclass or pydantic model a dict, anything else a
    placeholder naming its type)."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, str):  # subclasses (enums, numpy strings) lose their extra methods
        return str.__str__(value)
    if isinstance(value, int):  # (bool cannot be subclassed: it is exactly bool, above)
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, Mapping):
        return {_plain(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if isinstance(value, tuple):
        return tuple(_plain(v) for v in value)
    numpy = sys.modules.get("numpy")  # a numpy scalar exists only once numpy is imported
    if numpy is not None and isinstance(value, numpy.generic):
        return _plain(value.item())
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if callable(getattr(value, "model_dump", None)):  # a pydantic model
        return _plain(value.model_dump())
    return f"<{type(value).__name__}>"


def _repeats_too_much(left: Any, right: Any) -> bool:
    """`left * right` would build a string or list past MAX_TEMPLATE_REPEAT."""
    for seq, times in ((left, right), (right, left)):
        if isinstance(seq, (str, list, tuple)) and isinstance(times, int) and len(seq) * times > MAX_TEMPLATE_REPEAT:
            return True
    return False


def check_template(template: str, name: str = "chat_template") -> None:
    """A ValueError naming the syntax error of an operator's (or an offline caller's)
    template, at start-up: a malformed one made every chat request a 400."""
    import jinja2

    try:
        _environment().parse(template)
    except jinja2.TemplateSyntaxError as e:
        raise ValueError(f"{name} is not a valid Jinja template (line {e.lineno}: {e.message})") from None


def join_text_parts(message: dict[str, Any]) -> dict[str, Any]:
    """`message` with a content of text parts alone as one string, the parts joined with
    newlines, as vLLM gives it to a template that reads content as a string."""
    content = message.get("content")
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text" for p in content):
        return {**message, "content": "\n".join(p["text"] for p in content)}
    return message


@functools.lru_cache(maxsize=16)
def iterates_content(template: str) -> bool:
    """Whether the template loops over a message's content (`{% for item in
    message['content'] %}`, filtered or not), as Gemma 3's and the vision templates do:
    such a template gets content as a list of parts, as HF and vLLM's "auto" content
    format give it.  Joined into one string, two text parts were rendered with a newline
    between them that those do not write.  A template that cannot be parsed: False (its
    rendering reports the error)."""
    from jinja2 import nodes

    try:
        for loop in _environment().parse(template).find_all(nodes.For):
            source = loop.iter
            while isinstance(source, nodes.Filter) and source.node is not None:
                source = source.node
            if (isinstance(source, nodes.Getattr) and source.attr == "content") or (
                    isinstance(source, nodes.Getitem) and isinstance(source.arg, nodes.Const)
                    and source.arg.value == "content"):
                return True
    except (Exception, RecursionError):  # noqa: BLE001 - jinja2's errors come in many types
        return False
    return False


@functools.lru_cache(maxsize=16)
def _compile(template: str) -> Any:
    """The compiled template (cached: the default template is compiled once a process)."""
    return _environment().from_string(template)


@functools.cache
def _environment() -> Any:
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Generation(jinja2.ext.Extension):
        """`{% generation %}...{% endgeneration %}` marks assistant text for training
        masks; rendering keeps the body as it is."""

        tags = {"generation"}

        def parse(self, parser: Any) -> Any:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller: Any) -> str:
            return caller()

    class TemplateDict:
        """`dict(...)` for templates, without the class's attributes to climb through."""

        def __call__(self, *args: Any, **kwargs: Any) -> dict:
            return dict(*args, **kwargs)

        def fromkeys(self, *args: Any, **kwargs: Any) -> dict:
            return dict.fromkeys(*args, **kwargs)

    def check_name(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(
                f"chat templates cannot store underscore-prefixed attributes on a namespace ({name!r})")

    class TemplateNamespace(jinja2.utils.Namespace):
        """Jinja's namespace, refusing underscore names (the way to CPython's internals)."""

        def __init__(*args: Any, **kwargs: Any) -> None:  # noqa: N805 - Namespace's own signature trick
            self, rest = args[0], args[1:]
            attrs = dict(*rest, **kwargs)
            for name in attrs:
                check_name(name)
            jinja2.utils.Namespace.__init__(self, attrs)

        def __setitem__(self, name: str, value: Any) -> None:
            check_name(name)
            jinja2.utils.Namespace.__setitem__(self, name, value)

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None,
               sort_keys: bool = False) -> str:
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                          sort_keys=sort_keys)

    class Sandbox(ImmutableSandboxedEnvironment):
        """Jinja's immutable sandbox, with `*` on strings and lists bounded before it runs:
        `'a' * 200000000` would build 200 MB (seconds, then the memory limit) before any
        other bound could see it."""

        intercepted_binops = frozenset({"*"})

        def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
            if operator == "*" and _repeats_too_much(left, right):
                raise jinja2.exceptions.SecurityError(
                    f"chat templates cannot repeat a string or list to more than {MAX_TEMPLATE_REPEAT} characters "
                    "or items")
            return super().call_binop(context, operator, left, right)

    env = Sandbox(trim_blocks=True, lstrip_blocks=True, extensions=[Generation, jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals.update(raise_exception=raise_exception, dict=TemplateDict(), namespace=TemplateNamespace,
                       strftime_now=lambda fmt: datetime.datetime.now().strftime(fmt))
    return env
