"""The generation worker: one thread owns the model; requests reach it through a queue.

All model work (loading included) runs on this one thread: MLX streams and CUDA graphs are
thread-local, and the event loop must never block. Handlers `submit()` a request and get a
`Ticket`; the worker pushes each decoded piece of text back to the ticket's asyncio queue
with `loop.call_soon_threadsafe`. Between decode steps the worker admits waiting requests
(in arrival order, up to the decoder's capacity), drops cancelled or expired ones, and
retires finished ones, so a decoder that serves several sequences per step changes nothing
here or in the HTTP layer.
"""

from __future__ import annotations

import asyncio
import gc
import itertools
import logging
import threading
import time
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

from backends.contract import (
    Backend,
    Decoder,
    Detokenizer,
    KvCacheUsage,
    PromptCacheUsage,
    Sampling,
    Sequence,
    StepLogprobs,
)
from backends.decoding.text import KeepTokens
from backends.files.adapters import Adapter
from backends.workers.cores import SHARE

log = logging.getLogger("phi2_server.engine")

FLUSH_INTERVAL = 0.008  # seconds: text reaches clients in pieces at most this far apart
MIN_QUEUE = 64  # MAX_QUEUE's default is twice MAX_BATCH, at least this


class NotAccepting(Exception):
    """The worker takes no new requests: still loading, failed to load, or shutting down."""


class QueueFull(Exception):
    """Every wait slot is taken; the client should retry later."""


# Why a generation ended: its token budget, a stop sequence or end-of-text, its client left,
# REQUEST_TIMEOUT, the server's shutdown, or a failure (`Summary.error` says which).
FinishReason = Literal["length", "stop", "cancelled", "timeout", "shutdown", "error"]
ErrorKind = Literal["grammar"]  # a failure of the request's own input (the HTTP layer answers 4xx)
Status = Literal["loading", "ok", "error"]  # the engine's: loading the model, serving, or failed to load


@dataclass(frozen=True)
class Summary:
    tokens_used: int  # every id the model generated, a final end-of-text token included
    prompt_tokens: int
    finish_reason: FinishReason
    ttft_ms: float | None
    total_ms: float
    tokens_per_second: float  # decode rate after the first token (or tokens / total time)
    error: str | None = None
    cached_tokens: int = 0  # prompt tokens whose KV came from the prompt cache (not prefilled)
    # With finish_reason "error": "grammar" when the request's own grammar failed (the client's
    # input: the HTTP layer answers 4xx), else None (the server's fault: 5xx).
    error_kind: ErrorKind | None = None
    # With finish_reason "stop": the stop sequence that ended the text (None: end-of-text).
    stop_sequence: str | None = None
    reasoning_tokens: int = 0  # of tokens_used, those inside the reply's <think> (Request.thought)

    def timings(self) -> dict:
        return {
            "ttft_ms": None if self.ttft_ms is None else round(self.ttft_ms, 2),
            "total_ms": round(self.total_ms, 2),
            "tokens_per_second": round(self.tokens_per_second, 2),
        }


@dataclass
class EngineStats:
    """What the worker has done since it started (written by the worker thread; readers on the
    event loop read a value at a time: each is a plain number)."""

    completed: int = 0
    cancelled: int = 0
    timeouts: int = 0
    errors: int = 0
    tokens_generated: int = 0
    decode_steps: int = 0
    decode_seconds: float = 0.0  # inside the decoder's step
    busy_seconds: float = 0.0  # the worker's whole loop while sequences run
    prompt_tokens_cached: int = 0  # prompt tokens taken from the prompt cache
    prompt_tokens_computed: int = 0  # prompt tokens prefilled
    draft_tokens_accepted: int = 0  # generated tokens beyond a step's one: accepted prompt-lookup drafts


