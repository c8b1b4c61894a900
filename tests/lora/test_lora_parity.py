"""LoRA adapters against HF transformers + PEFT: greedy tokens and logprobs (vLLM's
check_logprobs_close, logprobs within 0.05) of random adapters with nonzero B, alone and
four adapters with the base model in one batch, on a tiny Llama and on the default model;
and the prefix cache never sharing a block between adapters."""

from __future__ import annotations

import os

import pytest
import torch

from pagedserve import LLM, LoRARequest, SamplingParams
from tests.e2e.test_hf_parity import check_logprobs_close, hf_weights_from_gguf
from tests.engine.helpers import make_tiny_llama
from tests.lora.peft_helpers import cached_peft_greedy, make_adapter, peft_greedy

TOKENS = 16
PROMPTS = [[1, 5, 9, 33, 70, 2, 8], [1, 100, 200, 300], [1, *[7] * 20, 8]]


def ours(llm: LLM, prompts: list[list[int]], lora) -> list[tuple[list[int], list[dict[int, float]]]]:
    params = SamplingParams(temperature=0.0, max_tokens=TOKENS, ignore_eos=True, logprobs=5)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False, lora_request=lora)
    return [(list(o.outputs[0].token_ids), [{t: lp.logprob for t, lp in d.items()} for d in o.outputs[0].logprobs])
            for o in outs]


def mixed_batch(prompts, loras, refs):
    """Every prompt under every adapter (None: the base), interleaved so that each step's
    rows of one adapter are not contiguous; the reference in the same order."""
    order = [(k, j) for k in range(len(prompts)) for j in range(len(loras))]
    return ([prompts[k] for k, _ in order], [loras[j] for _, j in order], [refs[j][k] for k, j in order])


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A tiny Llama, four adapters (one rsLoRA of rank 4 on q and v only) and HF + PEFT's answers."""
    import transformers

    d = str(tmp_path_factory.mktemp("tiny-llama-lora"))
    make_tiny_llama(d)
    base = transformers.AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32)
    dirs = [make_adapter(base, os.path.join(d, f"adapter{i}"), seed=i, scale=0.5) for i in range(3)]
    dirs.append(make_adapter(base, os.path.join(d, "adapter3"), seed=3, r=4, targets=["q_proj", "v_proj"],
                             rslora=True, scale=2.0))
    refs = [peft_greedy(base, a, PROMPTS, TOKENS) for a in [None, *dirs]]
    return d, [LoRARequest(f"adapter{i}", i + 1, a) for i, a in enumerate(dirs)], refs


def test_tiny_llama_adapters_alone_and_mixed_match_hf_peft(tiny) -> None:
    d, loras, refs = tiny
    assert all(refs[0][k][0] != refs[j][k][0] for j in range(1, 5) for k in range(len(PROMPTS))), \
        "every adapter must change the answers, or the test shows nothing"
    llm = LLM(d, dtype="float32", enable_lora=True, max_loras=4, max_lora_rank=8)
    for j, lora in enumerate(loras):
        check_logprobs_close(refs[j + 1], ours(llm, PROMPTS, lora), f"adapter{j} alone")
    prompts, mixed, ref = mixed_batch(PROMPTS, [None, *loras], refs)
    agreed = check_logprobs_close(ref, ours(llm, prompts, mixed), "mixed batch")
    assert agreed == [TOKENS] * len(prompts)


def test_enabling_lora_leaves_the_base_models_answers_bit_for_bit(tiny, monkeypatch) -> None:
    """Settings invariance: with LoRA enabled, base-model requests (alone, and in a batch
    beside adapters' rows) get exactly what an engine without LoRA answers, in the CPU's
    default dtype (bf16 where the CPU has it): the same direct layer calls, no compile (a
    compiled graph rounds 16-bit activations differently, which changed greedy answers)."""
    d, loras, _ = tiny
    monkeypatch.delenv("PAGEDSERVE_TORCH_COMPILE")  # the engine's own default, not the suite's "0"
    plain = LLM(d)
    base = ours(plain, PROMPTS, None)
    # The mixed batch's rows all on the base model, without LoRA: the same batch shape (an
    # unquantized float32 GEMM's rounding depends on its row count, so a batch of 15 is
    # compared with a batch of 15)
    prompts, mixed, _ = mixed_batch(PROMPTS, [None, *loras], [[None] * len(PROMPTS)] * 5)
    same_batch = ours(plain, prompts, None)
    llm = LLM(d, enable_lora=True, max_loras=4, max_lora_rank=8)
    assert ours(llm, PROMPTS, None) == base
    outs = ours(llm, prompts, mixed)
    base_rows = [i for i, lora in enumerate(mixed) if lora is None]
    assert [outs[i] for i in base_rows] == [same_batch[i] for i in base_rows]


