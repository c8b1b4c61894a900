from __future__ import annotations

import pytest

from pagedserve.engine.detokenizer import IncrementalDetokenizer, decoder_of
from pagedserve.sampling_params import SamplingParams
from tests.engine.helpers import make_tokenizer

TEXT = "héllo wörld, 你好 🙂 the quick brown fox jumps over the lazy dog."


@pytest.fixture(scope="module")
def tok():
    return make_tokenizer()


@pytest.fixture(scope="module")
def gemma_tokenizer(gemma3_path):
    """transformers' Gemma 3 tokenizer, loaded once for the file (its 262k vocabulary takes
    seconds to load on 2 cores; five tests loaded it each)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(gemma3_path)


def stream(tok, text: str, prompt: str = "user: ", **params):
    """Feed `text`'s tokens one at a time; return (detokenizer, texts shown after each)."""
    detok = IncrementalDetokenizer(tok, tok.encode(prompt), SamplingParams(**params))
    shown = []
    stop = None
    for tid in tok.encode(text):
        stop = detok.update([tid])
        shown.append(detok.get_text(finished=stop is not None))
        if stop is not None:
            break
    if stop is None:
        detok.finish()
    return detok, shown


def test_multibyte_characters_split_across_tokens_never_leak_half(tok) -> None:
    ids = tok.encode(TEXT)
    pieces = [tok.decode([i]) for i in ids]
    assert sum("\ufffd" in p for p in pieces) >= 4, "the fixture should split characters across tokens"
    detok, shown = stream(tok, TEXT)
    assert detok.output_text == TEXT == tok.decode(ids)
    for before, after in zip(shown, shown[1:], strict=False):
        assert "\ufffd" not in after and after.startswith(before)


def test_batch_of_tokens_in_one_update(tok) -> None:
    ids = tok.encode(TEXT)
    detok = IncrementalDetokenizer(tok, [5, 6], SamplingParams())
    for i in range(0, len(ids), 3):
        detok.update(ids[i : i + 3])
        assert "\ufffd" not in detok.output_text
    detok.finish()
    assert detok.output_text == TEXT


def test_unfinished_character_is_flushed_at_finish(tok) -> None:
    ids = tok.encode("ab 你")
    detok = IncrementalDetokenizer(tok, [5], SamplingParams())
    detok.update(ids[:-1])
    assert detok.output_text == "ab "  # the half character waits
    detok.finish()
    assert detok.output_text == tok.decode(ids[:-1])


def test_leading_space_kept_by_prefix_window() -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tk = Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.Metaspace()
    tk.decoder = decoders.Metaspace()
    tk.train_from_iterator(["hello world again and again"] * 5, trainers.BpeTrainer(vocab_size=60))
    sp = PreTrainedTokenizerFast(tokenizer_object=tk)
    world = sp.convert_tokens_to_ids("▁world")
    assert sp.decode([world]) == "world"  # decoded alone, SentencePiece-style drops the space
    detok = IncrementalDetokenizer(sp, sp.encode("hello"), SamplingParams())
    detok.update([world])
    assert detok.output_text == " world"


@pytest.mark.parametrize("include", [False, True])
def test_stop_string_spanning_tokens(tok, include: bool) -> None:
    stop = "quick brown"
    detok, shown = stream(tok, TEXT, stop=["zzz", stop], include_stop_str_in_output=include)
    head = TEXT[: TEXT.index(stop)]
    assert detok.stop_reason == stop
    assert detok.output_text == (head + stop if include else head)
    assert shown[-1] == detok.output_text
    for before, after in zip(shown, shown[1:], strict=False):
        assert after.startswith(before)
    if not include:
        assert all("quick" not in s for s in shown), "a partial stop string leaked into the stream"


def test_partial_stop_is_held_back_then_released(tok) -> None:
    detok = IncrementalDetokenizer(tok, [1], SamplingParams(stop="lazy cat"))
    for tid in tok.encode(TEXT):
        assert detok.update([tid]) is None
        # While running exactly len(stop) - 1 trailing characters stay hidden ...
        decoded = detok.output_text
        assert detok.get_text(finished=False) == decoded[: max(len(decoded) - 7, 0)]
    # ... and come out once the sequence ends without a match.
    detok.finish()
    assert detok.stop_reason is None and detok.get_text(finished=True) == TEXT


