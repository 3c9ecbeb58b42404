"""The families' own chat templates on the three chat APIs, on both runtimes: tiny models with a
family's template and special tokens that memorized a few replies (backends/torch/tiny.py
write_tiny_chat). Gemma 3's template has no system role (a system turn's text opens the first
user turn) and closes a turn with <end_of_turn>, which its config need not name as an end of text.
Gemma 4's calls are in its own notation (backends/chat/gemma4.py) and its reasoning in a thought
channel: each API returns them as it returns any family's calls and reasoning.
"""

from __future__ import annotations

import json

import pytest

from backends.choose import load_backend
from backends.contract import LoadOptions
from backends.torch.tiny import CHAT_DIALOGUES, CHAT_FAMILIES, TOOL, chat_dialogues, write_tiny_chat

SERVED = [(runtime, "gemma3_text") for runtime in ("torch", "mlx")]


@pytest.fixture(scope="module")
def chat_paths(tmp_path_factory):
    root = tmp_path_factory.mktemp("chats")
    return {family: write_tiny_chat(root / family, family) for family in CHAT_FAMILIES}


@pytest.fixture(scope="module", params=SERVED, ids=[f"{r}-{f}" for r, f in SERVED])
def chat_backend(request, chat_paths):
    runtime, family = request.param
    if runtime == "mlx":
        pytest.importorskip("mlx_lm")
    return load_backend(runtime, LoadOptions(model=str(chat_paths[family]), dtype="float32", warmup=False))


def test_the_templates_turn_end_ends_a_reply(chat_backend):
    tokenizer = chat_backend.text.tokenizer
    end = tokenizer.convert_tokens_to_ids("<end_of_turn>")
    assert end in chat_backend.eos_token_ids
    assert tokenizer.eos_token_id != end  # not the configs': the template's


def test_a_system_turn_opens_the_first_user_turn(chat_backend):
    from backends.chat.plan import ChatRequest

    messages, _ = CHAT_DIALOGUES[0]
    plan = chat_backend.chat_plan(ChatRequest(messages=messages))
    assert (
        plan.prompt
        == "<bos><start_of_turn>user\nAnswer in one line.\n\nSay hello.<end_of_turn>\n<start_of_turn>model\n"
    )


def sse_events(text: str) -> list[dict]:
    return [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: {")]


@pytest.mark.parametrize("dialogue", range(len(CHAT_DIALOGUES)))
async def test_each_api_answers_as_the_model_replied(make_client, chat_backend, dialogue):
    messages, reply = CHAT_DIALOGUES[dialogue]
    client = await make_client(lambda: chat_backend, max_batch=4, model="m")
    body = {"model": "m", "messages": messages, "temperature": 0, "max_tokens": 40}
    response = await client.post("/v1/chat/completions", json=body)
    whole = await response.json()
    assert response.status == 200, whole
    assert whole["choices"][0]["message"]["content"] == reply
    assert whole["choices"][0]["finish_reason"] == "stop"
    streamed = await (await client.post("/v1/chat/completions", json={**body, "stream": True})).text()
    chunks = sse_events(streamed)
    assert "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"]) == reply
    system = [m["content"] for m in messages if m["role"] == "system"]
    turns = [m for m in messages if m["role"] != "system"]
    responses = {"model": "m", "input": turns, "temperature": 0, "max_output_tokens": 40}
    answer = await (
        await client.post("/v1/responses", json={**responses, "instructions": "\n".join(system) or None})
    ).json()
    texts = [part["text"] for item in answer["output"] if item["type"] == "message" for part in item["content"]]
    assert texts == [reply] and answer["status"] == "completed"
    anthropic = {
        "model": "m",
        "messages": turns,
        "max_tokens": 40,
        "temperature": 0,
        **({"system": system[0]} if system else {}),
    }
    answer = await (await client.post("/v1/messages", json=anthropic)).json()
    assert [block["text"] for block in answer["content"]] == [reply]
    assert answer["stop_reason"] == "end_turn"


