from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedserve.errors import InvalidRequestError
from pagedserve.sampling_params import RequestOutputKind, SamplingParams
from tests.engine.fake_runner import make_engine, run_to_completion
from tests.engine.helpers import make_tokenizer
from tests.hypothesis_budget import examples

TEXT = "héllo wörld, 你好 the quick brown fox jumps over the lazy dog."


@pytest.fixture(scope="module")
def tok():
    return make_tokenizer()


def text_script(tok, text=TEXT):
    ids = tok.encode(text)
    return lambda i, prompt: ids[i % len(ids)]


def test_token_prompts_run_to_length_with_metrics() -> None:
    engine = make_engine()
    for k in range(3):
        engine.add_request(f"r{k}", [1, 2, 3 + k], SamplingParams(max_tokens=5 + k))
    assert engine.get_num_unfinished_requests() == 3
    final = run_to_completion(engine)
    for k in range(3):
        out = final[f"r{k}"]
        c = out.outputs[0]
        assert c.token_ids == [10 + i for i in range(5 + k)] and c.finish_reason == "length"
        assert c.text == "" and c.logprobs is None and c.cumulative_logprob is None
        assert out.prompt_token_ids == [1, 2, 3 + k] and out.prompt is None
        m = out.metrics
        assert m.arrival_time <= m.first_scheduled_time <= m.first_token_time <= m.finished_time
    stats = engine.get_stats()
    assert (stats.num_running, stats.num_waiting, stats.kv_cache_usage) == (0, 0, 0.0)
    assert stats.num_prompt_tokens == 9 and stats.num_generation_tokens == 5 + 6 + 7


def test_bad_requests_raise_and_leave_others_running(tok) -> None:
    engine = make_engine(tokenizer=tok, vocab_size=len(tok))
    engine.add_request("good", [5, 6, 7], SamplingParams(max_tokens=8))
    engine.step()
    mutated = SamplingParams()
    mutated.temperature = -1.0
    bad = [
        ("", "the prompt is empty"),
        ([], "the prompt is empty"),
        ({"prompt_token_ids": []}, "the prompt is empty"),
        ([1, len(tok)], "outside the vocabulary"),
        ([1, -3], "outside the vocabulary"),
        ([1, 2.5], "not an integer"),
        (list(range(1, 129)), "maximum context length"),
        (42, "a prompt must be"),
        ({"text": "hi"}, "keys 'prompt'"),
    ]
    for prompt, msg in bad:
        with pytest.raises(ValueError, match=msg):
            engine.add_request("bad", prompt, SamplingParams())
    with pytest.raises(ValueError, match="temperature"):
        engine.add_request("bad", [1], mutated)
    with pytest.raises(ValueError, match="logprobs must be at most 20"):
        engine.add_request("bad", [1], SamplingParams(logprobs=21))
    with pytest.raises(ValueError, match="stop_token_ids"):
        engine.add_request("bad", [1], SamplingParams(stop_token_ids=[10**6]))
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request("good", [1], SamplingParams())
    with pytest.raises(ValueError, match="request_id"):
        engine.add_request(7, [1], SamplingParams())
    with pytest.raises(ValueError, match="SamplingParams"):
        engine.add_request("bad", [1], {"temperature": 0})
    assert list(engine.scheduler.requests) == ["good"]
    final = run_to_completion(engine)
    assert list(final) == ["good"] and final["good"].outputs[0].token_ids == [10 + i for i in range(8)]
    assert engine.get_stats().kv_cache_usage == 0.0


def test_numpy_token_ids_are_accepted() -> None:
    import numpy as np

    engine = make_engine()
    engine.add_request("a", {"prompt_token_ids": np.array([4, 5, 6])}.get("prompt_token_ids").tolist())
    engine.add_request("b", [np.int64(4), np.int32(5)], SamplingParams(max_tokens=2))
    assert engine.scheduler.requests["b"].prompt_token_ids == [4, 5]
    assert all(type(t) is int for t in engine.scheduler.requests["b"].prompt_token_ids)


def test_text_prompts_need_a_tokenizer() -> None:
    engine = make_engine()
    with pytest.raises(ValueError, match="no tokenizer"):
        engine.add_request("a", "hello", SamplingParams())
    with pytest.raises(ValueError, match="stop strings need a tokenizer"):
        engine.add_request("a", [1], SamplingParams(stop="x"))
    assert not engine.has_unfinished_requests()


