"""The chat APIs' shared form. Chat completions, Responses and Messages each translate their
request onto one `ChatCall` (messages as `chat_messages` checks them, tools as `chat_tools` does);
phi2_server.py's one chat path asks the backend for its `ChatPlan` (backends/chat/plan.py: prompt,
stops, grammar, kept tags, a parser per choice) and answers through the API's Wire. Also the
message and tool schemas they share, and how a reply's calls and reasoning are named."""

from __future__ import annotations

import dataclasses
import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

from backends.chat.plan import GrammarSpec, ToolUse
from backends.chat.tools import ToolCall, ToolCallParser
from backends.wire.errors import ApiError
from backends.wire.openai import _ignored, _unsupported
from backends.wire.schema import MAX_JSON_DEPTH, too_deep
from backends.workers.engine import Summary

CONTENT_PART = {
    "type": "object",
    "required": ["type", "text"],
    "properties": {"type": {"enum": ["text"], "x-unsupported": True}, "text": {"type": "string"}},
    "x-check-first": "type",
}


FUNCTION_CALL = {
    "type": "object",
    "required": ["name"],
    "properties": {
        "name": {"type": "string"},
        "arguments": {"type": "string", "description": "a JSON object, as text"},
    },
}


CUSTOM_CALL = {  # a custom tool's call: its input as text
    "type": "object",
    "required": ["name", "input"],
    "properties": {"name": {"type": "string"}, "input": {"type": "string"}},
}


TOOL_CALL = {  # a function's call, or a custom tool's (type "custom")
    "type": "object",
    "properties": {
        "id": {"type": "string"},
        "type": {"enum": ["function", "custom"]},
        "function": FUNCTION_CALL,
        "custom": CUSTOM_CALL,
    },
}


MESSAGE = {
    "type": "object",
    "required": ["role"],
    "properties": {
        "role": {"enum": ["system", "developer", "user", "assistant", "tool", "function"]},
        "content": {"anyOf": [{"type": "string"}, {"type": "array", "items": CONTENT_PART}]},
        "name": {"type": "string"},
        "tool_calls": {"type": "array", "items": TOOL_CALL},
        "tool_call_id": {"type": "string", "description": "a tool message: the call it answers"},
        "function_call": FUNCTION_CALL,  # the deprecated single call of an assistant message
        # What a reasoning server returns: clients send it back as it is (it is not rendered).
        "reasoning_content": _ignored("string"),
        # What OpenAI puts in the assistant messages it returns: clients send them back as they are.
        "refusal": _ignored("string"),
        "annotations": {"type": "array", "items": {}, "description": "accepted and ignored"},
        "audio": _unsupported(),
    },
}


FUNCTION = {
    "type": "object",
    "required": ["name"],
    "properties": {
        "name": {"type": "string", "minLength": 1, "maxLength": 64},
        "description": {"type": "string"},
        "parameters": {"type": "object", "description": "a JSON Schema of the arguments; absent: any object"},
        "strict": {"type": "boolean", "description": "accepted: a call always follows its schema"},
    },
}


# OpenAI's custom tool: its input is text, free or in a grammar of the client's (Lark or a
# regex), which constrains it as a schema does a function's arguments (backends.chat.tools). Chat
# nests the grammar (`format.grammar.syntax`), Responses does not (`format.syntax`).
GRAMMAR = {
    "type": "object",
    "properties": {"syntax": {"enum": ["lark", "regex"]}, "definition": {"type": "string", "minLength": 1}},
}


CUSTOM_FORMAT = {
    "type": "object",
    "required": ["type"],
    "x-check-first": "type",
    "properties": {"type": {"enum": ["text", "grammar"]}, "grammar": GRAMMAR, **GRAMMAR["properties"]},
}


CUSTOM_TOOL = {
    "type": "object",
    "required": ["name"],
    "properties": {
        "name": FUNCTION["properties"]["name"],
        "description": {"type": "string"},
        "format": CUSTOM_FORMAT,
    },
}


TOOL = {
    "type": "object",
    "required": ["type"],
    "properties": {
        "type": {"enum": ["function", "custom"], "x-unsupported": True},
        "function": FUNCTION,
        "custom": CUSTOM_TOOL,
    },
    "x-check-first": "type",
}


NAME_ONLY = {"type": "object", "required": ["name"], "properties": {"name": {"type": "string"}}}


NAMED_TOOL = {
    "type": "object",
    "required": ["type"],
    "properties": {"type": {"enum": ["function", "custom"]}, "function": NAME_ONLY, "custom": NAME_ONLY},
}


