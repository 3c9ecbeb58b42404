"""OpenAI's custom tools (issue 53): a tool whose input is text, free or in the client's Lark or
regex grammar, called on /v1/chat/completions and /v1/responses through the openai SDK, on both
runtimes and both tiny tool models' formats. The grammar makes the call, whatever the weights:
forced calls' inputs always match their grammar (checked here by an independent regex that
describes the same language)."""

from __future__ import annotations

import json
import re

import jsonschema
import openai
import pytest
from conftest import post

from backends.chat import tools as T
from backends.chat.plan import ChatFormat

SERVED_TOOLS = [("torch", "hermes", 4), ("torch", "llama3", 1), ("mlx", "hermes", 1), ("mlx", "llama3", 4)]

# Sums of at most four numbers of one to three digits: the Lark grammar, and the same language
# as a Python regex to check the inputs by.
SUM_LARK = 'start: expr\nexpr: NUM (OP NUM){0,3}\nOP: "+" | "-"\nNUM: /[0-9]{1,3}/\n'
SUM = re.compile(r"[0-9]{1,3}([+-][0-9]{1,3}){0,3}")
DATE = r"[0-9]{4}-[0-9]{2}-[0-9]{2}"
CHAT_CUSTOM = [
    {
        "type": "custom",
        "custom": {
            "name": "calc",
            "description": "Adds and subtracts.",
            "format": {"type": "grammar", "grammar": {"syntax": "lark", "definition": SUM_LARK}},
        },
    },
    {
        "type": "custom",
        "custom": {"name": "day", "format": {"type": "grammar", "grammar": {"syntax": "regex", "definition": DATE}}},
    },
]
ORDER = {
    "type": "object",
    "properties": {"item": {"enum": ["tea", "coffee"]}, "count": {"type": "integer", "minimum": 1, "maximum": 9}},
    "required": ["item", "count"],
    "additionalProperties": False,
}
FUNCTION = {"type": "function", "function": {"name": "order", "parameters": ORDER}}
ASK = [{"role": "user", "content": "Two teas, please."}]


@pytest.fixture(params=SERVED_TOOLS, ids=[f"{r}-{f}-batch{b}" for r, f, b in SERVED_TOOLS])
def tool_server(request, live_server, tool_backends):
    runtime, fmt, batch = request.param
    backend = tool_backends(runtime, fmt)
    return live_server(lambda: backend, max_batch=batch, model="tiny")


