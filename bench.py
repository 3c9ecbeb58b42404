"""Benchmark a phi2-server: TTFT, decode and end-to-end tokens/s, latency percentiles, aggregate
throughput under concurrency, and /health latency while generations stream.

    python bench.py --url http://127.0.0.1:8000 --concurrency 1,4,16   # a running server
    python bench.py --spawn                  # start phi2_server.py on a free port (make bench)
    python bench.py --in-process             # the backend's own decode loop, no HTTP
    python bench.py --overhead               # both, back to back, and their ratio (make bench-overhead)
    python bench.py --dtype-sweep            # float32 against bfloat16 on this CPU, per model size
    python bench.py --quant-kernels          # int8/int4 weight-only kernels on Phi-2's shapes
    python bench.py --quant-quality          # int8/int4 logits against bfloat16's (random:phi-2)
    python bench.py --quant-agreement        # 8- and 4-bit greedy text against full precision (tiny)
    python bench.py --chat 4                 # a chat re-sending its history: prompt cache on, then off
    python bench.py --shared-prefix 4        # 4 clients sharing a system prompt: cache on, then off
    python bench.py --latency --url URL      # a long prompt's TTFT; streams' inter-token latency as long prompts arrive

The model and runtime come from the same environment variables as the server (PHI2_MODEL,
PHI2_BACKEND, PHI2_DTYPE, ...). Every request forces its token count (`ignore_eos`), so runs
are comparable; the first run of each concurrency level is a discarded warm-up.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import resource
import shutil
import socket
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field

import aiohttp

# -- measurements -------------------------------------------------------------------------------


@dataclass
class Timing:
    """One request: seconds since it was sent."""

    ttft: float
    total: float
    tokens: int
    prompt_tokens: int = 0
    cached_tokens: int = 0
    text: str = ""
    arrivals: list[float] = field(default_factory=list)  # each token line's arrival, seconds since sent

    @property
    def decode_rate(self) -> float:  # tokens after the first / time after the first
        return (self.tokens - 1) / (self.total - self.ttft) if self.tokens > 1 and self.total > self.ttft else 0.0

    @property
    def e2e_rate(self) -> float:
        return self.tokens / self.total


@dataclass
class Result:
    label: str
    mode: str  # http | in-process
    concurrency: int
    runs: list[list[Timing]] = field(default_factory=list)  # warm-up excluded
    wall: list[float] = field(default_factory=list)  # per run: first send to last done
    health_ms: list[float] = field(default_factory=list)
    peak_rss_gib: float | None = None

    def summary(self) -> dict:
        timings = [t for run in self.runs for t in run]
        latencies = sorted(t.total for t in timings)
        return {
            "label": self.label,
            "mode": self.mode,
            "concurrency": self.concurrency,
            "decode_tok_s": statistics.median(t.decode_rate for t in timings),
            "ttft_ms": statistics.median(t.ttft for t in timings) * 1000,
            "ttft_max_ms": max(t.ttft for t in timings) * 1000,
            "e2e_tok_s": statistics.median(t.e2e_rate for t in timings),
            "p50_s": percentile(latencies, 50),
            "p95_s": percentile(latencies, 95),
            "aggregate_tok_s": statistics.median(
                sum(t.tokens for t in run) / wall for run, wall in zip(self.runs, self.wall, strict=False)
            ),
            "health_p50_ms": percentile(sorted(self.health_ms), 50) if self.health_ms else None,
            "health_p99_ms": percentile(sorted(self.health_ms), 99) if self.health_ms else None,
            "peak_rss_gib": self.peak_rss_gib,
            "requests": len(timings),
        }


def percentile(ordered: list[float], p: float) -> float:
    index = min(len(ordered) - 1, max(0, round(p / 100 * len(ordered) + 0.5) - 1))
    return ordered[index]


# -- over HTTP ----------------------------------------------------------------------------------


async def stream_one(session: aiohttp.ClientSession, url: str, body: dict) -> Timing:
    sent = time.perf_counter()
    first = None
    lines = 0
    buffer = b""
    pieces = []
    arrivals = []
    async with session.post(url + "/generate/stream", json=body) as response:
        if response.status != 200:
            raise RuntimeError(f"HTTP {response.status}: {await response.text()}")
        # Whole chunks, split here: with 64 streams, a wait per line would make the client the bottleneck.
        async for chunk in response.content.iter_any():
            now = time.perf_counter()
            *complete, buffer = (buffer + chunk).split(b"\n")
            for raw in complete:
                line = json.loads(raw)
                if "token" in line:
                    lines += 1
                    first = first or now
                    pieces.append(line["token"])
                    arrivals.append(now - sent)
                    continue
                if "error" in line or line["finish_reason"] != "length":
                    raise RuntimeError(f"stream did not finish normally: {line}")
                tokens = line["tokens_used"]
                if tokens != body["max_tokens"] or not 1 <= lines <= tokens:
                    raise RuntimeError(f"{tokens} tokens and {lines} token lines for max_tokens={body['max_tokens']}")
                return Timing(
                    (first or now) - sent,
                    now - sent,
                    tokens,
                    line["prompt_tokens"],
                    line.get("cached_tokens", 0),
                    "".join(pieces),
                    arrivals,
                )
    raise RuntimeError("stream ended without its summary line")


async def probe_health(session: aiohttp.ClientSession, url: str, latencies: list[float], stop: asyncio.Event) -> None:
    while not stop.is_set():
        started = time.perf_counter()
        async with session.get(url + "/health") as response:
            await response.read()
        latencies.append((time.perf_counter() - started) * 1000)
        await asyncio.sleep(0.02)


async def bench_http(args, concurrency: int) -> Result:
    result = Result(args.label, "http", concurrency)
    body = {"prompt": args.prompt, "max_tokens": args.max_tokens, "ignore_eos": True, "temperature": 0}

    def body_of(i: int) -> dict:  # --distinct: realistic traffic, each client its own prompt, sampled
        if not args.distinct:
            return body
        return {**body, "prompt": f"Client {i} asks: {args.prompt}", "temperature": 0.8, "top_p": 0.95, "seed": i}

    connector = aiohttp.TCPConnector(limit=0)
    timeout = aiohttp.ClientTimeout(total=None)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session, aiohttp.ClientSession() as probe:
        for run in range(args.runs):
            stop = asyncio.Event()
            latencies: list[float] = []
            prober = asyncio.create_task(probe_health(probe, args.url, latencies, stop))
            started = time.perf_counter()
            timings = await asyncio.gather(
                *(stream_one(session, args.url, body_of(run * concurrency + i)) for i in range(concurrency))
            )
            wall = time.perf_counter() - started
            stop.set()
            await prober
            warmup = run == 0 and args.runs > 1
            progress(result, run, timings, wall, warmup)
            if not warmup:
                result.runs.append(timings)
                result.wall.append(wall)
                result.health_ms += latencies
    return result


# -- in process ---------------------------------------------------------------------------------


def load_in_process():
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from backends import load_backend, select_backend
    from phi2_server import Settings

    settings = Settings.from_args([])
    return load_backend(select_backend(settings.backend), settings.load_options())


def bench_in_process(args, backend) -> Result:
    """The same request through the backend's own decode loop and detokenizer, one at a time."""
    from backends import Sampling, Sequence
    from backends.drive import drive

    result = Result(args.label, "in-process", 1)
    prompt_ids = backend.encode(args.prompt)
    for run in range(args.runs):
        sent = time.perf_counter()
        # The decoder the server would use: the same batch size (and so the same code path).
        decoder, detokenizer = backend.decoder(backend.max_batch), backend.detokenizer()
        first = None

        def on_tokens(step: int, tokens: dict[int, int]) -> None:
            nonlocal first
            for token in tokens.values():  # a step may hand over no token (CUDA chains steps)
                if detokenizer.add(token) and first is None:  # first text, as a client sees it
                    first = time.perf_counter()

        drive(decoder, [Sequence(1, prompt_ids, Sampling(), args.max_tokens)], on_tokens=on_tokens)
        detokenizer.flush()
        now = time.perf_counter()
        first = first or now
        timings = [Timing(ttft=first - sent, total=now - sent, tokens=args.max_tokens)]
        warmup = run == 0 and args.runs > 1
        progress(result, run, timings, now - sent, warmup)
        if not warmup:
            result.runs.append(timings)
            result.wall.append(now - sent)
    result.peak_rss_gib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    return result


