"""Anthropic's Messages API (/v1/messages, /v1/messages/count_tokens), driven by the official
`anthropic` SDK unchanged (base_url pointed here) on both runtimes, batched: create, stream,
stop sequences, count_tokens, keys as x-api-key, and errors in Anthropic's shape."""

from __future__ import annotations

import re

import anthropic
import pytest

from phi2_server import SETTINGS

HELLO = [{"role": "user", "content": "How are you today?"}]
# The SDK no longer has sampling arguments (newer Claude models take none); this server still
# reads temperature, top_p and top_k from the body, and tests want greedy decoding.
GREEDY = {"extra_body": {"temperature": 0}}


@pytest.fixture
def server(live_server, backend, tiny_path):
    return live_server(lambda: backend, model=str(tiny_path))


@pytest.fixture
def sdk(server):
    return anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0)


def model_of(server) -> str:
    return server.app[SETTINGS].model


def chat_text(server, messages: list[dict], max_tokens: int) -> tuple[str, dict]:
    """The same conversation through /v1/chat/completions (greedy): what /v1/messages must say."""
    import openai

    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    answer = client.chat.completions.create(
        model=model_of(server), messages=messages, max_tokens=max_tokens, temperature=0
    )
    return answer.choices[0].message.content, answer


def test_create_says_what_chat_completions_says(server, sdk):
    system = "You are terse."
    message = sdk.messages.create(model=model_of(server), max_tokens=12, **GREEDY, system=system, messages=HELLO)
    expected, chat = chat_text(server, [{"role": "system", "content": system}, *HELLO], 12)
    assert message.type == "message" and message.role == "assistant" and message.id.startswith("msg_")
    assert message.model == model_of(server)
    assert [block.type for block in message.content] == ["text"]
    assert message.content[0].text == expected
    assert message.stop_reason == ("max_tokens" if chat.choices[0].finish_reason == "length" else "end_turn")
    usage = message.usage
    assert usage.input_tokens + usage.cache_read_input_tokens == chat.usage.prompt_tokens
    assert usage.output_tokens == chat.usage.completion_tokens


