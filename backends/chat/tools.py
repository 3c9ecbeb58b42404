"""Tool calling: how a model family writes its calls, how its prompts carry tools, how its
output is parsed, and the grammar that makes a call valid by construction.

One mechanism, described per family by a `ToolFormat` (the table below; docs/api.md, "Tool
calls", shows the same table). The format is read from the model's chat template, which
writes the family's own call syntax into its prompts; a template that knows no tools gets
`DEFAULT_TOOLS_BLOCK` in its system message and Hermes-style calls.

| format  | families                                  | a call                                              |
| ------- | ----------------------------------------- | --------------------------------------------------- |
| hermes  | Qwen2.5, Qwen3, Hermes, most fine-tunes;  | `<tool_call>{"name": …, "arguments": {…}}</tool_call>` |
|         | the default for a template without tools  | (one tag a call)                                    |
| llama3  | Llama-3.1, 3.2, 3.3                       | `{"name": …, "parameters": {…}}` opening the reply, |
|         |                                           | or after `<|python_tag|>`; calls joined by `; `     |
| mistral | Mistral, Mixtral, Ministral               | `[TOOL_CALLS][{"name": …, "arguments": {…}}, …]`    |
| phi4    | Phi-4-mini                                | `<|tool_call|>[{…}, …]<|/tool_call|>`               |
| gemma4  | Gemma 4                                   | `<|tool_call>call:name{key:<|"|>text<|"|>}<tool_call|>` |
|         |                                           | (its own notation: backends/chat/gemma4.py)         |

The parser (`ToolCallParser`) reads the reply's text as it streams: content outside the calls
passes through at once (only a possible start of a tag is held back), a call is given out whole
once its text is complete, and no tag ever reaches the content. `<think>…</think>` (Qwen3,
DeepSeek-R1 distills) is split off as reasoning where the tokenizer has those tokens.

The grammar (`tool_grammar`, llguidance's Lark with `%json` for each tool's parameter schema)
starts at the family's opening tag: with tool_choice `required` or a named function it is the
whole reply; with `auto` it is lazy, armed when the model opens a call (`backends.decoding.grammar`,
`LazyMatcher`), so plain text stays unconstrained and a call, once begun, always parses and
validates against its tool's schema.

OpenAI's custom tools (a tool whose input is free text, or text in a Lark or regex grammar of
the client's) are called inside the same tags, their input raw rather than JSON (as OpenAI's own
models write it): the tool's name as `{"name": …}` on a line of its own, then the input, e.g.
`<tool_call>\n{"name": "apply_patch"}\n*** Begin Patch …<|/tool_call|>`. The client's grammar
is a sub-grammar of the call grammar (llguidance's `@name`), so its rules keep their names. The
prompt shows such a tool as a function taking one string, its grammar in its description
(`as_function`).
"""

from __future__ import annotations

import json
import re
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import jsonschema
import jsonschema._keywords
import jsonschema._legacy_keywords
import jsonschema._utils
import llguidance
import regex

from backends.chat import gemma4

# The system block for a chat template that knows no tools (and for Phi-2's dialogue format):
# Hermes-style calls, the most common form, said in few tokens (a small model's context is short).
DEFAULT_TOOLS_BLOCK = """# Tools

You may call functions. Their signatures, one JSON object a line:
<tools>
{tools}
</tools>

To call one, reply with:
<tool_call>
{{"name": <function-name>, "arguments": <args-json-object>}}
</tool_call>"""


@dataclass(frozen=True)
class ToolFormat:
    """How one family writes tool calls."""

    name: str
    open: str  # the tag that opens a call (or the list of calls)
    close: str | None  # the tag that closes it; None: the calls run to the end of the reply
    listed: bool  # the payload is a JSON list of calls (one tag for all) rather than one call a tag
    arguments_key: str  # "arguments" or "parameters"
    bare: bool = False  # a call may also come untagged, as a JSON object opening the reply
    separator: str = ""  # between calls in one payload that is not a list (llama3: "; ")
    markers: tuple[str, ...] = field(default=())  # what in a chat template says it is this family's
    # Its template reads the tools from the system message's own `tools` (JSON text), not `tools=`.
    tools_in_system: bool = False
    # A format of its own notation (not JSON): the module with its `parse` and `grammar` (Gemma 4's)
    notation: object | None = None
    kept: tuple[str, ...] = ()  # special tokens inside a call that its text must keep (Gemma's <|"|>)