def test_earliest_stop_wins_and_min_tokens_delays_checks(tok) -> None:
    detok, _ = stream(tok, TEXT, stop=["lazy", "wörld"])
    assert detok.stop_reason == "wörld" and detok.output_text == "héllo "
    n_before = len(tok.encode("héllo wörld"))
    detok, _ = stream(tok, TEXT, stop="wörld", min_tokens=n_before + 2, max_tokens=100)
    assert detok.stop_reason is None and detok.output_text == TEXT


@pytest.mark.parametrize("include", [False, True])
def test_a_stop_string_skipped_under_min_tokens_is_not_found_again_later(tok, include: bool) -> None:
    """Each stop string is looked for where it could end in the new text (vLLM's window):
    with the longest one's window, "l" found again the "l" of "héllo" skipped under
    min_tokens once "wörld" arrived, and cut the text back to "hé" (with the stop string
    included, below what had been streamed)."""
    n = len(tok.encode("héllo"))
    detok, shown = stream(tok, TEXT, stop=["l", "xyzxyz"], min_tokens=n, include_stop_str_in_output=include)
    want = "héllo wörl" if include else "héllo wör"
    assert detok.stop_reason == "l" and detok.output_text == want
    assert all(want.startswith(s) for s in shown)  # streamed text is never taken back


def test_a_byte_fallback_run_cut_by_max_tokens_flushes_its_own_bytes(gemma_tokenizer) -> None:
    """Gemma's tokens <0xF0><0x9D><0x94><0x98> make one character; two more bytes of the next
    left open by max_tokens read as one U+FFFD per byte of the whole run in a window decode:
    the flush gave the character and five U+FFFD, where its own two bytes give two."""
    tokenizer = gemma_tokenizer
    ids = [tokenizer.convert_tokens_to_ids(f"<0x{b:02X}>") for b in "𝔘".encode() + "😀".encode()[:2]]
    detok = IncrementalDetokenizer(tokenizer, tokenizer.encode("lead"), SamplingParams())
    for tid in ids:
        detok.update([tid])
    assert detok.output_text == "𝔘"
    detok.finish()
    assert detok.output_text == "𝔘" + tokenizer.decode(ids[4:]) == "𝔘\ufffd\ufffd"


@pytest.mark.parametrize("char", ["𝔘", "Б"])
def test_a_stray_byte_after_a_byte_fallback_character_is_one_replacement(gemma_tokenizer, char: str) -> None:
    """A stray continuation byte made the whole run read as one U+FFFD per byte, the
    character already shown too: the slice by length gave 2-4 U+FFFD for the one byte."""
    tokenizer = gemma_tokenizer
    ids = [tokenizer.convert_tokens_to_ids(f"<0x{b:02X}>") for b in char.encode() + b"\xb6"]
    ids += tokenizer.encode(" x", add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer, tokenizer.encode("lead"), SamplingParams())
    shown = []
    for tid in ids:
        detok.update([tid])
        shown.append(detok.output_text)
    detok.finish()
    assert detok.output_text == char + "\ufffd x"
    assert all(detok.output_text.startswith(s) for s in shown)  # streamed text is never taken back


def test_a_prompt_ending_inside_a_byte_fallback_run_leaves_the_output_clean(gemma_tokenizer) -> None:
    """The prompt's last 5 tokens start inside a character (Gemma spells 🦩 as 4 byte
    tokens): the window read that whole run, the output's bytes with it, as one U+FFFD
    per byte (8 for "🦩🦩"), and a stop string of flamingos never matched."""
    tokenizer = gemma_tokenizer
    prompt = tokenizer.encode("Flamingos: 🦩🦩🦩 More: 🦩🦩")
    ids = tokenizer.encode("🦩🦩🦩", add_special_tokens=False)
    assert len(ids) == 12 and tokenizer.decode(prompt[-5:]).startswith("\ufffd")  # (the case: the edge mid-character)
    detok = IncrementalDetokenizer(tokenizer, prompt, SamplingParams())
    for tid in ids[:8]:
        detok.update([tid])
    detok.finish()
    assert detok.output_text == "🦩🦩"
    detok = IncrementalDetokenizer(tokenizer, prompt, SamplingParams(stop=["🦩🦩🦩"]))
    assert [detok.update([tid]) for tid in ids][-1] == "🦩🦩🦩" and detok.output_text == ""