@dataclass(frozen=True)
class Request:
    prompt_ids: list[int]
    max_tokens: int  # 0 only with prompt_logprobs: score the prompt, generate nothing
    sampling: Sampling
    stop: tuple[str, ...] = ()
    received_at: float = 0.0  # time.perf_counter() when the HTTP request arrived
    timeout_s: float | None = None
    ignore_eos: bool = False  # benchmarks force the token count
    logprobs: int | None = None  # each token's logprob and this many alternatives, as StepLogprobs events
    prompt_logprobs: int | None = None  # the same for the prompt, with the first token's event
    adapter: Adapter | None = None  # the LoRA adapter to decode with, loaded (None: the base model)
    cache_namespace: str = ""  # whose prompt cache entries it shares (Sequence.cache_namespace)
    # Special tokens whose text the reply keeps (tool-call tags: ChatPlan.keep_tokens), (id, text).
    keep_tokens: tuple[tuple[int, str], ...] = ()
    # A reply that may reason first (ChatPlan.thought): <think>'s id, </think>'s, and whether the
    # prompt opened it; the tokens inside are counted (Summary.reasoning_tokens).
    thought: tuple[int, int, bool] | None = None

    def sequence(self, seq_id: int) -> Sequence:
        """What the decoder sees of this request. Logprobs are computed for the larger of the two
        asks; a prompt scored alone (max_tokens 0) still computes its first token: its logits end
        the prefill."""
        logprobs = self.logprobs if self.prompt_logprobs is None else max(self.logprobs or 0, self.prompt_logprobs)
        return Sequence(
            seq_id,
            self.prompt_ids,
            self.sampling,
            max(self.max_tokens, 1),
            logprobs=logprobs,
            prompt_logprobs=self.prompt_logprobs,
            adapter=self.adapter,
            cache_namespace=self.cache_namespace,
        )


# What a ticket's handler receives, in order: text, a token's logprobs (before its text), the end.
Event = str | StepLogprobs | Summary


class Inbox:
    """A handler's (ticket index, event) pairs from the worker, taken all at once.

    What an asyncio.Queue would do, with less work per event: a list and, while its handler
    waits, one future. At hundreds of streams the event loop's work per token is what bounds
    throughput (docs/decisions.md, D-event-batches)."""

    __slots__ = ("_items", "_waiter")

    def __init__(self) -> None:
        self._items: list[tuple[int, Event]] = []
        self._waiter: asyncio.Future | None = None

    def put(self, item: tuple[int, Event]) -> None:
        """On the event loop."""
        self._items.append(item)
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def take(self) -> list[tuple[int, Event]]:
        """Wait for at least one pair; return all that are ready, in order."""
        while not self._items:
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        items, self._items = self._items, []
        return items


class Ticket:
    """A submitted request as its handler sees it: events in, cancel out.

    Tickets submitted together (`Engine.submit_all`: the choices of one HTTP request) share one
    inbox of (index, event) pairs, so their handler waits on all of them at once."""

    def __init__(
        self,
        engine: Engine,
        request: Request,
        loop: asyncio.AbstractEventLoop,
        inbox: Inbox | None = None,
        index: int = 0,
    ):
        self.request = request
        self.index = index
        self._sent_text = False
        # Events the worker queued for the handler, and those the handler took: the difference is
        # what waits for a client that does not read (each counter has one writer, one thread).
        self._queued = 0
        self._taken = 0
        # Set by the handler while a write to its client waits (the socket's buffers are full):
        # only then does a backlog mean a client that stopped reading, not a busy event loop.
        self.writing = False
        self.cancelled = False
        self.summary: Summary | None = None
        self._engine = engine
        self._loop = loop
        self._events = inbox if inbox is not None else Inbox()

    def cancel(self) -> None:
        """The client is gone: leave the queue, or stop generating at the next step."""
        if self.summary is None:
            self._engine._cancel(self)

    def _emit(self, event: Event) -> None:
        self._engine._send(self, event)


