"""No request can take the server down (issue 65): small hostile requests against the real
server process, on each runtime, where a crash would end that process and not the tests. Each
must get a 4xx or a bounded answer while /health keeps answering and a greedy neighbour's text
stays the same; then the process must still be alive.
"""

from __future__ import annotations

import asyncio
import contextlib
import http.client
import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from test_shutdown import free_port, wait_ready

ROOT = Path(__file__).resolve().parent.parent
MESSAGES = [{"role": "user", "content": "Hi"}]
NEIGHBOUR = {"prompt": "Once upon", "max_tokens": 12, "temperature": 0}


def ref_chain(levels: int, at: str = "#") -> dict:
    """A schema whose `$ref`s chain through `levels` `$defs` (`at`: where the `$defs` sit)."""
    defs = {f"d{i}": {"$ref": f"{at}/$defs/d{i + 1}"} for i in range(levels)}
    defs[f"d{levels}"] = {"type": "integer"}
    return {"type": "object", "properties": {"a": {"$ref": f"{at}/$defs/d0"}}, "required": ["a"], "$defs": defs}


def lark_chain(rules: int) -> str:
    """A Lark grammar of `rules` rules, each nesting the next in parentheses."""
    lines = [f'r{i}: "(" r{i + 1} ")"' for i in range(rules)]
    return "start: r0\n" + "\n".join(lines) + f'\nr{rules}: "x"\n'


DEEP = ref_chain(3000)  # each of these overflowed llguidance's stack: SIGSEGV, the process gone
DEEP_LARK = lark_chain(20000)
# Every surface a schema or a grammar comes in by: (path, body, the field a 4xx names).
SURFACES = {
    "generate": ("/generate", {"prompt": "Hi", "max_tokens": 4, "json_schema": DEEP}, "json_schema"),
    "chat response_format": (
        "/v1/chat/completions",
        {
            "messages": MESSAGES,
            "max_tokens": 4,
            "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": DEEP}},
        },
        "response_format.json_schema.schema",
    ),
    "function tool": (
        "/v1/chat/completions",
        {
            "messages": MESSAGES,
            "max_tokens": 4,
            "tool_choice": "required",
            "tools": [
                {"type": "function", "function": {"name": "f", "parameters": ref_chain(3000, "#/properties/arguments")}}
            ],
        },
        "tools",
    ),
    "custom tool": (
        "/v1/chat/completions",
        {
            "messages": MESSAGES,
            "max_tokens": 4,
            "tool_choice": "required",
            "tools": [
                {
                    "type": "custom",
                    "custom": {
                        "name": "c",
                        "format": {"type": "grammar", "grammar": {"syntax": "lark", "definition": DEEP_LARK}},
                    },
                }
            ],
        },
        "tools",
    ),
    "responses text.format": (
        "/v1/responses",
        {
            "input": "Hi",
            "max_output_tokens": 4,
            "text": {"format": {"type": "json_schema", "name": "x", "schema": DEEP}},
        },
        "text.format.schema",
    ),
    "messages output_config": (
        "/v1/messages",
        {"messages": MESSAGES, "max_tokens": 4, "output_config": {"format": {"type": "json_schema", "schema": DEEP}}},
        "output_config.format.schema",
    ),
    # 24 characters that hold ~150 MB once compiled: past GRAMMAR_MEMORY, refused.
    "regex memory": ("/generate", {"prompt": "Hi", "max_tokens": 4, "regex": "((a{10}){10}){2900}c"}, "regex"),
}


def neighbour(port: int) -> str:
    status, answer = call(port, "POST", "/generate", NEIGHBOUR)
    assert status == 200, answer
    return answer["text"]


def call(port: int, method: str, path: str, body: dict | None = None, timeout: float = 120) -> tuple[int, dict]:
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        data = None if body is None else json.dumps(body)
        connection.request(method, path, body=data, headers={"Content-Type": "application/json"})
        response = connection.getresponse()
        return response.status, json.loads(response.read() or b"{}")
    finally:
        connection.close()