FORMATS = {
    "hermes": ToolFormat("hermes", "<tool_call>", "</tool_call>", False, "arguments", markers=("<tool_call>",)),
    "llama3": ToolFormat(
        "llama3", "<|python_tag|>", None, False, "parameters", bare=True, separator="; ", markers=("<|python_tag|>",)
    ),
    "mistral": ToolFormat("mistral", "[TOOL_CALLS]", None, True, "arguments", markers=("[TOOL_CALLS]",)),
    "phi4": ToolFormat(
        "phi4",
        "<|tool_call|>",
        "<|/tool_call|>",
        True,
        "arguments",
        markers=("<|tool_call|>", "<|tool|>"),
        tools_in_system=True,
    ),
    "gemma4": ToolFormat(
        "gemma4",
        gemma4.OPEN,
        gemma4.CLOSE,
        False,
        "arguments",
        markers=(gemma4.OPEN,),
        notation=gemma4,
        kept=(gemma4.QUOTE,),
    ),
}
DEFAULT_FORMAT = FORMATS["hermes"]


def detect_format(template: str | None) -> tuple[ToolFormat, bool]:
    """The family's tool format read from its chat template, and whether the template renders
    `tools` itself (else the default block is added and the calls are Hermes-style)."""
    if not template:
        return DEFAULT_FORMAT, False
    knows_tools = "tools" in template
    for format in FORMATS.values():
        if any(marker in template for marker in format.markers):
            return format, knows_tools
    return DEFAULT_FORMAT, knows_tools


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # JSON text of an object, as OpenAI sends it ("" for a custom tool's call)
    input: str | None = None  # a custom tool's input, as the model wrote it; None: a function call

    @property
    def custom(self) -> bool:
        return self.input is not None


@dataclass(frozen=True)
class Piece:
    """A part of a reply as it streams: content, reasoning, or one whole tool call."""

    kind: str  # "content", "reasoning" or "call"
    text: str = ""
    call: ToolCall | None = None


# -- prompts ------------------------------------------------------------------------------------


def tool_json(tool: dict) -> str:
    return json.dumps(tool, ensure_ascii=False)


def custom_header(name: str) -> str:
    """The line that opens a custom tool's call, before its raw input."""
    return json.dumps({"name": name}) + "\n"


def as_function(tool: dict) -> dict:
    """A tool as the prompt shows it: a function as it is; a custom tool (`custom`: its syntax
    and definition) as a function taking one string, its description saying how a call is
    written and the grammar its input follows."""
    if "custom" not in tool:
        return tool
    syntax = tool["custom"]["syntax"]
    how = (
        f"Call it by writing {custom_header(tool['name']).strip()} on a line of its own, then its input as"
        " plain text (not JSON)"
    )
    if syntax != "text":
        how += f", which must match this {'Lark grammar' if syntax == 'lark' else 'regular expression'}:\n"
        how += tool["custom"]["definition"]
    description = "\n\n".join(part for part in (tool.get("description", "").strip(), how) if part)
    string = {"type": "object", "properties": {"input": {"type": "string"}}, "required": ["input"]}
    return {"name": tool["name"], "description": description, "parameters": string}


