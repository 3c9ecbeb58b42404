"""Tool calling on /v1/chat/completions (issue 28, part 1), driven through the openai SDK, litellm and
langchain-openai against the real app, on both runtimes, batched.

`auto` is tested for real on tiny instruction models that memorized a few dialogues in two
families' formats (backends.torch.tiny.write_tiny_tools: Hermes tags on a Qwen2 model, Llama-3 JSON on a
Llama model). `required` and a named function must hold with any weights, since the grammar makes
the call: they run on the demo model too, whose template knows no tools (the default block)."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest
from conftest import post

from backends.chat.plan import ChatRequest, ToolUse
from backends.torch.tiny import TOOL

TOOLS = [{"type": "function", "function": TOOL}]
PARIS = [{"role": "user", "content": "What is the weather in Paris?"}]
SERVED_TOOLS = [("torch", "hermes", 4), ("torch", "llama3", 1), ("mlx", "hermes", 1), ("mlx", "llama3", 4)]


@pytest.fixture(params=SERVED_TOOLS, ids=[f"{r}-{f}-batch{b}" for r, f, b in SERVED_TOOLS])
def tool_server(request, live_server, tool_backends):
    runtime, fmt, batch = request.param
    backend = tool_backends(runtime, fmt)
    server = live_server(lambda: backend, max_batch=batch, model="tiny")
    server.format = fmt
    return server


def sdk_of(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def calls_of(message) -> list[tuple[str, dict]]:
    return [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls or []]


def streamed(sdk, **body) -> dict:
    """A streamed reply folded as clients fold it: content, reasoning and the calls by index."""
    content, reasoning, calls, finish = "", "", {}, None
    for chunk in sdk.chat.completions.create(stream=True, **body):
        for choice in chunk.choices:
            delta = choice.delta
            content += delta.content or ""
            reasoning += (delta.model_extra or {}).get("reasoning_content") or ""
            for call in delta.tool_calls or []:
                entry = calls.setdefault(call.index, {"id": None, "name": "", "arguments": ""})
                if call.id:
                    assert entry["id"] is None, "a call's id comes once, first"
                    entry["id"] = call.id
                if call.function and call.function.name:
                    entry["name"] += call.function.name
                if call.function and call.function.arguments:
                    assert entry["name"], "a call is named before its arguments come"
                    entry["arguments"] += call.function.arguments
            finish = choice.finish_reason or finish
    return {
        "content": content,
        "reasoning": reasoning,
        "calls": [(calls[i]["name"], json.loads(calls[i]["arguments"])) for i in sorted(calls)],
        "ids": [calls[i]["id"] for i in sorted(calls)],
        "finish": finish,
    }


# -- auto: the model decides, and its calls are parsed ------------------------------------------


def test_auto_call_whole_and_streamed(tool_server):
    sdk = sdk_of(tool_server)
    whole = sdk.chat.completions.create(model="tiny", messages=PARIS, tools=TOOLS, temperature=0, max_tokens=80)
    choice = whole.choices[0]
    assert calls_of(choice.message) == [("get_weather", {"city": "Paris"})]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None
    assert choice.message.tool_calls[0].id.startswith("call_") and choice.message.tool_calls[0].type == "function"

    stream = streamed(sdk, model="tiny", messages=PARIS, tools=TOOLS, temperature=0, max_tokens=80)
    assert stream["calls"] == [("get_weather", {"city": "Paris"})]
    assert stream["content"] == "" and stream["finish"] == "tool_calls"
    assert all(stream["ids"])


def test_a_second_turn_with_the_tool_result(tool_server):
    """The reply's own message appended as the SDK gives it, then the tool's result for its id."""
    sdk = sdk_of(tool_server)
    first = sdk.chat.completions.create(model="tiny", messages=PARIS, tools=TOOLS, temperature=0, max_tokens=80)
    message = first.choices[0].message
    messages = [
        *PARIS,
        message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": message.tool_calls[0].id, "content": "22 C and sunny"},
    ]
    second = sdk.chat.completions.create(model="tiny", messages=messages, tools=TOOLS, temperature=0, max_tokens=40)
    assert second.choices[0].message.content == "It is 22 C and sunny in Paris."
    assert second.choices[0].message.tool_calls is None
    assert second.choices[0].finish_reason == "stop"


def test_plain_text_beside_tools_is_content(tool_server):
    sdk = sdk_of(tool_server)
    body = dict(model="tiny", messages=[{"role": "user", "content": "Say hello."}], tools=TOOLS, temperature=0)
    whole = sdk.chat.completions.create(max_tokens=40, **body)
    assert whole.choices[0].message.content == "Hello! How can I help you today?"
    assert whole.choices[0].message.tool_calls is None and whole.choices[0].finish_reason == "stop"
    stream = streamed(sdk, max_tokens=40, **body)
    assert stream["content"] == "Hello! How can I help you today?" and stream["calls"] == []


def test_parallel_calls_and_one_call_only(tool_server):
    sdk = sdk_of(tool_server)
    both = [{"role": "user", "content": "What is the weather in Paris and in Rome?"}]
    body = dict(model="tiny", messages=both, tools=TOOLS, temperature=0, max_tokens=120)
    whole = sdk.chat.completions.create(**body)
    assert calls_of(whole.choices[0].message) == [("get_weather", {"city": "Paris"}), ("get_weather", {"city": "Rome"})]
    stream = streamed(sdk, **body)
    assert stream["calls"] == [("get_weather", {"city": "Paris"}), ("get_weather", {"city": "Rome"})]
    assert len(set(stream["ids"])) == 2
    # parallel_tool_calls false: the grammar ends the reply after its first call.
    one = sdk.chat.completions.create(parallel_tool_calls=False, **body)
    assert calls_of(one.choices[0].message) == [("get_weather", {"city": "Paris"})]
    assert one.choices[0].finish_reason == "tool_calls"


def test_a_call_cut_by_max_tokens_is_no_call(tool_server):
    """finish_reason length, and neither a half call nor its tag anywhere."""
    sdk = sdk_of(tool_server)
    for tokens in (3, 12):
        whole = sdk.chat.completions.create(model="tiny", messages=PARIS, tools=TOOLS, temperature=0, max_tokens=tokens)
        choice = whole.choices[0]
        assert choice.finish_reason == "length" and choice.message.tool_calls is None
        assert not (choice.message.content or "").strip()
        stream = streamed(sdk, model="tiny", messages=PARIS, tools=TOOLS, temperature=0, max_tokens=tokens)
        assert stream["finish"] == "length" and stream["calls"] == [] and not stream["content"].strip()


def test_tool_choice_none_renders_no_tools(tool_server):
    sdk = sdk_of(tool_server)
    whole = sdk.chat.completions.create(
        model="tiny", messages=PARIS, tools=TOOLS, tool_choice="none", temperature=0, max_tokens=20
    )
    assert whole.choices[0].message.tool_calls is None and whole.choices[0].finish_reason != "tool_calls"


def test_n_choices_each_call(tool_server):
    sdk = sdk_of(tool_server)
    whole = sdk.chat.completions.create(model="tiny", messages=PARIS, tools=TOOLS, temperature=0, max_tokens=80, n=3)
    assert [calls_of(c.message) for c in whole.choices] == [[("get_weather", {"city": "Paris"})]] * 3
    assert len({c.message.tool_calls[0].id for c in whole.choices}) == 3


def test_reasoning_is_split_off(live_server, tool_backends):
    """<think>...</think> goes to reasoning_content, whole and streamed; the content is the rest."""
    backend = tool_backends("torch", "hermes")
    sdk = sdk_of(live_server(lambda: backend, model="tiny"))
    body = dict(
        model="tiny", messages=[{"role": "user", "content": "Think, then greet me."}], temperature=0, max_tokens=40
    )
    whole = sdk.chat.completions.create(tools=TOOLS, **body)  # memorized with the tools in its prompt
    message = whole.choices[0].message
    assert message.content == "Hello there!"
    assert message.model_extra["reasoning_content"] == "A greeting is asked for."
    stream = streamed(sdk, tools=TOOLS, **body)
    assert stream["content"] == "Hello there!" and stream["reasoning"] == "A greeting is asked for."


# -- required and named: valid by construction, whatever the weights ----------------------------

ORDER = {
    "type": "object",
    "properties": {
        "item": {"type": "string", "enum": ["tea", "coffee"]},
        "count": {"type": "integer", "minimum": 1, "maximum": 9},
    },
    "required": ["item", "count"],
    "additionalProperties": False,
}
CHOICE_TOOLS = [
    {"type": "function", "function": {"name": "order", "parameters": ORDER}},
    {
        "type": "function",
        "function": {"name": "cancel", "parameters": {"type": "object", "additionalProperties": False}},
    },
]


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "order"}}])
def test_forced_calls_always_parse_and_validate(tool_server, tool_choice):
    """Tools the tiny models never saw: whatever they would write, the grammar makes the call."""
    sdk = sdk_of(tool_server)
    body = dict(
        model="tiny",
        messages=[{"role": "user", "content": "Two teas, please."}],
        tools=CHOICE_TOOLS,
        tool_choice=tool_choice,
        max_tokens=100,
        parallel_tool_calls=False,
    )
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in CHOICE_TOOLS}
    for seed in range(3):
        whole = sdk.chat.completions.create(temperature=1.0, seed=seed, **body)
        choice = whole.choices[0]
        assert choice.finish_reason == "tool_calls", choice
        [(name, arguments)] = calls_of(choice.message)
        assert name in (schemas if tool_choice == "required" else ["order"])
        jsonschema.validate(arguments, schemas[name])
    stream = streamed(sdk, temperature=0, **body)
    assert stream["finish"] == "tool_calls" and len(stream["calls"]) == 1
    jsonschema.validate(stream["calls"][0][1], schemas[stream["calls"][0][0]])


@pytest.fixture
def server(live_server, backend):
    return live_server(lambda: backend, model="tiny")


PICK = {
    "type": "object",
    "properties": {"n": {"type": "integer", "minimum": 1, "maximum": 9}},
    "required": ["n"],
    "additionalProperties": False,
}


def test_a_template_without_tools_gets_the_default_block(server, backend):
    """The demo model (Phi-2's dialogue format, no template): the default tools block in its
    prompt, and a forced call under the grammar; the deprecated functions/function_call alike."""
    pick = ToolUse([{"name": "pick", "parameters": PICK}], "auto", True)
    plan = backend.chat_plan(ChatRequest([{"role": "user", "content": "Pick."}], pick))
    assert "# Tools" in plan.prompt and '"name": "pick"' in plan.prompt
    messages = [{"role": "user", "content": "Pick."}]
    for fields in (
        {"tools": [{"type": "function", "function": {"name": "pick", "parameters": PICK}}], "tool_choice": "required"},
        {"functions": [{"name": "pick", "parameters": PICK}], "function_call": {"name": "pick"}},
    ):
        body = {"messages": messages, "max_tokens": 60, "parallel_tool_calls": False, **fields}
        status, answer = post(server, "/v1/chat/completions", body)
        assert status == 200, answer
        choice = answer["choices"][0]
        assert choice["finish_reason"] == "tool_calls", choice
        [call] = choice["message"]["tool_calls"]
        assert call["function"]["name"] == "pick"
        jsonschema.validate(json.loads(call["function"]["arguments"]), PICK)


# -- bad input: a 400 naming the field ----------------------------------------------------------


@pytest.mark.parametrize(
    ("change", "param"),
    [
        ({"tool_choice": {"type": "function", "function": {"name": "nowhere"}}}, "tool_choice"),
        ({"tool_choice": "sometimes"}, "tool_choice"),
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"$ref": "#/$defs/x"}}}]}, "tools"),
        ({"tools": [{"type": "retrieval", "function": {"name": "f"}}]}, "tools[0].type"),
        ({"tools": [TOOLS[0], TOOLS[0]]}, "tools"),
        ({"tools": [{"type": "function", "function": {"name": "f</tool_call>"}}]}, "tools[0].function.name"),
        ({"tool_choice": "required", "tools": None}, "tool_choice"),
        ({"response_format": {"type": "json_object"}}, "response_format"),
        ({"functions": [TOOL]}, "functions"),
        (
            {"messages": [*PARIS, {"role": "tool", "tool_call_id": "call_x", "content": "22 C"}]},
            "messages[1].tool_call_id",
        ),
        ({"messages": [*PARIS, {"role": "tool", "content": "22 C"}]}, "messages[1].tool_call_id"),
        (
            {
                "messages": [
                    *PARIS,
                    {"role": "assistant", "tool_calls": [{"id": "c", "function": {"name": "f", "arguments": "{x"}}]},
                ]
            },
            "messages[1].tool_calls[0].function.arguments",
        ),
    ],
)
def test_bad_tool_input_is_a_400_naming_it(server, change, param):
    body = {"messages": PARIS, "tools": TOOLS, "max_tokens": 8, **change}
    status, answer = post(server, "/v1/chat/completions", {k: v for k, v in body.items() if v is not None})
    assert status == 400, answer
    assert answer["error"]["param"] == param, answer


# -- other clients ------------------------------------------------------------------------------


@pytest.fixture
def hermes_server(live_server, tool_backends):
    backend = tool_backends("torch", "hermes")
    return live_server(lambda: backend, max_batch=4, model="tiny")


def test_litellm_tool_calls(hermes_server):
    litellm = pytest.importorskip("litellm")
    answer = litellm.completion(
        model="openai/tiny",
        api_base=hermes_server.url + "/v1",
        api_key="unused",
        messages=PARIS,
        tools=TOOLS,
        temperature=0,
        max_tokens=80,
    )
    assert calls_of(answer.choices[0].message) == [("get_weather", {"city": "Paris"})]
    assert answer.choices[0].finish_reason == "tool_calls"


def test_langchain_bind_tools(hermes_server):
    from langchain_core.messages import ToolMessage
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI

    @tool
    def get_weather(city: str) -> str:
        """The weather in a city now"""
        return "22 C and sunny"

    chat = ChatOpenAI(base_url=hermes_server.url + "/v1", api_key="unused", model="tiny", temperature=0, max_tokens=80)
    bound = chat.bind_tools(TOOLS)  # the schema the tiny model memorized, in OpenAI's form
    reply = bound.invoke([("user", "What is the weather in Paris?")])
    assert [(c["name"], c["args"]) for c in reply.tool_calls] == [("get_weather", {"city": "Paris"})]
    streamed_reply = None
    for chunk in bound.stream([("user", "What is the weather in Paris?")]):
        streamed_reply = chunk if streamed_reply is None else streamed_reply + chunk
    assert [(c["name"], c["args"]) for c in streamed_reply.tool_calls] == [("get_weather", {"city": "Paris"})]
    result = ToolMessage(
        content=get_weather.invoke(reply.tool_calls[0]["args"]), tool_call_id=reply.tool_calls[0]["id"]
    )
    final = bound.invoke([("user", "What is the weather in Paris?"), reply, result])
    assert final.content == "It is 22 C and sunny in Paris."


def test_answers_with_calls_are_as_described(tool_server):
    """The whole answer with tool calls (content null, finish_reason tool_calls) against /openapi.json."""
    from test_openapi import call, conforms

    status, _, data = call(tool_server, "GET", "/openapi.json")
    document = json.loads(data)
    body = json.dumps({"messages": PARIS, "tools": TOOLS, "temperature": 0, "max_tokens": 80}).encode()
    status, media, data = call(tool_server, "POST", "/v1/chat/completions", body)
    assert status == 200 and json.loads(data)["choices"][0]["message"]["tool_calls"]
    conforms(document, "/v1/chat/completions", "POST", status, media, data)


def test_tokenize_renders_tools_as_chat_does(tool_server):
    """/tokenize with messages and tools: the ids a tool-calling chat's prompt has (its usage)."""
    status, counted = post(tool_server, "/tokenize", {"messages": PARIS, "tools": TOOLS})
    assert status == 200, counted
    plain = post(tool_server, "/tokenize", {"messages": PARIS})[1]
    assert counted["count"] > plain["count"]
    answer = sdk_of(tool_server).chat.completions.create(
        model="tiny", messages=PARIS, tools=TOOLS, temperature=0, max_tokens=80
    )
    assert answer.usage.prompt_tokens == counted["count"]
    status, error = post(tool_server, "/tokenize", {"prompt": "hi", "tools": TOOLS})
    assert status == 400 and error["error"]["param"] == "tools"


# -- Anthropic's Messages API: tools, tool_use blocks, tool_result ------------------------------

ANTHROPIC_TOOLS = [{"name": TOOL["name"], "description": TOOL["description"], "input_schema": TOOL["parameters"]}]


def test_anthropic_tool_use_create_stream_and_result(tool_server):
    import anthropic

    sdk = anthropic.Anthropic(base_url=tool_server.url, api_key="unused", max_retries=0)
    body = dict(model="tiny", max_tokens=80, messages=PARIS, tools=ANTHROPIC_TOOLS, extra_body={"temperature": 0})
    message = sdk.messages.create(**body)
    assert message.stop_reason == "tool_use"
    [block] = message.content
    assert block.type == "tool_use" and block.name == "get_weather" and block.input == {"city": "Paris"}
    assert block.id.startswith("toolu_")

    with sdk.messages.stream(**body) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_message()
    assert [(b.type, b.name, b.input) for b in final.content] == [("tool_use", "get_weather", {"city": "Paris"})]
    assert final.stop_reason == "tool_use"
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop" and "input_json" in kinds

    result = {"type": "tool_result", "tool_use_id": block.id, "content": "22 C and sunny"}
    turn = [*PARIS, {"role": "assistant", "content": [block.model_dump()]}, {"role": "user", "content": [result]}]
    second = sdk.messages.create(**{**body, "messages": turn, "max_tokens": 40})
    assert [b.text for b in second.content] == ["It is 22 C and sunny in Paris."]
    assert second.stop_reason == "end_turn"

    counted = sdk.messages.count_tokens(model="tiny", messages=PARIS, tools=ANTHROPIC_TOOLS)
    assert counted.input_tokens == message.usage.input_tokens + message.usage.cache_read_input_tokens


def test_anthropic_tool_choice_any_and_tool(server):
    import anthropic

    sdk = anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0)
    tools = [{"name": "pick", "input_schema": PICK}]
    for choice in ({"type": "any", "disable_parallel_tool_use": True}, {"type": "tool", "name": "pick"}):
        message = sdk.messages.create(
            model="tiny",
            max_tokens=100,
            messages=[{"role": "user", "content": "Pick."}],
            tools=tools,
            tool_choice=choice,
            extra_body={"temperature": 0},  # sampled, a tag spelled in small pieces takes more tokens
        )
        assert message.stop_reason == "tool_use", message
        [block] = [b for b in message.content if b.type == "tool_use"]
        jsonschema.validate(block.input, PICK)
    with pytest.raises(anthropic.BadRequestError) as raised:
        sdk.messages.create(
            model="tiny",
            max_tokens=8,
            messages=[{"role": "user", "content": "Pick."}],
            tools=tools,
            tool_choice={"type": "tool", "name": "nowhere"},
        )
    assert "nowhere" in str(raised.value)


