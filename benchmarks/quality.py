"""What quantized weights change: their logits against bfloat16's (--quant-quality) and their
greedy ids against full precision on the tiny demo model (--quant-agreement)."""

from __future__ import annotations

import os
import statistics
import time

from benchmarks.common import FILLER, QUESTIONS


def quant_quality(args) -> list[dict]:
    """How far quantized weights move the last-position logits from bfloat16's, on PHI2_MODEL
    (random:phi-2 where Phi-2's weights cannot be fetched): the relative L2 error, and whether
    the most likely token is the same, over a few prompts. Each method on a fresh bfloat16 load."""
    import torch

    from backends import LoadOptions, load_backend, select_backend
    from backends.torch_decoder import BatchedDecoder

    model = os.environ.get("PHI2_MODEL", "random:phi-2")
    prompts = [FILLER[: 40 * (i + 1)] + q for i, q in enumerate(QUESTIONS)]
    rows = []
    for method in ("int8", "int4"):
        backend = load_backend(select_backend("torch"), LoadOptions(model=model, dtype="bfloat16", warmup=False))
        ids = [backend.encode(p) for p in prompts]
        decodable = backend.decoder_weights.decodable  # the ids past the tokenizer's are never generated: left out
        reference = [BatchedDecoder(backend.decoder_weights, 1).logits_after(i)[:decodable] for i in ids]
        started = time.perf_counter()
        backend.quantize(method)
        seconds = time.perf_counter() - started
        decoder = BatchedDecoder(backend.decoder_weights, 1)
        errors, same = [], 0
        for i, ref in zip(ids, reference, strict=False):
            logits = decoder.logits_after(i)[:decodable]
            errors.append(float((logits - ref).norm() / ref.norm()))
            same += int(logits.argmax() == ref.argmax())
        row = {
            "method": method,
            "relative_error_mean": statistics.mean(errors),
            "relative_error_max": max(errors),
            "same_top1": same,
            "prompts": len(prompts),
            "quantize_seconds": seconds,
        }
        rows.append(row)
        print(
            f"| {method} | {row['relative_error_mean']:.4f} | {row['relative_error_max']:.4f} "
            f"| {same}/{len(prompts)} | {seconds:.1f} |",
            flush=True,
        )
        del backend, decoder, reference
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    return rows


def quant_agreement(args) -> list[dict]:
    """Greedy ids of quantized weights against full precision on the tiny demo model, which
    memorized its corpus: each memorized line is cut after its first word or two and the rest
    decoded (float32, both runtimes, 8 and 4 bits), as tests/test_quantization.py does."""
    from backends import LoadOptions, Sampling, Sequence, load_backend
    from backends.drive import drive
    from backends.tiny import ascii_lines

    rows = []
    for runtime, methods in (("torch", ("int8", "int4")), ("mlx", ("8", "4"))):
        full = load_backend(runtime, LoadOptions(model="tiny", dtype="float32", warmup=False))
        cases = []
        for line in ascii_lines():
            cut = (
                line.index(" ", 6) if " " in line[6:] else len(line) // 2
            )  # the rest starts with its space, as trained
            cases.append((full.encode(line[:cut]), len(full.encode(line[cut:]))))
        expected = [drive(full.decoder(1), [Sequence(0, prompt, Sampling(), n)]).ids[0] for prompt, n in cases]
        for method in methods:
            quantized = load_backend(runtime, LoadOptions(model="tiny", dtype="float32", quantize=method, warmup=False))
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
