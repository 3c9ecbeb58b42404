"""The KV budget under a full-context prompt: a spawned server with its default settings (set
PHI2_DTYPE=float32 for what `auto` picks on an AVX2 CPU) gets one prompt at the full context and,
while it is prefilled, 4 short clients. Reported: whether every request was answered, the long
request's time, the short ones' time to their first text (streamed) and to their last token, the
server's peak resident memory (VmHWM) against the weights, the KV budget and the prompt cache's
budget, and the KV cache's own peak from /model/info."""

from __future__ import annotations

import asyncio
import os
import random
import time

import aiohttp


async def complete(session, url: str, prompt, tokens: int) -> tuple[int, float, float]:
    """(status, seconds to the last byte, seconds to the first streamed text)."""
    started = time.perf_counter()
    body = {"prompt": prompt, "max_tokens": tokens, "ignore_eos": True, "temperature": 0, "stream": True}
    first = None
    async with session.post(url + "/v1/completions", json=body) as response:
        async for line in response.content:
            if first is None and line.startswith(b"data: {"):
                first = time.perf_counter() - started
        return response.status, time.perf_counter() - started, first if first is not None else float("nan")


async def workload(url: str, short_tokens: int) -> dict:
    timeout = aiohttp.ClientTimeout(total=3600)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        async with session.get(url + "/model/info") as response:
            info = await response.json()
        context = info["context_length"]
        words = random.Random(0).choices("alpha beta gamma delta river stone light cloud seven".split(), k=context)
        async with session.post(url + "/tokenize", json={"prompt": " ".join(words)}) as response:
            long_prompt = (await response.json())["tokens"][: context - 16]
        long = asyncio.create_task(complete(session, url, long_prompt, 8))
        await asyncio.sleep(1.0)  # the long prompt is being prefilled
        short = await asyncio.gather(
            *(complete(session, url, f"Client {i} says hello and", short_tokens) for i in range(4))
        )
        long_status, long_s, _ = await long
        async with session.get(url + "/model/info") as response:
            after = await response.json()
    return {"info": info, "after": after, "long": (long_status, long_s), "short": short, "context": context}


def kv_budget(args) -> list[dict]:
    from bench import SpawnedServer

    os.environ.setdefault("PHI2_MODEL", "random:phi-2")
    server = SpawnedServer(args.ready_timeout)
    try:
        got = asyncio.run(workload(server.url, args.max_tokens))
        peak = server.peak_rss_gib()
    finally:
        server.stop()
    info, kv = got["info"], got["after"]["kv_cache"]
    gib = 2**30
    weights, budget = info["weight_bytes"] / gib, kv["budget_bytes"] / gib
    prompt_cache = info["prompt_cache"]["budget_bytes"] / gib
    statuses = [got["long"][0]] + [status for status, _, _ in got["short"]]
    row = {
        "model": os.environ["PHI2_MODEL"],
        "dtype": info["dtype"],
        "context": got["context"],
        "statuses": statuses,
        "long_s": round(got["long"][1], 1),
        "short_s": [round(s, 1) for _, s, _ in got["short"]],
        "short_ttft_s": [round(t, 1) for _, _, t in got["short"]],
        "peak_rss_gib": peak,
        "weights_gib": round(weights, 2),
        "kv_budget_gib": round(budget, 2),
        "kv_peak_gib": round(kv["peak_bytes"] / gib, 2),
        "prompt_cache_budget_gib": round(prompt_cache, 2),
    }
    print(
        f"| {row['model']} {row['dtype']}, context {row['context']} | {statuses} | {row['long_s']} s | "
        f"{max(row['short_ttft_s'])} s | {max(row['short_s'])} s | "
        f"{peak:.2f} GiB | {weights:.2f} + {budget:.2f} + {prompt_cache:.2f} GiB | "
        f"{row['kv_peak_gib']} GiB |",
        flush=True,
    )
    return [row]
