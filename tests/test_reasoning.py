"""Reasoning controls (issue 53): a thinking budget that is enforced, and a grammar that holds
after the thought, on a model that thinks in <think> tags, through the three chat APIs, whole
and streamed, on both runtimes.

The tiny Hermes tool model (backends.torch.tiny) memorized one reply that reasons first:
"<think>\\nA greeting is asked for.\\n</think>\\n\\nHello there!". Its tokenizer has <think>
and </think> as tokens, as Qwen3's has. A budget of N tokens must cut that thought after its
first N tokens (then </think> is forced, and the reply goes on)."""

from __future__ import annotations

import json

import anthropic
import openai
import pytest
from conftest import post

from backends.torch.tiny import TOOL

THINK = [{"role": "user", "content": "Think, then greet me."}]
THOUGHT = "A greeting is asked for."  # as memorized, between "<think>\n" and "\n</think>"
TOOLS = [{"type": "function", "function": TOOL}]  # as the reply was memorized: with its tool offered
ANTHROPIC_TOOLS = [{"name": TOOL["name"], "description": TOOL["description"], "input_schema": TOOL["parameters"]}]
RESPONSES_TOOLS = [{"type": "function", **TOOL}]


def cut(backend, budget: int) -> str:
    """The memorized thought's first `budget` tokens, as text."""
    ids = backend.encode("\n" + THOUGHT + "\n")
    assert len(ids) > budget + 2, "the thought must be longer than the budgets tried"
    return backend.decode(ids[:budget]).strip()


@pytest.fixture(params=["torch", "mlx"])
def served(request, live_server, tool_backends):
    backend = tool_backends(request.param, "hermes")
    return backend, live_server(lambda: backend, model="tiny")


def chat(server, **body) -> dict:
    """The choice, its usage beside it."""
    body = {"messages": THINK, "tools": TOOLS, "max_tokens": 40, "temperature": 0, **body}
    status, answer = post(server, "/v1/chat/completions", body)
    assert status == 200, answer
    return {**answer["choices"][0], "usage": answer["usage"]}


@pytest.mark.parametrize("budget", [0, 3])
def test_budget_cuts_the_thought_on_chat(served, budget):
    """thinking_token_budget (vLLM's name) ends the reasoning after its tokens, whole and
    streamed alike (the openai SDK folds the stream); the reply goes on after it, its content
    free of the tags. Without a budget (or -1) the thought is whole."""
    backend, server = served
    whole = chat(server)["message"]
    assert whole["reasoning_content"].strip() == THOUGHT and whole["content"] == "Hello there!"
    assert chat(server, thinking_token_budget=-1)["message"] == whole
    choice = chat(server, thinking_token_budget=budget)
    assert (choice["message"].get("reasoning_content") or "").strip() == cut(backend, budget)
    assert choice["usage"]["completion_tokens_details"]["reasoning_tokens"] == budget
    assert "think>" not in (choice["message"]["content"] or "")
    sdk = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    stream = sdk.chat.completions.create(
        model="tiny",
        messages=THINK,
        tools=TOOLS,
        max_tokens=40,
        temperature=0,
        stream=True,
        extra_body={"thinking_token_budget": budget},
    )
    reasoning, content = "", ""
    for chunk in stream:
        if chunk.choices:
            delta = chunk.choices[0].delta.model_dump()
            reasoning += delta.get("reasoning_content") or ""
            content += delta.get("content") or ""
    assert reasoning.strip() == cut(backend, budget) and content == (choice["message"]["content"] or "")


def test_effort_and_server_default(served, live_server, tool_backends):
    """reasoning_effort's degrees are budgets (EFFORT_BUDGETS: "low" is 1,024 tokens, past this
    thought); THINKING_BUDGET is the default of a request that sets neither, and a request's own
    budget (-1: none) or effort is taken over it."""
    backend, server = served
    assert chat(server, reasoning_effort="low")["message"]["reasoning_content"].strip() == THOUGHT
    assert not chat(server, reasoning_effort="none")["message"].get("reasoning_content")
    limited = live_server(lambda: backend, model="tiny", thinking_budget=2)
    assert chat(limited)["message"]["reasoning_content"].strip() == cut(backend, 2)
    assert chat(limited, thinking_token_budget=-1)["message"]["reasoning_content"].strip() == THOUGHT
    assert chat(limited, reasoning_effort="high")["message"]["reasoning_content"].strip() == THOUGHT


