"""Real backends with one thing changed, for what the tiny model cannot do on its own.

`GatedBackend` lets a test decide when generation advances, so no test depends on how fast
this machine decodes: a test that needs a generation in flight (to time it out, disconnect it,
fill every slot, signal the server under it) holds it there instead of guessing that N tokens
take longer than its next few lines. `FailingBackend` breaks its decoder after some steps.
Both wrap the real tiny-model backends and honour the same contract (backends/contract.py).
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable

from backends.contract import Backend, Decoder, PromptCacheUsage, Sequence


class WrappedBackend:
    """The contract, passed through to a real backend; subclasses change `decoder`."""

    def __init__(self, backend: Backend):
        self.inner = backend
        self.info = backend.info
        self.eos_token_ids = backend.eos_token_ids
        self.max_batch = backend.max_batch
        self.adapters = backend.adapters
        self.draft_tokens = backend.draft_tokens

    def encode(self, text):
        return self.inner.encode(text)

    def decode(self, token_ids):
        return self.inner.decode(token_ids)

    def token_bytes(self, token_id):
        return self.inner.token_bytes(token_id)

    def constraint(self, kind, spec, owner=""):
        return self.inner.constraint(kind, spec, owner)

    def cached_constraint(self, kind, spec, owner=""):
        return self.inner.cached_constraint(kind, spec, owner)

    def constraints_ready(self):
        return self.inner.constraints_ready()

    def prepare_constraints(self):
        return self.inner.prepare_constraints()

    @property
    def vocab_size(self):
        return self.inner.vocab_size

    def chat_plan(self, chat):
        return self.inner.chat_plan(chat)

    def reasons(self):
        return self.inner.reasons()

    def detokenizer(self):
        return self.inner.detokenizer()

    def decoder(self, max_batch: int = 1, prompt_cache_bytes: int | None = None) -> Decoder:
        return self.inner.decoder(max_batch, prompt_cache_bytes)


class WrappedDecoder:
    """The Decoder contract, passed through to a real decoder; subclasses change `step`."""

    def __init__(self, decoder: Decoder):
        self.inner = decoder
        self.capacity = decoder.capacity
        self.adapter_slots = decoder.adapter_slots

    def add(self, sequence: Sequence) -> int:
        return self.inner.add(sequence)

    def step(self) -> dict[int, list[int]]:
        return self.inner.step()

    @property
    def logprobs(self):
        return self.inner.logprobs

    def remove(self, *sequence_ids: int) -> None:
        self.inner.remove(*sequence_ids)

    def prompt_cache_usage(self) -> PromptCacheUsage:
        return self.inner.prompt_cache_usage()

    def fits(self, needs: list[int]) -> bool:
        return self.inner.fits(needs)

    def kv_cache_usage(self):
        return self.inner.kv_cache_usage()


# -- failing -------------------------------------------------------------------------------------


class FailingBackend(WrappedBackend):
    """The real backend, except that its decoders break after `after` steps."""

    def __init__(self, backend: Backend, after: int):
        super().__init__(backend)
        self.after = after

    def decoder(self, max_batch: int = 1, prompt_cache_bytes: int | None = None) -> Decoder:
        return FailingDecoder(self.inner.decoder(max_batch, prompt_cache_bytes), self.after)


class FailingDecoder(WrappedDecoder):
    def __init__(self, decoder: Decoder, after: int):
        super().__init__(decoder)
        self._left = after

    def step(self) -> dict[int, list[int]]:
        if self._left == 0:
            raise RuntimeError("simulated device failure")
        self._left -= 1
        return self.inner.step()


# -- gated ---------------------------------------------------------------------------------------

POLL = 0.005  # seconds a step waits while every sequence is held, before it hands back to the engine


class Gate:
    """Holds chosen sequences after `after` tokens each, until `release()`.

    `held(sequence)` picks the sequences it holds (default: all); the others run freely. A held
    sequence's tokens are not lost: when the decoder must step for the others, the held ones'
    tokens are kept and handed over in order after the release, so the text is the same as
    ungated. While every sequence is held, a step returns no tokens after a short wait, so the
    engine still admits new requests, drops cancelled ones and ends expired ones between steps.
    """

    def __init__(self, after: int = 1, held: Callable[[Sequence], bool] = lambda sequence: True):
        self.after = after
        self.held = held
        self._released = threading.Event()
        self._lock = threading.Lock()
        self.live = 0  # sequences in the gated decoders now
        self.peak = 0  # the most there were at once
        self.holding = 0  # sequences waiting at the gate now

    def release(self) -> None:
        self._released.set()

    @property
    def released(self) -> bool:
        return self._released.is_set()

    def _count(self, live_change: int) -> None:
        with self._lock:
            self.live += live_change
            self.peak = max(self.peak, self.live)


class GatedBackend(WrappedBackend):
    def __init__(self, backend: Backend, gate: Gate):
        super().__init__(backend)
        self.gate = gate

    def decoder(self, max_batch: int = 1, prompt_cache_bytes: int | None = None) -> Decoder:
        return GatedDecoder(self.inner.decoder(max_batch, prompt_cache_bytes), self.gate)


class GatedDecoder(WrappedDecoder):
    def __init__(self, decoder: Decoder, gate: Gate):
        super().__init__(decoder)
        self._gate = gate
        self._given: dict[int, int] = {}  # tokens handed to the engine, per sequence
        self._kept: dict[int, deque[int]] = {}  # tokens decoded but not handed over yet
        self._held: dict[int, bool] = {}

    def add(self, sequence: Sequence) -> int:
        reused = self.inner.add(sequence)
        self._given[sequence.id] = 0
        self._kept[sequence.id] = deque()
        self._held[sequence.id] = self._gate.held(sequence)
        self._gate._count(+1)
        return reused

    def remove(self, *sequence_ids: int) -> None:
        self.inner.remove(*sequence_ids)
        for sequence_id in sequence_ids:
            if self._given.pop(sequence_id, None) is not None:
                del self._kept[sequence_id], self._held[sequence_id]
                self._gate._count(-1)

    def _may_advance(self, sequence_id: int) -> bool:
        return self._gate.released or not self._held[sequence_id] or self._given[sequence_id] < self._gate.after

    @property
    def logprobs(self):
        return {}  # held tokens come out later than their step: no gated test asks for logprobs

    def step(self) -> dict[int, list[int]]:
        must_step = any(self._may_advance(i) and not self._kept[i] for i in self._given)
        if must_step:
            for sequence_id, tokens in self.inner.step().items():
                self._kept[sequence_id].extend(tokens)
        out = {}
        for sequence_id, kept in self._kept.items():
            if kept and self._may_advance(sequence_id):
                out[sequence_id] = [kept.popleft()]  # a token at a time: the gate counts them
                self._given[sequence_id] += 1
        self._gate.holding = sum(not self._may_advance(i) for i in self._given)
        if not must_step and not out:
            self._gate._released.wait(POLL)
        return out


# -- a prefill held part-way -----------------------------------------------------------------------


class StepGate:
    """Lets a decoder take `steps` steps, then holds it (no step, no token) until `release()`:
    a long prompt's prefill stops part-way, whatever the machine's speed. `holding` is set
    once it holds; the engine still drops cancelled and expired requests meanwhile."""

    def __init__(self, steps: int):
        self.steps = steps
        self._released = threading.Event()
        self.holding = threading.Event()

    def release(self) -> None:
        self._released.set()


class StepGatedBackend(WrappedBackend):
    def __init__(self, backend: Backend, gate: StepGate):
        super().__init__(backend)
        self.gate = gate

    def decoder(self, max_batch: int = 1, prompt_cache_bytes: int | None = None) -> Decoder:
        return StepGatedDecoder(self.inner.decoder(max_batch, prompt_cache_bytes), self.gate)


class StepGatedDecoder(WrappedDecoder):
    def __init__(self, decoder: Decoder, gate: StepGate):
        super().__init__(decoder)
        self._gate = gate
        self._steps = 0

    def step(self) -> dict[int, list[int]]:
        if self._steps >= self._gate.steps and not self._gate._released.is_set():
            self._gate.holding.set()
            self._gate._released.wait(POLL)
            return {}
        self._steps += 1
        return self.inner.step()
