"""The runner's persistent per-request state, kept in fixed rows of preallocated arrays.

A request is described in full once (NewRequestData) and afterwards only by deltas
(CachedRequestData), so each step touches only what changed: appended tokens, new
block ids, the computed-token count.  Token ids and block tables live in numpy
arrays (one row per request) so that the runner can build a step's inputs with a
few vectorized gathers instead of per-token Python work.

Sampling tensors go up through pinned memory without blocking, so that preparing a
step never waits for the device (what overlap scheduling needs).  Under async
scheduling a row may also have one *pending* token: sampled by the previous step
and still only on the device; min_tokens and the penalties count it.
"""

from __future__ import annotations

import numpy as np
import torch

from pagedserve.core.sched_output import CachedRequestData, NewRequestData, SchedulerOutput
from pagedserve.platforms import is_cpu, is_cuda
from pagedserve.pooling_params import PoolingParams
from pagedserve.reasoning import ThinkingBudget
from pagedserve.sampling_params import SamplingParams
from pagedserve.utils import cdiv
from pagedserve.worker.sampler import SamplingMetadata


class InputBatch:
    def __init__(self, max_num_reqs: int, max_model_len: int, block_size: int, vocab_size: int,
                 device: torch.device, eos_token_id: int | None = None, num_kv_groups: int = 1) -> None:
        self.max_num_reqs = max_num_reqs
        self.max_model_len = max_model_len
        self.block_size = block_size
        self.max_blocks_per_req = cdiv(max_model_len, block_size)
        self.vocab_size = vocab_size
        self.device = device
        self.eos_token_id = eos_token_id
        self.token_ids = np.zeros((max_num_reqs, max_model_len), dtype=np.int32)  # token ids < 2**31
        self.num_tokens = np.zeros(max_num_reqs, dtype=np.int64)
        self.num_prompt_tokens = np.zeros(max_num_reqs, dtype=np.int64)
        self.long_rope = np.zeros(max_num_reqs, dtype=bool)  # NewRequestData.long_rope, per row
        self.num_computed_tokens = np.zeros(max_num_reqs, dtype=np.int64)
        # Per KV-cache group (core/kv_cache_manager.py): the scheduler sends a request's
        # block ids position-major over the groups, and each group's table is kept apart.
        self.num_kv_groups = num_kv_groups
        self.block_table = np.zeros((num_kv_groups, max_num_reqs, self.max_blocks_per_req), dtype=np.int32)
        self.num_blocks = np.zeros(max_num_reqs, dtype=np.int64)  # block positions, the same in every group
        self.req_id_to_row: dict[str, int] = {}
        self.params: dict[int, SamplingParams] = {}
        self.prompt_logprob_rows: set[int] = set()  # rows whose request wants prompt logprobs
        # Pooling requests' rows: they never sample (is_pooling masks them out of a step's samples).
        self.pooling_params: dict[int, PoolingParams] = {}
        self.is_pooling = np.zeros(max_num_reqs, dtype=bool)
        self.generators: dict[int, torch.Generator] = {}
        self.thinking: dict[int, ThinkingBudget] = {}  # rows under a thinking_token_budget
        self._free_rows = list(range(max_num_reqs - 1, -1, -1))  # pop() gives the lowest
        # Generators of preempted seeded requests: a resumed request continues its
        # random stream instead of restarting it.
        self._parked_generators: dict[str, torch.Generator] = {}

    # ----------------------------------------------------------- state updates
    def update_states(self, sched_out: SchedulerOutput) -> None:
        for req_id in sched_out.finished_req_ids:
            self.remove_request(req_id)
            self._parked_generators.pop(req_id, None)
        for req_id in sched_out.preempted_req_ids:
            gen = self.generators.get(self.req_id_to_row.get(req_id, -1))
            self.remove_request(req_id)
            if gen is not None:
                self._parked_generators[req_id] = gen
        for new in sched_out.scheduled_new_reqs:
            self.add_request(new)
        self.update_cached(sched_out.scheduled_cached_reqs)

    def add_request(self, new: NewRequestData) -> None:
        if new.req_id in self.req_id_to_row:
            self.remove_request(new.req_id)
        if not self._free_rows:
            raise ValueError(f"more than max_num_seqs={self.max_num_reqs} requests in the model runner")
        tokens = list(new.prompt_token_ids) + list(new.output_token_ids)
        if len(tokens) > self.max_model_len:
            raise ValueError(f"request {new.req_id!r} has {len(tokens)} tokens, more than "
                             f"max_model_len={self.max_model_len}")
        row = self._free_rows.pop()
        self.req_id_to_row[new.req_id] = row
        self.token_ids[row, : len(tokens)] = tokens
        self.num_tokens[row] = len(tokens)
        self.num_prompt_tokens[row] = len(new.prompt_token_ids)
        self.long_rope[row] = new.long_rope
        self.num_computed_tokens[row] = new.num_computed_tokens
        self.num_blocks[row] = 0
        self._append_blocks(row, new.block_ids)
        params = new.sampling_params
        self.params[row] = params
        if params.prompt_logprobs is not None:
            self.prompt_logprob_rows.add(row)
        if new.pooling_params is not None:
            self.pooling_params[row] = new.pooling_params
            self.is_pooling[row] = True
        if params.thinking_token_budget is not None and params.thinking_tags is not None:
            state = ThinkingBudget(params.thinking_token_budget, *params.thinking_tags)
            state.read(new.output_token_ids)  # (a preempted request's answer so far)
            self.thinking[row] = state
        if params.seed is not None and not params.is_greedy:
            gen = self._parked_generators.pop(new.req_id, None)
            if gen is None:
                gen = torch.Generator(device=self.device)
                gen.manual_seed(generator_seed(params.seed, self.device))
            self.generators[row] = gen

    def update_cached(self, cached: CachedRequestData) -> None:
        for i, req_id in enumerate(cached.req_ids):
            row = self.req_id_to_row.get(req_id)
            if row is None:
                raise ValueError(f"scheduler sent deltas for request {req_id!r}, unknown to the model runner")
            new_ids = cached.new_token_ids[i] if i < len(cached.new_token_ids) else []
            if new_ids:
                n = int(self.num_tokens[row])
                if n + len(new_ids) > self.max_model_len:
                    raise ValueError(f"request {req_id!r} would exceed max_model_len={self.max_model_len}")
                self.token_ids[row, n:n + len(new_ids)] = new_ids
                self.num_tokens[row] = n + len(new_ids)
                if row in self.thinking:
                    self.thinking[row].read(new_ids)
            if i < len(cached.new_block_ids):
                self._append_blocks(row, cached.new_block_ids[i])
            self.num_computed_tokens[row] = cached.num_computed_tokens[i]

    def write_draft_tokens(self, drafts: dict[str, list[int]]) -> None:
        """Speculative decoding: put each request's drafts after its known tokens, where
        the step reads its input ids; they stay unknown (num_tokens does not move) until
        verified and sent back as output tokens."""
        for req_id, ids in drafts.items():
            row = self.req_id_to_row[req_id]
            n = int(self.num_tokens[row])
            if n + len(ids) > self.max_model_len:
                raise ValueError(f"request {req_id!r}: {len(ids)} drafts after {n} tokens exceed "
                                 f"max_model_len={self.max_model_len}")
            self.token_ids[row, n:n + len(ids)] = ids

    def remove_request(self, req_id: str) -> None:
        row = self.req_id_to_row.pop(req_id, None)
        if row is None:
            return
        self.params.pop(row, None)
        self.prompt_logprob_rows.discard(row)
        if self.pooling_params.pop(row, None) is not None:
            self.is_pooling[row] = False
        self.generators.pop(row, None)
        self.thinking.pop(row, None)
        self._free_rows.append(row)
        self._free_rows.sort(reverse=True)

    def _append_blocks(self, row: int, block_ids: list[int]) -> None:
        if not block_ids:
            return
        g = self.num_kv_groups
        if len(block_ids) % g:
            raise ValueError(f"{len(block_ids)} new block ids do not fill whole positions of {g} KV-cache groups")
        n, k = int(self.num_blocks[row]), len(block_ids) // g
        if n + k > self.max_blocks_per_req:
            raise ValueError(f"block table overflow: {n + k} blocks for one request, "
                             f"max_model_len={self.max_model_len} allows {self.max_blocks_per_req}")
        self.block_table[:, row, n:n + k] = np.asarray(block_ids, dtype=np.int32).reshape(k, g).T
        self.num_blocks[row] = n + k

    @property
    def num_reqs(self) -> int:
        return len(self.req_id_to_row)

    # ----------------------------------------------------------------- sampling
    def upload(self, t: torch.Tensor) -> torch.Tensor:
        """Host tensor to the device without a host-device sync (pinned, non-blocking)."""
        if not is_cuda(self.device):
            return t
        return t.pin_memory().to(self.device, non_blocking=True)

    def sampling_metadata(self, rows: list[int],
                          pending: tuple[list[int], torch.Tensor] | None = None) -> SamplingMetadata:
        """The sampling knobs of `rows` (in this order), skipping every stage no row uses.
        `pending`: (indices into rows that have one pending token, those tokens on the
        device)."""
        params = [self.params[r] for r in rows]
        greedy = [p.is_greedy for p in params]
        metadata = SamplingMetadata(all_greedy=all(greedy), all_random=not any(greedy))

        def col(values, dtype=torch.float32) -> torch.Tensor:
            return self.upload(torch.tensor(values, dtype=dtype))

        if not metadata.all_greedy:
            metadata.temperature = col([1.0 if g else p.temperature for p, g in zip(params, greedy, strict=True)])
            if not metadata.all_random:
                metadata.greedy = col(greedy, torch.bool)
            vocab = self.vocab_size
            ks = [p.top_k if 0 < p.top_k < vocab and not g else vocab for p, g in zip(params, greedy, strict=True)]
            if any(k < vocab for k in ks):
                metadata.top_k = col(ks, torch.long)
            if any(p.top_p < 1.0 and not g for p, g in zip(params, greedy, strict=True)):
                metadata.top_p = col([1.0 if g else p.top_p for p, g in zip(params, greedy, strict=True)])
            if any(p.min_p > 0 and not g for p, g in zip(params, greedy, strict=True)):
                metadata.min_p = col([0.0 if g else p.min_p for p, g in zip(params, greedy, strict=True)])
            metadata.generators = {i: self.generators[r] for i, r in enumerate(rows) if r in self.generators}
        self._penalties(metadata, rows, params, pending)
        self._min_tokens(metadata, rows, params, pending)
        self._logit_edits(metadata, params, self._thinking_ends(rows, pending))
        wanted = [p.logprobs for p in params if p.logprobs is not None]
        metadata.max_num_logprobs = max(wanted) if wanted else None
        return metadata

    def _penalties(self, metadata: SamplingMetadata, rows: list[int], params: list[SamplingParams],
                   pending: tuple[list[int], torch.Tensor] | None) -> None:
        rep = any(p.repetition_penalty != 1.0 for p in params)
        freq = any(p.frequency_penalty != 0.0 for p in params)
        pres = any(p.presence_penalty != 0.0 for p in params)
        if not (rep or freq or pres):
            return

        def col(name: str) -> torch.Tensor:
            return self.upload(torch.tensor([getattr(p, name) for p in params], dtype=torch.float32))[:, None]

        start, end = self.num_prompt_tokens[rows], self.num_tokens[rows]
        if pending is None or not pending[0]:
            metadata.output_token_ids = self._padded_tokens(rows, start, end)
        else:  # one more column for each pending token, filled in on the device
            idx, tokens = pending
            end = end.copy()
            end[idx] += 1
            ids = self._padded_tokens(rows, start, end, valid_end=self.num_tokens[rows])
            cols = end[idx] - 1 - start[idx]
            ids[self.upload(torch.tensor(idx)), self.upload(torch.from_numpy(cols))] = tokens
            metadata.output_token_ids = ids
        if rep:
            metadata.repetition_penalty = col("repetition_penalty")
            metadata.prompt_token_ids = self._padded_tokens(rows, np.zeros(len(rows), np.int64),
                                                      self.num_prompt_tokens[rows])
        if freq:
            metadata.frequency_penalty = col("frequency_penalty")
        if pres:
            metadata.presence_penalty = col("presence_penalty")

    def _padded_tokens(self, rows: list[int], start: np.ndarray, end: np.ndarray,
                       valid_end: np.ndarray | None = None) -> torch.Tensor:
        """token_ids[row, start:end] per row, padded with vocab_size (a column the
        penalties drop), as one [N, max_len] device tensor; columns past `valid_end`
        are padding too."""
        width = max(1, int((end - start).max()))
        cols = start[:, None] + np.arange(width)[None, :]
        valid = cols < (end if valid_end is None else valid_end)[:, None]
        ids = self.token_ids[np.asarray(rows)[:, None], np.minimum(cols, self.max_model_len - 1)]
        ids = np.where(valid, ids, self.vocab_size).astype(np.int64)
        return self.upload(torch.from_numpy(ids))

    def _min_tokens(self, metadata: SamplingMetadata, rows: list[int], params: list[SamplingParams],
                    pending: tuple[list[int], torch.Tensor] | None) -> None:
        """Tokens to forbid this step, as (row, token) pairs: EOS and stop ids before
        min_tokens, and the last token of a bad word whose other tokens the output ends
        with.  Under overlap scheduling a row's newest token may still be on the device:
        min_tokens counts it, and a bad word whose prefix ends with it holds where the
        device's token is the prefix's last (banned_if; it saw only the host's tokens, so
        the word got through, and a word the host's tail matched banned a token wrongly)."""
        ban_rows: list[int] = []
        ban_tokens: list[int] = []
        needs: list[tuple[int, int]] = []  # per pair: (its pending token's index, the token it must be), or (-1, 0)
        pend = {row_index: j for j, row_index in enumerate(pending[0])} if pending is not None else {}
        for i, (row, p) in enumerate(zip(rows, params, strict=True)):
            num_out = self.num_tokens[row] - self.num_prompt_tokens[row] + (i in pend)
            if p.min_tokens and num_out < p.min_tokens:
                stops = set(p.stop_token_ids or ())
                if not p.ignore_eos and self.eos_token_id is not None:
                    stops.add(self.eos_token_id)
                stops = [t for t in stops if 0 <= t < self.vocab_size]
                ban_rows += [i] * len(stops)
                ban_tokens += stops
                needs += [(-1, 0)] * len(stops)
            if p.bad_words_token_ids:
                end, start = int(self.num_tokens[row]), int(self.num_prompt_tokens[row])
                out = self.token_ids[row, start:end]
                for seq in p.bad_words_token_ids:
                    prefix, need = seq[:-1], (-1, 0)
                    if prefix and i in pend:  # (its last token is the one on the device)
                        prefix, need = prefix[:-1], (pend[i], prefix[-1])
                    if len(prefix) <= len(out) and (not prefix or out[len(out) - len(prefix):].tolist() == prefix):
                        ban_rows.append(i)
                        ban_tokens.append(seq[-1])
                        needs.append(need)
        if ban_rows:
            metadata.banned_rows = self.upload(torch.tensor(ban_rows, dtype=torch.long))
            metadata.banned_tokens = self.upload(torch.tensor(ban_tokens, dtype=torch.long))
            if pending is not None and any(j >= 0 for j, _ in needs):
                index = self.upload(torch.tensor([max(j, 0) for j, _ in needs], dtype=torch.long))
                wanted = self.upload(torch.tensor([t for _, t in needs], dtype=torch.long))
                conditional = self.upload(torch.tensor([j >= 0 for j, _ in needs], dtype=torch.bool))
                metadata.banned_if = ~conditional | (pending[1].to(torch.long)[index] == wanted)

    def _thinking_ends(self, rows: list[int], pending: tuple[list[int], torch.Tensor] | None) -> dict[int, int]:
        """{index into rows: its end tag} for the rows whose thinking budget is spent
        inside a block (pagedserve/reasoning.py).  A pending token decides whether the
        block is still open: such rows' are read from the device (a wait, for them only)."""
        if not self.thinking:
            return {}
        read: dict[int, int] = {}
        if pending is not None:
            mine = [j for j, i in enumerate(pending[0]) if rows[i] in self.thinking]
            if mine:
                tokens = pending[1].tolist()
                read = {pending[0][j]: int(tokens[j]) for j in mine}
        return {i: self.thinking[r].end_id for i, r in enumerate(rows)
                if r in self.thinking and self.thinking[r].must_end(read.get(i))}

    def _logit_edits(self, metadata: SamplingMetadata, params: list[SamplingParams], ends: dict[int, int]) -> None:
        """logit_bias as (row, token, bias) triples; allowed_token_ids as (row, token)
        pairs that stay, every other token of those rows forbidden; `ends` (row -> token):
        that token alone allowed (a spent thinking budget's end tag)."""
        bias = [(i, t, b) for i, p in enumerate(params) if p.logit_bias for t, b in p.logit_bias.items()]
        if bias:
            r, t, b = zip(*bias, strict=True)
            metadata.bias_rows = self.upload(torch.tensor(r, dtype=torch.long))
            metadata.bias_tokens = self.upload(torch.tensor(t, dtype=torch.long))
            metadata.bias_values = self.upload(torch.tensor(b, dtype=torch.float32))
        allowed = [(i, t) for i, p in enumerate(params) if p.allowed_token_ids and i not in ends
                   for t in p.allowed_token_ids] + list(ends.items())
        if allowed:
            r, t = zip(*allowed, strict=True)
            metadata.allowed_rows = self.upload(torch.tensor(sorted(set(r)), dtype=torch.long))
            metadata.allowed_pairs = (self.upload(torch.tensor(r, dtype=torch.long)),
                                self.upload(torch.tensor(t, dtype=torch.long)))


def generator_seed(seed: int, device: torch.device) -> int:
    """What a seed seeds a generator on `device` with.  torch's CPU generator (mt19937)
    keeps a seed's low 32 bits, so seeds 2**32 apart sampled alike (and an n > 1 child's
    seed + index met another request's seed): there a seed outside [0, 2**32) is mixed
    down (splitmix64's finaliser, its halves xored), and one inside stays itself.  CUDA's
    Philox takes all 64 bits: the seed as it is."""
    if 0 <= seed < 2**32 or not is_cpu(device):
        return seed
    z = seed % 2**64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) % 2**64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) % 2**64
    z ^= z >> 31
    return (z ^ (z >> 32)) & 0xFFFFFFFF
