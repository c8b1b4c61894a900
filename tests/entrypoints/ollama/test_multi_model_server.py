"""Several models on one real server (`pagedserve serve --models-dir DIR`), one loaded at
a time: interleaved OpenAI and Ollama requests answer as each model alone does (the
offline engine, greedy), concurrent first requests load a model once, keep_alive
expires, a model that fails to load fails its requests by name while the others
serve.  Then the issue's demonstration on the two real models, with the official
`ollama` client: smollm2-135m-instruct and gemma3-270m, --max-loaded-models 1."""

from __future__ import annotations

import concurrent.futures
import json
import shutil
import time

import httpx
import ollama
import openai
import pytest

from pagedserve.utils import rss_bytes
from tests.entrypoints.openai.conftest import API_KEY, ServerProcess, make_tiny_model

pytestmark = pytest.mark.slow
ENGINE_FLAGS = ["--dtype", "float32", "--max-model-len", "256", "--kv-cache-memory-bytes", "16MiB", "--enforce-eager",
                "--seed", "0"]
CHAT = [{"role": "user", "content": "hello world, the quick brown fox"}]


@pytest.fixture(scope="module")
def models_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    make_tiny_model(root / "alpha", seed=0)
    make_tiny_model(root / "beta", seed=1)
    # (sorted first: the server starts on the first model that loads, naming this one in its log)
    shutil.copytree(root / "alpha", root / "0broken")
    (root / "0broken" / "model.safetensors").write_bytes(b"not weights")
    return root


@pytest.fixture(scope="module")
def server(models_dir, tmp_path_factory):
    proc = ServerProcess(["--models-dir", str(models_dir), "--api-key", API_KEY, "--max-loaded-models", "1",
                          *ENGINE_FLAGS], tmp_path_factory.mktemp("log") / "server.log")
    yield proc
    proc.stop()


def ollama_client(server) -> ollama.Client:
    return ollama.Client(host=server.url, headers={"Authorization": f"Bearer {API_KEY}"})


def offline_answers(path: str) -> str:
    from pagedserve import LLM, SamplingParams

    llm = LLM(path, dtype="float32", max_model_len=256, kv_cache_memory_bytes="16MiB", enforce_eager=True, seed=0)
    try:
        return llm.chat([CHAT], SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)[0].outputs[0].text
    finally:
        llm.shutdown()


def loads(server) -> float:
    return server.metrics()[("pagedserve:model_loads_total", ())]


def test_interleaved_models_answer_as_each_alone(server, models_dir) -> None:
    expected = {name: offline_answers(str(models_dir / name)) for name in ("alpha", "beta")}
    assert expected["alpha"] != expected["beta"]  # (else the routing below proves nothing)
    oai = openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0)
    client = ollama_client(server)
    assert [m.model for m in client.list().models] == ["0broken", "alpha", "beta"]
    assert [m.id for m in oai.models.list().data] == ["0broken", "alpha", "beta"]
    for name in ("alpha", "beta", "alpha", "beta"):  # each switch unloads the other (--max-loaded-models 1)
        a = oai.chat.completions.create(model=name, messages=CHAT, max_tokens=8, temperature=0)
        b = client.chat(name, CHAT, options={"temperature": 0, "num_predict": 8})
        assert a.choices[0].message.content == b.message.content == expected[name], name
        assert [m.model for m in client.ps().models] == [name]
    # A final assistant turn is continued, as Ollama does (OpenAI's continue_final_message).
    turn = [*CHAT, {"role": "assistant", "content": "Well"}]
    a = oai.chat.completions.create(model="alpha", messages=turn, max_tokens=8, temperature=0,
                                    extra_body={"continue_final_message": True, "add_generation_prompt": False})
    b = client.chat("alpha", turn, options={"temperature": 0, "num_predict": 8})
    assert a.choices[0].message.content == b.message.content != expected["alpha"]


def test_concurrent_first_requests_load_once_and_keep_alive_expires(server) -> None:
    client = ollama_client(server)
    client.generate("alpha", keep_alive=0)
    client.generate("beta", keep_alive=0)
    assert client.ps().models == []
    before = loads(server)
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        answers = list(pool.map(lambda _: client.generate("beta", "hello", options={"num_predict": 4,
                                                                                     "temperature": 0},
                                                          keep_alive="1s").response, range(4)))
    assert len(set(answers)) == 1 and loads(server) == before + 1
    deadline = time.monotonic() + 30
    while client.ps().models and time.monotonic() < deadline:
        time.sleep(0.2)
    assert client.ps().models == []  # unloaded a second after its last request
    assert server.metrics()[("pagedserve:model_loaded", ())] == 0  # (summed over the models)


