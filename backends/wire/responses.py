"""OpenAI's Responses API (/v1/responses): `input` (a string, or message, function_call and
function_call_output items) and `instructions` become chat messages; tools, tool_choice and
text.format work as on chat completions. A `response` object, or its events. An answer is stored
(`store`, the default) for a later request's `previous_response_id` (backends/wire/store.py).
docs/api.md, "Responses API"."""

from __future__ import annotations

import json
import time
import uuid
from typing import Any

from backends.chat.plan import ChatPlan, GrammarSpec, ToolUse
from backends.chat.tools import Piece
from backends.contract import StepLogprobs
from backends.wire.base import Context, Wire, grammar_failed
from backends.wire.chat import (
    CUSTOM_FORMAT,
    FUNCTION,
    MAX_TOOLS,
    REASONING_CONTROLS,
    ChatCall,
    Reasoning,
    call_id,
    chat_messages,
    chat_tools,
    pick,
    tools_or_format,
)
from backends.wire.errors import ApiError
from backends.wire.native import CACHE_SALT, GENERATE_SCHEMA, SAMPLING_PROPERTIES
from backends.wire.openai import RESPONSE_FORMAT, _ignored, _unsupported
from backends.wire.schema import tolerant
from backends.wire.store import stored
from backends.workers.engine import Event, Summary, Ticket

INPUT_PART = {
    "type": "object",
    "required": ["type"],
    "x-check-first": "type",
    "properties": {
        "type": {"enum": ["input_text", "output_text", "text"], "x-unsupported": True},
        "text": {"type": "string"},
        "annotations": {"type": "array", "items": {}, "description": "accepted and ignored"},
        "logprobs": {"type": "array", "items": {}, "description": "accepted and ignored"},
    },
}


INPUT_ITEM = {
    "type": "object",
    "x-check-first": "type",
    "properties": {
        "type": {
            "enum": [
                "message",
                "function_call",
                "function_call_output",
                "custom_tool_call",
                "custom_tool_call_output",
                "reasoning",
            ],
            "x-unsupported": True,
        },
        "role": {"enum": ["user", "system", "developer", "assistant"]},
        "content": {"anyOf": [{"type": "string"}, {"type": "array", "items": INPUT_PART}]},
        "id": {"type": "string"},
        "status": {"type": "string"},
        "call_id": {"type": "string", "description": "function_call, function_call_output: the call"},
        "name": {"type": "string", "description": "function_call: the function called"},
        "arguments": {"type": "string", "description": "function_call: a JSON object, as text"},
        "output": {"type": "string", "description": "function_call_output: what the function returned"},
        "input": {"type": "string", "description": "custom_tool_call: the custom tool's input"},
        "summary": {"type": "array", "items": {}, "description": "reasoning: accepted and ignored"},
        "encrypted_content": _ignored("string"),
    },
}


# The chat route's function, flat: {"type": "function", "name": ...}. A `namespace` (Codex's)
# holds such functions, offered as they are; a hosted tool OpenAI runs itself (web_search,
# file_search, ...) is skipped and logged, as llama.cpp does: nothing here can run it.
FLAT_FUNCTION = {
    "type": "object",
    "required": ["type", "name"],
    "x-check-first": "type",
    "properties": {"type": {"enum": ["function"], "x-unsupported": True}, **FUNCTION["properties"]},
}


RESPONSE_TOOL = {
    "type": "object",
    "required": ["type"],
    "x-check-first": "type",
    "properties": {
        "type": {"type": "string"},
        **FUNCTION["properties"],
        "format": {**CUSTOM_FORMAT, "description": "a custom tool's input: text, or a grammar's"},
        "tools": {"type": "array", "maxItems": MAX_TOOLS, "items": FLAT_FUNCTION, "description": "a namespace's"},
    },
}


TEXT_FORMAT = {  # response_format, flat: {"type": "json_schema", "schema": ...}
    "type": "object",
    "required": ["type"],
    "x-check-first": "type",
    "properties": {
        "type": RESPONSE_FORMAT["properties"]["type"],
        **RESPONSE_FORMAT["properties"]["json_schema"]["properties"],
    },
}