@pytest.mark.parametrize("runtime", ["torch", "mlx"])
def test_anthropic_text_holds_no_reasoning(live_server, tool_backends, runtime):
    """A reasoning model's <think> text stays out of Anthropic's text blocks, whole and streamed,
    as it stays out of chat's content (thinking blocks are not given out yet)."""
    import anthropic

    backend = tool_backends(runtime, "hermes")
    server = live_server(lambda: backend, model="tiny")
    sdk = anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0)
    think = [{"role": "user", "content": "Think, then greet me."}]
    body = dict(model="tiny", max_tokens=40, messages=think, tools=ANTHROPIC_TOOLS, extra_body={"temperature": 0})
    message = sdk.messages.create(**body)
    assert [(b.type, b.text) for b in message.content] == [("text", "Hello there!")]
    assert message.stop_reason == "end_turn"
    with sdk.messages.stream(**body) as stream:
        final = stream.get_final_message()
    assert [(b.type, b.text) for b in final.content] == [("text", "Hello there!")]


# -- OpenAI's Responses API ---------------------------------------------------------------------

RESPONSE_TOOLS = [{"type": "function", **TOOL}]


def test_responses_create_stream_and_function_call_output(tool_server):
    sdk = sdk_of(tool_server)
    body = dict(model="tiny", input="What is the weather in Paris?", tools=RESPONSE_TOOLS, temperature=0)
    response = sdk.responses.create(max_output_tokens=80, **body)
    assert response.status == "completed"
    [call] = response.output
    assert (
        call.type == "function_call" and call.name == "get_weather" and json.loads(call.arguments) == {"city": "Paris"}
    )
    assert call.call_id.startswith("call_") and response.usage.output_tokens > 0

    with sdk.responses.stream(max_output_tokens=80, **body) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_response()
    assert [(o.type, o.name, json.loads(o.arguments)) for o in final.output] == [
        ("function_call", "get_weather", {"city": "Paris"})
    ]
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.completed"
    assert "response.function_call_arguments.delta" in kinds

    turn = [
        {"role": "user", "content": "What is the weather in Paris?"},
        call.model_dump(exclude_none=True),
        {"type": "function_call_output", "call_id": call.call_id, "output": "22 C and sunny"},
    ]
    second = sdk.responses.create(model="tiny", input=turn, tools=RESPONSE_TOOLS, temperature=0, max_output_tokens=40)
    assert second.output_text == "It is 22 C and sunny in Paris." and second.status == "completed"


