"""Gemma 4's tool calls, a format the JSON table of backends/chat/tools.py cannot express: a call is
`<|tool_call>call:name{key:value,...}<tool_call|>`, its arguments Gemma's own notation (keys bare,
strings between `<|"|>` tokens, numbers, true/false/null, [lists] and {objects} as in JSON). This
module is the format's parse and grammar; tools.FORMATS names it with its tags, and the chat
template chooses it (it writes `<|tool_call>`). Its reasoning channel
(`<|channel>thought ... <channel|>`) is backends/chat/plan.py's REASONING_TAGS.
"""

from __future__ import annotations

import json
import re

OPEN, CLOSE, QUOTE = "<|tool_call>", "<tool_call|>", '<|"|>'
KEY = re.compile(r"[A-Za-z_][\w-]*")
NUMBER = re.compile(r"-?(0|[1-9]\d*)(\.\d+)?([eE][+-]?\d+)?")
# Lark: a string's text runs to its closing quote, spelled out (the lexeme's suffix: a lexer
# without lookahead would take the quote's first bytes as text) or the quote's token.
STRING_TEXT = "/(.|\\n)*/"


class Invalid(ValueError):
    pass


def parse(payload: str) -> list[tuple[str, dict]] | None:
    """The (name, arguments) of the one call in a payload (the text between the tags), or None
    if it is not a whole call."""
    text = payload.strip()
    if not text.startswith("call:"):
        return None
    match = KEY.match(text, 5)
    if match is None:
        return None
    try:
        arguments, at = _value(text, match.end())
    except (Invalid, RecursionError):
        return None
    if not isinstance(arguments, dict) or text[at:].strip():
        return None
    return [(match.group(), arguments)]


def _value(text: str, at: int):
    if text.startswith(QUOTE, at):
        end = text.find(QUOTE, at + len(QUOTE))
        if end < 0:
            raise Invalid("an open string")
        return text[at + len(QUOTE) : end], end + len(QUOTE)
    if text.startswith("{", at):
        return _items(text, at + 1, "}", keyed=True)
    if text.startswith("[", at):
        return _items(text, at + 1, "]", keyed=False)
    for word, value in (("true", True), ("false", False), ("null", None)):
        if text.startswith(word, at):
            return value, at + len(word)
    match = NUMBER.match(text, at)
    if match is None:
        raise Invalid(f"no value at {at}")
    number = match.group()
    return (float(number) if any(c in number for c in ".eE") else int(number)), match.end()


def _items(text: str, at: int, end: str, keyed: bool):
    out = {} if keyed else []
    if text.startswith(end, at):
        return out, at + 1
    while True:
        if keyed:
            match = KEY.match(text, at)
            if match is None or not text.startswith(":", match.end()):
                raise Invalid(f"no key at {at}")
            value, at = _value(text, match.end() + 1)
            out[match.group()] = value
        else:
            value, at = _value(text, at)
            out.append(value)
        if text.startswith(",", at):
            at += 1
        elif text.startswith(end, at):
            return out, at + 1
        else:
            raise Invalid(f"no separator at {at}")


def write(name: str, arguments: dict) -> str:
    """A call as Gemma 4 writes it (what `parse` reads back)."""
    return f"call:{name}{_write(arguments)}"


def _write(value) -> str:
    if isinstance(value, str):
        return f"{QUOTE}{value}{QUOTE}"
    if isinstance(value, dict):
        return "{" + ",".join(f"{key}:{_write(item)}" for key, item in value.items()) + "}"
    if isinstance(value, list):
        return "[" + ",".join(_write(item) for item in value) + "]"
    return json.dumps(value)


def grammar(tools: list[dict], parallel: bool, tag: dict[str, str]) -> str:
    """llguidance's Lark for a reply of calls from the opening tag on: each call names one of
    `tools` ({name, parameters}) and gives its arguments in Gemma's notation, each property by
    its JSON type (any value where the schema says no type); `tag[t]`: how the grammar writes
    tag t (its token, or its text). Which properties are required is checked on the parsed call
    (the tools' full schema), not here."""
    quote = tag[QUOTE]
    token = quote.split("]>")[0].split("<[")[-1] if "<[" in quote else None  # the quote's id, if a token
    closed = f"spelled | inner <[{token}]>" if token is not None else "spelled"
    rules = [
        f"string: {quote} ({closed})",
        f"spelled[suffix={json.dumps(QUOTE)}]: {STRING_TEXT}",
        f"inner: {STRING_TEXT}",
        r"number: /-?(0|[1-9][0-9]*)(\.[0-9]+)?([eE][+-]?[0-9]+)?/",
        r"integer: /-?(0|[1-9][0-9]*)/",
        'boolean: "true" | "false"',
        'value: string | number | boolean | "null" | list | object',
        'list: "[" (value ("," value)*)? "]"',
        r'object: "{" (pair ("," pair)*)? "}"',
        r'pair: /[A-Za-z_][A-Za-z0-9_\-]*/ ":" value',
    ]
    calls = []
    for i, tool in enumerate(tools):
        properties = (tool.get("parameters") or {}).get("properties") or {}
        if properties:
            options = " | ".join(f'{json.dumps(key)} ":" {_rule(schema)}' for key, schema in properties.items())
            rules.append(f"prop{i}: {options}")
            rules.append(f'args{i}: "{{" (prop{i} ("," prop{i})*)? "}}"')
        else:
            rules.append(f"args{i}: object")
        calls.append(f'"call:" {json.dumps(tool["name"])} args{i}')
    rules.append("call: " + " | ".join(calls))
    block = f"block: {tag[OPEN]} call {tag[CLOSE]}"
    start = 'start: block ("\\n"? block)*' if parallel else "start: block"
    return "\n".join([start, block, *rules]) + "\n"


def _rule(schema: dict) -> str:
    kind = schema.get("type") if isinstance(schema, dict) else None
    return {"string": "string", "integer": "integer", "number": "number", "boolean": "boolean", "array": "list"}.get(
        kind, "object" if kind == "object" else "value"
    )
