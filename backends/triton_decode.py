"""A Phi block's decode step in three Triton kernels, for CUDA (torch_fast uses it when Triton is
there; the CPU never imports this module).

The step is memory-bound: at batch 1 the whole cost should be reading the weights once. cuBLAS
plus ~18 small kernels a block reached 52% of the copy bandwidth (BENCHMARKS.md, "Where a
batch-1 step's time goes"): the GEMVs stream at ~78% and the small kernels leave the memory idle
between them. Here a block is three launches, each doing its small work beside a weight stream:

1. `ln_linear`: LayerNorm of the residual (its statistics computed by every program: the row is
   10 KB, read from L2), times [q; k; v; fc1], plus bias, GELU on the fc1 columns.
2. `decode_attention`: per (row, head), rotary on q and k, k and v written to the cache at the
   row's position, attention over the row's cached columns 0..position-1 and itself (an online
   softmax over only the live columns: no mask, no attention-length bucket), written over q.
3. `linear_residual`: [attention, gelu(fc1)] (the k/v columns between them skipped) times
   [dense | fc2], plus bias, plus the residual.

Arithmetic is in float32 with each GEMV's output rounded to the model's dtype, as F.linear's is.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _tanh(u):
    return 1.0 - 2.0 / (tl.exp(2.0 * u) + 1.0)


@triton.jit
def _gemv(
    x_ptr, ln_w_ptr, ln_b_ptr, w_ptr, b_ptr, res_ptr, y_ptr,
    M, N, K, stride_x, stride_w, stride_res, stride_y, eps, split, gap, gelu_from,
    NORM: tl.constexpr, RESIDUAL: tl.constexpr, GELU: tl.constexpr, DOT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """y[m, n] = sum_k in(x)[m, k] * w[n, k] + b[n] (then GELU from column `gelu_from`, then + res).
    in(x) is LayerNorm(x) if NORM; input column k is read at k, or at k + gap from k >= split."""
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    m_ok = rm < M
    n_ok = rn < N
    dtype = y_ptr.dtype.element_ty
    if NORM:  # two passes over the (L2-resident) row: the mean, then the variance around it
        total = tl.zeros([BLOCK_M], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            ok = m_ok[:, None] & ((k0 + rk) < K)[None, :]
            total += tl.sum(tl.load(x_ptr + rm[:, None] * stride_x + (k0 + rk)[None, :], mask=ok, other=0.0).to(tl.float32), axis=1)
        mean = total / K
        spread = tl.zeros([BLOCK_M], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            ok = m_ok[:, None] & ((k0 + rk) < K)[None, :]
            xk = tl.load(x_ptr + rm[:, None] * stride_x + (k0 + rk)[None, :], mask=ok, other=0.0).to(tl.float32)
            centred = tl.where(ok, xk - mean[:, None], 0.0)
            spread += tl.sum(centred * centred, axis=1)
        rstd = 1.0 / tl.sqrt(spread / K + eps)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + rk
        k_ok = kk < K
        column = kk + tl.where(kk >= split, gap, 0)
        xk = tl.load(x_ptr + rm[:, None] * stride_x + column[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        if NORM:
            ln_w = tl.load(ln_w_ptr + kk, mask=k_ok, other=0.0).to(tl.float32)
            ln_b = tl.load(ln_b_ptr + kk, mask=k_ok, other=0.0).to(tl.float32)
            xk = ((xk.to(tl.float32) - mean[:, None]) * rstd[:, None] * ln_w[None, :] + ln_b[None, :]).to(dtype)
        w = tl.load(w_ptr + rn[:, None] * stride_w + kk[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0)
        if DOT:
            acc += tl.dot(xk, tl.trans(w), input_precision="ieee")
        else:
            acc += tl.sum(xk.to(tl.float32)[:, None, :] * w.to(tl.float32)[None, :, :], axis=2)
    bias = tl.load(b_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)
    out = (acc + bias[None, :]).to(dtype)
    if GELU:  # the tanh approximation (Phi's gelu_new), on the rounded product as F.gelu sees it
        u = out.to(tl.float32)
        gelu = 0.5 * u * (1.0 + _tanh(0.7978845608028654 * (u + 0.044715 * u * u * u)))
        out = tl.where((rn >= gelu_from)[None, :], gelu.to(dtype), out)
    ok = m_ok[:, None] & n_ok[None, :]
    if RESIDUAL:
        residual = tl.load(res_ptr + rm[:, None] * stride_res + rn[None, :], mask=ok, other=0.0)
        out = (residual.to(tl.float32) + out.to(tl.float32)).to(dtype)
    tl.store(y_ptr + rm[:, None] * stride_y + rn[None, :], out, mask=ok)


@triton.jit
def _rotated(base, d, d_ok, partner, cos, sin):
    return tl.load(base + d, mask=d_ok, other=0.0).to(tl.float32) * cos + tl.load(base + partner, mask=d_ok, other=0.0).to(tl.float32) * sin


@triton.jit
def _attention_split(
    y_ptr, stride_y, cos_ptr, sin_ptr, stride_rot, pos_ptr, active_ptr, k_ptr, v_ptr, stride_row, stride_head, part_ptr, scale,
    HIDDEN: tl.constexpr, HEAD_DIM: tl.constexpr, ROT: tl.constexpr, D_PAD: tl.constexpr, BLOCK_N: tl.constexpr, SPLITS: tl.constexpr,
):
    """One split of one (row, head)'s cached columns 0..position-1 (flash-decoding): its softmax
    maximum, sum and weighted values, to part [row, head, split, D_PAD + 2]. Split 0 also writes
    the new token's k (rotated) and v to the cache at the row's position."""
    row = tl.program_id(0)
    head = tl.program_id(1)
    split = tl.program_id(2)
    position = tl.load(pos_ptr + row)
    live = position * tl.load(active_ptr + row)  # idle rows attend to no cached column
    d = tl.arange(0, D_PAD)
    d_ok = d < HEAD_DIM
    rotated = d < ROT
    partner = tl.where(rotated, (d + ROT // 2) % ROT, d)  # rotate_half as a roll, its sign in the sin table
    dtype = y_ptr.dtype.element_ty
    base = y_ptr + row * stride_y + head * HEAD_DIM
    cos = tl.load(cos_ptr + position * stride_rot + d, mask=rotated, other=1.0).to(tl.float32)
    sin = tl.load(sin_ptr + position * stride_rot + d, mask=rotated, other=0.0).to(tl.float32)
    q = _rotated(base, d, d_ok, partner, cos, sin).to(dtype).to(tl.float32)
    cache = row * stride_row + head * stride_head
    if split == 0:
        k = _rotated(base + HIDDEN, d, d_ok, partner, cos, sin).to(dtype)
        tl.store(k_ptr + cache + position * HEAD_DIM + d, k, mask=d_ok)
        tl.store(v_ptr + cache + position * HEAD_DIM + d, tl.load(base + 2 * HIDDEN + d, mask=d_ok, other=0.0), mask=d_ok)
    chunk = tl.cdiv(tl.cdiv(live, SPLITS), BLOCK_N) * BLOCK_N
    start = split * chunk
    end = tl.minimum(start + chunk, live)
    best = tl.max(tl.full([BLOCK_N], float("-inf"), tl.float32), axis=0)
    total = tl.sum(tl.zeros([BLOCK_N], tl.float32), axis=0)
    acc = tl.zeros([D_PAD], dtype=tl.float32)
    for begin in range(start, end, BLOCK_N):
        offsets = begin + tl.arange(0, BLOCK_N)
        ok = offsets < end
        where = cache + offsets[:, None] * HEAD_DIM + d[None, :]
        both = ok[:, None] & d_ok[None, :]
        keys = tl.load(k_ptr + where, mask=both, other=0.0)
        values = tl.load(v_ptr + where, mask=both, other=0.0)
        scores = tl.where(ok, tl.sum(keys.to(tl.float32) * q[None, :], axis=1) * scale, float("-inf"))
        new_best = tl.maximum(best, tl.max(scores, axis=0))
        p = tl.exp(scores - new_best)
        alpha = tl.exp(best - new_best)
        acc = acc * alpha + tl.sum(p[:, None] * values.to(tl.float32), axis=0)
        total = total * alpha + tl.sum(p, axis=0)
        best = new_best
    out = part_ptr + ((row * tl.num_programs(1) + head) * SPLITS + split) * (D_PAD + 2)
    tl.store(out + d, acc)
    tl.store(out + D_PAD, best)
    tl.store(out + D_PAD + 1, total)


@triton.jit
def _attention_combine(
    y_ptr, stride_y, cos_ptr, sin_ptr, stride_rot, pos_ptr, part_ptr, scale, mixed_ptr, stride_mixed,
    x_ptr, stride_x, bias_ptr, xb_ptr, inner,
    HIDDEN: tl.constexpr, HEAD_DIM: tl.constexpr, ROT: tl.constexpr, D_PAD: tl.constexpr, SPLITS: tl.constexpr,
    HEADS: tl.constexpr, BLOCK: tl.constexpr,
):
    """Per row, programs 0..HEADS-1: a head's splits and the new token itself -> its attention
    output, to mixed[:, head]. Then programs for GELU(fc1) -> mixed[:, HIDDEN:], and the last one
    x + the output bias -> xb (the out GEMM adds its product to xb)."""
    row = tl.program_id(0)
    job = tl.program_id(1)
    dtype = y_ptr.dtype.element_ty
    if job < HEADS:
        head = job
        position = tl.load(pos_ptr + row)
        d = tl.arange(0, D_PAD)
        d_ok = d < HEAD_DIM
        rotated = d < ROT
        partner = tl.where(rotated, (d + ROT // 2) % ROT, d)
        base = y_ptr + row * stride_y + head * HEAD_DIM
        cos = tl.load(cos_ptr + position * stride_rot + d, mask=rotated, other=1.0).to(tl.float32)
        sin = tl.load(sin_ptr + position * stride_rot + d, mask=rotated, other=0.0).to(tl.float32)
        q = _rotated(base, d, d_ok, partner, cos, sin).to(dtype).to(tl.float32)
        k = _rotated(base + HIDDEN, d, d_ok, partner, cos, sin).to(dtype).to(tl.float32)
        best = tl.sum(q * k, axis=0) * scale  # the new token's own score
        total = best * 0.0 + 1.0
        acc = tl.load(base + 2 * HIDDEN + d, mask=d_ok, other=0.0).to(tl.float32)
        parts = part_ptr + (row * HEADS + head) * SPLITS * (D_PAD + 2)
        for split in range(SPLITS):
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
    else:
        chunk = job - HEADS
        offsets = chunk * BLOCK + tl.arange(0, BLOCK)
        if chunk * BLOCK < inner:  # GELU (tanh) of the fc1 columns, rounded as F.gelu's output is
            ok = offsets < inner
            u = tl.load(y_ptr + row * stride_y + 3 * HIDDEN + offsets, mask=ok, other=0.0).to(tl.float32)
            gelu = 0.5 * u * (1.0 + _tanh(0.7978845608028654 * (u + 0.044715 * u * u * u)))
            tl.store(mixed_ptr + row * stride_mixed + HIDDEN + offsets, gelu.to(dtype), mask=ok)
        else:  # the residual plus the out bias
            for at in range(0, HIDDEN, BLOCK):
                cols = at + tl.arange(0, BLOCK)
                ok = cols < HIDDEN
                x = tl.load(x_ptr + row * stride_x + cols, mask=ok, other=0.0).to(tl.float32)
                b = tl.load(bias_ptr + cols, mask=ok, other=0.0).to(tl.float32)
                tl.store(xb_ptr + row * HIDDEN + cols, (x + b).to(dtype), mask=ok)


# Launch shapes, by the rows the GEMV multiplies. One row: a plain reduction; more: tensor cores
# over 16 (or more) rows. Chosen by measurement on an H200 (BENCHMARKS.md).
def gemv_config(m: int, n: int, k: int) -> dict:
    if m == 1:
        return dict(DOT=False, BLOCK_M=1, BLOCK_N=16, BLOCK_K=256, num_warps=4, num_stages=3)
    block_m = 16 if m <= 16 else 32 if m <= 32 else 64
    return dict(DOT=True, BLOCK_M=block_m, BLOCK_N=64, BLOCK_K=128, num_warps=4, num_stages=3)


CONFIG_OVERRIDE: dict = {}  # (m, n, k) -> config: for tuning runs (tests/gpu/kernels.py)


def _launch_gemv(x, w, b, y, *, norm=None, eps=0.0, residual=None, gelu_from=None, split=None, gap=0):
    m, n, k = x.shape[0], w.shape[0], w.shape[1]
    config = dict(CONFIG_OVERRIDE.get((m, n, k)) or gemv_config(m, n, k))
    grid = (triton.cdiv(n, config["BLOCK_N"]), triton.cdiv(m, config["BLOCK_M"]))
    ln_w, ln_b = norm if norm is not None else (b, b)
    _gemv[grid](
        x, ln_w, ln_b, w, b, residual if residual is not None else y, y,
        m, n, k, x.stride(0), w.stride(0), (residual if residual is not None else y).stride(0), y.stride(0), eps,
        split if split is not None else k, gap, gelu_from if gelu_from is not None else n,
        NORM=norm is not None, RESIDUAL=residual is not None, GELU=gelu_from is not None, **config,
    )
    return y


def ln_linear(x, ln_w, ln_b, eps, w, b, gelu_from=None):
    """LayerNorm(x) @ w.T + b, GELU (tanh) on the output columns from `gelu_from`."""
    y = torch.empty(x.shape[0], w.shape[0], dtype=x.dtype, device=x.device)
    return _launch_gemv(x, w, b, y, norm=(ln_w, ln_b), eps=eps, gelu_from=gelu_from)


def linear_residual(y, split, gap, w, b, residual):
    """residual + y' @ w.T + b, where y' is y without its columns split..split+gap-1."""
    out = torch.empty_like(residual)
    return _launch_gemv(y, w, b, out, residual=residual, split=split, gap=gap)


ATTENTION = {"BLOCK_N": 32, "num_warps": 2, "max_splits": 16, "work": 2048}  # tuning runs change these (tests/gpu/kernels.py)


def splits_for(rows: int, heads: int) -> int:
    """Splits of each row's columns: enough (row, head, split) programs to fill the GPU at small
    batch, one split where rows x heads already do."""
    return max(1, min(ATTENTION["max_splits"], ATTENTION["work"] // (rows * heads)))


def attention_block(y, x, cos, sin, positions, active, k_cache, v_cache, b_out, hidden, head_dim, rotary_dim):
    """The middle of a block, from y = [q, k, v, fc1] (before rotary and GELU) of each row's new
    token: writes k, v to the cache [rows, heads, length, head_dim] at the row's position, and
    returns (mixed, xb): mixed = [attention output, gelu(fc1)] for the out GEMM, xb = x + b_out
    for it to add to. `active` rows (1) attend to their columns 0..position-1 and the new token,
    idle rows (0) to the new token alone."""
    rows, heads = y.shape[0], hidden // head_dim
    inner = y.shape[1] - 3 * hidden
    assert k_cache.stride(2) == head_dim and k_cache.stride() == v_cache.stride()
    splits = splits_for(rows, heads)
    d_pad = triton.next_power_of_2(head_dim)
    parts = torch.empty(rows, heads, splits, d_pad + 2, dtype=torch.float32, device=y.device)
    scale = head_dim**-0.5
    _attention_split[(rows, heads, splits)](
        y, y.stride(0), cos, sin, cos.stride(0), positions, active, k_cache, v_cache, k_cache.stride(0), k_cache.stride(1), parts, scale,
        HIDDEN=hidden, HEAD_DIM=head_dim, ROT=rotary_dim, D_PAD=d_pad, BLOCK_N=ATTENTION["BLOCK_N"], SPLITS=splits,
        num_warps=ATTENTION["num_warps"],
    )
    mixed = torch.empty(rows, hidden + inner, dtype=y.dtype, device=y.device)
    xb = torch.empty(rows, hidden, dtype=y.dtype, device=y.device)
    block = 1024
    _attention_combine[(rows, heads + triton.cdiv(inner, block) + 1)](
        y, y.stride(0), cos, sin, cos.stride(0), positions, parts, scale, mixed, mixed.stride(0), x, x.stride(0), b_out, xb, inner,
        HIDDEN=hidden, HEAD_DIM=head_dim, ROT=rotary_dim, D_PAD=d_pad, SPLITS=splits, HEADS=heads, BLOCK=block, num_warps=4,
    )
    return mixed, xb


GEMV_MAX_ROWS = 0  # batches up to this size take `_gemv` instead of cuBLAS (0: none; see BENCHMARKS.md)


def available() -> bool:
    """Triton can compile for the current CUDA device (imported only on CUDA)."""
    return torch.cuda.is_available()
