"""/v1/embeddings, /v1/score and /v1/rerank on `pagedserve serve MODEL --runner pooling`,
with the default model, through the official `openai` client where it has the route.

The embeddings are HF transformers' final hidden state of each text's last token,
L2-normalised (float32, HF reading the same GGUF file): one batched request of eight
texts of different lengths, cosine >= 0.999 each."""

from __future__ import annotations

import base64

import httpx
import numpy as np
import openai
import pytest
import torch

from tests.entrypoints.openai.conftest import ServerProcess

TEXTS = [
    "Paris",
    "The capital of France is Paris.",
    "What is the tallest mountain in the world, and how high is it above sea level?",
    "def add(a, b):\n    return a + b",
    "Bananas are yellow when they are ripe and green before that.",
    "A B C D E F G H I J K L M N O P Q R S T U V W X Y Z " * 3,
    "The mitochondria is the powerhouse of the cell.",
    "Stock markets fell sharply on Tuesday after the central bank raised interest rates by half a point.",
]


@pytest.fixture(scope="module")
def pooling_server(smollm2_path, tmp_path_factory):
    proc = ServerProcess([smollm2_path, "--served-model-name", "smol", "--runner", "pooling", "--dtype", "float32",
                          "--enforce-eager", "--max-model-len", "512"], tmp_path_factory.mktemp("log") / "server.log")
    yield proc
    proc.stop()


def hf_pooled(smollm2_path: str, smollm2_gguf: str, texts: list[str], pooling: str) -> torch.Tensor:
    """HF's final hidden states (after the model's last norm), pooled and L2-normalised."""
    import os

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tests.e2e.test_hf_parity import hf_weights_from_gguf

    model = AutoModelForCausalLM.from_pretrained(hf_weights_from_gguf(smollm2_path, os.path.basename(smollm2_gguf)),
                                                 dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(smollm2_path)
    rows = []
    with torch.inference_mode():
        for text in texts:
            ids = torch.tensor([tok.encode(text)])
            states = model.model(input_ids=ids).last_hidden_state[0]
            rows.append(states[-1] if pooling == "LAST" else states.mean(0))
    return torch.nn.functional.normalize(torch.stack(rows), dim=-1)


def test_embeddings_equal_hf_last_token_states(pooling_server, smollm2_path, smollm2_gguf) -> None:
    client = openai.OpenAI(base_url=pooling_server.url + "/v1", api_key="none", max_retries=0, timeout=120)
    got = client.embeddings.create(model="smol", input=TEXTS)  # the client asks for base64 and decodes it
    assert [d.index for d in got.data] == list(range(len(TEXTS)))
    ours = torch.tensor([d.embedding for d in got.data])
    ref = hf_pooled(smollm2_path, smollm2_gguf, TEXTS, "LAST")
    cos = torch.nn.functional.cosine_similarity(ours, ref, dim=-1)
    assert cos.min() >= 0.999, cos
    assert torch.allclose(ours.norm(dim=-1), torch.ones(len(TEXTS)), atol=1e-5)
    assert got.usage.prompt_tokens == got.usage.total_tokens > len(TEXTS)

    # float encoding, token-id input, and Matryoshka truncation (cut, then normalised again)
    floats = client.embeddings.create(model="smol", input=TEXTS[1], encoding_format="float")
    assert torch.allclose(torch.tensor(floats.data[0].embedding), ours[1], atol=1e-5)
    ids = httpx.post(pooling_server.url + "/tokenize", json={"prompt": TEXTS[1]}).json()["tokens"]
    by_ids = client.embeddings.create(model="smol", input=ids, encoding_format="float")
    assert torch.allclose(torch.tensor(by_ids.data[0].embedding), ours[1], atol=1e-5)
    cut = client.embeddings.create(model="smol", input=TEXTS[1], dimensions=64, encoding_format="float")
    want = torch.nn.functional.normalize(ref[1, :64] * 1.0, dim=0)
    assert len(cut.data[0].embedding) == 64
    assert torch.nn.functional.cosine_similarity(torch.tensor(cut.data[0].embedding), want, dim=0) >= 0.999


def test_repeated_prefixes_hit_the_prefix_cache(pooling_server) -> None:
    prefix = "You are a retrieval system. Embed the following passage for search over a corpus of news. " * 3
    texts = [prefix + tail for tail in ("Markets fell.", "Rain is coming.")]
    url = pooling_server.url + "/v1/embeddings"
    first = httpx.post(url, json={"input": texts[:1], "encoding_format": "float"}, timeout=60).json()
    again = httpx.post(url, json={"input": texts, "encoding_format": "float"}, timeout=60).json()
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] >= 2 * 32  # both reuse the shared blocks
    a, b = np.array(first["data"][0]["embedding"]), np.array(again["data"][0]["embedding"])
    assert float(a @ b) >= 0.9999  # a hit computes the same state as the first time
    hits = sum(v for (name, _), v in pooling_server.metrics().items() if name == "vllm:prefix_cache_hits_total")
    assert hits >= 64


