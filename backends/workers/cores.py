"""A CPU's cores shared by the two threads that run torch: the generation thread's decode steps
and the encode worker's forwards (embeddings, rerank).

Each thread has an OpenMP team of its own, and OpenMP's threads spin while they wait for work
(GOMP's default, which a decode step's hundreds of small parallel regions need to be fast).
With more threads than cores, the spinning teams take each other's cores: on 2 vCPUs, 8
SmolLM2 streams beside embedding batches fell from 22.4 to 2.5 tok/s each, their p99 gap from
91 to 1,161 ms (docs/decisions.md, D-cpu-share). So while the encoder runs a forward, the decode
steps use the cores it leaves (at least one), and the encoder starts a forward only once the
step under way has given its extra cores back: never more threads than cores. A step waits for
nothing; a forward waits for at most the step under way.

One per process (`SHARE`): OpenMP's cores are the process's. Off (every call a no-op) until an
encoder that runs torch forwards on the CPU turns it on, handing it torch's per-thread team
(`Team`, backends/torch/encoder.py): this room imports no runtime.
"""

from __future__ import annotations

import contextlib
import os
import threading

from backends.contract import Team

NOTHING = contextlib.nullcontext()
WAIT_S = 1.0  # the longest a forward waits for a step to end (a step is milliseconds to ~0.1 s)


class CpuShare:
    def __init__(self, cores: int | None = None):
        self.cores = cores or os.cpu_count() or 1
        self.enabled = False
        self._cond = threading.Condition()
        self._wanted = 0  # threads the encoder runs with, or waits to
        self._stepping = 0  # threads of the decode step under way (0: none)
        self._full: int | None = None  # the generation thread's own count, read at its first step
        self._set: int | None = None  # what it was last set to
        self._team: Team | None = None

    def enable(self, team: Team) -> None:
        self._team = team
        self.enabled = True

    def step(self):
        """Around a decode step, on the generation thread: its team is the cores the encoder
        leaves while a forward runs or waits, else all of its own. Off: a context that does
        nothing, made once (this runs twice a step)."""
        return self._step() if self.enabled else NOTHING

    @contextlib.contextmanager
    def _step(self):
        team = self._team
        if self._full is None:
            self._full = self._set = team.get()
        with self._cond:
            threads = max(1, self._full - self._wanted) if self._wanted else self._full
            self._stepping = threads
        if threads != self._set:
            team.set(threads)  # this thread's team only
            self._set = threads
        try:
            yield
        finally:
            with self._cond:
                self._stepping = 0
                self._cond.notify_all()

    @contextlib.contextmanager
    def forward(self, threads: int):
        """Around a forward, on the encode worker's thread (`threads`: its team): it starts once
        the step under way, if any, runs within the cores left."""
        if not self.enabled:
            yield
            return
        with self._cond:
            self._wanted = threads
            self._cond.wait_for(lambda: self._stepping + threads <= self.cores or not self._stepping, WAIT_S)
        try:
            yield
        finally:
            with self._cond:
                self._wanted = 0


SHARE = CpuShare()
