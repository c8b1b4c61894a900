"""Greedy generations match HF transformers token for token (float32), in every
engine configuration that changes how the work is cut: prefix caching on/off,
chunked prefill, block size, heavy preemption, batch size 1 and 32, and the
torch.compile'd model.

Where a near-tie makes the two diverge, vLLM's check_logprobs_close rule applies:
each side's token must be in the other's top-5, and comparison stops there.
"""

from __future__ import annotations

import logging

import pytest
import torch

from pagedserve import LLM, SamplingParams
from tests.e2e.token_prompts import shared_prefix_prompts

MAX_TOKENS = 32
TOP = 5
ARCHS = ["llama", "qwen2", "qwen3", "phi3", "qwen3_moe", "gemma3", "mistral"]
# Families whose compiled variant would trace a graph another test compiles: llama and
# qwen3_moe in tests/e2e/test_compiled_parity.py (qwen3's layers are qwen3_moe's second, dense,
# layer: q/k norms and a gated MLP); mistral's is llama's module path (its
# sliding window lives in the attention op, which a compiled graph calls eagerly: compiled
# here with gemma3's sliding and global layers).  A cold compile is 10-20 s on 2 Zen 3 cores.
COMPILED_ELSEWHERE = ("llama", "qwen3", "qwen3_moe", "mistral")

ENGINE_VARIANTS = {
    "default": {},
    "no-prefix-caching": {"enable_prefix_caching": False},
    "chunked-16": {"max_num_batched_tokens": 16, "long_prefill_token_threshold": 0},
    "block-32": {"block_size": 32},
    "batch-1": {"max_num_seqs": 1},
    "compiled": {"torch_compile": True},
}


def hf_greedy(model_dir: str, prompts: list[list[int]], dtype: torch.dtype = torch.float32, device: str = "cpu",
              **load_kwargs) -> list[tuple[list[int], list[dict]]]:
    """Per prompt: HF's greedy tokens and, per step, {token: logprob} for its top-5.

    For a real model (a GGUF file) the answer is kept in the persistent cache, keyed by
    everything it depends on: HF's reading of that file (hf_weights_from_gguf's key), the
    transformers and torch versions, the CPU's vector capability, dtype, device, the
    prompts and the step and top-k counts.  HF's generate costs 7-25 s for a real model's
    prompts on 2 cores, every run, for the same numbers; the check against ours still runs
    in full.  Delete ~/.cache/pagedserve/hf-reference to recompute."""
    if "gguf_file" not in load_kwargs:
        return _hf_generate(model_dir, prompts, dtype, device, **load_kwargs)
    import hashlib
    import json
    import os

    import transformers

    weights = hf_weights_from_gguf(model_dir, load_kwargs.pop("gguf_file"))
    key = json.dumps(["no end token", os.path.basename(weights), transformers.__version__, torch.__version__,
                      torch.backends.cpu.get_cpu_capability(), str(dtype), device, prompts, MAX_TOKENS, TOP,
                      sorted(load_kwargs.items())])
    path = os.path.join(os.path.dirname(weights), "outputs", hashlib.sha256(key.encode()).hexdigest()[:24] + ".json")
    if os.path.isfile(path):
        with open(path) as f:
            return [(toks, [{int(t): lp for t, lp in step} for step in tops]) for toks, tops in json.load(f)]
    results = _hf_generate(weights, prompts, dtype, device, **load_kwargs)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump([(toks, [list(step.items()) for step in tops]) for toks, tops in results], f)
    os.replace(tmp, path)
    return results


def _hf_generate(model_dir: str, prompts: list[list[int]], dtype: torch.dtype, device: str,
                 **load_kwargs) -> list[tuple[list[int], list[dict]]]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype, **load_kwargs).eval().to(device)
    return greedy_tops(model, prompts, MAX_TOKENS, TOP, device)