def test_text_prompt_and_stop_string_finish_the_request(tok) -> None:
    engine = make_engine(text_script(tok), tokenizer=tok, vocab_size=len(tok))
    engine.add_request("s", "hello world", SamplingParams(max_tokens=100, stop=["quick brown"]))
    engine.add_request("plain", "hello", SamplingParams(max_tokens=len(tok.encode(TEXT))))
    shown = []
    final = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.request_id == "s":
                shown.append(out.outputs[0].text)
            if out.finished:
                final[out.request_id] = out
    s = final["s"].outputs[0]
    assert final["s"].prompt == "hello world" and final["s"].prompt_token_ids == tok.encode("hello world")
    assert (s.text, s.finish_reason, s.stop_reason) == ("héllo wörld, 你好 the ", "stop", "quick brown")
    assert all("quick" not in t and "\ufffd" not in t for t in shown)
    assert all(b.startswith(a) for a, b in zip(shown, shown[1:], strict=False))
    assert final["plain"].outputs[0].text == TEXT
    assert "s" not in engine.scheduler.requests and engine.get_stats().kv_cache_usage == 0.0


def test_eos_stops_and_is_not_in_the_text(tok) -> None:
    eos = tok.eos_token_id
    ids = tok.encode("hello") + [eos] + tok.encode(" more")
    engine = make_engine(lambda i, p: ids[i % len(ids)], tokenizer=tok, vocab_size=len(tok), eos_token_id=eos)
    engine.add_request("a", [5], SamplingParams(max_tokens=20, skip_special_tokens=False))
    engine.add_request("b", [5], SamplingParams(max_tokens=len(ids), ignore_eos=True))
    final = run_to_completion(engine)
    a, b = final["a"].outputs[0], final["b"].outputs[0]
    assert a.token_ids == ids[: ids.index(eos) + 1] and a.text == "hello"
    assert (a.finish_reason, a.stop_reason) == ("stop", None)
    assert b.token_ids == ids and b.finish_reason == "length"


def test_extra_eos_ids_from_the_model_config_stop() -> None:
    engine = make_engine(lambda i, p: [20, 21, 7, 22][i], eos_token_id=[2, 7])
    assert engine.eos_token_id == 2
    engine.add_request("a", [5], SamplingParams(max_tokens=10))
    engine.add_request("b", [5], SamplingParams(max_tokens=4, ignore_eos=True))
    final = run_to_completion(engine)
    assert final["a"].outputs[0].token_ids == [20, 21, 7] and final["a"].outputs[0].stop_reason == 7
    assert final["b"].outputs[0].token_ids == [20, 21, 7, 22]


def test_n_samples_aggregate_under_the_parent_id() -> None:
    engine = make_engine()
    engine.add_request("p", [1, 2, 3], SamplingParams(n=3, seed=5, max_tokens=4))
    seeds = sorted(r.sampling_params.seed for r in engine.scheduler.requests.values())
    assert seeds == [5, 6, 7] and len(engine.scheduler.requests) == 3
    outs = engine.step()
    assert [o.request_id for o in outs] == ["p"] and len(outs[0].outputs) == 3
    final = run_to_completion(engine)
    assert [c.index for c in final["p"].outputs] == [0, 1, 2]
    assert all(c.token_ids == [10, 11, 12, 13] for c in final["p"].outputs)
    engine.add_request("q", [1], SamplingParams(n=2))
    with pytest.raises(ValueError, match="already in use"):  # a child's id
        engine.add_request("q-1", [1])


def test_abort_frees_everything() -> None:
    engine = make_engine()
    engine.add_request("a", [1, 2, 3], SamplingParams(max_tokens=50))
    engine.add_request("b", [1, 2, 3], SamplingParams(n=2, max_tokens=50))
    engine.add_request("c", [4], SamplingParams(max_tokens=3))
    engine.step()
    engine.abort_request(["a", "b", "unknown"])
    assert set(engine.scheduler.requests) == {"c"}
    final = run_to_completion(engine)
    assert list(final) == ["c"] and engine.get_stats().kv_cache_usage == 0.0
    engine.abort_request("c")  # finished: ignored
    assert not engine.has_unfinished_requests()


def test_logprobs_dicts_and_cumulative() -> None:
    engine = make_engine()
    engine.add_request("a", [1], SamplingParams(max_tokens=3, logprobs=1))
    engine.add_request("b", [1], SamplingParams(max_tokens=3, logprobs=0))
    final = run_to_completion(engine)
    a, b = final["a"].outputs[0], final["b"].outputs[0]
    assert len(a.logprobs) == 3 and a.cumulative_logprob == pytest.approx(-1.5)
    first = a.logprobs[0]
    assert list(first) == [10, 11] and first[10].rank == 2 and first[11].rank == 1
    assert first[11].logprob == -0.25
    assert all(list(d) == [t] for d, t in zip(b.logprobs, b.token_ids, strict=True))


