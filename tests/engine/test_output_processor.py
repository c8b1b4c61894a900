"""OutputProcessor fed hand-made EngineCoreOutputs: the contract with the scheduler side."""

from __future__ import annotations

import pytest

from pagedserve.core.sched_output import EngineCoreOutput
from pagedserve.engine.output_processor import (
    OutputProcessor,
    ParentRequest,
    RequestOutputKind,
)
from pagedserve.outputs import RequestMetrics
from pagedserve.sampling_params import SamplingParams
from pagedserve.worker.runner_output import LogprobsEntry
from tests.engine.helpers import make_tokenizer


@pytest.fixture(scope="module")
def tok():
    return make_tokenizer()


def add(op, rid, params, n=1, kind=RequestOutputKind.CUMULATIVE, prompt_ids=(1, 2, 3)):
    parent = ParentRequest(rid, None, list(prompt_ids), kind, RequestMetrics(arrival_time=100.0))
    ids = [rid] if n == 1 else [f"{rid}-{i}" for i in range(n)]
    op.add_request(parent, ids, [params] * n)
    return ids


def test_stop_string_reports_sequence_to_finish(tok) -> None:
    op = OutputProcessor(tok)
    add(op, "a", SamplingParams(stop="world"))
    ids = tok.encode("hello world again")
    outs, stopped = op.process_outputs([EngineCoreOutput("a", ids[:1], num_cached_tokens=16)], now=101.0)
    assert stopped == [] and outs[0].outputs[0].finish_reason is None and outs[0].num_cached_tokens == 16
    outs, stopped = op.process_outputs([EngineCoreOutput("a", ids[1:])], now=102.0)
    assert stopped == ["a"]
    c = outs[0].outputs[0]
    assert (c.text, c.finish_reason, c.stop_reason, outs[0].finished) == ("hello ", "stop", "world", True)
    m = outs[0].metrics
    assert (m.arrival_time, m.first_token_time, m.last_token_time, m.finished_time) == (100.0, 101.0, 102.0, 102.0)
    assert not op.has_unfinished_requests()
    # Late outputs for a finished sequence are ignored.
    assert op.process_outputs([EngineCoreOutput("a", [5])]) == ([], [])


def test_scheduler_finish_passes_through(tok) -> None:
    op = OutputProcessor(tok)
    add(op, "a", SamplingParams())
    outs, stopped = op.process_outputs([EngineCoreOutput("a", [40, 41], finished=True, finish_reason="length")])
    assert stopped == [] and outs[0].outputs[0].finish_reason == "length" and outs[0].finished
    assert outs[0].outputs[0].text == tok.decode([40, 41])


def test_n_children_aggregate_and_finish_together() -> None:
    op = OutputProcessor(None)
    ids = add(op, "p", SamplingParams(n=2), n=2)
    outs, _ = op.process_outputs([EngineCoreOutput(ids[1], [7])])
    assert [o.request_id for o in outs] == ["p"] and [c.token_ids for c in outs[0].outputs] == [[], [7]]
    outs, _ = op.process_outputs([EngineCoreOutput(ids[1], [8], finished=True, finish_reason="stop", stop_reason=8)])
    assert not outs[0].finished and outs[0].outputs[1].stop_reason == 8
    outs, _ = op.process_outputs([EngineCoreOutput(ids[0], [9], finished=True, finish_reason="length")])
    assert outs[0].finished and [c.token_ids for c in outs[0].outputs] == [[9], [7, 8]]
    assert op.get_num_unfinished_requests() == 0


def test_abort_returns_live_children_only() -> None:
    op = OutputProcessor(None)
    ids = add(op, "p", SamplingParams(n=3), n=3)
    op.process_outputs([EngineCoreOutput(ids[0], [1], finished=True, finish_reason="length")])
    assert sorted(op.abort_requests(["p", "nope"])) == ids[1:]
    assert not op.has_unfinished_requests()


def test_logprobs_top_k_sliced_to_request() -> None:
    op = OutputProcessor(None)
    add(op, "a", SamplingParams(logprobs=1))
    entry = LogprobsEntry(token_id=5, logprob=-2.0, rank=3, topk_token_ids=[9, 4, 5],
                            topk_logprobs=[-0.1, -1.0, -2.0])
    outs, _ = op.process_outputs([EngineCoreOutput("a", [5])], {"a": entry})
    [d] = outs[0].outputs[0].logprobs
    assert list(d) == [5, 9] and (d[5].rank, d[9].rank, d[9].logprob) == (3, 1, -0.1)
    assert outs[0].outputs[0].cumulative_logprob == -2.0 and d[5].decoded_token is None
