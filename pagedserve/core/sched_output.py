"""What one scheduling step decided, in the shape the model runner consumes.

The runner keeps persistent per-request state (token ids, block table rows), so a
request is described in full once (`NewRequestData`) and afterwards only by what
changed (`CachedRequestData`).  Plain data only: this crosses into worker/ and,
with tensor parallelism, into other processes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from pagedserve.core.kv_tier import KVTransfers
from pagedserve.lora.request import LoRARequest
from pagedserve.pooling_params import PoolingParams
from pagedserve.sampling_params import SamplingParams


@dataclass
class NewRequestData:
    """A request the runner has not seen since it was (re)admitted."""

    req_id: str
    prompt_token_ids: list[int]
    # Tokens generated before a preemption; recomputed like prompt tokens.
    output_token_ids: list[int]
    sampling_params: SamplingParams
    block_ids: list[int]
    num_computed_tokens: int
    pooling_params: PoolingParams | None = None  # a pooling request: the runner pools, never samples
    lora_request: LoRARequest | None = None  # its adapter (None: the base model)
    # Its prompt's images (multimodal/inputs.py's ImageFeature: spans and the encoder's
    # inputs) and, for M-RoPE models, its positions (Request.mrope); opaque here.
    images: Sequence[Any] = ()
    mrope: Any = None
    long_rope: bool = False  # LongRoPE's long factors at every position (Request.long_rope)


@dataclass
class CachedRequestData:
    """Deltas for requests the runner already holds (struct of lists, as in vLLM v1)."""

    req_ids: list[str] = field(default_factory=list)
    # Output tokens appended since the request was last scheduled.
    new_token_ids: list[list[int]] = field(default_factory=list)
    new_block_ids: list[list[int]] = field(default_factory=list)
    num_computed_tokens: list[int] = field(default_factory=list)

    @property
    def num_reqs(self) -> int:
        return len(self.req_ids)


@dataclass
class GrammarBitmask:
    """The allowed next tokens of the constrained requests of one step: row `rows[i]` of
    the sampled rows gets `bitmask[rows[i]]` (int32, one bit per vocabulary token: a
    torch tensor filled by structured_output/; core only carries it)."""

    rows: list[int]
    bitmask: Any
    vocab_size: int


@dataclass
class SchedulerOutput:
    scheduled_new_reqs: list[NewRequestData]
    scheduled_cached_reqs: CachedRequestData
    num_scheduled_tokens: dict[str, int]
    total_num_scheduled_tokens: int
    preempted_req_ids: set[str]
    # Finished or aborted since the previous step: the runner drops their state.
    finished_req_ids: set[str]
    # Overlap scheduling: the step's number, so results are matched to it (-1 otherwise).
    step_id: int = -1
    # Constrained requests that sample this step -> their row among the sampled requests
    # (requests whose known tokens are all computed after the step, in this order).
    structured_output_rows: dict[str, int] = field(default_factory=dict)
    # Their bitmask: filled by the engine before the step runs (or, with overlap
    # scheduling, handed to the launched step once the previous step's tokens are in).
    grammar_bitmask: GrammarBitmask | None = None
    # Speculative decoding: the draft tokens scheduled (and given KV slots) after each
    # decoding request's last known token; the runner verifies them (vLLM's name).
    scheduled_spec_decode_tokens: dict[str, list[int]] = field(default_factory=dict)
    # Block copies between the pool and the KV tier (core/kv_tier.py); None: none.
    kv_transfers: KVTransfers | None = None
    # Encoder outputs (by image identifier) the runner drops before this step
    # (core/encoder_cache_manager.py).
    free_encoder_ids: list[str] = field(default_factory=list)

    @property
    def is_empty(self) -> bool:
        return self.total_num_scheduled_tokens == 0


@dataclass
class EngineCoreOutput:
    """Per-request result of `Scheduler.update_from_output`."""

    request_id: str
    new_token_ids: list[int]
    finished: bool = False
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    stop_reason: int | str | None = None  # the stop token id (or stop string, set by the engine)
    num_cached_tokens: int = 0
    # A finished pooling request's result (the runner's float32 tensor; core only carries it).
    pooling_output: Any = None
    # A request with a predicted output: OpenAI's (accepted, rejected) prediction tokens so
    # far, and per token of the output's last ones (this step's, and those it re-marked)
    # whether it matched a prediction token (a stop string cutting it off moves it to
    # rejected: output_processor).
    prediction_counts: tuple[int, int] | None = None
    predicted: bytes = b""
