"""POST /tokenize and /detokenize (vLLM's shapes, llama.cpp's `content` too): the ids are the
ones generation uses for the same prompt or chat, and bad input is a 400 naming its field."""

from __future__ import annotations

import pytest

MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there"}]


async def test_a_prompt_gives_the_ids_generation_counts(client, backend):
    prompt = "The quick brown fox"
    answer = await (await client.post("/tokenize", json={"prompt": prompt})).json()
    info = await (await client.get("/model/info")).json()
    assert answer["tokens"] == backend.encode(prompt)
    assert answer["count"] == len(answer["tokens"])
    assert answer["max_model_len"] == info["context_length"]
    generated = await (await client.post("/generate", json={"prompt": prompt, "max_tokens": 1})).json()
    assert generated["prompt_tokens"] == answer["count"]
    assert "token_strs" not in answer


async def test_a_chat_gives_the_ids_chat_completions_counts(client):
    name = (await (await client.get("/v1/models")).json())["data"][0]["id"]  # a served name is accepted
    answer = await (await client.post("/tokenize", json={"messages": MESSAGES, "model": name})).json()
    chat = await (await client.post("/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 1})).json()
    assert answer["count"] == chat["usage"]["prompt_tokens"] == len(answer["tokens"])


async def test_llama_cpp_content_token_strings_and_the_round_trip(client, backend):
    text = "Once upon a time"
    answer = await (await client.post("/tokenize", json={"content": text, "return_token_strs": True})).json()
    assert answer["tokens"] == backend.encode(text)
    assert "".join(answer["token_strs"]) == text
    back = await (await client.post("/detokenize", json={"tokens": answer["tokens"]})).json()
    assert back == {"prompt": text}
    assert await (await client.post("/detokenize", json={"tokens": []})).json() == {"prompt": ""}


@pytest.mark.parametrize(
    "path, body, field",
    [
        ("/tokenize", {}, "prompt"),
        ("/tokenize", {"prompt": "a", "messages": MESSAGES}, "prompt"),
        ("/tokenize", {"prompt": "a", "content": "a"}, "prompt"),
        ("/tokenize", {"prompt": 5}, "prompt"),
        ("/tokenize", {"prompt": "a", "add_special_tokens": True}, "add_special_tokens"),
        ("/tokenize", {"messages": MESSAGES, "add_generation_prompt": False}, "add_generation_prompt"),
        ("/tokenize", {"messages": [{"role": "user"}]}, "messages[0].content"),
        ("/tokenize", {"prompt": "a", "model": "not-served"}, "model"),
        ("/detokenize", {}, "tokens"),
        ("/detokenize", {"tokens": [1, -1]}, "tokens[1]"),
        ("/detokenize", {"tokens": [10**9]}, "tokens"),
        ("/detokenize", {"tokens": "abc"}, "tokens"),
    ],
)
async def test_bad_input_is_a_400_naming_its_field(client, path, body, field):
    response = await client.post(path, json=body)
    error = (await response.json())["error"]
    assert response.status == (404 if field == "model" else 400), error
    assert error["param"] == field, error
    assert set(error) == {"message", "type", "param", "code"}  # OpenAI's shape, as vLLM answers


async def test_the_routes_need_a_key_when_keys_are_set(make_client, backend):
    client = await make_client(lambda: backend, api_key="k1")
    assert (await client.post("/tokenize", json={"prompt": "a"})).status == 401
    headers = {"Authorization": "Bearer k1"}
    assert (await client.post("/tokenize", json={"prompt": "a"}, headers=headers)).status == 200
    assert (await client.post("/detokenize", json={"tokens": [1]}, headers=headers)).status == 200
