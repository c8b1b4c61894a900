"""The pooling runner: mean pooling on the default model against HF transformers with the
prompts cut into chunks (a server with --pooler-config), and offline
(`LLM(..., runner="pooling")`) pooled results that do not depend on how the engine cut,
cached or preempted the work."""

from __future__ import annotations

import pytest
import torch

from pagedserve import LLM
from pagedserve.pooling_params import PoolingParams
from tests.entrypoints.openai.test_embeddings_api import TEXTS, hf_pooled


def test_mean_pooling_in_chunks_equals_hf_on_the_default_model(smollm2_path, smollm2_gguf, tmp_path) -> None:
    """Through the server and the official client, the pooler set on the command line."""
    import openai

    from tests.entrypoints.openai.conftest import ServerProcess

    server = ServerProcess([smollm2_path, "--runner", "pooling", "--pooler-config", '{"pooling_type": "MEAN"}',
                            "--dtype", "float32", "--enforce-eager", "--max-model-len", "512",
                            "--max-num-batched-tokens", "16"],  # most texts span several steps
                           tmp_path / "server.log")
    try:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=120)
        ours = torch.tensor([d.embedding for d in client.embeddings.create(model=smollm2_path, input=TEXTS).data])
    finally:
        server.stop()
    cos = torch.nn.functional.cosine_similarity(ours, hf_pooled(smollm2_path, smollm2_gguf, TEXTS, "MEAN"), dim=-1)
    assert cos.min() >= 0.999, cos


def _pooled(path: str, kind: str, prompts: list[list[int]], **engine) -> tuple[torch.Tensor, int]:
    """The pooled results, and how many preemptions the engine made getting them."""
    llm = LLM(path, runner="pooling", pooler_config={"pooling_type": kind}, dtype="float32", **engine)
    try:
        outs = llm.encode([{"prompt_token_ids": p} for p in prompts], use_tqdm=False)
        return torch.stack([o.outputs.data for o in outs]), llm.llm_engine.get_stats().num_preemptions
    finally:
        llm.shutdown()


@pytest.mark.parametrize("kind", ["LAST", "MEAN", "CLS"])
def test_pooled_results_do_not_depend_on_chunking_caching_or_preemption(tiny_checkpoint, kind) -> None:
    path, _ = tiny_checkpoint("llama")
    g = torch.Generator().manual_seed(1)
    shared = torch.randint(1, 500, (40,), generator=g).tolist()
    prompts = [shared + torch.randint(1, 500, (n,), generator=g).tolist() for n in (3, 17, 60, 90, 120, 8)]
    ref, _ = _pooled(path, kind, prompts, enable_prefix_caching=False)
    # 12 blocks of 16 for six prompts of up to 160 tokens, prefilled side by side in
    # 8-token pieces: requests run out of blocks mid-prompt and are preempted.
    tight = {"num_gpu_blocks_override": 12, "max_num_batched_tokens": 32, "max_model_len": 160,
             "long_prefill_token_threshold": 8}
    variants = {
        "prefix caching": ({}, False),
        "chunks of 16": ({"max_num_batched_tokens": 16}, False),
        "preempted (recompute)": (tight, True),
        "preempted (swap)": ({**tight, "preemption_mode": "swap"}, True),
    }
    for name, (engine, preempts) in variants.items():
        got, preemptions = _pooled(path, kind, prompts, **engine)
        assert torch.allclose(got, ref, atol=1e-4), (name, (got - ref).abs().max())
        assert (preemptions > 0) == preempts, (name, preemptions)


def test_each_runner_refuses_the_others_requests(tiny_checkpoint) -> None:
    path, _ = tiny_checkpoint("llama")
    pooling = LLM(path, runner="pooling")
    try:
        with pytest.raises(ValueError, match="runner='generate'"):
            pooling.generate([[1, 2, 3]], use_tqdm=False)
        with pytest.raises(ValueError, match="classifier_from_token"):
            pooling.encode([[1, 2, 3]], PoolingParams(task="classify"), use_tqdm=False)
        with pytest.raises(ValueError, match="hidden size 64"):
            pooling.embed([[1, 2, 3]], PoolingParams(dimensions=65), use_tqdm=False)
        # vLLM's truncate_prompt_tokens: the embedding of the prompt's last tokens
        [cut] = pooling.embed([list(range(5, 40))], use_tqdm=False, truncate_prompt_tokens=6)
        [alone] = pooling.embed([list(range(34, 40))], use_tqdm=False)
        assert cut.prompt_token_ids == list(range(34, 40)) and cut.outputs.embedding == alone.outputs.embedding
        # vLLM's encode(..., pooling_task=): each request's task
        [pooled] = pooling.encode([list(range(34, 40))], use_tqdm=False, pooling_task="embed")
        assert pooled.outputs.data.tolist() == alone.outputs.embedding
        with pytest.raises(ValueError, match="classifier_from_token"):
            pooling.encode([[1, 2, 3]], use_tqdm=False, pooling_task="classify")
        with pytest.raises(ValueError, match="pooling_task must be one of embed, classify"):
            pooling.encode([[1, 2, 3]], use_tqdm=False, pooling_task="token_embed")
    finally:
        pooling.shutdown()
    generating = LLM(path)
    try:
        with pytest.raises(ValueError, match="runner='pooling'"):
            generating.embed([[1, 2, 3]], use_tqdm=False)
    finally:
        generating.shutdown()
