"""Fuzzing of the real server (subprocess, tiny random Llama) driven by its own OpenAPI
schema: every POST route gets bodies generated from the schema the server publishes at
/openapi.json, realistic seed bodies, and hostile mutations of both (a value of the
wrong JSON type, huge numbers, 100 kB strings, deeply nested lists, null, unknown
fields, a field dropped), streamed and not, plus raw bodies that are not JSON, not
UTF-8 or sent with the wrong content type.

What must hold for every case: no 5xx, an answer within REQUEST_TIMEOUT (a streamed
answer read to its end), every 4xx carries OpenAI's error body, every stream event is
JSON and none is a server_error, and a plain completion still works afterwards.

hypothesis-jsonschema would generate the bodies, but its latest release (0.23.1) breaks
on any object schema with the hypothesis this project uses (`'many' object has no
attribute 'more'`), so the few JSON Schema keywords FastAPI emits are turned into
strategies here (`schema_strategy`).
"""

from __future__ import annotations

import copy
import json
import re
import time
from typing import Any

import httpx
import pytest
from conftest import API_KEY, MODEL_NAME
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.hypothesis_budget import examples

AUTH = {"Authorization": f"Bearer {API_KEY}"}
JSON_HEADERS = {**AUTH, "Content-Type": "application/json"}
REQUEST_TIMEOUT = 30.0  # seconds for one whole answer, a stream read to its end included
ROUTES = {"/v1/completions": "CompletionRequest", "/v1/chat/completions": "ChatCompletionRequest",
          "/tokenize": "TokenizeRequest", "/detokenize": "DetokenizeRequest",
          "/v1/messages": "MessagesRequest", "/v1/messages/count_tokens": "CountTokensRequest",
          "/v1/responses": "ResponsesRequest", "/v1/embeddings": "EmbeddingRequest", "/v1/score": "ScoreRequest",
          "/v1/rerank": "RerankRequest", "/v1/load_lora_adapter": "LoadLoRAAdapterRequest",
          "/v1/unload_lora_adapter": "UnloadLoRAAdapterRequest",
          "/api/chat": "OllamaChatRequest", "/api/generate": "OllamaGenerateRequest",
          "/api/embed": "OllamaEmbedRequest", "/api/embeddings": "OllamaEmbeddingsRequest",
          "/api/show": "OllamaShowRequest"}
# Fuzzed against a second server, the same model under --runner pooling (the first
# refuses them by name before reading them).
POOLING = ("/v1/embeddings", "/v1/score", "/v1/rerank", "/api/embed", "/api/embeddings")
GENERATING = ("/v1/completions", "/v1/chat/completions", "/v1/messages", "/v1/responses", "/api/chat",
              "/api/generate")
OLLAMA = ("/api/chat", "/api/generate", "/api/embed", "/api/embeddings", "/api/show")  # {"error": "..."}, NDJSON
ANTHROPIC = ("/v1/messages", "/v1/messages/count_tokens")  # Anthropic's error and stream shapes
MAX_TOKENS, MAX_N = 4, 2  # a generation is forced this small unless the case targets the field
SIZE_FIELDS = {"max_tokens": MAX_TOKENS, "max_completion_tokens": MAX_TOKENS, "n": MAX_N,
               "max_output_tokens": MAX_TOKENS}
FUZZ = settings(max_examples=examples(100), deadline=None,
                suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow,
                                       HealthCheck.data_too_large])

