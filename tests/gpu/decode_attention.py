"""The decode step's attention kernels (backends/torch/cuda/triton_*.py `attention`: `_attention_split`
or, for grouped heads, `_attention_split_grouped`, then `_attention_combine`) against a torch
reference over the same paged cache: rows of different lengths, idle rows, a sliding window,
Qwen3's q/k norms, a parallel (Phi) block's extra outputs, a table as wide as a long context's
(most of the grid's splits past every row's), and one row alone over a long context. Then the
step's norms (`norm`: LayerNorm and RMSNorm) against torch's.

    python3 -P tests/gpu/decode_attention.py            # a GPU: float32 and bfloat16
    PYTHONPATH=/tmp/triton-interp TRITON_INTERPRET=1 .venv/bin/python tests/gpu/decode_attention.py   # the CPU

Each case runs both kernels where the heads are grouped (`GROUPED_FROM_KV_HEADS` moved to pick
each). Exits 1 if any output is off by more than the dtype's tolerance.
"""

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from backends.torch.cuda import triton_attention, triton_common, triton_ops  # noqa: E402
from backends.torch.kv_pages import PAGE  # noqa: E402

dev = "cuda" if torch.cuda.is_available() else "cpu"


def rotate(x, cos, sin, rot: int):
    """Rotary as the kernels apply it: the sign of rotate_half folded into the sin table."""
    half = rot // 2
    partner = torch.cat((x[..., half:rot], x[..., :half], x[..., rot:]), dim=-1)
    c = torch.cat((cos, torch.ones(x.shape[-1] - rot)), dim=-1)
    s = torch.cat((sin, torch.zeros(x.shape[-1] - rot)), dim=-1)
    return x * c + partner * s


def head_norm(x, weight, eps: float, dtype):
    """Qwen3's q/k norm as `_head` rounds it."""
    scale = 1.0 / torch.sqrt((x * x).mean(dim=-1, keepdim=True) + eps)
    return ((x * scale).to(dtype).float() * weight.float()).to(dtype).float()