def test_preemption_keeps_outputs_identical() -> None:
    prompts = [[i + 1] * (10 + i) for i in range(6)]
    engine = make_engine(lambda i, p: (i * 7 + len(p)) % 300, num_blocks=6, block_size=16)
    for k, p in enumerate(prompts):
        engine.add_request(f"r{k}", p, SamplingParams(max_tokens=40))
    final = run_to_completion(engine)
    assert engine.get_stats().num_preemptions > 0
    for k, p in enumerate(prompts):
        assert final[f"r{k}"].outputs[0].token_ids == [(i * 7 + len(p)) % 300 for i in range(40)]


def test_prompt_plus_max_tokens_is_capped_at_max_model_len() -> None:
    engine = make_engine(max_model_len=32)
    engine.add_request("a", list(range(1, 21)), SamplingParams(max_tokens=100))
    out = run_to_completion(engine)["a"].outputs[0]
    assert len(out.token_ids) == 12 and out.finish_reason == "length"


def test_min_tokens_past_what_the_context_leaves_is_refused() -> None:
    """With max_tokens unset ("the rest of the context"), a larger min_tokens was accepted
    and then not met (the answer ended "length" short of it)."""
    engine = make_engine(max_model_len=32)
    with pytest.raises(InvalidRequestError, match="min_tokens must be at most the 12 tokens") as info:
        engine.add_request("a", list(range(1, 21)), SamplingParams(min_tokens=13))
    assert info.value.param == "min_tokens" and not engine.has_unfinished_requests()
    engine.add_request("b", list(range(1, 21)), SamplingParams(min_tokens=12, ignore_eos=True))
    assert len(run_to_completion(engine)["b"].outputs[0].token_ids) == 12


@pytest.mark.parametrize("kind", [RequestOutputKind.DELTA, RequestOutputKind.FINAL_ONLY])
def test_output_kinds(tok, kind) -> None:
    engine = make_engine(text_script(tok), tokenizer=tok, vocab_size=len(tok))
    engine.add_request("ref", [5], SamplingParams(max_tokens=30, logprobs=2))
    engine.add_request("x", [5], SamplingParams(max_tokens=30, logprobs=2), output_kind=kind)
    outs = {"ref": [], "x": []}
    while engine.has_unfinished_requests():
        for o in engine.step():
            outs[o.request_id].append(o)
    ref = outs["ref"][-1].outputs[0]
    if kind is RequestOutputKind.FINAL_ONLY:
        assert len(outs["x"]) == 1 and outs["x"][0].outputs[0] == ref
    else:
        assert len(outs["x"]) == 30
        assert "".join(o.outputs[0].text for o in outs["x"]) == ref.text
        assert sum((o.outputs[0].token_ids for o in outs["x"]), []) == ref.token_ids
        assert sum((o.outputs[0].logprobs for o in outs["x"]), []) == ref.logprobs


def test_chat_template(tok) -> None:
    engine = make_engine(tokenizer=tok, vocab_size=len(tok))
    msgs = [{"role": "user", "content": "hi"}]
    text = engine.apply_chat_template(msgs)
    assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert engine.apply_chat_template(msgs, add_generation_prompt=False).endswith("<|im_end|>\n")
    assert engine.apply_chat_template(msgs, chat_template="{{ messages[0]['content'] }}!") == "hi!"
    parts = [{"role": "user", "content": [{"type": "text", "text": "h"}, {"type": "text", "text": "i"}]}]
    assert engine.apply_chat_template(parts) == text.replace("hi", "h\ni")
    with pytest.raises(ValueError, match="only text and image content parts"):
        engine.apply_chat_template([{"role": "user", "content": [{"type": "audio"}]}])
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
    with pytest.raises(ValueError, match="takes no images") as e:  # a text model, before any image is read
        engine.encode_chat([{"role": "user", "content": [image]}])
    assert engine.model_config.model not in str(e.value)  # (a client's error names no server path)
    enc = engine.encode_chat(msgs)
    assert enc["prompt"] == text and tok.decode(enc["prompt_token_ids"]) == text
    with pytest.raises(ValueError, match="messages"):
        engine.apply_chat_template([{"content": "no role"}])
    with pytest.raises(ValueError, match="chat_template: TemplateError: nope"):  # a request's: the sandbox's error
        engine.apply_chat_template(msgs, chat_template="{{ raise_exception('nope') }}")
    with pytest.raises(ValueError, match="chat template failed"):  # the default one's, in-process
        make_engine(tokenizer=tok, vocab_size=len(tok), chat_template="{{ raise_exception('no') }}").apply_chat_template(
            msgs)
    with pytest.raises(ValueError, match="no tokenizer"):
        make_engine().apply_chat_template(msgs)