async def next_events(tickets: list[Ticket]) -> list[tuple[int, Event]]:
    """For tickets submitted together: wait for at least one (ticket index, event) pair; return
    all that are ready, in order."""
    events = await tickets[0]._events.take()
    for index, _ in events:
        tickets[index]._taken += 1
    return events


def _deliver(batch: list[tuple[Ticket, Event]]) -> None:
    """On the event loop: hand a decode step's events to their handlers."""
    for ticket, event in batch:
        ticket._events.put((ticket.index, event))


class Courier:
    """Carries the worker's events to one event loop, one batch on the way at a time.

    The worker hands over what it has at each flush. While a batch is still being handled on the
    loop (its handlers writing to their clients), later events gather here, and the loop takes
    all of them as soon as it is done. With a few streams every flush goes out at once; with
    hundreds, when the event loop rather than the model sets the pace, each write carries the
    tokens of several steps instead of the loop falling further behind with a write per token
    (docs/decisions.md, D-event-batches)."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self._lock = threading.Lock()
        self._gathered: list[tuple[Ticket, Event]] = []
        self._on_the_way = False

    def hand_over(self, batch: list[tuple[Ticket, Event]]) -> None:
        """On the worker thread."""
        with self._lock:
            self._gathered += batch
            if self._on_the_way:
                return  # the loop takes it when it is done with the batch before
            self._on_the_way = True
        try:
            self.loop.call_soon_threadsafe(self._deliver)
        except RuntimeError:  # the loop is closed: nobody is listening any more
            with self._lock:
                self._gathered, self._on_the_way = [], False

    def _deliver(self) -> None:
        with self._lock:
            batch, self._gathered = self._gathered, []
        _deliver(batch)
        # Queued behind the handlers this woke, so it runs once they have written.
        self.loop.call_soon(self._delivered)

    def _delivered(self) -> None:
        with self._lock:
            if not self._gathered:
                self._on_the_way = False
                return
        self._deliver()


class StopText:
    """Holds back text that might be the start of a stop sequence."""

    def __init__(self, detokenizer: Detokenizer, stop: tuple[str, ...]):
        self._detokenizer = detokenizer
        self._stop = stop
        self._pending = ""
        self.matched: str | None = None  # the stop sequence that ended the text, once one has

    def push(self, token_id: int) -> tuple[str, bool]:
        """Text that is safe to emit now, and whether a stop sequence was hit."""
        self._pending += self._detokenizer.add(token_id)
        if not self._stop:
            text, self._pending = self._pending, ""
            return text, False
        hits = [(i, s) for i, s in ((self._pending.find(s), s) for s in self._stop) if i >= 0]
        if hits:
            at, self.matched = min(hits, key=lambda hit: hit[0])
            text, self._pending = self._pending[:at], ""
            return text, True
        keep = max(self._partial_match(s) for s in self._stop)
        cut = len(self._pending) - keep
        text, self._pending = self._pending[:cut], self._pending[cut:]
        return text, False

    def flush(self) -> str:
        text, self._pending = self._pending + self._detokenizer.flush(), ""
        for s in self._stop:  # a stop sequence completed by the held-back bytes
            if s in text:
                self.matched = s
                return text[: text.find(s)]
        return text

    def _partial_match(self, stop: str) -> int:
        """Length of the longest proper prefix of `stop` that ends the pending text."""
        for k in range(min(len(stop) - 1, len(self._pending)), 0, -1):
            if self._pending.endswith(stop[:k]):
                return k
        return 0


class _Running:
    """A ticket on the decoder."""

    def __init__(self, ticket: Ticket, text: StopText, cached: int):
        self.ticket = ticket
        self.text = text
        self.cached = cached
        self.count = 0
        thought = ticket.request.thought
        self.thinking = thought is not None and thought[2]  # inside <think> now
        self.reasoning = 0  # tokens inside it so far
        self.first_at: float | None = None
        self.last_at: float | None = None

    def count_thought(self, token: int) -> None:
        """The reply's reasoning: from <think> as its first token (or the prompt's) to </think>,
        as the reply's parser splits it (backends.chat.tools.ToolCallParser)."""
        opening, closing, _ = self.ticket.request.thought
        if self.thinking:
            if token == closing:
                self.thinking = False
            else:
                self.reasoning += 1
        elif token == opening and self.count == 1:
            self.thinking = True


