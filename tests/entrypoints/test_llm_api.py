"""LLM API shapes with a scripted runner (no model): prompt forms, ordering, errors, chat."""

from __future__ import annotations

import os

import pytest

from pagedserve import LLM, SamplingParams
from tests.engine.fake_runner import make_engine
from tests.engine.helpers import make_tokenizer


@pytest.fixture(scope="module")
def tok():
    return make_tokenizer()


@pytest.fixture
def llm(tok):
    # Output i of a request is token 10 + i + first prompt token: outputs identify their prompt.
    engine = make_engine(lambda i, p: 10 + i + p[0], tokenizer=tok, vocab_size=len(tok))
    return LLM.from_engine(engine)


def test_unknown_engine_argument_is_a_type_error() -> None:
    with pytest.raises(TypeError, match="bogus_flag"):
        LLM("smollm2-135m-instruct", bogus_flag=1)


def test_prompt_forms(llm, tok) -> None:
    p = SamplingParams(max_tokens=3)
    [one] = llm.generate("hello world", p, use_tqdm=False)
    assert one.prompt == "hello world" and one.prompt_token_ids == tok.encode("hello world")
    assert len(one.outputs) == 1 and len(one.outputs[0].token_ids) == 3 and one.finished
    outs = llm.generate(["hello", {"prompt_token_ids": [7, 8]}, {"prompt": "world"}, [9, 9, 9]], p,
                        use_tqdm=False)
    assert [o.prompt for o in outs] == ["hello", None, "world", None]
    assert outs[1].outputs[0].token_ids == [17, 18, 19] and outs[3].prompt_token_ids == [9, 9, 9]
    [ids_only] = llm.generate([5, 6], p, use_tqdm=False)  # a bare token list is one prompt
    assert ids_only.prompt_token_ids == [5, 6]
    assert llm.generate([], p, use_tqdm=False) == []


def test_outputs_in_input_order_with_per_prompt_params(llm) -> None:
    prompts = [{"prompt_token_ids": [k + 1]} for k in range(6)]
    params = [SamplingParams(max_tokens=12 - 2 * k) for k in range(6)]  # later prompts finish first
    outs = llm.generate(prompts, params, use_tqdm=False)
    for k, o in enumerate(outs):
        assert o.prompt_token_ids == [k + 1]
        assert o.outputs[0].token_ids == [11 + k + i for i in range(12 - 2 * k)]
    ids = [int(o.request_id) for o in outs]
    assert ids == sorted(ids)


def test_bad_input_raises_and_leaves_engine_clean(llm) -> None:
    good = {"prompt_token_ids": [3]}
    with pytest.raises(ValueError, match="outside the vocabulary"):
        llm.generate([good, {"prompt_token_ids": [10**7]}, good], SamplingParams(), use_tqdm=False)
    assert not llm.llm_engine.has_unfinished_requests()
    with pytest.raises(ValueError, match="2 sampling_params for 3 prompts"):
        llm.generate([good] * 3, [SamplingParams()] * 2, use_tqdm=False)
    with pytest.raises(ValueError, match="prompts must be"):
        llm.generate(3.5, use_tqdm=False)
    [o] = llm.generate(good, SamplingParams(max_tokens=2), use_tqdm=False)  # still works
    assert o.outputs[0].token_ids == [13, 14]


