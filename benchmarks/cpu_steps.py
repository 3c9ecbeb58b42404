"""Decode steps of the Torch decoder on the CPU, in process, beside long rows (issue 30): a long
prompt's prefill and its decode steps alone and with 4 short rows beside it (`mixed`), or 4 rows
that all hold a long prompt (`rows`). Random Phi-2 in float32, `decoder(8)` as the server makes
it without a prompt cache; the median of 8 steps.

    python benchmarks/cpu_steps.py mixed 1024     # ~3 min on 2 vCPUs
    python benchmarks/cpu_steps.py rows 512       # ~4 min

Only the backends' contract (load_backend, decoder, add, step), so that it runs on older trees
too: `cd old-checkout && python /path/to/benchmarks/cpu_steps.py mixed 1024`.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path.cwd()))  # the tree under test: the one it is run from

from backends import LoadOptions, Sampling, Sequence, load_backend  # noqa: E402


def median_step_ms(decoder, steps: int = 8) -> float:
    times = []
    for _ in range(steps):
        started = time.perf_counter()
        decoder.step()
        times.append(time.perf_counter() - started)
    return sorted(times)[steps // 2] * 1000


def prompt(length: int, salt: int = 0) -> list[int]:
    return [5 + (i * 37 + salt * 11) % 5000 for i in range(length)]


def main() -> None:
    mode, length = sys.argv[1], int(sys.argv[2])
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