MAX_TOOLS = 128  # OpenAI's limit


# A reasoning model's switches (backends.chat.plan.ChatRequest): vLLM's chat_template_kwargs and
# thinking_token_budget, and OpenAI's reasoning_effort ("none": no thinking; a degree: a budget).
REASONING_CONTROLS = {
    "chat_template_kwargs": {"type": "object", "description": "what the chat template reads besides the messages"},
    "reasoning_effort": {"type": "string", "description": '"none" asks a reasoning model not to think'},
    "thinking_token_budget": {"type": "integer", "minimum": -1, "description": "tokens of reasoning (-1: no limit)"},
}


# An effort's thinking budget in tokens (None: no limit; "none": no thinking at all), for OpenAI's
# reasoning_effort and reasoning.effort and Anthropic's output_config.effort. An effort not named
# here sets no budget. Chosen for the small local models this server runs (an 8k context):
# docs/api.md, "Reasoning".
EFFORT_BUDGETS = {"minimal": 256, "low": 1024, "medium": 4096, "high": None, "xhigh": None, "max": None}


CHAT_DEFAULT_MAX_TOKENS = 512  # OpenAI has no default cap; a local server wants one


TOOL_NAME = re.compile(r"[A-Za-z0-9_.:-]{1,64}")


def chat_messages(params: dict) -> list[dict]:
    """The request's messages as a `ChatRequest` holds them: content as text; an
    assistant's `tool_calls` (or deprecated `function_call`) with arguments that parse to an
    object; a `tool` result answering a call made before it. What does not hold is a 400 naming
    the field."""
    messages, calls = [], set()
    for i, m in enumerate(params["messages"]):
        content = m.get("content")
        role = m["role"]
        if content is None:
            if role != "assistant":  # an assistant turn that only called tools has none
                raise ApiError(400, f"messages[{i}].content is required", field=f"messages[{i}].content")
            content = ""
        message: dict[str, Any] = {
            "role": "tool" if role == "function" else role,
            "content": content if isinstance(content, str) else "".join(p["text"] for p in content),
        }
        tool_calls = m.get("tool_calls") or ([{"function": m["function_call"]}] if m.get("function_call") else [])
        if tool_calls and role != "assistant":
            raise ApiError(
                400, f"messages[{i}].tool_calls is for assistant messages", field=f"messages[{i}].tool_calls"
            )
        if tool_calls:
            message["tool_calls"] = []
            for j, call in enumerate(tool_calls):
                call = history_call(call, f"messages[{i}].tool_calls[{j}]")
                where = f"messages[{i}].tool_calls[{j}].function.arguments"
                try:
                    arguments = json.loads(call["function"].get("arguments") or "{}")
                except json.JSONDecodeError as exc:
                    raise ApiError(400, f"{where} is not JSON: {exc}", field=where) from None
                except RecursionError:  # text nested past the JSON depth any body may have
                    raise ApiError(400, f"{where} is nested too deeply", field=where) from None
                if not isinstance(arguments, dict):
                    raise ApiError(400, f"{where} must be a JSON object", field=where)
                if too_deep(arguments):  # the body's own bound, for the JSON inside its text
                    raise ApiError(400, f"{where} is nested past {MAX_JSON_DEPTH} levels", field=where)
                call_id = call.get("id") or f"call_{i}_{j}"
                calls.add(call_id)
                message["tool_calls"].append(
                    {
                        "id": call_id,
                        "type": "function",
                        "function": {**call["function"], "arguments": json.dumps(arguments)},
                    }
                )
        if role in ("tool", "function"):
            call_id = m.get("tool_call_id")
            if role == "tool" and call_id is None:
                raise ApiError(400, f"messages[{i}].tool_call_id is required", field=f"messages[{i}].tool_call_id")
            if call_id is not None and call_id not in calls:
                raise ApiError(
                    400,
                    f"messages[{i}].tool_call_id {call_id!r} answers no tool call made before it",
                    field=f"messages[{i}].tool_call_id",
                )
            message.update({k: v for k, v in (("tool_call_id", call_id), ("name", m.get("name"))) if v is not None})
        messages.append(message)
    return messages


