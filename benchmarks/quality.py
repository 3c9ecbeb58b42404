"""What quantized weights change: their logits against float32's (--quant-quality) and their
greedy ids against full precision on the tiny demo model (--quant-agreement)."""

from __future__ import annotations

import os
import statistics
import time

from benchmarks.common import FILLER, QUESTIONS


def quant_quality(args) -> list[dict]:
    """How far quantized weights move the logits from float32's on PHI2_MODEL (random:phi-2
    where Phi-2's weights cannot be fetched), teacher-forced: at every position of a few prompts,
    the relative L2 error of the logits and whether the most likely token is the same. Each
    method is loaded in the dtype it is served in here (int8 and int4 in bfloat16, as against
    llama.cpp; w8a8 in float32, its activations' dtype), and each prompt goes through the model
    as one piece (w8a8 takes a range per token, so the piece's size does not matter)."""
    import torch

    from backends.choose import load_backend, select_backend
    from backends.contract import LoadOptions
    from backends.torch.decoder import BatchedDecoder

    model = os.environ.get("PHI2_MODEL", "random:phi-2")
    prompts = [FILLER[: 40 * (i + 1)] + q for i, q in enumerate(QUESTIONS)]

    def load(dtype: str):
        return load_backend(
            select_backend("torch"), LoadOptions(model=model, dtype=dtype, warmup=False, quantized_cache=False)
        )

    def every_position(backend, ids: list[int]) -> torch.Tensor:
        decodable = backend.decoder_weights.decodable  # ids past the tokenizer's are never generated: left out
        return BatchedDecoder(backend.decoder_weights, 1).logits_after(ids, every_position=True)[:, :decodable]

    backend = load("float32")
    ids = [backend.encode(p) for p in prompts]
    reference = [every_position(backend, i) for i in ids]
    del backend
    rows = []
    for method, dtype in (("int8", "bfloat16"), ("int4", "bfloat16"), ("w8a8", "float32")):
        backend = load(dtype)
        started = time.perf_counter()
        backend.quantize(method)
        seconds = time.perf_counter() - started
        errors, same, positions = [], 0, 0
        for i, ref in zip(ids, reference, strict=True):
            logits = every_position(backend, i)
            errors += ((logits - ref).norm(dim=-1) / ref.norm(dim=-1)).tolist()
            same += int((logits.argmax(-1) == ref.argmax(-1)).sum())
            positions += len(i)
        row = {
            "method": method,
            "dtype": dtype,
            "relative_error_mean": statistics.mean(errors),
            "relative_error_max": max(errors),
            "same_top1": same,
            "positions": positions,
            "quantize_seconds": seconds,
        }
        rows.append(row)
        print(
            f"| {method} ({dtype}) | {row['relative_error_mean']:.4f} | {row['relative_error_max']:.4f} "
            f"| {same}/{positions} ({same / positions:.1%}) | {seconds:.1f} |",
            flush=True,
        )
        del backend
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    return rows


def quant_agreement(args) -> list[dict]:
    """Greedy ids of quantized weights against full precision on the tiny demo model, which
    memorized its corpus: each memorized line is cut after its first word or two and the rest
    decoded (float32, both runtimes, 8 and 4 bits), as tests/test_quantization.py does."""
    from backends.choose import load_backend
    from backends.contract import LoadOptions, Sampling, Sequence
    from backends.decoding.drive import drive
    from backends.torch.tiny import ascii_lines

    rows = []
    for runtime, methods in (("torch", ("int8", "int4", "w8a8")), ("mlx", ("8", "4"))):
        full = load_backend(runtime, LoadOptions(model="tiny", dtype="float32", warmup=False))
        cases = []
        for line in ascii_lines():
            cut = (
                line.index(" ", 6) if " " in line[6:] else len(line) // 2
            )  # the rest starts with its space, as trained
            cases.append((full.encode(line[:cut]), len(full.encode(line[cut:]))))
        expected = [drive(full.decoder(1), [Sequence(0, prompt, Sampling(), n)]).ids[0] for prompt, n in cases]
        for method in methods:
            options = LoadOptions(model="tiny", dtype="float32", quantize=method, warmup=False, quantized_cache=False)
            quantized = load_backend(runtime, options)
            got = [drive(quantized.decoder(4), [Sequence(0, prompt, Sampling(), n)]).ids[0] for prompt, n in cases]
            same = sum(a == b for x, y in zip(expected, got, strict=False) for a, b in zip(x, y, strict=False))
            total = sum(len(x) for x in expected)
            lines = sum(x == y for x, y in zip(expected, got, strict=False))
            rows.append(
                {
                    "runtime": runtime,
                    "method": method,
                    "tokens_same": same,
                    "tokens": total,
                    "lines_same": lines,
                    "lines": len(cases),
                }
            )
            print(f"| {runtime} | {method} | {same}/{total} ({same / total:.0%}) | {lines}/{len(cases)} |", flush=True)
    return rows