def sdk_of(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def matches(name: str, text: str) -> bool:
    return bool((SUM if name == "calc" else re.compile(DATE)).fullmatch(text))


def streamed_calls(sdk, **body) -> tuple[list[dict], str | None]:
    """The calls of a streamed chat answer as a client folds them (custom deltas by index)."""
    calls, finish = {}, None
    for chunk in sdk.chat.completions.create(stream=True, **body):
        for choice in chunk.choices:
            for delta in choice.delta.tool_calls or []:
                entry = calls.setdefault(delta.index, {"type": None, "name": "", "text": ""})
                fields = delta.model_dump(exclude_none=True)
                if "id" in fields:
                    assert entry["type"] is None, "a call's id and type come once, first"
                    entry["type"] = fields["type"]
                part = fields.get(entry["type"]) or {}
                entry["name"] += part.get("name", "")
                entry["text"] += part.get("input" if entry["type"] == "custom" else "arguments", "")
            finish = choice.finish_reason or finish
    return [calls[i] for i in sorted(calls)], finish


# -- chat: forced custom calls, whole and streamed ------------------------------------------------


@pytest.mark.parametrize("name", ["calc", "day"])
def test_a_forced_custom_call_follows_its_grammar(tool_server, name):
    sdk = sdk_of(tool_server)
    body = dict(
        model="tiny",
        messages=ASK,
        tools=CHAT_CUSTOM,
        tool_choice={"type": "custom", "custom": {"name": name}},
        max_tokens=60,
    )
    for seed in range(3):
        answer = sdk.chat.completions.create(temperature=1.0, seed=seed, **body)
        choice = answer.choices[0]
        assert choice.finish_reason == "tool_calls", choice
        [call] = choice.message.tool_calls
        assert call.type == "custom" and call.id.startswith("call_") and call.custom.name == name
        assert matches(name, call.custom.input), call.custom.input
    whole = sdk.chat.completions.create(temperature=0, **body).choices[0].message.tool_calls[0]
    calls, finish = streamed_calls(sdk, temperature=0, **body)
    assert finish == "tool_calls"
    assert calls == [{"type": "custom", "name": name, "text": whole.custom.input}]


def test_function_and_custom_tools_mixed(tool_server):
    """Either kind may be called beside the other: each call is valid for its own kind."""
    sdk = sdk_of(tool_server)
    body = dict(model="tiny", messages=ASK, tools=[FUNCTION, *CHAT_CUSTOM], tool_choice="required", max_tokens=80)
    for seed in range(4):
        choice = sdk.chat.completions.create(temperature=1.0, seed=seed, parallel_tool_calls=False, **body).choices[0]
        assert choice.finish_reason == "tool_calls", choice
        [call] = choice.message.tool_calls
        if call.type == "custom":
            assert matches(call.custom.name, call.custom.input), call.custom
        else:
            assert call.function.name == "order"
            jsonschema.validate(json.loads(call.function.arguments), ORDER)
    named = {"type": "function", "function": {"name": "order"}}
    forced = sdk.chat.completions.create(temperature=0, **{**body, "tool_choice": named})
    [call] = forced.choices[0].message.tool_calls
    assert call.type == "function" and call.function.name == "order"
    # A history holding a custom call and its result renders and is answered.
    history = [
        *ASK,
        {
            "role": "assistant",
            "tool_calls": [{"id": "c1", "type": "custom", "custom": {"name": "calc", "input": "1+1"}}],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "2"},
    ]
    again = sdk.chat.completions.create(model="tiny", messages=history, tools=CHAT_CUSTOM, max_tokens=8, temperature=0)
    assert again.choices[0].finish_reason in ("stop", "length", "tool_calls")


# -- the grammar and the parser, each family's format ---------------------------------------------

FORMS = {  # a reply of calls to each kind, as each family writes them
    "hermes": [
        '<tool_call>\n{"name": "calc"}\n12+3</tool_call>\n<tool_call>\n{"name": "order", "arguments": {"item": "tea",'
        ' "count": 2}}\n</tool_call>\n<tool_call>\n{"name": "note"}\nsay "hi"\nthere</tool_call>',
    ],
    "llama3": ['{"name": "day"}\n2024-01-02', '<|python_tag|>{"name": "note"}\nfree "text"\n', '{"name": "calc"}\n1'],
    "mistral": [
        '[TOOL_CALLS]{"name": "calc"}\n1-2',
        '[TOOL_CALLS][{"name": "order", "arguments": {"item": "tea", "count": 1}}]',
    ],
    "phi4": [
        '<|tool_call|>{"name": "day"}\n2024-01-02<|/tool_call|>',
        '<|tool_call|>{"name": "note"}\nhi<|/tool_call|>',
    ],
}
WRONG = {  # inputs their grammar refuses
    "hermes": '<tool_call>\n{"name": "calc"}\n12*3</tool_call>',
    "llama3": '{"name": "day"}\n2024-1-02',
    "mistral": '[TOOL_CALLS]{"name": "calc"}\n1+2+3+4+5',
    "phi4": '<|tool_call|>{"name": "day"}\nsoon<|/tool_call|>',
}
TOOL_LIST = [
    {"name": "order", "parameters": ORDER},
    {"name": "calc", "custom": {"syntax": "lark", "definition": SUM_LARK}},
    {"name": "day", "custom": {"syntax": "regex", "definition": DATE}},
    {"name": "note", "custom": {"syntax": "text"}},
]


@pytest.fixture(scope="module")
def hermes_format(tool_paths):
    from transformers import AutoTokenizer

    from backends.decoding.grammar import Grammars

    tokenizer = AutoTokenizer.from_pretrained(str(tool_paths["hermes"]))
    return ChatFormat(tokenizer), Grammars(tokenizer, len(tokenizer))


def accepted(chat: ChatFormat, grammars, fmt: str, text: str) -> bool:
    chat.tool_format = T.FORMATS[fmt]
    compiled = grammars.compile("tool_calls", chat.tool_grammar(TOOL_LIST, True, False))
    matcher = compiled.matcher()._matcher
    return matcher.consume_tokens(grammars.tokenizer.tokenize_str(text)) and matcher.is_accepting()


@pytest.mark.parametrize("fmt", sorted(FORMS))
def test_every_format_writes_and_reads_custom_calls(hermes_format, fmt):
    chat, grammars = hermes_format
    names = {t["name"] for t in TOOL_LIST}
    custom = frozenset(t["name"] for t in TOOL_LIST if "custom" in t)
    for text in FORMS[fmt]:
        assert accepted(chat, grammars, fmt, text), text
        for step in (1, 3, len(text)):  # streamed in pieces of every size, the same calls
            parser = T.ToolCallParser(T.FORMATS[fmt], names, custom=custom)
            pieces = [p for at in range(0, len(text), step) for p in parser.feed(text[at : at + step])]
            calls = [p.call for p in pieces + parser.finish()]
            assert calls and all(p.kind == "call" for p in pieces)
            for call in calls:
                if call.custom:
                    assert call.name == "note" or matches(call.name, call.input), call
                    assert text.count(call.input), "the input is given out as the model wrote it"
                else:
                    jsonschema.validate(json.loads(call.arguments), ORDER)
    assert not accepted(chat, grammars, fmt, WRONG[fmt])


def test_custom_tools_are_shown_as_functions_of_one_string():
    shown = T.as_function(TOOL_LIST[1])
    assert shown["parameters"]["properties"] == {"input": {"type": "string"}}
    assert SUM_LARK in shown["description"] and '{"name": "calc"}' in shown["description"]
    assert T.as_function(TOOL_LIST[0]) is TOOL_LIST[0]


# -- errors ---------------------------------------------------------------------------------------


def test_a_bad_grammar_is_a_400_naming_it(tool_server):
    bad_lark = {"type": "grammar", "grammar": {"syntax": "lark", "definition": "start: nowhere\n"}}
    bad_regex = {"type": "grammar", "grammar": {"syntax": "regex", "definition": "a(b"}}
    for form, says in [(bad_lark, 'unknown name: "nowhere"'), (bad_regex, "regex")]:
        tools = [{"type": "custom", "custom": {"name": "broken", "format": form}}]
        status, answer = post(tool_server, "/v1/chat/completions", {"messages": ASK, "tools": tools})
        assert status == 400 and answer["error"]["param"] == "tools", answer
        assert "custom tool 'broken'" in answer["error"]["message"] and says in answer["error"]["message"]
        flat = [{"type": "custom", "name": "broken", "format": {"type": "grammar", **form["grammar"]}}]
        status, answer = post(tool_server, "/v1/responses", {"input": "Hi", "tools": flat})
        assert status == 400 and "custom tool 'broken'" in answer["error"]["message"], answer
    for change, param in [
        (
            {"tools": [{"type": "custom", "custom": {"name": "x", "format": {"type": "grammar"}}}]},
            "tools[0].custom.format.grammar",
        ),
        ({"tool_choice": {"type": "custom", "custom": {"name": "order"}}, "tools": [FUNCTION]}, "tool_choice"),
        ({"tool_choice": {"type": "function", "function": {"name": "calc"}}, "tools": CHAT_CUSTOM}, "tool_choice"),
        ({"tools": [{"type": "custom"}]}, "tools[0].custom"),
    ]:
        status, answer = post(tool_server, "/v1/chat/completions", {"messages": ASK, **change})
        assert status == 400 and answer["error"]["param"] == param, (change, answer)


# -- Responses: a custom_tool_call item, streamed, and its output sent back -----------------------

RESPONSE_CUSTOM = [
    {"type": "custom", "name": "calc", "format": {"type": "grammar", "syntax": "lark", "definition": SUM_LARK}},
    {"type": "function", "name": "order", "parameters": ORDER},
]


def test_responses_custom_tool_call_and_its_output(tool_server):
    sdk = sdk_of(tool_server)
    body = dict(
        model="tiny",
        input="What is 2 + 2?",
        tools=RESPONSE_CUSTOM,
        tool_choice={"type": "custom", "name": "calc"},
        temperature=0,
        max_output_tokens=60,
    )
    response = sdk.responses.create(**body)
    assert response.status == "completed"
    [call] = response.output
    assert call.type == "custom_tool_call" and call.name == "calc" and SUM.fullmatch(call.input), call
    assert call.call_id.startswith("call_") and call.status == "completed"

    with sdk.responses.stream(**body) as stream:
        events = list(stream)
        final = stream.get_final_response()
    kinds = [e.type for e in events]
    assert "response.custom_tool_call_input.delta" in kinds and kinds[-1] == "response.completed"
    deltas = "".join(e.delta for e in events if e.type == "response.custom_tool_call_input.delta")
    [done] = [e for e in events if e.type == "response.custom_tool_call_input.done"]
    assert deltas == done.input == final.output[0].input == call.input

    turn = [
        {"role": "user", "content": "What is 2 + 2?"},
        call.model_dump(exclude_none=True),
        {"type": "custom_tool_call_output", "call_id": call.call_id, "output": "4"},
    ]
    second = sdk.responses.create(model="tiny", input=turn, tools=RESPONSE_CUSTOM, temperature=0, max_output_tokens=8)
    assert second.status in ("completed", "incomplete") and second.output


def test_custom_calls_are_as_described(tool_server):
    from test_openapi import call, conforms

    document = json.loads(call(tool_server, "GET", "/openapi.json")[2])
    for path, body in [
        ("/v1/chat/completions", {"messages": ASK, "tools": CHAT_CUSTOM, "tool_choice": "required"}),
        (
            "/v1/responses",
            {"input": "2 + 2?", "tools": RESPONSE_CUSTOM, "tool_choice": {"type": "custom", "name": "calc"}},
        ),
    ]:
        data = json.dumps({**body, "temperature": 0, "max_tokens" if "messages" in body else "max_output_tokens": 60})
        status, media, answer = call(tool_server, "POST", path, data.encode())
        assert status == 200 and b"custom" in answer, answer
        conforms(document, path, "POST", status, media, answer)
