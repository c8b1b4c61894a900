"""Turns the scheduler's per-step token ids into user-facing RequestOutputs.

The scheduler only knows token ids; everything a user sees -- text, logprob dicts,
finish reasons from stop strings, timing metrics, n > 1 aggregation -- lives here,
in one `RequestState` per sequence the scheduler runs.  A request with n > 1 is
fanned out into n scheduler requests ("children") that share the prompt (and, with
prefix caching, its KV blocks); a `ParentRequest` gathers them back into one
RequestOutput under the id the user gave.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from pagedserve.core.prediction_drafter import merge_matched
from pagedserve.core.sched_output import EngineCoreOutput
from pagedserve.engine.detokenizer import IncrementalDetokenizer
from pagedserve.outputs import (
    CompletionOutput,
    DeltaCursor,
    EngineOutput,
    Logprob,
    PoolingOutput,
    PoolingRequestOutput,
    RequestMetrics,
    RequestOutput,
)
from pagedserve.sampling_params import RequestOutputKind, SamplingParams


@dataclass
class RequestState:
    """One scheduler-level sequence (a whole request when n == 1, else one child)."""

    request_id: str
    parent: ParentRequest
    index: int
    params: SamplingParams
    detokenizer: IncrementalDetokenizer
    output_token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, Logprob]] | None = None
    cumulative_logprob: float | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0
    pooled: Any = None  # a pooling request's result, once its prompt is computed
    # A predicted output's (accepted, rejected) prediction tokens so far (OpenAI's), and per
    # output token whether it matched a prediction token (1) or not (0); None without one.
    prediction_counts: tuple[int, int] | None = None
    predicted: bytearray | None = None
    # What previous DELTA outputs already handed out.
    sent: DeltaCursor = field(default_factory=DeltaCursor)  # what DELTA outputs have handed out

    def __post_init__(self) -> None:
        if self.params.logprobs is not None:
            self.logprobs = []
            self.cumulative_logprob = 0.0
        if self.params.prediction is not None:
            self.prediction_counts, self.predicted = (0, 0), bytearray()

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def completion(self, delta: bool) -> CompletionOutput:
        accepted, rejected = self.prediction_counts or (None, None)
        whole = CompletionOutput(
            index=self.index, text=self.detokenizer.get_text(self.finished), token_ids=self.output_token_ids,
            cumulative_logprob=self.cumulative_logprob, logprobs=self.logprobs, finish_reason=self.finish_reason,
            stop_reason=self.stop_reason, accepted_prediction_tokens=accepted, rejected_prediction_tokens=rejected,
        )
        if delta:
            return self.sent.cut(whole)
        whole.token_ids = list(whole.token_ids)  # (the caller's copy: the engine's lists keep growing)
        whole.logprobs = list(whole.logprobs) if whole.logprobs is not None else None
        return whole


@dataclass
class ParentRequest:
    """The request as the user submitted it; owns its n children."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    output_kind: RequestOutputKind
    metrics: RequestMetrics
    children: list[RequestState] = field(default_factory=list)
    # With prompt_logprobs: one entry per prompt token (None for the first, which nothing
    # predicts), filled as prefill chunks compute them.
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    pooling: bool = False  # a pooling request: one PoolingRequestOutput, when it finishes
    lora_request: Any = None  # the adapter it ran with (a LoRARequest; None: the base model)

    @property
    def finished(self) -> bool:
        return all(c.finished for c in self.children)

    def make_output(self) -> RequestOutput | PoolingRequestOutput | None:
        finished = self.finished
        if self.pooling:
            child = self.children[0]
            if not finished or child.pooled is None:  # (aborted, or failed: no result to show)
                return None
            return PoolingRequestOutput(self.request_id, self.prompt, self.prompt_token_ids,
                                        PoolingOutput(child.pooled), True, child.num_cached_tokens, self.metrics)
        if self.output_kind is RequestOutputKind.FINAL_ONLY and not finished:
            return None
        delta = self.output_kind is RequestOutputKind.DELTA
        sent_before = delta and any(c.sent.tokens for c in self.children)  # (prompt logprobs: the first delta's)
        return RequestOutput(
            request_id=self.request_id, prompt=self.prompt, prompt_token_ids=self.prompt_token_ids,
            outputs=[c.completion(delta) for c in self.children], finished=finished,
            num_cached_tokens=max(c.num_cached_tokens for c in self.children), metrics=self.metrics,
            prompt_logprobs=list(self.prompt_logprobs) if self.prompt_logprobs is not None and not sent_before else None,
            lora_request=self.lora_request,
        )


