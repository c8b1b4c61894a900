"""Our chat-template renderer against transformers' on the same templates and inputs:
the same text, the same errors, the same sandbox."""

from __future__ import annotations

import functools

import jinja2
import pytest

from pagedserve.chat_template import render_chat_template

SPECIALS = {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}

# Written for these tests in the styles real models use: ChatML with reasoning and tools
# (namespace, loop controls, tojson, a generation block), Llama-2 style with
# raise_exception and trimmed whitespace, and one that reads strftime_now and dict().
CHATML = """{%- if tools %}{{ '<|im_start|>system\\n# Tools\\n' }}{% for t in tools %}{{ t | tojson }}
{% endfor %}{{ '<|im_end|>\\n' }}{% endif %}
{%- set ns = namespace(last_user=-1) %}
{%- for m in messages %}{% if m.role == 'user' %}{% set ns.last_user = loop.index0 %}{% endif %}{% endfor %}
{%- for m in messages %}
{%- if m.role == 'assistant' %}<|im_start|>assistant
{% if m.reasoning_content is defined and loop.index0 > ns.last_user %}<think>
{{ m.reasoning_content }}
</think>
{% endif %}{% generation %}{{ m.content }}{% endgeneration %}
{%- if m.tool_calls is defined %}{% for c in m.tool_calls %}
<tool_call>{{ c.function | tojson }}</tool_call>{% if loop.last %}{% break %}{% endif %}{% endfor %}{% endif %}<|im_end|>
{% else %}<|im_start|>{{ m.role }}
{{ m.content }}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% if enable_thinking is defined and not enable_thinking %}<think>

</think>

{% endif %}{% endif %}"""

LLAMA2 = """{{ bos_token }}{% for m in messages %}
{% if (m['role'] == 'user') != (loop.index0 % 2 == 0) %}{{ raise_exception('roles must alternate user/assistant') }}{% endif %}
{% if m['role'] == 'user' %}{{ '[INST] ' + m['content'] | trim + ' [/INST]' }}
{% else %}{{ ' ' + m['content'] | trim + ' ' + eos_token }}{% endif %}
{% endfor %}"""

DATED = """{% set d = dict(a=1, b=[1, 2]) %}{{ d | tojson(indent=2, sort_keys=True) }}|{{ strftime_now('%Y') }}
{% for m in messages %}{{ m.role }}: {{ m.content }}{% if m.thinking is defined %} ({{ m.thinking }}){% endif %}
{% endfor %}"""

CONVERSATIONS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "naïve café 🚀 \"quoted\""},
     {"role": "assistant", "content": "Paris.", "reasoning_content": "easy", "tool_calls": None},
     {"role": "user", "content": "And Italy?"}],
    [{"role": "user", "content": "weather?"},
     {"role": "assistant", "content": "", "tool_calls": [
         {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris", "unit": "°C"}}},
         {"type": "function", "function": {"name": "never_shown", "arguments": {}}}]},
     {"role": "tool", "content": "21"},
     {"role": "assistant", "content": "It is 21 degrees.", "reasoning": "from the tool"}],
]
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather <now> & later",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]


@functools.cache
def _hf_tokenizer():
    """transformers' tokenizer whose special tokens are SPECIALS (its vocabulary is the
    engine tests' tiny one: only the rendering is compared)."""
    from transformers import PreTrainedTokenizerFast

    from tests.engine.helpers import make_tokenizer

    return PreTrainedTokenizerFast(tokenizer_object=make_tokenizer().backend_tokenizer, **SPECIALS)


def _theirs(template: str, messages: list[dict], **kwargs) -> str:
    """transformers' apply_chat_template (its variables: the special tokens, then kwargs)."""
    return _hf_tokenizer().apply_chat_template(messages, chat_template=template, tokenize=False, **kwargs)


def _both(template: str, messages: list[dict], **kwargs) -> tuple[str, str]:
    variables = kwargs.pop("variables", {})
    assert _hf_tokenizer().special_tokens_map == SPECIALS
    return (render_chat_template(template, messages, **kwargs, **SPECIALS, **variables),
            _theirs(template, messages, **kwargs, **variables))


@pytest.mark.parametrize("template", [CHATML, DATED])
@pytest.mark.parametrize("conversation", CONVERSATIONS)
@pytest.mark.parametrize("generation_prompt", [True, False])
def test_the_same_text_as_transformers(template: str, conversation: list[dict], generation_prompt: bool) -> None:
    for extra in ({}, {"tools": TOOLS}, {"variables": {"enable_thinking": False}}):
        ours, theirs = _both(template, conversation, add_generation_prompt=generation_prompt, **extra)
        assert ours == theirs


