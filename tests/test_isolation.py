"""One client must not be able to hurt another (issue 25): each case a careless or hostile
client was seen to get through, reproduced against the real app on both runtimes, with what
it must answer now and what its neighbours must still get."""

from __future__ import annotations

import asyncio
import json
import socket
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
    {
        "type": "object",
        "properties": {f"p{i}": {"type": "integer"} for i in range(500)},
    },  # "Current row has 2007 items"
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
    chat = {
        "messages": [{"role": "user", "content": "Hi"}],
        "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}},
    }
    response = await client.post("/v1/chat/completions", json=chat)
    body = await response.json()
    assert (response.status, body["error"]["param"]) == (400, "response_format.json_schema.schema"), body


# -- grammars: one that fails while generating ends its own sequence alone ------------------------

# It compiles (its first tokens are fine), then fails where the model must open "o": the object
# of 500 optional properties is past llguidance's row limit. A string of at most 3 characters
# comes first, so the failure comes within a dozen tokens, whatever the model writes.
FAILS_LATER = {
    "type": "object",
    "properties": {
        "a": {"type": "string", "maxLength": 3},
        "o": {"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(500)}},
    },
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

    chat = {
        "messages": [{"role": "user", "content": "Hi"}],
        "max_tokens": 60,
        "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": FAILS_LATER}},
    }
    response = await client.post("/v1/chat/completions", json=chat)
    body = await response.json()
    assert (response.status, body["error"]["param"]) == (400, "response_format.json_schema.schema"), body

    response = await client.post(
        "/generate/stream", json={"prompt": "Hi", "json_schema": FAILS_LATER, "max_tokens": 60}
    )
    last = json.loads((await response.read()).decode().splitlines()[-1])
    assert last["finish_reason"] == "error" and last["error"]["type"] == "invalid_request", last
    response = await client.post("/v1/chat/completions", json={**chat, "stream": True})
    events = [line for line in (await response.read()).decode().split("\n\n") if line.startswith("data: {")]
    error = json.loads(events[-1][len("data: ") :])["error"]
    assert (error["type"], error["param"]) == ("invalid_request_error", "response_format.json_schema.schema"), error

    if max_batch > 1:
        assert not neighbour.done() and gate.holding == 1  # still in flight beside all of them
        gate.release()
        assert await neighbour == reference  # its text unchanged
    await wait_idle(engine)
    assert engine.stats.errors == 4
    assert not [line for line in read_log(log_dir) if line["status"] >= 500]


# -- grammars: their cost stays off the generation thread -----------------------------------------


async def test_no_grammar_work_runs_on_the_generation_thread(make_client, backend, monkeypatch):
    """Compiling, and each sequence's copy of the grammar (a large one takes seconds, then a
    while), happen on pools; the generation thread only reads masks computed elsewhere."""
    from backends.decoding import grammar

    threads = []
    for name in ("compile", "cached"):
        monkeypatch.setattr(grammar.Grammars, name, recording(getattr(grammar.Grammars, name), threads))
    monkeypatch.setattr(grammar.Grammar, "matcher", recording(grammar.Grammar.matcher, threads))
    client = await make_client(lambda: backend)
    schema = {
        "type": "object",
        "properties": {"n": {"type": "integer"}},
        "required": ["n"],
        "additionalProperties": False,
    }
    response = await client.post("/generate", json={"prompt": "Hi", "json_schema": schema, "max_tokens": 20})
    assert response.status == 200
    response = await client.post(
        "/v1/completions", json={"prompt": "Hi", "n": 3, "max_tokens": 20, "response_format": {"type": "json_object"}}
    )
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

    def constraint(self, kind, spec, owner=""):
        self.started += 1
        self.release.wait(60)
        return self.inner.constraint(kind, spec, owner)

    def cached_constraint(self, kind, spec, owner=""):
        return None


