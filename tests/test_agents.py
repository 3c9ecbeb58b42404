"""What the agent CLIs send (issue 53), replayed: Claude Code's and Codex CLI's own requests,
captured from the real CLIs (tests/data/agents/README.md says how), against the real app on the
tiny Hermes tool model, both runtimes.

The captured prompts are written for models of 200k tokens; the tiny model has 1,024, so each
body is shrunk (`shrunk`): long texts cut and a few tools kept, every field and shape as sent.
The real CLIs themselves, against a real model, are in tests/test_agent_clis.py."""

from __future__ import annotations

import asyncio
import copy
import json
import time
import uuid
from pathlib import Path

import jsonschema
import pytest
from conftest import post
from fakes import Gate, GatedBackend
from test_request_log import read_log

from backends.chat.plan import ChatFormat, ChatRequest, folded_system
from backends.contract import ChatError
from backends.torch.tiny import TOOL
from phi2_server import SETTINGS, Settings, create_app

AGENTS = Path(__file__).parent / "data" / "agents"
CUT = 24  # characters kept of a long text
# The tools kept of the default sets: the shapes that matter (propertyNames, format, const, ...).
KEPT = {"Bash", "TaskCreate", "WebFetch", "exec_command", "multi_agent_v1", "spawn_agent", "web_search"}
SERVED = [("torch", 4), ("mlx", 1)]


def captured(name: str) -> dict:
    return json.loads((AGENTS / f"{name}.json").read_text(encoding="utf-8"))


def shrunk(body: dict, model: str) -> dict:
    """`body` with its model named as served, texts cut to CUT characters, and only KEPT tools
    (a kept namespace keeps one function)."""

    def cut(value, key=None):
        if isinstance(value, str) and key in ("text", "content", "description", "system", "output"):
            return value[:CUT]
        if isinstance(value, list):
            return [cut(item, key) for item in value]
        if isinstance(value, dict):
            return {k: cut(v, k) for k, v in value.items()}
        return value

    body = cut(copy.deepcopy(body))
    tools = [t for t in body.get("tools", []) if (t.get("name") or t.get("type")) in KEPT]
    for tool in tools:
        if tool.get("type") == "namespace":
            tool["tools"] = [t for t in tool["tools"] if t["name"] in KEPT]
    if "tools" in body:
        body["tools"] = tools
    return {**body, "model": model}


def sse(data: bytes) -> list[tuple[str | None, dict]]:
    """(event, data) of each server-sent event, comment lines (keep-alives) left out."""
    events = []
    for block in data.decode().strip().split("\n\n"):
        lines = [line for line in block.splitlines() if not line.startswith(":")]
        kind = next((line[7:] for line in lines if line.startswith("event: ")), None)
        payload = "".join(line[6:] for line in lines if line.startswith("data: "))
        if payload and payload != "[DONE]":
            events.append((kind, json.loads(payload)))
    return events


def logged(server, path: str, body: dict, raw: bool = False) -> tuple[int, object, dict]:
    """POST, then the request's own log line (found by the request id it sent): written once the
    answer has gone, so waited for (the deadline only turns a hang into a failure)."""
    request_id = uuid.uuid4().hex
    status, answer = post(server, path, body, raw=raw, headers={"X-Request-Id": request_id})
    deadline = time.monotonic() + 60
    while not (mine := [line for line in read_log(server.log_dir) if line["request_id"] == request_id]):
        assert time.monotonic() < deadline, "no log line"
        time.sleep(0.005)
    return status, answer, mine[0]


@pytest.fixture(scope="module", params=SERVED, ids=[f"{r}-batch{b}" for r, b in SERVED])
def agent_server(request, tool_backends, tmp_path_factory):
    from conftest import LiveServer

    from phi2_server import Settings, create_app

    runtime, batch = request.param
    backend = tool_backends(runtime, "hermes")
    log_dir = tmp_path_factory.mktemp("logs")
    settings = Settings(log_dir=str(log_dir), shutdown_grace=1.0, max_batch=batch, model="smollm2")
    server = LiveServer(create_app(settings, load=lambda: backend))
    server.log_dir = log_dir
    yield server
    server.close()


