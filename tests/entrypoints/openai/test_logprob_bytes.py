"""Chat logprobs' `bytes` are each token's own bytes, so a client rebuilds characters that
tokens split (an emoji's four bytes over two tokens): they were the UTF-8 of U+FFFD."""

from __future__ import annotations

from pagedserve.entrypoints.openai.serving_engine import OpenAIServing, vocabulary_bytes
from pagedserve.entrypoints.openai.streaming import TextOffsets
from pagedserve.model_loader.sources import resolve_source
from pagedserve.model_loader.tokenizer import saved_tokenizer


def test_token_bytes_join_to_the_text_where_tokens_split_characters() -> None:
    tok = saved_tokenizer(resolve_source("smollm2-135m-instruct", "auto").path)
    handler = OpenAIServing.__new__(OpenAIServing)
    handler.tokenizer = tok
    text = "Party 🎉🔥 café 日本語 ok"
    ids = tok.encode(text, add_special_tokens=False)
    pieces = [tok.decode([i]) for i in ids]
    assert any("\ufffd" in p for p in pieces), "the text must have tokens that split a character"
    assert b"".join(handler.token_bytes(i, p) for i, p in zip(ids, pieces, strict=True)) == text.encode()


def test_vocabulary_forms() -> None:
    assert vocabulary_bytes("<0xF0>") == b"\xf0"  # SentencePiece's byte fallback
    assert vocabulary_bytes("Ġthe") == b" the"  # byte-level BPE: a space is Ġ
    assert vocabulary_bytes("▁the") is None and vocabulary_bytes(None) is None  # (the text's own bytes then)


def test_completions_show_a_split_characters_tokens_as_bytes() -> None:
    """The legacy logprobs name a token holding part of a character "bytes:\\xNN..." (OpenAI's
    form): each read U+FFFD, and the top alternatives' dict kept one of several."""
    from pagedserve.entrypoints.openai.serving_completion import OpenAIServingCompletion
    from pagedserve.outputs import CompletionOutput, Logprob

    tok = saved_tokenizer(resolve_source("smollm2-135m-instruct", "auto").path)
    handler = OpenAIServingCompletion.__new__(OpenAIServingCompletion)
    handler.tokenizer = tok
    ids = tok.encode("🎉", add_special_tokens=False)
    assert len(ids) > 1
    c = CompletionOutput(0, "🎉", ids, logprobs=[{i: Logprob(-0.5, 1)} for i in ids])
    lp = handler.logprobs(c, 0, 1, TextOffsets())
    assert all(t.startswith("bytes:") for t in lp.tokens), lp.tokens
    joined = b"".join(bytes(int(h, 16) for h in t[len("bytes:"):].split("\\x")[1:]) for t in lp.tokens)
    assert joined.decode() == "🎉" and all(len(d) == 1 for d in lp.top_logprobs)


def test_text_offsets_point_into_the_text_whole_and_streamed_in_any_chunks() -> None:
    """text_offset is where each token starts in the text: a token holding part of a
    character moves it when its character completes.  Each such token counted one U+FFFD
    (offsets past the text's end), and a stream advanced by the "bytes:\\xNN" strings."""
    from pagedserve.entrypoints.openai.serving_completion import OpenAIServingCompletion
    from pagedserve.outputs import CompletionOutput, Logprob

    tok = saved_tokenizer(resolve_source("smollm2-135m-instruct", "auto").path)
    handler = OpenAIServingCompletion.__new__(OpenAIServingCompletion)
    handler.tokenizer = tok
    text = "Party 🎉🔥 café 日本語 ok"
    ids = tok.encode(text, add_special_tokens=False)
    c = CompletionOutput(0, text, ids, logprobs=[{i: Logprob(-0.5, 1)} for i in ids])
    whole = handler.logprobs(c, 0, 1, TextOffsets(3)).text_offset  # (after 3 echoed characters)
    starts = [3 + len(tok.decode(ids[:k])) - tok.decode(ids[:k]).count("\ufffd") for k in range(len(ids))]
    assert whole == starts and whole[-1] < 3 + len(text)
    assert tok.decode(ids[ids.index(tok.encode(" ok", add_special_tokens=False)[0]):]) == text[whole[-1] - 3:]
    for cut in range(1, len(ids)):  # two chunks, the cut anywhere (inside a character too)
        offsets = TextOffsets(3)
        streamed = handler.logprobs(c, 0, 1, offsets, cut).text_offset + handler.logprobs(c, cut, 1, offsets).text_offset
        assert streamed == whole, cut


def test_echoed_prompt_offsets_leave_out_the_bos_the_tokenizer_added(gemma3_path) -> None:
    """Gemma's tokenizer adds <bos>, which the echoed prompt text does not hold: every
    prompt offset was 5 ("<bos>") too far, past the first generated token's."""
    from pagedserve.entrypoints.openai.serving_completion import OpenAIServingCompletion
    from pagedserve.outputs import Logprob, RequestOutput

    tok = saved_tokenizer(gemma3_path)
    handler = OpenAIServingCompletion.__new__(OpenAIServingCompletion)
    handler.tokenizer = tok
    text = "Hi 🙂 there, 日本"
    ids = tok.encode(text)
    assert ids[0] == tok.bos_token_id
    out = RequestOutput("r", text, ids, [], True, prompt_logprobs=[None] + [{i: Logprob(-1.0, 1)} for i in ids[1:]])
    offsets = handler._prompt_logprobs(out, 1, text).text_offset
    assert offsets[:2] == [0, 0] and offsets == sorted(offsets) and offsets[-1] < len(text)
    assert text[offsets[-1]:] == tok.decode(ids[-1:])


def test_a_special_token_left_out_of_the_text_takes_no_room_there() -> None:
    """Under skip_special_tokens (the default) an answer's `<|im_end|>` is listed with its
    logprob but is not in the text: it starts where the next token does.  It moved every
    later offset its length on, the last ones past the text's end."""
    from pagedserve.entrypoints.openai.serving_completion import OpenAIServingCompletion
    from pagedserve.outputs import CompletionOutput, Logprob

    tok = saved_tokenizer(resolve_source("smollm2-135m-instruct", "auto").path)
    handler = OpenAIServingCompletion.__new__(OpenAIServingCompletion)
    handler.tokenizer, handler._left_out = tok, {}
    ids = tok.encode("Hi there.<|im_end|>\n<|im_start|>user\nOk", add_special_tokens=False)
    for skip in (True, False):
        text = tok.decode(ids, skip_special_tokens=skip)
        c = CompletionOutput(0, text, ids, logprobs=[{i: Logprob(-0.5, 1)} for i in ids])
        lp = handler.logprobs(c, 0, 1, TextOffsets(), skip_special=skip)
        assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[-1] < len(text), (skip, lp.text_offset)
        for t, at in zip(lp.tokens, lp.text_offset, strict=True):
            assert text.startswith(t, at) or (skip and t in ("<|im_end|>", "<|im_start|>")), (skip, t, at)
        assert "<|im_end|>" in lp.tokens