def test_the_callers_messages_are_left_as_they_were() -> None:
    conversation = [{"role": "user", "content": "hi", "name": None},
                    {"role": "assistant", "content": "yo", "reasoning": "r"}]
    before = repr(conversation)
    render_chat_template(CHATML, conversation, continue_final_message=True)
    assert repr(conversation) == before


@pytest.mark.parametrize("template", [CHATML, LLAMA2])
@pytest.mark.parametrize("final", ["The answer is", "The answer is ", "trailing\n"])
def test_continue_final_message_cuts_where_transformers_does(template: str, final: str) -> None:
    conversation = [{"role": "user", "content": "Q?"}, {"role": "assistant", "content": final}]
    ours, theirs = _both(template, conversation, continue_final_message=True)
    assert ours == theirs and ours.rstrip().endswith(final.strip())


# A vision model's style: content as a list of parts (image placeholders and text).
PARTS = """{% for m in messages %}<|im_start|>{{ m.role }}
{% if m.content is string %}{{ m.content }}{% else %}{% for p in m.content %}{% if p.type == 'image' %}<image>{% else %}\
{{ p.text }}{% endif %}{% endfor %}{% endif %}<|im_end|>
{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""


@pytest.mark.parametrize("final", [[{"type": "text", "text": "The"}],
                                   [{"type": "text", "text": "A"}, {"type": "image"}, {"type": "text", "text": "so "}],
                                   "plain text"])
def test_a_final_message_of_parts_continues_its_last_text_part_as_transformers_does(final) -> None:
    conversation = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is it?"}]},
                    {"role": "assistant", "content": final}]
    before = repr(conversation)
    ours, theirs = _both(PARTS, conversation, continue_final_message=True)
    assert ours == theirs and not ours.endswith("<|im_end|>\n") and repr(conversation) == before
    with pytest.raises(ValueError, match="no \"content\" to continue"):  # (no text part: nothing to continue)
        render_chat_template(PARTS, [{"role": "assistant", "content": [{"type": "image"}]}],
                             continue_final_message=True)
    # An image after the last text would be cut from the prompt with what follows the text
    # (transformers drops it; here the images sent then outnumbered the prompt's slots).
    with pytest.raises(ValueError, match="ends with a part of type 'image' after its last text"):
        render_chat_template(PARTS, [{"role": "assistant", "content": [{"type": "text", "text": "It is"},
                                                                        {"type": "image"}]}],
                             continue_final_message=True)


def test_errors_are_the_templates_own() -> None:
    wrong_order = [{"role": "assistant", "content": "first"}]
    for render in (render_chat_template, _theirs):
        with pytest.raises(jinja2.exceptions.TemplateError, match="roles must alternate"):
            render(LLAMA2, wrong_order, **({} if render is _theirs else SPECIALS))
        with pytest.raises(ValueError, match="continue_final_message"):
            render("{{ messages | length }}", [{"role": "assistant", "content": "x"}], continue_final_message=True)


@pytest.mark.parametrize("template", [
    "{{ ().__class__.__base__.__subclasses__() }}",
    "{% set ns = namespace(_x=1) %}",
    "{% set ns = namespace() %}{% set ns._y = 2 %}",
    "{{ raise_exception.__globals__.keys() }}",
    "{{ messages.append(1) }}",
])
def test_the_sandbox_refuses_what_transformers_refuses(template: str) -> None:
    conversation = [{"role": "user", "content": "hi"}]
    with pytest.raises(jinja2.exceptions.SecurityError):
        _theirs(template, conversation)
    with pytest.raises(jinja2.exceptions.SecurityError):
        render_chat_template(template, conversation)


@pytest.mark.parametrize("template", ["{{ 'a' * 200000000 }}", "{{ 200000000 * 'ab' }}", "{{ [0] * 100000000 }}"])
def test_repeating_past_the_bound_is_refused_before_it_builds(template: str) -> None:
    """A `*` bomb is refused before the string or list exists (it would take seconds and
    hundreds of MB first), whatever else the machine is doing; small repeats render."""
    conversation = [{"role": "user", "content": "hi"}]
    with pytest.raises(jinja2.exceptions.SecurityError, match="characters or items"):  # (unbounded, it renders)
        render_chat_template(template, conversation)
    assert render_chat_template("{{ '-' * 3 }}{{ [1, 2] * 2 }}", conversation) == "---[1, 2, 1, 2]"
