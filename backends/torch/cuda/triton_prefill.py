"""Prefill's kernels: `_prefill_rotary` (rotary on q, k and v to the cache, one kernel a block) and
the paged attention of prompt pieces (`_paged_prefill_attention`, its splits combined)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from backends.torch.cuda.triton_common import Heads, _head, _norm_args, _paged, _paged_columns
from backends.torch.kv_pages import PAGE


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
# (docs/decisions.md, D-no-specialize).
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


# Launch shape of `_paged_prefill_attention`: tokens and columns a block (docs/decisions.md, D-prefill-splits).
PREFILL_ATTENTION = {"BLOCK_M": 64, "BLOCK_N": 32, "num_warps": 4, "num_stages": 2}


# Its column splits: enough programs to fill an H200's 132 multiprocessors a few times over, each
# at least PREFILL_SPLIT_COLUMNS columns of its caller's bound (docs/decisions.md, D-prefill-splits).
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
