"""Gemma 4's tool-call notation (backends/chat/gemma4.py): parsed as mlx-lm's Gemma 4 parser reads
it, written back the same, its calls and thought channel split from a streamed reply."""

from __future__ import annotations

import json

import pytest

from backends.chat import gemma4
from backends.chat.tools import FORMATS, ToolCallParser, detect_format

QUOTE = gemma4.QUOTE


@pytest.mark.parametrize(
    "arguments",
    [
        {},
        {"city": "Paris"},
        {"city": 'Paris, {FR}: "quoted"\nand <b>', "days": 3, "scale": -1.5e-3},
        {"flags": [True, False, None], "nested": {"a": [1, {"b": "c"}], "empty": []}},
    ],
)
def test_a_call_reads_back_as_written(arguments):
    text = gemma4.write("get_weather", arguments)
    assert gemma4.parse(text) == [("get_weather", arguments)]


def test_what_mlx_lms_parser_reads():
    text = f"call:get_weather{{location:{QUOTE}Tokyo{QUOTE},unit:{QUOTE}celsius{QUOTE},days:2}}"
    assert gemma4.parse(text) == [("get_weather", {"location": "Tokyo", "unit": "celsius", "days": 2})]


@pytest.mark.parametrize(
    "text", ["", "get_weather{}", "call:get_weather", f"call:f{{a:{QUOTE}open}}", "call:f{a:1,}", "call:f{a:1}x"]
)
def test_what_is_not_a_whole_call(text):
    assert gemma4.parse(text) is None


def test_the_format_is_chosen_from_the_template():
    template = "{% for t in tools %}{{ t | tojson }}{% endfor %}... <|tool_call>call:{{ name }}{...}<tool_call|>"
    assert detect_format(template) == (FORMATS["gemma4"], True)


@pytest.mark.parametrize("chunk", [1, 3, 1000])
def test_a_streamed_reply_splits_into_reasoning_content_and_calls(chunk):
    reply = (
        "<|channel>thought\nThe user wants the weather.<channel|>Let me check."
        f"<|tool_call>call:get_weather{{city:{QUOTE}Paris <tool_call|> {{FR}}{QUOTE}}}<tool_call|>"
    )
    parser = ToolCallParser(
        FORMATS["gemma4"], {"get_weather"}, reasoning=True, think=("<|channel>thought", "<channel|>")
    )
    pieces = [p for at in range(0, len(reply), chunk) for p in parser.feed(reply[at : at + chunk])] + parser.finish()
    reasoning = "".join(p.text for p in pieces if p.kind == "reasoning")
    content = "".join(p.text for p in pieces if p.kind == "content")
    calls = [(p.call.name, json.loads(p.call.arguments)) for p in pieces if p.kind == "call"]
    assert reasoning == "The user wants the weather." and content == "Let me check."
    assert calls == [("get_weather", {"city": "Paris <tool_call|> {FR}"})]


def test_the_grammar_holds_names_and_types():
    import llguidance

    tools = [
        {"name": "get_weather", "parameters": {"properties": {"city": {"type": "string"}, "days": {"type": "integer"}}}}
    ]
    tags = {tag: json.dumps(tag) for tag in (gemma4.OPEN, gemma4.CLOSE, QUOTE)}
    lark = gemma4.grammar(tools, parallel=True, tag=tags)
    grammar = llguidance.LLMatcher.grammar_from_lark(lark)
    tokenizer = llguidance.LLTokenizer(llguidance.TokenizerWrapper(ByteTokenizer()))

    def accepts(text: str) -> bool:
        matcher = llguidance.LLMatcher(tokenizer, grammar)
        return matcher.consume_tokens(list(text.encode())) and matcher.is_accepting()

    good = f"<|tool_call>call:get_weather{{city:{QUOTE}Paris{QUOTE},days:3}}<tool_call|>"
    assert accepts(good) and accepts(good + "\n" + good)
    assert not accepts(good.replace("get_weather", "get_time"))
    assert not accepts(good.replace("days:3", f"days:{QUOTE}3{QUOTE}"))


class ByteTokenizer:
    """A tokenizer of one token a byte, for llguidance (the grammar's text, byte by byte)."""

    eos_token_id = 256
    bos_token_id = None
    tokens = [bytes([b]) for b in range(256)] + [b"<eos>"]
    special_token_ids = [256]

    def __call__(self, text):
        return list(text.encode())