MESSAGES = [{"role": "system", "content": "answer briefly."}, {"role": "user", "content": "hello world"}]
TOOL = {"type": "function", "function": {"name": "get_weather", "description": "the weather in a city",
                                         "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                        "required": ["city"]}}}
RESPONSES_TOOL = {"type": "function", **TOOL["function"]}
ANTHROPIC_TOOL = {"name": "get_weather", "description": "the weather in a city",
                  "input_schema": TOOL["function"]["parameters"]}
# Realistic bodies that reach the deep paths (tools, structured outputs, logprobs, streams)
# which a random schema instance rarely does; the mutations then break them in place.
SEEDS: dict[str, list[dict]] = {
    "/v1/completions": [
        {"model": MODEL_NAME, "prompt": "the quick brown fox", "max_tokens": 3},
        {"model": MODEL_NAME, "prompt": ["hello world", "Paris is"], "max_tokens": 2, "n": 2, "stream": True,
         "stream_options": {"include_usage": True, "continuous_usage_stats": True}, "logprobs": 2, "echo": True},
        {"model": MODEL_NAME, "prompt": [5, 6, 7], "max_tokens": 3, "temperature": 0.7, "top_p": 0.9, "top_k": 5,
         "min_p": 0.05, "seed": 1, "stop": ["x", "y"], "stop_token_ids": [3], "logit_bias": {"5": 2.0},
         "repetition_penalty": 1.1, "presence_penalty": 0.5, "frequency_penalty": 0.5, "min_tokens": 1,
         "ignore_eos": True, "best_of": 1, "user": "u"},
        {"model": MODEL_NAME, "prompt": [[5, 6], [7]], "max_tokens": 2, "prompt_logprobs": 1, "echo": True,
         "logprobs": 0, "allowed_token_ids": [5, 6, 7, 8], "bad_words": ["fox"]},
        {"model": MODEL_NAME, "prompt": "a", "max_tokens": 3, "guided_regex": "[a-z]+", "bad_words": ["fox"]},
        {"model": MODEL_NAME, "prompt": "json:", "max_tokens": 4, "stream": True,
         "response_format": {"type": "json_schema", "json_schema": {
             "name": "s", "schema": {"type": "object", "properties": {"a": {"type": "integer"}}}}}},
        {"model": MODEL_NAME, "prompt": "yes or no?", "max_tokens": 3, "structured_outputs": {"choice": ["yes", "no"]},
         "cache_salt": "salt", "include_stop_str_in_output": True, "skip_special_tokens": False},
    ],
    "/v1/chat/completions": [
        {"model": MODEL_NAME, "messages": MESSAGES, "max_tokens": 3},
        {"model": MODEL_NAME, "messages": MESSAGES, "max_completion_tokens": 2, "n": 2, "stream": True,
         "stream_options": {"include_usage": True}, "logprobs": True, "top_logprobs": 2, "temperature": 0},
        {"model": MODEL_NAME, "messages": MESSAGES, "max_tokens": 4, "tools": [TOOL],
         "tool_choice": {"type": "function", "function": {"name": "get_weather"}}, "stream": True},
        {"model": MODEL_NAME, "messages": MESSAGES, "max_tokens": 4, "tools": [TOOL], "tool_choice": "required",
         "parallel_tool_calls": True},
        {"model": MODEL_NAME, "max_tokens": 3, "tools": [TOOL], "tool_choice": "auto", "messages": [
            {"role": "user", "content": [{"type": "text", "text": "weather?"}, {"type": "text", "text": "Paris"}]},
            {"role": "assistant", "content": "", "tool_calls": [
                {"id": "call-1", "type": "function", "function": {"name": "get_weather",
                                                                   "arguments": "{\"city\": \"Paris\"}"}}]},
            {"role": "tool", "content": "sunny", "tool_call_id": "call-1", "name": "get_weather"}]},
        {"model": MODEL_NAME, "max_tokens": 2, "continue_final_message": True, "add_generation_prompt": False,
         "messages": [{"role": "user", "content": "count"}, {"role": "assistant", "content": "1 2 3"}]},
        {"model": MODEL_NAME, "messages": MESSAGES, "max_tokens": 3, "response_format": {"type": "json_object"},
         "chat_template": "{% for m in messages %}{{ m['content'] }}\n{% endfor %}",
         "chat_template_kwargs": {"enable_thinking": False}},
        {"model": MODEL_NAME, "messages": MESSAGES, "max_tokens": 2, "guided_choice": ["a", "b"], "seed": 3,
         "prompt_logprobs": 1},
    ],
    "/tokenize": [
        {"model": MODEL_NAME, "prompt": "hello world", "add_special_tokens": False},
        {"messages": MESSAGES, "add_generation_prompt": False},
    ],
    "/detokenize": [{"model": MODEL_NAME, "tokens": [5, 6, 7]}, {"tokens": []}],
    "/v1/messages": [
        {"model": MODEL_NAME, "max_tokens": 3, "messages": [{"role": "user", "content": "hello world"}]},
        {"model": MODEL_NAME, "max_tokens": 4, "stream": True, "system": [{"type": "text", "text": "briefly."}],
         "stop_sequences": ["x"], "temperature": 0.5, "top_p": 0.9, "top_k": 5, "metadata": {"user_id": "u"},
         "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]},
        {"model": MODEL_NAME, "max_tokens": 4, "tools": [ANTHROPIC_TOOL], "tool_choice": {"type": "tool", "name":
         "get_weather"}, "stream": True, "messages": [{"role": "user", "content": "weather?"}]},
        {"model": MODEL_NAME, "max_tokens": 3, "tools": [ANTHROPIC_TOOL], "tool_choice": {
            "type": "any", "disable_parallel_tool_use": True}, "messages": [
            {"role": "user", "content": "weather?"},
            {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "get_weather",
                                               "input": {"city": "Paris"}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "sunny",
                                          "is_error": False}]}]},
    ],
    "/v1/responses": [
        {"model": MODEL_NAME, "input": "hello world", "max_output_tokens": 3},
        {"model": MODEL_NAME, "instructions": "briefly.", "max_output_tokens": 4, "stream": True, "temperature": 0.5,
         "top_p": 0.9, "user": "u", "metadata": {"k": "v"}, "truncation": "disabled", "reasoning": {"effort": "low"},
         "input": [{"role": "developer", "content": "be kind"},
                   {"role": "user", "content": [{"type": "input_text", "text": "hi"}]}]},
        {"model": MODEL_NAME, "max_output_tokens": 4, "stream": True, "tools": [RESPONSES_TOOL],
         "tool_choice": {"type": "function", "name": "get_weather"}, "input": "weather?"},
        {"model": MODEL_NAME, "max_output_tokens": 3, "tools": [RESPONSES_TOOL], "tool_choice": "required",
         "parallel_tool_calls": False, "input": [
             {"role": "user", "content": "weather?"},
             {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": "{\"city\": \"Paris\"}"},
             {"type": "function_call_output", "call_id": "c1", "output": "sunny"}]},
        {"model": MODEL_NAME, "max_output_tokens": 4, "input": "json:", "text": {"format": {
            "type": "json_schema", "name": "s", "schema": {"type": "object", "properties": {"a": {"type": "integer"}}}}}},
    ],
    "/v1/messages/count_tokens": [
        {"model": MODEL_NAME, "messages": [{"role": "user", "content": "hello"}], "system": "s",
         "tools": [ANTHROPIC_TOOL], "tool_choice": {"type": "auto"}},
    ],
    "/v1/embeddings": [
        {"model": MODEL_NAME, "input": ["hello world", "Paris is"], "encoding_format": "base64"},
        {"model": MODEL_NAME, "input": [[5, 6, 7], [8]], "dimensions": 8, "normalize": False, "user": "u",
         "truncate_prompt_tokens": 2, "priority": 0, "cache_salt": "salt", "encoding_format": "float"},
    ],
    "/v1/score": [
        {"model": MODEL_NAME, "text_1": "hello", "text_2": ["hello world", "Paris is"]},
        {"model": MODEL_NAME, "text_1": [[5, 6], [7]], "text_2": [[8], [9, 10]], "truncate_prompt_tokens": -1},
    ],
    "/v1/rerank": [
        {"model": MODEL_NAME, "query": "capital?", "documents": ["Paris is", "the quick fox"], "top_n": 1,
         "return_documents": False},
    ],
    "/api/chat": [
        {"model": MODEL_NAME, "messages": MESSAGES, "options": {"num_predict": 3, "temperature": 0.5, "seed": 1}},
        {"model": MODEL_NAME, "messages": [{"role": "user", "content": "weather?"}], "tools": [TOOL],
         "stream": False, "options": {"num_predict": 4}},
        {"model": MODEL_NAME, "messages": MESSAGES, "format": {"type": "object", "properties": {"a": {
            "type": "integer"}}}, "options": {"num_predict": 4, "num_ctx": 64, "stop": ["x"]}, "keep_alive": "5m"},
    ],
    "/api/generate": [
        {"model": MODEL_NAME, "prompt": "the quick brown fox", "options": {"num_predict": 3}},
        {"model": MODEL_NAME, "prompt": "json:", "raw": True, "format": "json", "stream": False,
         "options": {"num_predict": 4, "top_k": 5, "repeat_penalty": 1.1}},
        {"model": MODEL_NAME, "system": "briefly.", "prompt": "hello", "options": {"num_predict": 2, "num_gpu": 1}},
    ],
    "/api/embed": [{"model": MODEL_NAME, "input": ["hello world", "Paris is"], "truncate": True, "dimensions": 8}],
    "/api/embeddings": [{"model": MODEL_NAME, "prompt": "hello world"}],
    "/api/show": [{"model": MODEL_NAME}, {"name": MODEL_NAME, "verbose": True}],
    # The fuzzed server allows runtime LoRA updating: names and paths reach the adapter reader.
    "/v1/load_lora_adapter": [{"lora_name": "adapter", "lora_path": "/nonexistent/adapter"},
                              {"lora_name": "adapter", "lora_path": "/"}],
    "/v1/unload_lora_adapter": [{"lora_name": "adapter"}, {"lora_name": "adapter", "lora_int_id": 1}],
}

# ------------------------------------------------------------------ JSON Schema -> strategy
# Strings of the right JSON type that a tokenizer, a chat template or a grammar compiler may choke on.
ODD_TEXT = st.sampled_from(["", " ", "\ud800", "\udfff", "\ud83d", "\x00", "\uffff", "\U0010ffff", "\r\n", '"', "\\",
                            "<|im_end|>", "<|endoftext|>", "<tool_call>", "{{ 1/0 }}", "{% for %}", "root ::= b", "((",
                            "[a-", "\u00e9" * 300])
_SCALARS = st.one_of(st.none(), st.booleans(), st.integers(-1000, 1000),
                     st.floats(allow_nan=False, allow_infinity=False), st.text(max_size=12))
ANY_JSON = st.recursive(_SCALARS, lambda inner: st.lists(inner, max_size=3)
                        | st.dictionaries(st.text(max_size=8), inner, max_size=3), max_leaves=6)
_KEYWORDS = {"type", "anyOf", "oneOf", "enum", "const", "properties", "items", "additionalProperties"}


def resolve_refs(node: Any, components: dict[str, Any], depth: int = 0) -> Any:
    """`node` with every "$ref": "#/components/schemas/X" replaced by X, resolved in turn."""
    if depth > 32:
        raise ValueError("recursive schema: $ref chain deeper than 32")
    if isinstance(node, dict):
        if "$ref" in node:
            return resolve_refs(components[node["$ref"].rsplit("/", 1)[-1]], components, depth + 1)
        return {k: resolve_refs(v, components, depth) for k, v in node.items()}
    if isinstance(node, list):
        return [resolve_refs(v, components, depth) for v in node]
    return node


def schema_strategy(node: Any, max_optional: int = 3) -> st.SearchStrategy:
    """Instances of a (ref-free) JSON Schema as FastAPI writes them; objects get their
    required properties, at most `max_optional` of the others and sometimes an unknown one."""
    if node is True or not isinstance(node, dict) or not _KEYWORDS & set(node):
        return ANY_JSON
    if "const" in node:
        return st.just(node["const"])
    if "enum" in node:
        return st.sampled_from(node["enum"])
    if "anyOf" in node or "oneOf" in node:
        return st.one_of([schema_strategy(s, max_optional) for s in node.get("anyOf", node.get("oneOf"))])
    kind = node.get("type")
    if isinstance(kind, list):
        return st.one_of([schema_strategy({**node, "type": k}, max_optional) for k in kind])
    if kind == "string":
        return st.one_of(st.text(max_size=24), st.text(max_size=24), ODD_TEXT)
    if kind == "integer":
        return st.integers(min_value=node.get("minimum"), max_value=node.get("maximum"))
    if kind == "number":
        return st.floats(allow_nan=False, allow_infinity=False) | st.integers(-100, 100)
    if kind == "boolean":
        return st.booleans()
    if kind == "null":
        return st.none()
    if kind == "array":
        return st.lists(schema_strategy(node.get("items", True), max_optional), max_size=4)
    if kind == "object":
        return _object(node, max_optional)
    return ANY_JSON


@st.composite
def _object(draw, node: dict, max_optional: int) -> dict:
    props = node.get("properties", {})
    required = list(node.get("required", []))
    optional = sorted(set(props) - set(required))
    if optional and max_optional:
        required += draw(st.lists(st.sampled_from(optional), unique=True, max_size=min(max_optional, len(optional))))
    out = {k: draw(schema_strategy(props[k])) for k in required}
    extra = node.get("additionalProperties", True)
    if extra is not False and (not props or draw(st.integers(0, 5)) == 0):
        values = ANY_JSON if extra is True else schema_strategy(extra)
        out.update(draw(st.dictionaries(st.text(max_size=10).filter(lambda k: k not in props), values,
                                        max_size=2 if props else 3)))
    return out


# ------------------------------------------------------------------ hostile values
DEEP = re.compile(r'"@@DEEP(\d+)@@"')  # stands in for a nested list json.dumps could not write


def wrong_type(field_schema: Any) -> st.SearchStrategy:
    """A value whose JSON type the field's schema does not allow (anything, if it allows all)."""
    def types(node: Any) -> set[str]:
        if not isinstance(node, dict):
            return set()
        found = {node["type"]} if isinstance(node.get("type"), str) else set(node.get("type") or [])
        for sub in node.get("anyOf", []) + node.get("oneOf", []):
            found |= types(sub)
        return found

    allowed = types(field_schema)
    if "number" in allowed:
        allowed.add("integer")
    samples = {"string": "abc", "integer": 7, "number": 0.5, "boolean": True, "array": [1, "a", None],
               "object": {"k": [1]}, "null": None}
    wrong = [v for k, v in samples.items() if k not in allowed] or list(samples.values())
    return st.sampled_from(wrong)


HOSTILE = st.one_of(
    st.sampled_from([None, True, False, 0, -1, 1, 16, 17, 256, 257, 0.5, 1e308, -1e308, 5e-324, 10**30, -(10**30),
                     2**63, 2**64, -(2**63) - 1, [], {}, [None], [[]], [""], [-1], [1e308], {"": None},
                     {"type": None}, {"function": "f"}, {"name": 1}]),
    ODD_TEXT,
    # Long strings (a 100 kB prompt is ~50k tokens, far past the context).
    st.tuples(st.sampled_from(["a", "a ", "\u00e9", "{", "\\", "<|im_start|>"]),
              st.sampled_from([1_000, 30_000, 100_000])).map(lambda t: (t[0] * t[1])[:t[1]]),
    st.sampled_from([2, 60, 500, 990, 5000]).map(lambda d: f"@@DEEP{d}@@"),
    ANY_JSON,
).map(copy.deepcopy)  # fresh objects: later mutations must not edit the constants above


def paths(value: Any, prefix: tuple = ()) -> list[tuple]:
    """Every place in a JSON value a mutation can hit (lists: their first 3 items)."""
    out = [prefix]
    if isinstance(value, dict):
        for k, v in value.items():
            out += paths(v, (*prefix, k))
    elif isinstance(value, list):
        for i, v in enumerate(value[:3]):
            out += paths(v, (*prefix, i))
    return out


def get_in(value: Any, path: tuple) -> Any:
    for p in path:
        value = value[p]
    return value


@st.composite
def mutated(draw, body: Any, top_schema: dict) -> tuple[Any, set[str]]:
    """`body` with 1-3 hostile mutations; also the top-level fields they hit."""
    body, hit = copy.deepcopy(body), set()
    for _ in range(draw(st.integers(1, 3))):
        if not isinstance(body, dict | list) or draw(st.integers(0, 19)) == 0:  # the whole body
            return draw(HOSTILE | st.sampled_from([{}, [], None, "x", 1])), set(SIZE_FIELDS)
        where = draw(st.sampled_from(paths(body)))
        target = get_in(body, where)
        op = draw(st.sampled_from(["replace", "replace", "wrong_type", "drop", "unknown_field"]))
        if op == "unknown_field" or (op == "drop" and not where):
            if isinstance(target, dict):
                target[draw(st.text(min_size=1, max_size=12))] = draw(HOSTILE)
            continue
        if not where:
            continue
        parent, key = get_in(body, where[:-1]), where[-1]
        hit.add(str(where[0]))
        if op == "drop":
            del parent[key]
        elif op == "wrong_type" and len(where) == 1:
            parent[key] = draw(wrong_type(top_schema.get("properties", {}).get(key, True)))
        else:
            parent[key] = draw(HOSTILE)
    return body, hit


def keep_it_small(draw, body: Any, hit: set[str], schema: dict) -> None:
    """Force a short generation (max_tokens <= 4, n <= 2) unless the case is a hostile value
    of those very fields: then the server must refuse it or run it as asked."""
    if not isinstance(body, dict):
        return
    if "options" in schema.get("properties", {}) and "options" not in hit:  # Ollama's: options.num_predict
        options = body.get("options")
        if not isinstance(options, dict):
            options = body["options"] = {}
        value = options.get("num_predict")
        if not (type(value) is int and 0 <= value <= MAX_TOKENS):
            options["num_predict"] = draw(st.integers(0, MAX_TOKENS))
    for field, limit in SIZE_FIELDS.items():
        if (field in hit or field not in schema.get("properties", {})
                or (field == "max_completion_tokens" and body.get(field) is None)):
            continue
        value = body.get(field)
        if not (type(value) is int and value <= limit):
            body[field] = draw(st.integers(1, limit))


@st.composite
def request_body(draw, route: str, schema: dict) -> tuple[bytes, Any]:
    """(JSON bytes, the body) for `route`: a seed or schema instance, maybe mutated."""
    source = draw(st.sampled_from(["seed", "schema"]))
    if source == "seed":
        body = copy.deepcopy(draw(st.sampled_from(SEEDS[route])))
    else:
        body = draw(schema_strategy(schema, max_optional=draw(st.sampled_from([0, 2, 5, len(schema["properties"])]))))
        if "model" in body and draw(st.integers(0, 3)):
            body["model"] = MODEL_NAME  # mostly the served model, so the request gets past the 404
    hit: set[str] = set()
    if draw(st.integers(0, 2)):
        body, hit = draw(mutated(body, schema))
    if route in GENERATING:
        keep_it_small(draw, body, hit, schema)
    text = DEEP.sub(lambda m: "[" * int(m[1]) + "]" * int(m[1]), json.dumps(body, ensure_ascii=not draw(st.booleans())))
    # Unescaped, a lone surrogate ("\ud800") becomes bytes that are not UTF-8: the server must refuse them.
    return text.encode("utf-8", "surrogatepass"), body


# ------------------------------------------------------------------ checks
def show(content: bytes | str, limit: int = 1500) -> str:
    if isinstance(content, bytes):
        try:
            content = content.decode()
        except UnicodeDecodeError:
            content = repr(content)
    text = content
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} chars)"