# -- prompt reuse: a growing chat, clients sharing a system prompt --------------------------------

FILLER = (
    "Phi-2 is a Transformer with 2.7 billion parameters trained on synthetic and web data. "
    "Water boils at 100 degrees Celsius at sea level; it freezes at 0 degrees. "
    "Numbers like 3.14159, 2.71828 and 1.41421 are famous constants in mathematics. "
)
QUESTIONS = [
    "What is two plus two?",
    "How are you today?",
    "Why is the sky blue?",
    "Write a short poem about the sea.",
    "Name a famous constant.",
    "When does water boil?",
    "What is Phi-2?",
    "Tell me a story.",
]


async def system_prompt(session: aiohttp.ClientSession, url: str, tokens: int) -> str:
    """A system prompt of about `tokens` tokens of the served tokenizer (measured on the server)."""
    probe = await stream_one(session, url, {"prompt": FILLER * 4, "max_tokens": 1, "ignore_eos": True})
    repeats = max(1, round(tokens / (probe.prompt_tokens / 4)))
    return FILLER * repeats


async def latency_workload(args) -> list[dict]:
    """Time to first token of a long prompt alone, then the inter-token latency of `--streams`
    decoding streams, on their own and while long prompts arrive one after another (each new
    prompt sent when the previous one's first tokens are back), against a running server."""
    rows = []
    async with aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=0), timeout=aiohttp.ClientTimeout(total=None)
    ) as session:
        long_prompt = await system_prompt(session, args.url, args.long_prompt_tokens)

        def long_body(i: int) -> dict:  # a distinct first line: no stored prefix to reuse
            return {"prompt": f"Request {i}.\n" + long_prompt, "max_tokens": 4, "ignore_eos": True, "temperature": 0}

        alone = [await stream_one(session, args.url, long_body(i)) for i in range(args.rounds + 1)][
            1:
        ]  # the first pays new shapes
        ttfts = sorted(t.ttft * 1000 for t in alone)
        rows.append(
            {
                "workload": f"{alone[0].prompt_tokens}-token prompt alone, {len(alone)} rounds",
                "TTFT ms median / min / max": f"{statistics.median(ttfts):.1f} / {ttfts[0]:.1f} / {ttfts[-1]:.1f}",
            }
        )
        for arriving in (False, True):
            body = {"prompt": args.prompt, "max_tokens": args.max_tokens, "ignore_eos": True, "temperature": 0}
            streams = [asyncio.create_task(stream_one(session, args.url, body)) for _ in range(args.streams)]
            long_timings = []
            if arriving:
                await asyncio.sleep(
                    0.2
                )  # the streams are decoding (give them --max-tokens enough to outlast the arrivals)
                i = 1000
                while not all(task.done() for task in streams):
                    long_timings.append(await stream_one(session, args.url, long_body(i)))
                    i += 1
            timings = await asyncio.gather(*streams)
            # Gaps between a stream's successive deliveries after its first token (tokens read in one
            # chunk count once: the client saw them at once).
            gaps = sorted(
                1000 * (b - a)
                for t in timings
                for a, b in zip(sorted(set(t.arrivals))[:-1], sorted(set(t.arrivals))[1:], strict=False)
            )
            row = {
                "workload": f"{args.streams} streams decoding"
                + (f", {len(long_timings)} long prompts arriving" if arriving else ""),
                "inter-token ms p50 / p99 / max": (
                    f"{percentile(gaps, 50):.1f} / {percentile(gaps, 99):.1f} / {gaps[-1]:.1f}"
                ),
            }
            if long_timings:
                arriving_ttft = sorted(t.ttft * 1000 for t in long_timings)
                row["TTFT ms median / min / max"] = (
                    f"{statistics.median(arriving_ttft):.1f} / {arriving_ttft[0]:.1f} / {arriving_ttft[-1]:.1f}"
                )
            rows.append(row)
    for row in rows:
        print(
            f"| {row['workload']} | {row.get('TTFT ms median / min / max', '')} "
            f"| {row.get('inter-token ms p50 / p99 / max', '')} |",
            flush=True,
        )
    return rows


async def chat_workload(args, urls: dict[str, str]) -> dict[str, list[Timing]]:
    """One conversation: each turn sends the whole history (system prompt, earlier questions and
    the answers as received) plus a new question, as a chat client does. Each turn goes to the
    server with the prompt cache, then to the one without, the same prompt (the history follows
    the first one's answers), one at a time: neither competes with the other for the CPU."""
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None)) as session:
        history = await system_prompt(session, urls["on"], args.prefix_tokens)
        turns: dict[str, list[Timing]] = {"on": [], "off": []}
        for turn in range(args.chat):
            prompt = history + f"\nAlice: {QUESTIONS[turn % len(QUESTIONS)]}\nBob:"
            body = {"prompt": prompt, "max_tokens": args.max_tokens, "ignore_eos": True, "temperature": 0}
            for cache, url in urls.items():
                timing = await stream_one(session, url, body)
                turns[cache].append(timing)
                print(
                    f"[chat turn {turn}, cache {cache}] {timing.prompt_tokens} prompt tokens, "
                    f"{timing.cached_tokens} cached, TTFT {timing.ttft * 1000:.0f} ms",
                    file=sys.stderr,
                    flush=True,
                )
            history = prompt + turns["on"][-1].text
        return turns


