"""The CUDA path's Triton kernels on a CPU, under Triton's interpreter: each against the torch
code it replaces, on the tiny model and a tiny checkpoint of each other family, in float32. For
working on backends/torch/cuda/triton_*.py without a GPU; tests/gpu/check.py and kernels.py are the
measurements on one.

    python3 -m pip install --target /tmp/triton-interp triton==3.6.0 "numpy<2.3"
    PYTHONPATH=/tmp/triton-interp .venv/bin/python tests/gpu/interpret.py [llama ...]   # minutes

(Triton 3.6's interpreter needs numpy < 2.3.) Not part of `make test`: the CPU never runs these
kernels, and Triton is no dependency of the CPU install.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path

os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported
ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from backends.choose import load_backend  # noqa: E402
from backends.contract import LoadOptions, Sampling, Sequence  # noqa: E402
from backends.decoding.drive import drive  # noqa: E402
from backends.torch import decoder as torch_decoder  # noqa: E402
from backends.torch import network as torch_model  # noqa: E402
from backends.torch.decoder import BatchedDecoder  # noqa: E402
from backends.torch.kv_pages import pages_for  # noqa: E402

PROMPTS = ["Alice: describe yourself as JSON. Bob:", "Bob: I am fine", "Alice: What is two plus two? Bob:", "Hello"]
FAILURES: list[str] = []


def check(name: str, ok: bool, detail: str = "") -> None:
    print(f"{'ok  ' if ok else 'FAIL'} {name} {detail}", flush=True)
    if not ok:
        FAILURES.append(name)


def cuda_like(decoder: BatchedDecoder) -> BatchedDecoder:
    """The decoder as CUDA runs it (fused step, chained steps, device draws), graphs replaced by
    plain calls: the CPU has none."""
    decoder.kv.resize(1 + decoder.width * pages_for(decoder.context + 1))  # whole, as on CUDA (the CPU's grows by use)
    decoder.use_graphs = True
    decoder.graphs.replay = lambda batch, span, lora=0: decoder.network.decode_step(batch, span, lora)
    return decoder


def decode(decoder, backend, samplings, adapters=(None,) * 4, tokens: int = 16) -> list[list[int]]:
    decoder.clear()
    sequences = [
        Sequence(i, backend.encode(p), s, tokens, adapter=a)
        for i, (p, s, a) in enumerate(zip(PROMPTS, samplings, adapters, strict=False))
    ]
    ids = drive(decoder, sequences).ids
    return [ids[i] for i in range(len(PROMPTS))]


def main() -> int:
    torch.cuda.synchronize = lambda *args: None  # triton_check.works() waits for the device
    from backends.torch.cuda import triton_attention
    from backends.torch.tiny import TINY_FAMILIES, write_tiny_family

    # The interpreter runs every program in numpy: few splits still combine. A split per 16
    # columns gives the rows of a step split counts of their own (by their lengths).
    triton_attention.ATTENTION.update(max_splits=3, split_columns=16)

    root = Path(tempfile.mkdtemp(prefix="families-"))
    tiny = load_backend("torch", LoadOptions(model="tiny", device="cpu", dtype="float32", warmup=False))
    models = {"phi (tiny)": "tiny"}
    only = set(sys.argv[1:])  # family names, or none for all
    for family in TINY_FAMILIES:
        models[family] = str(write_tiny_family(root / family, family, Path(tiny.model.name_or_path)))
    for name, model in models.items():
        if only and name.split()[0] not in only:
            continue
        print(f"-- {name}", flush=True)
        check_model(name, model, root)
    print("FAILED: " + ", ".join(FAILURES) if FAILURES else "all passed")
    return 1 if FAILURES else 0


def check_model(name: str, model: str, root: Path) -> None:
    folder = tempfile.mkdtemp(prefix="adapters-", dir=root)
    backend = load_backend(
        "torch", LoadOptions(model=model, device="cpu", dtype="float32", adapters_dir=folder, warmup=False)
    )
    from benchmarks.adapters import write_random_adapters

    w = backend.decoder_weights
    from backends.torch.cuda import triton_check

    arch = w.arch
    check(
        f"{name}: the kernels run for the model's shapes",
        triton_check.works(
            w.device,
            w.embed.dtype,
            torch_model.heads_of(arch),
            w.hidden,
            w.inner,
            arch.parallel,
            arch.qk_norm,
            arch.gated,
        ),
    )

    # Prefill: one piece from position 0, one after cached columns (both attention choices), padded pieces.
    ids = backend.encode(" ".join(PROMPTS) * 3)
    with torch.inference_mode():
        plain = BatchedDecoder(w, 4, cuda_graphs=False)
        for row in range(4):  # every slot the checks write holds its pages
            plain.pages.take(row, len(ids) + 8)
        reference, _ = plain.prefill.run([(0, ids, 0), (1, ids[:50], 0)], lora_rows=[-1, -1])
        fused = BatchedDecoder(w, 4, cuda_graphs=False, fused=True)
        for row in range(4):
            fused.pages.take(row, len(ids) + 8)
        fused.use_graphs = True
        one, _ = fused.prefill.run([(0, ids, 0)], lora_rows=[-1])
        check(
            f"{name}: prefill, one piece",
            torch.allclose(one[0], reference[0], atol=1e-5),
            f"{(one[0] - reference[0]).abs().max():.1e}",
        )
        for threshold in (0, 10**9):
            torch_model.LOWER_RIGHT_FROM = threshold
            fused.prefill.run([(1, ids[:10], 0)], lora_rows=[-1])
            rest, _ = fused.prefill.run([(1, ids[10:], 10)], lora_rows=[-1])
            check(
                f"{name}: prefill after cached columns "
                f"({'bottom-right causal' if threshold == 0 else 'explicit mask'})",
                torch.allclose(rest[0], reference[0], atol=1e-5),
                f"{(rest[0] - reference[0]).abs().max():.1e}",
            )
        torch_model.LOWER_RIGHT_FROM = 768
        fused.use_graphs = False
        padded, _ = fused.prefill.run([(2, ids, 0), (3, ids[:50], 0)], lora_rows=[-1, -1])
        check(
            f"{name}: prefill, padded pieces",
            torch.allclose(padded, reference, atol=1e-5),
            f"{(padded - reference).abs().max():.1e}",
        )
        # New prompts padded to a prefill graph's shape (what CUDA replays; the paged attention
        # kernel), short enough for the tiny families' windows of 16: three prompts in four
        # rows, the last a padding row (no tokens, no columns read).
        prompts = [(0, ids[:12], 0), (1, ids[:7], 0), (2, ids[3:14], 0)]
        short, _ = plain.prefill.run(prompts, lora_rows=[-1] * 3)
        fresh = BatchedDecoder(w, 4, cuda_graphs=False, fused=True, prefill_graphs=True)
        for row in range(3):
            fresh.pages.take(row, 16)
        got, _ = fresh.prefill.run(prompts, lora_rows=[-1] * 3)
        check(
            f"{name}: prefill of new prompts padded to a graph's shape",
            fresh.network._padded_inputs is not None and torch.allclose(got, short, atol=1e-5),
            f"{(got - short).abs().max():.1e}",
        )
        # Pieces after cached columns padded to a graph's shape (a span): the paged attention
        # kernel, past the tiny families' windows, beside a new prompt and a padding row.
        expected, _ = plain.prefill.run([(0, ids[:60], 0), (1, ids[:50], 0), (2, ids[:9], 0)], lora_rows=[-1] * 3)
        after = BatchedDecoder(w, 4, cuda_graphs=False, fused=True, prefill_graphs=True)
        for row in range(4):
            after.pages.take(row, len(ids) + 8)
        after.prefill.run([(0, ids[:40], 0), (1, ids[:20], 0)], lora_rows=[-1, -1])
        spans = []
        after.graphs.padded = lambda rows, length, span: spans.append(span) or after.network.padded_pass(
            rows, length, span
        )
        got, _ = after.prefill.run([(0, ids[40:60], 40), (1, ids[20:50], 20), (2, ids[:9], 0)], lora_rows=[-1] * 3)
        check(
            f"{name}: prefill of pieces after cached columns padded to a graph's shape, paged attention",
            spans == [512] and torch.allclose(got, expected, atol=1e-5),
            f"{spans} {(got - expected).abs().max():.1e}",
        )

    # Decode: greedy with adapters, fused against the torch-ops step, long enough to pass the
    # tiny families' sliding windows (16, 32) and longrope's switch (64).
    adapters = [backend.adapters.get(name) for name in write_random_adapters(backend, folder, 2, layers=2)]
    chosen = [None, adapters[0], adapters[1], None]
    greedy = [Sampling()] * 4
    unfused = decode(BatchedDecoder(w, 4, cuda_graphs=False), backend, greedy, chosen, tokens=60)
    got = decode(cuda_like(BatchedDecoder(w, 4, cuda_graphs=False, fused=True)), backend, greedy, chosen, tokens=60)
    check(
        f"{name}: greedy decode with adapters, fused = torch ops",
        got == unfused,
        f"{sum(a == b for a, b in zip(got, unfused, strict=False))}/4",
    )

    # Sampled rows, under a grammar or not: drawn on the device, the same in a batch as alone.
    schema = {
        "type": "object",
        "properties": {"name": {"type": "string", "maxLength": 8}, "age": {"type": "integer"}},
        "required": ["name", "age"],
        "additionalProperties": False,
    }
    constraint = backend.constraint("json_schema", json.dumps(schema))

    def samplings_of() -> list[Sampling]:  # a sequence walks its grammar with a matcher of its own
        return [
            Sampling(temperature=0.9, seed=1, constraint=constraint.matcher()),
            Sampling(temperature=1.0, top_k=20, seed=2),
            Sampling(constraint=constraint.matcher()),
            Sampling(temperature=1.0, top_p=0.8, min_p=0.01, seed=5, constraint=constraint.matcher()),
        ]

    samplings = samplings_of()
    draws = []
    original = torch_decoder.sample_on_device
    torch_decoder.sample_on_device = lambda *args: draws.append(len(args[0])) or original(*args)
    decoder = cuda_like(BatchedDecoder(w, 4, cuda_graphs=False, fused=True))
    together = decode(decoder, backend, samplings, tokens=24)
    torch_decoder.sample_on_device = original
    check(f"{name}: sampled rows drawn on the device", bool(draws), f"{len(draws)} draws")
    alone, samplings = [], samplings_of()
    for i in range(4):
        decoder.clear()
        alone.append(drive(decoder, [Sequence(i, backend.encode(PROMPTS[i]), samplings[i], 24)]).ids[i])
    check(
        f"{name}: sampled rows: batched = alone",
        together == alone,
        f"{sum(a == b for a, b in zip(together, alone, strict=False))}/4",
    )
    for i in (0, 2, 3):
        text = backend.decode(together[i])
        check(f"{name}: constrained row {i} follows the schema so far", text.startswith('{"name": "'), repr(text[:40]))


if __name__ == "__main__":
    sys.exit(main())