async def test_slow_compiles_hold_neither_requests_nor_tokenizing(make_client, backend, monkeypatch):
    import phi2_server

    release = threading.Event()
    held = HeldCompiles(backend, release)
    monkeypatch.setattr(phi2_server, "GRAMMAR_BACKLOG", 3)
    client = await make_client(lambda: held)
    try:
        compiles = [
            asyncio.create_task(client.post("/generate", json={"prompt": "Hi", "regex": f"[0-9]{{{i}}}"}))
            for i in range(1, 4)
        ]
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


# -- slow and stalled clients ----------------------------------------------------------------------


def raw_connection(client, rcvbuf: int | None = None) -> socket.socket:
    sock = socket.socket()
    if rcvbuf:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    sock.connect((client.server.host, client.server.port))
    return sock


async def closed_by_server(sock: socket.socket) -> bytes:
    """Everything the server sends until it closes the connection (a hang fails the test)."""

    def read() -> bytes:
        sock.settimeout(60)
        data = b""
        while chunk := sock.recv(65536):
            data += chunk
        return data

    try:
        return await asyncio.to_thread(read)
    finally:
        sock.close()


@pytest.mark.parametrize(
    "sent", [b"", b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Le"], ids=["nothing", "half-headers"]
)
async def test_a_connection_that_never_finishes_its_headers_is_closed(make_client, backend, sent):
    client = await make_client(lambda: backend, idle_timeout=0.2)
    sock = raw_connection(client)
    sock.sendall(sent)
    assert await closed_by_server(sock) == b""


async def test_a_body_that_stops_arriving_is_answered_408(make_client, backend, log_dir):
    client = await make_client(lambda: backend, body_timeout=0.2)
    sock = raw_connection(client)
    sock.sendall(
        b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n"
        b'{"prompt": '
    )
    answer = await closed_by_server(sock)
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 408"), answer
    assert "BODY_TIMEOUT" in json.loads(body)["error"]["message"]
    assert [line["status"] for line in read_log(log_dir) if line["path"] == "/generate"] == [408]


STALLED = json.dumps(
    {
        "messages": [{"role": "user", "content": "Hi"}],
        "n": 16,
        "max_tokens": 480,
        "ignore_eos": True,
        "logprobs": True,
        "top_logprobs": 20,
        "stream": True,
    }
).encode()


def send_stalled(client) -> socket.socket:
    """~9 MB of answer for a client that reads none of it: more than any socket buffers (a 4 KiB
    receive buffer here; the server's send buffer grows to 4 MiB at most), so the handler's
    write blocks once they are full."""
    sock = raw_connection(client, rcvbuf=4096)
    sock.sendall(
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n%s" % (len(STALLED), STALLED)
    )
    return sock


# Filling a socket's buffers takes thousands of tokens: these run batched, once a runtime.
RUNTIMES = pytest.mark.parametrize("runtime", ["torch", "mlx"])


@RUNTIMES
async def test_a_stream_whose_client_stops_reading_stops_being_generated(make_client, request, runtime, log_dir):
    backend = request.getfixturevalue(f"{runtime}_backend")
    client = await make_client(lambda: backend, write_timeout=0, stream_buffer=32, max_batch=4)
    engine = engine_of(client)
    sock = send_stalled(client)
    # No write timeout here: only the buffer can end the choices that the socket cannot take.
    await wait_until(lambda: engine.stats.completed + engine.stats.cancelled == 16)
    assert engine.stats.cancelled >= 1 and engine.stats.tokens_generated < 16 * 480
    response = await client.post("/generate", json={"prompt": "The quick brown", "max_tokens": 4})
    assert response.status == 200  # its neighbours are served meanwhile
    sock.close()
    await wait_until(lambda: any(line["path"] == "/v1/chat/completions" for line in read_log(log_dir)))
    (line,) = [line for line in read_log(log_dir) if line["path"] == "/v1/chat/completions"]
    assert line["status"] == 499, line


@RUNTIMES
async def test_a_client_that_stops_reading_is_dropped_after_the_write_timeout(make_client, request, runtime, log_dir):
    backend = request.getfixturevalue(f"{runtime}_backend")
    client = await make_client(lambda: backend, write_timeout=0.3, max_batch=4)
    engine = engine_of(client)

    async def stalled_line(path: str) -> dict:
        await wait_until(lambda: any(line["path"] == path for line in read_log(log_dir)))
        (line,) = [line for line in read_log(log_dir) if line["path"] == path]
        return line

    sock = send_stalled(client)
    line = await stalled_line("/v1/chat/completions")  # while the client still reads nothing
    assert line["status"] == 499 and "WRITE_TIMEOUT" in line["error"], line
    await wait_idle(engine)
    assert engine.stats.tokens_generated < 16 * 480
    await dropped(sock)
    # A whole answer waits for its reader just as long.
    sock = raw_connection(client, rcvbuf=4096)
    body = json.dumps({**json.loads(STALLED), "stream": False}).encode()
    sock.sendall(
        b"POST /v1/chat/completions?whole HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body)
    )
    await wait_until(lambda: len([line for line in read_log(log_dir) if line["path"] == "/v1/chat/completions"]) == 2)
    line = read_log(log_dir)[-1]
    assert line["status"] == 499 and "WRITE_TIMEOUT" in line["error"], line
    await dropped(sock)


async def dropped(sock: socket.socket) -> None:
    """The server has aborted the connection: what it had sent is readable, then the end."""
    try:
        await closed_by_server(sock)
    except ConnectionResetError:
        pass


# -- one request cannot hold the worker ------------------------------------------------------------


def big(sequence) -> bool:
    return sequence.max_new_tokens == 60


async def test_a_request_of_many_sequences_leaves_a_slot_for_the_next(make_client, backend):
    gate = Gate(after=1, held=big)
    client = await make_client(lambda: GatedBackend(backend, gate), max_batch=8)
    engine = engine_of(client)
    many = asyncio.create_task(
        client.post("/v1/completions", json={"prompt": "Once upon", "n": 16, "max_tokens": 60, "ignore_eos": True})
    )
    # 7 of its 16 sequences run (the eighth slot stays for whoever comes next), all held.
    await wait_until(lambda: gate.holding == 7 and engine.waiting == 9)
    small = await client.post("/generate", json={"prompt": "The quick brown", "max_tokens": 4})
    assert small.status == 200 and not many.done()
    gate.release()
    assert (await many).status == 200


async def test_requests_take_turns_for_free_slots(make_client, backend):
    """With 4 slots (no reserve), a request queued behind a 16-sequence one gets the next free
    slot, not the one after its 16 sequences."""
    gate = Gate(after=1, held=big)
    client = await make_client(lambda: GatedBackend(backend, gate), max_batch=4)
    engine = engine_of(client)
    many = asyncio.create_task(
        client.post("/v1/completions", json={"prompt": "Once upon", "n": 16, "max_tokens": 60, "ignore_eos": True})
    )
    await wait_until(lambda: gate.holding == 4 and engine.waiting == 12)
    small = asyncio.create_task(client.post("/generate", json={"prompt": "The quick brown", "max_tokens": 4}))
    await wait_until(lambda: engine.waiting == 13)
    gate.release()
    done, _ = await asyncio.wait([many, small], return_when=asyncio.FIRST_COMPLETED)
    assert done == {small}  # it had its turn after the first 4 of 16, while 12 more were to come
    assert (await small).status == 200 and (await many).status == 200


async def test_sequences_times_tokens_are_bounded_per_request(make_client, backend):
    client = await make_client(lambda: backend)
    body = {"prompt": ["Once upon"] * 4, "best_of": 16, "max_tokens": 510, "ignore_eos": True}
    response = await client.post("/v1/completions", json=body)
    error = (await response.json())["error"]
    assert (response.status, error["param"]) == (400, "max_tokens") and "MAX_REQUEST_TOKENS" in error["message"], error
    client = await make_client(lambda: backend, max_request_tokens=40)
    body = {"prompt": ["Once upon"] * 4, "n": 2, "max_tokens": 5, "ignore_eos": True}  # 8 sequences x 5 tokens
    assert (await client.post("/v1/completions", json=body)).status == 200
    response = await client.post("/v1/completions", json={**body, "max_tokens": 6})
    assert response.status == 400
    # One sequence on the /v1 routes: its max_tokens is clipped to the limit, as to the context
    # (Claude Code asks 32,000 of any model: a 400 on a 32k-context one before); natively, a 422.
    model = (await (await client.get("/v1/models")).json())["data"][0]["id"]
    chat = {"model": model, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 32000, "ignore_eos": True}
    response = await client.post("/v1/messages", json=chat)
    answer = await response.json()
    assert response.status == 200 and response.headers["X-Max-Tokens-Granted"] == "40", answer
    assert answer["usage"]["output_tokens"] <= 40
    response = await client.post("/v1/chat/completions", json=chat)
    final = await response.json()
    assert response.status == 200 and response.headers["X-Max-Tokens-Granted"] == "40", final
    assert final["usage"]["completion_tokens"] <= 40, final
    response = await client.post("/generate", json={"prompt": "Hi", "max_tokens": 41})
    assert response.status == 422 and "MAX_REQUEST_TOKENS" in (await response.json())["error"]["message"]


# -- the prompt cache is no side channel between keys ---------------------------------------------

SECRET = "System: the vault code is 7391. Never tell anyone.\nUser: hello"


async def cached_tokens(client, key: str | None, prompt: str, **body) -> int:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    response = await client.post("/generate", json={"prompt": prompt, "max_tokens": 1, **body}, headers=headers)
    assert response.status == 200, await response.text()
    return (await response.json())["cached_tokens"]


async def test_keys_share_no_cached_prompt(make_client, backend):
    guessers = [f"guesser-{i}" for i in range(3)]
    client = await make_client(lambda: backend, api_key=",".join(["alice-key", *guessers]))
    assert await cached_tokens(client, "alice-key", SECRET) == 0
    # Other keys' guesses at Alice's secret all miss, the right one too: none is told apart.
    for key, guess in zip(guessers, ("7391", "7390", "1234"), strict=False):
        assert await cached_tokens(client, key, SECRET.replace("7391", guess)) == 0
    assert await cached_tokens(client, guessers[2], SECRET.replace("7391", "1234")) > 0  # its own prompt, again
    assert await cached_tokens(client, "alice-key", SECRET) > 0


async def test_one_key_or_none_shares_the_cache_and_a_salt_parts_it(make_client, backend):
    client = await make_client(lambda: backend, api_key="only-key")
    assert await cached_tokens(client, "only-key", SECRET) == 0
    assert await cached_tokens(client, "only-key", SECRET) > 0
    client = await make_client(lambda: backend)
    assert await cached_tokens(client, None, SECRET) == 0
    assert await cached_tokens(client, None, SECRET, cache_salt="tenant-a") == 0
    assert await cached_tokens(client, None, SECRET, cache_salt="tenant-a") > 0
    assert await cached_tokens(client, None, SECRET, cache_salt="tenant-b") == 0
    chat = {"messages": [{"role": "user", "content": SECRET}], "max_tokens": 1, "cache_salt": "tenant-c"}
    for expected_hit in (False, True):
        usage = (await (await client.post("/v1/chat/completions", json=chat)).json())["usage"]
        assert (usage["prompt_tokens_details"]["cached_tokens"] > 0) == expected_hit


# -- the event loop stays free ----------------------------------------------------------------------


async def test_large_bodies_and_answers_are_handled_off_the_event_loop(make_client, backend, monkeypatch):
    """500,000 token ids took the loop 1.3-2.6 s to validate, and a 7 MB logprobs answer 1.6 s:
    both now run on a pool (shown by where they run, not by how long a machine takes)."""
    from backends.wire import openai_chat, schema

    threads: dict[str, list[str]] = {"check": [], "chat_logprobs": []}
    homes = {"check": schema, "chat_logprobs": openai_chat}  # where each is looked up when it runs
    for name, seen in threads.items():
        monkeypatch.setattr(homes[name], name, recording(getattr(homes[name], name), seen))
    client = await make_client(lambda: backend)
    loop_thread = threading.current_thread().name
    body = json.dumps({"prompt": [7] * 500_000, "max_tokens": 1}, separators=(",", ":"))  # 1 MB
    response = await client.post("/v1/completions", data=body)
    assert response.status == 400 and (await response.json())["error"]["code"] == "context_length_exceeded"
    assert threads["check"] and loop_thread not in threads["check"], threads
    chat = {
        "messages": [{"role": "user", "content": "Hi"}],
        "n": 4,
        "max_tokens": 8,
        "logprobs": True,
        "top_logprobs": 20,
    }
    assert (await client.post("/v1/chat/completions", json=chat)).status == 200
    assert threads["chat_logprobs"] and loop_thread not in threads["chat_logprobs"], threads
    small = await client.post(
        "/generate", json={"prompt": "Hi", "max_tokens": 1}
    )  # a small body stays on the loop, cheaply
    assert small.status == 200


async def test_only_a_short_prompt_is_tokenized_on_the_event_loop(make_client, backend, monkeypatch):
    """A request's first INLINE_ENCODE_CHARS characters of prompt text are encoded on the loop
    (cheaper than the hop to the pool); a longer prompt, and a list of short prompts past that
    budget, go to the pool."""
    import phi2_server

    client = await make_client(lambda: backend)
    seen: list[str] = []
    monkeypatch.setattr(backend, "encode", recording(backend.encode, seen))
    loop_thread = threading.current_thread().name
    short = "Hi " * 20
    long = "Hi " * (phi2_server.INLINE_ENCODE_CHARS // 3 + 1)
    many = [f"{i} {short}" for i in range(6)]  # 62 characters each: 4 within the budget
    for prompt, on_loop in [(short, 1), (long, 0), (many, 4)]:
        seen.clear()
        response = await client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 1})
        assert response.status == 200, await response.text()
        calls = len(prompt) if isinstance(prompt, list) else 1
        assert (seen.count(loop_thread), len(seen)) == (on_loop, calls), seen


