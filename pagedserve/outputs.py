"""vLLM-shaped results handed to users of `LLM.generate` and the async engine."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any


@dataclass
class Logprob:
    logprob: float
    rank: int | None = None  # 1 = most likely under the unmodified model distribution
    decoded_token: str | None = None


# One dict per generated token: token id -> Logprob (the sampled token + the top-k).
SampleLogprobs = list[dict[int, Logprob]]


@dataclass
class RequestMetrics:
    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    logprobs: SampleLogprobs | None = None
    finish_reason: str | None = None  # "stop" | "length" | "abort" | None while running
    stop_reason: int | str | None = None
    # With a predicted output (SamplingParams.prediction): its tokens the verification
    # accepted and rejected so far (OpenAI's usage fields); None without one.
    accepted_prediction_tokens: int | None = None
    rejected_prediction_tokens: int | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class DeltaCursor:
    """How much of one completion has been handed out: `cut` turns its next cumulative
    form into what is new since (RequestOutputKind.DELTA).  A cumulative text only ever
    grows (the detokenizer holds back what could still become a stop string), so the
    new text is its suffix."""

    chars: int = 0
    tokens: int = 0
    logprobs: int = 0

    def cut(self, c: CompletionOutput) -> CompletionOutput:
        logprobs = c.logprobs[self.logprobs:] if c.logprobs is not None else None
        delta = replace(c, text=c.text[self.chars:], token_ids=c.token_ids[self.tokens:], logprobs=logprobs)
        self.chars, self.tokens, self.logprobs = len(c.text), len(c.token_ids), len(c.logprobs or ())
        return delta


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0
    metrics: RequestMetrics | None = None
    prompt_logprobs: list | None = field(default=None, repr=False)
    lora_request: Any = None  # vLLM's: the LoRARequest it ran with (None: the base model)

    def delta(self, cursors: dict[int, DeltaCursor]) -> RequestOutput:
        """This cumulative output as what is new since `cursors` (one per completion
        index, advanced here): a consumer's own deltas, however many outputs the engine
        merged while it was busy (AsyncLLM.generate under RequestOutputKind.DELTA).  The
        prompt's logprobs come with the first delta alone (vLLM's)."""
        first = not cursors
        return replace(self, outputs=[cursors.setdefault(c.index, DeltaCursor()).cut(c) for c in self.outputs],
                       prompt_logprobs=self.prompt_logprobs if first else None)


@dataclass
class BeamSearchSequence:
    """One beam: the prompt's and the generated tokens, as vLLM returns them."""

    tokens: list[int]
    text: str | None  # `tokens` decoded, the prompt's too (vLLM's offline beam text)
    cum_logprob: float
    score: float  # cum_logprob / generated length ** length_penalty
    finish_reason: str  # "stop" (an EOS token ended it) or "length"
    logprobs: list[dict[int, Logprob]] = field(default_factory=list)  # each generated token's step: its top 2 x width
    stop_reason: int | None = None  # the EOS token that ended it ("stop")


@dataclass
class BeamSearchOutput:
    sequences: list[BeamSearchSequence]  # best first


@dataclass
class PoolingOutput:
    """A pooling request's result: an embedding, or a one-element score (float32, CPU)."""

    data: Any  # torch.Tensor (this module imports no torch)


@dataclass
class PoolingRequestOutput:
    """What a pooling request (`LLM.encode`, the server's embedding and score routes) ends with."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: PoolingOutput
    finished: bool = True
    num_cached_tokens: int = 0
    metrics: RequestMetrics | None = None


@dataclass
class EmbeddingOutput:
    embedding: list[float]

    @property
    def hidden_size(self) -> int:
        return len(self.embedding)


@dataclass
class EmbeddingRequestOutput:
    """`LLM.embed`'s result per prompt, as vLLM shapes it (`.outputs.embedding`)."""

    request_id: str
    prompt_token_ids: list[int]
    outputs: EmbeddingOutput
    num_cached_tokens: int = 0

    @classmethod
    def from_base(cls, out: PoolingRequestOutput) -> EmbeddingRequestOutput:
        return cls(out.request_id, out.prompt_token_ids, EmbeddingOutput(out.outputs.data.tolist()),
                   out.num_cached_tokens)


@dataclass
class ClassificationOutput:
    probs: list[float]

    @property
    def num_classes(self) -> int:
        return len(self.probs)


@dataclass
class ClassificationRequestOutput:
    """`LLM.classify`'s result per prompt, as vLLM shapes it (`.outputs.probs`)."""

    request_id: str
    prompt_token_ids: list[int]
    outputs: ClassificationOutput
    num_cached_tokens: int = 0

    @classmethod
    def from_base(cls, out: PoolingRequestOutput) -> ClassificationRequestOutput:
        return cls(out.request_id, out.prompt_token_ids, ClassificationOutput(out.outputs.data.tolist()),
                   out.num_cached_tokens)


@dataclass
class ScoringOutput:
    score: float


@dataclass
class ScoringRequestOutput:
    """`LLM.score`'s result per (text_1, text_2) pair (`.outputs.score`)."""

    request_id: str
    prompt_token_ids: list[int]  # the scored prompt's (a reranker's pair) or the second text's (cosine)
    outputs: ScoringOutput


# What an engine step hands back per request.
EngineOutput = RequestOutput | PoolingRequestOutput
