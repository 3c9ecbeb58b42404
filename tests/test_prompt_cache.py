"""Prompt (prefix) KV reuse across requests, on every served runtime and batch size.

The rule every test checks: greedy output with reuse is exactly the output without it
(PROMPT_CACHE=0), and `cached_tokens` says how many prompt tokens were not prefilled.
"""

from __future__ import annotations

import asyncio
import json

import pytest
from conftest import engine_of, wait_until
from fakes import Gate, GatedBackend, StepGate, StepGatedBackend

from backends.contract import Sampling, Sequence
from backends.torch.prompt_cache import PrefixCache, common_prefix

SYSTEM = "Phi-2 is a Transformer with 2.7 billion parameters trained on synthetic and web data.\n"
STORY = "Once upon a time there was a little model that generated text one token at a time."


async def generate(client, body: dict) -> dict:
    response = await client.post("/generate", json={"max_tokens": 24, **body})
    assert response.status == 200, await response.text()
    return await response.json()


@pytest.fixture
async def cached(make_client, backend):
    return await make_client(lambda: backend)


@pytest.fixture
async def uncached(make_client, backend):
    return await make_client(lambda: backend, prompt_cache=False)


def comparable(result: dict) -> tuple:
    return result["text"], result["tokens_used"], result["finish_reason"]


def expected_reuse(stored: list[int], prompt: list[int]) -> int:
    """What a prompt can reuse of stored ids: their common prefix, leaving one token to prefill."""
    return min(common_prefix(tuple(stored), tuple(prompt)), len(prompt) - 1)


# -- the Torch runtime's store -------------------------------------------------------------------


def store(cache: PrefixCache, ids: list[int]) -> None:
    """KV that spells the ids: every layer and head holds ids[i] at position i."""
    import torch

    def kv(start: int, end: int):
        values = torch.tensor(ids[start:end], dtype=torch.float32).view(1, 1, -1, 1).expand(2, 3, -1, 4).contiguous()
        return values, -values

    cache.store(ids, 8, kv)


def reused(cache: PrefixCache, ids: list[int], limit: int) -> list[int]:
    """The ids whose KV a match gives back, read from the KV itself."""
    n, nodes = cache.match(ids, limit)
    out = [int(x) for node, taken in nodes for x in node.k[0, 0, :taken, 0]]
    assert len(out) == n
    return out


def test_the_store_matches_the_longest_prefix_and_trims_inside_a_node():
    cache = PrefixCache(budget_bytes=1000)
    store(cache, [1, 2, 3, 4, 5, 6])
    store(cache, [1, 2, 9])  # shares [1, 2]: the tree splits there
    assert reused(cache, [1, 2, 3, 4, 7], limit=4) == [1, 2, 3, 4]  # diverges inside a node
    assert reused(cache, [1, 2, 3, 4, 5, 6, 7], limit=6) == [1, 2, 3, 4, 5, 6]
    assert reused(cache, [1, 2, 3, 4, 5, 6], limit=5) == [1, 2, 3, 4, 5]  # the caller leaves one to prefill
    assert reused(cache, [1, 2, 9, 9], limit=3) == [1, 2, 9]
    assert cache.match([8], limit=1) == (0, [])
    # [1, 2] is held once: the split copied [3, 4, 5, 6] out, and the first node still holds
    # (and is charged for) the memory of all six.
    store(cache, [1, 2, 3])  # already held: nothing new
    assert cache.usage().entries == 2 and cache.bytes == 8 * (6 + 4 + 1)
    store(cache, [1, 2, 9, 10, 11])  # extends a leaf: only [10, 11] is copied
    assert cache.usage().entries == 2 and cache.bytes == 8 * (6 + 4 + 1 + 2)
    assert reused(cache, [1, 2, 9, 10, 11, 12], limit=5) == [1, 2, 9, 10, 11]