async def shared_prefix_workload(args, urls: dict[str, str]) -> dict[str, list[list[Timing]]]:
    """N clients at once with one long system prompt and different questions, in rounds: the
    first finds nothing stored, the later ones find the system prompt (a server's steady state;
    the first rounds also pay each server's first calls of new shapes). Each round runs
    against the server with the prompt cache, then the one without."""
    async with aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=0), timeout=aiohttp.ClientTimeout(total=None)
    ) as session:
        system = await system_prompt(session, urls["on"], args.prefix_tokens)
        await system_prompt(session, urls["off"], args.prefix_tokens)  # the same probe on both
        rounds: dict[str, list[list[Timing]]] = {"on": [], "off": []}
        for round_ in range(args.rounds):
            bodies = [
                {
                    "prompt": system
                    + f"\nAlice: {QUESTIONS[(i + round_ * args.shared_prefix) % len(QUESTIONS)]} ({round_}.{i})\nBob:",
                    "max_tokens": args.max_tokens,
                    "ignore_eos": True,
                    "temperature": 0,
                }
                for i in range(args.shared_prefix)
            ]
            for cache, url in urls.items():
                timings = await asyncio.gather(*(stream_one(session, url, body) for body in bodies))
                rounds[cache].append(timings)
                print(
                    f"[shared prefix round {round_}, cache {cache}] "
                    f"TTFT max {max(t.ttft for t in timings) * 1000:.0f} ms, "
                    f"{sum(t.cached_tokens for t in timings)} of {sum(t.prompt_tokens for t in timings)} "
                    "prompt tokens cached",
                    file=sys.stderr,
                    flush=True,
                )
        return rounds


def chat_in_process(args) -> list[dict]:
    """--chat TURNS --in-process: the same conversation through two decoders over one loaded
    model, one with a prompt cache and one without; each turn's TTFT (from adding the sequence
    to its first token) and whether the two decode the same ids. One model in memory, so this
    also runs in float32 at Phi-2's size."""
    from backends import Sampling, Sequence
    from backends.drive import drive

    backend = load_in_process()
    with_cache = backend.decoder(backend.max_batch)
    try:  # a second fast-path decoder of its own (backend.decoder hands one thread the same one)
        from backends.torch_decoder import BatchedDecoder

        without = (
            BatchedDecoder(backend.decoder_weights, backend.max_batch)
            if isinstance(with_cache, BatchedDecoder)
            else None
        )
    except ImportError:
        without = None
    without = without or backend.decoder(backend.max_batch, prompt_cache_bytes=0)
    history = FILLER * max(1, round(args.prefix_tokens / (len(backend.encode(FILLER * 4)) / 4)))
    rows = []
    for turn in range(args.chat):
        prompt = history + f"\nAlice: {QUESTIONS[turn % len(QUESTIONS)]}\nBob:"
        ids = backend.encode(prompt)
        row: dict = {"turn": turn, "prompt_tokens": len(ids)}
        for name, decoder in (("on", with_cache), ("off", without)):
            first = None
            sent = time.perf_counter()

            def on_tokens(step: int, tokens: dict[int, int]) -> None:
                nonlocal first
                first = first or (time.perf_counter() if tokens else None)

            driven = drive(decoder, [Sequence(turn, ids, Sampling(), args.max_tokens)], on_tokens=on_tokens)
            row[name] = {
                "ttft_ms": (first - sent) * 1000,
                "cached_tokens": driven.cached[turn],
                "ids": driven.ids[turn],
            }
        row["same"] = row["on"]["ids"] == row["off"]["ids"]
        print(
            f"| {turn} | {len(ids)} | {row['on']['cached_tokens']} | {row['on']['ttft_ms']:.0f} "
            f"| {row['off']['ttft_ms']:.0f} | {row['off']['ttft_ms'] / row['on']['ttft_ms']:.1f}x | {row['same']} |",
            flush=True,
        )
        history = prompt + backend.decode(row["on"]["ids"])
    return rows


def prompt_reuse(args) -> dict:
    """The chat or shared-prefix workload against two spawned servers, one with the prompt cache
    and one without (PROMPT_CACHE=0), in the same run; a table of both and their ratio."""
    servers = {
        cache: SpawnedServer(args.ready_timeout, env={"PROMPT_CACHE": "1" if cache == "on" else "0"})
        for cache in ("on", "off")
    }
    try:
        urls = {cache: server.url for cache, server in servers.items()}
        results = asyncio.run(chat_workload(args, urls) if args.chat else shared_prefix_workload(args, urls))
    finally:
        for server in servers.values():
            server.stop()
    if args.chat:
        print(
            "| turn | prompt tokens | cached tokens (cache on) | TTFT ms, cache on | TTFT ms, cache off "
            "| off / on | same answer |\n| --- | --- | --- | --- | --- | --- | --- |"
        )
        for turn, (on, off) in enumerate(zip(results["on"], results["off"], strict=False)):
            print(
                f"| {turn} | {on.prompt_tokens} | {on.cached_tokens} | {on.ttft * 1000:.0f} | {off.ttft * 1000:.0f} "
                f"| {off.ttft / on.ttft:.1f}x | {on.text == off.text} |"
            )
        later = results["on"][1:]
        hit = sum(t.cached_tokens for t in later) / max(1, sum(t.prompt_tokens for t in later))
        print(f"\nhit rate after the first turn: {hit:.1%} of prompt tokens")
        flat = results
    else:
        print(
            "| round | clients | TTFT ms mean / max, cache on | TTFT ms mean / max, cache off | hit rate (cache on) "
            "| same answers |\n| --- | --- | --- | --- | --- | --- |"
        )
        for round_, (on, off) in enumerate(zip(results["on"], results["off"], strict=False)):
            mean = lambda ts: statistics.mean(t.ttft for t in ts) * 1000  # noqa: E731
            peak = lambda ts: max(t.ttft for t in ts) * 1000  # noqa: E731
            hit = sum(t.cached_tokens for t in on) / sum(t.prompt_tokens for t in on)
            same = sum(a.text == b.text for a, b in zip(on, off, strict=False))
            print(
                f"| {round_} | {len(on)} | {mean(on):.0f} / {peak(on):.0f} | {mean(off):.0f} / {peak(off):.0f} "
                f"| {hit:.1%} | {same}/{len(on)} |"
            )
        flat = {cache: [t for r in rounds for t in r] for cache, rounds in results.items()}
    return {cache: [asdict(t) for t in timings] for cache, timings in flat.items()}


# -- a server of our own ------------------------------------------------------------------------


