"""The K-quant block products alone (backends/torch/cpu/kquants.h), one activation row (a decode
step), as bytes of records read a second: from memory (16 distinct matrices, past the caches) and
from cache (one matrix again and again), per block type and thread count (issue 67).

    python -m benchmarks.kquant_products                 # Q4_K, Q6_K, Q5_K, Q8_0 at 1 and 2 threads
    python -m benchmarks.kquant_products Q6_K Q4_K       # only these

Blocks are random (tests/test_kquants.py's `blocks`: every value and scale valid), in the sixteen-row
records the server packs. The memory row is what a decode step meets: a 1.5B model reads ~1 GB a token.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

import torch  # noqa: E402

SHAPE = (17920, 1536)  # Qwen2.5-1.5B's fused gate and up rows by its width
IN_CACHE = (4096, 1536)


def rate(module, kind: int, shape: tuple[int, int], copies: int, reps: int) -> float:
    from test_kquants import PACKED, blocks

    out, width = shape
    weights = [module.pack(torch.from_numpy(blocks(kind, out, width, seed=c)), kind, width) for c in range(copies)]
    x = torch.randn(1, width)
    for w in weights:
        module.mm(x, w, kind + PACKED, width)
    best = float("inf")
    for _ in range(reps):
        started = time.perf_counter()
        for w in weights:
            module.mm(x, w, kind + PACKED, width)
        best = min(best, (time.perf_counter() - started) / copies)
    return weights[0].numel() / best / 1e9


def main() -> None:
    from gguf import GGMLQuantizationType

    from backends.torch.cpu.kernels import kernels

    module = kernels()
    names = sys.argv[1:] or ["Q4_K", "Q6_K", "Q5_K", "Q8_0"]
    print(f"kernels: {module.simd()}; GB/s of records read, best of repeated passes")
    (out, width), (cached_out, cached_width) = SHAPE, IN_CACHE
    print(f"| type | threads | from memory (16 x {out}x{width}) | from cache ({cached_out}x{cached_width}) |")
    print("| --- | --- | --- | --- |")
    for name in names:
        kind = int(GGMLQuantizationType[name])
        for threads in (1, 2):
            torch.set_num_threads(threads)
            memory = rate(module, kind, SHAPE, 16, 5)
            cache = rate(module, kind, IN_CACHE, 1, 200)
            print(f"| {name} | {threads} | {memory:.1f} | {cache:.1f} |", flush=True)


if __name__ == "__main__":
    main()