def test_vllms_chat_form_embeds_the_rendered_conversation(pooling_server, smollm2_path) -> None:
    """vLLM's `messages` on /v1/embeddings (its EmbeddingChatRequest): the chat template's
    rendering of the conversation, without a generation prompt, embedded as one input
    ("input: Field required" before; the chat form is how a vision model embeds images)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm2_path)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": TEXTS[2]}]

    def post(body):
        return httpx.post(pooling_server.url + "/v1/embeddings", json={"model": "smol", **body}, timeout=60)

    chat = post({"messages": messages}).json()
    ids = tok.encode(tok.apply_chat_template(messages, add_generation_prompt=False, tokenize=False),
                     add_special_tokens=False)
    plain = post({"input": ids}).json()
    assert chat["usage"]["prompt_tokens"] == len(ids) == plain["usage"]["prompt_tokens"]
    assert np.allclose(chat["data"][0]["embedding"], plain["data"][0]["embedding"], atol=1e-5)
    asked = post({"messages": messages, "add_generation_prompt": True}).json()
    assert asked["usage"]["prompt_tokens"] > len(ids)
    for body, param, words in [({"input": "x", "messages": messages}, "input", "not both"),
                               ({}, "input", "not neither"), ({"messages": []}, "messages", "non-empty"),
                               ({"messages": "hi"}, "messages", "non-empty"),
                               ({"input": "x", "add_generation_prompt": True}, "add_generation_prompt", "not with input"),
                               ({"messages": [{"role": "user", "content": [
                                   {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}]},
                                "messages", "image")]:
        r = post(body)
        assert r.status_code == 400 and words in r.json()["error"]["message"], r.text
        if param is not None:
            assert r.json()["error"]["param"] == param, r.text


def test_add_special_tokens_reaches_the_tokenizer(monkeypatch) -> None:
    """vLLM's add_special_tokens on /v1/embeddings is what tokenizes a text input (SmolLM2
    adds no special tokens, so this is checked at the handler, not through its model)."""
    from pagedserve.entrypoints.openai.protocol_pooling import EmbeddingRequest
    from pagedserve.entrypoints.openai.serving_pooling import OpenAIServingEmbedding

    asked: list[bool] = []
    handler = OpenAIServingEmbedding.__new__(OpenAIServingEmbedding)
    monkeypatch.setattr(handler, "tokenize", lambda text, special=True, cut=False: asked.append(special) or [1, 2], raising=False)
    monkeypatch.setattr(handler, "model_name", lambda name: "m", raising=False)
    monkeypatch.setattr(handler, "max_model_len", 64, raising=False)
    for flag in (False, True):
        handler.prepare(EmbeddingRequest.model_validate({"input": "Paris", "add_special_tokens": flag}))
    assert asked == [False, True]


def test_score_and_rerank_answer_in_their_shapes(pooling_server) -> None:
    url = pooling_server.url
    docs = ["Paris is the capital of France.", "Bananas are yellow.", "France's capital city is Paris."]
    score = httpx.post(url + "/v1/score", json={"model": "smol", "text_1": "What is the capital of France?",
                                                 "text_2": docs}, timeout=60)
    assert score.status_code == 200, score.text
    body = score.json()
    assert body["object"] == "list" and [d["index"] for d in body["data"]] == [0, 1, 2]
    scores = [d["score"] for d in body["data"]]
    assert all(d["object"] == "score" and -1 <= d["score"] <= 1 for d in body["data"])
    # the same pairs, from the embeddings route: the score is their cosine
    emb = httpx.post(url + "/v1/embeddings", json={"input": ["What is the capital of France?", *docs],
                                                    "encoding_format": "base64"}, timeout=60).json()["data"]
    vecs = [np.frombuffer(base64.b64decode(d["embedding"]), dtype="<f4") for d in emb]
    assert scores == pytest.approx([float(vecs[0] @ v) for v in vecs[1:]], abs=1e-5)
    pairwise = httpx.post(url + "/score", json={"text_1": docs[:2], "text_2": docs[1:]}, timeout=60).json()
    assert len(pairwise["data"]) == 2

    for path in ("/v1/rerank", "/rerank", "/v2/rerank"):
        rerank = httpx.post(url + path, json={"query": "What is the capital of France?", "documents": docs,
                                              "top_n": 2}, timeout=60)
        assert rerank.status_code == 200, rerank.text
        results = rerank.json()["results"]
        assert len(results) == 2
        assert [r["index"] for r in results] == sorted(range(3), key=lambda i: -scores[i])[:2]
        assert results[0]["relevance_score"] == pytest.approx(max(scores), abs=1e-5)
        assert results[0]["document"]["text"] == docs[results[0]["index"]]
    assert "usage" in rerank.json()
    # The bound counts the prompts it would start: each distinct text once
    same = httpx.post(url + "/v1/rerank", json={"query": "q", "documents": [docs[1]] * 600}, timeout=60)
    assert same.status_code == 200 and len(same.json()["results"]) == 600


@pytest.mark.parametrize(("path", "body", "param"), [
    ("/v1/embeddings", {"input": "x", "dimensions": 100000}, "dimensions"),
    ("/v1/embeddings", {"input": "x", "dimensions": 0}, "dimensions"),
    ("/v1/embeddings", {"input": []}, "input"),
    ("/v1/embeddings", {"input": ""}, "input"),
    ("/v1/embeddings", {"input": [1, 2, 10**9]}, "input"),
    ("/v1/embeddings", {"input": "x", "truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
    ("/v1/embeddings", {"input": "x", "embed_dtype": "float16"}, "embed_dtype"),
    ("/v1/embeddings", {"input": "x", "truncate_prompt_tokens": 100000}, "truncate_prompt_tokens"),
    ("/v1/embeddings", {"input": "x " * 2000}, "input"),
    ("/v1/score", {"text_1": ["a", "b"], "text_2": ["a", "b", "c"]}, "text_2"),
    ("/v1/score", {"text_1": "a", "text_2": "b", "instruction": "rank"}, "instruction"),
    ("/v1/rerank", {"query": "a", "documents": []}, "documents"),
    ("/v1/rerank", {"query": "a", "documents": ["b"], "top_n": -1}, "top_n"),
    ("/v1/embeddings", {"input": ["x"] * 2049}, "input"),  # (OpenAI's bound: 2,048 inputs)
    ("/v1/rerank", {"query": "a", "documents": [f"b{i}" for i in range(1024)]}, "documents"),  # 1,025 texts
    ("/v1/score", {"text_1": "a", "text_2": [f"b{i}" for i in range(1024)]}, "text_2"),
    # Tokens summed over the prompts: 300,000 at most (1,600 x ~201 here; each fits alone)
    ("/v1/embeddings", {"input": ["x " * 200] * 1600}, "input"),
    ("/v1/rerank", {"query": "a", "documents": [f"{i} " + "x " * 300 for i in range(1000)]}, "documents"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}, "model"),
    ("/v1/completions", {"prompt": "hi"}, "model"),
    # what the generation routes refuse by name (each was ignored here, and not even logged)
    ("/v1/embeddings", {"input": "x", "use_beam_search": True}, "use_beam_search"),
    ("/v1/embeddings", {"input": "x", "audio": {"format": "wav"}}, "audio"),
    ("/v1/rerank", {"query": "a", "documents": ["b"], "return_token_ids": True}, "return_token_ids"),
    ("/v1/rerank", {"query": "a", "documents": ["b"], "max_tokens_per_doc": 8}, "max_tokens_per_doc"),  # (Cohere's)
    # another route's fields, which this one does not read (each was dropped with one log line)
    ("/v1/embeddings", {"input": "x", "stream": True}, "stream"),
    ("/v1/embeddings", {"input": "x", "max_tokens": 5}, "max_tokens"),
    ("/v1/embeddings", {"messages": [{"role": "user", "content": "x"}], "tools": []}, "tools"),
    ("/v1/score", {"text_1": "a", "text_2": "b", "dimensions": 4}, "dimensions"),
    ("/v1/rerank", {"query": "a", "documents": ["b"], "input": "c"}, "input"),
    # ... and fields another route requires (taken as unknown: the answer was for other inputs)
    ("/v1/rerank", {"query": "a", "documents": ["b"], "text_2": ["c"]}, "text_2"),
    ("/v1/score", {"text_1": "a", "text_2": ["b"], "query": "c"}, "query"),
    ("/v1/embeddings", {"input": "a", "prompt": "b"}, "prompt"),
])
def test_bad_pooling_requests_are_refused_by_name(pooling_server, path, body, param) -> None:
    r = httpx.post(pooling_server.url + path, json=body, timeout=60)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.text
    assert httpx.get(pooling_server.url + "/health", timeout=10).status_code == 200


def test_another_routes_fields_at_their_defaults_are_accepted(pooling_server) -> None:
    """What a generic client sends with every body (stream false, n 1, null) asks for nothing."""
    r = httpx.post(pooling_server.url + "/v1/embeddings", json={"input": "x", "stream": False, "n": 1,
                                                                "temperature": None}, timeout=60)
    assert r.status_code == 200, r.text


def test_a_generation_server_refuses_the_pooling_routes(server) -> None:
    from tests.entrypoints.openai.conftest import API_KEY

    for path, body in (("/v1/embeddings", {"input": "x"}), ("/v1/score", {"text_1": "a", "text_2": "b"}),
                       ("/v1/rerank", {"query": "a", "documents": ["b"]})):
        r = httpx.post(server.url + path, json=body, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=30)
        assert r.status_code == 400, r.text
        assert "--runner pooling" in r.json()["error"]["message"]


def test_ollamas_embed_routes_equal_the_openai_route(pooling_server) -> None:
    """/api/embed and the older /api/embeddings through the official `ollama` client."""
    import ollama

    client = ollama.Client(host=pooling_server.url)
    oai = openai.OpenAI(base_url=pooling_server.url + "/v1", api_key="none", max_retries=0, timeout=120)
    want = torch.tensor([d.embedding for d in oai.embeddings.create(model="smol", input=TEXTS[:3],
                                                                    encoding_format="float").data])
    got = client.embed("smol", TEXTS[:3])
    assert torch.allclose(torch.tensor(got.embeddings), want, atol=1e-5)
    assert got.prompt_eval_count > 3 and got.total_duration > 0
    one = torch.tensor(client.embeddings("smol", TEXTS[0]).embedding)  # (Ollama's older route: not normalised)
    assert torch.allclose(one / one.norm(), want[0], atol=1e-5) and abs(one.norm().item() - 1) > 1e-3
    assert client.show("smol").capabilities == ["embedding"]
    with pytest.raises(ollama.ResponseError, match="pooling runner"):
        client.chat("smol", [{"role": "user", "content": "hi"}])


def test_vllms_pooling_fields_work_or_are_refused_by_name(pooling_server) -> None:
    """vLLM's fields of the pooling routes do what vLLM's do (they were logged as unknown
    and ignored: big-endian base64 came back little-endian), and a refused input of
    several is named by its index and its field."""
    url = pooling_server.url

    def post(path: str, body: dict) -> httpx.Response:
        return httpx.post(url + path, json=body, timeout=60)

    floats = post("/v1/embeddings", {"input": TEXTS[1], "encoding_format": "float"}).json()["data"][0]["embedding"]
    for endianness, dtype in (("big", ">f4"), ("little", "<f4"), ("native", "=f4")):
        got = post("/v1/embeddings", {"input": TEXTS[1], "encoding_format": "base64", "endianness": endianness})
        assert np.allclose(np.frombuffer(base64.b64decode(got.json()["data"][0]["embedding"]), dtype=dtype), floats)
    assert post("/v1/embeddings", {"input": "x", "request_id": "job-7"}).json()["id"] == "embd-job-7"
    raw = post("/v1/embeddings", {"input": TEXTS[1], "use_activation": False, "encoding_format": "float"}).json()
    assert abs(np.linalg.norm(raw["data"][0]["embedding"]) - 1) > 1e-2  # not normalised: vLLM's newer name
    for path, body, param, words in [
        ("/v1/embeddings", {"input": "x", "endianness": "middle"}, "endianness", ""),
        ("/v1/embeddings", {"input": "x", "request_id": "a\nb"}, "request_id", "printable"),
        ("/v1/embeddings", {"input": "x", "mm_processor_kwargs": {"num_crops": 4}}, "mm_processor_kwargs", "per-request settings"),
        ("/v1/embeddings", {"input": "x", "normalize": True, "use_activation": False}, "use_activation", "one"),
        ("/v1/embeddings", {"input": [[1, 2], [3, -1]]}, "input", "input[1]"),
        # text too long to tokenize, named by its place (it was "prompt", without an index)
        ("/v1/embeddings", {"input": ["ok", "hello world " * 100_000]}, "input", "input[1]: the prompt is"),
        ("/v1/score", {"text_1": "a", "text_2": ["b", "c " * 600_000]}, "text_2", "text_2[1]: the prompt is"),
        ("/v1/score", {"text_1": "a", "text_2": "b", "use_activation": False}, "use_activation", "cosine"),
        ("/v1/score", {"text_1": "a", "text_2": "b", "softmax": True, "activation": False}, "use_activation", ""),
        ("/v1/score", {"text_1": "", "text_2": "b"}, "text_1", "text_1"),
        ("/v1/score", {"text_1": "a", "text_2": [[1], [2, -5]]}, "text_2", "text_2[1]"),
        ("/v1/rerank", {"query": "", "documents": ["b"]}, "query", "query"),
        ("/v1/rerank", {"query": "a", "documents": ["b", ""]}, "documents", "documents"),
        # (pydantic's union error said "Input should be a valid string" to all of these)
        ("/v1/embeddings", {"input": [1.5, 2]}, "input", "item 0 is float"),
        ("/v1/embeddings", {"input": ["a", [1, 2]]}, "input", "beside other kinds"),
        ("/v1/score", {"text_1": [[[1]]], "text_2": "b"}, "text_1", "not all token ids"),
    ]:
        r = post(path, body)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, (body, r.text)
        assert words in r.json()["error"]["message"], r.text


def test_ollamas_num_ctx_bounds_an_embedding(pooling_server) -> None:
    """Ollama's options.num_ctx is the window an /api/embed input must fit (truncate
    false: refused) or is cut to (truncate true); it was ignored."""
    long = "word " * 100
    url = pooling_server.url + "/api/embed"
    r = httpx.post(url, json={"model": "smol", "input": long, "truncate": False, "options": {"num_ctx": 10}},
                   timeout=60)
    assert r.status_code == 400 and "num_ctx 10" in r.json()["error"], r.text
    cut = httpx.post(url, json={"model": "smol", "input": long, "options": {"num_ctx": 10}}, timeout=60).json()
    assert cut["prompt_eval_count"] == 10
    whole = httpx.post(url, json={"model": "smol", "input": long}, timeout=60).json()
    assert whole["prompt_eval_count"] > 100
    # the older /api/embeddings takes no truncate: its refusal points to the route that does
    r = httpx.post(pooling_server.url + "/api/embeddings", json={"model": "smol", "prompt": long,
                                                                 "options": {"num_ctx": 10}}, timeout=60)
    assert r.status_code == 400 and "ask /api/embed with truncate true" in r.json()["error"], r.text