def test_responses_text_streamed_adds_up(tool_server):
    sdk = sdk_of(tool_server)
    body = dict(model="tiny", input="Say hello.", tools=RESPONSE_TOOLS, temperature=0, max_output_tokens=40)
    whole = sdk.responses.create(**body)
    assert whole.output_text == "Hello! How can I help you today?"
    deltas = []
    with sdk.responses.stream(**body) as stream:
        for event in stream:
            if event.type == "response.output_text.delta":
                deltas.append(event.delta)
        final = stream.get_final_response()
    assert "".join(deltas) == final.output_text == whole.output_text
    cut = sdk.responses.create(**{**body, "max_output_tokens": 3})
    assert cut.status == "incomplete" and cut.incomplete_details.reason == "max_output_tokens"


def test_responses_on_the_demo_model(server):
    """instructions and a message list; text.format through the grammar; what is stateless or
    unknown is a 400 naming it."""
    sdk = sdk_of(server)
    response = sdk.responses.create(
        model="tiny",
        instructions="Answer briefly.",
        input=[{"role": "user", "content": [{"type": "input_text", "text": "What is two plus two?"}]}],
        temperature=0,
        max_output_tokens=16,
    )
    assert response.output[0].type == "message" and response.output_text
    schema = PICK
    shaped = sdk.responses.create(
        model="tiny",
        input="A number?",
        text={"format": {"type": "json_schema", "name": "n", "schema": schema}},
        temperature=0,
        max_output_tokens=40,
    )
    jsonschema.validate(json.loads(shaped.output_text), schema)
    for change, param in [
        ({"input": [{"type": "function_call_output", "call_id": "nowhere", "output": "x"}]}, "input[0].tool_call_id"),
        ({"text": {"format": {"type": "json_schema", "schema": {"$ref": "#/$defs/x"}}}}, "text.format.schema"),
        ({"tools": [{"type": "function"}]}, "tools[0].name"),
        ({"background": True}, "background"),
    ]:
        status, answer = post(server, "/v1/responses", {"input": "Hi", "max_output_tokens": 4, **change})
        assert status == 400 and answer["error"]["param"] == param, (change, answer)


