"""Qwen2-VL / Qwen2.5-VL: our prompt expansion, M-RoPE positions, vision tower and
decoder reproduce transformers' on tiny random checkpoints (float32)."""

from __future__ import annotations

import json
import re
import shutil
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from pagedserve.multimodal.qwen2_vl import Qwen2VLImagePrompts, mrope_positions
from tests.models.qwen2_vl_helpers import (
    FAMILIES,
    MAX_PIXELS,
    MIN_PIXELS,
    hf_prompt_logits,
    load_ours,
    make_tokenizer,
    our_prompt_logits,
    prompt_text,
    random_image,
    save_checkpoint,
)

# Two sizes: a 2x2 merged grid and a 3x4 one (for Qwen2.5-VL's 2x2 windows: one full
# window, and full plus cut-short ones).
SIZES = [(56, 56), (84, 112)]


@pytest.fixture(scope="module")
def tok() -> Any:
    return make_tokenizer()


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, tuple[str, torch.nn.Module]]:
    """family -> (model directory, the HF model), built once for the module."""
    out = {}
    for family in FAMILIES:
        path = str(tmp_path_factory.mktemp(family))
        out[family] = (path, save_checkpoint(path, family))
    return out


@pytest.fixture(scope="module")
def ours(checkpoints) -> dict[str, torch.nn.Module]:
    return {family: load_ours(path) for family, (path, _) in checkpoints.items()}


def images(n: int, seed: int = 0) -> list[Any]:
    return [random_image(h, w, seed + i) for i, (h, w) in enumerate(SIZES[:n])]


def hf_expansion(path: str, tok: Any, text: str, imgs: list[Any]) -> tuple[list[int], Any]:
    """What Qwen2VLProcessor would give (it cannot be built here: its video processor needs
    torchvision): HF's image processor, HF's replace_image_token for each image, the
    placeholders replaced in order, the tokenizer's ids."""
    from transformers import Qwen2VLProcessor
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    ip = Qwen2VLImageProcessorPil.from_pretrained(path)
    processed = ip(images=imgs, return_tensors="pt")
    stub = SimpleNamespace(image_processor=ip, image_token="<|image_pad|>")
    replacements = iter([Qwen2VLProcessor.replace_image_token(stub, processed, i) for i in range(len(imgs))])
    expanded = re.sub(re.escape("<|image_pad|>"), lambda m: next(replacements), text)
    return tok(expanded)["input_ids"], processed


# ----------------------------------------------------------------------------- prompts


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("n", [1, 2])
def test_prompt_ids_and_mrope_positions_match_hf(family: str, n: int, checkpoints, tok) -> None:
    path, hf = checkpoints[family]
    text, imgs = prompt_text(tok, n), images(n)
    prompt = Qwen2VLImagePrompts(path, hf.config, tok).process(text, imgs, tok.encode)

    want_ids, processed = hf_expansion(path, tok, text, imgs)
    assert prompt.prompt_token_ids == want_ids
    assert torch.equal(torch.cat([im.data["pixel_values"] for im in prompt.images]), processed["pixel_values"])
    assert torch.equal(torch.cat([im.data["image_grid_thw"] for im in prompt.images]), processed["image_grid_thw"])

    image_id = hf.config.image_token_id
    ids = torch.tensor(want_ids)
    assert sum(im.length for im in prompt.images) == int((ids == image_id).sum())
    for im, grid in zip(prompt.images, processed["image_grid_thw"], strict=True):
        assert im.embed_mask is None and im.num_embeds == im.length == int(grid.prod()) // 4
        assert all(t == image_id for t in want_ids[im.offset:im.end])
        assert want_ids[im.offset - 1] == hf.config.vision_start_token_id
        assert want_ids[im.end] == hf.config.vision_end_token_id

    positions, deltas = hf.model.get_rope_index(ids[None], mm_token_type_ids=(ids == image_id).int()[None],
                                                image_grid_thw=processed["image_grid_thw"])
    assert prompt.mrope_positions.dtype == torch.int64
    assert torch.equal(prompt.mrope_positions, positions[:, 0])
    assert prompt.mrope_position_delta == int(deltas[0, 0]) < 0