CAPTURES = [
    "claude_code_first",
    "claude_code_tool_result",
    "claude_code_short_first",
    "claude_code_short_tool_result",
    "claude_code_title",
    "codex_first",
    "codex_tool_result",
    "codex_short_first",
]


@pytest.mark.parametrize("name", CAPTURES)
def test_each_captured_request_is_answered(agent_server, name):
    """Each request as its CLI sent it (shrunk): a 200 and a whole event stream in its API's
    shape, what the server ignored named in the request log line."""
    request = captured(name)
    body = shrunk(request["body"], "smollm2")
    status, raw, line = logged(agent_server, request["path"], body, raw=True)
    assert status == 200, raw[:500]
    events = sse(raw)
    if request["path"].startswith("/v1/messages"):
        assert events[0][0] == "message_start" and events[-1][0] == "message_stop", events[-2:]
        if "context_management" in body:
            assert "context_management" in line["ignored"]
        assert int(line["max_tokens_granted"]) < body["max_tokens"]  # 32,000 asked: clipped to the room left
    else:
        assert events[-1][1]["type"] in ("response.completed", "response.incomplete"), events[-1]  # sampled
        assert "client_metadata" in line["ignored"]


def test_fields_that_mean_nothing_here_change_nothing(agent_server):
    """Claude Code's short request, greedy, with and without what this server ignores or does
    not use on a model that does not reason: the same answer."""
    body = {**shrunk(captured("claude_code_short_first")["body"], "smollm2"), "stream": False, "temperature": 0}
    plain = {k: v for k, v in body.items() if k not in ("context_management", "metadata", "thinking", "output_config")}
    plain["system"] = [{k: v for k, v in block.items() if k != "cache_control"} for block in body["system"]]
    status, with_fields = post(agent_server, "/v1/messages", body)
    assert status == 200, with_fields
    status, without = post(agent_server, "/v1/messages", plain)
    assert status == 200, without
    # Its thinking ("adaptive") gives a thought out as a thinking block, where it is left out without.
    assert [b for b in with_fields["content"] if b["type"] != "thinking"] == without["content"]


def test_a_schema_keyword_the_grammar_lacks_does_not_refuse_the_tools(agent_server):
    """Claude Code's TaskCreate takes `metadata` as a zod record (`propertyNames`), which
    llguidance cannot express: the grammar leaves it out, and a forced call still follows the
    rest of the schema."""
    tools = [t for t in captured("claude_code_first")["body"]["tools"] if t["name"] == "TaskCreate"]
    assert "propertyNames" in json.dumps(tools[0]["input_schema"])
    body = {
        "model": "smollm2",
        "max_tokens": 200,
        "messages": [{"role": "user", "content": "Make a task."}],
        "tools": [{**tools[0], "description": tools[0]["description"][:CUT]}],
        "tool_choice": {"type": "tool", "name": "TaskCreate"},
        "temperature": 0,  # sampled, a string may run past max_tokens, and a call cut short is no call
    }
    status, answer = post(agent_server, "/v1/messages", body)
    assert status == 200, answer
    (call,) = [block for block in answer["content"] if block["type"] == "tool_use"]
    schema = {k: v for k, v in tools[0]["input_schema"].items() if k != "$schema"}
    jsonschema.validate(call["input"], schema)


