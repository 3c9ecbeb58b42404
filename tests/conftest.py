"""Shared fixtures: the tiny checkpoint and its backends are built once per test session.

`aiohttp_client` is function-scoped, so each test gets a fresh app (its own worker thread
and log directory) around a backend that was loaded once; loading inside every app's
startup hook would rebuild the model for every test.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from aiohttp.test_utils import TestServer

from backends.choose import load_backend
from backends.contract import Backend, LoadOptions
from backends.torch.tiny import write_tiny_checkpoint, write_tiny_tools
from phi2_server import ENGINE, LOAD_DONE, Settings, create_app, listen, runner_options


@pytest.fixture(scope="session", autouse=True)
def cache_dir(tmp_path_factory) -> Path:
    """PHI2_CACHE_DIR of the session: what the runtimes store (quantized weights) stays in the
    session's temporary folder, not the user's ~/.cache."""
    import os

    path = tmp_path_factory.mktemp("phi2-cache")
    previous = os.environ.get("PHI2_CACHE_DIR")
    os.environ["PHI2_CACHE_DIR"] = str(path)
    yield path
    if previous is None:
        os.environ.pop("PHI2_CACHE_DIR", None)
    else:
        os.environ["PHI2_CACHE_DIR"] = previous


@pytest.fixture(scope="session")
def tiny_path(tmp_path_factory) -> Path:
    return write_tiny_checkpoint(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="session")
def torch_backend(tiny_path) -> Backend:
    # float32 on both runtimes: greedy ids must match MLX's exactly.
    return load_backend("torch", LoadOptions(model=str(tiny_path), dtype="float32"))


@pytest.fixture(scope="session")
def mlx_backend(tiny_path) -> Backend:
    return load_backend("mlx", LoadOptions(model=str(tiny_path)))


# (runtime, MAX_BATCH) pairs that the API suite runs on: every test of the `backend` fixture
# runs once per pair.
SERVED = [("torch", 1), ("torch", 4), ("mlx", 1), ("mlx", 4)]


@pytest.fixture(scope="session", params=SERVED, ids=[f"{r}-batch{b}" for r, b in SERVED])
def served(request) -> tuple[str, int]:
    return request.param


@pytest.fixture(scope="session")
def backend(request, served) -> Backend:
    return request.getfixturevalue(f"{served[0]}_backend")


@pytest.fixture
def max_batch(request) -> int:
    """MAX_BATCH for make_client and live_server: the served pair's on `backend`, else 1."""
    return request.getfixturevalue("served")[1] if "backend" in request.fixturenames else 1


@pytest.fixture
def log_dir(tmp_path) -> Path:
    return tmp_path / "logs"


@pytest.fixture
def make_client(aiohttp_client, log_dir, max_batch):
    """make_client(load, wait=True, **settings) -> a test client over a fresh app."""

    async def make(load: Callable[[], Backend], wait: bool = True, load_encoders=None, **overrides):
        overrides.setdefault("max_batch", max_batch)
        settings = Settings(log_dir=str(log_dir), shutdown_grace=1.0, **overrides)
        app = create_app(settings, load=load, load_encoders=load_encoders)
        # Served as `phi2_server.run` serves it (TestServer takes the options here, not in its
        # constructor, and always cancels handlers whose client leaves).
        server = TestServer(app)
        await server.start_server(**{k: v for k, v in runner_options(app).items() if k != "handler_cancellation"})
        client = await aiohttp_client(server)
        if wait:
            await asyncio.wait_for(app[LOAD_DONE].wait(), 30)
        return client

    return make


@pytest.fixture
async def client(make_client, backend):
    return await make_client(lambda: backend)


async def wait_until(predicate, timeout: float = 60.0) -> None:
    """Wait for something the server does by itself. The timeout only turns a hang into a
    failure: it is far beyond what any step takes, even on a loaded machine."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached in time")
        await asyncio.sleep(0.002)


async def wait_idle(engine, timeout: float = 60.0) -> None:
    await wait_until(lambda: engine.idle, timeout)


def post(server, path: str, body: dict, raw: bool = False, headers: dict | None = None) -> tuple[int, Any]:
    """POST JSON to a LiveServer: (status, the JSON answer, or with `raw` its bytes), errors included."""
    import json
    import urllib.error
    import urllib.request

    request = urllib.request.Request(
        server.url + path,
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json", **(headers or {})},
    )
    try:
        with urllib.request.urlopen(request) as response:
            data = response.read()
            return response.status, data if raw else json.loads(data)
    except urllib.error.HTTPError as error:
        data = error.read()
        return error.code, data if raw else json.loads(data)


def engine_of(client):
    return client.server.app[ENGINE]


@pytest.fixture(scope="session")
def reference(tiny_path):
    """Greedy ids from transformers' own `generate`: an independent check of our decode loop."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_path)
    model = AutoModelForCausalLM.from_pretrained(tiny_path).eval()
    decodable = len(tokenizer)

    def mask_undecodable(input_ids, scores):
        scores[:, decodable:] = float("-inf")
        return scores

    def greedy(prompt: str, max_new_tokens: int) -> list[int]:
        ids = tokenizer.encode(prompt, add_special_tokens=False)
        with torch.inference_mode():
            out = model.generate(
                torch.tensor([ids]),
                max_new_tokens=max_new_tokens,
                do_sample=False,
                pad_token_id=tokenizer.eos_token_id,
                logits_processor=[mask_undecodable],
            )
        return out[0, len(ids) :].tolist()

    greedy.tokenizer = tokenizer
    return greedy


