"""Gemma 3's fused C++ kernels (layers/cpu_fused.py: its RMSNorm with the residual add
after it, q/k norm + rotary, GELU-tanh x up) against the torch ops they replace, and
its decoder layer's direct calls against its module path, in float32 (the AVX2 CPUs'
default), bfloat16 and float16."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pagedserve.config import ModelConfig
from pagedserve.forward_context import set_forward_context
from pagedserve.layers import cpu_fused, fused_ops
from pagedserve.layers.activation import GeluTanhAndMul
from pagedserve.layers.layernorm import GemmaRMSNorm
from pagedserve.layers.rotary_embedding import RotaryEmbedding
from pagedserve.model_loader.loader import get_model
from pagedserve.models.gemma3 import Gemma3DecoderLayer
from pagedserve.models.utils import bind_direct_layers
from tests.e2e.conftest import make_tiny_checkpoint
from tests.layers.fused_helpers import DTYPES, VARIANTS, fused, gated_input, one_rounding

pytestmark = pytest.mark.usefixtures("fused_kernel")  # (tests/layers/conftest.py)


def test_gemma_kernels_on_cpu_tensors_only():
    """Only the C++ set has Gemma's kernels: a test forcing Triton runs Gemma's torch ops."""
    x = torch.zeros(2)
    assert fused_ops.gemma_kernels_for(x, torch.zeros(2)) is cpu_fused
    assert fused_ops.gemma_kernels_for(x, torch.zeros(2, dtype=torch.bfloat16)) is None
    for override in (False, True):
        with fused(override):
            assert fused_ops.gemma_kernels_for(x) is None


def _gemma_norm(dtype: torch.dtype, n: int, g: torch.Generator) -> GemmaRMSNorm:
    norm = GemmaRMSNorm(n).to(dtype)
    norm.weight.data = (torch.randn(n, generator=g) * 0.3).to(dtype)  # 1 + weight around 1
    return norm


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,n", [(1, 640), (7, 96), (40, 1024)])
def test_gemma_rms_norm_matches_torch(variant, dtype, rows, n):
    kernel = cpu_fused.fused_kernel(variant)
    g = torch.Generator().manual_seed(rows * n)
    norm = _gemma_norm(dtype, n, g)
    x = (torch.randn(rows, n, generator=g) * 3).to(dtype)
    res = torch.randn(rows, n, generator=g).to(dtype)
    with fused(False):
        want, want_added = norm(x), norm(x, res)
    assert torch.equal(want_added, res + want)  # the torch path: the norm rounds, then the add
    got = kernel.gemma_rms_norm(x, norm.weight, norm.eps, None)
    got_added = kernel.gemma_rms_norm(x, norm.weight, norm.eps, res)
    torch.testing.assert_close(got, want, **one_rounding(dtype))
    torch.testing.assert_close(got_added, want_added, **one_rounding(dtype))
    if variant is None:  # the layer calls the kernel, over [..., N] rows too
        assert torch.equal(norm(x), got) and torch.equal(norm(x, res), got_added)
        assert torch.equal(norm(x.view(1, rows, n)), got.view(1, rows, n))


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_gemma_norm_rope_matches_norms_then_rotate(variant, dtype):
    """Gemma's q/k norms ((1 + weight), in float32, one rounding) then rotary, over a
    strided slice of a wider projection: Gemma3Attention's torch ops."""
    kernel = cpu_fused.fused_kernel(variant)
    g = torch.Generator().manual_seed(5)
    heads, kv_heads, t, d = 4, 1, 9, 256
    rope = RotaryEmbedding(d, d, max_position=64, theta=10000.0)
    rope.cos_sin_cache = rope.cos_sin_cache.to(dtype)
    q_norm, k_norm = _gemma_norm(dtype, d, g), _gemma_norm(dtype, d, g)
    width = (heads + 2 * kv_heads) * d
    qkv = torch.randn(t, width + 24, generator=g).to(dtype)[:, 8: 8 + width]
    cs = rope.cos_sin(torch.tensor([0, 1, 2, 5, 17, 18, 40, 63, 3]))
    with fused(False):
        q = q_norm(qkv[:, : heads * d].reshape(t, heads, d)).view(t, heads * d)
        k = k_norm(qkv[:, heads * d: (heads + kv_heads) * d].reshape(t, kv_heads, d)).view(t, kv_heads * d)
        want_q, want_k = rope.rotate(cs, q, heads), rope.rotate(cs, k, kv_heads)
    got_q, got_k = kernel.norm_rope(qkv, *cs, heads, kv_heads, d, d, q_norm.weight, k_norm.weight, 1e-6, gemma=True)
    torch.testing.assert_close(got_q, want_q, **one_rounding(dtype))
    torch.testing.assert_close(got_k, want_k, **one_rounding(dtype))


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,inter", [(1, 2048), (5, 48)])
def test_gelu_tanh_and_mul_matches_torch(variant, dtype, rows, inter):
    kernel = cpu_fused.fused_kernel(variant)
    x = gated_input(rows, inter, dtype, [-100.0, 100.0, -60.0, 60.0, 0.0, -0.0])  # past exp's clamps, and zeros
    gate, up = x.chunk(2, dim=-1)
    want = F.gelu(gate, approximate="tanh") * up
    got = kernel.gelu_tanh_and_mul(x)
    torch.testing.assert_close(got, want, **one_rounding(dtype))
    # tanh differs from torch's in its last bits only: most elements are equal
    assert (got == want).float().mean() > (0.7 if dtype == torch.float32 else 0.9)
    if variant is None:
        assert torch.equal(GeluTanhAndMul()(x), got)


def _logits(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    with torch.inference_mode(), set_forward_context(None):
        return model.compute_logits(model(ids, torch.arange(ids.shape[0])))


@pytest.mark.parametrize("quantization", ["int8", "none"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_gemma_direct_layer_calls_give_the_module_paths_logits_exactly(dtype, quantization, tmp_path):
    """Gemma 3 binds every layer (sliding and global) to direct calls, quantized or not;
    the logits are bit for bit those of its module path, within a rounding step of the
    torch ops."""
    make_tiny_checkpoint("gemma3", str(tmp_path))
    model = get_model(ModelConfig(model=str(tmp_path), dtype=dtype, quantization=quantization), "cpu")
    g = torch.Generator().manual_seed(0)
    for norm in model.modules():  # HF initialises Gemma's norm weights to 0: give (1 + weight) a shape
        if isinstance(norm, GemmaRMSNorm):
            norm.weight.data = (torch.randn(norm.hidden_size, generator=g) * 0.3).to(norm.weight.dtype)
    ids = torch.arange(3, 40) * 7 % 500
    want = _logits(model, ids)
    layers = [m for m in model.modules() if isinstance(m, Gemma3DecoderLayer)]
    assert bind_direct_layers(model) == (3, 3) and all(layer.direct is not None for layer in layers)
    assert torch.equal(_logits(model, ids), want)
    with fused(False):
        reference = _logits(model, ids)
    assert torch.equal(want.argmax(-1), reference.argmax(-1))
    if dtype == "float32":
        torch.testing.assert_close(want, reference, atol=1e-4, rtol=1e-4)
