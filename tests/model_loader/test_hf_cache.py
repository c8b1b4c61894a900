"""Hub ids (ORG/NAME) read from the local Hugging Face cache, as transformers leaves it."""

from __future__ import annotations

import os

import pytest

from pagedserve import LLM, SamplingParams
from pagedserve.model_loader.sources import hf_hub_cache_dir, hf_hub_snapshot, resolve_source
from tests.engine.helpers import make_tiny_llama


def _cache_with(tmp_path, repo_id: str, commit: str = "0123abcd", ref: bool = True) -> str:
    """A Hub cache holding one snapshot of a tiny Llama (config, weights, tokenizer)."""
    cache = tmp_path / "hub"
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    snapshot = repo / "snapshots" / commit
    snapshot.mkdir(parents=True)
    make_tiny_llama(str(snapshot))
    if ref:
        (repo / "refs").mkdir()
        (repo / "refs" / "main").write_text(commit + "\n")
    return str(cache)


def test_a_hub_id_loads_from_the_cache_like_a_directory(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", _cache_with(tmp_path, "acme/tiny-llama"))
    llm = LLM("acme/tiny-llama", dtype="float32")
    out = llm.generate(["hello world"], SamplingParams(temperature=0.0, max_tokens=5), use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 5 and out.outputs[0].text  # the cached tokenizer decoded it
    assert resolve_source("acme/tiny-llama").path.endswith(os.path.join("snapshots", "0123abcd"))


def test_the_cache_location_follows_the_hugging_face_variables(tmp_path, monkeypatch):
    for name in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "HF_HOME", "XDG_CACHE_HOME"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert hf_hub_cache_dir() == str(tmp_path / "xdg" / "huggingface" / "hub")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    assert hf_hub_cache_dir() == str(tmp_path / "hf" / "hub")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "elsewhere"))
    assert hf_hub_cache_dir() == str(tmp_path / "elsewhere")


def test_without_refs_the_only_snapshot_is_used(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", _cache_with(tmp_path, "acme/tiny", commit="feed", ref=False))
    assert hf_hub_snapshot("acme/tiny").endswith(os.path.join("snapshots", "feed"))


def test_a_model_missing_from_the_cache_names_where_it_looked(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "empty-hub"))
    with pytest.raises(ValueError, match=r"'Qwen/Qwen3-0.6B' is neither a local path nor in the Hugging Face "
                                         r"cache \(.*empty-hub/models--Qwen--Qwen3-0.6B does not exist\).*"
                                         r"huggingface-cli download Qwen/Qwen3-0.6B"):
        LLM("Qwen/Qwen3-0.6B")


def test_ambiguous_or_incomplete_snapshots_are_refused(tmp_path, monkeypatch):
    cache = _cache_with(tmp_path, "acme/two", commit="aaaa", ref=False)
    (tmp_path / "hub" / "models--acme--two" / "snapshots" / "bbbb").mkdir()
    monkeypatch.setenv("HF_HUB_CACHE", cache)
    with pytest.raises(ValueError, match="no refs/main and 2 snapshots"):
        hf_hub_snapshot("acme/two")
    partial = tmp_path / "hub" / "models--acme--partial" / "snapshots" / "cccc"
    partial.mkdir(parents=True)
    with pytest.raises(ValueError, match="has no config.json or .gguf file"):
        hf_hub_snapshot("acme/partial")


def test_a_local_directory_wins_over_a_hub_id_of_the_same_spelling(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    make_tiny_llama(str(tmp_path / "acme" / "local"))
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "no-hub"))
    assert resolve_source("acme/local").path == str(tmp_path / "acme" / "local")


def test_sharded_safetensors_with_an_index_load_like_one_file(tmp_path):
    import transformers

    make_tiny_llama(str(tmp_path / "whole"))
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "whole")
    model.save_pretrained(tmp_path / "sharded", max_shard_size="100KB")
    transformers.AutoTokenizer.from_pretrained(tmp_path / "whole").save_pretrained(tmp_path / "sharded")
    shards = sorted(p.name for p in (tmp_path / "sharded").glob("*.safetensors"))
    assert len(shards) > 1 and (tmp_path / "sharded" / "model.safetensors.index.json").is_file()
    sp = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    outs = [LLM(str(tmp_path / d), dtype="float32").generate(["hello world"], sp, use_tqdm=False)[0]
            for d in ("whole", "sharded")]
    assert outs[0].outputs[0].token_ids == outs[1].outputs[0].token_ids
    (tmp_path / "sharded" / shards[-1]).unlink()
    with pytest.raises(FileNotFoundError, match=f"lists weight files that do not exist: .*{shards[-1]}"):
        LLM(str(tmp_path / "sharded"), dtype="float32")
