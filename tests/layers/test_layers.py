"""Layer building blocks: fused norm, RoPE variants, and shard-aware weight loaders."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from pagedserve.layers import embedding, linear
from pagedserve.layers.activation import SiluAndMul
from pagedserve.layers.layernorm import RMSNorm
from pagedserve.layers.rotary_embedding import attention_factor, get_rope, inv_freq, rope_config


def test_rmsnorm_fused_residual_equals_add_then_norm() -> None:
    norm = RMSNorm(16, eps=1e-5)
    norm.weight.data.uniform_(0.5, 1.5)
    x, r = torch.randn(3, 16), torch.randn(3, 16)
    out, new_residual = norm(x, r)
    torch.testing.assert_close(new_residual, x + r, rtol=0, atol=0)
    torch.testing.assert_close(out, norm(x + r), rtol=0, atol=0)
    expected = (x + r) / torch.sqrt(((x + r) ** 2).mean(-1, keepdim=True) + 1e-5) * norm.weight
    torch.testing.assert_close(out, expected)


def test_silu_and_mul_gates_with_first_half() -> None:
    x = torch.randn(2, 8)
    torch.testing.assert_close(SiluAndMul()(x), torch.nn.functional.silu(x[:, :4]) * x[:, 4:])


@pytest.mark.parametrize("scaling", [
    {"rope_type": "linear", "factor": 4.0},
    {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
     "original_max_position_embeddings": 64},
    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 2048},  # Qwen2.5 / Qwen3's
    {"rope_type": "yarn", "factor": 40.0, "original_max_position_embeddings": 4096, "beta_fast": 32, "beta_slow": 1,
     "mscale": 1.0, "mscale_all_dim": 0.8},  # DeepSeek's two mscales
    {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 512, "attention_factor": 1.3,
     "truncate": False},
])
def test_scaled_inv_freq_matches_transformers(scaling: dict) -> None:
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    cfg = LlamaConfig(hidden_size=256, num_attention_heads=4, rope_theta=500000.0, max_position_embeddings=8192,
                      rope_scaling=dict(scaling))
    ref, ref_factor = ROPE_INIT_FUNCTIONS[scaling["rope_type"]](cfg, "cpu")
    theta, params = rope_config(cfg)
    ours = inv_freq(64, theta, params)
    torch.testing.assert_close(ours, ref, rtol=0, atol=0)
    assert not torch.equal(ours, inv_freq(64, theta, {"rope_type": "default"}))
    assert attention_factor(params) == pytest.approx(ref_factor, rel=1e-12)
    if scaling["rope_type"] == "yarn":
        assert attention_factor(params) != 1.0


def test_longrope_rotates_with_short_factors_then_long_ones_past_the_original_context() -> None:
    from transformers import Phi3Config
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    rope = {"rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.75,
            "short_factor": [1.0 + 0.1 * i for i in range(12)], "long_factor": [3.0 + 0.5 * i for i in range(12)],
            "original_max_position_embeddings": 64}
    cfg = Phi3Config(hidden_size=128, num_attention_heads=4, max_position_embeddings=512, rope_parameters=rope,
                     original_max_position_embeddings=64, pad_token_id=0)
    short, factor = ROPE_INIT_FUNCTIONS["longrope"](cfg, "cpu")
    long, _ = ROPE_INIT_FUNCTIONS["longrope"](cfg, "cpu", seq_len=65)
    assert factor == pytest.approx(math.sqrt(1 + math.log(8) / math.log(64)))
    with torch.device("cpu"):
        emb = get_rope(cfg, head_dim=32, max_position=512, partial=True)
    assert emb.rotary_dim == 24
    for pos, freq in ((0, short), (63, short), (64, long), (511, long)):
        angle = pos * freq.double()
        want = torch.cat([angle.cos(), angle.sin()]) * factor
        torch.testing.assert_close(emb.cos_sin_cache[pos].double(), want, atol=1e-5, rtol=1e-5)


def test_yarn_without_a_factor_stretches_to_max_position_embeddings() -> None:
    cfg = SimpleNamespace(rope_theta=1e6, max_position_embeddings=131072,
                          rope_scaling={"type": "yarn", "original_max_position_embeddings": 32768})
    _, params = rope_config(cfg)
    assert params["factor"] == 4.0 and params["rope_type"] == "yarn"
    with pytest.raises(ValueError, match="yarn.*original_max_position_embeddings"):
        rope_config(SimpleNamespace(rope_theta=1e6, rope_scaling={"type": "yarn", "factor": 4.0}))


def test_rope_rotates_halves_and_keeps_norm() -> None:
    cfg = SimpleNamespace(rope_theta=10000.0, rope_scaling=None)
    rope = get_rope(cfg, head_dim=8, max_position=32)
    q, k = torch.randn(5, 2 * 8), torch.randn(5, 8)
    pos = torch.tensor([0, 1, 2, 30, 31])
    q2, k2 = rope(pos, q, k)
    assert q2.shape == q.shape and k2.shape == k.shape
    torch.testing.assert_close(q2[0], q[0])  # position 0: identity
    torch.testing.assert_close(q2.view(5, 2, 8).norm(dim=-1), q.view(5, 2, 8).norm(dim=-1))
    # dims i and i + 4 rotate together by angle pos * theta^(-2i/8)
    angle = 31 * 10000.0 ** (-2 * 1 / 8)
    x1, x2 = k[4, 1], k[4, 5]
    expected = torch.tensor([x1 * torch.cos(torch.tensor(angle)) - x2 * torch.sin(torch.tensor(angle)),
                             x2 * torch.cos(torch.tensor(angle)) + x1 * torch.sin(torch.tensor(angle))])
    torch.testing.assert_close(torch.stack([k2[4, 1], k2[4, 5]]), expected, atol=1e-5, rtol=1e-5)


def test_unsupported_rope_type_is_named() -> None:
    cfg = SimpleNamespace(rope_scaling={"rope_type": "dynamic", "factor": 4.0}, rope_theta=1e4)
    with pytest.raises(ValueError, match="unsupported rope_scaling type 'dynamic'; supported: .*yarn"):
        get_rope(cfg, head_dim=8, max_position=16)


@pytest.fixture
def tp(monkeypatch):
    """Pretend to be rank `rank` of `size` tensor-parallel ranks while layers are built."""

    def set_rank(rank: int, size: int) -> None:
        monkeypatch.setattr(linear, "get_tp_rank_size", lambda: (rank, size))
        monkeypatch.setattr(embedding, "get_tp_rank_size", lambda: (rank, size))

    return set_rank


def _rows(n: int, cols: int = 3) -> torch.Tensor:
    return torch.arange(n * cols, dtype=torch.float32).view(n, cols)


def test_qkv_loader_takes_this_ranks_heads(tp) -> None:
    tp(1, 2)
    layer = linear.QKVParallelLinear(3, head_dim=2, total_num_heads=4, total_num_kv_heads=2, bias=True)
    assert (layer.num_heads, layer.num_kv_heads) == (2, 1)
    q, k, v = _rows(8), _rows(4) + 100, _rows(4) + 200
    for shard, w in (("q", q), ("k", k), ("v", v)):
        layer.weight.weight_loader(layer.weight, w, shard)
        layer.bias.weight_loader(layer.bias, w[:, 0], shard)
    torch.testing.assert_close(layer.weight.data, torch.cat([q[4:8], k[2:4], v[2:4]]))
    torch.testing.assert_close(layer.bias.data, torch.cat([q[4:8, 0], k[2:4, 0], v[2:4, 0]]))


def test_qkv_loader_replicates_kv_heads_when_ranks_outnumber_them(tp) -> None:
    tp(3, 4)
    layer = linear.QKVParallelLinear(3, head_dim=2, total_num_heads=4, total_num_kv_heads=2)
    k = _rows(4)
    layer.weight.weight_loader(layer.weight, k, "k")
    torch.testing.assert_close(layer.weight.data[2:4], k[2:4])  # ranks 2, 3 hold kv head 1


def test_merged_row_and_embedding_loaders_shard(tp) -> None:
    tp(1, 2)
    merged = linear.MergedColumnParallelLinear(3, [4, 6])
    gate, up = _rows(4), _rows(6) + 50
    merged.weight.weight_loader(merged.weight, gate, 0)
    merged.weight.weight_loader(merged.weight, up, 1)
    torch.testing.assert_close(merged.weight.data, torch.cat([gate[2:4], up[3:6]]))
    row = linear.RowParallelLinear(4, 3)
    w = _rows(3, 4)
    row.weight.weight_loader(row.weight, w)
    torch.testing.assert_close(row.weight.data, w[:, 2:4])
    emb = embedding.VocabParallelEmbedding(6, 3)
    emb.weight.weight_loader(emb.weight, _rows(6))
    torch.testing.assert_close(emb.weight.data, _rows(6)[3:6])


def test_loader_shape_mismatch_is_a_value_error() -> None:
    layer = linear.QKVParallelLinear(8, head_dim=2, total_num_heads=4, total_num_kv_heads=2)
    with pytest.raises(ValueError, match=r"shard k.*\(4, 8\).*\(6, 8\)"):
        layer.weight.weight_loader(layer.weight, torch.zeros(6, 8), "k")
    with pytest.raises(ValueError, match="got 'x'"):
        layer.weight.weight_loader(layer.weight, torch.zeros(4, 8), "x")
    row = linear.RowParallelLinear(4, 3)
    with pytest.raises(ValueError, match="shape mismatch"):
        row.weight.weight_loader(row.weight, torch.zeros(3, 5))


def test_lm_head_settles_16_bit_ties_with_exact_top_logits() -> None:
    """Two tokens whose bf16 logits round to the same value: the exact (float32) winner
    is the argmax, the top logits are float32-exact, and the rest are the bf16 values."""
    torch.manual_seed(0)
    head = embedding.ParallelLMHead(64, 16)
    w = torch.randn(64, 16) * 0.1
    hidden = torch.zeros(2, 16)
    hidden[:, :2] = 1.0
    w[:, 0] = -1.0
    # Weights exact in bf16; the logits 25.140625 and 25.171875 both round to 25.125.
    w[5, :2] = torch.tensor([25.0, 9 / 64])
    w[9, :2] = torch.tensor([25.0, 11 / 64])
    head.weight.data.copy_(w)
    head = head.to(torch.bfloat16)
    h = hidden.to(torch.bfloat16)
    plain = torch.nn.functional.linear(h, head.weight).float()
    assert plain[0, 5] == plain[0, 9] and plain[0].argmax() == 5  # the tie, lower id first
    logits = head.compute_logits(h)
    exact = h.float() @ head.weight.float().T
    assert logits.dtype == torch.float32 and int(logits[0].argmax()) == 9
    top = exact[0].topk(embedding.EXACT_TOP).indices
    torch.testing.assert_close(logits[:, top], exact[:, top], atol=1e-6, rtol=1e-6)
    rest = torch.ones(64, dtype=torch.bool)
    rest[top] = False
    assert torch.equal(logits[:, rest], plain[:, rest])
    # float32 models are left exactly as computed.
    head32 = embedding.ParallelLMHead(64, 16)
    head32.weight.data.copy_(w)
    assert torch.equal(head32.compute_logits(hidden), hidden @ w.T)


def test_lm_head_rows_do_not_depend_on_how_many_rows_there_are() -> None:
    """A row's logits are the same computed alone or among others (greedy choices must not
    change with the batch; speculative decoding's verified rows must match one-token steps)."""
    torch.manual_seed(0)
    head = embedding.ParallelLMHead(2048, 576).to(torch.bfloat16)
    head.weight.data.normal_()
    hidden = torch.randn(12, 576).to(torch.bfloat16)
    with torch.inference_mode():
        full = head.compute_logits(hidden)
        for m in (1, 2, 3, 5):
            assert torch.equal(head.compute_logits(hidden[:m]), full[:m]), m


