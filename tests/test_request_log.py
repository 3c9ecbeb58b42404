"""The request log: one JSON line per request, written through rotation."""

from __future__ import annotations

import asyncio
import json
import logging

from conftest import wait_until

from phi2_server import REQUEST_LOG


def read_log(log_dir):
    lines = []
    for path in sorted(log_dir.glob("requests.log*")):
        lines += [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]
    return lines


async def test_one_line_per_request_with_the_documented_fields(client, log_dir):
    await client.get("/health")
    await client.get("/ready")
    await client.post("/generate", json={"prompt": "The quick brown", "max_tokens": 3})
    response = await client.post("/generate/stream", json={"prompt": "Once upon 😀" + "x" * 200, "max_tokens": 4})
    await response.read()
    await client.post("/generate", json={"prompt": 1})
    await client.get("/missing")
    lines = read_log(log_dir)
    assert [(line["method"], line["path"], line["status"]) for line in lines] == [
        ("GET", "/health", 200),
        ("GET", "/ready", 200),
        ("POST", "/generate", 200),
        ("POST", "/generate/stream", 200),
        ("POST", "/generate", 422),
        ("GET", "/missing", 404),
    ]
    for line in lines:
        assert {"ts", "method", "path", "status", "duration_ms"} <= set(line)
    generate, streamed = lines[2], lines[3]
    assert generate["prompt"] == "The quick brown"
    assert generate["tokens_used"] == 3
    assert streamed["prompt"] == ("Once upon 😀" + "x" * 200)[:100]
    assert streamed["tokens_used"] == 4
    assert 0 < streamed["ttfb_ms"] <= streamed["duration_ms"]
    assert "prompt" not in lines[0]
    assert "error" not in generate and lines[4]["error"].startswith("prompt"), lines[4]
    assert lines[5]["error"] == "Not Found: GET /missing"


async def test_prompts_stay_out_of_the_log_when_asked(make_client, backend, log_dir):
    client = await make_client(lambda: backend, log_prompts=False)
    await client.post("/generate", json={"prompt": "secret words", "max_tokens": 1})
    (line,) = read_log(log_dir)
    assert "prompt" not in line
    assert "secret" not in (log_dir / "requests.log").read_text()
    assert line["tokens_used"] == 1


async def test_log_rotates_without_losing_lines(make_client, backend, log_dir):
    client = await make_client(lambda: backend, log_max_bytes=600, log_backups=50)
    for _ in range(30):
        await client.get("/health")
    await client.post("/generate", json={"prompt": "The quick brown", "max_tokens": 2})
    files = list(log_dir.glob("requests.log*"))
    assert len(files) > 3
    assert len(read_log(log_dir)) == 31


async def test_log_directory_is_created_at_startup(make_client, backend, tmp_path):
    client = await make_client(lambda: backend)
    assert client.server.app[REQUEST_LOG].path.parent.is_dir()


async def test_a_request_aiohttp_cannot_parse_gets_its_line_and_no_traceback(client, log_dir, caplog):
    # A NUL byte in a header: aiohttp answers 400 itself, before any middleware runs.
    reader, writer = await asyncio.open_connection(client.host, client.port)
    writer.write(b"GET /health HTTP/1.1\r\nHost: x\r\nX-Odd: a\x00b\r\n\r\n")
    await writer.drain()
    status_line = await reader.readline()
    writer.close()
    assert b" 400 " in status_line
    await wait_until(lambda: len(read_log(log_dir)) == 1)
    (line,) = read_log(log_dir)
    assert line["status"] == 400 and line["request_id"]
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR or r.exc_info]
    assert (await client.get("/health")).status == 200
    assert [line["status"] for line in read_log(log_dir)] == [400, 200]


def test_a_client_that_leaves_after_the_last_event_had_a_whole_answer(live_server, backend, monkeypatch, log_dir):
    """A stream's client that closes as soon as it reads the last event (Codex does, at
    response.completed) got the whole answer: its log line says 200, not 499, even when the
    handler had not returned yet (here held after the last event, where the tool arguments'
    checks are awaited, until the client has gone)."""
    import socket
    import threading

    import phi2_server

    gone = threading.Event()
    real = phi2_server.settle_checks

    async def held(request):
        while not gone.is_set():
            await asyncio.sleep(0.01)
        await real(request)

    monkeypatch.setattr(phi2_server, "settle_checks", held)
    server = live_server(lambda: backend)
    host, port = server.url.removeprefix("http://").split(":")
    body = json.dumps({"prompt": "The quick brown", "max_tokens": 4, "temperature": 0, "stream": True})
    with socket.create_connection((host, int(port))) as conn:
        head = "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        head += f"Content-Length: {len(body)}\r\n\r\n"
        conn.sendall(head.encode() + body.encode())
        seen = b""
        while b"data: [DONE]" not in seen:
            seen += conn.recv(65536)
    gone.set()

    def logged():
        return [line for line in read_log(log_dir) if line["path"] == "/v1/completions"]

    asyncio.run(wait_until(lambda: logged()))
    line = logged()[0]
    assert line["status"] == 200 and line["finish_reason"] == "length", line
