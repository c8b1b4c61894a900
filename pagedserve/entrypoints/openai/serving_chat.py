"""POST /v1/chat/completions: messages -> chat template -> one engine request (n choices).

Tools (OpenAI's function calling): the tools are rendered through the model's chat
template (unless tool_choice is "none") and the answer is read back as tool calls:
- a named tool_choice constrains the answer to that function's parameter schema: the
  whole answer is its arguments;
- "required" constrains it to a JSON array of {"name", "parameters"} calls;
- "auto" lets the model choose, reading calls in its own format with the server's
  `--tool-call-parser` (whose structural tag, where the format has one, keeps every
  call the model opens valid for its tool's schema).
A choice with calls has `tool_calls` and finish_reason "tool_calls"; streamed, plain
text goes out as it comes and each call once its arguments are complete (a named call:
its arguments as they are generated).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any, TypeVar

from pagedserve.chat_template import text_part_indices
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
    DeltaFunctionCall,
    DeltaMessage,
    DeltaToolCall,
    FunctionCall,
    FunctionDefinition,
    ToolCall,
    TopLogprob,
    random_id,
)
from pagedserve.entrypoints.openai.protocol_fields import COMPLETION_FIELDS
from pagedserve.entrypoints.openai.reasoning_parsers import END, START, ReasoningParser
from pagedserve.entrypoints.openai.serving_engine import (
    OpenAIError,
    OpenAIServing,
    PreparedRequest,
    TokenizedPrompt,
    make_usage,
    merge_streams,
    prompt_logprobs_of,
    request_failed,
    running_usage,
    sse,
    sse_error,
)
from pagedserve.entrypoints.openai.streaming import ChoiceStream, calls_after_text, sse_dicts
from pagedserve.entrypoints.openai.tool_parsers import (
    CallCursor,
    ParsedToolCall,
    ToolParser,
    forced_tools_system_prompt,
    required_calls,
    sent_calls,
    tool_parameters,
)
from pagedserve.errors import InvalidRequestError
from pagedserve.outputs import CompletionOutput
from pagedserve.sampling_params import SamplingParams, StructuredOutputsParams

_MISSING = -9999.0
logger = logging.getLogger("pagedserve.api_server")

C = TypeVar("C", ChatChoice, ChatStreamChoice)


def with_system_text(messages: list[ChatMessage], text: str) -> list[ChatMessage]:
    """The conversation with `text` at the end of its system message (one added first
    where it has none).  A system message of parts gets it at the end of its last text
    part: a second system message broke templates that want the roles to alternate, and a
    new part was dropped by those that read a message's first part alone (Gemma 3's)."""
    first = messages[0] if messages else None
    if first is None or first.role != "system" or not isinstance(first.content, (str, list)):
        return [ChatMessage(role="system", content=text), *messages]
    if isinstance(first.content, str):
        content: str | list = f"{first.content}\n\n{text}"
    else:
        content = list(first.content)
        texts = text_part_indices(content)
        if texts:
            content[texts[-1]] = {**content[texts[-1]], "text": f"{content[texts[-1]]['text']}\n\n{text}"}
        else:
            content.append({"type": "text", "text": text})
    return [first.model_copy(update={"content": content}), *messages[1:]]


def with_calls_as_text(messages: list[ChatMessage], parser: ToolParser) -> list[ChatMessage]:
    """The conversation with each past assistant turn's tool calls written into its text
    (`messages` itself where no turn has any)."""
    out, changed = [], False
    for m in messages:
        extra = m.model_extra or {}
        # (OpenAI's deprecated function_call is the turn's one call, as chat_utils renders it)
        legacy = [{"function": extra["function_call"]}] if isinstance(extra.get("function_call"), dict) else []
        calls = sent_calls(extra.get("tool_calls") or legacy) if m.role == "assistant" else []
        if calls:
            text = m.content if isinstance(m.content, str) and m.content else ""
            m = m.model_copy(update={"content": (text + "\n" if text else "") + parser.format_calls(calls),
                                     "tool_calls": None, "function_call": None})
            changed = True
        out.append(m)
    return out if changed else messages


def echo_text(req: ChatCompletionRequest) -> str:
    """vLLM's chat `echo`: the final message's text when it is the assistant's (the turn
    the answer continues, as with continue_final_message), put before the answer; nothing
    otherwise.  Text parts are joined by newlines, as vLLM joins them."""
    return final_assistant_text(req) if req.echo else ""


def final_assistant_text(req: ChatCompletionRequest) -> str:
    """The final message's text when it is the assistant's (what continue_final_message
    continues), else ""."""
    last = req.messages[-1] if req.messages else None
    if last is None or last.role != "assistant" or last.content is None:
        return ""
    if isinstance(last.content, str):
        return last.content
    return "\n".join(part["text"] for part in last.content
                     if part.get("type") == "text" and isinstance(part.get("text"), str))


def split_reasoning(parser: ReasoningParser | None,
                    c: CompletionOutput) -> tuple[str | None, CompletionOutput]:
    """(the reasoning so far, the output with only its content as text); (None, c)
    without a parser.  Tool calls are then read from the content alone."""
    if parser is None:
        return None, c
    reasoning, content = parser.split(c.text, c.finish_reason is not None)
    return reasoning, dataclasses.replace(c, text=content)


@dataclass
class ToolPlan:
    """How one request's answer is read: mode "none" | "auto" | "required" | "named"; under
    "auto", calls only of the request's tools (`names`), and at most one with
    `parallel_tool_calls` false (`one_call`: the formats without a structural tag to stop
    after the first, llama3_json's and pythonic's, have the rest cut here)."""

    mode: str = "none"
    function: FunctionDefinition | None = None
    parser: ToolParser | None = None
    names: frozenset[str] = frozenset()
    one_call: bool = False

    def calls(self, text: str, finished: bool,
              cursor: CallCursor | None = None) -> tuple[str | None, list[ParsedToolCall]]:
        """(plain text, tool calls) of an answer; `cursor`: a stream's parse so far (CallCursor)."""
        if self.mode == "named":
            return None, [ParsedToolCall(self.function.name, text)]
        if self.mode == "required":
            return None, required_calls(text, finished, cursor if cursor is not None else CallCursor())
        if self.mode == "auto":
            text, calls = self.parser.extract(text, finished, self.names, cursor)
            return text, calls[:1] if self.one_call else calls
        return text, []


