"""The prompt cache on disk (PROMPT_CACHE_DIR, issue 68): prompts' keys and values written behind
the memory cache, read back by the next start when a request starts alike.

An agent's first request is a long prompt (Claude Code's: 18,783 tokens, minutes of a 2-core
CPU) that every session and every restart used to compute again. Each file holds one stored
prompt's positions past its parent's (a file whose ids its own continue): a chat's next turn adds
its new positions only, as the memory cache's tree does. Files live in a folder named by what
makes keys and values alike (the model file, its quantization and dtype, the chat template, the
KV's layout); each names its namespace (an API key's, and the adapter's). The folder is read at
the first use, headers only; a file's data is read when a request takes it. Writes go through a
thread of their own, in a temporary file renamed into place; the oldest files leave past the
byte budget. A corrupt, truncated or foreign file is removed, with the files that continue it; a
full disk is logged and the entry dropped. Only the worker thread calls `match`, `load` and
`write_behind`.
"""

from __future__ import annotations

import atexit
import hashlib
import json
import logging
import os
import queue
import struct
import threading
import zlib
from dataclasses import dataclass
from pathlib import Path

import torch

from backends.torch.kv_pages import PAGE
from backends.torch.prompt_cache import common_prefix

log = logging.getLogger("phi2_server.prompt_disk")

MAGIC = b"PHI2KV\x00\x01"
FORMAT = 1
# A stored prompt is written once it holds this many positions that no file holds: a short
# chat turn is cheap to compute again, and each file costs an open and a header at the next start.
MIN_TOKENS = 256
QUEUED = 4  # files waiting for the writer at most; more are dropped (logged): memory, not disk, is short


@dataclass(eq=False)
class Entry:
    name: str
    namespace: str
    parent: str | None
    start: int
    ids: tuple[int, ...]  # its own positions' ids, from `start`
    nbytes: int
    full: tuple[int, ...] = ()  # the ids from position 0 (its parents' and its own)
    pending: bool = False  # queued for the writer: a parent for later files, not yet one to read


class NoDisk:
    """PROMPT_CACHE_DIR unset: nothing read, nothing written."""

    def restore(self, *args) -> None:
        pass

    def write_behind(self, *args) -> None:
        pass


NO_DISK = NoDisk()


def folder_key(**fields) -> str:
    return hashlib.sha256(json.dumps({"format": FORMAT, **fields}, sort_keys=True).encode()).hexdigest()[:24]