def assert_error_body(payload: Any, context: str, route: str = "") -> None:
    if route in OLLAMA:
        assert isinstance(payload, dict) and set(payload) == {"error"}, f"not an Ollama error body: {context}"
        assert isinstance(payload["error"], str) and payload["error"], context
        return
    if route in ANTHROPIC:
        assert isinstance(payload, dict) and payload.get("type") == "error", f"not an Anthropic error body: {context}"
        err = payload.get("error")
        assert isinstance(err, dict) and isinstance(err.get("message"), str) and err["message"], context
        assert isinstance(err.get("type"), str) and err["type"] != "api_error", context
        return
    assert isinstance(payload, dict) and set(payload) >= {"error"}, f"not an OpenAI error body: {context}"
    err = payload["error"]
    assert isinstance(err, dict) and {"message", "type", "param", "code"} <= set(err), f"error fields: {context}"
    assert isinstance(err["message"], str) and err["message"], f"empty error message: {context}"
    assert isinstance(err["type"], str) and err["type"], context
    assert err["param"] is None or isinstance(err["param"], str), context
    assert err["code"] is None or isinstance(err["code"], str | int), context


def send(client: httpx.Client, route: str, content: bytes | str, headers: dict[str, str]) -> None:
    """POST one case and check the answer (a stream to its end) as the module docstring says."""
    case = f"POST {route} {show(content)}"
    start = time.monotonic()
    try:
        # A fresh connection per case: one case's fate (the server closing the connection
        # after an unhandled exception) must not land on the next.
        with client.stream("POST", route, content=content, headers={**headers, "Connection": "close"}) as r:
            status = r.status_code
            if status == 200 and r.headers.get("content-type", "").startswith("text/event-stream"):
                events = []
                for line in r.iter_lines():
                    assert time.monotonic() - start < REQUEST_TIMEOUT, f"stream still open after the timeout: {case}"
                    if line.startswith("data: "):
                        events.append(line[len("data: "):])
                check_events(events, case, route)
                return
            if status == 200 and r.headers.get("content-type", "").startswith("application/x-ndjson"):
                lines = []
                for line in r.iter_lines():
                    assert time.monotonic() - start < REQUEST_TIMEOUT, f"stream still open after the timeout: {case}"
                    lines.append(line)
                check_ndjson(lines, case, route)
                return
            body = r.read().decode("utf-8", "replace")
    except httpx.TimeoutException as e:
        pytest.fail(f"no answer within {REQUEST_TIMEOUT:g} s ({type(e).__name__}): {case}")
    except httpx.TransportError as e:  # the server dropped the connection instead of answering
        pytest.fail(f"{type(e).__name__} ({e}) after {time.monotonic() - start:.1f} s: {case}")
    elapsed = time.monotonic() - start
    assert elapsed < REQUEST_TIMEOUT, f"answered after {elapsed:.1f} s: {case}"
    assert status < 500, f"{status} {show(body)} for {case}"
    try:
        payload = json.loads(body)
    except ValueError:
        pytest.fail(f"{status} with a body that is not JSON ({show(body)}) for {case}")
    if status >= 400:
        assert_error_body(payload, f"{status} {show(body)} for {case}", route)
    else:
        assert status == 200 and isinstance(payload, dict), f"{status} {show(body)} for {case}"