def overhead(args) -> list[Result]:
    """In-process and over HTTP, one run of each in turn: this machine's drift hits both alike.
    Both copies of the model are in memory at once (Phi-2 in float32 needs 2 x 11 GiB)."""
    backend = load_in_process()
    server = SpawnedServer(args.ready_timeout)
    args.url = server.url
    runs, args.runs = args.runs, 1
    local, http = Result(args.label, "in-process", 1), Result(args.label, "http", 1)
    try:
        for run in range(runs + 1):  # run 0 of each is the warm-up
            for result, one in (
                (local, lambda: bench_in_process(args, backend)),
                (http, lambda: asyncio.run(bench_http(args, 1))),
            ):
                measured = one()
                if run > 0:
                    result.runs += measured.runs
                    result.wall += measured.wall
                    result.health_ms += measured.health_ms
        local.peak_rss_gib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
        http.peak_rss_gib = server.peak_rss_gib()
    finally:
        server.stop()
        args.runs = runs
    return [local, http]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class SpawnedServer:
    """phi2_server.py on a free port, with this process's environment (and `env`); stopped with SIGTERM."""

    def __init__(self, ready_timeout: float, env: dict | None = None):
        port = free_port()
        here = os.path.dirname(os.path.abspath(__file__))
        command = [sys.executable, os.path.join(here, "phi2_server.py"), "--host", "127.0.0.1", "--port", str(port)]
        self.process = subprocess.Popen(command, env={**os.environ, **(env or {})})
        self.url = f"http://127.0.0.1:{port}"
        asyncio.run(self._wait_ready(ready_timeout))

    async def _wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        async with aiohttp.ClientSession() as session:
            while time.monotonic() < deadline:
                if self.process.poll() is not None:
                    raise SystemExit(f"the server exited with status {self.process.returncode}")
                try:
                    async with session.get(self.url + "/ready") as response:
                        if response.status == 200:
                            return
                except aiohttp.ClientError:
                    pass
                await asyncio.sleep(0.5)
        raise SystemExit(f"the server was not ready after {timeout:.0f} s")

    def peak_rss_gib(self, field: str = "VmHWM") -> float | None:
        """The server's peak resident memory (VmHWM), or with field="VmRSS" its memory now."""
        try:
            with open(f"/proc/{self.process.pid}/status") as status:
                for line in status:
                    if line.startswith(field + ":"):
                        return int(line.split()[1]) / 2**20
        except OSError:
            return None  # not Linux
        return None

    def stop(self) -> None:
        self.process.terminate()
        self.process.wait(60)


# -- reporting ----------------------------------------------------------------------------------


def progress(result: Result, run: int, timings: list[Timing], wall: float, warmup: bool) -> None:
    tokens = sum(t.tokens for t in timings)
    tag = "warm-up" if warmup else f"run {run}"
    print(
        f"[{result.mode} c={result.concurrency} {tag}] {len(timings)} requests, {tokens} tokens in {wall:.2f} s: "
        f"{tokens / wall:.1f} tok/s aggregate, TTFT {statistics.median(t.ttft for t in timings) * 1000:.0f} ms",
        file=sys.stderr,
        flush=True,
    )


def markdown(rows: list[dict]) -> str:
    head = (
        "| label | mode | concurrency | decode tok/s | TTFT ms | e2e tok/s | p50 s | p95 s | aggregate tok/s "
        "| /health p99 ms | peak RSS GiB |"
    )
    lines = [head, "|" + " --- |" * (head.count("|") - 1)]
    for r in rows:
        health = f"{r['health_p99_ms']:.1f}" if r["health_p99_ms"] is not None else "–"
        rss = f"{r['peak_rss_gib']:.1f}" if r["peak_rss_gib"] is not None else "–"
        lines.append(
            f"| {r['label']} | {r['mode']} | {r['concurrency']} | {r['decode_tok_s']:.2f} | {r['ttft_ms']:.0f} | "
            f"{r['e2e_tok_s']:.2f} | {r['p50_s']:.2f} | {r['p95_s']:.2f} | {r['aggregate_tok_s']:.2f} "
            f"| {health} | {rss} |"
        )
    return "\n".join(lines)


async def weight_bytes(url: str) -> int | None:
    async with aiohttp.ClientSession() as session:
        async with session.get(url + "/model/info") as response:
            return (await response.json()).get("weight_bytes") if response.status == 200 else None


def memory_bandwidth() -> dict:
    """This machine's read bandwidth, measured the way decode reads weights: float32
    matrix-vector products over 2 GiB of distinct matrices (and, for reference, a numpy copy)."""
    import numpy as np
    import torch

    def best(fn) -> float:
        fn()
        return min(_timed(fn) for _ in range(3))

    matrices = [torch.randn(10240, 2560) for _ in range(20)]  # 2.1 GB, far past the caches
    vector = torch.randn(1, 2560)
    nbytes = sum(m.numel() * 4 for m in matrices)
    gemv = nbytes / best(lambda: [torch.nn.functional.linear(vector, m) for m in matrices])
    source = np.ones(2**28)
    target = np.empty_like(source)
    copy = source.nbytes / best(lambda: np.copyto(target, source))
    return {"gemv_read_bytes_s": gemv, "copy_bytes_s": copy}


# Phi architectures from toy size to Phi-1.5's, for the CPU dtype rule (--dtype-sweep).
SWEEP_SIZES = [  # hidden, layers, heads, vocab
    (64, 2, 4, 1000),
    (128, 4, 4, 4000),
    (128, 4, 4, 8000),
    (192, 4, 6, 8000),
    (256, 4, 8, 8000),
    (256, 4, 8, 51200),
    (512, 8, 8, 51200),
    (1024, 16, 16, 51200),
    (2048, 24, 32, 51200),
]