def template_messages(
    messages: list[dict], tools: list[dict] | None, native: bool, format: ToolFormat = DEFAULT_FORMAT
) -> list[dict]:
    """OpenAI-shaped messages (assistant `tool_calls` with arguments as JSON text, `tool`
    results) as a chat template takes them. A template that knows tools gets arguments as
    objects (its `tojson` would quote a string again), and Phi-4-mini's its tools in the system
    message; one that does not gets the default block in its system message, calls written as
    Hermes tags and results as user turns."""
    if native and format.tools_in_system and tools:
        listed = json.dumps([{"type": "function", "function": t} for t in tools], ensure_ascii=False)
        if messages and messages[0]["role"] == "system":
            messages = [{**messages[0], "tools": listed}, *messages[1:]]
        else:
            messages = [{"role": "system", "content": "", "tools": listed}, *messages]
    if native:
        out = []
        for message in messages:
            if message.get("tool_calls"):
                calls = [
                    {
                        "id": call.get("id"),
                        "type": "function",
                        "function": {"name": call["function"]["name"], "arguments": arguments_object(call)},
                    }
                    for call in message["tool_calls"]
                ]
                message = {**message, "tool_calls": calls}
            out.append(message)
        return out
    out = []
    for message in messages:
        if message.get("tool_calls"):
            calls = "\n".join(
                "<tool_call>\n"
                + json.dumps({"name": c["function"]["name"], "arguments": arguments_object(c)}, ensure_ascii=False)
                + "\n</tool_call>"
                for c in message["tool_calls"]
            )
            content = message.get("content") or ""
            out.append({"role": "assistant", "content": f"{content}\n{calls}".strip()})
        elif message["role"] == "tool":
            out.append({"role": "user", "content": f"<tool_response>\n{message['content']}\n</tool_response>"})
        else:
            out.append({"role": message["role"], "content": message["content"]})
    if tools:
        block = DEFAULT_TOOLS_BLOCK.format(tools="\n".join(tool_json(t) for t in tools))
        if out and out[0]["role"] in ("system", "developer"):
            out[0] = {**out[0], "content": f"{out[0]['content']}\n\n{block}"}
        else:
            out.insert(0, {"role": "system", "content": block})
    return out


def arguments_object(call: dict) -> dict:
    arguments = call["function"].get("arguments") or "{}"
    if isinstance(arguments, dict):
        return arguments
    return json.loads(arguments)  # the HTTP layer checked that it parses to an object


# -- parsing ------------------------------------------------------------------------------------

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"


