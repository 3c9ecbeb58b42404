"""One answer loop, one Wire per API (phi2_server, "answers"): a whole answer is the fold of the
events its stream sends, on every API, with several choices and logprobs; and the published
request schemas say what the validation enforces (no field beyond an object's properties)."""

from __future__ import annotations

import json

import pytest
from jsonschema import Draft202012Validator
from test_request_log import read_log

from phi2_server import CHAT_SCHEMA, COMPLETIONS_SCHEMA, GENERATE_SCHEMA

PROMPT = "Once upon a time"


def same(a, b) -> bool:
    """Equal, but for float noise in logprobs (a repeated prompt may come from the prompt cache,
    whose prefill batches the numbers differently)."""
    if isinstance(a, float) or isinstance(b, float):
        return a == pytest.approx(b, abs=1e-3)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, list):
        return isinstance(b, list) and len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    return a == b


def sse_events(data: bytes) -> list:
    lines = [line.removeprefix("data: ") for line in data.decode().splitlines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


async def test_native_whole_is_the_fold_of_its_stream(client):
    body = {"prompt": PROMPT, "max_tokens": 12, "logprobs": 2, "ignore_eos": True}
    whole = await (await client.post("/generate", json=body)).json()
    response = await client.post("/generate/stream", json=body)
    lines = [json.loads(line) for line in (await response.read()).decode().splitlines()]
    assert response.headers["Content-Type"].startswith("application/x-ndjson")
    *tokens, done = lines
    assert done["done"] is True
    assert "".join(line["token"] for line in tokens) == whole["text"]
    assert same([e for line in tokens for e in line["logprobs"]], whole["logprobs"])
    facts = ("tokens_used", "prompt_tokens", "finish_reason", "model", "backend", "adapter")
    assert {k: done[k] for k in facts} == {k: whole[k] for k in facts}


async def test_completions_whole_is_the_fold_of_its_stream(client):
    body = {
        "prompt": [PROMPT, "The cat"],
        "max_tokens": 8,
        "n": 2,
        "seed": 3,
        "temperature": 1.0,
        "logprobs": 2,
        "echo": True,
        "ignore_eos": True,
    }
    whole = await (await client.post("/v1/completions", json=body)).json()
    response = await client.post(
        "/v1/completions", json={**body, "stream": True, "stream_options": {"include_usage": True}}
    )
    events = sse_events(await response.read())
    *chunks, last = events
    assert last["choices"] == [] and last["usage"] == whole["usage"]
    assert [c["index"] for c in whole["choices"]] == [0, 1, 2, 3]
    for choice in whole["choices"]:
        mine = [c["choices"][0] for c in chunks if c["choices"][0]["index"] == choice["index"]]
        assert "".join(c["text"] for c in mine) == choice["text"]
        assert mine[-1]["finish_reason"] == choice["finish_reason"] == "length"
        streamed = [c["logprobs"] for c in mine if c["logprobs"]]
        for key in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
            assert same([v for lp in streamed for v in lp[key]], choice["logprobs"][key])
    assert len({c["id"] for c in events}) == 1 and events[0]["object"] == "text_completion"


async def test_chat_whole_is_the_fold_of_its_stream(client):
    body = {
        "messages": [{"role": "user", "content": "Hello there"}],
        "max_tokens": 10,
        "n": 2,
        "seed": 5,
        "logprobs": True,
        "top_logprobs": 2,
        "ignore_eos": True,
    }
    whole = await (await client.post("/v1/chat/completions", json=body)).json()
    assert whole["object"] == "chat.completion"
    response = await client.post("/v1/chat/completions", json={**body, "stream": True})
    chunks = sse_events(await response.read())
    assert {c["object"] for c in chunks} == {"chat.completion.chunk"}
    for choice in whole["choices"]:
        mine = [c["choices"][0] for c in chunks if c["choices"][0]["index"] == choice["index"]]
        assert mine[0]["delta"] == {"role": "assistant", "content": ""}
        assert "".join(c["delta"].get("content", "") for c in mine) == choice["message"]["content"]
        assert mine[-1]["finish_reason"] == choice["finish_reason"]
        streamed = [e for c in mine if c["logprobs"] for e in c["logprobs"]["content"]]
        assert same(streamed, choice["logprobs"]["content"])


SCHEMAS = {"/generate": GENERATE_SCHEMA, "/v1/completions": COMPLETIONS_SCHEMA, "/v1/chat/completions": CHAT_SCHEMA}
BASES = {
    "/generate": {"prompt": "Hi"},
    "/v1/completions": {"prompt": "Hi"},
    "/v1/chat/completions": {"messages": [{"role": "user", "content": "Hi"}]},
}
# (path, a body's extra fields, the same without what is unknown, the paths the log names)
UNKNOWN_FIELDS = [
    *((path, {"unknown_field": 1}, {}, ["unknown_field"]) for path in SCHEMAS),
    *(
        (path, {"stream_options": {"include_usage": True, "surprise": 1}}, {}, ["stream_options.surprise"])
        for path in ("/v1/completions", "/v1/chat/completions")
    ),
    (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "Hi", "surprise": 1}, {"role": "user", "content": "Hi", "x": 2}]},
        {"messages": [{"role": "user", "content": "Hi"}, {"role": "user", "content": "Hi"}]},
        ["messages[].surprise", "messages[].x"],
    ),
    (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": [{"type": "text", "text": "Hi", "x": 1}]}]},
        {"messages": [{"role": "user", "content": [{"type": "text", "text": "Hi"}]}]},
        ["messages[].content[].x"],
    ),
    (
        "/v1/completions",
        {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "surprise": 1}}},
        {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
        ["response_format.json_schema.surprise"],
    ),
    (
        "/v1/chat/completions",
        {"response_format": {"type": "json_object", "surprise": 1}},
        {"response_format": {"type": "json_object"}},
        ["response_format.surprise"],
    ),
]


@pytest.mark.parametrize("path, extra, known, logged", UNKNOWN_FIELDS)
async def test_the_published_schema_takes_what_the_server_takes(client, log_dir, path, extra, known, logged):
    """Each body is valid but for unknown fields, at some depth. The native API refuses them (422
    naming one), and its published schema (the very dict it validates with) rejects them too.
    The OpenAI routes ignore them, as vLLM, llama.cpp and Ollama do (clients add fields every
    month): the answer is the one without them, the request log names what was ignored, and the
    published schema accepts them."""
    schema, base = SCHEMAS[path], {**BASES[path], "max_tokens": 3, "temperature": 0}
    response = await client.post(path, json={**base, **extra})
    if path == "/generate":
        assert response.status == 422
        assert "unknown field" in (await response.json())["error"]["message"]
        assert not Draft202012Validator(schema).is_valid({**base, **extra})
    else:
        assert response.status == 200, await response.text()
        with_extra = await response.json()
        without = await (await client.post(path, json={**base, **known})).json()
        assert with_extra["choices"] == without["choices"]
        assert [line.get("ignored") for line in read_log(log_dir)[-2:]] == [logged, None]
        assert Draft202012Validator(schema).is_valid({**base, **extra})
    assert Draft202012Validator(schema).is_valid(base)
    assert (await client.post(path, json=base)).status == 200
