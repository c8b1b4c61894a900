"""Phi-3's LongRoPE against HF transformers over whole engine runs: a prompt longer than
the original context rotates every position with the long factors, as HF's forward over
that sequence does (positions below the context took the short ones, and every answer
past the context differed from HF's); a shorter one keeps the short factors; the two
kinds never share prefix-cache blocks."""

from __future__ import annotations

import torch

from pagedserve import LLM, SamplingParams
from tests.e2e.test_hf_parity import greedy_tops

ORIGINAL, STEPS = 64, 12


def _checkpoint(path: str) -> torch.nn.Module:
    import transformers

    rope = {"rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.75,
            "short_factor": [1.0 + 0.1 * i for i in range(6)], "long_factor": [2.0 + 0.5 * i for i in range(6)],
            "original_max_position_embeddings": ORIGINAL}
    cfg = transformers.Phi3Config(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                                  initializer_range=0.15, rope_parameters=rope, pad_token_id=0,
                                  original_max_position_embeddings=ORIGINAL)
    torch.manual_seed(0)
    model = transformers.Phi3ForCausalLM(cfg).eval()
    model.save_pretrained(path)
    return model


def _hf(model: torch.nn.Module, prompt: list[int]) -> list[int]:
    return greedy_tops(model, [prompt], STEPS, 1)[0][0]  # (HF's greedy tokens, no end token)


def test_long_prompts_rotate_with_the_long_factors_as_hf_does(tmp_path) -> None:
    hf = _checkpoint(str(tmp_path))
    g = torch.Generator().manual_seed(1)
    short = torch.randint(1, 512, (40,), generator=g).tolist()  # (40 + 12 < 64: short factors throughout)
    long = short + torch.randint(1, 512, (260,), generator=g).tolist()  # (its first 40 tokens: short's)
    sp = SamplingParams(temperature=0, max_tokens=STEPS, ignore_eos=True)
    llm = LLM(str(tmp_path), dtype="float32", seed=0, max_model_len=512)
    try:
        # the short prompt first: its blocks are cached, and the long prompt must not take them
        got = [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in (short, long)], sp,
                                                            use_tqdm=False)]
        again = llm.generate({"prompt_token_ids": long}, sp, use_tqdm=False)[0]
    finally:
        llm.shutdown()
    assert got == [_hf(hf, short), _hf(hf, long)]
    assert again.outputs[0].token_ids == got[1] and again.num_cached_tokens > 0  # (long prompts share theirs)


def test_a_longrope_draft_model_rotates_a_long_prompt_as_the_target_does(tmp_path) -> None:
    """The model as its own draft: every greedy draft is the target's token, so all are
    accepted, a long prompt's too (the draft rotated it with the short factors below the
    original context and had none accepted)."""
    _checkpoint(str(tmp_path))
    prompt = torch.randint(1, 512, (150,), generator=torch.Generator().manual_seed(1)).tolist()
    llm = LLM(str(tmp_path), dtype="float32", seed=0, max_model_len=512, enable_prefix_caching=False,
              speculative_config={"model": str(tmp_path), "num_speculative_tokens": 3})
    try:
        llm.generate({"prompt_token_ids": prompt}, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
                     use_tqdm=False)
        stats = llm.llm_engine.get_stats()
    finally:
        llm.shutdown()
    assert stats.spec_decode_num_draft_tokens > 0
    assert stats.spec_decode_num_accepted_tokens == stats.spec_decode_num_draft_tokens


def test_an_answer_that_outgrows_the_original_context_goes_on_as_hf_generate_does(tmp_path) -> None:
    """HF's generate drops the cache it rotated with the short factors once the sequence
    passes the original context, and computes it all again with the long ones; the
    engine kept the short keys below it (every token after the crossing differed).
    Greedy with the engine's defaults (n-gram drafts on) and with drafts cut at the
    crossing, a preempted resumption too (a cache of few blocks), and a cache hit after."""
    hf = _checkpoint(str(tmp_path))
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(1, 512, (40,), generator=g).tolist() for _ in range(2)]
    want = [greedy_tops(hf, [p], 30, 1)[0][0] for p in prompts]  # (40 + 30 tokens: they cross 64 at the 25th)
    sp = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    small = {"num_gpu_blocks_override": 8, "max_model_len": 96}
    for kw in ({}, {"speculative_config": "off"}, small, {**small, "preemption_mode": "swap"}):
        llm = LLM(str(tmp_path), dtype="float32", seed=0, **{"max_model_len": 512, **kw})
        try:
            outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
            again = llm.generate({"prompt_token_ids": prompts[0]}, sp, use_tqdm=False)[0]
            stats = llm.llm_engine.get_stats()
        finally:
            llm.shutdown()
        assert [o.outputs[0].token_ids for o in (*outs, again)] == [*want, want[0]], kw
        if "num_gpu_blocks_override" in kw:
            assert stats.num_preemptions > 0, "the small cache should preempt"
