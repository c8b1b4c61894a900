"""Gemma 3 with images: our prompt expansion, vision tower + projector and decoder with
bidirectional image spans reproduce HF's Gemma3Processor and Gemma3ForConditionalGeneration."""

from __future__ import annotations

import json
import os
from typing import Any

import pytest
import torch

from pagedserve.forward_context import BidirectionalSpan, set_forward_context
from pagedserve.models.gemma3_mm import Gemma3ForConditionalGeneration
from pagedserve.multimodal.gemma3 import Gemma3ImagePrompts
from pagedserve.multimodal.registry import make_image_prompt_processor
from tests.models.gemma3_mm_helpers import (
    MM_TOKENS,
    make_image_processor,
    make_tokenizer,
    put_image_rows,
    random_image,
    save_checkpoint,
)

ONE_IMAGE = "<start_of_turn>user\n<start_of_image>describe the image please.<end_of_turn>\n<start_of_turn>model\n"
TWO_IMAGES = ("<start_of_turn>user\nwhat is in this picture? <start_of_image> and in this one: <start_of_image>"
              " compare the two images.<end_of_turn>\n<start_of_turn>model\n")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, torch.nn.Module]:
    path = str(tmp_path_factory.mktemp("gemma3_mm"))
    return path, save_checkpoint(path)


@pytest.fixture(scope="module")
def ours(checkpoint: tuple[str, torch.nn.Module]) -> Gemma3ForConditionalGeneration:
    from safetensors import safe_open

    path, hf = checkpoint
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float32)
    try:
        model = Gemma3ForConditionalGeneration(hf.config)
    finally:
        torch.set_default_dtype(previous)
    with safe_open(os.path.join(path, "model.safetensors"), "pt") as f, torch.no_grad():
        model.load_weights((name, f.get_tensor(name)) for name in f.keys())
    return model.eval()


@pytest.fixture(scope="module")
def prompts(checkpoint: tuple[str, torch.nn.Module]) -> Gemma3ImagePrompts:
    path, hf = checkpoint
    return make_image_prompt_processor("Gemma3ForConditionalGeneration", path, hf.config, make_tokenizer())


def encode(text: str) -> list[int]:
    return make_tokenizer()(text).input_ids


def hf_processor() -> Any:
    import transformers

    return transformers.Gemma3Processor(image_processor=make_image_processor(), tokenizer=make_tokenizer(),
                                        image_seq_length=MM_TOKENS)


# --- prompt expansion ------------------------------------------------------------------


@pytest.mark.parametrize("text,n", [(ONE_IMAGE, 1), (TWO_IMAGES, 2)], ids=["one-image", "two-images"])
def test_prompt_matches_hf_processor(prompts: Gemma3ImagePrompts, text: str, n: int) -> None:
    images = [random_image(seed) for seed in range(n)]
    mm = prompts.process(text, images, encode)
    ref = hf_processor()(text=text, images=images, return_tensors="pt")
    assert mm.prompt_token_ids == ref["input_ids"][0].tolist()
    # The bidirectional span of each image is exactly what HF's token_type_ids mark.
    marked = torch.zeros(len(mm.prompt_token_ids), dtype=torch.long)
    for feature in mm.images:
        assert feature.length == feature.num_embeds == MM_TOKENS and feature.embed_mask is None
        marked[feature.offset:feature.end] = 1
    assert marked.tolist() == ref["token_type_ids"][0].tolist()
    pixels = torch.cat([f.data["pixel_values"] for f in mm.images])
    assert pixels.shape == (n, 3, 32, 32)
    torch.testing.assert_close(pixels, ref["pixel_values"], atol=0, rtol=0)
    assert mm.mrope_positions is None


def test_identifier_is_a_content_hash(prompts: Gemma3ImagePrompts) -> None:
    a = prompts.process(TWO_IMAGES, [random_image(0), random_image(0)], encode).images
    b = prompts.process(ONE_IMAGE, [random_image(1)], encode).images
    assert a[0].identifier == a[1].identifier != b[0].identifier