GEMMA4 = [(runtime, "gemma4_text") for runtime in ("torch", "mlx")]
TOOLS = [{"type": "function", "function": TOOL}]


@pytest.fixture(scope="module", params=GEMMA4, ids=[f"{r}-{f}" for r, f in GEMMA4])
def gemma4_client_backend(request, chat_paths):
    runtime, family = request.param
    if runtime == "mlx":
        pytest.importorskip("mlx_lm")
    return load_backend(runtime, LoadOptions(model=str(chat_paths[family]), dtype="float32", warmup=False))


def test_gemma4s_format_is_chosen_from_its_template(gemma4_client_backend):
    chat = gemma4_client_backend.text.chat
    assert chat.tool_format.name == "gemma4" and chat.template_knows_tools
    assert chat.reasoning and chat.think == ("<|channel>thought", "<channel|>")


async def test_gemma4s_calls_and_reasoning_on_each_api(make_client, gemma4_client_backend):
    call, thought, hello = chat_dialogues("gemma4_text")
    client = await make_client(lambda: gemma4_client_backend, max_batch=4, model="m")

    async def chat(messages, **extra):
        body = {"model": "m", "messages": messages, "tools": TOOLS, "temperature": 0, "max_tokens": 40, **extra}
        response = await client.post("/v1/chat/completions", json=body)
        assert response.status == 200, await response.text()
        return response

    whole = (await (await chat(call[0])).json())["choices"][0]
    assert whole["finish_reason"] == "tool_calls" and not whole["message"].get("content")
    (made,) = whole["message"]["tool_calls"]
    assert made["function"]["name"] == "get_weather" and json.loads(made["function"]["arguments"]) == {"city": "Paris"}
    chunks = sse_events(await (await chat(call[0], stream=True)).text())
    deltas = [c["choices"][0]["delta"] for c in chunks if c["choices"]]
    streamed = [t for d in deltas for t in d.get("tool_calls") or []]
    assert streamed[0]["function"]["name"] == "get_weather"
    assert json.loads("".join(t["function"].get("arguments") or "" for t in streamed)) == {"city": "Paris"}
    forced = (await (await chat(hello[0], tool_choice="required")).json())["choices"][0]
    assert forced["message"]["tool_calls"][0]["function"]["name"] == "get_weather"  # the grammar made a call
    json.loads(forced["message"]["tool_calls"][0]["function"]["arguments"])
    reasoned = (await (await chat(thought[0])).json())["choices"][0]["message"]
    assert reasoned["reasoning_content"] == "A greeting is asked for." and reasoned["content"] == "Hello there!"

    responses = {"model": "m", "input": call[0], "tools": [{"type": "function", **TOOL}], "temperature": 0}
    answer = await (await client.post("/v1/responses", json={**responses, "max_output_tokens": 40})).json()
    calls = [item for item in answer["output"] if item["type"] == "function_call"]
    assert [(c["name"], json.loads(c["arguments"])) for c in calls] == [("get_weather", {"city": "Paris"})]
    tool = {"name": TOOL["name"], "description": TOOL["description"], "input_schema": TOOL["parameters"]}
    anthropic = {"model": "m", "messages": call[0], "tools": [tool], "max_tokens": 40, "temperature": 0}
    answer = await (await client.post("/v1/messages", json=anthropic)).json()
    uses = [block for block in answer["content"] if block["type"] == "tool_use"]
    assert [(u["name"], u["input"]) for u in uses] == [("get_weather", {"city": "Paris"})]
    assert answer["stop_reason"] == "tool_use"
    anthropic = {**anthropic, "messages": thought[0], "thinking": {"type": "adaptive"}}
    answer = await (await client.post("/v1/messages", json=anthropic)).json()
    assert [b["type"] for b in answer["content"]] == ["thinking", "text"]
    assert (
        answer["content"][0]["thinking"] == "A greeting is asked for."
        and answer["content"][1]["text"] == "Hello there!"
    )
