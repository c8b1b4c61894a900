"""Idefics3 / SmolVLM against HF transformers on a tiny random checkpoint: the prompt
expansion, the image features, and greedy generation through the engine."""

from __future__ import annotations

import pytest
import torch

from tests.models.idefics3_helpers import image, make_idefics3, make_tokenizer


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("idefics3")
    return path, make_idefics3(path)


def test_prompt_expansion_matches_hf_processor(checkpoint):
    from transformers import Idefics3Processor
    from transformers.models.idefics3.image_processing_pil_idefics3 import Idefics3ImageProcessorPil

    from pagedserve.multimodal.idefics3 import Idefics3ImagePrompts

    path, hf = checkpoint
    tok = make_tokenizer()
    ours = Idefics3ImagePrompts(str(path), hf.config, tok)
    processor = Idefics3Processor(Idefics3ImageProcessorPil.from_pretrained(path), tok, image_seq_len=4)
    text = "User:<image>Describe<image> both.<end_of_utterance>\nAssistant:"
    images = [image(64, 48, 1), image(20, 30, 2)]
    want = processor(text=text, images=images, add_special_tokens=False)
    got = ours.process(text, images, lambda t: tok.encode(t, add_special_tokens=False))
    assert got.prompt_token_ids == want["input_ids"][0]
    assert len(got.images) == 2 and all(f.num_embeds % 4 == 0 for f in got.images)
    assert sum(sum(f.embed_mask) for f in got.images) == got.prompt_token_ids.count(hf.config.image_token_id)
    with pytest.raises(ValueError, match="2 image placeholder"):
        ours.process(text, images[:1], tok.encode)


def test_the_rows_counted_from_a_size_are_the_rows_processing_gives(checkpoint):
    """embeds_for_size (intake's check before decoding) agrees with the processed image:
    one tile, and rows x cols tiles with the global view."""
    from pagedserve.multimodal.idefics3 import Idefics3ImagePrompts

    path, hf = checkpoint
    tok = make_tokenizer()
    ours = Idefics3ImagePrompts(str(path), hf.config, tok)
    for w, h in [(20, 30), (64, 48), (300, 90), (90, 300), (1000, 700)]:
        got = ours.process("<image>", [image(w, h, 1)], lambda t: tok.encode(t, add_special_tokens=False))
        assert ours.embeds_for_size(w, h) == got.images[0].num_embeds, (w, h)


def test_image_features_match_hf(checkpoint):
    from pagedserve.models.idefics3 import Idefics3ForConditionalGeneration
    from pagedserve.multimodal.idefics3 import Idefics3ImagePrompts

    path, hf = checkpoint
    ours = Idefics3ForConditionalGeneration(hf.config)
    ours.load_weights(hf.state_dict().items())
    prompts = Idefics3ImagePrompts(str(path), hf.config, make_tokenizer())
    got = prompts.process("<image>", [image(64, 48, 3)], make_tokenizer().encode).images[0]
    with torch.no_grad():
        want = hf.model.get_image_features(got.data["pixel_values"][None],
                                           got.data["pixel_attention_mask"][None]).pooler_output[0]
        rows = ours.embed_images([got.data])[0]
    torch.testing.assert_close(rows, want, rtol=1e-4, atol=1e-4)


def _hf_greedy(hf, tok, text: str, images: list, max_tokens: int) -> list[int]:
    from transformers import Idefics3Processor
    from transformers.models.idefics3.image_processing_pil_idefics3 import Idefics3ImageProcessorPil

    processor = Idefics3Processor(Idefics3ImageProcessorPil.from_pretrained(hf.name_or_path), tok, image_seq_len=4)
    inputs = processor(text=text, images=images or None, add_special_tokens=False, return_tensors="pt")
    with torch.no_grad():
        out = hf.generate(**inputs, max_new_tokens=max_tokens, do_sample=False, min_new_tokens=max_tokens)
    return out[0, inputs["input_ids"].shape[1]:].tolist()


@pytest.mark.parametrize("family", ["idefics3", "smolvlm"])
def test_greedy_generation_matches_hf(tmp_path, family):
    """One image, two images of different sizes, and text only, in one batch, with a block
    size that puts image tokens across block edges and chunked prefill that cuts them."""
    from pagedserve import LLM, SamplingParams

    hf = make_idefics3(tmp_path, family)
    hf.name_or_path = str(tmp_path)
    tok = make_tokenizer()
    cases = [
        ("User:<image>What is it?<end_of_utterance>\nAssistant:", [image(64, 48, 5)]),
        ("User:<image>and<image>?<end_of_utterance>\nAssistant:", [image(30, 20, 6), image(64, 64, 7)]),
        ("User: hello world<end_of_utterance>\nAssistant:", []),
    ]
    llm = LLM(model=str(tmp_path), dtype="float32", max_num_batched_tokens=16, block_size=16,
              speculative_config="off", max_model_len=512)
    prompts = [{"prompt": text, "multi_modal_data": {"image": imgs}} if imgs else {"prompt": text}
               for text, imgs in cases]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    outs = llm.generate(prompts, params, use_tqdm=False)
    for (text, imgs), out in zip(cases, outs, strict=True):
        assert out.outputs[0].token_ids == _hf_greedy(hf, tok, text, imgs, 6), text
