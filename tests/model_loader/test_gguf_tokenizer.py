"""A GGUF's embedded tokenizer, converted without AutoTokenizer's config pass
(gguf_utils.load_gguf_tokenizer), against AutoTokenizer itself: the same class and the
same saved files, for every GGUF architecture the loader reads.  Small vocabularies of
both kinds GGUF stores (a byte-level BPE with merges, a sentencepiece one with scores)
keep AutoTokenizer's slow metadata pass cheap here."""

from __future__ import annotations

import filecmp
import os

import numpy as np
import pytest

from pagedserve.model_loader.gguf_utils import GGUF_ARCHITECTURES, load_gguf_tokenizer

_LETTERS = "abcdefghijklmnopqrstuvwxyz"
_TEMPLATE = "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"


def _byte_level_vocab() -> tuple[list[str], list[str]]:
    """GPT-2's byte-to-character alphabet, a few merges, and the special tokens."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    alphabet, extra = [], 0
    for b in range(256):
        if b in keep:
            alphabet.append(chr(b))
        else:
            alphabet.append(chr(256 + extra))
            extra += 1
    merges = ["Ġ t", "h e", "Ġt he", "i n", "a n"]
    tokens = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", *alphabet, "Ġt", "he", "Ġthe", "in", "an"]
    return tokens, merges


def _write(path: str, arch: str) -> None:
    import gguf

    w = gguf.GGUFWriter(path, arch)
    w.add_context_length(512)
    w.add_embedding_length(64)
    w.add_block_count(1)
    w.add_feed_forward_length(128)
    w.add_head_count(4)
    w.add_head_count_kv(2)
    w.add_layer_norm_rms_eps(1e-6)
    if arch == "gemma3":  # sentencepiece: pieces with scores, bytes as <0xNN>
        tokens = ["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>", "▁",
                  *_LETTERS, *(f"▁{c}" for c in _LETTERS), *(f"<0x{b:02X}>" for b in range(256))]
        types = [3, 3, 3, 2, 3, 3, *[1] * (1 + 2 * len(_LETTERS)), *[6] * 256]
        w.add_tokenizer_model("llama")
        w.add_token_list(tokens)
        w.add_token_scores([-float(i) for i in range(len(tokens))])
        w.add_token_types(types)
        w.add_bos_token_id(2)
        w.add_eos_token_id(1)
        w.add_unk_token_id(3)
        w.add_pad_token_id(0)
        w.add_add_bos_token(True)
    else:
        tokens, merges = _byte_level_vocab()
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre("smollm" if arch == "llama" else "qwen2")
        w.add_token_list(tokens)
        w.add_token_types([3, 3, 3, *[1] * (len(tokens) - 3)])
        w.add_token_merges(merges)
        w.add_bos_token_id(1)
        w.add_eos_token_id(2)
    w.add_chat_template(_TEMPLATE)
    w.add_tensor("token_embd.weight", np.zeros((len(tokens), 64), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.mark.parametrize("arch", sorted(GGUF_ARCHITECTURES))
def test_the_tokenizer_is_autotokenizers(arch: str, tmp_path) -> None:
    from transformers import AutoTokenizer

    path = str(tmp_path / f"{arch}.gguf")
    _write(path, arch)
    ours = load_gguf_tokenizer(path)
    auto = AutoTokenizer.from_pretrained(str(tmp_path), gguf_file=os.path.basename(path))
    assert type(ours) is type(auto)
    text = "the cat in the hat"
    assert ours.encode(text) == auto.encode(text) and len(auto.encode(text)) > 1
    ours.save_pretrained(tmp_path / "ours")
    auto.save_pretrained(tmp_path / "auto")
    names = sorted(os.listdir(tmp_path / "auto"))
    assert names == sorted(os.listdir(tmp_path / "ours")) and "tokenizer.json" in names
    for name in names:
        assert filecmp.cmp(tmp_path / "ours" / name, tmp_path / "auto" / name, shallow=False), name


def test_a_file_that_is_not_a_gguf_names_itself(tmp_path) -> None:
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF" + b"\xff" * 64)
    with pytest.raises(ValueError, match="bad.gguf: cannot build a tokenizer"):
        load_gguf_tokenizer(str(bad))


@pytest.mark.parametrize("drop", ["tokenizer.ggml.tokens", "tokenizer.ggml.merges", "tokenizer.ggml.model"])
def test_a_gguf_without_a_tokenizer_names_the_missing_key(drop: str, tmp_path, monkeypatch) -> None:
    """Transformers' conversion said only "KeyError: 'tokens'" for a GGUF without its vocabulary."""
    import gguf

    real = gguf.GGUFWriter.add_key_value

    def skip(self, key, *args, **kwargs):
        if key != drop:
            real(self, key, *args, **kwargs)

    monkeypatch.setattr(gguf.GGUFWriter, "add_key_value", skip)
    path = str(tmp_path / "llama.gguf")
    _write(path, "llama")
    monkeypatch.undo()
    with pytest.raises(ValueError, match=f"llama.gguf: cannot build a tokenizer from the GGUF \\(it has no {drop};"
                                         " name a tokenizer with --tokenizer\\)"):
        load_gguf_tokenizer(path)


def test_a_gguf_beside_other_tokenizer_files_is_read_alone(tmp_path) -> None:
    """transformers reads a folder's tokenizer.json and tokenizer_config.json before a
    gguf_file: a GGUF in a converted model's folder, or beside another model's tokenizer,
    came back as that tokenizer, without its own chat template (chats were refused as a
    base model's)."""
    names = sorted(GGUF_ARCHITECTURES)
    (tmp_path / "alone").mkdir()
    _write(str(tmp_path / "alone" / "own.gguf"), names[0])
    own = load_gguf_tokenizer(str(tmp_path / "alone" / "own.gguf"))
    (tmp_path / "other").mkdir()
    _write(str(tmp_path / "other" / "other.gguf"), next(a for a in names if a != names[0]))
    other = load_gguf_tokenizer(str(tmp_path / "other" / "other.gguf"))
    other.chat_template = "{{ 'another template' }}"
    other.save_pretrained(tmp_path / "beside")  # (tokenizer.json, tokenizer_config.json, chat_template.jinja)
    os.replace(tmp_path / "alone" / "own.gguf", tmp_path / "beside" / "own.gguf")
    beside = load_gguf_tokenizer(str(tmp_path / "beside" / "own.gguf"))
    assert beside.chat_template == own.chat_template == _TEMPLATE
    assert beside.get_vocab() == own.get_vocab() != other.get_vocab()