@pytest.mark.parametrize("path, depth", [("/v1/chat/completions", 490), ("/generate", 990), ("/generate", 5000)])
async def test_deep_nesting_is_a_400_naming_it(make_client, backend, log_dir, path, depth):
    client = await make_client(lambda: backend)
    nested = "[" * depth + "]" * depth
    field = "metadata" if path.startswith("/v1") else "json_schema"
    raw = f'{{"messages": [{{"role": "user", "content": "Hi"}}], "prompt": "Hi", "{field}": {nested}}}'
    response = await client.post(path, data=raw)
    body = await response.json()
    assert response.status == 400 and "nested too deeply" in body["error"]["message"], body
    assert [line["status"] for line in read_log(log_dir)] == [400]


# -- headers, keys and the log -----------------------------------------------------------------------

KEY = "sekrit-key-4711"


async def raw_exchange(client, data: bytes) -> tuple[bytes, dict | None]:
    sock = raw_connection(client)
    sock.sendall(data)
    answer = await closed_by_server(sock)
    head, _, body = answer.partition(b"\r\n\r\n")
    return head, json.loads(body) if body else None


@pytest.mark.parametrize("ending", [b"\x01\r\n", b"\r\r\n", b"\n"], ids=["control", "cr", "bare-lf"])
async def test_a_malformed_authorization_header_shows_its_key_nowhere(make_client, backend, caplog, log_dir, ending):
    client = await make_client(lambda: backend, api_key=KEY)
    head, body = await raw_exchange(
        client, b"GET /model/info HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + KEY.encode() + ending + b"\r\n"
    )
    assert head.startswith(b"HTTP/1.") and b" 400 " in head.split(b"\r\n")[0], head
    assert body["error"]["message"].startswith("not a valid HTTP request"), body
    assert KEY not in json.dumps(body) and KEY not in caplog.text and KEY.encode() not in head
    assert KEY not in (log_dir / "requests.log").read_text()


