"""The dashboard in a real headless Chromium (Debian's, at /usr/bin/chromium; .ci/run
installs it) against a real `pagedserve serve` running a tiny model.  Everything is
asserted from the page itself: its block counters, queue rows, chart values and the
playground's streamed reply.  Screenshots of both tabs are written to
$PAGEDSERVE_SCREENSHOT_DIR (the README's picture comes from there) or the test's tmp dir."""

from __future__ import annotations

import os
import shutil
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from pagedserve.benchmarks.bench_dashboard import CHROMIUM_ARGS, open_dashboard
from tests.entrypoints.openai.conftest import API_KEY, MODEL_NAME, ServerProcess, make_tiny_model

CHROMIUM = os.environ.get("PAGEDSERVE_CHROMIUM", "/usr/bin/chromium")
pytestmark = pytest.mark.skipif(not shutil.which(CHROMIUM), reason=f"no Chromium at {CHROMIUM} (apt install chromium)")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    model = tmp_path_factory.mktemp("tiny-llama")
    make_tiny_model(model)
    proc = ServerProcess([str(model), "--served-model-name", MODEL_NAME, "--api-key", API_KEY, "--dtype", "float32",
                          "--max-model-len", "256", "--max-num-seqs", "32", "--kv-cache-memory-bytes", "4MiB",
                          "--enforce-eager", "--seed", "0"], tmp_path_factory.mktemp("log") / "server.log")
    yield proc
    proc.stop()


@pytest.fixture()
def page(tmp_path):
    from playwright.sync_api import sync_playwright

    with sync_playwright() as pw:
        context = pw.chromium.launch_persistent_context(
            str(tmp_path / "chromium-profile"), executable_path=CHROMIUM, headless=True, args=CHROMIUM_ARGS,
            viewport={"width": 1400, "height": 1000})
        page = context.pages[0] if context.pages else context.new_page()
        errors: list[str] = []
        page.on("pageerror", lambda e: errors.append(str(e)))
        yield page
        context.close()
        assert not errors, f"the page raised: {errors}"


def _fire_batch(server, n: int, max_tokens: int) -> None:
    from openai import OpenAI

    client = OpenAI(base_url=server.url + "/v1", api_key=API_KEY)
    shared = "Paris is the capital of France. What is the capital of Italy? Rome is. " * 3

    def one(i: int) -> None:
        out = client.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": shared + str(i)}],
                                             max_tokens=max_tokens, temperature=1.0, extra_body={"ignore_eos": True})
        assert out.usage.completion_tokens == max_tokens

    with ThreadPoolExecutor(n) as pool:
        list(pool.map(one, range(n)))


def _seen_while(page, condition: str, batch: threading.Thread) -> bool:
    """Whether `condition` holds on the page at some moment while `batch` runs."""
    from playwright.sync_api import TimeoutError as PlaywrightTimeout

    while batch.is_alive():
        try:
            page.wait_for_function(condition, timeout=1_000)
            return True
        except PlaywrightTimeout:
            pass
    return False


def _in_use(page) -> int:
    return page.evaluate("+document.getElementById('count-used').textContent"
                         " + +document.getElementById('count-shared').textContent")


def test_dashboard_shows_blocks_queues_and_series_live_and_the_playground_streams(server, page, tmp_path):
    shots = Path(os.environ.get("PAGEDSERVE_SCREENSHOT_DIR") or tmp_path)
    shots.mkdir(parents=True, exist_ok=True)
    open_dashboard(page, server.url, API_KEY)  # the page asks for the key when its event stream gets a 401
    assert MODEL_NAME in page.inner_text("#config")
    total = page.evaluate("window.pagedserve.numBlocks")
    assert total > 2 and _in_use(page) == 0

    # While a batch runs (32 requests of 120 tokens: ~1 s, several 250 ms snapshots), one
    # snapshot shows in-use cells and running rows together.  On a loaded machine (a cold
    # CI run under AVX2 emulation, the other worker compiling) a batch once ended without
    # the wait seeing that state, so a batch ended unseen is fired again, four at most.
    live = ("+document.getElementById('count-used').textContent > 0"
            " && document.querySelectorAll('#running tr').length > 0")
    for _ in range(4):
        batch = threading.Thread(target=_fire_batch, args=(server, 32, 120))
        t0 = time.monotonic()
        batch.start()
        if _seen_while(page, live, batch):
            break
        batch.join()
    else:
        pytest.fail("four batches ran and the page never showed in-use blocks and running rows in one snapshot")
    page.screenshot(path=str(shots / "dashboard.png"), full_page=True)
    assert page.evaluate("window.pagedserve.running.every(r => r.state === 'running')")
    batch.join(timeout=120)
    assert not batch.is_alive()
    print(f"the batch took {time.monotonic() - t0:.2f} s")
    # Afterwards: every cell is back to free or cached, the queues are empty, the
    # throughput chart has a point with generated tokens.
    page.wait_for_function("+document.getElementById('count-used').textContent"
                           " + +document.getElementById('count-shared').textContent == 0", timeout=30_000)
    page.wait_for_function("document.querySelectorAll('#running tr').length == 0", timeout=30_000)
    page.wait_for_function("+(document.getElementById('chart-throughput').dataset.gen_tps || 0) > 0 ||"
                           " window.pagedserve.series.some(p => p.gen_tps > 0)", timeout=30_000)
    counts = page.evaluate("window.pagedserve.counts")
    assert counts["cached"] > 0 and counts["cached"] + counts["free"] == total - 1
    assert page.evaluate("window.pagedserve.maxInUseSeen") > 0
    assert page.evaluate("window.pagedserve.series.some(p => p.gen_tps > 0 && p.kv_usage >= 0)")
    page.screenshot(path=str(shots / "dashboard-after.png"), full_page=True)

    page.click("#tab-playground")
    page.fill("#temperature", "0")
    page.fill("#max_tokens", "24")
    page.fill("#message", "What is the capital of Italy?")
    page.click("#send")
    page.wait_for_selector(".msg[data-done='1']", timeout=60_000)
    reply = page.locator(".msg.assistant").first
    assert int(reply.get_attribute("data-chunks")) > 1  # it streamed, chunk by chunk
    assert "completion tokens" in reply.inner_text() and "first token" in reply.inner_text()
    page.fill("#copies", "4")
    page.click("#send-copies")
    page.wait_for_selector("#copies-result[data-done='1']", timeout=60_000)
    assert page.inner_text("#copies-result").startswith("4/4 copies answered")
    page.screenshot(path=str(shots / "playground.png"), full_page=True)
    # A field left blank is the server's default (it was sent as 0: top_p 0 is a 400)
    page.fill("#top_p", "")
    page.fill("#message", "And of Spain?")
    page.click("#send")
    page.wait_for_selector(".msg.assistant:nth-of-type(4)[data-done='1'], .msg.error[data-done='1']", timeout=60_000)
    assert page.locator(".msg.error").count() == 0 and page.locator(".msg.assistant").count() == 2
    _stop_clear_hidden_tab_and_key(page)


