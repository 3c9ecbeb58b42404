"""Constrained decoding: JSON Schema, JSON mode and regexes through llguidance.

llguidance (MIT, no dependencies) turns a grammar into a mask over the vocabulary, token by
token. It was measured against xgrammar and outlines-core on a Phi-2-sized byte-level BPE
vocabulary (BENCHMARKS.md, "Structured output"): it compiles a schema in about a millisecond
(xgrammar 8-30 ms, outlines-core up to seconds), fills a mask in 0.03-0.07 ms a token, bounds
pathological schemas with its own limits (a 20,000-value enum: 75 ms; xgrammar 19 s), and
names what is wrong with an invalid schema.

Each compiled grammar is cached (a bounded LRU) per tokenizer. A constrained sequence walks it
with a `Matcher` of its own, which the runtime's sampling asks for the allowed ids before a
choice and tells the chosen one after; the next mask is computed on a worker thread as soon as
a token is consumed (llguidance drops the GIL), so it is ready by the time the next step's
logits are, and unconstrained sequences never wait for it.
"""

from __future__ import annotations

import functools
import json
import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor

import llguidance
import llguidance.hf
import numpy as np

from backends import GrammarError

GRAMMAR_CACHE = 256  # compiled grammars kept per tokenizer
# Compact JSON (", " and ": ", no other whitespace): a model cannot pad the output with
# whitespace until max_tokens, and the text reads as usual.
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
ANY_OBJECT = '{"type": "object"}'  # JSON mode: any JSON object (OpenAI's json_object)

_masks = ThreadPoolExecutor(max_workers=2, thread_name_prefix="grammar-mask")
# Rows advanced together (a batch of constrained rows) fill their masks on llguidance's own
# threads, in one call.
_rows = llguidance.LLExecutor(num_threads=max(1, min(8, (os.cpu_count() or 2) - 1)))


class Grammar:
    """A compiled grammar for one tokenizer: the `Constraint` the contract passes around."""

    def __init__(self, tokenizer: llguidance.LLTokenizer, text: str, vocab: int):
        self._tokenizer = tokenizer
        self._text = text
        self.vocab = vocab

    def matcher(self) -> "Matcher":
        return Matcher(llguidance.LLMatcher(self._tokenizer, self._text, log_level=0), self.vocab)


class Matcher:
    """One sequence's position in its grammar."""

    def __init__(self, matcher: llguidance.LLMatcher, vocab: int):
        self._matcher = matcher
        self.words = (vocab + 31) // 32  # int32 words of a mask
        self._next: tuple[Future, int] = (_masks.submit(lambda: self._fill()[None]), 0)

    def allowed_words(self) -> np.ndarray:
        """The ids the grammar allows next, a bit per id of the model's vocabulary (int32
        words, bit i of word w: id 32 w + i); end-of-text only where the grammar is complete."""
        future, row = self._next
        return future.result()[row]

    def allowed(self) -> np.ndarray:
        """The same as a bool per id."""
        return np.unpackbits(self.allowed_words().view(np.uint8), bitorder="little").view(bool)

    def consume(self, token: int) -> None:
        """The chosen token; the next mask starts computing at once."""
        self._consume(token)
        self._next = (_masks.submit(lambda: self._fill()[None]), 0)

    def _consume(self, token: int) -> None:
        if not self._matcher.consume_token(token):
            raise GrammarError(f"token {token} is not allowed here: {self._matcher.get_error()}")

    def _fill(self) -> np.ndarray:
        words = np.zeros(self.words, dtype=np.int32)
        self._matcher.unsafe_compute_mask_ptr(words.ctypes.data, words.nbytes)
        self._check()
        return words

    def _check(self) -> None:
        if self._matcher.is_error():
            raise GrammarError(self._matcher.get_error())


def advance_together(matchers: list[Matcher], tokens: list[int]) -> None:
    """Consume a token in each matcher, and compute all their next masks, in one task on a
    worker thread (the rows of a batch: one hand-over a step, not one per row)."""

    def work() -> np.ndarray:
        for matcher, token in zip(matchers, tokens):
            matcher._consume(token)
        words = np.zeros((len(matchers), matchers[0].words), dtype=np.int32)
        _rows.unsafe_compute_mask_ptr([(m._matcher, i) for i, m in enumerate(matchers)], words.ctypes.data, words.shape[1] * 4, len(matchers))
        for matcher in matchers:
            matcher._check()
        return words

    future = _masks.submit(work)
    for row, matcher in enumerate(matchers):
        matcher._next = (future, row)


class Grammars:
    """The grammars of one tokenizer, compiled on demand and cached."""

    def __init__(self, hf_tokenizer, vocab: int):
        self._hf_tokenizer = hf_tokenizer
        self.vocab = vocab  # the model's: masks cover every logit
        self._lock = threading.Lock()
        self._tokenizer: llguidance.LLTokenizer | None = None
        self.compile = functools.lru_cache(maxsize=GRAMMAR_CACHE)(self._compile)

    @property
    def tokenizer(self) -> llguidance.LLTokenizer:
        """llguidance's view of the tokenizer, built on first use (a third of a second for Phi-2's)."""
        with self._lock:
            if self._tokenizer is None:
                self._tokenizer = llguidance.hf.from_tokenizer(self._hf_tokenizer, n_vocab=self.vocab)
            return self._tokenizer

    def _compile(self, kind: str, spec: str) -> Grammar:
        try:
            if kind == "json_schema":
                json.loads(spec)  # its own error names the position
                text = llguidance.LLMatcher.grammar_from_json_schema(spec, defaults=JSON_OPTIONS)
            elif kind == "json_object":
                text = llguidance.LLMatcher.grammar_from_json_schema(ANY_OBJECT, defaults=JSON_OPTIONS)
            elif kind == "regex":
                text = llguidance.LLMatcher.grammar_from_regex(spec)
            else:
                raise GrammarError(f"unknown grammar kind {kind!r}")
        except (ValueError, TypeError) as exc:
            raise GrammarError(str(exc)) from None
        error = llguidance.LLMatcher.validate_grammar(text, self.tokenizer)
        if error:
            raise GrammarError(error)
        return Grammar(self.tokenizer, text, self.vocab)
