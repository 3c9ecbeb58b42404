"""The decode step's split attention kernel (backends/torch/cuda/triton_*.py `_attention_split`, a head's
dims in two tiles) against its launch shapes and against the kernel before it (one tile padded to
a power of two, masked loads), on a paged cache of Phi-2's, Phi-3-mini's and Qwen2.5-1.5B's heads
(the models that take the per-head kernel): rows x columns as the server's steps see them. Prints
each variant's time (CUDA events, triton.testing.do_bench) and the bandwidth of the keys and
values it reads, in the same run as a device-to-device copy; checks each variant's partial
softmaxes, merged, against the shipped launch's.

    python3 -P tests/gpu/attention_sweep.py
    PYTHONPATH=/tmp/triton-interp TRITON_INTERPRET=1 .venv/bin/python -P tests/gpu/attention_sweep.py   # agreement only
"""

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from triton.testing import do_bench  # noqa: E402

from backends.torch.cuda import triton_attention, triton_common  # noqa: E402
from backends.torch.kv_pages import PAGE  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"  # the CPU: TRITON_INTERPRET=1, agreement only


@triton.jit
def _split_one_tile(
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
):
    """`_attention_split` before 2026-12-05: a head's dims as one tile padded to a power of two
    (80 of 128), its loads masked on the columns and the dims."""
    row = tl.program_id(0)
    head = tl.program_id(1)
    split = tl.program_id(2)
    kv_head = head // GROUP
    position = tl.load(pos_ptr + row)
    live = position * tl.load(active_ptr + row)  # idle rows attend to no cached column
    first = tl.where(window > 0, tl.maximum(live - window + 1, 0), 0)
    d = tl.arange(0, D_PAD)
    d_ok = d < HEAD_DIM
    rotated = d < ROT
    partner = tl.where(rotated, (d + ROT // 2) % ROT, d)  # rotate_half as a roll, its sign in the sin table
    dtype = y_ptr.dtype.element_ty
    base = y_ptr + row * stride_y
    cos = tl.load(cos_ptr + position * stride_rot + d, mask=rotated, other=1.0).to(tl.float32)
    sin = tl.load(sin_ptr + position * stride_rot + d, mask=rotated, other=0.0).to(tl.float32)
    cache = kv_head * stride_head
    pages = table_ptr + row * stride_table
    if split == 0:
        if head % GROUP == 0:
            k = triton_common._head(
                base + Q_SIZE + kv_head * HEAD_DIM, d, d_ok, partner, cos, sin, k_norm_ptr, eps, HEAD_DIM, QK_NORM
            ).to(dtype)
            at = cache + tl.load(pages + position // PAGE).to(tl.int64) * stride_page + (position % PAGE) * HEAD_DIM
            tl.store(k_ptr + at + d, k, mask=d_ok)
            v = tl.load(base + Q_SIZE + KV_SIZE + kv_head * HEAD_DIM + d, mask=d_ok, other=0.0)
            tl.store(v_ptr + at + d, v, mask=d_ok)
    splits = triton_common._row_splits(live, first, fill, split_columns, SPLITS)
    if split < splits:  # past the row's splits: nothing to read, and `_attention_combine` reads no part
        q = (
            triton_common._head(base + head * HEAD_DIM, d, d_ok, partner, cos, sin, q_norm_ptr, eps, HEAD_DIM, QK_NORM)
            .to(dtype)
            .to(tl.float32)
        )
        chunk = tl.cdiv(tl.cdiv(live - first, splits), BLOCK_N) * BLOCK_N
        start = first + split * chunk
        end = tl.minimum(start + chunk, live)
        best = tl.max(tl.full([BLOCK_N], float("-inf"), tl.float32), axis=0)
        total = tl.sum(tl.zeros([BLOCK_N], tl.float32), axis=0)
        acc = tl.zeros([D_PAD], dtype=tl.float32)
        for begin in range(start, end, BLOCK_N):
            offsets = begin + tl.arange(0, BLOCK_N)
            ok = offsets < end
            keys, values = triton_common._paged_columns(
                k_ptr, v_ptr, pages, cache, offsets, ok, d, d_ok, stride_page, HEAD_DIM, PAGE
            )
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


def setup(rows: int, columns: int, heads: triton_common.Heads, dtype=torch.bfloat16):
    """A Phi-2-like layer: a pool with every row's pages in a random order, each row at `columns`."""
    gen = torch.Generator(device=DEV).manual_seed(rows * 7 + columns)
    width = triton.cdiv(columns + 1, PAGE)
    pages = rows * width + 1
    shape = (heads.kv_heads, pages, PAGE, heads.head_dim)
    k = torch.randn(shape, generator=gen, device=DEV).to(dtype)
    v = torch.randn(shape, generator=gen, device=DEV).to(dtype)
    table = (torch.randperm(pages - 1, generator=gen, device=DEV) + 1).view(rows, width)
    y = torch.randn(rows, heads.q_size + 2 * heads.kv_size, generator=gen, device=DEV).to(dtype)
    angles = torch.arange(width * PAGE, device=DEV, dtype=torch.float32)[:, None] * 0.01
    rot = heads.rotary_dim // 2
    cos = angles.expand(-1, rot).cos().repeat(1, 2).to(dtype)
    sin = angles.expand(-1, rot).sin().repeat(1, 2).to(dtype)
    positions = torch.full((rows,), columns, device=DEV, dtype=torch.long)
    active = torch.ones(rows, device=DEV, dtype=torch.long)
    return y, cos, sin, positions, active, k, v, table


def launcher(kernel, case, heads: triton_common.Heads, block_n: int, warps: int):
    y, cos, sin, positions, active, k, v, table = case
    rows = y.shape[0]
    splits = triton_attention.splits_for(rows, heads.heads, table.shape[1] * PAGE)
    d_pad = triton.next_power_of_2(heads.head_dim)
    parts = torch.zeros(rows, heads.heads, splits, d_pad + 2, dtype=torch.float32, device=DEV)
    parts[..., d_pad] = float("-inf")  # splits past a row's own write nothing: they weigh nothing
    fill = triton_attention.fill_splits(rows, heads.heads)
    tiles = {}
    if kernel is triton_attention._attention_split:
        tiles = dict(zip(("D_LO", "D_HI"), triton_attention._tiles(heads.head_dim), strict=True))
    args = (
        y,
        y.stride(0),
        cos,
        sin,
        cos.stride(0),
        positions,
        active,
        k,
        v,
        *triton_common._paged(k, v, table, heads),
        parts,
    )
    args += (heads.head_dim**-0.5, 0, y, y, heads.eps, fill, triton_attention.ATTENTION["split_columns"])

    def run():
        kernel[(rows, heads.heads, splits)](
            *args,
            Q_SIZE=heads.q_size,
            KV_SIZE=heads.kv_size,
            GROUP=heads.group,
            HEAD_DIM=heads.head_dim,
            ROT=heads.rotary_dim,
            D_PAD=d_pad,
            QK_NORM=False,
            BLOCK_N=block_n,
            SPLITS=splits,
            PAGE=PAGE,
            num_warps=warps,
            **tiles,
        )

    return run, parts


def merged(parts: torch.Tensor, head_dim: int) -> torch.Tensor:
    """Each (row, head)'s attention output from its splits' partial softmaxes (as
    `_attention_combine` merges them, less the new token): how a split's columns fall (which
    depends on BLOCK_N) does not change it."""
    acc, best, total = parts[..., :head_dim], parts[..., -2], parts[..., -1]
    weight = torch.exp(best - best.max(dim=-1, keepdim=True).values)
    return (weight[..., None] * acc).sum(-2) / (weight * total).sum(-1)[..., None]


def copy_bandwidth() -> float:
    """TB/s of a 1 GiB device-to-device copy, bytes read and written."""
    src = torch.empty(2**30, dtype=torch.uint8, device=DEV)
    dst = torch.empty_like(src)
    ms = do_bench(lambda: dst.copy_(src), warmup=50, rep=300)
    return 2 * src.numel() / ms / 1e9


def main() -> int:
    timed = DEV == "cuda"
    if timed:
        print(f"device-to-device copy: {copy_bandwidth():.2f} TB/s (read + write)", flush=True)
    shapes = {
        "phi-2": triton_common.Heads(32, 32, 80, 32),
        "phi-3-mini": triton_common.Heads(32, 32, 96, 96),
        "qwen2.5-1.5b": triton_common.Heads(12, 2, 128, 128),  # 2 key-value heads: the per-head kernel too
    }
    # The shipped kernel at the shipped launch shape (None: `triton_attention.attention_block` of the head's dims),
    # the one-tile kernel at 16 columns a step, as it shipped.
    variants = [
        ("shipped", triton_attention._attention_split, None, None),
        ("one tile (before)", _split_one_tile, 16, None),
    ]
    for name, kernel in (("two tiles", triton_attention._attention_split), ("one tile (before)", _split_one_tile)):
        for block_n in (16, 32, 64):
            for warps in (1, 2, 4):
                variants.append((name, kernel, block_n, warps))
    if not timed:  # the interpreter: a few of each kind
        variants = variants[:2] + [v for v in variants[2:] if v[2:] in ((32, 2), (64, 1))]
    failures = 0
    for shape_name, heads in shapes.items():
        sizes = ((1, 1044), (64, 300), (256, 300), (512, 300), (64, 1000)) if timed else ((3, 40),)
        for rows, columns in sizes:
            case = setup(rows, columns, heads)
            kv_bytes = rows * columns * heads.kv_heads * heads.head_dim * 2 * 2
            results = []
            reference = None
            for name, kernel, block_n, warps in variants:
                warps = warps or triton_attention._attention_warps(rows)
                block_n = block_n or triton_attention.attention_block(heads.head_dim)
                try:
                    run, parts = launcher(kernel, case, heads, block_n, warps)
                    run()
                    if timed:
                        torch.cuda.synchronize()
                    got = merged(parts, heads.head_dim)
                    if reference is None:
                        reference = got
                    error = (got - reference).abs().max().item()
                    ms = do_bench(run, warmup=10, rep=100) if timed else 1.0
                except Exception as e:  # a shape that does not compile: say so, go on
                    print(f"  {name} BLOCK_N {block_n} warps {warps}: {type(e).__name__} {e}"[:200])
                    continue
                bad = error > 1e-2
                failures += bad
                results.append((ms, name, block_n, warps, error))
            shipped = results[0][0]
            print(f"{shape_name} rows {rows} x {columns} columns ({kv_bytes / 1e6:.0f} MB of keys and values):")
            for ms, name, block_n, warps, error in sorted(results)[:6] + results[:2]:
                print(
                    f"  {name:18} BLOCK_N {block_n:2} warps {warps}: {ms * 1000:7.1f} us "
                    f"{kv_bytes / ms / 1e9:5.2f} TB/s  x{shipped / ms:4.2f}  error {error:.1e}",
                    flush=True,
                )
            del case
    print("all variants agree" if not failures else f"{failures} variants disagree")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
