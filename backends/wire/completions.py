"""OpenAI's legacy /v1/completions: prompts as text or token ids (up to MAX_PROMPTS), `n` and
`best_of` choices, `echo` and logprobs as lm-eval reads them; a `text_completion` body or its SSE
chunks then `[DONE]`."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from backends.contract import StepLogprobs, mean_logprob
from backends.wire import constraints
from backends.wire.base import Context, Generation, Wire, stop_tuple
from backends.wire.errors import ApiError
from backends.wire.openai import (
    MAX_CHOICES,
    MAX_PROMPTS,
    OPENAI_COMMON,
    RESPONSE_FORMAT,
    TOKEN_IDS,
    CompletionLogprobs,
    _unsupported,
    openai_generations,
    response_head,
    sse,
    sse_error,
    usage,
)
from backends.wire.schema import tolerant
from backends.workers.engine import Event, Ticket

COMPLETIONS_SCHEMA: dict[str, Any] = tolerant(
    {
        "type": "object",
        "required": ["prompt"],
        "properties": {
            **OPENAI_COMMON,
            "prompt": {
                "anyOf": [
                    {"type": "string", "minLength": 1},
                    {
                        "type": "array",
                        "minItems": 1,
                        "maxItems": MAX_PROMPTS,
                        "items": {"type": "string", "minLength": 1},
                    },
                    TOKEN_IDS,
                    {"type": "array", "minItems": 1, "maxItems": MAX_PROMPTS, "items": TOKEN_IDS},
                ],
                "x-error": (
                    "prompt must be a string, a list of token ids, or a list of up to "
                    f"{MAX_PROMPTS} of either (none empty)"
                ),
            },
            # OpenAI's default is 16, applied in v1_completions: a schema default here would count
            # as asked for, and refuse a prompt that leaves less room instead of clipping to it.
            # 0 scores the prompt alone (with echo).
            "max_tokens": {"type": "integer", "minimum": 0},
            "echo": {"type": "boolean", "default": False},
            "logprobs": {"type": "integer", "minimum": 0, "maximum": 5},
            "best_of": {"type": "integer", "minimum": 1, "maximum": MAX_CHOICES},
            "suffix": _unsupported(""),
            "response_format": RESPONSE_FORMAT,
            **constraints.FIELDS,  # vLLM's guided_* and llama.cpp's json_schema, grammar
        },
    }
)


def prompts(params: dict) -> list[str | list[int]]:
    """One prompt or several; a prompt is text or token ids."""
    prompt = params["prompt"]
    return [prompt] if isinstance(prompt, str) or isinstance(prompt[0], int) else prompt


def check(params: dict) -> None:
    """What n, best_of, echo and max_tokens may be together."""
    n, echo = params["n"], params["echo"]
    best_of = params["best_of"] or n
    if best_of < n:
        raise ApiError(400, f"best_of ({best_of}) must be at least n ({n})", field="best_of")
    if best_of > n and params["stream"]:
        raise ApiError(400, "best_of cannot be streamed: the best choices are known only at the end", field="best_of")
    if params["max_tokens"] == 0 and not echo:
        raise ApiError(400, "max_tokens must be at least 1 (0 only with echo, to score the prompt)", field="max_tokens")


def generations(params: dict, grammar: dict) -> list[Generation]:
    """`best_of` choices a prompt (n without it), OpenAI's default of 16 tokens; logprobs where
    asked, and where best_of ranks the choices by them; the prompt's with echo."""
    n, echo, k = params["n"], params["echo"], params["logprobs"]
    best_of = params["best_of"] or n
    options = dict(
        stop=stop_tuple(params["stop"]),
        logprobs=k if k is not None else (0 if best_of > n else None),  # best_of ranks by logprob
        prompt_logprobs=k if echo else None,
        **grammar,
    )
    return [
        g for p in prompts(params) for g in openai_generations(params, p, best_of, params["max_tokens"], 16, **options)
    ]


def texts(params: dict, decode: Callable[[list[int]], str]) -> list[str]:
    """The prompts as text, where echo shows them or logprobs count offsets from them."""
    if not params["echo"] and params["logprobs"] is None:
        return []
    return [p if isinstance(p, str) else decode(p) for p in prompts(params)]


