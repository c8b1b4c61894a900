"""POST /v1/completions: one engine request per prompt, n completions each.

Choice index = prompt_index * n + completion_index, as in OpenAI and vLLM.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import AsyncIterator

from pagedserve.core.request import prompt_length_error
from pagedserve.engine.async_llm import RequestStream
from pagedserve.entrypoints.openai.protocol import (
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    UsageInfo,
)
from pagedserve.entrypoints.openai.protocol_fields import CHAT_FIELDS
from pagedserve.entrypoints.openai.serving_engine import (
    OpenAIError,
    OpenAIServing,
    PreparedRequest,
    TokenizedPrompt,
    item_label,
    make_usage,
    merge_streams,
    prompt_logprobs_of,
    request_failed,
    running_usage,
    sse,
    sse_error,
)
from pagedserve.entrypoints.openai.streaming import ChoiceStream, TextOffsets
from pagedserve.errors import InvalidRequestError
from pagedserve.outputs import CompletionOutput, RequestOutput


def prompt_only(out: RequestOutput) -> RequestOutput:
    """An echo with max_tokens 0 (OpenAI's legacy way to score a prompt): the one token
    its step generated is not shown, used or counted; it ends as "length"."""
    outputs = [dataclasses.replace(c, text="", token_ids=[], logprobs=[] if c.logprobs is not None else None,
                                   cumulative_logprob=None, finish_reason="length", stop_reason=None)
               for c in out.outputs]
    return dataclasses.replace(out, outputs=outputs)


class OpenAIServingCompletion(OpenAIServing):
    id_prefix = "cmpl"
    OWN_REFUSALS = frozenset(CHAT_FIELDS)

    def prepare(self, req: CompletionRequest) -> PreparedRequest:
        model = self.model_name(req.model)
        try:
            req.check_unsupported(self.engine.structured_outputs_backend)
            params = req.to_sampling_params(self.engine.sampling_defaults)
        except InvalidRequestError as e:
            raise self.invalid(req, e) from None
        # Each prompt is judged as soon as it is tokenized: tokenizing a batch first cost 4-5 s
        # of a core (16 MB of prompts) before its first prompt, too long, was refused.
        items = self._prompt_items(req.prompt, params.n)
        prompts: list[TokenizedPrompt] = []
        for i, item in enumerate(items):
            p = TokenizedPrompt(item, self.tokenize(item, req.add_special_tokens, req.truncate_prompt_tokens is not None)) \
                if isinstance(item, str) else TokenizedPrompt(None, list(item))
            p = self.truncated(p, req.truncate_prompt_tokens, req.requested_max_tokens() or 1)
            self.check_length(len(p.token_ids), req.max_tokens, "prompt")
            if (error := prompt_length_error(len(p.token_ids), self.max_model_len)) is not None:
                raise self.invalid(req, error, item_label(i, len(items), req.api_param("prompt")))
            prompts.append(p)
        return PreparedRequest(model, prompts, params, beam=self.beam_search_params(req, params))

    def _prompt_items(self, prompt: str | list, n: int) -> list[str | list[int]]:
        """The request's prompts, as texts or token-id lists (not yet tokenized)."""
        if isinstance(prompt, str):
            items: list = [prompt]
        elif prompt and all(isinstance(t, int) for t in prompt):
            items = [prompt]
        else:
            items = list(prompt)
        if not items:
            raise OpenAIError("prompt must not be empty", param="prompt")
        self.check_fanout(len(items), n)  # before tokenizing any of them
        return items

    def _echo(self, prompt: TokenizedPrompt) -> str:
        """The prompt's text (token-id prompts are decoded; the engine has checked their ids)."""
        if prompt.text is not None:
            return prompt.text
        return self.tokenizer.decode(prompt.token_ids) if self.tokenizer is not None else ""

    async def full(self, req: CompletionRequest, prep: PreparedRequest, request_id: str,
                   streams: list[RequestStream]) -> CompletionResponse:
        prompts, params = prep.prompts, prep.params
        finals: list[RequestOutput | None] = [None] * len(prompts)
        async for i, out in merge_streams(streams):
            finals[i] = prompt_only(out) if req.prompt_only else out
        choices = []
        for i, out in enumerate(finals):
            assert out is not None and out.finished
            prefix = self._echo(prompts[i]) if req.echo else ""
            # (built once for the prompt's n choices: each built its own, 16 x 40,800 objects)
            scored = prompt_logprobs_of(out) if req.prompt_logprobs is not None else None
            for c in out.outputs:
                if (err := request_failed(c.finish_reason, c.stop_reason)) is not None:
                    raise err
                logprobs = self.logprobs(c, 0, params.logprobs, TextOffsets(len(prefix)),
                                         skip_special=params.skip_special_tokens)
                if req.echo and logprobs is not None:
                    logprobs = self._prompt_logprobs(out, params.logprobs, prefix).extend(logprobs)
                choices.append(CompletionChoice(
                    index=i * params.n + c.index, text=prefix + c.text, logprobs=logprobs,
                    finish_reason=c.finish_reason, stop_reason=c.stop_reason,
                    prompt_logprobs=scored))
        return CompletionResponse(id=request_id, model=prep.model, choices=choices,
                                  usage=make_usage([o for o in finals if o is not None]))

    async def stream(self, req: CompletionRequest, prep: PreparedRequest, request_id: str,
                     streams: list[RequestStream]) -> AsyncIterator[str]:
        model, prompts, params = prep.model, prep.prompts, prep.params
        created = int(time.time())
        include_usage = self.options.force_include_usage or bool(req.stream_options and req.stream_options.include_usage)
        continuous_usage = bool(req.stream_options and req.stream_options.continuous_usage_stats)
        choice_streams: dict[int, ChoiceStream] = {}
        finals: dict[int, RequestOutput] = {}
        try:
            async for i, out in merge_streams(streams):
                earlier = finals.get(i)  # (an echo's usage: what came before this output's tokens)
                finals[i] = out = prompt_only(out) if req.prompt_only else out
                for c in out.outputs:
                    if (err := request_failed(c.finish_reason, c.stop_reason)) is not None:
                        raise err
                # Every new choice's echo first, then the output's text: an echo after a sibling
                # choice's text counted fewer tokens than that text's chunk had.  The echo, its
                # logprobs and its usage are the prompt's: made once for its new choices.
                new = [i * params.n + c.index for c in out.outputs if i * params.n + c.index not in choice_streams]
                if new and req.echo:
                    echo = self._echo(prompts[i])
                    echo_lp = self._prompt_logprobs(out, params.logprobs, echo) if params.logprobs is not None \
                        else None
                    echo_usage = None
                    if continuous_usage:
                        before = {k: v for k, v in finals.items() if k != i}
                        if earlier is not None:
                            before[i] = earlier
                        echo_usage = running_usage(before, prompts)
                for index in new:
                    cs = choice_streams[index] = ChoiceStream()
                    if req.echo:
                        cs.text_offsets = TextOffsets(len(echo))
                        yield self._chunk(request_id, created, model, index, echo, echo_lp, None, echo_usage)
                for c in out.outputs:
                    index = i * params.n + c.index
                    cs = choice_streams[index]
                    delta = cs.advance(c, want_tokens=params.logprobs is not None)
                    if delta is None:
                        continue
                    text, tok_start, tok_end = delta
                    logprobs = self.logprobs(c, tok_start, params.logprobs, cs.text_offsets, tok_end,
                                             params.skip_special_tokens)
                    yield self._chunk(request_id, created, model, index, text, logprobs, c if cs.done else None,
                                      running_usage(finals, prompts) if continuous_usage else None)
            if include_usage:
                usage = make_usage(list(finals.values()))
                yield sse(CompletionResponse(id=request_id, created=created, model=model, choices=[],
                                             usage=usage))
        except Exception as e:  # noqa: BLE001 - the stream already started: report in-band
            yield sse_error(e)
        yield "data: [DONE]\n\n"

    def _chunk(self, request_id: str, created: int, model: str, index: int, text: str,
               logprobs: CompletionLogprobs | None, finished: CompletionOutput | None,
               usage: UsageInfo | None = None) -> str:
        choice = CompletionChoice(index=index, text=text, logprobs=logprobs,
                                  finish_reason=finished.finish_reason if finished else None,
                                  stop_reason=finished.stop_reason if finished else None)
        return sse(CompletionResponse(id=request_id, created=created, model=model, choices=[choice], usage=usage))

    def _prompt_logprobs(self, out: RequestOutput, k: int, echoed: str) -> CompletionLogprobs:
        """The echoed prompt's tokens with their logprobs (the first has none).  A first
        token the tokenizer added (Gemma's <bos>) is not in the `echoed` text: it starts
        at 0 and takes no room (every offset after it was its length too far)."""
        prompt = CompletionOutput(index=0, text="", token_ids=out.prompt_token_ids, logprobs=out.prompt_logprobs)
        lp = self.logprobs(prompt, 0, k, TextOffsets()) or CompletionLogprobs()
        bos = self.tokenizer.bos_token_id if self.tokenizer is not None else None
        if len(lp.tokens) > 1 and out.prompt_token_ids[0] == bos and not echoed.startswith(lp.tokens[0]):
            added = lp.text_offset[1]
            lp.text_offset = [0] + [max(0, o - added) for o in lp.text_offset[1:]]
        return lp

    def logprobs(self, c: CompletionOutput, start: int, k: int | None, offsets: TextOffsets,
                 end: int | None = None, skip_special: bool = False) -> CompletionLogprobs | None:
        """`skip_special`: the request's skip_special_tokens, under which a special token is
        listed but left out of the text, so it takes no room there (every offset after an
        `<|im_end|>` was its length too far, the last ones past the text's end)."""
        if k is None or c.logprobs is None:
            return None
        lp = CompletionLogprobs()
        steps = self.logprob_steps(c, start, len(c.token_ids) if end is None else end, k)
        for tok, (s, raw, token_lp, top) in zip(c.token_ids[start:], steps, strict=False):
            lp.tokens.append(_shown(s, raw))
            lp.token_logprobs.append(token_lp)
            in_text = not (skip_special and self.left_out_of_text(tok))
            lp.text_offset.append(offsets.start(s, raw) if in_text else offsets.offset)
            top_dict = {_shown(t, b): v for t, b, v in top}
            if token_lp is not None:
                top_dict.setdefault(_shown(s, raw), token_lp)
            lp.top_logprobs.append(top_dict if token_lp is not None else None)
        return lp


def _shown(text: str, raw: bytes) -> str:
    """A token as the legacy API shows it: its text, or, for a token holding part of a
    character, "bytes:\\xNN..." as OpenAI's does (each such token read U+FFFD, and the
    top alternatives' dict kept one of them)."""
    if "\ufffd" in text and raw != text.encode():
        return "bytes:" + "".join(f"\\x{b:02x}" for b in raw)
    return text