def check_ndjson(lines: list[str], case: str, route: str) -> None:
    """Ollama's stream: every line JSON, the last one done (or an in-band error)."""
    objects = [json.loads(line) for line in lines if line.strip()]
    assert objects, f"empty stream for {case}"
    last = objects[-1]
    if "error" in last:
        assert_error_body(last, f"in-band {show(lines[-1])} for {case}", route)
    else:
        assert last.get("done") is True and all(o.get("done") is False for o in objects[:-1]), case


def check_events(events: list[str], case: str, route: str = "") -> None:
    """Every event is JSON (an in-band error one not a server_error) and the stream ends with
    [DONE] (Anthropic's: with message_stop or an error event; the Responses API's: with
    response.completed or .incomplete, or an error event and response.failed)."""
    if route == "/v1/responses":
        assert events, f"empty stream for {case}"
        last = json.loads(events[-1])
        ends = ("response.completed", "response.incomplete", "response.failed")
        assert last["type"] in ends, f"stream ended with {show(events[-1])} for {case}"
        if last["type"] == "response.failed":
            error = json.loads(events[-2])
            assert error["type"] == "error" and isinstance(error["message"], str) and error["message"], case
        return
    if route in ANTHROPIC:
        assert events, f"empty stream for {case}"
        last = json.loads(events[-1])
        assert last["type"] in ("message_stop", "error"), f"stream ended with {show(events[-1])} for {case}"
        if last["type"] == "error":
            assert_error_body(last, f"in-band {show(events[-1])} for {case}", route)
        return
    assert events and events[-1] == "[DONE]", f"stream ended without [DONE] ({show(repr(events[-3:]))}) for {case}"
    for data in events:
        if data == "[DONE]":
            continue
        try:
            event = json.loads(data)
        except ValueError:
            pytest.fail(f"stream event that is not JSON ({show(data)}) for {case}")
        if "error" in event:
            assert_error_body(event, f"in-band {show(data)} for {case}")
            assert event["error"]["type"] != "server_error", f"in-band server error {show(data)} for {case}"


