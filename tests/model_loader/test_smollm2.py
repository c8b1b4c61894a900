"""The registered default model: our dequantized SmolLM2 against HF transformers reading the same GGUF."""

from __future__ import annotations

import os

import pytest
import torch

from pagedserve.config import ModelConfig
from pagedserve.forward_context import set_forward_context
from pagedserve.model_loader import get_model, load_model_config, load_tokenizer


@pytest.mark.slow
def test_smollm2_matches_hf_reading_the_gguf(smollm2_path: str, smollm2_gguf: str) -> None:
    """Logits of one chat prompt against HF's own GGUF reading (metadata, dequantization,
    Q/K un-permutation: tests/e2e/test_hf_parity.hf_weights_from_gguf, which the suite's
    other SmolLM2 references share), whose hyperparameters must be ours."""
    from transformers import AutoModelForCausalLM

    from tests.e2e.test_hf_parity import hf_weights_from_gguf

    mc = ModelConfig(model="smollm2-135m-instruct", dtype="float32", quantization="none")
    load_model_config(mc, "cpu")
    assert mc.max_model_len == 8192 and mc.hf_config.num_hidden_layers == 30
    tok = load_tokenizer(mc)
    assert tok.eos_token == "<|im_end|>" and "<|im_start|>" in tok.chat_template
    ids = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                  add_generation_prompt=True, tokenize=False)
    ids = torch.tensor(tok.encode(ids, add_special_tokens=False))
    model = get_model(mc, "cpu")
    with torch.no_grad(), set_forward_context(None):
        ours = model.compute_logits(model(ids, torch.arange(len(ids))))
    hf = AutoModelForCausalLM.from_pretrained(hf_weights_from_gguf(*os.path.split(smollm2_gguf)),
                                              dtype=torch.float32).eval()
    for key in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                "head_dim", "rms_norm_eps", "max_position_embeddings", "vocab_size", "tie_word_embeddings",
                "model_type", "rope_parameters"):
        assert getattr(hf.config, key) == getattr(mc.hf_config, key), key
    with torch.no_grad():
        ref = hf(ids[None]).logits[0]
    assert ref.abs().max() > 10  # a real model, not noise
    torch.testing.assert_close(ours, ref, atol=1e-3, rtol=1e-4)
    assert torch.equal(ours.argmax(-1), ref.argmax(-1))


def test_a_gguf_tokenizer_is_converted_once_and_loads_the_same(smollm2_gguf: str, tmp_path, monkeypatch) -> None:
    """The GGUF's vocabulary is converted on the first start and read from the cache on
    the next, with the same ids, decoding, special tokens and chat template."""
    from pagedserve.model_loader import gguf_utils
    from pagedserve.model_loader.tokenizer import gguf_tokenizer

    monkeypatch.setenv("PAGEDSERVE_CACHE_DIR", str(tmp_path))
    first = gguf_tokenizer(smollm2_gguf)
    [saved] = (tmp_path / "tokenizers").iterdir()

    def no_conversion(path: str):
        raise AssertionError("converted again")

    monkeypatch.setattr(gguf_utils, "load_gguf_tokenizer", no_conversion)
    second = gguf_tokenizer(smollm2_gguf)
    texts = ["What is the capital of France?", "  spaces\tand\nnewlines ", "naïve café 🚀", "<|im_start|>user"]
    assert [second.encode(t) for t in texts] == [first.encode(t) for t in texts]
    assert second.chat_template == first.chat_template  # (this file has none; the converted directory has one)
    assert second.decode(first.encode(texts[2])) == first.decode(first.encode(texts[2]))
    assert (second.eos_token_id, second.bos_token_id, len(second)) == (first.eos_token_id, first.bos_token_id, len(first))

    # A damaged copy is dropped and converted again (the conversion itself was checked
    # above; a converter that stops here saves running it a second time).
    class Converted(Exception):
        pass

    def convert(path: str):
        raise Converted(path)

    (saved / "tokenizer.json").write_text("{not json")
    monkeypatch.setattr(gguf_utils, "load_gguf_tokenizer", convert)
    with pytest.raises(Converted):
        gguf_tokenizer(smollm2_gguf)
    assert not saved.exists()


def test_the_saved_tokenizer_is_autotokenizers_without_transformers(smollm2_path: str) -> None:
    """The converted directory's tokenizer (a snapshot: model_loader/tokenizer_snapshot.py)
    does what AutoTokenizer's does: ids, text, special tokens, the chat template rendered."""
    from transformers import AutoTokenizer

    from pagedserve.model_loader.tokenizer import saved_tokenizer
    from pagedserve.model_loader.tokenizer_snapshot import SnapshotTokenizer, hf_tokenizer

    ours, auto = saved_tokenizer(smollm2_path), AutoTokenizer.from_pretrained(smollm2_path)
    texts = ["What is the capital of France?", "naïve café 🚀", "<|im_start|>user\nhi<|im_end|>"]
    assert isinstance(ours, SnapshotTokenizer) and type(hf_tokenizer(ours)) is type(auto)
    assert [ours.encode(t) for t in texts] == [auto.encode(t) for t in texts]
    assert [ours.decode(auto.encode(t)) for t in texts] == [auto.decode(auto.encode(t)) for t in texts]
    assert ours.special_tokens_map == auto.special_tokens_map and ours.chat_template == auto.chat_template
    assert (ours.eos_token_id, ours.bos_token_id, len(ours)) == (auto.eos_token_id, auto.bos_token_id, len(auto))
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "Capital of France?"}]
    for prompt in (True, False):
        assert (ours.apply_chat_template(chat, add_generation_prompt=prompt, tokenize=False)
                == auto.apply_chat_template(chat, add_generation_prompt=prompt, tokenize=False))
    assert (ours.apply_chat_template(chat[:3], continue_final_message=True, tokenize=False)
            == auto.apply_chat_template(chat[:3], continue_final_message=True, tokenize=False))
