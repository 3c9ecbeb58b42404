"""Bad input gets a clear 4xx JSON error naming the field, never a 500."""

from __future__ import annotations

import json

import pytest

VALID = {"prompt": "Hello"}


@pytest.mark.parametrize(
    "body, field",
    [
        ({}, "prompt"),
        ({"prompt": ""}, "prompt"),
        ({"prompt": 5}, "prompt"),
        ({"prompt": None}, "prompt"),
        ({"prompt": ["a"]}, "prompt"),
        ({"prompt": "\ud800"}, "prompt"),  # a lone surrogate, escaped in the JSON
        ({**VALID, "max_tokens": 0}, "max_tokens"),
        ({**VALID, "max_tokens": -3}, "max_tokens"),
        ({**VALID, "max_tokens": True}, "max_tokens"),  # a bool is not an int
        ({**VALID, "max_tokens": 2.5}, "max_tokens"),  # 2.0 is an integer (JSON Schema's rule)
        ({**VALID, "max_tokens": "10"}, "max_tokens"),
        ({**VALID, "max_tokens": 10**30}, "max_tokens"),
        ({**VALID, "temperature": -0.1}, "temperature"),
        ({**VALID, "temperature": "hot"}, "temperature"),
        (b'{"prompt": "Hello", "temperature": 1e999}', "temperature"),  # parses as infinity
        ({**VALID, "top_p": 0}, "top_p"),
        ({**VALID, "top_p": 1.01}, "top_p"),
        ({**VALID, "top_p": False}, "top_p"),
        ({**VALID, "stop": ["a", "b", "c", "d", "e"]}, "stop"),
        ({**VALID, "stop": [1]}, "stop[0]"),  # the list option fits: its own error
        ({**VALID, "stop": ""}, "stop"),
        ({**VALID, "stop": {"a": 1}}, "stop"),
        ({**VALID, "seed": -1}, "seed"),
        ({**VALID, "seed": 1.5}, "seed"),
        ({**VALID, "seed": 2**64}, "seed"),
        ({**VALID, "temprature": 0.5}, "temprature"),  # unknown fields are not ignored
    ],
)
async def test_invalid_fields_are_422_naming_the_field(client, body, field):
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    response = await client.post("/generate", data=data)
    assert response.status == 422, await response.text()
    error = (await response.json())["error"]
    assert error["field"] == field
    assert field in error["message"]
    stream = await client.post("/generate/stream", data=data)
    assert stream.status == 422


@pytest.mark.parametrize(
    "raw",
    [
        b"",
        b"not json",
        b"{",
        b'{"prompt": "a",}',
        b'{"prompt": NaN}',
        b'{"prompt": "x", "top_p": Infinity}',
        b"\xff\xfe",
    ],
)
async def test_malformed_json_is_400(client, raw):
    response = await client.post("/generate", data=raw, headers={"Content-Type": "application/json"})
    assert response.status == 400
    assert (await response.json())["error"]["type"] == "invalid_json"


@pytest.mark.parametrize("body", [b"[]", b'"prompt"', b"42", b"null"])
async def test_json_that_is_not_an_object_is_422(client, body):
    response = await client.post("/generate", data=body)
    assert response.status == 422
    assert (await response.json())["error"]["field"] == "body"


async def test_any_content_type_is_read_as_json(client):
    # curl -d sends application/x-www-form-urlencoded unless told otherwise.
    response = await client.post(
        "/generate",
        data=b'{"prompt": "Hi", "max_tokens": 1}',
        headers={"Content-Type": "application/x-www-form-urlencoded"},
    )
    assert response.status == 200


async def test_body_over_the_limit_is_413(make_client, backend):
    client = await make_client(lambda: backend, max_body_bytes=1000)
    ok = await client.post("/generate", json={"prompt": "a" * 300, "max_tokens": 1, "stop": "x" * 256})
    assert ok.status == 200
    response = await client.post("/generate", json={"prompt": "a" * 1000})
    assert response.status == 413
    assert "1000" in (await response.json())["error"]["message"]


async def test_max_tokens_beyond_the_context_left_is_422_with_both_numbers(client, backend):
    prompt_tokens = len(backend.encode("Hello world"))
    room = backend.info.context_length - prompt_tokens
    ok = await client.post("/generate", json={"prompt": "Hello world", "max_tokens": room, "stop": "\n"})
    assert ok.status == 200
    response = await client.post("/generate", json={"prompt": "Hello world", "max_tokens": room + 1})
    assert response.status == 422
    message = (await response.json())["error"]["message"]
    assert str(room + 1) in message and str(backend.info.context_length) in message


async def test_prompt_longer_than_the_context_is_422(client, backend):
    prompt = "lazy dog " * 400
    assert len(backend.encode(prompt)) > backend.info.context_length
    response = await client.post("/generate", json={"prompt": prompt})
    assert response.status == 422
    error = (await response.json())["error"]
    assert error["field"] == "prompt"
    assert str(len(backend.encode(prompt))) in error["message"]
    assert str(backend.info.context_length) in error["message"]


async def test_server_is_healthy_after_bad_input(client):
    await client.post("/generate", data=b"\x00\x01")
    await client.post("/generate", json={"prompt": "\x00 NUL and 😀 emoji and 漢字", "max_tokens": 3})
    response = await client.get("/health")
    assert (await response.json())["status"] == "ok"
