"""Graceful shutdown of the real server process on SIGTERM and SIGINT."""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
LONG = {"prompt": "Once upon", "max_tokens": 480, "ignore_eos": True}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_ready(process: subprocess.Popen, port: int, timeout: float, output) -> None:
    """Until the server process answers /ready with 200; `output()` is what it printed, for the
    failure that a process ending before then is."""
    deadline = time.monotonic() + timeout
    while True:
        assert process.poll() is None, output()
        with contextlib.suppress(OSError):
            connection = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
            connection.request("GET", "/ready")
            if connection.getresponse().status == 200:
                return
        assert time.monotonic() < deadline, "the server did not become ready"
        time.sleep(0.2)


@contextlib.contextmanager
def server_process(
    model: Path,
    log_dir: Path,
    backend: str,
    grace: float,
    max_batch: int = 1,
    release_on_shutdown: bool = False,
    drain_delay: float = 0.0,
    gate: str | None = None,
):
    """The server as a real process, its streams held after their first token (gated_server.py)."""
    port = free_port()
    env = {
        **os.environ,
        "PHI2_MODEL": str(model),
        "PHI2_BACKEND": backend,
        "PORT": str(port),
        "LOG_DIR": str(log_dir),
        "SHUTDOWN_GRACE": str(grace),
        "MAX_BATCH": str(max_batch),
        "ADAPTER_PATH": "",
        "GATE_RELEASE": gate or ("shutdown" if release_on_shutdown else "never"),
        "DRAIN_DELAY": str(drain_delay),
    }
    command = [sys.executable, str(ROOT / "tests" / "gated_server.py")]
    process = subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        wait_ready(process, port, 90, lambda: process.stdout.read().decode())
        yield process, port
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


def start_stream(port: int, body: dict):
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    connection.request("POST", "/generate/stream", body=json.dumps(body), headers={"Content-Type": "application/json"})
    response = connection.getresponse()
    assert response.status == 200
    return response


@pytest.mark.parametrize("runtime, max_batch", [("torch", 1), ("torch", 8), ("mlx", 1), ("mlx", 8)])
def test_sigterm_ends_a_running_stream_with_a_final_line_and_exits_0(tiny_path, tmp_path, runtime, max_batch):
    log_dir = tmp_path / "logs"
    with server_process(tiny_path, log_dir, runtime, grace=0.2, max_batch=max_batch) as (process, port):
        responses = [start_stream(port, LONG) for _ in range(min(max_batch, 2))]
        for response in responses:
            assert "token" in json.loads(response.readline())
        connection = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
        connection.request("GET", "/health")
        assert json.loads(connection.getresponse().read())["queue"]["active"] == len(responses)
        process.send_signal(signal.SIGTERM)
        for response in responses:
            lines = [json.loads(line) for line in response.read().splitlines()]
            assert lines[-1]["done"] is True
            assert lines[-1]["finish_reason"] == "shutdown"
            assert lines[-1]["tokens_used"] == 1  # held at the gate since its first token
        assert process.wait(timeout=60) == 0
        output = process.stdout.read().decode()
    assert "Traceback" not in output
    log_lines = [json.loads(line) for line in (log_dir / "requests.log").read_text().splitlines()]
    for line in log_lines[-len(responses) :]:
        assert line["path"] == "/generate/stream"
        assert line["finish_reason"] == "shutdown"


def test_sigint_lets_in_flight_generations_finish_within_the_grace_period(tiny_path, tmp_path):
    with server_process(tiny_path, tmp_path / "logs", "torch", grace=60, release_on_shutdown=True) as (process, port):
        response = start_stream(port, {**LONG, "max_tokens": 200})
        response.readline()  # in flight, held after its first token until the shutdown begins
        process.send_signal(signal.SIGINT)
        deadline = time.monotonic() + 60
        while True:  # the listening socket closes first
            try:
                connection = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
                connection.request("GET", "/health")
                connection.getresponse().read()
            except OSError:
                break
            assert time.monotonic() < deadline, "the server kept accepting connections"
            time.sleep(0.05)
        lines = [json.loads(line) for line in response.read().splitlines()]
        assert lines[-1]["finish_reason"] == "length"
        assert lines[-1]["tokens_used"] == 200
        assert process.wait(timeout=60) == 0


def get(port: int, path: str) -> tuple[int, dict]:
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    connection.request("GET", path)
    response = connection.getresponse()
    return response.status, json.loads(response.read())


def test_with_a_drain_delay_sigterm_turns_ready_503_first_and_keeps_serving(tiny_path, tmp_path):
    """Behind a load balancer: on SIGTERM /ready fails at once, so its health checks take the
    server out, while requests that still arrive are served. (The delay is an hour: the test ends
    it with a second signal, which exits at once.)"""
    with server_process(tiny_path, tmp_path / "logs", "torch", grace=5, drain_delay=3600, gate="open") as (
        process,
        port,
    ):
        assert get(port, "/ready") == (200, {"ready": True, "status": "ok", "draining": False})
        process.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 60
        while get(port, "/ready")[0] != 503:
            assert time.monotonic() < deadline, "/ready never turned 503"
            time.sleep(0.05)
        assert get(port, "/ready") == (503, {"ready": False, "status": "ok", "draining": True})
        assert get(port, "/health")[0] == 200  # alive: a liveness probe must not restart it
        connection = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
        connection.request(
            "POST", "/generate", body=json.dumps({"prompt": "Once upon", "max_tokens": 5, "ignore_eos": True})
        )
        response = connection.getresponse()
        assert response.status == 200 and json.loads(response.read())["tokens_used"] == 5
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=60) == 130


def test_after_the_drain_delay_the_server_drains_and_exits_0(tiny_path, tmp_path):
    with server_process(tiny_path, tmp_path / "logs", "torch", grace=0.2, drain_delay=0.2) as (process, port):
        response = start_stream(port, LONG)
        assert "token" in json.loads(response.readline())  # held after its first token
        process.send_signal(signal.SIGTERM)
        lines = [json.loads(line) for line in response.read().splitlines()]
        assert lines[-1]["done"] is True and lines[-1]["finish_reason"] == "shutdown"
        assert process.wait(timeout=60) == 0
        output = process.stdout.read().decode()
    assert "draining: /ready answers 503" in output and "Traceback" not in output