def test_more_adapters_than_slots_compiled_and_chunked(tiny) -> None:
    """Two slots for four adapters: the scheduler runs at most two at once and the slots
    are reused; compiled, and with prompts prefilled in chunks of 8."""
    d, loras, refs = tiny
    llm = LLM(d, dtype="float32", enable_lora=True, max_loras=2, max_lora_rank=8, torch_compile=True,
              max_num_batched_tokens=64, long_prefill_token_threshold=8)
    prompts, mixed, ref = mixed_batch(PROMPTS, [None, *loras], refs)
    assert check_logprobs_close(ref, ours(llm, prompts, mixed), "two slots") == [TOKENS] * len(prompts)


def test_speculative_decoding_keeps_each_adapters_answers(tiny) -> None:
    """n-gram drafts verified by the adapted model: greedy answers unchanged."""
    d, loras, refs = tiny
    llm = LLM(d, dtype="float32", enable_lora=True, max_loras=4, max_lora_rank=8,
              speculative_config={"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1})
    prompts, mixed, ref = mixed_batch(PROMPTS, [None, *loras], refs)
    assert check_logprobs_close(ref, ours(llm, prompts, mixed), "speculative") == [TOKENS] * len(prompts)


def test_prefix_cache_blocks_are_never_shared_across_adapters(tiny) -> None:
    d, loras, refs = tiny
    llm = LLM(d, dtype="float32", enable_lora=True, max_loras=2, max_lora_rank=8, block_size=4)
    prompt = [{"prompt_token_ids": PROMPTS[2]}]
    params = SamplingParams(temperature=0.0, max_tokens=2)

    def cached(lora) -> int:
        return llm.generate(prompt, params, use_tqdm=False, lora_request=lora)[0].num_cached_tokens

    assert cached(loras[0]) == 0
    assert cached(loras[0]) >= 16  # the same adapter reuses its blocks
    assert cached(loras[1]) == 0  # another adapter's KV for the same tokens differs
    assert cached(None) == 0  # and so does the base model's
    assert cached(None) >= 16
    check_logprobs_close([refs[2][2]], ours(llm, PROMPTS[2:], loras[1]), "adapter1 after caching")


def test_a_bad_adapter_is_refused_by_name_and_the_engine_goes_on(tiny, tmp_path) -> None:
    import transformers

    d, loras, refs = tiny
    other = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=512, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2))
    wrong_base = make_adapter(other, str(tmp_path / "wrong"), seed=0, r=4)
    llm = LLM(d, dtype="float32", enable_lora=True, max_loras=1, max_lora_rank=4)
    with pytest.raises(ValueError, match=r"rank r is over the maximum 4 \(--max-lora-rank\)"):
        ours(llm, PROMPTS, loras[0])
    with pytest.raises(ValueError, match="another base model"):
        ours(llm, PROMPTS, LoRARequest("wrong", 9, wrong_base))
    with pytest.raises(ValueError, match="is not a directory"):
        ours(llm, PROMPTS, LoRARequest("missing", 10, str(tmp_path / "nowhere")))
    import shutil

    from safetensors.torch import load_file, save_file

    poisoned = shutil.copytree(loras[3].lora_path, str(tmp_path / "nan"))  # then given a NaN, as a broken export has
    weights = load_file(os.path.join(poisoned, "adapter_model.safetensors"))
    next(w for k, w in weights.items() if "lora_A" in k)[0, 0] = float("nan")
    save_file(weights, os.path.join(poisoned, "adapter_model.safetensors"))
    with pytest.raises(ValueError, match="not all finite"):  # refused at load, before any batch runs it
        ours(llm, PROMPTS, LoRARequest("nan", 11, poisoned))
    check_logprobs_close(refs[4], ours(llm, PROMPTS, loras[3]), "after refusals")
    check_logprobs_close(refs[0], ours(llm, PROMPTS, None), "base after refusals")