class PromptDisk:
    """The files of one model's prompt cache under `root`, within `budget_bytes`."""

    def __init__(self, root: Path, key: dict, budget_bytes: int, layout: tuple[int, int, int], dtype: torch.dtype):
        """`key`: what makes keys and values alike; `layout`: (layers, kv_heads, head_dim)."""
        self.layout, self.dtype = tuple(layout), dtype
        self.key = folder_key(**key, layout=list(layout), dtype=str(dtype))
        self.folder = Path(root) / self.key
        self.budget = budget_bytes
        self.entries: dict[str, Entry] | None = None  # read at the first use
        self._lock = threading.Lock()  # the writer adds entries and removes old ones
        self._queue: queue.Queue = queue.Queue(QUEUED)
        self._writer: threading.Thread | None = None
        self.written = self.loaded = 0  # files, for the tests and the log

    # -- the folder ------------------------------------------------------------------------------

    def _entries(self) -> dict[str, Entry]:
        with self._lock:
            if self.entries is None:
                self.entries = self._scan()
            return self.entries

    def _scan(self) -> dict[str, Entry]:
        entries: dict[str, Entry] = {}
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
            files = sorted(self.folder.iterdir())
        except OSError as exc:
            log.warning("PROMPT_CACHE_DIR %s is not usable: %s", self.folder, exc)
            return entries
        for path in files:
            if path.name.endswith(".tmp"):  # a write a stop interrupted
                self._remove(path, "left unfinished")
                continue
            entry = self._read_header(path)
            if entry is not None:
                entries[entry.name] = entry
        for entry in list(entries.values()):  # whole chains only: a file whose parent is gone goes too
            if self._full(entry, entries) is None:
                entries.pop(entry.name, None)
                self._remove(self.folder / entry.name, "its parent is missing")
        return entries

    def _full(self, entry: Entry, entries: dict[str, Entry]) -> tuple[int, ...] | None:
        if entry.full:
            return entry.full
        chain, node = [], entry
        while node is not None:
            chain.append(node)
            if node.parent is None:
                break
            node = entries.get(node.parent)
            if node is None or len(chain) > 10_000:
                return None
        full: tuple[int, ...] = ()
        for node in reversed(chain):
            if node.start != len(full):
                return None
            full = node.full = full + node.ids
        return full

    def _read_header(self, path: Path) -> Entry | None:
        """The entry a file holds, or None (the file removed) if it is not one of this folder's."""
        try:
            with open(path, "rb") as file:
                header = self._header(file)
            size = path.stat().st_size
        except (OSError, ValueError, KeyError, TypeError, json.JSONDecodeError) as exc:
            self._remove(path, f"unreadable ({exc})")
            return None
        layers, heads, head_dim = self.layout
        n = len(header["ids"])
        nbytes = 2 * layers * heads * n * head_dim * self.dtype.itemsize
        if header["key"] != self.key or header["dtype"] != str(self.dtype) or size != header["offset"] + nbytes:
            self._remove(path, "foreign or truncated")
            return None
        return Entry(path.name, header["namespace"], header["parent"], header["start"], tuple(header["ids"]), size)

    @staticmethod
    def _header(file) -> dict:
        if file.read(len(MAGIC)) != MAGIC:
            raise ValueError("not a prompt cache file")
        (length,) = struct.unpack("<Q", file.read(8))
        if length > 1 << 26:
            raise ValueError("header too long")
        header = json.loads(file.read(length))
        header["offset"] = len(MAGIC) + 8 + length
        return header

    def _remove(self, path: Path, why: str) -> None:
        log.warning("prompt cache file %s removed: %s", path, why)
        try:
            path.unlink()
        except OSError:
            pass

    # -- reading ---------------------------------------------------------------------------------

    def match(self, namespace: str, ids: list[int], limit: int) -> tuple[int, list[Entry]]:
        """The longest prefix of `ids` (at most `limit`) the files of `namespace` hold: its length
        and the chain of entries from position 0 that holds it."""
        best, chain = 0, []
        key = tuple(ids[:limit])
        for entry in self._entries().values():
            if entry.namespace != namespace or not entry.full or entry.pending:
                continue
            n = common_prefix(entry.full, key)
            if n > best:
                best, chain = n, self._chain(entry)
        return best, chain

    def _chain(self, entry: Entry) -> list[Entry]:
        chain, node = [], entry
        while node is not None:
            chain.append(node)
            node = self.entries.get(node.parent) if node.parent else None
        return chain[::-1]

    def load(self, chain: list[Entry], n: int) -> torch.Tensor | None:
        """Keys and values of positions 0..n-1 from `chain`'s files, [2, layers, kv_heads, n,
        head_dim]; None if a file is damaged (removed, with what continues it)."""
        layers, heads, head_dim = self.layout
        out = torch.empty(2, layers, heads, n, head_dim, dtype=self.dtype)
        for entry in chain:
            if entry.start >= n:
                break
            path = self.folder / entry.name
            try:
                with open(path, "rb") as file:
                    header = self._header(file)
                    data = bytearray(file.read())
                if zlib.crc32(data) != header["crc32"]:
                    raise ValueError("its data does not match its checksum")
                kv = torch.frombuffer(data, dtype=self.dtype).view(2, layers, heads, len(entry.ids), head_dim)
                os.utime(path)  # used now: the last to leave past the budget
            except (OSError, ValueError, KeyError, RuntimeError, json.JSONDecodeError) as exc:
                self._drop(entry, f"unreadable ({exc})")
                return None
            take = min(len(entry.ids), n - entry.start)
            out[:, :, :, entry.start : entry.start + take] = kv[:, :, :, :take]
        self.loaded += 1
        return out

    def restore(self, decoder, row: int, sequence, limit: int) -> None:
        """The positions of `sequence`'s prompt (up to `limit`) that the files hold past what the
        batched `decoder`'s memory cache does: read into its free `row`'s pages, which the memory
        cache then keeps; the row gives them up. Not for an adapter's sequence (none written)."""
        prompts, pages, prompt = decoder.prompts, decoder.pages, sequence.prompt_ids
        namespace = decoder._namespace(sequence)
        if prompts.limit_bytes <= 0 or sequence.adapter is not None:
            return
        held, _ = prompts.match(prompt, limit, namespace=namespace)
        n, chain = self.match(namespace, prompt, limit)
        if n < held + PAGE:  # less than a page more: not worth the read
            return
        kv = self.load(chain, n)
        if kv is None:
            return
        pages.take(row, n)
        try:
            pages.kv.write_columns(pages.kv.held[row], kv)
            prompts.store_pages(prompt[:n], pages.kv.held[row], namespace=namespace)
        finally:
            pages.kv.release([row])

    def _drop(self, entry: Entry, why: str) -> None:
        """Remove an entry's file and those that continue it."""
        with self._lock:
            doomed, names, grew = [entry], {entry.name}, True
            while grew:  # what continues it, file by file
                grew = False
                for other in self.entries.values():
                    if other.parent in names and other.name not in names:
                        doomed.append(other)
                        names.add(other.name)
                        grew = True
            for gone in doomed:
                self.entries.pop(gone.name, None)
                self._remove(self.folder / gone.name, why if gone is entry else "its parent was removed")

    # -- writing ---------------------------------------------------------------------------------

    def write_behind(self, namespace: str, ids: list[int], columns) -> None:
        """Queue the positions of `ids` that no file of `namespace` holds, if there are enough:
        `columns(start, end)` copies them out of the pool ([2, layers, kv_heads, n, head_dim])."""
        entries = self._entries()
        parent, start = None, 0
        for entry in entries.values():  # the deepest file whose ids all start `ids`
            if (
                entry.namespace == namespace
                and start < len(entry.full) <= len(ids)
                and tuple(ids[: len(entry.full)]) == entry.full
            ):
                parent, start = entry, len(entry.full)
        if len(ids) - start < MIN_TOKENS:
            return
        if self._queue.full():
            log.warning("prompt cache: the disk writer is behind; a %d-token prompt is not written", len(ids))
            return
        own = tuple(ids[start:])
        parent_name = parent.name if parent else None
        name = hashlib.sha256(json.dumps([namespace, parent_name, own]).encode()).hexdigest()[:32]
        # In the index at once, so a later store (the same prompt with its reply, as the sequence
        # ends) continues this file instead of writing its positions again.
        entry = Entry(name, namespace, parent_name, start, own, 0, (parent.full if parent else ()) + own, pending=True)
        with self._lock:
            self.entries[name] = entry
        self._queue.put_nowait((entry, columns(start, len(ids))))
        if self._writer is None:
            self._writer = threading.Thread(target=self._write_loop, name="prompt_disk", daemon=True)
            self._writer.start()
            atexit.register(self.flush)  # a server that stops writes what it queued first

    def flush(self) -> None:
        """Wait until the queued files are written (tests, shutdown)."""
        self._queue.join()

    def _write_loop(self) -> None:
        while True:
            entry, kv = self._queue.get()
            try:
                written = self._write(entry, kv)
            except Exception:  # a write never takes the server down
                log.exception("prompt cache: writing a file failed")
                written = False
            finally:
                self._queue.task_done()
            with self._lock:
                if written:
                    entry.pending = False
                    self.written += 1
                else:  # not on disk: what would continue it cannot be read either
                    self.entries.pop(entry.name, None)

    def _write(self, entry: Entry, kv: torch.Tensor) -> bool:
        """Write `entry`'s file (its positions' keys and values `kv`); whether it is on disk."""
        data = kv.contiguous().view(torch.uint8).numpy().tobytes()
        header = json.dumps({
            "format": FORMAT, "key": self.key, "namespace": entry.namespace, "parent": entry.parent,
            "start": entry.start, "ids": list(entry.ids), "dtype": str(self.dtype), "crc32": zlib.crc32(data),
        }).encode()  # fmt: skip
        path, temporary = self.folder / entry.name, self.folder / (entry.name + ".tmp")
        size = len(MAGIC) + 8 + len(header) + len(data)
        if size > self.budget:
            log.info("prompt cache: a %d-byte file would not fit PROMPT_CACHE_DISK_BYTES; not written", size)
            return False
        with self._lock:
            if entry.name not in self.entries:  # dropped meanwhile, with a parent
                return False
        if not self._make_room(size, entry):
            log.info("prompt cache: no room in PROMPT_CACHE_DISK_BYTES for a %d-byte file; not written", size)
            return False
        try:
            with open(temporary, "wb") as file:
                file.write(MAGIC + struct.pack("<Q", len(header)) + header)
                file.write(data)
            os.replace(temporary, path)
        except OSError as exc:  # a full disk, most likely: the entry stays in memory only
            log.warning("prompt cache: could not write %s (%s); going on without it", path, exc)
            try:
                temporary.unlink()
            except OSError:
                pass
            return False
        entry.nbytes = size
        return True

    def _make_room(self, size: int, writing: Entry) -> bool:
        """Remove the least recently used files (and what continues them) until `size` fits, never
        `writing`'s parents (its file is read through theirs); whether it fits."""
        keep, node = set(), writing
        while node is not None and node.parent:
            keep.add(node.parent)
            node = self.entries.get(node.parent)

        def touched(entry: Entry) -> float:
            try:
                return (self.folder / entry.name).stat().st_mtime
            except OSError:
                return 0.0

        while True:
            with self._lock:
                written = [entry for entry in self.entries.values() if not entry.pending]
            if sum(entry.nbytes for entry in written) + size <= self.budget:
                return True
            candidates = [entry for entry in written if entry.name not in keep]
            if not candidates:
                return False
            self._drop(min(candidates, key=touched), "past PROMPT_CACHE_DISK_BYTES")
