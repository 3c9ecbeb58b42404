"""Constrained decoding: JSON Schema, JSON mode and regexes through llguidance.

llguidance (MIT, no dependencies) turns a grammar into a mask over the vocabulary, token by
token. It was measured against xgrammar and outlines-core on a Phi-2-sized byte-level BPE
vocabulary (docs/decisions.md, D-llguidance): it compiled schemas fastest, fills a mask in well under
a millisecond a token, bounds pathological schemas with its own limits (a huge enum included), and
names what is wrong with an invalid schema.

What a grammar costs is paid when it is compiled, never on the generation thread (issue 25):
- `Grammars.compile` builds llguidance's matcher (the parser and lexer: seconds for a schema
  of thousands of properties), computes its first mask, and takes one allowed token and the mask
  after it. A grammar that allows nothing (`[a&&b]`, a `$ref` to itself) or that runs past
  llguidance's limits on its first token (`a{1000000}`, 500 optional properties: "Current row
  has 2007 items") is refused there, as a GrammarError, before any sequence uses it.
- Each constrained sequence walks a `deep_copy` of that matcher (a `Matcher`), made by the
  caller off the generation thread too (`Grammar.matcher`), starting from the first mask
  computed at compile time.
- After that, a step's mask is bounded by llguidance's per-step fuel (`step_lexer_fuel`,
  `step_max_items`: milliseconds at most), computed on a worker thread as soon as a token is
  consumed (llguidance drops the GIL), so it is ready by the time the next step's logits are.
- A grammar that fails later anyway fails only its own sequence: the matcher keeps the error
  (`Matcher.error`, llguidance's reason without its state dump), allows every token from then on
  so the batch's step goes on as usual, and the engine ends that sequence with the error.

Each compiled grammar is cached per tokenizer and API key (least recently used out first),
within GRAMMAR_CACHE entries and GRAMMAR_CACHE_BYTES of what they hold, as measured where the
grammar was vetted (backends.decoding.guard): a 20-character regex can hold 150 MB.
"""

from __future__ import annotations

import copy
import json
import os
import threading
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

import llguidance
import numpy as np
from llguidance.gbnf_to_lark import any_to_lark

from backends.chat.tools import COMPACT_JSON, Trigger
from backends.contract import GrammarError

GRAMMAR_CACHE = 256  # compiled grammars kept per tokenizer
GRAMMAR_CACHE_BYTES = 512 << 20  # the bytes they may hold together (a 3,000-property schema: ~10 MB)
COMPILE_S = 5.0  # a grammar's compile in the guard's child, at most (then the server's own, as long)
VET_STACK = 1 << 20  # the guard child's compile thread (backends.decoding.guard): a chain of ~300 levels fits
GRAMMAR_STACK = 256 << 20  # the server's compile threads (address space; pages are used as touched)
# Compact JSON (", " and ": ", no other whitespace): a model cannot pad the output with
# whitespace until max_tokens, and the text reads as usual.
JSON_OPTIONS = COMPACT_JSON
ANY_OBJECT = '{"type": "object"}'  # JSON mode: any JSON object (OpenAI's json_object)
ERROR_CHARS = 300  # of llguidance's reason, in an error message

# llguidance's default limits, except that its errors carry no parser state (which names the
# grammar and the tokens generated so far: nothing a log line or a neighbour should see).
LIMITS = llguidance.LLParserLimits(verbose_errors=False)

_masks = ThreadPoolExecutor(max_workers=2, thread_name_prefix="grammar-mask")
# Rows advanced together (a batch of constrained rows) fill their masks on llguidance's own
# threads, in one call; their stacks as large as a Python thread's, 8 times the guard's child's
# (backends.decoding.guard.VET_STACK), not Rust's 2 MiB.
os.environ.setdefault("RUST_MIN_STACK", str(8 << 20))
_rows = llguidance.LLExecutor(num_threads=max(1, min(8, (os.cpu_count() or 2) - 1)))


def reason(text: str) -> str:
    """llguidance's error, its first line only (no state dump), at most ERROR_CHARS long."""
    first = text.strip().splitlines()[0] if text.strip() else "grammar error"
    return first if len(first) <= ERROR_CHARS else first[: ERROR_CHARS - 3] + "..."


