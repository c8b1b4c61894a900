"""What the completion and chat handlers share: errors, model names, prompt
tokenization with the context-length check, logprob formatting and SSE framing.

Prompts are tokenized here, not in the engine, because the context-length error has to
quote the prompt's token count, and the same ids then go to the engine unchanged.
"""

from __future__ import annotations

import asyncio
import json
import math
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel

from pagedserve.entrypoints.openai.protocol import ErrorInfo, ErrorResponse, UsageInfo
from pagedserve.outputs import Logprob, RequestOutput

_MIN_LOGPROB = -9999.0  # JSON has no -inf


class OpenAIError(Exception):
    """An error with an HTTP status, rendered in OpenAI's `{"error": {...}}` shape."""

    def __init__(self, message: str, status: int = 400, type: str = "invalid_request_error",
                 param: str | None = None, code: str | int | None = None) -> None:
        super().__init__(message)
        self.message, self.status, self.type, self.param, self.code = message, status, type, param, code

    def to_response(self) -> ErrorResponse:
        return ErrorResponse(error=ErrorInfo(message=self.message, type=self.type, param=self.param,
                                             code=self.code))


@dataclass
class TokenizedPrompt:
    text: str | None
    token_ids: list[int]


def sse(data: BaseModel | dict | str) -> str:
    if isinstance(data, BaseModel):
        data = data.model_dump_json()
    elif isinstance(data, dict):
        data = json.dumps(data)
    return f"data: {data}\n\n"


def sse_error(err: BaseException) -> str:
    if not isinstance(err, OpenAIError):
        err = OpenAIError(str(err) or type(err).__name__, status=500, type="server_error")
    return sse({"error": err.to_response().error.model_dump()})


class OpenAIServing:
    def __init__(self, engine: Any, served_model_names: list[str], max_model_len: int,
                 chat_template: str | None = None) -> None:
        self.engine = engine
        self.tokenizer = engine.tokenizer
        self.served_model_names = served_model_names
        self.max_model_len = max_model_len
        self.chat_template = chat_template
        # The model's vocabulary (it may be padded past the tokenizer's).
        self.vocab_size = getattr(getattr(engine, "engine", None), "vocab_size", None) or (
            len(self.tokenizer) if self.tokenizer is not None else None)

    def model_name(self, requested: str | None) -> str:
        if requested is None:
            return self.served_model_names[0]
        if requested not in self.served_model_names:
            raise OpenAIError(f"The model `{requested}` does not exist.", status=404, param="model",
                              code="model_not_found")
        return requested

    # ------------------------------------------------------------------ prompts
    def tokenize(self, prompt: str, add_special_tokens: bool = True) -> list[int]:
        if self.tokenizer is None:
            raise OpenAIError("this model has no tokenizer; send the prompt as token ids")
        return list(self.tokenizer.encode(prompt, add_special_tokens=add_special_tokens))

    def check_token_ids(self, ids: list[int]) -> None:
        if not ids:
            raise OpenAIError("The prompt must contain at least one token.", param="prompt")
        bad = [t for t in ids if not isinstance(t, int) or t < 0 or
               (self.vocab_size is not None and t >= self.vocab_size)]
        if bad:
            raise OpenAIError(f"Token id {bad[0]} is out of vocabulary (vocab size {self.vocab_size}).",
                              param="prompt")

    def check_length(self, num_prompt: int, max_tokens: int | None) -> int:
        """Return the max_tokens to use (the rest of the context when None)."""
        limit = self.max_model_len
        if max_tokens is None:
            if num_prompt >= limit:
                raise OpenAIError(
                    f"This model's maximum context length is {limit} tokens. However, you requested "
                    f"{num_prompt} tokens in the messages. Please reduce the length of the messages.")
            return limit - num_prompt
        if isinstance(max_tokens, int) and max_tokens >= 1 and num_prompt + max_tokens > limit:
            raise OpenAIError(
                f"This model's maximum context length is {limit} tokens. However, you requested "
                f"{num_prompt + max_tokens} tokens ({num_prompt} in the messages, {max_tokens} in the "
                "completion). Please reduce the length of the messages or completion.")
        return max_tokens

    def check_params(self, params: Any) -> None:
        """What the engine would refuse only after a stream has started (as an in-band
        error); checked here so the client gets a plain 400 instead."""
        bad = [t for t in params.stop_token_ids if self.vocab_size is not None and t >= self.vocab_size]
        if bad:
            raise OpenAIError(f"stop_token_ids {bad} are outside the vocabulary (0..{self.vocab_size - 1})",
                              param="stop_token_ids")
        if params.stop_strings and self.tokenizer is None:
            raise OpenAIError("stop strings need a tokenizer; this model has none (use stop_token_ids)",
                              param="stop")

    # ------------------------------------------------------------------ logprobs
    def token_str(self, token_id: int, lp: Logprob | None = None) -> str:
        if lp is not None and lp.decoded_token is not None:
            return lp.decoded_token
        if self.tokenizer is None:
            return f"token_id:{token_id}"
        return self.tokenizer.decode([token_id])

    def top_entries(self, step: dict[int, Logprob], k: int) -> list[tuple[int, Logprob]]:
        """The k most likely tokens of one step, best first."""
        ranked = sorted(step.items(), key=lambda kv: (kv[1].rank if kv[1].rank is not None else math.inf,
                                                       -kv[1].logprob))
        return ranked[:k]


def clamp_logprob(x: float) -> float:
    return max(x, _MIN_LOGPROB) if not math.isnan(x) else _MIN_LOGPROB


def make_usage(outputs: list[RequestOutput]) -> UsageInfo:
    from pagedserve.entrypoints.openai.protocol import PromptTokensDetails

    prompt = sum(len(o.prompt_token_ids) for o in outputs)
    completion = sum(len(c.token_ids) for o in outputs for c in o.outputs)
    cached = sum(o.num_cached_tokens or 0 for o in outputs)
    return UsageInfo(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion,
                     prompt_tokens_details=PromptTokensDetails(cached_tokens=cached))


async def merge_async_iterators(*iterators: AsyncIterator[Any]) -> AsyncIterator[tuple[int, Any]]:
    """Interleave several async iterators as (index, item); closing the merged iterator
    cancels (and so aborts) every source that is still running."""
    if len(iterators) == 1:
        async for item in iterators[0]:
            yield 0, item
        return
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(i: int, it: AsyncIterator[Any]) -> None:
        try:
            async for item in it:
                await queue.put((i, item))
            await queue.put((i, done))
        except BaseException as e:  # noqa: BLE001 - forwarded to the consumer
            await queue.put((i, e))

    tasks = [asyncio.ensure_future(pump(i, it)) for i, it in enumerate(iterators)]
    try:
        remaining = len(tasks)
        while remaining:
            i, item = await queue.get()
            if item is done:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