def _stop_clear_hidden_tab_and_key(page) -> None:
    """Stop ends a reply (there was no way but closing the page); Clear during a reply
    cleared the screen, then the reply came back as hidden history of the next message;
    a hidden tab gives its event stream up (six held every connection a browser opens to
    a host); a refused key says so; the key is never kept on disk (localStorage)."""
    bodies: list[dict] = []
    page.on("request", lambda r: bodies.append(r.post_data_json) if r.url.endswith("/v1/chat/completions") else None)
    held: list = []  # the reply is held at the network until the button is clicked
    for button in ("#stop", "#clear"):
        held.clear()
        page.route("**/v1/chat/completions", lambda route: held.append(route))
        page.fill("#message", "Count to ten.")
        page.click("#send")
        while not held:
            page.wait_for_timeout(50)
        page.click(button)
        page.unroute("**/v1/chat/completions")
        try:
            held[0].continue_()
        except Exception:  # noqa: BLE001 - (the page aborted it)
            pass
        if button == "#stop":
            page.wait_for_selector(".msg.assistant:last-of-type[data-done='1']", timeout=30_000)
            assert page.locator(".msg.assistant").last.inner_text().endswith("stopped")
    page.wait_for_timeout(2_000)  # (time for a reply that was not stopped to come back)
    assert page.locator(".msg").count() == 0
    page.fill("#message", "hello")
    page.click("#send")
    page.wait_for_selector(".msg.assistant[data-done='1']", timeout=60_000)
    assert [m["content"] for m in bodies[-1]["messages"] if m["role"] != "system"] == ["hello"]
    events = page.evaluate("window.pagedserve.events")
    page.evaluate("Object.defineProperty(document, 'hidden', {configurable: true, get: () => true});"
                  "document.dispatchEvent(new Event('visibilitychange'))")
    assert "paused" in page.inner_text("#status")
    time.sleep(1.5)  # (snapshots come every 250 ms to a page that streams)
    paused = page.evaluate("window.pagedserve.events")
    assert paused - events <= 2
    page.evaluate("Object.defineProperty(document, 'hidden', {configurable: true, get: () => false});"
                  "document.dispatchEvent(new Event('visibilitychange'))")
    page.wait_for_function(f"window.pagedserve.events > {paused}", timeout=30_000)
    assert page.evaluate("localStorage.length") == 0
    page.evaluate("sessionStorage.setItem('pagedserve-api-key', 'wrong')")
    page.reload()
    page.wait_for_selector("#key-form:not([hidden])", timeout=30_000)
    assert "refused" in page.inner_text("#status")


def test_a_pooling_server_offers_no_playground(page, tmp_path):
    """A pooling model answers no chat: its page offered the Playground, whose every
    message and "Send N copies" came back refused."""
    model = tmp_path / "tiny-llama"
    make_tiny_model(model)
    proc = ServerProcess([str(model), "--runner", "pooling", "--dtype", "float32", "--max-model-len", "256",
                          "--kv-cache-memory-bytes", "4MiB", "--enforce-eager", "--api-key", API_KEY],
                         tmp_path / "pooling.log")
    try:
        open_dashboard(page, proc.url, API_KEY)
        assert page.is_hidden("#tab-playground") and page.is_visible("#tab-dashboard")
        assert "pooling" in page.inner_text("#config")
    finally:
        proc.stop()
