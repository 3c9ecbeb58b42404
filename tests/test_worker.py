"""The generation worker: queueing, and no generation for a client that has gone."""

from __future__ import annotations

import asyncio
import json

from conftest import engine_of, wait_idle, wait_until
from fakes import Gate, GatedBackend

LONG = {"prompt": "Once upon", "max_tokens": 300, "ignore_eos": True}


async def test_ignore_eos_forces_the_token_count(client):
    response = await client.post("/generate", json={"prompt": "The quick brown", "max_tokens": 40, "ignore_eos": True})
    result = await response.json()
    assert result["tokens_used"] == 40
    assert result["finish_reason"] == "length"
    assert result["text"].startswith(" fox jumps over the lazy dog.")
    assert "<|endoftext|>" not in result["text"]


async def test_stream_disconnect_stops_generation(make_client, backend):
    client = await make_client(lambda: GatedBackend(backend, Gate(after=1)))
    engine = engine_of(client)
    response = await client.post("/generate/stream", json=LONG)
    first = json.loads(await response.content.readline())
    assert "token" in first
    response.close()  # hang up mid-stream: the gate holds the stream until the worker sees it
    await wait_idle(engine)
    assert engine.stats.cancelled == 1
    assert engine.stats.tokens_generated == 1


async def test_non_streaming_disconnect_stops_generation(make_client, backend):
    gate = Gate(after=1)
    client = await make_client(lambda: GatedBackend(backend, gate))
    engine = engine_of(client)
    task = asyncio.create_task(client.post("/generate", json=LONG))
    await wait_until(lambda: gate.holding == 1)  # generating, and held there
    task.cancel()  # the client gives up: its connection closes
    await asyncio.gather(task, return_exceptions=True)
    await wait_idle(engine)
    assert engine.stats.cancelled == 1
    assert engine.stats.tokens_generated == 1
    gate.release()
    ok = await client.post("/generate", json={"prompt": "The quick brown", "max_tokens": 3})
    assert ok.status == 200


async def test_requests_queue_in_arrival_order(make_client, backend):
    # Every slot busy with a held stream, four requests queued in order, then one slot freed:
    # the queued requests pass through that one slot, so they finish in arrival order.
    gate = Gate(after=1, held=lambda sequence: sequence.max_new_tokens == LONG["max_tokens"])
    client = await make_client(lambda: GatedBackend(backend, gate))
    engine = engine_of(client)
    running = [await client.post("/generate/stream", json=LONG) for _ in range(engine.max_batch)]
    finished = []

    async def one(i):
        response = await client.post(
            "/generate", json={"prompt": "The quick brown", "max_tokens": 5, "ignore_eos": True}
        )
        assert response.status == 200
        finished.append(i)

    tasks = []
    for i in range(4):
        tasks.append(asyncio.create_task(one(i)))
        await wait_until(lambda: engine.waiting == i + 1)  # submitted in order
    running[0].close()
    await asyncio.gather(*tasks)
    assert finished == [0, 1, 2, 3]
    for response in running[1:]:
        response.close()
    await wait_idle(engine)
