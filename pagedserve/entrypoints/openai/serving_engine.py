"""What the completion and chat handlers share: errors, model names, the flow of one
request (validate, hand to the engine, answer once or stream), the server's own
context-length rule, the logprobs walk and SSE framing.

Every check on the request's content happens once: pydantic checks JSON types, the
request model refuses fields we do not implement, `SamplingParams` checks ranges, and
the engine (`add_request`, awaited before any byte of the response is sent) checks
the prompt, the vocabulary and its own limits.  Their `InvalidRequestError`s become
400s here, with `param` translated to the name the client used.  The one rule that is
the server's alone is OpenAI's: max_tokens must fit in the context left by the prompt.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import re
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel

from pagedserve.engine.async_llm import (
    EngineDeadError,
    EngineShutdownError,
    RequestStream,
    RequestTimeoutError,
)
from pagedserve.engine.beam_search import BeamSearchStream, step_params, step_prompt
from pagedserve.engine.chat_utils import encode_text
from pagedserve.engine.detokenizer import decoder_of
from pagedserve.engine.input_processor import InputProcessor
from pagedserve.engine.protocol import EngineClient
from pagedserve.entrypoints.openai.protocol import (
    ChatMessage,
    CompletionTokensDetails,
    ErrorInfo,
    ErrorResponse,
    PromptLogprob,
    PromptLogprobs,
    PromptTokensDetails,
    UsageInfo,
    random_id,
)
from pagedserve.entrypoints.openai.protocol_fields import (
    KNOWN_EXTRA_FIELDS,
    RefusedFieldError,
    as_sent,
    check_request_id,
)
from pagedserve.entrypoints.openai.reasoning_parsers import ReasoningParser
from pagedserve.errors import (
    CONTEXT_LENGTH_ERROR,
    ImageInputError,
    InvalidRequestError,
    OverloadedError,
    PromptTooLongError,
)
from pagedserve.lora.request import LoRARequest
from pagedserve.outputs import CompletionOutput, Logprob, RequestOutput
from pagedserve.pooling_params import PoolingParams
from pagedserve.request_limits import MAX_SEQUENCES_PER_REQUEST, MAX_WARNED_FIELD_NAMES
from pagedserve.sampling_params import BeamSearchParams, SamplingParams
from pagedserve.utils import same_value

_MIN_LOGPROB = -9999.0  # JSON has no -inf
logger = logging.getLogger("pagedserve.api_server")


class OpenAIError(Exception):
    """An error with an HTTP status, rendered in OpenAI's `{"error": {...}}` shape."""

    def __init__(self, message: str, status: int = 400, type: str = "invalid_request_error",
                 param: str | None = None, code: str | int | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.message, self.status, self.type, self.param, self.code = message, status, type, param, code
        self.headers = headers

    def to_response(self) -> ErrorResponse:
        return ErrorResponse(error=ErrorInfo(message=self.message, type=self.type, param=self.param,
                                             code=self.code))


class ModelNotFoundError(OpenAIError):
    """A 404 for a model (or adapter) this server does not serve, in vLLM's words; `model`
    is the name asked for (Ollama's routes say it their way: http_utils.error_response)."""

    def __init__(self, model: str, why: str = "") -> None:
        super().__init__(f"The model `{model[:200]}` does not exist{why}.", status=404, param="model",
                         code="model_not_found")
        self.model = model[:200]


def request_failed(finish_reason: str | None, reason: object = None) -> OpenAIError | None:
    """The error for a choice the engine ended with "error": the engine's message when it
    gave one (a grammar that failed to compile), else its logits were not finite."""
    if finish_reason != "error":
        return None
    if isinstance(reason, str):
        return OpenAIError(reason, status=400)
    return OpenAIError("The model produced non-finite logits (NaN or inf) for this request, so it was stopped; "
                       "other requests are unaffected.", status=500, type="server_error")


# What beam search does not read: each refused by name (OpenAIServing.beam_search_params)
# at any value but these, which ask for nothing.
BEAM_IGNORED: dict[str, tuple[Any, ...]] = {
    "temperature": (None, 0.0), "top_p": (None, 1.0), "top_k": (None, 0, -1), "min_p": (None, 0.0),
    "presence_penalty": (None, 0.0), "frequency_penalty": (None, 0.0), "repetition_penalty": (None, 1.0),
    "stop": (None, [], ""), "logit_bias": (None, {}), "allowed_token_ids": (None,), "bad_words": (None, []),
    "min_tokens": (0,), "prediction": (None,), "thinking_token_budget": (None,), "prompt_logprobs": (None,),
    "logprobs": (None, False), "top_logprobs": (None, 0), "stop_token_ids": (None, []),
}


@dataclass
class PreparedRequest:
    """What a validated request becomes: the model name to answer with, its prompts
    (several for /v1/completions and the pooling routes), sampling (or pooling) params,
    and how to read tool calls (chat)."""

    model: str
    prompts: list[TokenizedPrompt]
    params: SamplingParams | PoolingParams
    tools: Any = None
    reasoning: ReasoningParser | None = None  # chat: what splits its answer's reasoning off, if anything
    # Where each prompt came from, (field, "field[i]"), when that is not the i-th item of
    # the prompt field (score and rerank pairs); None: the i-th item.
    labels: list[tuple[str, str]] | None = None
    beam: BeamSearchParams | None = None  # use_beam_search: each prompt's beams (engine/beam_search.py)

    def prompt_label(self, i: int, field: str | None) -> tuple[str, str] | None:
        """How an error names prompt `i` of several (None: the request has one)."""
        if self.labels is not None:
            return self.labels[i]
        return item_label(i, len(self.prompts), field)


def item_label(i: int, count: int, field: str | None) -> tuple[str, str] | None:
    """How an error names item `i` of `count` in the prompt field (None: there is one)."""
    return (field or "prompt", f"{field or 'prompt'}[{i}]") if count > 1 else None


@dataclass
class TokenizedPrompt:
    text: str | None
    token_ids: list[int]
    # A chat with images: the engine's expanded prompt (InputProcessor.encode_chat's).
    multi_modal: Any = None

    def engine_prompt(self) -> dict[str, Any]:
        prompt = {"prompt_token_ids": self.token_ids, "prompt": self.text}
        if self.multi_modal is not None:
            prompt["multi_modal"] = self.multi_modal
        return prompt


def sse(data: BaseModel | dict | str) -> str:
    if isinstance(data, BaseModel):
        data = data.model_dump_json()
    elif isinstance(data, dict):
        data = json.dumps(data)
    return f"data: {data}\n\n"


def to_openai_error(err: BaseException) -> OpenAIError:
    """The one mapping from what a request can fail with to the status and body a client
    gets, as a response or as a stream's error event.  Bodies never carry a traceback or
    a path: an unexpected exception is named by its type (the server log has the rest)."""
    if isinstance(err, OpenAIError):
        return err
    if isinstance(err, InvalidRequestError):
        return OpenAIError(str(err), param=err.param, code=err.code)
    if isinstance(err, OverloadedError):
        return OpenAIError(str(err), status=503, type="server_error", code="server_overloaded",
                           headers={"Retry-After": str(err.retry_after)})
    if isinstance(err, RequestTimeoutError):
        # (OpenAI's and Anthropic's clients retry a 408 twice by default: the same answer
        # would run past the same --request-timeout three times over; this header stops them)
        return OpenAIError(str(err), status=408, type="timeout_error", code="request_timeout",
                           headers={"x-should-retry": "false"})
    if isinstance(err, EngineShutdownError):
        return OpenAIError(str(err), status=503, type="server_error", code="shutting_down")
    if isinstance(err, EngineDeadError):
        return OpenAIError(str(err), status=503, type="server_error", code="engine_dead")
    if isinstance(err, ValueError):
        return OpenAIError(str(err))
    logger.error("request failed", exc_info=err)
    return OpenAIError(f"Internal server error ({type(err).__name__}; details in the server log).", status=500,
                       type="server_error")


def sse_error(err: BaseException) -> str:
    return sse({"error": to_openai_error(err).to_response().error.model_dump()})


@dataclass(frozen=True)
class ServingOptions:
    """Server-wide defaults of requests, from the command line (vLLM's flags)."""

    default_chat_template_kwargs: dict[str, Any] = field(default_factory=dict)  # a request's own keys win
    force_include_usage: bool = False  # every stream ends with a usage chunk, asked for or not


class OpenAIServing:
    """One generation endpoint.  Subclasses turn a request body into prompts and
    sampling params (`prepare`) and render the engine's outputs (`full`, `stream`)."""

    id_prefix = "cmpl"
    OWN_REFUSALS: frozenset[str] = frozenset()  # unmodelled fields this route refuses by name itself

    def __init__(self, engine: EngineClient, served_model_names: list[str], max_model_len: int,
                 lora_modules: dict[str, LoRARequest] | None = None, options: ServingOptions | None = None) -> None:
        """`lora_modules`: the server's adapters by name (shared with the runtime load and
        unload routes, which change it); a request's `model` picks one."""
        self.options = options or ServingOptions()
        self.engine = engine
        self.tokenizer = engine.tokenizer
        self.served_model_names = served_model_names
        self.lora_modules = lora_modules if lora_modules is not None else {}
        self.max_model_len = max_model_len
        self._warned_fields: set[str] = set()
        self._left_out: dict[int, bool] = {}  # left_out_of_text's answers, by token id (at most the vocabulary)

    def warn_unknown_fields(self, req: BaseModel, known: frozenset[str] | None = None) -> None:
        """Fields no version of OpenAI's or vLLM's API defines are ignored (newer clients
        keep working), with one warning line per request naming the new ones, each name
        once, for the first MAX_WARNED_FIELD_NAMES names (a request of 50,000 made-up
        names costs one line, and the set of names seen stays bounded).  `known`: the
        unmodelled fields the route refuses or documents itself (None: OpenAI's and vLLM's,
        and this route's OWN_REFUSALS; on Anthropic's and Ollama's, which do not read them,
        their own)."""
        known = KNOWN_EXTRA_FIELDS | self.OWN_REFUSALS if known is None else known
        extra = req.model_extra or {}
        if not extra or len(self._warned_fields) >= MAX_WARNED_FIELD_NAMES:
            return
        new = [name for name in extra if name not in self._warned_fields and name not in known]
        new = new[: MAX_WARNED_FIELD_NAMES - len(self._warned_fields)]
        if new:
            self._warned_fields.update(new)
            shown = ", ".join(repr(n[:100]) for n in new[:10])
            more = f" and {len(new) - 10} more" if len(new) > 10 else ""
            full = len(self._warned_fields) >= MAX_WARNED_FIELD_NAMES
            logger.warning("ignoring unknown request field(s) %s%s (each logged once%s)", shown, more,
                           "; no more will be logged" if full else "")

    def model_name(self, requested: str | None) -> str:
        """The served model or LoRA adapter a request names (None: the first served name)."""
        if requested is None:
            return self.served_model_names[0]
        if requested not in self.served_model_names and requested not in self.lora_modules:
            raise ModelNotFoundError(requested)
        return requested

    def lora_request(self, requested: str | None) -> LoRARequest | None:
        """The adapter a request names, looked up once for all its prompts (None: the base
        model); one unloaded since the request was checked is a 404, never the base model
        answering under the adapter's name."""
        if requested is None or requested in self.served_model_names:
            return None
        lora = self.lora_modules.get(requested)
        if lora is None:
            raise ModelNotFoundError(requested, " (it was unloaded while this request was prepared)")
        return lora

    # ------------------------------------------------------------------ one request
    def prepare(self, req: Any) -> PreparedRequest:
        raise NotImplementedError

    async def full(self, req: Any, prep: PreparedRequest, request_id: str, streams: list[RequestStream]) -> Any:
        raise NotImplementedError

    def stream(self, req: Any, prep: PreparedRequest, request_id: str,
               streams: list[RequestStream]) -> AsyncIterator[str]:
        raise NotImplementedError  # (the pooling routes never stream)

    async def start(self, req: Any, prep: PreparedRequest) -> tuple[str, list[RequestStream | BeamSearchStream]]:
        """Hand every prompt to the engine, which validates it; any refusal aborts the
        ones already accepted and becomes a 400 before the response starts.  The
        request is admitted as a whole: its first prompt meets max_waiting_requests.
        Returns the answer's id (vLLM's "<kind>-<request_id>" when the client gave one;
        the engine's own ids stay unique) and the prompts' streams."""
        request_id = random_id(self.id_prefix)
        answer_id = request_id if req.request_id is None else f"{self.id_prefix}-{check_request_id(req.request_id)}"
        lora_request = self.lora_request(req.model)
        streams: list[RequestStream | BeamSearchStream] = []
        i = 0
        # (a beam search's steps share its deadline, request_timeout bounding the whole search,
        # and its arrival, so that each step keeps the search's place in the queue)
        timeout = self.engine.request_timeout
        deadline = None if timeout is None or prep.beam is None else time.monotonic() + timeout
        arrival = None if prep.beam is None else time.time()
        try:
            for i, p in enumerate(prep.prompts):
                rid = request_id if len(prep.prompts) == 1 else f"{request_id}-{i}"
                prompt = p.engine_prompt()
                if req.cache_salt is not None:
                    prompt["cache_salt"] = req.cache_salt
                params = prep.params if prep.beam is None else step_params(prep.beam.beam_width)
                stream = await self.engine.add_request(rid, prompt, params, req.priority,
                                                       final_only=not req.stream or prep.beam is not None,
                                                       lora_request=lora_request, admitted=i > 0, deadline=deadline,
                                                       arrival_time=arrival)
                streams.append(stream if prep.beam is None else self._beams(
                    stream, rid, p, prep.beam, params, req, lora_request, deadline, arrival))
        except BaseException as e:
            for s in streams:
                s.close()
            if isinstance(e, ValueError):
                raise self.invalid(req, e, prep.prompt_label(i, req.api_param("prompt"))) from e
            raise
        return answer_id, streams

    def beam_search_params(self, req: Any, params: SamplingParams) -> BeamSearchParams | None:
        """vLLM's use_beam_search: each prompt's n best beams (engine/beam_search.py; n is
        the beam width), answered whole.  A field beam search does not read is refused by
        name at any value that asks for something (beams rank by the model's own logprobs
        and end at its end tokens; vLLM ignores these)."""
        if not req.use_beam_search:
            for name, neutral in (("length_penalty", (1.0,)), ("early_stopping", (False,))):
                if not same_value(getattr(req, name), neutral):
                    raise OpenAIError(f"{name} steers beam search: it needs use_beam_search", param=name)
            return None
        for name, neutral in BEAM_IGNORED.items():
            if name in type(req).model_fields and not same_value(getattr(req, name), neutral):
                raise OpenAIError(f"{name} is not read by beam search, which ranks by the model's own logprobs and "
                                  "ends beams at its end tokens: leave it out with use_beam_search", param=name)
        if params.structured_outputs is not None:  # (named: the constraining field, else tools' implicit one)
            raise OpenAIError("use_beam_search cannot follow a response format, a grammar or a tool call's schema",
                              param=next(iter(req.structured_fields()), "tools"))
        beam = BeamSearchParams(beam_width=params.n, max_tokens=params.max_tokens or self.max_model_len,
                                ignore_eos=params.ignore_eos, length_penalty=req.length_penalty,
                                early_stopping=req.early_stopping)
        try:
            beam.validate(self.engine.max_logprobs)
        except InvalidRequestError as e:
            raise OpenAIError(str(e).replace("beam_width must", "n (the beam width) must").replace("x beam_width", "x n"),
                              param="n" if e.param == "beam_width" else e.param) from None
        return beam

    def _beams(self, first: RequestStream, request_id: str, prompt: TokenizedPrompt, beam: BeamSearchParams,
               step: SamplingParams, req: Any, lora_request: LoRARequest | None,
               deadline: float | None, arrival: float | None) -> BeamSearchStream:
        """A prompt's beam search, from its first step's stream (the engine's checks of
        the prompt ran on it: a refusal is a 400 before the answer starts).  Its later
        steps share its deadline and arrival time and count as one request waiting
        (AsyncLLM's `group`)."""
        streams = iter([first])

        async def next_tokens(ids: list[int]) -> RequestOutput:
            stream = next(streams, None) or await self.engine.add_request(
                random_id("beam"), step_prompt(ids, req.cache_salt, prompt.multi_modal), step, req.priority, final_only=True, lora_request=lora_request, group=request_id,
                deadline=deadline, arrival_time=arrival)
            async for out in stream:
                c = out.outputs[0]
            if (err := request_failed(c.finish_reason, c.stop_reason)) is not None:
                raise err
            return out

        stops = set() if beam.ignore_eos else set(self.engine.stop_token_ids)
        decode = (lambda ids: self.tokenizer.decode(ids, skip_special_tokens=req.skip_special_tokens)) \
            if self.tokenizer is not None else (lambda ids: "")
        return BeamSearchStream(request_id, prompt.text, prompt.token_ids, beam, next_tokens, stops,
                                self.max_model_len, decode, on_close=first.close,
                                include_stop=req.include_stop_str_in_output)

    @staticmethod
    def invalid(req: Any, e: ValueError, label: tuple[str, str] | None = None) -> OpenAIError:
        """`e` as a 400 naming the request's field; a refused prompt of several is named
        by `label` ((its field, how the message names it), PreparedRequest.prompt_label)."""
        if isinstance(e, RefusedFieldError):  # (named as sent)
            return OpenAIError(str(e), param=e.param)
        if not isinstance(e, InvalidRequestError):
            return OpenAIError(str(e))
        param, code = req.api_param(e.param), e.code
        if label is not None and e.param == "prompt":
            return OpenAIError(f"{label[1]}: {e}", param=label[0], code=code)
        return OpenAIError(str(as_sent(e, param)), param=param, code=code)

    @staticmethod
    def check_fanout(num_prompts: int, n: int, param: str = "prompt", limit: int = MAX_SEQUENCES_PER_REQUEST) -> None:
        """One request starts at most `limit` sequences (prompts x n); `param`: the field
        that holds the prompts."""
        if num_prompts * n > limit:
            raise OpenAIError(f"this request would start {num_prompts} prompts x n={n} = {num_prompts * n} "
                              f"sequences; at most {limit} are allowed per request",
                              param=param if num_prompts > 1 else "n")

    def check_length(self, num_prompt: int, max_tokens: int | None, prompt_param: str = "messages",
                     max_tokens_param: str = "max_tokens") -> None:
        """OpenAI's rule: prompt + max_tokens must fit in the context (an unset max_tokens
        means "the rest of it"; a prompt that alone leaves no room is the engine's to refuse).
        The message is vLLM's, word for word; its `param` names max_tokens only where a
        smaller one would fit (as the client spelled it: `max_tokens_param`), else the prompt's
        field (`prompt_param`)."""
        limit = self.max_model_len
        if isinstance(max_tokens, int) and max_tokens >= 1 and num_prompt + max_tokens > limit:
            raise OpenAIError(
                f"{CONTEXT_LENGTH_ERROR} {limit} tokens. However, you requested "
                f"{num_prompt + max_tokens} tokens ({num_prompt} in the messages, {max_tokens} in the "
                "completion). Please reduce the length of the messages or completion.",
                param=max_tokens_param if num_prompt < limit else prompt_param, code=PromptTooLongError.code)

    def truncated(self, prompt: TokenizedPrompt, truncate: int | None, room: int = 0) -> TokenizedPrompt:
        """`prompt` cut to its last `truncate` tokens (vLLM's truncate_prompt_tokens, the
        engine's one rule: InputProcessor.truncate_prompt; `room`: the tokens to generate,
        which -1 leaves); a cut prompt keeps no text (echo decodes its ids)."""
        ids = InputProcessor.truncate_prompt(prompt.token_ids, truncate, self.max_model_len, prompt.multi_modal is not None,
                                             room)
        return prompt if ids is prompt.token_ids else TokenizedPrompt(None, ids)

    def render_chat(self, messages: list[ChatMessage], chat_template: str | None, add_generation_prompt: bool,
                    tools: list[dict] | None = None, **kwargs: Any) -> TokenizedPrompt:
        """The engine's chat rendering (template, content parts and images, tools) and
        tokenization, so chat, the chat form of the pooling routes and `LLM.chat` build
        the same prompt from the same messages; `kwargs`: chat_template_kwargs (over the
        server's --default-chat-template-kwargs), continue_final_message, add_special_tokens."""
        conversation = [m.model_dump(exclude_unset=True) for m in messages]
        template_kwargs = {**self.options.default_chat_template_kwargs, **(kwargs.get("chat_template_kwargs") or {})}
        kwargs["chat_template_kwargs"] = template_kwargs or None
        try:
            encoded = self.engine.encode_chat(conversation, chat_template, add_generation_prompt, tools=tools,
                                              **kwargs)
        except ImageInputError as e:  # an image's own refusal, not the template's
            raise OpenAIError(str(e), param=e.param or "messages") from e
        except PromptTooLongError as e:  # the conversation's length, not the template's fault
            raise OpenAIError(str(e), param=e.param or "messages", code=e.code) from e
        except ValueError as e:  # the field a bound names (chat_template, messages), else the messages
            param = e.param if isinstance(e, InvalidRequestError) and e.param else "messages"
            raise OpenAIError(f"Cannot apply the chat template: {e}", param=param) from e
        return TokenizedPrompt(encoded["prompt"], encoded["prompt_token_ids"], encoded.get("multi_modal"))

    def tokenize(self, prompt: str, add_special_tokens: bool = True, cut: bool = False) -> list[int]:
        """`cut`: only the last tokens will run (truncate_prompt_tokens; chat_utils.encode_text)."""
        if self.tokenizer is None:
            raise OpenAIError("this model has no tokenizer; send the prompt as token ids", param="prompt")
        return encode_text(self.tokenizer, prompt, self.engine.max_prompt_chars, add_special_tokens, cut=cut)

    # ------------------------------------------------------------------ logprobs
    def token_str(self, token_id: int, lp: Logprob | None = None) -> str:
        if lp is not None and lp.decoded_token is not None:
            return lp.decoded_token
        if self.tokenizer is None:
            return f"token_id:{token_id}"
        return self.tokenizer.decode([token_id])

    def left_out_of_text(self, token_id: int) -> bool:
        """Whether skip_special_tokens leaves the token out of an answer's text (the
        detokenizer's decode of it is empty where its own text is not)."""
        if token_id not in self._left_out:
            self._left_out[token_id] = (self.tokenizer is not None and self.token_str(token_id) != ""
                                        and decoder_of(self.tokenizer, True)([token_id]) == "")
        return self._left_out[token_id]

    def token_bytes(self, token_id: int, text: str) -> bytes:
        """The token's own bytes: its text's, unless the token holds part of a character
        (its text then reads U+FFFD): the bytes its vocabulary entry stands for (byte-level
        BPE's alphabet, SentencePiece's <0xNN>), from which a client rebuilds the text."""
        if "\ufffd" in text and self.tokenizer is not None:
            raw = vocabulary_bytes(self.tokenizer.convert_ids_to_tokens([token_id])[0])
            if raw is not None:
                return raw
        return text.encode()

    def logprob_steps(self, c: CompletionOutput, start: int, end: int,
                      k: int) -> Iterator[tuple[str, bytes, float | None, list[tuple[str, bytes, float]]]]:
        """For each generated token in [start, end): (its text, its bytes, its logprob or
        None, the k most likely (text, bytes, logprob), best first); -inf is clamped for JSON."""
        for pos in range(start, min(end, len(c.logprobs or ()))):
            tok, step = c.token_ids[pos], c.logprobs[pos]
            if step is None:  # a prompt's first token: nothing predicts it
                s = self.token_str(tok)
                yield s, self.token_bytes(tok, s), None, []
                continue
            chosen = step.get(tok)
            ranked = sorted(step.items(), key=lambda kv: (kv[1].rank if kv[1].rank is not None else math.inf,
                                                           -kv[1].logprob))
            top = [(t_s := self.token_str(t, v), self.token_bytes(t, t_s), clamp_logprob(v.logprob))
                   for t, v in ranked[:k]]
            s = self.token_str(tok, chosen)
            yield s, self.token_bytes(tok, s), clamp_logprob(chosen.logprob) if chosen else None, top


def _byte_alphabet() -> dict[str, int]:
    """Byte-level BPE's (GPT-2's) alphabet, character -> byte: printable bytes stand for
    themselves, the others for 256 + their order among them."""
    printable = {*range(ord("!"), ord("~") + 1), *range(ord("\xa1"), ord("\xac") + 1),
                 *range(ord("\xae"), ord("\xff") + 1)}
    out, shifted = {}, 0
    for b in range(256):
        if b in printable:
            out[chr(b)] = b
        else:
            out[chr(256 + shifted)] = b
            shifted += 1
    return out


_BYTE_ALPHABET = _byte_alphabet()
_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def vocabulary_bytes(piece: str | None) -> bytes | None:
    """The bytes a vocabulary entry stands for, where its form says (None: it does not)."""
    if piece is None:
        return None
    if m := _BYTE_PIECE.fullmatch(piece):
        return bytes([int(m.group(1), 16)])
    if all(ch in _BYTE_ALPHABET for ch in piece):
        return bytes(_BYTE_ALPHABET[ch] for ch in piece)
    return None


def prompt_logprobs_of(out: RequestOutput) -> PromptLogprobs | None:
    """The request's prompt logprobs in vLLM's response shape (None when not asked for)."""
    if out.prompt_logprobs is None:
        return None
    return [None if step is None else {t: PromptLogprob(logprob=clamp_logprob(lp.logprob), rank=lp.rank,
                                                        decoded_token=lp.decoded_token) for t, lp in step.items()}
            for step in out.prompt_logprobs]


def clamp_logprob(x: float) -> float:
    return max(x, _MIN_LOGPROB) if not math.isnan(x) else _MIN_LOGPROB


def make_usage(outputs: list[RequestOutput]) -> UsageInfo:
    """Usage over a response's outputs; with a prediction, OpenAI's counts of its tokens
    accepted and rejected.  completion_tokens counts the tokens generated only (OpenAI
    also bills rejected prediction tokens as completion tokens; nothing is billed here)."""
    prompt = sum(len(o.prompt_token_ids) for o in outputs)
    completion = sum(len(c.token_ids) for o in outputs for c in o.outputs)
    cached = sum(o.num_cached_tokens or 0 for o in outputs)
    predicted = [c for o in outputs for c in o.outputs if c.accepted_prediction_tokens is not None]
    details = CompletionTokensDetails(
        accepted_prediction_tokens=sum(c.accepted_prediction_tokens for c in predicted),
        rejected_prediction_tokens=sum(c.rejected_prediction_tokens or 0 for c in predicted)) if predicted else None
    return UsageInfo(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion,
                     prompt_tokens_details=PromptTokensDetails(cached_tokens=cached),
                     completion_tokens_details=details)


def running_usage(finals: dict[int, RequestOutput], prompts: list[TokenizedPrompt],
                  generated: bool = True) -> UsageInfo:
    """Usage so far, for vLLM's continuous_usage_stats: every prompt's tokens from the first
    chunk (a chat's role chunk, an echo; a prompt with no output yet counted as sent; it
    was left out, a completion of three prompts reporting 4, then 9, then 10), and the
    completion tokens so far.  `finals`: each prompt's latest output, by its index.
    `generated` False: a chunk sent before the answer's tokens (a chat's role chunk), which
    counts none of them (its cached prompt tokens are the output's)."""
    usage = make_usage(list(finals.values()))
    waiting = sum(len(p.token_ids) for i, p in enumerate(prompts) if i not in finals)
    update = {"prompt_tokens": usage.prompt_tokens + waiting, "total_tokens": usage.total_tokens + waiting}
    if not generated:
        update.update(completion_tokens=0, total_tokens=update["prompt_tokens"], completion_tokens_details=None)
    return usage.model_copy(update=update)


async def merge_streams(streams: list[RequestStream]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Interleave several request streams as (index, output); leaving early (an error,
    a cancelled handler, a closed SSE body) closes, and so aborts, every stream."""
    try:
        if len(streams) == 1:
            async for item in streams[0]:
                yield 0, item
            return
        queue: asyncio.Queue = asyncio.Queue()
        done = object()

        async def pump(i: int, stream: RequestStream) -> None:
            try:
                async for item in stream:
                    await queue.put((i, item))
                await queue.put((i, done))
            except BaseException as e:  # noqa: BLE001 - forwarded to the consumer
                await queue.put((i, e))

        tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
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
    finally:
        for s in streams:
            s.close()
