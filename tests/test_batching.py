"""Batched decoding: sequences share one running batch, joining and leaving between steps.

Each sequence in a batch must come out exactly as it would served alone, finish on its own,
and free its slot at once when it ends or its client leaves. The tests run per runtime
whose decoder batches, on the decoder directly and through the real app.
"""

from __future__ import annotations

import asyncio
import json

import pytest
from conftest import engine_of, wait_until
from fakes import Gate, GatedBackend

from backends.contract import Sampling, Sequence
from backends.decoding.drive import drive

RUNTIMES = ["mlx", "torch"]

PROMPTS = ["The quick brown", "Once upon", "日本語の", "Hello world", "def f(x):\n", "zq"]
LONG = {"prompt": "Once upon", "max_tokens": 300, "ignore_eos": True}
SEEDED = Sampling(temperature=0.9, top_p=0.9, seed=11)


@pytest.fixture(params=RUNTIMES)
def runtime_backend(request):
    return request.getfixturevalue(f"{request.param}_backend")


def decode(decoder, plan: list[tuple[int, Sequence]]) -> tuple[dict[int, list[int]], list[int]]:
    """Every sequence's ids and the order they finished; plan: (earliest step, sequence) in arrival order."""
    driven = drive(decoder, [s for _, s in plan], arrive_at={s.id: step for step, s in plan})
    return driven.ids, driven.finished


def alone(backend, sequence: Sequence) -> list[int]:
    return decode(backend.decoder(1), [(0, sequence)])[0][sequence.id]


def sequence(backend, seq_id: int, prompt: str, n: int, sampling: Sampling = Sampling()) -> Sequence:
    return Sequence(seq_id, backend.encode(prompt), sampling, n)


# -- the decoder -------------------------------------------------------------------------------


def test_greedy_batch_equals_each_sequence_alone(runtime_backend):
    # Seven prompts of 1 to 12 tokens, with different limits, through four slots: three
    # join as others end.
    prompts = PROMPTS + ["Once"]
    sequences = [sequence(runtime_backend, i, p, 20 + 13 * i) for i, p in enumerate(prompts)]
    decoder = runtime_backend.decoder(4)
    assert decoder.capacity == 4
    batched, finished = decode(decoder, [(0, s) for s in sequences])
    for s in sequences:
        assert batched[s.id] == alone(runtime_backend, s), prompts[s.id]
    assert finished[:4] == [0, 1, 2, 3]  # the first four ran together, shortest first


def test_short_and_long_sequences_finish_independently(runtime_backend):
    long, short = sequence(runtime_backend, 1, "Once upon", 300), sequence(runtime_backend, 2, "The quick brown", 5)
    batched, finished = decode(runtime_backend.decoder(2), [(0, long), (0, short)])
    assert finished == [2, 1]
    assert batched[2] == alone(runtime_backend, short)
    assert batched[1] == alone(runtime_backend, long)


def test_sequences_joining_a_running_batch(runtime_backend):
    first = sequence(runtime_backend, 1, "Once upon", 200)
    joiners = [sequence(runtime_backend, 2, "def f(x):\n", 60), sequence(runtime_backend, 3, "日本語の", 90)]
    batched, _ = decode(runtime_backend.decoder(3), [(0, first), (40, joiners[0]), (41, joiners[1])])
    for s in [first, *joiners]:
        assert batched[s.id] == alone(runtime_backend, s)


def test_seeded_sampling_is_the_same_alone_and_in_a_batch(runtime_backend):
    seeded = sequence(runtime_backend, 1, "Once upon", 120, SEEDED)
    expected = alone(runtime_backend, seeded)
    assert decode(runtime_backend.decoder(4), [(0, seeded)])[0][1] == expected
    traffic = [
        (0, sequence(runtime_backend, 2, "The quick brown", 150)),
        (0, sequence(runtime_backend, 3, "Hello world", 100, Sampling(temperature=1.0))),
        (5, seeded),
        (7, sequence(runtime_backend, 4, "Once upon", 80, Sampling(temperature=0.9, top_p=0.9, seed=12))),
    ]
    batched, _ = decode(runtime_backend.decoder(4), traffic)
    assert batched[1] == expected
    assert batched[4] != expected[:80]  # another seed: other samples


