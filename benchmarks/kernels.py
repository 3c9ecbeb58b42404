"""The machine and its kernels: memory bandwidth and the decode limit it sets (--bandwidth),
float32 against bfloat16 decode per model size (--dtype-sweep), and weight-only int8/int4 matrix
products on Phi-2's shapes (--quant-kernels)."""

from __future__ import annotations

import json
import statistics
import time

from benchmarks.common import time_call


def memory_bandwidth() -> dict:
    """This machine's read bandwidth: float32 matrix-vector products over 2 GiB of distinct
    matrices (the way decode once read weights), the same matrices reduced (`torch.amax`: a plain
    read, the limit a block kernel's decode can approach; on the 2-vCPU Zen 4 of 2026-12-08 the
    products read 16-17 GB/s where the reduction read 33-60 GB/s, the host's load varying), and,
    for reference, a numpy copy."""
    import numpy as np
    import torch

    def best(fn) -> float:
        fn()
        return min(time_call(fn) for _ in range(3))

    matrices = [torch.randn(10240, 2560) for _ in range(20)]  # 2.1 GB, far past the caches
    vector = torch.randn(1, 2560)
    nbytes = sum(m.numel() * 4 for m in matrices)
    gemv = nbytes / best(lambda: [torch.nn.functional.linear(vector, m) for m in matrices])
    reduce = nbytes / best(lambda: [torch.amax(m) for m in matrices])
    source = np.ones(2**28)
    target = np.empty_like(source)
    copy = source.nbytes / best(lambda: np.copyto(target, source))
    return {"gemv_read_bytes_s": gemv, "reduce_read_bytes_s": reduce, "copy_bytes_s": copy}


# Phi architectures from toy size to Phi-1.5's, for the CPU dtype rule (--dtype-sweep).
SWEEP_SIZES = [  # hidden, layers, heads, vocab
    (64, 2, 4, 1000),
    (128, 4, 4, 4000),
    (128, 4, 4, 8000),
    (192, 4, 6, 8000),
    (256, 4, 8, 8000),
    (256, 4, 8, 51200),
    (512, 8, 8, 51200),
    (1024, 16, 16, 51200),
    (2048, 24, 32, 51200),
]