def test_the_rows_counted_from_a_size_are_the_rows_processing_gives(prompts: Gemma3ImagePrompts) -> None:
    for w, h in [(20, 30), (900, 600)]:
        got = prompts.process(ONE_IMAGE, [random_image(0, (w, h))], encode).images[0].num_embeds
        assert prompts.embeds_for_size(w, h) == got


def test_placeholder_count_mismatch_is_refused(prompts: Gemma3ImagePrompts) -> None:
    with pytest.raises(ValueError, match=r"2 image placeholder\(s\).*1 image\(s\)"):
        prompts.process(TWO_IMAGES, [random_image(0)], encode)
    with pytest.raises(ValueError, match=r"0 image placeholder\(s\).*1 image\(s\)"):
        prompts.process("no image here", [random_image(0)], encode)


def test_pan_and_scan_and_long_images_are_refused(checkpoint: tuple[str, torch.nn.Module], tmp_path) -> None:
    import copy

    path, hf = checkpoint
    with open(os.path.join(path, "preprocessor_config.json")) as f:
        settings = json.load(f)
    (tmp_path / "preprocessor_config.json").write_text(json.dumps({**settings, "do_pan_and_scan": True}))
    with pytest.raises(ValueError, match="do_pan_and_scan"):
        Gemma3ImagePrompts(str(tmp_path), hf.config, make_tokenizer())
    config = copy.deepcopy(hf.config)
    config.text_config.sliding_window = MM_TOKENS
    with pytest.raises(ValueError, match="sliding_window"):
        Gemma3ImagePrompts(path, config, make_tokenizer())
    with pytest.raises(ValueError, match="sliding_window"):
        Gemma3ForConditionalGeneration(config)


# --- the model --------------------------------------------------------------------------


def test_embed_images_matches_hf(ours: Gemma3ForConditionalGeneration,
                                 checkpoint: tuple[str, torch.nn.Module]) -> None:
    _, hf = checkpoint
    pixels = hf_processor().image_processor(
        [random_image(0), random_image(1)], return_tensors="pt")["pixel_values"]
    with torch.no_grad():
        rows = ours.embed_images([{"pixel_values": pixels[:1]}, {"pixel_values": pixels[1:]}])
        ref = hf.model.get_image_features(pixels).pooler_output
    assert [r.shape for r in rows] == [(MM_TOKENS, 64)] * 2
    assert ref.abs().mean() > 0.3  # the features are not negligible next to the text embeddings
    torch.testing.assert_close(torch.stack(rows), ref, atol=2e-5, rtol=1e-5)


def our_mm_logits(model: Gemma3ForConditionalGeneration, mm: Any) -> torch.Tensor:
    ids = torch.tensor(mm.prompt_token_ids)
    spans = [BidirectionalSpan(0, f.offset, f.end, f.offset, f.end) for f in mm.images]
    with torch.no_grad(), set_forward_context(None, bidirectional=spans):
        embeds = put_image_rows(model.embed_input_ids(ids), mm.images,
                                model.embed_images([f.data for f in mm.images]))
        return model.compute_logits(model(ids, torch.arange(len(ids)), embeds))


def hf_mm_logits(hf: torch.nn.Module, mm: Any) -> torch.Tensor:
    ids = torch.tensor(mm.prompt_token_ids)[None]
    token_type = (ids == hf.config.image_token_id).long()
    kwargs: dict[str, Any] = {}
    if mm.images:
        kwargs = dict(pixel_values=torch.cat([f.data["pixel_values"] for f in mm.images]),
                      token_type_ids=token_type)
    with torch.no_grad():
        return hf(input_ids=ids, **kwargs).logits[0].float()


# Long enough (> sliding_window=64 tokens) that the sliding layer's window cuts in.  Over
# ~200 positions with logits of magnitude ~10, float32 summation order alone moves a few
# of them by ~2e-5, so the bound is test_models_vs_hf's with a little more absolute room.
ATOL, RTOL = 5e-5, 1e-5
LONG = " the quick brown fox jumps over the lazy dog;" * 6


@pytest.mark.parametrize("text,n", [(ONE_IMAGE + LONG, 1), (TWO_IMAGES + LONG, 2), (LONG + ONE_IMAGE, 1)],
                         ids=["one-image", "two-images", "image-past-the-window"])