def history_call(call: dict, where: str) -> dict:
    """A call in the history as a function's: a custom tool's input as the one string argument
    the prompt shows it taking (backends.chat.tools.as_function)."""
    if call.get("type") == "custom" or ("custom" in call and "function" not in call):
        if "custom" not in call:
            raise ApiError(400, f"{where}.custom is required", field=f"{where}.custom")
        arguments = json.dumps({"input": call["custom"]["input"]}, ensure_ascii=False)
        return {**pick(call, "id"), "function": {"name": call["custom"]["name"], "arguments": arguments}}
    if "function" not in call:
        raise ApiError(400, f"{where}.function is required", field=f"{where}.function")
    return call


def custom_tool(tool: dict, where: str, flat: bool) -> dict:
    """A custom tool as ToolUse holds it: {name, description, custom: {syntax, definition}}
    (syntax "text": free text). `flat`: the grammar's fields in `format` (Responses), else in
    `format.grammar` (chat)."""
    form = tool.get("format") or {"type": "text"}
    spec = {"syntax": "text"}
    if form["type"] == "grammar":
        grammar, at = (form, f"{where}.format") if flat else (form.get("grammar"), f"{where}.format.grammar")
        if grammar is None:
            raise ApiError(400, f"{at} is required", field=at)
        for key in ("syntax", "definition"):
            if key not in grammar:
                raise ApiError(400, f"{at}.{key} is required", field=f"{at}.{key}")
        spec = {"syntax": grammar["syntax"], "definition": grammar["definition"]}
    return {**pick(tool, "name", "description"), "custom": spec}


def chat_tools(params: dict, flat: bool = False) -> ToolUse | None:
    """`tools`/`tool_choice` (or the deprecated `functions`/`function_call`), checked. None where
    nothing may be called: no tools, or tool_choice "none" (the tools are then not rendered
    either, so the model has nothing to call; docs/api.md, "Tool calls")."""
    if params["tools"] is not None and params["functions"] is not None:
        raise ApiError(400, "give tools or functions, not both", field="functions")
    if params["tool_choice"] is not None and params["function_call"] is not None:
        raise ApiError(400, "give tool_choice or function_call, not both", field="function_call")
    given = "tools" if params["functions"] is None else "functions"
    tools = [tool_of(t, f"tools[{i}]", flat) for i, t in enumerate(params["tools"] or [])]
    tools = tools or list(params["functions"] or [])
    choice = params["tool_choice"] if params["function_call"] is None else params["function_call"]
    choice_field = "tool_choice" if params["function_call"] is None else "function_call"
    kind = None  # a named tool's kind: function or custom
    if isinstance(choice, dict):
        kind = "custom" if choice.get("type") == "custom" else "function"
        named = choice.get(kind) or choice  # chat's {"type", kind: {"name"}}, or flat {"type", "name"}
        if "name" not in named:
            raise ApiError(400, f"{choice_field}.{kind}.name is required", field=f"{choice_field}.{kind}.name")
        choice = named["name"]
    names = [t["name"] for t in tools]
    for i, name in enumerate(names):
        # OpenAI's and Anthropic's rule (and '.', ':' that MCP names use): a name is written into
        # the prompt and the call's JSON, so no tag or quote can hide in it.
        if not TOOL_NAME.fullmatch(name):
            inside = "custom" if "custom" in tools[i] else "function"
            where = f"{given}[{i}].{inside}.name" if given == "tools" and not flat else f"{given}[{i}].name"
            raise ApiError(400, f"{where} must be 1 to 64 of a-z, A-Z, 0-9, _, -, . or :", field=where)
    if len(set(names)) < len(names):
        raise ApiError(400, f"{given} names a function twice", field=given)
    kinds = {t["name"]: "custom" if "custom" in t else "function" for t in tools}
    if choice not in (None, "none", "auto", "required") and kinds.get(choice) != (kind or "function"):
        which = f"{kind or 'function'} tools" if given == "tools" else given
        raise ApiError(400, f"{choice_field} names {choice!r}, which is not one of the {which}", field=choice_field)
    if choice == "required" and not tools:
        raise ApiError(400, f'{choice_field} "required" needs {given}', field=choice_field)
    if not tools or choice == "none":
        return None
    return ToolUse(
        [t if "custom" in t else pick(t, "name", "description", "parameters") for t in tools],
        choice or "auto",
        # A named function is called once; function_call (deprecated) was always one call.
        params["parallel_tool_calls"] and choice_field == "tool_choice" and choice in (None, "auto", "required"),
    )


