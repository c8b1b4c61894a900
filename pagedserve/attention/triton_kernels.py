"""Triton kernels for paged attention: K/V store, split-KV decode, varlen extend.

Cache layout is the engine's: [num_blocks, block_size, num_kv_heads, head_dim], so one
token's head is a contiguous head_dim row and a token's flat slot is
block_id * block_size + offset.  Every kernel gathers cache rows through the block
table token by token, which makes the cache block size a free parameter (16, 32, ...)
rather than a tile size.

The kernel bodies below are plain Python functions; `get_kernels()` wraps them in
the mode triton.language itself was imported in: compiled JIT kernels, or, when
TRITON_INTERPRET=1 was set before triton's first import, interpreted ones that run
on CPU tensors.  Following the language's mode rather than the variable's value at
this module's import keeps the two consistent whatever the import order.

Two interpreter limits shape the code (triton 3.x; bf16 is unsupported there, see
triton-lang/triton#11584): `tl.dot` on bfloat16 operands multiplies the raw uint16
bits, and elementwise bf16 arithmetic is wrong.  So every
piece of arithmetic here is on fp32 values, and with UPCAST (set only when
interpreting) the dot operands are widened to fp32 before `tl.dot`.  On the GPU the
dots take the query's dtype (a narrower cache, kv_cache_dtype, is converted on load) and
accumulate in fp32.
"""

from __future__ import annotations

import functools
from types import SimpleNamespace

import triton
import triton.language as tl
from triton.runtime.jit import JITFunction

LOG2E = 1.4426950408889634


