"""Triton kernels for the CUDA decode step (torch_decoder imports this module only on CUDA).

A decode step is memory-bound. Per block, cuBLAS reads the two fused weight matrices at ~3.4 TB/s
(F.linear with its bias; addmm adding onto x + bias); what lies between the two GEMMs was ~15
small torch kernels, and attention read every row's cache up to a power-of-two span under a
mask. Here it is two kernels (`attention_block`):

1. `_attention_split`: per (row, head, split), rotary on q and k, the new k and v written to the
   cache at the row's position (split 0), and an online softmax over the split's share of the
   row's live columns 0..position-1 (flash-decoding: at batch 1 the 32 heads alone would leave
   most of the GPU idle, so each row's columns are split up to 16 ways).
2. `_attention_combine`: the splits and the new token itself -> the attention output, GELU of
   fc1, and x + the out bias, laid out for the out GEMM.

Prefill uses `_prefill_rotary`: rotary on q in place and k, v to the cache, one kernel a block.

A Triton GEMV with LayerNorm in its prologue was measured too (commit deda8ee): inside the step it
did not beat cuBLAS (BENCHMARKS.md), so the GEMMs stay cuBLAS. Arithmetic is float32, rounded to
the model's dtype where the unfused step rounds.
"""

from __future__ import annotations

import functools
import logging

import torch
import triton
import triton.language as tl

log = logging.getLogger("phi2_server.triton_decode")


@triton.jit
def _tanh(u):
    return 1.0 - 2.0 / (tl.exp(2.0 * u) + 1.0)


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
def _prefill_rotary(
    y_ptr, stride_y, cos_ptr, sin_ptr, stride_rot, pos_ptr, slot_ptr, k_ptr, v_ptr, stride_row, stride_head,
    HIDDEN: tl.constexpr, HEAD_DIM: tl.constexpr, ROT: tl.constexpr, D_PAD: tl.constexpr,
):
    """Per (prompt token, head): rotary on q in place in y, and k (rotated) and v written to the
    token's slot of the cache at its position."""
    token = tl.program_id(0)
    head = tl.program_id(1)
    position = tl.load(pos_ptr + token)
    slot = tl.load(slot_ptr + token)
    d = tl.arange(0, D_PAD)
    d_ok = d < HEAD_DIM
    rotated = d < ROT
    partner = tl.where(rotated, (d + ROT // 2) % ROT, d)
    dtype = y_ptr.dtype.element_ty
    base = y_ptr + token * stride_y + head * HEAD_DIM
    cos = tl.load(cos_ptr + position * stride_rot + d, mask=rotated, other=1.0).to(tl.float32)
    sin = tl.load(sin_ptr + position * stride_rot + d, mask=rotated, other=0.0).to(tl.float32)
    q = _rotated(base, d, d_ok, partner, cos, sin)
    k = _rotated(base + HIDDEN, d, d_ok, partner, cos, sin)
    v = tl.load(base + 2 * HIDDEN + d, mask=d_ok, other=0.0)
    tl.debug_barrier()  # every lane has read q before any overwrites it
    tl.store(base + d, q.to(dtype), mask=d_ok)
    cache = slot * stride_row + head * stride_head + position * HEAD_DIM
    tl.store(k_ptr + cache + d, k.to(dtype), mask=d_ok)
    tl.store(v_ptr + cache + d, v, mask=d_ok)


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
    _gumbel_argmax[(scores.shape[0],)](scores, scores.stride(0), seeds, offsets, out, scores.shape[1], BLOCK=2048, num_warps=8)
    return out


def prefill_rotary(y, cos, sin, positions, slots, k_cache, v_cache, hidden, head_dim, rotary_dim):
    """Prompt tokens y [tokens, 3*hidden + ...] at `positions` of cache rows `slots` (both
    [tokens]): q rotated in place, k and v to the cache [rows, heads, length, head_dim]."""
    assert k_cache.stride(2) == head_dim and k_cache.stride() == v_cache.stride() and y.stride(1) == 1
    _prefill_rotary[(y.shape[0], hidden // head_dim)](
        y, y.stride(0), cos, sin, cos.stride(0), positions, slots, k_cache, v_cache, k_cache.stride(0), k_cache.stride(1),
        HIDDEN=hidden, HEAD_DIM=head_dim, ROT=rotary_dim, D_PAD=triton.next_power_of_2(head_dim), num_warps=1,
    )


# Launch shapes of `_attention_split`, measured on an H200 (tests/gpu/kernels.py, BENCHMARKS.md):
# 16 columns a loop step; 2 warps a program up to 16 rows, 1 beyond (more programs resident).
ATTENTION = {"BLOCK_N": 16, "num_warps": None, "max_splits": 16, "work": 2048}


def splits_for(rows: int, heads: int) -> int:
    """Splits of each row's columns: enough (row, head, split) programs to fill the GPU at small
    batch, one split where rows x heads already do."""
    return max(1, min(ATTENTION["max_splits"], ATTENTION["work"] // (rows * heads)))


def _attention_warps(rows: int) -> int:
    return ATTENTION["num_warps"] or (2 if rows <= 16 else 1)


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
        num_warps=_attention_warps(rows),
    )
    mixed = torch.empty(rows, hidden + inner, dtype=y.dtype, device=y.device)
    xb = torch.empty(rows, hidden, dtype=y.dtype, device=y.device)
    block = 1024
    _attention_combine[(rows, heads + triton.cdiv(inner, block) + 1)](
        y, y.stride(0), cos, sin, cos.stride(0), positions, parts, scale, mixed, mixed.stride(0), x, x.stride(0), b_out, xb, inner,
        HIDDEN=hidden, HEAD_DIM=head_dim, ROT=rotary_dim, D_PAD=d_pad, SPLITS=splits, HEADS=heads, BLOCK=block, num_warps=4,
    )
    return mixed, xb


@functools.cache  # once a process for a device and model shape, however many decoders are built
def works(device, dtype, hidden: int, head_dim: int, rotary_dim: int, inner: int) -> bool:
    """Whether these kernels compile and run on `device` for the model's shapes (the compiled
    kernels are cached for the real calls): a GPU Triton cannot build for gets the torch step."""
    try:
        rows, length = 1, 4
        y = torch.randn(rows, 3 * hidden + inner, device=device, dtype=dtype)
        x = torch.randn(rows, hidden, device=device, dtype=dtype)
        cache = [torch.zeros(rows, hidden // head_dim, length, head_dim, device=device, dtype=dtype) for _ in range(2)]
        table = torch.ones(length, rotary_dim, device=device, dtype=dtype)
        one = torch.ones(rows, dtype=torch.long, device=device)
        attention_block(y, x, table, table, one, one, *cache, x[0], hidden, head_dim, rotary_dim)
        prefill_rotary(y, table, table, one, one - 1, *cache, hidden, head_dim, rotary_dim)
        gumbel_argmax(y[:, :64].float(), one, one)
        torch.cuda.synchronize(device)
        return True
    except Exception:
        log.exception("the Triton decode kernels do not run here: the torch-ops step serves instead")
        return False
