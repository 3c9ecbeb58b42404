"""Whether the Triton step's kernels compile and run here (`works`): checked once a process for a
model's shapes, before a decoder takes them."""

from __future__ import annotations

import functools
import logging

import torch

from backends.torch.cuda.triton_attention import attention
from backends.torch.cuda.triton_common import Heads
from backends.torch.cuda.triton_ops import gumbel_argmax, norm, silu_mul
from backends.torch.cuda.triton_prefill import PREFILL_MAX_SPLITS, paged_prefill_attention, prefill_rotary
from backends.torch.kv_pages import PAGE

log = logging.getLogger("phi2_server.triton")


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