# -- mlx-lm's BatchGenerator specifically --------------------------------------------------


def test_mlx_removed_sequences_leave_the_running_batch(mlx_backend):
    # BatchGenerator's own counters: what it computes per step, not what the decoder reports.
    decoder = mlx_backend.decoder(3)
    for s in [sequence(mlx_backend, i, p, 400) for i, p in enumerate(PROMPTS[:3])]:
        decoder.add(s)
    generator = decoder.generator
    for _ in range(3):  # prefill, then the first tokens
        decoder.step()
    with generator.stats() as stats:
        decoder.step()
    assert stats.generation_tokens == 3
    decoder.remove(1)
    with generator.stats() as stats:
        tokens = decoder.step()
    assert set(tokens) == {0, 2}
    assert stats.generation_tokens == 2
    decoder.add(sequence(mlx_backend, 3, "Hello world", 400))
    decoder.remove(3)  # still waiting for its prefill: it never gets one
    decoder.remove(0)
    with generator.stats() as stats:
        for _ in range(3):
            assert set(decoder.step()) == {2}
    assert stats.generation_tokens == 3 and stats.prompt_tokens == 0
    decoder.remove(2)
    assert decoder.generator is None  # an empty batch frees its generator


def test_mlx_long_prompt_is_prefilled_in_chunks_while_the_batch_decodes(mlx_backend):
    from backends.mlx.runtime import BatchDecoder

    decoder = BatchDecoder(mlx_backend, 2, prefill_step=8)
    running = sequence(mlx_backend, 1, "Once upon", 120)
    joiner = sequence(mlx_backend, 2, " ".join(PROMPTS) * 2, 40)
    assert len(joiner.prompt_ids) > 4 * 8
    decoder.add(running)
    ids, first_step = {1: [], 2: []}, {}
    for step in range(200):
        if step == 10:
            decoder.add(joiner)
        tokens = decoder.step()
        # Step 10: the running sequence, decoding alone with prompt-lookup drafts until then,
        # moves into BatchGenerator, whose pipeline hands its next token over a step later.
        if ids[1] and len(ids[1]) < 120 and step != 10:
            assert 1 in tokens, f"the running sequence stalled at step {step}"
        for seq_id, advanced in tokens.items():
            first_step.setdefault(seq_id, step)
            ids[seq_id] += advanced
            if len(ids[seq_id]) == (120 if seq_id == 1 else 40):
                decoder.remove(seq_id)
    assert first_step[2] > 10 + len(joiner.prompt_ids) // 8  # one 8-token chunk per step
    assert ids[1] == alone(mlx_backend, running)
    assert ids[2] == alone(mlx_backend, joiner)


# -- through the app ---------------------------------------------------------------------------


async def generate(client, body: dict) -> dict:
    response = await client.post("/generate", json=body)
    assert response.status == 200, await response.text()
    return await response.json()


async def concurrently(make_client, backend, bodies: list[dict], max_batch: int) -> tuple[list[dict], int]:
    """Results of concurrent /generate requests, and the most sequences decoded at once.

    Nothing is decoded until every request has reached the server, so the batch is as full as
    MAX_BATCH allows however fast this machine tokenizes and decodes."""
    gate = Gate(after=0)
    client = await make_client(lambda: GatedBackend(backend, gate), max_batch=max_batch)
    engine = engine_of(client)
    tasks = [asyncio.create_task(generate(client, body)) for body in bodies]
    await wait_until(lambda: engine.active + engine.waiting == len(bodies))
    gate.release()
    return await asyncio.gather(*tasks), gate.peak


def comparable(result: dict) -> tuple:
    return result["text"], result["tokens_used"], result["finish_reason"]


async def test_concurrent_requests_get_what_they_get_alone(make_client, runtime_backend):
    # Some end at end-of-text, some at their limit; the first is long, so others join it.
    bodies = [{"prompt": "Once upon", "max_tokens": 300, "ignore_eos": True}]
    bodies += [{"prompt": p, "max_tokens": 10 + 17 * i} for i, p in enumerate(PROMPTS)]
    serial = await make_client(lambda: runtime_backend, max_batch=1)
    expected = [comparable(await generate(serial, body)) for body in bodies]
    results, peak = await concurrently(make_client, runtime_backend, bodies, max_batch=4)
    assert [comparable(r) for r in results] == expected
    assert peak == 4
    assert {r["finish_reason"] for r in results} == {"stop", "length"}


