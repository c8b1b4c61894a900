"""The scheduler's view of one sequence: its tokens, how far its KV is computed, its state.

There are no prefill and decode phases: a request is just `num_tokens` tokens of
which `num_computed_tokens` already have KV in the cache, and every step tries to
close the gap.  Preemption resets `num_computed_tokens` to 0 but keeps the output
tokens, so a resumed request simply has a longer "prompt" to recompute.
"""

from __future__ import annotations

import enum
import time
from array import array
from collections.abc import Sequence
from typing import Any, Protocol

from pagedserve.core.kv_cache_utils import ImageSpan
from pagedserve.core.prediction_drafter import PredictionDrafter
from pagedserve.errors import CONTEXT_LENGTH_ERROR, PromptTooLongError
from pagedserve.lora.request import LoRARequest
from pagedserve.pooling_params import PoolingParams
from pagedserve.sampling_params import SamplingParams
from pagedserve.utils import is_int, is_number


class RequestStatus(enum.IntEnum):
    WAITING = enum.auto()
    WAITING_FOR_FSM = enum.auto()  # its grammar is still compiling: the scheduler skips it
    RUNNING = enum.auto()
    PREEMPTED = enum.auto()
    # Everything after PREEMPTED is a finished state (see is_finished).
    FINISHED_STOPPED = enum.auto()
    FINISHED_LENGTH_CAPPED = enum.auto()
    FINISHED_ABORTED = enum.auto()
    # The model's logits for it were not a distribution (NaN/inf): it fails alone.
    FINISHED_ERROR = enum.auto()

    @staticmethod
    def is_finished(status: RequestStatus) -> bool:
        return status > RequestStatus.PREEMPTED

    @staticmethod
    def get_finished_reason(status: RequestStatus) -> str | None:
        return _FINISH_REASONS.get(status)


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH_CAPPED: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    RequestStatus.FINISHED_ERROR: "error",
}


class GrammarState(Protocol):
    """What the scheduler needs of a request's grammar (structured_output/ implements it)."""

    error: str | None  # why it failed to compile, once is_ready() says it is done
    refusal: str | None  # the library's reason, once accept_token has refused a token (None: it gave none)

    def is_ready(self) -> bool:
        """Compiled, or failed; never blocks."""
        ...

    def accept_token(self, token_id: int) -> bool:
        """Advance over a sampled token; False if the grammar forbids it."""
        ...

    def is_terminated(self) -> bool:
        """The grammar has reached its end: nothing more may follow."""
        ...