class Engine:
    def __init__(
        self,
        load: Callable[[], Backend],
        *,
        max_queue: int = 0,
        max_batch: int = 0,
        prompt_cache_bytes: int | None = None,
        stream_buffer: int = 1024,
        on_load_done: Callable[[], None] | None = None,
    ):
        self.max_queue = max_queue
        # Events a ticket may have waiting for its handler while the handler waits to write to a
        # client that stopped reading: past it, the worker stops generating that sequence.
        self.stream_buffer = stream_buffer
        self.max_batch = max_batch
        self.prompt_cache_bytes = prompt_cache_bytes  # None: the device's default; 0: off
        self.status: Status = "loading"
        self.backend: Backend | None = None
        self.load_error: BaseException | None = None
        self.load_time_s: float | None = None
        self.loaded_at: float | None = None  # time.perf_counter() when loading finished
        self.stats = EngineStats()
        self._load = load
        self._on_load_done = on_load_done or (lambda: None)
        self._cond = threading.Condition()
        self._stats_lock = threading.Lock()
        self._waiting: deque[Ticket] = deque()
        self._running: dict[int, _Running] = {}
        self._ids = itertools.count(1)
        self._accepting = True
        self._abort_reason: str | None = None
        self._stopped = False
        self._thread = threading.Thread(target=self._main, name="generation-worker", daemon=True)
        self._outbox: dict[asyncio.AbstractEventLoop, list] = {}
        self._couriers: dict[asyncio.AbstractEventLoop, Courier] = {}  # the worker's, by event loop
        self._decoder: Decoder | None = None
        self._finished: list[int] = []  # sequence ids that ended and are still in the decoder
        self._urgent = False
        self._flushed_at = 0.0

    # -- called from the event loop ---------------------------------------------------------

    def start(self) -> None:
        self._thread.start()

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    @property
    def active(self) -> int:
        return len(self._running)

    @property
    def idle(self) -> bool:
        """Nothing waits or runs, and every sequence that ended has left the decoder (its KV given
        back). A reply reaches its client before its sequence leaves the decoder (`_finish`), so
        `active == 0` alone can be read while the decoder still holds it."""
        return not self._waiting and not self._running and not self._finished

    def prompt_cache_usage(self) -> PromptCacheUsage:
        """What the worker's decoder holds in its prompt cache (read from any thread)."""
        decoder = self._decoder
        return decoder.prompt_cache_usage() if decoder is not None else PromptCacheUsage()

    def kv_cache_usage(self) -> KvCacheUsage:
        """What the worker's decoder's KV cache takes (read from any thread)."""
        decoder = self._decoder
        return decoder.kv_cache_usage() if decoder is not None else KvCacheUsage()

    def submit_all(self, requests: list[Request]) -> list[Ticket]:
        """Queue requests together, all or none: their tickets share one inbox of (index, event)."""
        loop = asyncio.get_running_loop()
        inbox = Inbox()
        tickets = [Ticket(self, request, loop, inbox, index) for index, request in enumerate(requests)]
        with self._cond:
            if self.status != "ok" or not self._accepting:
                raise NotAccepting("shutting down" if self.status == "ok" else self.status)
            if len(self._waiting) + len(tickets) > self.max_queue:
                if len(tickets) == 1:
                    raise QueueFull(f"all {self.max_queue} queue slots are taken")
                raise QueueFull(
                    f"{len(tickets)} sequences need as many of the {self.max_queue} queue slots; "
                    f"{len(self._waiting)} are taken"
                )
            self._waiting.extend(tickets)
            self._cond.notify()
        return tickets

    @property
    def accepting(self) -> bool:
        return self._accepting

    def stop_accepting(self) -> None:
        with self._cond:
            self._accepting = False

    def abort(self, reason: str) -> None:
        """End every queued and running request now, with finish_reason `reason`."""
        with self._cond:
            self._abort_reason = reason
            self._cond.notify()

    def stop(self, timeout: float | None = None) -> None:
        """Abort what is left, end the worker thread and wait for it (blocking)."""
        with self._cond:
            self._accepting = False
            self._abort_reason = "shutdown"
            self._stopped = True
            self._cond.notify()
        # A load cannot be interrupted; the thread is a daemon, so the process still exits.
        if self._thread.is_alive() and self.status != "loading":
            self._thread.join(timeout)

    def _send(self, ticket: Ticket, event: Event) -> None:
        """Queue an event for its handler. The worker hands events over in batches: one wake-up
        of the event loop per flush, not one per token and stream."""
        if threading.current_thread() is self._thread:
            ticket._queued += 1
            self._outbox.setdefault(ticket._loop, []).append((ticket, event))
            if isinstance(event, StepLogprobs):
                return  # its text follows, and sets the pace
            if isinstance(event, Summary) or not ticket._sent_text:
                self._urgent = True  # a first token (TTFT) or an end goes out at once
            ticket._sent_text = True
        else:
            _call_soon(ticket._loop, [(ticket, event)])

    def _flush(self, force: bool = False) -> None:
        """Hand queued events over, at most every FLUSH_INTERVAL unless urgent: with many streams
        and fast steps the event loop, not the model, would otherwise set the pace."""
        now = time.perf_counter()
        if not self._outbox or not (force or self._urgent or now - self._flushed_at >= FLUSH_INTERVAL):
            return
        outbox, self._outbox = self._outbox, {}
        self._urgent, self._flushed_at = False, now
        for loop, batch in outbox.items():
            courier = self._couriers.get(loop)
            if courier is None:
                courier = self._couriers[loop] = Courier(loop)
            courier.hand_over(batch)

    def _cancel(self, ticket: Ticket) -> None:
        with self._cond:
            ticket.cancelled = True
            if ticket in self._waiting:
                self._waiting.remove(ticket)
                self._finish_unstarted(ticket, "cancelled")
            self._cond.notify()

    # -- the worker thread -------------------------------------------------------------------

    def _main(self) -> None:
        started = time.perf_counter()
        try:
            self.backend = self._load()
            # The decoder exists before the first request is accepted (its prompt cache is reported).
            self.max_batch = self.max_batch or self.backend.max_batch  # 0: the backend's default
            # 0: twice what a batch holds, at least 64: a burst the batch takes in at its next step
            # fits, and as many again waiting for rows, not 503s (docs/decisions.md, D-queue).
            self.max_queue = self.max_queue or max(MIN_QUEUE, 2 * self.max_batch)
            self._decoder = self._new_decoder(self.backend)
            # What loading made lives as long as the process: frozen, a full collection does not walk
            # it and stop every stream (docs/decisions.md, D-gc-freeze); vLLM freezes its startup objects.
            gc.collect()
            gc.freeze()
        except BaseException as exc:  # reported through /health and the startup error
            self.load_error = exc
            self.status = "error"
            self._on_load_done()
            return
        self.loaded_at = time.perf_counter()
        self.load_time_s = self.loaded_at - started
        self.status = "ok"
        self._on_load_done()
        try:
            self._serve(self.backend)
        except BaseException as exc:  # a bug here must not leave requests hanging forever
            log.exception("generation worker crashed")
            self.status = "error"
            self.load_error = exc
            with self._cond:
                self._accepting = False
                for ticket in list(self._waiting):
                    self._finish_unstarted(ticket, "error", f"generation worker crashed: {exc}")
                self._waiting.clear()
            for seq_id in list(self._running):
                self._finish(seq_id, "error", None, f"generation worker crashed: {exc}")
            self._flush(force=True)

    def _serve(self, backend: Backend) -> None:
        decoder = self._decoder
        while True:
            self._flush(force=not self._running)  # about to wait for work: nothing may stay behind
            work = self._admit(decoder.capacity, decoder.adapter_slots, decoder.fits)
            if work is None:
                self._flush(force=True)
                return
            admitted, abort_reason = work
            started = time.perf_counter()
            with SHARE.step():  # prefills (in _start) and the step: on the cores an encoder leaves
                for ticket in admitted:
                    self._start(decoder, backend, ticket)
            self._retire_ended(decoder, abort_reason)
            self._remove_finished(decoder)
            if not self._running:
                continue
            try:
                step_started = time.perf_counter()
                with SHARE.step():
                    tokens = decoder.step()
                self.stats.decode_seconds += time.perf_counter() - step_started
                self.stats.decode_steps += 1
            except Exception as exc:
                log.exception("decode step failed")
                # The message names no request's data: a batch's neighbours read it too.
                message = (
                    f"generation failed: the decode step raised {type(exc).__name__} (the server log has the details)"
                )
                for seq_id in list(self._running):
                    self._finish(seq_id, "error", decoder, message)
                self._remove_finished(decoder)
                decoder = self._decoder = self._new_decoder(backend)  # nothing of the old one is reused
                continue
            now = time.perf_counter()
            scores = decoder.logprobs
            for seq_id, advanced in tokens.items():
                self.stats.draft_tokens_accepted += len(advanced) - 1 if advanced else 0
                for token in advanced:  # several where a draft was accepted: it may end within them
                    if seq_id not in self._running:
                        break
                    self._advance(decoder, backend, seq_id, token, now, scores.get(seq_id))
            self._remove_finished(decoder)
            self.stats.busy_seconds += time.perf_counter() - started

    def _new_decoder(self, backend: Backend) -> Decoder:
        return backend.decoder(self.max_batch, prompt_cache_bytes=self.prompt_cache_bytes)

    def _admit(
        self, capacity: int, adapter_slots: int, fits: Callable[[list[int]], bool]
    ) -> tuple[list[Ticket], str | None] | None:
        """Wait for work; fill free decoder slots from the queue, fairly between requests.

        A request's sequences (its choices, its prompts) take turns with other requests': free
        slots go round the waiting requests in arrival order, one sequence each a round, and one
        request holds at most `request_share(capacity)` slots, so one asking for 64 sequences
        leaves room for a request that comes after it. A request alone still fills the batch but
        for that reserve.

        At most `adapter_slots` distinct adapters decode at once: a request for one more waits
        (and the requests behind it, so that it is not passed forever) until a running adapter's
        last sequence ends. So does one whose KV (its prompt and max_tokens) the decoder's budget
        cannot hold beside the running sequences' (`Decoder.fits`), until enough of them end;
        alone, a sequence is always admitted (the served context fits the budget).

        Returns the admitted tickets and a pending abort reason, or None to end the worker.
        """
        with self._cond:
            while not (self._waiting or self._running or self._stopped or self._abort_reason):
                self._cond.wait()
            abort_reason, self._abort_reason = self._abort_reason, None
            now = time.perf_counter()
            for ticket in list(self._waiting):
                reason = abort_reason or ("timeout" if self._expired(ticket, now) else None)
                if reason:
                    self._waiting.remove(ticket)
                    self._finish_unstarted(ticket, reason)
            if self._stopped and not self._running:
                return None
            free = capacity - len(self._running)
            if free <= 0 or not self._waiting:
                return [], abort_reason
            share = request_share(capacity)
            held = Counter(
                r.ticket._events for r in self._running.values()
            )  # slots each request holds (by its shared inbox)
            queues: dict[Inbox, deque[Ticket]] = {}  # each waiting request's tickets, requests in arrival order
            for ticket in self._waiting:
                queues.setdefault(ticket._events, deque()).append(ticket)
            adapters = None  # the distinct adapters decoding, counted only when a waiting request has one
            admitted: list[Ticket] = []
            needs: list[int] = []  # the positions each admitted sequence may reach
            while free:
                took = False
                for inbox, queue in queues.items():
                    if not free:
                        break
                    if not queue or held[inbox] >= share:
                        continue
                    adapter = queue[0].request.adapter
                    if adapter is not None:
                        if adapters is None:
                            adapters = {
                                r.ticket.request.adapter.key
                                for r in self._running.values()
                                if r.ticket.request.adapter is not None
                            }
                        if adapter.key not in adapters:
                            if len(adapters) >= adapter_slots:
                                free = 0  # it waits for an adapter slot, and so does everything behind it
                                break
                            adapters.add(adapter.key)
                    need = len(queue[0].request.prompt_ids) + max(queue[0].request.max_tokens, 1)
                    if (self._running or admitted) and not fits([*needs, need]):
                        free = 0  # it waits for KV room, and so does everything behind it
                        break
                    needs.append(need)
                    ticket = queue.popleft()
                    self._waiting.remove(ticket)
                    admitted.append(ticket)
                    held[inbox] += 1
                    free -= 1
                    took = True
                if not took:
                    break
            return admitted, abort_reason

    def _start(self, decoder: Decoder, backend: Backend, ticket: Ticket) -> None:
        request = ticket.request
        seq_id = next(self._ids)
        try:
            sequence = request.sequence(seq_id)
            cached = decoder.add(sequence)
        except Exception as exc:
            log.exception("could not start a sequence")
            self._finish_unstarted(ticket, "error", f"generation failed: {exc}")
            return
        self.stats.prompt_tokens_cached += cached
        self.stats.prompt_tokens_computed += len(request.prompt_ids) - cached
        detokenizer = backend.detokenizer()
        if request.keep_tokens:
            detokenizer = KeepTokens(backend.detokenizer, dict(request.keep_tokens))
        self._running[seq_id] = _Running(ticket, StopText(detokenizer, request.stop), cached)

    def _retire_ended(self, decoder: Decoder, abort_reason: str | None) -> None:
        """Remove sequences whose client left, whose time is up, or that an abort ends."""
        now = time.perf_counter()
        for seq_id, running in list(self._running.items()):
            ticket = running.ticket
            if ticket.cancelled:
                reason = "cancelled"
            elif abort_reason:
                reason = abort_reason
            elif self._expired(ticket, now):
                reason = "timeout"
            else:
                continue
            self._finish(seq_id, reason, decoder)

    # -- the worker thread: a sequence's tokens, its end ------------------------------------

    def _advance(
        self, decoder: Decoder, backend: Backend, seq_id: int, token: int, now: float, scores: StepLogprobs | None
    ) -> None:
        running = self._running.get(seq_id)
        if running is None:
            return
        request = running.ticket.request
        constraint = request.sampling.constraint
        if constraint is not None and constraint.error is not None:  # its grammar failed: it alone ends
            self._finish(seq_id, "error", decoder, f"the grammar failed: {constraint.error}", error_kind="grammar")
            return
        if request.max_tokens == 0:  # only the prompt's logprobs were asked for
            if scores is not None:
                running.ticket._emit(StepLogprobs(None, scores.prompt))
            self._finish(seq_id, "length", decoder)
            return
        if scores is not None:
            running.ticket._emit(scores)
        running.count += 1
        if request.thought is not None:
            running.count_thought(token)
        running.first_at = running.first_at or now
        running.last_at = now
        self.stats.tokens_generated += 1
        if token in backend.eos_token_ids and not running.ticket.request.ignore_eos:
            self._finish(seq_id, "stop", decoder)
            return
        text, stopped = running.text.push(token)
        if text:
            running.ticket._emit(text)
        if stopped:
            self._finish(seq_id, "stop", decoder, flush=False)
        elif running.count >= running.ticket.request.max_tokens:
            self._finish(seq_id, "length", decoder)
        elif running.ticket.writing and running.ticket._queued - running.ticket._taken > self.stream_buffer:
            # Its client is not reading: generating more would only queue it here, unbounded.
            waiting = running.ticket._queued - running.ticket._taken
            self._finish(
                seq_id,
                "cancelled",
                decoder,
                f"the client stopped reading: {waiting} events were waiting for it (STREAM_BUFFER)",
            )

    def _finish(
        self,
        seq_id: int,
        reason: FinishReason,
        decoder: Decoder | None,
        error: str | None = None,
        flush: bool = True,
        error_kind: ErrorKind | None = None,
    ) -> None:
        running = self._running.pop(seq_id)
        if flush and reason in ("stop", "length"):
            rest = running.text.flush()
            if rest:
                running.ticket._emit(rest)
        self._complete(
            running.ticket,
            reason,
            running.count,
            running.first_at,
            running.last_at,
            error,
            running.cached,
            error_kind,
            stop_sequence=running.text.matched if reason == "stop" else None,
            reasoning=running.reasoning,
        )
        if decoder is not None:
            self._finished.append(seq_id)  # removed from the decoder once the step's ends are out

    def _remove_finished(self, decoder: Decoder) -> None:
        """Remove the sequences that ended in this step from the decoder, after their ends went
        out in one hand-over: removing may take a while (the decoder keeps a sequence's KV in
        its prompt cache)."""
        if not self._finished:
            return
        self._flush(force=True)
        try:
            decoder.remove(*self._finished)  # at once: the decoder may rearrange its rows once
        except Exception:  # a broken decoder is replaced; the requests still got their ends
            log.exception("could not remove sequences %s", self._finished)
        self._finished.clear()

    def _finish_unstarted(self, ticket: Ticket, reason: FinishReason, error: str | None = None) -> None:
        self._complete(ticket, reason, 0, None, None, error)

    def _complete(
        self,
        ticket,
        reason,
        count,
        first_at,
        last_at,
        error,
        cached: int = 0,
        error_kind: ErrorKind | None = None,
        stop_sequence: str | None = None,
        reasoning: int = 0,
    ) -> None:
        now = time.perf_counter()
        request = ticket.request
        total = now - request.received_at
        if count > 1 and last_at > first_at:
            rate = (count - 1) / (last_at - first_at)
        else:
            rate = count / total if total > 0 else 0.0
        ticket.summary = Summary(
            tokens_used=count,
            prompt_tokens=len(request.prompt_ids),
            finish_reason=reason,
            ttft_ms=None if first_at is None else (first_at - request.received_at) * 1000,
            total_ms=total * 1000,
            tokens_per_second=rate,
            error=error,
            cached_tokens=cached,
            error_kind=error_kind,
            stop_sequence=stop_sequence,
            reasoning_tokens=reasoning,
        )
        key = {"cancelled": "cancelled", "timeout": "timeouts", "error": "errors"}.get(reason, "completed")
        with self._stats_lock:
            setattr(self.stats, key, getattr(self.stats, key) + 1)
        ticket._emit(ticket.summary)

    @staticmethod
    def _expired(ticket: Ticket, now: float) -> bool:
        timeout = ticket.request.timeout_s
        return timeout is not None and now - ticket.request.received_at > timeout


def request_share(capacity: int) -> int:
    """The most decoder slots one request's sequences hold at once: all but an eighth, which
    stays for the requests behind it (batches of fewer than 8 slots keep none: turns alone
    share them)."""
    return capacity - capacity // 8


def _call_soon(loop: asyncio.AbstractEventLoop, batch: list) -> None:
    try:
        loop.call_soon_threadsafe(_deliver, batch)
    except RuntimeError:
        pass  # the loop is closed: nobody is listening any more
