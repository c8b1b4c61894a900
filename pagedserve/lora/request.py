"""LoRARequest: which adapter a request runs with (vLLM's names and argument order).

Plain data that crosses into core/ (the scheduler counts adapters per step, the block
hash keys on the adapter) and, under tensor parallelism, into worker processes.
"""

from __future__ import annotations

from dataclasses import dataclass

from pagedserve.utils import is_int


@dataclass(frozen=True)
class LoRARequest:
    """`lora_name`: what clients call it (the server's `model` field); `lora_int_id`: a
    positive integer unique per adapter (0 is the base model); `lora_path`: a PEFT
    directory (adapter_config.json + adapter_model.safetensors) on the server's disk;
    `base_model_name`: the model it was trained on, as /v1/models reports its parent."""

    lora_name: str
    lora_int_id: int
    lora_path: str
    base_model_name: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.lora_name, str) or not self.lora_name:
            raise ValueError(f"LoRARequest.lora_name must be a non-empty string, got {self.lora_name!r}")
        if not is_int(self.lora_int_id) or self.lora_int_id < 1:
            raise ValueError(f"LoRARequest.lora_int_id must be a positive integer (0 is the base model), "
                             f"got {self.lora_int_id!r}")
        if not isinstance(self.lora_path, str) or not self.lora_path:
            raise ValueError(f"LoRARequest.lora_path must be a directory path, got {self.lora_path!r}")

    @property
    def cache_key(self) -> tuple[int, str, str]:
        """What keys the KV blocks computed under this adapter (Request.hash_salt) and the
        files it was first read from (EngineCore): an id freed and given to another
        adapter is another key."""
        return self.lora_int_id, self.lora_name, self.lora_path
