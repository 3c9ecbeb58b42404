"""Where a decode step of SmolLM2-135M (make demo's GGUF file) goes on the CPU (issue 54: profile
before choosing): the median step of the server's decoder at batch 1, then torch.profiler's
self time per op over 30 steps (matrix products against the rest; the wall time beyond the ops'
self time is Python and dispatch).

    python benchmarks/profile_step.py float32            # or bfloat16
    python benchmarks/profile_step.py float32 w8a8       # PHI2_QUANTIZE's methods
    MB=1 python benchmarks/profile_step.py float32       # decoder(1): MAX_BATCH=1's decoder
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path.cwd()))  # the tree under test: the one it is run from

import torch  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402

from backends.choose import load_backend
from backends.contract import LoadOptions, Sampling, Sequence
from backends.files.models import demo_gguf  # noqa: E402

MATRIX_OPS = ("mm", "linear", "matmul", "addmm", "_weight_int", "int8", "qlinear")


def main() -> None:
    dtype = sys.argv[1]
    method = sys.argv[2] if len(sys.argv) > 2 else ""
    rows = int(os.environ.get("MB", "8"))
    options = LoadOptions(model=str(demo_gguf()), dtype=dtype, quantize=method, quantized_cache=False, max_batch=rows)
    backend = load_backend("torch", options)
    decoder = backend.decoder(rows)
    decoder.add(Sequence(1, backend.encode("Write one sentence about the sea. " * 8), Sampling(), 400))
    for _ in range(20):  # warm-up
        decoder.step()
    times = []
    for _ in range(60):
        started = time.perf_counter()
        decoder.step()
        times.append(time.perf_counter() - started)
    step_ms = sorted(times)[30] * 1000
    print(
        f"{dtype} {method or '-'}: median step {step_ms:.2f} ms ({1000 / step_ms:.1f} tok/s), "
        f"{torch.get_num_threads()} threads, {type(decoder).__name__}"
    )
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        started = time.perf_counter()
        for _ in range(30):
            decoder.step()
        wall = (time.perf_counter() - started) / 30 * 1000
    table = prof.key_averages()
    ops = sum(e.self_cpu_time_total for e in table) / 30 / 1000
    matrix = sum(e.self_cpu_time_total for e in table if any(k in e.key for k in MATRIX_OPS)) / 30 / 1000
    launched = sum(e.count for e in table) / 30
    print(
        f"  profiled: {wall:.2f} ms a step, ops' self time {ops:.2f} ms, "
        f"matrix products {matrix:.2f} ms, {launched:.0f} ops"
    )
    for e in sorted(table, key=lambda e: -e.self_cpu_time_total)[:8]:
        print(f"    {e.key:50s} {e.self_cpu_time_total / 30 / 1000:7.3f} ms  x{e.count / 30:.0f}")


if __name__ == "__main__":
    main()
