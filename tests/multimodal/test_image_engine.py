"""Images through the engine on a tiny Idefics3 checkpoint: prefix-cache blocks keyed by
the image, the encoder cache, preemption (recompute and swap), the radix tree, and the
intake's refusals."""

from __future__ import annotations

import pytest

from pagedserve import LLM, SamplingParams
from pagedserve.errors import ImageInputError
from tests.models.idefics3_helpers import image, make_idefics3

# 20 text tokens or so before the image: the first block holds text only.
PREFIX = "User: the quick brown fox jumps over the lazy dog. Look:"
GREEDY = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("idefics3-engine")
    make_idefics3(path)
    return str(path)


@pytest.fixture(scope="module")
def fresh(model_dir):
    """The reference: no prefix caching, nothing shared between requests."""
    return LLM(model=model_dir, dtype="float32", speculative_config="off", max_model_len=512,
               enable_prefix_caching=False)


@pytest.fixture(scope="module")
def limited(model_dir):
    return LLM(model=model_dir, dtype="float32", speculative_config="off", max_model_len=512,
               limit_mm_per_prompt={"image": 1})


def prompt(img, text: str = "What is it?") -> dict:
    return {"prompt": f"{PREFIX}<image>{text}<end_of_utterance>\nAssistant:", "multi_modal_data": {"image": img}}


def run(llm: LLM, prompts: list, params: SamplingParams = GREEDY) -> list:
    return llm.generate(prompts, params, use_tqdm=False)


def test_the_same_image_reuses_blocks_and_its_encoder_output_a_different_one_does_not(model_dir, fresh) -> None:
    llm = LLM(model=model_dir, dtype="float32", block_size=16, speculative_config="off", max_model_len=512)
    first, again = run(llm, [prompt(image(64, 48, 1))]), run(llm, [prompt(image(64, 48, 1))])
    other = run(llm, [prompt(image(64, 48, 2))])[0]
    n = len(first[0].prompt_token_ids)
    assert first[0].num_cached_tokens == 0
    assert again[0].num_cached_tokens == (n - 1) // 16 * 16  # every full block
    assert again[0].outputs[0].token_ids == first[0].outputs[0].token_ids
    image_offset = llm.llm_engine.input_processor.process_prompt(prompt(image(64, 48, 2))).images[0].offset
    assert other.num_cached_tokens == image_offset // 16 * 16 > 0  # the text before the image only
    assert other.outputs[0].token_ids == run(fresh, [prompt(image(64, 48, 2))])[0].outputs[0].token_ids
    runner = llm.llm_engine.model_executor
    assert runner.images.encoder_runs == 2  # the repeated image was not encoded again


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption_keeps_answers(model_dir, fresh, mode: str) -> None:
    """Eight image requests in a KV cache too small for them all: preempted requests come
    back (recomputed, or swapped back in) with the answers an unhurried engine gives."""
    prompts = [prompt(image(64, 48 + i, i), f"Q{i}?") for i in range(8)]
    long = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)  # decodes that need new blocks
    want = [o.outputs[0].token_ids for o in run(fresh, prompts, long)]
    tight = LLM(model=model_dir, dtype="float32", speculative_config="off", max_model_len=128, block_size=16,
                num_gpu_blocks_override=20, preemption_mode=mode, max_num_batched_tokens=64,
                enable_prefix_caching=False)
    got = [o.outputs[0].token_ids for o in run(tight, prompts, long)]
    assert tight.llm_engine.scheduler.num_preemptions_total > 0
    assert got == want


def test_radix_matching_never_reuses_another_images_tokens(model_dir, fresh) -> None:
    llm = LLM(model=model_dir, dtype="float32", block_size=16, speculative_config="off", max_model_len=512,
              prefix_caching_algo="radix")
    for seed in (3, 4):
        assert run(llm, [prompt(image(64, 48, seed))])[0].outputs[0].token_ids == \
            run(fresh, [prompt(image(64, 48, seed))])[0].outputs[0].token_ids


def test_chat_with_image_parts_matches_the_prompt_form(limited) -> None:
    import base64
    import io

    llm = limited
    img = image(40, 40, 9)
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    url = "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()
    chat = llm.chat([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                                 {"type": "text", "text": "What is it?"}]}], GREEDY, use_tqdm=False)
    text = "<|im_start|>User:<image>What is it?<end_of_utterance>\nAssistant:"
    direct = run(llm, [{"prompt": text, "multi_modal_data": {"image": img}}])
    assert chat[0].prompt_token_ids == direct[0].prompt_token_ids
    assert chat[0].outputs[0].token_ids == direct[0].outputs[0].token_ids


