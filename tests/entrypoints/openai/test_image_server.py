"""Images through the real server with the official clients (tiny Idefics3 checkpoint):
the answer equals the offline engine's, a repeated image reports cached tokens while a
different image of the same size reuses only the text before it, and hostile images get
a 400 naming the problem while the server keeps serving."""

from __future__ import annotations

import base64
import io
import threading

import httpx
import openai
import pytest

from tests.entrypoints.openai.conftest import API_KEY, ServerProcess
from tests.lazy_module import LazyModule
from tests.models import gemma3_mm_helpers, qwen2_vl_helpers
from tests.models.idefics3_helpers import image, make_idefics3
from tests.multimodal.test_image import png_header_only

anthropic = LazyModule("anthropic")

NAME = "tiny-vlm"
QUESTION = "Describe the picture in the quick brown fox's words, please:"


def data_url(img, fmt: str = "PNG") -> str:
    buf = io.BytesIO()
    img.save(buf, format=fmt)
    return f"data:image/{fmt.lower()};base64," + base64.b64encode(buf.getvalue()).decode()


def messages(url: str) -> list[dict]:
    return [{"role": "user", "content": [{"type": "text", "text": QUESTION},
                                         {"type": "image_url", "image_url": {"url": url}}]}]


@pytest.fixture(scope="module")
def vlm(tmp_path_factory):
    """One server of the three families' tiny checkpoints (--models-dir): `NAME` is Idefics3's."""
    models = tmp_path_factory.mktemp("vlms")
    make_idefics3(models / NAME)
    gemma3_mm_helpers.save_checkpoint(str(models / "tiny-gemma3"))
    qwen2_vl_helpers.save_checkpoint(str(models / "tiny-qwen2-vl"), "qwen2_vl")
    proc = ServerProcess(["--models-dir", str(models), "--max-loaded-models", "3", "--api-key", API_KEY,
                          "--dtype", "float32", "--max-model-len", "256", "--block-size", "16",
                          "--speculative-config", "off", "--limit-mm-per-prompt", '{"image": 2}'],
                         tmp_path_factory.mktemp("log") / "vlm.log")
    yield models / NAME, proc
    proc.stop()


def test_answers_and_cached_tokens(vlm) -> None:
    from pagedserve import LLM, SamplingParams

    path, server = vlm
    client = openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY)
    url = data_url(image(64, 48, 11))

    def ask(u: str):
        return client.chat.completions.create(model=NAME, messages=messages(u), max_tokens=6, temperature=0,
                                              extra_body={"ignore_eos": True})

    first, again, other = ask(url), ask(url), ask(data_url(image(64, 48, 12)))
    assert again.choices[0].message.content == first.choices[0].message.content
    n = first.usage.prompt_tokens
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert again.usage.prompt_tokens_details.cached_tokens == (n - 1) // 16 * 16
    assert 0 < other.usage.prompt_tokens_details.cached_tokens < again.usage.prompt_tokens_details.cached_tokens
    offline = LLM(model=str(path), dtype="float32", max_model_len=512, speculative_config="off")
    want = offline.chat(messages(url), SamplingParams(temperature=0, max_tokens=6, ignore_eos=True), use_tqdm=False)
    assert first.choices[0].message.content == want[0].outputs[0].text


@pytest.mark.parametrize("name", ["tiny-gemma3", "tiny-qwen2-vl"])
def test_each_family_answers_as_offline(vlm, name: str) -> None:
    """Gemma 3 and Qwen2-VL through the server with a data: URL answer as LLM.chat does
    (which tests/models checks against HF greedy); Idefics3's is test_answers_and_cached_tokens."""
    from pagedserve import LLM, BeamSearchParams, SamplingParams

    path, server = vlm
    url = data_url(image(50, 40, 31))
    chat = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                         {"type": "text", "text": "Describe the image."}]}]
    client = openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY)
    served = client.chat.completions.create(model=name, messages=chat, max_tokens=6, temperature=0,
                                            extra_body={"ignore_eos": True})
    offline = LLM(model=str(path.parent / name), dtype="float32", max_model_len=256, speculative_config="off")
    want = offline.chat(chat, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True), use_tqdm=False)[0]
    assert served.choices[0].message.content == want.outputs[0].text
    assert served.usage.prompt_tokens == len(want.prompt_token_ids) > 10
    # vLLM's use_beam_search: the offline search's beams (every step with the image)
    beams = client.chat.completions.create(model=name, messages=chat, n=2, max_tokens=4, temperature=0,
                                           extra_body={"use_beam_search": True, "ignore_eos": True})
    prompt = offline.llm_engine.encode_chat(chat)
    searched = offline.beam_search([prompt], BeamSearchParams(beam_width=2, max_tokens=4, ignore_eos=True))[0]
    decode = offline.get_tokenizer().decode
    assert [c.message.content for c in beams.choices] == \
        [decode(s.tokens[len(want.prompt_token_ids):], skip_special_tokens=True) for s in searched.sequences]