def test_the_stream_is_anthropics_event_sequence_and_adds_up_to_create(server, sdk):
    body = dict(model=model_of(server), max_tokens=10, **GREEDY, messages=HELLO)
    whole = sdk.messages.create(**body)
    with sdk.messages.stream(**body) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_message()
    assert kinds[:2] == ["message_start", "content_block_start"]
    assert kinds[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert set(kinds[2:-3]) <= {"text", "content_block_delta"}  # the SDK's text events beside the deltas
    assert final.content[0].text == whole.content[0].text
    assert final.stop_reason == whole.stop_reason and final.usage.output_tokens == whole.usage.output_tokens


def test_a_stop_sequence_is_named_as_the_reason(server, sdk):
    prompt = HELLO
    free = sdk.messages.create(model=model_of(server), max_tokens=16, **GREEDY, messages=prompt)
    words = free.content[0].text.split()
    assert len(words) >= 3, free.content[0].text
    stop = " " + words[2]
    for streamed in (False, True):
        body = dict(model=model_of(server), max_tokens=16, **GREEDY, messages=prompt, stop_sequences=[stop])
        if streamed:
            with sdk.messages.stream(**body) as stream:
                message = stream.get_final_message()
        else:
            message = sdk.messages.create(**body)
        assert message.stop_reason == "stop_sequence" and message.stop_sequence == stop
        assert message.content[0].text == free.content[0].text.split(stop)[0].strip()


def test_count_tokens_counts_what_create_reads(server, sdk):
    count = sdk.messages.count_tokens(model=model_of(server), system="Be brief.", messages=HELLO)
    message = sdk.messages.create(model=model_of(server), max_tokens=1, **GREEDY, system="Be brief.", messages=HELLO)
    assert count.input_tokens == message.usage.input_tokens + message.usage.cache_read_input_tokens


def test_keys_come_as_x_api_key_or_bearer(live_server, backend, tiny_path):
    server = live_server(lambda: backend, model=str(tiny_path), api_key="k1")
    body = dict(model=str(tiny_path), max_tokens=2, **GREEDY, messages=HELLO)
    with pytest.raises(anthropic.AuthenticationError) as caught:
        anthropic.Anthropic(base_url=server.url, api_key="wrong", max_retries=0).messages.create(**body)
    assert caught.value.body["error"]["type"] == "authentication_error"
    assert anthropic.Anthropic(base_url=server.url, api_key="k1", max_retries=0).messages.create(**body).content
    bearer = anthropic.Anthropic(base_url=server.url, auth_token="k1", max_retries=0)
    assert bearer.messages.create(**body).content


@pytest.mark.parametrize(
    "change, field",
    [
        (
            {
                "tools": [{"name": "f", "input_schema": {"type": "object"}}],
                "tool_choice": {"type": "tool", "name": "g"},
            },
            "tool_choice",
        ),
        ({"tools": [{"name": "bash"}]}, "tools[0].input_schema"),
        ({"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}, "type"),
        ({"messages": [*HELLO, {"role": "assistant", "content": "Sure"}]}, "messages[1]"),
        ({"extra_body": {"temperature": 1.5}}, "temperature"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"model": "not-served"}, "model"),
    ],
)
def test_bad_input_is_an_anthropic_error_naming_the_field(server, sdk, change, field):
    body = {"model": model_of(server), "max_tokens": 4, "messages": HELLO, **change}
    with pytest.raises(anthropic.APIStatusError) as caught:
        sdk.messages.create(**body)
    error = caught.value
    assert error.status_code == (404 if field == "model" else 400)
    assert error.body["type"] == "error"
    assert error.body["error"]["type"] == ("not_found_error" if field == "model" else "invalid_request_error")
    assert field in error.body["error"]["message"]


def test_answers_match_the_published_description(server):
    import json
    import urllib.request

    from jsonschema import Draft202012Validator

    with urllib.request.urlopen(server.url + "/openapi.json") as response:
        paths = json.loads(response.read())["paths"]
    for path, body in (
        ("/v1/messages", {"model": model_of(server), "max_tokens": 4, "messages": HELLO, "temperature": 0}),
        ("/v1/messages/count_tokens", {"model": model_of(server), "messages": HELLO}),
    ):
        request = urllib.request.Request(server.url + path, data=json.dumps(body).encode())
        with urllib.request.urlopen(request) as response:
            answer = json.loads(response.read())
        schema = paths[path]["post"]["responses"]["200"]["content"]["application/json"]["schema"]
        Draft202012Validator(schema).validate(answer)
        Draft202012Validator(paths[path]["post"]["requestBody"]["content"]["application/json"]["schema"]).validate(body)


async def test_a_prompt_too_long_is_anthropic_s_error_and_max_tokens_is_clipped(client):
    model = client.app[SETTINGS].model
    """Claude Code compacts its conversation when it reads Anthropic's own wording, and asks for
    max_tokens 32,000 whatever the model: that is clipped to the room the prompt leaves."""
    too_long = {"model": model, "max_tokens": 10, "messages": [{"role": "user", "content": "x " * 600}]}
    response = await client.post("/v1/messages", json=too_long)
    assert response.status == 400
    answer = await response.json()
    assert answer["type"] == "error" and answer["error"]["type"] == "invalid_request_error"
    assert re.fullmatch(r"prompt is too long: \d+ tokens > 511 maximum", answer["error"]["message"])
    body = {"model": model, "max_tokens": 32_000, "messages": [{"role": "user", "content": "Hi"}]}
    response = await client.post("/v1/messages", json=body)
    assert response.status == 200
    granted = int(response.headers["X-Max-Tokens-Granted"])
    assert granted == 512 - (await response.json())["usage"]["input_tokens"]
