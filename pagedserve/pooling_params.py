"""Per-request knobs of a pooling request (vLLM's `PoolingParams`): one vector or score
from a prompt's hidden states instead of generated text.

A pooling request runs through the same scheduler, block pool and prefix cache as a
generation request: it is a prefill with no decode.  The model runner folds the
prompt's hidden states into one output as the chunks are computed (layers/pooler.py)
and the request finishes when its last prompt token is computed.  Plain data, no
torch: the scheduler carries it to the runner.
"""

from __future__ import annotations

from dataclasses import dataclass

from pagedserve.errors import InvalidRequestError
from pagedserve.utils import is_int

POOLING_TASKS = ("embed", "classify")
# How a prompt's hidden states become one vector (vLLM's names): the last token's state
# (a causal LM's summary of the whole prompt; the default), their mean, or the first's.
POOLING_TYPES = ("LAST", "MEAN", "CLS")


@dataclass
class PoolingParams:
    """`task` "embed": the pooled hidden state, cut to `dimensions` (Matryoshka models)
    and L2-normalised unless `normalize` is False.  "classify": a relevance score in
    (0, 1) from the last token's logits of the engine's two classifier tokens (vLLM's
    recipe for Qwen3-Reranker: sigmoid(logit(yes) - logit(no))); with `use_activation`
    False the difference itself.

    The engine fills `pooling_type` and `classifier_token_ids` from its PoolerConfig
    when it accepts the request; the runner reads only this object."""

    task: str = "embed"
    dimensions: int | None = None
    normalize: bool | None = None  # None: the engine's PoolerConfig.normalize
    pooling_type: str | None = None  # None: the engine's PoolerConfig.pooling_type
    classifier_token_ids: tuple[int, int] | None = None  # (negative, positive): set by the engine
    truncate_prompt_tokens: int | None = None  # vLLM's: the prompt's last N tokens (-1: the last max_model_len)
    # "classify": False answers the raw logit difference instead of its sigmoid (vLLM's use_activation)
    use_activation: bool | None = None

    def validate(self) -> None:
        """Raise InvalidRequestError naming the first field out of range."""
        if self.task not in POOLING_TASKS:
            raise InvalidRequestError(f"task must be one of {', '.join(POOLING_TASKS)}, got {self.task!r:.100}",
                                      param="task")
        if self.dimensions is not None and (not is_int(self.dimensions) or self.dimensions < 1):
            raise InvalidRequestError(f"dimensions must be a positive integer, got {self.dimensions!r:.100}",
                                      param="dimensions")
        if self.normalize is not None and not isinstance(self.normalize, bool):
            raise InvalidRequestError(f"normalize must be true or false, got {self.normalize!r:.100}",
                                      param="normalize")
        if self.pooling_type is not None and self.pooling_type not in POOLING_TYPES:
            raise InvalidRequestError(f"pooling_type must be one of {', '.join(POOLING_TYPES)}, "
                                      f"got {self.pooling_type!r:.100}", param="pooling_type")
        t = self.truncate_prompt_tokens
        if t is not None and (not is_int(t) or not (t >= 1 or t == -1)):
            raise InvalidRequestError(f"truncate_prompt_tokens must be -1, a positive integer or None, got {t!r:.100}",
                                      param="truncate_prompt_tokens")
        if self.use_activation is not None and not isinstance(self.use_activation, bool):
            raise InvalidRequestError(f"use_activation must be true or false, got {self.use_activation!r:.100}",
                                      param="use_activation")
        if self.task == "embed" and self.use_activation is not None:
            raise InvalidRequestError("use_activation applies to task 'classify'; an embedding's is `normalize`",
                                      param="use_activation")
        if self.task == "classify" and self.dimensions is not None:
            raise InvalidRequestError("dimensions applies to embeddings, not to task 'classify'", param="dimensions")

    @property
    def needs_every_state(self) -> bool:
        """MEAN and CLS read hidden states a prefix-cache hit would skip (only the last
        token is always recomputed), so such a request computes its whole prompt."""
        return self.task == "embed" and self.pooling_type in ("MEAN", "CLS")
