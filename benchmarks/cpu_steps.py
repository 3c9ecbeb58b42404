"""Decode steps of the Torch decoder on the CPU, in process, beside long rows (issue 30): a long
prompt's prefill and its decode steps alone and with 4 short rows beside it (`mixed`), or 4 rows
that all hold a long prompt (`rows`). Random Phi-2 in float32, `decoder(8)` as the server makes
it without a prompt cache; the median of 8 steps.

    python benchmarks/cpu_steps.py mixed 1024     # ~3 min on 2 vCPUs
    python benchmarks/cpu_steps.py rows 512       # ~4 min
    python benchmarks/cpu_steps.py attention 1040 # one layer's decode attention, a row alone: in place / copied

Only the backends' contract (load_backend, decoder, add, step), so that it runs on older trees
too: `cd old-checkout && python /path/to/benchmarks/cpu_steps.py mixed 1024`.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path.cwd()))  # the tree under test: the one it is run from

from backends.choose import load_backend
from backends.contract import LoadOptions, Sampling, Sequence


def median_step_ms(decoder, steps: int = 8) -> float:
    times = []
    for _ in range(steps):
        started = time.perf_counter()
        decoder.step()
        times.append(time.perf_counter() - started)
    return sorted(times)[steps // 2] * 1000


def prompt(length: int, salt: int = 0) -> list[int]:
    return [5 + (i * 37 + salt * 11) % 5000 for i in range(length)]


def attention(columns: int) -> None:
    """One layer's decode attention (Phi-2's heads, float32) for a row alone at `columns`: its
    pages read in place (`PagedKV.gathered`: consecutive) against copied into a kept buffer
    (the gather before), by turns; this tree's internals, not the contract."""
    import math
    import statistics

    import torch

    from backends.torch.decoder import Shape, decode_attention
    from backends.torch.kv_pages import PAGE, PagedKV

    kv_heads, head_dim = 32, 80
    kv = PagedKV(1, kv_heads, head_dim, torch.float32, torch.device("cpu"), rows=8, context=2048, pages=8 * 129 + 1)
    kv.assign(0, columns)
    keys = torch.randn(columns, kv_heads, head_dim)
    kv.write(0, torch.tensor(0), torch.arange(columns), keys, keys.flip(0))
    shape = Shape(2560, 32, kv_heads, head_dim, 32, 10240, 1e-5, False, True, False, None)
    q, bias, table = torch.randn(1, 32, head_dim), torch.zeros(kv_heads, 1, columns), kv.table[:1]
    buffers = [torch.empty(kv_heads * (columns // PAGE + 1) * PAGE * head_dim) for _ in range(2)]

    def copied(pages):
        size = (kv_heads, pages.numel(), PAGE, head_dim)
        k_out, v_out = (buffer[: math.prod(size)].view(size) for buffer in buffers)
        return torch.index_select(kv.k[0], 1, pages, out=k_out), torch.index_select(kv.v[0], 1, pages, out=v_out)

    ways = {"in place": lambda pages: kv.gathered(0, pages), "copied": copied}
    times: dict[str, list[float]] = {name: [] for name in ways}
    for turn in range(60):
        for name in sorted(ways, reverse=turn % 2 == 1):
            started = time.perf_counter()
            for _ in range(5):
                decode_attention(q, ways[name], table, bias, shape)
            times[name].append((time.perf_counter() - started) / 5 * 1000)
    same = torch.allclose(*(decode_attention(q, way, table, bias, shape) for way in ways.values()))
    print(
        f"a row alone at {columns} columns, one layer: "
        + ", ".join(f"{name} {statistics.median(ms):.2f} ms" for name, ms in times.items())
        + f" (same output: {same})",
        flush=True,
    )


def main() -> None:
    mode, length = sys.argv[1], int(sys.argv[2])
    if mode == "attention":
        attention(length)
        return
    backend = load_backend("torch", LoadOptions(model="random:phi-2", device="cpu", dtype="float32", warmup=False))
    decoder = backend.decoder(8, prompt_cache_bytes=0)
    if mode == "mixed":
        started = time.perf_counter()
        decoder.add(Sequence(0, prompt(length), Sampling(), 64))
        while 0 not in decoder.step():
            pass
        prefill = time.perf_counter() - started
        alone = median_step_ms(decoder)
        for i in range(4):
            decoder.add(Sequence(1 + i, [7 + i, 9, 11, 13, 17, 19, 23, 29], Sampling(), 64))
        decoder.step()
        decoder.step()
        print(
            f"prefill of {length} tokens {prefill:.1f} s; a decode step alone {alone:.0f} ms, "
            f"with 4 short rows {median_step_ms(decoder):.0f} ms",
            flush=True,
        )
    else:
        waiting = set(range(4))
        for row in waiting:
            decoder.add(Sequence(row, prompt(length, row), Sampling(), 64))
        while waiting:
            waiting -= set(decoder.step())
        print(f"4 rows at {length} columns: a decode step {median_step_ms(decoder):.0f} ms", flush=True)


if __name__ == "__main__":
    main()