def test_responses_answers_are_as_described(tool_server):
    from test_openapi import call, conforms

    document = json.loads(call(tool_server, "GET", "/openapi.json")[2])
    for text in ("What is the weather in Paris?", "Say hello."):
        body = json.dumps({"input": text, "tools": RESPONSE_TOOLS, "temperature": 0, "max_output_tokens": 80}).encode()
        status, media, data = call(tool_server, "POST", "/v1/responses", body)
        assert status == 200, data
        conforms(document, "/v1/responses", "POST", status, media, data)


# -- the formats, parsed as they stream (every split of the text gives the same pieces) ----------


def pieces_of(fmt: str, text: str, step: int, **options) -> tuple[list, bool]:
    from backends.chat.tools import FORMATS, ToolCallParser

    parser = ToolCallParser(FORMATS[fmt], {"get_weather", "f"}, **options)
    out = []
    for at in range(0, len(text), step):
        out += parser.feed(text[at : at + step])
    out += parser.finish()
    merged = []
    for piece in out:
        if merged and piece.kind != "call" and merged[-1][0] == piece.kind:
            merged[-1] = (piece.kind, merged[-1][1] + piece.text)
        else:
            merged.append(
                (piece.kind, piece.text)
                if piece.kind != "call"
                else ("call", piece.call.name, json.loads(piece.call.arguments))
            )
    return merged, parser.cut_call


