"""Tool calls on a CUDA machine (issue 28): the tiny tool models' memorized dialogues, decoded by
the CUDA decoder (graphs, the Triton step, masks on the device) in one batch, as the CPU suite
checks them (tests/test_tools.py).

    python3 tests/gpu/tool_calls.py

In one batch of 8 rows (9 with the budget's): `auto` (a lazy grammar, armed mid-reply, or never for a text reply),
`required` on tools the model never saw (validated), and plain rows beside them, greedy and
sampled; each memorized reply must come out as written, each forced call must parse and follow
its schema. A 9th row (Hermes) keeps a thinking budget of 3 tokens on the memorized reasoning
reply. Exit status 1 on any mismatch.
"""

from __future__ import annotations

import gc
import json
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
# Not this folder: its kernels.py would stand in for the `kernels` package transformers looks for.
sys.path = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]
sys.path.insert(0, str(ROOT))

from backends.chat.plan import ChatRequest, ToolUse  # noqa: E402
from backends.chat.tools import ToolCallParser  # noqa: E402
from backends.choose import load_backend  # noqa: E402
from backends.contract import LoadOptions, Sampling, Sequence  # noqa: E402
from backends.decoding.drive import drive  # noqa: E402
from backends.torch.tiny import TOOL, TOOL_DIALOGUES, tool_reply, write_tiny_tools  # noqa: E402

PICK = {
    "type": "object",
    "properties": {"n": {"type": "integer", "minimum": 1, "maximum": 9}},
    "required": ["n"],
    "additionalProperties": False,
}


def text_of(backend, ids: list[int]) -> str:
    ends = [i for i, t in enumerate(ids) if t in backend.eos_token_ids]
    return backend.decode(ids[: ends[0]] if ends else ids)


def main() -> int:
    failures = []
    for fmt in ("hermes", "llama3"):
        path = write_tiny_tools(Path(tempfile.mkdtemp()) / fmt, fmt)
        backend = load_backend("torch", LoadOptions(model=str(path), dtype="float32", max_batch=9))
        auto = ToolUse([TOOL], "auto", True)
        pick = ChatRequest(
            [{"role": "user", "content": "Pick."}], ToolUse([{"name": "pick", "parameters": PICK}], "required", False)
        )
        forced_plan = backend.chat_plan(pick)
        print(f"{fmt}: {backend.info.device}, format {forced_plan.tool_format.name}", flush=True)
        # The plan's grammar kind: "thinking" around the calls' where the tokenizer has <think> (hermes).
        lazy_grammar = backend.chat_plan(ChatRequest(TOOL_DIALOGUES[0][0], auto)).grammar
        lazy = backend.constraint(lazy_grammar.kind, lazy_grammar.spec)
        forced = backend.constraint(forced_plan.grammar.kind, forced_plan.grammar.spec)
        sequences, wanted = [], {}
        for i, (messages, reply) in enumerate(TOOL_DIALOGUES[:4]):
            prompt = backend.encode(backend.chat_plan(ChatRequest(messages, auto)).prompt)
            sequences.append(Sequence(i, prompt, Sampling(constraint=lazy.matcher()), 130))
            wanted[i] = tool_reply(fmt, reply)
        # The prompt renders the weather tool; the grammar forces a call to `pick`.
        pick_prompt = backend.encode(backend.chat_plan(ChatRequest(pick.messages, auto)).prompt)
        for j in range(4):
            sampling = Sampling(temperature=0.0 if j % 2 == 0 else 1.0, seed=j, constraint=forced.matcher())
            sequences.append(Sequence(4 + j, pick_prompt, sampling, 130))
        # Hermes has <think> tokens: a thinking budget of 3 (ThinkingGrammar) on the memorized
        # reasoning reply must cut its thought after 3 tokens, in the same batch (a 9th row).
        budgeted = None
        if fmt == "hermes":
            think = backend.chat_plan(ChatRequest(TOOL_DIALOGUES[4][0], auto, thinking_budget=3))
            budgeted = backend.constraint(think.grammar.kind, think.grammar.spec)
            sampling = Sampling(constraint=budgeted.matcher())
            sequences.append(Sequence(8, backend.encode(think.prompt), sampling, 40))
        out = drive(backend.decoder(9), sequences)  # the decoder the load made (a KV pool of its own)
        if budgeted is not None:
            opening, closing, _ = think.thought
            thought = backend.encode("\nA greeting is asked for.\n")[:3]
            got = out.ids[8][:5]
            ok = got == [opening, *thought, closing]
            print(f"  thinking budget 3: {'ok' if ok else 'MISMATCH'} {backend.decode(out.ids[8])!r}", flush=True)
            if not ok:
                failures.append(f"{fmt} thinking budget: {got} != {[opening, *thought, closing]}")
        for i, text in wanted.items():
            got = text_of(backend, out.ids[i])
            ok = got == text
            print(f"  auto {i}: {'ok' if ok else 'MISMATCH'} {got!r}", flush=True)
            if not ok:
                failures.append(f"{fmt} auto {i}: {got!r} != {text!r}")
        for j in range(4):
            got = text_of(backend, out.ids[4 + j])
            parser = ToolCallParser(forced_plan.tool_format, {"pick"})
            calls = [p.call for p in parser.feed(got) + parser.finish() if p.kind == "call"]
            arguments = json.loads(calls[0].arguments) if calls else None
            ok = len(calls) == 1 and calls[0].name == "pick" and set(arguments) == {"n"} and 1 <= arguments["n"] <= 9
            print(f"  required {j}: {'ok' if ok else 'INVALID'} {got!r}", flush=True)
            if not ok:
                failures.append(f"{fmt} required {j}: {got!r}")
        # This format's decoder (its KV pool sized to the free GPU memory) goes before the next's.
        del backend, out, sequences, lazy, forced, budgeted
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    print("PASS" if not failures else "FAIL:\n" + "\n".join(failures))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
