"""Anthropic's Messages API (/v1/messages, /v1/messages/count_tokens): its request as the shared
chat form, its answer shapes (a `message`, or its SSE event sequence), its error shape. A key comes
as `x-api-key` or as `Authorization: Bearer`. Tools as on the chat route (`tool_use` blocks out);
what agents send (system turns anywhere, thinking, output_config) is taken; images, documents or an
assistant message last (a prefill) are a 400 naming the field. docs/api.md, "Anthropic"."""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import os
import re
import uuid
from typing import Any

from backends.chat.plan import ChatPlan, GrammarSpec, ToolUse
from backends.chat.tools import Piece, ToolCallParser
from backends.contract import StepLogprobs
from backends.wire.base import Context, Wire, grammar_failed
from backends.wire.chat import MAX_TOOLS, ChatCall, Reasoning, chat_messages, chat_tools, pick, tools_or_format
from backends.wire.errors import ANTHROPIC_ERROR_TYPES, ApiError
from backends.wire.native import CACHE_SALT, MAX_STOP, SAMPLING_PROPERTIES
from backends.wire.openai import _ignored
from backends.wire.schema import tolerant
from backends.workers.engine import Event, Summary, Ticket

TEXT_BLOCK = {
    "type": "object",
    "required": ["type", "text"],
    "x-check-first": "type",
    "properties": {
        "type": {"enum": ["text"], "x-unsupported": True},
        "text": {"type": "string"},
        "cache_control": _ignored("object"),
        "citations": {"type": ["array", "null"], "description": "accepted and ignored"},
    },
}


# What a tool returned (`tool_result.content`): text, and whatever else an agent's tools give back
# (images, documents, Claude Code's `tool_reference` from its tool search). The model reads text:
# each other block becomes a line saying what it was (`result_text`).
RESULT_BLOCK = {
    "type": "object",
    "required": ["type"],
    "properties": {
        "type": {"type": "string", "description": "text; any other type is named in the text instead"},
        "text": {"type": "string"},
        "tool_name": {"type": "string", "description": "tool_reference: the tool a tool search found (now rendered)"},
    },
}


# A message's blocks: text, and the tool calls (`tool_use`) and results (`tool_result`) of a
# conversation with tools. Each type's own required fields are checked in `anthropic_chat`.
CONTENT_BLOCK = {
    "type": "object",
    "required": ["type"],
    "x-check-first": "type",
    "properties": {
        "type": {"enum": ["text", "tool_use", "tool_result", "thinking", "redacted_thinking"], "x-unsupported": True},
        "text": {"type": "string"},
        # An earlier turn's thought, sent back: taken, not rendered (Anthropic's models drop it too).
        "thinking": {"type": "string"},
        "signature": {"type": "string", "description": "thinking: not checked (this server's, or another's)"},
        "data": {"type": "string", "description": "redacted_thinking"},
        "id": {"type": "string", "description": "tool_use: the call's id"},
        "name": {"type": "string", "description": "tool_use: the tool called"},
        "input": {"type": "object", "description": "tool_use: the call's arguments"},
        "tool_use_id": {"type": "string", "description": "tool_result: the call it answers"},
        "content": {
            "anyOf": [{"type": "string"}, {"type": "array", "items": RESULT_BLOCK}],
            "description": "tool_result: what the tool returned",
        },
        "is_error": {"type": "boolean", "description": "tool_result: the tool failed (said in its text)"},
        "cache_control": _ignored("object"),
        "citations": {"type": ["array", "null"], "description": "accepted and ignored"},
    },
}


ANTHROPIC_CONTENT = {"anyOf": [{"type": "string"}, {"type": "array", "items": CONTENT_BLOCK}]}


ANTHROPIC_TOOL = {
    "type": "object",
    "required": ["name"],
    "properties": {
        "name": {"type": "string", "minLength": 1, "maxLength": 64},
        "description": {"type": "string"},
        "input_schema": {"type": "object", "description": "a JSON Schema of the input"},
        # Absent or "custom": the client's tool. Anthropic's server tools (web_search_20250305, ...)
        # are skipped and logged: nothing here runs them (`anthropic_tools`).
        "type": {"type": "string"},
        "cache_control": _ignored("object"),
        "strict": {"type": "boolean", "description": "accepted: a call always follows its schema"},
        "defer_loading": {
            "type": "boolean",
            "description": "rendered only once a tool_result's tool_reference names it (an agent's tool search)",
        },
    },
}