RESPONSES_SCHEMA: dict[str, Any] = tolerant(
    {
        "type": "object",
        "required": ["input"],
        "properties": {
            "model": {"type": "string"},
            "input": {
                "anyOf": [{"type": "string", "minLength": 1}, {"type": "array", "minItems": 1, "items": INPUT_ITEM}]
            },
            "instructions": {"type": "string"},
            "tools": {"type": "array", "maxItems": MAX_TOOLS, "items": RESPONSE_TOOL},
            "tool_choice": {
                "anyOf": [
                    {"enum": ["none", "auto", "required"]},
                    {
                        "type": "object",
                        "required": ["type", "name"],
                        "properties": {"type": {"enum": ["function", "custom"]}, "name": {"type": "string"}},
                    },
                ],
                "x-error": (
                    'tool_choice must be "none", "auto", "required" or {"type": "function" or "custom", "name": ...}'
                ),
            },
            "parallel_tool_calls": {"type": "boolean", "default": True},
            "max_output_tokens": {"type": "integer", "minimum": 1},
            "temperature": {"type": "number", "minimum": 0, "maximum": 2, "default": 1.0},
            "top_p": {"type": "number", "exclusiveMinimum": 0, "maximum": 1, "default": 1.0},
            "seed": GENERATE_SCHEMA["properties"]["seed"],
            **SAMPLING_PROPERTIES,
            "text": {
                "type": "object",
                "properties": {"format": TEXT_FORMAT, "verbosity": _ignored("string")},
                "default": {},
            },
            "stream": {"type": "boolean", "default": False},
            "store": {"type": "boolean", "default": True, "description": "keep the answer (RESPONSES_STORE)"},
            "previous_response_id": {
                "type": "string",
                "maxLength": 128,
                "description": "a stored answer this one continues",
            },
            "truncation": {"enum": ["disabled"], "x-unsupported": True},
            "reasoning": {
                "type": "object",
                "properties": {"effort": REASONING_CONTROLS["reasoning_effort"], "summary": _ignored("string")},
            },
            "chat_template_kwargs": REASONING_CONTROLS["chat_template_kwargs"],
            "thinking_token_budget": REASONING_CONTROLS["thinking_token_budget"],
            "include": {"type": "array", "items": {}, "description": "accepted and ignored"},
            "metadata": _ignored("object"),
            "user": _ignored("string"),
            "service_tier": _ignored("string"),
            "prompt_cache_key": _ignored("string"),
            "safety_identifier": _ignored("string"),
            "stream_options": _ignored("object"),
            "background": _unsupported(False),
            "conversation": _unsupported(),
            "prompt": _unsupported(),
            "top_logprobs": _unsupported(0),
            "cache_salt": CACHE_SALT,
        },
    }
)


def responses_chat(params: dict) -> list[dict]:
    """`instructions` and `input` as the chat messages `chat_messages` checks: function_call
    items (consecutive ones together) as an assistant's tool_calls, function_call_output items
    as tool results, reasoning items left out."""
    messages = [{"role": "system", "content": params["instructions"]}] if params["instructions"] else []
    items = [{"role": "user", "content": params["input"]}] if isinstance(params["input"], str) else params["input"]
    for i, item in enumerate(items):
        kind = item.get("type", "message")
        needs = {
            "message": ("role", "content"),
            "function_call": ("call_id", "name", "arguments"),
            "function_call_output": ("call_id", "output"),
            "custom_tool_call": ("call_id", "name", "input"),
            "custom_tool_call_output": ("call_id", "output"),
            "reasoning": (),
        }
        for key in needs[kind]:
            if key not in item:
                raise ApiError(400, f"input[{i}].{key} is required", field=f"input[{i}].{key}")
        if kind == "message":
            content = item["content"]
            text = content if isinstance(content, str) else "".join(p.get("text", "") for p in content)
            messages.append({"role": item["role"], "content": text})
        elif kind in ("function_call", "custom_tool_call"):
            if kind == "custom_tool_call":  # as chat_messages takes a custom tool's call
                call = {
                    "id": item["call_id"],
                    "type": "custom",
                    "custom": {"name": item["name"], "input": item["input"]},
                }
            else:
                call = {"id": item["call_id"], "function": {"name": item["name"], "arguments": item["arguments"]}}
            if messages and messages[-1]["role"] == "assistant" and "tool_calls" in messages[-1]:
                messages[-1]["tool_calls"].append(call)
            else:
                messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind in ("function_call_output", "custom_tool_call_output"):
            messages.append({"role": "tool", "tool_call_id": item["call_id"], "content": item["output"]})
    if not any(m["role"] not in ("system", "developer") for m in messages):
        raise ApiError(400, "input holds no message to answer", field="input")
    try:
        return chat_messages({"messages": messages})
    except ApiError as exc:  # name the field of this API: input[i], not messages[i]
        raise ApiError(
            400, exc.message.replace("messages[", "input["), field=(exc.field or "input").replace("messages[", "input[")
        ) from None


