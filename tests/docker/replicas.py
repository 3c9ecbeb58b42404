"""Replicas behind HAProxy, run and broken on purpose (issue 19; docs/deploying.md):
`make docker-replicas N=2` with the tiny model, then

1. spread: requests reach both replicas (each replica's own request log shows its share);
2. SIGTERM one replica under a steady load of non-streaming requests, then start it again:
   zero failed requests (it drains: /ready 503 first, DRAIN_DELAY, then the grace period);
3. SIGKILL one replica under load: only requests in flight on it may fail (counted), and the
   balancer stops routing to it (the time is measured and reported);
4. streams in flight on a SIGTERMed replica end with their final line, never a truncated one.

Run by .ci/run after tests/docker/e2e.sh (podman serving the Docker API). The load is bounded
in count and time, on the host's loopback only. Exit status 1 on any failure.
"""

from __future__ import annotations

import collections
import itertools
import json
import os
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PORT, STATS_PORT = int(os.environ.get("REPLICAS_PORT", 18200)), int(os.environ.get("REPLICAS_STATS_PORT", 18204))
PROJECT = "phi2-ci-replicas"
URL = f"http://127.0.0.1:{PORT}"
MAKE = ["make", "-s", f"DOCKER_PORT={PORT}", f"HAPROXY_STATS_PORT={STATS_PORT}", f"REPLICAS_PROJECT={PROJECT}"]
THREADS = 4  # clients of the steady load: at most this many requests are in flight at once


def fail(message: str) -> None:
    print(f"FAIL: {message}", file=sys.stderr)
    sys.exit(1)


def compose(*args: str) -> str:
    tool = (
        ["docker", "compose"]
        if subprocess.run(["docker", "compose", "version"], capture_output=True).returncode == 0
        else ["docker-compose"]
    )
    done = subprocess.run(
        [*tool, "-p", PROJECT, "-f", str(ROOT / "docker-compose.replicas.yml"), *args],
        capture_output=True,
        text=True,
        env={**os.environ, "DOCKER_PORT": str(PORT), "HAPROXY_STATS_PORT": str(STATS_PORT)},
    )
    if done.returncode != 0:
        fail(f"compose {' '.join(args)}: {done.stderr[-500:]}")
    return done.stdout


def docker(*args: str) -> str:
    done = subprocess.run(["docker", *args], capture_output=True, text=True)
    if done.returncode != 0:
        fail(f"docker {' '.join(args)}: {done.stderr[-500:]}")
    return done.stdout.strip()


def replicas() -> list[str]:
    return sorted(compose("ps", "-q", "phi2").split())


def up() -> int:
    """How many replicas HAProxy routes to now (its stats: server slots whose status is UP)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{STATS_PORT}/stats;csv", timeout=5) as response:
        lines = response.read().decode().splitlines()
    header = lines[0].lstrip("# ").split(",")
    rows = [dict(zip(header, line.split(","), strict=False)) for line in lines[1:] if line.startswith("phi2,replica")]
    return sum(row["status"] == "UP" for row in rows)


def wait(what: str, predicate, timeout: float = 180) -> float:
    """Seconds until `predicate()` holds; the timeout only turns a hang into a failure."""
    started = time.monotonic()
    while True:
        try:
            if predicate():
                return time.monotonic() - started
        except (OSError, ValueError):
            pass
        if time.monotonic() - started > timeout:
            fail(f"{what}: not within {timeout:.0f} s")
        time.sleep(0.2)


def generate(body: dict, headers: dict | None = None) -> tuple[int, dict]:
    request = urllib.request.Request(
        URL + "/generate",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json", **(headers or {})},
    )
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, {
                "X-Request-Id header": response.headers.get("X-Request-Id"),
                **json.loads(response.read()),
            }
    except urllib.error.HTTPError as error:
        # What answered matters when it fails: a replica's JSON error, or HAProxy's own page.
        return error.code, {"body": error.read()[:160].decode(errors="replace")}


def logged(container: str) -> list[dict]:
    done = subprocess.run(
        ["docker", "exec", container, "cat", "/var/log/phi2-server/requests.log"], capture_output=True, text=True
    )
    return [json.loads(line) for line in done.stdout.splitlines() if line.strip()]


def balancer_log(request_id: str) -> str:
    """HAProxy's log line for one request (httplog: the server, the retries as +N, the timers)."""
    lines = [line for line in balancer_lines() if request_id in line]
    return lines[-1] if lines else "(no line)"


def balancer_lines() -> list[str]:
    done = subprocess.run(["docker", "logs", *compose("ps", "-q", "balancer").split()], capture_output=True, text=True)
    return (done.stdout + done.stderr).splitlines()


def servers_changed() -> str:
    """The balancer's record of replicas going up and down, for a failure's message."""
    return "\n".join(line for line in balancer_lines() if "Server phi2/" in line)


class Load:
    """THREADS clients sending short non-streaming requests until stopped; failures are counted."""

    def __init__(self):
        self.counts: collections.Counter = collections.Counter()
        self.errors: list[str] = []
        self.ok_after: dict[float, bool] = {}
        self._stop = threading.Event()
        self._sent = itertools.count()
        self._threads = [threading.Thread(target=self._client, daemon=True) for _ in range(THREADS)]

    def _client(self) -> None:
        while not self._stop.is_set():
            sent, request_id = time.monotonic(), f"ci-load-{next(self._sent)}"
            try:
                status, answer = generate({"prompt": "Once upon", "max_tokens": 16}, {"X-Request-Id": request_id})
            except OSError as exc:
                status, answer = f"{type(exc).__name__}", {}
            self.counts["ok" if status == 200 else "failed"] += 1
            if status != 200:
                # The balancer's log line for it says which replica answered, after how many retries.
                self.errors.append(
                    f"{status} sent at {sent:.2f}: {answer.get('body', '')!r}; balancer: {balancer_log(request_id)}"
                )
                self.ok_after[sent] = False

    def __enter__(self) -> Load:
        for thread in self._threads:
            thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(60)


