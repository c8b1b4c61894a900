import numpy as np
import pytest

from pagedserve.core.request import Request, RequestStatus
from pagedserve.sampling_params import SamplingParams


def test_token_bookkeeping():
    req = Request("r", [1, 2, 3], SamplingParams(max_tokens=4), eos_token_id=2, arrival_time=5.0, priority=1)
    assert (req.num_tokens, req.num_prompt_tokens, req.num_output_tokens) == (3, 3, 0)
    assert req.status == RequestStatus.WAITING and req.num_computed_tokens == 0 and req.num_preemptions == 0
    req.append_output_token_id(9)
    req.append_output_token_ids([8, 7])
    assert req.output_token_ids == [9, 8, 7] and req.all_token_ids == [1, 2, 3, 9, 8, 7]
    assert req.num_tokens == 6 and req.num_output_tokens == 3 and req.prompt_token_ids == [1, 2, 3]
    req.num_computed_tokens = 4
    assert req.num_computed_tokens == 4
    assert req.arrival_time == 5.0 and req.priority == 1 and req.eos_token_id == 2


def test_finished_states():
    assert not RequestStatus.is_finished(RequestStatus.PREEMPTED)
    for status, reason in [
        (RequestStatus.FINISHED_STOPPED, "stop"),
        (RequestStatus.FINISHED_LENGTH_CAPPED, "length"),
        (RequestStatus.FINISHED_ABORTED, "abort"),
    ]:
        assert RequestStatus.is_finished(status) and RequestStatus.get_finished_reason(status) == reason


def test_numpy_ids_are_normalised():
    req = Request("r", np.array([4, 5, 6]), SamplingParams())
    assert req.prompt_token_ids == [4, 5, 6] and all(type(t) is int for t in req.all_token_ids)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(request_id=3), "request_id"),
        (dict(prompt_token_ids=[]), "empty"),
        (dict(prompt_token_ids=[1, -2]), "non-negative"),
        (dict(prompt_token_ids=[1, 2.5]), "integers"),
        (dict(prompt_token_ids="abc"), "integers"),
        (dict(prompt_token_ids=[2**70]), "integers"),
        (dict(priority=1.5), "priority"),
        (dict(arrival_time="now"), "arrival_time"),
    ],
)
def test_bad_input_is_a_clear_value_error(kwargs, match):
    args = dict(request_id="r", prompt_token_ids=[1, 2], sampling_params=SamplingParams())
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        Request(**args)