def responses_functions(ctx: Context, params: dict) -> list[dict]:
    """The request's function and custom tools as chat_tools takes them, a namespace's functions
    among them; the tools of other kinds (hosted ones) skipped, their types in the request log."""
    functions, skipped = [], []
    for i, tool in enumerate(params["tools"] or []):
        if tool["type"] in ("function", "custom"):
            if "name" not in tool:
                raise ApiError(400, f"tools[{i}].name is required", field=f"tools[{i}].name")
            functions.append(tool)
        elif tool["type"] == "namespace":
            functions += tool.get("tools") or []
        else:
            skipped.append(tool["type"])
    ctx.note_skipped(skipped)
    if len(functions) > MAX_TOOLS:  # namespaces' functions count too (128 of 128: 16,384 reached the compiler)
        raise ApiError(
            400, f"at most {MAX_TOOLS} functions in all, namespaces' included: {len(functions)}", field="tools"
        )
    return [
        {"type": "custom", "custom": pick(t, "name", "description", "format")}
        if t["type"] == "custom"
        else {"function": pick(t, "name", "description", "parameters")}
        for t in functions
    ]


def responses_tools(ctx: Context, params: dict) -> ToolUse | None:
    choice = params["tool_choice"]
    return chat_tools(
        {
            "tools": responses_functions(ctx, params) or None,
            "functions": None,
            "tool_choice": choice,
            "function_call": None,
            "parallel_tool_calls": params["parallel_tool_calls"],
        },
        flat=True,
    )


def responses_format(params: dict, use: ToolUse | None) -> tuple[GrammarSpec | None, str | None]:
    """`text.format` as the reply's grammar (json_object, json_schema) and its field; (None, None)
    for text."""
    text_format = (params["text"] or {}).get("format") or {"type": "text"}
    tools_or_format(use, text_format["type"], "text.format")
    if text_format["type"] == "json_object":
        return GrammarSpec("json_object", ""), "text.format"
    if text_format["type"] == "json_schema":
        schema = json.dumps(text_format.get("schema", {"type": "object"}))
        return GrammarSpec("json_schema", schema), "text.format.schema"
    return None, None


# A call's output item as the Responses API streams it, by whether it is a custom tool's: its
# type, its id's prefix, the field of its text, and its text's events (`.delta`, `.done`).
CALL_ITEMS = {
    False: ("function_call", "fc", "arguments", "response.function_call_arguments"),
    True: ("custom_tool_call", "ctc", "input", "response.custom_tool_call_input"),
}


