"""One weight option in process, as the server serves it (issue 54: no option slower than the
float default): a prompt of N random ids through the decoder's own steps (its pieces, as
served) to the first token, the best of RUNS after one to warm up; then one sequence's decode
rate (drafts off). Each option in a process of its own, on `make demo`'s GGUF file unless
PHI2_MODEL names another model:

    python benchmarks/prompt_options.py none bfloat16 1000    # auto's float default on an AVX-512 BF16 CPU
    python benchmarks/prompt_options.py "" float32 1000       # the file's own blocks (its default)
    python benchmarks/prompt_options.py q8_0 float32 1000     # a PHI2_QUANTIZE method
    PHI2_MODEL=random:phi-2 RUNS=1 python benchmarks/prompt_options.py q8_0 float32 512
"""

from __future__ import annotations

import os
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path.cwd()))  # the tree under test: the one it is run from

import torch  # noqa: E402

from backends.choose import load_backend
from backends.contract import LoadOptions, Sampling, Sequence
from backends.files.models import demo_gguf  # noqa: E402
from backends.torch.decoder import BatchedDecoder  # noqa: E402


def main() -> None:
    method, dtype = sys.argv[1], sys.argv[2]
    length = int(sys.argv[3]) if len(sys.argv) > 3 else 1000
    runs = int(os.environ.get("RUNS", "3"))
    model = os.environ.get("PHI2_MODEL") or str(demo_gguf())
    backend = load_backend("torch", LoadOptions(model=model, quantize=method, dtype=dtype, warmup=False))
    draw = random.Random(0)
    with torch.inference_mode():
        decoder = BatchedDecoder(backend.decoder_weights, 4)  # the server's CPU decoder (MAX_BATCH 4)

        def first_token(number: int) -> float:
            ids = [draw.randrange(100, 40000) for _ in range(length)]
            decoder.add(Sequence(id=number, prompt_ids=ids, sampling=Sampling(), max_new_tokens=2))
            started = time.perf_counter()
            while not decoder.step():
                pass
            took = time.perf_counter() - started
            decoder.remove(number)
            return took

        first_token(0)
        times = [first_token(k) for k in range(1, runs + 1)]
        decoder.add(Sequence(id=runs + 1, prompt_ids=list(range(100, 120)), sampling=Sampling(), max_new_tokens=1000))
        for _ in range(5):
            decoder.step()
        started = time.perf_counter()
        for _ in range(40):
            decoder.step()
        rate = 40 / (time.perf_counter() - started)
    print(
        f"{method or 'as stored'} ({backend.info.dtype}), PHI2_CPU_AMX={os.environ.get('PHI2_CPU_AMX', '1')}: "
        f"{length}-token TTFT {min(times):.3f} s (runs {', '.join(f'{t:.3f}' for t in times)}), "
        f"decode {rate:.1f} tok/s",
        flush=True,
    )


if __name__ == "__main__":
    main()
