"""LoRA adapters through `pagedserve serve` with the official `openai` client: two adapters
from --lora-modules and the base answered by name in one burst (each as HF + PEFT
answers), /v1/models listing the adapters with their parent, an adapter loaded and
unloaded at runtime, and bad adapters refused by name with the server going on."""

from __future__ import annotations

import asyncio
import json

import httpx
import openai
import pytest
import torch

from tests.entrypoints.openai.conftest import API_KEY, MODEL_NAME, SERVER_FLAGS, ServerProcess
from tests.lora.peft_helpers import make_adapter, peft_greedy

PROMPTS = [[5, 9, 33, 70, 2, 8], [60, 20, 30, 11]]
TOKENS = 8


@pytest.fixture(scope="module")
def adapters(tiny_model_dir, tmp_path_factory):
    """Three good adapters (two served from the start, one loaded at runtime), a rank-16
    one, and each good one's HF + PEFT greedy tokens (the base's under None)."""
    import transformers

    d = tmp_path_factory.mktemp("adapters")
    base = transformers.AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    good = {name: make_adapter(base, str(d / name), seed=i, scale=0.5) for i, name in enumerate(("a1", "a2", "a3"))}
    big = make_adapter(base, str(d / "rank16"), seed=5, r=16)
    refs = {name: [t for t, _ in peft_greedy(base, path, PROMPTS, TOKENS)] for name, path in
            [(None, None), *good.items()]}
    return good, big, refs


@pytest.fixture(scope="module")
def lora_server(tiny_model_dir, adapters, tmp_path_factory):
    good, _, _ = adapters
    spec = json.dumps({"name": "a2", "path": good["a2"], "base_model_name": MODEL_NAME})
    proc = ServerProcess([str(tiny_model_dir), *SERVER_FLAGS, "--max-loras", "2", "--max-lora-rank",
                          "8", "--lora-modules", f"a1={good['a1']}", spec],
                         tmp_path_factory.mktemp("log") / "server.log")
    yield proc
    proc.stop()


AUTH = {"Authorization": f"Bearer {API_KEY}"}


def good_path_hidden(text: str, adapters) -> bool:
    """No adapter's path on the server's disk is in `text`."""
    return not any(path in text for path in adapters[0].values())


def texts(tokenizer, refs: list[list[int]]) -> list[str]:
    return [tokenizer.decode(t, skip_special_tokens=True) for t in refs]


async def complete(client: openai.AsyncOpenAI, model: str, prompt: list[int]) -> str:
    out = await client.completions.create(model=model, prompt=prompt, max_tokens=TOKENS, temperature=0.0,
                                          extra_body={"ignore_eos": True})
    assert out.model == model
    return out.choices[0].text


def complete_one(url: str, model: str, prompt: list[int]) -> str:
    async def one() -> str:
        return await complete(openai.AsyncOpenAI(base_url=url + "/v1", api_key=API_KEY), model, prompt)

    return asyncio.run(one())


def test_two_adapters_and_the_base_answer_by_name_in_one_burst(lora_server, adapters, tokenizer) -> None:
    _, _, refs = adapters
    models = [MODEL_NAME, "a1", "a2"] * 3

    async def burst() -> list[str]:
        client = openai.AsyncOpenAI(base_url=lora_server.url + "/v1", api_key=API_KEY)
        return await asyncio.gather(*(complete(client, m, p) for m in models for p in PROMPTS))

    got = asyncio.run(burst())
    want = [text for m in models for text in texts(tokenizer, refs[None if m == MODEL_NAME else m])]
    assert got == want
    assert len(set(want[:6])) == 6, "the adapters must change the answers, or the test shows nothing"
    info = [dict(labels) for name, labels in lora_server.metrics() if name == "vllm:lora_requests_info"]
    assert len(info) == 1 and info[0]["max_lora"] == "2", info  # (vLLM's series; at rest no adapter runs)
    listed = {m.id: m for m in openai.OpenAI(base_url=lora_server.url + "/v1", api_key=API_KEY).models.list().data}
    assert set(listed) == {MODEL_NAME, "a1", "a2"}
    assert listed["a1"].parent == listed["a2"].parent == MODEL_NAME
    assert getattr(listed[MODEL_NAME], "parent", None) is None
    one = openai.OpenAI(base_url=lora_server.url + "/v1", api_key=API_KEY).models.retrieve("a2")
    assert one.id == "a2" and one.parent == MODEL_NAME and "/" not in (one.root or "")  # no server path shown

    # Ollama's listing and show too (a client that picks models from /api/tags saw no adapter)
    tags = {m["name"]: m for m in httpx.get(lora_server.url + "/api/tags", headers=AUTH, timeout=30).json()["models"]}
    assert set(tags) == {MODEL_NAME, "a1", "a2"} and tags["a1"]["details"]["parent_model"] == MODEL_NAME
    assert tags["a1"]["digest"] != tags["a2"]["digest"] and tags[MODEL_NAME]["details"]["parent_model"] == ""
    shown = httpx.post(lora_server.url + "/api/show", json={"model": "a1:latest"}, headers=AUTH, timeout=30)
    assert shown.status_code == 200 and shown.json()["details"]["parent_model"] == MODEL_NAME, shown.text
    assert "ADAPTER a1" in shown.json()["modelfile"] and good_path_hidden(shown.text, adapters)


