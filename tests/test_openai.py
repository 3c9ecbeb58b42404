"""The OpenAI-compatible routes, driven by the official OpenAI Python client and by raw HTTP."""

from __future__ import annotations

import json

import openai
import pytest
from conftest import engine_of, wait_idle
from fakes import Gate, GatedBackend

from backends.chat.plan import ChatRequest


@pytest.fixture
def server(live_server, backend):
    return live_server(lambda: backend)


@pytest.fixture
def sdk(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def server_model(server):
    from phi2_server import SETTINGS

    return server.app[SETTINGS].model


def native(server, **body):
    import urllib.request

    request = urllib.request.Request(
        server.url + "/generate", data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request) as response:
        return json.loads(response.read())


def test_models_lists_the_loaded_model(sdk, server):
    models = sdk.models.list().data
    assert [m.id for m in models] == [server_model(server)]
    assert models[0].object == "model"


def test_completion_matches_the_native_endpoint(sdk, server):
    completion = sdk.completions.create(
        model=server_model(server), prompt="The quick brown", max_tokens=32, temperature=0
    )
    reference = native(server, prompt="The quick brown", max_tokens=32)
    assert completion.object == "text_completion"
    assert completion.choices[0].text == reference["text"] == " fox jumps over the lazy dog."
    assert completion.choices[0].finish_reason == "stop"
    assert completion.usage.prompt_tokens == reference["prompt_tokens"]
    assert completion.usage.completion_tokens == reference["tokens_used"]
    assert completion.usage.total_tokens == reference["prompt_tokens"] + reference["tokens_used"]


def test_completion_defaults_follow_openai(sdk):
    # No model named is fine; max_tokens defaults to 16 as in OpenAI's API.
    completion = sdk.completions.create(model=openai.NOT_GIVEN, prompt="Once upon", temperature=0)
    assert completion.usage.completion_tokens == 16
    assert completion.choices[0].finish_reason == "length"


def prompt_leaving_little_room(backend) -> str:
    """A prompt after which fewer than 16 tokens (OpenAI's default max_tokens) fit the context."""
    context, words = backend.info.context_length, 1
    while context - len(backend.encode(" zq" * words)) >= 16:
        words += 1
    return " zq" * words


def test_default_max_tokens_is_clipped_to_the_room_left(sdk, backend):
    # Without max_tokens, OpenAI's default of 16 fits itself to the context, as /generate does.
    prompt = prompt_leaving_little_room(backend)
    assert 0 < backend.info.context_length - len(backend.encode(prompt)) < 16
    completion = sdk.completions.create(model=openai.NOT_GIVEN, prompt=prompt, temperature=0)
    assert completion.usage.prompt_tokens + completion.usage.completion_tokens <= backend.info.context_length
    # Asked for explicitly, it is clipped too on /v1 (test_max_tokens_past_the_context_is_clipped_on_v1).
    asked = sdk.completions.with_raw_response.create(model=openai.NOT_GIVEN, prompt=prompt, max_tokens=16)
    assert int(asked.headers["X-Max-Tokens-Granted"]) == backend.info.context_length - len(backend.encode(prompt))


def test_streamed_completion_equals_the_whole_one(sdk):
    kwargs = dict(model=openai.NOT_GIVEN, prompt="Once upon", max_tokens=40, temperature=0, stop=[" model"])
    whole = sdk.completions.create(**kwargs)
    chunks = list(sdk.completions.create(**kwargs, stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == whole.choices[0].text == " a time there was a little"
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
    assert chunks[-1].choices == []
    usage = chunks[-1].usage
    assert (usage.prompt_tokens, usage.completion_tokens, usage.total_tokens) == (
        whole.usage.prompt_tokens,
        whole.usage.completion_tokens,
        whole.usage.total_tokens,
    )
    assert usage.prompt_tokens_details.cached_tokens == usage.prompt_tokens - 1  # the second request


def test_chat_completion_uses_phi2_chat_format(sdk, server, backend):
    messages = [{"role": "user", "content": "How are you today?"}]
    chat = sdk.chat.completions.create(model=server_model(server), messages=messages, temperature=0)
    assert chat.object == "chat.completion"
    assert chat.choices[0].message.role == "assistant"
    assert chat.choices[0].message.content == "I am fine, thank you. And you?"
    assert chat.choices[0].finish_reason == "stop"
    plan = backend.chat_plan(ChatRequest(messages))
    assert plan.prompt == "Alice: How are you today?\nBob:"
    reference = native(server, prompt=plan.prompt, stop=list(plan.stop))
    assert chat.usage.prompt_tokens == reference["prompt_tokens"]
    assert chat.usage.completion_tokens == reference["tokens_used"]


def test_chat_stops_before_the_model_writes_the_next_user_turn(sdk):
    chat = sdk.chat.completions.create(
        model=openai.NOT_GIVEN, messages=[{"role": "user", "content": "What is two plus two?"}], temperature=0
    )
    assert chat.choices[0].message.content == "Four."
    assert chat.choices[0].finish_reason == "stop"


def test_streamed_chat_equals_the_whole_one(sdk):
    messages = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": [{"type": "text", "text": "How are you today?"}]},
    ]
    whole = sdk.chat.completions.create(model=openai.NOT_GIVEN, messages=messages, temperature=0, max_tokens=20)
    chunks = list(
        sdk.chat.completions.create(
            model=openai.NOT_GIVEN, messages=messages, temperature=0, max_tokens=20, stream=True
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == whole.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == whole.choices[0].finish_reason


def test_sampling_with_a_seed_is_reproducible(sdk):
    kwargs = dict(model=openai.NOT_GIVEN, prompt="Hello world", max_tokens=10, temperature=1.5, seed=11)
    assert sdk.completions.create(**kwargs).choices[0].text == sdk.completions.create(**kwargs).choices[0].text


@pytest.mark.parametrize(
    "kwargs, param",
    [
        ({"temperature": 3}, "temperature"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"n": 17}, "n"),
        ({"top_logprobs": 3}, "top_logprobs"),
        ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ({"extra_body": {"audio": {"voice": "alloy", "format": "wav"}}}, "audio"),
        ({"extra_body": {"modalities": ["text", "audio"]}}, "modalities"),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": 5}}}},
            "response_format.json_schema.schema",
        ),
        ({"extra_body": {"tools": [{"type": "web_search"}]}}, "tools[0].type"),
        ({"messages": []}, "messages"),
        ({"messages": [{"role": "tool", "content": "x"}]}, "messages[0].tool_call_id"),
        ({"messages": [{"role": "critic", "content": "x"}]}, "messages[0].role"),
    ],
)
def test_bad_requests_raise_bad_request_error(sdk, kwargs, param):
    kwargs = {"model": openai.NOT_GIVEN, "messages": [{"role": "user", "content": "hi"}], **kwargs}
    with pytest.raises(openai.BadRequestError) as raised:
        sdk.chat.completions.create(**kwargs)
    error = raised.value.body
    assert error["param"] == param
    assert error["type"] == "invalid_request_error"
    assert set(error) == {"message", "type", "param", "code"}


def test_harmless_parameters_are_accepted(sdk):
    completion = sdk.completions.create(
        model=openai.NOT_GIVEN, prompt="Hi", max_tokens=2, user="someone", n=1, presence_penalty=0
    )
    assert completion.usage.completion_tokens <= 2
    # A field this server has never heard of is ignored, as OpenAI's clients add fields monthly.
    chat = dict(model=openai.NOT_GIVEN, messages=[{"role": "user", "content": "hi"}], max_tokens=4, temperature=0)
    answer = sdk.chat.completions.create(**chat).choices[0].message.content
    assert sdk.chat.completions.create(**chat, extra_body={"wat": 1}).choices[0].message.content == answer


def test_unknown_model_raises_not_found(sdk):
    with pytest.raises(openai.NotFoundError) as raised:
        sdk.completions.create(model="gpt-4", prompt="Hi")
    assert raised.value.body["code"] == "model_not_found"
    with pytest.raises(openai.NotFoundError):
        sdk.chat.completions.create(model="gpt-4", messages=[{"role": "user", "content": "hi"}])


def parse_sse(raw: bytes) -> list[str]:
    text = raw.decode("utf-8")
    assert text.endswith("\n\n")
    events = text[:-2].split("\n\n")
    assert all(event.startswith("data: ") and "\n" not in event for event in events)
    return [event[len("data: ") :] for event in events]


async def test_raw_sse_framing(client):
    body = {"prompt": "The quick brown", "max_tokens": 20, "temperature": 0, "stream": True}
    response = await client.post("/v1/completions", json=body)
    assert response.status == 200
    assert response.headers["Content-Type"].startswith("text/event-stream")
    events = parse_sse(await response.read())
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert "".join(c["choices"][0]["text"] for c in chunks) == " fox jumps over the lazy dog."
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"
    assert all(c["object"] == "text_completion" and c["id"] == chunks[0]["id"] for c in chunks)

    chat = await client.post(
        "/v1/chat/completions",
        json={"messages": [{"role": "user", "content": "How are you today?"}], "stream": True, "temperature": 0},
    )
    events = parse_sse(await chat.read())
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)


async def test_raw_errors_have_openai_shape(client):
    response = await client.post("/v1/completions", data=b"{nope")
    assert response.status == 400
    assert set((await response.json())["error"]) == {"message", "type", "param", "code"}
    response = await client.get("/v1/nope")
    assert response.status == 404
    assert (await response.json())["error"]["type"] == "invalid_request_error"
    response = await client.post("/v1/completions", json={"prompt": "x " * 600, "max_tokens": 10})
    assert response.status == 400  # a prompt over the context window: a 422 on the native route
    error = (await response.json())["error"]
    assert (error["param"], error["code"]) == ("prompt", "context_length_exceeded")
    assert error["message"].startswith("This model's maximum context length is 512 tokens. However, you requested")


async def test_max_tokens_past_the_context_is_clipped_on_v1(make_client, backend):
    """An asked max_tokens beyond the room the prompt leaves is clipped to it on /v1 (agents ask
    for 32,000 whatever the model), and the answer's X-Max-Tokens-Granted says how many; the
    native route refuses it, naming the numbers. MAX_TOKENS_LIMIT clips the same way on /v1."""
    client = await make_client(lambda: backend)
    body = {"prompt": "x", "max_tokens": 10_000, "ignore_eos": True, "temperature": 0}
    for stream in (False, True):
        response = await client.post("/v1/completions", json={**body, "stream": stream})
        assert response.status == 200 and response.headers["X-Max-Tokens-Granted"] == "511"
        await response.read()
    answer = await (await client.post("/v1/completions", json=body)).json()
    assert answer["usage"]["completion_tokens"] == 511 and answer["choices"][0]["finish_reason"] == "length"
    fits = await client.post("/v1/completions", json={**body, "max_tokens": 5})
    assert fits.status == 200 and "X-Max-Tokens-Granted" not in fits.headers
    native = await client.post("/generate", json={"prompt": "x", "max_tokens": 10_000})
    assert native.status == 422 and "at most 511 tokens can be generated" in (await native.json())["error"]["message"]
    limited = await make_client(lambda: backend, max_tokens_limit=8)
    response = await limited.post("/v1/completions", json={**body, "max_tokens": 100})
    assert response.status == 200 and response.headers["X-Max-Tokens-Granted"] == "8"
    assert (await response.json())["usage"]["completion_tokens"] == 8


async def test_sse_disconnect_stops_generation(make_client, backend):
    client = await make_client(lambda: GatedBackend(backend, Gate(after=1)))
    engine = engine_of(client)
    body = {"prompt": "Once upon", "max_tokens": 300, "stream": True, "temperature": 1.0, "seed": 5}
    response = await client.post("/v1/completions", json=body)
    await response.content.readline()
    response.close()  # the gate holds the generation until the worker has seen the client go
    await wait_idle(engine)
    assert engine.stats.cancelled == 1
    assert engine.stats.tokens_generated == 1