def write_mlx_adapter(
    model_path: Path, directory: Path, *, num_layers: int = 2, rank: int = 4, scale: float = 2.0, dora: bool = False
) -> Path:
    """A LoRA adapter made with mlx-lm's own utilities and saved in its format."""
    import json

    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_lm import load
    from mlx_lm.tuner.utils import linear_to_lora_layers

    model, _ = load(str(model_path))
    model.freeze()
    parameters = {"rank": rank, "scale": scale, "dropout": 0.0}
    # Seeded before the LoRA layers are made: they draw lora_a from MLX's global key, which
    # is seeded from the clock, so unseeded adapters differed from run to run (and now and
    # then two of test_adapters' three gave the same text).
    mx.random.seed(3)
    linear_to_lora_layers(model, num_layers, parameters, use_dora=dora)
    weights = dict(tree_flatten(model.trainable_parameters()))
    for name in weights:
        if name.endswith("lora_b"):  # zero at initialization: the adapter would change nothing
            weights[name] = mx.random.normal(weights[name].shape) * 0.2
    directory.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(directory / "adapters.safetensors"), weights)
    config = {"fine_tune_type": "dora" if dora else "lora", "num_layers": num_layers, "lora_parameters": parameters}
    (directory / "adapter_config.json").write_text(json.dumps(config))
    return directory


@pytest.fixture(scope="session")
def adapter_path(tiny_path, tmp_path_factory) -> Path:
    return write_mlx_adapter(tiny_path, tmp_path_factory.mktemp("adapter"))


@pytest.fixture(scope="session")
def adapted_backends(tiny_path, adapter_path) -> dict[str, Backend]:
    options = LoadOptions(model=str(tiny_path), adapter_path=str(adapter_path), dtype="float32")
    return {name: load_backend(name, options) for name in ("torch", "mlx")}


class LiveServer:
    """The real app on a real port, on an event loop of its own thread, for sync clients."""

    def __init__(self, app):
        from aiohttp import web

        self.app = app
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="live-server", daemon=True)
        self.thread.start()
        self.runner = web.AppRunner(app, **runner_options(app))

        async def start():
            await self.runner.setup()
            await listen(self.runner, "127.0.0.1", 0)
            await asyncio.wait_for(app[LOAD_DONE].wait(), 30)
            return self.runner.addresses[0][1]

        port = asyncio.run_coroutine_threadsafe(start(), self.loop).result(60)
        self.url = f"http://127.0.0.1:{port}"

    def close(self):
        asyncio.run_coroutine_threadsafe(self.runner.cleanup(), self.loop).result(60)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.loop.close()


def greedy_chat_answers(backends, tmp_path, prompt: str, max_tokens: int = 12) -> list[str]:
    """Each backend's greedy chat answer to `prompt` over HTTP (/v1/chat/completions), in turn."""
    from phi2_server import Settings, create_app

    answers = []
    for backend in backends:
        settings = Settings(log_dir=str(tmp_path / "logs"), model="smollm2")
        live = LiveServer(create_app(settings, load=lambda b=backend: b))
        try:
            body = {"messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens, "temperature": 0}
            status, answer = post(live, "/v1/chat/completions", body)
            assert status == 200, answer
            answers.append(answer["choices"][0]["message"]["content"])
        finally:
            live.close()
    return answers


@pytest.fixture
def live_server(log_dir, max_batch):
    """live_server(load, **settings) -> a LiveServer (closed after the test)."""
    servers = []

    def start(load: Callable[[], Backend], load_encoders=None, **overrides) -> LiveServer:
        overrides.setdefault("max_batch", max_batch)
        settings = Settings(log_dir=str(log_dir), shutdown_grace=1.0, **overrides)
        server = LiveServer(create_app(settings, load=load, load_encoders=load_encoders))
        servers.append(server)
        return server

    yield start
    for server in servers:
        server.close()


@pytest.fixture
def reach_groups(monkeypatch) -> list:
    """What every eager decode step's `_reach_groups` returns from now on (the groups of rows
    that attend together, or None for one group), as the steps run."""
    from backends.torch.decoder import BatchedDecoder

    found = []
    original = BatchedDecoder._reach_groups

    def recorded(self, batch):
        found.append(original(self, batch))
        return found[-1]

    monkeypatch.setattr(BatchedDecoder, "_reach_groups", recorded)
    return found


@pytest.fixture(scope="session")
def tool_paths(tmp_path_factory) -> dict:
    """The tiny instruction models that memorized tool dialogues, in two families' formats
    (backends.torch.tiny.write_tiny_tools): Hermes tags on Qwen2, Llama-3 JSON on Llama."""
    return {fmt: write_tiny_tools(tmp_path_factory.mktemp(f"tiny-{fmt}"), fmt) for fmt in ("hermes", "llama3")}


@pytest.fixture(scope="session")
def tool_backends(tool_paths) -> Callable[[str, str], Backend]:
    """tool_backends(runtime, format): that tool model loaded once a session."""
    loaded = {}

    def get(runtime: str, fmt: str):
        if (runtime, fmt) not in loaded:
            loaded[runtime, fmt] = load_backend(runtime, LoadOptions(model=str(tool_paths[fmt]), dtype="float32"))
        return loaded[runtime, fmt]

    return get
