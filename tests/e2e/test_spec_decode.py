"""Speculative decoding (n-gram and a draft model) through the real engine: greedy
outputs are token for token those of decoding one token at a time, in every
configuration that changes how the work is cut, and every run really drafted and
accepted something (else the comparison would prove nothing)."""

from __future__ import annotations

import re

import pytest

from pagedserve import LLM, SamplingParams
from tests.e2e.test_hf_parity import ENGINE_VARIANTS, kv_bytes_for_blocks
from tests.e2e.token_prompts import shared_prefix_prompts

MAX_TOKENS = 48
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "disable_by_batch_size": 64}


def prompts_for(vocab: int) -> list[list[int]]:
    """The parity prompts, plus prompts that repeat a run (something to copy from)."""
    base = shared_prefix_prompts(vocab)
    return base + [p[:12] * 3 for p in base[:4]]


def greedy(llm: LLM, prompts: list[list[int]], **params) -> list[list[int]]:
    sp = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, **params)
    return [list(o.outputs[0].token_ids) for o in llm.generate([{"prompt_token_ids": p} for p in prompts], sp,
                                                                use_tqdm=False)]


def assert_drafted(llm: LLM, name: str) -> None:
    stats = llm.llm_engine.get_stats()
    assert stats.spec_decode_num_drafts > 0 and stats.spec_decode_num_accepted_tokens > 0, (name, stats)


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_greedy_identical_with_speculation_on_and_off(arch: str, tiny_checkpoint) -> None:
    model_dir, hf_cfg = tiny_checkpoint(arch)
    prompts = prompts_for(hf_cfg.vocab_size)
    variants = {name: ENGINE_VARIANTS[name] for name in ("default", "no-prefix-caching", "chunked-16", "batch-1")}
    longest = max(len(p) for p in prompts) + MAX_TOKENS
    blocks = -(-longest // 16) + 2
    variants["preemption"] = {"max_model_len": longest,
                              "kv_cache_memory_bytes": kv_bytes_for_blocks(hf_cfg, blocks + 1, 16)}
    for name, kw in variants.items():
        off = greedy(LLM(model_dir, dtype="float32", seed=0, **kw), prompts)
        llm = LLM(model_dir, dtype="float32", seed=0, speculative_config=NGRAM, **kw)
        assert greedy(llm, prompts) == off, name
        assert_drafted(llm, name)
        if name == "preemption":
            assert llm.llm_engine.get_stats().num_preemptions > 0, "the small KV cache should force preemptions"

    # Batch of 32, all in flight together (drafting at any batch size here).
    many = prompts * 3
    off = greedy(LLM(model_dir, dtype="float32", max_num_seqs=32), many[:32])
    llm = LLM(model_dir, dtype="float32", max_num_seqs=32, speculative_config=NGRAM)
    assert greedy(llm, many[:32]) == off
    assert_drafted(llm, "batch-32")


@pytest.fixture(scope="module")
def drafts_for_llama(tiny_checkpoint, tmp_path_factory) -> dict[str, str]:
    """Draft models for the tiny llama: itself (every draft accepted) and the same
    architecture with smaller weights (about a quarter accepted)."""
    from tests.e2e.conftest import make_tiny_checkpoint

    target, _ = tiny_checkpoint("llama")
    partial = str(tmp_path_factory.mktemp("draft-partial"))
    make_tiny_checkpoint("llama", partial, initializer_range=0.12)
    return {"self": target, "partial": partial}


def test_greedy_identical_with_a_draft_model(tiny_checkpoint, drafts_for_llama) -> None:
    model_dir, hf_cfg = tiny_checkpoint("llama")
    prompts = prompts_for(hf_cfg.vocab_size)
    longest = max(len(p) for p in prompts) + MAX_TOKENS
    variants = {name: ENGINE_VARIANTS[name] for name in ("default", "no-prefix-caching", "chunked-16", "batch-1")}
    variants["preemption"] = {"max_model_len": longest,
                              "kv_cache_memory_bytes": kv_bytes_for_blocks(hf_cfg, -(-longest // 16) + 3, 16)}
    off = {name: greedy(LLM(model_dir, dtype="float32", seed=0, **kw), prompts) for name, kw in variants.items()}
    for draft, names in (("self", ["default"]), ("partial", list(variants))):
        spec = {"model": drafts_for_llama[draft], "num_speculative_tokens": 4, "disable_by_batch_size": 64}
        for name in names:
            llm = LLM(model_dir, dtype="float32", seed=0, speculative_config=spec, **variants[name])
            assert greedy(llm, prompts) == off[name], (draft, name)
            assert_drafted(llm, f"draft model {draft}, {name}")
            stats = llm.llm_engine.get_stats()
            if draft == "self":
                assert stats.spec_decode_num_accepted_tokens == stats.spec_decode_num_draft_tokens, stats
            else:
                assert stats.spec_decode_num_accepted_tokens < stats.spec_decode_num_draft_tokens, stats
            if name == "preemption":
                assert stats.num_preemptions > 0, "the small KV cache should force preemptions"
    # 32 in flight, all drafting together in the draft model's batches.
    many = (prompts * 3)[:32]
    spec = {"model": drafts_for_llama["partial"], "num_speculative_tokens": 4, "disable_by_batch_size": 32}
    llm = LLM(model_dir, dtype="float32", max_num_seqs=32, speculative_config=spec)
    assert greedy(llm, many) == greedy(LLM(model_dir, dtype="float32", max_num_seqs=32), many)
    assert_drafted(llm, "draft model, batch 32")


def test_a_draft_model_of_a_shorter_context_drafts_within_it(tiny_checkpoint, tmp_path) -> None:
    """It was refused ("max_model_len=512 exceeds the model's limit of 64"): past its own
    context the target goes on alone, with the same tokens."""
    from tests.e2e.conftest import make_tiny_checkpoint

    model_dir, hf_cfg = tiny_checkpoint("llama")
    short = str(tmp_path / "short-draft")
    make_tiny_checkpoint("llama", short, max_position_embeddings=64)
    prompts = prompts_for(hf_cfg.vocab_size)
    assert min(len(p) for p in prompts) < 64 < max(len(p) for p in prompts) + MAX_TOKENS
    spec = {"model": short, "num_speculative_tokens": 4, "disable_by_batch_size": 64}
    llm = LLM(model_dir, dtype="float32", speculative_config=spec)
    assert greedy(llm, prompts) == greedy(LLM(model_dir, dtype="float32"), prompts)
    assert_drafted(llm, "a draft of 64 tokens' context")


def test_draft_model_refusals(tiny_checkpoint, tmp_path) -> None:
    from tests.e2e.conftest import make_tiny_checkpoint

    model_dir, _ = tiny_checkpoint("llama")
    other_vocab = str(tmp_path / "vocab-256")
    make_tiny_checkpoint("llama", other_vocab, vocab_size=256)
    with pytest.raises(ValueError, match=r"speculative_config.model .*vocabulary has 256 tokens, the target's 512"):
        LLM(model_dir, dtype="float32", speculative_config={"model": other_vocab})
    # the same size, another map (it said "its vocabulary (512 tokens) is not the target's (512 tokens)")
    import json
    import shutil

    from tests.engine.helpers import make_tiny_llama

    target, other_map = str(tmp_path / "with-tokenizer"), str(tmp_path / "other-map")
    make_tiny_llama(target)
    shutil.copytree(target, other_map)
    with open(f"{other_map}/tokenizer.json") as f:
        spec = json.load(f)
    vocab = spec["model"]["vocab"]
    a, b = sorted(vocab, key=vocab.get)[100:102]
    vocab[a], vocab[b] = vocab[b], vocab[a]
    with open(f"{other_map}/tokenizer.json", "w") as f:
        json.dump(spec, f)
    with pytest.raises(ValueError, match="its tokenizer maps tokens to other ids than the target's"):
        LLM(target, dtype="float32", speculative_config={"model": other_map})
    with pytest.raises(ValueError, match="speculative_config.model '/no/such/draft'"):
        LLM(model_dir, dtype="float32", speculative_config={"model": "/no/such/draft"})
    with pytest.raises(ValueError, match="speculative_config.model: a draft model does not run under tensor"):
        LLM(model_dir, dtype="float32", speculative_config={"model": model_dir}, tensor_parallel_size=2)
    with pytest.raises(ValueError, match="method 'draft_model' needs the draft model"):
        LLM(model_dir, dtype="float32", speculative_config={"method": "draft_model"})
    with pytest.raises(ValueError, match="speculative_config.model is for method 'draft_model'"):
        LLM(model_dir, dtype="float32", speculative_config={"method": "ngram", "model": model_dir})


def test_stops_and_limits_inside_an_accepted_run(tiny_checkpoint) -> None:
    """max_tokens, a stop token id and EOS that fall inside a run of accepted drafts end
    the output at the same token as without speculation; logprobs cover every token."""
    model_dir, hf_cfg = tiny_checkpoint("llama")
    prompts = prompts_for(hf_cfg.vocab_size)
    off_llm = LLM(model_dir, dtype="float32", seed=0)
    on_llm = LLM(model_dir, dtype="float32", seed=0, speculative_config=NGRAM)
    ref = greedy(off_llm, prompts)
    # A token each output produces somewhere after its first few: the stop lands mid-step.
    stop_id = next(t for out in ref for t in out[5:] if t not in out[:5])
    for params in ({"max_tokens": 7}, {"max_tokens": 13}, {"stop_token_ids": [stop_id]}):
        sp = {**params}
        max_tokens = sp.pop("max_tokens", MAX_TOKENS)
        want = [list(o.outputs[0].token_ids) for o in off_llm.generate(
            [{"prompt_token_ids": p} for p in prompts],
            SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **sp), use_tqdm=False)]
        got_outs = on_llm.generate([{"prompt_token_ids": p} for p in prompts],
                                   SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True,
                                                  logprobs=1, **sp), use_tqdm=False)
        got = [list(o.outputs[0].token_ids) for o in got_outs]
        assert got == want, params
        for o in got_outs:
            c = o.outputs[0]
            assert len(c.logprobs) == len(c.token_ids)
            assert all(t in d for t, d in zip(c.token_ids, c.logprobs, strict=True))
    assert_drafted(on_llm, "stops")


def test_stop_string_inside_an_accepted_run(tmp_path) -> None:
    """A stop string completed by a token in the middle of a step's accepted drafts cuts
    the text and the token ids where one token at a time does."""
    from tests.engine.helpers import make_tiny_llama

    make_tiny_llama(str(tmp_path))
    off_llm = LLM(str(tmp_path), dtype="float32", seed=0)
    on_llm = LLM(str(tmp_path), dtype="float32", seed=0, speculative_config=NGRAM)
    # This prompt's greedy output repeats one token ("laz") four times: a 2-gram the
    # drafts hit from the third on, and a stop string the fourth completes inside a step.
    prompt = "hello world hello world hello"
    full = off_llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True),
                            use_tqdm=False)[0].outputs[0]
    stop = " laz laz laz laz"
    assert stop in full.text, full.text
    sp = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, stop=[stop])
    want = off_llm.generate([prompt], sp, use_tqdm=False)[0].outputs[0]
    got = on_llm.generate([prompt], sp, use_tqdm=False)[0].outputs[0]
    assert (got.text, list(got.token_ids), got.finish_reason) == (want.text, list(want.token_ids), "stop")
    assert_drafted(on_llm, "stop string")