def dtype_sweep(args) -> list[dict]:
    """float32 against bfloat16 decode on this CPU, per model size: where bfloat16 starts to pay.

    Random Phi weights (speed does not depend on them), one sequence through the decoder the
    server uses on a CPU (the batched fast path), both dtypes in turn, the median of `runs`."""
    import tempfile
    from pathlib import Path

    import torch

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from backends import Sampling, Sequence
    from backends.drive import drive
    from backends.model_files import RANDOM_ARCHITECTURES
    from backends.torch_decoder import BatchedDecoder, DecoderWeights
    from backends.torch_runtime import CPU_BF16_MIN_PARAMETERS, random_model

    rows = []
    for hidden, layers, heads, vocab in SWEEP_SIZES:
        config = {
            **RANDOM_ARCHITECTURES["phi-2"],
            "hidden_size": hidden,
            "num_hidden_layers": layers,
            "num_attention_heads": heads,
            "num_key_value_heads": heads,
            "intermediate_size": 4 * hidden,
            "vocab_size": vocab,
            "partial_rotary_factor": 0.5,
        }  # as Phi-1.5: an even rotary width at every head size here
        directory = Path(tempfile.mkdtemp())
        (directory / "config.json").write_text(json.dumps(config))
        decoders, parameters = {}, 0
        for dtype in (torch.float32, torch.bfloat16):
            model = random_model(directory, dtype, "cpu")
            parameters = sum(p.numel() for p in model.parameters())
            decoders[dtype] = BatchedDecoder(DecoderWeights(model, vocab, config["max_position_embeddings"]), 8)
        rates: dict = {dtype: [] for dtype in decoders}
        for run in range(args.runs + 1):  # the first round warms up
            for dtype, decoder in decoders.items():
                sequence = Sequence(run, list(range(5, 13)), Sampling(), args.max_tokens)
                seconds = _timed(lambda: drive(decoder, [sequence]))
                if run:
                    rates[dtype].append(args.max_tokens / seconds)
        f32, bf16 = (sorted(rates[d])[len(rates[d]) // 2] for d in (torch.float32, torch.bfloat16))
        rows.append({"parameters": parameters, "float32_tok_s": f32, "bfloat16_tok_s": bf16})
        auto = "bfloat16" if parameters >= CPU_BF16_MIN_PARAMETERS else "float32"
        print(
            f"| {parameters / 1e6:.1f}M (h{hidden}, L{layers}, vocab {vocab}) | {f32:.1f} | {bf16:.1f} "
            f"| {bf16 / f32:.2f} | {auto} |",
            flush=True,
        )
    return rows


# Phi-2's matrices as the fast path multiplies them: [q; k; v; fc1] and [dense | fc2] of a block.
PHI2_SHAPES = {"block in (17920 x 2560)": (17920, 2560), "block out (2560 x 12800)": (2560, 12800)}


def quant_kernels(args) -> list[dict]:
    """Weight-only matrix products on Phi-2's shapes at batch 1 and 8, per candidate kernel, on
    this machine's device (CUDA if there is one): time, and weight bytes streamed per second."""
    import torch
    import torch.nn.functional as F

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from backends.torch_quant import Int4Weight, Int8Weight

    cuda = torch.cuda.is_available()
    device = "cuda" if cuda else "cpu"
    dtype = torch.bfloat16

    def timed(fn) -> float:  # median of 20 calls after 3 warm-ups, the device synchronized
        for _ in range(3):
            fn()
        samples = []
        for _ in range(20):
            if cuda:
                torch.cuda.synchronize()
            started = time.perf_counter()
            fn()
            if cuda:
                torch.cuda.synchronize()
            samples.append(time.perf_counter() - started)
        return statistics.median(samples)

    rows = []
    for shape_name, (n, k) in PHI2_SHAPES.items():
        weight = (torch.randn(n, k, device=device) * 0.02).to(dtype)
        candidates = {"bfloat16": (lambda x: F.linear(x, weight), weight.nbytes)}
        if not cuda:
            fp32 = weight.float()
            candidates["float32"] = (lambda x: F.linear(x.float(), fp32), fp32.nbytes)
        int8 = Int8Weight(weight)
        int8pack = lambda x: torch.ops.aten._weight_int8pack_mm(x, int8.qweight, int8.scales)  # noqa: E731
        candidates["int8 (aten._weight_int8pack_mm)"] = (int8pack, int8.nbytes)
        if cuda:
            dequantizing = lambda x: F.linear(x, int8.qweight.to(x.dtype)) * int8.scales  # noqa: E731
            candidates["int8 (dequantize + matmul)"] = (dequantizing, int8.nbytes)
            candidates["int8 (dequantize + matmul, torch.compile)"] = (
                torch.compile(dequantizing, dynamic=False),
                int8.nbytes,
            )
        else:
            from torch.ao.nn.quantized.dynamic import Linear as DynamicLinear

            dynamic = DynamicLinear(k, n, bias_=False, dtype=torch.qint8)
            dynamic.set_weight_bias(
                torch.quantize_per_channel(
                    weight.float(), int8.scales.float(), torch.zeros(n, dtype=torch.long), 0, torch.qint8
                ),
                None,
            )
            candidates["int8 (fbgemm dynamic: int8 activations too)"] = (lambda x: dynamic(x.float()), int8.nbytes)
        int4 = Int4Weight(weight)
        candidates["int4 (aten._weight_int4pack_mm" + ("" if cuda else "_for_cpu") + f", group {int4.group_size})"] = (
            int4.linear,
            int4.nbytes,
        )
        for batch in (1, 8, 64) if cuda else (1, 8):
            x = torch.randn(batch, k, device=device, dtype=dtype)
            base = None
            for name, (fn, nbytes) in candidates.items():
                seconds = timed(lambda: fn(x))
                base = base or seconds
                row = {
                    "shape": shape_name,
                    "batch": batch,
                    "kernel": name,
                    "ms": seconds * 1000,
                    "weight_gb_s": nbytes / seconds / 1e9,
                    "speedup_vs_bf16": base / seconds,
                }
                rows.append(row)
                print(
                    f"| {shape_name} | {batch} | {name} | {row['ms']:.3f} | {row['weight_gb_s']:.1f} "
                    f"| {row['speedup_vs_bf16']:.2f}x |",
                    flush=True,
                )
    return rows


def quant_quality(args) -> list[dict]:
    """How far quantized weights move the last-position logits from bfloat16's, on PHI2_MODEL
    (random:phi-2 where Phi-2's weights cannot be fetched): the relative L2 error, and whether
    the most likely token is the same, over a few prompts. Each method on a fresh bfloat16 load."""
    import torch

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from backends import LoadOptions, load_backend, select_backend
    from backends.torch_decoder import BatchedDecoder

    model = os.environ.get("PHI2_MODEL", "random:phi-2")
    prompts = [FILLER[: 40 * (i + 1)] + q for i, q in enumerate(QUESTIONS)]
    rows = []
    for method in ("int8", "int4"):
        backend = load_backend(select_backend("torch"), LoadOptions(model=model, dtype="bfloat16", warmup=False))
        ids = [backend.encode(p) for p in prompts]
        decodable = backend.decoder_weights.decodable  # the ids past the tokenizer's are never generated: left out
        reference = [BatchedDecoder(backend.decoder_weights, 1).logits_after(i)[:decodable] for i in ids]
        started = time.perf_counter()
        backend.quantize(method)
        seconds = time.perf_counter() - started
        decoder = BatchedDecoder(backend.decoder_weights, 1)
        errors, same = [], 0
        for i, ref in zip(ids, reference, strict=False):
            logits = decoder.logits_after(i)[:decodable]
            errors.append(float((logits - ref).norm() / ref.norm()))
            same += int(logits.argmax() == ref.argmax())
        row = {
            "method": method,
            "relative_error_mean": statistics.mean(errors),
            "relative_error_max": max(errors),
            "same_top1": same,
            "prompts": len(prompts),
            "quantize_seconds": seconds,
        }
        rows.append(row)
        print(
            f"| {method} | {row['relative_error_mean']:.4f} | {row['relative_error_max']:.4f} "
            f"| {same}/{len(prompts)} | {seconds:.1f} |",
            flush=True,
        )
        del backend, decoder, reference
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    return rows


def quant_agreement(args) -> list[dict]:
    """Greedy ids of quantized weights against full precision on the tiny demo model, which
    memorized its corpus: each memorized line is cut after its first word or two and the rest
    decoded (float32, both runtimes, 8 and 4 bits), as tests/test_quantization.py does."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from backends import LoadOptions, Sampling, Sequence, load_backend
    from backends.drive import drive
    from backends.tiny import ascii_lines

    rows = []
    for runtime, methods in (("torch", ("int8", "int4")), ("mlx", ("8", "4"))):
        full = load_backend(runtime, LoadOptions(model="tiny", dtype="float32", warmup=False))
        cases = []
        for line in ascii_lines():
            cut = (
                line.index(" ", 6) if " " in line[6:] else len(line) // 2
            )  # the rest starts with its space, as trained
            cases.append((full.encode(line[:cut]), len(full.encode(line[cut:]))))
        expected = [drive(full.decoder(1), [Sequence(0, prompt, Sampling(), n)]).ids[0] for prompt, n in cases]
        for method in methods:
            quantized = load_backend(runtime, LoadOptions(model="tiny", dtype="float32", quantize=method, warmup=False))
            got = [drive(quantized.decoder(4), [Sequence(0, prompt, Sampling(), n)]).ids[0] for prompt, n in cases]
            same = sum(a == b for x, y in zip(expected, got, strict=False) for a, b in zip(x, y, strict=False))
            total = sum(len(x) for x in expected)
            lines = sum(x == y for x, y in zip(expected, got, strict=False))
            rows.append(
                {
                    "runtime": runtime,
                    "method": method,
                    "tokens_same": same,
                    "tokens": total,
                    "lines_same": lines,
                    "lines": len(cases),
                }
            )
            print(f"| {runtime} | {method} | {same}/{total} ({same / total:.0%}) | {lines}/{len(cases)} |", flush=True)
    return rows


# A typical schema: a record with bounded fields and one long free-text field, so that every
# sequence keeps generating for the whole run (random weights would otherwise close it early).
TYPICAL_SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "email": {"type": "string", "format": "email"},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 20}, "maxItems": 5},
        "bio": {"type": "string", "minLength": 4000},
    },
    "required": ["name", "age", "email", "tags", "bio"],
    "additionalProperties": False,
}


def constrained_decoding(args) -> list[dict]:
    """Decode tok/s with and without TYPICAL_SCHEMA, same decoder, alternating runs, per batch
    size (--concurrency) and temperature (0 and 1); and the schema's compile time."""
    from backends import Sampling, Sequence
    from backends.drive import drive

    os.environ.setdefault("PHI2_MODEL", "random:phi-2")
    backend = load_in_process()
    tokenizer_s = _timed(lambda: backend.grammars.tokenizer)
    spec = json.dumps(TYPICAL_SCHEMA)
    compile_s = _timed(lambda: backend.constraint("json_schema", spec))
    constraint = backend.constraint("json_schema", spec)
    print(
        f"grammar tokenizer built in {tokenizer_s * 1000:.0f} ms; "
        f"schema compiled in {compile_s * 1000:.2f} ms "
        f"(cached: {_timed(lambda: backend.constraint('json_schema', spec)) * 1e6:.0f} us)",
        flush=True,
    )
    prompt_ids = backend.encode("Alice: Describe yourself as a JSON record.\nBob:")
    rows = []
    for batch in [int(b) for b in args.concurrency.split(",")]:
        decoder = backend.decoder(batch)
        for temperature in (0.0, 1.0):
            rates: dict[str, list[float]] = {"unconstrained": [], "constrained": []}
            for run in range(args.runs):
                for variant in rates:  # alternating, so drift on a noisy machine hits both
                    sampling = Sampling(
                        temperature=temperature,
                        seed=run,
                        constraint=constraint.matcher() if variant == "constrained" else None,
                    )
                    sequences = [Sequence(i, prompt_ids, sampling, args.max_tokens) for i in range(batch)]
                    first: list[float] = []
                    drive(decoder, sequences, on_tokens=lambda step, tokens: first or first.append(time.perf_counter()))
                    elapsed = time.perf_counter() - first[0]
                    if run > 0 or args.runs == 1:  # the first run warms up
                        rates[variant].append(batch * (args.max_tokens - 1) / elapsed)
            plain, constrained = statistics.median(rates["unconstrained"]), statistics.median(rates["constrained"])
            row = {
                "batch": batch,
                "temperature": temperature,
                "unconstrained_tok_s": plain,
                "constrained_tok_s": constrained,
                "ratio": constrained / plain,
                "compile_ms": compile_s * 1000,
            }
            rows.append(row)
            print(
                f"| {batch} | {temperature:g} | {plain:.1f} | {constrained:.1f} | {constrained / plain:.3f} |",
                flush=True,
            )
    print(constrained_outputs_check(backend, prompt_ids), flush=True)
    return rows


def constrained_outputs_check(backend, prompt_ids: list[int], n: int = 16) -> str:
    """On this device: sampled outputs under a small schema, beside unconstrained ones, parse and
    validate when they complete (the tests check this on the tiny model; this, on the real path)."""
    from backends import Sampling, Sequence
    from backends.drive import drive

    schema = {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 20},
            "age": {"type": "integer", "minimum": 0, "maximum": 150},
        },
        "required": ["name", "age"],
        "additionalProperties": False,
    }
    constraint = backend.constraint("json_schema", json.dumps(schema))
    sequences = [
        Sequence(
            i,
            prompt_ids,
            Sampling(temperature=1.0, seed=i, constraint=constraint.matcher() if i % 2 == 0 else None),
            96,
        )
        for i in range(n)
    ]
    out = drive(backend.decoder(n), sequences)
    complete = valid = 0
    for i in range(0, n, 2):
        ids = out.ids[i]
        ends = [j for j, t in enumerate(ids) if t in backend.eos_token_ids]
        if not ends:
            continue
        complete += 1
        record = json.loads(backend.decode(ids[: ends[0]]))
        valid += set(record) == {"name", "age"} and len(record["name"]) <= 20 and 0 <= record["age"] <= 150
    return (
        f"constrained outputs beside unconstrained ones, batch {n}: "
        f"{complete}/{n // 2} complete within 96 tokens, {valid}/{complete} valid"
    )