def test_a_request_with_invalid_logits_fails_alone() -> None:
    # The runner reports request "bad" as invalid (its logits were NaN) on its 3rd token.
    engine = make_engine(script=lambda i, prompt: None if prompt == [9, 9] and i == 2 else 10 + i)
    engine.add_request("good", [1, 2, 3], SamplingParams(max_tokens=6))
    engine.add_request("bad", [9, 9], SamplingParams(max_tokens=6))
    final = run_to_completion(engine)
    assert final["bad"].outputs[0].finish_reason == "error" and final["bad"].outputs[0].token_ids == [10, 11]
    assert final["good"].outputs[0].finish_reason == "length" and len(final["good"].outputs[0].token_ids) == 6
    assert engine.get_stats().kv_cache_usage == 0
    engine.add_request("after", [4, 5], SamplingParams(max_tokens=3))
    assert run_to_completion(engine)["after"].outputs[0].finish_reason == "length"


def test_engine_limits_name_their_field() -> None:
    engine = make_engine(max_n=4, max_logprobs=5)
    cases = [(SamplingParams(n=5), "n"), (SamplingParams(logprobs=6), "logprobs"),
             (SamplingParams(prompt_logprobs=10**30), "prompt_logprobs"),
             (SamplingParams(stop_token_ids=[400]), "stop_token_ids")]
    for params, field in cases:
        with pytest.raises(InvalidRequestError) as e:
            engine.add_request("x", [1, 2], params)
        assert e.value.param == field and field in str(e.value)
    with pytest.raises(InvalidRequestError, match="Got priority 3 but Priority scheduling is not enabled") as e:
        engine.add_request("x", [1, 2], SamplingParams(), priority=3)
    assert e.value.param == "priority"
    assert not engine.has_unfinished_requests()
    make_engine(scheduling_policy="priority").add_request("x", [1, 2], SamplingParams(), priority=3)
    # max_logprobs past the vocabulary (--max-logprobs 100000): the vocabulary bounds a
    # top-k (prompt_logprobs 60000 reached the runner's topk, which killed the engine)
    wide = make_engine(max_logprobs=100_000, vocab_size=400)
    for field in ("logprobs", "prompt_logprobs"):
        with pytest.raises(InvalidRequestError, match=f"{field} must be at most 400 \\(the model's vocabulary\\)"):
            wide.add_request("x", [1, 2], SamplingParams(**{field: 401}))
    wide.add_request("y", [1, 2], SamplingParams(max_tokens=1, logprobs=400, prompt_logprobs=400))
    assert run_to_completion(wide)["y"].outputs[0].logprobs is not None


SAMPLING_FIELDS = ("n", "temperature", "top_p", "top_k", "min_p", "seed", "presence_penalty", "frequency_penalty",
                   "repetition_penalty", "max_tokens", "min_tokens", "logprobs")


@settings(max_examples=examples(150), deadline=None)
@given(field=st.sampled_from(SAMPLING_FIELDS),
       value=st.sampled_from([math.nan, math.inf, -math.inf, 1e308, -1e308, 10**30, -(10**30), -1, 0, 2**63,
                              "1", None, [], True]))
def test_hostile_sampling_values_never_reach_the_engine(field, value):
    """Set after construction (bypassing __post_init__): the engine re-validates, refuses
    with ValueError and a good request runs afterwards."""
    engine = make_engine(max_model_len=64)
    params = SamplingParams(max_tokens=4)
    setattr(params, field, value)
    try:
        engine.add_request("x", [1, 2, 3], params)
    except (ValueError, TypeError):
        assert not engine.has_unfinished_requests()
    else:
        run_to_completion(engine)
    engine.add_request("good", [1, 2], SamplingParams(max_tokens=2))
    assert run_to_completion(engine)["good"].outputs[0].finish_reason == "length"


