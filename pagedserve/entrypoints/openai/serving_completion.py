"""POST /v1/completions: one engine request per prompt, n completions each.

Choice index = prompt_index * n + completion_index, as in OpenAI and vLLM.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

from pagedserve.entrypoints.openai.protocol import (
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    random_id,
)
from pagedserve.entrypoints.openai.serving_engine import (
    OpenAIError,
    OpenAIServing,
    TokenizedPrompt,
    clamp_logprob,
    make_usage,
    merge_async_iterators,
    sse,
    sse_error,
)
from pagedserve.entrypoints.openai.streaming import ChoiceStream
from pagedserve.outputs import CompletionOutput, RequestOutput
from pagedserve.sampling_params import SamplingParams


class OpenAIServingCompletion(OpenAIServing):
    def prepare(self, req: CompletionRequest) -> tuple[str, list[TokenizedPrompt], SamplingParams]:
        model = self.model_name(req.model)
        req.check_unsupported()
        prompts = self._prompts(req.prompt)
        # One SamplingParams for all prompts: an unset max_tokens fills the longest one's context.
        max_tokens = min(self.check_length(len(p.token_ids), req.max_tokens) for p in prompts)
        params = req.to_sampling_params(default_max_tokens=max_tokens)
        self.check_params(params)
        return model, prompts, params

    def _prompts(self, prompt: str | list) -> list[TokenizedPrompt]:
        if isinstance(prompt, str):
            items: list = [prompt]
        elif prompt and all(isinstance(t, int) for t in prompt):
            items = [prompt]
        else:
            items = list(prompt)
        if not items:
            raise OpenAIError("prompt must not be empty", param="prompt")
        out = []
        for item in items:
            if isinstance(item, str):
                out.append(TokenizedPrompt(item, self.tokenize(item)))
            else:
                ids = list(item)
                self.check_token_ids(ids)
                text = self.tokenizer.decode(ids) if self.tokenizer is not None else None
                out.append(TokenizedPrompt(text, ids))
            self.check_token_ids(out[-1].token_ids)
        return out

    def generators(self, prompts: list[TokenizedPrompt], params: SamplingParams, request_id: str,
                   priority: int) -> AsyncIterator[tuple[int, RequestOutput]]:
        gens = [self.engine.generate({"prompt_token_ids": p.token_ids, "prompt": p.text}, params,
                                     f"{request_id}-{i}", priority=priority)
                for i, p in enumerate(prompts)]
        return merge_async_iterators(*gens)

    async def full(self, req: CompletionRequest, model: str, prompts: list[TokenizedPrompt],
                   params: SamplingParams) -> CompletionResponse:
        request_id = random_id("cmpl")
        finals: list[RequestOutput | None] = [None] * len(prompts)
        async for i, out in self.generators(prompts, params, request_id, req.priority):
            finals[i] = out
        choices = []
        for i, out in enumerate(finals):
            assert out is not None and out.finished
            prefix = (prompts[i].text or "") if req.echo else ""
            for c in out.outputs:
                choices.append(CompletionChoice(
                    index=i * params.n + c.index, text=prefix + c.text,
                    logprobs=self.logprobs(c, 0, params.logprobs, 0),
                    finish_reason=c.finish_reason, stop_reason=c.stop_reason))
        return CompletionResponse(id=request_id, model=model, choices=choices,
                                  usage=make_usage([o for o in finals if o is not None]))

    async def stream(self, req: CompletionRequest, model: str, prompts: list[TokenizedPrompt],
                     params: SamplingParams) -> AsyncIterator[str]:
        request_id = random_id("cmpl")
        created = int(time.time())
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        streams: dict[int, ChoiceStream] = {}
        finals: dict[int, RequestOutput] = {}
        try:
            async for i, out in self.generators(prompts, params, request_id, req.priority):
                finals[i] = out
                for c in out.outputs:
                    index = i * params.n + c.index
                    cs = streams.get(index)
                    if cs is None:
                        cs = streams[index] = ChoiceStream(params.stop_strings, params.include_stop_str_in_output)
                        if req.echo:
                            cs.text_offset_before = len(prompts[i].text or "")
                            yield self._chunk(request_id, created, model, index, prompts[i].text or "", None, None)
                    delta = cs.advance(c, want_tokens=params.logprobs is not None)
                    if delta is None:
                        continue
                    text, tok_start, tok_end = delta
                    logprobs = self.logprobs(c, tok_start, params.logprobs, cs.text_offset_before, tok_end)
                    if logprobs is not None:
                        cs.text_offset_before += sum(len(t) for t in logprobs.tokens)
                    yield self._chunk(request_id, created, model, index, text, logprobs, c if cs.done else None)
            if include_usage:
                usage = make_usage(list(finals.values()))
                yield sse(CompletionResponse(id=request_id, created=created, model=model, choices=[],
                                             usage=usage))
        except Exception as e:  # noqa: BLE001 - the stream already started: report in-band
            yield sse_error(e)
        yield "data: [DONE]\n\n"

    def _chunk(self, request_id: str, created: int, model: str, index: int, text: str,
               logprobs: CompletionLogprobs | None, finished: CompletionOutput | None) -> str:
        choice = CompletionChoice(index=index, text=text, logprobs=logprobs,
                                  finish_reason=finished.finish_reason if finished else None,
                                  stop_reason=finished.stop_reason if finished else None)
        return sse(CompletionResponse(id=request_id, created=created, model=model, choices=[choice]))

    def logprobs(self, c: CompletionOutput, start: int, k: int | None, offset: int,
                 end: int | None = None) -> CompletionLogprobs | None:
        if k is None or c.logprobs is None:
            return None
        end = len(c.token_ids) if end is None else end
        lp = CompletionLogprobs()
        for pos in range(start, min(end, len(c.logprobs))):
            tok, step = c.token_ids[pos], c.logprobs[pos]
            chosen = step.get(tok)
            s = self.token_str(tok, chosen)
            lp.tokens.append(s)
            lp.token_logprobs.append(clamp_logprob(chosen.logprob) if chosen else None)
            lp.text_offset.append(offset)
            offset += len(s)
            top = {self.token_str(t, v): clamp_logprob(v.logprob) for t, v in self.top_entries(step, k)}
            if chosen is not None:
                top.setdefault(s, clamp_logprob(chosen.logprob))
            lp.top_logprobs.append(top)
        return lp
