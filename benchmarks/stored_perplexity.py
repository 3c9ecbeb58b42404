"""A GGUF file's perplexity as stored on MLX against as stored on Torch, on the same ids (issue 67).

    PHI2_MODEL=<file.gguf> python -m benchmarks.stored_perplexity [--windows 2] [--context 512]

The method and the scorers are benchmarks/perplexity.py's (llama-perplexity's windows); only the
first --windows windows are scored (MLX's Linux CPU build is slow), both runtimes on the same ones.
MLX builds a K-quant file from its blocks (backends/mlx/gguf_direct.py), Torch serves them as
stored (backends/torch/gguf_direct.py): this is what MLX's re-quantized Q6_K costs, beside Torch's
int8 activations.
"""

from __future__ import annotations

import argparse
import gc
import os
import platform
import time
from pathlib import Path

from benchmarks.perplexity import TEXT, gguf_facts, mlx_scorer, perplexity, text_ids, torch_scorer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--windows", type=int, default=2)
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--text", default=str(TEXT))
    args = parser.parse_args()
    from backends.choose import load_backend
    from backends.contract import LoadOptions
    from backends.files.models import gguf_file

    spec = os.environ.get("PHI2_MODEL", "")
    source = gguf_file(spec)
    if not source:
        raise SystemExit("PHI2_MODEL must name a GGUF file")
    facts = gguf_facts(source)
    bos = facts["bos"] if facts["add_bos"] else None
    text = Path(args.text).read_text()
    print(f"{source.name}: {facts['types']}; {platform.processor() or platform.machine()}", flush=True)
    ids, rows = None, {}
    for runtime, scorer in (("torch", torch_scorer), ("mlx", mlx_scorer)):
        started = time.perf_counter()
        options = LoadOptions(model=spec, warmup=False, **({"dtype": "auto"} if runtime == "torch" else {}))
        backend = load_backend(runtime, options)
        loaded = time.perf_counter() - started
        theirs = text_ids(backend, text, bos)
        if ids is not None and theirs != ids:
            raise SystemExit(f"{runtime}'s tokenizer gives other ids for the text")
        ids = theirs
        started = time.perf_counter()
        row = perplexity(scorer(backend), ids, args.context, bos, limit=args.windows)
        rows[runtime] = row
        print(
            f"{runtime}: perplexity {row['perplexity']:.4f} ± {row['plus_minus']:.4f} over {row['windows']} windows "
            f"of {args.context} ({row['tokens']} ids scored); load {loaded:.0f} s, scoring "
            f"{time.perf_counter() - started:.0f} s; quantization {backend.info.quantization}; "
            f"weight_bytes {backend.info.extra.get('weight_bytes')}",
            flush=True,
        )
        del backend
        gc.collect()
    print(f"mlx / torch: {rows['mlx']['perplexity'] / rows['torch']['perplexity'] - 1:+.2%}")


if __name__ == "__main__":
    main()