def reference(y, cos, sin, positions, active, k_cache, v_cache, table, heads, window, norms, dtype):
    """Each row's attention output [rows, q_size] (float32), from the cache as it was before the
    kernel wrote the new token's keys and values."""
    hd, rot = heads.head_dim, heads.rotary_dim
    out = []
    for r in range(y.shape[0]):
        p = int(positions[r])
        live = p * int(active[r])
        first = max(live - window + 1, 0) if window else 0
        row = y[r].float()
        q = row[: heads.q_size].view(heads.heads, hd)
        k_new = row[heads.q_size : heads.q_size + heads.kv_size].view(heads.kv_heads, hd)
        v_new = row[heads.q_size + heads.kv_size : heads.q_size + 2 * heads.kv_size].view(heads.kv_heads, hd)
        if norms is not None:
            q, k_new = head_norm(q, norms[0], heads.eps, dtype), head_norm(k_new, norms[1], heads.eps, dtype)
        c, s = cos[p].float(), sin[p].float()
        q = rotate(q, c, s, rot).to(dtype).float()
        k_new = rotate(k_new, c, s, rot).to(dtype).float()
        columns = torch.arange(first, live)
        pages = table[r].long()[columns // PAGE]
        keys = k_cache[:, pages, columns % PAGE].float()  # [kv_heads, n, hd]
        values = v_cache[:, pages, columns % PAGE].float()
        keys = torch.cat((keys, k_new[:, None]), dim=1)
        values = torch.cat((values, v_new.float()[:, None]), dim=1)
        attention = F.scaled_dot_product_attention(
            q[:, None], keys, values, enable_gqa=heads.group > 1
        )  # [heads, 1, hd]
        out.append(attention.reshape(-1))
    return torch.stack(out)


def case(name, heads, rows, lengths, width, dtype, window=None, qk_norm=False, parallel=False, idle=()):
    gen = torch.Generator().manual_seed(len(name))
    hd, rot = heads.head_dim, heads.rotary_dim
    inner, hidden = (64, heads.q_size) if parallel else (0, 0)
    pages = rows * width
    k_cache = torch.randn(heads.kv_heads, pages, PAGE, hd, generator=gen).to(dtype)
    v_cache = torch.randn(heads.kv_heads, pages, PAGE, hd, generator=gen).to(dtype)
    table = torch.randperm(pages, generator=gen).to(torch.int32).view(rows, width)
    y = torch.randn(rows, heads.q_size + 2 * heads.kv_size + inner, generator=gen).to(dtype)
    angles = torch.arange(width * PAGE, dtype=torch.float32)[:, None] * torch.rand(rot // 2, generator=gen)
    cos = torch.cat((angles.cos(), angles.cos()), -1).to(dtype)
    sin = torch.cat((-angles.sin(), angles.sin()), -1).to(dtype)
    positions = torch.tensor(lengths)
    active = torch.tensor([0 if r in idle else 1 for r in range(rows)])
    norms = (
        (torch.rand(hd, generator=gen).to(dtype) + 0.5, torch.rand(hd, generator=gen).to(dtype) + 0.5)
        if qk_norm
        else None
    )
    x = torch.randn(rows, hidden, generator=gen).to(dtype) if parallel else None
    b_out = torch.randn(hidden, generator=gen).to(dtype) if parallel else None
    expected = reference(y, cos, sin, positions, active, k_cache, v_cache, table, heads, window, norms, dtype)
    tolerance = 1e-4 if dtype == torch.float32 else 3e-2
    kernels = [("per query head", 10**9)] + ([("grouped", 1)] if heads.group > 1 else [])
    failures = 0
    for kernel, grouped_from in kernels:
        triton_attention.GROUPED_FROM_KV_HEADS = grouped_from
        moved = [t.to(dev) if isinstance(t, torch.Tensor) else t for t in (y, cos, sin, positions, active)]
        k, v = k_cache.to(dev), v_cache.to(dev)
        got = triton_attention.attention(
            *moved,
            k,
            v,
            table.to(dev),
            heads,
            window=window,
            q_norm=norms[0].to(dev) if norms else None,
            k_norm=norms[1].to(dev) if norms else None,
            x=x.to(dev) if parallel else None,
            b_out=b_out.to(dev) if parallel else None,
            inner=inner,
        )
        mixed, xb = got if parallel else (got, None)
        error = (mixed[:, : heads.q_size].float().cpu() - expected).abs().max().item()
        ok = error <= tolerance
        if parallel:
            u = y[:, -inner:].float()
            gelu = F.gelu(u, approximate="tanh")
            ok &= (mixed[:, heads.q_size :].float().cpu() - gelu).abs().max().item() <= tolerance
            ok &= (xb.float().cpu() - (x.float() + b_out.float())).abs().max().item() <= tolerance
        # The new token's keys and values went to the cache at each row's position.
        p = positions.long()
        written = k[:, table.to(dev)[torch.arange(rows), p // PAGE].long(), p % PAGE].float().cpu()
        k_new = y[:, heads.q_size : heads.q_size + heads.kv_size].float().view(rows, heads.kv_heads, hd)
        if norms is not None:
            k_new = head_norm(k_new, norms[1], heads.eps, dtype)
        k_new = torch.stack([rotate(k_new[r], cos[p[r]].float(), sin[p[r]].float(), rot) for r in range(rows)])
        ok &= (written.transpose(0, 1) - k_new.to(dtype).float()).abs().max().item() <= tolerance
        failures += not ok
        print(f"{'ok  ' if ok else 'FAIL'} {name:44} {str(dtype)[6:]:8} {kernel:15} max error {error:.2e}", flush=True)
    return failures


def norm_case(n: int, rms: bool, dtype, with_bias: bool = True) -> int:
    """`triton_ops.norm` of rows with an offset (LayerNorm must center them) against the torch step's."""
    from backends.torch.network import norm

    torch.manual_seed(n)
    x = (torch.randn(5, n, device=dev) * 3 + torch.randn(5, 1, device=dev) * 4).to(dtype)
    weight = (1 + 0.3 * torch.randn(n, device=dev)).to(dtype)
    bias = None if rms or not with_bias else (0.5 * torch.randn(n, device=dev)).to(dtype)
    eps = 1e-6 if rms else 1e-5
    want = norm(x, weight, bias, eps, rms).float()
    got = triton_ops.norm(x, weight, bias, eps, rms).float()
    error = ((got - want).abs() / want.abs().clamp(min=1)).max().item()
    ok = error <= (1e-5 if dtype == torch.float32 else 1e-2)
    name = f"{'RMSNorm' if rms else 'LayerNorm'} of {n}{'' if bias is not None or rms else ', no bias'}"
    print(f"{'ok  ' if ok else 'FAIL'} {name:44} {str(dtype)[6:]:8} {'norm':15} max error {error:.2e}", flush=True)
    return not ok


def main() -> int:
    gqa = triton_common.Heads(8, 2, 32, 16)
    mha = triton_common.Heads(4, 4, 32, 32)
    phi = triton_common.Heads(4, 4, 80, 32)  # Phi-2's head: two tiles, 64 + 16, partial rotary
    odd = triton_common.Heads(4, 2, 112, 112)  # 64 + 48 of a 64 tile: the second tile's loads masked
    dtypes = [torch.float32] + ([torch.bfloat16] if dev == "cuda" else [])
    failures = 0
    for dtype in dtypes:
        cases = [
            ("rows of different lengths", gqa, 5, [3, 40, 17, 90, 1], 8, {}),
            ("an idle row, position 0", gqa, 3, [0, 33, 5], 4, {"idle": (0,)}),
            ("a sliding window of 24", gqa, 4, [50, 10, 24, 63], 4, {"window": 24}),
            ("q/k norms (Qwen3)", gqa, 3, [20, 7, 45], 4, {"qk_norm": True}),
            ("a parallel block (Phi)", mha, 3, [12, 30, 2], 4, {"parallel": True}),
            ("a table as wide as a long context", gqa, 4, [30, 5, 60, 12], 64, {}),
            ("one row alone over 700 columns", gqa, 1, [700], 48, {}),
            ("ungrouped heads, rows of different lengths", mha, 4, [9, 70, 33, 1], 8, {}),
            ("Phi-2's 80 dims, a parallel block", phi, 4, [9, 70, 33, 1], 8, {"parallel": True, "idle": (3,)}),
            ("80 dims with q/k norms", phi, 3, [20, 7, 45], 4, {"qk_norm": True}),
            ("112 dims, a sliding window", odd, 3, [50, 10, 31], 4, {"window": 24}),
        ]
        for name, heads, rows, lengths, width, options in cases:
            failures += case(name, heads, rows, lengths, width, dtype, **options)
        for n, rms in ((2560, False), (2048, True), (3072, True), (96, False)):
            failures += norm_case(n, rms, dtype)
        failures += norm_case(1024, False, dtype, with_bias=False)
    print("all ok" if not failures else f"{failures} failed")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