def answers_normally(client: httpx.Client, pooling: bool = False) -> None:
    if pooling:
        r = client.post("/v1/embeddings", headers=JSON_HEADERS,
                        content=json.dumps({"model": MODEL_NAME, "input": "hello world", "encoding_format": "float"}))
        assert r.status_code == 200, r.text
        (data,) = r.json()["data"]
        assert abs(sum(x * x for x in data["embedding"]) - 1) < 1e-3
        return
    r = client.post("/v1/completions", headers=JSON_HEADERS,
                    content=json.dumps({"model": MODEL_NAME, "prompt": "hello world", "max_tokens": 2}))
    assert r.status_code == 200, r.text
    (choice,) = r.json()["choices"]
    assert isinstance(choice["text"], str) and choice["finish_reason"] in ("length", "stop")


# ------------------------------------------------------------------ tests
@pytest.fixture(scope="module")
def client(server):
    with httpx.Client(base_url=server.url, timeout=REQUEST_TIMEOUT) as c:
        yield c


@pytest.fixture(scope="module")
def pooling_client(tiny_model_dir, tmp_path_factory):
    from tests.entrypoints.openai.conftest import SERVER_FLAGS, ServerProcess

    proc = ServerProcess([str(tiny_model_dir), *SERVER_FLAGS, "--runner", "pooling"],
                         tmp_path_factory.mktemp("log") / "pooling-server.log")
    try:
        with httpx.Client(base_url=proc.url, timeout=REQUEST_TIMEOUT) as c:
            yield c
    finally:
        proc.stop()