def test_lora_requests_need_enable_lora(tiny) -> None:
    d, loras, _ = tiny
    llm = LLM(d, dtype="float32")
    with pytest.raises(ValueError, match="enable_lora=True"):
        ours(llm, PROMPTS, loras[0])
    with pytest.raises(ValueError, match="got 1 lora_request for 3 prompts"):
        ours(llm, PROMPTS, [loras[0]])
    with pytest.raises(ValueError, match=r"lora_request\[1\] must be a LoRARequest or None, got str"):
        ours(llm, PROMPTS, [None, "adapter0", None])


@pytest.mark.slow
def test_default_model_adapters_match_hf_peft(smollm2_path, smollm2_gguf, tmp_path) -> None:
    """SmolLM2 as the engine runs it by default (its Q4_1 blocks) against HF + PEFT on HF's
    dequantization of the same file: one adapter alone, and four with the base in one batch."""
    from transformers import AutoModelForCausalLM

    hf_dir = hf_weights_from_gguf(*os.path.split(smollm2_gguf))
    base = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    kwargs = [{"seed": 10 + i, "r": 8, "scale": 0.3} for i in range(4)]
    dirs = [make_adapter(base, str(tmp_path / f"smol{i}"), **kw) for i, kw in enumerate(kwargs)]
    prompts = [[1, 4093, 314, 253, 3575, 30, 2118, 216], PROMPTS[1]]
    refs = [cached_peft_greedy(base, os.path.basename(hf_dir), a, prompts, TOKENS)
            for a in [None, *zip(dirs, kwargs, strict=True)]]
    loras = [LoRARequest(f"smol{i}", i + 1, a) for i, a in enumerate(dirs)]
    llm = LLM(smollm2_path, dtype="float32", enable_lora=True, max_loras=4, max_lora_rank=8)
    check_logprobs_close(refs[1], ours(llm, prompts, loras[0]), "smollm2 adapter alone")
    batch, mixed, ref = mixed_batch(prompts, [None, *loras], refs)
    check_logprobs_close(ref, ours(llm, batch, mixed), "smollm2 mixed batch")


def test_tensor_parallel_adapters_match_hf_peft(tiny) -> None:
    """Two ranks: A split by input on the row-parallel layers, B by output on the column-
    parallel ones (q, k, v and gate, up each by its own shard), as the base weights are."""
    d, loras, refs = tiny
    llm = LLM(d, dtype="float32", enable_lora=True, max_loras=4, max_lora_rank=8, tensor_parallel_size=2)
    try:
        prompts, mixed, ref = mixed_batch(PROMPTS[:2], [None, *loras], [r[:2] for r in refs])
        assert check_logprobs_close(ref, ours(llm, prompts, mixed), "tensor parallel") == [TOKENS] * len(prompts)
        with pytest.raises(ValueError, match="is not a directory"):  # refused on every rank, the ranks go on
            ours(llm, PROMPTS[:1], LoRARequest("missing", 9, "/nonexistent/adapter"))
        check_logprobs_close(refs[1][:1], ours(llm, PROMPTS[:1], loras[0]), "tensor parallel after a refusal")
    finally:
        llm.shutdown()


def test_past_max_cpu_loras_the_least_recently_used_idle_adapter_is_unloaded_and_read_again(tiny) -> None:
    d, loras, refs = tiny
    llm = LLM(d, dtype="float32", enable_lora=True, max_loras=1, max_cpu_loras=2, max_lora_rank=8)
    engine = llm.llm_engine
    for lora in loras:  # four adapters through two host slots
        ours(llm, PROMPTS[:1], lora)
        assert len(engine.list_loras()) <= 2
    assert [r.lora_name for r in engine.list_loras()] == ["adapter2", "adapter3"]
    check_logprobs_close(refs[1][:1], ours(llm, PROMPTS[:1], loras[0]), "adapter0 read again")