def test_one_llm_from_two_threads_gives_each_its_own_answers(llm) -> None:
    """Two threads' batches stepped one scheduler at once: one raised an internal error and
    the other returned another's text.  They now run one after the other."""
    import threading

    prompts = [{"prompt_token_ids": [k + 1]} for k in range(6)]
    params = SamplingParams(max_tokens=100, ignore_eos=True)  # (the scripted model's context is 128)
    expected = [[11 + k + i for i in range(100)] for k in range(6)]
    got: dict[int, object] = {}

    def run(t: int) -> None:
        try:
            got[t] = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        except Exception as e:  # noqa: BLE001 - reported below
            got[t] = e

    threads = [threading.Thread(target=run, args=(t,)) for t in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert [got[t] == expected for t in range(3)] == [True] * 3, got
    assert not llm.llm_engine.has_unfinished_requests()


def test_text_that_tokenizes_past_the_models_vocabulary_is_refused(tok) -> None:
    """A tokenizer with more tokens than the weights' embedding rows (a GGUF with extra
    tokens): text holding one reached the embedding lookup and took the process down; token
    ids were checked, text was not."""
    engine = make_engine(lambda i, p: 10 + i, tokenizer=tok, vocab_size=len(tok) - 1)
    llm = LLM.from_engine(engine)
    with pytest.raises(ValueError, match=rf"tokenizes to id {len(tok) - 1}, outside the model's vocabulary"):
        llm.generate(" assistant", SamplingParams(max_tokens=2), use_tqdm=False)
    [ok] = llm.generate("hello world", SamplingParams(max_tokens=2), use_tqdm=False)
    assert ok.outputs[0].token_ids == [10, 11]


def test_priority_per_prompt() -> None:
    engine = make_engine(lambda i, p: 10 + i, scheduling_policy="priority", max_num_seqs=1)
    llm = LLM.from_engine(engine)
    finished_order = []
    step = engine.step

    def spy():
        outs = step()
        finished_order.extend(o.prompt_token_ids[0] for o in outs if o.finished)
        return outs

    engine.step = spy
    llm.generate([[1], [2], [3]], SamplingParams(max_tokens=2), use_tqdm=False, priority=[2, 0, 1])
    assert finished_order == [2, 3, 1]
    with pytest.raises(ValueError, match="priorities"):
        llm.generate([[1], [2]], use_tqdm=False, priority=[0])


def test_n_samples_and_tqdm(llm, capsys) -> None:
    [o] = llm.generate("hello", SamplingParams(n=3, max_tokens=4, seed=1), use_tqdm=True)
    assert [c.index for c in o.outputs] == [0, 1, 2] and all(len(c.token_ids) == 4 for c in o.outputs)
    err = capsys.readouterr().err
    assert "Processed prompts" in err and "output:" in err and "toks/s" in err


@pytest.mark.parametrize("stream", ["closed", "none", "breaks"])
def test_a_progress_bar_that_cannot_write_turns_off_and_the_batch_keeps_its_outputs(llm, monkeypatch, stream) -> None:
    """stderr closed, None, or a pipe whose reader left mid-batch: generate failed before
    any work, or threw the batch's finished outputs away."""
    import io
    import sys

    class Breaking(io.StringIO):
        def write(self, s: str) -> int:
            if self.tell() > 0:
                raise BrokenPipeError(32, "Broken pipe")
            return super().write(s)

    err = {"closed": io.StringIO(), "none": None, "breaks": Breaking()}[stream]
    if stream == "closed":
        err.close()
    monkeypatch.setattr(sys, "stderr", err)
    outs = llm.generate(["a", "b", "c"], SamplingParams(max_tokens=3), use_tqdm=True)
    assert [len(o.outputs[0].token_ids) for o in outs] == [3, 3, 3]


def test_after_shutdown_a_batch_is_refused_by_name(llm) -> None:
    """It ran on, and only a grammar request failed, with concurrent.futures' "cannot
    schedule new futures after shutdown"."""
    from pagedserve.sampling_params import StructuredOutputsParams

    llm.shutdown()
    for params in (SamplingParams(max_tokens=2), SamplingParams(max_tokens=2,
                                                                 structured_outputs=StructuredOutputsParams(choice=["a"]))):
        with pytest.raises(RuntimeError, match="was shut down"):
            llm.generate("hello", params, use_tqdm=False)
    llm.shutdown()  # (again: nothing)


def test_chat_single_and_batched(llm, tok) -> None:
    conv = [{"role": "user", "content": "hi"}]
    [o] = llm.chat(conv, SamplingParams(max_tokens=2), use_tqdm=False)
    assert o.prompt == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert o.prompt_token_ids == tok.encode(o.prompt, add_special_tokens=False)
    outs = llm.chat([conv, conv + [{"role": "assistant", "content": "yo"}, {"role": "user", "content": "?"}]],
                    SamplingParams(max_tokens=2), use_tqdm=False)
    assert len(outs) == 2 and outs[1].prompt.count("<|im_start|>") == 4
    [o] = llm.chat(conv, SamplingParams(max_tokens=1), use_tqdm=False, chat_template="Q: {{ messages[0].content }}")
    assert o.prompt == "Q: hi"
    with pytest.raises(ValueError, match="messages"):
        llm.chat([], use_tqdm=False)


def test_chat_takes_vllms_positional_order_and_refuses_non_booleans(llm) -> None:
    """vLLM's order is (messages, params, use_tqdm, lora_request, chat_template, ...): a
    ported call's template, given fifth, was taken as add_generation_prompt (truthy, so
    ignored), and "no" was a yes."""
    conv = [{"role": "user", "content": "hi"}]
    [o] = llm.chat(conv, SamplingParams(max_tokens=1), False, None, "Q: {{ messages[0].content }}")
    assert o.prompt == "Q: hi"
    for name in ("add_generation_prompt", "continue_final_message"):
        with pytest.raises(TypeError, match=f"{name} must be True or False, got 'no'"):
            llm.chat(conv, use_tqdm=False, **{name: "no"})
    with pytest.raises(TypeError, match="chat_template must be Jinja text or a file name, got int"):
        llm.chat(conv, use_tqdm=False, chat_template=3)


def test_vllms_methods_not_served_here_say_why_and_the_engines_tokenizer_is_transformers(llm, tok) -> None:
    with pytest.raises(AttributeError, match=r"LLM.sleep \(vLLM's\) is not supported here: there is no sleep mode"):
        llm.sleep()
    with pytest.raises(AttributeError, match="'LLM' object has no attribute 'nonsense'"):
        llm.nonsense  # noqa: B018
    assert llm.llm_engine.get_tokenizer()("hi")["input_ids"] == tok("hi")["input_ids"]  # (a snapshot was not callable)


def test_vllm_call_forms_fail_clearly_or_run(llm, tok) -> None:
    """What a ported vLLM script passes: a tqdm class as use_tqdm (it was ignored), a bare
    int as priority, SamplingParams to beam_search, tools a template does not render
    (silently dropped), chat_template_kwargs of the wrong type: each runs or says why."""
    import tqdm

    made = []

    class Bar(tqdm.tqdm):
        def __init__(self, *args, **kwargs) -> None:
            made.append(kwargs.get("total"))
            super().__init__(*args, **kwargs)

    llm.generate(["a", "b"], SamplingParams(max_tokens=1), use_tqdm=Bar)
    assert made == [2]
    with pytest.raises(TypeError, match="priority must be a list"):
        llm.generate("a", priority=5)
    with pytest.raises(TypeError, match="BeamSearchParams"):
        llm.beam_search(["a"], SamplingParams())
    conv = [{"role": "user", "content": "hi"}]
    tools = [{"type": "function", "function": {"name": "f", "parameters": {}}}]
    with pytest.raises(ValueError, match="does not render tools"):
        llm.chat(conv, use_tqdm=False, tools=tools)
    rendered = "{% for t in tools or [] %}{{ t.function.name }};{% endfor %}{{ messages[0].content }}"
    [o] = llm.chat(conv, SamplingParams(max_tokens=1), use_tqdm=False, tools=tools, chat_template=rendered)
    assert o.prompt == "f;hi"
    # a past call the template does not write (the server writes it into the turn's text)
    called = [*conv, {"role": "assistant", "content": "", "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
              {"role": "tool", "tool_call_id": "c1", "content": "ok"}]
    turns = "{% for m in messages %}{{ m.role }}:{{ m.content }}{% endfor %}"
    with pytest.raises(ValueError, match="does not render an assistant turn's tool calls"):
        llm.chat(called, use_tqdm=False, chat_template=turns)
    [o] = llm.chat(called, SamplingParams(max_tokens=1), use_tqdm=False,
                   chat_template=turns.replace("}}{% endfor", "}}{{ m.tool_calls | length }}{% endfor"))
    assert "assistant:1" in o.prompt
    with pytest.raises(TypeError, match="chat_template_kwargs must be a dict"):
        llm.chat(conv, use_tqdm=False, chat_template_kwargs="x")
    [o] = llm.chat(conv, SamplingParams(max_tokens=1), use_tqdm=False, chat_template_content_format="auto")
    with pytest.raises(ValueError, match="chat_template_content_format='openai' is not supported"):
        llm.chat(conv, use_tqdm=False, chat_template_content_format="openai")


def test_vllms_profile_calls(llm, tmp_path, monkeypatch) -> None:
    """LLM.start_profile / stop_profile (vLLM's simple_profiling.py): a trace of the steps
    between them, where a directory is named (engine/profiler.py), else a clear error."""
    monkeypatch.delenv("VLLM_TORCH_PROFILER_DIR", raising=False)
    monkeypatch.delenv("PAGEDSERVE_TORCH_PROFILER_DIR", raising=False)
    with pytest.raises(RuntimeError, match="profiling is off"):
        LLM.from_engine(llm.llm_engine).start_profile()
    monkeypatch.setenv("VLLM_TORCH_PROFILER_DIR", str(tmp_path))
    profiled = LLM.from_engine(llm.llm_engine)
    profiled.start_profile(profile_prefix="gen")
    profiled.generate(["a"], SamplingParams(max_tokens=2), use_tqdm=False)
    path = profiled.stop_profile()
    assert os.path.isfile(path) and os.path.basename(path).startswith("gen-")