def test_the_store_never_exceeds_its_budget_and_evicts_the_least_recently_used():
    cache = PrefixCache(budget_bytes=8 * 10)
    store(cache, [1, 1, 1, 1])
    store(cache, [2, 2, 2, 2])
    cache.match([1, 1, 5], limit=2)  # 1s used last
    store(cache, [3, 3, 3, 3])  # 12 ids > 10: the least recently used (2s) leaves
    assert cache.match([2, 2, 2], limit=2)[0] == 0 and cache.match([1, 1, 1], limit=2)[0] == 2
    assert cache.bytes <= cache.budget_bytes
    store(cache, list(range(11)))  # larger than the whole budget: not kept, nothing evicted
    assert cache.usage().entries == 2 and cache.bytes == 8 * 8
    store(cache, [1, 1, 1, 1, 7, 7, 7])  # extending a leaf never evicts the path it extends
    assert cache.bytes <= cache.budget_bytes and reused(cache, [1, 1, 1, 1, 7, 7, 7, 0], limit=7) == [
        1,
        1,
        1,
        1,
        7,
        7,
        7,
    ]
    off = PrefixCache(budget_bytes=0)
    store(off, [1, 2])
    assert off.usage().entries == 0 and off.match([1, 2, 3], limit=2) == (0, [])


class CheckedCache(PrefixCache):
    """A store that checks each eviction against the whole tree: no leaf left in it was used
    before the one that leaves (a parent is used whenever its children are, so the path a store
    extends, used last, never beats it)."""

    evicted: list[object]

    def _forget(self, node) -> None:
        self.evicted.append(node)
        left = [leaf.used for leaf in self._leaves()]
        assert not left or min(left) >= node.used
        super()._forget(node)


def test_eviction_takes_the_least_recently_used_leaf_among_many():
    """Hundreds of entries that share prefixes, matched and stored in a random order under a
    budget a fraction of them fit: every eviction is of the least recently used leaf (without a
    walk of the tree for it), the bytes counted are the nodes' own, and an evicted entry lets go
    of its tensors."""
    import random

    rng = random.Random(3)
    cache = CheckedCache(budget_bytes=8 * 600)
    cache.evicted = []
    prefixes = [[rng.randrange(50) for _ in range(rng.randrange(1, 12))] for _ in range(12)]
    for _ in range(600):
        ids = rng.choice(prefixes) + [rng.randrange(50) for _ in range(rng.randrange(0, 20))]
        if rng.random() < 0.3:
            cache.match(ids, limit=len(ids))
        else:
            store(cache, ids)
        assert cache.bytes <= cache.budget_bytes
        assert cache.bytes == sum(node.nbytes for node in cache._nodes())
        assert len(cache._candidates) <= max(cache._rebuild_at, 4 * sum(1 for _ in cache._leaves())) + 1
    assert len(cache.evicted) > 100
    assert all(node.k is None and node.v is None for node in cache.evicted)


def test_a_cache_that_never_fills_keeps_its_eviction_candidates_bounded():
    """Every match of a leaf queues it as an eviction candidate again; a cache with room to spare
    never evicts, and still keeps that queue within a few entries a leaf (a server answering the
    same prompt all day must not grow)."""
    cache = PrefixCache(budget_bytes=1 << 30)
    for n in range(3):
        store(cache, [n, 1, 2, 3])
    for _ in range(5000):
        assert cache.match([1, 1, 2, 3], limit=4)[0] == 4
    assert cache.usage().entries == 3
    assert len(cache._candidates) <= cache._rebuild_at <= 64


def test_common_prefix():
    assert common_prefix((1, 2, 3), (1, 2, 3)) == 3
    assert common_prefix((1, 2, 3), (1, 2)) == 2
    assert common_prefix((), (1,)) == 0
    for n in range(1, 40):
        assert common_prefix(tuple(range(50)), tuple(range(n)) + (-1,) * 5) == n


# -- through the app, on each runtime and batch size ------------------------------------------


async def test_a_second_identical_request_reuses_all_but_the_last_prompt_token(cached, uncached):
    body = {"prompt": SYSTEM + "Alice: How are you today?\nBob:"}
    first, second = await generate(cached, body), await generate(cached, body)
    reference = await generate(uncached, body)
    assert first["cached_tokens"] == 0 and reference["cached_tokens"] == 0
    assert second["cached_tokens"] == second["prompt_tokens"] - 1
    assert comparable(first) == comparable(second) == comparable(reference)


