"""OpenAI's /v1/chat/completions: its schema, its translation onto the shared `ChatCall`, and a
`chat.completion` body or `chat.completion.chunk`s (each choice's role first) then `[DONE]`."""

from __future__ import annotations

from typing import Any

from backends.chat.plan import ChatPlan
from backends.chat.tools import Piece
from backends.contract import MAX_LOGPROBS, StepLogprobs
from backends.wire import constraints
from backends.wire.base import Context, Wire, stop_tuple
from backends.wire.chat import (
    FUNCTION,
    MAX_TOOLS,
    MESSAGE,
    NAMED_TOOL,
    REASONING_CONTROLS,
    TOOL,
    ChatCall,
    Reasoning,
    call_id,
    call_parts,
    chat_call,
    chat_finish,
    chat_messages,
    chat_tools,
    tools_or_format,
)
from backends.wire.openai import (
    OPENAI_COMMON,
    RESPONSE_FORMAT,
    _unsupported,
    chat_logprobs,
    openai_params,
    response_grammar,
    response_head,
    sse,
    sse_error,
    usage,
)
from backends.wire.schema import tolerant
from backends.workers.engine import Event, Ticket

CHAT_SCHEMA: dict[str, Any] = tolerant(
    {
        "type": "object",
        "required": ["messages"],
        "properties": {
            **OPENAI_COMMON,
            "messages": {"type": "array", "minItems": 1, "items": MESSAGE},
            "max_completion_tokens": {"type": "integer", "minimum": 1},
            "logprobs": {"type": "boolean", "default": False},
            "top_logprobs": {"type": "integer", "minimum": 0, "maximum": MAX_LOGPROBS},
            "tools": {"type": "array", "maxItems": MAX_TOOLS, "items": TOOL},
            "tool_choice": {
                "anyOf": [{"enum": ["none", "auto", "required"]}, NAMED_TOOL],
                "x-error": (
                    'tool_choice must be "none", "auto", "required", {"type": "function", "function": {"name": ...}} '
                    'or {"type": "custom", "custom": {"name": ...}}'
                ),
            },
            "parallel_tool_calls": {"type": "boolean", "default": True},
            # The deprecated forms of tools and tool_choice.
            "functions": {"type": "array", "maxItems": MAX_TOOLS, "items": FUNCTION},
            "function_call": {
                "anyOf": [
                    {"enum": ["none", "auto"]},
                    {"type": "object", "required": ["name"], "properties": {"name": {"type": "string"}}},
                ],
                "x-error": 'function_call must be "none", "auto" or {"name": ...}',
            },
            "response_format": RESPONSE_FORMAT,
            **constraints.FIELDS,  # vLLM's guided_* and llama.cpp's json_schema, grammar
            "modalities": _unsupported(["text"]),
            **REASONING_CONTROLS,
            "audio": _unsupported(),
            "prediction": _unsupported(),
            "web_search_options": _unsupported(),
        },
    }
)


