"""/openapi.json describes the native API from the schemas the validation uses and the answers'
schemas of docs/openapi-answers.json; a property-based fuzz run drives a live server from it: never a
5xx, and every answer matches the description. The route table (`ROUTES`) is what the app registers,
what the document describes, and what the module docstring's index lists."""

from __future__ import annotations

import http.client
import inspect
import json
import re
from urllib.parse import urlparse

import pytest
from conftest import LiveServer
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from jsonschema import Draft202012Validator

import phi2_server
from phi2_server import (
    CHAT_SCHEMA,
    COMPLETIONS_SCHEMA,
    GENERATE_SCHEMA,
    ROUTES,
    Settings,
    answer_schemas,
    create_app,
    openapi_document,
)

JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=12),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3),
    max_leaves=5,
)


def from_schema(schema: dict) -> st.SearchStrategy:
    """Values that satisfy the JSON Schema subset the request schemas use."""
    if "anyOf" in schema:
        return st.one_of([from_schema(s) for s in schema["anyOf"]])
    if "enum" in schema:
        return st.sampled_from(schema["enum"])
    if "type" not in schema:  # anything
        return JSON
    kinds = schema["type"] if isinstance(schema["type"], list) else [schema["type"]]
    options = []
    for kind in kinds:
        if kind == "string":
            options.append(st.text(min_size=schema.get("minLength", 0), max_size=min(schema.get("maxLength", 30), 30)))
        elif kind == "integer":
            options.append(st.integers(min_value=schema.get("minimum"), max_value=schema.get("maximum")))
        elif kind == "number":
            low = schema.get("minimum", schema.get("exclusiveMinimum"))
            options.append(
                st.floats(
                    min_value=low,
                    max_value=schema.get("maximum"),
                    exclude_min="exclusiveMinimum" in schema,
                    allow_nan=False,
                    allow_infinity=False,
                )
            )
        elif kind == "boolean":
            options.append(st.booleans())
        elif kind == "null":
            options.append(st.none())
        elif kind == "array":
            options.append(st.lists(from_schema(schema["items"]), max_size=schema.get("maxItems", 3)))
        elif kind == "object":
            properties = schema.get("properties", {})
            required = set(schema.get("required", []))
            options.append(
                st.fixed_dictionaries(
                    {k: from_schema(v) for k, v in properties.items() if k in required},
                    optional={k: from_schema(v) for k, v in properties.items() if k not in required},
                )
            )
    return st.one_of(options)


@pytest.fixture(scope="module")
def server(backend, tmp_path_factory):
    settings = Settings(log_dir=str(tmp_path_factory.mktemp("logs")), max_tokens_limit=6)  # valid requests stay short
    server = LiveServer(create_app(settings, load=lambda: backend))
    yield server
    server.close()


def call(server, method: str, path: str, body: bytes | None = None):
    url = urlparse(server.url)
    connection = http.client.HTTPConnection(url.hostname, url.port, timeout=60)
    connection.request(
        method, path, body=body, headers={"Content-Type": "application/json"} if body is not None else {}
    )
    response = connection.getresponse()
    data = response.read()
    connection.close()
    return response.status, response.getheader("Content-Type", "").split(";")[0], data


@pytest.fixture(scope="module")
def document(server):
    status, _, data = call(server, "GET", "/openapi.json")
    assert status == 200
    return json.loads(data)


def conforms(document: dict, path: str, method: str, status: int, media: str, data: bytes) -> None:
    responses = document["paths"][path][method.lower()]["responses"]
    assert str(status) in responses, f"{method} {path} answered {status}, which is not described"
    content = responses[str(status)]["content"]
    assert media in content, f"{method} {path} {status} answered {media}"
    if media == "application/json":
        Draft202012Validator(content[media]["schema"]).validate(json.loads(data))
    elif media == "application/x-ndjson":
        lines = [json.loads(line) for line in data.decode("utf-8").splitlines()]
        assert all(set(line) in ({"token"}, {"token", "logprobs"}) for line in lines[:-1]) and lines[-1]["done"] is True
    elif media == "text/event-stream":
        events = [
            line.removeprefix("data: ") for line in data.decode("utf-8").splitlines() if line.startswith("data: ")
        ]
        assert events[-1] == "[DONE]"
        assert all("choices" in json.loads(e) or "error" in json.loads(e) for e in events[:-1])


