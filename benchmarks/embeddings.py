"""`bench.py --embeddings`: /v1/embeddings beside the chat model (docs/decisions.md, D-embeddings).

A server is spawned with EMBEDDING_MODEL (default: all-MiniLM-L6-v2 from its wheel) and the
chat model of PHI2_MODEL (default: bench.py's). Measured, over HTTP:

- embeddings/s at batch 1 (one input a request, one request at a time) and at batch 32 (32
  inputs a request), on sentences of 10-60 tokens;
- the inter-token gap of 8 greedy streams (/generate/stream) on their own, then while a client
  keeps a long embedding batch (1024 inputs of ~120 tokens a request) running beside them;

then, with the server stopped, sentence-transformers' `encode` on the same model and sentences
in this process at batch sizes 1 and 32 (its own default threads).
"""

from __future__ import annotations

import asyncio
import os
import statistics
import time

import aiohttp

WORDS = "the sea is wide and deep and blue while a small model embeds every sentence it is given today".split()
STREAMS = 8


def sentences(count: int, low: int = 8, high: int = 48, seed: int = 0) -> list[str]:
    import random

    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(low, high))) + "." for _ in range(count)]


async def embed_rate(session, url: str, texts: list[str], batch: int, rounds: int) -> float:
    """Inputs embedded a second, requests of `batch` inputs one after another (one warm-up),
    in base64 as the openai SDK asks by default (JSON floats cost 5.4 ms a 32 x 384 answer to
    write on a 2-vCPU Xeon: most of a GPU batch's time)."""
    chunks = [texts[i : i + batch] for i in range(0, len(texts), batch)][: rounds + 1]
    for n, chunk in enumerate(chunks):
        if n == 1:
            started = time.perf_counter()
        async with session.post(url + "/v1/embeddings", json={"input": chunk, "encoding_format": "base64"}) as response:
            assert response.status == 200, await response.text()
            await response.read()
    return sum(len(c) for c in chunks[1:]) / (time.perf_counter() - started)


async def gaps(session, url: str, max_tokens: int, beside: bool) -> dict:
    """8 streams' inter-token gaps, ms, with or without an embedding client beside them."""
    from bench import stream_one

    stop = asyncio.Event()
    batches = 0
    long_inputs = sentences(1024, 100, 140, seed=1)  # 0.6 MB: within MAX_BODY_BYTES

    async def embedder():
        nonlocal batches
        while not stop.is_set():
            async with session.post(url + "/v1/embeddings", json={"input": long_inputs, "truncate": True}) as response:
                assert response.status == 200, await response.text()
                await response.read()
            batches += 1

    task = asyncio.create_task(embedder()) if beside else None
    if beside:
        await asyncio.sleep(1.0)  # the batch is running before the streams start
    body = {"max_tokens": max_tokens, "ignore_eos": True, "temperature": 0}
    timings = await asyncio.gather(
        *(stream_one(session, url, {**body, "prompt": f"Stream {i}: the quick brown"}) for i in range(STREAMS))
    )
    stop.set()
    if task:
        await task
    between = sorted(
        (b - a) * 1000 for t in timings for a, b in zip(t.arrivals[1:], t.arrivals[2:], strict=False)
    )  # after each stream's first token
    return {
        "p50": statistics.median(between),
        "p99": between[min(len(between) - 1, int(0.99 * len(between)))],
        "max": between[-1],
        "tok_s": statistics.median(t.decode_rate for t in timings),
        "embedding_requests": batches,
    }


def embeddings(args) -> list[dict]:
    from backends.files.models import demo_embedder
    from bench import SpawnedServer, default_model

    os.environ.setdefault("PHI2_MODEL", default_model())
    model = os.environ.get("EMBEDDING_MODEL") or str(demo_embedder())
    threads = os.environ.get("EMBEDDING_THREADS", "0")
    texts = sentences(32 * 9)
    server = SpawnedServer(args.ready_timeout, env={"EMBEDDING_MODEL": model})
    rows = []
    try:

        async def run():
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None)) as session:
                url = server.url
                for _ in range(2):  # the second pass is timed: the first meets every kernel once (CUDA loads lazily)
                    one = await embed_rate(session, url, texts, 1, 64)
                    many = await embed_rate(session, url, texts, 32, 8)
                alone = await gaps(session, url, args.max_tokens, beside=False)
                beside = await gaps(session, url, args.max_tokens, beside=True)
                return one, many, alone, beside

        one, many, alone, beside = asyncio.run(run())
    finally:
        server.stop()
    label = f"phi2-server (EMBEDDING_THREADS={threads})"
    rows.append({"what": f"{label}, embeddings/s at batch 1 / 32", "value": f"{one:.1f} / {many:.1f}"})
    progress(rows[-1])
    for name, g in (("8 streams alone", alone), ("8 streams beside 1024-input batches", beside)):
        rows.append(
            {
                "what": f"{os.environ['PHI2_MODEL']}: {name}, inter-token ms p50 / p99 / max, decode tok/s"
                + (f" ({g['embedding_requests']} batches done)" if g["embedding_requests"] else ""),
                "value": f"{g['p50']:.1f} / {g['p99']:.1f} / {g['max']:.1f}, {g['tok_s']:.1f}",
            }
        )
        progress(rows[-1])
    import torch
    from sentence_transformers import SentenceTransformer

    # Where the server's encoder runs, in its dtype (float32; a file stored in float16 would load as such).
    device = "cuda" if torch.cuda.is_available() else "cpu"
    st = SentenceTransformer(model, device=device, model_kwargs={"dtype": torch.float32})
    for _ in range(2):  # the second pass is timed, as the server's
        rates = []
        for batch in (1, 32):
            count = 64 if batch == 1 else len(texts) - 32
            started = time.perf_counter()
            st.encode(texts[32 : 32 + count], batch_size=batch)  # numpy out: the device is synchronized
            rates.append(count / (time.perf_counter() - started))
    rows.append(
        {
            "what": "sentence-transformers encode, same model and sentences, embeddings/s at batch 1 / 32",
            "value": f"{rates[0]:.1f} / {rates[1]:.1f}",
        }
    )
    progress(rows[-1])
    return rows


def progress(row: dict) -> None:
    print(f"| {row['what']} | {row['value']} |", flush=True)
