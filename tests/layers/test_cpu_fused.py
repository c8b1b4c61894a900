"""The fused C++ kernels for CPU tensors (layers/cpu_fused.py; float32, bfloat16 and
float16) against the torch ops they replace, and the decoder layer's direct calls
against its module path.  Gemma's kernels: test_cpu_fused_gemma.py."""

from __future__ import annotations

import pytest
import torch

from pagedserve.config import ModelConfig
from pagedserve.forward_context import set_forward_context
from pagedserve.layers import cpu_fused, fused_ops
from pagedserve.layers.activation import SiluAndMul
from pagedserve.layers.layernorm import RMSNorm, rms_normalize
from pagedserve.layers.rotary_embedding import RotaryEmbedding
from pagedserve.model_loader.loader import get_model
from pagedserve.models.llama import LlamaDecoderLayer
from pagedserve.models.utils import bind_direct_layers
from tests.e2e.conftest import make_tiny_checkpoint
from tests.layers.fused_helpers import DTYPES, VARIANTS, fused, gated_input, one_rounding

pytestmark = pytest.mark.usefixtures("fused_kernel")  # (tests/layers/conftest.py)


def test_kernels_apply_to_cpu_tensors_of_one_dtype():
    bf = torch.zeros(2, dtype=torch.bfloat16)
    assert fused_ops.kernels_for(bf) is cpu_fused
    assert fused_ops.kernels_for(bf, torch.zeros(2, dtype=torch.bfloat16)) is cpu_fused
    assert fused_ops.kernels_for(torch.zeros(2, dtype=torch.float16)) is cpu_fused
    assert fused_ops.kernels_for(torch.zeros(2)) is cpu_fused  # float32: the AVX2 machines' default dtype
    assert fused_ops.kernels_for(torch.zeros(2, dtype=torch.float64)) is None
    assert fused_ops.kernels_for(bf, torch.zeros(2)) is None  # mixed: the torch ops' type promotion
    with fused(False):
        assert fused_ops.kernels_for(bf) is None


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,n", [(1, 576), (7, 96), (40, 1024)])
def test_rms_norm_matches_torch(variant, dtype, rows, n):
    kernel = cpu_fused.fused_kernel(variant)
    g = torch.Generator().manual_seed(rows * n)
    weight = (torch.rand(n, generator=g) + 0.5).to(dtype)
    x = (torch.randn(rows, n, generator=g) * 3).to(dtype)
    res = torch.randn(rows, n, generator=g).to(dtype)
    want_res = x + res
    want = weight * rms_normalize(x, 1e-6).to(dtype)
    want2 = weight * rms_normalize(want_res, 1e-6).to(dtype)
    got, none = kernel.rms_norm(x, weight, 1e-6, None)
    got2, got_res = kernel.rms_norm(x, weight, 1e-6, res)
    assert none is None
    torch.testing.assert_close(got, want, **one_rounding(dtype))
    torch.testing.assert_close(got2, want2, **one_rounding(dtype))
    assert torch.equal(got_res, want_res)  # the add rounds once, as torch's does
    if dtype != torch.float32:  # most 16-bit elements round to the same value: only a sum's last bits differ
        assert (got2 == want2).float().mean() > 0.95


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_layer_takes_strided_and_3d_rows(dtype):
    norm = RMSNorm(64).to(dtype)
    norm.weight.data = torch.linspace(0.5, 1.5, 64).to(dtype)
    wide = torch.randn(2, 5, 80).to(dtype)
    x, res = wide[..., 8:72], torch.randn(2, 5, 64).to(dtype)
    with fused(False):
        want, want_res = norm(x, res)
    got, got_res = norm(x, res)
    assert got.shape == (2, 5, 64) and got_res.shape == (2, 5, 64)
    assert torch.equal(got_res, want_res)
    torch.testing.assert_close(got, want, **one_rounding(dtype))


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("qk_norm", [False, True])
@pytest.mark.parametrize("head_dim,rotary_dim", [(64, 64), (16, 12)])
def test_norm_rope_matches_rotate_qk(variant, dtype, qk_norm, head_dim, rotary_dim):
    """Qwen3's q/k RMSNorm + rotary and Llama's rotary alone, full and partial (Phi-3's
    3/4) rotation, over a strided slice of a wider projection."""
    kernel = cpu_fused.fused_kernel(variant)
    g = torch.Generator().manual_seed(head_dim + qk_norm)
    heads, kv_heads, t = 4, 2, 9
    rope = RotaryEmbedding(head_dim, rotary_dim, max_position=64, theta=10000.0)
    rope.cos_sin_cache = rope.cos_sin_cache.to(dtype)
    norms = None
    if qk_norm:
        norms = (RMSNorm(head_dim).to(dtype), RMSNorm(head_dim).to(dtype))
        for norm in norms:
            norm.weight.data = (torch.rand(head_dim, generator=g) + 0.5).to(dtype)
    width = (heads + 2 * kv_heads) * head_dim
    wide = torch.randn(t, width + 24, generator=g).to(dtype)
    qkv = wide[:, 8: 8 + width]
    positions = torch.tensor([0, 1, 2, 5, 17, 18, 40, 63, 3])
    cs = rope.cos_sin(positions)
    with fused(False):
        want_q, want_k = rope.rotate_qk(cs, qkv, heads, kv_heads, norms)
    weights = (norms[0].weight, norms[1].weight) if norms else (None, None)
    got_q, got_k = kernel.norm_rope(qkv, *cs, heads, kv_heads, head_dim, rotary_dim, *weights, 1e-6)
    assert got_q.shape == (t, heads, head_dim) and got_k.shape == (t, kv_heads, head_dim)
    # Rotary alone rounds exactly where torch does (products of 16-bit values are exact in
    # float32; in float32 each product rounds, then the sum: the kernels build without FMA
    # contraction).
    tol = one_rounding(dtype) if qk_norm else dict(atol=0, rtol=0)
    torch.testing.assert_close(got_q, want_q, **tol)
    torch.testing.assert_close(got_k, want_k, **tol)
    if variant is None:  # the layer calls the kernel
        layer_q, layer_k = rope.rotate_qk(cs, qkv, heads, kv_heads, norms)
        assert torch.equal(layer_q, got_q) and torch.equal(layer_k, got_k)


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,inter", [(1, 1536), (5, 48)])
def test_silu_and_mul_matches_torch(variant, dtype, rows, inter):
    kernel = cpu_fused.fused_kernel(variant)
    x = gated_input(rows, inter, dtype, [-100.0, 100.0, -87.5, 88.5, 0.0, -0.0])  # past exp's clamps, and zeros
    with fused(False):
        want = SiluAndMul()(x)
    got = kernel.silu_and_mul(x)
    torch.testing.assert_close(got, want, **one_rounding(dtype))
    assert (got == want).float().mean() > 0.95  # exp differs from torch's in its last bits only
    if variant is None:
        assert torch.equal(SiluAndMul()(x), got)


