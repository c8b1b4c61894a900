"""LLM.beam_search against HF transformers' num_beams search (greedy, no sampling) on a
tiny model: the same beams, in the same order, with the same scores."""

from __future__ import annotations

import json

import pytest
import torch

from pagedserve import LLM, BeamSearchParams, SamplingParams
from pagedserve.errors import InvalidRequestError
from tests.e2e.token_prompts import shared_prefix_prompts

WIDTH, MAX_TOKENS = 3, 8


def hf_beams(model_dir: str, prompt: list[int], width: int, max_tokens: int) -> list[tuple[list[int], float]]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None  # as ignore_eos: beams run to max_tokens
    with torch.inference_mode():
        out = model.generate(torch.tensor([prompt]), num_beams=width, num_return_sequences=width, do_sample=False,
                             max_new_tokens=max_tokens, length_penalty=1.0, output_scores=True,
                             return_dict_in_generate=True, pad_token_id=0)
    return [(seq[len(prompt):].tolist(), float(score)) for seq, score in zip(out.sequences, out.sequences_scores,
                                                                             strict=True)]


def test_beams_equal_hf_transformers(tiny_checkpoint) -> None:
    model_dir, hf_cfg = tiny_checkpoint("llama")
    prompts = shared_prefix_prompts(hf_cfg.vocab_size)[:3]
    llm = LLM(model_dir, dtype="float32", seed=0)
    outs = llm.beam_search([{"prompt_token_ids": p} for p in prompts],
                           BeamSearchParams(beam_width=WIDTH, max_tokens=MAX_TOKENS, ignore_eos=True))
    for prompt, out in zip(prompts, outs, strict=True):
        ref = hf_beams(model_dir, prompt, WIDTH, MAX_TOKENS)
        got = [(seq.tokens[len(prompt):], seq.score) for seq in out.sequences]
        assert [g for g, _ in got] == [r for r, _ in ref], (got, ref)
        for (_, ours), (_, theirs) in zip(got, ref, strict=True):
            assert ours == pytest.approx(theirs, abs=1e-4)
        assert all(s.finish_reason == "length" and len(s.tokens) == len(prompt) + MAX_TOKENS for s in out.sequences)
        assert all(s.score == pytest.approx(s.cum_logprob / MAX_TOKENS) for s in out.sequences)
        for seq in out.sequences:  # vLLM's per-step logprobs: each chosen token's, adding up to the beam's
            gen = seq.tokens[len(prompt):]
            assert len(seq.logprobs) == MAX_TOKENS and all(t in step for t, step in zip(gen, seq.logprobs, strict=True))
            assert sum(step[t].logprob for t, step in zip(gen, seq.logprobs, strict=True)) == \
                pytest.approx(seq.cum_logprob)
            assert seq.stop_reason is None
    # vLLM's other arguments: searched two prompts at a time, the same beams; a bar over the steps
    steps: list[int] = []

    class Bar:
        def __init__(self, total: int, **_: object) -> None:
            steps.append(total)

        def update(self, n: int) -> None:
            steps.append(-n)

        def close(self) -> None:
            pass

    again = llm.beam_search([{"prompt_token_ids": p} for p in prompts],
                            BeamSearchParams(beam_width=WIDTH, max_tokens=MAX_TOKENS, ignore_eos=True),
                            lora_request=None, use_tqdm=Bar, concurrency_limit=2)
    assert [[s.tokens for s in o.sequences] for o in again] == [[s.tokens for s in o.sequences] for o in outs]
    assert steps == [2 * MAX_TOKENS] + [-1] * (2 * MAX_TOKENS)  # (two rounds: prompts 1-2, then 3)
    with pytest.raises(ValueError, match="concurrency_limit"):
        llm.beam_search({"prompt_token_ids": prompts[0]}, BeamSearchParams(beam_width=2, max_tokens=2),
                        concurrency_limit=0)
    # The beams' prompts came from the prefix cache: every step re-reads what the last one wrote.
    stats = llm.llm_engine.get_stats()
    assert stats.prefix_cache_hits > stats.prefix_cache_queries // 2, stats