def write_random_adapters(
    backend, folder: str, count: int, rank: int = 8, layers: int = 8, scale: float = 20.0
) -> list[str]:
    """`count` LoRA adapters in mlx-lm's format for the loaded model: rank 8 on every Linear of
    the last 8 blocks (mlx-lm's default keys for Phi), random weights, scale 20 (its default)."""
    import torch
    from safetensors.torch import save_file

    from backends.adapters import torch_linears

    linears = torch_linears(backend.model)
    blocks = 1 + max(int(name.split(".")[2]) for name in linears)
    names = []
    for index in range(count):
        generator = torch.Generator().manual_seed(index)
        tensors = {}
        for name, (n_in, n_out) in linears.items():
            if int(name.split(".")[2]) >= blocks - layers:
                tensors[f"{name}.lora_a"] = torch.randn(n_in, rank, generator=generator) * n_in**-0.5
                tensors[f"{name}.lora_b"] = torch.randn(rank, n_out, generator=generator) * 1e-3
        path = os.path.join(folder, f"adapter-{index}")
        os.makedirs(path)
        save_file(tensors, os.path.join(path, "adapters.safetensors"))
        config = {
            "fine_tune_type": "lora",
            "num_layers": layers,
            "lora_parameters": {"rank": rank, "scale": scale, "dropout": 0.0},
        }
        with open(os.path.join(path, "adapter_config.json"), "w") as out:
            json.dump(config, out)
        names.append(f"adapter-{index}")
    return names