class OutputProcessor:
    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.parents: dict[str, ParentRequest] = {}
        self.states: dict[str, RequestState] = {}  # by scheduler request id
        self._token_text: dict[int, str] = {}  # decoded_token cache for logprobs
        # Counters for EngineStats.
        self.num_prompt_tokens = 0
        self.num_generation_tokens = 0

    def add_request(self, parent: ParentRequest, child_ids: list[str], child_params: list[SamplingParams]) -> None:
        if child_params[0].prompt_logprobs is not None:
            parent.prompt_logprobs = [None] * len(parent.prompt_token_ids)
        for i, (cid, params) in enumerate(zip(child_ids, child_params, strict=True)):
            detok = IncrementalDetokenizer(self.tokenizer, parent.prompt_token_ids, params)
            state = RequestState(cid, parent, i, params, detok)
            parent.children.append(state)
            self.states[cid] = state
        self.parents[parent.request_id] = parent

    def abort_requests(self, request_ids: list[str]) -> list[str]:
        """Forget the given user-level requests; return their scheduler-level ids."""
        child_ids = []
        for rid in request_ids:
            parent = self.parents.pop(rid, None)
            if parent is None:
                continue
            for child in parent.children:
                if self.states.pop(child.request_id, None) is not None and not child.finished:
                    child_ids.append(child.request_id)
        return child_ids

    def mark_scheduled(self, request_ids: Any, now: float) -> None:
        for rid in request_ids:
            state = self.states.get(rid)
            if state is not None and state.parent.metrics.first_scheduled_time is None:
                state.parent.metrics.first_scheduled_time = now

    def process_outputs(
        self, core_outputs: list[EngineCoreOutput], logprobs: dict[str, Any] | None = None,
        now: float | None = None,
    ) -> tuple[list[EngineOutput], list[str]]:
        """Returns (outputs for the user, ids of sequences a stop string just finished)."""
        now = time.time() if now is None else now
        logprobs = logprobs or {}
        touched: dict[str, ParentRequest] = {}
        stopped: list[str] = []
        for out in core_outputs:
            state = self.states.get(out.request_id)
            if state is None or state.finished:
                continue
            touched[state.parent.request_id] = state.parent
            if out.pooling_output is not None:  # a pooling request's prompt is computed: its one result
                self._finish_pooling(state, out, now)
                continue
            if out.new_token_ids:
                self._append_tokens(state, out, logprobs, now)
            if out.prediction_counts is not None:
                state.prediction_counts = out.prediction_counts
            stop_str = self._detokenize(state, out)
            if stop_str is not None and not out.finished:
                stopped.append(out.request_id)
        return self._make_outputs(touched, now), stopped

    def _finish_pooling(self, state: RequestState, out: EngineCoreOutput, now: float) -> None:
        metrics = state.parent.metrics
        self.num_prompt_tokens += len(state.parent.prompt_token_ids)
        state.num_cached_tokens = max(out.num_cached_tokens, 0)
        state.pooled, state.finish_reason = out.pooling_output, "stop"
        metrics.first_token_time = metrics.last_token_time = now
        del self.states[out.request_id]

    def _append_tokens(self, state: RequestState, out: EngineCoreOutput, logprobs: dict[str, Any],
                       now: float) -> None:
        """A step's new tokens (and their logprobs) into the sequence, and into the counts
        and times the metrics read (the prompt is counted with the first token)."""
        metrics, new_ids = state.parent.metrics, out.new_token_ids
        if metrics.first_token_time is None:
            metrics.first_token_time = now
        if not state.output_token_ids:
            self.num_prompt_tokens += len(state.parent.prompt_token_ids)
            state.num_cached_tokens = max(out.num_cached_tokens, 0)
        metrics.last_token_time = now
        self.num_generation_tokens += len(new_ids)
        state.output_token_ids.extend(new_ids)
        if state.predicted is not None:  # (per token: whether it matched a prediction token)
            merge_matched(state.predicted, len(new_ids), out.predicted)
        if state.logprobs is not None and out.request_id in logprobs:
            self._append_logprobs(state, new_ids, logprobs[out.request_id])

    def _detokenize(self, state: RequestState, out: EngineCoreOutput) -> str | None:
        """Detokenize the new tokens and check the stop strings; a sequence that finished
        (here or in the engine) gets its finish and stop reasons and leaves `states`.
        Returns the stop string this step matched, if any."""
        finish_reason, stop_reason = out.finish_reason, out.stop_reason
        # EOS / a stop token id ends the text before that token (vLLM's behaviour).
        token_stop = finish_reason == "stop" and not isinstance(stop_reason, str)
        stop_str = state.detokenizer.update(out.new_token_ids, skip_last=token_stop)
        extra = state.detokenizer.tokens_after_stop
        if stop_str is not None and extra:  # tokens that came after the stop string in one step
            self._drop_last_tokens(state, extra)
        if stop_str is not None:
            finish_reason, stop_reason = "stop", stop_str
        elif out.finished:
            state.detokenizer.finish()
            if state.detokenizer.stop_reason is not None:  # matched in the flushed tail
                finish_reason, stop_reason = "stop", state.detokenizer.stop_reason
        if out.finished or stop_str is not None:
            state.finish_reason, state.stop_reason = finish_reason or "stop", stop_reason
            del self.states[out.request_id]
        return stop_str

    def _drop_last_tokens(self, state: RequestState, extra: int) -> None:
        """Forget the last `extra` tokens (past a stop string): from the output, the
        generation count, the logprobs and the prediction's accepted drafts."""
        dropped = state.output_token_ids[-extra:]
        del state.output_token_ids[-extra:]
        self.num_generation_tokens -= extra
        if state.predicted is not None and state.prediction_counts is not None:
            # Matched tokens past the stop string are not in the completion: rejected (OpenAI's
            # accepted tokens appear in it; the engine counted them before the string was seen).
            cut = sum(state.predicted[-extra:])
            del state.predicted[-extra:]
            accepted, rejected = state.prediction_counts
            state.prediction_counts = (accepted - cut, rejected + cut)
        if state.logprobs:
            for tid, d in zip(dropped, state.logprobs[-extra:], strict=True):
                state.cumulative_logprob -= d[tid].logprob
            del state.logprobs[-extra:]

    def _make_outputs(self, touched: dict[str, ParentRequest], now: float) -> list[EngineOutput]:
        outputs = []
        for parent in touched.values():
            if parent.finished:
                parent.metrics.finished_time = now
                self.parents.pop(parent.request_id, None)
            ro = parent.make_output()
            if ro is not None:
                outputs.append(ro)
        return outputs

    def add_prompt_logprobs(self, computed: dict[str, tuple[int, list[Any]]]) -> None:
        """Prompt logprobs a step computed (each child computes them; the first child's count)."""
        for req_id, (first, entries) in computed.items():
            state = self.states.get(req_id)
            if state is None or state.index != 0 or state.parent.prompt_logprobs is None:
                continue
            k = state.params.prompt_logprobs or 0
            for j, entry in enumerate(entries):
                state.parent.prompt_logprobs[first + j] = self._logprob_dict(entry.token_id, entry, k,
                                                                             state.params.detokenize)

    def _logprob_dict(self, token_id: int, entry: Any, k: int, decode: bool) -> dict[int, Logprob]:
        """{token: Logprob} for one position: the token itself, then the k most likely;
        `decode`: with each token's text (SamplingParams.detokenize)."""
        text = self._decode_token if decode else lambda _: None
        d = {token_id: Logprob(entry.logprob, entry.rank, text(token_id))}
        for rank, (t, lp) in enumerate(zip(entry.topk_token_ids[:k], entry.topk_logprobs[:k], strict=True), 1):
            if t not in d:
                d[t] = Logprob(lp, rank, text(t))
        return d

    def _append_logprobs(self, state: RequestState, new_ids: list[int], entries: Any) -> None:
        if not isinstance(entries, (list, tuple)):  # one entry per step: the usual case
            entries = [entries]
        k = state.params.logprobs or 0
        for tid, entry in zip(new_ids, entries, strict=False):
            state.logprobs.append(self._logprob_dict(tid, entry, k, state.params.detokenize))
            state.cumulative_logprob += entry.logprob

    def _decode_token(self, token_id: int) -> str | None:
        if self.tokenizer is None:
            return None
        text = self._token_text.get(token_id)
        if text is None:
            text = self.tokenizer.decode([token_id], skip_special_tokens=False)
            self._token_text[token_id] = text
        return text

    def has_unfinished_requests(self) -> bool:
        return bool(self.parents)

    def get_num_unfinished_requests(self) -> int:
        return len(self.parents)