class Schemas(dict):
    def __repr__(self) -> str:  # hypothesis prints the test's arguments with a failing example
        return "<request schemas from /openapi.json>"


@pytest.fixture(scope="module")
def schemas(client) -> Schemas:
    r = client.get("/openapi.json", headers=AUTH)
    assert r.status_code == 200, r.text
    spec = r.json()
    components = spec["components"]["schemas"]
    out = Schemas()
    for route, name in ROUTES.items():
        (media,) = spec["paths"][route]["post"]["requestBody"]["content"].values()
        assert media["schema"] == {"$ref": f"#/components/schemas/{name}"}, (route, media)
        out[route] = resolve_refs(media["schema"], components)
        assert out[route]["type"] == "object" and out[route]["properties"], route
    return out


def test_every_post_route_is_fuzzed(client, schemas):
    spec = client.get("/openapi.json", headers=AUTH).json()
    with_body = {path for path, ops in spec["paths"].items() if "post" in ops and "requestBody" in ops["post"]}
    assert with_body == set(ROUTES) == set(schemas)
    bodiless = {path for path, ops in spec["paths"].items() if "post" in ops} - with_body
    # (/ping: vLLM's liveness probe, POST too; the profile routes, off on this server: 404s)
    assert bodiless == {"/v1/responses/{response_id}/cancel", "/ping", "/start_profile", "/stop_profile"}
    assert client.post("/ping").status_code == 200
    assert [client.post(p, headers=AUTH).status_code for p in ("/start_profile", "/stop_profile")] == [404, 404]
    for response_id in ["", "x" * 10_000, "../../etc/passwd", "%00", "resp_" + "\u00e9" * 50]:
        r = client.post(f"/v1/responses/{response_id}/cancel", headers=AUTH)
        assert r.status_code in (404, 405) and r.headers["content-type"].startswith("application/json"), r.text


@pytest.mark.parametrize("route", list(ROUTES))
@FUZZ
@given(data=st.data())
def test_fuzzed_bodies_get_answers_not_5xx(client, schemas, route, data, request):
    pooling = route in POOLING
    target = request.getfixturevalue("pooling_client") if pooling else client
    content, _ = data.draw(request_body(route, schemas[route]), label="body")
    send(target, route, content, JSON_HEADERS)
    answers_normally(target, pooling)


