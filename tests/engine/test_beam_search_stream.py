"""BeamSearchStream (the server's use_beam_search) with a scripted next-token source."""

from __future__ import annotations

import asyncio

import pytest
import torch

from pagedserve.engine.beam_search import BeamSearchStream
from pagedserve.outputs import CompletionOutput, Logprob, RequestOutput
from pagedserve.sampling_params import BeamSearchParams

EOS = 2


def answer(top: dict[int, float]) -> RequestOutput:
    """A beam step's engine answer: one token, with its top logprobs."""
    best = max(top, key=top.__getitem__)
    logprobs = {tok: Logprob(lp) for tok, lp in top.items()}
    return RequestOutput("step", None, [], [CompletionOutput(0, "", [best], 0.0, [logprobs], "length")], True)


async def _next_tokens(ids: list[int]) -> RequestOutput:
    """After the prompt, token 7 then the end token are the likeliest."""
    if ids[-1] == 7:
        return answer({EOS: -0.1, 8: -3.0, 9: -4.0, 5: -5.0})
    return answer({7: -0.2, 8: -2.0, 9: -3.0, 5: -4.0})


@pytest.mark.parametrize("include", [False, True])
def test_an_ending_end_token_is_shown_only_when_the_request_includes_stop_strings(include) -> None:
    """include_stop_str_in_output was accepted beside use_beam_search and did nothing: the
    end token's text was always cut (without beam search it is kept)."""
    stream = BeamSearchStream("r", None, [1], BeamSearchParams(beam_width=2, max_tokens=4), _next_tokens, {EOS},
                              64, lambda ids: " ".join(map(str, ids)), include_stop=include)

    async def first() -> object:
        return await stream.__anext__()

    best = asyncio.run(first()).outputs[0]
    assert best.token_ids == [7, EOS] and best.finish_reason == "stop"
    assert best.text == ("7 2" if include else "7")


def test_beams_and_where_they_stop_are_hf_transformers_for_each_early_stopping() -> None:
    """HF's num_beams search (the reference) and ours over the same scripted next-token
    log-probabilities (a random table by search, position and last token: no two beams
    tie; HF's through a logits processor, twelve searches a batch): the same beams in
    the same order for each early_stopping (HF's default False: done once beam_width
    beams finished and the best live one cannot beat them at its length; the search ran
    on to max_tokens, and the best answer changed on chat prompts), length penalty and
    width."""
    from transformers import LlamaConfig, LlamaForCausalLM, LogitsProcessor, LogitsProcessorList

    searches, vocab, max_tokens = 12, 16, 9
    prompts = [[3 + i] for i in range(searches)]  # (each search's one token names its table)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=vocab, hidden_size=8, intermediate_size=16, num_hidden_layers=1,
                                         num_attention_heads=1, num_key_value_heads=1)).eval()
    g = torch.Generator().manual_seed(0)
    table = torch.log_softmax(3 * torch.randn((vocab, 1 + max_tokens, vocab, vocab), generator=g, dtype=torch.float64),
                              -1).float()
    table[..., 0] = -1e4  # (HF's padding token: never a beam's)

    class Table(LogitsProcessor):
        def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
            return table[input_ids[:, 0], input_ids.shape[1], input_ids[:, -1]]

    def next_tokens(width: int):
        async def step(ids: list[int]) -> RequestOutput:
            row = table[ids[0], len(ids), ids[-1]]
            return answer({tok: float(row[tok]) for tok in row.topk(2 * width).indices.tolist()})
        return step

    differ = 0
    for width, penalty in ((2, 1.0), (3, 1.0), (3, 0.0), (3, 2.0), (2, -0.5)):
        got = {}
        for early in (False, True, "never"):
            with torch.inference_mode():
                ref = model.generate(torch.tensor(prompts), num_beams=width, num_return_sequences=width,
                                     do_sample=False, max_new_tokens=max_tokens, length_penalty=penalty,
                                     early_stopping=early, eos_token_id=EOS, pad_token_id=0,
                                     logits_processor=LogitsProcessorList([Table()]))[:, 1:].tolist()
            want = [[seq[:seq.index(EOS) + 1] if EOS in seq else seq for seq in ref[i * width:(i + 1) * width]]
                    for i in range(searches)]
            params = BeamSearchParams(beam_width=width, max_tokens=max_tokens, length_penalty=penalty,
                                      early_stopping=early)
            got[early] = [[c.token_ids for c in asyncio.run(
                BeamSearchStream("r", None, p, params, next_tokens(width), {EOS}, 64, str).__anext__()).outputs]
                for p in prompts]
            assert got[early] == want, (width, penalty, early)
        differ += sum(a != b for a, b in zip(got[False], got["never"], strict=True))
    assert differ >= 2, differ  # (the modes' answers differ in some of these searches)
