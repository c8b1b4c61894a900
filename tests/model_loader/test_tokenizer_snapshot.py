"""Tokenizer snapshots: transformers' fast tokenizer saved once and served without it,
doing what transformers' does (ids, text, special tokens, templates)."""

from __future__ import annotations

import functools
import json
import os
import pickle
import subprocess
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedserve.model_loader import tokenizer_snapshot
from pagedserve.model_loader.tokenizer_snapshot import (
    SnapshotTokenizer,
    cached_tokenizer,
    hf_tokenizer,
    longest_token_chars,
    snapshot_state,
)
from tests.engine.helpers import CHAT_TEMPLATE, make_tokenizer

TEXTS = ["hello world", "Paris is the capital of France.", "naïve café 🚀", "<|im_start|>user\nhi<|im_end|>",
         "  two  spaces\n\ttab", ""]


@pytest.fixture
def saved(tmp_path, monkeypatch) -> str:
    """A tokenizer directory as pagedserve writes one, with the cache under tmp_path."""
    monkeypatch.setenv("PAGEDSERVE_CACHE_DIR", str(tmp_path / "cache"))
    path = str(tmp_path / "tok")
    make_tokenizer().save_pretrained(path)
    return path


def _snapshots(tmp_path) -> list[str]:
    folder = tmp_path / "cache" / "tokenizer-snapshots"
    return sorted(os.listdir(folder)) if folder.is_dir() else []


def test_the_first_start_saves_a_snapshot_and_later_ones_load_it_alone(saved, tmp_path, monkeypatch) -> None:
    first = cached_tokenizer(saved)
    assert isinstance(first, SnapshotTokenizer) and len(_snapshots(tmp_path)) == 1

    def no_transformers(directory: str):
        raise AssertionError("loaded transformers' tokenizer")

    monkeypatch.setattr(tokenizer_snapshot, "_load_hf", no_transformers)
    second = cached_tokenizer(saved)
    assert isinstance(second, SnapshotTokenizer)
    assert [second.encode(t) for t in TEXTS] == [first.encode(t) for t in TEXTS]
    assert second.chat_template == CHAT_TEMPLATE


def test_a_snapshot_does_what_transformers_tokenizer_does(saved) -> None:
    ours, hf = cached_tokenizer(saved), make_tokenizer()
    for text in TEXTS:
        for special in (True, False):
            assert ours.encode(text, add_special_tokens=special) == hf.encode(text, add_special_tokens=special)
        ids = hf.encode(text)
        for skip in (True, False):
            assert ours.decode(ids, skip_special_tokens=skip) == hf.decode(ids, skip_special_tokens=skip)
    assert ours.get_vocab() == hf.get_vocab() and len(ours) == len(hf)
    # counted when saved, so that a start need not build the vocabulary's dict
    assert longest_token_chars(ours) == longest_token_chars(hf) == max(map(len, hf.get_vocab()))
    assert longest_token_chars(cached_tokenizer(saved)) == ours.longest_token_chars  # loaded back
    assert ours.get_added_vocab() == hf.get_added_vocab()  # what structural tags match whole
    assert ours.special_tokens_map == hf.special_tokens_map
    for name in ("bos_token_id", "eos_token_id", "unk_token_id", "pad_token_id", "bos_token", "eos_token"):
        assert getattr(ours, name) == getattr(hf, name), name
    for token in ("<|im_end|>", "hello", "not-a-token"):
        assert ours.convert_tokens_to_ids(token) == hf.convert_tokens_to_ids(token)
    conversation = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello"}]
    for generation_prompt in (True, False):
        assert (ours.apply_chat_template(conversation, add_generation_prompt=generation_prompt, tokenize=False)
                == hf.apply_chat_template(conversation, add_generation_prompt=generation_prompt, tokenize=False))
    assert (ours.apply_chat_template(conversation, tokenize=True)
            == hf.apply_chat_template(conversation, tokenize=True, return_dict=False))


@settings(max_examples=60, deadline=None)
@given(ids=st.lists(st.integers(0, 399), max_size=24), skip=st.booleans())
def test_any_ids_decode_as_transformers_decodes_them(ids: list[int], skip: bool) -> None:
    ours, hf = _pair()
    assert ours.decode(ids, skip_special_tokens=skip) == hf.decode(ids, skip_special_tokens=skip)


