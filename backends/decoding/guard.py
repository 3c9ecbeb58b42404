"""Every grammar is compiled first in a child process, where a crash, a runaway or a memory
blow-up costs that child only (issue 65).

llguidance's compiler recurses on a grammar's depth on the native stack, ~3.2 KB a level: a
$ref chain of ~2,500 `$defs` or a Lark chain of ~2,700 rules overflowed an 8 MiB stack, and a
stack overflow is a SIGSEGV that no Python code can catch. Its memory follows the grammar's
lexer, not its text (`((a{10}){10}){2900}c`: 24 characters, ~150 MB). A compiled matcher cannot
cross a process boundary (llguidance has no serialized form of one), so the child only *vets*:
it builds the grammar exactly as the server will (`backends.grammar.build`: the matcher, its
first mask, a probe of its first token), on a thread of VET_STACK bytes, within VET_MEMORY bytes
of address space and the caller's time limit, and answers the bytes the grammar holds. Only then
does the server build it, on a thread with GRAMMAR_STACK bytes of stack: 256 times the child's,
so a grammar that fitted in the child fits there with room for any difference of traversal
order. A child that dies or runs out of time is replaced; its grammar is refused (GrammarError,
a 400 naming the limit), and remembered so that sending it again costs no new child.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import hashlib
import json
import os
import queue
import resource
import select
import signal
import subprocess
import sys
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path

from backends.contract import GrammarError
from backends.decoding.grammar import VET_STACK, build, reason

GRAMMAR_MEMORY = 64 << 20  # what one grammar may hold once compiled (bytes; a 3,000-property schema: ~10 MB)
VET_MEMORY = 2 * GRAMMAR_MEMORY  # the child's address space past its idle size; beyond it, it dies
VET_CHILDREN = 2  # children at once (the server's GRAMMAR_WORKERS)
REFUSED = 256  # grammars refused, remembered by digest


class CompileGuard:
    """The server's side: up to VET_CHILDREN children, started on demand, each compiling one
    grammar at a time. `check` blocks its caller (a compile thread, never the event loop)."""

    def __init__(self, tokenizer: dict, children: int = VET_CHILDREN, memory: int = GRAMMAR_MEMORY):
        self._init = {"tokenizer": tokenizer, "stack": VET_STACK, "memory": max(memory * 2, VET_MEMORY)}
        self.memory = memory
        self._idle: queue.LifoQueue[_Child | None] = queue.LifoQueue()
        for _ in range(children):
            self._idle.put(None)  # a slot; its child starts when first needed
        self._refused: OrderedDict[str, str] = OrderedDict()
        self._lock = threading.Lock()
        self.started = 0  # children started so far (a test reads it: a crash starts a new one)

    def check(self, kind: str, spec: str, timeout: float) -> int:
        """The bytes the grammar holds once compiled, or GrammarError: what the compiler says,
        or that it crashed, ran past `timeout` seconds or past the memory limit."""
        digest = hashlib.sha256(f"{kind}\0{spec}".encode()).hexdigest()
        with self._lock:
            if digest in self._refused:
                self._refused.move_to_end(digest)
                raise GrammarError(self._refused[digest])
        child = self._idle.get()
        try:
            if child is None:
                self.started += 1
                child = _Child(self._init)
            answer = child.ask({"kind": kind, "spec": spec}, timeout)
        except _Died as exc:
            if child is not None:
                child.kill()
            child = None
            if exc.remember:  # a crash or memory: the same again; a time limit may be the machine's load
                self._refuse(digest, str(exc))
            raise GrammarError(str(exc)) from None
        finally:
            self._idle.put(child)
        if "error" in answer:
            self._refuse(digest, answer["error"])
            raise GrammarError(answer["error"])
        if answer["bytes"] > self.memory:
            error = (
                f"the compiled grammar holds {answer['bytes'] / 2**20:.0f} MiB, over the limit of "
                f"{self.memory / 2**20:.0f} MiB (GRAMMAR_MEMORY)"
            )
            self._refuse(digest, error)
            raise GrammarError(error)
        return answer["bytes"]

    def start(self) -> None:
        """A child started ahead of the first grammar (its imports and tokenizer: seconds on a
        loaded machine), so that a grammar's time limit counts the grammar only."""
        child = self._idle.get()
        try:
            if child is None:
                self.started += 1
                child = _Child(self._init)
        finally:
            self._idle.put(child)

    def _refuse(self, digest: str, error: str) -> None:
        with self._lock:
            self._refused[digest] = error
            while len(self._refused) > REFUSED:
                self._refused.popitem(last=False)

    def close(self) -> None:
        while True:
            try:
                child = self._idle.get_nowait()
            except queue.Empty:
                return
            if child is not None:
                child.kill()


class Unavailable(RuntimeError):
    """No child could start: the server's fault, not the grammar's (a 500; not remembered)."""


class _Died(Exception):
    """The child failed: its grammar is refused with this reason."""

    def __init__(self, message: str, remember: bool = True):
        super().__init__(message)
        self.remember = remember


