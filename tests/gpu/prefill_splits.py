"""The paged prefill attention kernel split across programs (backends/torch/cuda/triton_*.py,
`paged_prefill_attention(..., splits=)`), against a torch reference, and timed by splits on a GPU.

    python3 -P tests/gpu/prefill_splits.py                  # a GPU: float32 and bfloat16, timed
    PYTHONPATH=/tmp/triton-interp TRITON_INTERPRET=1 .venv/bin/python tests/gpu/prefill_splits.py   # the CPU

Cases: one token after 1,043 columns, 40 after 1,000, 200 after 1,000, a piece beside a padding
row, a new prompt; grouped heads with a window; Llama-3.2-1B's heads. Timed in bfloat16, GPU time
from a CUDA graph of 20 calls (as the decoder replays them). "auto" is what `prefill_splits` picks for the
case's own reach (the decoder gives a graph's span bucket, which may pick more).
"""

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import triton  # noqa: E402

from backends.torch.cuda import triton_common, triton_prefill  # noqa: E402

PAGE = 16
dev = "cuda" if torch.cuda.is_available() else "cpu"


def graph_us(run, calls: int = 20) -> float:
    """GPU time of one call, from a CUDA graph of `calls` of them (as the decoder replays it: the
    host's launch cost, which would bound a timed loop of these short kernels, is not counted)."""
    run()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            run()
    return round(triton.testing.do_bench(graph.replay, warmup=5, rep=50) * 1000 / calls, 1)


def case(dtype, heads, pieces, length, window=None, splits_list=(1, 2, 4, 16), width=130, pages=400, time_it=False):
    torch.manual_seed(0)
    H, KV, D = heads.heads, heads.kv_heads, heads.head_dim
    k = torch.randn(KV, pages, PAGE, D, dtype=dtype, device=dev)
    v = torch.randn_like(k)
    n = len(pieces)
    table = torch.stack([torch.randperm(pages - 1, device=dev)[:width] + 1 for _ in range(n)])
    q = torch.randn(n, length, H * D * 3, dtype=dtype, device=dev)
    slots = torch.arange(n, device=dev)
    starts = torch.tensor([s for s, _ in pieces], device=dev)
    lens = torch.tensor([m for _, m in pieces], device=dev)
    ref = torch.zeros(n, length, H * D, dtype=torch.float32, device=dev)
    for r, (s, m) in enumerate(pieces):
        if not m:
            continue
        cols = torch.arange(s + m, device=dev)
        pg, off = table[r, cols // PAGE], cols % PAGE
        K = k[:, pg, off].float().repeat_interleave(H // KV, 0)
        V = v[:, pg, off].float().repeat_interleave(H // KV, 0)
        Q = q[r, :m, : H * D].float().view(m, H, D).transpose(0, 1)
        sc = Q @ K.transpose(1, 2) / D**0.5
        at = (s + torch.arange(m, device=dev))[:, None]
        vis = cols[None, :] <= at
        if window:
            vis &= cols[None, :] > at - window
        sc = sc.masked_fill(~vis, float("-inf"))
        ref[r, :m] = (sc.softmax(-1) @ V).transpose(0, 1).reshape(m, -1)
    out = {}
    for splits in splits_list:

        def run(splits=splits):
            return triton_prefill.paged_prefill_attention(
                q, k, v, table, slots, starts, lens, heads, window=window, splits=splits
            )

        got = run().float()
        err = float((got - ref).abs().max())
        us = graph_us(run) if time_it else 0
        out[splits] = (round(err, 6), us)
    blocks = triton.cdiv(length, triton_prefill.PREFILL_ATTENTION["BLOCK_M"])
    auto = triton_prefill.prefill_splits(n * heads.heads * blocks, max(s + length for s, _ in pieces))
    print(
        str(dtype)[6:],
        heads.heads,
        heads.kv_heads,
        pieces[:3],
        len(pieces),
        length,
        window,
        "auto",
        auto,
        out,
        flush=True,
    )
    return out


phi = triton_common.Heads(32, 32, 80, 32)
gqa = triton_common.Heads(8, 2, 64, 64)
llama = triton_common.Heads(32, 8, 64, 64)  # Llama-3.2-1B
for dtype in (torch.float32, torch.bfloat16) if dev == "cuda" else (torch.float32,):
    timing = dtype == torch.bfloat16  # float32 on a GPU is for parity runs only
    case(dtype, phi, [(1043, 1)], 16, time_it=timing)
    case(dtype, phi, [(1000, 40)], 64, time_it=timing)
    case(dtype, phi, [(1000, 200)], 256, time_it=timing)
    case(dtype, phi, [(500, 12), (2048, 0)], 16, time_it=timing)
    case(dtype, phi, [(0, 24)], 32, time_it=timing)
    case(dtype, gqa, [(700, 30), (90, 5), (2048, 0), (300, 33)], 64, window=100, time_it=timing)
    case(dtype, gqa, [(1200, 50)], 64, window=None, time_it=timing)
    case(dtype, llama, [(1000, 40)], 64, time_it=timing)
