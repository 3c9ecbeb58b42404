"""This server against llama.cpp's llama-server on the same CPU and the same weights (issue 29).

llama.cpp is the measuring stick, not a dependency: build its server yourself (the
llama-cpp-python sdist carries the source; see BENCHMARKS.md) and give its tree with
--llama-cpp DIR (DIR/build/bin/llama-server, DIR/build/bin/llama-quantize and
DIR/convert_hf_to_gguf.py).

1. Random weights of PHI2_MODEL's architecture (default random:phi-2) are drawn once, in
   bfloat16, and saved as a checkpoint with its tokenizer; this server serves that directory,
   and llama.cpp's own converter turns the same directory into GGUF files (bf16, Q8_0, and
   Q4_0 through llama-quantize), so both sides multiply the same numbers.
2. Each pair (this server's PHI2_QUANTIZE and dtype, llama.cpp's GGUF type) runs both servers
   side by side, idle but for the one being measured, and alternates them within each
   repetition: one client, the same token-id prompts, every token count forced (ignore_eos),
   greedy, no prompt reuse (llama.cpp `cache_prompt: false`, this server PROMPT_CACHE=0) and
   no drafts (PROMPT_LOOKUP_TOKENS=0: llama-server drafts nothing without a draft model).
3. Workloads per repetition: decode at batch 1 (a 20-token prompt, --max-tokens forced
   tokens), the TTFT of that prompt, the TTFT of a --long-prompt-tokens prompt (cold, one
   token generated after it), and 4 clients x 64 tokens at once (llama-server `--parallel 4`).
   Start to ready and resident memory are read per server: this server's quantized start is
   its second one, mapping the weights the first stored (QUANTIZED_CACHE).
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import aiohttp

# (label, this server's env, llama.cpp's GGUF type); --llama-pairs picks among them by label.
PAIRS = {
    "w8a8-q8_0": ({"PHI2_QUANTIZE": "w8a8", "PHI2_DTYPE": "float32"}, "q8_0"),
    "int8-q8_0": ({"PHI2_QUANTIZE": "int8", "PHI2_DTYPE": "bfloat16"}, "q8_0"),
    "int4-q4_0": ({"PHI2_QUANTIZE": "int4", "PHI2_DTYPE": "bfloat16"}, "q4_0"),
    "bf16-bf16": ({"PHI2_QUANTIZE": "", "PHI2_DTYPE": "bfloat16"}, "bf16"),
    # llama.cpp's own block types on this server's CPU kernels (backends/torch/quant/blocks.py): the same
    # checkpoint quantized by each side's reference quantizer.
    "q8_0-q8_0": ({"PHI2_QUANTIZE": "q8_0", "PHI2_DTYPE": "float32"}, "q8_0"),
    "q4_0-q4_0": ({"PHI2_QUANTIZE": "q4_0", "PHI2_DTYPE": "float32"}, "q4_0"),
}
PAIRS_DEFAULT = "w8a8-q8_0,int8-q8_0,int4-q4_0,bf16-bf16"  # bench.py --llama-pairs
SHORT_PROMPT_TOKENS = 20
CLIENTS, CLIENT_TOKENS = 4, 64


def export_checkpoint(spec: str, out: Path) -> Path:
    """The architecture of `spec` with random weights, saved in bfloat16 with its tokenizer."""
    import torch

    from backends.choose import resolve_model
    from backends.torch.runtime import random_model

    if (out / "model.safetensors.index.json").exists() or (out / "model.safetensors").exists():
        return out
    source = resolve_model(spec)
    model = random_model(source, torch.bfloat16, "cpu")
    model.save_pretrained(out)
    for file in source.iterdir():
        if file.name.startswith("tokenizer"):
            shutil.copy(file, out / file.name)
    del model
    return out


# llama.cpp's converter knows pre-tokenizers by a hash of their output; the tiny tokenizer is
# not among them, and it splits as GPT-2 does, so a wrapper falls back to "gpt-2".
CONVERT = """
import sys
sys.path.insert(0, {tree!r})
sys.path.insert(0, {tree!r} + "/gguf-py")
import conversion.base as base
original = base.TextModel.get_vocab_base_pre
def get_vocab_base_pre(self, tokenizer):
    try:
        return original(self, tokenizer)
    except NotImplementedError:
        return "gpt-2"