class CompletionsWire(Wire):
    """/v1/completions: a `text_completion` body, or its SSE chunks then `[DONE]`. Choices come
    `copies` (best_of) a prompt; a whole answer keeps each prompt's `n` best by mean logprob."""

    def __init__(self, ctx: Context, tickets: list[Ticket], params: dict, name: str, texts: list[str]):
        super().__init__(ctx, tickets, params["stream"])
        self.n, self.echo, self.k = params["n"], params["echo"], params["logprobs"]
        self.copies = params["best_of"] or self.n
        self.texts = texts  # the prompts as text, where echo shows them or logprobs count offsets from them
        self.prompts = len(tickets) // self.copies
        self.envelope = response_head(name, "text_completion")
        self.include_usage = bool(params["stream_options"].get("include_usage"))
        self.pending: dict[int, list[StepLogprobs]] = {i: [] for i in range(len(tickets))}
        self.echoed: set[int] = set()
        self.shapers: dict[int, CompletionLogprobs] = {}  # a streamed choice's: its text offsets run on

    @property
    def heavy(self) -> bool:
        return self.k is not None or self.copies > self.n

    def shaper(self, prompt: int) -> CompletionLogprobs:
        return CompletionLogprobs(self.backend, self.k, 0 if self.echo else len(self.texts[prompt]))

    def sse_chunk(self, index: int, text: str, entries: list | None = None, finish: str | None = None) -> str:
        logprobs = None
        if self.k is not None and entries:
            if index not in self.shapers:
                self.shapers[index] = self.shaper(index // self.n)
            logprobs = self.shapers[index].shape(entries)
        payload = {
            **self.envelope,
            "choices": [{"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish}],
        }
        return sse({**payload, "usage": None} if self.include_usage else payload)

    def chunk(self, index: int, event: Event) -> str:
        out = ""
        if self.echo and index not in self.echoed:  # the prompt first, with its logprobs
            self.echoed.add(index)
            scores = [event] if isinstance(event, StepLogprobs) else []
            prompt_ids = self.tickets[index].request.prompt_ids
            out = self.sse_chunk(
                index, self.texts[index // self.n], CompletionLogprobs.prompt_entries(prompt_ids, scores)
            )
        if isinstance(event, StepLogprobs):
            self.pending[index].append(event)
            return out
        entries = CompletionLogprobs.token_entries(self.pending[index])
        self.pending[index].clear()
        if isinstance(event, str):
            return out + self.sse_chunk(index, event, entries)
        if event.finish_reason == "error":  # the SDKs raise on an error event
            return out + sse_error(self.ctx.facts, event)
        return out + self.sse_chunk(index, "", entries, finish=event.finish_reason)

    def tail(self) -> str:
        end = ""
        if self.include_usage:
            end = sse({**self.envelope, "choices": [], "usage": usage(self.summaries(), self.prompts)})
        return end + sse("[DONE]")

    def body(self) -> dict:
        choices = []
        for p in range(self.prompts):
            group = list(zip(self.tickets, self.choices, strict=True))[p * self.copies : (p + 1) * self.copies]
            if self.copies > self.n:
                group = sorted(group, key=lambda pair: mean_logprob(pair[1].logprobs), reverse=True)[: self.n]
            for j, (ticket, choice) in enumerate(group):
                text = "".join(choice.text)
                logprobs = None
                if self.k is not None:
                    entries = CompletionLogprobs.token_entries(choice.logprobs)
                    if self.echo:
                        entries = (
                            CompletionLogprobs.prompt_entries(ticket.request.prompt_ids, choice.logprobs) + entries
                        )
                    logprobs = self.shaper(p).shape(entries)
                choices.append(
                    {
                        "index": p * self.n + j,
                        "text": self.texts[p] + text if self.echo else text,
                        "logprobs": logprobs,
                        "finish_reason": choice.summary.finish_reason,
                    }
                )
        return {**self.envelope, "choices": choices, "usage": usage(self.summaries(), self.prompts)}


SCHEMA, Answer = COMPLETIONS_SCHEMA, CompletionsWire