ANTHROPIC_TOOL_CHOICE = {
    "type": "object",
    "required": ["type"],
    "x-check-first": "type",
    "properties": {
        "type": {"enum": ["auto", "any", "tool", "none"]},
        "name": {"type": "string"},
        "disable_parallel_tool_use": {"type": "boolean"},
    },
}


ANTHROPIC_INPUT = {
    "model": {"type": "string"},
    "messages": {
        "type": "array",
        "minItems": 1,
        "items": {
            "type": "object",
            "required": ["role", "content"],
            # A system turn mid-conversation (Claude Code's): rendered where the template allows.
            "properties": {"role": {"enum": ["user", "assistant", "system"]}, "content": ANTHROPIC_CONTENT},
        },
    },
    "system": {"anyOf": [{"type": "string"}, {"type": "array", "items": TEXT_BLOCK}]},
    "tools": {"type": "array", "maxItems": MAX_TOOLS, "items": ANTHROPIC_TOOL},
    "tool_choice": ANTHROPIC_TOOL_CHOICE,
    # Extended thinking: a reasoning model thinks within budget_tokens (enabled), or as output_config's
    # effort says (adaptive); a model that does not reason answers as without it.
    "thinking": {
        "type": "object",
        "required": ["type"],
        "x-check-first": "type",
        "properties": {
            "type": {"enum": ["enabled", "disabled", "adaptive"]},
            "budget_tokens": {"type": "integer", "minimum": 0},
        },
    },
}


MESSAGES_SCHEMA: dict[str, Any] = tolerant(
    {
        "type": "object",
        "required": ["model", "max_tokens", "messages"],
        "properties": {
            **ANTHROPIC_INPUT,
            "max_tokens": {"type": "integer", "minimum": 1},
            "stop_sequences": {"type": "array", "maxItems": MAX_STOP, "items": {"type": "string", "minLength": 1}},
            "temperature": {"type": "number", "minimum": 0, "maximum": 1, "default": 1.0},
            "top_p": {"type": "number", "exclusiveMinimum": 0, "maximum": 1, "default": 1.0},
            "top_k": {"type": "integer", "minimum": 0, "default": 0},
            "stream": {"type": "boolean", "default": False},
            "metadata": _ignored("object"),
            "service_tier": _ignored("string"),
            "cache_control": _ignored("object"),  # the prompt cache here is automatic
            "inference_geo": _ignored("string"),
            "user_profile_id": _ignored("string"),
            "workspace_id": _ignored("string"),
            "output_config": {
                "type": "object",
                "properties": {
                    "effort": {"type": "string", "description": "a reasoning model's thinking budget (EFFORT_BUDGETS)"},
                    # Structured output, as response_format's json_schema (Claude Code's title request).
                    "format": {
                        "type": "object",
                        "required": ["type"],
                        "x-check-first": "type",
                        "properties": {"type": {"enum": ["json_schema"]}, "schema": {"type": "object"}},
                    },
                },
            },
            "cache_salt": CACHE_SALT,
        },
    }
)


COUNT_TOKENS_SCHEMA: dict[str, Any] = tolerant(
    {"type": "object", "required": ["model", "messages"], "properties": ANTHROPIC_INPUT}
)


def anthropic_error(request_id: str | None, status: int, message: str) -> dict:
    kind = ANTHROPIC_ERROR_TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")
    return {"type": "error", "error": {"type": kind, "message": message}, "request_id": request_id}


def anthropic_text(content: str | list[dict]) -> str:
    return content if isinstance(content, str) else "".join(block.get("text", "") for block in content)


def result_text(content: str | list[dict]) -> str:
    """A tool_result's content as the text a text-only model reads: text blocks as they are, a
    `tool_reference` as the tool it loaded, any other block (an image, a document) as a line
    saying what was left out."""
    if isinstance(content, str):
        return content
    parts = []
    for block in content:
        kind = block["type"]
        if kind == "text":
            parts.append(block.get("text", ""))
        elif kind == "tool_reference":
            parts.append(f"[tool loaded: {block.get('tool_name', '')}]")
        else:
            parts.append(f"[{kind} omitted: this model reads text only]")
    return "\n".join(part for part in parts if part)


def referenced_tools(params: dict) -> set[str]:
    """The tools a conversation's tool results named (`tool_reference`): a tool search found them."""
    names = set()
    for message in params["messages"]:
        for block in message["content"] if isinstance(message["content"], list) else ():
            if block["type"] == "tool_result" and isinstance(block.get("content"), list):
                names.update(b.get("tool_name") for b in block["content"] if b["type"] == "tool_reference")
    return names


