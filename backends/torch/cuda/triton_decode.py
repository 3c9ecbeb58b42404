"""Triton kernels for the CUDA decode step (torch_decoder imports this module only on CUDA).

A decode step is memory-bound. Per block, cuBLAS reads the fused weight matrices at ~3.4 TB/s
(F.linear with its bias; addmm adding onto the residual); what lies between the GEMMs was ~15 to
~30 small torch kernels, and attention read every row's cache up to a power-of-two span under a
mask. Here each family's block is its GEMMs with these between them:

1. `_attention_split`: per (row, query head, split), rotary on q and k (after Qwen3's q/k norms),
   the new k and v written to the cache at the row's position (split 0 of the first query head
   of each key-value head), and an online softmax over the split's share of the row's live
   columns: 0..position-1, or its sliding window's (flash-decoding: at batch 1 the heads alone
   would leave most of the GPU idle, so each row's columns are split up to 16 ways). With
   grouped heads (GQA) and at least `GROUPED_FROM_KV_HEADS` key-value heads,
   `_attention_split_grouped` instead: a program per key-value head takes the query heads that
   share it together, through tensor-core products.
2. `_attention_combine`: the splits and the new token itself -> the attention output; for a
   parallel block (Phi) also GELU of fc1 and x + the out bias, laid out for its one out GEMM.
3. `_norm`: Phi's LayerNorm before its block's one GEMM over the residual; the sequential
   blocks' (Llama, Mistral, Qwen2/3, Phi-3) RMSNorm before each of their two, and `_silu_mul`
   between [gate; up] and down. The final norm before the LM head too.

Prefill uses `_prefill_rotary`: rotary on q in place and k, v to the cache, one kernel a block.

A Triton GEMV with LayerNorm in its prologue was measured too (commit deda8ee): inside the step it
did not beat cuBLAS (BENCHMARKS.md, D-cublas-gemms), so the GEMMs stay cuBLAS. Arithmetic is
float32, rounded to the model's dtype where the unfused step rounds.
"""

from __future__ import annotations

import functools
import logging
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from backends.torch.kv_pages import PAGE

log = logging.getLogger("phi2_server.triton_decode")


@triton.jit
def _tanh(u):
    return 1.0 - 2.0 / (tl.exp(2.0 * u) + 1.0)


@triton.jit
def _head(base, d, d_ok, partner, cos, sin, norm_ptr, eps, HEAD_DIM: tl.constexpr, QK_NORM: tl.constexpr):
    """One head of q or k from y, rotated (float32): RMSNorm'd over the head first where the model
    has q/k norms (Qwen3), rounded to the model's dtype as transformers' norm rounds it."""
    x = tl.load(base + d, mask=d_ok, other=0.0)
    p = tl.load(base + partner, mask=d_ok, other=0.0)
    if QK_NORM:
        dtype = x.dtype
        xf = x.to(tl.float32)
        scale = 1.0 / tl.sqrt(tl.sum(xf * xf, axis=0) / HEAD_DIM + eps)
        w = tl.load(norm_ptr + d, mask=d_ok, other=0.0).to(tl.float32)
        wp = tl.load(norm_ptr + partner, mask=d_ok, other=0.0).to(tl.float32)
        x = ((xf * scale).to(dtype).to(tl.float32) * w).to(dtype)
        p = ((p.to(tl.float32) * scale).to(dtype).to(tl.float32) * wp).to(dtype)
    return x.to(tl.float32) * cos + p.to(tl.float32) * sin


@triton.jit
def _head_tiles(base, d0, ok0, partner0, cos0, sin0, d1, ok1, partner1, cos1, sin1, norm_ptr, eps, HEAD_DIM, QK_NORM):
    """`_head` with the head's dims in two tiles (`_attention_split`), its q/k norm over both."""
    x0 = tl.load(base + d0, mask=ok0, other=0.0)
    p0 = tl.load(base + partner0, mask=ok0, other=0.0)
    x1 = tl.load(base + d1, mask=ok1, other=0.0)
    p1 = tl.load(base + partner1, mask=ok1, other=0.0)
    if QK_NORM:
        dtype = x0.dtype
        x0f = x0.to(tl.float32)
        x1f = x1.to(tl.float32)
        scale = 1.0 / tl.sqrt((tl.sum(x0f * x0f, axis=0) + tl.sum(x1f * x1f, axis=0)) / HEAD_DIM + eps)
        w0 = tl.load(norm_ptr + d0, mask=ok0, other=0.0).to(tl.float32)
        w1 = tl.load(norm_ptr + d1, mask=ok1, other=0.0).to(tl.float32)
        wp0 = tl.load(norm_ptr + partner0, mask=ok0, other=0.0).to(tl.float32)
        wp1 = tl.load(norm_ptr + partner1, mask=ok1, other=0.0).to(tl.float32)
        x0 = ((x0f * scale).to(dtype).to(tl.float32) * w0).to(dtype)
        x1 = ((x1f * scale).to(dtype).to(tl.float32) * w1).to(dtype)
        p0 = ((p0.to(tl.float32) * scale).to(dtype).to(tl.float32) * wp0).to(dtype)
        p1 = ((p1.to(tl.float32) * scale).to(dtype).to(tl.float32) * wp1).to(dtype)
    return x0.to(tl.float32) * cos0 + p0.to(tl.float32) * sin0, x1.to(tl.float32) * cos1 + p1.to(tl.float32) * sin1


