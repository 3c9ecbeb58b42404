"""The families decoder (issue 26) on a CUDA machine: correctness per family, then speed per shape.

    python3 tests/gpu/families.py --out $OUT [--only parity,llama-3.2-1b,...] [--skip-static]

1. parity: each tiny family checkpoint (backends/torch/tiny.py TINY_FAMILIES) and Phi-2's shape, on
   the GPU in float32: the decoder's logits (CUDA graphs, the Triton step) against transformers'
   forward, and greedy ids of 8 prompts decoded in one batch against each alone (float32, then
   bfloat16 with random weights at the real shape).
2. For each real shape (random:phi-2, random:llama-3.2-1b, random:qwen2.5-1.5b,
   random:phi-3-mini), bf16, in one process: the copy bandwidth and the batch-1 limit it sets
   (weight bytes read per token), transformers' generate with a static cache at batch 1, and the
   decoder in process at batch 1 and 64; then a real server (MAX_BATCH=64) driven over HTTP by
   bench.py: 1 client, then 64 clients with distinct prompts, 128 tokens each, with TTFTs.
Writes every number to --out/families.json as it goes; prints a table last.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests" / "gpu"))

import torch  # noqa: E402
from check import copy_bandwidth, profile_step, say, timed_cuda  # noqa: E402

from backends.choose import load_backend  # noqa: E402
from backends.contract import LoadOptions, Sampling, Sequence  # noqa: E402
from backends.decoding.drive import drive  # noqa: E402
from backends.torch.decoder import BatchedDecoder  # noqa: E402

SHAPES = ["random:phi-2", "random:llama-3.2-1b", "random:qwen2.5-1.5b", "random:phi-3-mini"]
PROMPTS = [[5 + (i * 37 + j * 11) % 580 for i in range(12 + 7 * j)] for j in range(8)]
RESULTS: dict = {}


def release() -> None:
    """Give this process's unused GPU memory back (the next decoder, or the server, needs it)."""
    import gc

    gc.collect()
    torch.cuda.empty_cache()


def save(out: Path) -> None:
    (out / "families.json").write_text(json.dumps(RESULTS, indent=1, default=str))


def reference_ids(model, prompt: list[int], n: int, decodable: int) -> list[int]:
    """Greedy ids from transformers' forward, token by token with its own cache."""
    import inspect

    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    # transformers 5.24 takes `cache=`; older 5.x (the GPU image's 5.17) only `past_key_values=`.
    cache_kw = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    ids = []
    with torch.inference_mode():
        out = model(torch.tensor([prompt], device="cuda"), use_cache=True, **{cache_kw: cache})
        for _ in range(n):
            ids.append(int(out.logits[0, -1, :decodable].argmax()))
            position = torch.tensor([[len(prompt) + len(ids) - 1]], device="cuda")
            out = model(
                torch.tensor([[ids[-1]]], device="cuda"), use_cache=True, position_ids=position, **{cache_kw: cache}
            )
    return ids


def parity(name: str, model: str, dtype: str) -> dict:
    backend = load_backend("torch", LoadOptions(model=model, device="cuda", dtype=dtype, warmup=False))
    weights = backend.decoder_weights
    result = {"fused": BatchedDecoder(weights, 1).network.fused}
    prompt = PROMPTS[3]
    with torch.inference_mode():
        expected = backend.model(torch.tensor([prompt], device="cuda")).logits[0, -1].float()
    got = BatchedDecoder(weights, 1).logits_after(prompt)
    result["logits_max_diff"] = float((got - expected).abs().max())
    result["logits_scale"] = float(expected.abs().max())
    n = 40
    batched = drive(BatchedDecoder(weights, 8), [Sequence(i, p, Sampling(), n) for i, p in enumerate(PROMPTS)]).ids
    alone = [drive(BatchedDecoder(weights, 1), [Sequence(0, p, Sampling(), n)]).ids[0] for p in PROMPTS]
    result["batched_equals_alone"] = sum(batched[i] == alone[i] for i in range(8))
    if dtype == "float32":
        reference = [reference_ids(backend.model, p, n, weights.decodable) for p in PROMPTS[:4]]
        result["equals_transformers"] = sum(alone[i] == reference[i] for i in range(4))
        result["same_prefix_lengths"] = [
            next((j for j, (a, b) in enumerate(zip(alone[i], reference[i], strict=False)) if a != b), n)
            for i in range(4)
        ]
        for label, options in (
            ("torch-ops eager", dict(fused=False, cuda_graphs=False)),
            ("torch-ops graphs", dict(fused=False)),
            ("triton graphs", dict(fused=True)),
            ("triton no chaining", dict(fused=True, cuda_graphs=True)),
        ):
            decoder = BatchedDecoder(weights, 1, **options)
            if label == "triton no chaining":
                decoder._can_chain = lambda launched: False
            got = [drive(decoder, [Sequence(0, p, Sampling(), n)]).ids[0] for p in PROMPTS[:4]]
            result[f"same_prefix {label}"] = [
                next((j for j, (a, b) in enumerate(zip(got[i], reference[i], strict=False)) if a != b), n)
                for i in range(4)
            ]
    say(name, dtype, result)
    return result


