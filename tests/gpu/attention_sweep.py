"""Phi-2's decode attention split kernel (backends/triton_decode.py `_attention_split`) against
launch-shape variants and a variant that reads head dims 80 as 64 + 16 instead of one tile padded
to 128, on a paged cache of Phi-2's heads: rows x columns as the server's steps see them. Prints
each variant's time (CUDA events, triton.testing.do_bench) and the bandwidth of the keys and
values it reads, in the same run as a device-to-device copy; checks each variant's partial
softmaxes against the shipped kernel's.

    python3 -P tests/gpu/attention_sweep.py
"""

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from triton.testing import do_bench  # noqa: E402

from backends import triton_decode as td  # noqa: E402
from backends.kv_pages import PAGE  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"  # the CPU: TRITON_INTERPRET=1, agreement only


@triton.jit
def _split_two_tiles(
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
    SCALAR_PAGE: tl.constexpr = False,
):
    """`_attention_split` with a head's dims read as two tiles, D_LO + D_HI (64 + 16 for 80);
    SCALAR_PAGE (BLOCK_N == PAGE, columns from 0): one page id a block, loaded once."""
    row = tl.program_id(0)
    head = tl.program_id(1)
    split = tl.program_id(2)
    kv_head = head // GROUP
    position = tl.load(pos_ptr + row)
    live = position * tl.load(active_ptr + row)
    first = tl.where(window > 0, tl.maximum(live - window + 1, 0), 0)
    d0 = tl.arange(0, D_LO)
    d1 = D_LO + tl.arange(0, D_HI)
    ok0 = d0 < HEAD_DIM
    ok1 = d1 < HEAD_DIM
    rot0 = d0 < ROT
    rot1 = d1 < ROT
    partner0 = tl.where(rot0, (d0 + ROT // 2) % ROT, d0)
    partner1 = tl.where(rot1, (d1 + ROT // 2) % ROT, d1)
    dtype = y_ptr.dtype.element_ty
    base = y_ptr + row * stride_y
    cos0 = tl.load(cos_ptr + position * stride_rot + d0, mask=rot0, other=1.0).to(tl.float32)
    sin0 = tl.load(sin_ptr + position * stride_rot + d0, mask=rot0, other=0.0).to(tl.float32)
    cos1 = tl.load(cos_ptr + position * stride_rot + d1, mask=rot1, other=1.0).to(tl.float32)
    sin1 = tl.load(sin_ptr + position * stride_rot + d1, mask=rot1, other=0.0).to(tl.float32)
    cache = kv_head * stride_head
    pages = table_ptr + row * stride_table
    if split == 0:
        if head % GROUP == 0:
            kb = base + Q_SIZE + kv_head * HEAD_DIM
            k0 = td._head(kb, d0, ok0, partner0, cos0, sin0, k_norm_ptr, eps, HEAD_DIM, QK_NORM).to(dtype)
            k1 = td._head(kb, d1, ok1, partner1, cos1, sin1, k_norm_ptr, eps, HEAD_DIM, QK_NORM).to(dtype)
            at = cache + tl.load(pages + position // PAGE).to(tl.int64) * stride_page + (position % PAGE) * HEAD_DIM
            tl.store(k_ptr + at + d0, k0, mask=ok0)
            tl.store(k_ptr + at + d1, k1, mask=ok1)
            vb = base + Q_SIZE + KV_SIZE + kv_head * HEAD_DIM
            tl.store(v_ptr + at + d0, tl.load(vb + d0, mask=ok0, other=0.0), mask=ok0)
            tl.store(v_ptr + at + d1, tl.load(vb + d1, mask=ok1, other=0.0), mask=ok1)
    splits = td._row_splits(live, first, fill, split_columns, SPLITS)
    if split < splits:
        qb = base + head * HEAD_DIM
        q0 = td._head(qb, d0, ok0, partner0, cos0, sin0, q_norm_ptr, eps, HEAD_DIM, QK_NORM).to(dtype).to(tl.float32)
        q1 = td._head(qb, d1, ok1, partner1, cos1, sin1, q_norm_ptr, eps, HEAD_DIM, QK_NORM).to(dtype).to(tl.float32)
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
            if SCALAR_PAGE:
                page_at = cache + tl.load(pages + begin // PAGE).to(tl.int64) * stride_page
                row_at = page_at + tl.arange(0, BLOCK_N)[:, None] * HEAD_DIM
            else:
                page = tl.load(pages + offsets // PAGE, mask=ok, other=0).to(tl.int64)
                row_at = cache + page[:, None] * stride_page + (offsets % PAGE)[:, None] * HEAD_DIM
            m0 = ok[:, None] & ok0[None, :]
            m1 = ok[:, None] & ok1[None, :]
            key0 = tl.load(k_ptr + row_at + d0[None, :], mask=m0, other=0.0)
            key1 = tl.load(k_ptr + row_at + d1[None, :], mask=m1, other=0.0)
            val0 = tl.load(v_ptr + row_at + d0[None, :], mask=m0, other=0.0)
            val1 = tl.load(v_ptr + row_at + d1[None, :], mask=m1, other=0.0)
            dots = tl.sum(key0.to(tl.float32) * q0[None, :], axis=1) + tl.sum(key1.to(tl.float32) * q1[None, :], axis=1)
            scores = tl.where(ok, dots * scale, float("-inf"))
            new_best = tl.maximum(best, tl.max(scores, axis=0))
            p = tl.exp(scores - new_best)
            alpha = tl.exp(best - new_best)
            acc0 = acc0 * alpha + tl.sum(p[:, None] * val0.to(tl.float32), axis=0)
            acc1 = acc1 * alpha + tl.sum(p[:, None] * val1.to(tl.float32), axis=0)
            total = total * alpha + tl.sum(p, axis=0)
            best = new_best
        out = part_ptr + ((row * tl.num_programs(1) + head) * SPLITS + split) * (D_PAD + 2)
        tl.store(out + d0, acc0)
        tl.store(out + d1, acc1, mask=ok1)
        tl.store(out + D_PAD, best)
        tl.store(out + D_PAD + 1, total)


def setup(rows: int, columns: int, heads: td.Heads, dtype=torch.bfloat16):
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


def launcher(kernel, case, heads: td.Heads, block_n: int, warps: int, stages: int, two_tiles, scalar_page=False):
    y, cos, sin, positions, active, k, v, table = case
    rows = y.shape[0]
    splits = td.splits_for(rows, heads.heads, table.shape[1] * PAGE)
    d_pad = triton.next_power_of_2(heads.head_dim)
    parts = torch.zeros(rows, heads.heads, splits, d_pad + 2, dtype=torch.float32, device=DEV)
    parts[..., d_pad] = float("-inf")  # splits past a row's own write nothing: they weigh nothing
    fill = td.fill_splits(rows, heads.heads)
    extra = {}
    if two_tiles:
        lo = triton.next_power_of_2(heads.head_dim) // 2
        extra = {"D_LO": lo, "D_HI": triton.next_power_of_2(heads.head_dim - lo), "SCALAR_PAGE": scalar_page}
    args = (y, y.stride(0), cos, sin, cos.stride(0), positions, active, k, v, *td._paged(k, v, table, heads), parts)
    args += (heads.head_dim**-0.5, 0, y, y, heads.eps, fill, td.ATTENTION["split_columns"])

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
            **({"num_stages": stages} if stages else {}),
            **extra,
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
    shapes = {"phi-2": td.Heads(32, 32, 80, 32), "phi-3-mini": td.Heads(32, 32, 96, 96)}
    variants = [("shipped", False, 16, None, None)]
    variants += [("two tiles, page once", "scalar", 16, warps, stages) for warps in (1, 2, 4) for stages in (1, 3)]
    for two in (False, True):
        for block_n in (16, 32, 64):
            for warps in (1, 2, 4):
                for stages in (1, 3):
                    variants.append(("two tiles" if two else "one tile", two, block_n, warps, stages))
    if not timed:  # the interpreter: one of each kind
        variants = [variants[0], variants[1], variants[-1], ("one tile", False, 64, 1, 1)]
    failures = 0
    for shape_name, heads in shapes.items():
        sizes = ((1, 1044), (64, 300), (256, 300), (512, 300), (64, 1000)) if timed else ((3, 40),)
        for rows, columns in sizes:
            case = setup(rows, columns, heads)
            kv_bytes = rows * columns * heads.kv_heads * heads.head_dim * 2 * 2
            results = []
            reference = None
            for name, two, block_n, warps, stages in variants:
                warps = warps or td._attention_warps(rows)
                kernel = _split_two_tiles if two else td._attention_split
                try:
                    run, parts = launcher(kernel, case, heads, block_n, warps, stages, bool(two), two == "scalar")
                    run()
                    if timed:
                        torch.cuda.synchronize()
                    got = merged(parts, heads.head_dim)
                    if reference is None:
                        reference = got
                    error = (got - reference).abs().max().item()
                    ms = do_bench(run, warmup=10, rep=100) if timed else 1.0
                except Exception as e:  # a shape that does not compile: say so, go on
                    print(f"  {name} BLOCK_N {block_n} warps {warps} stages {stages}: {type(e).__name__} {e}"[:200])
                    continue
                bad = error > 1e-2
                failures += bad
                results.append((ms, name, block_n, warps, stages, error))
            shipped = results[0][0]
            print(f"{shape_name} rows {rows} x {columns} columns ({kv_bytes / 1e6:.0f} MB of keys and values):")
            for ms, name, block_n, warps, stages, error in sorted(results)[:8] + [results[0]]:
                print(
                    f"  {name:20} BLOCK_N {block_n:2} warps {warps} stages {stages}: {ms * 1000:7.1f} us "
                    f"{kv_bytes / ms / 1e9:5.2f} TB/s  x{shipped / ms:4.2f}  error {error:.1e}",
                    flush=True,
                )
            del case
    print("all variants agree" if not failures else f"{failures} variants disagree")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