class Health(threading.Thread):
    """/health asked over and over on a connection of its own until stopped; what failed is kept
    (a stalled loop shows as a timeout, a dead process as a refused connection)."""

    def __init__(self, port: int):
        super().__init__(daemon=True)
        self.port = port
        self.answered = 0
        self.failures: list[str] = []
        self.stop = threading.Event()

    def run(self) -> None:
        while not self.stop.is_set():
            try:
                status, _ = call(self.port, "GET", "/health", timeout=30)
                self.answered += 1
                if status != 200:
                    self.failures.append(f"status {status}")
            except OSError as exc:
                self.failures.append(repr(exc))
                return
            self.stop.wait(0.02)


@pytest.fixture(scope="module", params=["torch", "mlx"])
def hostile_server(request, tiny_path, tmp_path_factory):
    """The real server process on the tiny model: (process, port)."""
    port = free_port()
    env = {
        **os.environ,
        "PHI2_MODEL": str(tiny_path),
        "PHI2_BACKEND": request.param,
        "PORT": str(port),
        "LOG_DIR": str(tmp_path_factory.mktemp("hostile-logs")),
        "ADAPTER_PATH": "",
        "SERVED_MODEL_NAME": "tiny",
        "MAX_BATCH": "4",
    }
    process = subprocess.Popen(
        [sys.executable, "phi2_server.py"], cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
    )
    try:
        wait_ready(process, port, 180, lambda: process.stderr.read().decode())
        yield process, port
    finally:
        process.terminate()
        try:
            process.wait(30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


@contextlib.contextmanager
def watched(process, port: int):
    """/health probed throughout; afterwards it answered every time, and the process lives."""
    health = Health(port)
    health.start()
    try:
        yield health
    finally:
        health.stop.set()
        health.join(60)
    assert health.failures == [] and health.answered > 0
    assert process.poll() is None, f"the server died: exit {process.returncode}"


@pytest.mark.parametrize("surface", list(SURFACES))
def test_a_grammar_that_crashed_the_compiler_is_a_400(hostile_server, surface):
    process, port = hostile_server
    path, body, field = SURFACES[surface]
    body = {"model": "tiny", **body} if path.startswith("/v1") else body
    before = neighbour(port)
    with watched(process, port):
        for _ in range(2):  # the second time from the refusals remembered
            status, answer = call(port, "POST", path, body)
            assert status in (400, 422), answer
            text = json.dumps(answer)
            assert field in text and ("too deep" in text or "memory" in text), answer
    assert neighbour(port) == before


# -- in process: the cache's bytes, keys' shares, and the full-schema check of arguments -----------


@pytest.fixture(scope="module")
def grammars(tiny_path):
    from transformers import AutoTokenizer

    from backends.decoding.grammar import Grammars
    from backends.decoding.guard import CompileGuard
    from backends.torch.tiny import MODEL_VOCAB

    compiled = Grammars(AutoTokenizer.from_pretrained(tiny_path), MODEL_VOCAB, guard=CompileGuard)
    yield compiled
    compiled.close()


def test_the_grammar_cache_counts_the_bytes_grammars_hold(grammars, monkeypatch):
    """A regex of 20 characters holds megabytes: the guard measures them, the cache counts them,
    and stays within GRAMMAR_CACHE_BYTES; a key's grammars are its own, and its share is a quarter."""
    import backends.decoding.grammar as grammar_module

    small = grammars.compile("regex", "[0-9]{3}", "k1")
    big = grammars.compile("regex", "((a{10}){10}){200}c", "k1")
    assert big.size > 50 * small.size and big.size > 1 << 20  # bytes held, not characters
    assert grammars.cached("regex", "[0-9]{3}", "k2") is None  # another key's is not seen
    monkeypatch.setattr(grammar_module, "GRAMMAR_CACHE_BYTES", 4 * big.size)
    for n in range(201, 206):  # each ~the same size: k1 keeps its share, one (the newest) at least
        grammars.compile("regex", f"((a{{10}}){{10}}){{{n}}}c", "k1")
        held = [key for key in grammars._cache if key[0] == "k1"]
        assert grammars._owned["k1"] <= grammar_module.GRAMMAR_CACHE_BYTES // 4 or len(held) == 1
    assert grammars.cached("regex", "((a{10}){10}){205}c", "k1") is not None
    grammars.compile("regex", "[0-9]{3}", "k2")
    assert grammars.cached_bytes <= grammar_module.GRAMMAR_CACHE_BYTES
    assert grammars.cached("regex", "[0-9]{3}", "k2") is not None  # k1's grammars evicted k1's own


def test_a_crashing_compile_is_refused_and_its_child_replaced(grammars):
    from backends.contract import GrammarError

    started = grammars._guard.started
    with pytest.raises(GrammarError, match="too deep"):
        grammars.compile("json_schema", json.dumps(ref_chain(3000)), "k3")
    with pytest.raises(GrammarError, match="too deep"):  # remembered: no child dies for it again
        grammars.compile("json_schema", json.dumps(ref_chain(3000)), "k3")
    assert grammars.compile("json_schema", json.dumps(ref_chain(100)), "k3").size > 0  # a new child
    assert grammars._guard.started == started + 1
    with pytest.raises(GrammarError, match="did not compile within"):  # no time at all: its child is ended
        grammars.compile("regex", "[a-z]{5}@[0-9]{3}", "k3", timeout=0)
    assert grammars.compile("regex", "[a-z]{5}@[0-9]{3}", "k3").size > 0  # not remembered: time may be the load's
    assert grammars._guard.started == started + 2


@pytest.mark.parametrize("pattern", [r"^(a|a)*$", r"^(a|aa)+$"])
def test_a_catastrophic_pattern_ends_the_argument_check(pattern):
    """Python's `re` takes hours on these (holding the GIL); the check gives up within its
    budget and says nothing of the call, and still names a plain mismatch."""
    from backends.chat.tools import argument_error

    schema = {"type": "object", "properties": {"a": {"type": "string", "pattern": pattern}}}
    assert argument_error(schema, json.dumps({"a": "a" * 60 + "b"})) is None
    assert "does not match" in argument_error(schema, json.dumps({"a": "b"}))
    assert argument_error(schema, json.dumps({"a": "aa"})) is None
    keyed = {"type": "object", "patternProperties": {pattern: {"type": "integer"}}, "additionalProperties": False}
    assert argument_error(keyed, json.dumps({"a" * 60 + "b": 1})) is None
    assert "is not of type" in argument_error(keyed, json.dumps({"aa": "x"}))


def test_a_process_that_dies_says_why_and_what_it_was_serving(tiny_path, tmp_path):
    """A fault in native code: fault.log has every thread's stack and the request ids in flight,
    and the next start sets it aside and says so."""
    import signal

    from test_shutdown import server_process

    log_dir = tmp_path / "logs"
    with server_process(tiny_path, log_dir, "torch", grace=0.2) as (process, port):
        connection = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
        body = json.dumps({"prompt": "Once upon", "max_tokens": 40, "ignore_eos": True})
        connection.request("POST", "/generate/stream", body=body, headers={"X-Request-Id": "the-held-one"})
        response = connection.getresponse()
        assert "token" in json.loads(response.readline())  # held at the gate after its first token
        head = (log_dir / "fault.log").read_bytes()[:4096].decode()
        assert "the-held-one" in head
        process.send_signal(signal.SIGSEGV)
        assert process.wait(60) == -signal.SIGSEGV
    written = (log_dir / "fault.log").read_text()
    assert "requests in flight: the-held-one" in written
    assert "Segmentation fault" in written and "Thread 0x" in written and "File " in written
    with server_process(tiny_path, log_dir, "torch", grace=0.2) as (process, port):
        kept = list(log_dir.glob("fault-*.log"))
        assert len(kept) == 1 and "the-held-one" in kept[0].read_text()
        assert "requests in flight:" in (log_dir / "fault.log").read_text()  # this process's, none yet
        process.send_signal(signal.SIGTERM)
        assert process.wait(60) == 0
        said = process.stdout.read().decode()
    assert "ended without shutting down" in said and "the-held-one" in said
    assert not (log_dir / "fault.log").exists()  # a clean exit leaves none


def gzip_bomb(megabytes: int) -> bytes:
    """A gzip body of ~1 KB a MB of JSON it inflates to."""
    import zlib

    packer = zlib.compressobj(9, zlib.DEFLATED, 31)
    parts = [packer.compress(b'{"prompt": "')]
    parts += [packer.compress(b"a" * (1 << 20)) for _ in range(megabytes)]
    return b"".join([*parts, packer.compress(b'"}'), packer.flush()])


def test_gzip_bombs_are_a_413_and_stall_nothing(hostile_server):
    """Four bodies of 1 GiB of JSON, gzipped to ~1 MB each: aiohttp inflated them on the loop (and
    drained them after the 413), 6-9 s of /health's time; each is now refused at MAX_BODY_BYTES."""
    from concurrent.futures import ThreadPoolExecutor

    process, port = hostile_server
    bomb = gzip_bomb(1024)
    assert len(bomb) <= 1 << 20  # within MAX_BODY_BYTES as sent

    def send(_) -> tuple[int, dict]:
        connection = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
        headers = {"Content-Encoding": "gzip", "Content-Type": "application/json"}
        connection.request("POST", "/generate", body=bomb, headers=headers)
        response = connection.getresponse()
        return response.status, json.loads(response.read())

    before = neighbour(port)
    with watched(process, port), ThreadPoolExecutor(4) as pool:
        answers = list(pool.map(send, range(4)))
    for status, answer in answers:
        assert status == 413 and "decompresses past MAX_BODY_BYTES" in answer["error"]["message"], answer
    assert neighbour(port) == before


def test_compressed_bodies_are_read_within_the_limit():
    import gzip
    import zlib

    from backends.wire.bodies import TooLarge, Unreadable, decoded

    body = json.dumps({"prompt": "x" * 1000}).encode()
    assert decoded(gzip.compress(body), "gzip", len(body)) == body
    assert decoded(gzip.compress(body[:10]) + gzip.compress(body[10:]), "x-gzip", len(body)) == body  # two members
    assert decoded(zlib.compress(body), "deflate", len(body)) == body
    raw = zlib.compressobj(6, zlib.DEFLATED, -15)
    assert decoded(raw.compress(body) + raw.flush(), "Deflate", len(body)) == body  # raw deflate, as some send
    assert decoded(body, "identity", len(body)) == body
    with pytest.raises(TooLarge):
        decoded(gzip.compress(body), "gzip", len(body) - 1)
    with pytest.raises(TooLarge):
        decoded(gzip_bomb(64), "gzip", 1 << 20)
    with pytest.raises(Unreadable, match="not gzip"):
        decoded(b"not gzip at all", "gzip", 1 << 20)
    with pytest.raises(Unreadable, match="ends before"):
        decoded(gzip.compress(body)[:-20], "gzip", 1 << 20)
    with pytest.raises(Unreadable, match="not supported") as refused:
        decoded(body, "br", 1 << 20)
    assert refused.value.unsupported


@pytest.mark.parametrize("runtime", ["torch", "mlx"])
async def test_a_small_encode_request_is_not_stuck_behind_a_large_one(runtime, tmp_path):
    """A one-input rerank queued behind a 160-input one runs in the first forward: the worker takes
    an input of each waiting request a round (issue 65: it waited 15 s, in arrival order). The
    rerank's pairs are the tokenizer's own: the query tokenized once."""
    from backends.choose import load_encoder
    from backends.torch.tiny import write_tiny_reranker
    from backends.workers.encode import EncodeWorker

    reranker = load_encoder(runtime, "rerank", str(write_tiny_reranker(tmp_path / "reranker")), "cpu")
    documents = [f"document {i} about the sea and its depth" for i in range(160)]
    large = reranker.pairs("where is the sea?", documents, False)
    assert [item.ids for item in large] == [
        item.ids for item in reranker._pairs_one_by_one("where is the sea?", documents, False)
    ]
    width = max(len(item.ids) for item in large)
    worker = EncodeWorker(lambda: {"rerank": reranker}, lambda: 8, batch_tokens=8 * width, threads=1)
    finished = []
    big = worker.submit("rerank", large)
    small = worker.submit("rerank", reranker.pairs("a question", ["an answer"], False))
    big.future.add_done_callback(lambda _: finished.append("large"))
    small.future.add_done_callback(lambda _: finished.append("small"))
    worker.start()
    try:
        scores = await asyncio.wait_for(asyncio.gather(big.future, small.future), 300)
    finally:
        worker.stop(30)
    assert finished == ["small", "large"] and len(scores[0]) == 160
    assert worker.stats["rerank"].forwards >= 160 // 8  # the large one took its many forwards


def test_a_forward_on_a_cpu_holds_2048_padded_tokens_unless_set(tmp_path):
    """EMBEDDING_BATCH_TOKENS 0 (the default): 2,048 where the encoder runs on a CPU, which cut a
    one-input request's wait behind a 160-input batch from ~4.8 s to ~0.9 s
    (benchmarks/encode_wait.py); a value given is kept."""
    from backends.choose import load_encoder
    from backends.torch.tiny import write_tiny_reranker
    from backends.workers.encode import CPU_BATCH_TOKENS, EncodeWorker

    reranker = load_encoder("torch", "rerank", str(write_tiny_reranker(tmp_path / "reranker")), "cpu")
    for setting, budget in ((0, CPU_BATCH_TOKENS), (8192, 8192), (300, 300)):
        worker = EncodeWorker(lambda: {"rerank": reranker}, lambda: 8, batch_tokens=setting, threads=1)
        worker.encoders = {"rerank": reranker}
        assert worker.budget("rerank") == budget


async def test_namespaces_of_many_functions_are_refused_before_the_compiler(client):
    """128 namespaces of 128 functions each reached the grammar compiler: 16,384 functions."""
    namespaces = [  # within MAX_BODY_BYTES: ~560 KB
        {"type": "namespace", "name": f"n{i}", "tools": [{"type": "function", "name": f"f{i}_{j}"} for j in range(128)]}
        for i in range(128)
    ]
    body = {"input": "Hi", "max_output_tokens": 4, "tools": namespaces, "tool_choice": "required"}
    response = await client.post("/v1/responses", json=body)
    answer = await response.json()
    assert response.status == 400 and answer["error"]["param"] == "tools", answer
    assert "16384" in answer["error"]["message"]
    few = {**body, "tools": [{**namespaces[0], "tools": namespaces[0]["tools"][:2]}]}
    assert (await client.post("/v1/responses", json=few)).status == 200


def test_the_responses_store_counts_what_it_holds_and_shares_it_between_keys():
    """What the store holds in memory is within its byte limit (it held ~17 times the JSON it
    counted), and one key's answers never push out another's while it holds more."""
    import gc
    import tracemalloc

    from backends.wire.store import ResponseStore

    def answer(i: int, key: str) -> tuple[dict, list[dict]]:
        items = [
            {"type": "message", "role": "user", "content": [{"type": "input_text", "text": f"{key}{i} " * 20}]}
        ] * 40
        return {"id": f"resp_{key}{i}", "object": "response", "output": items[:1]}, items

    store = ResponseStore(entries=10_000, size=1 << 20)
    gc.collect()
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    for i in range(200):
        store.put("a", *answer(i, "a"))
    held = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    assert store.held <= 1 << 20 and held <= 1.2 * store.held, (held, store.held)
    assert store.get("a", "resp_a199").items == answer(199, "a")[1]  # as it was kept
    for i in range(5):
        store.put("b", *answer(i, "b"))
    for i in range(200, 400):  # key a sends on: it loses its own oldest, never b's
        store.put("a", *answer(i, "a"))
    assert all(store.get("b", f"resp_b{i}") is not None for i in range(5))
    assert store.get("a", "resp_a200") is None and store.get("a", "resp_a399") is not None
    assert store.held <= 1 << 20
    assert store.get("b", "resp_a399") is None  # a key sees only its own
    assert store.delete("b", "resp_b0") and store.get("b", "resp_b0") is None
