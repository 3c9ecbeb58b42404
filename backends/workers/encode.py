"""The encode worker: one thread runs the embedding model and the reranker, apart from the
generation worker, so an embedding batch never sits between two decode steps.

Handlers `submit()` a request's inputs (tokenized, sorted longest first) and await its `Job`.
The worker takes the waiting requests' inputs in turns, an input of each request a round, into
forwards of at most `batch_tokens` padded positions (and `MAX_ROWS` inputs), so a one-input
request goes into the next forward however large the batch queued before it (issue 65: it
waited 15 s behind a 160-input request, in arrival order). One forward's time is bounded, and
between forwards the cores go back to whoever needs them. On a CPU it runs with `threads` torch
threads of its own (OpenMP's pool is per calling thread), and while a forward runs the decode
steps use the cores it leaves (backends.workers.cores: never more threads than cores);
docs/decisions.md (D-embeddings) measures the decode gap of 8 streams beside a long batch.

Without an embedding model of its own, the worker embeds with the chat model
(`backends.encoders.chat`): `chat` builds that encoder once the chat model has loaded.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from backends.encoders.embeddings import Encoder, Item, Kind
from backends.workers.cores import SHARE

log = logging.getLogger("phi2_server.encode_worker")

MAX_ROWS = 256  # inputs in one forward, whatever their length
# EMBEDDING_BATCH_TOKENS 0: a forward's padded tokens by where the encoder runs. On a CPU a forward
# of 8,192 held a one-input request queued behind a 160-input batch 4.7-5.5 s; of 2,048, 0.85-1.24 s,
# the batch itself as fast (5.0-6.1 s against 5.5-6.6; MiniLM, Torch, 2-vCPU Zen 4, 2026-12-08,
# docs/benchmark-log.md). A GPU's wider forwards are kept: there the smaller ones were not measured.
CPU_BATCH_TOKENS, GPU_BATCH_TOKENS = 2048, 8192


class NotReady(Exception):
    """No encoder of that kind is set, it is still loading, failed, or the server is stopping."""


class Busy(Exception):
    """MAX_QUEUE requests are waiting already."""


@dataclass
class EncodeStats:
    """Per kind, what the worker has done (written by its thread, read a value at a time)."""

    requests: int = 0
    inputs: int = 0
    tokens: int = 0
    forwards: int = 0
    seconds: float = 0.0  # inside forwards
    errors: int = 0


class Job:
    """One request's inputs; its future gets the rows (vectors or scores) in input order."""

    def __init__(self, kind: Kind, items: list[Item], order: list[int], loop: asyncio.AbstractEventLoop):
        self.kind = kind
        self.items = items  # in the order they run (longest first)
        self.order = order  # the request's index of each
        self.rows: list = [None] * len(items)
        self.left = len(items)
        self.loop = loop
        self.future: asyncio.Future = loop.create_future()
        self.cancelled = False
        self.waits = True  # counted in `waiting` until its first input runs or it is dropped
        self.taken = 0  # inputs handed to forwards so far (items[:taken])

    def cancel(self) -> None:
        """The client left or the request timed out: its inputs still waiting are dropped."""
        self.cancelled = True