def test_budget_on_responses_and_messages(served):
    """The same budget through the Responses API (a reasoning item, whole and streamed) and the
    Messages API (budget_tokens: a thinking block, whole and streamed)."""
    backend, server = served
    sdk = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    body = dict(model="tiny", input=THINK, tools=RESPONSES_TOOLS, max_output_tokens=40, temperature=0)
    for extra, thought in (({}, THOUGHT), ({"thinking_token_budget": 3}, cut(backend, 3))):
        answer = sdk.responses.create(**body, extra_body=extra)
        item = next(i for i in answer.output if i.type == "reasoning")
        assert item.content[0].text.strip() == thought
        if extra:
            assert answer.usage.output_tokens_details.reasoning_tokens == 3
        with sdk.responses.stream(**body, extra_body=extra) as stream:
            # completed, or incomplete: a cut thought may leave the reply talking to max_output_tokens
            final = [e for e in stream if e.type in ("response.completed", "response.incomplete")][-1].response
        assert [i.model_dump(exclude={"id"}, exclude_none=True) for i in final.output] == [
            i.model_dump(exclude={"id"}, exclude_none=True) for i in answer.output
        ]
        assert next(i for i in final.output if i.type == "reasoning").content[0].text.strip() == thought
    claude = anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0)
    base = dict(model="tiny", max_tokens=40, messages=THINK, tools=ANTHROPIC_TOOLS, extra_body={"temperature": 0})
    for thinking, thought in (
        ({"type": "enabled", "budget_tokens": 1024}, THOUGHT),
        ({"type": "enabled", "budget_tokens": 3}, cut(backend, 3)),
        ({"type": "adaptive"}, THOUGHT),
    ):
        message = claude.messages.create(**base, thinking=thinking)
        assert message.content[0].type == "thinking" and message.content[0].thinking.strip() == thought
        with claude.messages.stream(**base, thinking=thinking) as stream:
            final = stream.get_final_message()
        assert [b.model_dump() for b in final.content] == [b.model_dump() for b in message.content]
    adaptive = claude.messages.create(
        **{**base, "extra_body": {"temperature": 0, "output_config": {"effort": "minimal"}}},
        thinking={"type": "adaptive"},
    )
    assert adaptive.content[0].thinking.strip() == THOUGHT  # "minimal" is 256 tokens: past this thought


def test_a_forced_call_holds_after_the_thought(served):
    """Asked to think, a reply whose grammar holds from its start (here a forced call; a
    response format alike) reasons first and then calls (the grammar holds from the end of the
    thought, as vLLM's reasoning parsers have it), within its budget too. Not asked, the grammar
    holds from the first token, as before."""
    backend, server = served
    forced = {"tool_choice": "required", "max_tokens": 100}  # room for the thought and the call

    def called(message: dict) -> None:
        assert [c["function"]["name"] for c in message["tool_calls"]] == ["get_weather"]
        assert set(json.loads(message["tool_calls"][0]["function"]["arguments"])) == {"city"}

    message = chat(server, **forced, reasoning_effort="high")["message"]
    assert message["reasoning_content"].strip() == THOUGHT
    called(message)
    message = chat(server, **forced, thinking_token_budget=2, chat_template_kwargs={"enable_thinking": True})["message"]
    assert message["reasoning_content"].strip() == cut(backend, 2)
    called(message)
    message = chat(server, **forced)["message"]
    assert not message.get("reasoning_content")
    called(message)


def test_a_model_that_does_not_think_takes_the_controls(live_server, tool_backends):
    """On a tokenizer without <think> tokens (the Llama-3 tool model) every control is accepted
    and changes nothing."""
    backend = tool_backends("torch", "llama3")
    server = live_server(lambda: backend, model="tiny")
    hello = {"messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 20, "temperature": 0}
    plain = post(server, "/v1/chat/completions", hello)[1]["choices"][0]["message"]
    for extra in ({"thinking_token_budget": 1}, {"reasoning_effort": "low"}, {"thinking_token_budget": 0}):
        status, answer = post(server, "/v1/chat/completions", {**hello, **extra})
        assert status == 200 and answer["choices"][0]["message"] == plain
