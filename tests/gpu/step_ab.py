r"""The decoder's graphed decode step with this tree's `triton_attention.attention` against other
versions of it (each a copy of backends/torch/cuda/triton_*.py in abtest/, named by its file), alternating,
in one process: rows x columns per shape, random bfloat16 weights, each step's time from 100
graph replays.

    git show REV:backends/torch/cuda/triton_*.py > abtest/old.py
    STEP_CASES=64x300,256x300 python3 -P tests/gpu/step_ab.py [random:phi-2 ...]

The decoder calls `triton_attention.attention` through the module at capture, so each decoder
built after the swap captures that tree's kernels; everything else is this tree's.
"""

import gc
import importlib.util
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from backends.choose import load_backend  # noqa: E402
from backends.contract import LoadOptions, Sampling, Sequence  # noqa: E402
from backends.torch.cuda import triton_attention  # noqa: E402
from backends.torch.decoder import BatchedDecoder  # noqa: E402

CASES = [
    tuple(int(n) for n in case.split("x"))
    for case in (os.environ.get("STEP_CASES") or "1x300,64x300,256x300,64x1000").split(",")
]
DEVICE, DTYPE = (
    ("cuda", "bfloat16") if torch.cuda.is_available() else ("cpu", "float32")
)  # the CPU: the script's flow only


def load_variants() -> dict:
    """abtest/NAME.py's `attention` by NAME."""
    variants = {}
    for path in sorted((ROOT / "abtest").glob("*.py")):
        spec = importlib.util.spec_from_file_location(f"abtest_{path.stem}", path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        variants[path.stem] = module.attention
    return variants


def step_ms(weights, rows: int, columns: int) -> float:
    decoder = BatchedDecoder(weights, rows, prefill_graphs=False, kv_cache_bytes=60 << 30)  # the server passes a budget
    decoder.capture(spans=(0,))
    decoder.clear()
    for i in range(rows):
        decoder.add(Sequence(i, [5 + (i * 7 + j) % 5000 for j in range(columns)], Sampling(), 128))
    while any(s.next_token is None for s in decoder.rows[:rows]):
        decoder.step()
    for _ in range(5):
        decoder.step()
    steps = 100
    sync()
    start = time.perf_counter()
    for _ in range(steps):
        decoder.step()
    sync()
    return (time.perf_counter() - start) / steps * 1000


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def release() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def main() -> int:
    shapes = sys.argv[1:] or ["random:phi-2", "random:phi-3-mini", "random:qwen2.5-1.5b"]
    trees = {**load_variants(), "new": triton_attention.attention}
    for shape in shapes:
        backend = load_backend("torch", LoadOptions(model=shape, device=DEVICE, dtype=DTYPE, warmup=False))
        weights = backend.decoder_weights
        for rows, columns in CASES:
            times = {name: [] for name in trees}
            for name in [*trees, *trees]:
                triton_attention.attention = trees[name]
                times[name].append(step_ms(weights, rows, columns))
                release()
            triton_attention.attention = trees["new"]
            said = "  ".join(f"{name} " + ", ".join(f"{ms:.3f}" for ms in got) + " ms" for name, got in times.items())
            print(f"{shape} {rows} rows x {columns} columns: {said}", flush=True)
        del backend, weights
        release()
    return 0


if __name__ == "__main__":
    sys.exit(main())
