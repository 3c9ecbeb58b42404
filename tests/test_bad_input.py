"""A property-based battery: whatever a client sends, the answer is a 4xx JSON error or a 200."""

from __future__ import annotations

import http.client
import json
from urllib.parse import urlparse

import pytest
from conftest import LiveServer
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from phi2_server import Settings, create_app

json_scalars = st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20)
json_values = st.recursive(
    json_scalars,
    lambda children: st.lists(children, max_size=3) | st.dictionaries(st.text(max_size=8), children, max_size=3),
    max_leaves=6,
)
odd_text = st.text(
    alphabet=st.characters(codec=None, exclude_categories=()),  # emoji, CJK, NUL, lone surrogates
    min_size=0,
    max_size=40,
)
fields = {
    "prompt": odd_text | json_values,
    "max_tokens": st.integers(-3, 10**30) | json_values,
    "temperature": st.floats() | json_values,
    "top_p": st.floats() | json_values,
    "stop": st.lists(odd_text, max_size=6) | odd_text | json_values,
    "seed": st.integers(-(2**70), 2**70) | json_values,
    "ignore_eos": json_values,
}
bodies = st.fixed_dictionaries({}, optional=fields) | st.dictionaries(st.text(max_size=10), json_values, max_size=4)


def encode(body) -> bytes:
    # json.dumps writes NaN/Infinity literals and escapes lone surrogates as \\udXXX.
    return json.dumps(body).encode()


raw_bodies = (
    bodies.map(encode)
    | json_values.map(encode)
    | st.binary(max_size=200)
    | st.sampled_from(
        [b"", b"{", b"[1,", b'{"prompt": NaN}', b'{"prompt":"a"}' * 3, b"\xff\xfe\x00", b'{"prompt": "\\ud800"}']
    )
)
content_types = st.sampled_from(
    ["application/json", "text/plain", "application/x-www-form-urlencoded", "", "multipart/form-data; boundary=x"]
)
methods = st.sampled_from(["POST", "GET", "PUT", "DELETE", "PATCH"])
paths = st.sampled_from(["/generate", "/generate/stream", "/health", "/model/info", "/nope", "/generate/"])


class Client:
    def __init__(self, url: str):
        parsed = urlparse(url)
        self.host, self.port = parsed.hostname, parsed.port

    def request(self, method: str, path: str, body: bytes, content_type: str):
        connection = http.client.HTTPConnection(self.host, self.port, timeout=30)
        headers = {"Content-Type": content_type} if content_type else {}
        connection.request(method, path, body=body, headers=headers)
        response = connection.getresponse()
        data = response.read()
        connection.close()
        return response.status, response.getheader("Content-Type", ""), data


@pytest.fixture(scope="module")
def server(backend, tmp_path_factory):
    """One server for the whole battery (per runtime): the last test checks it is still healthy."""
    settings = Settings(log_dir=str(tmp_path_factory.mktemp("logs")), max_tokens_limit=4, max_body_bytes=4096)
    server = LiveServer(create_app(settings, load=lambda: backend))  # short generations keep it fast
    yield server
    server.close()


def check_answer(status: int, content_type: str, data: bytes) -> None:
    assert status < 500, data
    if status >= 400:
        assert content_type.startswith("application/json")
        error = json.loads(data)["error"]
        assert isinstance(error["message"], str) and error["message"]
    elif content_type.startswith("application/x-ndjson"):
        lines = [json.loads(line) for line in data.decode("utf-8").splitlines()]
        assert lines[-1]["done"] is True
    else:
        json.loads(data)


@settings(max_examples=250, deadline=None, suppress_health_check=list(HealthCheck))
@given(body=raw_bodies, content_type=content_types)
def test_generate_never_answers_5xx(server, body, content_type):
    client = Client(server.url)
    for path in ("/generate", "/generate/stream"):
        check_answer(*client.request("POST", path, body, content_type))


@settings(max_examples=100, deadline=None, suppress_health_check=list(HealthCheck))
@given(method=methods, path=paths, body=raw_bodies)
def test_any_method_and_path_answers_json(server, method, path, body):
    check_answer(*Client(server.url).request(method, path, body, "application/json"))


def test_server_is_healthy_after_the_battery(server):
    status, _, data = Client(server.url).request("GET", "/health", b"", "")
    assert status == 200 and json.loads(data)["status"] == "ok"
    status, _, data = Client(server.url).request(
        "POST", "/generate", b'{"prompt": "The quick brown", "max_tokens": 4}', "application/json"
    )
    assert status == 200 and json.loads(data)["text"] == " fox jumps over the"