class ResponsesWire(Wire):
    """A `response` object; streamed, its events (`response.created`, each output item's
    `output_item.added`, text deltas or function-call arguments, `output_item.done`, then
    `response.completed`, or `response.incomplete` at max_output_tokens), each with its
    `sequence_number`. The items are built once, as the pieces come, for both."""

    def __init__(self, ctx: Context, tickets: list[Ticket], call: ChatCall, name: str, plan: ChatPlan):
        params = call.params
        super().__init__(ctx, tickets, params["stream"])
        self.params = params
        self.parser = ctx.parser(plan)
        self.response = {
            "id": f"resp_{uuid.uuid4().hex}",
            "object": "response",
            "created_at": int(time.time()),
            "model": name,
            "instructions": params["instructions"],
            "max_output_tokens": params["max_output_tokens"],
            "parallel_tool_calls": params["parallel_tool_calls"],
            "previous_response_id": params["previous_response_id"],
            "store": params["store"],
            "temperature": params["temperature"],
            "top_p": params["top_p"],
            "text": {"format": (params["text"] or {}).get("format") or {"type": "text"}},
            "tool_choice": params["tool_choice"] or ("auto" if params["tools"] else "none"),
            "tools": params["tools"] or [],
            "truncation": "disabled",
            "metadata": params["metadata"] or {},
            "user": None,
            "reasoning": {"effort": None, "summary": None},
        }
        self.output: list[dict] = []
        self.open: dict | None = None  # the message item whose text is streaming
        self.events = 0
        self.thought = ""  # reasoning not given out yet
        self.start()

    def event(self, kind: str, **payload) -> str:
        self.events += 1
        body = {"type": kind, "sequence_number": self.events - 1, **payload}
        return f"event: {kind}\ndata: {json.dumps(body, ensure_ascii=False)}\n\n" if self.streaming else ""

    def snapshot(self, status: str, **more) -> dict:
        return {
            **self.response,
            "status": status,
            "output": self.output,
            "error": None,
            "incomplete_details": None,
            "usage": None,
            **more,
        }

    def opening(self) -> str:
        return self.head

    def keepalive(self) -> str:
        """While a prompt prefills: `response.in_progress` again. Codex's stream idle timer (300 s
        by default) is reset by events, not by SSE comments."""
        return self.event("response.in_progress", response=self.snapshot("in_progress"))

    def start(self) -> None:
        """The stream's first events, numbered first (the answer loop asks for the opening only
        once the first events are in), with nothing in the output yet."""
        head = self.snapshot("in_progress")
        self.head = self.event("response.created", response=head) + self.event("response.in_progress", response=head)

    def close_message(self) -> str:
        item, self.open = self.open, None
        if item is None:
            return ""
        at, part = len(self.output) - 1, item["content"][0]
        item["status"] = "completed"
        ids = {"item_id": item["id"], "output_index": at, "content_index": 0}
        return (
            self.event("response.output_text.done", **ids, text=part["text"], logprobs=[])
            + self.event("response.content_part.done", **ids, part=part)
            + self.event("response.output_item.done", output_index=at, item=item)
        )

    def add_item(self, item: dict) -> str:
        out = self.close_message()
        self.output.append(item)
        return out + self.event(
            "response.output_item.added",
            output_index=len(self.output) - 1,
            item=dict(item, **({"content": []} if item["type"] == "message" else {})),
        )

    def pieces(self, pieces: list[Piece], final: bool = False) -> str:
        out = ""
        for piece in pieces:
            if piece.kind != "reasoning":
                out += self.think()
            if piece.kind == "content":
                if self.open is None:
                    item = {
                        "type": "message",
                        "id": f"msg_{uuid.uuid4().hex}",
                        "status": "in_progress",
                        "role": "assistant",
                        "content": [],
                    }
                    out += self.add_item(item)
                    self.open = item
                    part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
                    item["content"].append(part)
                    ids = {"item_id": item["id"], "output_index": len(self.output) - 1, "content_index": 0}
                    out += self.event("response.content_part.added", **ids, part=dict(part))
                self.open["content"][0]["text"] += piece.text
                ids = {"item_id": self.open["id"], "output_index": len(self.output) - 1, "content_index": 0}
                out += self.event("response.output_text.delta", **ids, delta=piece.text, logprobs=[])
            elif piece.kind == "reasoning":  # given out as one item once the thought ends
                self.thought += piece.text
                continue
            else:  # a call: its item, then its text (a function's arguments, a custom tool's input)
                call = piece.call
                kind, prefix, field, stem = CALL_ITEMS[call.custom]
                text = call.input if call.custom else call.arguments
                item = {
                    "type": kind,
                    "id": f"{prefix}_{uuid.uuid4().hex}",
                    "call_id": call_id(),
                    "name": call.name,
                    field: "",
                    "status": "in_progress",
                }
                out += self.add_item(item)
                at = len(self.output) - 1
                item.update({field: text, "status": "completed"})
                ids = {"item_id": item["id"], "output_index": at}
                named = {} if call.custom else {"name": call.name}  # only a function's .done names it
                out += self.event(f"{stem}.delta", **ids, delta=text)
                out += self.event(f"{stem}.done", **ids, **named, **{field: text})
                out += self.event("response.output_item.done", output_index=at, item=item)
        return out + (self.think() if final else "")

    def think(self) -> str:
        """The reasoning so far as its output item (a reasoning model's <think> text)."""
        if not self.thought:
            return ""
        content = [{"type": "reasoning_text", "text": self.thought}]
        item = {"type": "reasoning", "id": f"rs_{uuid.uuid4().hex}", "summary": [], "content": content}
        self.thought = ""
        added = self.add_item(item)
        return added + self.event("response.output_item.done", output_index=len(self.output) - 1, item=item)

    def chunk(self, index: int, event: Event) -> str:
        if isinstance(event, StepLogprobs):
            return ""
        if isinstance(event, str):
            return self.pieces(self.parser.feed(event))
        if event.finish_reason == "error" or event.finish_reason not in ("stop", "length"):
            error = {
                "code": "invalid_prompt" if grammar_failed(event) else "server_error",
                "message": event.error or event.finish_reason,
            }
            return self.close_message() + self.event("response.failed", response=self.snapshot("failed", error=error))
        out = self.pieces(self.parser.finish(), final=True) + self.close_message()
        final = self.final(event)
        self.keep(final)  # before the event goes: the client's next request may continue it
        return out + self.event(f"response.{final['status']}", response=final)

    def keep(self, final: dict) -> None:
        """A finished answer into the store (`store`), with the conversation it ends."""
        if self.params["store"]:
            items = (
                self.params["input"]
                if isinstance(self.params["input"], list)
                else [{"role": "user", "content": self.params["input"]}]
            )
            self.ctx.store.put(self.ctx.namespace, final, [*items, *final["output"]])

    def final(self, summary: Summary) -> dict:
        incomplete = summary.finish_reason == "length"
        return self.snapshot(
            "incomplete" if incomplete else "completed",
            incomplete_details={"reason": "max_output_tokens"} if incomplete else None,
            usage={
                "input_tokens": summary.prompt_tokens,
                "input_tokens_details": {"cached_tokens": summary.cached_tokens},
                "output_tokens": summary.tokens_used,
                "output_tokens_details": {"reasoning_tokens": summary.reasoning_tokens},
                "total_tokens": summary.prompt_tokens + summary.tokens_used,
            },
        )

    def body(self) -> dict:
        (choice,) = self.choices
        self.pieces(self.parser.feed("".join(choice.text)) + self.parser.finish(), final=True)
        self.close_message()
        final = self.final(choice.summary)
        self.keep(final)
        return final


def translate(params: dict, ctx: Context) -> ChatCall:
    """The request as the shared chat form: a continued conversation (`previous_response_id`,
    its items first, not its instructions), then `instructions` and `input`, tools, text.format."""
    if params["previous_response_id"] is not None:
        before = stored(ctx.store, ctx.namespace, params["previous_response_id"], "previous_response_id")
        given = params["input"] if isinstance(params["input"], list) else [{"role": "user", "content": params["input"]}]
        params = {**params, "input": [*before.items, *given]}
    use = responses_tools(ctx, params)
    messages = responses_chat(params)
    output, output_field = responses_format(params, use)
    effort = (params["reasoning"] or {}).get("effort")
    return ChatCall(
        params,
        messages,
        use,
        sampling={**params, "ignore_eos": False},  # the chat route's sampling fields
        max_tokens=params["max_output_tokens"],
        reasoning=Reasoning(params["chat_template_kwargs"], None, effort, params["thinking_token_budget"]),
        output=output,
        output_field=output_field,
        prompt_field="input",
    )


SCHEMA, check, Answer = RESPONSES_SCHEMA, None, ResponsesWire
