"""What Ollama's routes say of a model, read from its files without loading it
(model_loader/model_facts.py), against gguf's own reader."""

from __future__ import annotations

import os

from pagedserve.model_loader.model_facts import model_details


def test_a_gguf_files_facts_are_what_ggufs_own_reader_reads(smollm2_gguf: str, smollm2_path: str) -> None:
    from gguf import GGUFReader, LlamaFileType

    reader = GGUFReader(smollm2_gguf)  # decodes every field: the slow reference
    arch = reader.fields["general.architecture"].contents()
    facts = model_details(smollm2_gguf)
    assert facts.format == "gguf" and facts.family == arch == "llama"
    assert facts.parameter_count == sum(int(t.n_elements) for t in reader.tensors) > 100_000_000
    assert facts.quantization == LlamaFileType(reader.fields["general.file_type"].contents()).name.removeprefix(
        "MOSTLY_") == "Q4_1"
    assert facts.context_length == reader.fields[f"{arch}.context_length"].contents() == 8192
    assert facts.size == os.path.getsize(smollm2_gguf)
    # A bare file's chat template is the one its chats are rendered with (/api/show lists "tools").
    assert facts.chat_template == reader.fields["tokenizer.chat_template"].contents() and "<|im_start|>" in \
        facts.chat_template
    # The converted directory: its own config and template, the GGUF's quantization.
    converted = model_details(smollm2_path)
    assert (converted.format, converted.family, converted.quantization, converted.context_length) == (
        "gguf", "llama", "Q4_1", 8192)
    assert "<|im_start|>" in converted.chat_template
    assert converted.details()["parameter_size"] == "134.52M"
    # Its size is the GGUF file's, the format and quantization it names (not the conversion's bytes).
    [original] = [f for f in os.listdir(smollm2_path) if f.endswith(".gguf")]
    assert converted.size == os.path.getsize(os.path.join(smollm2_path, original)) < 120_000_000


def test_an_unreadable_model_shows_only_its_name(tmp_path) -> None:
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF" + b"\xff" * 64)
    facts = model_details(str(bad))
    assert (facts.format, facts.family, facts.parameter_count) == ("unknown", "unknown", 0)


def test_a_vision_language_checkpoint_says_so(tmp_path) -> None:
    """(Ollama's /api/show lists "vision" among its capabilities.)"""
    import json

    # (a top-level max_position_embeddings beside the text config's is not the one the engine reads)
    for name, config in (("vlm", {"model_type": "idefics3", "architectures": ["Idefics3ForConditionalGeneration"],
                                  "max_position_embeddings": 512, "text_config": {"max_position_embeddings": 1024}}),
                         ("text", {"model_type": "llama", "architectures": ["LlamaForCausalLM"],
                                   "max_position_embeddings": 2048})):
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text(json.dumps(config))
    assert model_details(str(tmp_path / "vlm")).vision and not model_details(str(tmp_path / "text")).vision
    # its context is its language model's (the text config's: /api/show said 0)
    assert (model_details(str(tmp_path / "vlm")).context_length, model_details(str(tmp_path / "text")).context_length) \
        == (1024, 2048)


def crafted_gguf(count: int, kind: int = 8) -> bytes:
    """A GGUF header with one metadata array of `count` values of `kind` (8: strings), and
    no data behind it: what a crafted file claims."""
    import struct

    key = b"tokenizer.ggml.tokens"
    return (b"GGUF" + struct.pack("<IQQ", 3, 0, 1) + struct.pack("<Q", len(key)) + key
            + struct.pack("<IIQ", 9, kind, count))


def test_hostile_model_files_show_unknown_facts_quickly_and_once(tmp_path, monkeypatch) -> None:
    """A header's lengths are checked against the file before anything is skipped (a
    2^62-string array over a sparse 1 GiB file kept an event loop 22 s); a config of the
    wrong shapes is unknown facts, not an exception; each file is read once."""
    import json
    import time

    from pagedserve.model_loader import model_facts

    sparse = tmp_path / "sparse.gguf"
    with open(sparse, "wb") as f:
        f.write(crafted_gguf(2**62))
        f.truncate(1 << 30)
    (tmp_path / "values.gguf").write_bytes(crafted_gguf(2**40, kind=4) + b"\0" * 64)
    for name, config in (("archs", {"architectures": 5}), ("ctx", {"max_position_embeddings": [1]}), ("list", [])):
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text(json.dumps(config))
    (tmp_path / "deep").mkdir()
    (tmp_path / "deep" / "config.json").write_text("[" * 100_000)
    start = time.perf_counter()
    for name in ("sparse.gguf", "values.gguf", "archs", "ctx", "list", "deep"):
        facts = model_details(str(tmp_path / name))
        assert (facts.format, facts.parameter_count) == ("unknown", 0), name
    assert time.perf_counter() - start < 2.0
    reads: list[str] = []
    monkeypatch.setattr(model_facts, "_read_facts", lambda path, mtime: reads.append(path))
    model_details(str(sparse))
    assert reads == []  # (a failure is cached as a success is)