def tool_of(tool: dict, where: str, flat: bool) -> dict:
    """One of `tools`: a function ({"function": ...}), or a custom tool ({"custom": ...})."""
    if tool.get("type") == "custom" or ("custom" in tool and "function" not in tool):
        if "custom" not in tool:
            raise ApiError(400, f"{where}.custom is required", field=f"{where}.custom")
        return custom_tool(tool["custom"], where if flat else f"{where}.custom", flat)
    if "function" not in tool:
        raise ApiError(400, f"{where}.function is required", field=f"{where}.function")
    return tool["function"]


def first_tool_choice(use: ToolUse | None, messages: list[dict], forced: bool, facts: dict) -> ToolUse | None:
    """FIRST_TOOL_CHOICE=required: tool_choice auto made required where the model answers the
    user, that is where a user message and no tool result follow the last assistant message. A
    turn answering a tool result keeps auto, so an agent's loop can end; the log line says so."""
    if use is None or use.choice != "auto" or not forced:
        return use
    since = []
    for message in reversed(messages):
        if message["role"] == "assistant":
            break
        since.append(message["role"])
    if "user" not in since or "tool" in since:
        return use
    facts["tool_choice"] = "required"
    return dataclasses.replace(use, choice="required")


def pick(mapping: dict, *keys: str) -> dict:
    return {k: mapping[k] for k in keys if k in mapping}


@dataclass(frozen=True)
class Reasoning:
    """A request's reasoning switches: template kwargs (vLLM's chat_template_kwargs), thinking on
    or off, an effort (OpenAI's reasoning_effort, Anthropic's output_config.effort), a budget."""

    kwargs: dict | None = None
    thinking: bool | None = None
    effort: str | None = None
    budget: int | None = None


def template_options(reasoning: Reasoning, default_kwargs: dict, default_budget: int) -> dict:
    """ChatRequest's reasoning fields: template_kwargs (CHAT_TEMPLATE_KWARGS, the request's over
    them); thinking (off for effort "none"); and the thinking budget, the request's own (-1: no
    limit), else its effort's (EFFORT_BUDGETS), else THINKING_BUDGET."""
    thinking, effort, budget = reasoning.thinking, reasoning.effort, reasoning.budget
    if effort is not None and thinking is None:
        thinking = effort != "none"
    if budget is None and effort in EFFORT_BUDGETS:
        budget = -1 if EFFORT_BUDGETS[effort] is None else EFFORT_BUDGETS[effort]
    if budget is None:
        budget = default_budget
    return {
        "template_kwargs": {**default_kwargs, **(reasoning.kwargs or {})},
        "thinking": thinking,
        "thinking_budget": None if budget < 0 else budget,
    }


@dataclass(frozen=True)
class ChatCall:
    """One chat API request as phi2_server.py's one chat path serves it: what each API's
    `translate` gives. `sampling` holds openai_generations' fields (temperature, top_p, seed,
    ignore_eos and SAMPLING_PROPERTIES'); `output` is a response format's grammar, `output_field`
    the field its errors name; `choices` copies of the prompt (OpenAI's n)."""

    params: dict  # the request's parameters, as its Wire reads them (a continued one's conversation in)
    messages: list[dict]
    tools: ToolUse | None
    sampling: dict
    max_tokens: int | None
    reasoning: Reasoning = field(default_factory=Reasoning)
    output: GrammarSpec | None = None
    output_field: str | None = None
    stop: tuple[str, ...] = ()
    choices: int = 1
    logprobs: int | None = None
    prompt_field: str = "messages"


def tools_or_format(use: ToolUse | None, format_type: str | None, field: str) -> None:
    """A reply is its calls' grammar or a response format's, not both."""
    if use is not None and format_type not in (None, "text"):
        raise ApiError(400, f"{field} cannot be combined with tools here; give one or the other", field=field)


def call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def call_parts(call: ToolCall) -> tuple[str, str, str]:
    """A call's type on chat, the field of its text, and that text: a function's arguments or
    a custom tool's input."""
    return ("custom", "input", call.input) if call.custom else ("function", "arguments", call.arguments)


def chat_call(call: ToolCall) -> dict:
    kind, field, text = call_parts(call)
    return {"id": call_id(), "type": kind, kind: {"name": call.name, field: text}}


def chat_finish(summary: Summary, parser: ToolCallParser) -> str:
    """ "tool_calls" for a reply that called and then ended as it chose to; a call cut short by
    max_tokens is "length" (its part is dropped: never given out as a call)."""
    return "tool_calls" if parser.calls and summary.finish_reason == "stop" else summary.finish_reason
