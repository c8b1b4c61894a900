"""vLLM's /tokenize and /detokenize: the served model's tokenizer (and chat template)
as the engine would apply them, so a client can count a prompt's tokens before it
sends it."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from pydantic import ValidationError

from pagedserve.engine.chat_utils import messages_hold_image
from pagedserve.entrypoints.openai.exception_handlers import first_error
from pagedserve.entrypoints.openai.protocol import ChatCompletionRequest, ChatMessage, RequestBody
from pagedserve.entrypoints.openai.protocol_fields import refuse_unsupported_fields, refuse_vllm_fields
from pagedserve.entrypoints.openai.server_state import ServerStateDep
from pagedserve.entrypoints.openai.serving_engine import OpenAIError
from pagedserve.errors import InvalidRequestError

router = APIRouter()
# The fields that shape a chat's rendering: with messages only.
CHAT_FIELDS = ("add_generation_prompt", "continue_final_message", "chat_template", "chat_template_kwargs", "tools",
               "tool_choice", "documents")


def check_extras(body: RequestBody) -> None:
    """OpenAI's and vLLM's fields these routes were sent and do not do, refused by name as
    chat refuses them (they were dropped without a word)."""
    try:
        refuse_unsupported_fields(body.model_extra)
        refuse_vllm_fields(body.model_extra)
    except InvalidRequestError as e:
        raise OpenAIError(str(e), param=e.param) from None


class TokenizeRequest(RequestBody):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    return_token_strs: bool = False  # vLLM's: each token's vocabulary string too ("token_strs")
    # With messages, chat's rendering fields: the prompt counted is the one chat would run.
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    documents: list[dict[str, str]] | None = None

    def brings_chat_template(self) -> bool:
        return bool(self.chat_template)

    def image_field(self) -> str | None:
        return "messages" if messages_hold_image(self.messages) else None

    def chat_request(self) -> ChatCompletionRequest:
        """The chat request whose prompt these messages make (its checks included; its
        add_special_tokens when sent: chat's default is false)."""
        body = {"messages": [m.model_dump(exclude_unset=True) for m in self.messages or []],
                **{f: getattr(self, f) for f in (*CHAT_FIELDS, "add_special_tokens") if f in self.model_fields_set}}
        try:
            return ChatCompletionRequest.model_validate(body)
        except ValidationError as e:
            raise first_error(e.errors()) from None

    def check_prompt_fields(self) -> None:
        """A prompt is tokenized as it is: the chat fields are refused with it, not dropped."""
        for name in CHAT_FIELDS:
            if name in self.model_fields_set:
                raise OpenAIError(f"{name} applies to messages, not to a prompt", param=name)


class DetokenizeRequest(RequestBody):
    model: str | None = None
    tokens: list[int]


@router.post("/tokenize")
async def tokenize(body: TokenizeRequest, request: Request, state: ServerStateDep) -> dict:
    if (body.prompt is None) == (body.messages is None):
        raise OpenAIError("send exactly one of prompt or messages")
    conversation = "messages" if body.messages is not None and body.chat_template is None else None
    # (the chat handler holds the model's tokenizer; what refuses a chat or an image, before a load)
    lease = await state.lease(body.model, chat=conversation, client=request, images=body.image_field())
    try:
        chat = lease.handlers.chat
        chat.warn_unknown_fields(body)
        check_extras(body)
        if body.prompt is not None:
            body.check_prompt_fields()
        if body.messages is not None:
            ids = (await state.prepare.run_for(body, chat.rendered, body.chat_request())).token_ids
        else:
            ids = await state.prepare.run(chat.tokenize, body.prompt, body.add_special_tokens)
        out = {"count": len(ids), "max_model_len": lease.handlers.max_model_len, "tokens": ids}
        if body.return_token_strs and chat.tokenizer is not None:
            out["token_strs"] = chat.tokenizer.convert_ids_to_tokens(ids)
        return out
    finally:
        lease.release()


@router.post("/detokenize")
async def detokenize(body: DetokenizeRequest, request: Request, state: ServerStateDep) -> dict:
    lease = await state.lease(body.model, client=request)
    try:
        chat = lease.handlers.chat
        chat.warn_unknown_fields(body)
        check_extras(body)  # (the list's length is the body's bound: /tokenize gives longer lists than the context)
        vocab = lease.handlers.engine.vocab_size
        bad = [t for t in body.tokens if not 0 <= t < vocab]
        if bad:
            raise OpenAIError(f"token id {bad[0]} is outside the vocabulary (0..{vocab - 1})", param="tokens")
        text = await state.prepare.run(chat.tokenizer.decode, body.tokens) if chat.tokenizer is not None else ""
        return {"prompt": text}
    finally:
        lease.release()