def test_refused_with_async_scheduling_and_bad_config(tiny_checkpoint) -> None:
    model_dir, _ = tiny_checkpoint("llama")
    with pytest.raises(ValueError, match="async_scheduling"):
        LLM(model_dir, dtype="float32", speculative_config=NGRAM, async_scheduling=True)
    with pytest.raises(ValueError, match="speculative_config.num_speculative_tokens"):
        LLM(model_dir, dtype="float32", speculative_config={"method": "ngram", "num_speculative_tokens": 0})
    with pytest.raises(ValueError, match="must be a JSON object"):
        LLM(model_dir, dtype="float32", speculative_config="{ngram")


def test_default_model_greedy_identical_one_at_a_time_and_batched(smollm2_path) -> None:
    """The default model as it runs by default (quantized; bf16 where the CPU has it):
    edit-code requests, where most drafts are accepted, one alone and three at once; n-gram
    drafts, and the model drafting for itself (a draft model that agrees)."""
    from pagedserve.benchmarks.workloads import edit_code

    convs = edit_code().conversations[:3]
    sp = SamplingParams(temperature=0.0, max_tokens=24)  # (64 tokens, 4 requests and two alone: 63 s of the suite)
    results = {}
    for name, spec in (("off", None), ("ngram", {"method": "ngram", "num_speculative_tokens": 8}),
                       ("self-draft", {"model": "smollm2-135m-instruct", "num_speculative_tokens": 4})):
        llm = LLM("smollm2-135m-instruct", speculative_config=spec)
        prompts = [llm.llm_engine.encode_chat(c) for c in convs]
        alone = [list(llm.generate([p], sp, use_tqdm=False)[0].outputs[0].token_ids) for p in prompts[:1]]
        together = [list(o.outputs[0].token_ids) for o in llm.generate(prompts, sp, use_tqdm=False)]
        results[name] = (alone, together)
        if spec:
            assert_drafted(llm, "default model")
            stats = llm.llm_engine.get_stats()
            # The model drafting for itself disagrees only where its prefill and decode
            # paths round a near-tie differently.
            share = 0.9 if name == "self-draft" else 0.5
            assert stats.spec_decode_num_accepted_tokens > share * stats.spec_decode_num_draft_tokens, stats
        del llm
    assert results["ngram"] == results["off"]
    assert results["self-draft"] == results["off"]