class EncodeWorker:
    def __init__(
        self,
        load: Callable[[], dict[Kind, Encoder]] | None,
        max_waiting: Callable[[], int],
        batch_tokens: int,
        threads: int,
        chat: Callable[[], Encoder] | None = None,
    ):
        """`load`: EMBEDDING_MODEL's and RERANK_MODEL's encoders (None: none); `chat`: the chat
        model's encoder, used where `load` gives no embedding model (None: the chat model does
        not embed)."""
        self.status = "loading" if load else "ok"  # loading, ok or error; no loader: ready at once
        self.encoders: dict[Kind, Encoder] = {}
        self.load_error: BaseException | None = None
        self.chat_refused: str | None = None  # why the chat model does not embed, where it was to
        self._chat = chat
        self._setting_up = load is not None or chat is not None  # until the thread has its encoders
        self.load_time_s: float | None = None
        self.stats: dict[Kind, EncodeStats] = {"embedding": EncodeStats(), "rerank": EncodeStats()}
        self.batch_tokens = max(batch_tokens, 0)  # 0: by the encoder's device (`budget`)
        self.threads = threads
        self._load = load
        self._max_waiting = max_waiting
        self._cond = threading.Condition()
        self._queue: deque[Job] = deque()  # jobs with inputs not yet taken, in turn order
        self._jobs_waiting = 0
        self._stopped = False
        self._thread = threading.Thread(target=self._main, name="encode-worker", daemon=True)

    # -- called from the event loop ---------------------------------------------------------

    def start(self) -> None:
        if self._setting_up:
            self._thread.start()

    @property
    def waiting(self) -> int:
        """Requests with inputs not yet run."""
        return self._jobs_waiting

    def encoder(self, kind: Kind) -> Encoder:
        """The loaded encoder of `kind`; NotReady says why there is none."""
        if self.status == "loading":
            raise NotReady("the embedding and rerank models are still loading")
        if self.status == "error":
            raise NotReady(f"the embedding and rerank models failed to load: {self.load_error}")
        if kind not in self.encoders:
            if kind == "rerank":
                raise NotReady("no rerank model is served: set RERANK_MODEL")
            if self._chat is None:
                raise NotReady(
                    "no embedding model is served: set EMBEDDING_MODEL (or EMBEDDING_POOLING, for the chat model's)"
                )
            if self.chat_refused is None:
                raise NotReady("the chat model's embeddings are not set up yet")  # a 503: it has just loaded
            raise NotReady(f"no embedding model is served: set EMBEDDING_MODEL ({self.chat_refused})")
        return self.encoders[kind]

    def submit(self, kind: Kind, items: list[Item]) -> Job:
        """Queue a request's inputs, longest first (less padding in a forward)."""
        order = sorted(range(len(items)), key=lambda i: -len(items[i].ids))
        job = Job(kind, [items[i] for i in order], order, asyncio.get_running_loop())
        with self._cond:
            if self._stopped:
                raise NotReady("the server is shutting down")
            if self._jobs_waiting >= self._max_waiting():
                raise Busy(f"all {self._max_waiting()} queue slots are taken")
            self._jobs_waiting += 1
            if items:
                self._queue.append(job)
            self._cond.notify()
        return job

    def stop(self, timeout: float | None = None) -> None:
        with self._cond:
            self._stopped = True
            self._cond.notify()
        if self._thread.is_alive() and not self._setting_up:  # a load is not interrupted: it is not waited for
            self._thread.join(timeout)

    # -- the worker thread -------------------------------------------------------------------

    def _main(self) -> None:
        started = time.perf_counter()
        try:
            encoders = self._load() if self._load is not None else {}
        except BaseException as exc:  # reported by /health, /model/info and the routes' 503
            log.error("the embedding or rerank model failed to load: %s", exc)
            self.load_error = exc
            self.status = "error"
            self._setting_up = False
            return
        if self._load is not None:
            self.load_time_s = time.perf_counter() - started
        if self._chat is not None and "embedding" not in encoders:
            try:
                encoders["embedding"] = self._chat()
            except Exception as exc:  # the chat model still chats; /v1/embeddings says why it does not embed
                log.warning("the chat model does not embed: %s", exc)
                self.chat_refused = str(exc)
        teams = [e.team for e in encoders.values() if e.team is not None]  # torch's forwards only (MLX has none)
        if self.threads and teams:
            teams[0].set(self.threads)  # this thread's OpenMP team only
        if teams and any(e.info.backend == "torch" and e.info.device == "cpu" for e in encoders.values()):
            SHARE.enable(teams[0])  # its forwards and the decode steps share the cores (backends.workers.cores)
        self.encoders = encoders
        self._setting_up = False
        self.status = "ok"
        while True:
            batch = self._next_batch()
            if batch is None:
                return
            self._run(batch)

    def budget(self, kind: Kind) -> int:
        """Padded tokens one forward of `kind` may hold: EMBEDDING_BATCH_TOKENS, or by device."""
        if self.batch_tokens:
            return self.batch_tokens
        encoder = self.encoders.get(kind)
        on_cpu = encoder is None or encoder.info.device == "cpu"
        return CPU_BATCH_TOKENS if on_cpu else GPU_BATCH_TOKENS

    def _next_batch(self) -> list[tuple[Job, int]] | None:
        """The next forward's inputs: of one kind, an input of each waiting request a round
        (the request served first last time goes last), within the budget."""
        with self._cond:
            while True:
                self._prune()
                if self._queue or self._stopped:
                    break
                self._cond.wait()
            if self._stopped:
                for job in self._queue:
                    job.cancelled = True
                self._queue.clear()
                return None
            kind = self._queue[0].kind
            budget = self.budget(kind)
            batch: list[tuple[Job, int]] = []
            width = 0
            while (took := len(batch)) < MAX_ROWS:
                for job in self._queue:
                    if job.kind != kind or job.cancelled or job.taken == len(job.items):
                        continue
                    wider = max(width, len(job.items[job.taken].ids))
                    if len(batch) == MAX_ROWS or (batch and wider * (len(batch) + 1) > budget):
                        return self._taken(batch)
                    batch.append((job, job.taken))
                    job.taken += 1
                    width = wider
                    self._drop(job)  # its first input runs: it waits no longer
                if len(batch) == took:
                    break
            return self._taken(batch)

    def _taken(self, batch: list[tuple[Job, int]]) -> list[tuple[Job, int]]:
        """The queue after a batch is taken (under the lock): the first job served goes last."""
        if self._queue and batch and self._queue[0] is batch[0][0]:
            self._queue.rotate(-1)
        self._prune()
        return batch

    def _prune(self) -> None:
        """Jobs cancelled or with every input taken leave the queue (under the lock)."""
        if any(job.cancelled or job.taken == len(job.items) for job in self._queue):
            for job in self._queue:
                if job.cancelled:
                    self._drop(job)
            self._queue = deque(job for job in self._queue if not job.cancelled and job.taken < len(job.items))

    def _drop(self, job: Job) -> None:
        """`job` no longer waits: an input of it runs, or it was cancelled (under the lock)."""
        if job.waits:
            job.waits = False
            self._jobs_waiting -= 1

    def _run(self, batch: list[tuple[Job, int]]) -> None:
        kind = batch[0][0].kind
        encoder = self.encoders[kind]
        items = [job.items[position] for job, position in batch]
        stats = self.stats[kind]
        started = time.perf_counter()
        try:
            with SHARE.forward(self.threads or 1):
                rows = encoder.embed(items) if kind == "embedding" else encoder.score(items)
        except Exception as exc:
            log.exception("an %s forward failed", kind)
            stats.errors += 1
            for job in {id(job): job for job, _ in batch}.values():
                job.cancelled = True
                job.loop.call_soon_threadsafe(_fail, job, exc)
            return
        stats.seconds += time.perf_counter() - started
        stats.forwards += 1
        stats.inputs += len(items)
        stats.tokens += sum(len(item.ids) for item in items)
        for (job, position), row in zip(batch, rows, strict=True):
            job.rows[job.order[position]] = row
            job.left -= 1
            if job.left == 0:
                stats.requests += 1
                job.loop.call_soon_threadsafe(_done, job)


def _done(job: Job) -> None:
    if not job.future.done():
        job.future.set_result(job.rows)


def _fail(job: Job, exc: BaseException) -> None:
    if not job.future.done():
        job.future.set_exception(exc)
