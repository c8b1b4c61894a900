"""POST /v1/chat/completions: messages -> chat template -> one engine request (n choices)."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

from pagedserve.entrypoints.openai.protocol import (
    ChatChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatLogprobs,
    ChatLogprobToken,
    ChatMessage,
    ChatResponseMessage,
    ChatStreamChoice,
    DeltaMessage,
    TopLogprob,
    random_id,
)
from pagedserve.entrypoints.openai.serving_engine import (
    OpenAIError,
    OpenAIServing,
    TokenizedPrompt,
    clamp_logprob,
    make_usage,
    sse,
    sse_error,
)
from pagedserve.entrypoints.openai.streaming import ChoiceStream
from pagedserve.outputs import CompletionOutput, RequestOutput
from pagedserve.sampling_params import SamplingParams


class OpenAIServingChat(OpenAIServing):
    def render(self, messages: list[ChatMessage], add_generation_prompt: bool = True,
               chat_template: str | None = None) -> TokenizedPrompt:
        plain = [{"role": m.role, "content": _text_content(m.content)} for m in messages]
        try:
            text = self.engine.apply_chat_template(
                plain, chat_template=chat_template or self.chat_template,
                add_generation_prompt=add_generation_prompt)
        except ValueError as e:
            raise OpenAIError(f"Cannot apply the chat template: {e}", param="messages") from e
        # The template already wrote BOS (if the model uses one).
        return TokenizedPrompt(text, self.tokenize(text, add_special_tokens=False))

    def prepare(self, req: ChatCompletionRequest) -> tuple[str, TokenizedPrompt, SamplingParams]:
        model = self.model_name(req.model)
        req.check_unsupported()
        prompt = self.render(req.messages, req.add_generation_prompt, req.chat_template)
        self.check_token_ids(prompt.token_ids)
        max_tokens = self.check_length(len(prompt.token_ids), req._requested_max_tokens())
        params = req.to_sampling_params(default_max_tokens=max_tokens)
        self.check_params(params)
        return model, prompt, params

    def _generate(self, prompt: TokenizedPrompt, params: SamplingParams, request_id: str,
                  priority: int) -> AsyncIterator[RequestOutput]:
        return self.engine.generate({"prompt_token_ids": prompt.token_ids, "prompt": prompt.text}, params,
                                    request_id, priority=priority)

    async def full(self, req: ChatCompletionRequest, model: str, prompt: TokenizedPrompt,
                   params: SamplingParams) -> ChatCompletionResponse:
        request_id = random_id("chatcmpl")
        final = None
        async for out in self._generate(prompt, params, request_id, req.priority):
            final = out
        assert final is not None and final.finished
        choices = [ChatChoice(index=c.index, message=ChatResponseMessage(content=c.text),
                              logprobs=self.logprobs(c, 0, params.logprobs),
                              finish_reason=c.finish_reason, stop_reason=c.stop_reason)
                   for c in final.outputs]
        return ChatCompletionResponse(id=request_id, model=model, choices=choices, usage=make_usage([final]))

    async def stream(self, req: ChatCompletionRequest, model: str, prompt: TokenizedPrompt,
                     params: SamplingParams) -> AsyncIterator[str]:
        request_id = random_id("chatcmpl")
        created = int(time.time())
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        streams = [ChoiceStream(params.stop_strings, params.include_stop_str_in_output) for _ in range(params.n)]
        final = None

        def chunk(choice: ChatStreamChoice) -> str:
            return sse(ChatCompletionChunk(id=request_id, created=created, model=model, choices=[choice]))

        try:
            # The role goes first, before any token exists, as OpenAI does.
            for i, cs in enumerate(streams):
                cs.first = False
                yield chunk(ChatStreamChoice(index=i, delta=DeltaMessage(role="assistant", content="")))
            async for out in self._generate(prompt, params, request_id, req.priority):
                final = out
                for c in out.outputs:
                    cs = streams[c.index]
                    delta = cs.advance(c, want_tokens=params.logprobs is not None)
                    if delta is None:
                        continue
                    text, tok_start, tok_end = delta
                    yield chunk(ChatStreamChoice(
                        index=c.index, delta=DeltaMessage(content=text),
                        logprobs=self.logprobs(c, tok_start, params.logprobs, tok_end),
                        finish_reason=c.finish_reason if cs.done else None,
                        stop_reason=c.stop_reason if cs.done else None))
            if include_usage and final is not None:
                yield sse(ChatCompletionChunk(id=request_id, created=created, model=model, choices=[],
                                              usage=make_usage([final])))
        except Exception as e:  # noqa: BLE001 - the stream already started: report in-band
            yield sse_error(e)
        yield "data: [DONE]\n\n"

    def logprobs(self, c: CompletionOutput, start: int, k: int | None,
                 end: int | None = None) -> ChatLogprobs | None:
        if k is None or c.logprobs is None:
            return None
        end = len(c.token_ids) if end is None else end
        content = []
        for pos in range(start, min(end, len(c.logprobs))):
            tok, step = c.token_ids[pos], c.logprobs[pos]
            chosen = step.get(tok)
            s = self.token_str(tok, chosen)
            top = []
            for t, v in self.top_entries(step, k):
                ts = self.token_str(t, v)
                top.append(TopLogprob(token=ts, logprob=clamp_logprob(v.logprob), bytes=list(ts.encode())))
            content.append(ChatLogprobToken(token=s, logprob=clamp_logprob(chosen.logprob) if chosen else
                                            _MISSING, bytes=list(s.encode()), top_logprobs=top))
        return ChatLogprobs(content=content)


_MISSING = -9999.0


def _text_content(content: str | list | None) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    parts = []
    for part in content:
        if part.get("type") != "text":
            raise OpenAIError(f"message content of type {part.get('type')!r} is not supported (text only)",
                              param="messages")
        parts.append(part.get("text", ""))
    return "".join(parts)
