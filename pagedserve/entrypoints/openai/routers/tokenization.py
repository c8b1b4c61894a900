"""vLLM's /tokenize and /detokenize: the served model's tokenizer (and chat template)
as the engine would apply them, so a client can count a prompt's tokens before it
sends it."""

from __future__ import annotations

from fastapi import APIRouter

from pagedserve.entrypoints.openai.protocol import DetokenizeRequest, TokenizeRequest
from pagedserve.entrypoints.openai.server_state import ServerStateDep
from pagedserve.entrypoints.openai.serving_engine import OpenAIError

router = APIRouter()


@router.post("/tokenize")
async def tokenize(body: TokenizeRequest, state: ServerStateDep) -> dict:
    if (body.prompt is None) == (body.messages is None):
        raise OpenAIError("send exactly one of prompt or messages")
    lease = await state.lease(body.model)  # the chat handler holds the model's tokenizer
    try:
        chat = lease.handlers.chat
        if body.messages is not None:
            ids = (await state.prepare.run(chat.render, None, body.messages, body.add_generation_prompt)).token_ids
        else:
            ids = await state.prepare.run(chat.tokenize, body.prompt, body.add_special_tokens)
        return {"count": len(ids), "max_model_len": lease.handlers.max_model_len, "tokens": ids}
    finally:
        lease.release()


@router.post("/detokenize")
async def detokenize(body: DetokenizeRequest, state: ServerStateDep) -> dict:
    lease = await state.lease(body.model)
    try:
        chat, max_model_len = lease.handlers.chat, lease.handlers.max_model_len
        if len(body.tokens) > max_model_len:
            raise OpenAIError(f"{len(body.tokens)} tokens is more than max_model_len ({max_model_len})",
                              param="tokens")
        vocab = lease.handlers.engine.vocab_size
        bad = [t for t in body.tokens if not 0 <= t < vocab]
        if bad:
            raise OpenAIError(f"token id {bad[0]} is outside the vocabulary (0..{vocab - 1})", param="tokens")
        text = await state.prepare.run(chat.tokenizer.decode, body.tokens) if chat.tokenizer is not None else ""
        return {"prompt": text}
    finally:
        lease.release()
