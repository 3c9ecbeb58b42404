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


async def test_events_that_arrive_while_the_loop_is_busy_go_out_together_in_order():
    """engine.Courier: while a batch is on its way to the event loop, later ones gather and go
    in one delivery after it, in order; a handler takes everything that is ready at once."""
    import threading

    from backends.workers.engine import Courier, Inbox, next_events

    class Ticket:  # what the courier reads of one: its inbox, its index, its taken count
        def __init__(self, inbox):
            self._events, self.index, self._taken = inbox, 0, 0

    loop = asyncio.get_running_loop()
    courier, inbox = Courier(loop), Inbox()
    ticket = Ticket(inbox)
    delivered = []
    original = courier._deliver

    def counted():
        delivered.append(len(courier._gathered))
        original()

    courier._deliver = counted
    handed = threading.Event()

    def worker():  # three flushes while the loop cannot run (it waits on `handed` below)
        for piece in ("a", "b", "c"):
            courier.hand_over([(ticket, piece)])
        handed.set()

    threading.Thread(target=worker).start()
    handed.wait()  # blocks the loop: the courier's first call cannot run yet
    events = await next_events([ticket])
    assert [event for _, event in events] == ["a", "b", "c"]
    assert delivered == [3]  # one delivery carried all three
    courier.hand_over([(ticket, "d")])  # nothing on the way: it goes at once
    assert [event for _, event in await next_events([ticket])] == ["d"]
    assert delivered == [3, 1]
    await asyncio.sleep(0)  # the courier's check after the handlers it woke
    assert not courier._on_the_way
