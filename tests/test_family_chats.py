"""The families' own chat templates on the three chat APIs, on both runtimes: tiny models with a
family's template and special tokens that memorized a few replies (backends/tiny.py
write_tiny_chat). Gemma 3's template has no system role (a system turn's text opens the first
user turn) and closes a turn with <end_of_turn>, which its config need not name as an end of text.
"""

from __future__ import annotations

import json

import pytest

from backends.choose import load_backend
from backends.contract import LoadOptions
from backends.torch.tiny import CHAT_DIALOGUES, CHAT_FAMILIES, write_tiny_chat

SERVED = [(runtime, family) for family in sorted(CHAT_FAMILIES) for runtime in ("torch", "mlx")]


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
