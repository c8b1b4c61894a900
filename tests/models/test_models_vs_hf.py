"""Our models reproduce HF transformers' logits for a whole prompt, per architecture variant."""

from __future__ import annotations

import pytest
import torch

from pagedserve.config import ModelConfig
from pagedserve.model_loader import get_model
from tests.models.models_helpers import TINY_CASES, hf_logits, our_logits


@pytest.mark.parametrize("case", sorted(TINY_CASES))
def test_float32_logits_match_hf(case: str, tiny_checkpoint) -> None:
    path, hf = tiny_checkpoint(case)
    model = get_model(ModelConfig(model=path, dtype="float32"), "cpu")
    ids = torch.randint(0, hf.config.vocab_size, (50,), generator=torch.Generator().manual_seed(1))
    ours, ref = our_logits(model, ids), hf_logits(hf, ids)
    assert ours.dtype == torch.float32 and ours.shape == (50, hf.config.vocab_size)
    torch.testing.assert_close(ours, ref, atol=2e-5, rtol=1e-5)


def test_tied_embeddings_share_one_tensor(tiny_checkpoint) -> None:
    path, _ = tiny_checkpoint("qwen2-tied")
    model = get_model(ModelConfig(model=path, dtype="float32"), "cpu")
    assert model.lm_head.weight is model.model.embed_tokens.weight


def test_bfloat16_close_to_hf_bfloat16(tiny_checkpoint) -> None:
    """The default CPU dtype: same rounding points as HF, so logits stay within bf16 noise."""
    path, hf = tiny_checkpoint("llama3-rope-tied")
    model = get_model(ModelConfig(model=path, dtype="bfloat16"), "cpu")
    assert model.lm_head.weight.dtype == torch.bfloat16
    ids = torch.randint(0, hf.config.vocab_size, (40,), generator=torch.Generator().manual_seed(2))
    ours, ref = our_logits(model, ids), hf_logits(hf.to(torch.bfloat16), ids)
    assert (ours - ref).abs().max() < 0.05 * ref.abs().max()
    assert (ours.argmax(-1) == ref.argmax(-1)).float().mean() > 0.9
