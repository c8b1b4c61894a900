"""chat_utils' text bounds: a prompt only whose last tokens run (truncate_prompt_tokens)
is tokenized from the part that holds them, and those tokens are the whole text's."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedserve.engine.chat_utils import CUT_MARGIN_CHARS, encode_text, prompt_char_limit
from pagedserve.errors import InvalidRequestError
from pagedserve.model_loader.tokenizer_snapshot import longest_token_chars

WORDS = ["the", " quick", " brown", "fox", " jumps", "\n", "é", "東京", "🙂", ",", "1234", "über", " -", "x" * 30]


@pytest.fixture(scope="module", params=["smollm2", "gemma3"])
def tokenizer(request, smollm2_path, gemma3_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2_path if request.param == "smollm2" else gemma3_path)


@pytest.fixture(scope="module")
def char_limit(tokenizer) -> int:
    """The prompt-character bound at 64 tokens, once per tokenizer (reading Gemma's 262k
    vocabulary for its longest token took ~0.4 s of each of the property test's examples)."""
    return prompt_char_limit(longest_token_chars(tokenizer), 64)


def test_a_cut_prompt_is_tokenized_from_its_tail_only(monkeypatch) -> None:
    """A 16 MB prompt to keep its last 10 tokens was tokenized whole: 7 s holding the
    interpreter's lock, every other request and /health frozen."""
    seen: list[int] = []

    class Recording:
        def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
            seen.append(len(text))
            return [ord(c) for c in text]  # (one token a character: every tail agrees)

    encode_text(Recording(), "word " * 3_000_000, max_chars=80_000, cut=True)
    assert max(seen) < 80_000 + 3 * CUT_MARGIN_CHARS and sum(seen) < 3 * 90_000  # (two tails and the margin)


@settings(max_examples=25, deadline=None)
@given(st.lists(st.sampled_from(WORDS), min_size=2, max_size=400).filter(lambda w: len(set(w)) > 1),
       st.integers(1, 64))
def test_the_last_tokens_of_the_tail_are_the_whole_texts(tokenizer, char_limit, words, keep) -> None:
    limit = char_limit
    text = "".join(words) * (1 + 2 * (limit + 2 * CUT_MARGIN_CHARS) // len("".join(words)))
    whole = tokenizer.encode(text, add_special_tokens=False)
    assert encode_text(tokenizer, text, limit, add_special_tokens=False, cut=True)[-keep:] == whole[-keep:]


def test_a_run_of_one_character_that_tokenizes_by_where_it_starts_is_refused(tokenizer, char_limit) -> None:
    """Its last tokens depend on where the run began (runs are grouped from their start),
    so no tail can say them: refused by name, not cut wrong."""
    limit = char_limit
    text = "\n" * (limit + 3 * CUT_MARGIN_CHARS + 1)
    whole = tokenizer.encode(text, add_special_tokens=False)
    try:
        got = encode_text(tokenizer, text, limit, add_special_tokens=False, cut=True)
    except InvalidRequestError as e:
        assert "truncate_prompt_tokens cannot cut it" in str(e)
    else:  # (a tokenizer that reads a run the same from anywhere: the tail is exact)
        assert got[-64:] == whole[-64:]


def test_a_tokenizers_closing_token_ends_a_cut_prompt_too(smollm2_path) -> None:
    """A tokenizer that appends a token (BERT's [SEP], an EOS post-processor) ends the
    whole text's ids with it: the tail read for a cut keeps it (it was read without the
    tokenizer's special tokens, so a long text's embedding lost it)."""
    from tokenizers.processors import TemplateProcessing
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(smollm2_path)
    tokenizer.backend_tokenizer.post_processor = TemplateProcessing(single="$A <|endoftext|>",
                                                                     special_tokens=[("<|endoftext|>", 0)])
    for size in (100, 3 * CUT_MARGIN_CHARS + 200):  # (short: whole; long: from its end)
        text = "some words here " * (size // 16)
        whole = tokenizer.encode(text)
        got = encode_text(tokenizer, text, 100, add_special_tokens=True, cut=True)
        assert got[-1] == 0 and got[-8:] == whole[-8:]


def test_documents_reach_the_template_in_process_and_in_the_sandbox(smollm2_path) -> None:
    """vLLM's `documents` (a RAG template's sources) reach the template, the default one
    and a request's own (rendered in the sandbox); the variable was always None, and
    chat_template_kwargs may not set it."""
    from transformers import AutoTokenizer

    from pagedserve.engine.chat_utils import render_chat

    tok = AutoTokenizer.from_pretrained(smollm2_path)
    template = "{% for d in documents %}[{{ d.title }}: {{ d.text }}]{% endfor %}{{ messages[0].content }}"
    docs = [{"title": "a", "text": "one"}, {"title": "b", "text": "two"}]
    messages = [{"role": "user", "content": "q"}]
    assert render_chat(tok, template, messages, documents=docs) == "[a: one][b: two]q"
    assert render_chat(tok, None, messages, template, documents=docs) == "[a: one][b: two]q"  # (sandbox)
    assert render_chat(tok, "{{ documents is none }}", messages) == "True"
    with pytest.raises(InvalidRequestError, match="chat_template_kwargs may not set documents") as info:
        render_chat(tok, template, messages, chat_template_kwargs={"documents": docs})
    assert info.value.param == "chat_template_kwargs"  # (the 400 named messages)



def test_a_models_own_template_that_loops_on_output_stops_at_the_prompt_bound() -> None:
    """The model's template is rendered in-process (it is the operator's file); one that
    writes without end (a GGUF's `tokenizer.chat_template`) grew the server by 100 MB/s.
    Rendering now stops once the text is past the prompt's character bound, refused as a
    too-long prompt."""
    from pagedserve.engine.chat_utils import render_chat
    from tests.engine.helpers import make_tokenizer

    # (3,000 x 3,000: a bomb that ends, so that the test ends without the bound too)
    bomb = "{% for i in range(3000) %}{% for j in range(3000) %}x{% endfor %}{% endfor %}"
    with pytest.raises(InvalidRequestError, match=r"the prompt is at least 100\d characters, more than the 1000") as e:
        render_chat(make_tokenizer(), bomb, [{"role": "user", "content": "hi"}], max_chars=1000)
    assert e.value.param == "messages"


# Gemma 3's way with content: a string, or parts it iterates over itself (trimmed, no separator).
PARTS_TEMPLATE = ("{% for m in messages %}<{{ m.role }}>{% if m['content'] is string %}{{ m['content'] | trim }}"
                  "{% else %}{% for item in m['content'] | selectattr('type', 'equalto', 'text') %}"
                  "{{ item['text'] | trim }}{% endfor %}{% endif %}</{{ m.role }}>{% endfor %}")


def test_a_template_that_iterates_over_content_gets_the_parts_as_hf_and_vllm_give_them(smollm2_path) -> None:
    """Text parts were joined with newlines for every text model's template; Gemma 3's
    iterates over the parts itself and wrote them with nothing between (HF, vLLM's
    "auto" content format).  A template that reads content as a string still gets them
    joined, in-process and in the sandbox alike."""
    from transformers import AutoTokenizer

    from pagedserve.chat_template import iterates_content
    from pagedserve.engine.chat_utils import render_chat

    tok = AutoTokenizer.from_pretrained(smollm2_path)
    messages = [{"role": "system", "content": "be brief"},
                {"role": "user", "content": [{"type": "text", "text": "part one "}, {"type": "text", "text": "two"}]}]
    expected = tok.apply_chat_template(messages, chat_template=PARTS_TEMPLATE, tokenize=False)
    assert expected == "<system>be brief</system><user>part onetwo</user>"
    assert render_chat(tok, PARTS_TEMPLATE, messages, add_generation_prompt=False) == expected
    assert render_chat(tok, None, messages, PARTS_TEMPLATE, add_generation_prompt=False) == expected  # (sandbox)
    joined = "{% for m in messages %}[{{ m.content }}]{% endfor %}"
    assert render_chat(tok, joined, messages, add_generation_prompt=False) == "[be brief][part one \ntwo]"
    assert iterates_content("{% for c in message.content %}{% endfor %}")
    assert not iterates_content(joined) and not iterates_content("{% for c in m.content.split() %}{% endfor %}")
    assert not iterates_content("{% for x in y %}" * 5000)  # (unparseable: the render reports it)