# Claude Code's first system block: `x-anthropic-billing-header: cc_version=2.1.197.1c0;
# cc_entrypoint=sdk-cli;`, whose version's last part (`.1c0`, `.e84`) differs between sessions. At the
# prompt's start it left no two sessions a shared prefix to cache: that part is dropped, so sessions of
# one Claude Code version send the same text (the model reads the same header, less three characters).
BILLING_HEADER = re.compile(r"(x-anthropic-billing-header:[^\n]*?cc_version=\d+\.\d+\.\d+)\.[0-9A-Za-z]+;")


def normalized_billing_header(system: str | list[dict] | None, facts: dict) -> str | list[dict] | None:
    """`system` with Claude Code's billing header made the same for every session (the request
    log says it was)."""

    def same(text: str) -> str:
        fixed, changed = BILLING_HEADER.subn(r"\1;", text, count=1)
        if changed:
            facts["normalized"] = ["system billing header"]
        return fixed

    if isinstance(system, list):
        return [{**b, "text": same(b["text"])} if "text" in b else b for b in system]
    return same(system) if isinstance(system, str) else system


def anthropic_chat(params: dict) -> list[dict]:
    """The request as OpenAI-shaped chat messages (what `chat_messages` checks and a
    `ChatRequest` holds): an assistant's `tool_use` blocks as its tool_calls, a user's
    `tool_result` blocks as tool messages before the rest of its text."""
    messages = [{"role": "system", "content": anthropic_text(params["system"])}] if params["system"] else []
    for i, m in enumerate(params["messages"]):
        blocks = [{"type": "text", "text": m["content"]}] if isinstance(m["content"], str) else m["content"]
        for j, block in enumerate(blocks):
            where = f"messages[{i}].content[{j}]"
            needs = {"text": ("text",), "tool_use": ("id", "name", "input"), "tool_result": ("tool_use_id",)}
            for key in needs.get(block["type"], ()):
                if key not in block:
                    raise ApiError(400, f"{where}.{key} is required", field=f"{where}.{key}")
            calling = block["type"] in ("tool_use", "tool_result")
            if calling and (block["type"] == "tool_use") != (m["role"] == "assistant"):
                raise ApiError(400, f"{where}: a {block['type']} block is not for the {m['role']}", field=where)
        text = "".join(b["text"] for b in blocks if b["type"] == "text")
        results = [b for b in blocks if b["type"] == "tool_result"]
        messages += [
            {"role": "tool", "tool_call_id": b["tool_use_id"], "content": result_text(b.get("content") or "")}
            for b in results
        ]
        calls = [
            {"id": b["id"], "function": {"name": b["name"], "arguments": json.dumps(b["input"])}}
            for b in blocks
            if b["type"] == "tool_use"
        ]
        if calls:
            messages.append({"role": "assistant", "content": text, "tool_calls": calls})
        elif text or not results:
            messages.append({"role": m["role"], "content": text})
    if params["messages"][-1]["role"] == "assistant":
        field = f"messages[{len(params['messages']) - 1}]"
        raise ApiError(400, f"{field}: a final assistant message (a prefill) is not supported", field=field)
    return chat_messages({"messages": messages})


def anthropic_tools(ctx: Context, params: dict) -> ToolUse | None:
    """Anthropic's tools and tool_choice as the chat route's (auto, any: required, tool: named,
    none: no tools at all); its server tools skipped, their types in the request log."""
    choice = params["tool_choice"] or {"type": "auto"}
    tools, skipped = [], []
    found = referenced_tools(params)
    for i, t in enumerate(params["tools"] or []):
        if t.get("defer_loading") and t["name"] not in found:
            continue  # not rendered until a tool search names it
        if t.get("type", "custom") != "custom":
            skipped.append(t["type"])
        elif "input_schema" not in t:
            raise ApiError(400, f"tools[{i}].input_schema is required", field=f"tools[{i}].input_schema")
        else:
            tools.append({"function": {"name": t["name"], **pick(t, "description"), "parameters": t["input_schema"]}})
    ctx.note_skipped(skipped)
    mapped = {"auto": "auto", "any": "required", "none": "none", "tool": {"function": {"name": choice.get("name")}}}
    if choice["type"] == "tool" and choice.get("name") is None:
        raise ApiError(400, "tool_choice.name is required with type tool", field="tool_choice.name")
    return chat_tools(
        {
            "tools": tools or None,
            "functions": None,
            "tool_choice": mapped[choice["type"]] if tools or choice["type"] != "auto" else None,
            "function_call": None,
            "parallel_tool_calls": not choice.get("disable_parallel_tool_use", False),
        },
        flat=True,
    )


