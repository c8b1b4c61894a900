"""A tiny decoder with the models-area contract, for runner tests that must not
depend on real checkpoints: forward(input_ids [T], positions [T]) -> hidden [T, E],
compute_logits(hidden) -> float logits, attention through pagedserve's Attention."""

from __future__ import annotations

from types import SimpleNamespace

import torch
from torch import nn

from pagedserve.config import CacheConfig, DeviceConfig, EngineConfig, ModelConfig, SchedulerConfig
from pagedserve.forward_context import set_forward_context
from pagedserve.layers.attention import Attention


class ToyLayer(nn.Module):
    def __init__(self, hidden: int, heads: int, kv_heads: int, head_dim: int, window: int | None = None) -> None:
        super().__init__()
        self.q_size, self.kv_size = heads * head_dim, kv_heads * head_dim
        self.qkv = nn.Linear(hidden, self.q_size + 2 * self.kv_size)
        self.o = nn.Linear(self.q_size, hidden)
        self.mlp = nn.Sequential(nn.Linear(hidden, 2 * hidden), nn.GELU(), nn.Linear(2 * hidden, hidden))
        self.attn = Attention(heads, head_dim, head_dim**-0.5, kv_heads, sliding_window=window)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).split([self.q_size, self.kv_size, self.kv_size], -1)
        x = x + self.o(self.attn(q.contiguous(), k.contiguous(), v.contiguous()))
        return x + self.mlp(x)


class ToyModel(nn.Module):
    def __init__(self, vocab: int = 97, hidden: int = 64, heads: int = 4, kv_heads: int = 2, head_dim: int = 16,
                 layers: int = 2, max_pos: int = 1024, seed: int = 0, window: int | None = None) -> None:
        """`window`: every layer attends a sliding window of that many tokens."""
        super().__init__()
        torch.manual_seed(seed)
        self.embed = nn.Embedding(vocab, hidden)
        self.pos = nn.Embedding(max_pos, hidden)  # positions must matter
        self.layers = nn.ModuleList(ToyLayer(hidden, heads, kv_heads, head_dim, window) for _ in range(layers))
        self.lm_head = nn.Linear(hidden, vocab, bias=False)
        with torch.no_grad():
            self.lm_head.weight.mul_(8.0)  # peaked distributions: greedy far from ties

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        x = self.embed(input_ids) + self.pos(positions)
        for layer in self.layers:
            x = layer(x)
        return x

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()

    @torch.inference_mode()
    def reference_logits(self, token_ids: list[int]) -> torch.Tensor:
        """Logits after every prefix, recomputed from scratch without any cache."""
        ids = torch.tensor(token_ids)
        with set_forward_context(None):
            return self.compute_logits(self(ids, torch.arange(len(ids))))


def toy_config(block_size: int = 16, max_model_len: int = 256, max_num_seqs: int = 8,
               max_num_batched_tokens: int = 512, kv_cache_memory_bytes: int | None = None,
               vocab: int = 97, eos: int = 1) -> EngineConfig:
    hf = SimpleNamespace(vocab_size=vocab, eos_token_id=eos)
    # Not compiled: EngineArgs would read $PAGEDSERVE_TORCH_COMPILE (off in tests), but a
    # config built here would compile each toy runner on the CPU (~5 s each, and far
    # longer on the GPU machine: test_cuda_graph.py never got past its first planning
    # test there, in two runs, most likely for this).
    return EngineConfig(
        device_config=DeviceConfig(torch_compile=False),
        model_config=ModelConfig(model="toy", hf_config=hf, seed=0),
        cache_config=CacheConfig(block_size=block_size, kv_cache_memory_bytes=kv_cache_memory_bytes),
        scheduler_config=SchedulerConfig(max_num_seqs=max_num_seqs, max_model_len=max_model_len,
                                         max_num_batched_tokens=max_num_batched_tokens),
    )