class ToolCallParser:
    """One reply's text split into content, reasoning and tool calls as it streams.

    `feed` takes each piece of text and returns what is settled; `finish` returns the rest at
    the end. A call whose text is incomplete at the end (cut by max_tokens) is dropped, never
    given out as a call: `cut_call` says there was one."""

    def __init__(
        self,
        format: ToolFormat,
        tools: set[str] | None,
        reasoning: bool = False,
        thinking: bool = False,
        custom: frozenset[str] = frozenset(),
        think: tuple[str, str] = ("<think>", "</think>"),
    ):
        self.format = format
        self.tools = tools  # the names callable; None: no calls are looked for (no tools, or tool_choice none)
        self.custom = custom  # those of them that are custom tools (raw input)
        self.on_call: Callable[[ToolCall], None] | None = None  # told of each call as it is given out
        self.reasoning = reasoning  # split <think>...</think> off as reasoning
        self.think = think  # its tags (Gemma 4's: <|channel>thought ... <channel|>)
        self._mode = "think" if thinking else "start"  # start, text, think, call
        self._bare = False  # the call being read opened with its brace, untagged (llama3)
        self._reasoned = False  # some reasoning text was given out
        self._buffer = ""
        self.calls = 0
        self.cut_call = False

    def feed(self, text: str) -> list[Piece]:
        self._buffer += text
        return self._drain(final=False)

    def finish(self) -> list[Piece]:
        return self._drain(final=True)

    def _drain(self, final: bool) -> list[Piece]:
        out: list[Piece] = []
        while True:
            pieces, progressed = self._step(final)
            out.extend(p for p in pieces if p.kind == "call" or p.text)
            if not progressed:
                return out

    def _tags(self) -> list[str]:
        tags = [self.format.open] if self.tools is not None else []
        return [*tags, self.think[0]] if self.reasoning else tags

    def _step(self, final: bool) -> tuple[list[Piece], bool]:
        buffer = self._buffer
        if self._mode == "think":
            if not self._reasoned:  # reasoning starts at its first visible character
                buffer = self._buffer = buffer.lstrip()
                self._reasoned = bool(buffer)
            close = self.think[1]
            at = buffer.find(close)
            if at >= 0:
                self._buffer, self._mode = buffer[at + len(close) :], "start"
                return [Piece("reasoning", buffer[:at].rstrip())], True
            keep = 0 if final else held_back(buffer, [close])
            self._buffer = buffer[len(buffer) - keep :]
            return [Piece("reasoning", buffer[: len(buffer) - keep])], False
        if self._mode == "call":
            return self._call(final)
        if self._mode == "start" or (self._mode == "text" and self.calls and not buffer.strip()):
            # The reply's content starts at its first visible character (after reasoning too),
            # and whitespace between or after calls is no content.
            buffer = self._buffer = buffer.lstrip()
            if not buffer:
                return [], False
            if self._mode == "start" and self.tools is not None and self.format.bare and buffer.startswith("{"):
                self._mode, self._bare = "call", True
                return [], True
            if self._mode == "start" and self.tools and not self.format.bare and self.format.notation is None:
                opened = UNTAGGED.match(buffer, partial=True)
                if opened is not None and not final:
                    return [], False  # held: a reply that may be an untagged call is read whole
                if opened is not None and not opened.partial and (calls := untagged_calls(buffer, self.tools)):
                    self._buffer, self._mode = "", "text"
                    return self._calls(calls), False
            self._mode = "text"
        hits = sorted((buffer.find(tag), tag) for tag in self._tags() if tag in buffer)
        if hits:
            at, tag = hits[0]
            self._buffer = buffer[at + len(tag) :]
            self._mode = "think" if tag == self.think[0] else "call"
            self._bare = False
            return [Piece("content", buffer[:at].rstrip())], True
        # Held back: what may start a tag, and trailing whitespace (formatting, if a tag follows).
        if final and self.calls and buffer.strip() and held_back(buffer.strip(), self._tags()):
            # The start of another call's tag, cut by max_tokens: no content.
            self._buffer, self.cut_call = "", True
            return [], False
        keep = 0 if final else held_back(buffer, self._tags())
        self._buffer = buffer[len(buffer) - keep :]
        return [Piece("content", buffer[: len(buffer) - keep])], False

    def _call(self, final: bool) -> tuple[list[Piece], bool]:
        """The text after an opening tag (or a bare call from its first brace on)."""
        close, buffer = self.format.close, self._buffer
        if close is not None and not self._bare:
            # The first closing tag after which the call parses: the tag's text inside one of its
            # strings (a command that writes "</tool_call>") does not end it.
            at = buffer.find(close)
            while at >= 0 and parse_calls(buffer[:at], self.format, self.custom) is None:
                at = buffer.find(close, at + 1)
            if at < 0:
                if final:
                    self.cut_call = self.cut_call or bool(buffer.strip())
                    self._buffer = ""
                return [], False
            self._buffer, self._mode = buffer[at + len(close) :].lstrip("\n"), "text"
            return self._calls(buffer[:at]), True
        if not final:  # no closing tag: the calls run to the end of the reply
            return [], False
        # A bare brace opened a call too: with tools, the lazy grammar makes it one.
        self._buffer, self._mode = "", "text"
        return self._calls(buffer), False

    def _calls(self, payload: str | list[ToolCall]) -> list[Piece]:
        calls = payload if isinstance(payload, list) else parse_calls(payload, self.format, self.custom)
        if not calls:
            self.cut_call = self.cut_call or bool(payload.strip())
            return []
        self.calls += len(calls)
        if self.on_call is not None:
            for call in calls:
                self.on_call(call)
        return [Piece("call", call=call) for call in calls]