def test_logits_with_images_match_hf(ours: Gemma3ForConditionalGeneration, checkpoint: tuple[str, torch.nn.Module],
                                     prompts: Gemma3ImagePrompts, text: str, n: int) -> None:
    _, hf = checkpoint
    mm = prompts.process(text, [random_image(10 + i) for i in range(n)], encode)
    assert len(mm.prompt_token_ids) > 64
    ours_logits, ref = our_mm_logits(ours, mm), hf_mm_logits(hf, mm)
    torch.testing.assert_close(ours_logits, ref, atol=ATOL, rtol=RTOL)
    # The bidirectional spans matter: causal-only attention over the same embeddings differs.
    ids = torch.tensor(mm.prompt_token_ids)
    with torch.no_grad(), set_forward_context(None):
        embeds = put_image_rows(ours.embed_input_ids(ids), mm.images, ours.embed_images([f.data for f in mm.images]))
        causal = ours.compute_logits(ours(ids, torch.arange(len(ids)), embeds))
    assert (causal - ref).abs().max() > 1e-3


def test_text_only_logits_match_hf(ours: Gemma3ForConditionalGeneration, checkpoint: tuple[str, torch.nn.Module],
                                   prompts: Gemma3ImagePrompts) -> None:
    _, hf = checkpoint
    mm = prompts.process("hello world," + LONG, [], encode)
    assert mm.images == []
    ids = torch.tensor(mm.prompt_token_ids)
    with torch.no_grad(), set_forward_context(None):
        plain = ours.compute_logits(ours(ids, torch.arange(len(ids))))
    torch.testing.assert_close(plain, hf_mm_logits(hf, mm), atol=ATOL, rtol=RTOL)


def test_both_weight_namings_load(ours: Gemma3ForConditionalGeneration,
                                  checkpoint: tuple[str, torch.nn.Module]) -> None:
    """transformers 5's in-memory names (model.language_model.*, model.vision_tower.*) and
    the hub's older ones (vision_tower.vision_model.*) load to the same parameters."""
    _, hf = checkpoint
    state = {k: v for k, v in hf.state_dict().items() if k != "lm_head.weight"}  # tied
    assert any(k.startswith("model.language_model.") for k in state)
    older = {}
    for k, v in state.items():
        k = k.replace("model.language_model.", "language_model.model.")
        k = k.replace("model.vision_tower.", "vision_tower.vision_model.")
        older[k.replace("model.multi_modal_projector.", "multi_modal_projector.")] = v
    expected = dict(ours.named_parameters())
    for weights in (state, older):
        model = Gemma3ForConditionalGeneration(hf.config).to(torch.float32)
        used = model.load_weights(weights.items())
        assert used == set(weights)
        for name, p in model.named_parameters():
            torch.testing.assert_close(p, expected[name], atol=0, rtol=0)
    assert ours.language_model.lm_head.weight is ours.language_model.model.embed_tokens.weight
    with pytest.raises(ValueError, match="does not use"):
        Gemma3ForConditionalGeneration(hf.config).load_weights([*state.items(), ("foo.bar", torch.zeros(1))])
    with pytest.raises(ValueError, match="missing"):
        Gemma3ForConditionalGeneration(hf.config).load_weights(
            [kv for kv in state.items() if "vision_tower" not in kv[0] or "post_layernorm" not in kv[0]])


def test_out_of_vocabulary_image_token_embeds_as_id_0(ours: Gemma3ForConditionalGeneration,
                                                      checkpoint: tuple[str, torch.nn.Module]) -> None:
    """As HF's Gemma3Model: an image token id past the vocabulary (its rows are replaced
    anyway) embeds as id 0 instead of indexing out of range."""
    import copy

    config = copy.deepcopy(checkpoint[1].config)
    config.image_token_id = config.text_config.vocab_size + 5
    model = Gemma3ForConditionalGeneration(config).to(torch.float32)
    model.load_state_dict(ours.state_dict())
    ids = torch.tensor([3, config.image_token_id, 4])
    with torch.no_grad():
        torch.testing.assert_close(model.embed_input_ids(ids), ours.embed_input_ids(torch.tensor([3, 0, 4])))
        with set_forward_context(None):
            assert model(ids, torch.arange(3)).shape == (3, 64)