def test_responses_anthropic_and_ollama_take_images(vlm, tmp_path) -> None:
    _, server = vlm
    url = data_url(image(32, 32, 13))
    client = openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY)
    r = client.responses.create(model=NAME, max_output_tokens=4, temperature=0, input=[{"role": "user", "content": [
        {"type": "input_text", "text": QUESTION}, {"type": "input_image", "image_url": url}]}])
    assert r.status in ("completed", "incomplete") and r.usage.input_tokens > 20  # (4 tokens may cut it)
    claude = anthropic.Anthropic(base_url=server.url, api_key=API_KEY)
    b64 = url.split(",", 1)[1]
    m = claude.messages.create(model=NAME, max_tokens=4, messages=[{"role": "user", "content": [
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": b64}},
        {"type": "text", "text": QUESTION}]}])
    assert m.usage.input_tokens > 20
    import ollama

    local = ollama.Client(host=server.url, headers={"Authorization": f"Bearer {API_KEY}"})
    o = local.chat(NAME, [{"role": "user", "content": QUESTION, "images": [b64]}], options={"num_predict": 2})
    assert o.prompt_eval_count == m.usage.input_tokens  # the same prompt: image first, then the text
    # A JPEG file, which Ollama's client sends as its base64: that starts "/9j/", no path.
    image(32, 32, 13).save(tmp_path / "photo.jpg")
    o = local.chat(NAME, [{"role": "user", "content": QUESTION, "images": [tmp_path / "photo.jpg"]}],
                   options={"num_predict": 2})
    assert o.prompt_eval_count == m.usage.input_tokens
    # Each route's own shape of a wrong image names it: Ollama's base64 (not a data: URL),
    # Anthropic's four media types.
    r = httpx.post(server.url + "/api/chat", headers={"Authorization": f"Bearer {API_KEY}"}, timeout=60,
                   json={"model": NAME, "messages": [{"role": "user", "content": QUESTION, "images": [url]}]})
    assert r.status_code == 400 and "images[0] must be the image file's bytes in base64" in r.json()["error"], r.text
    with pytest.raises(anthropic.BadRequestError, match="media_type must be one of image/jpeg"):
        claude.messages.create(model=NAME, max_tokens=4, messages=[{"role": "user", "content": [
            {"type": "image", "source": {"type": "base64", "media_type": "image/svg+xml", "data": b64}}]}])
    with pytest.raises(anthropic.BadRequestError, match="'detail' is not a field of a base64 image source"):
        claude.messages.create(model=NAME, max_tokens=4, messages=[{"role": "user", "content": [
            {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": b64, "detail": "low"}}]}])


BOMB = "data:image/png;base64," + base64.b64encode(png_header_only(30_000, 30_000)).decode()


@pytest.mark.parametrize("content, match", [
    ([{"type": "image_url", "image_url": {"url": BOMB}}], "more pixels than the limit"),
    ([{"type": "image_url", "image_url": {"url": "data:image/png;base64,aGVsbG8gd29ybGQ="}}], "not a PNG"),
    ([{"type": "image_url", "image_url": {"url": "file:///etc/passwd"}}], "data: URLs"),
    ([{"type": "image_url", "image_url": {"url": "http://169.254.169.254/latest"}}], "fetches no image URLs"),
    ([{"type": "image_url", "image_url": {"url": data_url(image(8, 8, i))}} for i in range(3)],
     "more than the 2 limit_mm_per_prompt"),
    ([{"type": "image_url"}], "needs its image"),
    # Keys beside an image (they were dropped): a stray one, and vLLM's cache id.
    ([{"type": "image_url", "image_url": {"url": data_url(image(8, 8, 1)), "foo": 1}}],
     "'foo' is not a field of an image_url"),
    ([{"type": "image_url", "image_url": {"url": data_url(image(8, 8, 1))}, "uuid": "abc"}],
     "uuid is not supported: images are cached here by their content"),
])
def test_hostile_images_get_a_named_400_and_the_server_keeps_serving(vlm, content, match) -> None:
    _, server = vlm
    headers = {"Authorization": f"Bearer {API_KEY}"}
    good: list[int] = []
    worker = threading.Thread(target=lambda: good.append(httpx.post(
        server.url + "/v1/chat/completions", headers=headers, timeout=60,
        json={"model": NAME, "max_tokens": 8, "messages": messages(data_url(image(32, 32, 1)))}).status_code))
    worker.start()
    r = httpx.post(server.url + "/v1/chat/completions", headers=headers, timeout=60,
                   json={"model": NAME, "max_tokens": 2, "messages": [{"role": "user", "content": content}]})
    worker.join()
    assert r.status_code == 400, r.text
    assert match in r.json()["error"]["message"]
    assert good == [200]
    assert httpx.get(server.url + "/health", timeout=10).status_code == 200


def test_an_image_tokens_text_in_a_message_is_text_not_an_image_slot(vlm) -> None:
    """A user who writes the model's image token ("<image>") in their text gets it read as
    text (engine/special_text.py): the prompt's image slots are the images sent (it was
    refused as a placeholder count that did not match; before that check, a forged slot)."""
    _, server = vlm
    headers = {"Authorization": f"Bearer {API_KEY}"}
    one = data_url(image(8, 8, 1))

    def prompt_tokens(text: str) -> int:
        r = httpx.post(server.url + "/v1/chat/completions", headers=headers, timeout=60, json={
            "model": NAME, "max_tokens": 1, "messages": [{"role": "user", "content": [
                {"type": "image_url", "image_url": {"url": one}}, {"type": "text", "text": text}]}]})
        assert r.status_code == 200, r.text
        return r.json()["usage"]["prompt_tokens"]

    # As text, "<image>" is a few plain tokens ("<", "image", ">"), not the one image token.
    assert prompt_tokens("<image>") - prompt_tokens("") >= 2


def test_the_playground_sends_an_attached_image(vlm, tmp_path) -> None:
    """In headless Chromium: the Image button's file goes with the message as an image_url
    part (the reply's prompt counts the image's tokens) and shows in the transcript."""
    import os
    import shutil

    chromium = os.environ.get("PAGEDSERVE_CHROMIUM", "/usr/bin/chromium")
    if not shutil.which(chromium):
        pytest.skip(f"no Chromium at {chromium} (apt install chromium)")
    from playwright.sync_api import sync_playwright

    from pagedserve.benchmarks.bench_dashboard import CHROMIUM_ARGS, open_dashboard

    _, server = vlm
    picture = tmp_path / "picture.png"
    image(40, 30, 21).save(picture)
    with sync_playwright() as pw:
        context = pw.chromium.launch_persistent_context(str(tmp_path / "profile"), executable_path=chromium,
                                                        headless=True, args=CHROMIUM_ARGS)
        page = context.pages[0] if context.pages else context.new_page()
        errors: list[str] = []
        page.on("pageerror", lambda e: errors.append(str(e)))
        open_dashboard(page, server.url, API_KEY)
        page.click("#tab-playground")
        page.fill("#temperature", "0")
        page.fill("#max_tokens", "4")
        for attach in (True, False):
            if attach:
                page.set_input_files("#image", str(picture))
            page.fill("#message", "What is it?")
            page.click("#send")
            page.wait_for_function("document.querySelectorAll('.msg.assistant[data-done=\"1\"]').length == "
                                   f"{1 if attach else 2}", timeout=60_000)
        replies = page.locator(".msg.assistant")
        with_image, without = (int(replies.nth(i).inner_text().split(" prompt")[0].split()[-1]) for i in (0, 1))
        assert page.locator(".msg.user img.thumb").count() == 1
        assert page.evaluate("document.getElementById('image').value") == ""  # sent once, then cleared
        context.close()
    assert not errors, errors
    assert with_image > 20 and without > with_image  # the second turn carries the first (and its image)


def test_a_pooling_server_embeds_images_in_vllms_chat_form(tmp_path) -> None:
    """/v1/embeddings with `messages` (vLLM's chat form) on `--runner pooling`: the server
    had no way to embed an image.  The same image gives the same embedding (from the
    prefix cache the second time), another image another one; the image bound holds."""
    import numpy as np

    make_idefics3(tmp_path / NAME)
    proc = ServerProcess([str(tmp_path / NAME), "--runner", "pooling", "--dtype", "float32", "--max-model-len", "256",
                          "--limit-mm-per-prompt", '{"image": 1}'], tmp_path / "pooling.log")
    try:
        def embed(*urls: str) -> httpx.Response:
            content = [{"type": "text", "text": QUESTION}, *({"type": "image_url", "image_url": {"url": u}} for u in urls)]
            return httpx.post(proc.url + "/v1/embeddings", json={"messages": [{"role": "user", "content": content}]},
                              timeout=60)

        first, again, other = (embed(data_url(image(64, 48, seed))) for seed in (11, 11, 12))
        vectors = [np.array(r.json()["data"][0]["embedding"]) for r in (first, again, other)]
        assert again.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
        assert np.allclose(vectors[0], vectors[1], atol=1e-5) and not np.allclose(vectors[0], vectors[2], atol=1e-3)
        assert first.json()["usage"]["prompt_tokens"] > 30  # the image's rows counted
        two = embed(data_url(image(64, 48, 11)), data_url(image(64, 48, 12)))
        assert two.status_code == 400 and "image" in two.json()["error"]["message"], two.text
    finally:
        proc.stop()