def test_chat_takes_vllms_image_pil_parts_and_refuses_embeds_and_unknown_details(limited) -> None:
    img, question = image(40, 40, 9), {"type": "text", "text": "What is it?"}

    def chat(part: dict) -> list[int]:
        out = limited.chat([{"role": "user", "content": [part, question]}], GREEDY, use_tqdm=False)
        return out[0].outputs[0].token_ids

    assert chat({"type": "image_pil", "image_pil": img}) == chat({"type": "image", "image": img})
    for part, match in [({"type": "image_embeds", "image_embeds": [[0.0]]}, "image_embeds content parts"),
                        ({"type": "image_url", "image_url": {"url": "data:,", "detail": {"x": 1}}},
                         "detail must be one of auto, low, high")]:
        with pytest.raises(ImageInputError, match=match):
            chat(part)


def test_intake_refusals_name_the_problem(limited) -> None:
    llm = limited
    ip = llm.llm_engine.input_processor
    two = {"prompt": "<image><image>", "multi_modal_data": {"image": [image(8, 8, 1), image(8, 8, 2)]}}
    for bad, match in [
        (two, "more than the 1 limit_mm_per_prompt allows"),
        ({"prompt": "no placeholder", "multi_modal_data": {"image": image(8, 8, 1)}}, "0 image placeholder"),
        ({"prompt": "<image>", "multi_modal_data": {"video": []}}, "takes {'image'"),
        ({"prompt_token_ids": [1, 2], "multi_modal_data": {"image": image(8, 8, 1)}}, "needs the prompt as text"),
    ]:
        with pytest.raises(ImageInputError, match=match):
            ip.process_prompt(bad)
    # The token that takes an image's rows, in a prompt without images (text or ids): refused
    # as a wrong count is where there are images.
    image_id = ip.image_prompts.image_token_id
    for bad in ["User: <image> what is it?", {"prompt_token_ids": [1, image_id, 2]}]:
        with pytest.raises(ImageInputError, match=f"holds the image token \\(id {image_id}"):
            ip.process("r", bad, GREEDY)
    # the engine goes on serving
    assert run(llm, [prompt(image(16, 16, 1))])[0].outputs[0].token_ids


def test_an_image_that_can_never_fit_is_refused_before_it_is_decoded(model_dir, monkeypatch) -> None:
    """Its encoder rows are counted from the header's size: nothing is decoded (a PNG of
    headers only would be "corrupt" if it were)."""
    from pagedserve.engine import input_processor
    from tests.multimodal.test_image import data_url, png_header_only

    # (this tiny checkpoint resizes every image to 2 x 2 tiles and a global view: 20 rows)
    llm = LLM(model=model_dir, dtype="float32", speculative_config="off", max_model_len=512, encoder_cache_size=16)
    decoded: list[object] = []
    decode = input_processor.decode
    monkeypatch.setattr(input_processor, "decode", lambda *a: decoded.append(a) or decode(*a))
    with pytest.raises(ImageInputError, match="takes 20 encoder rows, more than the encoder cache holds \\(16"):
        run(llm, [prompt(data_url(png_header_only(3000, 2000)))])
    assert decoded == []
    assert run(llm, ["User: what is it?"])[0].outputs[0].token_ids  # (the engine goes on)


def test_a_prompts_images_are_decoded_and_processed_within_the_pixel_budget(limited, monkeypatch) -> None:
    """Intake holds the prompt's header-declared pixels in the process's budget from
    before decoding until the processor is done (multimodal/image.py's DECODING): so
    many prompts of large images cannot all hold their pixels at once."""
    import base64
    import io

    from pagedserve.engine import input_processor
    from pagedserve.multimodal.image import PixelBudget

    seen: list[tuple[str, int]] = []

    class Recording(PixelBudget):
        def hold(self, pixels: int, timeout: float = 1.0):
            seen.append(("hold", pixels))
            return super().hold(pixels, timeout)

    budget = Recording(10**6)
    monkeypatch.setattr(input_processor, "DECODING", budget)
    decode = input_processor.decode
    monkeypatch.setattr(input_processor, "decode", lambda *a: seen.append(("decode", budget.held)) or decode(*a))
    process = limited.llm_engine.input_processor.image_prompts.process
    monkeypatch.setattr(limited.llm_engine.input_processor.image_prompts, "process",
                        lambda *a: seen.append(("process", budget.held)) or process(*a))
    buf = io.BytesIO()
    image(40, 30, 3).save(buf, format="PNG")
    url = "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()
    out = limited.chat([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                                    {"type": "text", "text": "What is it?"}]}], GREEDY,
                       use_tqdm=False)
    assert out[0].outputs[0].token_ids and budget.held == 0
    assert seen == [("hold", 1200), ("decode", 1200), ("process", 1200)]  # decoded and processed while held