def greedy_tops(model, prompts: list[list[int]], max_tokens: int, top: int,
                device: str = "cpu") -> list[tuple[list[int], list[dict[int, float]]]]:
    """Per prompt: `model`'s (HF's, or PEFT's over it) greedy tokens and each step's
    top-`top` logprobs, prompts of similar length in one left-padded `generate`."""
    results: dict[int, tuple[list[int], list[dict[int, float]]]] = {}
    # No end token, as ignore_eos runs ours: min_new_tokens would mask it instead, and HF
    # took its second choice where its first was the end (ours), which ended the comparison.
    # (Set on the model's own config: generate fills a passed config's unset fields from it.)
    saved, model.generation_config.eos_token_id = model.generation_config.eos_token_id, None
    with torch.inference_mode():
        for group in _length_groups(prompts):
            width = max(len(prompts[k]) for k in group)
            ids = torch.tensor([[0] * (width - len(prompts[k])) + prompts[k] for k in group], device=device)
            mask = torch.tensor([[0] * (width - len(prompts[k])) + [1] * len(prompts[k]) for k in group],
                                device=device)
            out = model.generate(
                input_ids=ids, attention_mask=mask, max_new_tokens=max_tokens,
                do_sample=False, output_logits=True, return_dict_in_generate=True, pad_token_id=0,
            )
            for row, k in enumerate(group):
                tops = []
                for logits in out.logits:
                    v, i = torch.log_softmax(logits[row].float(), -1).topk(top)
                    tops.append(dict(zip(i.tolist(), v.tolist(), strict=True)))
                results[k] = (out.sequences[row, width:].tolist(), tops)
    model.generation_config.eos_token_id = saved
    return [results[k] for k in range(len(prompts))]


def _length_groups(prompts: list[list[int]]) -> list[list[int]]:
    """Indices of prompts of similar length, each group one left-padded HF `generate`:
    SmolLM2's eight chat prompts one at a time took 31.6 s here, together 6.6 s, with the
    same 256 tokens and logprobs within 1.2e-5 (Gemma 3's three, the long one apart:
    the same 96 tokens).  A prompt far longer than the rest goes alone, not padding them."""
    order = sorted(range(len(prompts)), key=lambda k: len(prompts[k]))
    groups: list[list[int]] = []
    for k in order:
        if groups and len(prompts[k]) <= 1.5 * len(prompts[groups[-1][0]]) + 16:
            groups[-1].append(k)
        else:
            groups.append([k])
    return groups


