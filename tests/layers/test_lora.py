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


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
@pytest.mark.parametrize("path", ["kernel", "masked"])
def test_a_non_finite_adapter_stays_in_its_own_rows(path, bad) -> None:
    """An adapter whose A holds a NaN or an infinity (refused at load, lora/peft.py; an
    activation that overflows a float16 product does the same at run time) in a batch
    with the base model and another adapter: only its own rows are non-finite.  The
    masked path multiplied by the mask, and inf * 0 or NaN * 0 is NaN, which the second
    product then added to every row of the batch."""
    kernel = lora_kernel() if path == "kernel" else None
    assert path == "masked" or kernel is not None
    gen = torch.Generator().manual_seed(0)
    good = (torch.randn(4, 40, generator=gen) / 40 ** 0.5, torch.randn(72, 4, generator=gen) / 2)
    poisoned = (torch.randn(8, 40, generator=gen), torch.randn(72, 8, generator=gen))
    poisoned[0][3, 5] = bad
    batch, clean_batch = LoRABatch(kernel), LoRABatch(kernel)
    layer, clean = LinearLoRA(batch, num_slots=3), LinearLoRA(clean_batch, num_slots=3)
    layer.slots = {1: poisoned, 2: good}
    clean.slots = {2: good}
    layer.pack()
    clean.pack()
    slots = torch.tensor([0, 1, 2, 0, 2, 1, 0])
    batch.token_slots = clean_batch.token_slots = slots
    x = torch.randn(7, 40, generator=gen)
    y = torch.randn(7, 72, generator=gen)
    out, expected = layer.apply(x, y.clone()), clean.apply(x, y.clone())
    assert not out[slots == 1].isfinite().all()  # its own rows show it (the engine then fails that request)
    assert torch.equal(out[slots == 0], y[slots == 0])  # the base model's rows, untouched
    torch.testing.assert_close(out[slots == 2], expected[slots == 2], atol=1e-5, rtol=1e-5)