class Grammar:
    """A compiled grammar for one tokenizer: the matcher every sequence copies, and its first mask.
    With a `trigger`, a lazy grammar: each sequence's matcher waits, unconstrained, until the
    model opens a tool call (`LazyMatcher`)."""

    def __init__(
        self,
        prototype: llguidance.LLMatcher,
        first_mask: np.ndarray,
        vocab: int,
        size: int,
        trigger: Trigger | None = None,
        tokenizer: llguidance.LLTokenizer | None = None,
    ):
        self._prototype = prototype
        self._first_mask = first_mask
        self._lock = threading.Lock()  # copies are taken from any thread; the prototype never moves
        self.vocab = vocab
        self.size = size  # the bytes it holds (measured by the guard; else its text's length): what the cache counts
        self.trigger = trigger
        self._tokenizer = tokenizer

    def matcher(self) -> Matcher:
        """A sequence's own walk through the grammar. Made off the generation thread (the HTTP
        layer makes one per sequence with the compile): a copy of a large grammar takes a while."""
        with self._lock:
            copy = self._prototype.deep_copy()
        if self.trigger is not None:
            return LazyMatcher(copy, self.vocab, self._first_mask, self.trigger, self._tokenizer)
        return Matcher(copy, self.vocab, self._first_mask)


class Matcher:
    """One sequence's position in its grammar: the `Constraint` the contract passes around."""

    def __init__(self, matcher: llguidance.LLMatcher, vocab: int, first_mask: np.ndarray):
        self._matcher = matcher
        self.words = (vocab + 31) // 32  # int32 words of a mask
        self.error: str | None = None  # why the grammar failed; then every token is allowed
        done: Future = Future()
        done.set_result(first_mask[None])
        self._next: tuple[Future, int] = (done, 0)

    def allowed_words(self) -> np.ndarray:
        """The ids the grammar allows next, a bit per id of the model's vocabulary (int32
        words, bit i of word w: id 32 w + i); end-of-text only where the grammar is complete.
        Every id once the grammar has failed: the step goes on, and the engine ends the sequence."""
        future, row = self._next
        words = future.result()[row]
        return words if self.error is None else np.full(self.words, -1, dtype=np.int32)

    def allowed(self) -> np.ndarray:
        """The same as a bool per id."""
        return np.unpackbits(self.allowed_words().view(np.uint8), bitorder="little").view(bool)

    def consume(self, token: int) -> None:
        """The chosen token; the next mask starts computing at once."""
        self._consume(token)
        self._next = (_masks.submit(lambda: self._fill()[None]), 0)

    def _consume(self, token: int) -> None:
        if self.error is None and not self._matcher.consume_token(token):
            self._fail(f"token {token} is not allowed here: {self._matcher.get_error()}")

    def _fill(self) -> np.ndarray:
        words = np.zeros(self.words, dtype=np.int32)
        if self.error is None:
            self._matcher.unsafe_compute_mask_ptr(words.ctypes.data, words.nbytes)
            self._check()
        return words

    def _check(self) -> None:
        if self.error is None and self._matcher.is_error():
            self._fail(self._matcher.get_error())

    def _source(self):
        """What advance_together fills this row's mask from: llguidance's matcher, or (a failed
        grammar, a lazy one not armed yet) every token."""
        if self.error is None and self.active:
            return self._matcher
        return np.full(self.words, -1, dtype=np.int32)

    def _finish(self, words: np.ndarray) -> None:
        """After advance_together filled this row's mask: a grammar that failed there says so."""
        self._check()

    def _fail(self, text: str) -> None:
        self.error = reason(text)

    @property
    def active(self) -> bool:
        """Whether the grammar constrains the next token (a lazy one only once armed)."""
        return True

    def constrains(self) -> bool:
        """`active`, once the last token is consumed (a lazy grammar may arm on it)."""
        return True


