"""EngineClient: what the OpenAI layer needs of its front end, `AsyncLLM` (the one there
is, over one engine in this process or data-parallel replicas alike); typed here so the
route handlers and their tests depend on this surface alone, not on AsyncLLM's module."""

from __future__ import annotations

from typing import Any, Protocol

from pagedserve.engine.async_llm import RequestStream
from pagedserve.lora.request import LoRARequest
from pagedserve.pooling_params import PoolingParams
from pagedserve.sampling_params import SamplingParams


class EngineClient(Protocol):
    tokenizer: Any
    vocab_size: int
    max_prompt_chars: int  # longer prompt text cannot fit in max_model_len tokens: refused untokenized
    sampling_defaults: dict[str, Any]  # the model's generation-config defaults for unset request fields
    structured_outputs_backend: str  # the grammar library ("guidance" or "xgrammar")
    request_timeout: float | None
    runner: str  # "generate", or "pooling" (embeddings and scores)
    classifier_token_ids: tuple[int, int] | None  # the pooling runner's scorer tokens, if any
    chat_template: str | None  # the model's own; None: a base model
    stop_token_ids: tuple[int, ...]  # the tokens that end an answer (beam search ends beams at them)
    max_logprobs: int  # the most top logprobs a request may ask for

    @property
    def errored(self) -> bool:
        """Failed for good: the server exits so a supervisor restarts it."""

    @property
    def serving(self) -> bool:
        """Can take a request now."""

    @property
    def num_open_requests(self) -> int: ...

    def start(self) -> None: ...

    async def add_request(self, request_id: str, prompt: Any, sampling_params: SamplingParams | PoolingParams,
                          priority: int = 0, final_only: bool = False,
                          lora_request: LoRARequest | None = None, admitted: bool = False,
                          group: str | None = None, deadline: float | None = None,
                          arrival_time: float | None = None) -> RequestStream: ...

    async def add_lora(self, lora_request: LoRARequest) -> bool:
        """Load and check a LoRA adapter (False: it was loaded); ValueError names the problem."""

    async def remove_lora(self, lora_id: int) -> bool: ...

    def encode_chat(self, messages: list[dict], chat_template: str | None = None,
                    add_generation_prompt: bool = True, **kwargs: Any) -> dict[str, Any]: ...

    def close_admission(self, error: BaseException) -> None: ...

    def abort_all(self, error: BaseException) -> None: ...

    def shutdown(self) -> None: ...
