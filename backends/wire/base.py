"""What every API's wire format shares: the `Generation` record a request's translation gives
(one a choice, submitted by phi2_server.py), the `Context` a wire format reads of its HTTP request,
and `Wire`, the answer's shape. Every generating route ends in phi2_server.py's one answer loop,
which reads the choices' events (text, a token's logprobs, the end); a `Wire` turns them into what
its API sends. A stream writes each event's chunk as it comes; a whole answer is a fold over the
same events, then `wire.body()`. A new API is a new Wire, not a new loop."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from typing import Any

from backends.chat.plan import ChatPlan
from backends.chat.tools import ToolCall, ToolCallParser
from backends.contract import Backend, Grammar, Sampling, StepLogprobs
from backends.wire.schema import MAX_IGNORED
from backends.workers.engine import Event, Request, Summary, Ticket


@dataclass
class Context:
    """What a wire format reads of its HTTP request (phi2_server.py builds it): the model, the
    request's id, its log line's facts (`facts`: the wire adds what the log should say), its prompt
    cache namespace (its API key's), what checks each tool call given out (`on_call`), and the
    Responses store."""

    backend: Backend
    request_id: str
    facts: dict[str, Any]
    namespace: str = ""
    on_call: Callable[[ToolCall], None] | None = None
    store: Any = None  # backends.wire.store.ResponseStore

    def parser(self, plan: ChatPlan) -> ToolCallParser:
        """A parser for one choice's text whose calls are checked (`on_call`), if any may come."""
        parser = plan.parser()
        parser.on_call = self.on_call
        return parser

    def note_skipped(self, types: list[str]) -> None:
        """The types of the tools a request offered that nothing here can run, in its log line."""
        if types:
            self.facts["tools_skipped"] = sorted({kind[:64] for kind in types})[:MAX_IGNORED]


@dataclass(frozen=True)
class Generation:
    prompt: str | list[int]  # text, or token ids (OpenAI's completions take both)
    max_tokens: int  # 0 only with prompt_logprobs: the prompt is scored, nothing generated
    max_tokens_given: bool  # False: a default, clipped to the context left instead of refused
    sampling: Sampling
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None  # each generated token's logprob and this many alternatives
    prompt_logprobs: int | None = None  # the same for the prompt (OpenAI's echo)
    prompt_field: str = "prompt"  # the field a prompt too long for the context names
    grammar: Grammar | None = None  # compiled; `submit` gives the sequence a matcher of its own
    grammar_field: str | None = None  # the field that gave it (what a failing grammar's error names)
    keep_tokens: tuple[tuple[int, str], ...] = ()  # tags the reply's text keeps (Request.keep_tokens)
    thought: tuple[int, int, bool] | None = None  # a reasoning reply's tags (Request.thought)

    def request(self, prompt_ids: list[int], max_tokens: int, **context: Any) -> Request:
        """The engine's request for this generation: every field the two records share comes from
        here (so a field added to both flows through), the tokenized prompt, the `max_tokens` the
        limits left, and what the HTTP request adds (`context`: its time, adapter, namespace)."""
        shared = {f.name: getattr(self, f.name) for f in fields(Request) if f.name in GENERATION_FIELDS}
        return Request(**{**shared, "prompt_ids": prompt_ids, "max_tokens": max_tokens, **context})


GENERATION_FIELDS = frozenset(f.name for f in fields(Generation))


def stop_tuple(stop: str | list[str] | None) -> tuple[str, ...]:
    return (stop,) if isinstance(stop, str) else tuple(stop or ())


def sampling_of(params: dict, temperature: float, top_p: float, seed: int | None) -> Sampling:
    return Sampling(
        temperature=temperature,
        top_p=top_p,
        seed=seed,
        top_k=max(params["top_k"], 0),
        min_p=params["min_p"],
        repetition_penalty=params["repetition_penalty"],
        presence_penalty=params["presence_penalty"],
        frequency_penalty=params["frequency_penalty"],
        logit_bias=tuple(sorted((int(token), float(bias)) for token, bias in params["logit_bias"].items())),
    )


@dataclass
class Answer:
    """One choice as it comes back: its text, its tokens' logprobs (both kept only for a whole
    answer), its summary."""

    text: list[str] = field(default_factory=list)
    logprobs: list[StepLogprobs] = field(default_factory=list)
    summary: Summary | None = None


class Wire:
    """One API's wire format for one request. `add` takes each event in order; streaming, it
    returns the text to send for it (keeping what state the format needs), between `opening()`
    and `tail()`; whole, it keeps the event in `choices`, and `body()` builds the answer."""

    content_type = "text/event-stream"

    def __init__(self, ctx: Context, tickets: list[Ticket], streaming: bool):
        self.ctx, self.tickets, self.streaming = ctx, tickets, streaming
        self.backend: Backend = ctx.backend
        self.choices = [Answer() for _ in tickets]

    @property
    def heavy(self) -> bool:
        """Whether the whole body is worth building and encoding on a pool (logprobs)."""
        return False

    @property
    def finished(self) -> bool:
        return all(choice.summary is not None for choice in self.choices)

    def summaries(self) -> list[Summary]:
        return [choice.summary for choice in self.choices]

    def add(self, index: int, event: Event) -> str:
        choice = self.choices[index]
        if isinstance(event, Summary):
            choice.summary = event
        elif not self.streaming:
            (choice.text if isinstance(event, str) else choice.logprobs).append(event)
        return self.chunk(index, event) if self.streaming else ""

    def opening(self) -> str:
        """What a stream starts with, sent with its headers."""
        return ""

    def keepalive(self) -> str:
        """What a stream sends while it waits for its first token, so that clients and proxies
        do not time out: an SSE comment line (NDJSON has none: the headers alone)."""
        return ": keep-alive\n\n" if self.content_type == "text/event-stream" else ""

    def chunk(self, index: int, event: Event) -> str:
        raise NotImplementedError

    def tail(self) -> str:
        """What a stream ends with, once every choice has ended."""
        return ""

    def body(self) -> dict:
        raise NotImplementedError


def combined(summaries: list[Summary]) -> Summary:
    """One summary for the request log and metrics: the choices' tokens added up."""
    first = summaries[0]
    if len(summaries) == 1:
        return first
    return dataclasses.replace(
        first,
        tokens_used=sum(s.tokens_used for s in summaries),
        cached_tokens=sum(s.cached_tokens for s in summaries),
        finish_reason=next(
            (s.finish_reason for s in summaries if s.finish_reason not in ("stop", "length")), first.finish_reason
        ),
    )


def grammar_failed(summary: Summary) -> bool:
    """The request's own grammar failed while generating: the client's input, not the server."""
    return summary.finish_reason == "error" and summary.error_kind == "grammar"


def token_string(data: bytes) -> str:
    """A token as text, as OpenAI shows it: the bytes of part of a character as `bytes:\\xNN`."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{b:02x}" for b in data)
