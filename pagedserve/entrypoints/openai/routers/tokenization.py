"""vLLM's /tokenize and /detokenize: the served model's tokenizer (and chat template)
as the engine would apply them, so a client can count a prompt's tokens before it
sends it."""

from __future__ import annotations

from fastapi import APIRouter

from pagedserve.entrypoints.openai.protocol import DetokenizeRequest, TokenizeRequest
from pagedserve.entrypoints.openai.server_state import ServerState, ServerStateDep
from pagedserve.entrypoints.openai.serving_chat import OpenAIServingChat
from pagedserve.entrypoints.openai.serving_engine import OpenAIError

router = APIRouter()


def tokenizing(state: ServerState, body: TokenizeRequest | DetokenizeRequest) -> OpenAIServingChat:
    """The chat handler (it holds the tokenizer), once the model named is known."""
    state.ready()
    if body.model is not None:
        state.chat.model_name(body.model)
    return state.chat


@router.post("/tokenize")
async def tokenize(body: TokenizeRequest, state: ServerStateDep) -> dict:
    chat = tokenizing(state, body)
    if (body.prompt is None) == (body.messages is None):
        raise OpenAIError("send exactly one of prompt or messages")
    if body.messages is not None:
        ids = (await state.prepare.run(chat.render, None, body.messages, body.add_generation_prompt)).token_ids
    else:
        ids = await state.prepare.run(chat.tokenize, body.prompt, body.add_special_tokens)
    return {"count": len(ids), "max_model_len": state.max_model_len, "tokens": ids}


@router.post("/detokenize")
async def detokenize(body: DetokenizeRequest, state: ServerStateDep) -> dict:
    chat = tokenizing(state, body)
    if len(body.tokens) > state.max_model_len:
        raise OpenAIError(f"{len(body.tokens)} tokens is more than max_model_len ({state.max_model_len})",
                          param="tokens")
    vocab = state.engine.vocab_size
    bad = [t for t in body.tokens if not 0 <= t < vocab]
    if bad:
        raise OpenAIError(f"token id {bad[0]} is outside the vocabulary (0..{vocab - 1})", param="tokens")
    text = await state.prepare.run(chat.tokenizer.decode, body.tokens) if chat.tokenizer is not None else ""
    return {"prompt": text}