PARIS_CALL = ("call", "get_weather", {"city": "Paris"})
ROME_CALL = ("call", "get_weather", {"city": "Rome"})


@pytest.mark.parametrize(
    ("fmt", "text", "expected"),
    [
        (
            "hermes",
            'Sure.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
            [("content", "Sure."), PARIS_CALL],
        ),
        ("hermes", "a < b, and <tool_ca is no tag", [("content", "a < b, and <tool_ca is no tag")]),
        (
            "llama3",
            '{"name": "get_weather", "parameters": {"city": "Paris"}}; '
            '{"name": "get_weather", "parameters": {"city": "Rome"}}',
            [PARIS_CALL, ROME_CALL],
        ),
        ("llama3", '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}', [PARIS_CALL]),
        ("llama3", "The answer is {x}.", [("content", "The answer is {x}.")]),
        (
            "mistral",
            '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}, '
            '{"name": "get_weather", "arguments": {"city": "Rome"}}]',
            [PARIS_CALL, ROME_CALL],
        ),
        (
            "phi4",
            'Calling.<|tool_call|>[{"name": "get_weather", "arguments": {"city": "Paris"}}]<|/tool_call|>',
            [("content", "Calling."), PARIS_CALL],
        ),
        # The closing tag's text inside an argument's string does not end the call.
        (
            "hermes",
            '<tool_call>\n{"name": "f", "arguments": {"text": "a </tool_call> b"}}\n</tool_call>\nDone.',
            [("call", "f", {"text": "a </tool_call> b"}), ("content", "Done.")],
        ),
        # Untagged: a whole reply that is a call to a known tool, fenced or not (what
        # Qwen2.5-Coder-1.5B answered Claude Code's prompt with); anything else stays text.
        (
            "hermes",
            '```json\n{\n  "name": "get_weather",\n  "arguments": {\n    "city": "Paris"\n  }\n}\n```',
            [PARIS_CALL],
        ),
        ("hermes", '{"name": "get_weather", "arguments": "{\\"city\\": \\"Paris\\"}"}', [PARIS_CALL]),
        (
            "phi4",
            '[{"name": "get_weather", "arguments": {"city": "Paris"}}, {"name": "f", "arguments": {}}]',
            [PARIS_CALL, ("call", "f", {})],
        ),
        ("hermes", '{"name": "unknown", "arguments": {}}', [("content", '{"name": "unknown", "arguments": {}}')]),
        ("hermes", '{"name": "Ann", "age": 3}', [("content", '{"name": "Ann", "age": 3}')]),
        (
            "hermes",
            '```json\n{"name": "f", "arguments": {}}\n```\nThis calls f.',
            [("content", '```json\n{"name": "f", "arguments": {}}\n```\nThis calls f.')],
        ),
        ("hermes", "```python\nprint(1)\n```", [("content", "```python\nprint(1)\n```")]),
    ],
)
def test_every_format_parses_whole_and_streamed(fmt, text, expected):
    for step in (1, 2, 5, len(text)):
        assert pieces_of(fmt, text, step) == (expected, False), step