def test_a_model_that_fails_to_load_is_named_and_the_others_serve(server) -> None:
    client = ollama_client(server)
    with pytest.raises(ollama.ResponseError) as e:
        client.chat("0broken", CHAT)
    assert e.value.status_code == 500 and "'0broken'" in e.value.error
    assert "/" not in e.value.error.split("'0broken'")[1]  # (no server path: the details are the log's)
    oai = openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0)
    with pytest.raises(openai.InternalServerError, match="0broken"):
        oai.completions.create(model="0broken", prompt="x", max_tokens=1)
    assert "failed to load the model '0broken'" in server.log_path.read_text()  # (at start-up; then alpha)
    assert client.chat("alpha", CHAT, options={"num_predict": 2}).done
    with pytest.raises(ollama.ResponseError) as e:  # no paths in requests: only the listed models
        client.chat(str(server.log_path), CHAT)
    assert e.value.status_code == 404
    assert server.metrics()[("pagedserve:model_load_failures_total", ())] >= 1


def test_the_two_real_models_through_ollama_and_openai(tmp_path) -> None:
    """The issue's Done-when on the default and the Gemma 3 model."""
    proc = ServerProcess(["smollm2-135m-instruct", "gemma3-270m", "--max-loaded-models", "1"],
                         tmp_path / "server.log", timeout=600)
    try:
        client = ollama.Client(host=proc.url)
        assert {m.model for m in client.list().models} == {"smollm2-135m-instruct", "gemma3-270m"}
        smol = "smollm2-135m-instruct"
        greedy = {"temperature": 0, "num_predict": 12}
        plain = client.chat(smol, [{"role": "user", "content": "What is the capital of France?"}], options=greedy)
        assert "Paris" in plain.message.content
        streamed = "".join(p.message.content for p in client.chat(
            smol, [{"role": "user", "content": "What is the capital of France?"}], options=greedy, stream=True))
        assert streamed == plain.message.content
        schema = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
        shaped = client.chat(smol, [{"role": "user", "content": "Name a city as JSON."}], format=schema,
                             options={"temperature": 0, "num_predict": 40})
        assert isinstance(json.loads(shaped.message.content)["city"], str)
        oai = openai.OpenAI(base_url=proc.url + "/v1", api_key="none", max_retries=0)
        again = oai.chat.completions.create(model=smol, messages=[{"role": "user", "content": "What is the capital of "
                                                                    "France?"}], max_tokens=12, temperature=0)
        assert again.choices[0].message.content == plain.message.content

        gemma = client.generate("gemma3-270m", "The capital of France is", options=greedy)
        assert gemma.response and gemma.eval_count > 0 and gemma.load_duration > 0
        assert [m.model for m in client.ps().models] == ["gemma3-270m"]
        completion = oai.completions.create(model="gemma3-270m", prompt="The capital of France is", max_tokens=12,
                                            temperature=0)
        assert completion.choices[0].text == gemma.response
        # <end_of_turn> ends an answer, as Gemma 3's generation configs and llama.cpp have it (its
        # GGUF names only <eos>: a chat under a Gemma template ran on past the turn to max_tokens)
        turn = oai.completions.create(model="gemma3-270m", prompt="Hi", max_tokens=5, temperature=0,
                                      logit_bias={"106": 100})
        assert turn.choices[0].finish_reason == "stop" and turn.usage.completion_tokens == 1, turn
        loaded = rss_bytes(proc.proc.pid)
        client.generate("gemma3-270m", keep_alive=0)
        assert client.ps().models == []
        assert rss_bytes(proc.proc.pid) < loaded - 300 * 2**20  # its weights went back to the system
        tags = httpx.get(proc.url + "/api/tags").json()["models"]
        assert {t["details"]["quantization_level"] for t in tags} == {"Q4_1", "Q4_K_M"}
        shown = client.show("gemma3-270m")  # read from its files: not loaded for this
        assert shown.modelinfo["gemma3_text.context_length"] == 32768 and shown.details.parameter_size == "268.1M"
        assert "<|im_start|>" in client.show(smol).template
        assert client.ps().models == [] and httpx.get(proc.url + "/api/version").json()["version"]
    finally:
        proc.stop()