def adapter_decoding(args) -> list[dict]:
    """Decode tok/s of per-request LoRA adapters, in process, on the Torch runtime, alternating
    runs on one decoder: a batch of 8 mixing 4 adapters against 8 sequences of the base model;
    and one sequence with one adapter, unmerged, against the same adapter merged into the weights
    (merged in place and subtracted again: the same memory, the same decoder)."""
    import tempfile

    from backends import Sampling, Sequence
    from backends.drive import drive

    os.environ.setdefault("PHI2_MODEL", "random:phi-2")
    folder = tempfile.mkdtemp(prefix="bench-adapters-")
    os.environ["ADAPTERS_DIR"] = folder
    backend = load_in_process()
    names = write_random_adapters(backend, folder, 8 if backend.max_batch >= 64 else 4)
    adapters = [backend.adapters.get(name) for name in names]
    prompt_ids = backend.encode(args.prompt)

    def rate(decoder, chosen: list) -> float:
        sequences = [
            Sequence(i, prompt_ids, Sampling(), args.max_tokens, adapter=adapter) for i, adapter in enumerate(chosen)
        ]
        first: list[float] = []
        drive(decoder, sequences, on_tokens=lambda step, tokens: first or first.append(time.perf_counter()))
        return len(chosen) * (args.max_tokens - 1) / (time.perf_counter() - first[0])

    def merged(sign: float) -> None:  # the adapter's product added to (or taken from) the weights
        import torch

        with torch.no_grad():
            for name, (a, b) in adapters[0].modules.items():
                weight = backend.model.get_submodule(name).weight
                weight += (sign * adapters[0].scale * (a.double() @ b.double()).T).to(
                    device=weight.device, dtype=weight.dtype
                )

    comparisons = [
        (
            "batch 8: 4 adapters, 2 sequences each / the base model",
            8,
            lambda d: rate(d, [adapters[i % 4] for i in range(8)]),
            lambda d: rate(d, [None] * 8),
        ),
        ("batch 1: one adapter unmerged / merged into the weights", 1, lambda d: rate(d, [adapters[0]]), None),
    ]
    if backend.max_batch >= 64:  # a GPU's batch: every slot in use
        comparisons.append(
            (
                "batch 64: 8 adapters, 8 sequences each / the base model",
                64,
                lambda d: rate(d, [adapters[i % 8] for i in range(64)]),
                lambda d: rate(d, [None] * 64),
            )
        )
    rows = []
    for label, batch, measure, against in comparisons:
        decoder = backend.decoder(max(batch, backend.max_batch))  # the batched path, as the server decodes
        rates: dict[str, list[float]] = {"with adapters": [], "reference": []}
        for _ in range(args.runs):
            rates["with adapters"].append(measure(decoder))
            if against is not None:
                rates["reference"].append(against(decoder))
            else:
                merged(+1)
                try:
                    rates["reference"].append(rate(decoder, [None]))
                finally:
                    merged(-1)
        if args.runs > 1:  # the first run warms up
            rates = {k: v[1:] for k, v in rates.items()}
        ours, reference = statistics.median(rates["with adapters"]), statistics.median(rates["reference"])
        rows.append(
            {
                "comparison": label,
                "batch": batch,
                "adapters_tok_s": ours,
                "reference_tok_s": reference,
                "ratio": ours / reference,
            }
        )
        print(f"| {label} | {ours:.2f} | {reference:.2f} | {ours / reference:.3f} |", flush=True)
    shutil.rmtree(folder, ignore_errors=True)
    return rows


def _timed(fn) -> float:
    started = time.perf_counter()
    fn()
    return time.perf_counter() - started