@pytest.mark.parametrize("skip", [True, False])
def test_special_tokens(tok, skip: bool) -> None:
    ids = tok.encode("hello") + [tok.convert_tokens_to_ids("<|im_start|>")] + tok.encode(" world")
    detok = IncrementalDetokenizer(tok, [1], SamplingParams(skip_special_tokens=skip))
    for t in ids:
        detok.update([t])
    assert detok.output_text == ("hello world" if skip else "hello<|im_start|> world")


def test_eos_token_text_dropped(tok) -> None:
    eos = tok.eos_token_id
    detok = IncrementalDetokenizer(tok, [1], SamplingParams(skip_special_tokens=False))
    detok.update(tok.encode("hello") + [eos], skip_last=True)
    assert detok.output_text == "hello" and detok.num_output_tokens == len(tok.encode("hello")) + 1


def test_no_tokenizer_gives_empty_text() -> None:
    detok = IncrementalDetokenizer(None, [1, 2], SamplingParams())
    assert detok.update([3, 4]) is None
    detok.finish()
    assert detok.output_text == "" and detok.num_output_tokens == 2


@pytest.mark.parametrize("include", [False, True])
def test_several_tokens_at_once_stop_at_the_token_that_completes_the_stop_string(tok, include: bool) -> None:
    """Speculative decoding hands over several tokens a step: the text and the token count
    must be what one token at a time gives, and the caller learns how many came after."""
    ids = tok.encode(TEXT)
    one, _ = stream(tok, TEXT, stop="fox", include_stop_str_in_output=include)
    used = len(one.token_ids) - len(tok.encode("user: "))  # output tokens up to the stop
    detok = IncrementalDetokenizer(tok, tok.encode("user: "), SamplingParams(stop="fox", include_stop_str_in_output=include))
    stop = detok.update(ids[:used - 2])
    assert stop is None and detok.tokens_after_stop == 0
    stop = detok.update(ids[used - 2:used + 3])  # the stop string completes at the 2nd of these 5
    assert stop == "fox"
    assert detok.tokens_after_stop == 3
    assert detok.output_text == one.output_text
    assert detok.token_ids == one.token_ids


@pytest.mark.parametrize("which", ["tiny", "smollm2", "gemma3"])
def test_the_direct_decoder_is_exactly_the_tokenizers_decode(which, tok, request) -> None:
    """The fast path (the Rust tokenizer called directly) against tokenizer.decode, on
    random ids (partial UTF-8 characters, special tokens) with and without skipping
    special tokens; the real models' tokenizers take the fast path."""
    import random

    from transformers import AutoTokenizer

    tokenizer = {"tiny": lambda: tok, "gemma3": lambda: request.getfixturevalue("gemma_tokenizer"),
                 "smollm2": lambda: AutoTokenizer.from_pretrained(request.getfixturevalue("smollm2_path"))}[which]()
    rng = random.Random(0)
    specials = list(tokenizer.all_special_ids)
    for skip in (False, True):
        fast = decoder_of(tokenizer, skip)
        for _ in range(300):
            ids = [rng.randrange(len(tokenizer)) for _ in range(rng.randrange(0, 12))]
            if specials and rng.random() < 0.3:
                ids.insert(rng.randrange(len(ids) + 1), rng.choice(specials))
            assert fast(ids) == tokenizer.decode(ids, skip_special_tokens=skip), ids
    if which != "tiny":
        assert decoder_of(tokenizer, False).__code__ is not decoder_of(object(), False).__code__


def test_a_tokenizer_with_its_own_decode_keeps_it() -> None:
    class Custom:
        def decode(self, ids, skip_special_tokens=False):
            return f"{len(ids)}:{skip_special_tokens}"

    assert decoder_of(Custom(), True)([1, 2]) == "2:True"