async def test_headers_that_are_not_text_get_4xx_not_500(make_client, backend, log_dir):
    client = await make_client(lambda: backend, api_key=KEY)
    head, body = await raw_exchange(
        client, b"GET /model/info HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer sekr\xe9t\r\nConnection: close\r\n\r\n"
    )
    assert head.startswith(b"HTTP/1.1 401"), head
    gzip_lie = b"not gzip at all"
    head, body = await raw_exchange(
        client,
        b"POST /generate HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer %s\r\nContent-Encoding: gzip\r\n"
        b"Content-Length: %d\r\nConnection: close\r\n\r\n%s" % (KEY.encode(), len(gzip_lie), gzip_lie),
    )
    assert head.startswith(b"HTTP/1.1 400") and "cannot be read" in body["error"]["message"], (head, body)
    assert [line["status"] for line in read_log(log_dir)] == [401, 400]


async def test_the_request_log_escapes_what_terminals_act_on(make_client, backend, log_dir):
    client = await make_client(lambda: backend)
    prompt = "line\u0085break \u2028sep\u2029 csi\u009b2J osc\u009d0;x\u0007 rtl\u202egnp.exe del\x7f"
    assert (await client.post("/generate", json={"prompt": prompt, "max_tokens": 1})).status == 200
    assert (await client.get("/nope%C2%85%E2%80%A8%C2%9B")).status == 404
    raw = (log_dir / "requests.log").read_text(encoding="utf-8")
    assert not any(c in raw for c in "\u0085\u2028\u2029\u009b\u009d\u202e\x7f"), raw
    assert len(raw.splitlines()) == 2
    lines = read_log(log_dir)
    assert lines[0]["prompt"] == prompt[:100] and lines[1]["path"] == "/nope\u0085\u2028\u009b"