@settings(max_examples=60, deadline=None)
@given(text=st.text(max_size=40))
def test_any_text_encodes_as_transformers_encodes_it(text: str) -> None:
    ours, hf = _pair()
    assert ours.encode(text) == hf.encode(text)
    assert ours.encode(text, add_special_tokens=False) == hf.encode(text, add_special_tokens=False)


@settings(max_examples=20, deadline=None)
@given(text=st.text(min_size=1, max_size=40), repeat=st.integers(1, 400))
def test_long_text_encodes_as_transformers_encodes_it(text: str, repeat: int) -> None:
    """Past LONG_TEXT_CHARS the snapshot tokenizes through encode_batch, which lets other
    threads run meanwhile (encode held the interpreter's lock: a 3M-character prompt froze
    the event loop for 0.9 s): the same ids either way."""
    from pagedserve.model_loader.tokenizer_snapshot import LONG_TEXT_CHARS

    ours, hf = _pair()
    long = text * (LONG_TEXT_CHARS // len(text) + repeat)
    assert len(long) > LONG_TEXT_CHARS
    assert ours.encode(long) == hf.encode(long)
    assert ours.encode(long, add_special_tokens=False) == hf.encode(long, add_special_tokens=False)


@functools.cache
def _pair() -> tuple[SnapshotTokenizer, object]:
    """A snapshot and the tokenizer it was made of (no directory: nothing loads from it)."""
    hf = make_tokenizer()
    return SnapshotTokenizer("", snapshot_state(hf), hf=hf), hf


def test_transformers_own_tokenizer_is_there_for_those_that_index_it(saved) -> None:
    from transformers import PreTrainedTokenizerFast

    ours = cached_tokenizer(saved)
    ours.chat_template = "{{ messages[0]['content'] }}!"
    hf = hf_tokenizer(ours)
    assert isinstance(hf, PreTrainedTokenizerFast) and hf.get_vocab() == ours.get_vocab()
    assert hf.chat_template == ours.chat_template  # a replaced template travels along
    assert hf_tokenizer(hf) is hf and hf_tokenizer(None) is None


def test_a_tokenizer_that_cleans_up_spaces_stays_transformers(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("PAGEDSERVE_CACHE_DIR", str(tmp_path / "cache"))
    make_tokenizer().save_pretrained(tmp_path / "tok")
    config = tmp_path / "tok" / "tokenizer_config.json"
    config.write_text(json.dumps({**json.loads(config.read_text()), "clean_up_tokenization_spaces": True}))
    assert not isinstance(cached_tokenizer(str(tmp_path / "tok")), SnapshotTokenizer)
    assert _snapshots(tmp_path) == []


def test_a_torn_snapshot_is_made_again(saved, tmp_path) -> None:
    cached_tokenizer(saved)
    [name] = _snapshots(tmp_path)
    (tmp_path / "cache" / "tokenizer-snapshots" / name).write_text('{"backend": "{not json')
    again = cached_tokenizer(saved)
    assert isinstance(again, SnapshotTokenizer) and again.encode("hello world") == make_tokenizer().encode("hello world")
    with open(tmp_path / "cache" / "tokenizer-snapshots" / name) as f:
        assert json.load(f)["chat_template"] == CHAT_TEMPLATE


def test_a_changed_directory_gets_a_new_snapshot(saved, tmp_path) -> None:
    cached_tokenizer(saved)
    config = os.path.join(saved, "tokenizer_config.json")
    with open(config) as f:
        values = json.load(f)
    values["eos_token"] = "<|endoftext|>"
    with open(config, "w") as f:
        json.dump(values, f)
    os.utime(config, ns=(1, 1))  # (a rewrite within the clock's resolution still changes the key)
    assert cached_tokenizer(saved).eos_token == "<|endoftext|>" and len(_snapshots(tmp_path)) == 2


def test_a_copied_directory_reads_the_snapshot_and_each_file_read_is_in_its_key(saved, tmp_path, monkeypatch) -> None:
    """Keyed by the files' bytes, not the directory's path: a copy loads without
    transformers; a file the load reads, added to the copy only, makes its own snapshot."""
    import shutil

    first = cached_tokenizer(saved)
    copy = str(tmp_path / "copy")
    shutil.copytree(saved, copy)
    real_load_hf = tokenizer_snapshot._load_hf
    monkeypatch.setattr(tokenizer_snapshot, "_load_hf", lambda *a: pytest.fail("the copy should read the snapshot"))
    again = cached_tokenizer(copy)
    assert isinstance(again, SnapshotTokenizer) and len(_snapshots(tmp_path)) == 1
    assert [again.encode(t) for t in TEXTS] == [first.encode(t) for t in TEXTS]
    with open(os.path.join(copy, "config.json"), "w") as f:  # (names the class where tokenizer_config.json does not)
        json.dump({"model_type": "llama"}, f)
    loaded: list[str] = []
    monkeypatch.setattr(tokenizer_snapshot, "_load_hf", lambda d, *a: loaded.append(d) or real_load_hf(d, *a))
    assert isinstance(cached_tokenizer(copy), SnapshotTokenizer)
    assert loaded == [copy] and len(_snapshots(tmp_path)) == 2


def test_loading_a_snapshot_imports_no_transformers(saved, tmp_path) -> None:
    cached_tokenizer(saved)
    code = ("import sys\nfrom pagedserve.model_loader.tokenizer import saved_tokenizer\n"
            f"tok = saved_tokenizer({saved!r})\n"
            "print(type(tok).__name__, tok.apply_chat_template([{'role': 'user', 'content': 'hi'}], tokenize=False,"
            " add_generation_prompt=True).count('<|im_start|>'), 'transformers' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={**os.environ, "PAGEDSERVE_CACHE_DIR": str(tmp_path / "cache")}).stdout
    assert out.split() == ["SnapshotTokenizer", "2", "False"]


def test_a_snapshot_travels_by_pickle(saved) -> None:
    """As a data-parallel replica sends it to the server's front end."""
    ours = cached_tokenizer(saved)
    ours.chat_template = "{{ messages | length }}"
    back = pickle.loads(pickle.dumps(ours))
    assert back.encode("hello world") == ours.encode("hello world") and back.chat_template == ours.chat_template
    assert back.hf_tokenizer().get_vocab() == ours.get_vocab()


def test_gemmas_tokenizer_class_is_snapshotted_and_does_what_transformers_does(gemma3_path, tmp_path,
                                                                               monkeypatch) -> None:
    """GemmaTokenizer (a model-specific class) is snapshotted once checked against it."""
    from pagedserve.model_loader.tokenizer import saved_tokenizer

    monkeypatch.setenv("PAGEDSERVE_CACHE_DIR", str(tmp_path / "cache"))
    ours = saved_tokenizer(gemma3_path)
    hf = hf_tokenizer(ours)  # the one it was checked against (and what grammar backends index)
    assert isinstance(ours, SnapshotTokenizer) and type(hf).__name__ == "GemmaTokenizer"
    assert len(_snapshots(tmp_path)) == 1
    for text in [*TEXTS, "<start_of_turn>user\nhi<end_of_turn>", "日本語のテキスト"]:
        for special in (True, False):
            assert ours.encode(text, add_special_tokens=special) == hf.encode(text, add_special_tokens=special)
        ids = hf.encode(text)
        assert ours.decode(ids, skip_special_tokens=True) == hf.decode(ids, skip_special_tokens=True)
    assert len(ours) == len(hf) and ours.special_tokens_map == hf.special_tokens_map


def test_long_text_is_tokenized_where_other_threads_can_run() -> None:
    """The Rust tokenizer's encode holds the interpreter's lock; its encode_batch lets go.
    Long text takes encode_batch (what lets /health answer meanwhile)."""
    from pagedserve.model_loader.tokenizer_snapshot import LONG_TEXT_CHARS

    hf = make_tokenizer()
    ours = SnapshotTokenizer("", snapshot_state(hf), hf=hf)
    calls: list[str] = []

    class Recording:
        def __init__(self, inner) -> None:
            self.inner = inner

        def encode(self, *args, **kwargs):
            calls.append("encode")
            return self.inner.encode(*args, **kwargs)

        def encode_batch(self, *args, **kwargs):
            calls.append("encode_batch")
            return self.inner.encode_batch(*args, **kwargs)

    ours.backend_tokenizer = Recording(ours.backend_tokenizer)
    ours.encode("short text")
    ours.encode("x " * LONG_TEXT_CHARS)
    assert calls == ["encode", "encode_batch"]
