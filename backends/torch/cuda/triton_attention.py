"""The decode step's attention (backends/torch/cuda/triton_common.py has the overview):
`_attention_split` (or `_attention_split_grouped`), then `_attention_combine`."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from backends.torch.cuda.triton_common import (
    Heads,
    _head,
    _head_tiles,
    _norm_args,
    _paged,
    _paged_columns,
    _row_splits,
    _tanh,
)
from backends.torch.kv_pages import PAGE


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


# Launch shapes of `_attention_split`: 16 columns a loop step, 64 for 80-dim heads (Phi-2's step
# shorter; 96 and 128 dims were not, docs/decisions.md, D-block-n); 2 warps up to 16 rows, 1 beyond.
# A row's columns are split `fill_splits` ways (enough programs to fill the GPU at small batch),
# or one split per `split_columns` where its length asks for more, within `max_splits` and a grid
# of at most `max_programs` (docs/decisions.md, D-split-columns).
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
# faster than a program per query head for grouped heads (docs/decisions.md, D-grouped).
GROUPED_ATTENTION = {"BLOCK_N": 32, "num_warps": 2, "num_stages": 2}


# Fewer key-value heads keep a program per query head: Qwen2.5-1.5B's 2 made its step faster but
# its server slower, for a reason not yet known (docs/decisions.md, D-grouped).
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
