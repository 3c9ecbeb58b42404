"""Load, disconnects, overload, timeouts, failures mid-stream, and bad input of every kind."""

from __future__ import annotations

import asyncio
import json
import threading
import time

from conftest import FailingBackend, engine_of, wait_idle, wait_until
from test_request_log import read_log

LONG = {"prompt": "Once upon", "max_tokens": 400, "ignore_eos": True}


def parse_stream(raw: bytes) -> list[dict]:
    assert raw.endswith(b"\n")
    return [json.loads(line) for line in raw.decode("utf-8").splitlines()]


def worker_threads() -> set[str]:
    return {t.name for t in threading.enumerate()}


async def test_32_concurrent_streams_complete_while_health_stays_fast(client):
    engine = engine_of(client)

    async def one(i):
        body = {"prompt": "The quick brown", "max_tokens": 30, "ignore_eos": True, "temperature": 0.8, "seed": i}
        response = await client.post("/generate/stream", json=body)
        assert response.status == 200
        lines = parse_stream(await response.read())
        assert all(set(line) == {"token"} for line in lines[:-1])
        assert lines[-1]["done"] is True and lines[-1]["tokens_used"] == 30
        return lines

    tasks = [asyncio.create_task(one(i)) for i in range(32)]
    latencies, queue_seen = [], 0
    while not all(t.done() for t in tasks):
        started = time.perf_counter()
        health = await client.get("/health")
        latencies.append(time.perf_counter() - started)
        queue_seen = max(queue_seen, (await health.json())["queue"]["waiting"])
        await asyncio.sleep(0.01)
    results = await asyncio.gather(*tasks)
    assert len(results) == 32
    assert queue_seen > 0  # the clients really were concurrent
    assert max(latencies) < 1.0  # generous: the distribution goes in BENCHMARKS.md
    assert engine.stats["completed"] == 32


async def test_disconnect_storm_leaves_the_worker_idle_and_leaks_nothing(client):
    engine = engine_of(client)
    await client.post("/generate", json={"prompt": "warm up", "max_tokens": 1})
    threads_before = worker_threads()
    tasks_before = len(asyncio.all_tasks())

    async def drop_after_first_token():
        response = await client.post("/generate/stream", json=LONG)
        line = json.loads(await response.content.readline())
        assert "token" in line
        response.close()

    await asyncio.gather(*(drop_after_first_token() for _ in range(12)))
    await wait_idle(engine)
    assert engine.stats["cancelled"] == 12
    assert engine.stats["tokens_generated"] < 12 * 40  # each stopped within a few tokens
    await asyncio.sleep(0.1)
    # Only the app's bounded tokenizer pool may have grown (to its 2 threads).
    assert all(name.startswith("tokenizer_") for name in worker_threads() - threads_before)
    assert sum(name.startswith("tokenizer_") for name in worker_threads()) <= 2
    assert len(asyncio.all_tasks()) <= tasks_before
    started = time.perf_counter()
    response = await client.post("/generate", json={"prompt": "The quick brown", "max_tokens": 50})
    assert (await response.json())["text"] == " fox jumps over the lazy dog."
    assert time.perf_counter() - started < 5


async def test_a_queued_request_whose_client_leaves_leaves_the_queue(client):
    engine = engine_of(client)
    running = [await client.post("/generate/stream", json=LONG) for _ in range(engine.max_batch)]
    for response in running:  # every decoder slot is busy
        await response.content.readline()
    queued = asyncio.create_task(client.post("/generate", json=LONG))
    await wait_until(lambda: engine.waiting == 1)
    queued.cancel()
    await asyncio.gather(queued, return_exceptions=True)
    await wait_until(lambda: engine.waiting == 0)
    assert engine.active == engine.max_batch  # the running streams go on
    assert engine.stats["cancelled"] == 1
    for response in running:
        response.close()
    await wait_until(lambda: engine.active == 0)


async def test_overload_gets_503_with_retry_after_at_once(make_client, backend):
    client = await make_client(lambda: backend, max_queue=2)
    engine = engine_of(client)
    running = [await client.post("/generate/stream", json=LONG) for _ in range(engine.max_batch)]
    for response in running:  # every decoder slot is busy
        await response.content.readline()
    body = {"prompt": "Once upon", "max_tokens": 20, "ignore_eos": True}
    admitted = [asyncio.create_task(client.post("/generate", json=body)) for _ in range(2)]
    await wait_until(lambda: engine.waiting == 2)
    started = time.perf_counter()
    rejected = await asyncio.gather(*(client.post("/generate", json=body) for _ in range(5)))
    assert time.perf_counter() - started < 2
    for response in rejected:
        assert response.status == 503
        assert int(response.headers["Retry-After"]) > 0
        assert "busy" in (await response.json())["error"]["message"]
    for response in running:
        response.close()
    for response in await asyncio.gather(*admitted):
        assert response.status == 200
        assert (await response.json())["tokens_used"] == 20


