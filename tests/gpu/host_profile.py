"""Where a decode step's time goes at hundreds of rows (issue 30), in process on a CUDA machine.

    python3 -P tests/gpu/host_profile.py --out $OUT [--shape random:phi-2] [--rows 128,512] [--modes greedy]

(-P: this folder's kernels.py would shadow the `kernels` package that transformers may import.)

For greedy rows, rows sampled with a temperature alone, and rows sampled with temperature 0.8
and top_p 0.95 (bench.py --distinct's): the median wall time of a steady decode step
(`BatchedDecoder.step`, through `drive`), the same step's GPU kernels (torch.profiler, the top
ones by device time) and its host time by function (cProfile, the top ones by own time).
Writes --out/host_profile.json and prints it.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from backends.choose import load_backend  # noqa: E402
from backends.contract import LoadOptions, Sampling, Sequence  # noqa: E402
from backends.decoding.drive import drive  # noqa: E402
from backends.torch.decoder import BatchedDecoder  # noqa: E402

MODES = {
    "greedy": Sampling(),
    "temperature": Sampling(temperature=0.8),
    "top_p": Sampling(temperature=0.8, top_p=0.95),
}


def prompt_of(length: int, salt: int) -> list[int]:
    return [5 + (i * 37 + salt * 101) % 580 for i in range(length)]


def steady_steps(decoder, sequences) -> list[float]:
    stamps = []
    drive(decoder, sequences, on_tokens=lambda step, tokens: stamps.append(time.perf_counter()))
    gaps = [b - a for a, b in zip(stamps, stamps[1:], strict=False)]
    return gaps[4:-4] or gaps


def profile(decoder, rows: int, sampling: Sampling, tokens: int) -> dict:
    def sequences(salt):
        return [Sequence(i, prompt_of(20 + i % 11, i + salt), sampling, tokens) for i in range(rows)]

    steady_steps(decoder, sequences(0))  # warm: graphs, allocator
    gaps = steady_steps(decoder, sequences(1000))
    result = {"step_ms_median": statistics.median(gaps) * 1e3, "tok_s": rows / statistics.median(gaps)}
    profiler = cProfile.Profile()
    profiler.enable()
    drive(decoder, sequences(2000))
    profiler.disable()
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(18)
    result["host_top"] = text.getvalue().splitlines()[-30:]
    if torch.cuda.is_available():
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            drive(decoder, sequences(3000))
        table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=15)
        result["device_top"] = table.splitlines()
    else:
        result["device_top"] = []
    return result


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="gpu-results")
    parser.add_argument("--shape", default="random:phi-2")
    parser.add_argument("--rows", default="128,512")
    parser.add_argument("--tokens", type=int, default=48)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--modes", default=",".join(MODES), help="comma list of " + ", ".join(MODES))
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    backend = load_backend("torch", LoadOptions(model=args.shape, device=args.device, dtype="bfloat16", warmup=False))
    results = {}
    for rows in (int(r) for r in args.rows.split(",")):
        decoder = BatchedDecoder(backend.decoder_weights, rows, context=2048, kv_cache_bytes=40 << 30)
        decoder.capture()
        for mode in args.modes.split(","):
            sampling = MODES[mode]
            key = f"{rows} rows {mode}"
            results[key] = profile(decoder, rows, sampling, args.tokens)
            print(key, f"{results[key]['step_ms_median']:.2f} ms a step, {results[key]['tok_s']:.0f} tok/s", flush=True)
            (out / "host_profile.json").write_text(json.dumps(results, indent=1))
        decoder = None
        torch.cuda.empty_cache()
    for key, result in results.items():
        print(f"== {key}: {result['step_ms_median']:.2f} ms")
        print("\n".join(result["host_top"][-22:]))
        print("\n".join(result["device_top"][:14]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
