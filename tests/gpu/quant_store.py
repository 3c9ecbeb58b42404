"""Quantized weights stored once and mapped at the next start, on a CUDA machine (issue 29): as
tests/test_quantization.py checks it on the CPU, with the GPU's layouts (int8 dequantized in
the step, int4 in tinygemm's CUDA layout), and then the same for random Phi-2 timed.

    python3 tests/gpu/quant_store.py

For int8 on the tiny checkpoint (bfloat16, the CUDA default): a first load stores the file, a
second maps it without calling from_pretrained, and both decode the same greedy ids in a batch
of 4. w8a8, and int4 at the tiny model's width, must be refused on CUDA with a clear error.
Then random Phi-2 in int8 and int4: the time of the first load (quantize and store) and of the
second (map), and the same ids from both. Exit status 1 on any mismatch.
"""

from __future__ import annotations

import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# Not this folder: its kernels.py would stand in for the `kernels` package transformers looks for.
sys.path = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]
sys.path.insert(0, str(ROOT))

os.environ["PHI2_CACHE_DIR"] = tempfile.mkdtemp()

import transformers  # noqa: E402

from backends.choose import load_backend  # noqa: E402
from backends.contract import LoadOptions, ModelLoadError, Sampling, Sequence  # noqa: E402
from backends.decoding.drive import drive  # noqa: E402
from backends.torch.tiny import write_tiny_checkpoint  # noqa: E402

PROMPTS = ["The quick brown", "Once upon a time", "Water boils at", "zq"]


def greedy(backend) -> list[list[int]]:
    sequences = [Sequence(i, backend.encode(p), Sampling(), 12) for i, p in enumerate(PROMPTS)]
    driven = drive(backend.decoder(4), sequences)
    return [driven.ids[i] for i in range(len(PROMPTS))]


def load(model: str, method: str):
    started = time.perf_counter()
    backend = load_backend("torch", LoadOptions(model=model, quantize=method, max_batch=4, warmup=False))
    return backend, time.perf_counter() - started


def main() -> int:
    failures = []
    tiny = str(write_tiny_checkpoint(Path(tempfile.mkdtemp()) / "tiny"))
    real_from_pretrained = transformers.AutoModelForCausalLM.from_pretrained
    try:  # the tiny model is 64 wide: tinygemm's CUDA int4 needs 128
        load(tiny, "int4")
        failures.append("int4 loaded on CUDA at width 64")
    except ModelLoadError as exc:
        print(f"tiny int4 on CUDA: refused: {exc}", flush=True)
    for method in ("int8",):
        first, _ = load(tiny, method)
        expected = greedy(first)

        def refuse(*args, **kwargs):
            raise AssertionError("the stored file was not used")

        transformers.AutoModelForCausalLM.from_pretrained = refuse
        try:
            second, _ = load(tiny, method)
        finally:
            transformers.AutoModelForCausalLM.from_pretrained = real_from_pretrained
        got = greedy(second)
        ok = got == expected and second.info.device.startswith("cuda")
        print(f"tiny {method} on {second.info.device} ({second.info.dtype}): mapped, same ids: {ok}", flush=True)
        if not ok:
            failures.append(f"tiny {method}: {expected} != {got}")
    try:
        load(tiny, "w8a8")
        failures.append("w8a8 loaded on CUDA")
    except ModelLoadError as exc:
        print(f"w8a8 on CUDA: refused: {exc}", flush=True)
    for method in ("int8", "int4"):
        ids = []
        for start in ("first (quantize, store)", "next (map)"):
            backend, seconds = load("random:phi-2", method)
            ids.append(greedy(backend))
            print(f"random:phi-2 {method}, {start}: loaded in {seconds:.1f} s", flush=True)
            del backend
        if ids[0] != ids[1]:
            failures.append(f"random:phi-2 {method}: the mapped start decodes other ids")
    print("FAIL:\n" + "\n".join(failures) if failures else "PASS", flush=True)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
