"""The prompt cache's shared pages on a CUDA machine (issue 30), float32 then bfloat16.

    python3 -P tests/gpu/shared_pages.py --out $OUT [--shapes random:phi-2,random:llama-3.2-1b]

(-P: this folder's kernels.py would shadow the `kernels` package that transformers may import.)

With CUDA graphs, the Triton step and the graphed prefill: prompts that share a prefix cut at
every length (on and between page boundaries), each added to a decoder with a prompt cache while
another decodes. For every hit, the keys and values the row reads through its table (the shared
pages and the copied one) against the same prompt prefilled by a decoder without a cache; and
every sequence's greedy ids against that decoder's. The CPU suite checks the same
(tests/test_torch_decoder.py); this runs the CUDA kernels. Writes --out/shared_pages.json.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from backends.choose import load_backend  # noqa: E402
from backends.contract import LoadOptions, Sampling, Sequence  # noqa: E402
from backends.decoding.drive import drive  # noqa: E402
from backends.torch.decoder import BatchedDecoder  # noqa: E402
from backends.torch.kv_pages import PAGE  # noqa: E402

CONTEXT = 2048


def check(shape: str, dtype: str, prompts: int = 24) -> dict:
    device = "cuda" if torch.cuda.is_available() else "cpu"  # the CPU: a smoke test of this script
    backend = load_backend("torch", LoadOptions(model=shape, device=device, dtype=dtype, warmup=False))
    weights = backend.decoder_weights
    rng = random.Random(5)
    base = [5 + (i * 37) % 580 for i in range(300)]
    cached = BatchedDecoder(weights, 4, context=CONTEXT, prompt_cache_bytes=1 << 30)
    reference = BatchedDecoder(weights, 1, context=CONTEXT)
    cached.add(Sequence(999, [7, 8, 9] * 20, Sampling(), 10_000))  # decodes beside them throughout
    worst, hits, part_pages, equal_ids = 0.0, 0, 0, 0
    for i in range(prompts):
        cut = rng.randrange(3, len(base))
        prompt = base[:cut] + [600 + i % 4, 601 + cut % 3] + base[: rng.randrange(0, 40)]
        sequence = Sequence(i, prompt, Sampling(), 12)
        reused = cached.add(sequence)
        if reused:
            hits += 1
            part_pages += reused % PAGE != 0
            reference.add(Sequence(10_000 + i, prompt, Sampling(), 1))
            while 10_000 + i not in reference.step():
                pass
            expected = reference.kv.columns_of(reference.kv.held[0], 0, reused)
            got = cached.kv.columns_of(cached.kv.held[cached.row_of[i]], 0, reused)
            for a, b in zip(got, expected, strict=True):
                worst = max(worst, float((a.float() - b.float()).abs().max()))
            reference.remove(10_000 + i)
        ids = []
        while len(ids) < 12:
            ids += cached.step().get(i, [])
        cached.remove(i)
        equal_ids += ids[:12] == drive(BatchedDecoder(weights, 1, context=CONTEXT), [sequence]).ids[i]
    result = {
        "prompts": prompts,
        "hits": hits,
        "hits_ending_inside_a_page": part_pages,
        "kv_max_abs_diff": worst,
        "greedy_ids_equal_to_no_cache": equal_ids,
        "graphs": cached.use_graphs,
        "fused": cached.network.fused,
    }
    print(shape, dtype, result, flush=True)
    return result


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="gpu-results")
    parser.add_argument("--shapes", default="random:phi-2,random:llama-3.2-1b")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    torch.backends.cuda.matmul.allow_tf32 = False
    results = {}
    for shape in args.shapes.split(","):
        for dtype in ("float32", "bfloat16"):
            try:
                results[f"{shape} {dtype}"] = check(shape, dtype)
            except Exception as exc:  # the next shape still runs
                results[f"{shape} {dtype}"] = f"{type(exc).__name__}: {exc}"[:500]
                print(results[f"{shape} {dtype}"], flush=True)
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
            (out / "shared_pages.json").write_text(json.dumps(results, indent=1))
    failed = [key for key, value in results.items() if isinstance(value, str)]  # an exception's text
    if failed:
        print("FAILED:", ", ".join(failed), flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