RAW_BODIES = [
    (b"", "application/json"),
    (b"not json", "application/json"),
    (b"{", "application/json"),
    (b'{"prompt": "x", }', "application/json"),
    (b"\xff\xfe\xfd", "application/json"),
    (b'{"prompt": "\xc3\x28", "model": "tiny-llama"}', "application/json"),  # invalid UTF-8 in a string
    ('{"prompt": "x", "tokens": [1]}'.encode("utf-16"), "application/json"),
    (b"\xef\xbb\xbf{}", "application/json"),  # a UTF-8 byte order mark
    (b'{"max_tokens": NaN, "prompt": "x", "tokens": [1]}', "application/json"),
    (b"null", "application/json"),
    (b"[]", "application/json"),
    (b'"x"', "application/json"),
    (b"1e999", "application/json"),
    (b"[" * 100_000 + b"]" * 100_000, "application/json"),
    (b'{"prompt": "x", "messages": [], "tokens": [1], "model": "tiny-llama"}', "text/plain"),
    (b'{"prompt": "x", "tokens": [1]}', "application/x-www-form-urlencoded"),
    (b"prompt=x&tokens=1", "application/x-www-form-urlencoded"),
    (b'--b\r\nContent-Disposition: form-data; name="prompt"\r\n\r\nx\r\n--b--\r\n', "multipart/form-data; boundary=b"),
    (b'{"prompt": "x", "tokens": [1]}', "application/json; charset=latin-1"),
    (b'{"prompt": "x", "tokens": [1]}', None),
    (b'{"prompt": "x", "prompt": ["y"], "tokens": [1], "tokens": "z"}', "application/json"),  # duplicate keys
]


@pytest.mark.parametrize("route", list(ROUTES))
def test_raw_bodies_are_4xx_not_5xx(client, route):
    for content, content_type in RAW_BODIES:
        headers = {**AUTH, **({"Content-Type": content_type} if content_type else {})}
        send(client, route, content, headers)
    answers_normally(client)


def test_a_body_sent_as_a_form_is_named_as_such(client):
    """curl's -d sends a form type: the 400 says so (it said "body: Input should be a valid
    dictionary"); Ollama's routes read their bodies as JSON whatever the type."""
    r = client.post("/v1/completions", content=b'{"prompt": "x", "max_tokens": 1}',
                    headers={**AUTH, "Content-Type": "application/x-www-form-urlencoded"})
    assert r.status_code == 400 and "Content-Type: application/json" in r.json()["error"]["message"], r.text
    # JSON types are application/json and application/*+json (FastAPI reads no other as JSON:
    # these met its unnamed error); no type at all (`requests.post(url, data=text)`) reads as JSON.
    for content_type in ("text/json", "application/jsonl", "multipart/form-data; boundary=json"):
        r = client.post("/tokenize", content=b'{"prompt": "x"}', headers={**AUTH, "Content-Type": content_type})
        assert r.status_code == 400 and repr(content_type) in r.json()["error"]["message"], r.text
    for headers in (AUTH, {**AUTH, "Content-Type": "application/vnd.api+json"}):
        r = client.post("/tokenize", content=b'{"prompt": "x"}', headers=headers)
        assert r.status_code == 200 and r.json()["count"] >= 1, r.text
    r = client.post("/api/generate", content=b'{"model": "tiny-llama", "prompt": "x", "stream": false, '
                    b'"options": {"num_predict": 1}}', headers={**AUTH, "Content-Type": "application/x-www-form-urlencoded"})
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("route", list(ROUTES))
@settings(FUZZ, max_examples=examples(40))
@given(content=st.binary(max_size=64), content_type=st.sampled_from(
    ["application/json", "text/plain", "application/octet-stream", "application/json; charset=utf-16", ""]))
def test_random_bytes_are_4xx_not_5xx(client, route, content, content_type):
    send(client, route, content, {**AUTH, "Content-Type": content_type})


# Minimal cases the fuzzing found (each was a 500): kept so that they fail until fixed.
FOUND = [
    ("/tokenize", b'{"prompt": "\\ud800"}'),  # a lone surrogate reaches the tokenizer: TypeError
    ("/v1/chat/completions", b'{"model": "tiny-llama", "max_tokens": 2, "messages": [{"role": "user", '
                             b'"content": "\\udfff"}]}'),
    ("/v1/completions", b'{"model": "tiny-llama", "prompt": "hi", "max_tokens": 2, "guided_grammar": ""}'),
    ("/v1/completions", b'{"model": "tiny-llama", "prompt": "hi", "max_tokens": 2, "guided_grammar": "root ::= b"}'),
    ("/v1/chat/completions", b'{"model": "tiny-llama", "max_tokens": 2, "messages": [{"role": "user", '
                             b'"content": "hi"}], "tools": [{"type": "function", "function": {"name": "f"}}], '
                             b'"tool_choice": {"type": "function", "function": "f"}}'),
    # Constraints that together leave no token to sample.
    ("/v1/completions", b'{"model": "tiny-llama", "prompt": "hi", "max_tokens": 2, "allowed_token_ids": [5], '
                        b'"guided_regex": "[a-z]+"}'),
    ("/v1/completions", b'{"model": "tiny-llama", "prompt": "hi", "max_tokens": 2, "allowed_token_ids": [5], '
                        b'"guided_regex": "[a-z]+", "stream": true}'),
]


@pytest.mark.parametrize("route,content", FOUND, ids=range(len(FOUND)))
def test_cases_found_by_fuzzing(client, route, content):
    send(client, route, content, JSON_HEADERS)