# A whole reply that is a call without the family's tags, as small models write one: the call's
# JSON alone, or in a ```json fence (Qwen2.5-Coder-1.5B answered Claude Code's 21k-token prompt
# with one). llama.cpp's Hermes/Qwen parser takes the same forms. `partial`: a reply so far that
# may still become one is held back until it ends; one that cannot is streamed as it comes.
UNTAGGED = regex.compile(r'(?:```(?:json)?[ \t]*\r?\n\s*)?\[?\s*\{\s*"name"\s*:')


def untagged_calls(reply: str, tools: set[str]) -> list[ToolCall] | None:
    """A whole reply's untagged calls (one object or a list of them, fenced or not), each to one of
    `tools` with an object of arguments; None if the reply is anything else (then it is text)."""
    text = reply.strip()
    if text.startswith("```"):
        if not text.endswith("```") or "\n" not in text:
            return None
        text = text[text.index("\n") + 1 : -3]
    calls = parse_calls(text, FORMATS["mistral"])  # listed: one object or a list of them
    return calls if calls and all(call.name in tools for call in calls) else None


def held_back(text: str, tags: list[str]) -> int:
    """How many characters at the end of `text` to hold back: what could be the start of one of
    `tags`, and the whitespace before it (formatting, if a tag follows)."""
    if not tags:
        return 0
    best = 0
    for tag in tags:
        for k in range(min(len(tag) - 1, len(text)), 0, -1):
            if text.endswith(tag[:k]):
                best = max(best, k)
                break
    rest = text[: len(text) - best]
    return best + len(rest) - len(rest.rstrip())


def parse_calls(payload: str, format: ToolFormat, custom: frozenset[str] = frozenset()) -> list[ToolCall] | None:
    """The calls in one payload, or None if it is not whole, valid JSON of the family's shape
    (or one custom tool's call: its header line, then its raw input)."""
    if custom and (call := custom_call(payload, custom)) is not None:
        return [call]
    if format.notation is not None:
        found = format.notation.parse(payload)
        return None if found is None else [ToolCall(name, json.dumps(args, ensure_ascii=False)) for name, args in found]
    payload = payload.strip()
    try:
        if format.listed:
            items = json.loads(payload)
            if not isinstance(items, list):
                items = [items]
        elif format.separator:
            decoder, items, at = json.JSONDecoder(), [], 0
            while at < len(payload):
                item, at = decoder.raw_decode(payload, at)
                items.append(item)
                rest = payload[at:].lstrip()
                at = len(payload) - len(rest)
                if rest.startswith(format.separator.strip()):
                    at += len(format.separator.strip())
                    at = len(payload) - len(payload[at:].lstrip())
                elif rest:
                    return None
        else:
            items = [json.loads(payload)]
    except (json.JSONDecodeError, RecursionError):  # not JSON, or nested past Python's parser
        return None
    calls = []
    for item in items:
        if not isinstance(item, dict) or not isinstance(item.get("name"), str):
            return None
        arguments = item.get(format.arguments_key, item.get("arguments", item.get("parameters", {})))
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments)
            except (json.JSONDecodeError, RecursionError):
                return None
        if not isinstance(arguments, dict):
            return None
        calls.append(ToolCall(item["name"], json.dumps(arguments, ensure_ascii=False)))
    return calls


def custom_call(payload: str, custom: frozenset[str]) -> ToolCall | None:
    """A custom tool's call: `{"name": …}` (one of `custom`), a newline, then the input as it is."""
    text = payload.lstrip()
    if not text.startswith("{"):
        return None
    try:
        head, at = json.JSONDecoder().raw_decode(text)
    except (json.JSONDecodeError, RecursionError):
        return None
    if not isinstance(head, dict) or set(head) != {"name"} or head["name"] not in custom or text[at : at + 1] != "\n":
        return None
    return ToolCall(head["name"], "", input=text[at + 1 :])


# -- grammars -----------------------------------------------------------------------------------


def call_schema(tools: list[dict], arguments_key: str) -> dict:
    """The JSON Schema of one call: the name of one of `tools`, then its arguments under its own
    parameter schema (in that order: a streamed call names its function first)."""
    options = [
        {
            "type": "object",
            "properties": {"name": {"const": t["name"]}, arguments_key: t.get("parameters") or {"type": "object"}},
            "required": ["name", arguments_key],
            "additionalProperties": False,
        }
        for t in tools
    ]
    return options[0] if len(options) == 1 else {"anyOf": options}