def test_an_adapter_read_again_after_its_files_changed_is_refused(tiny, tmp_path) -> None:
    """Evicted past max_cpu_loras, then its files replaced and named again: it was read
    anew while the prefix cache still held KV computed under its old weights (an answer
    of neither adapter).  Now refused by name; a new id runs the new files."""
    import shutil

    d, loras, refs = tiny
    llm = LLM(d, dtype="float32", enable_lora=True, max_loras=1, max_cpu_loras=1, max_lora_rank=8)
    moving = str(tmp_path / "moving")
    shutil.copytree(loras[0].lora_path, moving)
    first = LoRARequest("moving", 1, moving)
    check_logprobs_close(refs[1][:1], ours(llm, PROMPTS[:1], first), "adapter0 at the moving path")
    ours(llm, PROMPTS[:1], loras[1])  # evicts it (one host slot)
    shutil.rmtree(moving)
    shutil.copytree(loras[1].lora_path, moving)
    with pytest.raises(ValueError, match="its files changed since it was first loaded"):
        ours(llm, PROMPTS[:1], first)
    check_logprobs_close(refs[2][:1], ours(llm, PROMPTS[:1], LoRARequest("moving", 9, moving)), "the new files")


def test_requests_past_max_cpu_loras_wait_for_room_and_host_memory_holds_that_many(tiny, tmp_path) -> None:
    """Four adapters named at once through one host slot: a request whose adapter has no
    room waits (counted as waiting, its parent known) and joins when the adapter before it
    goes idle, with the same answer; one whose adapter's files are gone by then ends with
    "error", one aborted while it waits never runs.  Host memory never holds two."""
    import shutil

    d, loras, refs = tiny
    llm = LLM(d, dtype="float32", enable_lora=True, max_loras=1, max_cpu_loras=1, max_lora_rank=8)
    engine = llm.llm_engine
    params = SamplingParams(temperature=0.0, max_tokens=TOKENS, ignore_eos=True)
    gone = LoRARequest("gone", 9, shutil.copytree(loras[2].lora_path, str(tmp_path / "gone")))
    for i, lora in enumerate([loras[0], loras[1], gone, loras[3], loras[1]]):
        engine.add_request(f"r{i}", {"prompt_token_ids": PROMPTS[0]}, params, lora_request=lora)
    assert engine.list_loras() == [loras[0]]
    assert engine.get_stats().num_waiting == 5 and engine.get_num_unfinished_requests() == 5
    # (vllm:lora_requests_info names the waiting ones' adapters: the parked ones' were left out)
    assert engine.get_stats().waiting_lora_adapters == ("adapter0", "adapter1", "adapter3", "gone")
    # An adapter that is not one is refused when named, as when it loads at once (waiting,
    # it ended later with an empty "error" output: offline, no exception)
    from pagedserve.lora.peft import LoRAAdapterError

    with pytest.raises(LoRAAdapterError, match="not a directory holding a PEFT adapter"):
        engine.add_request("bad", {"prompt_token_ids": PROMPTS[0]}, params,
                           lora_request=LoRARequest("nope", 11, str(tmp_path / "nonexistent")))
    assert engine.get_num_unfinished_requests() == 5
    engine.abort_request("r4")
    shutil.rmtree(tmp_path / "gone")
    done = {}
    while engine.has_unfinished_requests():
        done |= {o.request_id: o.outputs[0] for o in engine.step() if o.finished}
        assert len(engine.list_loras()) <= 1
    assert sorted(done) == ["r0", "r1", "r2", "r3"]
    assert [list(done[r].token_ids) for r in ("r0", "r1", "r3")] == [refs[1][0][0], refs[2][0][0], refs[4][0][0]]
    assert done["r2"].finish_reason == "error" and done["r2"].token_ids == []
    assert engine.get_stats().num_waiting == 0


def test_structured_outputs_hold_under_every_adapter(tiny) -> None:
    """A grammar constrains what each adapter's logits may pick: every answer matches it,
    and the adapters still answer differently from each other."""
    import re

    from pagedserve.sampling_params import StructuredOutputsParams

    d, loras, _ = tiny
    llm = LLM(d, dtype="float32", enable_lora=True, max_loras=4, max_lora_rank=8)
    params = SamplingParams(temperature=0.0, max_tokens=12,
                            structured_outputs=StructuredOutputsParams(regex=r"[a-e ]{3,10}"))
    prompts = [{"prompt_token_ids": PROMPTS[0]}] * 5
    outs = llm.generate(prompts, params, use_tqdm=False, lora_request=[None, *loras])
    texts = [o.outputs[0].text for o in outs]
    assert [o.lora_request for o in outs] == [None, *loras]  # (vLLM's RequestOutput field)
    assert all(re.fullmatch(r"[a-e ]{3,10}", t) for t in texts), texts
    assert len(set(texts)) > 1, texts


