"""LinearLoRA: the CPU kernel (one adapter's product per row) equals the dense masked
products, for any mix of slots, in float32 and bfloat16."""

from __future__ import annotations

import pytest
import torch

from pagedserve.layers.lora import LinearLoRA, LoRABatch
from pagedserve.lora.manager import lora_kernel


@pytest.mark.parametrize("dtype, atol", [(torch.float32, 1e-4), (torch.bfloat16, 0.05)])
@pytest.mark.parametrize("rows", [1, 7, 300])
def test_the_kernel_equals_the_masked_products(dtype, atol, rows) -> None:
    kernel = lora_kernel()
    assert kernel is not None, "the LoRA kernel must build on a machine that builds the other kernels"
    gen = torch.Generator().manual_seed(rows)
    fast, dense = LoRABatch(kernel), LoRABatch(None)
    layers = [LinearLoRA(b, num_slots=5) for b in (fast, dense)]
    ranks = {1: 8, 3: 24, 4: 4}  # slot 2 is resident elsewhere but does not adapt this layer
    for s, r in ranks.items():
        a = (torch.randn(r, 40, generator=gen) / 40 ** 0.5).to(dtype)
        b = (torch.randn(72, r, generator=gen) / r ** 0.5).to(dtype)
        for layer in layers:
            layer.slots[s] = (a, b)
    for layer in layers:
        layer.pack()
    slots = torch.randint(0, 5, (rows,), generator=gen)
    x = torch.randn(rows, 40, generator=gen).to(dtype)
    y = torch.randn(rows, 72, generator=gen).to(dtype)
    outs = []
    for batch, layer in zip((fast, dense), layers, strict=True):
        batch.token_slots = slots
        outs.append(layer.apply(x, y.clone()))
    torch.testing.assert_close(outs[0].float(), outs[1].float(), atol=atol, rtol=0.02)
    untouched = (slots == 0) | (slots == 2)
    assert torch.equal(outs[0][untouched], y[untouched])  # the base model's rows, and a slot without this layer
    fast.token_slots = None
    assert torch.equal(layers[0].apply(x, y.clone()), y)  # a step without adapters
