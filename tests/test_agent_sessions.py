"""What agent sessions read and send at real size (issue 68), on the real app over the tiny
backends of both runtimes: the context window and capabilities in /v1/models, Claude Code's
per-session billing header kept out of the prompt (so sessions share their cached prefix), and
tool results of any block type, with tools deferred until a tool search names them."""

from __future__ import annotations

import pytest
from conftest import engine_of, wait_idle, wait_until
from test_request_log import read_log

from backends.wire import anthropic
from backends.wire.base import Context
from phi2_server import ENCODER

SYSTEM = "You are an agent that helps with software. " * 12  # long enough to fill cache pages


def billing(suffix: str) -> dict:
    return {"type": "text", "text": f"x-anthropic-billing-header: cc_version=2.1.197.{suffix}; cc_entrypoint=sdk-cli;"}


MODEL = "microsoft/phi-2"  # the default served name (Settings.model)


def messages_body(system, content="What is 2 + 2?", **more) -> dict:
    return {
        "model": MODEL,
        "max_tokens": 2,
        "system": system,
        "messages": [{"role": "user", "content": content}],
        **more,
    }


async def test_models_give_the_context_window_and_capabilities(client, backend):
    worker = client.server.app[ENCODER]  # the chat model's encoder is made after the model loads
    await wait_until(lambda: worker.encoders or worker.chat_refused is not None)
    listed = await (await client.get("/v1/models")).json()
    card = listed["data"][0]
    context = backend.info.context_length
    assert card["context_length"] == card["max_model_len"] == card["context_window"] == context
    embeds = "embedding" in card.get("tasks", [])  # the chat model embeds (EMBEDDING_POOLING, no EMBEDDING_MODEL)
    assert card["capabilities"] == {"chat": True, "tools": True, "reasoning": backend.reasons(), "embeddings": embeds}
    one = await (await client.get(f"/v1/models/{card['id']}")).json()
    assert one["context_window"] == context and one["capabilities"] == card["capabilities"]


async def test_two_sessions_differing_only_in_the_billing_header_share_their_prefix(client, backend, log_dir):
    """Claude Code's first system block changes between sessions (`.1c0`, `.e84`): that part is
    dropped, so the second session's prompt is the first's and comes from the cache."""
    counts = []
    for suffix in ("1c0", "e84"):
        body = messages_body([billing(suffix), {"type": "text", "text": SYSTEM}])
        counts.append((await (await client.post("/v1/messages/count_tokens", json=body)).json())["input_tokens"])
    fixed = {"type": "text", "text": "x-anthropic-billing-header: cc_version=2.1.197; cc_entrypoint=sdk-cli;"}
    plain = messages_body([fixed, {"type": "text", "text": SYSTEM}])
    without = (await (await client.post("/v1/messages/count_tokens", json=plain)).json())["input_tokens"]
    assert counts[0] == counts[1] == without  # the header reaches the prompt without its session's part

    usages = []
    for suffix in ("1c0", "e84"):
        response = await client.post(
            "/v1/messages", json=messages_body([billing(suffix), {"type": "text", "text": SYSTEM}])
        )
        assert response.status == 200
        usages.append((await response.json())["usage"])
        await wait_idle(engine_of(client))
    prompt = usages[1]["input_tokens"] + usages[1]["cache_read_input_tokens"]
    assert prompt == without
    assert usages[1]["cache_read_input_tokens"] >= prompt - 16, usages  # all but the last page's worth
    await wait_until(lambda: len([line for line in read_log(log_dir) if line["path"] == "/v1/messages"]) == 2)
    lines = read_log(log_dir)
    sent = [line for line in lines if line["path"] == "/v1/messages"]
    assert all(line["normalized"] == ["system billing header"] for line in sent)
    assert sent[1]["cached_tokens"] == usages[1]["cache_read_input_tokens"]
    assert sent[1]["prompt_tokens"] == prompt


TOOLS = [
    {
        "name": "Read",
        "description": "Read a file",
        "input_schema": {"type": "object", "properties": {"path": {"type": "string"}}},
    },
    {
        "name": "NotebookEdit",
        "description": "Edit a notebook cell",
        "input_schema": {"type": "object", "properties": {"cell": {"type": "integer"}}},
        "defer_loading": True,
    },
]


def session(result_content) -> dict:
    """A turn answering a tool call whose result is `result_content`."""
    return {
        "model": MODEL,
        "max_tokens": 2,
        "tools": TOOLS,
        "messages": [
            {"role": "user", "content": "Read a.txt"},
            {
                "role": "assistant",
                "content": [{"type": "tool_use", "id": "toolu_1", "name": "Read", "input": {"path": "a.txt"}}],
            },
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": result_content}]},
        ],
    }


BLOCKS = [
    [
        {"type": "text", "text": "42"},
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="}},
    ],
    [{"type": "document", "source": {"type": "text", "media_type": "text/plain", "data": "a page"}, "title": "a.txt"}],
    [{"type": "tool_reference", "tool_name": "NotebookEdit"}],
    [
        {
            "type": "search_result",
            "source": "https://example.com",
            "title": "t",
            "content": [{"type": "text", "text": "x"}],
        }
    ],
]


@pytest.fixture(params=["torch", "mlx"])
async def tool_client(request, make_client, tool_backends):
    """A client over the tiny Hermes tool model (1,024 tokens: room for two tools and a turn)."""
    return await make_client(lambda: tool_backends(request.param, "hermes"))


@pytest.mark.parametrize("blocks", BLOCKS, ids=["image", "document", "tool_reference", "other"])
async def test_a_tool_result_of_any_block_type_is_answered(tool_client, blocks):
    response = await tool_client.post("/v1/messages", json=session(blocks))
    assert response.status == 200, await response.text()
    assert (await response.json())["type"] == "message"


def translated(body: dict) -> tuple[list[dict], list[str]]:
    """The chat messages and rendered tool names the Messages translation gives `body`."""
    from backends.wire.anthropic import COUNT_TOKENS_SCHEMA
    from backends.wire.schema import parse

    call = anthropic.translate(parse(body, COUNT_TOKENS_SCHEMA), Context(None, "test", {}))
    return call.messages, [t["name"] for t in (call.tools.tools if call.tools else [])]


def test_what_the_model_reads_of_other_blocks_and_deferred_tools():
    messages, tools = translated(session(BLOCKS[0]))
    assert messages[-1]["content"] == "42\n[image omitted: this model reads text only]"
    assert tools == ["Read"]  # NotebookEdit waits for a tool search to name it
    messages, tools = translated(session(BLOCKS[2]))
    assert messages[-1]["content"] == "[tool loaded: NotebookEdit]"
    assert tools == ["Read", "NotebookEdit"]


async def test_the_deferred_tool_is_rendered_once_named(tool_client):
    async def tokens(body):
        return (await (await tool_client.post("/v1/messages/count_tokens", json=body)).json())["input_tokens"]

    deferred = session("ok")
    loaded = {**deferred, "tools": [{k: v for k, v in t.items() if k != "defer_loading"} for t in TOOLS]}
    assert await tokens(deferred) < await tokens(loaded)