# Compact JSON (", " and ": ", no other whitespace), as for response_format: a model cannot pad
# a call with whitespace until max_tokens. llguidance reads its options from `x-guidance`.
COMPACT_JSON = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
# A tool's schema is the client's, written for other models' servers (Claude Code's carry
# `$schema`, `propertyNames`, `format`): what llguidance cannot express is left out of the
# grammar (lenient) rather than refusing the tools; the rest still holds every call.
CALL_JSON = {**COMPACT_JSON, "lenient": True}


def tool_grammar(
    format: ToolFormat, tools: list[dict], parallel: bool, tag: dict[str, str], ids: dict[str, int] | None = None
) -> str:
    """llguidance's grammar for a reply of tool calls, from the opening tag on: Lark text, or with
    custom tools llguidance's JSON form (the Lark, then each custom tool's grammar, named
    `custom_i`, that the Lark references as `@custom_i`). `tools`: {name, parameters} each, or
    {name, custom: {syntax, definition}} (the ones allowed); `tag[t]`: how the grammar writes tag
    t (a special token by id, `<[id]>`, else its text quoted); `ids[t]`: tag t's token, if one."""
    functions = [t for t in tools if "custom" not in t]
    customs = [t for t in tools if "custom" in t]
    if format.notation is not None:  # its own notation; custom tools are called as functions of one string
        return format.notation.grammar([as_function(t) if "custom" in t else t for t in tools], parallel, tag)
    open_, close = tag[format.open], tag.get(format.close) if format.close else None
    rules, subgrammars = [], []
    for i, tool in enumerate(customs):
        # The header is JSON as a function call's is (a literal would be one lexeme, and llguidance's
        # lexer, greedy, would then take no function call's "{" beside it).
        name = {"type": "object", "properties": {"name": {"const": tool["name"]}}, "required": ["name"]}
        rules.append(f"head{i}: %json {json.dumps({**name, 'additionalProperties': False, 'x-guidance': CALL_JSON})}")
        header = f'head{i} "\\n"'
        syntax, definition = tool["custom"]["syntax"], tool["custom"].get("definition", "")
        if syntax == "text":  # free text, up to the closing tag (whether a token or spelled out) or the end
            if close is None:
                body = "ANY"
            else:
                token = (ids or {}).get(format.close)
                spelled = f"free{i}"
                rules.append(f"{spelled}[suffix={json.dumps(format.close)}]: /(.|\\n)*/")
                body = f"(ANY <[{token}]> | {spelled})" if token is not None else spelled
            rules.append(f"custom{i}: {header} {body}")
        else:
            subgrammars.append({"name": f"custom_{i}", "lark_grammar": custom_lark(syntax, definition)})
            rules.append(f"custom{i}: {header} @custom_{i}{f' {close}' if close else ''}")
    if customs:
        rules.append("custom: " + " | ".join(f"custom{i}" for i in range(len(customs))))
        if any(t["custom"]["syntax"] == "text" for t in customs):
            rules.append("ANY: /(.|\\n)*/")
    if functions:
        schema = {**call_schema(functions, format.arguments_key), "x-guidance": CALL_JSON}
    if format.listed:
        options = []
        if functions:
            array = {"type": "array", "items": schema, "minItems": 1, "x-guidance": CALL_JSON}
            if not parallel:
                array["maxItems"] = 1
            options.append(f"{open_} calls{f' {close}' if close else ''}")
            rules.append(f"calls: %json {json.dumps(array)}")
        if customs:
            options.append(f"{open_} custom")
        lark = "start: " + " | ".join(options)
    elif format.close is not None:  # hermes: a tag around each call
        options = []
        if functions:
            options.append(f'{open_} "\\n" call "\\n" {close}')
            rules.append(f"call: %json {json.dumps(schema)}")
        if customs:
            options.append(f'{open_} "\\n" custom')
        more = ' ("\\n"? block)*' if parallel else ""  # Qwen puts a newline between calls; not all do
        lark = f"start: block{more}\nblock: " + " | ".join(options)
    else:  # llama3: bare calls (or after its tag), joined by its separator; a custom call alone
        options = []
        if functions:
            more = f" ({json.dumps(format.separator)} call)*" if parallel else ""
            options.append(f"{open_}? call{more}")
            rules.append(f"call: %json {json.dumps(schema)}")
        if customs:
            options.append(f"{open_}? custom")
        lark = "start: " + " | ".join(options)
    lark = "\n".join([lark, *rules]) + "\n"
    if not subgrammars:
        return lark
    return json.dumps({"grammars": [{"lark_grammar": lark}, *subgrammars]})