def main() -> int:
    env = {**os.environ, "PHI2_MODEL": "tiny"}
    started = time.monotonic()
    subprocess.run(MAKE + ["docker-replicas", "N=2"], check=True, env=env, cwd=ROOT)
    print(f"ok  make docker-replicas N=2: both up in {time.monotonic() - started:.0f} s (images built)")
    try:
        run()
    finally:
        subprocess.run(MAKE + ["docker-replicas-stop"], env=env, cwd=ROOT, capture_output=True)
    print("PASS: replicas behind HAProxy")
    return 0


def run() -> None:
    first, second = replicas()
    if len(replicas()) != 2:
        fail(f"{len(replicas())} replicas, expected 2")

    # 1. Spread, and one request id end to end.
    with Load() as load:
        time.sleep(3)
    shares = [sum(r["path"] == "/generate" for r in logged(c)) for c in (first, second)]
    if load.counts["failed"] or min(shares) == 0:
        fail(f"spread: {dict(load.counts)}, requests in each replica's log: {shares}")
    print(f"ok  spread: {load.counts['ok']} requests, {shares[0]} and {shares[1]} in the two replicas' request logs")
    status, answer = generate({"prompt": "Once upon", "max_tokens": 4}, {"X-Request-Id": "ci-replicas-1"})
    ids = [r.get("request_id") for c in (first, second) for r in logged(c)]
    if (
        status != 200
        or answer.get("X-Request-Id header") != "ci-replicas-1"
        or answer.get("request_id") != "ci-replicas-1"
        or "ci-replicas-1" not in ids
    ):
        fail(f"X-Request-Id: status {status}, answer {answer}")
    print("ok  X-Request-Id passes through the balancer to the replica's answer and request log")

    # 2. SIGTERM one replica under load, then start it again: nothing may fail.
    with Load() as load:
        time.sleep(2)
        stop_started = time.monotonic()
        docker("stop", "-t", "30", first)  # SIGTERM; compose gives it the same 30 s
        stopped_in = time.monotonic() - stop_started
        code = docker("inspect", "-f", "{{.State.ExitCode}}", first)
        out = up()  # it drained: the balancer took it out before it stopped
        docker("start", first)
        back_in = wait("the restarted replica back in rotation", lambda: up() == 2)
        time.sleep(2)
    if code != "0" or out != 1:
        fail(f"SIGTERM: the replica exited with status {code}; {out} replicas in rotation once it stopped")
    if load.counts["failed"]:
        fail(f"SIGTERM and restart under load: {dict(load.counts)}; {load.errors[:5]}\n{servers_changed()}")
    print(
        f"ok  SIGTERM under load: {load.counts['ok']} requests, 0 failed; "
        f"the replica drained and exited 0 in {stopped_in:.1f} s, "
        f"was back in rotation {back_in:.1f} s after its start"
    )

    # 3. SIGKILL one replica under load: only what was in flight on it may fail.
    with Load() as load:
        time.sleep(2)
        docker("kill", "-s", "KILL", second)
        out_in = wait("the killed replica out of rotation", lambda: up() == 1, timeout=60)
        failed_before = load.counts["failed"]
        time.sleep(3)
        failed_after = load.counts["failed"] - failed_before
    if load.counts["failed"] > THREADS or failed_after:
        fail(f"SIGKILL under load: {dict(load.counts)} ({failed_after} after it left the rotation); {load.errors[:5]}")
    print(
        f"ok  SIGKILL under load: {load.counts['ok']} requests, {load.counts['failed']} failed "
        f"(at most the {THREADS} in flight may); "
        f"out of rotation {out_in:.1f} s after the kill (checks: inter 1 s, fall 2), none failed after that"
    )
    docker("start", second)
    wait("the killed replica back", lambda: up() == 2)

    # 4. Streams in flight on a replica that gets SIGTERM end with their final line.
    def stream(results: list, index: int) -> None:
        request = urllib.request.Request(
            URL + "/generate/stream",
            data=json.dumps({"prompt": "Once upon", "max_tokens": 400, "ignore_eos": True}).encode(),
        )
        with urllib.request.urlopen(request, timeout=120) as response:
            results[index] = [line for line in response.read().decode().splitlines() if line]

    results: list = [None] * 8
    threads = [threading.Thread(target=stream, args=(results, i)) for i in range(len(results))]
    for thread in threads:
        thread.start()
    docker("stop", "-t", "30", first)
    for thread in threads:
        thread.join(120)
    ends = collections.Counter()
    for lines in results:
        last = json.loads(lines[-1]) if lines else {}
        if not last.get("done"):
            fail(f"a stream ended without its final line: {lines[-2:] if lines else lines}")
        ends[last["finish_reason"]] += 1
    if set(ends) - {"length", "shutdown"}:
        fail(f"streams ended with {dict(ends)}")
    print(f"ok  {len(results)} streams while a replica got SIGTERM: every one ended with its final line {dict(ends)}")
    docker("start", first)


if __name__ == "__main__":
    sys.exit(main())
