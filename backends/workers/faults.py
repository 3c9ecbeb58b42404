"""A process that dies says why (issue 65): LOG_DIR/fault.log.

A fault in native code (a segfault in a library, an abort) ends the process before any Python
code can log. `faulthandler` writes every thread's Python stack to fault.log then; the request
ids in flight are already there: the file's first HEADER bytes are a memory map of them,
rewritten as requests start and end (the kernel keeps a shared map's pages when the process
dies, however it dies). A clean exit removes the file; the next start finds the one a dead
process left, moves it aside (fault-<time>.log) and says so in the server's log.
"""

from __future__ import annotations

import contextlib
import faulthandler
import itertools
import mmap
import os
import time
from pathlib import Path

HEADER = 4096  # bytes of the file's head: the request ids in flight
TITLE = b"requests in flight:"


class FaultLog:
    def __init__(self, directory: str | Path):
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        self.path = directory / "fault.log"
        self.previous = self._set_aside()  # what a dead process left, or None
        with open(self.path, "wb") as file:
            file.write(self._render([]))
        self._file = open(self.path, "ab")  # noqa: SIM115 (open while the process lives: faulthandler writes to it)
        fd = os.open(self.path, os.O_RDWR)
        try:
            self._map = mmap.mmap(fd, HEADER)
        finally:
            os.close(fd)
        self._in_flight: dict[str, int] = {}
        faulthandler.enable(file=self._file, all_threads=True)

    def _set_aside(self) -> tuple[Path, str] | None:
        """The file a process that died left (a clean exit removes it), renamed; its head's ids."""
        if not self.path.exists():
            return None
        kept = self.path.with_name(f"fault-{time.strftime('%Y%m%dT%H%M%S')}.log")
        self.path.rename(kept)
        with open(kept, "rb") as file:
            head = file.read(HEADER).decode(errors="replace").strip()
        return kept, head

    @staticmethod
    def _render(ids) -> bytes:
        shown = itertools.islice(ids, HEADER // 8)  # what fits (an id is 1 to 128 characters): O(1) a request
        line = b" ".join([TITLE, *(i.encode() for i in shown)])[: HEADER - 1]
        return line.ljust(HEADER - 1) + b"\n"

    def started(self, request_id: str) -> None:
        """On the event loop (every call is, so no lock): a request begins."""
        self._in_flight[request_id] = self._in_flight.get(request_id, 0) + 1
        self._map[:] = self._render(self._in_flight)

    def ended(self, request_id: str) -> None:
        count = self._in_flight.pop(request_id, 1) - 1
        if count > 0:  # two requests with one client-given id
            self._in_flight[request_id] = count
        self._map[:] = self._render(self._in_flight)

    def close(self) -> None:
        """A clean exit: no fault to tell of."""
        faulthandler.disable()
        with contextlib.suppress(OSError, ValueError):
            self._map.close()
            self._file.close()
            self.path.unlink()