async def test_wrong_keys_are_rate_limited_per_address(make_client, backend, monkeypatch):
    import phi2_server

    monkeypatch.setattr(phi2_server, "AUTH_FAILURES_PER_MINUTE", 3)
    client = await make_client(lambda: backend, api_key=KEY)
    for _ in range(3):
        assert (await client.get("/model/info", headers={"Authorization": "Bearer guess"})).status == 401
    for headers in (
        {"Authorization": "Bearer guess"},
        {"Authorization": f"Bearer {KEY}"},
    ):  # the right key must wait too
        response = await client.get("/model/info", headers=headers)
        assert response.status == 429 and int(response.headers["Retry-After"]) >= 1
    assert (await client.get("/health")).status == 200


async def test_a_key_file_takes_comments_anywhere(make_client, backend, tmp_path):
    keys = tmp_path / "keys"
    keys.write_text("   # indented comment\nfile-key-aaaa   # Alice, since May\n\t#tabbed\nfile-key-bbbb\n")
    client = await make_client(lambda: backend, api_key_file=str(keys))
    for key, status in [
        ("file-key-aaaa", 200),
        ("file-key-bbbb", 200),
        ("# indented comment", 401),
        ("file-key-aaaa   # Alice, since May", 401),
        ("#tabbed", 401),
    ]:
        assert (await client.get("/model/info", headers={"Authorization": f"Bearer {key}"})).status == status, key
    keys.write_text("two words\n")
    with pytest.raises(ValueError, match="not one key") as error:
        await make_client(lambda: backend, api_key_file=str(keys))
    assert "two" not in str(error.value)


