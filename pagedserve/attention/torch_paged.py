"""TorchPagedBackend: paged attention from plain torch ops, fast enough for CPU decode.

Why it is shaped like this (measured on 2 Zen 4 cores, SmolLM2 shapes, bf16):
  * Per-request Python loops per layer cost more than the math, so requests are
    attended in a few padded *groups*, planned once per step in `build_metadata`:
    decodes (one query token) grouped by context length, prefill chunks with prefill
    chunks.  A long prefill is cut into query chunks (each causal with its own
    offset) so no group's score matrix outgrows GROUP_MAX_AREA.
  * GQA is folded into the rows: the G query heads of one KV head (times the query
    tokens) are the rows of one matmul against that KV head, so K/V are never
    repeated and every matmul is a plain batched GEMM over contiguous operands.
    This beats torch SDPA on CPU by 2-3x for decode, and for prefill in 16 bits.
    Float32 prefill chunks go to SDPA's fused kernel instead (`_prefill_fused`).
  * The paged gather copies whole blocks (`index_select` over the block axis: one
    contiguous block_size x Hkv x D chunk per block), then one transposing copy puts
    K and V in the [Hkv, B*L, D] layout the matmuls read.  In a real step every
    layer's cache is cold, and the gather is bound by memory latency: whole-block
    chunks stream, where per-slot or per-head row gathers (and advanced indexing)
    cost twice as much; the transpose then runs on cache-hot data.
  * Gather buffers come from a grow-only workspace shared by all layers: fresh
    multi-MB tensors every layer cost more in page faults than the gather itself.
  * Padded keys (the tail of a request's last block; block-table columns past its
    context, which read the null block) are hidden by an additive -inf mask built
    once per step.  A mask cannot hide NaN, and cache memory that was never written
    may hold NaN bit patterns, so a block is zeroed in the step that writes its first
    slot (offset 0: every block is filled from its start, since prefix-cache hits are
    whole blocks) unless that step also writes its last; the unwritten tail of any
    block read is then zero.  That costs two small fills per layer in the steps that
    open blocks and nothing in the others, where zeroing the padding of every gathered
    copy cost ~5% of a decode step (and zeroing the blocks a prompt fills whole, ~1% of
    its prefill: 40 ms of a 512-token prompt at the 1.7B shape on a Zen 5).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from pagedserve.attention import kv_dtype
from pagedserve.attention.backend import AttentionBackend, CommonAttentionMetadata
from pagedserve.config import MAX_SPECULATIVE_TOKENS
from pagedserve.utils import cdiv

# Padded (query, key) cells one group may hold: bounds the score matrices and the
# workspace; a longer prefill is split into query chunks under it.
GROUP_MAX_AREA = 1 << 20
GROUP_MAX_KV = 1 << 15  # padded keys (requests x kv_len) one group may gather
# Fixed cost of one more group, in padded cells: about what a group's ~12 ops per
# layer cost compared with the per-cell matmul and gather cost.
GROUP_OVERHEAD_CELLS = 3072
BIAS_EXPAND_MAX = 1 << 18  # elements: masks up to this size are materialised per step
# A request with at most this many new tokens attends them as that many one-token decode
# rows (each over its own context length), so each row is computed exactly as a one-token
# step computes it: speculative decoding's verified drafts then match decoding one token
# at a time bit for bit, and short chunks take the native decode kernel.
DECODE_ROWS_MAX_TOKENS = MAX_SPECULATIVE_TOKENS + 1
# Decode groups with at most this many KV heads attend all heads in one matmul pair
# (`_decode_all_heads`); more heads would multiply the wasted score work.
FOLD_HEADS_MAX_KV = 4

# One unit of work: (query tokens, keys it sees, first query row, request index).
Item = tuple[int, int, int, int]


@dataclass
class AttnGroup:
    """Requests attended as one padded batch: `num_reqs` x `q_len` queries over `kv_len` keys."""

    num_reqs: int
    q_len: int
    kv_len: int
    token_idx: torch.Tensor | None  # [B*Q] query rows to read (padding reads row 0); None: rows 0..B*Q-1
    out_idx: torch.Tensor | None  # [B*Q] output rows to write (padding writes the scratch row T)
    # The torch path's gather plan, built by the first layer that reads it: a step whose
    # layers all take a decode kernel never pays for it (~20 small tensor ops a step).
    plan: Callable[[], tuple[torch.Tensor, torch.Tensor]] = field(repr=False)
    # Decode groups (Q == 1), for a kernel that walks the block table itself (cpu_paged):
    block_table: torch.Tensor | None = None  # [B, >= blocks of the longest context] int32
    seq_lens: torch.Tensor | None = None  # [B] int32
    window: int = 0  # the sliding window (0: none)
    # One request whose queries are its first tokens (no earlier context) and no window:
    # query row i sees keys 0..i, which is SDPA's is_causal (the padding keys lie past them).
    causal_from_zero: bool = False
    _bias: dict = field(default_factory=dict, repr=False)
    _plan_made: tuple[torch.Tensor, torch.Tensor] | None = field(default=None, repr=False)

    @property
    def blocks(self) -> torch.Tensor:
        """[B*L/block_size] block ids (0, the null block, past a request's context)."""
        return self._planned()[0]

    @property
    def masked(self) -> torch.Tensor:
        """[B, Q, L] bool, True where a key is not visible."""
        return self._planned()[1]

    def _planned(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self._plan_made is None:
            self._plan_made = self.plan()
        return self._plan_made

    def sdpa_mask(self, dtype: torch.dtype) -> torch.Tensor:
        """[B, 1, Q, L] additive mask (-inf where a key is hidden) for SDPA, built by the
        first layer: a boolean one SDPA would turn into this anew in every layer."""
        key = ("sdpa", dtype)
        if key not in self._bias:
            m = torch.zeros(self.masked.shape, dtype=dtype, device=self.masked.device)
            self._bias[key] = m.masked_fill_(self.masked, float("-inf")).unsqueeze(1)
        return self._bias[key]

    def heads_bias(self, num_heads: int, num_kv_heads: int, dtype: torch.dtype) -> torch.Tensor:
        """Decode groups attended over all KV heads at once: [B, H, L*Hkv], -inf where the
        key is hidden or belongs to another query head's KV head."""
        key = ("heads", num_heads, num_kv_heads, dtype)
        if key not in self._bias:
            b, _, L = self.masked.shape
            dev = self.masked.device
            other = (torch.arange(num_heads, device=dev)[:, None] // (num_heads // num_kv_heads)
                     != torch.arange(num_kv_heads, device=dev)[None, :])  # [H, Hkv]
            hidden = self.masked[:, 0, None, :, None] | other[None, :, None, :]  # [B, H, L, Hkv]
            m = torch.zeros(b, num_heads, L * num_kv_heads, dtype=dtype, device=dev)
            self._bias[key] = m.masked_fill_(hidden.reshape(b, num_heads, L * num_kv_heads), float("-inf"))
        return self._bias[key]

    def bias(self, num_kv_heads: int, group: int, dtype: torch.dtype) -> torch.Tensor:
        """The additive mask in the compute dtype, built by the first layer: expanded to
        the scores' [Hkv*B, Q*G, L] when small (decode: baddbmm then fuses it), else
        [1, B, Q, 1, L] for broadcasting (for long prefills the expanded mask would be
        as big as the scores, and it lives for the whole step)."""
        key = (num_kv_heads, group, dtype)
        if key not in self._bias:
            b, q, L = self.masked.shape
            m = torch.zeros(b, q, L, dtype=dtype, device=self.masked.device)
            m = m.masked_fill_(self.masked, float("-inf"))[None, :, :, None, :]
            if num_kv_heads * b * q * group * L <= BIAS_EXPAND_MAX:
                m = m.expand(num_kv_heads, b, q, group, L).reshape(num_kv_heads * b, q * group, L)
            self._bias[key] = m
        return self._bias[key]


@dataclass
class TorchPagedMetadata:
    common: CommonAttentionMetadata
    groups: list[AttnGroup]
    fresh_blocks: torch.Tensor | None  # blocks whose first slot is written this step: zeroed first
    slots: torch.Tensor  # [T] the new tokens' cache slots (slot_mapping[:T])
    # One group holding every token in batch order, unpadded (the usual all-decode
    # step): its output is the layer's output, with no scatter.
    identity: bool = False


class _Workspace(threading.local):
    """Grow-only scratch per (device, dtype), shared by every layer of a step; per thread
    (several models' engines step at once on their own threads)."""

    def __init__(self) -> None:
        self._bufs: dict[tuple[torch.device, torch.dtype, bool], torch.Tensor] = {}

    def get(self, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        # Inference-mode tensors cannot be written outside inference mode (and vice
        # versa for views): one buffer per mode, for callers that mix them.
        key = (device, dtype, torch.is_inference_mode_enabled())
        buf = self._bufs.get(key)
        if buf is None or buf.numel() < numel:
            buf = torch.empty(max(numel, 1), dtype=dtype, device=device)
            self._bufs[key] = buf
        return buf[:numel]


_WORKSPACE = _Workspace()


def _gather_blocks(g: AttnGroup, k_cache: torch.Tensor, v_cache: torch.Tensor, out: torch.Tensor) -> None:
    """The group's blocks of K and V into out[0] and out[1] ([blocks, block_size, Hkv, D]
    each, in out's dtype): whole-block copies, a narrower cache (kv_cache_dtype)
    converted as it is gathered."""
    for dst, cache in zip(out.unbind(0), (k_cache, v_cache), strict=True):
        if cache.dtype == out.dtype:
            torch.index_select(cache, 0, g.blocks, out=dst)
        else:
            dst.copy_(kv_dtype.gather(cache, g.blocks, out.dtype))


def plan_groups(items: list[Item]) -> list[list[Item]]:
    """Split work items into groups whose padding is worth its cost.

    Greedy over items sorted by (q_len, seq_len): an item joins the current group
    unless the padded area it would add costs more than starting a new group."""
    groups: list[list[Item]] = []
    cur: list[Item] = []
    cur_q = cur_l = 0
    for item in sorted(items):
        q, s = item[0], item[1]
        if cur:
            nq, nl = max(cur_q, q), max(cur_l, s)
            padded = (len(cur) + 1) * nq * nl
            separate = len(cur) * cur_q * cur_l + q * s + GROUP_OVERHEAD_CELLS
            if padded <= separate and padded <= GROUP_MAX_AREA and (len(cur) + 1) * nl <= GROUP_MAX_KV:
                cur.append(item)
                cur_q, cur_l = nq, nl
                continue
            groups.append(cur)
        cur, cur_q, cur_l = [item], q, s
    if cur:
        groups.append(cur)
    return groups


class TorchPagedBackend(AttentionBackend):
    name = "torch_paged"

    @classmethod
    def build_metadata(cls, common: CommonAttentionMetadata) -> TorchPagedMetadata:
        qsl, seq_lens, exact = common.query_start_loc_cpu, common.seq_lens_cpu, common.exact_rows_context
        items: list[Item] = []  # prefill chunks
        rows: list[Item] = []  # one-token decode rows
        for i in range(common.num_reqs):
            n, s = qsl[i + 1] - qsl[i], seq_lens[i]
            if n <= 0:
                continue
            if n > s:
                raise ValueError(f"attention metadata: request {i} has {n} new tokens but seq_len {s}")
            first = s - n  # the first new token's position
            # Short chunks, and every row below the exact horizon, as decode rows.
            m = n if n <= DECODE_ROWS_MAX_TOKENS else min(n, max(0, exact - first))
            rows += [(1, first + j + 1, qsl[i] + j, i) for j in range(m)]
            if m == n:
                continue
            chunk = n - m if (n - m) * s <= GROUP_MAX_AREA else max(1, GROUP_MAX_AREA // s)
            for c0 in range(m, n, chunk):
                c1 = min(n, c0 + chunk)
                items.append((c1 - c0, first + c1, qsl[i] + c0, i))
        # With an exact horizon the decode kernel serves every layer: all decode rows are one
        # call however long their contexts (padding is the torch path's cost, not its).
        planned = (plan_groups(items) + [rows]) if exact and rows else plan_groups(items + rows)
        # Within a group, batch order: an all-decode step then reads and writes rows in place.
        groups = [cls._build_group(common, sorted(g, key=lambda it: it[2])) for g in planned]
        g0 = groups[0] if len(groups) == 1 else None
        identity = g0 is not None and g0.token_idx is None and g0.num_reqs * g0.q_len == common.num_actual_tokens
        slots = common.slot_mapping[: common.num_actual_tokens]
        return TorchPagedMetadata(common, groups, cls._fresh_blocks(common, slots), slots, identity)

    @staticmethod
    def _fresh_blocks(common: CommonAttentionMetadata, slots: torch.Tensor) -> torch.Tensor | None:
        """The blocks this step opens (a slot at offset 0: a new token at a position that is
        a multiple of the block size), less those it also fills to their last slot.  Most
        decode steps open none, which the positions tell without a tensor op: the 4-8 small
        ops took ~0.1 ms of a 7.5 ms single-stream SmolLM2 step on a 2-core Zen 2, each
        slower than alone because the step's weights had just streamed through the caches."""
        bs, qsl = common.block_size, common.query_start_loc_cpu
        if not any((s - 1) // bs * bs >= s - (qsl[i + 1] - qsl[i]) for i, s in enumerate(common.seq_lens_cpu)):
            return None
        fresh = slots[slots % bs == 0] // bs
        if fresh.numel() and bs > 1:  # a block this step also fills to its last slot needs no zeros
            fresh = fresh[~torch.isin(fresh, slots[slots % bs == bs - 1] // bs)]
        return fresh if fresh.numel() else None

    @staticmethod
    def _build_group(common: CommonAttentionMetadata, items: list[Item]) -> AttnGroup:
        """Pad the items to one batch.  Under a sliding window each request's keys start
        at the block holding its first query's window (earlier blocks may be stale or
        the null block, and are never gathered); the mask hides what falls outside."""
        dev, bs, window = common.block_table.device, common.block_size, common.sliding_window
        b, q_len = len(items), max(it[0] for it in items)
        first = [max(0, s - n - window + 1) // bs if window is not None else 0 for n, s, _, _ in items]
        kv_len = cdiv(max(s - f * bs for (_, s, _, _), f in zip(items, first, strict=True)), bs) * bs

        def plan() -> tuple[torch.Tensor, torch.Tensor]:
            n, s, starts, reqs = (torch.tensor(col, dtype=torch.long) for col in zip(*items, strict=True))
            first_blk = torch.tensor(first, dtype=torch.long)
            j = torch.arange(q_len)
            q_pos = (s - n)[:, None] + j[None, :]  # absolute position of each query row
            k_pos = (first_blk * bs)[:, None] + torch.arange(kv_len)[None, :]  # [B, L] absolute
            masked = k_pos[:, None, :] > q_pos[:, :, None]  # causal; also hides the padding
            if window is not None:
                masked |= k_pos[:, None, :] <= q_pos[:, :, None] - window
            # Only a request's own context blocks: later columns may hold blocks allocated
            # ahead and never written.  On the device, where the block table lives.
            cols = first_blk[:, None] + torch.arange(kv_len // bs)[None, :]  # [B, L/bs]
            own = cols < (s[:, None] + bs - 1) // bs
            full = common.block_table.index_select(0, reqs.to(dev))
            table = full.gather(1, cols.clamp(max=full.shape[1] - 1).to(dev))
            return torch.where(own.to(dev), table.long(), 0).view(-1), masked.to(dev)

        # Rows in batch order with no padding (every request q_len tokens, its rows next
        # to each other from row 0): read and written in place.
        token_idx = out_idx = None
        if not all(n == q_len and start == i * q_len for i, (n, _, start, _) in enumerate(items)):
            n_t, starts = torch.tensor([it[0] for it in items]), torch.tensor([it[2] for it in items])
            j = torch.arange(q_len)
            valid_q = j[None, :] < n_t[:, None]  # [B, Q]
            rows = starts[:, None] + j[None, :]
            token_idx = torch.where(valid_q, rows, 0).view(-1).to(dev)
            out_idx = torch.where(valid_q, rows, common.num_actual_tokens).view(-1).to(dev)
        if q_len > 1:
            causal = b == 1 and window is None and items[0][0] == items[0][1]  # n == s: from position 0
            return AttnGroup(b, q_len, kv_len, token_idx, out_idx, plan, causal_from_zero=causal)
        # A decode kernel walks the table itself from position 0 (and skips to the window).
        reqs, lens = [it[3] for it in items], [it[1] for it in items]
        if reqs == list(range(b)) and lens == common.seq_lens_cpu[:b]:  # the usual decode step: views, no copies
            table, seq_lens = common.block_table[:b], common.seq_lens[:b]
        else:  # rows of one request's new tokens too, each over its own context
            idx = torch.tensor(reqs, device=dev)
            table = common.block_table[:, :cdiv(max(lens), bs)].index_select(0, idx)
            seq_lens = torch.tensor(lens, dtype=torch.int32, device=dev)
        return AttnGroup(b, 1, kv_len, token_idx, out_idx, plan, table.int(), seq_lens.int(), window or 0)

    def forward(self, query, key, value, k_cache, v_cache, attn_metadata: TorchPagedMetadata):
        metadata = attn_metadata
        num_tokens = metadata.common.num_actual_tokens
        self._zero_fresh_blocks(metadata, k_cache, v_cache)
        kv_dtype.store(key[:num_tokens], value[:num_tokens], k_cache, v_cache, metadata.slots)
        if metadata.identity and query.shape[0] == num_tokens:
            return self._group_forward(metadata.groups[0], query, k_cache, v_cache, None)
        # One scratch row past the real tokens takes the padded query rows' output.
        out = query.new_empty(max(query.shape[0], num_tokens + 1), self.num_heads, self.head_dim)
        for g in metadata.groups:
            self._group_forward(g, query, k_cache, v_cache, out)
        if query.shape[0] > num_tokens:
            out[num_tokens:].zero_()
        return out[: query.shape[0]]

    @staticmethod
    def _zero_fresh_blocks(metadata: TorchPagedMetadata, k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
        """Zero the blocks this step opens, before their first slot is written (see the module doc)."""
        if metadata.fresh_blocks is not None:
            kv_dtype.zero_blocks(k_cache, metadata.fresh_blocks)
            kv_dtype.zero_blocks(v_cache, metadata.fresh_blocks)

    def _group_forward(self, g: AttnGroup, query, k_cache, v_cache, out) -> torch.Tensor:
        """Attend one group; scatter into `out`, or with out=None return its [B*Q, H, D]."""
        hkv, d = self.num_kv_heads, self.head_dim
        grp = self.num_heads // hkv
        b, q, L = g.num_reqs, g.q_len, g.kv_len
        dtype = query.dtype
        qg = query[: b * q] if g.token_idx is None else query.index_select(0, g.token_idx)
        kernel = self._kernel_for(qg, k_cache) if q == 1 else None
        if kernel is not None:
            o = kernel(qg.view(b, self.num_heads, d), k_cache, v_cache, g.block_table, g.seq_lens, self.scale,
                       g.window)
            return self._emit(g, o, out)
        if q == 1 and hkv <= FOLD_HEADS_MAX_KV and k_cache.dtype == dtype:
            o = self._decode_all_heads(g, qg, k_cache, v_cache)
            return self._emit(g, o, out)
        if q > 1 and dtype == torch.float32:
            return self._emit(g, self._prefill_fused(g, qg, k_cache, v_cache), out)
        qg = qg.reshape(b, q, hkv, grp, d)
        qg = qg.permute(2, 0, 1, 3, 4).reshape(hkv * b, q * grp, d)
        ws = _WORKSPACE.get(4 * hkv * b * L * d, dtype, query.device)
        gathered, kv = ws.view(2, 2, b * L, hkv * d).unbind(0)
        _gather_blocks(g, k_cache, v_cache, gathered.view(2, -1, self.block_size, hkv, d))
        kv = kv.view(2, hkv, b * L, d)
        kv.copy_(gathered.view(2, b * L, hkv, d).transpose(1, 2))
        kbuf, vbuf = kv.unbind(0)
        bias = g.bias(hkv, grp, dtype)
        k_t = kbuf.view(hkv * b, L, d).transpose(1, 2)
        if bias.dim() == 3:
            scores = torch.baddbmm(bias, qg, k_t, alpha=self.scale)
        else:
            scores = torch.bmm(qg, k_t).view(hkv, b, q, grp, L).mul_(self.scale).add_(bias)
        o = torch.bmm(scores.view(hkv * b, q * grp, L).softmax(-1), vbuf.view(hkv * b, L, d))
        o = o.view(hkv, b, q, grp, d).permute(1, 2, 0, 3, 4).reshape(b * q, self.num_heads, d)
        return self._emit(g, o, out)

    def _prefill_fused(self, g: AttnGroup, qg: torch.Tensor, k_cache, v_cache) -> torch.Tensor:
        """A float32 group of prefill chunks through torch's fused attention (on CPU its
        flash-attention kernel: scores in blocks, never the whole [Q, L] matrix in memory),
        reading the gathered blocks in the cache's own [slot, head, dim] order (strided
        views, no transposing copy), each query head against its KV head (GQA) in place.
        A request with no earlier context (no prefix hit, not a later chunk) and no sliding
        window is plain causal (whole blocks of keys skipped); the others take the mask.

        Float32 only: there the padded matmuls, the mask add and the softmax each pass
        over a score matrix that outgrows the caches, and this kernel took 124 instead of
        179 ms of a 512-token prompt's 622 (SmolLM2-135M, 30 layers; Zen 5 under AVX2
        emulation; 108 instead of 169 ms with AVX-512).  In bf16 the matmuls (native bf16
        dot products) win: 64 ms against this kernel's 133 (Zen 5).  Measured with torch
        2.13, whose CPU flash kernel takes GQA and a float mask (a torch too old for it
        falls back to SDPA's math path: correct, slower)."""
        b, q, L, hkv, d = g.num_reqs, g.q_len, g.kv_len, self.num_kv_heads, self.head_dim
        ws = _WORKSPACE.get(2 * b * L * hkv * d, qg.dtype, qg.device)
        kv = ws.view(2, b * L // self.block_size, self.block_size, hkv, d)
        _gather_blocks(g, k_cache, v_cache, kv)
        k, v = kv.view(2, b, L, hkv, d).transpose(2, 3).unbind(0)  # [B, Hkv, L, D] views
        query = qg.view(b, q, self.num_heads, d).transpose(1, 2)  # [B, H, Q, D]
        if g.causal_from_zero:
            o = F.scaled_dot_product_attention(query, k, v, is_causal=True, scale=self.scale, enable_gqa=True)
        else:
            o = F.scaled_dot_product_attention(query, k, v, attn_mask=g.sdpa_mask(qg.dtype), scale=self.scale,
                                               enable_gqa=True)
        return o.transpose(1, 2).reshape(b * q, self.num_heads, d)

    def _decode_all_heads(self, g: AttnGroup, qg: torch.Tensor, k_cache, v_cache) -> torch.Tensor:
        """One query token per request, every head against every KV head: the gathered
        blocks are already [B, L*Hkv, D] row-major (slot, head), so the two matmuls read
        them with no transposing copy, and q and the output need no permute either.  The
        mask zeroes the probabilities of other heads' keys, so the result is exact; the
        price is Hkv times the (small) score work, which wins while Hkv is small."""
        b, L, hkv, d = g.num_reqs, g.kv_len, self.num_kv_heads, self.head_dim
        ws = _WORKSPACE.get(2 * b * L * hkv * d, qg.dtype, qg.device)
        kv = ws.view(2, b * L // self.block_size, self.block_size, hkv, d)
        _gather_blocks(g, k_cache, v_cache, kv)
        k, v = kv.view(2, b, L * hkv, d).unbind(0)
        bias = g.heads_bias(self.num_heads, hkv, qg.dtype)
        scores = torch.baddbmm(bias, qg, k.transpose(1, 2), alpha=self.scale)
        return torch.bmm(scores.softmax(-1), v)  # [B, H, D]

    def _kernel_for(self, query: torch.Tensor, k_cache: torch.Tensor):
        """A native decode kernel for these operands, or None (cpu_paged overrides)."""
        return None

    @staticmethod
    def _emit(g: AttnGroup, o: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
        if out is None:
            return o
        if g.out_idx is None:
            out[: o.shape[0]] = o
        else:
            out.index_copy_(0, g.out_idx, o)
        return out