def test_chat_template_options_tools_and_tool_history(tok) -> None:
    engine = make_engine(tokenizer=tok, vocab_size=len(tok))
    template = ("{% if tools %}[{{ tools | map(attribute='function.name') | join(',') }}]{% endif %}"
                "{% for m in messages %}<{{ m.role }}>{{ m.content }}"
                "{% for c in m.get('tool_calls', []) %}{{ c.function.name }}({{ c.function.arguments.city }})"
                "{% endfor %}{% endfor %}{% if add_generation_prompt %}<assistant>{% endif %}"
                "{% if think is defined %}think={{ think }}{% endif %}")
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {}}}]
    msgs = [{"role": "user", "content": "hi"},
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'}}]},
            {"role": "tool", "tool_call_id": "c1", "content": "sunny"}]
    text = engine.apply_chat_template(msgs, template, tools=tools, chat_template_kwargs={"think": False})
    # Tools rendered, the call's JSON-text arguments given to the template as an object, the
    # tool result kept, the template kwarg seen.
    assert text == "[get_weather]<user>hi<assistant>get_weather(Rome)<tool>sunny<assistant>think=False"
    cont = engine.apply_chat_template([{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Hel"}],
                                      add_generation_prompt=False, continue_final_message=True)
    assert cont.endswith("<|im_start|>assistant\nHel")
    with pytest.raises(ValueError, match="continue_final_message and add_generation_prompt cannot both be true"):
        engine.apply_chat_template([{"role": "user", "content": "hi"}], continue_final_message=True)
    # any role's last message is continued, as HF's apply_chat_template and vLLM do (it was refused)
    user = engine.apply_chat_template([{"role": "user", "content": "Once upon a"}], add_generation_prompt=False,
                                      continue_final_message=True)
    assert user.endswith("<|im_start|>user\nOnce upon a")
    with pytest.raises(ValueError, match="may not set tools"):
        engine.apply_chat_template(msgs, template, chat_template_kwargs={"tools": []})


def test_bad_words_are_tokenized_once_per_request_and_text_prompts_are_bounded(tok) -> None:
    """n=4 samples share one tokenization of the bad words (it was once per sample, on
    the engine thread); prompt text too long for max_model_len tokens is refused before
    the tokenizer sees it."""
    engine = make_engine(tokenizer=tok, vocab_size=len(tok))
    calls = []
    encode = tok.encode

    def counting(text, *a, **kw):
        calls.append(text)
        return encode(text, *a, **kw)

    tok.encode = counting
    try:
        engine.add_request("r", [1, 2, 3], SamplingParams(max_tokens=2, n=4, bad_words=["fox", "dog"]))
        assert len(calls) == 4  # each word alone and after a space, once
        calls.clear()
        with pytest.raises(InvalidRequestError, match="characters") as info:
            engine.add_request("big", "ab " * (engine.max_prompt_chars // 3 + 1), SamplingParams())
        assert info.value.param == "prompt" and not calls
    finally:
        tok.encode = encode
    assert engine.max_prompt_chars <= 128 * max(len(t) for t in tok.get_vocab())


def test_a_bad_word_is_banned_alone_and_after_a_space_whatever_it_starts_with(tok) -> None:
    """vLLM's rule: " Paris" was tokenized as written and after a space, both " Paris",
    so the word alone stayed allowed."""
    processor = make_engine(tokenizer=tok, vocab_size=len(tok)).input_processor
    both = [tok.encode("fox", add_special_tokens=False), tok.encode(" fox", add_special_tokens=False)]
    assert both[0] != both[1]
    for word in ("fox", " fox", "  fox"):
        assert processor.bad_words_token_ids([word]) == both, word


# Where each request field is checked (the structure issue's one rule in one place): its
# shape and range once, in SamplingParams.validate (run at construction, and again when
# the engine takes the request, since a caller can change a field afterwards), and the
# limits of this engine (its vocabulary, max_logprobs, max_n, a tokenizer) once, in
# the InputProcessor (engine/input_processor.py).  The HTTP layer's request models check
# only the JSON types and the fields that exist there alone (stream_options, tool_choice,
# ...).  Each row: a bad value and the class whose method refuses it.
_SP, _ENG = "SamplingParams", "InputProcessor"
REQUEST_FIELD_CHECKS = {
    "n": [(0, _SP), (5, _ENG)], "temperature": [(-1.0, _SP)], "top_p": [(0.0, _SP)], "top_k": [(-2, _SP)],
    "min_p": [(2.0, _SP)], "seed": [(2**64, _SP)], "presence_penalty": [(3.0, _SP)],
    "frequency_penalty": [(math.nan, _SP)], "repetition_penalty": [(0.0, _SP)], "stop": [([""], _SP)],
    "stop_token_ids": [([-1], _SP), ([400], _ENG)], "include_stop_str_in_output": [(1, _SP)],
    "ignore_eos": [("no", _SP)], "max_tokens": [(0, _SP)], "min_tokens": [(-1, _SP)],
    "logprobs": [(-1, _SP), (6, _ENG)], "prompt_logprobs": [(-1, _SP), (6, _ENG)],
    "skip_special_tokens": [(None, _SP)], "logit_bias": [({1: 101.0}, _SP), ({400: 1.0}, _ENG)],
    "allowed_token_ids": [([], _SP), ([400], _ENG)], "bad_words": [([""], _SP), (["x"], _ENG)],
    "structured_outputs": [("json", _SP)], "truncate_prompt_tokens": [(0, _SP), (10**6, _ENG)],
    "output_kind": [("delta", _SP)], "detokenize": [("no", _SP)],
    # n > 1, penalties and logit edits with it are refused in SamplingParams too (tests/test_sampling_params.py).
    "prediction": [(5, _SP), ([1, -1], _SP), ([400], _ENG), (list(range(129)), _ENG), ("text", _ENG)],
    # (the engine here has no tokenizer: no thinking tags, so any budget is refused there)
    "thinking_token_budget": [(-1, _SP), (4, _ENG)],
    # Set by the front end from bad_words and thinking_token_budget (tokenized off the
    # engine thread), not sent by clients.
    "bad_words_token_ids": [], "thinking_tags": [],
}


def test_every_request_field_is_listed_with_where_it_is_checked() -> None:
    from dataclasses import fields

    assert sorted(REQUEST_FIELD_CHECKS) == sorted(f.name for f in fields(SamplingParams))


@pytest.mark.parametrize(("name", "value", "owner"), [
    (name, value, owner) for name, rows in sorted(REQUEST_FIELD_CHECKS.items()) for value, owner in rows])
def test_each_request_field_is_refused_in_its_one_place(name, value, owner) -> None:
    engine = make_engine(max_n=4, max_logprobs=5)  # no tokenizer: bad_words need one
    params = SamplingParams(max_tokens=4)
    setattr(params, name, value)
    with pytest.raises(InvalidRequestError) as info:
        engine.add_request("x", [1, 2], params)
    assert info.value.param == name, info.value
    tb = info.value.__traceback__
    while tb.tb_next is not None:
        tb = tb.tb_next
    assert tb.tb_frame.f_code.co_qualname.split(".")[0] == owner, (name, tb.tb_frame.f_code.co_qualname)
    assert not engine.has_unfinished_requests()


def test_a_refused_prompt_of_a_batch_is_named_by_its_position() -> None:
    """`prompts[2]: the prompt is empty`, keeping the error's type and field (the message
    alone did not say which of thousands to fix); a batch of one is not numbered; a
    replica's share names the caller's positions; nothing is left queued."""
    engine = make_engine()
    sp = SamplingParams(max_tokens=2)
    with pytest.raises(InvalidRequestError, match=r"^prompts\[2\]: the prompt is empty$") as e:
        engine.run_batch([[1], [2], [], [3]], [sp] * 4)
    assert e.value.param == "prompt"
    with pytest.raises(InvalidRequestError, match=r"^prompts\[7\]: the prompt is empty$"):
        engine.run_batch([[1], []], [sp] * 2, positions=[3, 7])
    with pytest.raises(InvalidRequestError, match=r"^the prompt is empty$"):
        engine.run_batch([[]], [sp])
    assert not engine.has_unfinished_requests()
    assert [len(o.outputs[0].token_ids) for o in engine.run_batch([[1], [2]], [sp] * 2)] == [2, 2]


def test_arrival_time_is_when_the_request_came_not_when_it_was_tokenized(monkeypatch) -> None:
    """vLLM stamps arrival before preprocessing: a long prompt's tokenizing put its
    arrival after a later short one's, and equal priorities ran in that order."""
    import time

    engine = make_engine()
    processor = engine.input_processor
    slow = processor.process_prompt

    def tokenizing_slowly(*args, **kwargs):
        time.sleep(0.2)
        return slow(*args, **kwargs)

    monkeypatch.setattr(processor, "process_prompt", tokenizing_slowly)
    before = time.time()
    request = processor.process("r", [1, 2, 3], SamplingParams(max_tokens=2))
    assert before <= request.arrival_time < before + 0.1