def extras(family: str, path: Path, folder: Path) -> dict:
    """A tiny family in float32 on the GPU: an adapter in a batch (the Triton step, CUDA graphs)
    against transformers with it merged, and int8 weights (the torch-ops step, graphed):
    logits near the full-precision ones, batched equal to alone."""
    from benchmarks.adapters import write_random_adapters
    from tests.lora_reference import merge_lora_into_torch

    result = {}
    backend = load_backend(
        "torch", LoadOptions(model=str(path), device="cuda", dtype="float32", adapters_dir=str(folder), warmup=False)
    )
    (name,) = write_random_adapters(backend, str(folder), 1, layers=2, scale=2.0)
    adapter = backend.adapters.get(name)
    merged = load_backend("torch", LoadOptions(model=str(path), device="cuda", dtype="float32", warmup=False))
    merge_lora_into_torch(merged.model, folder / name)
    n = 30
    sequences = [Sequence(i, p, Sampling(), n, adapter=adapter if i % 2 else None) for i, p in enumerate(PROMPTS[:4])]
    together = drive(BatchedDecoder(backend.decoder_weights, 4), sequences).ids
    expected = [
        reference_ids((merged if i % 2 else backend).model, PROMPTS[i], n, backend.decoder_weights.decodable)
        for i in range(4)
    ]
    result["adapter_rows_equal_merged"] = sum(together[i] == expected[i] for i in range(4))
    full = BatchedDecoder(backend.decoder_weights, 1).logits_after(PROMPTS[2])
    for method in ("int8",):  # tinygemm's int4 wants input widths of 128 multiples: the tiny families' are 64
        quantized = load_backend(
            "torch", LoadOptions(model=str(path), device="cuda", dtype="float32", quantize=method, warmup=False)
        )
        weights = quantized.decoder_weights
        got = BatchedDecoder(weights, 1).logits_after(PROMPTS[2])
        batched = drive(BatchedDecoder(weights, 8), [Sequence(i, p, Sampling(), 20) for i, p in enumerate(PROMPTS)]).ids
        alone = [drive(BatchedDecoder(weights, 1), [Sequence(0, p, Sampling(), 20)]).ids[0] for p in PROMPTS]
        result[method] = {
            "fused": BatchedDecoder(weights, 1).network.fused,
            "relative_logit_error": float((got - full).norm() / full.norm()),
            "batched_equals_alone": sum(batched[i] == alone[i] for i in range(8)),
        }
    say(family, "extras", result)
    return result


def speed(shape: str, static: bool) -> dict:
    backend = load_backend("torch", LoadOptions(model=shape, device="cuda", dtype="bfloat16", warmup=False))
    model = backend.model
    weights = backend.decoder_weights
    # Bytes a batch-1 step reads: every weight once (a tied embedding counts once: the output head).
    weight_bytes = sum(p.numel() * p.element_size() for p in {id(p): p for p in model.parameters()}.values())
    if not model.config.tie_word_embeddings:
        weight_bytes -= (
            model.model.embed_tokens.weight.numel() * model.model.embed_tokens.weight.element_size()
        )  # read a row, not all
    bandwidth = copy_bandwidth()
    result = {
        "weight_bytes_per_token": weight_bytes,
        "copy_bandwidth_bytes_s": bandwidth,
        "limit_tok_s": bandwidth / weight_bytes,
        "context_length": backend.info.context_length,
    }
    ids = torch.tensor([PROMPTS[1][:16]], device="cuda")
    n = 128
    if static:
        try:
            model.generate(
                ids, max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0, cache_implementation="static"
            )
            seconds = timed_cuda(
                lambda: model.generate(
                    ids,
                    max_new_tokens=n,
                    min_new_tokens=n,
                    do_sample=False,
                    pad_token_id=0,
                    cache_implementation="static",
                )
            )
            result["generate_static_tok_s"] = n / seconds
        except Exception as exc:
            result["generate_static_tok_s"] = f"{type(exc).__name__}: {exc}"[:300]
    for batch in (1, 64):
        decoder = BatchedDecoder(weights, batch)
        result["fused"] = decoder.network.fused
        decoder.capture(spans=(128, 256))
        decoder.clear()
        for i in range(batch):
            decoder.add(Sequence(i, PROMPTS[i % 8][:16], Sampling(), n))
        while any(s.next_token is None for s in decoder.rows):
            decoder.step()
        steps = 100
        seconds = timed_cuda(lambda: [decoder.step() for _ in range(steps)])
        result[f"in_process_batch_{batch}"] = {"step_ms": seconds / steps * 1000, "tok_s": batch * steps / seconds}
        decoder = None  # its cache goes before the next one's is allocated
        release()
    say(shape, result)
    return result