async def test_options_needs_a_key_but_a_cors_preflight_does_not(make_client, backend):
    client = await make_client(lambda: backend, api_key=KEY, cors_origins="https://app.example")
    assert (await client.options("/model/info")).status == 401
    preflight = {"Origin": "https://app.example", "Access-Control-Request-Method": "POST"}
    assert (await client.options("/generate", headers=preflight)).status == 204
    assert (await client.options("/generate", headers={**preflight, "Origin": "https://evil.example"})).status == 401


async def test_the_tokenizer_and_anthropic_routes_hurt_no_neighbour(make_client, backend, max_batch, log_dir):
    """Broken and hostile bodies on the routes added since (/tokenize, /detokenize, /v1/messages,
    count_tokens, tools, /v1/responses) while a neighbour is in flight on the same worker and key: each gets a 4xx in
    its API's shape, the biggest allowed tokenize is answered, and the neighbour's text is the
    one it gets alone."""
    reference = await neighbour_text(await make_client(lambda: backend))
    gate = Gate(after=1, held=unconstrained)
    client = await make_client(lambda: GatedBackend(backend, gate))
    engine = engine_of(client)
    if max_batch > 1:
        neighbour = asyncio.create_task(neighbour_text(client))
        await wait_until(lambda: gate.holding == 1)
    hello = [{"role": "user", "content": "Hi"}]
    broken = [
        ("/tokenize", {"prompt": "a" * 4_000_001}),
        ("/tokenize", {"messages": [{"role": "user", "content": [{"type": "image"}]}]}),
        ("/detokenize", {"tokens": [2**62]}),
        ("/detokenize", {"tokens": list(range(10)) + [-5]}),
        ("/v1/messages", {"model": "x" * 10_000, "max_tokens": 4, "messages": hello}),
        ("/v1/messages", {"model": backend.info.model, "max_tokens": 4, "messages": hello, "stop_sequences": [""]}),
        ("/v1/messages", {"model": backend.info.model, "max_tokens": 4, "messages": hello, "system": [{"x": 1}]}),
        ("/v1/messages/count_tokens", {"model": backend.info.model, "messages": []}),
        # tool calls and the Responses API (issue 28)
        (
            "/v1/chat/completions",
            {
                "messages": hello,
                "tools": [{"type": "function", "function": {"name": "f", "parameters": {"$ref": "#/$defs/f"}}}],
                "tool_choice": "required",
            },
        ),
        ("/v1/chat/completions", {"messages": hello, "tools": [{"type": "function", "function": {"name": "f"}}] * 129}),
        ("/v1/chat/completions", {"messages": [*hello, {"role": "tool", "tool_call_id": "x", "content": "y"}]}),
        (
            "/v1/chat/completions",
            {
                "messages": [
                    *hello,
                    {"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "[" * 5000}}]},
                ]
            },
        ),
        (
            "/v1/messages",
            {
                "model": backend.info.model,
                "max_tokens": 4,
                "messages": [{"role": "user", "content": [{"type": "tool_result"}]}],
            },
        ),
        ("/v1/responses", {"input": [{"type": "function_call_output", "call_id": "x", "output": "y"}]}),
        ("/v1/responses", {"input": "Hi", "previous_response_id": "resp_1"}),
        (
            "/v1/responses",
            {
                "input": [
                    {
                        "type": "function_call",
                        "call_id": "c",
                        "name": "f",
                        "arguments": '{"a": ' + "[" * 300 + "]" * 300 + "}",
                    }
                ]
            },
        ),
        (
            "/v1/responses",
            {
                "input": "Hi",
                "text": {
                    "format": {
                        "type": "json_schema",
                        "schema": {"type": "object", "properties": {"a": {"$ref": "#"}}, "required": ["a"]},
                    }
                },
            },
        ),
    ]
    for path, body in broken:
        response = await client.post(path, json=body)
        answer = await response.json()
        assert 400 <= response.status < 500, (path, response.status, answer)
        assert ("type" in answer and answer["type"] == "error") if "messages" in path else "param" in answer["error"]
    big = await client.post("/tokenize", json={"prompt": "ab " * 330_000})  # near MAX_BODY_BYTES (1 MiB)
    assert big.status == 200 and (await big.json())["count"] > 0
    if max_batch > 1:
        assert not neighbour.done() and gate.holding == 1  # still in flight beside all of them
        gate.release()
        assert await neighbour == reference
    await wait_idle(engine)
    assert not [line for line in read_log(log_dir) if line["status"] >= 500]
