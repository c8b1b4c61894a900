"""The fused Triton kernels (layers/triton_fused.py) against the torch ops they replace.

Like test_triton_backend.py: without a GPU and with triton not yet imported, this
module sets TRITON_INTERPRET=1 and runs the kernels interpreted on CPU tensors (the
CI case); where triton is already compiled in this process, the interpreter suite runs
in a fresh python process.  The interpreter has no bf16, so the CPU cases use float32
and float16; on a GPU the same checks run compiled in bf16 as well.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

if "triton" not in sys.modules and not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"
pytest.importorskip("triton", reason="triton is not installed (pip install triton)")

from pagedserve.attention.triton_kernels import language_interpreted  # noqa: E402
from pagedserve.config import ModelConfig  # noqa: E402
from pagedserve.forward_context import set_forward_context  # noqa: E402
from pagedserve.layers import fused_ops, triton_fused  # noqa: E402
from pagedserve.layers.activation import SiluAndMul  # noqa: E402
from pagedserve.layers.layernorm import RMSNorm, rms_normalize  # noqa: E402
from pagedserve.layers.rotary_embedding import RotaryEmbedding  # noqa: E402
from pagedserve.model_loader.loader import get_model  # noqa: E402
from tests.e2e.conftest import make_tiny_checkpoint  # noqa: E402
from tests.layers.fused_helpers import fused  # noqa: E402

INTERPRETED = language_interpreted()
DEVICE = "cpu" if INTERPRETED else "cuda"
DTYPES = [torch.float32, torch.float16] if INTERPRETED else [torch.float32, torch.float16, torch.bfloat16]
runs_here = pytest.mark.skipif(not INTERPRETED and not torch.cuda.is_available(),
                               reason="triton is compiled in this process: test_interpreter_suite_in_fresh_process runs these")


def _close(dtype: torch.dtype) -> dict:
    """One rounding step of the dtype: the kernels sum a row's squares in another order."""
    return {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.float16: dict(atol=2e-3, rtol=2e-3),
            torch.bfloat16: dict(atol=1.6e-2, rtol=1.6e-2)}[dtype]


@runs_here
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,n", [(1, 64), (7, 96), (33, 1024)])
def test_rms_norm_matches_torch(dtype, rows, n):
    g = torch.Generator().manual_seed(rows * n)
    norm = RMSNorm(n, eps=1e-6).to(DEVICE, dtype)
    norm.weight.data = (torch.rand(n, generator=g) + 0.5).to(DEVICE, dtype)
    x = (torch.randn(rows, n, generator=g) * 3).to(DEVICE, dtype)
    res = torch.randn(rows, n, generator=g).to(DEVICE, dtype)
    with torch.inference_mode():
        want, want_res = _norm_torch(norm, x), x + res
        want2 = _norm_torch(norm, want_res)
        got = triton_fused.rms_norm(x, norm.weight, norm.eps)
        got2, got_res = triton_fused.rms_norm(x, norm.weight, norm.eps, res)
    torch.testing.assert_close(got, want, **_close(dtype))
    torch.testing.assert_close(got2, want2, **_close(dtype))
    torch.testing.assert_close(got_res, want_res, atol=0, rtol=0)  # the add rounds once, as torch's does
    empty = triton_fused.rms_norm(x[:0], norm.weight, norm.eps, res[:0])
    assert empty[0].shape == (0, n) and empty[1].shape == (0, n)


def _norm_torch(norm: RMSNorm, x: torch.Tensor) -> torch.Tensor:
    """RMSNorm's torch ops (what it runs on the CPU)."""
    return norm.weight * rms_normalize(x, norm.eps).to(x.dtype)


