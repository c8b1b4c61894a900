"""DraftModelProposer's bookkeeping against a scripted runner: what it asks the draft
model to compute each round, its blocks, and eviction when its KV cache is full."""

from __future__ import annotations

from pagedserve.worker.draft_model import DraftModelProposer
from pagedserve.worker.runner_output import ModelRunnerOutput


class ScriptedRunner:
    """Records each step and 'samples' the last known token + 1, like a model that counts."""

    block_size = 4
    max_model_len = 64

    def __init__(self) -> None:
        self.steps = []
        self.tokens: dict[str, list[int]] = {}
        self.blocks: dict[str, list[int]] = {}

    def execute_model(self, so):
        for rid in so.finished_req_ids:
            self.tokens.pop(rid)
        for nr in so.scheduled_new_reqs:
            assert nr.req_id not in self.tokens
            self.tokens[nr.req_id] = list(nr.prompt_token_ids)
            self.blocks[nr.req_id] = list(nr.block_ids)
        c = so.scheduled_cached_reqs
        for rid, new in zip(c.req_ids, c.new_token_ids, strict=True):
            self.tokens[rid].extend(new)
        self.steps.append({
            "new": {nr.req_id: nr.num_computed_tokens for nr in so.scheduled_new_reqs},
            "cached": dict(zip(c.req_ids, c.num_computed_tokens, strict=True)),
            "scheduled": dict(so.num_scheduled_tokens), "finished": set(so.finished_req_ids)})
        for rid, n in so.num_scheduled_tokens.items():  # every scheduled slot must have a block
            computed = self.steps[-1]["new"].get(rid, self.steps[-1]["cached"].get(rid))
            assert computed + n <= len(self.blocks[rid]) * self.block_size
        return ModelRunnerOutput(req_ids=list(so.num_scheduled_tokens),
                                 sampled_token_ids={rid: [self.tokens[rid][-1] + 1] for rid in so.num_scheduled_tokens})


def make(num_blocks: int = 64, max_drafts: int = 4) -> tuple[DraftModelProposer, ScriptedRunner]:
    runner = ScriptedRunner()
    return DraftModelProposer(runner, num_blocks, max_num_seqs=4, max_drafts=max_drafts), runner


def test_a_round_catches_up_then_drafts_one_token_per_step():
    p, runner = make()
    assert p.propose_batch([("a", [1, 2, 3], 3), ("b", [10, 11], 1)]) == {"a": [4, 5, 6], "b": [12]}
    first, second, third = runner.steps
    assert first["new"] == {"a": 0, "b": 0} and first["scheduled"] == {"a": 3, "b": 2}
    assert second["cached"] == {"a": 3} and third["cached"] == {"a": 4}  # drafts fed back, one a step
    # Next round: 2 drafts accepted + the target's token; only those 3 tokens are computed again,
    # from the committed sequence (the rejected draft 6 is gone), and the runner's old state is dropped.
    assert p.propose_batch([("a", [1, 2, 3, 4, 5, 9], 2)]) == {"a": [10, 11]}
    assert runner.steps[3]["finished"] == {"a", "b"}
    assert runner.steps[3]["new"] == {"a": 3} and runner.steps[3]["scheduled"] == {"a": 3}
    assert runner.tokens["a"] == [1, 2, 3, 4, 5, 9, 10]


def test_drafts_stop_at_the_draft_models_context():
    p, runner = make()
    tokens = list(range(62))
    assert p.propose_batch([("a", tokens, 4)]) == {"a": [62, 63, 64]}  # draft i is written at position 61 + i


def test_a_full_cache_evicts_requests_not_drafting_now_least_recent_first():
    p, runner = make(num_blocks=9)  # 8 usable blocks of 4 tokens
    p.propose_batch([("a", list(range(10)), 2)])  # 11 slots: 3 blocks
    p.propose_batch([("b", list(range(10)), 2)])
    assert len(p.free_block_ids) == 2
    p.propose_batch([("c", list(range(10)), 2)])  # needs 3: evicts a, the least recently drafted
    assert set(p.states) == {"b", "c"}
    # b drafts in this round, so d (needing all 8 blocks) could only take c's 3: no drafts
    # for d, and c keeps its KV (evicting it would not have made room).
    assert p.propose_batch([("b", list(range(11)), 1), ("d", list(range(30)), 2)]) == {"b": [11]}
    assert len(p.states["c"].block_ids) == 3 and p.states["d"].block_ids == []
    p.forget(["b", "c", "d"])
    assert sorted(p.free_block_ids) == list(range(1, 9))


def test_forget_returns_the_blocks_and_a_new_request_starts_from_zero():
    p, runner = make()
    p.propose_batch([("a", [1, 2, 3, 4, 5], 2)])
    p.forget(["a"])
    assert len(p.free_block_ids) == 63 and "a" not in p.states
    p.propose_batch([("a", [7, 8], 1)])
    assert runner.steps[-1]["new"] == {"a": 0}