def custom_lark(syntax: str, definition: str) -> str:
    """A custom tool's grammar as Lark: its own, or its regex (Rust's syntax, as llguidance reads
    a regex) as the one rule of one."""
    if syntax == "lark":
        return definition
    return f"start: /{llguidance.regex_to_lark(definition, '')}/\n"


PATTERN_SECONDS = 0.25  # the pattern matching one call's check may do, all its patterns together


class PatternTimeout(Exception):
    """A call's patterns took longer than PATTERN_SECONDS to match: left unchecked."""


class _Patterns:
    """`re` as jsonschema's keywords see it (pattern, patternProperties, additionalProperties,
    unevaluatedProperties: all call `re.search`). Within `argument_error`, a client's pattern is
    matched by `regex`, which drops the GIL and stops at the check's deadline (Python's `re`
    backtracks exponentially on `^(a+)+$` holding the GIL); elsewhere it is `re` itself."""

    def __init__(self):
        self.local = threading.local()

    def search(self, pattern, string, flags=0):
        deadline = getattr(self.local, "deadline", None)
        if deadline is None:
            return re.search(pattern, string, flags)
        left = deadline - time.monotonic()
        if left <= 0:
            raise PatternTimeout
        try:
            return regex.search(pattern, string, flags, timeout=left)
        except TimeoutError:
            raise PatternTimeout from None

    def __getattr__(self, name):
        return getattr(re, name)


PATTERNS = _Patterns()
for _module in (jsonschema._keywords, jsonschema._utils, jsonschema._legacy_keywords):
    _module.re = PATTERNS  # jsonschema 4.26's keywords search patterns through their module's `re`


def argument_error(schema: dict, arguments: str) -> str | None:
    """Why a call's arguments break its tool's full JSON Schema (the grammar held them to a lenient
    form of it: `CALL_JSON`), or None. Formats are checked where jsonschema knows them; a schema
    jsonschema cannot read (or a `$ref` it cannot resolve: nothing is fetched) is no error of the
    call's, nor are patterns that take longer than PATTERN_SECONDS to match (`_Patterns`).
    Seconds for a huge schema: callers run it on a pool."""
    PATTERNS.local.deadline = time.monotonic() + PATTERN_SECONDS
    try:
        validator = jsonschema.validators.validator_for(schema)
        errors = validator(schema, format_checker=validator.FORMAT_CHECKER).iter_errors(json.loads(arguments))
        error = jsonschema.exceptions.best_match(errors)
    except Exception:  # the schema's own fault (SchemaError, Unresolvable, ...), or PatternTimeout
        return None
    finally:
        PATTERNS.local.deadline = None
    return None if error is None else f"{error.json_path}: {error.message}"[:300]


@dataclass(frozen=True)
class Trigger:
    """What arms a lazy tool grammar (`auto`): a tag's token id, a tag's text (where a tag is no
    single token of the vocabulary), or, at the reply's start, a bare call's first brace."""

    ids: tuple[int, ...] = ()
    texts: tuple[str, ...] = ()
    at_start: tuple[str, ...] = ()

    def to_json(self) -> dict:
        return {"ids": list(self.ids), "texts": list(self.texts), "at_start": list(self.at_start)}
