"""Prompt-lookup speculative decoding (PROMPT_LOOKUP_TOKENS), in process, on one loaded model
(PHI2_MODEL default random:phi-2), one sequence at a time through the server's decoder.

Two parts, in one run:
- What a verify pass costs: the next input and k draft tokens through the decoder's prefill path,
  against one decode step, on the same sequence (Torch's batched decoder). A draft of k tokens of
  which a are accepted gives a + 1 tokens for that cost: the break-even and the most it can give.
- Decoding with drafts off and on, alternated, on an input-grounded workload (the model asked to
  repeat a text it was given) and on open text (sampled), with the tokens per step, decode
  tokens/s, and for greedy whether the ids are the same.

Random weights do not copy their input as a trained model does: what they accept is what they
repeat of their own loops. The verify costs, and tokens per step, say what a trained model's
acceptance would give.
"""

from __future__ import annotations

import os
import statistics
import time

from benchmarks.common import time_call

DOCUMENT = (
    "def parse_header(line):\n"
    "    key, _, value = line.partition(':')\n"
    "    return key.strip().lower(), value.strip()\n\n"
    "def parse_headers(lines):\n"
    "    headers = {}\n"
    "    for line in lines:\n"
    "        key, value = parse_header(line)\n"
    "        headers[key] = value\n"
    "    return headers\n"
)
GROUNDED = f"Rewrite this code exactly as it is.\n\n{DOCUMENT}\nThe same code:\n\n{DOCUMENT[:40]}"
OPEN = "Write a short story about a lighthouse keeper who finds a message in a bottle."


def prompt_lookup_decoding(args) -> list[dict]:
    from backends.contract import Sampling, Sequence
    from backends.decoding.drive import drive
    from benchmarks.in_process import load_in_process

    os.environ.setdefault("PHI2_MODEL", "random:phi-2")
    backend = load_in_process()
    decoder = backend.decoder(backend.max_batch)
    rows = []
    workloads = [
        ("input-grounded (repeat a given text), greedy", GROUNDED, Sampling()),
        ("open text, greedy", OPEN, Sampling()),
        ("open text, sampled (temperature 1)", OPEN, Sampling(temperature=1.0)),
    ]
    for name, prompt, sampling in workloads:
        ids = backend.encode(prompt)
        runs = {0: [], backend.draft_tokens or 4: []}
        for run in range(args.runs):
            for drafts in runs:
                decoder.draft_tokens = drafts
                first: list[float] = []
                started = time.perf_counter()
                driven = drive(
                    decoder,
                    [Sequence(run, ids, sampling, args.max_tokens)],
                    on_tokens=lambda step, tokens: first or (tokens and first.append(time.perf_counter())),
                )
                seconds = time.perf_counter() - first[0]
                runs[drafts].append(
                    {
                        "tokens_per_second": (args.max_tokens - 1) / seconds,
                        "tokens_per_step": args.max_tokens / driven.steps,
                        "ids": driven.ids[run],
                        "total_s": time.perf_counter() - started,
                    }
                )
        off, on = runs.values()
        same = None
        if sampling.greedy:  # the same ids, or where the first pair parts
            a, b = off[0]["ids"], on[0]["ids"]
            same = "yes" if all(x["ids"] == y["ids"] for x, y in zip(off, on, strict=True)) else "no"
            if a != b:
                same += f" (from token {next(i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y)})"
        row = {
            "workload": name,
            "prompt_tokens": len(ids),
            "off": [r["tokens_per_second"] for r in off],
            "on": [r["tokens_per_second"] for r in on],
            "tokens_per_step": statistics.median(r["tokens_per_step"] for r in on),
            "same_ids": same,
        }
        ratio = statistics.median(row["on"]) / statistics.median(row["off"])
        print(
            f"| {name} | {len(ids)} | {fmt(row['off'])} | {fmt(row['on'])} | {row['tokens_per_step']:.2f} "
            f"| {ratio:.2f}x | {'-' if same is None else same} |"
        )
        rows.append({**row, "ratio": ratio})
    decoder.draft_tokens = backend.draft_tokens
    if hasattr(decoder, "_prefill"):  # Torch's batched decoder
        rows += verify_costs(backend, decoder, args.runs)
    return rows


def fmt(values: list[float]) -> str:
    return " / ".join(f"{v:.2f}" for v in values)


def verify_costs(backend, decoder, runs: int) -> list[dict]:
    """One decode step against one verify pass of 1 + k tokens, on a sequence 100 tokens in."""
    import torch

    from backends.contract import Sampling, Sequence

    decoder.draft_tokens = 0
    decoder.add(Sequence(10_000, backend.encode(OPEN * 4)[:100], Sampling(), 10_000))
    while not decoder.step():  # its prefill
        pass
    slot = decoder.slots[0]
    rows = []
    print("\n| pass | tokens in | median time | / decode step | tokens it may give |\n| --- | --- | --- | --- | --- |")
    # A step's time includes the device's (CUDA's steps are launched asynchronously).
    sync = torch.cuda.synchronize if decoder.device.type == "cuda" else (lambda: None)
    with torch.inference_mode():
        step = statistics.median(time_call(lambda: (decoder.step(), sync())) for _ in range(max(runs, 3) * 2))
        print(f"| decode step | 1 | {step * 1000:.0f} ms | 1.00 | 1 |")
        for k in (1, 2, 3, 4, 8):
            ids = [slot.next_token] + [7] * k  # where the sequence is: the columns after it are free
            cost = statistics.median(
                time_call(lambda ids=ids: (decoder._prefill([(0, ids, slot.cached)], every_position=[0]), sync()))
                for _ in range(max(runs, 3) * 2)
            )
            print(f"| verify pass, k = {k} | {k + 1} | {cost * 1000:.0f} ms | {cost / step:.2f} | {k + 1} |")
            rows.append({"k": k, "verify_ms": cost * 1000, "step_ms": step * 1000, "ratio": cost / step})
    decoder.remove(10_000)
    decoder.draft_tokens = backend.draft_tokens
    return rows