async def test_request_timeout_ends_streams_and_answers_504(make_client, backend):
    client = await make_client(lambda: backend, request_timeout=0.3)
    response = await client.post("/generate/stream", json=LONG)
    lines = parse_stream(await response.read())
    assert lines[-1]["done"] is True
    assert lines[-1]["finish_reason"] == "timeout"
    assert 0 < lines[-1]["tokens_used"] < 400
    response = await client.post("/generate", json=LONG)
    assert response.status == 504
    assert (await response.json())["error"]["type"] == "timeout"
    ok = await client.post("/generate", json={"prompt": "The quick brown", "max_tokens": 3})
    assert ok.status == 200


async def test_error_after_the_stream_began_ends_it_with_an_error_line(make_client, backend):
    client = await make_client(lambda: FailingBackend(backend, after=5))
    response = await client.post("/generate/stream", json=LONG)
    assert response.status == 200
    lines = parse_stream(await response.read())
    assert len(lines) > 1 and "token" in lines[0]
    assert lines[-1]["done"] is True
    assert lines[-1]["finish_reason"] == "error"
    assert "simulated device failure" in lines[-1]["error"]["message"]
    response = await client.post("/generate", json=LONG)
    assert response.status == 500
    assert (await response.json())["error"]["type"] == "server_error"
    # A fresh decoder serves the next request (within its 5 steps: a batch's first token
    # comes on its third step).
    ok = await client.post("/generate", json={"prompt": "The quick brown", "max_tokens": 2})
    assert ok.status == 200
    assert (await client.get("/health")).status == 200


async def test_limits_at_their_edges(make_client, backend):
    client = await make_client(lambda: backend, max_body_bytes=2000, max_tokens_limit=50)
    body = {"prompt": "x", "max_tokens": 1}
    padding = 2000 - len(json.dumps({**body, "prompt": ""}))
    exact = json.dumps({**body, "prompt": "x" * padding}).encode()
    assert len(exact) == 2000
    response = await client.post("/generate", data=exact)
    assert response.status in (200, 422)  # fits the body limit (the prompt may not fit the context)
    assert (await client.post("/generate", data=exact[:-2] + b'x"}')).status == 413
    assert (await client.post("/generate", json={**body, "max_tokens": 50})).status == 200
    response = await client.post("/generate", json={**body, "max_tokens": 51})
    assert response.status == 422
    assert "MAX_TOKENS_LIMIT" in (await response.json())["error"]["message"]
    assert (await client.post("/generate", json={**body, "stop": ["a", "b", "c", "d"]})).status == 200
    assert (await client.post("/generate", json={**body, "stop": ["a", "b", "c", "d", "e"]})).status == 422
    assert (await client.post("/generate", json={**body, "stop": "s" * 256})).status == 200
    assert (await client.post("/generate", json={**body, "stop": "s" * 257})).status == 422


async def test_one_log_line_per_request_under_load_with_rotation(make_client, backend, log_dir):
    client = await make_client(lambda: backend, max_queue=3, log_max_bytes=400, log_backups=200)
    engine = engine_of(client)
    body = {"prompt": "Once upon", "max_tokens": 20, "ignore_eos": True}

    async def complete():
        return (await client.post("/generate", json=body)).status

    async def drop():
        response = await client.post("/generate/stream", json=LONG)
        await response.content.readline()
        response.close()

    statuses = await asyncio.gather(*(complete() for _ in range(10)), return_exceptions=True)
    await drop()
    await client.post("/generate", json={"prompt": 3})
    await client.get("/health")
    await wait_idle(engine)
    await asyncio.sleep(0.05)
    lines = read_log(log_dir)
    assert len(list(log_dir.glob("requests.log.*"))) >= 2  # it rotated
    assert len(lines) == 13
    status_counts = {s: sum(1 for line in lines if line["status"] == s) for s in (200, 503, 499, 422)}
    assert status_counts[200] == statuses.count(200) + 1  # + /health
    assert status_counts[503] == statuses.count(503) > 0  # the queue overflowed
    assert status_counts[499] == 1
    assert status_counts[422] == 1
