"""A prompt cancelled mid-prefill keeps what it computed, on CUDA (issue 68), and a 19k-token
cold prompt's time to its first token, with a Qwen2.5-1.5B-shaped model (random weights, bf16).

    python3 -P tests/gpu/prefill_keep.py --out $OUT

1. A 12,000-token prompt joins while another sequence decodes, so its pieces run beside the
   decode steps on their own stream (8,192 tokens of them at once); it is removed once those were
   read, then sent again: the retry
   reuses exactly the positions read (`cached`), and its greedy ids equal a decoder's without a
   cache. 2. The same with no other sequence: the whole prompt is one pass, then removed after
   its first token: reused whole. 3. A cold 18,783-token prompt (Claude Code's first request's
   length) to its first token, through the server's decoder, 3 times. Writes --out/prefill_keep.json.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from backends.choose import load_backend  # noqa: E402
from backends.contract import LoadOptions, Sampling, Sequence  # noqa: E402
from backends.decoding.drive import drive  # noqa: E402


def prompt_of(length: int, seed: int = 0, vocabulary: int = 30000) -> list[int]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(100, vocabulary, (length,), generator=generator).tolist()


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="gpu-results")
    parser.add_argument("--model", default="random:qwen2.5-1.5b")
    parser.add_argument("--long", type=int, default=12000, help="the prompt removed part-way")
    parser.add_argument("--cold", type=int, default=18783, help="the cold prompt timed")
    args = parser.parse_args()  # (--model tiny --long 300 --cold 400: a smoke test of this script on a CPU)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    backend = load_backend("torch", LoadOptions(model=args.model, device=device, warmup=False))
    vocabulary, context = min(30000, backend.vocab_size), backend.info.context_length
    results, ok = {"device": torch.cuda.get_device_name() if device == "cuda" else "cpu"}, True

    # 1. Beside a decoding sequence: pieces on the side stream, removed part-way.
    decoder = backend.decoder(8, prompt_cache_bytes=4 << 30)
    long = prompt_of(args.long, 1, vocabulary)  # 12,000: past the 8,192 tokens of pieces launched at once
    other = Sequence(1, prompt_of(40, 2, vocabulary), Sampling(), min(4000, context - 41))
    decoder.add(other)
    while not decoder.step():
        pass
    decoder.add(Sequence(2, long, Sampling(), 8))
    steps = 0
    while decoder.rows[decoder.row_of[2]].cached == 0 and steps < 10_000:
        decoder.step()
        steps += 1
    cached = decoder.rows[decoder.row_of[2]].cached
    decoder.remove(2)
    reused = decoder.add(Sequence(3, long, Sampling(), 8))
    tokens = []
    while len(tokens) < 8:
        tokens += decoder.step().get(3, [])
    decoder.remove(1, 3)
    fresh = drive(backend.decoder(8, prompt_cache_bytes=0), [Sequence(4, long, Sampling(), 8)])
    beside = {"cached_when_removed": cached, "reused": reused, "same_ids": tokens[:8] == fresh.ids[4]}
    results["beside_a_decoding_sequence"] = beside
    ok &= 0 < cached < len(long) and reused == cached and beside["same_ids"]

    # 2. Alone: one pass, removed after its first token.
    decoder = backend.decoder(8, prompt_cache_bytes=4 << 30)
    decoder.add(Sequence(5, long, Sampling(), 8))
    while not decoder.step():
        pass
    decoder.remove(5)
    reused = decoder.add(Sequence(6, long, Sampling(), 8))
    decoder.remove(6)
    results["alone"] = {"reused": reused}
    ok &= reused == len(long) - 1

    # 3. A cold 18,783-token prompt to its first token.
    prompt = prompt_of(args.cold, 3, vocabulary)
    times = []
    for run in range(3):
        decoder = backend.decoder(8, prompt_cache_bytes=0)
        if device == "cuda":
            torch.cuda.synchronize()
        began = time.perf_counter()
        decoder.add(Sequence(10 + run, prompt, Sampling(), 1))
        while not decoder.step():
            pass
        times.append(time.perf_counter() - began)
        decoder.remove(10 + run)
    results["cold_prompt"] = {"tokens": len(prompt), "ttft_s": times}
    results["ok"] = bool(ok)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "prefill_keep.json").write_text(json.dumps(results, indent=2))
    print(json.dumps(results, indent=2))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