def test_unloading_an_adapter_with_a_running_request_lets_it_finish(tiny) -> None:
    d, loras, refs = tiny
    llm = LLM(d, dtype="float32", enable_lora=True, max_loras=1, max_cpu_loras=1, max_lora_rank=8)
    engine = llm.llm_engine
    params = SamplingParams(temperature=0.0, max_tokens=TOKENS, ignore_eos=True)
    engine.add_request("r", {"prompt_token_ids": PROMPTS[0]}, params, lora_request=loras[0])
    engine.step()
    assert engine.remove_lora(loras[0].lora_int_id)
    assert engine.list_loras() == [loras[0]]  # kept while its request runs
    outs = []
    while engine.has_unfinished_requests():
        outs += [o for o in engine.step() if o.finished]
    assert list(outs[0].outputs[0].token_ids) == refs[1][0][0]
    ours(llm, PROMPTS[:1], loras[1])  # idle now: it makes room for the next adapter
    assert engine.list_loras() == [loras[1]]


def test_an_id_names_one_adapter_until_removed_loaded_parked_or_evicted(tiny) -> None:
    """Id 1 given to another adapter is refused when named, whatever host memory holds: it
    was refused while loaded, ended with an empty "error" output while parked behind a
    busy adapter, and ran the other adapter once evicted."""
    d, loras, refs = tiny
    llm = LLM(d, dtype="float32", enable_lora=True, max_loras=1, max_cpu_loras=1, max_lora_rank=8)
    engine = llm.llm_engine
    params = SamplingParams(temperature=0.0, max_tokens=TOKENS, ignore_eos=True)
    first, other = LoRARequest("a", 1, loras[0].lora_path), LoRARequest("a", 1, loras[1].lora_path)
    ours(llm, PROMPTS[:1], first)
    with pytest.raises(ValueError, match="LoRA id 1 is adapter 'a'"):  # loaded
        ours(llm, PROMPTS[:1], other)
    engine.add_request("busy", {"prompt_token_ids": PROMPTS[0]}, params, lora_request=loras[2])
    engine.add_request("parked", {"prompt_token_ids": PROMPTS[0]}, params, lora_request=first)
    with pytest.raises(ValueError, match="LoRA id 1 is adapter 'a'"):  # parked
        engine.add_request("other", {"prompt_token_ids": PROMPTS[0]}, params, lora_request=other)
    while engine.has_unfinished_requests():
        engine.step()
    ours(llm, PROMPTS[:1], loras[3])  # evicts id 1
    assert 1 not in [r.lora_int_id for r in engine.list_loras()]
    with pytest.raises(ValueError, match="LoRA id 1 is adapter 'a'"):  # evicted
        ours(llm, PROMPTS[:1], other)
    assert not engine.remove_lora(1)  # (not loaded) frees the id
    check_logprobs_close(refs[2][:1], ours(llm, PROMPTS[:1], other), "adapter1 under the freed id 1")


@pytest.mark.parametrize("prefix_caching", [True, False])
def test_an_id_reused_for_another_adapter_after_removal_runs_the_new_one(tiny, prefix_caching) -> None:
    """remove_lora(1), then another adapter under id 1: its answers are its own.  The old
    adapter's slot weights kept running, and its cached KV blocks (keyed by the id alone)
    served the new adapter's prompt."""
    d, loras, refs = tiny
    llm = LLM(d, dtype="float32", enable_lora=True, max_loras=2, max_lora_rank=8,
              enable_prefix_caching=prefix_caching)
    first = LoRARequest("first", 1, loras[0].lora_path)
    check_logprobs_close(refs[1][:1], ours(llm, PROMPTS[:1], first), "adapter0 as id 1")
    assert llm.llm_engine.remove_lora(1)
    second = LoRARequest("second", 1, loras[1].lora_path)
    out = llm.generate([{"prompt_token_ids": PROMPTS[0]}], SamplingParams(temperature=0.0, max_tokens=TOKENS,
                                                                          ignore_eos=True), use_tqdm=False,
                       lora_request=second)[0]
    assert list(out.outputs[0].token_ids) == refs[2][0][0] and out.num_cached_tokens == 0