def anthropic_stop_reason(summary: Summary, stop_sequences: tuple[str, ...]) -> str:
    if summary.finish_reason == "length":
        return "max_tokens"
    if summary.stop_sequence is not None and summary.stop_sequence in stop_sequences:
        return "stop_sequence"
    return "end_turn"  # end-of-text, or the chat format's own end of turn


def anthropic_usage(summary: Summary) -> dict:
    """Anthropic's counts: `input_tokens` are the prompt tokens computed, the cached ones apart."""
    return {
        "input_tokens": summary.prompt_tokens - summary.cached_tokens,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": summary.cached_tokens,
        "output_tokens": summary.tokens_used,
    }


def sse_event(kind: str, payload: dict) -> str:
    return f"event: {kind}\ndata: {json.dumps({'type': kind, **payload}, ensure_ascii=False)}\n\n"


class AnthropicWire(Wire):
    """A `message` body; streamed, message_start, then each block's start, deltas and stop (a
    text block at once without tools; with tools, blocks as the reply's text and calls come:
    `tool_use` with its input as one `input_json_delta`), then message_delta (stop reason,
    usage) and message_stop; a failure is an `error` event. A reasoning model's thought is a
    `thinking` block (its text, then its signature) where the request asked for thinking, else
    left out."""

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
        self.stop_sequences = call.stop
        self.message = {"id": f"msg_{uuid.uuid4().hex}", "type": "message", "role": "assistant", "model": name}
        self.tools = plan.tool_names is not None
        self.thinks = (params.get("thinking") or {}).get("type") in ("enabled", "adaptive")
        self.thought = ""  # the open thinking block's text, for its signature
        self.parser = lambda: ctx.parser(plan)
        self.stream_parser = self.parser()
        self.blocks = 0  # blocks started
        self.open: str | None = None  # the type of the block open now
        # Made now, before any event: the answer loop asks for the opening with the first events.
        prompt_tokens = len(self.tickets[0].request.prompt_ids)
        usage = {"input_tokens": prompt_tokens, "output_tokens": 0}
        start = {**self.message, "content": [], "stop_reason": None, "stop_sequence": None, "usage": usage}
        self.thought_first = self.thinks and plan.reasoning
        later = self.tools or self.thought_first  # the first block is the reply's own
        self.head = sse_event("message_start", {"message": start}) + ("" if later else self.start_block("text"))

    def opening(self) -> str:
        return self.head

    def keepalive(self) -> str:
        """While a prompt prefills: an empty delta of the reply's first block (opened now if none is:
        text, or the thought a reasoning reply starts with). Claude Code's idle watchdog (300 s)
        counts message events only, not Anthropic's `ping`s, and cancelled long prefills."""
        out = "" if self.open else self.start_block("thinking" if self.thought_first else "text")
        delta = (
            {"type": "thinking_delta", "thinking": ""}
            if self.open == "thinking"
            else {"type": "text_delta", "text": ""}
        )
        return out + sse_event("content_block_delta", {"index": self.blocks - 1, "delta": delta})

    def start_block(self, kind: str, **fields) -> str:
        out = self.stop_block()
        block = {"type": kind, **fields, "input": {}} if kind == "tool_use" else {"type": kind, kind: ""}
        out += sse_event("content_block_start", {"index": self.blocks, "content_block": block})
        if self.blocks == 0:
            out += sse_event("ping", {})
        self.blocks, self.open = self.blocks + 1, kind
        return out

    def stop_block(self) -> str:
        if self.open is None:
            return ""
        out = ""
        if self.open == "thinking":  # its signature last, as Anthropic sends it
            delta = {"type": "signature_delta", "signature": thought_signature(self.thought)}
            out, self.thought = sse_event("content_block_delta", {"index": self.blocks - 1, "delta": delta}), ""
        self.open = None
        return out + sse_event("content_block_stop", {"index": self.blocks - 1})

    def pieces(self, pieces: list[Piece]) -> str:
        out = ""
        for piece in pieces:
            if piece.kind == "call":
                out += self.start_block("tool_use", id=tool_use_id(), name=piece.call.name)
                delta = {"type": "input_json_delta", "partial_json": piece.call.arguments}
                out += sse_event("content_block_delta", {"index": self.blocks - 1, "delta": delta})
                out += self.stop_block()
            elif piece.kind == "reasoning" and piece.text and self.thinks:
                if self.open != "thinking":
                    out += self.start_block("thinking")
                self.thought += piece.text
                delta = {"type": "thinking_delta", "thinking": piece.text}
                out += sse_event("content_block_delta", {"index": self.blocks - 1, "delta": delta})
            elif piece.kind == "content" and piece.text:
                if self.open != "text":
                    out += self.start_block("text")
                delta = {"type": "text_delta", "text": piece.text}
                out += sse_event("content_block_delta", {"index": self.blocks - 1, "delta": delta})
        return out

    def chunk(self, index: int, item: Event) -> str:
        if isinstance(item, StepLogprobs):
            return ""
        if isinstance(item, str):
            return self.pieces(self.stream_parser.feed(item))
        if item.finish_reason in ("error", "timeout"):
            status = 400 if grammar_failed(item) else 504 if item.finish_reason == "timeout" else 500
            return sse_event(
                "error",
                {"error": anthropic_error(self.ctx.request_id, status, item.error or item.finish_reason)["error"]},
            )
        out = self.pieces(self.stream_parser.finish())
        if self.blocks == 0:  # an empty reply: one empty text block, as without tools
            out += self.start_block("text")
        delta = self.stop_fields(item, self.stream_parser)
        return (
            out
            + self.stop_block()
            + sse_event("message_delta", {"delta": delta, "usage": anthropic_usage(item)})
            + sse_event("message_stop", {})
        )

    def stop_fields(self, summary: Summary, parser: ToolCallParser) -> dict:
        reason = anthropic_stop_reason(summary, self.stop_sequences)
        if parser.calls and summary.finish_reason == "stop":
            reason = "tool_use"
        return {"stop_reason": reason, "stop_sequence": summary.stop_sequence if reason == "stop_sequence" else None}

    def body(self) -> dict:
        (choice,) = self.choices
        parser = self.parser()
        content = []
        for piece in parser.feed("".join(choice.text)) + parser.finish():
            if piece.kind == "call":
                arguments = json.loads(piece.call.arguments)
                content.append({"type": "tool_use", "id": tool_use_id(), "name": piece.call.name, "input": arguments})
            elif piece.kind == "reasoning":
                if not self.thinks or not piece.text:
                    continue
                if not content or content[-1]["type"] != "thinking":
                    content.append({"type": "thinking", "thinking": "", "signature": ""})
                content[-1]["thinking"] += piece.text
            elif content and content[-1]["type"] == "text":
                content[-1]["text"] += piece.text
            else:
                content.append({"type": "text", "text": piece.text})
        for block in content:
            if block["type"] == "thinking":
                block["signature"] = thought_signature(block["thinking"])
        return {
            **self.message,
            "content": content or [{"type": "text", "text": ""}],
            **self.stop_fields(choice.summary, parser),
            "usage": anthropic_usage(choice.summary),
        }