class ChatWire(Wire):
    """/v1/chat/completions: a `chat.completion` body, or `chat.completion.chunk`s (each choice's
    role first) then `[DONE]`. Each choice's text goes through its plan's parser: content,
    `reasoning_content` and `tool_calls` (a call streamed as its id and name, then its arguments)."""

    def __init__(
        self,
        ctx: Context,
        tickets: list[Ticket],
        call: ChatCall,
        name: str,
        plan: ChatPlan,
    ):
        params = call.params
        super().__init__(ctx, tickets, params["stream"])
        self.k = call.logprobs
        self.envelope = response_head(name, "chat.completion.chunk" if self.streaming else "chat.completion")
        self.include_usage = bool(params["stream_options"].get("include_usage"))
        self.parser = lambda: ctx.parser(plan)
        self.thinks = plan.thought is not None  # usage then counts the reasoning's tokens
        self.parsers = [self.parser() for _ in tickets]
        self.calls = [0 for _ in tickets]  # tool calls streamed so far, per choice
        self.pending: dict[int, list[StepLogprobs]] = {i: [] for i in range(len(tickets))}

    @property
    def heavy(self) -> bool:
        return self.k is not None

    def sse_chunk(self, index: int, delta: dict, finish: str | None = None) -> str:
        logprobs = None
        if self.k is not None and self.pending[index] and "tool_calls" not in delta:
            logprobs = chat_logprobs(self.backend, self.pending[index], self.k)
            self.pending[index].clear()
        choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
        payload = {**self.envelope, "choices": [choice]}
        return sse({**payload, "usage": None} if self.include_usage else payload)

    def opening(self) -> str:
        return "".join(self.sse_chunk(i, {"role": "assistant", "content": ""}) for i in range(len(self.tickets)))

    def pieces(self, index: int, pieces: list[Piece]) -> str:
        out = []
        for piece in pieces:
            if piece.kind == "call":  # its id, type and name first, then its arguments (or input)
                at, self.calls[index] = self.calls[index], self.calls[index] + 1
                kind, field, text = call_parts(piece.call)
                head = {"index": at, "id": call_id(), "type": kind, kind: {"name": piece.call.name, field: ""}}
                out.append(self.sse_chunk(index, {"tool_calls": [head]}))
                out.append(self.sse_chunk(index, {"tool_calls": [{"index": at, kind: {field: text}}]}))
            else:
                out.append(
                    self.sse_chunk(index, {"content" if piece.kind == "content" else "reasoning_content": piece.text})
                )
        return "".join(out)

    def chunk(self, index: int, event: Event) -> str:
        if isinstance(event, StepLogprobs):
            self.pending[index].append(event)
            return ""
        if isinstance(event, str):
            return self.pieces(index, self.parsers[index].feed(event))  # logprobs wait for text
        if event.finish_reason == "error":  # the SDKs raise on an error event
            return sse_error(self.ctx.facts, event)
        rest = self.pieces(index, self.parsers[index].finish())
        return rest + self.sse_chunk(index, {}, finish=chat_finish(event, self.parsers[index]))

    def tail(self) -> str:
        end = (
            sse({**self.envelope, "choices": [], "usage": usage(self.summaries(), 1, reasoning=self.thinks)})
            if self.include_usage
            else ""
        )
        return end + sse("[DONE]")

    def body(self) -> dict:
        choices = []
        for i, choice in enumerate(self.choices):
            parser = self.parser()
            pieces = parser.feed("".join(choice.text)) + parser.finish()
            content = "".join(p.text for p in pieces if p.kind == "content")
            reasoning = "".join(p.text for p in pieces if p.kind == "reasoning")
            calls = [chat_call(p.call) for p in pieces if p.kind == "call"]
            message = {"role": "assistant", "content": content if content or not calls else None, "refusal": None}
            if reasoning:
                message["reasoning_content"] = reasoning
            if calls:
                message["tool_calls"] = calls
            choices.append(
                {
                    "index": i,
                    "message": message,
                    "logprobs": chat_logprobs(self.backend, choice.logprobs, self.k) if self.k is not None else None,
                    "finish_reason": chat_finish(choice.summary, parser),
                }
            )
        return {**self.envelope, "choices": choices, "usage": usage(self.summaries(), 1, reasoning=self.thinks)}


def translate(params: dict, ctx: Context) -> ChatCall:
    """The request as the shared chat form: messages, tools (and the deprecated functions),
    response_format, reasoning switches, n choices, logprobs."""
    use = chat_tools(params)
    messages = chat_messages(params)
    output, output_field = response_grammar(params)
    tools_or_format(use, output and output.kind, output_field or "response_format")
    return ChatCall(
        params,
        messages,
        use,
        sampling=params,
        max_tokens=params["max_completion_tokens"] or params["max_tokens"],
        reasoning=Reasoning(
            params["chat_template_kwargs"], None, params["reasoning_effort"], params["thinking_token_budget"]
        ),
        output=output,
        output_field=output_field,
        stop=stop_tuple(params["stop"]),
        choices=params["n"],
        logprobs=(params["top_logprobs"] or 0) if params["logprobs"] else None,
    )


SCHEMA, check, Answer = CHAT_SCHEMA, openai_params, ChatWire