def test_text_only_prompt_positions(checkpoints, tok) -> None:
    path, hf = checkpoints["qwen2_vl"]
    text = prompt_text(tok, 0)
    prompt = Qwen2VLImagePrompts(path, hf.config, tok).process(text, [], tok.encode)
    n = len(tok.encode(text))
    assert prompt.prompt_token_ids == tok.encode(text) and prompt.images == []
    assert torch.equal(prompt.mrope_positions, torch.arange(n).expand(3, -1))
    assert prompt.mrope_position_delta == 0


def test_image_at_prompt_end_and_adjacent_images() -> None:
    """Spans with no text after or between them: each image still gets its own grid."""
    positions, delta = mrope_positions(2 + 4 + 4, [(2, (1, 4, 4)), (6, (1, 4, 4))], 2)
    assert positions[:, 2:6].tolist() == [[2] * 4, [2, 2, 3, 3], [2, 3, 2, 3]]
    assert positions[:, 6:].tolist() == [[4] * 4, [4, 4, 5, 5], [4, 5, 4, 5]]
    assert delta == 6 - 10


def test_placeholder_count_must_match_images(checkpoints, tok) -> None:
    path, hf = checkpoints["qwen2_vl"]
    prompts = Qwen2VLImagePrompts(path, hf.config, tok)
    with pytest.raises(ValueError, match=r"2 image placeholder.*for 1 image"):
        prompts.process(prompt_text(tok, 2), images(1), tok.encode)
    with pytest.raises(ValueError, match=r"0 image placeholder.*for 1 image"):
        prompts.process(prompt_text(tok, 0), images(1), tok.encode)


def test_the_rows_counted_from_a_size_are_the_rows_processing_gives(checkpoints, tok) -> None:
    """embeds_for_size (intake's check before decoding) agrees with the processed image,
    and a size past Qwen's aspect ratio of 200 is refused by it."""
    path, hf = checkpoints["qwen2_vl"]
    prompts = Qwen2VLImagePrompts(path, hf.config, tok)
    for w, h in [(20, 30), (56, 56), (600, 900), (900, 600), (1000, 13), (57, 29)]:
        got = prompts.process(prompt_text(tok, 1), [random_image(h, w, 1)], tok.encode).images[0].num_embeds
        assert prompts.embeds_for_size(w, h) == got, (w, h)
    with pytest.raises(ValueError, match="aspect ratio"):
        prompts.embeds_for_size(16000, 1)


def test_identifier_is_a_content_hash(checkpoints, tok) -> None:
    path, hf = checkpoints["qwen2_vl"]
    prompts = Qwen2VLImagePrompts(path, hf.config, tok)
    a = prompts.process(prompt_text(tok, 2), [random_image(56, 56, 7), random_image(56, 56, 7)], tok.encode)
    b = prompts.process(prompt_text(tok, 1), [random_image(56, 56, 8)], tok.encode)
    first, second = a.images
    assert first.identifier == second.identifier != b.images[0].identifier
    assert re.fullmatch(r"[0-9a-f]{32}", first.identifier)