def test_hosted_tools_are_skipped_and_namespaces_offered(agent_server):
    """Codex's tools: a namespace's functions are offered as functions (a forced call names one),
    web_search (which OpenAI runs itself) is skipped and logged; so are Anthropic's server tools."""
    body = shrunk(captured("codex_tool_result")["body"], "smollm2")
    # Greedy: sampled, a string argument may run past max tokens, and a call cut short is no call.
    body = {**body, "stream": False, "temperature": 0, "tool_choice": {"type": "function", "name": "spawn_agent"}}
    status, answer, line = logged(agent_server, "/v1/responses", body)
    assert status == 200, answer
    assert [item["name"] for item in answer["output"] if item["type"] == "function_call"][:1] == ["spawn_agent"]
    assert line["tools_skipped"] == ["web_search"]
    server_tool = {"type": "web_search_20250305", "name": "web_search", "max_uses": 5}
    message = {"model": "smollm2", "max_tokens": 4, "messages": [{"role": "user", "content": "Hi"}]}
    status, answer, line = logged(agent_server, "/v1/messages", {**message, "tools": [server_tool]})
    assert status == 200, answer
    assert line["tools_skipped"] == ["web_search_20250305"]


def test_output_config_format_is_structured_output(agent_server):
    """Claude Code's title request asks for JSON through output_config.format: it gets JSON of
    that schema."""
    title = shrunk(captured("claude_code_title")["body"], "smollm2")
    body = {**title, "stream": False, "max_tokens": 64, "temperature": 0}  # greedy: whole within 64 tokens
    status, answer = post(agent_server, "/v1/messages", body)
    assert status == 200, answer
    title = json.loads(answer["content"][0]["text"])
    jsonschema.validate(title, body["output_config"]["format"]["schema"])


