"""Drive a decoder outside the server: the one plain decode loop for tests and tools.

The server's loop is the engine's (`backends.workers.engine`), which adds what HTTP needs: a queue,
cancellation, detokenizing, stop strings, timeouts. Tests, `bench.py --in-process` and the GPU
check only need "feed these sequences through this decoder as slots free up, and collect the
ids", done the way the engine does it: admission in arrival order into free slots before a
step, at most `adapter_slots` distinct adapters at once (a sequence that needs one more waits,
and so does everything behind it), removal once a sequence has its tokens (end-of-text does not
end it here). The runtimes' warm-ups decode through it too.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field

from backends.contract import Decoder, Sequence, StepLogprobs


@dataclass
class Driven:
    ids: dict[int, list[int]] = field(default_factory=dict)  # every sequence's generated ids
    finished: list[int] = field(default_factory=list)  # sequence ids in the order they ended
    cached: dict[int, int] = field(default_factory=dict)  # prompt ids each took from the prompt cache
    logprobs: dict[int, list[StepLogprobs]] = field(default_factory=dict)  # of the sequences that asked, a step each
    steps: int = 0


def drive(
    decoder: Decoder,
    sequences: Seq[Sequence],
    *,
    arrive_at: Mapping[int, int] | None = None,
    stop_after: Mapping[int, int] | None = None,
    on_tokens: Callable[[int, dict[int, list[int]]], None] | None = None,
    max_steps: int = 100_000,
) -> Driven:
    """Decode `sequences` (in arrival order) to their `max_new_tokens`.

    `arrive_at` gives a sequence's earliest step (default 0); `stop_after` cuts a sequence
    short after that many tokens, as a client that leaves; `on_tokens(step, tokens)` sees every
    step's tokens as they come (bench.py times the first text with it).
    """
    arrive_at = arrive_at or {}
    stop_after = stop_after or {}
    waiting = list(sequences)
    active: dict[int, int] = {}  # sequence id -> tokens it ends at
    adapters: dict[int, str] = {}  # sequence id -> its adapter's key, for those with one
    out = Driven(ids={s.id: [] for s in sequences})

    def fits(sequence: Sequence) -> bool:
        if sequence.adapter is None or sequence.adapter.key in adapters.values():
            return True
        return len(set(adapters.values())) < decoder.adapter_slots

    for step in range(max_steps):
        while (
            waiting
            and arrive_at.get(waiting[0].id, 0) <= step
            and len(active) < decoder.capacity
            and fits(waiting[0])
            # Its KV fits the decoder's budget beside the active sequences' (alone, always).
            and (not active or decoder.fits([len(waiting[0].prompt_ids) + waiting[0].max_new_tokens]))
        ):
            sequence = waiting.pop(0)
            if sequence.adapter is not None:
                adapters[sequence.id] = sequence.adapter.key
            out.cached[sequence.id] = decoder.add(sequence)
            active[sequence.id] = min(sequence.max_new_tokens, stop_after.get(sequence.id, sequence.max_new_tokens))
        if not active and not waiting:
            out.steps = step
            return out
        tokens = decoder.step()
        for seq_id, scores in decoder.logprobs.items():
            out.logprobs.setdefault(seq_id, []).append(scores)
        if on_tokens is not None:
            on_tokens(step, tokens)
        ended = []
        for seq_id, advanced in tokens.items():
            if seq_id not in active:
                raise RuntimeError(f"the decoder gave a token to sequence {seq_id}, which is not in its batch")
            # An accepted draft may go past where the sequence ends: the rest is dropped, as the engine does.
            out.ids[seq_id] += advanced[: active[seq_id] - len(out.ids[seq_id])]
            if len(out.ids[seq_id]) == active[seq_id]:
                ended.append(seq_id)
                del active[seq_id]
                adapters.pop(seq_id, None)
                out.finished.append(seq_id)
        decoder.remove(*ended)  # those that ended in this step at once, as the engine removes them
    raise RuntimeError(f"not finished after {max_steps} steps: sequences {sorted(active)} still decoding")
