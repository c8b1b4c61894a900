"""The torch.compile'd model (worker/compiled_model.py) against the eager one, through
the whole engine: the same greedy tokens and logprobs in float32, across steps of every
shape (prefills of different lengths, chunked prefill, single-token and batched
decodes), with one graph compiled at start-up and never again: checked through dynamo
with its guards, which is what lets the default run the compiled bytecode without them."""

from __future__ import annotations

import pytest

from pagedserve import LLM, SamplingParams
from pagedserve.worker.compiled_model import CompiledModel
from tests.e2e.token_prompts import shared_prefix_prompts
from tests.lazy_module import LazyModule

dynamo_utils = LazyModule("torch._dynamo.utils")


def greedy(llm: LLM, prompts: list[list[int]], max_tokens: int = 24):
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, logprobs=3)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [(list(o.outputs[0].token_ids), [{t: lp.logprob for t, lp in d.items()} for d in o.outputs[0].logprobs])
            for o in outs]


# int8: quantized linears build their kernel arguments on first use, state dynamo guards on.
# Dense Qwen3 is not among them: its graph is qwen3_moe's second layer (the q/k norms and a
# dense MLP, mlp_only_layers), and each case here compiles twice (~15 s each on a cold Zen 3).
@pytest.mark.parametrize("arch, quantization", [("llama", "auto"), ("qwen3_moe", "auto"), ("llama", "int8")])
def test_compiled_matches_eager_and_compiles_once(arch, quantization, tiny_checkpoint, monkeypatch):
    model_dir, cfg = tiny_checkpoint(arch)
    prompts = shared_prefix_prompts(cfg.vocab_size)
    # Quantized layers round activations to 16-bit codes per block: where the compiled and
    # eager inputs differ in their last bit a code can flip, moving an output by up to
    # 1/65534 of its block's largest activation (measured: logprobs 1.3e-4 apart).
    tol = 1e-4 if quantization == "auto" else 5e-4
    eager = LLM(model_dir, dtype="float32", quantization=quantization, torch_compile=False,
                max_num_batched_tokens=48)
    assert eager.llm_engine.model_executor.compiled is None
    want_batch, want_one = greedy(eager, prompts), greedy(eager, prompts[:1])
    del eager

    # The default (no argument, no PAGEDSERVE_TORCH_COMPILE) compiles on CPU only a model
    # whose layers cannot all run direct kernel calls (the mixture of experts here): the
    # others are asked.
    monkeypatch.delenv("PAGEDSERVE_TORCH_COMPILE", raising=False)
    compile_arg = {} if arch == "qwen3_moe" else {"torch_compile": True}
    # Guarded, then guard-free, then guard-free again: the second guard-free engine loads the
    # compilation the first saved (or one an earlier run saved) and must give the same.
    for i, skip_guards in enumerate((False, True, True)):
        monkeypatch.setattr(CompiledModel, "skip_guards", skip_guards)
        llm = LLM(model_dir, dtype="float32", quantization=quantization, max_num_batched_tokens=48,  # chunked
                  **compile_arg)
        compiled = llm.llm_engine.model_executor.compiled
        assert compiled is not None and compiled.guard_free is skip_guards
        if i == 0:
            assert compiled.loaded_from is None  # the guarded path always traces
        if i == 2:
            assert compiled.loaded_from is not None, "the saved compilation did not load"
        graphs = dynamo_utils.counters["stats"]["unique_graphs"]
        got_batch, got_one = greedy(llm, prompts), greedy(llm, prompts[:1])  # the latter decodes 1 token/step
        assert dynamo_utils.counters["stats"]["unique_graphs"] == graphs, "a step shape recompiled the model"
        for want, got in ((want_batch, got_batch), (want_one, got_one)):
            for (wt, wl), (gt, gl) in zip(want, got, strict=True):
                assert gt == wt
                for a, b in zip(wl, gl, strict=True):
                    diff = max(abs(a[t] - b[t]) for t in a)
                    assert a.keys() == b.keys() and diff < tol, diff
        del llm
