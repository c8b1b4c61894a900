"""Beam search over the engine: vLLM's offline `LLM.beam_search` (entrypoints/llm.py) and
its servers' `use_beam_search` (BeamSearchStream), one algorithm for both.

It ranks and stops as HF transformers' `num_beams` search does: each step every live
beam asks the engine for its 2 x beam_width most likely next tokens (a one-token greedy
request whose prompt is the beam's tokens: beams share their blocks through the prefix
cache); the beam_width best extensions by cumulative logprob live on, an end token among
them (the beam_width best only) finishes its beam, and at the last step (max_tokens, or
the context full) the beam_width best finish whatever their token.  The answer is the
beam_width best finished beams by cumulative logprob over generated length **
length_penalty.  The search ends early as HF's `early_stopping` says (its default,
False: once beam_width beams have finished and the best live one, scored at its
current length, cannot beat the worst of them; True: once beam_width have finished;
"never": only when no live beam can beat them at any length it may reach).
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from pagedserve.multimodal.inputs import MultiModalPrompt
from pagedserve.outputs import BeamSearchSequence, CompletionOutput, Logprob, RequestOutput
from pagedserve.sampling_params import BeamSearchParams, SamplingParams


def step_prompt(token_ids: list[int], cache_salt: str | None, images: MultiModalPrompt | None) -> dict[str, Any]:
    """A beam's step as an engine prompt: its tokens, with the searched prompt's cache salt
    and images (their spans lie in the prompt, which every beam continues, and an M-RoPE
    table covers the prompt: a beam's tokens take the positions generated tokens take)."""
    prompt: dict[str, Any] = {"prompt_token_ids": token_ids}
    if cache_salt is not None:
        prompt["cache_salt"] = cache_salt
    if images is not None:
        prompt["multi_modal"] = dataclasses.replace(images, prompt_token_ids=token_ids)
    return prompt


def step_params(width: int) -> SamplingParams:
    """What each beam asks the engine for, each step: its next token's 2 x width best."""
    return SamplingParams(max_tokens=1, temperature=0.0, logprobs=2 * width, ignore_eos=True)


@dataclass
class Beam:
    tokens: list[int]  # generated
    cum: float  # cumulative logprob
    logprobs: list[dict[int, Logprob]]  # each step's top 2 x beam_width, the chosen token's among them
    why: str = ""  # once finished: "stop" (an end token) or "length"


class BeamSet:
    """One prompt's beam search: live beams, the next-token logprobs of each (`tops`, set
    by the caller each step), and the finished beams.  `room`: the tokens it may
    generate (max_tokens, or less where the context ends first)."""

    def __init__(self, prompt: list[int], tops: list[dict[int, Logprob]], params: BeamSearchParams,
                 stops: set[int], room: int) -> None:
        self.prompt, self.tops, self.params, self.stops = prompt, tops, params, stops
        self.room = min(params.max_tokens, room)
        self.live: list[Beam] = [Beam([], 0.0, [])] if self.room > 0 else []
        self.finished: list[Beam] = []

    def asks(self) -> list[list[int]]:
        """The token sequences whose next token this step needs (one per live beam)."""
        return [self.prompt + beam.tokens for beam in self.live]

    def extend(self) -> None:
        """One step: every live beam's extensions ranked; then the search ends where HF's
        would (no live beam left)."""
        if not self.live:
            return
        width = self.params.beam_width
        last = len(self.live[0].tokens) + 1 >= self.room
        candidates = sorted(((beam.cum + lp.logprob, tok, beam, top) for beam, top in zip(self.live, self.tops, strict=True)
                             for tok, lp in top.items()), key=lambda c: -c[0])
        self.live = []
        for rank, (cum, tok, beam, top) in enumerate(candidates):
            grown = Beam(beam.tokens + [tok], cum, beam.logprobs + [top])
            if tok in self.stops or last:
                if rank < width:  # (HF finishes a beam only among the beam_width best)
                    grown.why = "stop" if tok in self.stops else "length"
                    self.finished.append(grown)
            elif len(self.live) < width:
                self.live.append(grown)
        if self.live and self._cannot_improve():
            self.live = []

    def _cannot_improve(self) -> bool:
        """HF's early-stopping test: beam_width beams have finished and (early_stopping
        True) that is enough, or the best live beam's score at its current length ("never"
        with a positive length_penalty: at the longest it may grow) is no better than the
        worst of them."""
        width, early, penalty = self.params.beam_width, self.params.early_stopping, self.params.length_penalty
        scores = sorted((self.score(beam) for beam in self.finished), reverse=True)[:width]
        if len(scores) < width:
            return False
        if early is True:
            return True
        length = self.room if early == "never" and penalty > 0 else len(self.live[0].tokens)
        return self.live[0].cum / length ** penalty <= scores[-1]

    def score(self, beam: Beam) -> float:
        return beam.cum / len(beam.tokens) ** self.params.length_penalty

    def best(self) -> list[tuple[float, Beam]]:
        """The beam_width best finished beams, best first."""
        return sorted(((self.score(beam), beam) for beam in self.finished), key=lambda b: -b[0])[:self.params.beam_width]

    def sequences(self, decode: Callable[[list[int]], str] | None) -> list[BeamSearchSequence]:
        """The answer as vLLM's offline beam search gives it: each sequence's text is all
        its tokens decoded, the prompt's too."""
        return [BeamSearchSequence(self.prompt + beam.tokens, decode(self.prompt + beam.tokens) if decode else None,
                                   beam.cum, score, beam.why, [dict(step) for step in beam.logprobs],  # (beams shared them)
                                   beam.tokens[-1] if beam.why == "stop" else None)
                for score, beam in self.best()]


# One step of one beam: the token ids it continues -> the engine's answer (one token and
# its top logprobs; the first step's also counts the prompt's cached tokens).
NextTokens = Callable[[list[int]], Awaitable[RequestOutput]]


class BeamSearchStream:
    """A server request's beam search (`use_beam_search`), read as an engine request's
    stream is: one final RequestOutput whose `n` completions are the beams, best first
    (their text the generated tokens decoded, an ending end token left out, as vLLM's
    servers answer).  `next_tokens` runs one beam's step on the engine; `close()` (a
    client gone) cancels the search, and with it the step in flight."""

    def __init__(self, request_id: str, prompt: Any, prompt_ids: list[int], params: BeamSearchParams,
                 next_tokens: NextTokens, stops: set[int], max_model_len: int,
                 decode: Callable[[list[int]], str], on_close: Callable[[], None] = lambda: None,
                 include_stop: bool = False) -> None:
        """`on_close`: what closing it before it ran must also close (its first step's stream);
        `include_stop`: an ending end token is decoded with the rest (the request's
        include_stop_str_in_output; its text shows where skip_special_tokens is false)."""
        self.request_id, self.prompt, self.prompt_ids, self.params = request_id, prompt, prompt_ids, params
        self.next_tokens, self.stops, self.max_model_len, self.decode = next_tokens, stops, max_model_len, decode
        self.on_close, self.include_stop = on_close, include_stop
        self._task: asyncio.Task | None = None
        self._done = False

    def __aiter__(self) -> BeamSearchStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self._done:
            raise StopAsyncIteration
        self._task = asyncio.ensure_future(self._search())
        try:
            out = await self._task
        finally:
            self._done = True
        return out

    def close(self) -> None:
        self._done = True
        if self._task is not None:
            self._task.cancel()
        self.on_close()

    async def _search(self) -> RequestOutput:
        first = await self.next_tokens(self.prompt_ids)
        beams = BeamSet(self.prompt_ids, [first.outputs[0].logprobs[0]], self.params, self.stops,
                        self.max_model_len - len(self.prompt_ids))
        for n in range(self.params.max_tokens):
            if not beams.live:
                break
            if n:
                steps = [asyncio.ensure_future(self.next_tokens(ids)) for ids in beams.asks()]
                try:
                    beams.tops = [out.outputs[0].logprobs[0] for out in await asyncio.gather(*steps)]
                except BaseException:  # (one step failed, or the search was cancelled: the others too)
                    for task in steps:
                        task.cancel()
                    raise
            beams.extend()
        outputs = []
        for i, (_, beam) in enumerate(beams.best()):
            shown = beam.tokens[:-1] if beam.why == "stop" and not self.include_stop else beam.tokens
            outputs.append(CompletionOutput(i, self.decode(shown), beam.tokens, beam.cum, None, beam.why,
                                            beam.tokens[-1] if beam.why == "stop" else None))
        return RequestOutput(self.request_id, self.prompt, self.prompt_ids, outputs, finished=True,
                             num_cached_tokens=first.num_cached_tokens)