def hf_weights_from_gguf(model_dir: str, gguf_file: str) -> str:
    """A directory of HF's own reading of `model_dir/gguf_file` (transformers' GGUF loader,
    saved as it loaded it), made once per GGUF file and transformers version in the
    persistent cache, by one of the suite's workers while the other waits.  The reference
    stays HF's dequantization and naming, independent of ours.  HF reads a copy without
    the vocabulary arrays, which a model load does not use (`_gguf_without_vocabulary`):
    the saved weights and config are the same as from the whole file, compared tensor by
    tensor when this was written, and the reading takes 13 s instead of 40 s for Gemma 3,
    10 s instead of 21 s for SmolLM2 (real Zen 3, with the name-table memo below)."""
    import fcntl
    import os

    import transformers

    from pagedserve.model_loader.sources import cache_dir

    gguf = os.path.join(model_dir, gguf_file)
    st = os.stat(gguf)
    key = f"{gguf_file}-{st.st_size}-{int(st.st_mtime)}-transformers-{transformers.__version__}"
    final = os.path.join(cache_dir(), "hf-reference", key)
    if os.path.isfile(os.path.join(final, "config.json")):
        return final
    os.makedirs(os.path.dirname(final), exist_ok=True)
    # One reader per file across the suite's workers: the other waits for it, not reads it too.
    with open(f"{final}.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not os.path.isfile(os.path.join(final, "config.json")):
            _save_hf_reading(gguf_file, model_dir, final)
    return final


def _save_hf_reading(gguf_file: str, model_dir: str, final: str) -> None:
    import functools
    import os
    import shutil
    import tempfile
    import unittest.mock

    import gguf
    from safetensors.torch import save_model
    from transformers import AutoModelForCausalLM

    # HF rebuilds gguf's tensor-name table (a pure function of the architecture and the
    # layer count) for each of its ~400 submodules: 8 s of SmolLM2's reading, memoized.
    names = functools.lru_cache(gguf.get_tensor_name_map)
    with (tempfile.TemporaryDirectory(dir=os.path.dirname(final)) as work,
          unittest.mock.patch.object(gguf, "get_tensor_name_map", names)):
        _gguf_without_vocabulary(os.path.join(model_dir, gguf_file), os.path.join(work, gguf_file))
        model = AutoModelForCausalLM.from_pretrained(work, dtype=torch.float32, gguf_file=gguf_file)
        tmp = os.path.join(work, "reading")
        os.makedirs(tmp)
        # (save_pretrained refuses a GGUF-loaded model: the weights and the config, by hand)
        save_model(model, os.path.join(tmp, "model.safetensors"))
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        model.config.save_pretrained(tmp)
        if os.path.exists(final):  # (a stale partial one: the lock keeps out live writers)
            shutil.rmtree(final)
        os.replace(tmp, final)


_GGUF_SCALAR_BYTES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
_GGUF_STRING, _GGUF_ARRAY, _GGUF_UINT32 = 8, 9, 4


def _gguf_without_vocabulary(src: str, dst: str) -> None:
    """`src` byte for byte without its tokenizer arrays (vocabulary strings, scores, types,
    merges), plus `ARCH.vocab_size` from the embedding's rows where the file has none (HF
    takes it from the vocabulary's length then): the same tensors and model metadata.  HF's
    GGUF loader decodes every vocabulary string with gguf's reader and parses them again
    for each of its two passes (25 s of Gemma 3's 40 s reading, real Zen 3) for a model
    load that uses none of them.  Its own walk of the format, not gguf_utils' reader: the
    reference's input does not go through the code it checks."""
    import struct

    import numpy as np

    buf = memoryview(np.memmap(src, dtype=np.uint8, mode="r"))

    def u32(p: int) -> int:
        return struct.unpack_from("<I", buf, p)[0]

    def u64(p: int) -> int:
        return struct.unpack_from("<Q", buf, p)[0]

    def string(p: int) -> tuple[str, int]:
        n = u64(p)
        return bytes(buf[p + 8: p + 8 + n]).decode(), p + 8 + n

    def skip_value(p: int, vtype: int) -> int:
        if vtype == _GGUF_STRING:
            return p + 8 + u64(p)
        if vtype != _GGUF_ARRAY:
            return p + _GGUF_SCALAR_BYTES[vtype]
        etype, count, p = u32(p), u64(p + 4), p + 12
        if etype != _GGUF_STRING:
            return p + count * _GGUF_SCALAR_BYTES[etype]
        for _ in range(count):
            p += 8 + u64(p)
        return p

    assert bytes(buf[:4]) == b"GGUF" and u32(4) >= 2, src
    n_tensors, n_kv, p = u64(8), u64(16), 24
    kept, meta = [], {}
    for _ in range(n_kv):
        start = p
        key, p = string(p)
        vtype, p = u32(p), p + 4
        end = skip_value(p, vtype)
        if vtype in (_GGUF_STRING, _GGUF_UINT32):
            meta[key] = string(p)[0] if vtype == _GGUF_STRING else u32(p)
        if not (vtype == _GGUF_ARRAY and key.startswith("tokenizer.")):
            kept.append(bytes(buf[start:end]))
        p = end
    infos_start, rows = p, None
    for _ in range(n_tensors):
        name, p = string(p)
        dims = [u64(p + 4 + 8 * i) for i in range(u32(p))]
        p += 4 + 8 * len(dims) + 12
        if name == "token_embd.weight":
            rows = dims[1]  # (innermost first: [hidden, vocab])
    vocab_key = f"{meta['general.architecture']}.vocab_size"
    if vocab_key not in meta:
        kept.append(struct.pack("<Q", len(vocab_key)) + vocab_key.encode() + struct.pack("<II", _GGUF_UINT32, rows))
    align = meta.get("general.alignment", 32)
    data_start = -(-p // align) * align
    header = bytes(buf[:8]) + struct.pack("<QQ", n_tensors, len(kept)) + b"".join(kept) + bytes(buf[infos_start:p])
    with open(dst, "wb") as f:
        f.write(header + bytes(-len(header) % align))
        f.write(buf[data_start:])


def ours_greedy(llm: LLM, prompts: list[list[int]]) -> list[tuple[list[int], list[dict]]]:
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=TOP)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    res = []
    for o in outs:
        c = o.outputs[0]
        assert len(c.token_ids) == MAX_TOKENS
        res.append((list(c.token_ids), [{t: lp.logprob for t, lp in d.items()} for d in c.logprobs]))
    return res


def check_logprobs_close(ref, ours, name: str, atol: float | None = 0.05) -> list[int]:
    """vLLM's rule, plus a bound on the logprob of each agreed token (None: vLLM's rule
    alone); returns, per prompt, how many tokens agreed before the first divergence."""
    agreed = []
    for k, ((rt, rlp), (ot, olp)) in enumerate(zip(ref, ours, strict=True)):
        agreed.append(len(rt))
        for step, (a, b) in enumerate(zip(rt, ot, strict=True)):
            if a != b:
                assert a in olp[step] and b in rlp[step], (
                    f"{name} prompt {k} step {step}: HF {a} vs ours {b} and not in each other's top-{TOP}"
                    f" (HF top {rlp[step]}, ours {olp[step]})"
                )
                agreed[-1] = step
                break
            assert atol is None or abs(rlp[step][a] - olp[step][a]) < atol, (
                f"{name} prompt {k} step {step}: logprob {rlp[step][a]:.4f} (HF) vs {olp[step][a]:.4f}"
            )
    return agreed


def kv_bytes_for_blocks(cfg, num_blocks: int, block_size: int, dtype_bytes: int = 4) -> int:
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    per_block = 2 * cfg.num_hidden_layers * block_size * cfg.num_key_value_heads * head_dim * dtype_bytes
    return num_blocks * per_block


def _run_variants(model_dir: str, hf_cfg, ref, prompts, variants) -> None:
    for name in variants:
        llm = LLM(model_dir, dtype="float32", seed=0, **ENGINE_VARIANTS[name])
        check_logprobs_close(ref, ours_greedy(llm, prompts), name)
        del llm


@pytest.mark.parametrize("arch", ARCHS)
def test_tiny_models_match_hf(arch: str, tiny_checkpoint) -> None:
    model_dir, hf_cfg = tiny_checkpoint(arch)
    prompts = shared_prefix_prompts(hf_cfg.vocab_size)
    ref = hf_greedy(model_dir, prompts)
    variants = [v for v in ENGINE_VARIANTS if v != "compiled" or arch not in COMPILED_ELSEWHERE]
    _run_variants(model_dir, hf_cfg, ref, prompts, variants)

    # Heavy preemption: room for one request and a block, 8 requests at once.
    longest = max(len(p) for p in prompts) + MAX_TOKENS
    blocks = -(-longest // 16) + 2
    llm = LLM(model_dir, dtype="float32", max_model_len=longest,
              kv_cache_memory_bytes=kv_bytes_for_blocks(hf_cfg, blocks + 1, 16))
    check_logprobs_close(ref, ours_greedy(llm, prompts), "preemption")
    assert llm.llm_engine.get_stats().num_preemptions > 0, "the small KV cache should force preemptions"

    # Batch of 32: the 8 prompts four times over, all in flight together.
    llm = LLM(model_dir, dtype="float32", max_num_seqs=32)
    check_logprobs_close(ref * 4, ours_greedy(llm, prompts * 4), "batch-32")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("arch", ARCHS)
def test_tiny_models_match_hf_on_cuda_bf16(arch: str, tiny_checkpoint, tmp_path) -> None:
    """On a GPU in bfloat16, both sides: HF on CUDA against the engine as it runs there by
    default (Triton kernels, CUDA graphs where the model allows, overlap scheduling) and
    eagerly.  bf16 rounding makes near-ties flip, so vLLM's rule alone applies (no bound
    on the logprobs), plus: most tokens agree before any divergence."""
    model_dir, hf_cfg = tiny_checkpoint(arch)
    if arch == "qwen3_moe":
        # Every expert chosen for every token.  This checkpoint's top-2 routing has
        # choices whose probabilities are 2e-4 apart, which bf16 router logits (1/128
        # resolution) flip on any difference in rounding order (the first H100 run with
        # the fused norm kernels flipped one), and a flipped choice is another function,
        # not a rounding difference.  Top-k selection is checked in float32 on the CPU.
        from tests.e2e.conftest import make_tiny_checkpoint

        model_dir = str(tmp_path / "qwen3_moe_all_experts")
        hf_cfg = make_tiny_checkpoint(arch, model_dir, num_experts_per_tok=hf_cfg.num_experts)
    prompts = shared_prefix_prompts(hf_cfg.vocab_size)
    ref = hf_greedy(model_dir, prompts, dtype=torch.bfloat16, device="cuda")
    for eager in (False, True):
        llm = LLM(model_dir, dtype="bfloat16", device="cuda", seed=0, enforce_eager=eager, max_num_seqs=32)
        agreed = check_logprobs_close(ref * 4, ours_greedy(llm, prompts * 4), f"{arch}-cuda-bf16-eager={eager}",
                                      atol=None)
        assert sum(agreed) >= len(agreed) * MAX_TOKENS // 2, agreed
        del llm
        torch.cuda.empty_cache()


@pytest.mark.parametrize("arch", ["qwen2", "qwen3"])
def test_yarn_rope_scaling_matches_hf(arch: str, tmp_path) -> None:
    """Qwen with YaRN (as Qwen2.5 / Qwen3 configs for long contexts set it), trained
    context 32 tokens, so the prompts and outputs run well past it."""
    from tests.e2e.conftest import make_tiny_checkpoint

    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32, "rope_theta": 10000.0}
    hf_cfg = make_tiny_checkpoint(arch, str(tmp_path), rope_parameters=yarn)
    prompts = shared_prefix_prompts(hf_cfg.vocab_size)
    assert max(map(len, prompts)) > 32
    ref = hf_greedy(str(tmp_path), prompts)
    _run_variants(str(tmp_path), hf_cfg, ref, prompts, ["default", "chunked-16"])
    default = make_tiny_checkpoint(arch, str(tmp_path / "plain"))  # the scaling matters here
    assert ours_greedy(LLM(str(tmp_path / "plain"), dtype="float32"), prompts) != ref, default


def test_partial_rotary_factor_is_ignored_where_hf_ignores_it(tmp_path) -> None:
    """HF's Llama (and Mistral, Qwen) rotate whole heads whatever partial_rotary_factor
    says; only Phi-3's code reads it (tests/models/test_longrope.py).  Half of each head
    was rotated here: every answer differed from the first token."""
    from tests.e2e.conftest import make_tiny_checkpoint

    rope = {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5}
    hf_cfg = make_tiny_checkpoint("llama", str(tmp_path), rope_parameters=rope)
    prompts = shared_prefix_prompts(hf_cfg.vocab_size)[:2]
    llm = LLM(str(tmp_path), dtype="float32", seed=0)
    try:
        ours, ref = ours_greedy(llm, prompts), hf_greedy(str(tmp_path), prompts)
        check_logprobs_close(ref, ours, "partial_rotary_factor", atol=1e-3)
        assert [tokens for tokens, _ in ours] == [tokens for tokens, _ in ref]
    finally:
        llm.shutdown()


@pytest.mark.parametrize(("arch", "flag"), [("mistral", "attention_bias"), ("phi3", "attention_bias"),
                                          ("qwen2", "mlp_bias")])
def test_a_bias_flag_the_familys_hf_code_never_reads_is_not_read(arch: str, flag: str, tmp_path) -> None:
    """HF's Mistral and Phi-3 have no attention biases and Qwen2 no MLP bias, whatever
    their configs say: such a config failed to load here ("checkpoint is missing ...
    bias"), where HF runs it."""
    from tests.e2e.conftest import make_tiny_checkpoint

    hf_cfg = make_tiny_checkpoint(arch, str(tmp_path), **{flag: True})
    prompts = shared_prefix_prompts(hf_cfg.vocab_size)[:1]
    llm = LLM(str(tmp_path), dtype="float32", seed=0)
    try:
        ours, ref = ours_greedy(llm, prompts), hf_greedy(str(tmp_path), prompts)
        assert [tokens for tokens, _ in ours] == [tokens for tokens, _ in ref]
    finally:
        llm.shutdown()


def test_generation_configs_eos_ids_replace_the_configs(tmp_path) -> None:
    """HF's generate (and vLLM) stop on generation_config.json's eos ids: config.json's
    other one was a stop token here too, and answers ended where HF's went on."""
    import json

    from tests.e2e.conftest import make_tiny_checkpoint

    make_tiny_checkpoint("llama", str(tmp_path), eos_token_id=168)
    gen = json.loads((tmp_path / "generation_config.json").read_text())
    (tmp_path / "generation_config.json").write_text(json.dumps({**gen, "eos_token_id": [333, 334]}))
    llm = LLM(str(tmp_path), dtype="float32", seed=0)
    try:
        assert sorted(llm.llm_engine.stop_token_ids) == [333, 334]
    finally:
        llm.shutdown()


SMOL_MESSAGES = [
    "What is the capital of France?", "Write a haiku about autumn rain.",
    "Explain photosynthesis to a ten-year-old.", "List five prime numbers.",
    "How do I reverse a list in Python?", "Give me three tips for better sleep.",
    "What causes the seasons on Earth?", "Summarize Romeo and Juliet in two sentences.",
]


def test_smollm2_matches_hf(smollm2_path, smollm2_gguf) -> None:
    """The real model: our dequantized weights vs HF loading the same GGUF."""
    import os

    llm = LLM(smollm2_path, dtype="float32")
    tok = llm.get_tokenizer()
    prompts = [
        tok.apply_chat_template([{"role": "user", "content": m}], add_generation_prompt=True, tokenize=False)
        for m in SMOL_MESSAGES
    ]
    ids = [tok(p, add_special_tokens=False)["input_ids"] for p in prompts]
    d, f = os.path.split(smollm2_gguf)
    ref = hf_greedy(d, ids, gguf_file=f)
    check_logprobs_close(ref, ours_greedy(llm, ids), "smollm2-default")
    del llm
    # One more engine covers the other settings (each costs seconds to build): chunks of 16
    # tokens in blocks of 32, with every prompt twice in flight.  (Compiled-vs-eager parity and the
    # saved compilation are tests/worker/test_compiled_model.py's, on tiny models: compiling
    # this one took ~50 s of the suite on a 2-core Zen 3, AVX2 only.)
    llm = LLM(smollm2_path, dtype="float32", max_num_seqs=32,
              **{**ENGINE_VARIANTS["chunked-16"], "block_size": 32})
    check_logprobs_close(ref * 2, ours_greedy(llm, ids * 2), "smollm2-chunked-16-block-32-batched")


def test_gemma3_270m_matches_hf(gemma3_path) -> None:
    """The real Gemma 3 270M: our dequantized weights vs HF reading the same Q4_K_M GGUF,
    on two chat prompts and one of ~700 tokens, past the 512-token window of its sliding
    layers; then the prefix-cached, chunked and batched engines on the same prompts."""
    import os

    from pagedserve.model_loader.sources import MODEL_NAMES, gguf_file_name

    llm = LLM(gemma3_path, dtype="float32", max_model_len=1024)
    # The engine's own tokenizer (the saved one, checked against transformers' when it was
    # saved): loading transformers' for Gemma's 262k vocabulary costs 5-10 s here.
    tok = llm.llm_engine.input_processor.tokenizer
    turn = "<start_of_turn>user\n{}<end_of_turn>\n<start_of_turn>model\n"
    story = " ".join(f"Day {i}: the {c} fox walked to the {p} and counted {i * 7} stones." for i, (c, p) in
                     enumerate(zip(["red", "grey", "small", "quick"] * 12, ["river", "hill", "town"] * 16, strict=True)))
    texts = [turn.format(SMOL_MESSAGES[0]), turn.format(SMOL_MESSAGES[4]),
             turn.format(story + " How many stones did the fox count on day 20?")]
    ids = [tok.encode(t) for t in texts]
    assert len(ids[2]) > 600 > 512 == llm.llm_engine.config.model_config.hf_config.sliding_window
    ref = hf_greedy(gemma3_path, ids, gguf_file=gguf_file_name(MODEL_NAMES["gemma3-270m"]))
    assert os.path.isfile(os.path.join(gemma3_path, gguf_file_name(MODEL_NAMES["gemma3-270m"])))
    check_logprobs_close(ref, ours_greedy(llm, ids), "gemma3-default")
    del llm
    llm = LLM(gemma3_path, dtype="float32", max_model_len=1024, max_num_batched_tokens=256, max_num_seqs=32)
    check_logprobs_close(ref, ours_greedy(llm, ids), "gemma3-chunked-256-batched")  # (the three together)


def test_smollm2_quantized_matches_dequantized(smollm2_path, caplog) -> None:
    """The default model as it runs by default on CPU (its Q4_1/Q8_0 blocks kept, 16-bit
    activations) against the same weights dequantized, both in float32: vLLM's
    check_logprobs_close and agreed tokens' logprobs within 0.05, on 8 chat prompts.  The
    opt-in 8-bit activations (llama.cpp's scheme) fail that bound here: what made the
    default answer "What is the capital of France?" with nonsense."""
    llm = LLM("smollm2-135m-instruct", dtype="float32", quantization="none")
    tok = llm.get_tokenizer()
    ids = [tok(tok.apply_chat_template([{"role": "user", "content": m}], add_generation_prompt=True,
                                       tokenize=False), add_special_tokens=False)["input_ids"] for m in SMOL_MESSAGES]
    ref = ours_greedy(llm, ids)
    del llm
    with caplog.at_level(logging.INFO):
        llm = LLM("smollm2-135m-instruct", dtype="float32")
    assert "quantization gguf: 121 layers keep Q4_1/Q8_0 weights" in caplog.text
    assert "16-bit activations" in caplog.text
    agreed = check_logprobs_close(ref, ours_greedy(llm, ids), "smollm2-quantized")
    assert sum(agreed) >= len(ids) * MAX_TOKENS * 3 // 4, agreed  # the same text, not just top-5 neighbours
    del llm
    llm = LLM("smollm2-135m-instruct", dtype="float32", quant_activation_bits=8)
    with pytest.raises(AssertionError):  # a token out of the other's top-5, or a logprob off
        check_logprobs_close(ref, ours_greedy(llm, ids), "smollm2-quantized-8-bit-activations")