class Request:
    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams | None = None,
        eos_token_id: int | None = None,
        arrival_time: float | None = None,
        priority: int = 0,
        cache_salt: str | None = None,
        grammar: GrammarState | None = None,
        pooling_params: PoolingParams | None = None,
        lora_request: LoRARequest | None = None,
        prediction_token_ids: list[int] | None = None,
        images: Sequence[ImageSpan] = (),
        mrope: Any = None,
        long_rope: bool = False,
    ) -> None:
        if not isinstance(request_id, str):
            raise ValueError(f"request_id must be a str, got {type(request_id).__name__}")
        try:
            # array() checks every id is an integer in C; tolist() normalises numpy ints.
            packed = array("q", prompt_token_ids)
        except (TypeError, OverflowError):
            raise ValueError(f"request {request_id!r}: prompt_token_ids must be a list of integers") from None
        if not packed:
            raise ValueError(f"request {request_id!r}: prompt_token_ids must not be empty")
        if min(packed) < 0:
            raise ValueError(f"request {request_id!r}: prompt_token_ids must be non-negative")
        prompt_token_ids = packed.tolist()
        if not is_int(priority):
            raise ValueError(f"request {request_id!r}: priority must be an integer, got {priority!r}")
        self.request_id = request_id
        self.prompt_token_ids = prompt_token_ids
        self.sampling_params = sampling_params if sampling_params is not None else SamplingParams()
        self.eos_token_id = eos_token_id
        if arrival_time is not None and not is_number(arrival_time):
            raise ValueError(f"request {request_id!r}: arrival_time must be a number, got {arrival_time!r}")
        self.arrival_time = time.time() if arrival_time is None else arrival_time
        self.priority = priority
        self.cache_salt = cache_salt
        # A LongRoPE prompt longer than the original context: all its positions rotate
        # with the long factors (layers/rotary_embedding.py), so its KV is its own.
        self.long_rope = long_rope
        self.lora_request = lora_request  # the adapter it runs with (None: the base model)
        # Structured output: the grammar the sampled tokens must follow (None: free text).
        self.grammar = grammar
        # A pooling request (pooling_params.py): its prompt is computed, nothing is sampled.
        self.pooling_params = pooling_params

        self.status = RequestStatus.WAITING
        self.num_computed_tokens = 0
        self.num_preemptions = 0
        # Prefix-cache hit (tokens) of the first admission, as reported to the user.
        self.num_cached_tokens = 0
        self.stop_reason: int | str | None = None
        self.num_prompt_tokens = len(prompt_token_ids)
        # Read freely (the scheduler does, every step, without copies); append only
        # through append_output_token_id(s), which keeps the two lists in step.
        self.output_token_ids: list[int] = []
        self.all_token_ids: list[int] = list(prompt_token_ids)
        # Chain of full-block hashes, extended by the KVCacheManager as blocks fill.
        self.block_hashes: list[int] = []

        params = self.sampling_params
        self.max_tokens = params.max_tokens  # None: bounded only by max_model_len
        self.min_tokens = params.min_tokens
        self.stop_token_ids = frozenset(params.stop_token_ids or ())
        self.eos_for_stop = None if params.ignore_eos else eos_token_id
        # Every token id that ends the request, so one set lookup per sampled token decides.
        self.finish_token_ids = self.stop_token_ids | ({self.eos_for_stop} - {None})
        # Length at which the request is capped; the scheduler lowers it to max_model_len.
        self.max_num_tokens = self.num_prompt_tokens + self.max_tokens if self.max_tokens else 1 << 62
        # How many output tokens the model runner already holds (see Scheduler).
        self.num_output_tokens_sent = 0
        # Async scheduling: tokens sampled by in-flight steps, not yet known to the host.
        # Scheduling counts them (the runner reads them on the device); outputs do not.
        self.num_output_placeholders = 0
        # Async scheduling: the first and the latest step (SchedulerOutput.step_id) that
        # scheduled this request; -1 before any.
        self.first_scheduled_step = -1
        self.last_scheduled_step = -1
        # Speculative decoding: most drafts the proposer may give it next step (adapted to
        # how many were accepted; set by the scheduler when speculation is on).
        self.max_draft_tokens = 0
        # A predicted output (OpenAI's `prediction`, tokenized): the request's own draft
        # source, whatever the engine's speculative decoding (core/prediction_drafter.py).
        self.prediction = PredictionDrafter(prediction_token_ids) if prediction_token_ids is not None else None
        # The prompt's images (multimodal/inputs.py's ImageFeature, opaque here beyond their
        # spans), in position order: their identifiers key the blocks that hold them, and
        # the model runner takes them with the request.
        self.images = tuple(images)
        self.mrope = mrope  # an M-RoPE model's positions for it (the runner's; opaque here)
        for image in self.images:
            if image.offset < 0 or image.length < 1 or image.offset + image.length > len(prompt_token_ids):
                raise ValueError(f"request {request_id!r}: an image span [{image.offset}, "
                                 f"{image.offset + image.length}) lies outside the prompt")
        # Order under the priority policy; the scheduler fills in the tie-breaking sequence.
        self.sched_key: tuple[int, float, int] = (priority, self.arrival_time, 0)

    @property
    def hash_salt(self) -> str | tuple[Any, ...] | None:
        """What keys this request's KV blocks besides its tokens: the client's salt, and the
        LoRA adapter (two adapters' KV for the same tokens differ) by its id, name and path
        (an id freed and given to another adapter served that one the first one's blocks),
        and LongRoPE's long factors (long_rope), as tuples that no client salt string can equal."""
        lora = self.lora_request
        salt = self.cache_salt if lora is None else (self.cache_salt, *lora.cache_key)
        return ("long_rope", salt) if self.long_rope else salt

    def image_free_until(self, start: int) -> int:
        """The first position at or after `start` that belongs to an image (the number of
        tokens when none does): token-matched prefix reuse (the radix tree's partial
        blocks) must stop there, since equal placeholder tokens may hold different images."""
        for image in self.images:
            if image.offset + image.length > start:
                return max(start, image.offset)
        return self.num_tokens

    @property
    def needs_every_prompt_state(self) -> bool:
        """Every prompt position must be computed (a prefix-cache hit would skip some):
        prompt logprobs score each one, and MEAN/CLS pooling read them."""
        return self.sampling_params.prompt_logprobs is not None or (
            self.pooling_params is not None and self.pooling_params.needs_every_state)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_tokens_to_compute(self) -> int:
        """Known tokens (and, under overlap scheduling, in-flight placeholders) without KV
        yet: 1 for a request decoding."""
        return len(self.all_token_ids) + self.num_output_placeholders - self.num_computed_tokens

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    def append_output_token_id(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)

    def append_output_token_ids(self, token_ids: list[int]) -> None:
        self.output_token_ids.extend(token_ids)
        self.all_token_ids.extend(token_ids)

    def is_finished(self) -> bool:
        return self.status > RequestStatus.PREEMPTED

    def get_finished_reason(self) -> str | None:
        return _FINISH_REASONS.get(self.status)

    def __repr__(self) -> str:
        return (
            f"Request(id={self.request_id!r}, status={self.status.name}, tokens={self.num_tokens}, "
            f"computed={self.num_computed_tokens}, outputs={self.num_output_tokens})"
        )


def check_stop(request: Request, tok: int) -> RequestStatus | None:
    """Stop rules for the token just appended: EOS / stop token ids (held back until
    min_tokens), then max_tokens / max_model_len."""
    if tok in request.finish_token_ids and len(request.output_token_ids) >= request.min_tokens:
        if tok != request.eos_for_stop:
            request.stop_reason = tok
        return RequestStatus.FINISHED_STOPPED
    if len(request.all_token_ids) >= request.max_num_tokens:
        return RequestStatus.FINISHED_LENGTH_CAPPED
    return None


def prompt_length_error(num_prompt: int, max_model_len: int, pooling: bool = False) -> PromptTooLongError | None:
    """The refusal of a prompt the context cannot hold with one token to generate (a
    pooling prompt: the prompt alone), else None.  The scheduler's admission rule; a front
    end judging a batch's prompts as it tokenizes them asks it too."""
    if num_prompt + (not pooling) <= max_model_len:
        return None
    return PromptTooLongError(
        f"{CONTEXT_LENGTH_ERROR} {max_model_len} tokens (max_model_len). However, the prompt has "
        f"{num_prompt} tokens{'' if pooling else ', which leaves no room to generate one'}. Please reduce the "
        "length of the prompt.", param="prompt")