def test_an_adapter_loaded_and_unloaded_at_runtime(lora_server, adapters, tokenizer) -> None:
    good, _, refs = adapters
    headers = {"Authorization": f"Bearer {API_KEY}"}
    url = lora_server.url
    body = {"lora_name": "a3", "lora_path": good["a3"]}
    assert httpx.post(url + "/v1/load_lora_adapter", json=body, timeout=30).status_code == 401  # the API key guards it
    r = httpx.post(url + "/v1/load_lora_adapter", json=body, headers=headers, timeout=30)
    assert r.status_code == 200, r.text
    assert complete_one(url, "a3", PROMPTS[0]) == texts(tokenizer, refs["a3"])[0]
    again = httpx.post(url + "/v1/load_lora_adapter", json=body, headers=headers, timeout=30)
    assert again.status_code == 400 and "already loaded" in again.json()["error"]["message"]
    # vLLM's load_inplace replaces it (a1's weights now answer as a3); a base_model_name
    # that is not the model adapters belong to is refused by name (it was ignored)
    other = {"base_model_name": "zzz", **body}
    r = httpx.post(url + "/v1/load_lora_adapter", json=other, headers=headers, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "base_model_name"
    inplace = {"lora_name": "a3", "lora_path": good["a1"], "load_inplace": True, "base_model_name": MODEL_NAME}
    r = httpx.post(url + "/v1/load_lora_adapter", json=inplace, headers=headers, timeout=30)
    assert r.status_code == 200, r.text
    assert complete_one(url, "a3", PROMPTS[0]) == texts(tokenizer, refs["a1"])[0]
    r = httpx.post(url + "/v1/unload_lora_adapter", json={"lora_name": "a3"}, headers=headers, timeout=30)
    assert r.status_code == 200, r.text
    with pytest.raises(openai.NotFoundError, match="a3"):
        complete_one(url, "a3", PROMPTS[0])
    r = httpx.post(url + "/v1/unload_lora_adapter", json={"lora_name": "a3"}, headers=headers, timeout=30)
    assert r.status_code == 404


def test_bad_adapters_are_refused_by_name_and_nothing_else_changes(lora_server, adapters, tokenizer,
                                                                   tmp_path) -> None:
    _, big, refs = adapters
    headers = {"Authorization": f"Bearer {API_KEY}"}
    url = lora_server.url
    (tmp_path / "adapter_model.bin").write_bytes(b"not a pickle we would ever load")
    (tmp_path / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 4, "lora_alpha": 8}))
    cases = [({"lora_name": "big", "lora_path": big}, "rank r is over the maximum 8"),
             ({"lora_name": "gone", "lora_path": "/nonexistent/adapter"}, "is not a directory"),
             ({"lora_name": "pickled", "lora_path": str(tmp_path)}, "adapter_model.bin is a pickle"),
             ({"lora_name": MODEL_NAME, "lora_path": big}, "the base model's served name"),
             ({"lora_name": MODEL_NAME + ":latest", "lora_path": big}, "Ollama's routes read NAME:latest as NAME"),
             # beside adapter a1, its Ollama reading would be a1 (Ollama's routes answered as a1)
             ({"lora_name": "a1:latest", "lora_path": big}, "name it 'a1'"),
             ({"lora_name": "a\nb", "lora_path": big}, "control characters")]
    for body, message in cases:
        r = httpx.post(url + "/v1/load_lora_adapter", json=body, headers=headers, timeout=30)
        assert r.status_code == 400, r.text
        assert message in r.json()["error"]["message"]
    assert complete_one(url, "a1", PROMPTS[1]) == texts(tokenizer, refs["a1"])[1]
    names = {m.id for m in openai.OpenAI(base_url=url + "/v1", api_key=API_KEY).models.list().data}
    assert names == {MODEL_NAME, "a1", "a2"}


