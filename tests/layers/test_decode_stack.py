"""The decoder layers as one C++ call for all-decode CPU steps (layers/decode_stack.py)
against the same layers run one direct call at a time: bit for bit the same outputs."""

from __future__ import annotations

import pytest

from pagedserve import LLM, SamplingParams
from pagedserve.layers import decode_stack, quantization
from pagedserve.models.llama import LlamaModel
from tests.e2e.conftest import make_tiny_checkpoint

pytestmark = pytest.mark.usefixtures("fused_kernel")  # (tests/layers/conftest.py)

# Three requests of different lengths, each crossing several 16-token blocks (the steps
# that open a block zero it first), decoding together and then alone.
PROMPTS = [{"prompt_token_ids": [(7 * i + 3 * j) % 500 for i in range(n)]} for j, n in enumerate((5, 20, 37))]


def _generate(path: str, dtype: str, stack: bool, monkeypatch: pytest.MonkeyPatch,
              kv_cache_dtype: str = "auto") -> tuple[list, int]:
    """(each request's tokens and logprobs, how many steps the stack ran)."""
    runs = 0
    run = decode_stack.DecodeStack.run

    def counted(self, hidden, rope):
        nonlocal runs
        out = run(self, hidden, rope)
        runs += out is not None
        return out

    with monkeypatch.context() as m:
        m.setattr(decode_stack.DecodeStack, "run", counted)
        if not stack:
            m.setattr(LlamaModel, "bind_decode_stack", lambda self: False)
        llm = LLM(path, dtype=dtype, quantization="int8", speculative_config="off", max_model_len=256,
                  kv_cache_dtype=kv_cache_dtype)
        greedy = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True, logprobs=3)
        sampled = SamplingParams(max_tokens=24, temperature=0.9, seed=7, ignore_eos=True)
        outs = llm.generate(PROMPTS, greedy, use_tqdm=False) + llm.generate(PROMPTS[:1], sampled, use_tqdm=False)
        del llm
    return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs], runs


@pytest.mark.parametrize("dtype", ["bfloat16", "float32", "float16"])
@pytest.mark.parametrize("arch", ["llama", "qwen3", "mistral"])
def test_the_stack_gives_the_layer_by_layer_outputs_exactly(arch, dtype, tmp_path, monkeypatch):
    """Llama, Qwen3 (q/k norms) and Mistral (a sliding window shorter than the requests),
    in bf16, float32 (the AVX2 default) and float16: the stack runs the decode steps, and
    the tokens and logprobs are exactly those of the layer-by-layer direct calls."""
    make_tiny_checkpoint(arch, str(tmp_path), **({"head_dim": 64} if arch == "llama" else {}))
    want, none = _generate(str(tmp_path), dtype, False, monkeypatch)
    got, runs = _generate(str(tmp_path), dtype, True, monkeypatch)
    assert none == 0 and runs >= 40
    assert got == want


@pytest.mark.parametrize("kv_cache_dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("arch", ["llama", "mistral"])
def test_a_16_bit_cache_under_float32_compute_takes_the_stack_exactly(arch, kv_cache_dtype, tmp_path, monkeypatch):
    """`--kv-cache-dtype float16` (or bfloat16) where float32 is the compute dtype (AVX2's
    default): the decode kernel stores the new rows itself, so the stack runs the decode
    steps, with the layer-by-layer path's tokens and logprobs."""
    make_tiny_checkpoint(arch, str(tmp_path), **({"head_dim": 64} if arch == "llama" else {}))
    want, none = _generate(str(tmp_path), "float32", False, monkeypatch, kv_cache_dtype)
    got, runs = _generate(str(tmp_path), "float32", True, monkeypatch, kv_cache_dtype)
    assert none == 0 and runs >= 40
    assert got == want


def test_weights_of_several_segments_take_the_list_call_exactly(tmp_path, monkeypatch):
    """q|k|v and gate|up kept one segment per shard (as GGUF shards of different types
    stay): the stack calls the kernel's list-taking `linear`, with the same outputs."""
    monkeypatch.setattr(quantization.QuantizedWeight, "merge", lambda self: None)
    make_tiny_checkpoint("llama", str(tmp_path), head_dim=64)
    llm = LLM(str(tmp_path), dtype="float32", quantization="int8", speculative_config="off", max_model_len=256)
    model = next(m for m in llm.llm_engine.model_executor.model.modules() if isinstance(m, LlamaModel))
    assert len(model.layers[0].self_attn.qkv_proj.qweight.segments) == 3 and model.decode_stack is not None
    del llm, model
    want, none = _generate(str(tmp_path), "float32", False, monkeypatch)
    got, runs = _generate(str(tmp_path), "float32", True, monkeypatch)
    assert none == 0 and runs >= 40
    assert got == want


def test_models_the_stack_cannot_run_keep_their_layers(tmp_path):
    """Qwen2's q/k/v bias is not a bare quantized product, and an unquantized model has no
    quantized projections: neither binds a stack (both still bind direct layer calls)."""
    make_tiny_checkpoint("qwen2", str(tmp_path / "qwen2"), head_dim=64)
    make_tiny_checkpoint("llama", str(tmp_path / "llama"), head_dim=64)
    for path, method in ((tmp_path / "qwen2", "int8"), (tmp_path / "llama", "none")):
        llm = LLM(str(path), dtype="float32", quantization=method, speculative_config="off", max_model_len=256)
        model = next(m for m in llm.llm_engine.model_executor.model.modules() if isinstance(m, LlamaModel))
        assert model.decode_stack is None and all(layer.direct is not None for layer in model.layers)
