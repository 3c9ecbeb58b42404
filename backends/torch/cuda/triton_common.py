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
did not beat cuBLAS (docs/decisions.md, D-cublas-gemms), so the GEMMs stay cuBLAS. Arithmetic is
float32, rounded to the model's dtype where the unfused step rounds.

This module: what the kernels share (a head's rotary and norm, paged columns, a row's splits).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from backends.torch.kv_pages import PAGE


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
