"""Tokenizing and incremental detokenizing through a Hugging Face tokenizer (no torch here)."""

from __future__ import annotations

import functools
import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from backends import tools

if TYPE_CHECKING:
    from backends import Detokenizer
    from backends.grammar import Grammars


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
        template = getattr(tokenizer, "chat_template", None)
        self.tool_format, self.template_knows_tools = tools.detect_format(
            template if isinstance(template, str) else None
        )
        if not self.template_knows_tools:
            self.tool_format = tools.DEFAULT_FORMAT  # the default block asks for Hermes-style calls
        vocab = tokenizer.get_vocab()
        self.reasoning = tools.THINK_OPEN in vocab and tools.THINK_CLOSE in vocab

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

    def chat_prompt(self, messages: list[dict], tool_list: list[dict] | None = None) -> ChatPrompt:
        """The tokenizer's chat template when it has one, else Phi-2's model-card chat format.
        With tools (OpenAI's function tools), through the template's own `tools=` where it
        renders them, else with the default tools block (backends.tools)."""
        has_template = bool(getattr(self.tokenizer, "chat_template", None))
        native = has_template and self.template_knows_tools
        if tool_list or any(m.get("tool_calls") or m["role"] == "tool" for m in messages):
            messages = tools.template_messages(messages, tool_list, native, self.tool_format)
        if has_template:
            text = self.tokenizer.apply_chat_template(
                messages,
                # transformers' (and the templates') form of a tool: {"type": "function", "function": {...}}
                tools=[{"type": "function", "function": t} for t in tool_list] if native and tool_list else None,
                tokenize=False,
                add_generation_prompt=True,
            )
            return ChatPrompt(text, (), thinking=self.reasoning and text.rstrip().endswith(tools.THINK_OPEN))
        return phi2_chat_prompt(messages)

    def single_token(self, text: str) -> int | None:
        ids = self.tokenizer.encode(text, add_special_tokens=False)
        return ids[0] if len(ids) == 1 else None

    def tool_tokens(self) -> tuple[tuple[int, str], ...]:
        """The format's tags (and <think>'s) that are single tokens: the text of a reply keeps
        them, where decoding would skip them as special tokens, so that its calls can be parsed."""
        tags = [self.tool_format.open, self.tool_format.close]
        if self.reasoning:
            tags += [tools.THINK_OPEN, tools.THINK_CLOSE]
        found = ((self.single_token(tag), tag) for tag in tags if tag)
        return tuple((token, tag) for token, tag in found if token is not None)

    def tool_grammar(self, tool_list: list[dict], parallel: bool, lazy: bool) -> str:
        """The `tool_calls` grammar spec (backends.grammar) for calls to `tool_list` ({name,
        parameters} each): the whole reply, or lazy (armed when the model opens a call)."""
        format = self.tool_format

        def written(tag: str) -> str:
            # A tag that is one token (llguidance counts every added token as special) may also
            # come spelled out in pieces: the grammar takes either.
            token = self.single_token(tag)
            return json.dumps(tag) if token is None else f"(<[{token}]> | {json.dumps(tag)})"

        tags = {tag: written(tag) for tag in (format.open, format.close) if tag}
        trigger = None
        if lazy:
            token = self.single_token(format.open)
            ids = (token,) if token is not None else ()
            trigger = tools.Trigger(ids, (format.open,), ("{",) if format.bare else ()).to_json()
        return json.dumps({"lark": tools.tool_grammar(format, tool_list, parallel, tags), "trigger": trigger})


class TokenizerMethods:
    """The contract's tokenizer methods, for a runtime that keeps a TokenizerText in `self.text`."""

    text: TokenizerText
    grammars: Grammars  # backends.grammar, over the model's whole vocabulary

    def encode(self, text: str) -> list[int]:
        return self.text.encode(text)

    def decode(self, token_ids: list[int]) -> str:
        return self.text.decode(token_ids)

    def token_bytes(self, token_id: int) -> bytes:
        return self.text.token_bytes(token_id)

    def constraint(self, kind: str, spec: str):
        return self.grammars.compile(kind, spec)

    def cached_constraint(self, kind: str, spec: str):
        return self.grammars.cached(kind, spec)

    @property
    def vocab_size(self) -> int:
        return self.text.vocab_size

    def chat_prompt(self, messages: list[dict], tools: list[dict] | None = None) -> ChatPrompt:
        return self.text.chat_prompt(messages, tools)

    @property
    def tool_format(self) -> tools.ToolFormat:
        return self.text.tool_format

    @property
    def reasoning(self) -> bool:
        return self.text.reasoning

    def tool_tokens(self) -> tuple[tuple[int, str], ...]:
        return self.text.tool_tokens()

    def tool_grammar(self, tool_list: list[dict], parallel: bool, lazy: bool) -> str:
        return self.text.tool_grammar(tool_list, parallel, lazy)


@dataclass(frozen=True)
class ChatPrompt:
    text: str
    stop: tuple[str, ...]  # added to the request's own stop sequences
    thinking: bool = False  # the prompt opened <think>: the reply starts inside its reasoning


class KeepTokens:
    """A detokenizer that keeps some special tokens' text (tool-call tags: `tool_tokens`), which
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


# Base Phi-2 has no chat template; its model card's chat format is a dialogue of Alice (the
# user) and Bob (the model). Generation starts after "Bob:" and stops before the model writes
# Alice's next turn itself.
USER_NAME, ASSISTANT_NAME = "Alice", "Bob"


def phi2_chat_prompt(messages: list[dict]) -> ChatPrompt:
    lines = []
    for message in messages:
        role, content = message["role"], message["content"]
        if role in ("system", "developer"):
            lines.append(content)
        else:
            lines.append(f"{USER_NAME if role == 'user' else ASSISTANT_NAME}: {content}")
    lines.append(f"{ASSISTANT_NAME}:")
    return ChatPrompt("\n".join(lines), (f"\n{USER_NAME}:",))


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