def store_kv_kernel(
    key_ptr, value_ptr, k_cache_ptr, v_cache_ptr, slot_mapping_ptr,
    stride_kt, stride_kh, stride_vt, stride_vh, stride_cs, stride_ch,
    NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """One program per token writes all its KV heads; slot < 0 marks a padded token."""
    t = tl.program_id(0)
    slot = tl.load(slot_mapping_ptr + t).to(tl.int64)
    if slot < 0:
        return
    h = tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_D)
    mask = (h < NUM_KV_HEADS)[:, None] & (d < HEAD_DIM)[None, :]
    t64 = t.to(tl.int64)
    k = tl.load(key_ptr + t64 * stride_kt + h[:, None] * stride_kh + d[None, :], mask=mask)
    v = tl.load(value_ptr + t64 * stride_vt + h[:, None] * stride_vh + d[None, :], mask=mask)
    dst = slot * stride_cs + h[:, None] * stride_ch + d[None, :]
    tl.store(k_cache_ptr + dst, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_cache_ptr + dst, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def attend_tile(
    q, k_cache_ptr, v_cache_ptr, bt_row, n, n_ok, visible, d, d_ok, kvh,
    stride_cb, stride_cs, stride_ch, scale_log2e, m, l_sum, acc,
    CACHE_BLOCK: tl.constexpr, MASKED: tl.constexpr, UPCAST: tl.constexpr, DOT_PREC: tl.constexpr,
):
    """The online-softmax step every attention kernel here takes: gather one tile of
    keys (positions `n`) through the block table, score them against the query rows,
    hide what is not `visible` (MASKED only: the unmasked stretch of an extend skips
    every mask), and fold the tile into the running max `m`, sum `l_sum` and output
    `acc` (base 2).  Returns the new (m, l_sum, acc)."""
    if MASKED:
        blk = tl.load(bt_row + n // CACHE_BLOCK, mask=n_ok, other=0).to(tl.int64)
        kv_mask = n_ok[:, None] & d_ok[None, :]
    else:
        blk = tl.load(bt_row + n // CACHE_BLOCK).to(tl.int64)
        kv_mask = d_ok[None, :]
    row = blk * stride_cb + (n % CACHE_BLOCK) * stride_cs + kvh * stride_ch
    k = tl.load(k_cache_ptr + row[:, None] + d[None, :], mask=kv_mask, other=0.0)
    v = tl.load(v_cache_ptr + row[:, None] + d[None, :], mask=kv_mask, other=0.0)
    if UPCAST:
        k = k.to(tl.float32)
        v = v.to(tl.float32)
    else:  # a narrower cache (kv_cache_dtype) is computed on in q's dtype (a no-op when they agree)
        k = k.to(q.dtype)
        v = v.to(q.dtype)
    s = tl.dot(q, tl.trans(k), input_precision=DOT_PREC) * scale_log2e
    if MASKED:
        s = tl.where(visible, s, float("-inf"))
    m_new = tl.maximum(m, tl.max(s, 1))
    # A row that has seen no visible key yet (a sliding window's start lies in a later
    # tile) keeps m = -inf: subtract 0 instead, so its p and alpha are 0, not NaN.
    m_sub = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.exp2(s - m_sub[:, None])
    alpha = tl.exp2(m - m_sub)
    l_sum = l_sum * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PREC)
    return m_new, l_sum, acc


def decode_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, part_out_ptr, part_lse_ptr,
    block_table_ptr, seq_lens_ptr, query_start_loc_ptr, decode_reqs_ptr,
    stride_qt, stride_qh, stride_ot, stride_oh, stride_bt, stride_cb, stride_cs, stride_ch,
    scale_log2e, window,
    NUM_HEADS: tl.constexpr, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, CACHE_BLOCK: tl.constexpr,
    BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, NUM_SPLITS: tl.constexpr,
    UPCAST: tl.constexpr, DOT_PREC: tl.constexpr,
):
    """Program (decode i, kv head, split): the GROUP query heads sharing one KV head are
    the rows of one tile, so each K/V row is read once for all of them.  The split's
    token range is derived in-kernel from seq_len, so a fixed NUM_SPLITS serves any
    context length (what a captured CUDA graph needs).  `window` > 0: a sliding window,
    the keys [seq_len - window, seq_len) only (earlier blocks are never read)."""
    i = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    req = tl.load(decode_reqs_ptr + i)
    tok = tl.load(query_start_loc_ptr + req).to(tl.int64)
    seq_len = tl.load(seq_lens_ptr + req)
    win_lo = tl.where(window > 0, tl.maximum(seq_len - window, 0), 0)
    per_split = tl.cdiv(tl.cdiv(seq_len - win_lo, NUM_SPLITS), BLOCK_N) * BLOCK_N
    lo = win_lo + split * per_split
    hi = tl.minimum(lo + per_split, seq_len)

    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, BLOCK_D)
    g_ok = g < GROUP
    d_ok = d < HEAD_DIM
    heads = kvh * GROUP + g
    q = tl.load(q_ptr + tok * stride_qt + heads[:, None] * stride_qh + d[None, :],
                mask=g_ok[:, None] & d_ok[None, :], other=0.0)
    if UPCAST:
        q = q.to(tl.float32)
    m = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_sum = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    bt_row = block_table_ptr + req.to(tl.int64) * stride_bt
    for n0 in range(lo, hi, BLOCK_N):
        n = n0 + tl.arange(0, BLOCK_N)
        n_ok = n < hi
        m, l_sum, acc = attend_tile(q, k_cache_ptr, v_cache_ptr, bt_row, n, n_ok, n_ok[None, :], d, d_ok, kvh,
                                    stride_cb, stride_cs, stride_ch, scale_log2e, m, l_sum, acc,
                                    CACHE_BLOCK, True, UPCAST, DOT_PREC)

    nonempty = l_sum > 0
    o = acc / tl.where(nonempty, l_sum, 1.0)[:, None]
    if NUM_SPLITS == 1:
        tl.store(out_ptr + tok * stride_ot + heads[:, None] * stride_oh + d[None, :],
                 o.to(out_ptr.dtype.element_ty), mask=g_ok[:, None] & d_ok[None, :])
    else:
        part = (i.to(tl.int64) * NUM_HEADS + heads) * NUM_SPLITS + split  # [BLOCK_G]
        tl.store(part_out_ptr + part[:, None] * HEAD_DIM + d[None, :], o,
                 mask=g_ok[:, None] & d_ok[None, :])
        lse = tl.where(nonempty, m + tl.log2(tl.where(nonempty, l_sum, 1.0)), float("-inf"))
        tl.store(part_lse_ptr + part, lse, mask=g_ok)


