"""One client must not be able to hurt another (issue 25): each case a careless or hostile
client was seen to get through, reproduced against the real app on both runtimes, with what
it must answer now and what its neighbours must still get."""

from __future__ import annotations

import asyncio
import json
import threading

import pytest

from conftest import engine_of, wait_idle, wait_until
from fakes import Gate, GatedBackend, WrappedBackend
from test_request_log import read_log

# -- grammars: refused at compile time where that can be known ----------------------------------

BROKEN_REGEXES = ["[a&&b]", r"[^\s\S]", "a{1000000}", "(a{1000}){1000}"]
BROKEN_SCHEMAS = [
    {"$defs": {"a": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"},
    {"type": "object", "properties": {"a": {"$ref": "#"}}, "required": ["a"]},
    {"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(500)}},  # "Current row has 2007 items"
]


@pytest.mark.parametrize("regex", BROKEN_REGEXES)
async def test_a_regex_that_cannot_work_is_refused_when_it_compiles(client, regex):
    response = await client.post("/generate", json={"prompt": "Hi", "regex": regex})
    body = await response.json()
    assert (response.status, body["error"]["field"]) == (422, "regex"), body
    assert "<state>" not in body["error"]["message"] and "\n" not in body["error"]["message"]


@pytest.mark.parametrize("schema", BROKEN_SCHEMAS, ids=["self-ref", "root-ref", "500-properties"])
async def test_a_schema_that_cannot_work_is_refused_when_it_compiles(client, schema):
    response = await client.post("/generate", json={"prompt": "Hi", "json_schema": schema})
    body = await response.json()
    assert (response.status, body["error"]["field"]) == (422, "json_schema"), body
    chat = {"messages": [{"role": "user", "content": "Hi"}], "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}}
    response = await client.post("/v1/chat/completions", json=chat)
    body = await response.json()
    assert (response.status, body["error"]["param"]) == (400, "response_format.json_schema.schema"), body


# -- grammars: one that fails while generating ends its own sequence alone ------------------------

# It compiles (its first tokens are fine), then fails where the model must open "o": the object
# of 500 optional properties is past llguidance's row limit. A string of at most 3 characters
# comes first, so the failure comes within a dozen tokens, whatever the model writes.
FAILS_LATER = {
    "type": "object",
    "properties": {"a": {"type": "string", "maxLength": 3}, "o": {"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(500)}}},
    "required": ["a", "o"],
    "additionalProperties": False,
}
NEIGHBOUR = {"prompt": "Once upon a time", "max_tokens": 24, "ignore_eos": True}


def unconstrained(sequence) -> bool:
    return sequence.sampling.constraint is None


async def neighbour_text(client) -> str:
    response = await client.post("/generate/stream", json=NEIGHBOUR)
    lines = [json.loads(line) for line in (await response.read()).decode().splitlines()]
    assert lines[-1]["done"] and lines[-1]["finish_reason"] == "length", lines[-1]
    return "".join(line.get("token", "") for line in lines[:-1])


async def test_a_grammar_failing_mid_generation_ends_only_its_sequence(make_client, backend, max_batch, log_dir):
    reference = await neighbour_text(await make_client(lambda: backend))
    # The neighbour is held after its first token, so it shares the batch with every faulty
    # request below (its tokens are kept and handed over at the release: the same text).
    gate = Gate(after=1, held=unconstrained)
    client = await make_client(lambda: GatedBackend(backend, gate))
    engine = engine_of(client)
    if max_batch > 1:
        neighbour = asyncio.create_task(neighbour_text(client))
        await wait_until(lambda: gate.holding == 1)

    response = await client.post("/generate", json={"prompt": "Hi", "json_schema": FAILS_LATER, "max_tokens": 60})
    body = await response.json()
    assert (response.status, body["error"]["field"]) == (422, "json_schema"), body
    assert "Current row has 2007 items" in body["error"]["message"] and "<state>" not in body["error"]["message"]

    chat = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 60, "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": FAILS_LATER}}}
    response = await client.post("/v1/chat/completions", json=chat)
    body = await response.json()
    assert (response.status, body["error"]["param"]) == (400, "response_format.json_schema.schema"), body

    response = await client.post("/generate/stream", json={"prompt": "Hi", "json_schema": FAILS_LATER, "max_tokens": 60})
    last = json.loads((await response.read()).decode().splitlines()[-1])
    assert last["finish_reason"] == "error" and last["error"]["type"] == "invalid_request", last
    response = await client.post("/v1/chat/completions", json={**chat, "stream": True})
    events = [line for line in (await response.read()).decode().split("\n\n") if line.startswith("data: {")]
    error = json.loads(events[-1][len("data: "):])["error"]
    assert (error["type"], error["param"]) == ("invalid_request_error", "response_format.json_schema.schema"), error

    if max_batch > 1:
        assert not neighbour.done() and gate.holding == 1  # still in flight beside all of them
        gate.release()
        assert await neighbour == reference  # its text unchanged
    await wait_idle(engine)
    assert engine.stats["errors"] == 4
    assert not [line for line in read_log(log_dir) if line["status"] >= 500]


# -- grammars: their cost stays off the generation thread -----------------------------------------


async def test_no_grammar_work_runs_on_the_generation_thread(make_client, backend, monkeypatch):
    """Compiling, and each sequence's copy of the grammar (a large one takes seconds, then a
    while), happen on pools; the generation thread only reads masks computed elsewhere."""
    from backends import grammar

    threads = []
    for name in ("compile", "cached"):
        monkeypatch.setattr(grammar.Grammars, name, recording(getattr(grammar.Grammars, name), threads))
    monkeypatch.setattr(grammar.Grammar, "matcher", recording(grammar.Grammar.matcher, threads))
    client = await make_client(lambda: backend)
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"], "additionalProperties": False}
    response = await client.post("/generate", json={"prompt": "Hi", "json_schema": schema, "max_tokens": 20})
    assert response.status == 200
    response = await client.post("/v1/completions", json={"prompt": "Hi", "n": 3, "max_tokens": 20, "response_format": {"type": "json_object"}})
    assert response.status == 200
    assert threads and "generation-worker" not in threads, threads


def recording(method, threads: list):
    def wrapper(*args, **kwargs):
        threads.append(threading.current_thread().name)
        return method(*args, **kwargs)

    return wrapper


class HeldCompiles(WrappedBackend):
    """Every grammar compile waits for `release` (a slow schema, without guessing how slow)."""

    def __init__(self, backend, release: threading.Event):
        super().__init__(backend)
        self.release = release
        self.started = 0

    def constraint(self, kind, spec):
        self.started += 1
        self.release.wait(60)
        return self.inner.constraint(kind, spec)

    def cached_constraint(self, kind, spec):
        return None


async def test_slow_compiles_hold_neither_requests_nor_tokenizing(make_client, backend, monkeypatch):
    import phi2_server

    release = threading.Event()
    held = HeldCompiles(backend, release)
    monkeypatch.setattr(phi2_server, "GRAMMAR_BACKLOG", 3)
    client = await make_client(lambda: held)
    try:
        compiles = [asyncio.create_task(client.post("/generate", json={"prompt": "Hi", "regex": f"[0-9]{{{i}}}"})) for i in range(1, 4)]
        await wait_until(lambda: held.started == phi2_server.GRAMMAR_WORKERS)
        # Every compiler thread is busy and the backlog full: a plain request is tokenized and
        # served at once, and one more grammar is told to come back later.
        response = await client.post("/generate", json={"prompt": "The quick brown", "max_tokens": 4})
        assert response.status == 200
        response = await client.post("/generate", json={"prompt": "Hi", "regex": "[a-z]+"})
        body = await response.json()
        assert (response.status, body["error"]["field"], response.headers["Retry-After"]) == (503, "regex", "5"), body
    finally:
        release.set()
    assert [r.status for r in await asyncio.gather(*compiles)] == [200, 200, 200]