class Driver:
    """A minimal stand-in for the core scheduler: token budget, chunked prefill,
    prefix sharing by whole blocks, preemption by recompute, scattered block ids.
    It exercises the runner through SchedulerOutput exactly as the contract says."""

    def __init__(self, runner, num_blocks: int, budget: int, seed: int = 0) -> None:
        self.runner, self.budget, self.bs = runner, budget, runner.block_size
        g = torch.Generator().manual_seed(seed)
        self.free = (torch.randperm(num_blocks - 1, generator=g) + 1).tolist()  # block 0 is null
        self.refs: dict[int, int] = {}
        self.reqs: dict[str, dict] = {}
        self.finished: set[str] = set()
        self.preempted: set[str] = set()
        self.outputs: list = []

    def add(self, req_id: str, prompt: list[int], params, max_tokens: int, share_from: str | None = None,
            shared_blocks: int = 0) -> None:
        blocks = []
        if share_from is not None:
            blocks = self.reqs[share_from]["blocks"][:shared_blocks]
            for b in blocks:
                self.refs[b] += 1
        self.reqs[req_id] = dict(tokens=list(prompt), prompt_len=len(prompt), out=[], params=params,
                                 max_tokens=max_tokens, blocks=list(blocks), computed=len(blocks) * self.bs,
                                 sent=None, unsent_blocks=[])

    def preempt(self, req_id: str) -> None:
        r = self.reqs[req_id]
        self._free(r["blocks"])
        r.update(blocks=[], computed=0, sent=None)
        self.preempted.add(req_id)

    def _free(self, blocks: list[int]) -> None:
        for b in blocks:
            self.refs[b] -= 1
            if self.refs[b] == 0:
                del self.refs[b]
                self.free.append(b)

    def _alloc(self, r: dict, upto: int) -> list[int]:
        new = []
        while len(r["blocks"]) * self.bs < upto:
            b = self.free.pop()
            self.refs[b] = 1
            r["blocks"].append(b)
            new.append(b)
        return new

    def step(self):
        from pagedserve.core.sched_output import CachedRequestData, NewRequestData, SchedulerOutput

        budget, sched, new_reqs, cached = self.budget, {}, [], CachedRequestData()
        for req_id, r in self.reqs.items():
            n = min(len(r["tokens"]) - r["computed"], budget)
            if n <= 0:
                continue
            new_blocks = self._alloc(r, r["computed"] + n)
            if r["sent"] is None:
                new_reqs.append(NewRequestData(req_id, r["tokens"][: r["prompt_len"]], list(r["out"]), r["params"],
                                               list(r["blocks"]), r["computed"]))
            else:
                cached.req_ids.append(req_id)
                cached.new_token_ids.append(r["out"][r["sent"]:])
                cached.new_block_ids.append(new_blocks)
                cached.num_computed_tokens.append(r["computed"])
            r["sent"] = len(r["out"])
            sched[req_id] = n
            r["computed"] += n
            budget -= n
        so = SchedulerOutput(new_reqs, cached, sched, sum(sched.values()), self.preempted, self.finished)
        self.preempted, self.finished = set(), set()
        out = self.runner.execute_model(so)
        self.outputs.append((so, out))
        for req_id, toks in out.sampled_token_ids.items():
            r = self.reqs[req_id]
            assert r["computed"] == len(r["tokens"]), "a token was sampled for an unfinished prompt"
            r["out"] += toks
            r["tokens"] += toks
            if len(r["out"]) >= r["max_tokens"]:
                self._free(r["blocks"])
                self.finished.add(req_id)
        for req_id in self.finished:
            self.done[req_id] = self.reqs.pop(req_id)
        return out

    @property
    def done(self) -> dict:
        if not hasattr(self, "_done"):
            self._done = {}
        return self._done

    def run(self, max_steps: int = 1000) -> dict:
        for _ in range(max_steps):
            if not self.reqs:
                self.step()  # deliver the last finished ids
                return self.done
            self.step()
        raise AssertionError("requests did not finish")