# --- through the engine -----------------------------------------------------------------


GEN_TOKENS = 8


def hf_generate(hf: torch.nn.Module, mm: Any) -> tuple[list[int], list[float]]:
    """HF's greedy tokens for an expanded prompt and each one's logprob."""
    ids = torch.tensor(mm.prompt_token_ids)[None]
    kwargs: dict[str, Any] = {}
    if mm.images:
        kwargs = dict(pixel_values=torch.cat([f.data["pixel_values"] for f in mm.images]),
                      token_type_ids=(ids == hf.config.image_token_id).long())
    with torch.no_grad():
        out = hf.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=GEN_TOKENS,
                          do_sample=False, output_logits=True, return_dict_in_generate=True, **kwargs)
    tokens = out.sequences[0, ids.shape[1]:].tolist()
    return tokens, [torch.log_softmax(step[0].float(), -1)[t].item()
                    for step, t in zip(out.logits, tokens, strict=True)]


CHUNKED = dict(max_num_batched_tokens=50, enable_chunked_prefill=True)


@pytest.mark.parametrize("engine_kwargs", [{}, CHUNKED], ids=["whole-prompts", "chunked-prefill-50"])
def test_greedy_generation_matches_hf(checkpoint: tuple[str, torch.nn.Module], prompts: Gemma3ImagePrompts,
                                      engine_kwargs: dict[str, Any]) -> None:
    """One image, the same text with another image, two images, one image twice and text
    only, in one batch through LLM.generate and again (prefix and encoder caches warm): HF's greedy tokens,
    each with HF's logprob.  The logprobs are the check on the bidirectional spans: with
    causal-only image attention the tokens here stay the same but logprobs move by ~1e-2."""
    from pagedserve import LLM, SamplingParams

    path, hf = checkpoint
    cases = [(ONE_IMAGE + LONG, [random_image(20)]), (ONE_IMAGE + LONG, [random_image(23)]),
             (TWO_IMAGES, [random_image(21), random_image(22)]), (TWO_IMAGES, [random_image(22), random_image(22)]),
             ("hello world," + LONG, [])]
    refs = [hf_generate(hf, prompts.process(text, images, encode)) for text, images in cases]
    assert refs[0][0] != refs[1][0]  # the image, not only the text, decides the answer
    requests = [{"prompt": text, "multi_modal_data": {"image": images}} if images else {"prompt": text}
                for text, images in cases]
    llm = LLM(model=path, dtype="float32", max_model_len=512, max_num_seqs=4, **engine_kwargs)
    params = SamplingParams(temperature=0.0, max_tokens=GEN_TOKENS, logprobs=1)
    for _ in range(2):
        outs = llm.generate(requests, params, use_tqdm=False)
        for (text, images), (ref_tokens, ref_logprobs), out in zip(cases, refs, outs, strict=True):
            assert list(out.prompt_token_ids) == prompts.process(text, images, encode).prompt_token_ids
            completion = out.outputs[0]
            assert list(completion.token_ids) == ref_tokens, text[:60]
            logprobs = [step[t].logprob for step, t in zip(completion.logprobs, completion.token_ids, strict=True)]
            assert max(abs(a - b) for a, b in zip(logprobs, ref_logprobs, strict=True)) < 1e-4, text[:60]
    # A chat message's image part renders as the template's placeholder and is expanded
    # as HF's processor expands the rendered conversation.
    image = random_image(24)
    messages = [{"role": "user", "content": [{"type": "image", "image": image},
                                             {"type": "text", "text": "describe the image please."}]}]
    rendered = make_tokenizer().apply_chat_template(
        [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "describe the image please."}]}],
        tokenize=False, add_generation_prompt=True)
    expected = hf_processor()(text=rendered, images=[image], add_special_tokens=False)["input_ids"][0]
    mm = prompts.process(rendered, [image], lambda text: make_tokenizer()(text, add_special_tokens=False).input_ids)
    assert mm.prompt_token_ids == list(expected)
    out = llm.chat(messages, params, use_tqdm=False)[0]
    assert list(out.prompt_token_ids) == mm.prompt_token_ids
    assert list(out.outputs[0].token_ids) == hf_generate(hf, mm)[0]
