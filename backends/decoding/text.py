"""Tokenizing and incremental detokenizing through a Hugging Face tokenizer (no torch here); the
model's chat, read from the same tokenizer, is backends.chat.plan's."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import TYPE_CHECKING

from backends.chat.plan import ChatFormat

if TYPE_CHECKING:
    from backends.chat.plan import ChatPlan, ChatRequest
    from backends.contract import Detokenizer
    from backends.decoding.grammar import Grammars


@functools.cache
def byte_level_alphabet() -> dict[str, int]:
    """GPT-2's byte-level BPE alphabet (Phi's tokenizer uses it): each byte is one printable
    character in a token's string. Character -> byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {}, 0
    for byte in range(256):
        if byte in printable:
            chars[chr(byte)] = byte
        else:
            chars[chr(256 + extra)] = byte
            extra += 1
    return chars


# A reply the chat template renders, to find what it closes an assistant turn with.
TURN_PROBE = "Probe reply 7f3a."


class TokenizerText:
    """Tokenizing and decoding through the Hugging Face tokenizer (shared by both runtimes)."""

    def __init__(self, tokenizer):
        # The server checks prompts against the context window itself (a 422 that says both
        # numbers); the tokenizer's own warning about long inputs would only be log noise.
        tokenizer.model_max_length = 1 << 62
        self.tokenizer = tokenizer
        self.vocab_size = len(tokenizer)
        # A cache of this instance's own: functools.lru_cache on the method would be one cache
        # for every instance, keyed by self, keeping each tokenizer alive after its backend is gone.
        self.token_bytes = functools.lru_cache(maxsize=65536)(self._token_bytes)
        self.chat = ChatFormat(tokenizer)

    def turn_end_ids(self) -> frozenset[int]:
        """The special token the chat template closes an assistant turn with (Gemma's
        <end_of_turn>, ChatML's <|im_end|>), an end of text besides the configs' own: a Gemma 3
        file whose config names only <eos> still stops where its template ends a turn, as
        llama.cpp's end-of-generation tokens do. Empty without a template, or where it closes a
        turn with no special token."""
        tokenizer = self.tokenizer
        if not getattr(tokenizer, "chat_template", None):
            return frozenset()
        turns = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": TURN_PROBE}]
        try:
            text = tokenizer.apply_chat_template(turns, tokenize=False)
        except Exception:  # a template that wants another chat (a system turn first, tools): no probe
            return frozenset()
        after = text.rpartition(TURN_PROBE)[2].lstrip() if TURN_PROBE in text else ""
        special = {t.content: i for i, t in tokenizer.added_tokens_decoder.items() if t.special}
        found = [token for token in special if token and after.startswith(token)]
        return frozenset([special[max(found, key=len)]]) if found else frozenset()

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False)

    def decode(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)

    def _token_bytes(self, token_id: int) -> bytes:
        """The bytes one token stands for (a special token: its own text; an id past the
        tokenizer's vocabulary: none). A byte-level token may hold part of a character."""
        if not 0 <= token_id < self.vocab_size:
            return b""
        token = self.tokenizer.convert_ids_to_tokens(token_id)
        alphabet = byte_level_alphabet()
        if token_id not in self.tokenizer.all_special_ids and all(c in alphabet for c in token):
            return bytes(alphabet[c] for c in token)
        if token_id in self.tokenizer.all_special_ids:
            return token.encode()
        return self.tokenizer.decode([token_id], clean_up_tokenization_spaces=False).encode()  # other tokenizer kinds


class TokenizerMethods:
    """The contract's tokenizer methods, for a runtime that keeps a TokenizerText in `self.text`."""

    text: TokenizerText
    grammars: Grammars  # backends.decoding.grammar, over the model's whole vocabulary

    def encode(self, text: str) -> list[int]:
        return self.text.encode(text)

    def decode(self, token_ids: list[int]) -> str:
        return self.text.decode(token_ids)

    def token_bytes(self, token_id: int) -> bytes:
        return self.text.token_bytes(token_id)

    def constraint(self, kind: str, spec: str, owner: str = ""):
        return self.grammars.compile(kind, spec, owner)

    def cached_constraint(self, kind: str, spec: str, owner: str = ""):
        return self.grammars.cached(kind, spec, owner)

    def constraints_ready(self) -> bool:
        return self.grammars.prepared

    def prepare_constraints(self) -> None:
        self.grammars.prepare()

    @property
    def vocab_size(self) -> int:
        return self.text.vocab_size

    def chat_plan(self, chat: ChatRequest) -> ChatPlan:
        return self.text.chat.plan(chat)

    def reasons(self) -> bool:
        return self.text.chat.reasoning


class KeepTokens:
    """A detokenizer that keeps some special tokens' text (tags: `ChatPlan.keep_tokens`), which
    plain decoding skips. Each kept token ends a segment: the text before it is flushed, and the
    ids after it decode afresh."""

    def __init__(self, make: Callable[[], Detokenizer], keep: dict[int, str]):
        self._make = make
        self._keep = keep
        self._inner = make()

    def add(self, token_id: int) -> str:
        if token_id in self._keep:
            text = self._inner.flush() + self._keep[token_id]
            self._inner = self._make()
            return text
        return self._inner.add(token_id)

    def flush(self) -> str:
        return self._inner.flush()


class StreamDetokenizer:
    """O(1) per token with tokenizers' DecodeStream; the final flush makes the text exact."""

    def __init__(self, text: TokenizerText):
        from tokenizers.decoders import DecodeStream

        self._text = text
        self._stream = DecodeStream(skip_special_tokens=True)
        self._ids: list[int] = []
        self._emitted = 0

    def add(self, token_id: int) -> str:
        self._ids.append(token_id)
        piece = self._stream.step(self._text.tokenizer.backend_tokenizer, token_id) or ""
        self._emitted += len(piece)
        return piece

    def flush(self) -> str:
        # Bytes of an unfinished character are still held back: decode them as plain
        # decoding would (U+FFFD), so the whole text equals decode(ids).
        full = self._text.decode(self._ids)
        rest = full[self._emitted :]
        self._emitted = len(full)
        return rest