def tool_use_id() -> str:
    return f"toolu_{uuid.uuid4().hex[:24]}"


SIGNATURE_KEY = os.urandom(32)  # this process's: a thought's signature is not checked when it comes back


def thought_signature(text: str) -> str:
    """A thinking block's signature: this server's HMAC of its text (clients send it back as
    they got it; nothing here depends on it)."""
    return base64.b64encode(hmac.new(SIGNATURE_KEY, text.encode(), hashlib.sha256).digest()).decode()


def translate(params: dict, ctx: Context) -> ChatCall:
    """The request as the shared chat form (what /v1/messages generates from and count_tokens
    counts): tools, output_config's format and effort, thinking, the messages."""
    params = {**params, "system": normalized_billing_header(params["system"], ctx.facts)}
    use = anthropic_tools(ctx, params)
    format = (params.get("output_config") or {}).get("format")
    tools_or_format(use, format and "json_schema", "output_config.format")
    schema = format and GrammarSpec("json_schema", json.dumps(format.get("schema", {"type": "object"})))
    thinking = params.get("thinking") or {}
    reasoning = Reasoning(
        None,
        None if not thinking else thinking["type"] != "disabled",
        effort=(params.get("output_config") or {}).get("effort"),
        budget=thinking.get("budget_tokens") if thinking.get("type") == "enabled" else None,
    )
    messages = anthropic_chat(params)
    defaults = {key: schema["default"] for key, schema in SAMPLING_PROPERTIES.items()}
    sampling = {
        **defaults,
        "top_k": params.get("top_k"),
        "temperature": params.get("temperature"),
        "top_p": params.get("top_p"),
        "seed": None,
        "ignore_eos": False,
    }
    return ChatCall(
        params,
        messages,
        use,
        sampling=sampling,
        max_tokens=params.get("max_tokens"),
        reasoning=reasoning,
        output=schema or None,
        output_field="output_config.format.schema",
        stop=tuple(params.get("stop_sequences") or ()),
    )


SCHEMA, check, Answer = MESSAGES_SCHEMA, None, AnthropicWire
