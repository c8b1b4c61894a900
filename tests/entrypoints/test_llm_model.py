"""LLM end to end on a tiny random Llama saved by transformers (float32, CPU, seconds)."""

from __future__ import annotations

import os

import pytest
import torch

from pagedserve import LLM, SamplingParams
from tests.engine.helpers import make_tiny_llama


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> str:
    path = str(tmp_path_factory.mktemp("tiny-llama"))
    make_tiny_llama(path, vocab_size=400)
    return path


@pytest.fixture(scope="module")
def llm(tiny_dir) -> LLM:
    return LLM(tiny_dir, dtype="float32", max_model_len=256)


def test_greedy_matches_hf(llm, tiny_dir) -> None:
    from transformers import AutoModelForCausalLM

    prompts = [[5, 17, 33, 2 + k, 90] for k in range(3)] + [list(range(20, 60))]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)
    hf = AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32).eval()
    for p, o in zip(prompts, outs, strict=True):
        with torch.inference_mode():
            ref = hf.generate(torch.tensor([p]), max_new_tokens=8, min_new_tokens=8, do_sample=False,
                              pad_token_id=0)[0, len(p):].tolist()
        assert o.outputs[0].token_ids == ref


def test_text_chat_and_stop_strings(llm) -> None:
    tok = llm.get_tokenizer()
    [o] = llm.generate("hello world", SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
                       use_tqdm=False)
    c = o.outputs[0]
    assert o.prompt_token_ids == tok.encode("hello world")
    assert c.text == tok.decode(c.token_ids, skip_special_tokens=True)
    [chat] = llm.chat([{"role": "user", "content": "hi"}], SamplingParams(temperature=0, max_tokens=4),
                      use_tqdm=False)
    assert chat.prompt.endswith("<|im_start|>assistant\n")
    if len(c.text) > 4:
        stop = c.text[2:4]
        [s] = llm.generate("hello world", SamplingParams(temperature=0, max_tokens=12, ignore_eos=True,
                                                         stop=stop), use_tqdm=False)
        assert s.outputs[0].finish_reason == "stop" and s.outputs[0].stop_reason == stop
        assert s.outputs[0].text == c.text[: c.text.index(stop)]


def test_seeded_sampling_is_reproducible(llm) -> None:
    prompts = [{"prompt_token_ids": [7, 8, 9 + k]} for k in range(4)]
    params = [SamplingParams(temperature=1.0, top_p=0.9, seed=100 + k, max_tokens=16, ignore_eos=True)
              for k in range(4)]
    a = llm.generate(prompts, params, use_tqdm=False)
    b = llm.generate(prompts[::-1], params[::-1], use_tqdm=False)[::-1]  # other batch order
    assert [o.outputs[0].token_ids for o in a] == [o.outputs[0].token_ids for o in b]
    c = llm.generate(prompts[:1], SamplingParams(temperature=1.0, seed=5, max_tokens=16, ignore_eos=True),
                     use_tqdm=False)
    assert c[0].outputs[0].token_ids != a[0].outputs[0].token_ids


def test_n_samples_share_the_prompt_blocks(llm) -> None:
    prompt = {"prompt_token_ids": list(range(30, 30 + 48))}
    [o] = llm.generate(prompt, SamplingParams(n=3, temperature=1.0, seed=1, max_tokens=8, ignore_eos=True),
                       use_tqdm=False)
    assert [c.index for c in o.outputs] == [0, 1, 2]
    assert len({tuple(c.token_ids) for c in o.outputs}) > 1  # seed + index: distinct samples
    stats = llm.llm_engine.get_stats()
    assert stats.prefix_cache_hits > 0 and stats.kv_cache_usage == 0.0


def test_logprobs_shape(llm) -> None:
    [o] = llm.generate({"prompt_token_ids": [3, 4, 5]}, SamplingParams(temperature=0, max_tokens=5, logprobs=3),
                       use_tqdm=False)
    c = o.outputs[0]
    assert len(c.logprobs) == 5
    for tid, d in zip(c.token_ids, c.logprobs, strict=True):
        assert tid in d and d[tid].rank == 1 and len(d) == 3
        assert sorted(lp.rank for lp in d.values()) == [1, 2, 3]
        assert all(isinstance(lp.decoded_token, str) for lp in d.values())
    assert c.cumulative_logprob == pytest.approx(sum(d[t].logprob for t, d in zip(c.token_ids, c.logprobs,
                                                                                 strict=True)))