def test_a_reply_that_cannot_be_an_untagged_call_streams_as_it_comes():
    """Held back only while the reply may still open an untagged call: a code fence of another
    language, or text, is given out before the reply ends."""
    from backends.chat.tools import FORMATS, ToolCallParser

    for start, held in (("```python\nprint(", False), ('```json\n{"na', True), ("Sure", False), ('{"name": "f"', True)):
        parser = ToolCallParser(FORMATS["hermes"], {"f"})
        given = "".join(piece.text for piece in parser.feed(start))
        assert (given == "") == held, (start, given)


def test_reasoning_and_cut_calls_parse_as_they_stream():
    text = "<think>\nWeather, so a call.\n</think>\n\nOne moment."
    for step in (1, 3, len(text)):
        assert pieces_of("hermes", text, step, reasoning=True) == (
            [("reasoning", "Weather, so a call."), ("content", "One moment.")],
            False,
        )
    # A template that opens <think> in the prompt: the reply starts inside it.
    assert pieces_of("hermes", "Hmm.\n</think>\nHi", 2, reasoning=True, thinking=True)[0] == [
        ("reasoning", "Hmm."),
        ("content", "Hi"),
    ]
    for cut in (
        '<tool_call>\n{"name": "get_wea',
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n<tool',
    ):
        pieces, cut_call = pieces_of("hermes", cut, 3)
        assert cut_call and all(p[0] == "call" for p in pieces), pieces


