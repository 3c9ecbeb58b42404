"""Probes, model info, loading and load failure, and the JSON error contract."""

from __future__ import annotations

import threading

import pytest
from conftest import engine_of, wait_until

from backends.contract import ModelLoadError


async def test_health_ready_and_info_when_loaded(client, backend):
    health = await client.get("/health")
    assert health.status == 200
    assert await health.json() == {"status": "ok", "model_loaded": True, "queue": {"waiting": 0, "active": 0}}
    ready = await client.get("/ready")
    assert ready.status == 200
    assert await ready.json() == {"ready": True, "status": "ok", "draining": False}
    info = await (await client.get("/model/info")).json()
    assert info["model"] == backend.info.model
    assert info["backend"] == backend.info.backend
    assert info["device"] == "cpu"
    assert info["dtype"] == "float32"
    assert info["adapter_applied"] is False
    assert info["context_length"] == 512
    assert isinstance(info["load_time_s"], float)
    assert {"adapter_path", "stats"} <= set(info)


async def test_loading_is_observable_and_answers_503(make_client, backend):
    release = threading.Event()

    def slow_load():
        release.wait(10)
        return backend

    client = await make_client(slow_load, wait=False)
    health = await client.get("/health")
    assert health.status == 200
    assert (await health.json())["status"] == "loading"
    assert (await health.json())["model_loaded"] is False
    for method, path in [
        ("GET", "/ready"),
        ("GET", "/model/info"),
        ("POST", "/generate"),
        ("POST", "/generate/stream"),
    ]:
        response = await client.request(method, path, json={"prompt": "hi"})
        assert response.status == 503, path
        assert response.headers["Retry-After"].isdigit()
        assert response.content_type == "application/json"
    release.set()
    await wait_until(lambda: engine_of(client).status == "ok")
    assert (await client.get("/ready")).status == 200
    response = await client.post("/generate", json={"prompt": "hi", "max_tokens": 2})
    assert response.status == 200


async def test_load_failure_is_reported(make_client):
    def broken_load():
        raise ModelLoadError("PHI2_MODEL='nope' is not a loadable checkpoint directory")

    client = await make_client(broken_load)
    health = await client.get("/health")
    assert health.status == 200
    assert await health.json() == {"status": "error", "model_loaded": False, "queue": {"waiting": 0, "active": 0}}
    assert (await client.get("/ready")).status == 503
    response = await client.post("/generate", json={"prompt": "hi"})
    assert response.status == 503
    assert "failed to load" in (await response.json())["error"]["message"]
    assert isinstance(engine_of(client).load_error, ModelLoadError)


async def test_unknown_path_and_wrong_method_are_json(client):
    response = await client.get("/nope")
    assert response.status == 404
    assert (await response.json())["error"]["message"]
    response = await client.get("/generate")
    assert response.status == 405
    assert response.headers["Allow"] == "POST"
    assert (await response.json())["error"]["type"] == "method_not_allowed"
    response = await client.post("/health")
    assert response.status == 405


async def test_wildcard_aliases_answer_unlisted_names(make_client, backend):
    """SERVED_MODEL_NAME=smollm2,claude-*: the names Claude Code asks for (its main and background
    models) reach the one model, answered under the name asked for; /v1/models lists smollm2
    alone, and a name no alias matches is still a 404."""
    client = await make_client(lambda: backend, served_model_name="smollm2,claude-*")
    listed = await (await client.get("/v1/models")).json()
    assert [card["id"] for card in listed["data"]] == ["smollm2"]
    chat = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3, "temperature": 0}
    plain = await (await client.post("/v1/chat/completions", json={**chat, "model": "smollm2"})).json()
    haiku = await client.post("/v1/chat/completions", json={**chat, "model": "claude-haiku-4-5"})
    assert haiku.status == 200
    answer = await haiku.json()
    assert answer["model"] == "claude-haiku-4-5"
    assert answer["choices"][0]["message"] == plain["choices"][0]["message"]
    message = {"model": "claude-sonnet-4-5", "max_tokens": 3, "messages": [{"role": "user", "content": "Hi"}]}
    assert (await client.post("/v1/messages", json=message)).status == 200
    assert (await client.get("/v1/models/claude-opus-4")).status == 200
    missing = await client.post("/v1/chat/completions", json={**chat, "model": "gpt-4"})
    assert missing.status == 404 and (await missing.json())["error"]["code"] == "model_not_found"


async def test_temperature_is_the_default_of_requests_that_send_none(make_client, backend):
    """TEMPERATURE=0: a request that sends no temperature decodes greedily (agents send none),
    one that sends its own keeps it; a bad value stops the start, naming it."""
    from phi2_server import Settings, create_app

    client = await make_client(lambda: backend, temperature="0")
    chat = {"messages": [{"role": "user", "content": "How are you today?"}], "max_tokens": 12, "seed": 3}
    greedy = await (await client.post("/v1/chat/completions", json={**chat, "temperature": 0})).json()
    default = await (await client.post("/v1/chat/completions", json=chat)).json()
    assert default["choices"][0]["message"] == greedy["choices"][0]["message"]
    hot = {**chat, "temperature": 2.0, "n": 4}
    texts = {
        c["message"]["content"] for c in (await (await client.post("/v1/chat/completions", json=hot)).json())["choices"]
    }
    assert len(texts) > 1  # its own temperature: sampled, seeded per choice
    with pytest.raises(ValueError, match="TEMPERATURE"):
        create_app(Settings(temperature="warm"))
