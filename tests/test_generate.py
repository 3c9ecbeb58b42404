"""/generate and /generate/stream on the real tiny model: text, counts, stops, framing."""

from __future__ import annotations

import json

import pytest

# The tiny model has memorized its corpus (backends/torch/tiny.py), so these continuations are known.
FOX = "The quick brown"
FOX_TEXT = " fox jumps over the lazy dog."
JAPANESE = "日本語の"
JAPANESE_TEXT = "テキストも少し含めます。東京は日本の首都です。"


async def generate(client, **body):
    response = await client.post("/generate", json=body)
    assert response.status == 200, await response.text()
    return await response.json()


async def stream(client, **body):
    """(token texts, final line, response) of one streamed request."""
    response = await client.post("/generate/stream", json=body)
    assert response.status == 200, await response.text()
    raw = await response.read()
    lines = [json.loads(line) for line in raw.decode("utf-8").splitlines()]
    assert raw.endswith(b"\n")
    tokens = [line["token"] for line in lines[:-1]]
    assert all(set(line) == {"token"} for line in lines[:-1])
    return tokens, lines[-1], response


async def test_generate_finishes_at_end_of_text(client, backend, reference):
    result = await generate(client, prompt=FOX, max_tokens=50)
    ids = reference(FOX, 50)
    eos = reference.tokenizer.eos_token_id
    assert ids[-1] == eos
    assert result["text"] == FOX_TEXT == reference.tokenizer.decode(ids[:-1])
    assert result["finish_reason"] == "stop"
    assert result["tokens_used"] == len(ids)  # the end-of-text token counts: it was generated
    assert result["prompt_tokens"] == len(backend.encode(FOX))
    assert result["model"] == backend.info.model
    assert result["backend"] == backend.info.backend
    assert set(result["timings"]) == {"ttft_ms", "total_ms", "tokens_per_second"}
    assert 0 < result["timings"]["ttft_ms"] <= result["timings"]["total_ms"]


async def test_generate_counts_exact_token_ids_at_length(client, reference):
    result = await generate(client, prompt="Once upon", max_tokens=5)
    ids = reference("Once upon", 5)
    assert result["finish_reason"] == "length"
    assert result["tokens_used"] == 5
    assert result["text"] == reference.tokenizer.decode(ids)


async def test_default_max_tokens_is_128(client):
    result = await generate(client, prompt="zzzz qqqq")
    assert result["tokens_used"] <= 128
    if result["finish_reason"] == "length":
        assert result["tokens_used"] == 128


@pytest.mark.parametrize(
    "stop, text",
    [
        (" little", " a time there was a"),
        ([" model", " little"], " a time there was a"),
        ("re wa", " a time the"),  # spans the tokens " there" and " was"
        ("no such text", None),
    ],
)
async def test_stop_sequences_end_generation_and_are_not_returned(client, stop, text):
    full = await generate(client, prompt="Once upon", max_tokens=40)
    result = await generate(client, prompt="Once upon", max_tokens=40, stop=stop)
    if text is None:
        same = ("timings", "request_id", "cached_tokens")  # the second finds its prompt cached
        assert result == {**full, **{key: result[key] for key in same}}
        return
    assert result["text"] == text
    assert result["finish_reason"] == "stop"
    assert full["text"].startswith(text)
    streamed, done, _ = await stream(client, prompt="Once upon", max_tokens=40, stop=stop)
    assert "".join(streamed) == text
    assert done["finish_reason"] == "stop"
    assert done["tokens_used"] == result["tokens_used"]


async def test_stream_framing_and_equality_with_generate(client):
    body = {"prompt": FOX, "max_tokens": 50}
    tokens, done, response = await stream(client, **body)
    assert response.headers["Content-Type"].startswith("application/x-ndjson")
    assert response.headers.get("Transfer-Encoding") == "chunked"
    result = await generate(client, **body)
    assert "".join(tokens) == result["text"]
    assert done["done"] is True
    differ = ("timings", "request_id", "cached_tokens")  # the second request finds its prompt cached
    assert {k: v for k, v in done.items() if k not in ("done", *differ)} == {
        k: v for k, v in result.items() if k not in ("text", *differ)
    }
    assert done["cached_tokens"] == 0 and result["cached_tokens"] == result["prompt_tokens"] - 1
    assert len(tokens) > 1


async def test_stream_holds_back_split_characters(client, backend):
    # Every Japanese character spans several byte-level tokens of the tiny tokenizer.
    assert len(backend.encode(JAPANESE_TEXT)) > len(JAPANESE_TEXT)
    tokens, done, _ = await stream(client, prompt=JAPANESE, max_tokens=120)
    assert done["finish_reason"] == "stop"
    assert "".join(tokens) == JAPANESE_TEXT
    assert all("\ufffd" not in token for token in tokens)
    assert len(tokens) < done["tokens_used"]  # fewer lines than tokens, never half a character
    result = await generate(client, prompt=JAPANESE, max_tokens=120)
    assert result["text"] == JAPANESE_TEXT


async def test_text_cut_inside_a_character_is_decoded_like_decode(client, reference):
    # Stopping mid-character returns what decoding those ids gives (a U+FFFD at the end),
    # the same on the stream and without it.
    ids = reference(JAPANESE, 4)
    expected = reference.tokenizer.decode(ids)
    result = await generate(client, prompt=JAPANESE, max_tokens=4)
    tokens, _, _ = await stream(client, prompt=JAPANESE, max_tokens=4)
    assert result["text"] == "".join(tokens) == expected


async def test_seed_makes_sampling_reproducible(client):
    body = {"prompt": "Hello world", "max_tokens": 12, "temperature": 5.0}
    first = await generate(client, **body, seed=7)
    again = await generate(client, **body, seed=7)
    assert first["text"] == again["text"]
    texts = {(await generate(client, **body, seed=seed))["text"] for seed in range(6)}
    assert len(texts) > 1
    streamed, _, _ = await stream(client, **body, seed=7)
    assert "".join(streamed) == first["text"]


async def test_tiny_top_p_keeps_only_the_most_likely_token(client):
    greedy = await generate(client, prompt="Once upon", max_tokens=10)
    nucleus = await generate(client, prompt="Once upon", max_tokens=10, temperature=1.0, top_p=1e-6)
    assert nucleus["text"] == greedy["text"]