def test_tensor_parallel_lm_head_settles_16_bit_ties_like_one_rank(tp, monkeypatch) -> None:
    """Two tokens whose bf16 logits tie (25.125) but whose exact ones differ (25.078 and
    25.156), on different ranks: one rank recomputes its top tokens in float32 and picks
    the larger; split over two ranks, each rank settles its own slice's top tokens before
    the driver gathers them, so the choice is the same (it was the lower id, 3)."""
    vocab, dim = 64, 16
    weight = torch.full((vocab, dim), 0.01)
    weight[3] = weight[40] = 1.5625
    weight[3, 0], weight[40, 0] = 1.640625, 1.71875  # row sums 25.078125 and 25.15625
    hidden = torch.ones(1, dim, dtype=torch.bfloat16)

    def head(rank: int, size: int) -> embedding.ParallelLMHead:
        tp(rank, size)
        h = embedding.ParallelLMHead(vocab, dim)
        h.weight.weight_loader(h.weight, weight)
        return h.to(torch.bfloat16)

    one = head(0, 1)
    raw = one._linear(hidden, one.weight, None).float()
    assert raw[0, 3] == raw[0, 40] == 25.125  # the tie this test is about
    alone = head(0, 1).compute_logits(hidden)
    monkeypatch.setattr(embedding, "gather_to_driver", lambda x, rank, size: x)  # each rank's slice
    split = torch.cat([head(r, 2).compute_logits(hidden) for r in range(2)], dim=-1)
    assert int(alone.argmax()) == int(split.argmax()) == 40
    torch.testing.assert_close(split[0, [3, 40]], alone[0, [3, 40]])