def test_a_bad_adapter_at_start_up_stops_it_naming_the_adapter(monkeypatch) -> None:
    """The start-up's error names the --lora-modules entry (it said only what was wrong)."""
    from types import SimpleNamespace

    from pagedserve.engine import async_llm
    from pagedserve.entrypoints.openai.api_server import ServerState, make_engine_client
    from pagedserve.entrypoints.openai.serving_models import LoRAAdapters
    from pagedserve.lora.request import LoRARequest

    def refuse(lora):
        raise ValueError("the adapter's rank r is over the maximum 8")

    engine = SimpleNamespace(add_lora=refuse)
    monkeypatch.setattr(async_llm, "make_engine_core_client", lambda *a, **k: SimpleNamespace(local_engine=engine))
    state = ServerState(served_model_names=["base"],
                        lora_adapters=LoRAAdapters({"wide": LoRARequest("wide", 1, "/adapters/wide")}))
    with pytest.raises(ValueError, match=r"--lora-modules wide=/adapters/wide: the adapter's rank r is over"):
        make_engine_client(None, state, {})


def test_an_adapter_path_that_is_not_a_directory_is_refused_before_the_model_loads(tmp_path) -> None:
    """It passed the checks made before the port opens; the load found it afterwards."""
    from pagedserve.entrypoints.openai.serving_models import parse_lora_modules

    (tmp_path / "file").write_text("")
    for path in (tmp_path / "none", tmp_path / "file"):
        with pytest.raises(ValueError, match=f"--lora-modules a: '{path}' is not a directory"):
            parse_lora_modules([f"a={path}"], ["base"])
    assert parse_lora_modules([f"a={tmp_path}"], ["base"])["a"].lora_path == str(tmp_path)


def test_a_base_model_name_must_be_one_the_model_is_served_under(tmp_path) -> None:
    """It is each listing's parent, which clients then ask for: a name served nowhere was
    accepted at start-up (and then a 404), while the load route refused an alias."""
    from pagedserve.entrypoints.openai.serving_models import check_base_model_name, parse_lora_modules

    spec = json.dumps({"name": "a", "path": str(tmp_path), "base_model_name": "smollm2"})
    with pytest.raises(ValueError, match=r"--lora-modules 'a': base_model_name 'smollm2' is not a name the base "
                                         r"model is served under \('base', 'alias'\)"):
        parse_lora_modules([spec], ["base", "alias"])
    spec = json.dumps({"name": "a", "path": str(tmp_path), "base_model_name": "alias"})
    assert parse_lora_modules([spec], ["base", "alias"])["a"].base_model_name == "alias"
    check_base_model_name("alias", ["base", "alias"])  # (the load route's check)
    check_base_model_name(None, ["base"])


def test_an_adapter_loaded_at_runtime_keeps_its_base_model_name(tmp_path) -> None:
    """The load route checked base_model_name, then dropped it: listings showed the base's
    first name as the parent, and a load_inplace lost the one --lora-modules had set."""
    import asyncio

    from pagedserve.entrypoints.openai.serving_engine import OpenAIError
    from pagedserve.entrypoints.openai.serving_models import LoRAAdapters

    class Engine:
        async def add_lora(self, request) -> bool:
            return True

    adapters = LoRAAdapters(allow_runtime_updating=True)
    asyncio.run(adapters.load(Engine(), ["base", "alias"], "a", str(tmp_path), base="alias"))
    assert adapters.loras["a"].base_model_name == "alias"
    with pytest.raises(OpenAIError, match="base_model_name 'zzz' is not a name") as e:
        asyncio.run(adapters.load(Engine(), ["base", "alias"], "b", str(tmp_path), base="zzz"))
    assert e.value.param == "base_model_name" and "b" not in adapters.loras
