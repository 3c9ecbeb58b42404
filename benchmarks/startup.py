"""Start to ready with PHI2_QUANTIZE on Torch: quantized at every start (QUANTIZED_CACHE=0),
the first start that stores the quantized weights, and the next one that maps them.

Each start is a spawned server with an empty PHI2_CACHE_DIR of its own (the second start
shares the first's), timed from the process's start to /ready answering 200, with its peak
resident memory (VmHWM) and its resident memory once ready. Each answers the same forced
greedy request, and the three texts must be equal."""

from __future__ import annotations

import asyncio
import os
import shutil
import tempfile
import time

import aiohttp


async def greedy_text(url: str, tokens: int) -> str:
    body = {"prompt": "The quick brown fox", "max_tokens": tokens, "ignore_eos": True, "temperature": 0}
    async with aiohttp.ClientSession() as session:
        async with session.post(url + "/generate", json=body) as response:
            return (await response.json())["text"]


def startup(args) -> list[dict]:
    from bench import SpawnedServer

    os.environ.setdefault("PHI2_MODEL", "random:phi-2")
    os.environ.setdefault("PHI2_QUANTIZE", "int8")
    root = tempfile.mkdtemp(prefix="phi2-startup-")
    runs = [
        ("quantize at every start (QUANTIZED_CACHE=0)", "off", {"QUANTIZED_CACHE": "0"}),
        ("first start: quantize and store", "stored", {}),
        ("next start: map the stored file", "stored", {}),
    ]
    rows, texts = [], []
    try:
        for label, cache, env in runs:
            started = time.perf_counter()
            server = SpawnedServer(args.ready_timeout, env={"PHI2_CACHE_DIR": os.path.join(root, cache), **env})
            ready = time.perf_counter() - started
            try:
                peak, now = server.peak_rss_gib(), server.peak_rss_gib("VmRSS")
                texts.append(asyncio.run(greedy_text(server.url, args.max_tokens)))
            finally:
                server.stop()
            row = {"start": label, "ready_s": round(ready, 2), "peak_rss_gib": peak, "rss_ready_gib": now}
            rows.append(row)
            print(f"| {label} | {ready:.1f} s | {peak:.2f} GiB | {now:.2f} GiB |", flush=True)
        stored = [f for f in os.listdir(os.path.join(root, "stored", "quantized")) if f.endswith(".pt")]
        size = sum(os.path.getsize(os.path.join(root, "stored", "quantized", f)) for f in stored)
        print(f"\nstored file: {size / 2**30:.2f} GiB; the three greedy texts are equal: {len(set(texts)) == 1}")
        rows.append({"stored_gib": size / 2**30, "texts_equal": len(set(texts)) == 1})
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return rows