class LazyMatcher(Matcher):
    """A tool-call grammar that constrains nothing until the model opens a call (tool_choice
    `auto`): then the grammar takes over from the opening tag, so the call always parses and
    its arguments follow their schema, while the text before it is the model's own.

    Armed by a trigger token (a tag that is one token), by a tag's text spread over several
    tokens, or by a bare call's brace at the reply's start. The grammar begins at the tag:
    what the reply holds from the tag on is fed to it (re-tokenized where the tag began inside
    a token), then it masks every step. A token that completes a text tag mid-token with bytes
    the grammar refuses fails this sequence alone, like any grammar."""

    WINDOW = 256  # bytes of dormant text kept to find a tag spread over tokens

    def __init__(
        self,
        matcher: llguidance.LLMatcher,
        vocab: int,
        first_mask: np.ndarray,
        trigger: Trigger,
        tokenizer: llguidance.LLTokenizer,
    ):
        super().__init__(matcher, vocab, first_mask)
        self._trigger = trigger
        self._tokenizer = tokenizer
        self._armed = False
        self._text = b""  # the reply so far, its last WINDOW bytes, while dormant
        self._at_start = bool(trigger.at_start)  # only whitespace so far
        self._next = (_ready(np.full((1, self.words), -1, dtype=np.int32)), 0)

    @property
    def active(self) -> bool:
        return self._armed

    def constrains(self) -> bool:
        self._next[0].result()  # the step that consumed the last token (its worker may arm the grammar)
        return self._armed

    def consume(self, token: int) -> None:
        self._consume(token)
        if self._armed:
            self._next = (_masks.submit(lambda: self._fill()[None]), 0)
        else:
            self._next = (_ready(np.full((1, self.words), -1, dtype=np.int32)), 0)

    def _consume(self, token: int) -> None:
        if self._armed:
            super()._consume(token)
            return
        if token in self._trigger.ids:
            self._arm([token])
            return
        self._text = (self._text + self._tokenizer.decode_bytes([token]))[-self.WINDOW :]
        if self._at_start:
            stripped = self._text.lstrip()
            if stripped:
                self._at_start = False
                if any(stripped.startswith(t.encode()) for t in self._trigger.at_start):
                    self._arm(self._tokenizer.tokenize_bytes(stripped))
                    return
        found = [at for at in (self._text.find(t.encode()) for t in self._trigger.texts) if at >= 0]
        if found:
            self._arm(self._tokenizer.tokenize_bytes(self._text[min(found) :]))

    def _arm(self, tokens: list[int]) -> None:
        self._armed = True
        for token in tokens:
            super()._consume(token)

    def _fill(self) -> np.ndarray:
        if not self._armed:
            return np.full(self.words, -1, dtype=np.int32)
        return super()._fill()


def _ready(value) -> Future:
    done: Future = Future()
    done.set_result(value)
    return done


def advance_together(matchers: list, tokens: list[int]) -> None:
    """Consume a token in each matcher, and compute all their next masks, in one task on a
    worker thread (the rows of a batch: one hand-over a step, not one per row). A matcher whose
    grammar fails records it (`Matcher.error`); the others go on."""

    def work() -> np.ndarray:
        for matcher, token in zip(matchers, tokens, strict=False):
            matcher._consume(token)
        words = np.zeros((len(matchers), matchers[0].words), dtype=np.int32)
        live = []
        for i, matcher in enumerate(matchers):
            source = matcher._source()
            if isinstance(source, np.ndarray):  # every token, or a mask of its own (ThinkingMatcher)
                words[i] = source
            else:
                live.append((source, i))
        if live:
            _rows.unsafe_compute_mask_ptr(live, words.ctypes.data, words.shape[1] * 4, len(matchers))
        for i, matcher in enumerate(matchers):
            matcher._finish(words[i])
        return words

    future = _masks.submit(work)
    for row, matcher in enumerate(matchers):
        matcher._next = (future, row)


class ThinkingGrammar:
    """A reply that may reason first, in `<think>` ... `</think>` (both single tokens), with
    the request's grammar (or none) over the reply after it. Issue 53's thinking budget: after
    `budget` tokens of reasoning only `</think>` is allowed, so the reasoning ends there and the
    reply goes on. And a grammar (a response format, tool calls) holds from the reply's start,
    after the reasoning (vLLM's reasoning parsers do the same): it never forces the thought
    into JSON, and a call's tag inside the thought does not arm the tool grammar."""

    def __init__(self, inner: Grammar | None, vocab: int, plan: dict, size: int):
        self.inner = inner
        self.vocab = vocab
        self.budget: int | None = plan["budget"]  # tokens of reasoning (not counting the tags); None: no limit
        self.open: int = plan["open"]
        self.close: int = plan["close"]
        self.inside: bool = plan["inside"]  # the prompt opened <think>: the reply starts inside it
        self.may_open: bool = plan["may_open"]  # the reply's first token may open <think>
        self.size = size
        self.trigger = None

    def matcher(self) -> ThinkingMatcher:
        return ThinkingMatcher(self, self.inner.matcher() if self.inner is not None else None)