async def test_eight_concurrent_requests_at_max_batch_8(make_client, runtime_backend):
    bodies = [{"prompt": PROMPTS[i % 6], "max_tokens": 40 + 5 * i, "ignore_eos": True} for i in range(8)]
    bodies[3] = {**bodies[3], "temperature": 0.8, "seed": 3}
    serial = await make_client(lambda: runtime_backend, max_batch=1)
    expected = [comparable(await generate(serial, body)) for body in bodies]
    results, peak = await concurrently(make_client, runtime_backend, bodies, max_batch=8)
    assert [comparable(r) for r in results] == expected
    assert peak == 8


def held_long(gate_after: int = 1) -> Gate:
    """Holds the LONG requests after their first token; the others run."""
    return Gate(after=gate_after, held=lambda sequence: sequence.max_new_tokens == LONG["max_tokens"])


async def test_short_request_finishes_while_a_long_one_runs(make_client, runtime_backend):
    gate = held_long()
    client = await make_client(lambda: GatedBackend(runtime_backend, gate), max_batch=2)
    engine = engine_of(client)
    long = await client.post("/generate/stream", json=LONG)
    first = json.loads(await long.content.readline())["token"]
    short = await generate(client, {"prompt": "The quick brown", "max_tokens": 50})
    assert short["text"] == " fox jumps over the lazy dog." and short["finish_reason"] == "stop"
    assert engine.stats.completed == 1 and engine.active == 1  # the long one is still going
    gate.release()
    lines = [json.loads(line) for line in (await long.read()).splitlines()]
    text = first + "".join(line["token"] for line in lines[:-1])
    assert lines[-1]["tokens_used"] == LONG["max_tokens"]
    serial = await make_client(lambda: runtime_backend, max_batch=1)
    assert text == (await generate(serial, LONG))["text"]


async def test_cancelled_stream_frees_its_slot(make_client, runtime_backend):
    gate = held_long()
    client = await make_client(lambda: GatedBackend(runtime_backend, gate), max_batch=2)
    engine = engine_of(client)
    streams = [await client.post("/generate/stream", json=LONG) for _ in range(2)]
    for response in streams:
        assert "token" in json.loads(await response.content.readline())
    assert engine.active == 2
    third = asyncio.create_task(generate(client, {"prompt": "The quick brown", "max_tokens": 50}))
    await wait_until(lambda: engine.waiting == 1)  # both slots are taken
    streams[0].close()  # hang up mid-stream
    result = await third  # admitted into the freed slot while the other stream is still held
    assert result["text"] == " fox jumps over the lazy dog."
    assert engine.stats.cancelled == 1 and engine.stats.completed == 1 and engine.active == 1
    gate.release()
    lines = [json.loads(line) for line in (await streams[1].read()).splitlines()]
    assert lines[-1]["finish_reason"] == "length" and lines[-1]["tokens_used"] == LONG["max_tokens"]
    await wait_until(lambda: engine.active == 0)
    cancelled_tokens = engine.stats.tokens_generated - LONG["max_tokens"] - result["tokens_used"]
    assert cancelled_tokens == 1  # the cancelled stream got its first token, then nothing


async def test_seeded_request_is_the_same_alone_and_in_a_batch(make_client, runtime_backend):
    seeded = {"prompt": "Once upon", "max_tokens": 80, "ignore_eos": True, "temperature": 0.9, "top_p": 0.9, "seed": 11}
    alone_texts = []
    for max_batch in (1, 4):  # the same text whatever MAX_BATCH is
        client = await make_client(lambda: runtime_backend, max_batch=max_batch)
        alone_texts.append((await generate(client, seeded))["text"])
    assert alone_texts[0] == alone_texts[1]
    traffic = [
        {"prompt": "The quick brown", "max_tokens": 200, "ignore_eos": True, "temperature": 1.0},
        {"prompt": "Hello world", "max_tokens": 120, "ignore_eos": True},
        seeded,
        {**seeded, "prompt": "zq", "seed": 12},
    ]
    results, peak = await concurrently(make_client, runtime_backend, traffic, max_batch=4)
    assert results[2]["text"] == alone_texts[0]
    assert peak == 4