@dataclass
class ToolStream:
    """Per choice: how much plain text and which calls were sent."""

    sent_text: int = 0
    sent_calls: int = 0
    sent_args: int = 0  # named mode: characters of the arguments sent
    sent_tokens: int = 0  # tokens whose logprobs were sent
    finished: bool = False  # its finish_reason was sent: nothing more (n > 1: the other choices go on)
    call_ids: list[str] = field(default_factory=list)
    cursor: CallCursor = field(default_factory=CallCursor)  # where the answer's parse resumes


class OpenAIServingChat(OpenAIServing):
    id_prefix = "chatcmpl"
    OWN_REFUSALS = frozenset(COMPLETION_FIELDS)

    def __init__(self, *args, tool_parser: ToolParser | None = None,
                 reasoning_parser: ReasoningParser | None = None, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.tool_parser = tool_parser
        self.reasoning_parser = reasoning_parser
        self._warned_tools_block: set[str] = set()  # the tool_choice modes logged
        tok = self.tokenizer
        if reasoning_parser is not None and tok is not None and tok.convert_tokens_to_ids(END) in (None, tok.unk_token_id):
            logger.warning("--reasoning-parser %s: this tokenizer has no %s token (not a thinking model's?): "
                           "answers are split by their text, and under a grammar they are all content (it cannot "
                           "start after the block)", reasoning_parser.name, END)

    def render(self, req: ChatCompletionRequest | None, messages: list[ChatMessage],
               add_generation_prompt: bool = True, tools: list[dict] | None = None) -> TokenizedPrompt:
        """The engine's chat rendering (template, content parts, tools) and tokenization,
        so the server and `LLM.chat` build the same prompt from the same messages."""
        kwargs = {}
        if req is not None:
            kwargs = dict(chat_template_kwargs=req.chat_template_kwargs, documents=req.documents,
                          continue_final_message=req.continue_final_message, add_special_tokens=req.add_special_tokens,
                          cut=req.truncate_prompt_tokens is not None)
        return self.render_chat(messages, req.chat_template if req else None, add_generation_prompt, tools, **kwargs)

    def rendered(self, req: ChatCompletionRequest, plan: ToolPlan | None = None) -> TokenizedPrompt:
        """`req`'s prompt as the chat handler runs it (its tools shown unless tool_choice
        is "none"); also what /tokenize counts."""
        plan = self.tool_plan(req) if plan is None else plan
        tools = [t.model_dump(exclude_none=True) for t in req.tools] if req.tools and plan.mode != "none" else None
        prompt = self.render(req, req.messages, req.add_generation_prompt, tools)
        if req.documents and prompt.text == self.render(req.model_copy(update={"documents": []}), req.messages,
                                                        req.add_generation_prompt, tools).text:
            raise OpenAIError("documents: this model's chat template does not read them (a RAG template's "
                              "`documents`): put them in the messages", param="documents")
        if tools and prompt.text == self.render(req, req.messages, req.add_generation_prompt).text:
            # The template does not render tools: tell the model about them in the system
            # message, as vLLM's tool-aware templates would: under "auto" in the parser's own
            # format, else what the functions are (the grammar fixes the answer's form).
            if plan.mode not in self._warned_tools_block:
                self._warned_tools_block.add(plan.mode)
                how = f"in the {plan.parser.name} format" if plan.parser is not None else "what the functions are"
                logger.info("the chat template does not render tools: tool_choice %r describes them in the system "
                            "message, %s (a --chat-template that renders tools takes precedence)", plan.mode, how)
            function = plan.function.model_dump(exclude_none=True) if plan.function is not None else None
            described = plan.parser.tools_system_prompt(tools) if plan.mode == "auto" else \
                forced_tools_system_prompt(tools, function)
            messages = with_system_text(req.messages, described)
            prompt = self.render(req, messages, req.add_generation_prompt, tools)
        else:
            messages = req.messages
        parser = plan.parser or self.tool_parser
        inlined = messages if parser is None else with_calls_as_text(messages, parser)
        if inlined is not messages:
            bare = [m.model_copy(update={"tool_calls": None, "function_call": None}) for m in messages]
            if self.render(req, bare, req.add_generation_prompt, tools).text == prompt.text:  # (ids may be a cut)
                # The template drops past calls: they are written into their turns in the
                # parser's format, else the model would not know what it called.
                prompt = self.render(req, inlined, req.add_generation_prompt, tools)
        return prompt

    def tool_plan(self, req: ChatCompletionRequest) -> ToolPlan:
        mode, function = req.tool_mode()
        if mode == "auto" and self.tool_parser is None:
            raise OpenAIError('"auto" tool choice needs a tool call parser: start the server with '
                              '--tool-call-parser (hermes or llama3_json, the format the model writes calls in)',
                              param="tool_choice")
        return ToolPlan(mode, function, self.tool_parser if mode == "auto" else None,
                        frozenset(t.function.name for t in req.tools or []), req.parallel_tool_calls is False)

    def prepare(self, req: ChatCompletionRequest) -> PreparedRequest:
        model = self.model_name(req.model)
        try:
            req.check_unsupported(self.engine.structured_outputs_backend)
            plan = self.tool_plan(req)
            params = req.to_sampling_params(self.engine.sampling_defaults)
            constraint = self._tool_constraint(req, plan, params.structured_outputs)
            if constraint is not None:
                params.structured_outputs = constraint
                params.validate()
        except InvalidRequestError as e:
            raise self.invalid(req, e) from None
        prompt = self.rendered(req, plan)
        # (from the whole prompt: a cut one keeps no text)
        reasoning = self._reasoning(prompt, params, final_assistant_text(req) if req.continue_final_message else "")
        prompt = self.truncated(prompt, req.truncate_prompt_tokens, req.requested_max_tokens() or 1)
        self.check_length(len(prompt.token_ids), req.requested_max_tokens(), max_tokens_param=req.api_param("max_tokens"))
        return PreparedRequest(model, [prompt], params, plan, reasoning, beam=self.beam_search_params(req, params))

    def _reasoning(self, prompt: TokenizedPrompt, params: SamplingParams, continued: str) -> ReasoningParser | None:
        """The reasoning parser that splits this answer, if any: none when the prompt
        already closed the block (Qwen3's enable_thinking false, a template that ends in
        "</think>", or a continued final message past its block): the answer is all
        content; one that reads the answer as inside the block when the prompt opened it
        (R1's templates, a continued message inside its block), whichever parser was
        chosen.  Under a grammar (structured outputs, a named or required tool call) the
        model first thinks, as in vLLM: the grammar starts after the block's end token,
        or at once where the prompt closed the block.  "auto" tools' structural tag
        leaves free text free, reasoning included.  (`continued`: the final assistant
        message the answer continues, whose tags are the answer's own; a user's text
        quoting a tag says nothing.)"""
        parser, constraint = self.reasoning_parser, params.structured_outputs
        if parser is None:
            return None
        text = (prompt.text or "").rstrip()
        last_end, last_start = continued.rfind(END), continued.rfind(START)
        if text.endswith(END) or last_end > last_start:
            return None  # the block closed in the prompt: all content, constrained from the start
        if text.endswith(START) or last_start > last_end:
            parser = dataclasses.replace(parser, template_opens=True)  # the answer starts inside the block
        tag = constraint.structural_tag if constraint is not None else None
        answer_or_calls = isinstance(tag, dict) and (tag.get("format") or {}).get("type") == "or"
        if constraint is None or tag is not None and not answer_or_calls:
            return parser  # (tools' tags leave free text free: thinking too; a schema answer starts after it)
        end = self.tokenizer.convert_tokens_to_ids(END) if self.tokenizer is not None else None
        if not isinstance(end, int) or end == self.tokenizer.unk_token_id:
            return None  # no single end token to start the grammar on: the answer is all content
        constraint.after_token = end
        return parser

    def _tool_constraint(self, req: ChatCompletionRequest, plan: ToolPlan,
                         answer: StructuredOutputsParams | None = None) -> StructuredOutputsParams | None:
        """The grammar the tools put on the answer: a named or required call's (a response
        format, OpenAI's for text answers, has none to shape in such a turn), or under
        "auto" the parser's structural tag, and beside a response format (`answer`) the
        schema's JSON or calls, as OpenAI lets the model choose."""
        if plan.mode == "named":
            return StructuredOutputsParams(json=tool_parameters(plan.function.parameters))
        if plan.mode == "required":
            defs: dict[str, Any] = {}
            calls = [{"type": "object", "required": ["name", "parameters"],
                      "properties": {"name": {"const": t.function.name},
                                     "parameters": hoist_tool_schema(tool_parameters(t.function.parameters),
                                                                     f"tool{i}", defs)}}
                     for i, t in enumerate(req.tools)]
            schema = {"type": "array", "minItems": 1, "items": {"anyOf": calls}}
            if defs:
                schema["$defs"] = defs
            if req.parallel_tool_calls is False:
                schema["maxItems"] = 1
            return StructuredOutputsParams(json=schema)
        if plan.mode != "auto":
            return None
        tools, one_call = [t.function.model_dump() for t in req.tools], req.parallel_tool_calls is False
        if answer is None:
            tag = plan.parser.structural_tag(tools, one_call)
            return StructuredOutputsParams(structural_tag=tag) if tag is not None else None
        schema = {"type": "object"} if answer.json_object else answer.json
        schema = json.loads(schema) if isinstance(schema, str) else schema
        field_name = req.structured_fields()[0]
        if not isinstance(schema, dict):  # (the answer would follow it and could call no tool: named)
            raise InvalidRequestError(f'tool_choice "auto" takes a JSON schema or json_object {field_name} beside '
                                      f'tools, not a {answer.key[0].replace("_", " ")}', param=field_name)
        spec = plan.parser.answer_or_calls(tools, schema, one_call)
        if spec is None:
            raise InvalidRequestError(f'tool_choice "auto" with {field_name}: the {plan.parser.name} tool-call format '
                                      "and a JSON answer have no one grammar here (use hermes or llama3_json, or "
                                      'tool_choice "required" or "none")', param=field_name)
        return StructuredOutputsParams(**spec)

    def message(self, plan: ToolPlan, c: CompletionOutput) -> tuple[ChatResponseMessage, str | None]:
        """The choice's message and finish_reason."""
        text, calls = plan.calls(c.text, finished=True)
        if not calls:
            return ChatResponseMessage(content=text), c.finish_reason
        tool_calls = [ToolCall(function=FunctionCall(name=call.name, arguments=call.arguments)) for call in calls]
        return ChatResponseMessage(content=text, tool_calls=tool_calls), _calls_finish(c)

    async def full(self, req: ChatCompletionRequest, prep: PreparedRequest, request_id: str,
                   streams: list[RequestStream]) -> ChatCompletionResponse:
        final = None
        async for _, out in merge_streams(streams):
            final = out
        assert final is not None and final.finished
        choices, echo = [], echo_text(req)
        for c in final.outputs:
            if (err := request_failed(c.finish_reason, c.stop_reason)) is not None:
                raise err
            reasoning, c = split_reasoning(prep.reasoning, c)
            message, reason = self.message(prep.tools, c)
            message.content = echo + (message.content or "") if echo else message.content
            if reasoning:  # (none when the model did not think)
                message.content = message.content or None  # (vLLM's: no answer past the thinking is null)
                if req.include_reasoning:
                    message.reasoning = message.reasoning_content = reasoning
            choice = ChatChoice(index=c.index, message=message, logprobs=self.logprobs(c, 0, prep.params.logprobs),
                                finish_reason=reason, stop_reason=c.stop_reason)
            choices.append(legacy_function_call(choice) if req.functions is not None else choice)
        return ChatCompletionResponse(id=request_id, model=prep.model, choices=choices, usage=make_usage([final]),
                                      prompt_logprobs=prompt_logprobs_of(final))

    async def stream(self, req: ChatCompletionRequest, prep: PreparedRequest, request_id: str,
                     streams: list[RequestStream]) -> AsyncIterator[str]:
        model, params = prep.model, prep.params
        created = int(time.time())
        include_usage = self.options.force_include_usage or bool(req.stream_options and req.stream_options.include_usage)
        continuous_usage = bool(req.stream_options and req.stream_options.continuous_usage_stats)
        plan: ToolPlan = prep.tools
        choice_streams = [ChoiceStream() for _ in range(params.n)]
        tool_streams = [ToolStream() for _ in range(params.n)]
        sent_reasoning = [0] * params.n
        final = None

        def chunk(choice: ChatStreamChoice, generated: bool = True) -> str:
            """`generated` False: a chunk before the answer's tokens (its usage counts none)."""
            if req.functions is not None:
                choice = legacy_function_call(choice)
            usage = running_usage({0: final}, prep.prompts, generated) if continuous_usage else None
            return sse(ChatCompletionChunk(id=request_id, created=created, model=model, choices=[choice],
                                           usage=usage))

        def opening() -> list[str]:
            """The role first, then vLLM's chat echo (the final assistant message), sent
            with the first output, as vLLM does: a client (`vllm bench serve` among them)
            times its first token by the first chunk, and a request queued behind a full
            batch had its role chunk at once and its first token seconds later.  Their usage
            is the first output's prompt, its cached tokens known, and no token generated."""
            echo = echo_text(req)
            return [chunk(ChatStreamChoice(index=i, delta=DeltaMessage(role="assistant", content="")), False)
                    for i in range(params.n)] + [
                        chunk(ChatStreamChoice(index=i, delta=DeltaMessage(content=echo)), False)
                        for i in range(params.n) if echo]

        try:
            async for _, out in merge_streams(streams):
                first, final = final is None, out
                if first:
                    for piece in opening():
                        yield piece
                for c in out.outputs:
                    if (err := request_failed(c.finish_reason, c.stop_reason)) is not None:
                        raise err
                    reasoning, c = split_reasoning(prep.reasoning, c)
                    if reasoning is not None and len(reasoning) > sent_reasoning[c.index] and req.include_reasoning:
                        new = reasoning[sent_reasoning[c.index]:]
                        yield chunk(ChatStreamChoice(index=c.index, delta=DeltaMessage(reasoning=new,
                                                                                       reasoning_content=new)))
                        sent_reasoning[c.index] = len(reasoning)
                    if plan.mode != "none":
                        for piece in self._tool_deltas(plan, tool_streams[c.index], c, params.logprobs):
                            yield chunk(piece)
                        continue
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

    async def chunks(self, req: ChatCompletionRequest, prep: PreparedRequest, request_id: str,
                     streams: list[RequestStream], calls_last: bool = False) -> AsyncIterator[dict]:
        """The stream's chunks as dicts (streaming.sse_dicts); `calls_last`: each choice's
        calls come after all its text and reasoning (streaming.calls_after_text), under
        tool_choice auto, and under a named or required one where the model may think first
        (a named call's head was sent at once, while the model was still thinking); else a
        named call's arguments stream as they grow."""
        chunks = sse_dicts(self.stream(req, prep, request_id, streams))
        mode = prep.tools.mode
        if calls_last and mode != "none" and (mode == "auto" or prep.reasoning is not None):
            chunks = calls_after_text(chunks)
        async for chunk in chunks:
            yield chunk

    def _tool_deltas(self, plan: ToolPlan, ts: ToolStream, c: CompletionOutput,
                     k: int | None = None) -> list[ChatStreamChoice]:
        """The chunks a tool-enabled choice owes after this output: plain text that can
        no longer start a call, calls whose arguments are complete (a named call's
        arguments as they grow), and the finish_reason once done (once: a finished choice
        of several stays in the outputs while the others go on)."""
        if ts.finished:
            return []
        finished = ts.finished = c.finish_reason is not None
        pieces: list[DeltaMessage] = []
        if plan.mode == "named":
            if not ts.call_ids:
                ts.call_ids.append(random_id("call"))
                pieces.append(DeltaMessage(tool_calls=[DeltaToolCall(
                    index=0, id=ts.call_ids[0], type="function",
                    function=DeltaFunctionCall(name=plan.function.name, arguments=""))]))
            if len(c.text) > ts.sent_args:
                pieces.append(DeltaMessage(tool_calls=[DeltaToolCall(
                    index=0, function=DeltaFunctionCall(arguments=c.text[ts.sent_args:]))]))
                ts.sent_args = len(c.text)
            reason = _calls_finish(c)
        else:
            text, calls = plan.calls(c.text, finished, ts.cursor)
            if plan.mode == "auto" and not calls and not finished:  # no call yet: the part that cannot open one
                text = c.text[:plan.parser.text_before_calls(c.text)]
            if text and len(text) > ts.sent_text:
                pieces.append(DeltaMessage(content=text[ts.sent_text:]))
                ts.sent_text = len(text)
            for i, call in enumerate(calls[ts.sent_calls:], start=ts.sent_calls):
                pieces.append(DeltaMessage(tool_calls=[DeltaToolCall(
                    index=i, id=random_id("call"), type="function",
                    function=DeltaFunctionCall(name=call.name, arguments=call.arguments))]))
            ts.sent_calls = max(ts.sent_calls, len(calls))  # (a call sent is never sent again)
            reason = _calls_finish(c) if calls else c.finish_reason
        choices = [ChatStreamChoice(index=c.index, delta=d) for d in pieces]
        if finished:
            choices.append(ChatStreamChoice(index=c.index, delta=DeltaMessage(), finish_reason=reason,
                                            stop_reason=c.stop_reason))
        if k is not None and len(c.token_ids) > ts.sent_tokens:  # the new tokens' logprobs, as without tools
            choices = choices or [ChatStreamChoice(index=c.index, delta=DeltaMessage())]
            choices[0].logprobs = self.logprobs(c, ts.sent_tokens, k)
            ts.sent_tokens = len(c.token_ids)
        return choices

    def logprobs(self, c: CompletionOutput, start: int, k: int | None,
                 end: int | None = None) -> ChatLogprobs | None:
        if k is None or c.logprobs is None:
            return None
        content = []
        for s, raw, token_lp, top in self.logprob_steps(c, start, len(c.token_ids) if end is None else end, k):
            content.append(ChatLogprobToken(
                token=s, logprob=_MISSING if token_lp is None else token_lp, bytes=list(raw),
                top_logprobs=[TopLogprob(token=t, logprob=lp, bytes=list(b)) for t, b, lp in top]))
        return ChatLogprobs(content=content)


def _calls_finish(c: CompletionOutput) -> str | None:
    """A choice with calls finishes "tool_calls" where the model ended them (its end token or
    the grammar's end); a client's stop string that cut one leaves "stop": its arguments may
    not parse, and "tool_calls" tells a client they do."""
    return "tool_calls" if c.finish_reason == "stop" and not isinstance(c.stop_reason, str) else c.finish_reason


def legacy_function_call(choice: C) -> C:
    """A choice in the shape of OpenAI's deprecated functions API: the call (one at most:
    ChatCompletionRequest asks for one) as message.function_call, or the delta's
    function_call, and finish_reason "function_call"."""
    if isinstance(choice, ChatChoice):
        if choice.message.tool_calls:
            choice.message.function_call = choice.message.tool_calls[0].function
            choice.message.tool_calls = []
    elif choice.delta.tool_calls:
        choice.delta.function_call = choice.delta.tool_calls[0].function
        choice.delta.tool_calls = None
    if choice.finish_reason == "tool_calls":
        choice.finish_reason = "function_call"
    return choice


def hoist_tool_schema(schema: Any, name: str, defs: dict[str, Any]) -> Any:
    """A tool's parameter schema placed inside the "required" mode's array schema: its
    local references (`#`, `#/$defs/X`, `#/definitions/X`, any `#/...` pointer) meant its
    own document, and would resolve against the array's.  Its definitions move to the
    root's `$defs` under `name`'s prefix (and the schema itself as `name` when something
    points at it), with every reference rewritten to match."""
    refs: list[str] = []

    def rewrite(node: Any) -> Any:
        if isinstance(node, list):
            return [rewrite(v) for v in node]
        if not isinstance(node, dict):
            return node
        out = {k: rewrite(v) for k, v in node.items() if k not in ("$defs", "definitions") or node is not schema}
        ref = node.get("$ref")
        if isinstance(ref, str) and (ref == "#" or ref.startswith("#/")):
            out["$ref"] = _hoisted_ref(ref, name)
            refs.append(ref)
        return out

    if not isinstance(schema, dict):
        return schema
    hoisted = rewrite(schema)
    for key in ("$defs", "definitions"):
        local = schema.get(key)
        if isinstance(local, dict):
            defs.update({f"{name}_{k}": rewrite(v) for k, v in local.items()})
    if any(not r.startswith(("#/$defs/", "#/definitions/")) for r in refs):
        defs[name] = hoisted  # something points into the schema itself
    return hoisted


def _hoisted_ref(ref: str, name: str) -> str:
    for prefix in ("#/$defs/", "#/definitions/"):
        if ref.startswith(prefix):
            return f"#/$defs/{name}_{ref[len(prefix):]}"
    return f"#/$defs/{name}{ref[1:]}"
