"""Issue 30's graphed prefill and MAX_BATCH default on a CUDA machine.

    python3 tests/gpu/prefill.py --out $OUT [--shapes random:phi-2,random:llama-3.2-1b] [--no-serve]

1. parity, per shape, float32 then bfloat16: new prompts prefilled padded from CUDA graphs
   (`Graphs.prefill_padded`) against the same prompts prefilled eagerly
   (`prefill_graphs=False`): the last-token logits of prompts of 3 to 250 tokens, and the greedy
   ids of 8 prompts decoded together by each (and, graphed, each alone); then pieces after
   cached columns: 6 prompts of 40-790 tokens chunked 64 tokens a step while others decode
   (graphed against eager and against each alone), and a 30-token tail after a stored 600-token
   prefix against no prompt cache.
2. in process, bfloat16: a 24-token prompt's prefill (`logits_after`, median of 30), and 64
   distinct prompts' prefill and first token (median of 5), graphed against eager.
3. real servers driven by bench.py over HTTP (the server's own MAX_QUEUE unless --queue), 128
   tokens a request, at each of --levels: 1 client with a new sampled prompt each run (the TTFT
   of a prompt not seen before), 1 client sending the same prompt (a stored prefix's), the same
   two with a ~1,040-token prompt, 64-512 clients with distinct sampled prompts, and `latency`
   (bench.py --latency: a 1,044-token prompt alone, then 63 streams' inter-token gaps while such
   prompts arrive); for each MAX_BATCH of --batches (0: the default; the MAX_BATCH it chose and
   its kv_cache are reported), and with --baseline DIR (a checkout of an earlier commit: `git
   worktree add DIR COMMIT`) the same workloads against that tree's server first, in the same run.
Writes every number to --out/prefill.json as it goes; prints a summary last.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests" / "gpu"))

import torch  # noqa: E402
from check import say, timed_cuda  # noqa: E402

from backends.choose import load_backend  # noqa: E402
from backends.contract import LoadOptions, Sampling, Sequence  # noqa: E402
from backends.decoding.drive import drive  # noqa: E402
from backends.torch.decoder import BatchedDecoder  # noqa: E402

RESULTS: dict = {}
CONTEXT = 2048  # the in-process decoders' window: Llama's 131,072 at 64 rows would not fit


def prompt_of(length: int, salt: int = 0) -> list[int]:
    return [5 + (i * 37 + salt * 101) % 580 for i in range(length)]


def release() -> None:
    import gc

    gc.collect()
    torch.cuda.empty_cache()


def save(out: Path) -> None:
    (out / "prefill.json").write_text(json.dumps(RESULTS, indent=1, default=str))


def parity(shape: str, dtype: str) -> dict:
    backend = load_backend("torch", LoadOptions(model=shape, device="cuda", dtype=dtype, warmup=False))
    weights = backend.decoder_weights
    graphed = BatchedDecoder(weights, 8, context=CONTEXT)
    eager = BatchedDecoder(weights, 8, context=CONTEXT, prefill_graphs=False)
    assert graphed.prefill_graphs and not eager.prefill_graphs
    result = {"logits": {}}
    for n in (3, 17, 24, 100, 250):
        a, b = graphed.logits_after(prompt_of(n)), eager.logits_after(prompt_of(n))
        result["logits"][n] = {"max_abs_diff": float((a - b).abs().max()), "scale": float(b.abs().max())}
    result["prefill_graphs_captured"] = len(graphed.graphs.padded_graphs)
    sequences = [Sequence(i, prompt_of(5 + 29 * i, i), Sampling(), 32) for i in range(8)]
    together_graphed = drive(graphed, sequences).ids
    together_eager = drive(eager, sequences).ids
    alone = [drive(BatchedDecoder(weights, 1, context=CONTEXT), [s]).ids[s.id] for s in sequences]
    result["greedy_graphed_equals_eager"] = sum(together_graphed[i] == together_eager[i] for i in range(8))
    result["greedy_graphed_together_equals_alone"] = sum(together_graphed[i] == alone[i] for i in range(8))
    result["first_divergence_graphed_vs_eager"] = [
        next((t for t, (x, y) in enumerate(zip(together_graphed[i], together_eager[i], strict=False)) if x != y), None)
        for i in range(8)
    ]
    # Pieces after cached columns, padded to a graph's shape (a span): the chunks of prompts that
    # arrive while others decode, 64 tokens a step, and a stored prefix's tail.
    sequences = [Sequence(i, prompt_of(40 + 150 * i, i), Sampling(), 24) for i in range(6)]
    arrive = {i: 2 for i in range(1, 6)}
    chunked = BatchedDecoder(weights, 8, context=CONTEXT, prefill_chunk=64)
    chunked_ids = drive(chunked, sequences, arrive_at=arrive).ids
    eager_ids = drive(
        BatchedDecoder(weights, 8, context=CONTEXT, prefill_chunk=64, prefill_graphs=False), sequences, arrive_at=arrive
    ).ids
    result["continued_graphs_used"] = sorted(key for key in chunked.graphs.padded_graphs if key[2])
    result["chunked_graphed_equals_eager"] = sum(chunked_ids[s.id] == eager_ids[s.id] for s in sequences)
    result["chunked_graphed_equals_alone"] = sum(
        chunked_ids[s.id] == drive(BatchedDecoder(weights, 1, context=CONTEXT), [s]).ids[s.id] for s in sequences
    )
    cached = BatchedDecoder(weights, 2, context=CONTEXT, prompt_cache_bytes=1 << 30)
    drive(cached, [Sequence(100, prompt_of(600, 9), Sampling(), 4)])
    turn = Sequence(101, prompt_of(600, 9) + prompt_of(30, 10), Sampling(), 24)
    with_cache = drive(cached, [turn])
    result["tail_cached_tokens"] = with_cache.cached[101]
    result["tail_graphed_equals_no_cache"] = (
        with_cache.ids[101] == drive(BatchedDecoder(weights, 1, context=CONTEXT), [turn]).ids[101]
    )
    say(shape, dtype, "parity", result)
    return result


def in_process(shape: str) -> dict:
    backend = load_backend("torch", LoadOptions(model=shape, device="cuda", dtype="bfloat16", warmup=False))
    weights = backend.decoder_weights
    result = {}
    for label, graphs in (("graphed", True), ("eager", False)):
        decoder = BatchedDecoder(weights, 64, context=CONTEXT, prefill_graphs=graphs)
        started = time.perf_counter()
        decoder.capture()
        result[f"{label}_capture_s"] = time.perf_counter() - started
        prompt = prompt_of(24)
        for _ in range(3):
            decoder.logits_after(prompt)
        times = [timed_cuda(lambda: decoder.logits_after(prompt)) for _ in range(30)]  # noqa: B023
        result[f"{label}_prefill_24_tokens_ms"] = statistics.median(times) * 1000
        sequences = [
            Sequence(i, prompt_of(20 + i % 11, i), Sampling(temperature=0.8, top_p=0.95, seed=i), 1) for i in range(64)
        ]
        drive(decoder, sequences)
        times = [timed_cuda(lambda: drive(decoder, sequences)) for _ in range(5)]  # noqa: B023
        result[f"{label}_64_prompts_first_tokens_ms"] = statistics.median(times) * 1000
        decoder = None
        release()
    say(shape, "in process", result)
    return result


def serve(
    shape: str,
    out: Path,
    max_batch: str,
    levels: list[tuple[str, list[str]]],
    tree: Path = ROOT,
    queue: str = "",
    extra_env: dict | None = None,
    script: str = "phi2_server.py",
) -> dict:
    """phi2_server.py of `tree` on `shape` (bench.py's ServerProcess), driven by this tree's
    bench.py at each level."""
    import urllib.request

    from bench import ServerProcess, free_port

    variant = "-baseline" if tree != ROOT else "".join(f"-{k}{v}" for k, v in (extra_env or {}).items())
    logs = out / f"server-{shape.split(':')[-1]}-batch{max_batch}{variant}"
    logs.mkdir(parents=True, exist_ok=True)
    env = {"PHI2_MODEL": shape, "MAX_BATCH": max_batch, "LOG_DIR": str(logs), "ADAPTER_PATH": ""}
    if queue:
        env["MAX_QUEUE"] = queue
    env.update(extra_env or {})
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    command = [sys.executable, str(tree / script), "--port", str(port)]
    try:
        server = ServerProcess(command, url, 300, env, output=open(logs / "server.log", "w"))
    except SystemExit as failed:
        say(shape, "server", max_batch, failed)
        return {"startup_to_ready_s": None, "error": str(failed)}
    result = {"startup_to_ready_s": server.ready_s}
    with urllib.request.urlopen(url + "/model/info", timeout=5) as response:
        info = json.loads(response.read())
    result["max_batch"], result["context_length"] = info.get("max_batch"), info.get("context_length")
    result["kv_cache"] = info.get("kv_cache")
    for level, extra in levels:
        long = "-long" if any(len(x) > 1000 for x in extra) else ""
        name = f"bench-{level}{long}{'-distinct' if '--distinct' in extra else '-same'}.json"
        command = [sys.executable, str(ROOT / "bench.py"), "--url", url, "--json", str(logs / name)]
        if level == "latency":  # a 1,044-token prompt alone, then 63 streams' gaps as such prompts arrive
            command += ["--latency"]
        else:
            command += ["--concurrency", level, "--max-tokens", "128", "--runs", "3", "--label", shape, *extra]
        bench = subprocess.run(command, capture_output=True, text=True, timeout=400)
        say(bench.stdout, bench.stderr[-1500:])
        result[name] = json.loads((logs / name).read_text()) if (logs / name).exists() else bench.stderr[-500:]
        with urllib.request.urlopen(url + "/model/info", timeout=5) as response:  # the worker's time, cumulative
            result[name.replace(".json", " stats")] = json.loads(response.read())["stats"]
    server.stop()
    say(shape, "server", max_batch, {k: v for k, v in result.items() if not k.startswith("bench")})
    return result


# About 24 tokens of random:phi-2's tokenizer (bench.py reports the count).
PROMPT_24 = "Alice: How are you today? Bob: I am fine, thank you. And you? Alice: What is"
# About 1,040 tokens (bench.py reports the count): the long prompt, cold and stored.
PROMPT_LONG = " ".join(f"line {i}: the quick brown fox jumps over the lazy dog." for i in range(80))
LEVELS = {
    "1new": ("1", ["--prompt", PROMPT_24, "--distinct"]),
    "1same": ("1", ["--prompt", PROMPT_24]),
    "1long-new": ("1", ["--prompt", PROMPT_LONG, "--distinct"]),
    "1long-same": ("1", ["--prompt", PROMPT_LONG]),
    **{n: (n, ["--distinct"]) for n in ("64", "128", "256", "512")},
    "latency": ("latency", []),
}


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="gpu-results")
    parser.add_argument("--shapes", default="random:phi-2,random:llama-3.2-1b")
    parser.add_argument("--no-serve", action="store_true")
    parser.add_argument("--no-parity", action="store_true", help="skip sections 1 and 2")
    parser.add_argument("--baseline", metavar="DIR", help="an earlier commit's checkout, served beside this one")
    parser.add_argument("--levels", default="1new,1same,64,256", help=f"of {', '.join(LEVELS)}")
    parser.add_argument("--batches", default="64,0", help="MAX_BATCH of each server (0: its default)")
    parser.add_argument("--queue", default="", help="MAX_QUEUE (default: the server's)")
    parser.add_argument("--env", default="", help="more of the servers' environment, K=V,K=V")
    parser.add_argument("--server", default="phi2_server.py", help="the script that serves, in the tree")
    parser.add_argument("--label", default="", help="a suffix for this run's result keys")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    say(torch.cuda.get_device_name(), torch.__version__)
    torch.backends.cuda.matmul.allow_tf32 = False
    shapes = [s for s in args.shapes.split(",") if s]
    for shape in [] if args.no_parity else shapes:
        for dtype in ("float32", "bfloat16"):
            try:
                RESULTS[f"parity {shape} {dtype}"] = parity(shape, dtype)
            except Exception as exc:
                RESULTS[f"parity {shape} {dtype}"] = f"{type(exc).__name__}: {exc}"[:500]
                say(RESULTS[f"parity {shape} {dtype}"])
            release()
            save(out)
        RESULTS[f"in process {shape}"] = in_process(shape)
        release()
        save(out)
    if not args.no_serve:
        shape = shapes[0]
        levels = [LEVELS[name] for name in args.levels.split(",")]
        for batch in args.batches.split(","):
            label = "default" if batch == "0" else f"batch{batch}"
            if args.baseline:
                RESULTS[f"serve {shape} {label} baseline"] = serve(
                    shape, out, batch, levels, Path(args.baseline), args.queue
                )
                save(out)
            extra = dict(pair.split("=", 1) for pair in args.env.split(",") if pair)
            RESULTS[f"serve {shape} {label}{args.label}"] = serve(
                shape, out, batch, levels, queue=args.queue, extra_env=extra, script=args.server
            )
            save(out)
        for key, result in RESULTS.items():
            if key.startswith("serve"):
                for name, bench in result.items():
                    if name.startswith("bench") and isinstance(bench, dict) and "rows" in bench:
                        row = bench["rows"][0]
                        say(
                            f"{key} {name}: {row['aggregate_tok_s']:.0f} tok/s, TTFT median {row['ttft_ms']:.1f} "
                            f"max {row.get('ttft_max_ms', 0):.1f} ms (server's median {row.get('server_ttft_ms')}), "
                            f"max_batch {result.get('max_batch')}"
                        )
    say(json.dumps({k: v for k, v in RESULTS.items() if not k.startswith("serve")}, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
