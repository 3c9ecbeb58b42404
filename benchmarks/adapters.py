"""Per-request LoRA adapters in process (--adapters): random adapters written for the loaded
model, and decode tok/s with them against the base model and against one merged into the weights."""

from __future__ import annotations

import json
import os
import shutil
import statistics
import time

from benchmarks.in_process import load_in_process


def write_random_adapters(
    backend, folder: str, count: int, rank: int = 8, layers: int = 8, scale: float = 20.0
) -> list[str]:
    """`count` LoRA adapters in mlx-lm's format for the loaded model: rank 8 on every Linear of
    the last 8 blocks (mlx-lm's default keys for Phi), random weights, scale 20 (its default)."""
    import torch
    from safetensors.torch import save_file

    from backends.torch.lora import torch_linears

    linears = torch_linears(backend.model)
    blocks = 1 + max(int(name.split(".")[2]) for name in linears)
    names = []
    for index in range(count):
        generator = torch.Generator().manual_seed(index)
        tensors = {}
        for name, (n_in, n_out) in linears.items():
            if int(name.split(".")[2]) >= blocks - layers:
                tensors[f"{name}.lora_a"] = torch.randn(n_in, rank, generator=generator) * n_in**-0.5
                tensors[f"{name}.lora_b"] = torch.randn(rank, n_out, generator=generator) * 1e-3
        path = os.path.join(folder, f"adapter-{index}")
        os.makedirs(path)
        save_file(tensors, os.path.join(path, "adapters.safetensors"))
        config = {
            "fine_tune_type": "lora",
            "num_layers": layers,
            "lora_parameters": {"rank": rank, "scale": scale, "dropout": 0.0},
        }
        with open(os.path.join(path, "adapter_config.json"), "w") as out:
            json.dump(config, out)
        names.append(f"adapter-{index}")
    return names


def adapter_decoding(args) -> list[dict]:
    """Decode tok/s of per-request LoRA adapters, in process, on the Torch runtime, alternating
    runs on one decoder: a batch of 8 mixing 4 adapters against 8 sequences of the base model;
    and one sequence with one adapter, unmerged, against the same adapter merged into the weights
    (merged in place and subtracted again: the same memory, the same decoder)."""
    import tempfile

    from backends.contract import Sampling, Sequence
    from backends.decoding.drive import drive

    os.environ.setdefault("PHI2_MODEL", "random:phi-2")
    folder = tempfile.mkdtemp(prefix="bench-adapters-")
    os.environ["ADAPTERS_DIR"] = folder
    backend = load_in_process()
    names = write_random_adapters(backend, folder, 8 if backend.max_batch >= 64 else 4)
    adapters = [backend.adapters.get(name) for name in names]
    prompt_ids = backend.encode(args.prompt)

    def rate(decoder, chosen: list) -> float:
        sequences = [
            Sequence(i, prompt_ids, Sampling(), args.max_tokens, adapter=adapter) for i, adapter in enumerate(chosen)
        ]
        first: list[float] = []
        drive(decoder, sequences, on_tokens=lambda step, tokens: first or first.append(time.perf_counter()))
        return len(chosen) * (args.max_tokens - 1) / (time.perf_counter() - first[0])

    def merged(sign: float) -> None:  # the adapter's product added to (or taken from) the weights
        import torch

        with torch.no_grad():
            for name, (a, b) in adapters[0].modules.items():
                weight = backend.model.get_submodule(name).weight
                weight += (sign * adapters[0].scale * (a.double() @ b.double()).T).to(
                    device=weight.device, dtype=weight.dtype
                )

    comparisons = [
        (
            "batch 8: 4 adapters, 2 sequences each / the base model",
            8,
            lambda d: rate(d, [adapters[i % 4] for i in range(8)]),
            lambda d: rate(d, [None] * 8),
        ),
        ("batch 1: one adapter unmerged / merged into the weights", 1, lambda d: rate(d, [adapters[0]]), None),
    ]
    if backend.max_batch >= 64:  # a GPU's batch: every slot in use
        comparisons.append(
            (
                "batch 64: 8 adapters, 8 sequences each / the base model",
                64,
                lambda d: rate(d, [adapters[i % 8] for i in range(64)]),
                lambda d: rate(d, [None] * 64),
            )
        )
    rows = []
    for label, batch, measure, against in comparisons:
        decoder = backend.decoder(max(batch, backend.max_batch))  # the batched path, as the server decodes
        rates: dict[str, list[float]] = {"with adapters": [], "reference": []}
        for _ in range(args.runs):
            rates["with adapters"].append(measure(decoder))
            if against is not None:
                rates["reference"].append(against(decoder))
            else:
                merged(+1)
                try:
                    rates["reference"].append(rate(decoder, [None]))
                finally:
                    merged(-1)
        if args.runs > 1:  # the first run warms up
            rates = {k: v[1:] for k, v in rates.items()}
        ours, reference = statistics.median(rates["with adapters"]), statistics.median(rates["reference"])
        rows.append(
            {
                "comparison": label,
                "batch": batch,
                "adapters_tok_s": ours,
                "reference_tok_s": reference,
                "ratio": ours / reference,
            }
        )
        print(f"| {label} | {ours:.2f} | {reference:.2f} | {ours / reference:.3f} |", flush=True)
    shutil.rmtree(folder, ignore_errors=True)
    return rows
