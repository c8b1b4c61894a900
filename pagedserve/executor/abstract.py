"""The contract between LLMEngine and whatever runs the model.

`ModelRunner` (one process), `MultiprocExecutor` (tensor parallel) and the tests'
fakes all satisfy `ModelExecutor`; the engine types its collaborator by it instead of
probing for methods, so a missing method is a type error at the seam rather than a
silent change of behaviour.
"""

from __future__ import annotations

from typing import Protocol

import torch

from pagedserve.core.kv_tier import KVTier
from pagedserve.core.sched_output import GrammarBitmask, SchedulerOutput
from pagedserve.lora.request import LoRARequest
from pagedserve.worker.runner_output import ModelRunnerOutput


class PendingModelOutput(Protocol):
    """A launched step whose sampled tokens may still be on their way to the host."""

    def sample(self, grammar: GrammarBitmask) -> None:
        """A step launched with constrained requests but no grammar mask (overlap
        scheduling: the mask needs the previous step's tokens) samples once given it."""
        ...

    def get_output(self) -> ModelRunnerOutput: ...


class ModelExecutor(Protocol):
    # Where the model runs (decides defaults such as overlap scheduling).
    device: torch.device
    # Whether execute_model_async may be called (overlap scheduling).
    supports_async_scheduling: bool
    # The KV tier beneath the block pool, when configured (its bytes move in the
    # executor; the KV-cache manager decides what moves).
    kv_tier: KVTier | None

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        """Run one step and return its sampled tokens."""
        ...

    def execute_model_async(self, scheduler_output: SchedulerOutput) -> PendingModelOutput:
        """Launch one step and return at once; the step may run one token past what the
        host knows, provided the previous step launched here sampled that token."""
        ...

    def add_lora(self, lora_request: LoRARequest) -> None:
        """Load and check a LoRA adapter now, between steps (ValueError naming what is
        wrong with it), so the step that first runs it reads no files."""
        ...

    def remove_lora(self, lora_id: int) -> bool:
        """Forget an adapter; False when it was not loaded."""
        ...

    def describe(self) -> dict[str, str]:
        """What runs the model, for people (the dashboard's configuration panel):
        the attention backend, whether the model is compiled, and so on."""
        ...

    def check_health(self) -> None:
        """Raise if no further step can run (a tensor-parallel worker died), so that an
        idle server stops answering /health with 200 on an engine that cannot step."""
        ...

    def shutdown(self) -> None:
        """Release processes and devices (idempotent)."""
        ...
