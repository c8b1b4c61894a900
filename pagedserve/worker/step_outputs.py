"""What a step computes from its hidden states besides the sampled tokens: prompt
logprobs, pooling requests' results, and the draft rows' logits and logprobs under
speculative decoding.

Why apart from the model runner: these read the step's layout (query_start_loc, the
InputBatch rows) but decide nothing about the step itself; as functions of plain
arguments they are testable without a runner and keep its step loop short.
"""

from __future__ import annotations

import numpy as np
import torch

from pagedserve.layers.pooler import LogitsModel, Pooler, pooled_outputs
from pagedserve.worker.input_batch import InputBatch
from pagedserve.worker.rejection_sampler import DraftVerdict
from pagedserve.worker.runner_output import LogprobsEntry, logprobs_entries
from pagedserve.worker.sampler import Sampler, SamplerOutput

# The [rows, vocab] float32 logits block prompt_logprobs scores per compute_logits call:
# its rows follow from the vocabulary (85 positions at 49k, 16 at Gemma's 262k), so the
# extra memory of a prompt's logprobs is this block, normalised in place, whatever the
# prompt's length (512 rows at a time added ~350 MiB at peak at a 49k vocabulary).
PROMPT_LOGPROBS_BLOCK_BYTES = 16 << 20


def prompt_logprobs(model: LogitsModel, ib: InputBatch, query_start_loc: np.ndarray, req_ids: list[str],
                    hidden: torch.Tensor, vocab_size: int) -> dict[str, tuple[int, list[LogprobsEntry]]]:
    """Logprobs of the prompt tokens this step's hidden states predict, for requests that
    asked (`prompt_logprobs` top ones each): the state at prompt position p scores prompt
    token p + 1.  Rows go through compute_logits a PROMPT_LOGPROBS_BLOCK_BYTES block at a
    time, so a long prompt costs a bounded [rows, vocab] of float32 per pass (all of an
    8k-token chunk's rows at once took 6 GB for a 49k vocabulary)."""
    rows_per_pass = max(1, PROMPT_LOGPROBS_BLOCK_BYTES // (4 * vocab_size))
    qsl = query_start_loc
    out: dict[str, tuple[int, list[LogprobsEntry]]] = {}
    for i, req_id in enumerate(req_ids):
        row = ib.req_id_to_row[req_id]
        if row not in ib.prompt_logprob_rows:
            continue
        start = int(ib.num_computed_tokens[row])
        end = min(start + int(qsl[i + 1] - qsl[i]), int(ib.num_prompt_tokens[row]) - 1)
        entries: list[LogprobsEntry] = []
        for c0 in range(0, end - start, rows_per_pass):
            count = min(rows_per_pass, end - start - c0)
            entries += _score_prompt_rows(model, ib, row, hidden, int(qsl[i]) + c0, start + c0, count)
        if entries:
            out[req_id] = (start + 1, entries)
    return out


def _score_prompt_rows(model: LogitsModel, ib: InputBatch, row: int, hidden: torch.Tensor, first: int,
                       pos: int, count: int) -> list[LogprobsEntry]:
    """One pass: the `count` hidden rows from flat index `first` (prompt positions from
    `pos`) score the prompt tokens after them; nothing on a tensor-parallel rank > 0."""
    index = torch.arange(first, first + count, device=hidden.device)
    logits = model.compute_logits(hidden.index_select(0, index))
    if logits is None:  # a tensor-parallel rank > 0 (it still took part in the collective)
        return []
    lp = logits.float()  # compute_logits' own tensor (or a copy): normalised in place
    del logits
    lp -= lp.logsumexp(-1, keepdim=True)
    targets = torch.from_numpy(ib.token_ids[row, pos + 1: pos + 1 + count].astype(np.int64))
    target_lp = lp.gather(1, targets.to(lp.device)[:, None])
    ranks = ((lp > target_lp).sum(-1) + 1).tolist()
    k = ib.params[row].prompt_logprobs
    top_lp, top_ids = lp.topk(k, dim=-1) if k else (lp[:, :0], lp[:, :0].long())
    return [LogprobsEntry(t, v, r, ids, vals) for t, v, r, ids, vals in zip(
        targets.tolist(), target_lp.squeeze(1).tolist(), ranks, top_ids.tolist(), top_lp.tolist(), strict=True)]


def pool(pooler: Pooler, model: LogitsModel, ib: InputBatch, query_start_loc: np.ndarray, req_ids: list[str],
         hidden: torch.Tensor) -> dict[str, torch.Tensor]:
    """Fold this step's hidden states of each pooling request's prompt positions into
    its pooled state (layers/pooler.py); the requests whose prompt this step completed
    get their result."""
    qsl = query_start_loc
    done = {}
    for i, req_id in enumerate(req_ids):
        row = ib.req_id_to_row[req_id]
        params = ib.pooling_params.get(row)
        if params is None:
            continue
        state = pooler.fold(req_id, params, hidden[int(qsl[i]): int(qsl[i + 1])],
                            int(ib.num_computed_tokens[row]), int(ib.num_prompt_tokens[row]))
        if state is not None:
            done[req_id] = (params, state)
    return pooled_outputs(model, done) if done else {}


def draft_logits(model: LogitsModel, query_start_loc: np.ndarray, req_ids: list[str], spec_ids: list[str],
                 drafts: dict[str, list[int]], hidden: torch.Tensor) -> torch.Tensor | None:
    """Logits of the rows that predict each request's drafts (the k rows ahead of its
    last query row, which the ordinary sampler takes), for `spec_ids` (the requests
    with drafts, in step order); None on tensor-parallel ranks > 0."""
    qsl = query_start_loc
    ends = [int(qsl[i + 1]) - 1 for i, r in enumerate(req_ids) if r in drafts]
    flat = np.concatenate([np.arange(end - len(drafts[r]), end) for end, r in zip(ends, spec_ids, strict=True)])
    return model.compute_logits(hidden.index_select(0, torch.from_numpy(flat).to(hidden.device)))


def draft_logprobs(ib: InputBatch, spec_ids: list[str], drafts: dict[str, list[int]], verdicts: list[DraftVerdict],
                   logits: torch.Tensor) -> dict[str, list[LogprobsEntry]]:
    """Logprobs (raw model distribution, as for sampled tokens) of the tokens the draft
    rows emitted: the accepted drafts and the replacement of the first rejected one."""
    ks = [ib.params[ib.req_id_to_row[r]].logprobs for r in spec_ids]
    if all(k is None for k in ks):
        return {}
    rows: list[int] = []
    emitted: list[int] = []
    counts: list[int] = []  # tokens each request's draft rows emitted
    start = 0
    for r, v in zip(spec_ids, verdicts, strict=True):
        d = drafts[r]
        counts.append(v.num_accepted + (v.replacement is not None))
        rows += range(start, start + counts[-1])
        emitted += d[: v.num_accepted] + ([v.replacement] if v.replacement is not None else [])
        start += len(d)
    index = torch.tensor(rows, dtype=torch.long, device=logits.device)
    raw = logits.index_select(0, index).float().log_softmax(-1)
    lp = SamplerOutput(torch.tensor(emitted, dtype=torch.long, device=logits.device))
    Sampler.gather_logprobs(raw, lp.sampled_token_ids, max(k or 0 for k in ks), lp)
    row_ks = [k for k, n in zip(ks, counts, strict=True) for _ in range(n)]
    entries = logprobs_entries(
        emitted, lp.sampled_logprobs.tolist(), lp.sampled_ranks.tolist(),
        lp.topk_token_ids.tolist() if lp.topk_token_ids is not None else None,
        lp.topk_logprobs.tolist() if lp.topk_logprobs is not None else None, row_ks)
    out: dict[str, list[LogprobsEntry]] = {}
    i = 0
    for r, k, n in zip(spec_ids, ks, counts, strict=True):
        if k is not None:
            out[r] = entries[i: i + n]
        i += n
    return out