@pytest.mark.parametrize("style", ["size", "min_max_pixels"])
def test_min_and_max_pixels_come_from_the_processor_config(style: str, checkpoints, tok, tmp_path) -> None:
    """Both spellings of the resize bounds: transformers 5's `size` and the hub's older
    top-level min_pixels / max_pixels."""
    path, hf = checkpoints["qwen2_vl"]
    with open(f"{path}/preprocessor_config.json") as f:
        cfg = json.load(f)
    if style == "min_max_pixels":
        cfg.pop("size")
        cfg.update(min_pixels=MIN_PIXELS * 4, max_pixels=MAX_PIXELS * 2)
        low, high = MIN_PIXELS * 4, MAX_PIXELS * 2
    else:
        low, high = MIN_PIXELS, MAX_PIXELS
    (tmp_path / "preprocessor_config.json").write_text(json.dumps(cfg))
    prompts = Qwen2VLImagePrompts(str(tmp_path), hf.config, tok)
    big = prompts.process(prompt_text(tok, 1), [random_image(600, 900, 1)], tok.encode).images[0]
    small = prompts.process(prompt_text(tok, 1), [random_image(20, 30, 2)], tok.encode).images[0]
    _, h, w = big.data["image_grid_thw"][0].tolist()
    assert (h * w * 14 * 14 <= high) and (h * w * 14 * 14 > high // 2)
    _, h, w = small.data["image_grid_thw"][0].tolist()
    assert low <= h * w * 14 * 14 < low * 2


# ----------------------------------------------------------------------------- vision tower


@pytest.mark.parametrize("family", FAMILIES)
def test_embed_images_match_hf(family: str, checkpoints, ours, tok) -> None:
    path, hf = checkpoints[family]
    prompt = Qwen2VLImagePrompts(path, hf.config, tok).process(prompt_text(tok, 2), images(2), tok.encode)
    data = [im.data for im in prompt.images]
    with torch.no_grad():
        rows = ours[family].embed_images(data)
        alone = [ours[family].embed_images([d])[0] for d in data]
        want = hf.get_image_features(torch.cat([d["pixel_values"] for d in data]),
                                     torch.cat([d["image_grid_thw"] for d in data])).pooler_output
    assert [r.shape for r in rows] == [w.shape for w in want] == [(4, 64), (12, 64)]
    for got, single, ref in zip(rows, alone, want, strict=True):
        torch.testing.assert_close(got, ref, atol=2e-5, rtol=1e-5)
        # Images never see each other: a leak would move rows by ~0.1.  Not bit for bit: the
        # GEMMs' row count changes float32 rounding on some CPUs (2.9e-6 on an Intel Xeon with
        # AVX-512); the engine encodes each image alone (worker/mm_inputs.py), so its answers
        # do not depend on which images share a step.
        torch.testing.assert_close(single, got, atol=1e-5, rtol=1e-5)


# ----------------------------------------------------------------------------- whole model


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("n", [0, 1, 2])
def test_logits_match_hf(family: str, n: int, checkpoints, ours, tok) -> None:
    path, hf = checkpoints[family]
    prompt = Qwen2VLImagePrompts(path, hf.config, tok).process(prompt_text(tok, n), images(n), tok.encode)
    got, want = our_prompt_logits(ours[family], prompt), hf_prompt_logits(hf, prompt)
    assert got.dtype == torch.float32 and got.shape == (len(prompt.prompt_token_ids), hf.config.text_config.vocab_size)
    # test_models_vs_hf's tolerance; image rows carry the patch embedding's rounding too (one
    # matmul where HF runs a Conv3d: the same sums in another order, ~1e-6 relative).
    torch.testing.assert_close(got, want, atol=2e-5 if n == 0 else 5e-5, rtol=1e-5)


def test_the_image_changes_the_logits(checkpoints, ours, tok) -> None:
    """The parity above is not vacuous: another image of the same size moves the logits
    after it."""
    path, hf = checkpoints["qwen2_5_vl"]
    prompts = Qwen2VLImagePrompts(path, hf.config, tok)
    a = our_prompt_logits(ours["qwen2_5_vl"], prompts.process(prompt_text(tok, 1), images(1, 0), tok.encode))
    b = our_prompt_logits(ours["qwen2_5_vl"], prompts.process(prompt_text(tok, 1), images(1, 5), tok.encode))
    assert (a[-1] - b[-1]).abs().max() > 1e-2


def test_text_positions_as_one_or_three_streams(ours) -> None:
    """[T] positions and [3, T] with equal streams are the same rotation."""
    from pagedserve.forward_context import set_forward_context

    model = ours["qwen2_vl"]
    ids = torch.randint(0, 300, (20,), generator=torch.Generator().manual_seed(3))
    with torch.no_grad(), set_forward_context(None):
        flat = model(ids, torch.arange(20))
        streams = model(ids, torch.arange(20).expand(3, -1))
    torch.testing.assert_close(flat, streams, atol=0, rtol=0)


# ----------------------------------------------------------------------------- weights


@pytest.mark.parametrize("family", FAMILIES)
def test_both_checkpoint_namings_load(family: str, checkpoints, ours) -> None:
    """transformers 5.24's save_pretrained writes the hub's names (model.*, visual.*); its
    modules are named model.language_model.*, model.visual.*: both load the same."""
    _, hf = checkpoints[family]
    names = list(hf.state_dict())
    assert any(n.startswith("model.language_model.") for n in names)
    assert any(n.startswith("model.visual.") for n in names)
    fresh = type(ours[family])(hf.config)
    with torch.no_grad():
        fresh.load_weights(hf.state_dict().items())
    loaded = dict(ours[family].named_parameters())
    for name, p in fresh.named_parameters():
        assert torch.equal(p, loaded[name]), name


def test_missing_or_stray_vision_tensors_are_named(checkpoints, ours) -> None:
    _, hf = checkpoints["qwen2_5_vl"]
    state = dict(hf.state_dict())
    missing = {k: v for k, v in state.items() if k != "model.visual.blocks.0.mlp.gate_proj.bias"}
    with pytest.raises(ValueError, match=r"visual\.blocks\.0\.mlp\.gate_proj\.bias"):
        type(ours["qwen2_5_vl"])(hf.config).load_weights(missing.items())
    stray = {**state, "visual.blocks.9.attn.qkv.weight": torch.zeros(1)}
    with pytest.raises(ValueError, match=r"visual\.blocks\.9\.attn\.qkv\.weight"):
        type(ours["qwen2_5_vl"])(hf.config).load_weights(stray.items())


def test_copied_directory_still_loads(checkpoints, tmp_path) -> None:
    """The directory is self-contained (config, weights, tokenizer, preprocessor config)."""
    path, _ = checkpoints["qwen2_vl"]
    copy = tmp_path / "copy"
    shutil.copytree(path, copy)
    assert load_ours(str(copy)).lm_head.weight.shape == (416, 64)


# ----------------------------------------------------------------------------- through the engine

GEN_TOKENS = 8


def hf_greedy(hf: Any, prompt: Any) -> list[int]:
    """HF's greedy continuation of our expanded prompt (its ids, pixels and grids), EOS
    taken as an ordinary token (as ignore_eos does)."""
    ids = torch.tensor(prompt.prompt_token_ids)[None]
    with torch.no_grad():
        out = hf.generate(**hf_inputs(hf, prompt), max_new_tokens=GEN_TOKENS, do_sample=False, eos_token_id=None,
                          pad_token_id=0)
    return out[0, ids.shape[1]:].tolist()


def hf_inputs(hf: Any, prompt: Any) -> dict[str, Any]:
    """HF generate's inputs for our expanded prompt: its ids, and its pixels and grids."""
    ids = torch.tensor(prompt.prompt_token_ids)[None]
    kwargs: dict[str, Any] = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    if prompt.images:
        kwargs.update(pixel_values=torch.cat([im.data["pixel_values"] for im in prompt.images]),
                      image_grid_thw=torch.cat([im.data["image_grid_thw"] for im in prompt.images]),
                      mm_token_type_ids=(ids == hf.config.image_token_id).int())
    return kwargs


def test_beam_search_keeps_the_images_and_equals_hf(checkpoints, tok) -> None:
    """Every step of LLM.beam_search carries the prompt's images and M-RoPE table (its later
    steps were sent as token ids alone and refused as image tokens without an image)."""
    from pagedserve import LLM, BeamSearchParams

    path, hf = checkpoints["qwen2_vl"]
    text, imgs = prompt_text(tok, 2), images(2)
    expanded = Qwen2VLImagePrompts(path, hf.config, tok).process(text, imgs, tok.encode)
    n = len(expanded.prompt_token_ids)
    with torch.no_grad():
        out = hf.generate(**hf_inputs(hf, expanded), num_beams=3, num_return_sequences=3, do_sample=False,
                          max_new_tokens=5, length_penalty=1.0, eos_token_id=None, pad_token_id=0,
                          output_scores=True, return_dict_in_generate=True)
    want = [seq[n:].tolist() for seq in out.sequences]
    llm = LLM(path, dtype="float32", seed=0)
    got = llm.beam_search([{"prompt": text, "multi_modal_data": {"image": imgs}, "cache_salt": "s"}],
                          BeamSearchParams(beam_width=3, max_tokens=5, ignore_eos=True))[0].sequences
    assert [s.tokens[n:] for s in got] == want
    for ours, theirs in zip(got, out.sequences_scores.tolist(), strict=True):
        assert ours.score == pytest.approx(theirs, abs=1e-4)
    # Its steps kept the prompt's salt: the prompt's blocks were read back under it, so an
    # unsalted request finds none of them.
    plain = llm.generate({"prompt": text, "multi_modal_data": {"image": imgs}}, use_tqdm=False)[0]
    assert plain.num_cached_tokens == 0


# KV blocks of 16 tokens: 2 layers x 2 kv heads x head_dim 16, k and v, float32.
BLOCK_BYTES = 2 * 2 * 16 * 2 * 16 * 4
ENGINE_VARIANTS: dict[str, dict[str, Any]] = {
    "default": {},
    # prefill chunks of 8 tokens: image spans (4 and 12 rows) cut across steps; and no n-gram
    # drafts (the default on CPU), so plain one-token decode steps run too
    "chunked-8-no-drafts": {"max_num_batched_tokens": 8, "long_prefill_token_threshold": 0,
                            "speculative_config": "off"},
    # 4 usable blocks (one request of max_model_len) for the three prompts three times over:
    # requests are preempted and come back with their images and M-RoPE table
    "preemption": {"max_model_len": 64, "block_size": 16, "kv_cache_memory_bytes": 5 * BLOCK_BYTES},
}


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_generation_through_llm_matches_hf(family: str, checkpoints, tok) -> None:
    from pagedserve import LLM, SamplingParams

    path, hf = checkpoints[family]
    processor = Qwen2VLImagePrompts(path, hf.config, tok)
    cases = [(prompt_text(tok, n), images(n)) for n in (0, 1, 2)]
    want = [hf_greedy(hf, processor.process(text, imgs, tok.encode)) for text, imgs in cases]
    requests = [{"prompt": text, "multi_modal_data": {"image": imgs}} if imgs else {"prompt": text}
                for text, imgs in cases]
    params = SamplingParams(temperature=0.0, max_tokens=GEN_TOKENS, ignore_eos=True)
    for name, variant in ENGINE_VARIANTS.items():
        llm = LLM(path, dtype="float32", seed=0, **variant)
        times = 3 if name == "preemption" else 1
        for attempt in ("cold", "prefix-cached"):  # the second run reuses the cached image blocks
            outs = llm.generate(requests * times, params, use_tqdm=False)
            got = [list(o.outputs[0].token_ids) for o in outs]
            assert got == want * times, f"{family} {name} {attempt}"
        if name == "preemption":
            assert llm.llm_engine.get_stats().num_preemptions > 0
        if name == "default":  # chat image parts render as the template's placeholder: the same prompt
            content = [{"type": "image", "image": im} for im in images(2)]
            content.append({"type": "text", "text": "Describe the image."})
            out = llm.chat([{"role": "user", "content": content}], params, use_tqdm=False)
            assert list(out[0].outputs[0].token_ids) == want[2]
        del llm
