"""A model runner stand-in that replays scripted tokens, so engine logic (validation,
stop strings, n > 1, aborts, preemption) is tested without loading a model."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from types import SimpleNamespace

import torch

from pagedserve.engine.arg_utils import EngineArgs
from pagedserve.engine.llm_engine import LLMEngine
from pagedserve.worker.runner_output import LogprobsEntry


@dataclass
class FakeRunnerOutput:
    req_ids: list[str]
    sampled_token_ids: dict[str, list[int]]
    logprobs: dict[str, LogprobsEntry] = field(default_factory=dict)
    invalid_req_ids: dict[str, str | None] = field(default_factory=dict)
    prompt_logprobs: dict = field(default_factory=dict)
    pooler_output: dict = field(default_factory=dict)


class FakeRunner:
    """next token = script(output_index, prompt_token_ids); logprob -0.25 * (rank).
    A script returning None makes that request's logits invalid (the sampler's NaN case)."""

    device = torch.device("cpu")
    supports_async_scheduling = False
    kv_tier = None

    def shutdown(self) -> None:
        pass

    def check_health(self) -> None:
        pass

    def describe(self) -> dict[str, str]:
        return {"device": "cpu", "attention_backend": "fake"}

    def execute_model_async(self, so):
        raise NotImplementedError

    def __init__(self, script: Callable[[int, list[int]], int]) -> None:
        self.script = script
        self.tokens: dict[str, list[int]] = {}
        self.prompt_len: dict[str, int] = {}
        self.computed: dict[str, int] = {}
        self.calls = 0
        self.dropped: set[str] = set()

    def execute_model(self, so) -> FakeRunnerOutput:
        self.calls += 1
        for rid in so.finished_req_ids:
            self.dropped.add(rid)
            self.tokens.pop(rid, None)
        for nr in so.scheduled_new_reqs:
            self.tokens[nr.req_id] = list(nr.prompt_token_ids) + list(nr.output_token_ids)
            self.prompt_len[nr.req_id] = len(nr.prompt_token_ids)
            self.computed[nr.req_id] = nr.num_computed_tokens
        c = so.scheduled_cached_reqs
        for rid, new, comp in zip(c.req_ids, c.new_token_ids, c.num_computed_tokens, strict=True):
            self.tokens[rid].extend(new)
            self.computed[rid] = comp
        sampled, logprobs, invalid = {}, {}, {}
        for rid, n in so.num_scheduled_tokens.items():
            self.computed[rid] += n
            toks = self.tokens[rid]
            if self.computed[rid] < len(toks):
                continue
            p = self.prompt_len[rid]
            t = self.script(len(toks) - p, toks[:p])
            if t is None:
                invalid[rid] = None
                continue
            sampled[rid] = [t]
            logprobs[rid] = LogprobsEntry(t, -0.5, 2, [t + 1, t], [-0.25, -0.5])
        return FakeRunnerOutput(list(so.num_scheduled_tokens), sampled, logprobs, invalid)


def make_engine(script=lambda i, prompt: 10 + i % 50, tokenizer=None, vocab_size: int = 400,
                num_blocks: int = 64, eos_token_id: int | None = None, **engine_args) -> LLMEngine:
    engine_args.setdefault("max_model_len", 128)
    config = EngineArgs(**engine_args).create_engine_config(load_hf_config=False)
    config.model_config.hf_config = SimpleNamespace(vocab_size=vocab_size, eos_token_id=eos_token_id)
    config.cache_config.num_blocks = num_blocks
    return LLMEngine(config, FakeRunner(script), tokenizer)


def run_to_completion(engine: LLMEngine, max_steps: int = 10_000) -> dict:
    final = {}
    for _ in range(max_steps):
        if not engine.has_unfinished_requests():
            return final
        for out in engine.step():
            if out.finished:
                final[out.request_id] = out
    raise AssertionError("engine did not finish")
