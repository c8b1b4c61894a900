"""POST /v1/chat/completions: messages -> chat template -> one engine request (n choices)."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

from pagedserve.engine.async_llm import RequestStream
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
)
from pagedserve.entrypoints.openai.serving_engine import (
    OpenAIError,
    OpenAIServing,
    TokenizedPrompt,
    make_usage,
    merge_streams,
    request_failed,
    sse,
    sse_error,
)
from pagedserve.entrypoints.openai.streaming import ChoiceStream
from pagedserve.errors import InvalidRequestError
from pagedserve.outputs import CompletionOutput
from pagedserve.sampling_params import SamplingParams

_MISSING = -9999.0


class OpenAIServingChat(OpenAIServing):
    id_prefix = "chatcmpl"

    def render(self, messages: list[ChatMessage], add_generation_prompt: bool = True,
               chat_template: str | None = None) -> TokenizedPrompt:
        """The engine's chat rendering (template, content parts) and tokenization, so the
        server and `LLM.chat` build the same prompt from the same messages."""
        conversation = [m.model_dump(exclude_unset=True) for m in messages]
        try:
            encoded = self.engine.encode_chat(conversation, chat_template or self.chat_template,
                                              add_generation_prompt)
        except ValueError as e:
            raise OpenAIError(f"Cannot apply the chat template: {e}", param="messages") from e
        return TokenizedPrompt(encoded["prompt"], encoded["prompt_token_ids"])

    def prepare(self, req: ChatCompletionRequest) -> tuple[str, list[TokenizedPrompt], SamplingParams]:
        model = self.model_name(req.model)
        try:
            req.check_unsupported()
            params = req.to_sampling_params()
        except InvalidRequestError as e:
            raise self.invalid(req, e) from None
        prompt = self.render(req.messages, req.add_generation_prompt, req.chat_template)
        self.check_length(len(prompt.token_ids), req.requested_max_tokens())
        return model, [prompt], params

    async def full(self, req: ChatCompletionRequest, model: str, prompts: list[TokenizedPrompt],
                   params: SamplingParams, request_id: str, streams: list[RequestStream]) -> ChatCompletionResponse:
        final = None
        async for _, out in merge_streams(streams):
            final = out
        assert final is not None and final.finished
        for c in final.outputs:
            if (err := request_failed(c.finish_reason)) is not None:
                raise err
        choices = [ChatChoice(index=c.index, message=ChatResponseMessage(content=c.text),
                              logprobs=self.logprobs(c, 0, params.logprobs),
                              finish_reason=c.finish_reason, stop_reason=c.stop_reason)
                   for c in final.outputs]
        return ChatCompletionResponse(id=request_id, model=model, choices=choices, usage=make_usage([final]))

    async def stream(self, req: ChatCompletionRequest, model: str, prompts: list[TokenizedPrompt],
                     params: SamplingParams, request_id: str, streams: list[RequestStream]) -> AsyncIterator[str]:
        created = int(time.time())
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        choice_streams = [ChoiceStream() for _ in range(params.n)]
        final = None

        def chunk(choice: ChatStreamChoice) -> str:
            return sse(ChatCompletionChunk(id=request_id, created=created, model=model, choices=[choice]))

        try:
            # The role goes first, before any token exists, as OpenAI does.
            for i in range(params.n):
                yield chunk(ChatStreamChoice(index=i, delta=DeltaMessage(role="assistant", content="")))
            async for _, out in merge_streams(streams):
                final = out
                for c in out.outputs:
                    if (err := request_failed(c.finish_reason)) is not None:
                        raise err
                    cs = choice_streams[c.index]
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
        content = []
        for s, token_lp, top in self.logprob_steps(c, start, len(c.token_ids) if end is None else end, k):
            content.append(ChatLogprobToken(
                token=s, logprob=_MISSING if token_lp is None else token_lp, bytes=list(s.encode()),
                top_logprobs=[TopLogprob(token=t, logprob=lp, bytes=list(t.encode())) for t, lp in top]))
        return ChatLogprobs(content=content)