def test_the_format_is_read_from_the_template():
    from backends.chat.tools import detect_format, template_messages

    assert detect_format(None)[0].name == "hermes"
    assert detect_format("{% for tool in tools %}<tool_call>{% endfor %}") == (
        detect_format("x<tool_call>tools")[0],
        True,
    )
    assert detect_format("{{ '<|python_tag|>' }}{% if tools %}{% endif %}")[0].name == "llama3"
    assert detect_format("[AVAILABLE_TOOLS] {{ tools }}[TOOL_CALLS]")[0].name == "mistral"
    phi4 = "{% if 'tools' in message %}<|tool|>{{ message['tools'] }}<|/tool|>{% endif %}"
    fmt, knows = detect_format(phi4)
    assert fmt.name == "phi4" and knows
    rendered = template_messages([{"role": "user", "content": "Hi"}], [TOOL], True, fmt)
    assert rendered[0]["role"] == "system" and json.loads(rendered[0]["tools"])[0]["function"]["name"] == "get_weather"


@pytest.mark.parametrize("runtime", ["torch", "mlx"])
def test_anthropic_thinking_blocks(live_server, tool_backends, runtime):
    """With thinking asked for, a reasoning model's thought is a `thinking` block before its text,
    whole and streamed (the SDK folds the events), with a signature; sent back in the history,
    tampered or not, it is taken and not rendered."""
    import anthropic

    backend = tool_backends(runtime, "hermes")
    server = live_server(lambda: backend, model="tiny")
    sdk = anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0)
    think = [{"role": "user", "content": "Think, then greet me."}]
    body = dict(
        model="tiny",
        max_tokens=40,
        messages=think,
        tools=ANTHROPIC_TOOLS,
        thinking={"type": "enabled", "budget_tokens": 1024},
        extra_body={"temperature": 0},
    )
    message = sdk.messages.create(**body)
    assert [b.type for b in message.content] == ["thinking", "text"]
    assert message.content[0].thinking.strip() == "A greeting is asked for." and message.content[0].signature
    assert message.content[1].text == "Hello there!"
    with sdk.messages.stream(**body) as stream:
        final = stream.get_final_message()
    assert [b.model_dump() for b in final.content] == [b.model_dump() for b in message.content]
    thought = {**message.content[0].model_dump(), "signature": "tampered"}
    history = [*think, {"role": "assistant", "content": [thought, {"type": "text", "text": "Hello there!"}]}]
    again = sdk.messages.count_tokens(model="tiny", messages=[*history, {"role": "user", "content": "Hi"}])
    plain = [*think, {"role": "assistant", "content": "Hello there!"}, {"role": "user", "content": "Hi"}]
    assert again.input_tokens == sdk.messages.count_tokens(model="tiny", messages=plain).input_tokens


