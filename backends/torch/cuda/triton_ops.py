"""The step's other kernels: `_norm` (LayerNorm or RMSNorm), `_silu_mul` (a gated MLP's middle),
`_gumbel_argmax` (sampling)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


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
    (docs/decisions.md, D-layernorm-triton)."""
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
