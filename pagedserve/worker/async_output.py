"""A step's sampled tokens on their way to the host.

`.tolist()` on a CUDA tensor waits for the whole step.  Under overlap scheduling the
runner instead starts a non-blocking copy into pinned host memory, records an event
and returns at once; the engine asks for the tokens (`get_output`) only after it has
launched the next step.  The synchronous path uses the same object and simply asks
at once, so both paths build their ModelRunnerOutput in one place.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from pagedserve.core.sched_output import GrammarBitmask
from pagedserve.platforms import is_cuda
from pagedserve.worker.rejection_sampler import DraftVerdict
from pagedserve.worker.runner_output import NO_TOKEN_LEFT, LogprobsEntry, ModelRunnerOutput, logprobs_entries
from pagedserve.worker.sampler import SamplerOutput

_FIELDS = ("sampled_token_ids", "invalid", "no_token", "sampled_logprobs", "sampled_ranks", "topk_token_ids", "topk_logprobs")


class AsyncModelRunnerOutput:
    """`req_ids`: every request of the step; `sample_req_ids`/`logprobs_k`: the sampled
    ones and how many top logprobs each wants (None: none), taken when the step ran,
    since a row may belong to another request by the time the output is read."""

    def __init__(self, req_ids: list[str], sample_req_ids: list[str] | None = None,
                 logprobs_k: list[int | None] | None = None, sampled: SamplerOutput | None = None,
                 prompt_logprobs: dict[str, tuple[int, list[LogprobsEntry]]] | None = None,
                 pooler_output: dict[str, torch.Tensor] | None = None) -> None:
        self.req_ids = req_ids
        self.prompt_logprobs = prompt_logprobs or {}
        self.pooler_output = pooler_output or {}
        self.sample_req_ids = sample_req_ids or []
        self.logprobs_k = logprobs_k or []
        self._host: dict[str, torch.Tensor] = {}
        self._event: torch.cuda.Event | None = None
        self._output: ModelRunnerOutput | None = None
        self._deferred: Callable[[GrammarBitmask], None] | None = None
        # Speculative decoding: requests whose drafts were verified, with the verdicts.
        self._drafts: dict[str, list[int]] = {}
        self._verdicts: dict[str, DraftVerdict] = {}
        self._draft_logprobs: dict[str, list[LogprobsEntry]] = {}
        if sampled is not None:
            self.set_sampled(sampled)

    def defer_sampling(self, sample: Callable[[GrammarBitmask], None]) -> None:
        """The step's logits are computed but its constrained rows wait for their grammar
        mask (overlap scheduling): `sample(mask)` runs when the engine has one."""
        self._deferred = sample

    def sample(self, grammar: GrammarBitmask) -> None:
        if self._deferred is None:
            raise RuntimeError("this step sampled when it was launched: it takes no grammar mask now")
        sample, self._deferred = self._deferred, None
        sample(grammar)

    def set_sampled(self, sampled: SamplerOutput) -> None:
        """Start bringing the sampled tokens to the host (without waiting on CUDA)."""
        tensors = {f: getattr(sampled, f) for f in _FIELDS if getattr(sampled, f) is not None}
        if is_cuda(sampled.sampled_token_ids.device):
            for name, t in tensors.items():
                host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
                host.copy_(t, non_blocking=True)
                self._host[name] = host
            self._event = torch.cuda.Event()
            self._event.record()
        else:
            self._host = tensors

    def set_draft_verdicts(self, drafts: dict[str, list[int]], verdicts: dict[str, DraftVerdict],
                           draft_logprobs: dict[str, list[LogprobsEntry]]) -> None:
        """A request with verdict keeps its accepted drafts, then the replacement of the
        first rejected one, or (all accepted) the token sampled at its last position;
        `draft_logprobs`: the entries of the tokens its draft rows emitted, for requests
        that asked for logprobs."""
        self._drafts, self._verdicts, self._draft_logprobs = drafts, verdicts, draft_logprobs

    @classmethod
    def ready(cls, output: ModelRunnerOutput) -> AsyncModelRunnerOutput:
        out = cls(output.req_ids)
        out._output = output
        return out

    def get_output(self) -> ModelRunnerOutput:
        """Wait for the copy (not for anything launched after it) and build the output."""
        if self._output is not None:
            return self._output
        if self._deferred is not None:
            raise RuntimeError("the step's grammar mask was never given (sample() before get_output())")
        if self._event is not None:
            self._event.synchronize()
        out = self._output = ModelRunnerOutput(req_ids=self.req_ids, prompt_logprobs=self.prompt_logprobs,
                                               pooler_output=self.pooler_output)
        if not self.sample_req_ids:
            return out
        h = self._host
        tokens = h["sampled_token_ids"].tolist()
        invalid = h["invalid"].tolist() if "invalid" in h else [False] * len(tokens)
        no_token = h["no_token"].tolist() if "no_token" in h else [False] * len(tokens)
        verdicts = self._verdicts
        for req_id, tok, bad, empty in zip(self.sample_req_ids, tokens, invalid, no_token, strict=True):
            v = verdicts.get(req_id) if verdicts else None
            if v is not None and v.invalid:
                out.invalid_req_ids[req_id] = None
            elif v is not None:
                kept = self._drafts[req_id][: v.num_accepted]
                if v.replacement is not None:
                    out.sampled_token_ids[req_id] = [*kept, v.replacement]
                elif bad:
                    out.invalid_req_ids[req_id] = NO_TOKEN_LEFT if empty else None
                else:
                    out.sampled_token_ids[req_id] = [*kept, tok]
            elif bad:
                out.invalid_req_ids[req_id] = NO_TOKEN_LEFT if empty else None
            else:
                out.sampled_token_ids[req_id] = [tok]
        if "sampled_logprobs" not in h:
            return out
        top_ids = h["topk_token_ids"].tolist() if "topk_token_ids" in h else None
        top_lps = h["topk_logprobs"].tolist() if "topk_logprobs" in h else None
        entries = logprobs_entries(tokens, h["sampled_logprobs"].tolist(), h["sampled_ranks"].tolist(), top_ids,
                                   top_lps, self.logprobs_k)
        for req_id, last in zip(self.sample_req_ids, entries, strict=True):
            if last is None or req_id not in out.sampled_token_ids:
                continue
            v = verdicts.get(req_id) if verdicts else None
            if v is None:
                out.logprobs[req_id] = last
            else:  # the draft rows' entries, then the bonus token's when every draft was accepted
                drafted = list(self._draft_logprobs.get(req_id, ()))
                out.logprobs[req_id] = drafted + [last] if v.replacement is None else drafted
        return out
