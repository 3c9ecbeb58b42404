"""Constrained decoding in process: tok/s with and without a typical JSON Schema per batch
size (--constrained), and whether sampled outputs under a small schema validate."""

from __future__ import annotations

import json
import os
import statistics
import time

from benchmarks.common import time_call
from benchmarks.in_process import load_in_process

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
    from backends.contract import Sampling, Sequence
    from backends.decoding.drive import drive

    os.environ.setdefault("PHI2_MODEL", "random:phi-2")
    backend = load_in_process()
    tokenizer_s = time_call(lambda: backend.grammars.tokenizer)
    spec = json.dumps(TYPICAL_SCHEMA)
    compile_s = time_call(lambda: backend.constraint("json_schema", spec))
    constraint = backend.constraint("json_schema", spec)
    print(
        f"grammar tokenizer built in {tokenizer_s * 1000:.0f} ms; "
        f"schema compiled in {compile_s * 1000:.2f} ms "
        f"(cached: {time_call(lambda: backend.constraint('json_schema', spec)) * 1e6:.0f} us)",
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
    from backends.contract import Sampling, Sequence
    from backends.decoding.drive import drive

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


# A tool whose one argument is long free text, so that a call keeps generating for the whole run
# (random weights would otherwise close it early), as TYPICAL_SCHEMA does for response_format.
NOTE_TOOL = {
    "name": "save_note",
    "parameters": {
        "type": "object",
        "properties": {"title": {"type": "string", "maxLength": 40}, "body": {"type": "string", "minLength": 4000}},
        "required": ["title", "body"],
        "additionalProperties": False,
    },
}


def tool_call_decoding(args) -> list[dict]:
    """Decode tok/s of plain text, of a tool call under its grammar (tool_choice required), and of
    text under a dormant lazy grammar (tool_choice auto, no call opened), same decoder,
    alternating runs, per batch size (--concurrency); greedy and sampled."""
    from backends.chat.plan import ChatRequest, ToolUse
    from backends.contract import Sampling, Sequence
    from backends.decoding.drive import drive

    os.environ.setdefault("PHI2_MODEL", "random:phi-2")
    backend = load_in_process()
    time_call(lambda: backend.grammars.tokenizer)  # built once a model, outside the timings
    messages = [{"role": "user", "content": "Save a note about the sea."}]
    forced = backend.chat_plan(ChatRequest(messages, ToolUse([NOTE_TOOL], "required", False)))
    forced_spec = forced.grammar
    lazy_spec = backend.chat_plan(ChatRequest(messages, ToolUse([NOTE_TOOL], "auto", False))).grammar
    compile_s = time_call(lambda: backend.constraint(forced_spec.kind, forced_spec.spec))
    grammars = {
        "required": backend.constraint(forced_spec.kind, forced_spec.spec),
        "auto": backend.constraint(lazy_spec.kind, lazy_spec.spec),
    }
    print(f"tool grammar compiled in {compile_s * 1000:.2f} ms; format {forced.tool_format.name}", flush=True)
    prompt_ids = backend.encode(forced.prompt)  # the tools are rendered alike with either choice
    rows = []
    for batch in [int(b) for b in args.concurrency.split(",")]:
        decoder = backend.decoder(batch)
        for temperature in (0.0, 1.0):
            rates: dict[str, list[float]] = {"plain": [], "required": [], "auto": []}
            for run in range(args.runs):
                for variant in rates:  # alternating, so drift on a noisy machine hits all three
                    grammar = grammars.get(variant)
                    sequences = [
                        Sequence(
                            i,
                            prompt_ids,
                            Sampling(temperature=temperature, seed=run, constraint=grammar and grammar.matcher()),
                            args.max_tokens,
                        )
                        for i in range(batch)
                    ]
                    first: list[float] = []
                    drive(decoder, sequences, on_tokens=lambda step, tokens: first or first.append(time.perf_counter()))
                    elapsed = time.perf_counter() - first[0]
                    if run > 0 or args.runs == 1:  # the first run warms up
                        rates[variant].append(batch * (args.max_tokens - 1) / elapsed)
            plain, required, auto = (statistics.median(rates[v]) for v in ("plain", "required", "auto"))
            rows.append(
                {
                    "batch": batch,
                    "temperature": temperature,
                    "plain_tok_s": plain,
                    "tool_call_tok_s": required,
                    "auto_dormant_tok_s": auto,
                    "compile_ms": compile_s * 1000,
                }
            )
            print(
                f"| {batch} | {temperature:g} | {plain:.1f} | {required:.1f} ({required / plain:.3f}) "
                f"| {auto:.1f} ({auto / plain:.3f}) |",
                flush=True,
            )
    return rows