async def test_a_longer_prompt_extending_a_cached_one(cached, uncached, backend):
    first = await generate(cached, {"prompt": "Once upon a time"})
    longer = {"prompt": "Once upon a time" + first["text"] + " Then"}
    result = await generate(cached, longer)
    stored = backend.encode("Once upon a time") + backend.encode(first["text"])  # prompt + reply, as decoded
    assert result["cached_tokens"] >= len(backend.encode("Once upon a time"))
    assert result["cached_tokens"] <= expected_reuse(stored, backend.encode(longer["prompt"]))
    assert comparable(result) == comparable(await generate(uncached, longer))


async def test_a_chat_next_turn_reuses_the_history(cached, uncached):
    async def chat(client, messages):
        response = await client.post(
            "/v1/chat/completions", json={"messages": messages, "temperature": 0, "max_tokens": 30}
        )
        assert response.status == 200
        return await response.json()

    turn = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "How are you today?"}]
    first = await chat(cached, turn)
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    turn += [first["choices"][0]["message"], {"role": "user", "content": "What is two plus two?"}]
    second, reference = await chat(cached, turn), await chat(uncached, turn)
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] >= first["usage"]["prompt_tokens"]
    assert reference["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert second["choices"][0]["message"] == reference["choices"][0]["message"]


async def test_a_prompt_diverging_inside_a_cached_one_reuses_the_common_part(cached, uncached, backend):
    await generate(cached, {"prompt": SYSTEM + STORY, "max_tokens": 1})
    diverging = {"prompt": SYSTEM + "Water boils at 100 degrees"}
    result = await generate(cached, diverging)
    stored = backend.encode(SYSTEM + STORY)
    assert result["cached_tokens"] == expected_reuse(stored, backend.encode(diverging["prompt"]))
    assert result["cached_tokens"] >= len(backend.encode(SYSTEM)) - 1
    assert comparable(result) == comparable(await generate(uncached, diverging))


async def test_batched_with_unrelated_sequences_the_output_is_unchanged(cached, uncached):
    bodies = [
        {"prompt": SYSTEM + "Alice: How are you today?\nBob:"},
        {"prompt": "The quick brown", "max_tokens": 40, "ignore_eos": True},
        {"prompt": SYSTEM + "Exercise: explain why the sky is blue.\nAnswer:"},
        {"prompt": STORY[:30], "temperature": 0.9, "seed": 3},
        {"prompt": SYSTEM + "Alice: What is two plus two?\nBob:"},
    ]
    for _ in range(2):  # the second round finds every prompt stored
        results = await asyncio.gather(*(generate(cached, body) for body in bodies))
    references = await asyncio.gather(*(generate(uncached, body) for body in bodies))
    assert [comparable(r) for r in results] == [comparable(r) for r in references]
    assert all(r["cached_tokens"] > 0 for r in results)


async def test_concurrent_requests_share_a_system_prompt_once_it_is_stored(make_client, backend, max_batch):
    # The first request is held after its first token: its prefill is complete and stored,
    # and it is still generating when the second arrives (if the batch has room for both).
    batched = max_batch > 1
    gate = Gate(after=1, held=lambda sequence: sequence.id == 1 and batched)
    client = await make_client(lambda: GatedBackend(backend, gate))
    first = asyncio.create_task(generate(client, {"prompt": SYSTEM + "Alice: How are you today?\nBob:"}))
    if batched:
        await wait_until(lambda: gate.holding == 1)
    else:
        await first
    second = await generate(client, {"prompt": SYSTEM + "Alice: What is two plus two?\nBob:"})
    gate.release()
    await first
    assert second["cached_tokens"] >= len(backend.encode(SYSTEM)) - 1


async def test_eviction_under_a_tiny_budget(make_client, backend):
    a, b = {"prompt": STORY[:40]}, {"prompt": SYSTEM[:40]}
    probe = await make_client(lambda: backend)
    usage = engine_of(probe).prompt_cache_usage
    text_a = (await generate(probe, a))["text"]
    await wait_until(lambda: usage().entries == 1)  # stored as the request ends, after its answer
    size_a = usage().bytes
    await generate(probe, b)
    await wait_until(lambda: usage().entries == 2)
    size_b = usage().bytes - size_a
    # The conversation goes on after a's answer: with room for everything, the answer is reused.
    follow = {"prompt": a["prompt"] + text_a + " And then"}
    assert (await generate(probe, follow))["cached_tokens"] > len(backend.encode(a["prompt"]))

    # Room for either a or b with its answer, never for both.
    client = await make_client(lambda: backend, prompt_cache_bytes=max(size_a, size_b) + min(size_a, size_b) // 2)
    engine = engine_of(client)
    budget = engine.prompt_cache_usage().budget_bytes
    assert (await generate(client, a))["text"] == text_a
    assert (await generate(client, b))["cached_tokens"] == 0  # stored: a's answer makes way
    await wait_until(lambda: engine.prompt_cache_usage().bytes > 0)
    assert engine.prompt_cache_usage().bytes <= budget
    assert (await generate(client, follow))["cached_tokens"] <= len(backend.encode(a["prompt"]))  # evicted
    assert 0 < engine.prompt_cache_usage().bytes <= budget  # whatever the worker is storing now
    info = await (await client.get("/model/info")).json()
    assert info["prompt_cache"]["bytes"] <= info["prompt_cache"]["budget_bytes"] == budget


async def test_prompt_cache_off(uncached):
    body = {"prompt": SYSTEM}
    for _ in range(2):
        assert (await generate(uncached, body))["cached_tokens"] == 0
    info = await (await uncached.get("/model/info")).json()
    assert info["prompt_cache"] == {"budget_bytes": 0, "bytes": 0, "entries": 0}


async def test_reuse_is_reported_in_the_stream_usage_and_metrics(cached):
    body = {"prompt": SYSTEM + "Alice:", "max_tokens": 4}
    await generate(cached, body)
    stream = await cached.post("/generate/stream", json=body)
    last = json.loads((await stream.read()).splitlines()[-1])
    assert last["done"] and last["cached_tokens"] == last["prompt_tokens"] - 1
    completion = await (await cached.post("/v1/completions", json={**body, "temperature": 0})).json()
    assert completion["usage"]["prompt_tokens_details"]["cached_tokens"] == last["cached_tokens"]
    await wait_until(lambda: engine_of(cached).prompt_cache_usage().entries >= 1)
    text = await (await cached.get("/metrics")).text()
    metrics = {
        line.split()[0]: float(line.split()[1]) for line in text.splitlines() if line.startswith("phi2_prompt_cache")
    }
    assert metrics["phi2_prompt_cache_hit_tokens_total"] == 2 * last["cached_tokens"]
    assert metrics["phi2_prompt_cache_miss_tokens_total"] == 3 * last["prompt_tokens"] - 2 * last["cached_tokens"]
    assert 0 < metrics["phi2_prompt_cache_bytes"] <= metrics["phi2_prompt_cache_budget_bytes"]
    assert metrics["phi2_prompt_cache_entries"] >= 1


async def test_adapters_never_share_entries_with_the_base_model(make_client, backend, adapted_backends):
    adapted = adapted_backends[backend.info.backend]
    body = {"prompt": SYSTEM + "Alice: How are you today?\nBob:"}
    base = await make_client(lambda: backend)
    await generate(base, body)
    with_adapter = await make_client(lambda: adapted)
    result = await generate(with_adapter, body)
    assert result["cached_tokens"] == 0
    reference = await make_client(lambda: adapted, prompt_cache=False)
    assert comparable(result) == comparable(await generate(reference, body))


# -- a prefill that does not complete keeps what it computed (Torch) -------------------------------


def chunked_decoder(backend, name: str):
    """A batching decoder that prefills at most 4 prompt tokens a step."""
    if name == "torch":
        from backends.torch.decoder import BatchedDecoder

        return BatchedDecoder(backend.decoder_weights, 2, prefill_chunk=4, prompt_cache_bytes=1 << 30)
    from backends.mlx.runtime import BatchDecoder

    return BatchDecoder(backend, 2, prefill_step=4, prompt_cache_bytes=1 << 30)


@pytest.mark.parametrize("name", ["torch", "mlx"])
def test_a_sequence_cancelled_during_its_prefill_keeps_what_it_computed(request, name):
    """Torch keeps the positions a cancelled prefill computed, so a retry resumes there (issue
    68: a client that gave up on an 18.8k-token prompt recomputed all of it at every retry);
    MLX's BatchGenerator gives no cache back mid-prompt, and stores nothing."""
    backend = request.getfixturevalue(f"{name}_backend")
    decoder = chunked_decoder(backend, name)
    prompt = backend.encode(SYSTEM + STORY)
    assert len(prompt) > 12
    decoder.add(Sequence(1, prompt, Sampling(), 8))
    assert decoder.step() == {} and decoder.step() == {}  # 8 of its tokens are in; it is cancelled now
    decoder.remove(1)
    kept = 8 if name == "torch" else 0
    assert decoder.prompt_cache_usage().entries == (1 if kept else 0)
    assert decoder.add(Sequence(2, prompt, Sampling(), 8)) == kept
    decoder.remove(2)


async def test_a_request_cancelled_mid_prefill_leaves_its_pieces_for_the_retry(
    make_client, backend, max_batch, log_dir
):
    """Over HTTP: a long prompt held after its first prefill step (a piece of CPU_ALONE_CHUNK
    tokens) whose client leaves; sent again, it is served from there, and says so; its answer is
    the uncached one."""
    if backend.info.backend != "torch" or max_batch == 1:
        pytest.skip("the batched Torch decoder prefills in pieces (MLX stores nothing mid-prompt)")
    from backends.torch.decoder import CPU_ALONE_CHUNK

    gate = StepGate(steps=1)
    client = await make_client(lambda: StepGatedBackend(backend, gate))
    engine = engine_of(client)
    body = {"prompt": (STORY + " ") * 20, "max_tokens": 8, "ignore_eos": True}
    prompt = backend.encode(body["prompt"])
    assert CPU_ALONE_CHUNK < len(prompt) < 500
    first = asyncio.create_task(client.post("/generate/stream", json=body))
    await wait_until(gate.holding.is_set)
    first.cancel()  # the client leaves mid-prefill
    await asyncio.gather(first, return_exceptions=True)
    await wait_until(lambda: engine.stats.cancelled == 1 and engine.prompt_cache_usage().entries == 1)
    gate.release()
    again = await generate(client, body)
    assert again["cached_tokens"] == CPU_ALONE_CHUNK
    logged = json.loads((log_dir / "requests.log").read_text().splitlines()[-1])  # the request log says it too
    assert (logged["prompt_tokens"], logged["cached_tokens"]) == (len(prompt), CPU_ALONE_CHUNK)
    reference = await make_client(lambda: backend, prompt_cache=False)
    assert comparable(again) == comparable(await generate(reference, body))


@pytest.mark.parametrize("name", ["torch", "mlx"])
def test_a_complete_prefill_is_stored_while_its_sequence_still_decodes(request, name):
    backend = request.getfixturevalue(f"{name}_backend")
    decoder = chunked_decoder(backend, name)
    prompt = backend.encode(SYSTEM + STORY)
    decoder.add(Sequence(1, prompt, Sampling(), 400))
    while not decoder.step():  # prefilled, 4 tokens a step, until its first token
        pass
    assert decoder.add(Sequence(2, prompt + [5], Sampling(), 4)) >= len(prompt) - 1
    decoder.remove(1)
    decoder.remove(2)


@pytest.mark.parametrize("max_batch", [1, 4])
def test_each_decoder_gets_the_budget_it_is_given(backend, max_batch):
    assert backend.decoder(max_batch, prompt_cache_bytes=0).prompt_cache_usage().budget_bytes == 0
    assert backend.decoder(max_batch, prompt_cache_bytes=12345).prompt_cache_usage().budget_bytes == 12345
    default = backend.decoder(max_batch).prompt_cache_usage().budget_bytes
    assert 0 < default <= 2 << 30  # an eighth of this machine's RAM, at most 2 GiB


@pytest.mark.parametrize("max_batch", [1, 4])
def test_mlx_entries_hold_no_more_memory_than_they_count(mlx_backend, max_batch):
    """What MLX's cache holds is what its budget counts: a sequence's cache taken out of a batch
    is lazy, and kept unevaluated it pinned the whole batch's buffers (8x the bytes counted)."""
    import gc

    import mlx.core as mx

    from backends.decoding.drive import drive

    gc.collect()
    baseline = mx.get_active_memory()
    decoder = mlx_backend.decoder(max_batch, prompt_cache_bytes=64 << 20)
    prompts = [mlx_backend.encode(STORY * (1 + i % 5)) for i in range(24)]
    drive(
        decoder, [Sequence(i, prompt, Sampling(temperature=0.8, seed=i), 8 + 3 * i) for i, prompt in enumerate(prompts)]
    )
    gc.collect()
    held = mx.get_active_memory() - baseline
    counted = decoder.prompt_cache_usage().bytes
    assert counted > 0 and held <= counted * 1.25 + (1 << 20), (held, counted)


# -- the prompt cache on disk (PROMPT_CACHE_DIR) ----------------------------------------------------


@pytest.fixture
def disk_options(tiny_path, tmp_path):
    from backends.contract import LoadOptions

    return LoadOptions(model=str(tiny_path), dtype="float32", prompt_cache_dir=str(tmp_path / "kv"), warmup=False)


def disk_prompt(backend) -> list[int]:
    from backends.torch.prompt_disk import MIN_TOKENS

    prompt = backend.encode((STORY + " ") * 20)[: MIN_TOKENS + 40]
    assert len(prompt) == MIN_TOKENS + 40
    return prompt


async def test_the_prompt_cache_on_disk_survives_a_restart(make_client, disk_options):
    """A long prompt is written behind the memory cache; a new server (a new runtime, reading the
    folder afresh) serves it from the file: `cached_tokens` says so, and the answer is the same."""
    from backends.choose import load_backend

    first = load_backend("torch", disk_options)
    body = {"prompt": first.decode(disk_prompt(first)), "max_tokens": 8, "ignore_eos": True}
    client = await make_client(lambda: first, max_batch=4)
    answer = await generate(client, body)
    assert answer["cached_tokens"] == 0
    await wait_until(lambda: first.prompt_disk().written == 1)
    folder = first.prompt_disk().folder
    assert len(list(folder.iterdir())) == 1

    second = load_backend("torch", disk_options)  # the next start
    restarted = await make_client(lambda: second, max_batch=4)
    again = await generate(restarted, body)
    assert again["cached_tokens"] == again["prompt_tokens"] - 1
    assert comparable(again) == comparable(answer)
    assert second.prompt_disk().loaded == 1


@pytest.mark.parametrize("damage", ["corrupt", "truncated", "foreign"])
def test_a_damaged_prompt_cache_file_is_removed_not_served(disk_options, damage, caplog):
    from backends.choose import load_backend
    from backends.decoding.drive import drive

    first = load_backend("torch", disk_options)
    prompt = disk_prompt(first)
    expected = drive(first.decoder(4), [Sequence(1, prompt, Sampling(), 6)]).ids[1]
    first.prompt_disk().flush()
    (path,) = first.prompt_disk().folder.iterdir()
    original = path.read_bytes()
    data = bytearray(original)
    if damage == "corrupt":  # a byte of the keys flipped: the checksum finds it
        data[-100] ^= 0xFF
        path.write_bytes(data)
    elif damage == "truncated":
        path.write_bytes(data[: len(data) // 2])
    else:  # a file that is not one of ours
        path.write_bytes(b"not a prompt cache file at all")
    second = load_backend("torch", disk_options)
    driven = drive(second.decoder(4), [Sequence(2, prompt, Sampling(), 6)])
    assert driven.cached[2] == 0 and driven.ids[2] == expected  # computed again, the same tokens
    assert f"{path} removed" in caplog.text
    second.prompt_disk().flush()
    assert path.read_bytes() == original  # and written again, as the first start wrote it


def test_a_full_disk_is_logged_and_serving_goes_on(disk_options, monkeypatch, caplog):
    import errno

    from backends.choose import load_backend
    from backends.decoding.drive import drive
    from backends.torch import prompt_disk

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(prompt_disk.os, "replace", full)
    backend = load_backend("torch", disk_options)
    prompt = disk_prompt(backend)
    decoder = backend.decoder(4)
    first = drive(decoder, [Sequence(1, prompt, Sampling(), 6)]).ids[1]
    backend.prompt_disk().flush()
    assert "No space left" in caplog.text and list(backend.prompt_disk().folder.iterdir()) == []
    again = drive(decoder, [Sequence(2, prompt, Sampling(), 6)])  # the memory cache still serves it
    assert again.cached[2] == len(prompt) - 1 and again.ids[2] == first


async def test_warm_prompts_are_in_the_prompt_cache_when_clients_come(make_client, backend, tmp_path, caplog):
    """WARM_PROMPTS' files, sent as the server sends them once loaded: a captured chat request
    and a raw prompt are then served from the cache; a missing file is logged, not fatal."""
    from phi2_server import warm_prompts

    client = await make_client(lambda: backend)
    chat = {"model": "another-servers-name", "messages": [{"role": "user", "content": SYSTEM}], "max_tokens": 40}
    captured = tmp_path / "first.json"
    captured.write_text(json.dumps({"method": "POST", "path": "/v1/chat/completions?beta=true", "body": chat}))
    raw = tmp_path / "raw.txt"
    raw.write_text(SYSTEM + STORY)

    async def post(route: str, body: dict) -> tuple[int, dict]:
        response = await client.post(route, json=body)
        return response.status, await response.json()

    await warm_prompts(f"{captured}, {tmp_path / 'missing.txt'},{raw}", post, "microsoft/phi-2")
    assert "missing.txt not sent" in caplog.text
    engine = engine_of(client)
    await wait_until(lambda: engine.prompt_cache_usage().entries >= 2)
    chat["model"] = "microsoft/phi-2"  # PHI2_MODEL's default: the name the app serves
    answer = await (await client.post("/v1/chat/completions", json={**chat, "temperature": 0})).json()
    assert answer["usage"]["prompt_tokens_details"]["cached_tokens"] == answer["usage"]["prompt_tokens"] - 1
    prompt = len(backend.encode(SYSTEM + STORY))
    assert (await generate(client, {"prompt": SYSTEM + STORY + " The end"}))["cached_tokens"] >= prompt - 1


def test_a_prompt_and_its_reply_are_one_file_however_slow_the_writer(disk_options, monkeypatch):
    """The prompt is queued when its prefill completes and again with its reply as it ends; the
    second continues the first even while the first is still being written (its positions are
    not written twice), and a short reply adds no file."""
    import threading

    from backends.choose import load_backend
    from backends.decoding.drive import drive
    from backends.torch.prompt_disk import PromptDisk

    backend = load_backend("torch", disk_options)
    gate, original = threading.Event(), PromptDisk._write

    def held(self, entry, kv):
        gate.wait(60)  # the writer is behind: the reply's store comes first
        return original(self, entry, kv)

    monkeypatch.setattr(PromptDisk, "_write", held)
    prompt = disk_prompt(backend)
    drive(backend.decoder(4), [Sequence(1, prompt, Sampling(), 6)])
    gate.set()
    disk = backend.prompt_disk()
    disk.flush()
    assert disk.written == 1 and len(list(disk.folder.iterdir())) == 1
