"""In process, no HTTP: the model loaded here as the server would load it, the server's request
through the backend's own decode loop (--in-process, and the in-process half of --overhead), and
one chat through two decoders over one model, prompt cache on and off (--chat TURNS --in-process)."""

from __future__ import annotations

import os
import resource
import time
from pathlib import Path

from backends.choose import load_backend, select_backend
from backends.contract import LoadOptions
from benchmarks.common import FILLER, QUESTIONS, Result, Timing, progress

# -- the model, from the server's environment variables ------------------------------------------

# This mirrors phi2_server.Settings (its fields' defaults, env_name() and load_options()) for the
# settings that choose and load the model, so that a benchmark loads what the server would,
# without importing the server: bench.py is its client. A loading setting added there belongs here.
DEFAULT_ADAPTER_PATH = "~/ml-experiment/experiments/2026-05-04-0014"  # phi2_server.DEFAULT_ADAPTER_PATH


def server_load_options(environ: dict | None = None) -> tuple[str, LoadOptions]:
    """PHI2_BACKEND, and the LoadOptions the server builds from the environment."""
    env = os.environ if environ is None else environ
    adapter_path = env.get("ADAPTER_PATH", DEFAULT_ADAPTER_PATH)
    compile_step = env.get("PHI2_COMPILE", "auto")
    options = LoadOptions(
        model=env.get("PHI2_MODEL", "microsoft/phi-2"),
        adapter_path=str(Path(adapter_path).expanduser()) if adapter_path else None,
        adapter_path_is_default=adapter_path == DEFAULT_ADAPTER_PATH,
        adapters_dir=env.get("ADAPTERS_DIR", str(Path(DEFAULT_ADAPTER_PATH).parent)) or None,
        max_adapters=int(env.get("MAX_ADAPTERS", 8)),
        device=env.get("PHI2_DEVICE", "auto"),
        dtype=env.get("PHI2_DTYPE", "auto"),
        max_batch=int(env.get("MAX_BATCH", 0)),
        compile=None if compile_step == "auto" else compile_step.strip().lower() not in ("0", "false", "no", "off", ""),
        quantize=env.get("PHI2_QUANTIZE", "").strip().lower(),
        max_context=int(env.get("MAX_MODEL_LEN", 0)),
    )
    return env.get("PHI2_BACKEND", "auto"), options


def load_in_process():
    """The backend the server would load, with this process's environment."""
    backend, options = server_load_options()
    return load_backend(select_backend(backend), options)


# -- the server's request, without HTTP ----------------------------------------------------------


def bench_in_process(args, backend) -> Result:
    """The same request through the backend's own decode loop and detokenizer, one at a time."""
    from backends.contract import Sampling, Sequence
    from backends.decoding.drive import drive

    result = Result(args.label, "in-process", 1)
    prompt_ids = backend.encode(args.prompt)
    for run in range(args.runs):
        sent = time.perf_counter()
        # The decoder the server would use: the same batch size (and so the same code path).
        decoder, detokenizer = backend.decoder(backend.max_batch), backend.detokenizer()
        first = None

        def on_tokens(step: int, tokens: dict[int, list[int]]) -> None:
            nonlocal first
            for advanced in tokens.values():  # a step may hand over no token (CUDA chains steps)
                for token in advanced:
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


def chat_in_process(args) -> list[dict]:
    """--chat TURNS --in-process: the same conversation through two decoders over one loaded
    model, one with a prompt cache and one without; each turn's TTFT (from adding the sequence
    to its first token) and whether the two decode the same ids. One model in memory, so this
    also runs in float32 at Phi-2's size."""
    from backends.contract import Sampling, Sequence
    from backends.decoding.drive import drive

    backend = load_in_process()
    with_cache = backend.decoder(backend.max_batch)
    try:  # a second fast-path decoder of its own (backend.decoder hands one thread the same one)
        from backends.torch.decoder import BatchedDecoder

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

            def on_tokens(step: int, tokens: dict[int, list[int]]) -> None:
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
        rows.append(row)
        history = prompt + backend.decode(row["on"]["ids"])
    return rows
