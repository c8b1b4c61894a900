"""The child process that renders requests' own chat templates: bounded in time and
memory, replaced after a breach, one render at a time with a bounded wait."""

from __future__ import annotations

import threading
import time

import pytest

from pagedserve.engine import chat_utils
from pagedserve.engine.chat_utils import TemplateSandbox
from pagedserve.errors import InvalidRequestError, OverloadedError

MSGS = [{"role": "user", "content": "hi"}]


def render(sandbox: TemplateSandbox, template: str, max_chars: int = 10_000) -> str:
    return sandbox.render(template, MSGS, None, True, False, {"bos_token": "<s>"}, max_chars)


def test_limits_are_enforced_and_the_child_replaced():
    sandbox = TemplateSandbox(seconds=1.0, memory_bytes=64 << 20)
    try:
        assert render(sandbox, "{{ bos_token }}{% for m in messages %}{{ m.content }}{% endfor %}") == "<s>hi"
        t0 = time.monotonic()
        with pytest.raises(InvalidRequestError, match="longer than 1 s") as info:
            render(sandbox, "{% for i in range(10**5) %}{% for j in range(10**5) %}{% endfor %}{% endfor %}")
        assert info.value.param == "chat_template" and time.monotonic() - t0 < 5
        with pytest.raises(InvalidRequestError, match="64 MiB"):  # (doubling: one `*` is bounded before it runs)
            render(sandbox, "{% set ns = namespace(s='ab') %}{% for i in range(40) %}{% set ns.s = ns.s ~ ns.s %}"
                            "{% endfor %}{{ ns.s }}", max_chars=10**12)
        with pytest.raises(InvalidRequestError, match="the prompt is 20000 characters"):
            render(sandbox, "{{ 'ab' * 10000 }}")
        with pytest.raises(InvalidRequestError, match="SecurityError"):
            render(sandbox, "{{ ''.__class__.__mro__[1].__subclasses__() }}")
        with pytest.raises(InvalidRequestError, match="no loader"):  # no template reaches a file
            render(sandbox, "{% include '/etc/passwd' %}")
        assert sandbox.num_restarts == 3  # after the time, memory and size breaches
        assert render(sandbox, "ok {{ messages | length }}") == "ok 1"  # a fresh child
    finally:
        sandbox.close()


def test_a_fresh_childs_first_render_is_not_charged_for_the_renderers_imports():
    # Importing jinja2 in the child took 0.02-0.1 s (Zen 4, AVX-512, native bf16) and more
    # than the 2 s limit on a loaded CI host: a trivial first render was refused.  A warm
    # render takes ~0.3 ms.  Each try below is a fresh child (a breach stops it), so
    # without the warm-up every try fails; with it, a try fails only on a 10 ms stall.
    for _ in range(5):
        sandbox = TemplateSandbox(seconds=0.01)
        try:
            assert render(sandbox, "{{ messages[0].content }}!") == "hi!"
            break
        except InvalidRequestError:
            continue
        finally:
            sandbox.close()
    else:
        pytest.fail("a trivial first render missed 0.01 s five times")


def test_renders_queue_for_a_bounded_time(monkeypatch):
    monkeypatch.setattr(chat_utils, "TEMPLATE_QUEUE_SECONDS", 0.2)
    sandbox = TemplateSandbox(seconds=1.0)
    render(sandbox, "warm")
    errors: list[BaseException] = []

    def slow() -> None:
        try:
            render(sandbox, "{% for i in range(10**5) %}{% for j in range(10**5) %}{% endfor %}{% endfor %}")
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    t = threading.Thread(target=slow)
    t.start()
    time.sleep(0.1)
    try:
        with pytest.raises(OverloadedError, match="one at a time"):
            render(sandbox, "quick")
        t.join()
        assert isinstance(errors[0], InvalidRequestError)
        assert render(sandbox, "quick") == "quick"
    finally:
        sandbox.close()


def test_a_lone_surrogate_a_template_writes_is_the_templates_error():
    """'%c' % 55296 wrote one: the tokenizer's TypeError was a 500 that dropped the connection."""
    sandbox = TemplateSandbox()
    try:
        for template in ('{{ "%c" % 55296 }}', '{{ "\\ud800" }}x'):
            with pytest.raises(InvalidRequestError, match=r"wrote a lone surrogate \(U\+D800\)") as info:
                render(sandbox, template)
            assert info.value.param == "chat_template"
    finally:
        sandbox.close()


def test_a_request_template_past_its_bound_is_refused_before_it_is_parsed(monkeypatch):
    """The content-format check parsed it in the server process first: a 4 MB template
    took 40 s of the server's CPU before its 400.  The size is checked first, and a
    request's template is parsed only in the sandbox."""
    from pagedserve import chat_template
    from tests.engine.helpers import make_tokenizer

    parsed = []
    monkeypatch.setattr(chat_utils, "iterates_content", lambda t: parsed.append(t) or False)
    big = "{{ " + "a+" * 2_000_000 + "a }}"
    with pytest.raises(InvalidRequestError, match="chat_template must be Jinja template text of at most") as info:
        chat_utils.render_chat(make_tokenizer(), "{{ messages[0].content }}", MSGS, big)
    assert info.value.param == "chat_template" and parsed == []
    chat_utils.render_chat(make_tokenizer(), None, MSGS, "{{ messages[0].content }}")  # (in the sandbox)
    assert parsed == [] and chat_template.iterates_content("{% for p in m.content %}{% endfor %}")