class ThinkingMatcher:
    """One reply's walk through a ThinkingGrammar: the `Constraint` the decoders take, with
    Matcher's interface (advance_together included). States: "start" (the first token may open
    the thought), "think" (counting its tokens), "after" (the inner grammar's, or free text).
    Its masks are its own (every token while thinking, the closing tag alone once the budget
    is spent); the inner matcher sees only the tokens after the thought."""

    def __init__(self, grammar: ThinkingGrammar, inner: Matcher | None):
        self._grammar = grammar
        self._inner = inner
        self.words = (grammar.vocab + 31) // 32
        self._state = "think" if grammar.inside else ("start" if grammar.may_open else "after")
        self.spent = 0  # tokens of reasoning so far
        self._next = (_ready(self._fill()[None]), 0)

    @property
    def error(self) -> str | None:
        return self._inner.error if self._inner is not None else None

    def _forcing(self) -> bool:
        budget = self._grammar.budget
        return self._state == "think" and budget is not None and self.spent >= budget

    def _every(self) -> np.ndarray:
        return np.full(self.words, -1, dtype=np.int32)

    def _only(self, token: int) -> np.ndarray:
        words = np.zeros(self.words, dtype=np.int32)
        words.view(np.uint32)[token // 32] = np.uint32(1 << (token % 32))
        return words

    def _consume(self, token: int) -> None:
        if self._state == "start":
            if token == self._grammar.open:
                self._state = "think"
                return
            self._state = "after"
        elif self._state == "think":
            if token == self._grammar.close:
                self._state = "after"
            else:
                self.spent += 1
            return
        if self._inner is not None:
            self._inner._consume(token)

    def _source(self):
        """What advance_together fills this row's mask from: an llguidance matcher, or the words."""
        if self._state == "think":
            return self._only(self._grammar.close) if self._forcing() else self._every()
        if self._inner is None:
            return self._every()
        return self._inner._source()

    def _finish(self, words: np.ndarray) -> None:
        if self._state == "start" and self._grammar.may_open:  # the thought may open, whatever the grammar
            words.view(np.uint32)[self._grammar.open // 32] |= np.uint32(1 << (self._grammar.open % 32))
        if self._state != "think" and self._inner is not None:
            self._inner._finish(words)

    def _fill(self) -> np.ndarray:
        if self._state == "think" or self._inner is None:
            words = self._source()
        elif self._state == "start":  # nothing consumed yet: the inner grammar's first mask
            words = self._inner.allowed_words().copy()
        else:
            words = self._inner._fill()
        self._finish(words)
        return words

    def allowed_words(self) -> np.ndarray:
        future, row = self._next
        words = future.result()[row]
        return words if self.error is None else self._every()

    def allowed(self) -> np.ndarray:
        return np.unpackbits(self.allowed_words().view(np.uint8), bitorder="little").view(bool)

    def consume(self, token: int) -> None:
        self._consume(token)
        self._next = (_masks.submit(lambda: self._fill()[None]), 0)

    @property
    def active(self) -> bool:
        if self._state == "think":
            return self._forcing()
        return self._inner is not None and self._inner.active

    def constrains(self) -> bool:
        self._next[0].result()  # the step that consumed the last token
        if self._state == "think":
            return self._forcing()
        return self._inner is not None and self._inner.constrains()


class Grammars:
    """The grammars of one tokenizer, compiled on demand and cached. `compile` is slow for a
    large grammar (seconds) and thread-safe: callers run it on a pool of their own, never on the
    event loop or the generation thread. With a `guard` (backends.decoding.guard), each grammar
    is vetted in a child process first, which also measures the bytes it holds.

    The cache is bounded by those bytes: GRAMMAR_CACHE_BYTES in all, and a quarter of it for
    one owner (the API key: a key's grammars are its own, so no key learns from a hit what
    another compiled, nor evicts more than its share of another's)."""

    def __init__(
        self, hf_tokenizer, vocab: int, guard: Callable[[dict], object] | None = None, ends: list[int] | None = None
    ):
        self._hf_tokenizer = hf_tokenizer
        self.vocab = vocab  # the model's: masks cover every logit
        # the ids a reply may end with (the backend's end-of-text ids: Gemma's turn end besides
        # <eos>), where a grammar is complete; None: the tokenizer's end-of-text
        self._ends = ends
        self._lock = threading.Lock()
        self._tokenizer: llguidance.LLTokenizer | None = None
        self._guard_factory = guard
        self._guard = None
        self._prepared = False
        self._cache: OrderedDict[tuple[str, str, str], Grammar | ThinkingGrammar] = OrderedDict()
        self._cached_size = 0
        self._owned: dict[str, int] = {}  # bytes cached per owner

    @property
    def tokenizer(self) -> llguidance.LLTokenizer:
        """llguidance's view of the tokenizer, built on first use (a third of a second for Phi-2's)."""
        with self._lock:
            if self._tokenizer is None:
                spec = tokenizer_spec(self._hf_tokenizer, self.vocab, self._ends)
                self._tokenizer = llguidance.LLTokenizer(spec["json"], n_vocab=spec["vocab"], eos_token=spec["eos"])
                if self._guard_factory is not None:
                    self._guard = self._guard_factory(spec)
            return self._tokenizer

    @property
    def prepared(self) -> bool:
        """Whether `prepare` ran: llguidance's tokenizer built, the guard's first child started."""
        return self._prepared

    def prepare(self) -> None:
        """The set-up every first grammar needs, done once: llguidance's view of the tokenizer
        (~2.5 s for a 151k vocabulary on a loaded 2-core CPU) and the guard's first child (a
        process and its imports). The server runs it outside a grammar's time limit: on a busy
        machine it took past GRAMMAR_TIMEOUT_S, and Claude Code's first request (25 tools) was
        refused with a 400 it does not retry."""
        _ = self.tokenizer
        if self._guard is not None:
            self._guard.start()
        self._prepared = True

    def cached(self, kind: str, spec: str, owner: str = "") -> Grammar | None:
        """The grammar if it is compiled already (cheap: callers ask before queueing a compile)."""
        with self._lock:
            grammar = self._cache.get((owner, kind, spec))
            if grammar is not None:
                self._cache.move_to_end((owner, kind, spec))
            return grammar

    def compile(self, kind: str, spec: str, owner: str = "", timeout: float = COMPILE_S) -> Grammar:
        grammar = self.cached(kind, spec, owner)
        if grammar is not None:
            return grammar
        grammar = self._compile(kind, spec, owner, timeout)
        with self._lock:
            key = (owner, kind, spec)
            if key not in self._cache:
                self._cache[key] = grammar
                self._cached_size += grammar.size
                self._owned[owner] = self._owned.get(owner, 0) + grammar.size
            self._evict(owner)
        return grammar

    def _evict(self, owner: str) -> None:
        """The owner's least recently used out while it holds over its share, then anyone's
        while the whole holds too much (the newest entry stays: it is in use)."""
        share = max(GRAMMAR_CACHE_BYTES // 4, 1)
        mine = [key for key in self._cache if key[0] == owner]
        while self._owned.get(owner, 0) > share and len(mine) > 1:
            self._drop(mine.pop(0))
        while len(self._cache) > 1 and (len(self._cache) > GRAMMAR_CACHE or self._cached_size > GRAMMAR_CACHE_BYTES):
            self._drop(next(iter(self._cache)))

    def _drop(self, key: tuple[str, str, str]) -> None:
        evicted = self._cache.pop(key)
        self._cached_size -= evicted.size
        self._owned[key[0]] -= evicted.size
        if not self._owned[key[0]]:
            del self._owned[key[0]]

    @property
    def cached_bytes(self) -> int:
        return self._cached_size

    def _compile(self, kind: str, spec: str, owner: str, timeout: float) -> Grammar | ThinkingGrammar:
        if kind == "thinking":  # backends.chat.plan: a reasoning reply's plan, over its inner grammar
            plan = json.loads(spec)
            inner = self.compile(*plan["inner"], owner, timeout) if plan["inner"] else None
            return ThinkingGrammar(inner, self.vocab, plan, len(spec))
        tokenizer = self.tokenizer
        held = self._guard.check(kind, spec, timeout) if self._guard is not None else None
        prototype, first_mask, text, trigger = on_big_stack(build, tokenizer, self.vocab, kind, spec)
        return Grammar(prototype, first_mask, self.vocab, held if held is not None else len(text), trigger, tokenizer)

    def close(self) -> None:
        """Ends the guard's children (they end by themselves with the process too)."""
        if self._guard is not None:
            self._guard.close()


def on_big_stack(fn: Callable, *args):
    """fn(*args) on a thread of its own with GRAMMAR_STACK bytes of stack (llguidance recurses on
    the native stack; a Python thread's default is 8 MiB on Linux, 512 KiB for others' threads on
    macOS). A thread a compile is nothing beside the compile."""
    result: list = []

    def run():
        try:
            result.append((True, fn(*args)))
        except BaseException as exc:  # re-raised on the caller's thread
            result.append((False, exc))

    with _stack_lock:
        previous = threading.stack_size(GRAMMAR_STACK)
        try:
            thread = threading.Thread(target=run, name="grammar-build", daemon=True)
            thread.start()
        finally:
            threading.stack_size(previous)
    thread.join()
    ok, value = result[0]
    if not ok:
        raise value
    return value


_stack_lock = threading.Lock()


def tokenizer_spec(hf_tokenizer, vocab: int, ends: list[int] | None = None) -> dict:
    """What llguidance's LLTokenizer is made from: the fast tokenizer's JSON (as llguidance.hf
    makes it, without importing transformers where the guard's child rebuilds it), the vocabulary
    and end-of-text (`ends`, the backend's end-of-text ids, where given)."""
    backend = copy.copy(hf_tokenizer.backend_tokenizer)
    backend.no_padding()
    backend.no_truncation()
    return {"json": backend.to_str(), "vocab": vocab, "eos": ends or hf_tokenizer.eos_token_id}


def build(tokenizer: llguidance.LLTokenizer, vocab: int, kind: str, spec: str):
    """A grammar built: (llguidance's matcher, its first mask, its grammar text, a trigger or
    None). The same steps in the server and in the guard's child."""
    trigger = None
    try:
        if kind == "json_schema":
            json.loads(spec)  # its own error names the position
            text = llguidance.LLMatcher.grammar_from_json_schema(spec, defaults=JSON_OPTIONS)
        elif kind == "json_object":
            text = llguidance.LLMatcher.grammar_from_json_schema(ANY_OBJECT, defaults=JSON_OPTIONS)
        elif kind == "regex":
            text = llguidance.LLMatcher.grammar_from_regex(spec)
        elif kind == "lark":  # backends.wire.constraints: a client's grammar, GBNF (made Lark) or Lark
            try:
                lark = any_to_lark(spec)
            except Exception as exc:  # llguidance's converter raises plain Exceptions (and may recurse)
                raise GrammarError(f"neither GBNF nor Lark: {reason(str(exc))}") from None
            text = llguidance.LLMatcher.grammar_from_lark(lark)
        elif kind == "tool_calls":  # backends.chat.tools: Lark text, and a trigger if lazy
            tool_spec = json.loads(spec)
            for custom in tool_spec.get("custom", ()):  # a client's grammar alone: its error names its tool
                error = llguidance.LLMatcher.validate_grammar(
                    llguidance.LLMatcher.grammar_from_lark(custom["lark"]), tokenizer, limits=LIMITS
                )
                if error and not error.startswith("WARNING"):
                    raise GrammarError(f"custom tool {custom['tool']!r}'s grammar: {reason(error)}")
            text = tool_spec["lark"]
            trigger = (
                Trigger(**{k: tuple(v) for k, v in tool_spec["trigger"].items()}) if tool_spec["trigger"] else None
            )
        else:
            raise GrammarError(f"unknown grammar kind {kind!r}")
    except (ValueError, TypeError) as exc:
        if isinstance(exc, GrammarError):
            raise
        raise GrammarError(str(exc)) from None
    prototype = llguidance.LLMatcher(tokenizer, text, log_level=0, limits=LIMITS)
    first_mask = _probe(tokenizer, vocab, prototype)
    return prototype, first_mask, text, trigger


def _probe(tokenizer: llguidance.LLTokenizer, vocab: int, prototype: llguidance.LLMatcher) -> np.ndarray:
    """The grammar's first mask, once it is known to allow some token and to survive taking
    one (on a copy): most grammars that break do so there, and are refused at compile time."""
    words = np.zeros((vocab + 31) // 32, dtype=np.int32)
    prototype.unsafe_compute_mask_ptr(words.ctypes.data, words.nbytes)
    if prototype.is_error():
        raise GrammarError(reason(prototype.get_error()))
    allowed = np.flatnonzero(np.unpackbits(words.view(np.uint8), bitorder="little"))
    eos = tokenizer.eos_token
    first = next((int(t) for t in allowed if t != eos), None)
    if first is None:
        if prototype.is_accepting():
            return words  # only the empty text matches: end-of-text at once
        raise GrammarError("the grammar allows no text at all")
    probe = prototype.deep_copy()
    after = np.zeros_like(words)
    if probe.consume_token(first):
        probe.unsafe_compute_mask_ptr(after.ctypes.data, after.nbytes)
    if probe.is_error():
        raise GrammarError(reason(probe.get_error()))
    return words