def test_system_turns_anywhere(tool_backends):
    """A developer turn is a system turn where the template knows no `developer` role; a system
    turn mid-conversation stays where a template writes it (ChatML) and is folded into the first
    system turn where the template refuses it."""
    backend = tool_backends("torch", "hermes")
    chat = [
        {"role": "developer", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
        {"role": "system", "content": "Agents: none."},
        {"role": "user", "content": "Go"},
    ]
    prompt = backend.chat_plan(ChatRequest(chat)).prompt
    assert "developer" not in prompt
    assert prompt.index("Be brief.") < prompt.index("Hi") < prompt.index("Agents: none.") < prompt.index("Go")
    assert folded_system(chat[1:]) == [
        {"role": "system", "content": "Agents: none."},
        {"role": "user", "content": "Hi"},
        {"role": "user", "content": "Go"},
    ]
    tokenizer = copy.deepcopy(backend.text.tokenizer)
    tokenizer.chat_template = (
        "{% for m in messages %}{% if m['role'] == 'system' and not loop.first %}"
        "{{ raise_exception('system only first') }}{% endif %}"
        "<{{ m['role'] }}>{{ m['content'] }}{% endfor %}<assistant>"
    )
    folded = ChatFormat(tokenizer).plan(ChatRequest(chat)).prompt
    assert folded == "<system>Be brief.\n\nAgents: none.<user>Hi<user>Go<assistant>"
    tokenizer.chat_template = "{{ raise_exception('no chat today') }}"  # a refusal is the request's 400
    with pytest.raises(ChatError, match="no chat today"):
        ChatFormat(tokenizer).plan(ChatRequest(chat))


async def test_a_stream_is_never_silent_before_its_first_token(make_client, backend):
    """While no token has come (a gate holds every sequence before its first, as a long prompt's
    prefill would), each stream sends its headers and its protocol's keep-alive; once released,
    the stream goes on whole."""
    gate = Gate(after=0)
    client = await make_client(lambda: GatedBackend(backend, gate), stream_keepalive=0.05)
    hello = [{"role": "user", "content": "Hi"}]
    model = client.app[SETTINGS].model
    cases = [  # path, body, its keep-alive, the first line of its last event (one of)
        (
            "/v1/messages",
            {"model": model, "max_tokens": 4, "messages": hello},
            b'"delta": {"type": "text_delta", "text": ""}}',  # a message event: Claude Code's watchdog counts those
            [b"event: message_stop"],
        ),  # noqa: E501
        ("/v1/chat/completions", {"max_tokens": 4, "messages": hello}, b": keep-alive\n\n", [b"data: [DONE]"]),
        (
            "/v1/responses",
            {"max_output_tokens": 4, "input": "Hi"},
            b'event: response.in_progress\ndata: {"type": "response.in_progress", "sequence_number": 2',
            [b"event: response.completed", b"event: response.incomplete"],
        ),
    ]
    responses = []
    for path, body, keepalive, _ in cases:
        response = await client.post(path, json={**body, "stream": True})
        assert response.status == 200  # the headers came while the gate holds the token
        await asyncio.wait_for(response.content.readuntil(keepalive), 60)  # the deadline: a hang fails
        responses.append(response)
    native = await client.post("/generate/stream", json={"prompt": "Hi", "max_tokens": 4})
    assert native.status == 200 and native.headers["Content-Type"].startswith("application/x-ndjson")
    assert not gate.released
    gate.release()
    for (_, _, _, ends), response in zip(cases, responses, strict=True):
        last = (await response.read()).strip().split(b"\n\n")[-1]
        assert last.split(b"\n")[0] in ends, last
    assert json.loads((await native.read()).splitlines()[-1])["done"] is True


def test_reasoning_switches_reach_the_template(agent_server):
    """Anthropic's thinking, OpenAI's reasoning_effort and vLLM's chat_template_kwargs all reach
    the chat template as Qwen3's reads them (enable_thinking: off opens and closes an empty
    thought); a model that reasons then gives no reasoning."""
    hello = [{"role": "user", "content": "Think, then greet me."}]

    def tokens(body: dict) -> int:
        status, answer = post(agent_server, "/tokenize", {"messages": hello, **body})
        assert status == 200, answer
        return answer["count"]

    plain = tokens({})
    off = tokens({"chat_template_kwargs": {"enable_thinking": False}})
    assert off > plain
    assert tokens({"reasoning_effort": "none"}) == off and tokens({"reasoning_effort": "high"}) == plain

    def counted(thinking: dict | None) -> int:
        body = {"model": "smollm2", "messages": hello, **({"thinking": thinking} if thinking else {})}
        status, answer = post(agent_server, "/v1/messages/count_tokens", body)
        assert status == 200, answer
        return answer["input_tokens"]

    assert counted({"type": "disabled"}) > counted(None) == counted({"type": "adaptive"})
    # As the model memorized it: with its tool offered.
    chat = {"messages": hello, "max_tokens": 40, "temperature": 0, "tools": [{"type": "function", "function": TOOL}]}
    status, thought = post(agent_server, "/v1/chat/completions", chat)
    assert thought["choices"][0]["message"]["reasoning_content"].strip() == "A greeting is asked for."
    status, unthought = post(agent_server, "/v1/chat/completions", {**chat, "reasoning_effort": "none"})
    assert status == 200 and not unthought["choices"][0]["message"].get("reasoning_content")


async def test_chat_template_kwargs_default_and_override(make_client, tool_backends):
    """CHAT_TEMPLATE_KWARGS is every request's; a request's own lay over it; a bad one stops the start."""
    client = await make_client(
        lambda: tool_backends("torch", "hermes"), chat_template_kwargs='{"enable_thinking": false}'
    )
    hello = {"messages": [{"role": "user", "content": "Hi"}]}

    async def count(body: dict) -> int:
        return (await (await client.post("/tokenize", json={**hello, **body})).json())["count"]

    off, on = await count({}), await count({"chat_template_kwargs": {"enable_thinking": True}})
    assert off > on
    with pytest.raises(ValueError, match="CHAT_TEMPLATE_KWARGS"):
        create_app(Settings(chat_template_kwargs="[1]"))


def test_hostile_template_kwargs_are_a_400_and_hurt_nobody(agent_server):
    """chat_template_kwargs naming the renderer's own parameters (tokenize, chat_template,
    add_generation_prompt, messages ...) or making the template raise are a 400 naming the
    reason, on every chat route; a greedy request sent beside them gets its usual answer."""
    from concurrent.futures import ThreadPoolExecutor

    hello = [{"role": "user", "content": "Say hello."}]
    chat = {"messages": hello, "max_tokens": 12, "temperature": 0}
    status, before = post(agent_server, "/v1/chat/completions", chat)
    assert status == 200
    hostile = [
        {"tokenize": True},
        {"chat_template": "{{ raise_exception('x') }}"},
        {"add_generation_prompt": False},
        {"messages": 1},
        {"tools": "x"},
        {"continue_final_message": True},
        {"conversations": []},  # the names transformers' renderer takes its arguments by: a 500 before
        {"self": 1},
    ]
    bodies = [("/v1/chat/completions", {**chat, "chat_template_kwargs": kw}) for kw in hostile]
    bodies += [("/v1/responses", {"input": "Hi", "chat_template_kwargs": kw}) for kw in hostile]
    bodies += [("/tokenize", {"messages": hello, "chat_template_kwargs": kw}) for kw in hostile]
    with ThreadPoolExecutor(4) as pool:
        beside = pool.submit(lambda: [post(agent_server, "/v1/chat/completions", chat) for _ in range(3)])
        answers = list(pool.map(lambda pair: post(agent_server, *pair), bodies))
    for (path, body), (status, answer) in zip(bodies, answers, strict=True):
        assert status == 400, (path, body, answer)
        assert "chat_template_kwargs may not set" in answer["error"]["message"], answer
        assert "chat_template_kwargs" in (answer["error"].get("param"), answer["error"].get("field")), answer
    assert all(status == 200 and answer["choices"] == before["choices"] for status, answer in beside.result())


def test_broken_reasoning_tool_and_embedding_values_are_4xx_and_hurt_nobody(agent_server):
    """The fields and routes issues 53 and 55 added, sent broken or hostile: a thinking budget
    that is no integer or below -1, an effort that is no string, Anthropic's budget_tokens below
    0, a custom tool whose Lark grammar names a rule it lacks, embeddings of nothing, of an empty
    string, of an id past the vocabulary, or cut to a size the model does not have. Each is a 4xx
    with an error; greedy chats sent beside them on the same server get their usual answer."""
    from concurrent.futures import ThreadPoolExecutor

    hello = [{"role": "user", "content": "Say hello."}]
    chat = {"messages": hello, "max_tokens": 12, "temperature": 0}
    status, before = post(agent_server, "/v1/chat/completions", chat)
    assert status == 200
    lark = {"type": "grammar", "grammar": {"syntax": "lark", "definition": "start: nowhere"}}
    broken_tool = {"type": "custom", "custom": {"name": "calc", "format": lark}}
    bodies = [
        ("/v1/chat/completions", {**chat, "thinking_token_budget": "lots"}),
        ("/v1/chat/completions", {**chat, "thinking_token_budget": -2}),
        ("/v1/chat/completions", {**chat, "reasoning_effort": 5}),
        ("/v1/chat/completions", {**chat, "tools": [broken_tool], "tool_choice": "required"}),
        ("/v1/responses", {"input": "Hi", "thinking_token_budget": [1]}),
        (
            "/v1/messages",
            {
                "model": "smollm2",
                "max_tokens": 8,
                "messages": hello,
                "thinking": {"type": "enabled", "budget_tokens": -1},
            },
        ),
        ("/v1/embeddings", {"input": []}),
        ("/v1/embeddings", {"input": [""]}),
        ("/v1/embeddings", {"input": [[10**12]]}),
        ("/v1/embeddings", {"input": "Hi", "dimensions": 3}),
    ]
    with ThreadPoolExecutor(4) as pool:
        beside = pool.submit(lambda: [post(agent_server, "/v1/chat/completions", chat) for _ in range(3)])
        answers = list(pool.map(lambda pair: post(agent_server, *pair), bodies))
    for (path, body), (status, answer) in zip(bodies, answers, strict=True):
        assert 400 <= status < 500 and answer.get("error"), (path, body, status, answer)
    assert all(status == 200 and answer["choices"] == before["choices"] for status, answer in beside.result())


@pytest.mark.parametrize("runtime", ["torch", "mlx"])
async def test_first_tool_choice_forces_the_turn_that_answers_the_user(make_client, tool_backends, runtime, log_dir):
    """FIRST_TOOL_CHOICE=required: tools offered with tool_choice auto (sent or by default) get a
    call where the model answers the user ("Say hello.", which it answers in text unforced), on
    the three APIs; answering a tool result the model is free (its memorized text), so an
    agent's loop ends; none stays the request's. Unset, nothing changes; a bad value stops the
    start."""
    tools = [{"type": "function", "function": TOOL}]
    # A call takes ~60 of the tiny model's tokens; calls completed before a cut are given out.
    hello = {"messages": [{"role": "user", "content": "Say hello."}], "tools": tools, "max_tokens": 160}
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    answered = {
        "messages": [
            {"role": "user", "content": "What is the weather in Paris?"},
            {"role": "assistant", "content": "", "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "call_1", "content": "22 C and sunny"},
        ],
        "tools": tools,
        "max_tokens": 40,
    }

    async def chat(client, body: dict) -> dict:
        response = await client.post("/v1/chat/completions", json={**body, "temperature": 0})
        assert response.status == 200, await response.text()
        return (await response.json())["choices"][0]["message"]

    def called(calls: list[dict] | None) -> bool:
        return bool(calls) and all(c["function"]["name"] == "get_weather" for c in calls)

    plain = await make_client(lambda: tool_backends(runtime, "hermes"))
    assert (await chat(plain, hello))["content"] == "Hello! How can I help you today?"
    with pytest.raises(ValueError, match="FIRST_TOOL_CHOICE"):
        create_app(Settings(first_tool_choice="any"))

    client = await make_client(lambda: tool_backends(runtime, "hermes"), first_tool_choice="required", model="tiny")
    for body in (hello, {**hello, "tool_choice": "auto"}):
        message = await chat(client, body)
        assert called(message.get("tool_calls")), message
    assert (await chat(client, {**hello, "tool_choice": "none"})).get("tool_calls") is None
    assert (await chat(client, answered))["content"] == "It is 22 C and sunny in Paris."
    lines = [line for line in read_log(log_dir) if line["path"] == "/v1/chat/completions"]
    assert [line.get("tool_choice") for line in lines[-4:]] == ["required", "required", None, None]

    response = await client.post(
        "/v1/responses",
        json={
            "input": "Say hello.",
            "tools": [{"type": "function", **TOOL}],
            "max_output_tokens": 160,
            "temperature": 0,
        },
    )
    output = (await response.json())["output"]
    assert output and all(item["type"] == "function_call" and item["name"] == "get_weather" for item in output), output

    tool = {"name": TOOL["name"], "description": TOOL["description"], "input_schema": TOOL["parameters"]}
    anthropic = {"model": "tiny", "max_tokens": 160, "temperature": 0, "tools": [tool]}
    response = await client.post(
        "/v1/messages", json={**anthropic, "messages": [{"role": "user", "content": "Say hello."}]}
    )
    content = (await response.json())["content"]
    assert content and all(block["type"] == "tool_use" and block["name"] == "get_weather" for block in content), content
    use = {"type": "tool_use", "id": "call_1", "name": "get_weather", "input": {"city": "Paris"}}
    turns = [
        {"role": "user", "content": "What is the weather in Paris?"},
        {"role": "assistant", "content": [use]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "call_1", "content": "22 C and sunny"}]},
    ]
    response = await client.post("/v1/messages", json={**anthropic, "messages": turns})
    assert (await response.json())["content"] == [{"type": "text", "text": "It is 22 C and sunny in Paris."}]
    # Claude Code sends text beside a tool result (its reminders): still a turn answering the result.
    turns[-1]["content"].append({"type": "text", "text": "<system-reminder>Be brief.</system-reminder>"})
    response = await client.post("/v1/messages", json={**anthropic, "messages": turns})
    assert response.status == 200
    lines = [line for line in read_log(log_dir) if line["path"] == "/v1/messages"]
    assert [line.get("tool_choice") for line in lines] == ["required", None, None]