def test_an_eos_finishes_a_beam_and_bad_params_are_refused(tiny_checkpoint) -> None:
    model_dir, hf_cfg = tiny_checkpoint("llama")
    llm = LLM(model_dir, dtype="float32", seed=0)
    prompt = shared_prefix_prompts(hf_cfg.vocab_size)[0]
    greedy = llm.generate({"prompt_token_ids": prompt}, SamplingParams(temperature=0, max_tokens=1),
                          use_tqdm=False)[0].outputs[0].token_ids[0]
    # The most likely first token made a stop token: the beam it starts ends at once with
    # the best cumulative logprob of all, so with no length normalisation it ranks first.
    llm.llm_engine.stop_token_ids.append(greedy)
    out = llm.beam_search({"prompt_token_ids": prompt}, BeamSearchParams(beam_width=2, max_tokens=4,
                                                                         length_penalty=0.0))[0].sequences
    assert out[0].tokens == [*prompt, greedy] and out[0].finish_reason == "stop", out
    assert out[0].stop_reason == greedy and len(out[0].logprobs) == 1 and out[1].stop_reason is None
    assert out[1].finish_reason == "length" and greedy not in out[1].tokens[len(prompt):]
    for bad, param in (({"beam_width": 0}, "beam_width"), ({"beam_width": 11}, "beam_width"),
                       ({"max_tokens": 0}, "max_tokens"), ({"length_penalty": "x"}, "length_penalty")):
        with pytest.raises(InvalidRequestError) as e:
            llm.beam_search({"prompt_token_ids": prompt}, BeamSearchParams(**{"beam_width": 2, "max_tokens": 2, **bad}))
        assert e.value.param == param


def test_beams_that_fill_the_context_end_there_and_the_other_prompts_answer(tiny_checkpoint) -> None:
    """A prompt 4 tokens short of max_model_len: its beams end at the context with
    "length", as generate's sequences do, beside a short prompt's full search (asking for
    a token past the context failed the whole call, both prompts' beams lost)."""
    model_dir, hf_cfg = tiny_checkpoint("llama")
    llm = LLM(model_dir, dtype="float32", seed=0, max_model_len=64)
    short, long = shared_prefix_prompts(hf_cfg.vocab_size)[0], list(range(3, 63))
    outs = llm.beam_search([{"prompt_token_ids": short}, {"prompt_token_ids": long}],
                           BeamSearchParams(beam_width=2, max_tokens=8, ignore_eos=True))
    assert all(len(s.tokens) == len(short) + 8 for s in outs[0].sequences)
    assert [(len(s.tokens), s.finish_reason) for s in outs[1].sequences] == [(64, "length")] * 2


def test_a_beams_text_is_all_its_tokens_decoded_as_vllms() -> None:
    """vLLM's LLM.beam_search decodes each beam's tokens, the prompt's included (ported
    scripts cut the prompt off its text); the text was the generated part alone."""
    llm = LLM("smollm2-135m-instruct", max_model_len=128, kv_cache_memory_bytes="32MiB")
    [out] = llm.beam_search([{"prompt": "The capital of France is"}], BeamSearchParams(beam_width=2, max_tokens=3))
    tok = llm.get_tokenizer()
    for seq in out.sequences:
        assert seq.text == tok.decode(seq.tokens) and seq.text.startswith("The capital of France is"), seq.text


