"""A Claude Code session at full size, replayed (issue 68): its captured requests
(tests/data/agents, Claude Code 2.1.197's default system prompt and 25 tools, ~18.8k tokens) sent to
this server and to llama.cpp's llama-server on the same GGUF file, its Anthropic route, one after
the other, and the time to each turn's first token.

    python benchmarks/agent_session.py --model FILE.gguf --llama-server PATH/llama-server [--json OUT]

Turns, in order, each streamed until its first content (a delta with text: not a keep-alive's
empty one), then its stream read to the end (so the turn's prompt and reply are what the next
turn continues from, as in a session):
1. the first turn, cold (`claude_code_first.json`);
2. its tool round trip (`claude_code_tool_result.json`: the same prompt plus a Bash call and its
   result);
3. a second session's first turn: the first request with another billing header (`.e84`);
4. after a restart of this server (its PROMPT_CACHE_DIR kept), a third session's first turn
   (`.2f1`); llama-server keeps nothing across a restart, so this turn would be its first again.

Both servers decode greedily with `max_tokens` MAX_TOKENS (the turn's reply is not what is
measured). The targets (issue 68): turn 1 at least as fast as llama-server's; turn 2 <= 5 s; turns
3 and 4 <= 10 s.
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import aiohttp

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench import ServerProcess, free_port  # noqa: E402

AGENTS = ROOT / "tests" / "data" / "agents"
MAX_TOKENS = 16
NAME = "qwen"


def captured(name: str, suffix: str | None = None) -> dict:
    body = json.loads((AGENTS / f"{name}.json").read_text())["body"]
    body = {**copy.deepcopy(body), "model": NAME, "max_tokens": MAX_TOKENS, "temperature": 0, "stream": True}
    if suffix is not None:
        for block in body["system"]:
            block["text"] = block["text"].replace("cc_version=2.1.197.1c0", f"cc_version=2.1.197.{suffix}")
    return body


async def turn(url: str, body: dict) -> dict:
    """The turn's time to its first content block delta and to its end, and its usage."""
    started = time.perf_counter()
    first, usage = None, {}
    timeout = aiohttp.ClientTimeout(total=3600)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        async with session.post(url + "/v1/messages", json=body, headers={"x-api-key": "dummy"}) as response:
            if response.status != 200:
                return {"status": response.status, "error": (await response.text())[:300]}
            async for line in response.content:
                if not line.startswith(b"data: "):
                    continue
                event = json.loads(line[6:])
                delta = event.get("delta", {}) if event["type"] == "content_block_delta" else {}
                if first is None and any(delta.get(k) for k in ("text", "thinking", "partial_json")):
                    first = time.perf_counter() - started  # not the keep-alive's empty deltas
                if event["type"] == "message_start":
                    usage.update(event["message"].get("usage", {}))
                if event["type"] == "message_delta":
                    usage.update(event.get("usage", {}))
    return {"status": 200, "ttft_s": first, "total_s": time.perf_counter() - started, "usage": usage}


def this_server(model: str, cache_dir: str, log) -> ServerProcess:
    port = free_port()
    env = {"PHI2_MODEL": model, "SERVED_MODEL_NAME": NAME, "PROMPT_CACHE_DIR": cache_dir, "REQUEST_TIMEOUT": "3600"}
    command = [sys.executable, str(ROOT / "phi2_server.py"), "--host", "127.0.0.1", "--port", str(port)]
    return ServerProcess(command, f"http://127.0.0.1:{port}", 1800, env, output=log)


def llama_server(binary: str, model: str, context: int, log) -> ServerProcess:
    port = free_port()
    command = [binary, "-m", model, "--port", str(port), "-c", str(context), "--threads", "2", "--jinja"]
    command += ["--parallel", "1", "--alias", NAME]
    return ServerProcess(command, f"http://127.0.0.1:{port}", 1800, ready_path="/health", output=log)


def session(start, label: str, restart: bool = True) -> list[dict]:
    turns = [("first turn, cold", captured("claude_code_first"))]
    turns.append(("tool round trip", captured("claude_code_tool_result")))
    turns.append(("second session", captured("claude_code_first", "e84")))
    rows = []
    server = start()
    try:
        for name, body in turns:
            result = asyncio.run(turn(server.url, body))
            print(f"{label:12} {name:18} {json.dumps(result)}", flush=True)
            rows.append({"server": label, "turn": name, **result})
    finally:
        server.stop()
    if not restart:
        return rows
    server = start()
    try:
        result = asyncio.run(turn(server.url, captured("claude_code_first", "2f1")))
        print(f"{label:12} {'after a restart':18} {json.dumps(result)}", flush=True)
        rows.append({"server": label, "turn": "after a restart", "ready_s": server.ready_s, **result})
    finally:
        server.stop()
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, help="a GGUF file both servers serve")
    parser.add_argument("--llama-server", help="llama.cpp's llama-server binary (leave out: this server only)")
    parser.add_argument("--context", type=int, default=32768, help="llama-server's -c (default: %(default)s)")
    parser.add_argument("--json", help="write the rows here")
    args = parser.parse_args(argv)
    cpu = subprocess.run(["sh", "-c", "grep -o -w 'avx512[a-z_0-9]*\\|amx[a-z_0-9]*\\|avx2' /proc/cpuinfo | sort -u"],
                         capture_output=True, text=True).stdout.split()  # fmt: skip
    print("CPU flags:", " ".join(cpu), "| cores:", os.cpu_count(), flush=True)
    rows = []
    with tempfile.TemporaryDirectory() as cache_dir, open(os.devnull, "w") as log:
        rows += session(lambda: this_server(args.model, cache_dir, log), "phi2-server")
        if args.llama_server:
            # llama-server keeps no prompt across a restart: its fourth turn would be its first again.
            start = lambda: llama_server(args.llama_server, args.model, args.context, log)  # noqa: E731
            rows += session(start, "llama-server", restart=False)
    print("| turn | " + " | ".join(dict.fromkeys(r["server"] for r in rows)) + " |")
    for name in dict.fromkeys(r["turn"] for r in rows):
        cells = [f"{r['ttft_s']:.1f} s" if r.get("ttft_s") else str(r.get("status")) for r in rows if r["turn"] == name]
        print(f"| {name} | " + " | ".join(cells) + " |")
    if args.json:
        Path(args.json).write_text(json.dumps({"cpu": cpu, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