def default_model() -> str:
    """Phi-2 when its weights are in the local Hugging Face cache, else the tiny demo model."""
    try:
        from huggingface_hub import snapshot_download

        snapshot_download("microsoft/phi-2", local_files_only=True, allow_patterns=["*.json"])
        return "microsoft/phi-2"
    except Exception:
        return "tiny"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=__doc__.split("\n\n", 1)[1],
    )
    parser.add_argument("--url", default="http://127.0.0.1:8000", help="a running server (default: %(default)s)")
    parser.add_argument("--prompt", default="The quick brown fox")
    parser.add_argument("--max-tokens", type=int, default=64, help="tokens per request, forced (default: %(default)s)")
    parser.add_argument(
        "--runs", type=int, default=3, help="runs per concurrency level; the first is a warm-up (default: %(default)s)"
    )
    parser.add_argument("--concurrency", default="1", help="one level or a list, e.g. 1,4,16 (default: %(default)s)")
    parser.add_argument("--label", default=os.environ.get("PHI2_MODEL", "server"), help="the table's first column")
    parser.add_argument("--json", metavar="FILE", help="also write every number to FILE")
    parser.add_argument(
        "--distinct",
        action="store_true",
        help="over HTTP: each client its own prompt, sampled (temperature 0.8, top_p 0.95), as real traffic is",
    )
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--spawn", action="store_true", help="start phi2_server.py on a free port, bench it, stop it")
    mode.add_argument("--in-process", action="store_true", help="load the backend here and bench its decode loop")
    mode.add_argument(
        "--overhead", action="store_true", help="--in-process, then --spawn at concurrency 1, and the ratio"
    )
    parser.add_argument("--ready-timeout", type=float, default=900, help="seconds to wait for a spawned server")
    parser.add_argument(
        "--bandwidth", action="store_true", help="also measure memory bandwidth and the decode limit it sets"
    )
    mode.add_argument(
        "--dtype-sweep", action="store_true", help="float32 against bfloat16 decode on this CPU, per model size"
    )
    mode.add_argument(
        "--quant-kernels", action="store_true", help="weight-only int8/int4 kernels against bfloat16 on Phi-2's shapes"
    )
    mode.add_argument(
        "--quant-quality",
        action="store_true",
        help="int8/int4 logits against bfloat16's on PHI2_MODEL (default random:phi-2)",
    )
    mode.add_argument(
        "--quant-agreement",
        action="store_true",
        help="greedy ids of 8- and 4-bit weights against full precision, tiny model, both runtimes",
    )
    mode.add_argument(
        "--constrained",
        action="store_true",
        help="decode tok/s with and without a typical JSON Schema, in process, per --concurrency batch size "
        "(PHI2_MODEL default random:phi-2)",
    )
    mode.add_argument(
        "--adapters",
        action="store_true",
        help="per-request LoRA adapters: a batch of 8 mixing 4 against the base model, and batch 1 unmerged "
        "against merged, in process (PHI2_MODEL default random:phi-2)",
    )
    parser.add_argument(
        "--latency",
        action="store_true",
        help="TTFT of a long prompt alone, then --streams streams' inter-token latency without and with long "
        "prompts arriving (a running server, --url)",
    )
    parser.add_argument(
        "--long-prompt-tokens", type=int, default=1044, help="the long prompt of --latency (default: %(default)s)"
    )
    parser.add_argument("--streams", type=int, default=63, help="decoding streams of --latency (default: %(default)s)")
    parser.add_argument(
        "--chat",
        type=int,
        metavar="TURNS",
        help="one conversation of TURNS turns, prompt cache on then off (spawns; with --in-process: two decoders here)",
    )
    parser.add_argument(
        "--shared-prefix",
        type=int,
        metavar="N",
        help="N clients sharing a system prompt, prompt cache on then off (spawns)",
    )
    parser.add_argument(
        "--prefix-tokens",
        type=int,
        default=900,
        help="system prompt length for --chat and --shared-prefix (default: %(default)s)",
    )
    parser.add_argument(
        "--rounds", type=int, default=3, help="rounds of --shared-prefix clients (default: %(default)s)"
    )
    args = parser.parse_args(argv)
    if args.latency:
        print("| workload | TTFT ms median / min / max | inter-token ms p50 / p99 / max |\n| --- | --- | --- |")
        rows = asyncio.run(latency_workload(args))
        if args.json:
            with open(args.json, "w") as out:
                json.dump({"latency": rows}, out, indent=2)
        return 0
    if args.chat or args.shared_prefix:
        os.environ.setdefault("PHI2_MODEL", default_model())
        if args.chat and args.in_process:
            print(
                "| turn | prompt tokens | cached tokens (cache on) | TTFT ms, cache on | TTFT ms, cache off "
                "| off / on | same ids |\n| --- | --- | --- | --- | --- | --- | --- |"
            )
            measured = {"in_process": chat_in_process(args)}
        else:
            measured = prompt_reuse(args)
        if args.json:
            with open(args.json, "w") as out:
                json.dump(measured, out, indent=2)
        return 0
    # The one-table studies: (flag, the table's header, the study).
    studies = [
        (
            args.quant_agreement,
            "| runtime | quantization | greedy ids equal to full precision | memorized lines equal |",
            quant_agreement,
        ),
        (
            args.quant_quality,
            "| method | relative logit error, mean | max | same top-1 token | quantize at load, s |",
            quant_quality,
        ),
        (args.quant_kernels, "| matrix | batch | kernel | ms | weight GB/s | vs bfloat16 |", quant_kernels),
        (args.dtype_sweep, "| parameters | float32 tok/s | bfloat16 tok/s | bf16 / f32 | auto picks |", dtype_sweep),
        (
            args.constrained,
            "| batch | temperature | unconstrained tok/s | with the schema tok/s | with / without |",
            constrained_decoding,
        ),
        (args.adapters, "| comparison | with adapters tok/s | reference tok/s | ratio |", adapter_decoding),
    ]
    for wanted, header, study in studies:
        if wanted:
            print(header + "\n|" + " --- |" * (header.count("|") - 1))
            rows = study(args)
            if args.json:
                with open(args.json, "w") as out:
                    json.dump({study.__name__: rows}, out, indent=2)
            return 0
    if args.spawn or args.in_process or args.overhead:
        os.environ.setdefault("PHI2_MODEL", default_model())  # the spawned server inherits it
        args.label = args.label if args.label != "server" else os.environ["PHI2_MODEL"]
    levels = [int(c) for c in args.concurrency.split(",")]

    results: list[Result] = []
    weights = rss_now = None
    if args.overhead:
        results += overhead(args)
    if args.in_process:
        results.append(bench_in_process(args, load_in_process()))
    if args.spawn:
        server = SpawnedServer(args.ready_timeout)
        args.url = server.url
        try:
            for level in levels:
                results.append(asyncio.run(bench_http(args, level)))
            results[-1].peak_rss_gib = server.peak_rss_gib()
            rss_now = server.peak_rss_gib("VmRSS")
            weights = asyncio.run(weight_bytes(server.url))
        finally:
            server.stop()
    if not (args.in_process or args.spawn or args.overhead):  # a running server
        for level in levels:
            results.append(asyncio.run(bench_http(args, level)))
        weights = asyncio.run(weight_bytes(args.url))

    rows = [r.summary() for r in results]
    print(markdown(rows))
    if args.spawn and rss_now is not None:
        print(
            f"\nserver memory after the runs: {rss_now:.2f} GiB resident "
            f"(peak {results[-1].peak_rss_gib:.2f} GiB, loading included)"
        )
    measured = {}
    if args.bandwidth:
        limits = memory_bandwidth()  # after the server stopped: its memory is free again
        print(
            f"\nmemory: {limits['gemv_read_bytes_s'] / 1e9:.1f} GB/s read by float32 matrix-vector products, "
            f"{limits['copy_bytes_s'] / 1e9:.1f} GB/s copied (numpy, bytes copied / time)"
        )
        if weights:
            limit = limits["gemv_read_bytes_s"] / weights
            best = max(r["decode_tok_s"] for r in rows if r["concurrency"] == 1)
            print(
                f"decode limit for {weights / 1e9:.2f} GB of weights: {limit:.2f} tok/s; "
                f"measured {best:.2f} tok/s = {best / limit:.0%}"
            )
        measured = {"bandwidth": limits, "weight_bytes": weights}
    if args.overhead:
        in_process, http = rows
        print(
            "\nserver overhead: HTTP / in-process decode tok/s = "
            f"{http['decode_tok_s'] / in_process['decode_tok_s']:.3f}, "
            f"end-to-end tok/s = {http['e2e_tok_s'] / in_process['e2e_tok_s']:.3f}"
        )
    if args.json:
        with open(args.json, "w") as out:
            json.dump({"rows": rows, "raw": [asdict(r) for r in results], **measured}, out, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