class _Child:
    def __init__(self, init: dict):
        root = str(Path(__file__).resolve().parents[2])
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([root, os.environ.get("PYTHONPATH", "")])}
        self._memory = init["memory"]
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "backends.decoding.guard"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=env,
            start_new_session=True,  # a terminal's Ctrl-C goes to the server, which ends it
        )
        self._stderr = b""
        threading.Thread(target=self._drain, daemon=True, name="grammar-guard-stderr").start()
        self._buffer = b""
        try:
            self.ask(init, 60.0)
        except _Died as exc:
            self.kill()
            raise Unavailable(f"the grammar checker did not start: {exc}; {self._stderr[-300:]!r}") from None

    def _drain(self) -> None:
        for line in self._proc.stderr:
            self._stderr = (self._stderr + line)[-2000:]

    def ask(self, message: dict, timeout: float) -> dict:
        try:
            self._proc.stdin.write(json.dumps(message).encode() + b"\n")
            self._proc.stdin.flush()
        except OSError:
            raise self._death(timeout) from None
        deadline = time.monotonic() + timeout
        fd = self._proc.stdout.fileno()
        while b"\n" not in self._buffer:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                raise _Died(f"the grammar did not compile within {timeout:.0f} s", remember=False)
            chunk = os.read(fd, 1 << 16)
            if not chunk:
                raise self._death(timeout)
            self._buffer += chunk
        line, self._buffer = self._buffer.split(b"\n", 1)
        return json.loads(line)

    def _death(self, timeout: float) -> _Died:
        try:
            code = self._proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            code = None
        said = self._stderr.decode(errors="replace")
        if code == -signal.SIGSEGV or code == -signal.SIGBUS or "overflowed its stack" in said:
            return _Died("the grammar is nested too deep for the compiler (its stack overflowed)")
        if "memory allocation" in said or "MemoryError" in said:
            limit = self._memory / 2**20
            return _Died(f"compiling the grammar ran past its memory limit ({limit:.0f} MiB, GRAMMAR_MEMORY × 2)")
        return _Died(f"the grammar compiler failed on it (exit {code})")

    def kill(self) -> None:
        with contextlib.suppress(OSError):
            self._proc.kill()
        with contextlib.suppress(Exception):
            self._proc.wait(timeout=5)
        for stream in (self._proc.stdin, self._proc.stdout):
            with contextlib.suppress(OSError):
                stream.close()


# -- the child ------------------------------------------------------------------------------------


def _allocated() -> Callable[[], int]:
    """A reader of the bytes malloc holds (glibc's mallinfo2), else of the resident size (psutil:
    macOS, musl), which counts pages rather than allocations but grows with them."""
    path = ctypes.util.find_library("c")
    libc = ctypes.CDLL(path) if path else None
    if libc is not None and hasattr(libc, "mallinfo2"):

        class Info(ctypes.Structure):
            names = "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks keepcost"
            _fields_ = [(n, ctypes.c_size_t) for n in names.split()]

        libc.mallinfo2.restype = Info
        return lambda: (lambda m: m.uordblks + m.hblkhd)(libc.mallinfo2())
    import psutil

    process = psutil.Process()
    return lambda: process.memory_info().rss


def _child() -> None:
    import llguidance

    out = sys.stdout.buffer
    init = json.loads(sys.stdin.buffer.readline())
    spec = init["tokenizer"]
    tokenizer = llguidance.LLTokenizer(spec["json"], n_vocab=spec["vocab"], eos_token=spec["eos"])
    vocab = spec["vocab"]
    allocated = _allocated()
    jobs: queue.Queue = queue.Queue()
    answers: queue.Queue = queue.Queue()

    def work():
        while True:
            kind, text = jobs.get()
            before = allocated()
            try:
                built = build(tokenizer, vocab, kind, text)
                held = max(0, allocated() - before)
                del built
                answers.put({"bytes": held})
            except GrammarError as exc:
                answers.put({"error": str(exc)})
            except MemoryError:
                answers.put({"error": "compiling the grammar ran past its memory limit"})
            except Exception as exc:
                answers.put({"error": reason(str(exc))})

    threading.stack_size(init["stack"])
    threading.Thread(target=work, daemon=True).start()
    jobs.put(("json_object", ""))  # the thread's malloc arena, before the limit is measured from here
    answers.get()
    if hasattr(resource, "RLIMIT_AS"):
        with contextlib.suppress(ValueError, OSError):
            size = int(Path("/proc/self/statm").read_text().split()[0]) * os.sysconf("SC_PAGE_SIZE")
            resource.setrlimit(resource.RLIMIT_AS, (size + init["memory"], resource.RLIM_INFINITY))
    out.write(b'{"ready": true}\n')
    out.flush()
    for line in sys.stdin.buffer:
        message = json.loads(line)
        jobs.put((message["kind"], message["spec"]))
        out.write(json.dumps(answers.get()).encode() + b"\n")
        out.flush()


if __name__ == "__main__":
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _child()