base.TextModel.get_vocab_base_pre = get_vocab_base_pre
import convert_hf_to_gguf
sys.argv = ["convert_hf_to_gguf.py", *{argv!r}]
convert_hf_to_gguf.main()
"""


def gguf(tree: Path, checkpoint: Path, kind: str, out_dir: Path) -> Path:
    """checkpoint as a GGUF file of `kind` (bf16, q8_0: the converter; q4_0: llama-quantize)."""
    out = out_dir / f"model-{kind}.gguf"
    if out.exists():
        return out
    if kind == "q4_0":
        source = gguf(tree, checkpoint, "bf16", out_dir)
        subprocess.run([str(tree / "build/bin/llama-quantize"), str(source), str(out), "Q4_0"], check=True)
        return out
    argv = [str(checkpoint), "--outtype", kind, "--outfile", str(out)]
    subprocess.run([sys.executable, "-c", CONVERT.format(tree=str(tree), argv=argv)], check=True)
    return out


def start_ours(checkpoint: Path, env: dict, cache: Path, timeout: float, log: Path):
    from bench import SpawnedServer

    settings = {
        "PHI2_MODEL": str(checkpoint),
        "PHI2_CACHE_DIR": str(cache),
        "PROMPT_CACHE": "0",
        "PROMPT_LOOKUP_TOKENS": "0",
        **env,
    }
    with open(log, "ab") as output:  # its log, not the table's
        return SpawnedServer(timeout, settings, output)


def start_llama(tree: Path, model: Path, threads: int, context: int, timeout: float, log: Path):
    from bench import ServerProcess, free_port

    port = free_port()
    command = [
        str(tree / "build/bin/llama-server"),
        *("--model", str(model), "--host", "127.0.0.1", "--port", str(port)),
        *("--threads", str(threads), "--parallel", str(CLIENTS), "--ctx-size", str(context * CLIENTS)),
    ]
    with open(log, "ab") as output:
        return ServerProcess(command, f"http://127.0.0.1:{port}", timeout, ready_path="/health", output=output)


async def stream(session: aiohttp.ClientSession, side: str, url: str, ids: list[int], tokens: int) -> tuple:
    """(TTFT, total seconds, tokens generated) of one streamed greedy request of forced length."""
    if side == "llama.cpp":
        path = "/completion"
        body = {"prompt": ids, "n_predict": tokens, "ignore_eos": True, "temperature": 0, "stream": True}
        body["cache_prompt"] = False
    else:
        path = "/v1/completions"
        body = {"prompt": ids, "max_tokens": tokens, "ignore_eos": True, "temperature": 0, "stream": True}
        body["stream_options"] = {"include_usage": True}
    sent = time.perf_counter()
    first, counted, buffer = None, None, b""
    async with session.post(url + path, json=body) as response:
        if response.status != 200:
            raise RuntimeError(f"{side}: HTTP {response.status}: {await response.text()}")
        async for chunk in response.content.iter_any():
            now = time.perf_counter()
            *lines, buffer = (buffer + chunk).split(b"\n")
            for line in lines:
                if not line.startswith(b"data: ") or line == b"data: [DONE]":
                    continue
                event = json.loads(line[6:])
                if side == "llama.cpp":
                    if event.get("stop"):
                        counted = event["tokens_predicted"]
                    elif first is None:
                        first = now
                elif event.get("usage"):
                    counted = event["usage"]["completion_tokens"]
                elif event.get("choices") and first is None:
                    first = now
    total = time.perf_counter() - sent
    if counted != tokens or first is None:
        raise RuntimeError(f"{side}: {counted} tokens streamed for {tokens} forced")
    return first - sent, total, counted


async def workloads(side: str, url: str, short: list[int], long: list[int], tokens: int) -> dict:
    timeout = aiohttp.ClientTimeout(total=3600)
    # A connection per request: llama-server closes one after a streamed answer.
    connector = aiohttp.TCPConnector(force_close=True)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
        await stream(session, side, url, short, 2)  # each side's first request pays one-off costs
        ttft, total, n = await stream(session, side, url, short, tokens)
        long_ttft, _, _ = await stream(session, side, url, long, 1)
        started = time.perf_counter()
        # Each client its own prompt (its first id differs), so none shares another's work.
        prompts = [[(short[0] + i) % 500 + 1, *short[1:]] for i in range(CLIENTS)]
        done = await asyncio.gather(*(stream(session, side, url, p, CLIENT_TOKENS) for p in prompts))
        wall = time.perf_counter() - started
    return {
        "decode_tok_s": (n - 1) / (total - ttft),
        "ttft_short_s": ttft,
        "ttft_long_s": long_ttft,
        "aggregate_tok_s": sum(d[2] for d in done) / wall,
    }


def prompt_ids(url: str, count: int) -> list[int]:
    """`count` token ids of the README's text, through this server's tokenizer (both sides read the ids)."""
    text = (Path(__file__).resolve().parent.parent / "README.md").read_text()[:6000]

    async def tokenize() -> list[int]:
        async with aiohttp.ClientSession() as session:
            async with session.post(url + "/tokenize", json={"prompt": text}) as response:
                return (await response.json())["tokens"]

    ids = asyncio.run(tokenize())
    return (ids * (count // len(ids) + 1))[:count]


# PHI2_MODEL a GGUF file: both servers serve one file, this server as stored (its default). "file":
# the file itself; "q8_0", "q4_0", "q4_k_m": the file requantized by llama-quantize
# (--allow-requantize; Q4_K_M, the most common download, this server serves in Q8_0 blocks).
FILE_PAIRS = ("file", "q8_0", "q4_0", "q4_k_m")


def requantized(tree: Path, source: Path, kind: str, out_dir: Path) -> Path:
    if kind == "file":
        return source
    out = out_dir / f"{source.stem}-{kind}.gguf"
    if not out.exists():
        command = [str(tree / "build/bin/llama-quantize"), "--allow-requantize", str(source), str(out), kind.upper()]
        subprocess.run(command, check=True, capture_output=True)
    return out


def compare(args) -> list[dict]:
    from backends.files.models import gguf_file

    tree = Path(args.llama_cpp).resolve()
    spec = os.environ.get("PHI2_MODEL", "random:phi-2")
    work = Path(args.llama_work or tempfile.mkdtemp(prefix="phi2-llama-"))
    work.mkdir(parents=True, exist_ok=True)
    source = gguf_file(spec)
    checkpoint = None if source else export_checkpoint(spec, work / "checkpoint")
    threads = os.cpu_count() or 1
    rows = []
    labels = args.llama_pairs.split(",") if args.llama_pairs != PAIRS_DEFAULT or not source else ["file", "q8_0"]
    for label in labels:
        if source:  # the same file on both sides; this server's first start converts and stores it
            env, kind = {"PHI2_QUANTIZE": ""}, label
            model = checkpoint = requantized(tree, source, label, work)
        else:
            env, kind = PAIRS[label]
            model = gguf(tree, checkpoint, kind, work)
        cache = Path(tempfile.mkdtemp(prefix="phi2-llama-cache-"))
        log = work / f"{label}.log"
        sides = {}
        try:
            if env["PHI2_QUANTIZE"] or source:  # the first start quantizes and stores; the measured one maps
                first = start_ours(checkpoint, env, cache, args.ready_timeout, log)
                first_ready = first.ready_s
                first.stop()
            sides["this server"] = ours = start_ours(checkpoint, env, cache, args.ready_timeout, log)
            ready_rss = {"this server": ours.peak_rss_gib("VmRSS")}
            sides["llama.cpp"] = start_llama(tree, model, threads, 2048, args.ready_timeout, log)
            ready_rss["llama.cpp"] = sides["llama.cpp"].peak_rss_gib("VmRSS")
            sides = {"llama.cpp": sides["llama.cpp"], "this server": ours}
            short = prompt_ids(ours.url, SHORT_PROMPT_TOKENS)
            long = prompt_ids(ours.url, args.long_prompt_tokens)
            runs = {side: [] for side in sides}
            for repetition in range(args.runs):
                order = list(sides) if repetition % 2 == 0 else list(sides)[::-1]
                for side in order:
                    measured = asyncio.run(workloads(side, sides[side].url, short, long, args.max_tokens))
                    runs[side].append(measured)
                    print(f"[{label} {side} run {repetition + 1}] {json.dumps(measured)}", file=sys.stderr, flush=True)
            for side, process in sides.items():
                row = {"pair": label, "side": side, "gguf": kind if side == "llama.cpp" else None, **env}
                for key in runs[side][0]:
                    row[key] = statistics.median(run[key] for run in runs[side])
                    row[key + "_runs"] = [round(run[key], 3) for run in runs[side]]
                row["ready_s"] = process.ready_s
                stored = env["PHI2_QUANTIZE"] or source
                row["first_ready_s"] = first_ready if side == "this server" and stored else None
                row["rss_ready_gib"], row["rss_after_gib"] = ready_rss[side], process.peak_rss_gib("VmRSS")
                row["peak_rss_gib"] = process.peak_rss_gib()
                rows.append(row)
                print(
                    f"| {label} | {side} | {row['decode_tok_s']:.2f} | {row['ttft_short_s']:.2f} s "
                    f"| {row['ttft_long_s']:.1f} s | {row['aggregate_tok_s']:.2f} | {row['ready_s']:.1f} s "
                    f"| {row['rss_ready_gib']:.2f} / {row['rss_after_gib']:.2f} / {row['peak_rss_gib']:.2f} GiB |",
                    flush=True,
                )
        finally:
            for process in sides.values():
                process.stop()
            shutil.rmtree(cache, ignore_errors=True)
    return rows