def test_sampled_and_parallel_sequences_run_with_speculation(tiny_checkpoint) -> None:
    """n > 1 at temperature > 0 (low, so the tiny model repeats itself): every child drafts and verifies on its own, and each ends
    at exactly max_tokens (EOS ignored); a seeded request gives the same text twice, and the
    same text as without speculation (each position uses the draw one token at a time would,
    whether its draft was accepted or not)."""
    model_dir, hf_cfg = tiny_checkpoint("llama")
    prompts = [{"prompt_token_ids": p[:12] * 3} for p in shared_prefix_prompts(hf_cfg.vocab_size)[:4]]
    llm = LLM(model_dir, dtype="float32", seed=0, speculative_config=NGRAM)
    sp = SamplingParams(temperature=0.1, n=3, max_tokens=MAX_TOKENS, ignore_eos=True, seed=7)

    def tokens(engine: LLM) -> list[list[list[int]]]:
        return [[list(c.token_ids) for c in o.outputs] for o in engine.generate(prompts, sp, use_tqdm=False)]

    first = tokens(llm)
    assert all(len(c) == MAX_TOKENS for o in first for c in o)
    assert all(len(o) == 3 for o in first)
    stats = llm.llm_engine.get_stats()
    assert 0 < stats.spec_decode_num_accepted_tokens < stats.spec_decode_num_draft_tokens, stats  # both verdicts
    assert tokens(llm) == first
    assert tokens(LLM(model_dir, dtype="float32", seed=0)) == first


