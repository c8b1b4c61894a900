"""Float checkpoints quantized at load (--quantization int8/int4): every linear, the
embedding and the (tied) head keep only packed blocks, and the logits stay close to the
float model's; the wrong method for a source is refused by name."""

from __future__ import annotations

import pytest
import torch

from pagedserve import LLM, SamplingParams
from pagedserve.config import ModelConfig
from pagedserve.layers.quantization import QuantizableLayer
from pagedserve.model_loader import get_model, load_model_config
from tests.models.models_helpers import our_logits

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


def build(path: str, quantization: str) -> torch.nn.Module:
    mc = ModelConfig(model=path, dtype="float32", quantization=quantization)
    load_model_config(mc, "cpu")
    return get_model(mc, "cpu")


@pytest.mark.parametrize("case", ["llama-linear-rope-bias", "qwen2-tied"])
# These tiny models' weights are wide random draws, so rounding shows: measured 6% (int8)
# and 39-45% (int4) of the largest logit, top-1 agreeing on 88-92% and 58-75% of tokens.
# A wrong layout or scale gives errors of order 100% and chance agreement (1/320).
@pytest.mark.parametrize("method, tol", [("int8", 0.12), ("int4", 0.7)])
def test_quantized_logits_stay_close(tiny_checkpoint, case: str, method: str, tol: float) -> None:
    path, _ = tiny_checkpoint(case)
    ids = torch.randint(0, 320, (24,), generator=torch.Generator().manual_seed(1))
    ref = our_logits(build(path, "none"), ids)
    model = build(path, method)
    layers = [m for m in model.modules() if isinstance(m, QuantizableLayer)]
    quantized = [m for m in layers if m.qweight is not None]
    assert quantized and all(m.weight.shape[1] == 0 for m in quantized)  # no float copy kept
    got = our_logits(model, ids)
    err = (got - ref).abs().max().item() / ref.abs().max().item()
    assert err < tol, err
    assert (got.argmax(-1) == ref.argmax(-1)).float().mean() >= (0.8 if method == "int8" else 0.4)


def test_gguf_method_needs_a_gguf(tiny_checkpoint) -> None:
    path, _ = tiny_checkpoint("llama")
    with pytest.raises(ValueError, match="quantization='gguf' needs a GGUF file"):
        build(path, "gguf")
    with pytest.raises(ValueError, match="quantization must be one of"):
        ModelConfig(model=path, quantization="fp4")
    with pytest.raises(ValueError, match="quant_activation_bits must be one of 16, 8"):
        ModelConfig(model=path, quant_activation_bits=4)
    with pytest.raises(ValueError, match="quant_activation_bits must be one of 16, 8"):  # (8.0 crashed in a kernel)
        ModelConfig(model=path, quant_activation_bits=8.0)


def test_8_bit_activations_without_quantized_layers_are_refused(tiny_checkpoint) -> None:
    """They did nothing, silently, on a float model (quantization 'none' or 'auto' there)."""
    path, _ = tiny_checkpoint("llama")
    for method in ("none", "auto"):
        mc = ModelConfig(model=path, dtype="float32", quantization=method, quant_activation_bits=8)
        load_model_config(mc, "cpu")
        with pytest.raises(ValueError, match="quant_activation_bits=8 applies to quantized linear layers"):
            get_model(mc, "cpu")


def test_the_disk_tier_keeps_blocks_of_other_activation_bits_apart(tiny_checkpoint, tmp_path) -> None:
    """8-bit activations compute other K/V: an engine with them read the blocks a 16-bit
    engine had left in the same directory and answered neither's tokens."""
    path, _ = tiny_checkpoint("llama")
    prompts = [{"prompt_token_ids": list(range(7 + i, 55 + i))} for i in range(4)]
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    common = dict(dtype="float32", quantization="int8", max_model_len=128, speculative_config="off")

    def run(**kw) -> list[list[int]]:
        llm = LLM(path, **common, **kw)
        try:
            return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        finally:
            llm.shutdown()

    run(kv_offload_dir=str(tmp_path))  # 16-bit activations leave their blocks
    assert run(kv_offload_dir=str(tmp_path), quant_activation_bits=8) == run(quant_activation_bits=8)


@pytest.mark.parametrize("bits", [16, 8])
def test_activation_bits_reach_every_quantized_layer(tiny_checkpoint, bits: int) -> None:
    """The config's activation bits are what each layer's kernel call uses, the tied head's too."""
    path, _ = tiny_checkpoint("qwen2-tied")
    mc = ModelConfig(model=path, dtype="float32", quantization="int4", quant_activation_bits=bits)
    load_model_config(mc, "cpu")
    model = get_model(mc, "cpu")
    quantized = [m.qweight for m in model.modules() if isinstance(m, QuantizableLayer) and m.qweight is not None]
    assert quantized and {q.activation_bits for q in quantized} == {bits}


def test_step_time_budget_keeps_greedy_outputs(tiny_checkpoint) -> None:
    """--max-step-ms changes how prompts are chunked, never what is generated."""
    path, _ = tiny_checkpoint("llama")
    prompts = [{"prompt_token_ids": list(range(5 + i, 60 + 3 * i))} for i in range(6)]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    ref = [o.outputs[0].token_ids for o in LLM(path, dtype="float32").generate(prompts, params, use_tqdm=False)]
    for overlap in (False, True):  # (under async scheduling no step time was recorded: the budget was the cap)
        llm = LLM(path, dtype="float32", max_step_ms=0.5, async_scheduling=overlap)  # tiny: steps are chunked
        got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        assert got == ref
        assert llm.llm_engine.scheduler.step_budget is not None and llm.llm_engine.scheduler.step_budget.cost()
