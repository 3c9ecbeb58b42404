"""Where a long prompt's time goes on the CPU (issue 68): one prompt piece of PIECE tokens after
P cached columns, for several P, through the server's own decoder (its prefill pass), with
the KV before P left as the pool holds it (the cost does not depend on the values). A prompt of
N tokens costs the sum of its pieces, so the growth of a piece's time with P is the growth of
a long prompt's cost past linear.

    PHI2_MODEL=<file.gguf> python benchmarks/long_prompt.py 0 2048 4096 8192 16384
    PIECE=256 REPS=2 ...
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path.cwd()))  # the tree under test: the one it is run from

import torch  # noqa: E402

from benchmarks.in_process import load_in_process  # noqa: E402


@torch.inference_mode()
def main() -> None:
    starts = [int(a) for a in sys.argv[1:]] or [0, 2048, 4096, 8192]
    piece = int(os.environ.get("PIECE", "256"))
    reps = int(os.environ.get("REPS", "2"))
    if os.environ.get("THREADS"):  # 1: CPU time is the work, whatever else the machine runs
        torch.set_num_threads(int(os.environ["THREADS"]))
    backend = load_in_process()
    decoder = backend.decoder(max(backend.max_batch, 1))
    ids = [(i * 7919) % 20000 + 100 for i in range(piece)]
    print(f"piece {piece} tokens, torch threads {torch.get_num_threads()}")
    results = []
    for start in starts:
        decoder.pages.take(0, start + piece + 1)
        try:
            times, cpu = [], []
            for _ in range(reps):
                began, began_cpu = time.perf_counter(), time.process_time()
                decoder.prefill.run([(0, ids, start)], lora_rows=[-1], long_rope=[False])
                times.append(time.perf_counter() - began)
                cpu.append(time.process_time() - began_cpu)
        finally:
            decoder.kv.release([0])
        best = min(cpu) if os.environ.get("THREADS") == "1" else min(times)
        results.append((start, best))
        print(
            f"after {start:6d} columns: {min(times):7.3f} s wall, {min(cpu):7.3f} s CPU a piece "
            f"({piece / best:6.1f} tok/s)",
            flush=True,
        )
    if len(results) >= 2:
        (p0, t0), (p1, t1) = results[0], results[-1]
        slope = (t1 - t0) / (p1 - p0)
        print(f"fit: {t0:.3f} s + {slope * 1000:.3f} s per 1,000 columns (a piece)")
        n = 18783
        pieces = range(0, n, piece)
        total = sum(t0 + slope * (p - p0) for p in pieces)
        print(f"an {n}-token prompt, extrapolated: {total:.0f} s")


if __name__ == "__main__":
    main()