def test_kernels_refuse_what_they_cannot_take():
    kernel = cpu_fused.fused_kernel()
    bf = torch.zeros(2, 8, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="float32, bfloat16 or float16"):
        kernel.silu_and_mul(torch.zeros(2, 8, dtype=torch.float64))
    with pytest.raises(RuntimeError, match="weight must be"):
        kernel.rms_norm(bf, torch.zeros(4, dtype=torch.bfloat16), 1e-6, None)
    with pytest.raises(RuntimeError, match="unit column stride"):
        kernel.silu_and_mul(bf.t())
    with pytest.raises(RuntimeError, match="head_dim"):
        kernel.norm_rope(torch.zeros(1, 3 * 2048, dtype=torch.bfloat16), torch.zeros(1, 2048, dtype=torch.bfloat16),
                         torch.zeros(1, 2048, dtype=torch.bfloat16), 1, 1, 2048, 2048, None, None, 0.0)


def _logits(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    with torch.inference_mode(), set_forward_context(None):
        return model.compute_logits(model(ids, torch.arange(ids.shape[0])))


@pytest.mark.parametrize("quantization", ["int8", "none"])
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("arch", ["llama", "qwen3", "qwen2"])
def test_direct_layer_calls_give_the_module_paths_logits_exactly(arch, dtype, quantization, tmp_path):
    """Decoders bind their layers' direct calls (Qwen3 with its q/k norm, Qwen2 with its
    q/k/v bias), quantized or not, in bf16 and in float32 (the AVX2 default); the logits
    are bit for bit those of the module path."""
    make_tiny_checkpoint(arch, str(tmp_path))
    model = get_model(ModelConfig(model=str(tmp_path), dtype=dtype, quantization=quantization), "cpu")
    ids = torch.arange(3, 40) * 7 % 500
    want = _logits(model, ids)
    layers = [m for m in model.modules() if isinstance(m, LlamaDecoderLayer)]
    assert bind_direct_layers(model) == (2, 2) == (len(layers), len(layers))
    assert all(layer.direct is not None for layer in layers)
    assert torch.equal(_logits(model, ids), want)
    with fused(False):  # and both are one rounding step from the torch ops
        reference = _logits(model, ids)
    assert torch.equal(want.argmax(-1), reference.argmax(-1))
    if dtype == "float32":
        torch.testing.assert_close(want, reference, atol=1e-4, rtol=1e-4)


def test_float64_and_tensor_parallel_decoders_do_not_bind(tmp_path):
    """No kernels for float64; a tensor-parallel projection all-reduces after its product:
    both keep the module path.  (Adapters bind, their products in each projection's call:
    tests/lora/test_lora_parity.py holds the base model's answers bit for bit.)"""
    make_tiny_checkpoint("llama", str(tmp_path))
    quantized = get_model(ModelConfig(model=str(tmp_path), dtype="float32", quantization="int8"), "cpu")
    quantized.double()
    assert bind_direct_layers(quantized) == (0, 2)
    model = get_model(ModelConfig(model=str(tmp_path), dtype="float32", quantization="none"), "cpu")
    layer = next(m for m in model.modules() if isinstance(m, LlamaDecoderLayer))
    layer.mlp.down_proj.tp_size = 2  # (a rank's shard: direct_call declines)
    assert bind_direct_layers(model) == (1, 2) and layer.direct is None
