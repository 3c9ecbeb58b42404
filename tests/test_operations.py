"""Safe to expose: API keys, rate limits, request ids, metrics, CORS."""

from __future__ import annotations

import json

import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families
from test_request_log import read_log

KEYS = "first-key-0123,second-key-4567"
GUARDED = [
    ("GET", "/model/info", None),
    ("POST", "/generate", {"prompt": "The quick brown", "max_tokens": 2}),
    ("POST", "/generate/stream", {"prompt": "The quick brown", "max_tokens": 2}),
    ("GET", "/v1/models", None),
    ("POST", "/v1/completions", {"prompt": "The quick brown", "max_tokens": 2}),
    ("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}),
    ("GET", "/metrics", None),
]
OPEN = [("GET", "/health"), ("GET", "/ready"), ("GET", "/openapi.json")]


def bearer(key: str) -> dict:
    return {"Authorization": f"Bearer {key}"}


@pytest.mark.parametrize("method, path, body", GUARDED)
async def test_every_guarded_route_needs_a_key_when_keys_are_set(make_client, backend, method, path, body):
    client = await make_client(lambda: backend, api_key=KEYS)
    for headers in (
        {},
        bearer("wrong"),
        {"Authorization": "first-key-0123"},
        {"Authorization": "Basic first-key-0123"},
    ):
        response = await client.request(method, path, json=body, headers=headers)
        assert response.status == 401, (headers, await response.text())
        assert response.headers["WWW-Authenticate"] == "Bearer"
        assert "error" in await response.json()
    for key in KEYS.split(","):  # key rotation: both the old and the new key work
        response = await client.request(method, path, json=body, headers=bearer(key))
        assert response.status == 200, await response.text()
        await response.read()


@pytest.mark.parametrize("method, path", OPEN)
async def test_probes_and_the_description_stay_open(make_client, backend, method, path):
    client = await make_client(lambda: backend, api_key=KEYS)
    assert (await client.request(method, path)).status == 200


async def test_no_key_configured_means_no_auth(client):
    for method, path, body in GUARDED:
        response = await client.request(method, path, json=body)
        assert response.status == 200, path
        await response.read()


async def test_keys_from_a_file(make_client, backend, tmp_path):
    keys = tmp_path / "keys"
    keys.write_text("# rotated on Monday\nfile-key-aaaa\n\nfile-key-bbbb\n")
    client = await make_client(lambda: backend, api_key_file=str(keys))
    assert (await client.get("/model/info", headers=bearer("file-key-bbbb"))).status == 200
    assert (await client.get("/model/info", headers=bearer("# rotated on Monday"))).status == 401


async def test_no_key_reaches_the_log(make_client, backend, log_dir):
    client = await make_client(lambda: backend, api_key=KEYS)
    await client.post(
        "/generate", json={"prompt": "The quick brown", "max_tokens": 2}, headers=bearer("first-key-0123")
    )
    await client.get("/model/info", headers=bearer("a-wrong-key-9999"))
    text = "".join(path.read_text() for path in log_dir.glob("requests.log*"))
    assert "key-0123" not in text and "a-wrong-key" not in text
    assert [line["status"] for line in read_log(log_dir)] == [200, 401]


async def test_the_openai_client_sends_its_key(live_server, backend):
    server = live_server(lambda: backend, api_key=KEYS)
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=server.url + "/v1", api_key="wrong", max_retries=0).models.list()
    models = openai.OpenAI(base_url=server.url + "/v1", api_key="second-key-4567", max_retries=0).models.list()
    assert len(models.data) == 1


async def test_rate_limit_answers_429_with_retry_after(make_client, backend):
    client = await make_client(lambda: backend, rate_limit=3, api_key=KEYS)
    statuses = [(await client.get("/model/info", headers=bearer("first-key-0123"))).status for _ in range(4)]
    assert statuses == [200, 200, 200, 429]
    response = await client.get("/model/info", headers=bearer("first-key-0123"))
    assert response.status == 429
    assert 1 <= int(response.headers["Retry-After"]) <= 20  # a minute holds 3: one more in 20 s
    assert (await response.json())["error"]["type"] == "rate_limited"
    # each key has its own bucket; probes and metrics are never limited
    assert (await client.get("/model/info", headers=bearer("second-key-4567"))).status == 200
    assert (await client.get("/health")).status == 200
    assert (await client.get("/metrics", headers=bearer("first-key-0123"))).status == 200
    openai_style = await client.get("/v1/models", headers=bearer("first-key-0123"))
    assert openai_style.status == 429 and (await openai_style.json())["error"]["type"] == "rate_limit_error"


