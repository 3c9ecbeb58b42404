"""Issue 30's single-request latency on a CUDA machine, in process (no HTTP), random bfloat16
weights, the server's decoder (64 rows, a prompt cache):

    python3 -P tests/gpu/first_token.py [--shape random:phi-2] [--as-served]

1. GPU time of the prefill graphs (a replay alone, CUDA events): new prompts and pieces after
   cached columns, by (rows, length, span).
2. Eager pieces after cached columns (a long prompt's chunks): the paged attention kernel
   against a gather of the rows' columns and masked SDPA, and their logits' difference.
3. The decoder's time to a first token (add and steps, synchronized, median of 15): a new
   24-token prompt greedy and sampled, a 1,000-token one cold greedy and sampled, the same sent
   again, and a chat's next turn (the 1,000 stored, 40 or 200 new tokens); and the time to
   tokenize a 1,052-token text.

With --as-served, only 3., through the decoder the server makes with its defaults (its rows, KV
pool and prompt cache by the GPU's memory), to tell what the decoder's settings cost from what
the server around it does.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from backends.choose import load_backend  # noqa: E402
from backends.contract import LoadOptions, Sampling, Sequence  # noqa: E402
from backends.torch import network as torch_model  # noqa: E402
from backends.torch.decoder import BatchedDecoder  # noqa: E402

GRAPHS = [(1, 32, 0), (1, 64, 0), (1, 64, 512), (1, 64, 2048), (1, 256, 2048), (8, 64, 2048), (32, 32, 512)]
PIECES = [(512, 512), (1024, 512), (1500, 400), (100, 600)]  # (cached columns, piece length)


def prompt_of(length: int, salt: int = 0) -> list[int]:
    return [5 + (i * 37 + salt * 101) % 580 for i in range(length)]


def gpu_ms(fn, n: int = 20) -> float:
    for _ in range(3):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(n):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / n


def graphs(decoder: BatchedDecoder) -> None:
    for shape in GRAPHS:
        if shape in decoder.graphs.padded_graphs:
            graph, _ = decoder.graphs.padded_graphs[shape]
            print(f"prefill graph {shape}: replay {gpu_ms(graph.replay):.3f} ms", flush=True)


@torch.inference_mode()
def pieces(decoder: BatchedDecoder) -> None:
    decoder.pages.take(0, 2048)
    paged = torch_model.Placement.paged
    for start, length in PIECES:
        parts = [(0, prompt_of(length, 7), start)]
        kernel = gpu_ms(lambda: decoder.prefill.run(parts, lora_rows=[-1]))  # noqa: B023
        a, _ = decoder.prefill.run(parts, lora_rows=[-1])
        torch_model.Placement.paged = property(lambda self: False)
        try:
            gathered = gpu_ms(lambda: decoder.prefill.run(parts, lora_rows=[-1]))  # noqa: B023
            b, _ = decoder.prefill.run(parts, lora_rows=[-1])
        finally:
            torch_model.Placement.paged = paged
        print(
            f"{length} tokens after {start}: paged kernel {kernel:.2f} ms, gather + masked SDPA {gathered:.2f} ms, "
            f"logits differ by {float((a - b).abs().max()):.3f} of {float(b.abs().max()):.2f}",
            flush=True,
        )
    decoder.kv.release([0])


def first_tokens(decoder: BatchedDecoder, backend) -> None:
    ids = iter(range(10**6))

    def first(prompt, sampling=Sampling()):
        sequence = Sequence(next(ids), prompt, sampling, 4)
        torch.cuda.synchronize()
        started = time.perf_counter()
        decoder.add(sequence)
        while sequence.id not in decoder.step():
            pass
        torch.cuda.synchronize()
        took = time.perf_counter() - started
        decoder.remove(sequence.id)
        return took * 1000

    stored = prompt_of(1000)
    first(stored)
    sampled = Sampling(temperature=0.8, top_p=0.95, seed=7)
    cases = {
        "new 24 tokens": lambda i: (prompt_of(24, 1000 + i),),
        "new 24 tokens, sampled": lambda i: (prompt_of(24, 2000 + i), sampled),
        "1,000 tokens cold": lambda i: (prompt_of(1000, 3000 + i),),
        "1,000 tokens cold, sampled": lambda i: (prompt_of(1000, 4000 + i), sampled),
        "the same 1,000 again": lambda i: (stored,),
        "a turn: the 1,000 stored + 40 new": lambda i: (stored + prompt_of(40, 5000 + i),),
        "a turn: the 1,000 stored + 200 new": lambda i: (stored + prompt_of(200, 6000 + i),),
    }
    for name, make in cases.items():
        for i in range(3):
            first(*make(i))
        times = [first(*make(10 + i)) for i in range(15)]
        print(f"{name}: first token {statistics.median(times):.2f} ms (min {min(times):.2f})", flush=True)
    text = " ".join(f"line {i}: the quick brown fox jumps over the lazy dog." for i in range(80))
    times = []
    for _ in range(20):
        started = time.perf_counter()
        count = len(backend.encode(text))
        times.append((time.perf_counter() - started) * 1000)
    print(f"tokenizing {count} tokens: {statistics.median(times):.2f} ms", flush=True)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shape", default="random:phi-2")
    parser.add_argument(
        "--as-served",
        action="store_true",
        help="the decoder the server makes with its defaults (MAX_BATCH and the KV pool by the GPU's memory, "
        "the default prompt cache), warmed up as at start, first tokens only",
    )
    args = parser.parse_args()
    print(torch.cuda.get_device_name(), torch.__version__, flush=True)
    options = LoadOptions(model=args.shape, device="cuda", dtype="bfloat16", warmup=args.as_served)
    started = time.perf_counter()
    backend = load_backend("torch", options)
    if args.as_served:
        decoder = backend.decoder(backend.max_batch)
        print(
            f"as served: {decoder.capacity} rows, {decoder.kv.pages} pages, loaded and warmed up in "
            f"{time.perf_counter() - started:.1f} s",
            flush=True,
        )
        first_tokens(decoder, backend)
        return 0
    decoder = BatchedDecoder(backend.decoder_weights, 64, prompt_cache_bytes=2 << 30)
    started = time.perf_counter()
    decoder.capture()
    print(
        f"captured in {time.perf_counter() - started:.1f} s: {len(decoder.graphs.padded_graphs)} prefill graphs, "
        f"{len(decoder.graphs.decode_graphs)} decode",
        flush=True,
    )
    graphs(decoder)
    pieces(decoder)
    first_tokens(decoder, backend)
    return 0


if __name__ == "__main__":
    sys.exit(main())