@triton.jit
def _paged_columns(
    k_ptr, v_ptr, pages, cache, columns, ok, d, d_ok, stride_page, HEAD_DIM: tl.constexpr, PAGE: tl.constexpr
):
    """Keys and values [columns, D_PAD] of one key-value head (at offset `cache`) of a row whose
    page table starts at `pages`: column c is at offset c % PAGE of page pages[c // PAGE]
    (backends/kv_pages). Columns not `ok` and dimensions past the head read zeros."""
    page = tl.load(pages + columns // PAGE, mask=ok, other=0).to(tl.int64)
    where = cache + page[:, None] * stride_page + (columns % PAGE)[:, None] * HEAD_DIM + d[None, :]
    both = ok[:, None] & d_ok[None, :]
    return tl.load(k_ptr + where, mask=both, other=0.0), tl.load(v_ptr + where, mask=both, other=0.0)


@triton.jit
def _row_splits(live, first, fill, split_columns, SPLITS: tl.constexpr):
    """How many of the grid's SPLITS a row's columns first..live-1 go to (`_attention_split`)."""
    return tl.minimum(tl.maximum(fill, tl.cdiv(live - first, split_columns)), SPLITS)


@triton.jit
def _attention_split(
    y_ptr,
    stride_y,
    cos_ptr,
    sin_ptr,
    stride_rot,
    pos_ptr,
    active_ptr,
    k_ptr,
    v_ptr,
    stride_head,
    stride_page,
    table_ptr,
    stride_table,
    part_ptr,
    scale,
    window,
    q_norm_ptr,
    k_norm_ptr,
    eps,
    fill,
    split_columns,
    Q_SIZE: tl.constexpr,
    KV_SIZE: tl.constexpr,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    ROT: tl.constexpr,
    D_PAD: tl.constexpr,
    D_LO: tl.constexpr,
    D_HI: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SPLITS: tl.constexpr,
    QK_NORM: tl.constexpr,
    PAGE: tl.constexpr,
):
    """One split of one (row, query head)'s cached columns (flash-decoding): its softmax maximum,
    sum and weighted values, to part [row, head, split, D_PAD + 2]. The columns are 0..position-1,
    or the last `window` - 1 of them with a sliding window (the new token makes `window`). A query
    head reads the key-value head it shares with GROUP - 1 others; split 0 of the first of them
    also writes the new token's k (rotated) and v to the cache at the row's position. The cache
    is paged (backends/kv_pages): column c of a row is at offset c % PAGE of the page that the
    row's table entry c // PAGE names.

    A row's columns go to `fill` splits, or to one per `split_columns` where that is more (at most
    SPLITS, the grid's): a long row among short ones is read by as many programs as its length
    asks, not by one per head that the whole step waits for. Splits past a row's own do nothing
    (the grid's splits are for the longest row a table may hold: at 256 rows of a 32k-context
    model, 16 a head, where a row of 300 columns takes 2).

    A head's dims are read as two tiles, D_LO + D_HI (`_tiles`: 80 = 64 + 16), and a block's
    columns past the split's end read its last column again, weighed 0: where the tiles cover the
    head exactly the loads take no mask. With one tile padded to a power of two and masked loads,
    ptxas issued a block's loads one after another, each after the previous one's sum (its SASS
    for Phi-2's 80 dims), so each block waited for memory several times over (BENCHMARKS.md,
    D-two-tiles)."""
    row = tl.program_id(0)
    head = tl.program_id(1)
    split = tl.program_id(2)
    kv_head = head // GROUP
    position = tl.load(pos_ptr + row)
    live = position * tl.load(active_ptr + row)  # idle rows attend to no cached column
    first = tl.where(window > 0, tl.maximum(live - window + 1, 0), 0)
    d0 = tl.arange(0, D_LO)
    d1 = D_LO + tl.arange(0, D_HI)
    ok0 = d0 < HEAD_DIM
    ok1 = d1 < HEAD_DIM
    rot0 = d0 < ROT
    rot1 = d1 < ROT
    partner0 = tl.where(rot0, (d0 + ROT // 2) % ROT, d0)  # rotate_half as a roll, its sign in the sin table
    partner1 = tl.where(rot1, (d1 + ROT // 2) % ROT, d1)
    dtype = y_ptr.dtype.element_ty
    base = y_ptr + row * stride_y
    rotation = position * stride_rot
    cos0 = tl.load(cos_ptr + rotation + d0, mask=rot0, other=1.0).to(tl.float32)
    sin0 = tl.load(sin_ptr + rotation + d0, mask=rot0, other=0.0).to(tl.float32)
    cos1 = tl.load(cos_ptr + rotation + d1, mask=rot1, other=1.0).to(tl.float32)
    sin1 = tl.load(sin_ptr + rotation + d1, mask=rot1, other=0.0).to(tl.float32)
    cache = kv_head * stride_head
    pages = table_ptr + row * stride_table
    if split == 0:
        if head % GROUP == 0:
            k0, k1 = _head_tiles(
                base + Q_SIZE + kv_head * HEAD_DIM,
                d0,
                ok0,
                partner0,
                cos0,
                sin0,
                d1,
                ok1,
                partner1,
                cos1,
                sin1,
                k_norm_ptr,
                eps,
                HEAD_DIM,
                QK_NORM,
            )
            at = cache + tl.load(pages + position // PAGE).to(tl.int64) * stride_page + (position % PAGE) * HEAD_DIM
            tl.store(k_ptr + at + d0, k0.to(dtype), mask=ok0)
            tl.store(k_ptr + at + d1, k1.to(dtype), mask=ok1)
            v = base + Q_SIZE + KV_SIZE + kv_head * HEAD_DIM
            tl.store(v_ptr + at + d0, tl.load(v + d0, mask=ok0, other=0.0), mask=ok0)
            tl.store(v_ptr + at + d1, tl.load(v + d1, mask=ok1, other=0.0), mask=ok1)
    splits = _row_splits(live, first, fill, split_columns, SPLITS)
    if split < splits:  # past the row's splits: nothing to read, and `_attention_combine` reads no part
        q0, q1 = _head_tiles(
            base + head * HEAD_DIM,
            d0,
            ok0,
            partner0,
            cos0,
            sin0,
            d1,
            ok1,
            partner1,
            cos1,
            sin1,
            q_norm_ptr,
            eps,
            HEAD_DIM,
            QK_NORM,
        )
        q0 = q0.to(dtype).to(tl.float32)
        q1 = q1.to(dtype).to(tl.float32)
        chunk = tl.cdiv(tl.cdiv(live - first, splits), BLOCK_N) * BLOCK_N
        start = first + split * chunk
        end = tl.minimum(start + chunk, live)
        best = tl.max(tl.full([BLOCK_N], float("-inf"), tl.float32), axis=0)
        total = tl.sum(tl.zeros([BLOCK_N], tl.float32), axis=0)
        acc0 = tl.zeros([D_LO], dtype=tl.float32)
        acc1 = tl.zeros([D_HI], dtype=tl.float32)
        for begin in range(start, end, BLOCK_N):
            offsets = begin + tl.arange(0, BLOCK_N)
            ok = offsets < end
            columns = tl.minimum(offsets, end - 1)  # written columns all: no mask on the loads
            page = tl.load(pages + columns // PAGE).to(tl.int64)
            at = cache + page[:, None] * stride_page + (columns % PAGE)[:, None] * HEAD_DIM
            key0 = tl.load(k_ptr + at + d0[None, :])
            value0 = tl.load(v_ptr + at + d0[None, :])
            if D_LO + D_HI == HEAD_DIM:
                key1 = tl.load(k_ptr + at + d1[None, :])
                value1 = tl.load(v_ptr + at + d1[None, :])
            else:  # the second tile runs past the head (112 = 64 + 48 of 64)
                key1 = tl.load(k_ptr + at + d1[None, :], mask=ok1[None, :], other=0.0)
                value1 = tl.load(v_ptr + at + d1[None, :], mask=ok1[None, :], other=0.0)
            dots = tl.sum(key0.to(tl.float32) * q0[None, :], axis=1) + tl.sum(key1.to(tl.float32) * q1[None, :], axis=1)
            scores = tl.where(ok, dots * scale, float("-inf"))
            new_best = tl.maximum(best, tl.max(scores, axis=0))
            p = tl.exp(scores - new_best)
            alpha = tl.exp(best - new_best)
            acc0 = acc0 * alpha + tl.sum(p[:, None] * value0.to(tl.float32), axis=0)
            acc1 = acc1 * alpha + tl.sum(p[:, None] * value1.to(tl.float32), axis=0)
            total = total * alpha + tl.sum(p, axis=0)
            best = new_best
        out = part_ptr + ((row * tl.num_programs(1) + head) * SPLITS + split) * (D_PAD + 2)
        tl.store(out + d0, acc0)
        tl.store(out + d1, acc1)
        tl.store(out + D_PAD, best)
        tl.store(out + D_PAD + 1, total)


@triton.jit
def _attention_split_grouped(
    y_ptr,
    stride_y,
    cos_ptr,
    sin_ptr,
    stride_rot,
    pos_ptr,
    active_ptr,
    k_ptr,
    v_ptr,
    stride_head,
    stride_page,
    table_ptr,
    stride_table,
    part_ptr,
    scale,
    window,
    q_norm_ptr,
    k_norm_ptr,
    eps,
    fill,
    split_columns,
    Q_SIZE: tl.constexpr,
    KV_SIZE: tl.constexpr,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    ROT: tl.constexpr,
    D_PAD: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SPLITS: tl.constexpr,
    QK_NORM: tl.constexpr,
    PAGE: tl.constexpr,
    G_PAD: tl.constexpr,
    HEADS: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """`_attention_split` for grouped heads (GQA): one program per (row, key-value head,
    split) for the GROUP query heads that share it, as a [G_PAD, D_PAD] tile, so each page of
    keys and values is read once for all of them (not once per query head), and the scores and
    the weighted values are tensor-core products (tl.dot). Its part rows are the query heads',
    as `_attention_split` writes them, for `_attention_combine`. The weights p are rounded to
    the model's dtype for the values' product, as transformers' eager attention rounds its
    softmax."""
    row = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    position = tl.load(pos_ptr + row)
    live = position * tl.load(active_ptr + row)  # idle rows attend to no cached column
    first = tl.where(window > 0, tl.maximum(live - window + 1, 0), 0)
    d = tl.arange(0, D_PAD)
    d_ok = d < HEAD_DIM
    rotated = d < ROT
    partner = tl.where(rotated, (d + ROT // 2) % ROT, d)
    dtype = y_ptr.dtype.element_ty
    base = y_ptr + row * stride_y
    cos = tl.load(cos_ptr + position * stride_rot + d, mask=rotated, other=1.0).to(tl.float32)
    sin = tl.load(sin_ptr + position * stride_rot + d, mask=rotated, other=0.0).to(tl.float32)
    cache = kv_head * stride_head
    pages = table_ptr + row * stride_table
    if split == 0:
        k = _head(
            base + Q_SIZE + kv_head * HEAD_DIM, d, d_ok, partner, cos, sin, k_norm_ptr, eps, HEAD_DIM, QK_NORM
        ).to(dtype)
        at = cache + tl.load(pages + position // PAGE).to(tl.int64) * stride_page + (position % PAGE) * HEAD_DIM
        tl.store(k_ptr + at + d, k, mask=d_ok)
        v = tl.load(base + Q_SIZE + KV_SIZE + kv_head * HEAD_DIM + d, mask=d_ok, other=0.0)
        tl.store(v_ptr + at + d, v, mask=d_ok)
    splits = _row_splits(live, first, fill, split_columns, SPLITS)
    if split < splits:  # (as `_attention_split`)
        g = tl.arange(0, G_PAD)
        g_ok = g < GROUP
        heads = kv_head * GROUP + g
        both = g_ok[:, None] & d_ok[None, :]
        x = tl.load(base + heads[:, None] * HEAD_DIM + d[None, :], mask=both, other=0.0)
        p = tl.load(base + heads[:, None] * HEAD_DIM + partner[None, :], mask=both, other=0.0)
        if QK_NORM:  # as `_head`, a row per query head
            xf = x.to(tl.float32)
            inverse = 1.0 / tl.sqrt(tl.sum(xf * xf, axis=1) / HEAD_DIM + eps)
            w = tl.load(q_norm_ptr + d, mask=d_ok, other=0.0).to(tl.float32)
            wp = tl.load(q_norm_ptr + partner, mask=d_ok, other=0.0).to(tl.float32)
            x = ((xf * inverse[:, None]).to(dtype).to(tl.float32) * w[None, :]).to(dtype)
            p = ((p.to(tl.float32) * inverse[:, None]).to(dtype).to(tl.float32) * wp[None, :]).to(dtype)
        q = (x.to(tl.float32) * cos[None, :] + p.to(tl.float32) * sin[None, :]).to(dtype)
        chunk = tl.cdiv(tl.cdiv(live - first, splits), BLOCK_N) * BLOCK_N
        start = first + split * chunk
        end = tl.minimum(start + chunk, live)
        best = tl.full([G_PAD], float("-inf"), tl.float32)
        total = tl.zeros([G_PAD], tl.float32)
        acc = tl.zeros([G_PAD, D_PAD], dtype=tl.float32)
        for begin in range(start, end, BLOCK_N):
            offsets = begin + tl.arange(0, BLOCK_N)
            ok = offsets < end
            keys, values = _paged_columns(k_ptr, v_ptr, pages, cache, offsets, ok, d, d_ok, stride_page, HEAD_DIM, PAGE)
            scores = tl.dot(q, tl.trans(keys), input_precision=PRECISION) * scale
            scores = tl.where(ok[None, :], scores, float("-inf"))
            new_best = tl.maximum(best, tl.max(scores, axis=1))
            weights = tl.exp(scores - new_best[:, None])
            alpha = tl.exp(best - new_best)
            acc = acc * alpha[:, None] + tl.dot(weights.to(dtype), values, input_precision=PRECISION)
            total = total * alpha + tl.sum(weights, axis=1)
            best = new_best
        out = part_ptr + ((row * HEADS + heads) * SPLITS + split) * (D_PAD + 2)
        tl.store(out[:, None] + d[None, :], acc, mask=g_ok[:, None])
        tl.store(out + D_PAD, best, mask=g_ok)
        tl.store(out + D_PAD + 1, total, mask=g_ok)


@triton.jit
def _prefill_rotary(
    y_ptr,
    stride_y,
    cos_ptr,
    sin_ptr,
    stride_rot,
    pos_ptr,
    slot_ptr,
    k_ptr,
    v_ptr,
    stride_head,
    stride_page,
    table_ptr,
    stride_table,
    q_norm_ptr,
    k_norm_ptr,
    eps,
    Q_SIZE: tl.constexpr,
    KV_SIZE: tl.constexpr,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    ROT: tl.constexpr,
    D_PAD: tl.constexpr,
    QK_NORM: tl.constexpr,
    PAGE: tl.constexpr,
):
    """Per (prompt token, query head): q rotated in place in y (normalized first with q/k norms);
    the first query head of each key-value head also writes k (rotated) and v to the token's slot
    of the cache at its position (through the slot's page table, as `_attention_split`)."""
    token = tl.program_id(0)
    head = tl.program_id(1)
    kv_head = head // GROUP
    position = tl.load(pos_ptr + token)
    slot = tl.load(slot_ptr + token)
    d = tl.arange(0, D_PAD)
    d_ok = d < HEAD_DIM
    rotated = d < ROT
    partner = tl.where(rotated, (d + ROT // 2) % ROT, d)
    dtype = y_ptr.dtype.element_ty
    base = y_ptr + token * stride_y
    cos = tl.load(cos_ptr + position * stride_rot + d, mask=rotated, other=1.0).to(tl.float32)
    sin = tl.load(sin_ptr + position * stride_rot + d, mask=rotated, other=0.0).to(tl.float32)
    q = _head(base + head * HEAD_DIM, d, d_ok, partner, cos, sin, q_norm_ptr, eps, HEAD_DIM, QK_NORM)
    if head % GROUP == 0:
        k = _head(base + Q_SIZE + kv_head * HEAD_DIM, d, d_ok, partner, cos, sin, k_norm_ptr, eps, HEAD_DIM, QK_NORM)
        v = tl.load(base + Q_SIZE + KV_SIZE + kv_head * HEAD_DIM + d, mask=d_ok, other=0.0)
        page = tl.load(table_ptr + slot * stride_table + position // PAGE).to(tl.int64)
        cache = kv_head * stride_head + page * stride_page + (position % PAGE) * HEAD_DIM
        tl.store(k_ptr + cache + d, k.to(dtype), mask=d_ok)
        tl.store(v_ptr + cache + d, v, mask=d_ok)
    tl.debug_barrier()  # every lane has read q before any overwrites it
    tl.store(base + head * HEAD_DIM + d, q.to(dtype), mask=d_ok)


# A piece's length and the window are plain values: specialized, Triton compiles a variant per class
# (1, a multiple of 16, other), and a piece of a class not built at start waited for one
# (BENCHMARKS.md, D-no-specialize).
@triton.jit(do_not_specialize=["length", "window"])
def _paged_prefill_attention(
    q_ptr,
    stride_q_row,
    stride_q_token,
    out_ptr,
    stride_o_row,
    stride_o_token,
    k_ptr,
    v_ptr,
    stride_head,
    stride_page,
    table_ptr,
    stride_table,
    slots_ptr,
    starts_ptr,
    lens_ptr,
    length,
    scale,
    window,
    part_ptr,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    D_PAD: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PAGE: tl.constexpr,
    PRECISION: tl.constexpr,
    SPLITS: tl.constexpr,
):
    """One (piece, query head, block of BLOCK_M of the piece's tokens, split of its columns):
    each token's attention over its row's columns up to its own position (the last `window` of
    them with a sliding window), read from the paged cache through the row's table, where the
    piece's own keys and values are already written: no gather of the row's columns into a copy.
    A piece of `lens` tokens starts at position `starts` of cache row `slots`; its tokens past
    `lens` (padding) get zeros. With SPLITS > 1 the block's columns are cut in SPLITS ranges
    (flash-decoding, for a short piece after many columns: otherwise a few programs read them
    all), each program's softmax maximum, sum and weighted values go to part [n, heads, SPLITS,
    length, D_PAD + 2], and `_paged_prefill_combine` writes the output."""
    row = tl.program_id(0)
    head = tl.program_id(1)
    block = tl.program_id(2) // SPLITS
    split = tl.program_id(2) % SPLITS
    n = tl.load(lens_ptr + row).to(tl.int32)
    start = tl.load(starts_ptr + row).to(tl.int32)
    pages = table_ptr + tl.load(slots_ptr + row).to(tl.int64) * stride_table
    cache = (head // GROUP) * stride_head
    m = block * BLOCK_M + tl.arange(0, BLOCK_M)
    m_ok = m < n
    at = start + m  # each token's position
    d = tl.arange(0, D_PAD)
    d_ok = d < HEAD_DIM
    q = tl.load(
        q_ptr + row * stride_q_row + m[:, None] * stride_q_token + head * HEAD_DIM + d[None, :],
        mask=m_ok[:, None] & d_ok[None, :],
        other=0.0,
    )
    end = start + tl.minimum(block * BLOCK_M + BLOCK_M, n)  # past the block's last real token
    first = 0
    if window > 0:
        first = tl.maximum(start + block * BLOCK_M - window + 1, 0) // BLOCK_N * BLOCK_N
    # A block of padding alone reads nothing: a padding row (no tokens) starts at the scratch
    # column, and its loop would read every column up to it.
    end = tl.where(block * BLOCK_M < n, end, first)
    if SPLITS > 1:  # this program's share of the block's columns, whole BLOCK_N at a time
        chunk = tl.cdiv(tl.cdiv(end - first, SPLITS), BLOCK_N) * BLOCK_N
        first = first + split * chunk
        end = tl.minimum(first + chunk, end)
    acc = tl.zeros([BLOCK_M, D_PAD], dtype=tl.float32)
    best = tl.full([BLOCK_M], float("-inf"), tl.float32)
    total = tl.zeros([BLOCK_M], tl.float32)
    for begin in range(first, end, BLOCK_N):
        columns = begin + tl.arange(0, BLOCK_N)
        c_ok = columns < end
        keys, values = _paged_columns(k_ptr, v_ptr, pages, cache, columns, c_ok, d, d_ok, stride_page, HEAD_DIM, PAGE)
        scores = tl.dot(q, tl.trans(keys), input_precision=PRECISION) * scale
        visible = (columns[None, :] <= at[:, None]) & c_ok[None, :]
        if window > 0:
            visible = visible & (columns[None, :] > at[:, None] - window)
        scores = tl.where(visible, scores, float("-inf"))
        new_best = tl.maximum(best, tl.max(scores, axis=1))
        # A token that sees no column of this block yet (a window's start): no NaN from -inf - -inf.
        shift = tl.where(new_best == float("-inf"), 0.0, new_best)
        p = tl.exp(scores - shift[:, None])
        alpha = tl.exp(best - shift)
        total = total * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(values.dtype), values, input_precision=PRECISION)
        best = new_best
    if SPLITS > 1:
        part = part_ptr + (((row * tl.num_programs(1) + head) * SPLITS + split) * length + m) * (D_PAD + 2)
        in_piece = m < length
        tl.store(part[:, None] + d[None, :], acc, mask=in_piece[:, None])
        tl.store(part + D_PAD, best, mask=in_piece)
        tl.store(part + D_PAD + 1, total, mask=in_piece)
    else:
        out = acc / tl.where(total > 0, total, 1.0)[:, None]
        out = tl.where(m_ok[:, None], out, 0.0)
        tl.store(
            out_ptr + row * stride_o_row + m[:, None] * stride_o_token + head * HEAD_DIM + d[None, :],
            out.to(out_ptr.dtype.element_ty),
            mask=(m[:, None] < length) & d_ok[None, :],
        )


@triton.jit(do_not_specialize=["length"])  # (as `_paged_prefill_attention`)
def _paged_prefill_combine(
    part_ptr,
    lens_ptr,
    out_ptr,
    stride_o_row,
    stride_o_token,
    length,
    HEAD_DIM: tl.constexpr,
    D_PAD: tl.constexpr,
    BLOCK_M: tl.constexpr,
    SPLITS: tl.constexpr,
):
    """One (piece, query head, block of BLOCK_M tokens): its splits' partial softmaxes
    (`_paged_prefill_attention` with SPLITS > 1) merged into the attention output. A split that
    read no column has sum 0 and counts for nothing; a token that no split saw (padding) gets
    zeros."""
    row = tl.program_id(0)
    head = tl.program_id(1)
    m = tl.program_id(2) * BLOCK_M + tl.arange(0, BLOCK_M)
    m_ok = m < length
    real = m < tl.load(lens_ptr + row).to(tl.int32)
    d = tl.arange(0, D_PAD)
    parts = part_ptr + ((row * tl.num_programs(1) + head) * SPLITS * length + m) * (D_PAD + 2)
    best = tl.full([BLOCK_M], float("-inf"), tl.float32)
    for split in range(SPLITS):
        part = parts + split * length * (D_PAD + 2)
        split_total = tl.load(part + D_PAD + 1, mask=m_ok, other=0.0)
        split_best = tl.load(part + D_PAD, mask=m_ok, other=float("-inf"))
        best = tl.maximum(best, tl.where(split_total > 0, split_best, float("-inf")))
    shift = tl.where(best == float("-inf"), 0.0, best)
    acc = tl.zeros([BLOCK_M, D_PAD], dtype=tl.float32)
    total = tl.zeros([BLOCK_M], tl.float32)
    for split in range(SPLITS):
        part = parts + split * length * (D_PAD + 2)
        split_total = tl.load(part + D_PAD + 1, mask=m_ok, other=0.0)
        split_best = tl.load(part + D_PAD, mask=m_ok, other=0.0)
        weight = tl.where(split_total > 0, tl.exp(split_best - shift), 0.0)
        acc += tl.load(part[:, None] + d[None, :], mask=m_ok[:, None], other=0.0) * weight[:, None]
        total += split_total * weight
    out = tl.where(real[:, None], acc / tl.where(total > 0, total, 1.0)[:, None], 0.0)
    tl.store(
        out_ptr + row * stride_o_row + m[:, None] * stride_o_token + head * HEAD_DIM + d[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=m_ok[:, None] & (d < HEAD_DIM)[None, :],
    )


@triton.jit
def _attention_combine(
    y_ptr,
    stride_y,
    cos_ptr,
    sin_ptr,
    stride_rot,
    pos_ptr,
    active_ptr,
    window,
    fill,
    split_columns,
    part_ptr,
    scale,
    mixed_ptr,
    stride_mixed,
    x_ptr,
    stride_x,
    bias_ptr,
    xb_ptr,
    inner,
    q_norm_ptr,
    k_norm_ptr,
    eps,
    Q_SIZE: tl.constexpr,
    KV_SIZE: tl.constexpr,
    GROUP: tl.constexpr,
    HIDDEN: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    ROT: tl.constexpr,
    D_PAD: tl.constexpr,
    SPLITS: tl.constexpr,
    HEADS: tl.constexpr,
    BLOCK: tl.constexpr,
    QK_NORM: tl.constexpr,
    PARALLEL: tl.constexpr,
    HAS_BIAS: tl.constexpr,
):
    """Per row, programs 0..HEADS-1: a query head's splits and the new token itself -> its
    attention output, to mixed[:, head]. A parallel block (Phi) has more programs: GELU(fc1) ->
    mixed[:, Q_SIZE:], and the last one x + the output bias -> xb (the out GEMM adds its product
    to xb)."""
    row = tl.program_id(0)
    job = tl.program_id(1)
    dtype = y_ptr.dtype.element_ty
    if job < HEADS:
        head = job
        kv_head = head // GROUP
        position = tl.load(pos_ptr + row)
        d = tl.arange(0, D_PAD)
        d_ok = d < HEAD_DIM
        rotated = d < ROT
        partner = tl.where(rotated, (d + ROT // 2) % ROT, d)
        base = y_ptr + row * stride_y
        cos = tl.load(cos_ptr + position * stride_rot + d, mask=rotated, other=1.0).to(tl.float32)
        sin = tl.load(sin_ptr + position * stride_rot + d, mask=rotated, other=0.0).to(tl.float32)
        q = (
            _head(base + head * HEAD_DIM, d, d_ok, partner, cos, sin, q_norm_ptr, eps, HEAD_DIM, QK_NORM)
            .to(dtype)
            .to(tl.float32)
        )
        k = (
            _head(base + Q_SIZE + kv_head * HEAD_DIM, d, d_ok, partner, cos, sin, k_norm_ptr, eps, HEAD_DIM, QK_NORM)
            .to(dtype)
            .to(tl.float32)
        )
        best = tl.sum(q * k, axis=0) * scale  # the new token's own score
        total = best * 0.0 + 1.0
        acc = tl.load(base + Q_SIZE + KV_SIZE + kv_head * HEAD_DIM + d, mask=d_ok, other=0.0).to(tl.float32)
        parts = part_ptr + (row * HEADS + head) * SPLITS * (D_PAD + 2)
        live = position * tl.load(active_ptr + row)
        first = tl.where(window > 0, tl.maximum(live - window + 1, 0), 0)
        for split in range(_row_splits(live, first, fill, split_columns, SPLITS)):  # the parts written
            part = parts + split * (D_PAD + 2)
            split_best = tl.load(part + D_PAD)
            split_total = tl.load(part + D_PAD + 1)
            new_best = tl.maximum(best, split_best)
            alpha = tl.exp(best - new_best)
            beta = tl.where(split_total > 0, tl.exp(split_best - new_best), 0.0)
            acc = acc * alpha + tl.load(part + d) * beta
            total = total * alpha + split_total * beta
            best = new_best
        tl.store(mixed_ptr + row * stride_mixed + head * HEAD_DIM + d, (acc / total).to(dtype), mask=d_ok)
    elif PARALLEL:
        chunk = job - HEADS
        offsets = chunk * BLOCK + tl.arange(0, BLOCK)
        if chunk * BLOCK < inner:  # GELU (tanh) of the fc1 columns, rounded as F.gelu's output is
            ok = offsets < inner
            u = tl.load(y_ptr + row * stride_y + Q_SIZE + 2 * KV_SIZE + offsets, mask=ok, other=0.0).to(tl.float32)
            gelu = 0.5 * u * (1.0 + _tanh(0.7978845608028654 * (u + 0.044715 * u * u * u)))
            tl.store(mixed_ptr + row * stride_mixed + Q_SIZE + offsets, gelu.to(dtype), mask=ok)
        else:  # the residual plus the out bias
            for at in range(0, HIDDEN, BLOCK):
                cols = at + tl.arange(0, BLOCK)
                ok = cols < HIDDEN
                x = tl.load(x_ptr + row * stride_x + cols, mask=ok, other=0.0).to(tl.float32)
                if HAS_BIAS:
                    x += tl.load(bias_ptr + cols, mask=ok, other=0.0).to(tl.float32)
                tl.store(xb_ptr + row * HIDDEN + cols, x.to(dtype), mask=ok)


@triton.jit
def _norm(
    x_ptr,
    stride_x,
    w_ptr,
    b_ptr,
    out_ptr,
    eps,
    N: tl.constexpr,
    BLOCK: tl.constexpr,
    RMS: tl.constexpr,
    HAS_BIAS: tl.constexpr,
):
    """Per row, in float32: RMSNorm as transformers computes it (x * rsqrt(mean(x^2) + eps),
    rounded to the dtype, times the weight), or LayerNorm as torch does ((x - mean) * rstd *
    weight + bias, rounded once). In the step it takes less than torch's LayerNorm kernel
    (BENCHMARKS.md, D-layernorm-triton)."""
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    ok = cols < N
    x = tl.load(x_ptr + row * stride_x + cols, mask=ok, other=0.0)
    dtype = x.dtype
    xf = x.to(tl.float32)
    w = tl.load(w_ptr + cols, mask=ok, other=0.0).to(tl.float32)
    if RMS:
        scale = 1.0 / tl.sqrt(tl.sum(xf * xf, axis=0) / N + eps)
        out = (xf * scale).to(dtype).to(tl.float32) * w
    else:
        centered = tl.where(ok, xf - tl.sum(xf, axis=0) / N, 0.0)
        scale = 1.0 / tl.sqrt(tl.sum(centered * centered, axis=0) / N + eps)
        out = centered * scale * w
        if HAS_BIAS:
            out += tl.load(b_ptr + cols, mask=ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * N + cols, out.to(dtype), mask=ok)


@triton.jit
def _silu_mul(u_ptr, stride_u, out_ptr, INNER: tl.constexpr, BLOCK: tl.constexpr):
    """silu(gate) * up of a gated MLP's fused [gate; up] row, each product rounded as torch rounds it."""
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < INNER
    gate = tl.load(u_ptr + row * stride_u + cols, mask=ok, other=0.0)
    up = tl.load(u_ptr + row * stride_u + INNER + cols, mask=ok, other=0.0)
    dtype = gate.dtype
    g = gate.to(tl.float32)
    silu = (g / (1.0 + tl.exp(-g))).to(dtype)
    tl.store(out_ptr + row * INNER + cols, (silu.to(tl.float32) * up.to(tl.float32)).to(dtype), mask=ok)


@triton.jit
def _gumbel_argmax(scores_ptr, stride, seeds_ptr, offsets_ptr, out_ptr, V, BLOCK: tl.constexpr):
    """Per row: argmax over v of scores[v] + Gumbel noise drawn from (the row's seed, its offset
    * V + v): a sample from softmax(scores), the same for the same seed and position in any batch."""
    row = tl.program_id(0)
    seed = tl.load(seeds_ptr + row)
    base = tl.load(offsets_ptr + row).to(tl.int32) * V
    best = tl.max(tl.full([BLOCK], float("-inf"), tl.float32), axis=0)
    chosen = tl.max(tl.zeros([BLOCK], tl.int32), axis=0)
    for start in range(0, V, BLOCK):
        v = start + tl.arange(0, BLOCK)
        ok = v < V
        score = tl.load(scores_ptr + row * stride + v, mask=ok, other=float("-inf"))
        u = tl.rand(seed, base + v)
        noisy = tl.where(score > float("-inf"), score - tl.log(-tl.log(tl.maximum(u, 1e-20))), float("-inf"))
        block_best = tl.max(noisy, axis=0)
        block_arg = tl.argmax(noisy, axis=0).to(tl.int32) + start
        better = block_best > best
        chosen = tl.where(better, block_arg, chosen)
        best = tl.where(better, block_best, best)
    tl.store(out_ptr + row, chosen.to(tl.int64))


def gumbel_argmax(scores, seeds, offsets):
    """Rows of float32 scores [n, V] -> one sampled id each (int64 [n]), from per-row seeds
    (int64, below 2**31) and offsets (the token's position: a new draw every token)."""
    out = torch.empty(scores.shape[0], dtype=torch.long, device=scores.device)
    _gumbel_argmax[(scores.shape[0],)](
        scores, scores.stride(0), seeds, offsets, out, scores.shape[1], BLOCK=2048, num_warps=8
    )
    return out


class Heads(NamedTuple):
    """A model's attention as the kernels need it (backends/files/architecture.py's facts)."""

    heads: int
    kv_heads: int
    head_dim: int
    rotary_dim: int
    eps: float = 1e-6  # the q/k norms' (Qwen3)

    @property
    def group(self) -> int:
        return self.heads // self.kv_heads

    @property
    def q_size(self) -> int:
        return self.heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.kv_heads * self.head_dim


def _norm_args(q_norm, k_norm, like: torch.Tensor):
    """The q/k norms' weights, or a stand-in pointer where the model has none (QK_NORM off)."""
    if q_norm is None:
        return like, like, False
    return q_norm, k_norm, True


def _paged(k_cache, v_cache, table, heads: Heads) -> tuple:
    """The paged cache's arguments: head and page strides, the table and its row stride."""
    assert k_cache.stride(2) == heads.head_dim and k_cache.stride(3) == 1 and k_cache.stride() == v_cache.stride()
    assert k_cache.shape[2] == PAGE and table.stride(1) == 1
    return k_cache.stride(0), k_cache.stride(1), table, table.stride(0)


def prefill_rotary(y, cos, sin, positions, slots, k_cache, v_cache, table, heads: Heads, q_norm=None, k_norm=None):
    """Prompt tokens y [tokens, q + 2 kv + ...] at `positions` of cache rows `slots` (both
    [tokens]): q rotated in place, k and v to the paged cache [kv_heads, pages, PAGE, head_dim]
    through the rows' page `table` [rows, width] (backends/kv_pages)."""
    assert y.stride(1) == 1
    q_w, k_w, qk_norm = _norm_args(q_norm, k_norm, y)
    _prefill_rotary[(y.shape[0], heads.heads)](
        y,
        y.stride(0),
        cos,
        sin,
        cos.stride(0),
        positions,
        slots,
        k_cache,
        v_cache,
        *_paged(k_cache, v_cache, table, heads),
        q_w,
        k_w,
        heads.eps,
        Q_SIZE=heads.q_size,
        KV_SIZE=heads.kv_size,
        GROUP=heads.group,
        HEAD_DIM=heads.head_dim,
        ROT=heads.rotary_dim,
        D_PAD=triton.next_power_of_2(heads.head_dim),
        QK_NORM=qk_norm,
        PAGE=PAGE,
        num_warps=1,
    )


# Launch shapes of `_attention_split`: 16 columns a loop step, 64 for 80-dim heads (Phi-2's step
# shorter; 96 and 128 dims were not, BENCHMARKS.md, D-block-n); 2 warps up to 16 rows, 1 beyond.
# A row's columns are split `fill_splits` ways (enough programs to fill the GPU at small batch),
# or one split per `split_columns` where its length asks for more, within `max_splits` and a grid
# of at most `max_programs` (BENCHMARKS.md, D-split-columns).
ATTENTION = {
    "BLOCK_N": 16,
    "BLOCK_N_BY_HEAD_DIM": {80: 64},
    "num_warps": None,
    "max_splits": 16,
    "work": 2048,
    "split_columns": 256,
    "max_programs": 65536,
}
# Launch shape of `_attention_split_grouped`: the query heads of a key-value head as one tile,
# faster than a program per query head for grouped heads (BENCHMARKS.md, D-grouped).
GROUPED_ATTENTION = {"BLOCK_N": 32, "num_warps": 2, "num_stages": 2}
# Fewer key-value heads keep a program per query head: Qwen2.5-1.5B's 2 made its step faster but
# its server slower, for a reason not yet known (BENCHMARKS.md, D-grouped).
GROUPED_FROM_KV_HEADS = 4


def fill_splits(rows: int, heads: int) -> int:
    """Splits of every row's columns: enough (row, head, split) programs to fill the GPU at small
    batch, one split where rows x heads already do."""
    return max(1, min(ATTENTION["max_splits"], ATTENTION["work"] // (rows * heads)))


def splits_for(rows: int, heads: int, columns: int) -> int:
    """The grid's splits a (row, head), for rows of up to `columns` columns: `fill_splits`, or as
    many as the longest row may take (one per `split_columns`)."""
    by_length = min(
        ATTENTION["max_splits"],
        -(-columns // ATTENTION["split_columns"]),
        ATTENTION["max_programs"] // (rows * heads),
    )
    return max(fill_splits(rows, heads), by_length, 1)


def _tiles(head_dim: int) -> tuple[int, int]:
    """`_attention_split`'s two tiles of a head's dims: half the power of two that holds it, and
    the rest padded to a power of two (80 = 64 + 16, 96 = 64 + 32, 128 = 64 + 64, 112 = 64 + 48
    of 64)."""
    low = triton.next_power_of_2(head_dim) // 2
    return low, triton.next_power_of_2(head_dim - low)


def attention_block(head_dim: int) -> int:
    """`_attention_split`'s columns a loop step for heads of `head_dim` dims."""
    return ATTENTION["BLOCK_N_BY_HEAD_DIM"].get(head_dim, ATTENTION["BLOCK_N"])


def _attention_warps(rows: int) -> int:
    return ATTENTION["num_warps"] or (2 if rows <= 16 else 1)


def attention(
    y,
    cos,
    sin,
    positions,
    active,
    k_cache,
    v_cache,
    table,
    heads: Heads,
    *,
    window: int | None = None,
    q_norm=None,
    k_norm=None,
    x=None,
    b_out=None,
    inner: int = 0,
):
    """The middle of a block, from y = [q; k; v; ...] (before rotary) of each row's new token:
    writes k, v to the paged cache [kv_heads, pages, PAGE, head_dim] at the row's position (its
    page from `table` [rows, width], backends/kv_pages) and returns
    the attention output [rows, q]. `active` rows (1) attend to their columns 0..position-1 (the
    last `window` - 1 of them with a sliding window) and the new token, idle rows (0) to the new
    token alone.

    For a parallel block (Phi: `x` given, y = [q; k; v; fc1]) it returns (mixed, xb) instead:
    mixed = [attention output, gelu(fc1)] for the out GEMM, xb = x + b_out for it to add to."""
    rows = y.shape[0]
    splits = splits_for(rows, heads.heads, table.shape[1] * PAGE)
    d_pad = triton.next_power_of_2(heads.head_dim)
    parts = torch.empty(rows, heads.heads, splits, d_pad + 2, dtype=torch.float32, device=y.device)
    scale = heads.head_dim**-0.5
    fill = fill_splits(rows, heads.heads)
    q_w, k_w, qk_norm = _norm_args(q_norm, k_norm, y)
    common = dict(
        Q_SIZE=heads.q_size,
        KV_SIZE=heads.kv_size,
        GROUP=heads.group,
        HEAD_DIM=heads.head_dim,
        ROT=heads.rotary_dim,
        D_PAD=d_pad,
        QK_NORM=qk_norm,
    )
    args = (
        y,
        y.stride(0),
        cos,
        sin,
        cos.stride(0),
        positions,
        active,
        k_cache,
        v_cache,
        *_paged(k_cache, v_cache, table, heads),
        parts,
        scale,
        window or 0,
        q_w,
        k_w,
        heads.eps,
        fill,
        ATTENTION["split_columns"],
    )
    if heads.group > 1 and heads.kv_heads >= GROUPED_FROM_KV_HEADS:
        _attention_split_grouped[(rows, heads.kv_heads, splits)](
            *args,
            SPLITS=splits,
            PAGE=PAGE,
            G_PAD=max(16, triton.next_power_of_2(heads.group)),  # tl.dot's least rows
            HEADS=heads.heads,
            PRECISION="ieee" if y.dtype == torch.float32 else "tf32",  # float32: no TF32 rounding
            **GROUPED_ATTENTION,
            **common,
        )
    else:
        d_lo, d_hi = _tiles(heads.head_dim)
        _attention_split[(rows, heads.heads, splits)](
            *args,
            D_LO=d_lo,
            D_HI=d_hi,
            BLOCK_N=attention_block(heads.head_dim),
            SPLITS=splits,
            PAGE=PAGE,
            num_warps=_attention_warps(rows),
            **common,
        )
    parallel = x is not None
    hidden = x.shape[1] if parallel else 0
    mixed = torch.empty(rows, heads.q_size + (inner if parallel else 0), dtype=y.dtype, device=y.device)
    xb = torch.empty(rows, hidden, dtype=y.dtype, device=y.device) if parallel else mixed
    block = 1024
    programs = heads.heads + (triton.cdiv(inner, block) + 1 if parallel else 0)
    _attention_combine[(rows, programs)](
        y,
        y.stride(0),
        cos,
        sin,
        cos.stride(0),
        positions,
        active,
        window or 0,
        fill,
        ATTENTION["split_columns"],
        parts,
        scale,
        mixed,
        mixed.stride(0),
        x if parallel else y,
        x.stride(0) if parallel else 0,
        b_out if b_out is not None else y,
        xb,
        inner,
        q_w,
        k_w,
        heads.eps,
        HIDDEN=hidden,
        SPLITS=splits,
        HEADS=heads.heads,
        BLOCK=block,
        PARALLEL=parallel,
        HAS_BIAS=b_out is not None,
        num_warps=4,
        **common,
    )
    return (mixed, xb) if parallel else mixed


# Launch shape of `_paged_prefill_attention`: tokens and columns a block (BENCHMARKS.md, D-prefill-splits).
PREFILL_ATTENTION = {"BLOCK_M": 64, "BLOCK_N": 32, "num_warps": 4, "num_stages": 2}
# Its column splits: enough programs to fill an H200's 132 multiprocessors a few times over, each
# at least PREFILL_SPLIT_COLUMNS columns of its caller's bound (BENCHMARKS.md, D-prefill-splits).
PREFILL_PROGRAMS, PREFILL_MAX_SPLITS, PREFILL_SPLIT_COLUMNS = 512, 16, 256


def prefill_splits(programs: int, reach: int | None) -> int:
    """How many ways `_paged_prefill_attention` cuts each block's columns: 1 unless its
    (piece, head, block) programs are few and the pieces may reach far (`reach`: a bound on the
    columns any piece attends to, known on the host); a power of two."""
    if not reach:
        return 1
    splits = min(PREFILL_MAX_SPLITS, PREFILL_PROGRAMS // max(programs, 1), reach // PREFILL_SPLIT_COLUMNS)
    return 1 << (splits.bit_length() - 1) if splits > 1 else 1


def paged_prefill_attention(
    q, k_cache, v_cache, table, slots, starts, lens, heads: Heads, window: int | None = None, reach: int | None = None,
    splits: int | None = None,
):  # fmt: skip
    """Attention of prompt pieces q [n, length, >= q_size] (rotated; rows and tokens may be
    strided, as y's q part) over their rows' paged cache [kv_heads, pages, PAGE, head_dim]
    (backends/kv_pages), which holds their own keys and values already: piece r is `lens[r]`
    tokens from position `starts[r]` of cache row `slots[r]`, each token attending to the
    row's columns up to its own position. `reach`, if given, bounds the columns a piece reaches
    (start + length): a short piece after many columns has them read by several programs each
    (`prefill_splits`; `splits` sets their number). Returns [n, length, q_size]; padding tokens
    get zeros. Everything is read on the device: a CUDA graph can capture it."""
    assert q.stride(-1) == 1 and all(t.is_contiguous() for t in (slots, starts, lens))
    n, length = q.shape[0], q.shape[1]
    out = torch.empty(n, length, heads.q_size, dtype=q.dtype, device=q.device)
    block_m = PREFILL_ATTENTION["BLOCK_M"]
    blocks = triton.cdiv(length, block_m)
    if splits is None:
        splits = prefill_splits(n * heads.heads * blocks, reach)
    d_pad = max(16, triton.next_power_of_2(heads.head_dim))
    part = (
        torch.empty(n * heads.heads * splits * length * (d_pad + 2), dtype=torch.float32, device=q.device)
        if splits > 1
        else out  # not read
    )
    _paged_prefill_attention[(n, heads.heads, blocks * splits)](
        q,
        q.stride(0),
        q.stride(1),
        out,
        out.stride(0),
        out.stride(1),
        k_cache,
        v_cache,
        *_paged(k_cache, v_cache, table, heads),
        slots,
        starts,
        lens,
        length,
        heads.head_dim**-0.5,
        window or 0,
        part,
        GROUP=heads.group,
        HEAD_DIM=heads.head_dim,
        D_PAD=d_pad,
        BLOCK_M=block_m,
        BLOCK_N=PREFILL_ATTENTION["BLOCK_N"],
        PAGE=PAGE,
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        SPLITS=splits,
        num_warps=PREFILL_ATTENTION["num_warps"],
        num_stages=PREFILL_ATTENTION["num_stages"],
    )
    if splits > 1:
        _paged_prefill_combine[(n, heads.heads, blocks)](
            part,
            lens,
            out,
            out.stride(0),
            out.stride(1),
            length,
            HEAD_DIM=heads.head_dim,
            D_PAD=d_pad,
            BLOCK_M=block_m,
            SPLITS=splits,
            num_warps=PREFILL_ATTENTION["num_warps"],
        )
    return out


def norm(x, weight, bias, eps: float, rms: bool):
    """Each row of x [rows, n] normalized: transformers' RMSNorm (`rms`; no bias) or LayerNorm
    (with `bias` if given), as torch_decoder.norm computes them, one kernel (its arguments)."""
    out = torch.empty(x.shape[0], x.shape[1], dtype=x.dtype, device=x.device)
    _norm[(x.shape[0],)](
        x,
        x.stride(0),
        weight,
        weight if bias is None else bias,  # not read without one
        out,
        eps,
        N=x.shape[1],
        BLOCK=triton.next_power_of_2(x.shape[1]),
        RMS=rms,
        HAS_BIAS=bias is not None,
        num_warps=4,
    )
    return out


def silu_mul(u, inner: int):
    """silu(gate) * up from a gated MLP's [gate; up] rows u [rows, 2 inner], one kernel."""
    out = torch.empty(u.shape[0], inner, dtype=u.dtype, device=u.device)
    block = 1024
    _silu_mul[(u.shape[0], triton.cdiv(inner, block))](u, u.stride(0), out, INNER=inner, BLOCK=block, num_warps=4)
    return out


@functools.cache  # once a process for a device and model shape, however many decoders are built
def works(device, dtype, heads: Heads, hidden: int, inner: int, parallel: bool, qk_norm: bool, gated: bool) -> bool:
    """Whether these kernels compile and run on `device` for the model's shapes (the compiled
    kernels are cached for the real calls): a GPU Triton cannot build for gets the torch step."""
    try:
        rows = 1
        y = torch.randn(rows, heads.q_size + 2 * heads.kv_size + (inner if parallel else 0), device=device, dtype=dtype)
        x = torch.randn(rows, hidden, device=device, dtype=dtype)
        cache = [torch.zeros(heads.kv_heads, 2, PAGE, heads.head_dim, device=device, dtype=dtype) for _ in range(2)]
        pages = torch.ones(rows, 1, dtype=torch.long, device=device)
        table = torch.ones(4, heads.rotary_dim, device=device, dtype=dtype)
        one = torch.ones(rows, dtype=torch.long, device=device)
        norms = (torch.ones(heads.head_dim, device=device, dtype=dtype),) * 2 if qk_norm else (None, None)
        if parallel:  # Phi: LayerNorm (architecture.py), the others RMSNorm
            attention(y, table, table, one, one, *cache, pages, heads, x=x, b_out=x[0], inner=inner)
            norm(x, x[0], x[0], 1e-5, rms=False)
        else:
            attention(y, table, table, one, one, *cache, pages, heads, window=2, q_norm=norms[0], k_norm=norms[1])
            norm(x, x[0], None, 1e-6, rms=True)
            if gated:
                silu_mul(torch.randn(rows, 2 * inner, device=device, dtype=dtype), inner)
        prefill_rotary(y, table, table, one, one - 1, *cache, pages, heads, *norms)
        # Every split count `prefill_splits` may choose (a short piece after many columns is
        # read by several programs): compiled here, not in a request's prefill.
        for k in range(PREFILL_MAX_SPLITS.bit_length()):
            paged_prefill_attention(y[:, None], *cache, pages, one - 1, one - 1, one, heads, splits=1 << k)
        gumbel_argmax(y[:, :64].float(), one, one)
        torch.cuda.synchronize(device)
        return True
    except Exception:
        log.exception("the Triton decode kernels do not run here: the torch-ops step serves instead")
        return False