async def test_request_ids_round_trip(client, log_dir):
    response = await client.post(
        "/generate", json={"prompt": "Once upon", "max_tokens": 3}, headers={"X-Request-Id": "trace-42.a"}
    )
    assert response.headers["X-Request-Id"] == "trace-42.a"
    assert (await response.json())["request_id"] == "trace-42.a"
    stream = await client.post("/generate/stream", json={"prompt": "Once upon", "max_tokens": 3})
    made = stream.headers["X-Request-Id"]
    last = json.loads((await stream.read()).splitlines()[-1])
    assert last["request_id"] == made and len(made) == 32
    odd = await client.get("/nope", headers={"X-Request-Id": "bad id\twith spaces"})  # not echoed
    assert odd.status == 404 and odd.headers["X-Request-Id"] != "bad id\twith spaces"
    assert [line["request_id"] for line in read_log(log_dir)] == ["trace-42.a", made, odd.headers["X-Request-Id"]]


def scrape(text: str) -> dict:
    samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return samples


async def test_metrics_parse_and_move(client, backend):
    before = scrape(await (await client.get("/metrics")).text())
    await client.post("/generate", json={"prompt": "The quick brown", "max_tokens": 5, "ignore_eos": True})
    response = await client.post("/generate/stream", json={"prompt": "Once upon", "max_tokens": 4, "ignore_eos": True})
    await response.read()
    await client.post("/generate", json={"prompt": ""})
    after = scrape(await (await client.get("/metrics")).text())
    assert after[("phi2_generated_tokens_total", ())] - before.get(("phi2_generated_tokens_total", ()), 0) == 9
    assert after[("phi2_prompt_tokens_total", ())] - before.get(("phi2_prompt_tokens_total", ()), 0) == len(
        backend.encode("The quick brown")
    ) + len(backend.encode("Once upon"))
    ok = ("phi2_requests_total", (("method", "POST"), ("route", "/generate"), ("status", "200")))
    assert after[ok] == 1
    assert after[("phi2_requests_total", (("method", "POST"), ("route", "/generate"), ("status", "422")))] == 1
    assert after[("phi2_time_to_first_token_seconds_count", ())] == 2
    assert after[("phi2_request_duration_seconds_count", (("route", "/generate/stream"),))] == 1
    assert after[("phi2_model_loaded", ())] == 1
    assert after[("phi2_queue_waiting", ())] == 0 and after[("phi2_active_sequences", ())] == 0
    assert after[("phi2_decode_steps_total", ())] > before.get(("phi2_decode_steps_total", ()), 0)
    build = [labels for (name, labels) in after if name == "phi2_build_info"]
    assert dict(build[0])["backend"] == backend.info.backend
    await client.get("/some/unknown/path")
    assert ("phi2_requests_total", (("method", "GET"), ("route", "unmatched"), ("status", "404"))) in scrape(
        await (await client.get("/metrics")).text()
    )


async def test_cors_is_off_by_default(client):
    response = await client.get("/health", headers={"Origin": "https://app.example"})
    assert "Access-Control-Allow-Origin" not in response.headers
    preflight = await client.options(
        "/generate", headers={"Origin": "https://app.example", "Access-Control-Request-Method": "POST"}
    )
    assert preflight.status == 405


async def test_cors_allows_configured_origins(make_client, backend):
    client = await make_client(lambda: backend, cors_origins="https://app.example", api_key=KEYS)
    preflight = await client.options(
        "/generate",
        headers={
            "Origin": "https://app.example",
            "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "authorization",
        },
    )
    assert preflight.status == 204
    assert preflight.headers["Access-Control-Allow-Origin"] == "https://app.example"
    assert "Authorization" in preflight.headers["Access-Control-Allow-Headers"]
    stream = await client.post(
        "/generate/stream",
        json={"prompt": "Hi", "max_tokens": 2},
        headers={"Origin": "https://app.example", **bearer("first-key-0123")},
    )
    assert stream.headers["Access-Control-Allow-Origin"] == "https://app.example"
    await stream.read()
    denied = await client.get("/health", headers={"Origin": "https://evil.example"})
    assert "Access-Control-Allow-Origin" not in denied.headers