def test_a_constrained_request_beside_drafting_ones_gets_its_own_mask(tmp_path) -> None:
    """A request with a grammar decodes one token a step while others verify drafts in the
    same step: its bitmask must land on its own row of the sampled logits."""
    from pagedserve.sampling_params import StructuredOutputsParams
    from tests.engine.helpers import make_tiny_llama

    make_tiny_llama(str(tmp_path))
    llm = LLM(str(tmp_path), dtype="float32", seed=0, speculative_config=NGRAM)
    # This prompt's output soon repeats itself (see the stop-string test): drafts come
    # while the constrained request is still decoding.
    repeats = ["hello world hello world hello"] * 3
    constrained = SamplingParams(temperature=0.0, max_tokens=60,
                                 structured_outputs=StructuredOutputsParams(regex="[a-z ]{50}"))
    free = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outs = llm.generate([*repeats, "Say hello:"], [free] * 3 + [constrained], use_tqdm=False)
    out = outs[-1].outputs[0]
    assert out.finish_reason == "stop" and re.fullmatch("[a-z ]{50}", out.text), (out.text, out.finish_reason)
    assert_drafted(llm, "beside a grammar")


def test_sampled_distribution_unchanged_through_the_engine(tmp_path) -> None:
    """Temperature 1 on a tiny 64-token model, one draft per step, and the second sampled
    token goes through verification: with n-gram drafts (the prompt holds every token
    once, so after the first sampled token t1 the draft is the token that followed t1 in
    the prompt) and with a draft model (the model itself, whose greedy draft after t1 is
    the target's most likely token).  Over 5,000 sequences each, the first and second
    tokens' distributions must match 5,000 without speculation (two-sample chi-square,
    p = 0.001), and so must how often the second token is the draft."""
    import random

    from tests.e2e.conftest import make_tiny_checkpoint

    vocab = 64
    make_tiny_checkpoint("llama", str(tmp_path), vocab_size=vocab, initializer_range=0.05)
    order = list(range(vocab))
    random.Random(0).shuffle(order)
    prompt = {"prompt_token_ids": order}
    n = 5_000  # a wrong accept or residual rule moves the draft-hit count by ~2x: far past p = 0.001 here
    sp = SamplingParams(temperature=1.0, max_tokens=3, ignore_eos=True)  # (the last token never has drafts)
    engine = {"dtype": "float32", "max_num_seqs": 256, "max_model_len": 128}
    # The draft after each first token t1, per method.
    greedy_next = LLM(str(tmp_path), **engine).generate(
        [{"prompt_token_ids": [*order, t]} for t in range(vocab)],
        SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True), use_tqdm=False)
    follow = {"ngram": dict(zip(order, order[1:], strict=False)),
              "draft_model": {t: o.outputs[0].token_ids[0] for t, o in zip(range(vocab), greedy_next, strict=True)}}
    counts, hits = {}, {}
    methods = {"off": None,
               "ngram": {"method": "ngram", "num_speculative_tokens": 1, "prompt_lookup_min": 1,
                         "disable_by_batch_size": 256},
               "draft_model": {"model": str(tmp_path), "num_speculative_tokens": 1, "disable_by_batch_size": 256}}
    for seed, (name, spec) in enumerate(methods.items()):
        llm = LLM(str(tmp_path), seed=seed, speculative_config=spec, **engine)
        outs = llm.generate([prompt] * n, sp, use_tqdm=False)
        tokens = [o.outputs[0].token_ids for o in outs]
        counts[name] = [[sum(1 for t in tokens if t[pos] == v) for v in range(vocab)] for pos in (0, 1)]
        # How often the second token is the draft itself: the statistic a wrong accept or
        # residual rule moves most (a residual that kept the draft about doubles it).
        hits[name] = {m: sum(1 for t in tokens if t[0] in f and t[1] == f[t[0]]) for m, f in follow.items()}
        if spec:
            stats = llm.llm_engine.get_stats()
            assert stats.spec_decode_num_drafts >= 0.99 * n, stats  # (t1 is in the prompt unless it is its last)
            assert 0 < stats.spec_decode_num_accepted_tokens < stats.spec_decode_num_draft_tokens, stats
    for name in ("ngram", "draft_model"):
        for pos in (0, 1):
            a, b = counts["off"][pos], counts[name][pos]
            # Bins with few draws are pooled so every expected count is at least 5.
            bins, pool_a, pool_b = [], 0, 0
            for x, y in zip(a, b, strict=True):
                if x + y >= 20:
                    bins.append((x, y))
                else:
                    pool_a, pool_b = pool_a + x, pool_b + y
            if pool_a + pool_b:
                bins.append((pool_a, pool_b))
            chi2 = sum((x - y) ** 2 / (x + y) for x, y in bins)  # equal sample sizes
            df = len(bins) - 1
            # Wilson-Hilferty approximation of the chi-square 0.999 quantile.
            crit = df * (1 - 2 / (9 * df) + 3.09 * (2 / (9 * df)) ** 0.5) ** 3
            assert chi2 < crit, (name, pos, chi2, crit, df)
        x, y = hits["off"][name], hits[name][name]
        assert (x - y) ** 2 / (x + y) < 10.83, (name, hits)  # chi-square, 1 degree of freedom, p = 0.001