def test_dummy_weights_take_token_ids_only(tiny_dir, tmp_path) -> None:
    bare = tmp_path / "bare"
    bare.mkdir()
    (bare / "config.json").write_text(open(os.path.join(tiny_dir, "config.json")).read())
    llm = LLM(str(bare), load_format="dummy", dtype="float32", max_model_len=128)
    assert llm.get_tokenizer() is None
    [o] = llm.generate({"prompt_token_ids": [1, 2, 3]}, SamplingParams(max_tokens=4, ignore_eos=True),
                       use_tqdm=False)
    assert len(o.outputs[0].token_ids) == 4 and o.outputs[0].text == ""
    with pytest.raises(ValueError, match="no tokenizer"):
        llm.generate("hello", use_tqdm=False)


def test_bad_models_are_clear_errors(tmp_path, tiny_dir) -> None:
    with pytest.raises(ValueError, match="unknown model"):
        LLM("no-such-model-xyz")
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text(open(os.path.join(tiny_dir, "config.json")).read())
    (broken / "model.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(ValueError, match="safetensors"):
        LLM(str(broken))
    with pytest.raises(ValueError, match="max_model_len"):
        LLM(tiny_dir, max_model_len=10**6)


@pytest.mark.parametrize("overlap", [False, True])
def test_nan_logits_fail_one_request_and_the_engine_goes_on(tiny_dir, overlap) -> None:
    llm = LLM(tiny_dir, dtype="float32", max_model_len=128, async_scheduling=overlap)
    model = llm.llm_engine.model_executor.model
    compute_logits = model.compute_logits

    def nan_in_row_0(hidden):
        logits = compute_logits(hidden)
        logits[0] = float("nan")  # the first request of every step (what a broken kernel could do)
        return logits

    model.compute_logits = nan_in_row_0
    params = [SamplingParams(temperature=0, max_tokens=6, ignore_eos=True),
              SamplingParams(temperature=0.8, seed=1, max_tokens=6, ignore_eos=True)]
    outs = llm.generate([{"prompt_token_ids": [5, 6, 7]}, {"prompt_token_ids": [8, 9]}], params, use_tqdm=False)
    assert outs[0].outputs[0].finish_reason == "error" and outs[0].outputs[0].token_ids == []
    # The second request moved to row 0 once the first failed, so it fails a step later.
    assert outs[1].outputs[0].finish_reason == "error"
    model.compute_logits = compute_logits
    [ok] = llm.generate({"prompt_token_ids": [5, 6, 7]}, params[0], use_tqdm=False)
    assert ok.outputs[0].finish_reason == "length" and len(ok.outputs[0].token_ids) == 6
    assert llm.llm_engine.get_stats().kv_cache_usage == 0


@pytest.mark.parametrize("budget,rows", [(None, 512), (8, 512), (None, 3)])
def test_prompt_logprobs_match_hf(tiny_dir, budget, rows, monkeypatch) -> None:
    """Every prompt token's logprob as HF computes it, also when the prompt is prefilled in
    chunks of 8 (and with the prompt already in the prefix cache: it must be recomputed),
    and when the runner scores the prompt 3 positions per logits pass (its memory bound)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from pagedserve.worker import step_outputs

    monkeypatch.setattr(step_outputs, "PROMPT_LOGPROBS_BLOCK_BYTES", rows * 4 * AutoConfig.from_pretrained(
        tiny_dir).vocab_size)
    kw = {"max_num_batched_tokens": budget, "long_prefill_token_threshold": 8} if budget else {}
    llm = LLM(tiny_dir, dtype="float32", max_model_len=128, **kw)
    prompt = [5, 17, 33, 2, 90, 41, 7, 7, 19, 250, 3, 64, 8, 11, 12, 13, 99, 2, 45]
    llm.generate({"prompt_token_ids": prompt}, SamplingParams(max_tokens=1), use_tqdm=False)  # cache it
    [out] = llm.generate({"prompt_token_ids": prompt}, SamplingParams(max_tokens=2, prompt_logprobs=3),
                         use_tqdm=False)
    hf = AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32).eval()
    with torch.inference_mode():
        ref = hf(torch.tensor([prompt])).logits[0].log_softmax(-1)
    plp = out.prompt_logprobs
    assert len(plp) == len(prompt) and plp[0] is None
    for pos in range(1, len(prompt)):
        entry = plp[pos]
        tok = prompt[pos]
        assert entry[tok].logprob == pytest.approx(ref[pos - 1, tok].item(), abs=1e-4)
        assert entry[tok].rank == int((ref[pos - 1] > ref[pos - 1, tok]).sum()) + 1
        top = ref[pos - 1].topk(3).indices.tolist()
        assert set(top) <= set(entry) and len(entry) <= 4


def test_prompt_logprobs_with_n_samples_score_the_prompt_once(tiny_dir) -> None:
    """n samples share one prompt scoring: the first sample computes it, the others read
    its cached blocks (each recomputed every position and its top-k: n times the work)."""
    prompt = {"prompt_token_ids": [5, 17, 33, 2, 90, 41, 7, 7, 19, 250, 3, 64, 8, 11, 12, 13, 99, 2, 45]}
    alone = LLM(tiny_dir, dtype="float32", max_model_len=128).generate(
        prompt, SamplingParams(max_tokens=2, prompt_logprobs=2), use_tqdm=False)[0]
    llm = LLM(tiny_dir, dtype="float32", max_model_len=128, max_num_batched_tokens=8, long_prefill_token_threshold=8)
    [out] = llm.generate(prompt, SamplingParams(n=3, temperature=1.0, seed=0, max_tokens=2, prompt_logprobs=2),
                         use_tqdm=False)
    assert len(out.outputs) == 3 and out.num_cached_tokens == 16  # (a later sample read the first one's block)
    assert [None if d is None else {t: round(lp.logprob, 4) for t, lp in d.items()} for d in out.prompt_logprobs] == \
        [None if d is None else {t: round(lp.logprob, 4) for t, lp in d.items()} for d in alone.prompt_logprobs]


def test_generation_config_gives_the_defaults(tiny_dir, tmp_path) -> None:
    import json
    import shutil

    model = tmp_path / "with-defaults"
    shutil.copytree(tiny_dir, model)
    (model / "generation_config.json").write_text(json.dumps({"temperature": 0.25, "top_k": 7, "top_p": 0.8,
                                                               "eos_token_id": [2]}))
    llm = LLM(str(model), dtype="float32", max_model_len=128)
    d = llm.get_default_sampling_params()
    assert (d.temperature, d.top_k, d.top_p) == (0.25, 7, 0.8)
    plain = LLM(str(model), dtype="float32", max_model_len=128, generation_config="vllm")
    d = plain.get_default_sampling_params()
    assert (d.temperature, d.top_k, d.top_p) == (1.0, 0, 1.0)


def test_vllm_spellings_of_llm_arguments_and_prompts(tiny_dir, llm) -> None:
    """What scripts written for vLLM pass: `task` (its runner), `seed=None` (a random
    engine seed) and `quantization=None` ("auto"); TokensPrompt / TextPrompt dicts;
    LLM.reset_prefix_cache."""
    from pagedserve import TextPrompt, TokensPrompt
    from pagedserve.engine.arg_utils import EngineArgs

    assert EngineArgs.from_kwargs(task="embed").runner == "pooling"
    assert EngineArgs.from_kwargs(task="generate", quantization=None).quantization == "auto"
    assert isinstance(EngineArgs.from_kwargs(seed=None).seed, int)
    with pytest.raises(ValueError, match="task must be one of"):
        EngineArgs.from_kwargs(task="transcription")
    with pytest.raises(ValueError, match="runner='generate' was given"):
        EngineArgs.from_kwargs(task="embed", runner="generate")
    # vLLM's other arguments, as its example scripts pass them: each is this engine's
    # field of that meaning, dropped where it asks for nothing, else refused by name.
    args = EngineArgs.from_kwargs(structured_outputs_config={"backend": "xgrammar"}, compilation_config=0,
                                  swap_space=2, preemption_mode="swap", disable_log_stats=True, tokenizer_mode="auto",
                                  revision=None, distributed_executor_backend="mp", tensor_parallel_size=1,
                                  cpu_offload_gb=0.0)
    assert (args.structured_outputs_backend, args.torch_compile, args.preemption_mode, args.kv_offload_bytes) == (
        "xgrammar", False, "swap", 2 * 2**30)
    # (vLLM's default swap_space, 4, asks for no swapping: vLLM v1 swaps nothing)
    assert EngineArgs.from_kwargs(swap_space=4) == EngineArgs()
    # (level 3 is vLLM v1's default, -O3: this engine's default; 1 and 2 compile)
    assert EngineArgs.from_kwargs(compilation_config={"level": 3}).torch_compile is None
    assert EngineArgs.from_kwargs(compilation_config=2).torch_compile is True
    assert EngineArgs.from_kwargs(revision="main") == EngineArgs()  # (the revision a local copy is)
    assert EngineArgs.from_kwargs(guided_decoding_backend="guidance").structured_outputs_backend == "guidance"
    for kwargs, match in [({"revision": "v2.0"}, "revision='v2.0' is not supported here: models come from local"),
                          ({"tokenizer_mode": "slow"}, "tokenizer_mode='slow'"),
                          ({"compilation_config": {"level": 3, "cudagraph_capture_sizes": [1]}}, "a level 0-3"),
                          ({"distributed_executor_backend": "ray"}, "Ray runs data_parallel_size's"),
                          ({"structured_outputs_config": {"backend": "xgrammar", "disable_any_whitespace": True}},
                           "takes a backend alone"),
                          ({"swap_space": -1}, "swap_space must be"),
                          # (inf raised OverflowError from int(), nan an unnamed error)
                          ({"swap_space": float("inf"), "preemption_mode": "swap"}, "swap_space must be a finite"),
                          ({"swap_space": float("nan"), "preemption_mode": "swap"}, "swap_space must be a finite")]:
        with pytest.raises(ValueError, match=match):
            EngineArgs.from_kwargs(**kwargs)
    sp = SamplingParams(max_tokens=4, temperature=0)
    a, b = llm.generate([TokensPrompt(prompt_token_ids=[5, 6, 7]), TextPrompt(prompt="hello")], sp, use_tqdm=False)
    assert a.prompt_token_ids == [5, 6, 7] and b.prompt == "hello"
    llm.generate([{"prompt_token_ids": list(range(20, 60))}], sp, use_tqdm=False)
    assert llm.reset_prefix_cache() is True


def test_truncate_prompt_tokens_keeps_the_prompts_last_tokens(llm) -> None:
    """vLLM's SamplingParams.truncate_prompt_tokens: the prompt's last N tokens run (the
    answer is the one that prompt alone gets); -1 is as many as fit; past max_model_len, refused."""
    prompt = list(range(20, 90))
    greedy = {"max_tokens": 4, "temperature": 0}
    [cut] = llm.generate([prompt], SamplingParams(truncate_prompt_tokens=8, **greedy), use_tqdm=False)
    [alone] = llm.generate([prompt[-8:]], SamplingParams(**greedy), use_tqdm=False)
    assert cut.prompt_token_ids == prompt[-8:] and cut.outputs[0].token_ids == alone.outputs[0].token_ids
    [whole] = llm.generate([prompt], SamplingParams(truncate_prompt_tokens=-1, **greedy), use_tqdm=False)
    assert whole.prompt_token_ids == prompt
    with pytest.raises(ValueError, match="truncate_prompt_tokens must be -1 or within 1..max_model_len"):
        llm.generate([prompt], SamplingParams(truncate_prompt_tokens=10_000, **greedy), use_tqdm=False)
    # -1 on a prompt past the context: as much as fits with room for max_tokens (cut to
    # max_model_len, it was refused for leaving none)
    long = list(range(20, 320))
    [fit] = llm.generate([long], SamplingParams(truncate_prompt_tokens=-1, **greedy), use_tqdm=False)
    assert fit.prompt_token_ids == long[-252:] and len(fit.outputs[0].token_ids) == 4
    # Text longer than 256 tokens can spell is tokenized, then cut (it was refused untokenized)
    chars = llm.llm_engine.input_processor.max_prompt_chars
    text = "hello world " * (chars // 12 + 10)
    with pytest.raises(ValueError, match="characters, more than the"):
        llm.generate([text], SamplingParams(**greedy), use_tqdm=False)
    [tail] = llm.generate([text], SamplingParams(truncate_prompt_tokens=8, **greedy), use_tqdm=False)
    assert len(tail.prompt_token_ids) == 8 and tail.prompt == text  # the caller's text, as vLLM's
    assert tail.prompt_token_ids == llm.get_tokenizer().encode(text[-400:], add_special_tokens=False)[-8:]
    # and a chat of it: rendered, then cut (it was refused by the rendered text's characters)
    [chat] = llm.chat([{"role": "user", "content": text}], SamplingParams(truncate_prompt_tokens=8, **greedy),
                      use_tqdm=False)
    assert len(chat.prompt_token_ids) == 8
    # with tools, whether the template renders them is read from the text, not the (cut) ids:
    # the check applied the character bound and refused the conversation
    template = "{% for m in messages %}{{ m['content'] }}{% endfor %}{% if tools %}[tools]{% endif %}"
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    [chat] = llm.chat([{"role": "user", "content": text}], SamplingParams(truncate_prompt_tokens=8, **greedy),
                      use_tqdm=False, chat_template=template, tools=[tool])
    assert len(chat.prompt_token_ids) == 8


@pytest.mark.parametrize("kwargs", [{"max_num_batched_tokens": 10**12}, {"max_num_seqs": 10**12},
                                    {"kv_cache_memory_bytes": 10**15}])
def test_sizes_memory_cannot_hold_are_a_clear_error(tiny_dir, kwargs) -> None:
    """A size no memory holds: one error naming the settings (numpy's MemoryError or
    mmap's OSError came as a traceback that said nothing of which one)."""
    with pytest.raises(ValueError, match="do not fit in memory .*lower max_num_seqs, max_num_batched_tokens"):
        LLM(tiny_dir, dtype="float32", max_model_len=128, **kwargs)


def test_detokenize_false_returns_the_same_tokens_without_text(llm) -> None:
    """vLLM's detokenize=False (it was refused): the same token ids, text "", logprobs
    without decoded tokens; stop strings, matched in the text, are refused with it."""
    greedy = {"max_tokens": 6, "temperature": 0, "logprobs": 2, "prompt_logprobs": 1}
    [text] = llm.generate(["The capital of France is"], SamplingParams(**greedy), use_tqdm=False)
    [ids] = llm.generate(["The capital of France is"], SamplingParams(detokenize=False, **greedy), use_tqdm=False)
    assert ids.outputs[0].token_ids == text.outputs[0].token_ids and text.outputs[0].text
    assert ids.outputs[0].text == "" and ids.prompt == "The capital of France is"
    assert all(lp.decoded_token is None for d in ids.outputs[0].logprobs for lp in d.values())
    assert all(lp.decoded_token is None for d in ids.prompt_logprobs[1:] for lp in d.values())
    assert any(lp.decoded_token for d in text.prompt_logprobs[1:] for lp in d.values())
    assert [{t: lp.logprob for t, lp in d.items()} for d in ids.outputs[0].logprobs] == \
        [{t: lp.logprob for t, lp in d.items()} for d in text.outputs[0].logprobs]
    with pytest.raises(ValueError, match="stop strings need detokenize=True"):
        SamplingParams(detokenize=False, stop=["."])


def test_delta_outputs_carry_the_prompts_logprobs_once(llm) -> None:
    """Under RequestOutputKind.DELTA (the engine's, and AsyncLLM.generate's cut of
    cumulative outputs) the prompt's logprobs come with the first output alone, as
    vLLM's; every delta repeated them."""
    from pagedserve.outputs import DeltaCursor
    from pagedserve.sampling_params import RequestOutputKind

    engine = llm.llm_engine
    params = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True, prompt_logprobs=1)
    # (the params' own output_kind, when add_request is given none)
    engine.add_request("delta-pl", [1, 2, 3, 4], SamplingParams(
        max_tokens=5, temperature=0, ignore_eos=True, prompt_logprobs=1, output_kind=RequestOutputKind.DELTA))
    engine.add_request("cumulative-pl", [1, 2, 3, 4], params)
    deltas, cumulative = [], []
    while engine.has_unfinished_requests():
        for out in engine.step():
            (deltas if out.request_id == "delta-pl" else cumulative).append(out)
    assert len(deltas) > 1 and deltas[0].prompt_logprobs is not None
    assert all(d.prompt_logprobs is None for d in deltas[1:])
    cursors: dict[int, DeltaCursor] = {}
    cut = [c.delta(cursors) for c in cumulative]
    assert cut[0].prompt_logprobs == cumulative[0].prompt_logprobs and all(c.prompt_logprobs is None for c in cut[1:])
    assert [t for c in cut for t in c.outputs[0].token_ids] == [t for d in deltas for t in d.outputs[0].token_ids]


def test_swap_space_without_swap_preemption_is_named_once(monkeypatch, caplog) -> None:
    """--swap-space sizes swap preemption's host memory: given without
    --preemption-mode swap it was dropped in silence (the docs promise a warning for a
    flag given without the feature it adjusts); once however often the flags are read."""
    import logging

    from pagedserve.engine import arg_spellings
    from pagedserve.engine.arg_utils import EngineArgs

    monkeypatch.setattr(arg_spellings, "_warned", set())
    with caplog.at_level(logging.WARNING, logger="pagedserve"):
        EngineArgs.from_kwargs(swap_space=0)
        EngineArgs.from_kwargs(swap_space=2, preemption_mode="swap")
        assert "swap_space" not in caplog.text
        EngineArgs.from_kwargs(swap_space=4)
        EngineArgs.from_kwargs(swap_space=4)
    assert caplog.text.count("swap_space (--swap-space) has no effect without preemption_mode='swap'") == 1