def dtype_sweep(args) -> list[dict]:
    """float32 against bfloat16 decode on this CPU, per model size: where bfloat16 starts to pay.

    Random Phi weights (speed does not depend on them), one sequence through the decoder the
    server uses on a CPU (the batched fast path), both dtypes in turn, the median of `runs`."""
    import tempfile
    from pathlib import Path

    import torch

    from backends.contract import Sampling, Sequence
    from backends.decoding.drive import drive
    from backends.files.models import RANDOM_ARCHITECTURES
    from backends.torch.decoder import BatchedDecoder, DecoderWeights
    from backends.torch.runtime import CPU_BF16_MIN_PARAMETERS, random_model

    rows = []
    for hidden, layers, heads, vocab in SWEEP_SIZES:
        config = {
            **RANDOM_ARCHITECTURES["phi-2"],
            "hidden_size": hidden,
            "num_hidden_layers": layers,
            "num_attention_heads": heads,
            "num_key_value_heads": heads,
            "intermediate_size": 4 * hidden,
            "vocab_size": vocab,
            "partial_rotary_factor": 0.5,
        }  # as Phi-1.5: an even rotary width at every head size here
        directory = Path(tempfile.mkdtemp())
        (directory / "config.json").write_text(json.dumps(config))
        decoders, parameters = {}, 0
        for dtype in (torch.float32, torch.bfloat16):
            model = random_model(directory, dtype, "cpu")
            parameters = sum(p.numel() for p in model.parameters())
            decoders[dtype] = BatchedDecoder(DecoderWeights(model, vocab, config["max_position_embeddings"]), 8)
        rates: dict = {dtype: [] for dtype in decoders}
        for run in range(args.runs + 1):  # the first round warms up
            for dtype, decoder in decoders.items():
                sequence = Sequence(run, list(range(5, 13)), Sampling(), args.max_tokens)
                seconds = time_call(lambda: drive(decoder, [sequence]))
                if run:
                    rates[dtype].append(args.max_tokens / seconds)
        f32, bf16 = (sorted(rates[d])[len(rates[d]) // 2] for d in (torch.float32, torch.bfloat16))
        rows.append({"parameters": parameters, "float32_tok_s": f32, "bfloat16_tok_s": bf16})
        auto = "bfloat16" if parameters >= CPU_BF16_MIN_PARAMETERS else "float32"
        print(
            f"| {parameters / 1e6:.1f}M (h{hidden}, L{layers}, vocab {vocab}) | {f32:.1f} | {bf16:.1f} "
            f"| {bf16 / f32:.2f} | {auto} |",
            flush=True,
        )
    return rows


# Phi-2's matrices as the fast path multiplies them: [q; k; v; fc1] and [dense | fc2] of a block.
PHI2_SHAPES = {"block in (17920 x 2560)": (17920, 2560), "block out (2560 x 12800)": (2560, 12800)}


def quant_kernels(args) -> list[dict]:
    """Weight-only matrix products on Phi-2's shapes at batch 1 and 8, per candidate kernel, on
    this machine's device (CUDA if there is one): time, and weight bytes streamed per second."""
    import torch
    import torch.nn.functional as F

    from backends.torch.quant.methods import Int4Weight, Int8Weight

    cuda = torch.cuda.is_available()
    device = "cuda" if cuda else "cpu"
    dtype = torch.bfloat16

    def timed(fn) -> float:  # median of 20 calls after 3 warm-ups, the device synchronized
        for _ in range(3):
            fn()
        samples = []
        for _ in range(20):
            if cuda:
                torch.cuda.synchronize()
            started = time.perf_counter()
            fn()
            if cuda:
                torch.cuda.synchronize()
            samples.append(time.perf_counter() - started)
        return statistics.median(samples)

    rows = []
    for shape_name, (n, k) in PHI2_SHAPES.items():
        weight = (torch.randn(n, k, device=device) * 0.02).to(dtype)
        candidates = {"bfloat16": (lambda x: F.linear(x, weight), weight.nbytes)}
        if not cuda:
            fp32 = weight.float()
            candidates["float32"] = (lambda x: F.linear(x.float(), fp32), fp32.nbytes)
        int8 = Int8Weight(weight)
        int8pack = lambda x: torch.ops.aten._weight_int8pack_mm(x, int8.qweight, int8.scales)  # noqa: E731
        candidates["int8 (aten._weight_int8pack_mm)"] = (int8pack, int8.nbytes)
        if cuda:
            dequantizing = lambda x: F.linear(x, int8.qweight.to(x.dtype)) * int8.scales  # noqa: E731
            candidates["int8 (dequantize + matmul)"] = (dequantizing, int8.nbytes)
            candidates["int8 (dequantize + matmul, torch.compile)"] = (
                torch.compile(dequantizing, dynamic=False),
                int8.nbytes,
            )
        else:
            from torch.ao.nn.quantized.dynamic import Linear as DynamicLinear

            dynamic = DynamicLinear(k, n, bias_=False, dtype=torch.qint8)
            dynamic.set_weight_bias(
                torch.quantize_per_channel(
                    weight.float(), int8.scales.float(), torch.zeros(n, dtype=torch.long), 0, torch.qint8
                ),
                None,
            )
            candidates["int8 (fbgemm dynamic: int8 activations too)"] = (lambda x: dynamic(x.float()), int8.nbytes)
        int4 = Int4Weight(weight)
        candidates["int4 (aten._weight_int4pack_mm" + ("" if cuda else "_for_cpu") + f", group {int4.group_size})"] = (
            int4.linear,
            int4.nbytes,
        )
        for batch in (1, 8, 64) if cuda else (1, 8):
            x = torch.randn(batch, k, device=device, dtype=dtype)
            base = None
            for name, (fn, nbytes) in candidates.items():
                seconds = timed(lambda: fn(x))
                base = base or seconds
                row = {
                    "shape": shape_name,
                    "batch": batch,
                    "kernel": name,
                    "ms": seconds * 1000,
                    "weight_gb_s": nbytes / seconds / 1e9,
                    "speedup_vs_bf16": base / seconds,
                }
                rows.append(row)
                print(
                    f"| {shape_name} | {batch} | {name} | {row['ms']:.3f} | {row['weight_gb_s']:.1f} "
                    f"| {row['speedup_vs_bf16']:.2f}x |",
                    flush=True,
                )
    return rows