@runs_here
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("qk_norm", [False, True])
@pytest.mark.parametrize("head_dim,rotary_dim", [(64, 64), (16, 12)])
def test_norm_rope_matches_rotate_qk(dtype, qk_norm, head_dim, rotary_dim):
    """Qwen3's q/k RMSNorm + rotary and Llama's rotary alone, full and partial (Phi-3's
    3/4) rotation, over a strided slice of a wider projection."""
    g = torch.Generator().manual_seed(head_dim + qk_norm)
    heads, kv_heads, t = 4, 2, 9
    rope = RotaryEmbedding(head_dim, rotary_dim, max_position=64, theta=10000.0).to(DEVICE, dtype)
    rope.cos_sin_cache = rope.cos_sin_cache.to(dtype)
    norms = None
    if qk_norm:
        norms = (RMSNorm(head_dim).to(DEVICE, dtype), RMSNorm(head_dim).to(DEVICE, dtype))
        for n in norms:
            n.weight.data = (torch.rand(head_dim, generator=g) + 0.5).to(DEVICE, dtype)
    width = (heads + 2 * kv_heads) * head_dim
    wide = torch.randn(t, width + 24, generator=g).to(DEVICE, dtype)
    qkv = wide[:, 8: 8 + width]  # rows strided, as a view of something wider
    positions = torch.tensor([0, 1, 2, 5, 17, 18, 40, 63, 3], device=DEVICE)
    with torch.inference_mode():
        cs = rope.cos_sin(positions)
        with fused(False):
            want_q, want_k = rope.rotate_qk(cs, qkv, heads, kv_heads, norms)
        with fused(True):
            got_q, got_k = rope.rotate_qk(cs, qkv, heads, kv_heads, norms)
    assert got_q.shape == (t, heads, head_dim) and got_k.shape == (t, kv_heads, head_dim)
    # Interpreted, rotary alone rounds exactly as torch does; compiled, the GPU may fuse a
    # product into the add (an FMA), one rounding fewer.
    tol = dict(atol=0, rtol=0) if INTERPRETED and not qk_norm else _close(dtype)
    torch.testing.assert_close(got_q, want_q, **tol)
    torch.testing.assert_close(got_k, want_k, **tol)


@runs_here
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,inter", [(1, 48), (5, 1500)])
def test_silu_and_mul_matches_torch(dtype, rows, inter):
    g = torch.Generator().manual_seed(inter)
    x = (torch.randn(rows, 2 * inter, generator=g) * 4).to(DEVICE, dtype)
    want = _silu_mul_torch(x)
    got = triton_fused.silu_and_mul(x)
    if DEVICE == "cpu":
        with fused(False):
            torch.testing.assert_close(SiluAndMul()(x), want, atol=0, rtol=0)  # the layer's torch ops
    torch.testing.assert_close(got, want, **_close(dtype))
    assert triton_fused.silu_and_mul(x[:0]).shape == (0, inter)


def _silu_mul_torch(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up


@runs_here
@pytest.mark.parametrize("arch", ["qwen3", "llama", "phi3", "qwen3_moe"])
def test_model_forward_fused_matches_unfused(arch, tmp_path):
    """The models' own forward with the kernels in place of the torch ops: Qwen3's q/k
    norm, Llama 3's scaled rope, Phi-3's partial rotary, the experts' gated MLPs.  (Mistral
    calls Llama's kernels: its sliding window is the attention op's.)"""
    make_tiny_checkpoint(arch, str(tmp_path))
    dtype = torch.float32
    model = get_model(ModelConfig(model=str(tmp_path), dtype="float32"), DEVICE)
    ids = torch.arange(3, 40, device=DEVICE) * 7 % 500
    positions = torch.arange(ids.shape[0], device=DEVICE)

    def logits() -> torch.Tensor:
        with torch.inference_mode(), set_forward_context(None):
            return model.compute_logits(model(ids, positions))

    with fused(False):
        want = logits()
    with fused(True):
        got = logits()
    torch.testing.assert_close(got, want, **_close(dtype))
    assert torch.equal(got.argmax(-1), want.argmax(-1))


def test_triton_kernels_apply_to_cuda_tensors_unless_overridden():
    # CPU tensors take the C++ kernels (layers/cpu_fused.py) or, float64, the torch ops
    assert fused_ops.kernels_for(torch.zeros(2, dtype=torch.float64)) is None
    with fused(True):
        assert fused_ops.kernels_for(torch.zeros(2)) is triton_fused
    if torch.cuda.is_available():
        assert fused_ops.kernels_for(torch.zeros(2, device="cuda")) is triton_fused
        with fused(False):
            assert fused_ops.kernels_for(torch.zeros(2, device="cuda")) is None


@pytest.mark.skipif(INTERPRETED or torch.cuda.is_available(), reason="the interpreter suite runs in this process")
def test_interpreter_suite_in_fresh_process():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"} | {
        "TRITON_INTERPRET": "1", "CUDA_VISIBLE_DEVICES": ""}
    root = Path(__file__).resolve().parents[2]
    res = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", str(Path(__file__))],
                         capture_output=True, text=True, timeout=600, cwd=root, env=env)
    assert res.returncode == 0, res.stdout[-6000:] + res.stderr[-2000:]