def serve(shape: str, out: Path) -> dict:
    """A real server on `shape`, bench.py over HTTP: 1 client, then 64 with distinct prompts."""
    import urllib.request

    logs = out / f"server-{shape.split(':')[1]}"
    logs.mkdir(parents=True, exist_ok=True)
    env = {
        **os.environ,
        "PHI2_MODEL": shape,
        "MAX_BATCH": "64",
        "MAX_QUEUE": "1024",
        "LOG_DIR": str(logs),
        "ADAPTER_PATH": "",
    }
    port = 8322
    started = time.perf_counter()
    server = subprocess.Popen(
        [sys.executable, str(ROOT / "phi2_server.py"), "--port", str(port)],
        env=env,
        stdout=open(logs / "server.log", "w"),
        stderr=subprocess.STDOUT,
    )
    ready = None
    while time.perf_counter() - started < 300 and server.poll() is None:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/ready", timeout=2) as response:
                if response.status == 200:
                    ready = time.perf_counter() - started
                    break
        except OSError:
            time.sleep(0.5)
    result = {"startup_to_ready_s": ready}
    if ready is not None:
        for level, extra in (("1", []), ("64", ["--distinct"])):
            command = [
                sys.executable,
                str(ROOT / "bench.py"),
                "--url",
                f"http://127.0.0.1:{port}",
                "--concurrency",
                level,
                "--max-tokens",
                "128",
                "--runs",
                "3",
                "--label",
                shape,
                "--json",
                str(logs / f"bench-{level}.json"),
                *extra,
            ]
            bench = subprocess.run(command, capture_output=True, text=True, timeout=400)
            say(bench.stdout, bench.stderr[-1500:])
            result[f"clients_{level}"] = (
                json.loads((logs / f"bench-{level}.json").read_text())
                if (logs / f"bench-{level}.json").exists()
                else bench.stderr[-500:]
            )
    server.terminate()
    server.wait(60)
    say(shape, "server", result)
    return result


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="gpu-results")
    parser.add_argument(
        "--only",
        default="",
        help="comma list: parity, extras (adapters, int8/int4 on the tiny families), "
        "and/or shapes (random:... or their names)",
    )
    parser.add_argument(
        "--skip-static", action="store_true", help="no transformers static generate (its compile takes ~30 s a shape)"
    )
    parser.add_argument("--no-serve", action="store_true")
    parser.add_argument(
        "--profile", action="store_true", help="per shape only where a batch-1 step's GPU time goes (kernels, GEMMs)"
    )
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    only = {name.strip() for name in args.only.split(",") if name.strip()}
    say(torch.cuda.get_device_name(), torch.__version__)
    if not only or "parity" in only or "extras" in only:
        from backends.torch.tiny import TINY_FAMILIES, write_tiny_family

        root = Path(tempfile.mkdtemp())
        tiny = load_backend("torch", LoadOptions(model="tiny", device="cpu", warmup=False))
        for family in TINY_FAMILIES:
            try:
                path = write_tiny_family(root / family, family, Path(tiny.model.name_or_path))
                RESULTS[f"parity {family}"] = parity(family, str(path), "float32")
                release()
                if "extras" in only or not only:
                    folder = root / f"{family}-adapters"
                    folder.mkdir()
                    RESULTS[f"extras {family}"] = extras(family, path, folder)
                    release()
            except Exception as exc:
                RESULTS[f"parity {family}"] = f"{type(exc).__name__}: {exc}"[:500]
                say(family, RESULTS[f"parity {family}"])
            save(out)
    for shape in SHAPES:
        if only and shape not in only and shape.split(":")[1] not in only:
            continue
        if args.profile:
            backend = load_backend("torch", LoadOptions(model=shape, device="cuda", dtype="bfloat16", warmup=False))
            RESULTS[f"profile {shape}"] = profile_step(backend)
            say(shape, "profile", RESULTS[f"profile {shape}"])
            backend = None
            release()
            save(out)
            continue
        try:
            RESULTS[f"parity {shape} bf16"] = parity(shape, shape, "bfloat16")
            release()
            RESULTS[f"speed {shape}"] = speed(shape, static=not args.skip_static)
            release()
            save(out)
            if not args.no_serve:
                RESULTS[f"serve {shape}"] = serve(shape, out)
        except Exception as exc:
            RESULTS[f"error {shape}"] = f"{type(exc).__name__}: {exc}"[:500]
            say(shape, RESULTS[f"error {shape}"])
        save(out)
    say(json.dumps({k: v for k, v in RESULTS.items() if not k.startswith("serve")}, default=str)[:6000])
    failed = [key for key, value in RESULTS.items() if isinstance(value, str)]  # an exception's text
    if failed:
        say("FAILED:", ", ".join(failed))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
