"""AsyncModelRunnerOutput: the sampled-token handle both step paths build outputs from."""

from __future__ import annotations

import pytest
import torch

from pagedserve.worker.async_output import AsyncModelRunnerOutput
from pagedserve.worker.runner_output import ModelRunnerOutput
from pagedserve.worker.sampler import SamplerOutput

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.mark.parametrize("device", DEVICES)
def test_tokens_and_logprobs(device):
    so = SamplerOutput(
        torch.tensor([7, 3], device=device), torch.tensor([-0.5, -1.0], device=device),
        torch.tensor([1, 2], device=device), torch.tensor([[7, 1, 2], [9, 3, 4]], device=device),
        torch.tensor([[-0.5, -1.0, -2.0], [-0.2, -1.0, -3.0]], device=device))
    handle = AsyncModelRunnerOutput(["a", "b", "c"], ["a", "c"], [2, None], so)
    out = handle.get_output()
    assert out.req_ids == ["a", "b", "c"] and out.sampled_token_ids == {"a": [7], "c": [3]}
    assert list(out.logprobs) == ["a"]
    e = out.logprobs["a"]
    assert (e.token_id, e.logprob, e.rank, e.topk_token_ids, e.topk_logprobs) == (7, -0.5, 1, [7, 1], [-0.5, -1.0])
    assert handle.get_output() is out


def test_ready_and_empty():
    done = ModelRunnerOutput(req_ids=["x"])
    assert AsyncModelRunnerOutput.ready(done).get_output() is done
    assert AsyncModelRunnerOutput(["x"]).get_output().sampled_token_ids == {}
