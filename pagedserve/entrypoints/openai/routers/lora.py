"""vLLM's runtime LoRA routes: load and unload an adapter by name while the server runs
(`--allow-runtime-lora-updating`; LoRAAdapters refuses them otherwise).  The answers
are plain text, as vLLM's are."""

from __future__ import annotations

from fastapi import APIRouter, Depends
from fastapi.responses import PlainTextResponse

from pagedserve.entrypoints.openai.protocol import OpenAIBaseModel
from pagedserve.entrypoints.openai.server_state import ServerStateDep


def _allowed(state: ServerStateDep) -> None:
    """Checked before the body is read: a server without runtime updating answers 404 to any body."""
    state.lora_adapters.check_allowed()


router = APIRouter(dependencies=[Depends(_allowed)])


class LoadLoRAAdapterRequest(OpenAIBaseModel):
    """vLLM's POST /v1/load_lora_adapter body; `load_inplace` replaces an adapter of that
    name (requests running with the old one finish with it); `base_model_name`, when
    given, must be a name of the model adapters belong to here (the one served)."""

    lora_name: str
    lora_path: str
    load_inplace: bool = False
    base_model_name: str | None = None


class UnloadLoRAAdapterRequest(OpenAIBaseModel):
    """vLLM's POST /v1/unload_lora_adapter body (the adapter is found by name)."""

    lora_name: str
    lora_int_id: int | None = None


@router.post("/v1/load_lora_adapter")
async def load_lora_adapter(body: LoadLoRAAdapterRequest, state: ServerStateDep) -> PlainTextResponse:
    """Load a PEFT adapter from the server's disk (--allow-runtime-lora-updating)."""
    lease = await state.lease(None)  # adapters belong to the first model
    try:
        return PlainTextResponse(await state.lora_adapters.load(lease.handlers.engine, state.models.names(),
                                                                body.lora_name, body.lora_path,
                                                                body.load_inplace, body.base_model_name))
    finally:
        lease.release()


@router.post("/v1/unload_lora_adapter")
async def unload_lora_adapter(body: UnloadLoRAAdapterRequest, state: ServerStateDep) -> PlainTextResponse:
    lease = await state.lease(None)
    try:
        return PlainTextResponse(await state.lora_adapters.unload(lease.handlers.engine, body.lora_name,
                                                                  body.lora_int_id))
    finally:
        lease.release()