def decode_reduce_kernel(
    part_out_ptr, part_lse_ptr, out_ptr, query_start_loc_ptr, decode_reqs_ptr,
    stride_ot, stride_oh,
    NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, NUM_SPLITS: tl.constexpr,
    BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """Program (decode i, query head): merge the splits' normalised partial outputs,
    weighted by their log-sum-exp (base 2).  All-empty rows (seq_len 0) give zeros."""
    i = tl.program_id(0)
    h = tl.program_id(1)
    req = tl.load(decode_reqs_ptr + i)
    tok = tl.load(query_start_loc_ptr + req).to(tl.int64)
    s = tl.arange(0, BLOCK_S)
    d = tl.arange(0, BLOCK_D)
    s_ok = s < NUM_SPLITS
    base = (i.to(tl.int64) * NUM_HEADS + h) * NUM_SPLITS
    lse = tl.load(part_lse_ptr + base + s, mask=s_ok, other=float("-inf"))
    m = tl.max(lse, 0)
    m = tl.where(m > float("-inf"), m, 0.0)  # all splits empty: keep exp2's argument finite
    w = tl.where(lse > float("-inf"), tl.exp2(lse - m), 0.0)
    part = tl.load(part_out_ptr + (base + s)[:, None] * HEAD_DIM + d[None, :],
                   mask=s_ok[:, None] & (d < HEAD_DIM)[None, :], other=0.0)
    denom = tl.sum(w, 0)
    o = tl.sum(w[:, None] * part, 0) / tl.where(denom > 0, denom, 1.0)
    tl.store(out_ptr + tok * stride_ot + h * stride_oh + d, o.to(out_ptr.dtype.element_ty), mask=d < HEAD_DIM)


def extend_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, out_ptr,
    block_table_ptr, seq_lens_ptr, query_start_loc_ptr, tile_req_ptr, tile_q0_ptr,
    stride_qt, stride_qh, stride_ot, stride_oh, stride_bt, stride_cb, stride_cs, stride_ch,
    scale_log2e, window,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, CACHE_BLOCK: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
    UPCAST: tl.constexpr, DOT_PREC: tl.constexpr,
):
    """Program (tile, kv head): BLOCK_Q query tokens of one request times the GROUP heads
    of one KV head form the BLOCK_M rows (row r = token r // GROUP, head r % GROUP).
    Query j of a request with context L and n new tokens sits at position L - n + j.
    Keys below the tile's first position are visible to every row, so that stretch
    runs without a causal mask; only the diagonal stretch is masked.  With a sliding
    window (`window` > 0: row p sees keys (p - window, p]) every tile is masked and the
    keys start at the tile holding the first row's window."""
    tile = tl.program_id(0)
    kvh = tl.program_id(1)
    req = tl.load(tile_req_ptr + tile)
    q0 = tl.load(tile_q0_ptr + tile)
    q_start = tl.load(query_start_loc_ptr + req)
    n_new = tl.load(query_start_loc_ptr + req + 1) - q_start
    seq_len = tl.load(seq_lens_ptr + req)
    prefix = seq_len - n_new

    r = tl.arange(0, BLOCK_M)
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    qi = q0 + r // GROUP
    heads = kvh * GROUP + r % GROUP
    row_ok = (r < BLOCK_Q * GROUP) & (qi < n_new)
    tok = (q_start + qi).to(tl.int64)
    io_mask = row_ok[:, None] & d_ok[None, :]
    q = tl.load(q_ptr + tok[:, None] * stride_qt + heads[:, None] * stride_qh + d[None, :],
                mask=io_mask, other=0.0)
    if UPCAST:
        q = q.to(tl.float32)
    q_pos = prefix + qi

    m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_sum = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    bt_row = block_table_ptr + req.to(tl.int64) * stride_bt
    windowed = window > 0
    win = tl.where(windowed, window, seq_len + 1)
    kv_lo = (tl.maximum(prefix + q0 - win + 1, 0) // BLOCK_N) * BLOCK_N
    full_end = tl.where(windowed, 0, ((prefix + q0) // BLOCK_N) * BLOCK_N)
    masked_lo = tl.where(windowed, kv_lo, full_end)
    kv_end = tl.minimum(seq_len, prefix + q0 + BLOCK_Q)
    for n0 in range(0, full_end, BLOCK_N):  # keys every row sees: no masks
        n = n0 + tl.arange(0, BLOCK_N)
        m, l_sum, acc = attend_tile(q, k_cache_ptr, v_cache_ptr, bt_row, n, n, n, d, d_ok, kvh,
                                    stride_cb, stride_cs, stride_ch, scale_log2e, m, l_sum, acc,
                                    CACHE_BLOCK, False, UPCAST, DOT_PREC)
    for n0 in range(masked_lo, kv_end, BLOCK_N):
        n = n0 + tl.arange(0, BLOCK_N)
        n_ok = n < kv_end
        visible = (n[None, :] <= q_pos[:, None]) & (n[None, :] > q_pos[:, None] - win) & n_ok[None, :]
        m, l_sum, acc = attend_tile(q, k_cache_ptr, v_cache_ptr, bt_row, n, n_ok, visible, d, d_ok, kvh,
                                    stride_cb, stride_cs, stride_ch, scale_log2e, m, l_sum, acc,
                                    CACHE_BLOCK, True, UPCAST, DOT_PREC)

    o = acc / tl.where(l_sum > 0, l_sum, 1.0)[:, None]
    tl.store(out_ptr + tok[:, None] * stride_ot + heads[:, None] * stride_oh + d[None, :],
             o.to(out_ptr.dtype.element_ty), mask=io_mask)


_BODIES = (store_kv_kernel, decode_kernel, decode_reduce_kernel, extend_kernel)
_HELPERS = (attend_tile,)  # device functions the kernels call


def language_interpreted() -> bool:
    """Whether triton.language was imported under TRITON_INTERPRET=1.  Its own library
    functions (tl.sum, tl.max, tl.cdiv) are wrapped for one mode at that moment, so the
    mode is fixed for the whole process from triton's first import on."""
    return not isinstance(tl.sum, JITFunction)


def wrap_for_mode(bodies: tuple, helpers: tuple = (), namespace: dict | None = None) -> SimpleNamespace:
    """Kernel bodies (plain functions) wrapped for the process's mode: compiled JIT
    functions, or interpreted ones (which also accept CPU tensors).  A compiled kernel
    resolves the functions it calls through its module's globals (`namespace`), and they
    must be JIT functions too; interpreted kernels call them as plain Python."""
    interpret = language_interpreted()
    if interpret:
        from triton.runtime.interpreter import InterpretedFunction as wrap
    else:
        wrap = JITFunction
        for helper in helpers:
            if not isinstance(namespace[helper.__name__], JITFunction):
                namespace[helper.__name__] = JITFunction(helper)
    return SimpleNamespace(**{f.__name__: wrap(f) for f in bodies}, interpreted=interpret)


@functools.cache
def get_kernels() -> SimpleNamespace:
    """This module's kernels wrapped for the process's mode (see wrap_for_mode)."""
    return wrap_for_mode(_BODIES, _HELPERS, globals())


def next_pow2(x: int, floor: int = 16) -> int:
    """tl.arange needs powers of two and tl.dot needs every dim >= 16."""
    return max(floor, triton.next_power_of_2(x))