# ------------------------------------------------ hostile content: templates, grammars, bounds
# Pieces of Jinja a hostile request combines: bombs of memory and time, escapes from the
# sandbox, file access, and ordinary template code (the bounds must not refuse that).
TEMPLATE_PIECES = [
    "{{ messages[0].content }}", "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}",
    "{{ 'ab' * %d }}", "{% for i in range(%d) %}x{% endfor %}", "{% for i in range(%d) %}{% for j in range(%d) %}"
    "{% endfor %}{% endfor %}", "{{ ().__class__.__base__.__subclasses__() }}", "{{ cycler.__init__.__globals__ }}",
    "{% include '/etc/passwd' %}", "{% import 'x' as y %}", "{{ raise_exception('refused') }}", "{{ a.b.c }}",
    "{{ '%%0%dd' %% 1 }}", "{{ 'a' | center(%d) }}", "{{ 10 ** 10 ** %d }}", "{{ lipsum(%d) }}",
    "{% set ns = namespace(s='ab') %}{% for i in range(%d) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}{{ ns.s }}",
    "{{ tools | tojson }}", "/etc/passwd", "{%", "{{ bos_token }}", "{% if add_generation_prompt %}A:{% endif %}",
]


@st.composite
def hostile_template(draw) -> str:
    pieces = []
    for piece in draw(st.lists(st.sampled_from(TEMPLATE_PIECES), min_size=1, max_size=3)):
        while "%d" in piece:
            piece = piece.replace("%d", str(draw(st.sampled_from([1, 3, 40, 10**5, 10**8]))), 1)
        pieces.append(piece.replace("%%", "%"))
    return "".join(pieces)


@settings(FUZZ, max_examples=15)
@given(template=hostile_template(), stream=st.booleans())
def test_hostile_chat_templates_get_answers_not_5xx(client, template, stream):
    body = {"model": MODEL_NAME, "messages": MESSAGES, "max_tokens": 2, "chat_template": template, "stream": stream}
    send(client, "/v1/chat/completions", json.dumps(body), JSON_HEADERS)
    answers_normally(client)


@st.composite
def hostile_constraint(draw) -> dict:
    n = draw(st.sampled_from([1, 10, 100, 1000, 3000]))
    kind = draw(st.sampled_from(["refs", "props", "arrays", "anyof", "rules", "parens", "regex"]))
    if kind in ("refs", "props"):
        defs = {f"d{i}": {"$ref": f"#/$defs/d{i + 1}"} if kind == "refs" else
                {"type": "object", "properties": {"a": {"$ref": f"#/$defs/d{i + 1}"}}} for i in range(n)}
        defs[f"d{n}"] = {"type": "integer"}
        return {"guided_json": {"$defs": defs, "$ref": "#/$defs/d0"}}
    if kind in ("arrays", "anyof"):
        schema: dict = {"type": "integer"}
        for _ in range(min(n, 400)):  # deeper bodies are the JSON parser's (a 400 before us)
            schema = {"type": "array", "items": schema} if kind == "arrays" else {"anyOf": [schema, {"type": "null"}]}
        return {"guided_json": schema}
    if kind == "rules":
        return {"guided_grammar": "\n".join(["root ::= r0", *(f"r{i} ::= r{i + 1}" for i in range(n)),
                                             f'r{n} ::= "7"'])}
    if kind == "parens":
        return {"guided_grammar": "root ::= " + "(" * n + '"x"' + ")" * n}
    return {"guided_regex": "(" * n + "x" + ")" * n + draw(st.sampled_from(["", "{1000}", "*", "{1,65535}"]))}


@settings(FUZZ, max_examples=15)
@given(constraint=hostile_constraint(), route=st.sampled_from(GENERATING))
def test_hostile_grammars_get_answers_not_5xx(client, constraint, route):
    body = {"model": MODEL_NAME, "max_tokens": 2, **constraint,
            **({"prompt": "n:"} if route == "/v1/completions" else {"messages": MESSAGES})}
    send(client, route, json.dumps(body), JSON_HEADERS)
    answers_normally(client)


@st.composite
def bounded_fields(draw) -> dict:
    """A list field drawn around its bound (request_limits.py), or a big fan-out."""
    from pagedserve import request_limits as rl

    field = draw(st.sampled_from(["bad_words", "allowed_token_ids", "logit_bias", "stop", "stop_token_ids",
                                  "prompt"]))
    bound = {"bad_words": rl.MAX_BAD_WORDS, "allowed_token_ids": rl.MAX_ALLOWED_TOKEN_IDS,
             "logit_bias": rl.MAX_TOKEN_ID_LIST, "stop": rl.MAX_STOP_STRINGS,
             "stop_token_ids": rl.MAX_TOKEN_ID_LIST, "prompt": rl.MAX_SEQUENCES_PER_REQUEST}[field]
    size = draw(st.sampled_from([1, bound, bound + 1, 3 * bound]))
    if field == "bad_words":
        return {field: ["w" * draw(st.sampled_from([1, rl.MAX_BAD_WORD_CHARS, 9600]))] * size,
                "n": draw(st.sampled_from([1, 16]))}
    if field == "allowed_token_ids":
        return {field: draw(st.sampled_from([list(range(5, 5 + min(size, 300))), [7] * size]))}
    if field == "logit_bias":
        return {field: {str(i % 384): 1.0 for i in range(size)}}
    if field == "stop":
        return {field: ["zz"] * size}
    if field == "stop_token_ids":
        return {field: [3] * size}
    return {"prompt": ["hi"] * max(1, size // 4), "n": 4, "max_tokens": 1}


@settings(FUZZ, max_examples=20)
@given(fields=bounded_fields())
def test_bounded_fields_get_answers_not_5xx(client, fields):
    body = {"model": MODEL_NAME, "prompt": "hi", "max_tokens": 2, **fields}
    send(client, "/v1/completions", json.dumps(body), JSON_HEADERS)
    answers_normally(client)


def test_server_answers_a_normal_request_afterwards(client, server):
    answers_normally(client)
    assert client.get("/health").status_code == 200
    assert server.proc.poll() is None, server.log()
