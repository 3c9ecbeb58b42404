"""What real OpenAI clients send and expect, beyond plain completions (issue 15): logprobs, echo,
token-id and listed prompts, n and best_of, the sampling options, tolerance of the fields and
nulls clients send, OpenAI's context-overflow error, model names. On both runtimes, batched."""

from __future__ import annotations

import json
import threading
import urllib.error
import urllib.request

import openai
import pytest
import torch
from conftest import post


@pytest.fixture
def server(live_server, backend, tiny_path):
    return live_server(lambda: backend, model=str(tiny_path))


@pytest.fixture
def sdk(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def model_of(server) -> str:
    from phi2_server import SETTINGS

    return server.app[SETTINGS].model


def sse_events(server, path: str, body: dict) -> list[dict]:
    request = urllib.request.Request(
        server.url + path,
        data=json.dumps({**body, "stream": True}).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request) as response:
        lines = response.read().decode().splitlines()
    data = [line.removeprefix("data: ") for line in lines if line.startswith("data: ")]
    assert data[-1] == "[DONE]"
    return [json.loads(d) for d in data[:-1]]


@pytest.fixture(scope="session")
def hf_logprobs(tiny_path):
    """log-softmax of transformers' own float32 forward: the model's distribution at every position."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_path, dtype=torch.float32).eval()

    def logprobs(ids: list[int]) -> torch.Tensor:
        with torch.inference_mode():
            return torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1)

    return logprobs


# -- tolerance of what clients send ------------------------------------------------------------------


def test_multi_turn_with_the_returned_message_appended(sdk, server):
    """The SDK's own message object, model_dump()ed back into messages (refusal, annotations,
    audio, tool_calls ... as null), with the fields clients add that a local server ignores."""
    messages = [{"role": "user", "content": "How are you today?"}]
    first = sdk.chat.completions.create(model=openai.NOT_GIVEN, messages=messages, max_tokens=8, temperature=0)
    dumped = first.choices[0].message.model_dump()
    assert {"refusal", "annotations", "audio", "tool_calls", "function_call"} <= set(dumped)
    messages += [dumped, {"role": "user", "content": "And you?"}]
    second = sdk.chat.completions.create(
        model=openai.NOT_GIVEN,
        messages=messages,
        max_tokens=8,
        temperature=0,
        store=False,
        metadata={"run": "7"},
        service_tier="auto",
        parallel_tool_calls=False,
        user="me",
        extra_body={"audio": None, "prediction": None, "stream_options": None, "model": None, "seed": None},
    )
    assert second.choices[0].finish_reason in ("stop", "length")
    streamed = sdk.chat.completions.create(
        model=str(model_of(server)),
        messages=messages,
        max_tokens=8,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True, "include_obfuscation": False},
    )
    text = "".join(c.choices[0].delta.content or "" for c in streamed if c.choices)
    assert text == second.choices[0].message.content


@pytest.mark.parametrize(
    "path, body",
    [
        ("/v1/completions", {"prompt": "The quick", "max_tokens": 4.0, "seed": 7.0, "n": 1.0, "temperature": 0}),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4.0, "seed": 7.0, "temperature": 0},
        ),
        ("/generate", {"prompt": "The quick", "max_tokens": 4.0, "seed": 7.0, "top_k": 5.0}),
    ],
)
def test_integral_floats_count_as_integers(server, path, body):
    status, answer = post(server, path, body)
    assert status == 200, answer
    tokens = answer["usage"]["completion_tokens"] if path.startswith("/v1") else answer["tokens_used"]
    assert tokens <= 4


@pytest.mark.parametrize(
    "body, param",
    [
        ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
        (
            {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
            "messages[0].content[0].type",
        ),
        ({"messages": [{"role": "user"}]}, "messages[0].content"),
        ({"logit_bias": {"99999": 5}}, "logit_bias"),
        ({"logit_bias": {"a": 5}}, "logit_bias"),
        ({"logit_bias": {"5": 101}}, "logit_bias.5"),
        ({"max_tokens": 2.5}, "max_tokens"),
    ],
)
def test_what_cannot_be_done_is_a_400_naming_it(server, body, param):
    status, answer = post(server, "/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], **body})
    assert status == 400, answer
    assert answer["error"]["param"] == param, answer


# -- errors and names ----------------------------------------------------------------------------------


def test_context_overflow_is_openai_s_error(server):
    long_prompt = "The quick brown fox " * 200
    status, answer = post(server, "/v1/chat/completions", {"messages": [{"role": "user", "content": long_prompt}]})
    assert status == 400
    error = answer["error"]
    assert (error["code"], error["param"], error["type"]) == (
        "context_length_exceeded",
        "messages",
        "invalid_request_error",
    )
    assert error["message"].startswith("This model's maximum context length is 512 tokens. However, you requested")
    status, answer = post(server, "/generate", {"prompt": long_prompt})
    assert (status, answer["error"]["field"]) == (422, "prompt")  # the native API keeps its own shape


def test_litellm_raises_context_window_exceeded(server):
    litellm = pytest.importorskip("litellm")
    with pytest.raises(litellm.ContextWindowExceededError):
        litellm.completion(
            model="openai/" + model_of(server),
            api_base=server.url + "/v1",
            api_key="unused",
            messages=[{"role": "user", "content": "The quick brown fox " * 200}],
            max_tokens=4,
            num_retries=0,
        )


def test_models_retrieve_and_aliases(live_server, backend, tiny_path):
    server = live_server(lambda: backend, model=str(tiny_path), served_model_name="phi-2, tiny-phi")
    sdk = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    assert [m.id for m in sdk.models.list().data] == ["phi-2", "tiny-phi"]
    assert sdk.models.retrieve("tiny-phi").id == "tiny-phi"
    with pytest.raises(openai.NotFoundError):
        sdk.models.retrieve(str(tiny_path))  # with aliases, only they are served names
    answer = sdk.completions.create(model="tiny-phi", prompt="The quick", max_tokens=2)
    assert answer.model == "tiny-phi"
    with pytest.raises(openai.NotFoundError) as raised:
        sdk.completions.create(model="gpt-4o", prompt="The quick", max_tokens=2)
    assert raised.value.body["code"] == "model_not_found"


def test_models_retrieve_a_path_like_name(sdk, server):
    assert sdk.models.retrieve(model_of(server)).id == model_of(server)


# -- prompts, n, best_of -------------------------------------------------------------------------------


def test_prompt_lists_and_token_ids(server, backend):
    prompts = ["The quick brown", "Alice: How are you"]
    status, listed = post(server, "/v1/completions", {"prompt": prompts, "max_tokens": 6, "temperature": 0})
    assert status == 200
    assert [c["index"] for c in listed["choices"]] == [0, 1]
    for prompt, choice in zip(prompts, listed["choices"], strict=False):
        _, alone = post(server, "/v1/completions", {"prompt": prompt, "max_tokens": 6, "temperature": 0})
        assert choice["text"] == alone["choices"][0]["text"]
        _, as_ids = post(
            server, "/v1/completions", {"prompt": backend.encode(prompt), "max_tokens": 6, "temperature": 0}
        )
        assert as_ids["choices"][0]["text"] == choice["text"]
    _, id_lists = post(
        server, "/v1/completions", {"prompt": [backend.encode(p) for p in prompts], "max_tokens": 6, "temperature": 0}
    )
    assert [c["text"] for c in id_lists["choices"]] == [c["text"] for c in listed["choices"]]
    assert listed["usage"]["prompt_tokens"] == sum(len(backend.encode(p)) for p in prompts)
    status, answer = post(server, "/v1/completions", {"prompt": [5, backend.vocab_size], "max_tokens": 2})
    assert (status, answer["error"]["param"]) == (400, "prompt")


def test_n_choices_are_seeded_one_by_one(sdk):
    body = dict(model=openai.NOT_GIVEN, prompt="Once upon", max_tokens=8, temperature=1.5, seed=11)
    together = sdk.completions.create(n=3, **body)
    assert [c.index for c in together.choices] == [0, 1, 2]
    assert together.usage.prompt_tokens == 2  # the prompt counts once
    for i, choice in enumerate(together.choices):  # choice i is the request with seed + i
        alone = sdk.completions.create(**{**body, "seed": 11 + i})
        assert choice.text == alone.choices[0].text
    chat = sdk.chat.completions.create(
        model=openai.NOT_GIVEN, messages=[{"role": "user", "content": "Hi"}], n=2, max_tokens=4, temperature=1.0, seed=3
    )
    assert [c.index for c in chat.choices] == [0, 1]


def test_best_of_returns_the_most_likely(server):
    body = {"prompt": "Once upon", "max_tokens": 6, "temperature": 1.5, "seed": 4}
    status, best = post(server, "/v1/completions", {**body, "best_of": 4, "n": 2, "logprobs": 0})
    assert status == 200 and len(best["choices"]) == 2
    candidates = []
    for i in range(4):
        _, one = post(server, "/v1/completions", {**body, "seed": 4 + i, "logprobs": 0})
        lps = one["choices"][0]["logprobs"]["token_logprobs"]
        candidates.append((sum(lps) / len(lps), one["choices"][0]["text"]))
    expected = [text for _, text in sorted(candidates, reverse=True)[:2]]
    assert [c["text"] for c in best["choices"]] == expected
    status, answer = post(server, "/v1/completions", {**body, "best_of": 2, "n": 3})
    assert (status, answer["error"]["param"]) == (400, "best_of")


# -- logprobs --------------------------------------------------------------------------------------------


def test_completion_logprobs_are_the_model_s(server, backend, hf_logprobs):
    prompt = "The quick brown"
    status, answer = post(
        server, "/v1/completions", {"prompt": prompt, "max_tokens": 5, "temperature": 0, "logprobs": 3}
    )
    assert status == 200
    logprobs = answer["choices"][0]["logprobs"]
    ids = backend.encode(prompt)
    generated = backend.encode(prompt + answer["choices"][0]["text"])[len(ids) :]
    reference = hf_logprobs(ids + generated)
    assert "".join(logprobs["tokens"]) == answer["choices"][0]["text"]
    for i, (token_id, logprob, top) in enumerate(
        zip(generated, logprobs["token_logprobs"], logprobs["top_logprobs"], strict=False)
    ):
        expected = reference[len(ids) + i - 1]
        assert logprob == pytest.approx(float(expected[token_id]), abs=1e-4)
        assert 3 <= len(top) <= 4  # the 3 most likely, and the chosen one
        assert max(top.values()) == pytest.approx(float(expected.max()), abs=1e-4)
    assert logprobs["text_offset"][0] == len(prompt)  # offsets count from the prompt's start


def test_echo_scores_the_prompt_as_lm_eval_asks(server, backend, hf_logprobs):
    """lm-eval's loglikelihood request: token ids, echo, logprobs 1, max_tokens 1 (and the legacy
    score-only max_tokens 0)."""
    ids = [backend.encode("Alice: What is two plus two?"), backend.encode("The quick brown fox jumps")]
    for max_tokens in (1, 0):
        status, answer = post(
            server,
            "/v1/completions",
            {"prompt": ids, "echo": True, "logprobs": 1, "max_tokens": max_tokens, "temperature": 0, "seed": 1234},
        )
        assert status == 200, answer
        for prompt_ids, choice in zip(ids, sorted(answer["choices"], key=lambda c: c["index"]), strict=False):
            logprobs = choice["logprobs"]
            assert len(logprobs["tokens"]) == len(prompt_ids) + max_tokens
            assert logprobs["token_logprobs"][0] is None and logprobs["top_logprobs"][0] is None
            reference = hf_logprobs(prompt_ids)
            for position, token_id in enumerate(prompt_ids[1:], start=1):
                assert logprobs["token_logprobs"][position] == pytest.approx(
                    float(reference[position - 1, token_id]), abs=1e-4
                )
                greedy = float(reference[position - 1].max())
                assert max(logprobs["top_logprobs"][position].values()) == pytest.approx(greedy, abs=1e-4)
            assert choice["text"].startswith(backend.decode(prompt_ids))
        assert answer["usage"]["completion_tokens"] == max_tokens * len(ids)


def test_streamed_logprobs_equal_the_whole_ones(server):
    body = {"prompt": "Alice: How are you", "max_tokens": 8, "temperature": 0, "logprobs": 2, "echo": True}
    _, whole = post(server, "/v1/completions", body)
    chunks = sse_events(server, "/v1/completions", body)
    tokens, token_logprobs, offsets = [], [], []
    for chunk in chunks:
        logprobs = chunk["choices"][0]["logprobs"]
        if logprobs:
            tokens += logprobs["tokens"]
            token_logprobs += logprobs["token_logprobs"]
            offsets += logprobs["text_offset"]
    expected = whole["choices"][0]["logprobs"]
    assert tokens == expected["tokens"]
    assert token_logprobs == pytest.approx(expected["token_logprobs"], abs=1e-5)
    assert offsets == expected["text_offset"]
    assert "".join(c["choices"][0]["text"] for c in chunks) == whole["choices"][0]["text"]


def test_chat_logprobs_whole_and_streamed(sdk):
    body = dict(
        model=openai.NOT_GIVEN,
        messages=[{"role": "user", "content": "How are you today?"}],
        max_tokens=8,
        temperature=0,
        logprobs=True,
        top_logprobs=3,
    )
    whole = sdk.chat.completions.create(**body)
    content = whole.choices[0].logprobs.content
    assert "".join(t.token for t in content).strip() == whole.choices[0].message.content.strip()
    for entry in content:
        assert len(entry.top_logprobs) == 3
        assert [t.logprob for t in entry.top_logprobs] == sorted((t.logprob for t in entry.top_logprobs), reverse=True)
        assert entry.top_logprobs[0].logprob >= entry.logprob - 1e-6
        assert bytes(entry.bytes).decode("utf-8", "replace") == entry.token or entry.token.startswith("bytes:")
    streamed = [c for c in sdk.chat.completions.create(**body, stream=True) if c.choices and c.choices[0].logprobs]
    entries = [e for c in streamed for e in c.choices[0].logprobs.content]
    assert [(e.token, round(e.logprob, 4)) for e in entries] == [(e.token, round(e.logprob, 4)) for e in content]
    no_logprobs = sdk.chat.completions.create(**{**body, "logprobs": False, "top_logprobs": openai.NOT_GIVEN})
    assert no_logprobs.choices[0].logprobs is None


def test_native_logprobs(server):
    body = {"prompt": "The quick brown", "max_tokens": 6, "logprobs": 2}
    status, whole = post(server, "/generate", body)
    assert status == 200
    assert "".join(e["token"] for e in whole["logprobs"]) == whole["text"]
    assert all(len(e["top"]) == 2 and e["top"][0]["logprob"] >= e["logprob"] - 1e-6 for e in whole["logprobs"])
    request = urllib.request.Request(server.url + "/generate/stream", data=json.dumps(body).encode())
    with urllib.request.urlopen(request) as response:
        lines = [json.loads(line) for line in response.read().decode().splitlines()]
    streamed = [e for line in lines[:-1] for e in line["logprobs"]]
    assert [e["id"] for e in streamed] == [e["id"] for e in whole["logprobs"]]
    _, plain = post(server, "/generate", {"prompt": "The quick brown", "max_tokens": 6})
    assert "logprobs" not in plain


# -- sampling ------------------------------------------------------------------------------------------


def transformers_greedy(tiny_path, prompt_ids: list[int], n: int, **processing) -> list[int]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_path)
    model = AutoModelForCausalLM.from_pretrained(tiny_path, dtype=torch.float32).eval()
    decodable = len(tokenizer)

    def mask_undecodable(input_ids, scores):
        scores[:, decodable:] = float("-inf")
        return scores

    with torch.inference_mode():
        out = model.generate(
            torch.tensor([prompt_ids]),
            max_new_tokens=n,
            do_sample=False,
            pad_token_id=tokenizer.eos_token_id,
            logits_processor=[mask_undecodable],
            **processing,
        )
    return out[0, len(prompt_ids) :].tolist()


def test_penalties_and_bias_match_transformers(server, backend, tiny_path):
    prompt = "The sea is wide and deep and"
    ids = backend.encode(prompt)
    for options, processing in [
        ({"repetition_penalty": 1.8}, {"repetition_penalty": 1.8}),
        (
            {"logit_bias": {str(backend.encode(" blue")[0]): -100}},
            {"sequence_bias": {tuple(backend.encode(" blue")[:1]): -100.0}},
        ),
    ]:
        expected = transformers_greedy(tiny_path, ids, 10, **processing)
        status, answer = post(server, "/generate", {"prompt": prompt, "max_tokens": 10, "logprobs": 0, **options})
        assert status == 200, answer
        assert [e["id"] for e in answer["logprobs"]] == expected, options  # end-of-text included, where generate stops
    _, plain = post(server, "/generate", {"prompt": prompt, "max_tokens": 10, "logprobs": 0})
    assert [e["id"] for e in plain["logprobs"]] == transformers_greedy(tiny_path, ids, 10)


def test_presence_and_frequency_penalties_change_a_repetitive_reply(server):
    """Past its trained sentence the tiny model repeats " a time"; the penalties steer it off."""
    body = {"prompt": "Once upon", "max_tokens": 24, "temperature": 0, "ignore_eos": True}
    _, plain = post(server, "/v1/completions", body)
    _, penalized = post(server, "/v1/completions", {**body, "frequency_penalty": 2, "presence_penalty": 2})
    assert plain["choices"][0]["text"].endswith("one token at a time.\ufffd a time.\ufffd")
    assert penalized["choices"][0]["text"] != plain["choices"][0]["text"]


def test_a_seed_reproduces_inside_a_full_batch(server):
    """Every sampling option at once, alone and beside other requests: the same text."""
    body = {
        "prompt": "Once upon",
        "max_tokens": 12,
        "temperature": 1.3,
        "top_k": 40,
        "top_p": 0.95,
        "min_p": 0.02,
        "repetition_penalty": 1.2,
        "presence_penalty": 0.5,
        "frequency_penalty": 0.3,
        "seed": 99,
    }
    _, alone = post(server, "/generate", body)
    results = {}

    def run(i):
        results[i] = post(server, "/generate", body if i == 0 else {**body, "seed": 1000 + i, "prompt": "Alice: Hi"})[1]

    threads = [threading.Thread(target=run, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results[0]["text"] == alone["text"]


def test_top_k_one_is_greedy(server):
    _, greedy = post(server, "/generate", {"prompt": "Once upon", "max_tokens": 10})
    _, top1 = post(
        server, "/generate", {"prompt": "Once upon", "max_tokens": 10, "temperature": 1.5, "top_k": 1, "seed": 5}
    )
    assert top1["text"] == greedy["text"]


def test_langchain_chat_model(server):
    from langchain_openai import ChatOpenAI

    chat = ChatOpenAI(
        model=model_of(server),
        base_url=server.url + "/v1",
        api_key="unused",
        max_retries=0,
        temperature=0,
        max_tokens=8,
    )
    whole = chat.invoke("How are you today?")
    streamed = "".join(chunk.content for chunk in chat.stream("How are you today?"))
    assert whole.content and streamed == whole.content
    scored = chat.bind(logprobs=True, top_logprobs=2).invoke("How are you today?")
    assert len(scored.response_metadata["logprobs"]["content"]) == whole.usage_metadata["output_tokens"]


def test_streamed_choices_carry_their_index(server):
    """Several prompts and choices in one stream: each choice's chunks, in order, make the same
    text as the whole answer; every choice ends once; usage comes last."""
    body = {
        "prompt": ["Once upon", "The quick brown"],
        "n": 2,
        "max_tokens": 6,
        "temperature": 0.9,
        "seed": 8,
        "stream_options": {"include_usage": True},
    }
    _, whole = post(server, "/v1/completions", body)
    chunks = sse_events(server, "/v1/completions", body)
    texts, ends = {}, []
    for chunk in chunks[:-1]:
        (choice,) = chunk["choices"]
        texts[choice["index"]] = texts.get(choice["index"], "") + choice["text"]
        if choice["finish_reason"]:
            ends.append(choice["index"])
    assert sorted(ends) == [0, 1, 2, 3]
    assert texts == {c["index"]: c["text"] for c in whole["choices"]}
    tokens = (
        "prompt_tokens",
        "completion_tokens",
        "total_tokens",
    )  # cached_tokens: the second request reuses the first's prompts
    assert chunks[-1]["choices"] == [] and [chunks[-1]["usage"][k] for k in tokens] == [
        whole["usage"][k] for k in tokens
    ]
    chat = sse_events(
        server, "/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "n": 3, "max_tokens": 4}
    )
    roles = [c["choices"][0]["index"] for c in chat if c["choices"][0]["delta"].get("role")]
    finished = [c["choices"][0]["index"] for c in chat if c["choices"][0]["finish_reason"]]
    assert roles == [0, 1, 2] and sorted(finished) == [0, 1, 2]
