"""Tokenizing and incremental detokenizing through a Hugging Face tokenizer (no torch here)."""

from __future__ import annotations


class TokenizerText:
    """Tokenizing and decoding through the Hugging Face tokenizer (shared by both runtimes)."""

    def __init__(self, tokenizer):
        # The server checks prompts against the context window itself (a 422 that says both
        # numbers); the tokenizer's own warning about long inputs would only be log noise.
        tokenizer.model_max_length = 1 << 62
        self.tokenizer = tokenizer
        self.vocab_size = len(tokenizer)

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False)

    def decode(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)


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
        piece = self._stream.step(self._text.tokenizer._tokenizer, token_id) or ""
        self._emitted += len(piece)
        return piece

    def flush(self) -> str:
        # Bytes of an unfinished character are still held back: decode them as plain
        # decoding would (U+FFFD), so the whole text equals decode(ids).
        full = self._text.decode(self._ids)
        rest = full[self._emitted :]
        self._emitted = len(full)
        return rest