# -- arguments checked against the full schema, after the lenient grammar ------------------------

# `not` is beyond llguidance: the grammar leaves it out (lenient), so the call it makes (n 1 to 3)
# always breaks the full schema.
NEVER = {
    "type": "object",
    "properties": {"n": {"type": "integer", "minimum": 1, "maximum": 3, "not": {"enum": [1, 2, 3]}}},
    "required": ["n"],
    "additionalProperties": False,
}


def test_arguments_are_checked_against_the_full_schema(tool_server, log_dir):
    """A call that breaks its tool's full schema is still the answer, in each API's shape (agents
    check calls and tell the model); the request log names the tool and /metrics counts it."""
    import urllib.request

    from test_agents import logged

    tool_server.log_dir = log_dir
    chat = {
        "messages": PARIS,
        "tools": [{"type": "function", "function": {"name": "pick", "parameters": NEVER}}, *TOOLS],
        "tool_choice": {"type": "function", "function": {"name": "pick"}},
        "temperature": 0,
        "max_tokens": 40,
    }
    responses = {
        "input": "Pick.",
        "tools": [{"type": "function", "name": "pick", "parameters": NEVER}],
        "tool_choice": {"type": "function", "name": "pick"},
        "temperature": 0,
        "max_output_tokens": 40,
    }
    anthropic = {
        "model": "tiny",
        "messages": PARIS,
        "tools": [{"name": "pick", "input_schema": NEVER}],
        "tool_choice": {"type": "tool", "name": "pick"},
        "max_tokens": 40,
        "temperature": 0,
    }
    for path, body in [
        ("/v1/chat/completions", chat),
        ("/v1/chat/completions", {**chat, "stream": True}),
        ("/v1/responses", responses),
        ("/v1/responses", {**responses, "stream": True}),
        ("/v1/messages", anthropic),
    ]:
        status, answer, line = logged(tool_server, path, body, raw=body.get("stream", False))
        assert status == 200, answer
        assert line["tool_arguments_invalid"] == ["pick"], (path, line)
        if path == "/v1/chat/completions" and not body.get("stream"):
            [call] = answer["choices"][0]["message"]["tool_calls"]
            assert json.loads(call["function"]["arguments"])["n"] in (1, 2, 3)
            assert answer["choices"][0]["finish_reason"] == "tool_calls"
    status, answer, line = logged(
        tool_server, "/v1/chat/completions", {**chat, "tools": TOOLS, "tool_choice": "required", "max_tokens": 80}
    )
    assert status == 200 and answer["choices"][0]["message"]["tool_calls"]
    assert "tool_arguments_invalid" not in line, "a call that follows its schema is not named"
    with urllib.request.urlopen(tool_server.url + "/metrics") as response:
        metrics = response.read().decode()
    assert "phi2_tool_arguments_invalid_total 5.0" in metrics