def test_the_servers_use_beam_search_answers_the_offline_beams() -> None:
    """vLLM's use_beam_search on /v1/completions and /v1/chat/completions (it was refused):
    n beams, best first, as LLM.beam_search finds them (the generated text alone, as
    vLLM's servers answer), streamed or not; what beam search does not read is refused
    by name, and so is length_penalty without it."""
    import asyncio

    import httpx

    from pagedserve.engine.async_llm import AsyncLLM
    from pagedserve.entrypoints.openai.api_server import Attachment, ServerState, build_app

    llm = LLM("smollm2-135m-instruct", max_model_len=128, kv_cache_memory_bytes="32MiB")
    prompt = "The capital of France is"
    [ref] = llm.beam_search([{"prompt": prompt}], BeamSearchParams(beam_width=3, max_tokens=5))
    longer = "Paris is the capital of France, and Rome is the capital of Italy. The capital of Spain is"
    [early] = llm.beam_search([{"prompt": longer}], BeamSearchParams(beam_width=3, max_tokens=5, early_stopping=True))
    state = ServerState(served_model_names=["m"])
    app = build_app(state)
    front = AsyncLLM(llm.llm_engine, log_stats=False)
    state.attach(Attachment.local(front, 128))
    body = {"model": "m", "prompt": prompt, "max_tokens": 5, "n": 3, "use_beam_search": True}

    long = {**body, "n": 4, "max_tokens": 100, "ignore_eos": True}

    async def run():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
            whole = (await c.post("/v1/completions", json=body)).json()
            again = (await c.post("/v1/completions", json={**body, "prompt": longer, "early_stopping": True})).json()
            streamed = (await c.post("/v1/completions", json={**body, "stream": True})).text
            chat = (await c.post("/v1/chat/completions", json={
                "model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "n": 2,
                "use_beam_search": True})).json()
            refused = [(await c.post("/v1/completions", json={**body, **extra})).json()["error"]["param"]
                       for extra in ({"temperature": 0.5}, {"logprobs": 1}, {"n": 11},
                                     {"use_beam_search": False, "length_penalty": 0.5}, {"length_penalty": 1000},
                                     {"use_beam_search": False, "early_stopping": True}, {"early_stopping": "x"},
                                     {"guided_regex": "a+"})]
            anthropic = (await c.post("/v1/messages", json={"model": "m", "max_tokens": 2, "use_beam_search": True,
                                                            "messages": [{"role": "user", "content": "hi"}]})).json()
            # The front door's limits hold for a search as a whole (its steps are requests
            # of their own): request_timeout ends it (each step had a fresh deadline: 200
            # after 13.6 s of a 2 s timeout), and it counts as one waiting request (its n
            # steps waiting each turn made max_waiting_requests refuse every other client
            # while it ran: 74 of 74 503s).
            front.request_timeout = 0.3
            late = (await c.post("/v1/completions", json=long)).status_code
            while front.num_waiting:  # (its last steps, aborted: gone at the engine's next turn)
                await asyncio.sleep(0.01)
            # (3: the search's first step waits as a request of its own before its steps do)
            front.request_timeout, front.max_waiting_requests = None, 3
            search = asyncio.ensure_future(c.post("/v1/completions", json=long))
            others = []
            while not search.done() and len(others) < 6:
                probe = await c.post("/v1/completions", json={"model": "m", "prompt": "hi", "max_tokens": 1})
                others.append(probe.status_code)
            return whole, again, streamed, chat, refused, anthropic, late, (await search).status_code, others

    whole, again, streamed, chat, refused, anthropic, late, searched, others = asyncio.run(
        asyncio.wait_for(run(), 120))
    want = [seq.text[len(prompt):] for seq in ref.sequences]
    assert [c["text"] for c in whole["choices"]] == want, (whole, want)
    assert [c["text"] for c in again["choices"]] == [seq.text[len(longer):] for seq in early.sequences]
    # (its prompt's blocks were in the prefix cache: the offline search wrote them)
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] > 0, again["usage"]
    chunks = [json.loads(line[6:]) for line in streamed.splitlines() if line.startswith("data: {")]
    assert sorted((ch["index"], ch["text"]) for c in chunks for ch in c["choices"]) == list(enumerate(want))
    assert [c["index"] for c in chat["choices"]] == [0, 1] and all(c["message"]["content"] for c in chat["choices"])
    assert refused == ["temperature", "logprobs", "n", "length_penalty", "length_penalty", "early_stopping",
                       "early_stopping", "guided_regex"]
    assert anthropic["type"] == "error" and "use_beam_search" in anthropic["error"]["message"], anthropic
    assert late == 408 and searched == 200 and others and set(others) == {200}, (late, searched, others)
