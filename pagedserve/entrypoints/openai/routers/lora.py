"""vLLM's runtime LoRA routes: load and unload an adapter by name while the server runs
(`--allow-runtime-lora-updating`; LoRAAdapters refuses them otherwise).  The answers
are plain text, as vLLM's are."""

from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import PlainTextResponse

from pagedserve.entrypoints.openai.protocol import LoadLoRAAdapterRequest, UnloadLoRAAdapterRequest
from pagedserve.entrypoints.openai.server_state import ServerStateDep

router = APIRouter()


@router.post("/v1/load_lora_adapter")
async def load_lora_adapter(body: LoadLoRAAdapterRequest, state: ServerStateDep) -> PlainTextResponse:
    """Load a PEFT adapter from the server's disk (--allow-runtime-lora-updating)."""
    engine = state.ready()
    return PlainTextResponse(await state.lora_adapters.load(engine, state.served_model_names, body.lora_name,
                                                            body.lora_path))


@router.post("/v1/unload_lora_adapter")
async def unload_lora_adapter(body: UnloadLoRAAdapterRequest, state: ServerStateDep) -> PlainTextResponse:
    engine = state.ready()
    return PlainTextResponse(await state.lora_adapters.unload(engine, body.lora_name))