def test_the_docstring_indexes_the_route_table():
    """The index is written by hand: method, path, handler and section, in the table's order."""
    lines = phi2_server.__doc__.splitlines()
    index = [line.split(maxsplit=3) for line in lines if re.match(r" +(GET|POST|DELETE) +/", line)]
    assert index == [[r.method, r.openapi_path, r.handler.__name__, r.section] for r in ROUTES]


def test_each_handler_is_in_the_section_its_route_names():
    lines = inspect.getsource(phi2_server).splitlines()
    headers = [(number, line.removeprefix("# -- ")) for number, line in enumerate(lines, 1) if line.startswith("# -- ")]
    for route in ROUTES:
        start = inspect.getsourcelines(route.handler)[1]
        header = [line for number, line in headers if number < start][-1]
        assert header.startswith(route.section), f"{route.handler.__name__} is under {header!r}, not {route.section!r}"


def test_the_app_registers_the_table_and_the_document_describes_it(tmp_path):
    app = create_app(Settings(log_dir=str(tmp_path)), load=lambda: None)
    registered = {(r.method, r.resource.canonical, r.handler) for r in app.router.routes() if r.method != "HEAD"}
    assert registered == {(r.method, r.openapi_path, r.handler) for r in ROUTES}
    described = {
        (path, method.upper()) for path, entry in openapi_document(ROUTES)["paths"].items() for method in entry
    }
    assert described == {(r.openapi_path, r.method) for r in ROUTES if r.path != "/openapi.json"}


def test_the_answer_schemas_are_json_schemas():
    """docs/openapi-answers.json, its references resolved: every schema valid, none left a $ref."""
    schemas = answer_schemas()
    for name, schema in schemas.items():
        Draft202012Validator.check_schema(schema)
        assert "$ref" not in json.dumps(schema), name


def test_the_document_uses_the_validation_schema(document):
    assert document["openapi"].startswith("3.1")
    for path in ("/generate", "/generate/stream"):
        assert (
            document["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"] == GENERATE_SCHEMA
        )
    Draft202012Validator.check_schema(GENERATE_SCHEMA)


@settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    body=st.one_of(
        from_schema(GENERATE_SCHEMA), from_schema(GENERATE_SCHEMA).map(lambda b: {**b, "prompt": "Once upon"}), JSON
    ),
    stream=st.booleans(),
)
def test_fuzz_generation_from_the_document(server, document, body, stream):
    path = "/generate/stream" if stream else "/generate"
    status, media, data = call(server, "POST", path, json.dumps(body).encode())
    assert status < 500, data
    conforms(document, path, "POST", status, media, data)


@pytest.mark.parametrize("path", ["/health", "/ready", "/model/info", "/metrics"])
def test_every_described_get_answers_as_described(server, document, path):
    status, media, data = call(server, "GET", path)
    conforms(document, path, "GET", status, media, data)


@settings(max_examples=100, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    body=st.one_of(
        from_schema(COMPLETIONS_SCHEMA),
        from_schema(COMPLETIONS_SCHEMA).map(lambda b: {**b, "prompt": "Once upon"}),
        from_schema(CHAT_SCHEMA),
        from_schema(CHAT_SCHEMA).map(
            lambda b: {**b, "messages": [{"role": "user", "content": "Hi"}], "tools": [], "audio": None}
        ),
        JSON,
    ),
)
def test_fuzz_openai_routes_from_the_document(server, document, body):
    path = "/v1/chat/completions" if isinstance(body, dict) and "messages" in body else "/v1/completions"
    status, media, data = call(server, "POST", path, json.dumps(body).encode())
    assert status < 500, data
    conforms(document, path, "POST", status, media, data)


@pytest.mark.parametrize("path", ["/v1/models", "/v1/models/nope"])
def test_the_model_routes_answer_as_described(server, document, path):
    status, media, data = call(server, "GET", path)
    conforms(document, "/v1/models/{model}" if path != "/v1/models" else path, "GET", status, media, data)
