"""The tokenizer routes' shapes (/tokenize, /detokenize, vLLM's): the ids a prompt or a chat is
generated from, exactly as the generating routes tokenize it: a chat through the model's chat
template with its generation prompt, and no special token added beyond what the template writes.
llama.cpp's `content` is accepted for `prompt`. Errors come in OpenAI's shape, as vLLM's do."""

from __future__ import annotations

from typing import Any

from backends.wire.chat import MAX_TOOLS, MESSAGE, REASONING_CONTROLS, TOOL
from backends.wire.errors import ApiError
from backends.wire.openai import TOKEN_IDS
from backends.wire.schema import tolerant

MAX_TOKENIZE_CHARS = 4_000_000  # a prompt's text: beyond any context window this server serves


TOKENIZE_SCHEMA: dict[str, Any] = tolerant(
    {
        "type": "object",
        "properties": {
            "model": {"type": "string"},
            "prompt": {"type": "string", "maxLength": MAX_TOKENIZE_CHARS},
            "content": {
                "type": "string",
                "maxLength": MAX_TOKENIZE_CHARS,
                "description": "llama.cpp's name for prompt",
            },
            "messages": {"type": "array", "minItems": 1, "items": MESSAGE},
            "tools": {"type": "array", "maxItems": MAX_TOOLS, "items": TOOL, "description": "rendered with messages"},
            **REASONING_CONTROLS,
            "add_generation_prompt": {
                "enum": [True],
                "x-unsupported": True,
                "default": True,
                "description": "a chat is tokenized as generation sees it: with the assistant's turn opened",
            },
            "add_special_tokens": {
                "enum": [False],
                "x-unsupported": True,
                "default": False,
                "description": "this server's prompts get no special tokens added",
            },
            "return_token_strs": {"type": "boolean", "default": False},
        },
    }
)


DETOKENIZE_SCHEMA: dict[str, Any] = tolerant(
    {
        "type": "object",
        "required": ["tokens"],
        "properties": {"model": {"type": "string"}, "tokens": {**TOKEN_IDS, "minItems": 0}},
    }
)


def tokenize_params(params: dict) -> dict:
    given = [name for name in ("prompt", "content", "messages") if params[name] is not None]
    if len(given) != 1:
        raise ApiError(400, "give exactly one of prompt (or content) and messages", field="prompt")
    if params["tools"] and params["messages"] is None:
        raise ApiError(400, "tools are rendered with messages, not with a prompt", field="tools")
    return params
