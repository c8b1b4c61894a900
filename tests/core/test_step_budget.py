"""The time budget of a step (max_step_ms): the cost fit, and the scheduler under it."""

from __future__ import annotations

import pytest
from core_helpers import make_request, make_scheduler
from hypothesis import given
from hypothesis import strategies as st

from pagedserve.config import SchedulerConfig
from pagedserve.core.step_budget import StepTimeBudget


@given(base=st.floats(0.0, 0.2), per_token=st.floats(1e-5, 1e-2),
       sizes=st.lists(st.integers(1, 4096), min_size=2, max_size=30, unique=True))
def test_fit_recovers_a_linear_cost(base: float, per_token: float, sizes: list[int]) -> None:
    b = StepTimeBudget(target_s=1.0, max_tokens=8192)
    for n in sizes:
        b.observe(n, base + per_token * n)
    got_base, got_per_token = b.cost()
    assert got_per_token == pytest.approx(per_token, rel=1e-4)
    assert got_base == pytest.approx(base, abs=1e-4 + 1e-4 * per_token * max(sizes))


def test_budget_is_what_fits_the_target_within_bounds() -> None:
    b = StepTimeBudget(target_s=0.1, max_tokens=2048)
    assert b.token_budget(min_tokens=20) == 2048  # nothing measured yet: the token budget
    for n in (16, 64, 256, 1024):
        b.observe(n, 0.04 + 0.001 * n)  # 40 ms of fixed cost, 1 ms a token
    assert b.token_budget(min_tokens=20) == 60
    assert b.token_budget(min_tokens=100) == 100  # the running decodes always go
    b.observe(8, 0.008)
    slow = StepTimeBudget(target_s=0.001, max_tokens=2048)
    slow.observe(32, 1.0)
    assert slow.token_budget(min_tokens=40) == 40
    assert StepTimeBudget(target_s=100.0, max_tokens=512).token_budget(1) == 512


def test_one_step_size_is_taken_as_all_per_token_cost() -> None:
    b = StepTimeBudget(target_s=0.1, max_tokens=4096)
    for _ in range(5):
        b.observe(100, 0.05)
    assert b.cost() == (0.0, pytest.approx(0.0005))
    assert b.token_budget(1) == 200


def test_scheduler_chunks_prefill_so_decodes_keep_their_step_time() -> None:
    sched = make_scheduler(block_size=4, max_num_batched_tokens=64, max_model_len=128, num_blocks=128,
                           max_step_ms=30)
    for i in range(4):
        sched.add_request(make_request(f"d{i}", 4, max_tokens=100))
    so = sched.schedule()
    assert so.total_num_scheduled_tokens == 16
    sched.update_from_output(so, {rid: [5] for rid in so.num_scheduled_tokens})
    for n in (16, 4, 40, 64):
        sched.record_step_time(n, 0.002 + 0.001 * n)  # 2 ms fixed, 1 ms a token
    sched.add_request(make_request("long", 100, max_tokens=4))
    so = sched.schedule()
    # 28 tokens fit 30 ms: the four decodes and 24 prompt tokens (the token budget allows 64)
    assert so.num_scheduled_tokens == {"d0": 1, "d1": 1, "d2": 1, "d3": 1, "long": 24}
    assert so.total_num_scheduled_tokens == 28


def test_with_no_stream_to_protect_a_prompt_prefills_at_the_full_token_budget() -> None:
    """The time target protects running streams' next tokens; a prompt alone (or beside
    other prompts) is nobody's wait, so it takes max_num_batched_tokens a step."""
    sched = make_scheduler(block_size=4, max_num_batched_tokens=64, max_model_len=256, num_blocks=128,
                           max_step_ms=30)
    for n in (16, 4, 40, 64):
        sched.record_step_time(n, 0.002 + 0.001 * n)  # 28 tokens would fit 30 ms
    sched.add_request(make_request("long", 200, max_tokens=4))
    sched.add_request(make_request("other", 100, max_tokens=4))
    so = sched.schedule()
    assert so.total_num_scheduled_tokens == 64
    sched.update_from_output(so, {})
    so = sched.schedule()  # both still prefilling: no stream yet
    assert so.total_num_scheduled_tokens == 64


def test_config_checks() -> None:
    for bad in (0, float("inf"), float("nan")):  # (inf started, then the first step died converting it)
        with pytest.raises(ValueError, match="max_step_ms must be a finite positive number"):
            SchedulerConfig(max_step_ms=bad)
    with pytest.raises(ValueError, match="needs chunked prefill"):
        SchedulerConfig(max_step_ms=50, enable_chunked_prefill=False, max_num_batched_tokens=4096, max_model_len=2048)
