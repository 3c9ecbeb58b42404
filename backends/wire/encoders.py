"""Embeddings and rerank shapes: OpenAI's /v1/embeddings (a vector an input, float or base64,
`dimensions` for Matryoshka models) and the Cohere/Jina /v1/rerank llama.cpp and vLLM serve. The
encoders themselves run on the encode worker (backends/workers/encode.py). docs/api.md,
"Embeddings and rerank"."""

from __future__ import annotations

import base64
import json
from typing import Any

from backends.encoders.embeddings import Encoder, EncoderInfo, InputTooLong, Item
from backends.wire.errors import ApiError
from backends.wire.openai import TOKEN_IDS, _ignored
from backends.wire.schema import tolerant

MAX_INPUTS = 2048  # inputs of one embeddings request, documents of one rerank request (OpenAI's limit)
# Tokens of one embeddings or rerank request in all (OpenAI's limit for embeddings, issue 65): what
# one request may hold the encoder for. 2048 inputs of 512 tokens would be 1M, minutes of a CPU.
MAX_REQUEST_TOKENS = 300_000


def within_budget(items: list[Item], field: str) -> int:
    """The items' tokens in all, or a 400 naming `field` past MAX_REQUEST_TOKENS."""
    tokens = sum(len(item.ids) for item in items)
    if tokens > MAX_REQUEST_TOKENS:
        raise ApiError(
            400,
            f"{field} takes {tokens} tokens in all; at most {MAX_REQUEST_TOKENS} a request: send them in "
            "several requests",
            field=field,
            code="max_tokens_per_request",
        )
    return tokens


MAX_INPUT_CHARS = 1_000_000  # a text's characters: far past any encoder's length


TEXT_INPUT = {"type": "string", "maxLength": MAX_INPUT_CHARS}


EMBED_TEXT = {**TEXT_INPUT, "minLength": 1}  # OpenAI refuses an empty input too


TRUNCATE = {
    "type": "boolean",
    "description": "cut inputs longer than the model takes to its length (false: such an input is a 400)",
}


EMBEDDINGS_SCHEMA: dict[str, Any] = tolerant(
    {
        "type": "object",
        "required": ["input"],
        "properties": {
            "input": {
                "anyOf": [
                    EMBED_TEXT,
                    {"type": "array", "minItems": 1, "maxItems": MAX_INPUTS, "items": EMBED_TEXT},
                    {**TOKEN_IDS, "description": "one input's token ids, the embedding model's own, as it reads them"},
                    {"type": "array", "minItems": 1, "maxItems": MAX_INPUTS, "items": TOKEN_IDS},
                ],
                "x-error": f"input must be a string, a list of at most {MAX_INPUTS} strings, a list of token ids "
                "or a list of such lists",
            },
            "model": {"type": "string"},
            "encoding_format": {"enum": ["float", "base64"], "default": "float"},
            "dimensions": {"type": "integer", "minimum": 1, "description": "cut each vector to its first dimensions"},
            "truncate": {**TRUNCATE, "default": False},
            "user": _ignored("string"),
        },
    }
)


RERANK_DOCUMENT = {
    "anyOf": [
        TEXT_INPUT,
        {"type": "object", "required": ["text"], "properties": {"text": TEXT_INPUT}},
    ],
    "x-error": "a document must be a string or an object with a text",
}


RERANK_SCHEMA: dict[str, Any] = tolerant(
    {
        "type": "object",
        "required": ["query", "documents"],
        "properties": {
            "query": TEXT_INPUT,
            "documents": {"type": "array", "minItems": 1, "maxItems": MAX_INPUTS, "items": RERANK_DOCUMENT},
            "model": {"type": "string"},
            "top_n": {"type": "integer", "minimum": 1, "description": "the best n only (default: all)"},
            "return_documents": {"type": "boolean", "default": False},
            "truncate": {**TRUNCATE, "default": True, "description": "cut each document to fit the model's length"},
        },
    }
)


def embedding_items(encoder: Encoder, given: Any, truncate: bool) -> list[Item]:
    """A request's `input` as the encoder's items (on the pool: tokenizing 2048 texts takes a while)."""
    if isinstance(given, str) or given and isinstance(given[0], int):
        given = [given]
    if isinstance(given[0], str):
        try:
            items = encoder.tokenize(given, truncate)
        except InputTooLong as exc:
            raise ApiError(400, str(exc), field="input", code="context_length_exceeded") from None
        within_budget(items, "input")
        return items
    limit, vocab = encoder.info.max_tokens, encoder.info.vocab_size
    items = []
    for index, ids in enumerate(given):
        if max(ids) >= vocab:
            raise ApiError(400, f"input[{index}] holds a token id outside the vocabulary (0 to {vocab - 1})", "input")
        if len(ids) > limit and not truncate:
            raise ApiError(400, str(InputTooLong(index, len(ids), limit)), "input", "context_length_exceeded")
        items.append(Item(ids[:limit]))
    within_budget(items, "input")
    return items


def embeddings_body(rows: list, params: dict, info: EncoderInfo, name: str, tokens: int) -> bytes:
    """The answer, on the pool: 2048 vectors of 1024 floats are megabytes of JSON."""
    import numpy as np

    vectors = np.stack(rows).astype(np.float32)
    if params["dimensions"] is not None and params["dimensions"] < vectors.shape[1]:
        vectors = vectors[:, : params["dimensions"]]
        if info.normalize:  # a cut normalized vector is normalized again, as OpenAI's are
            vectors = vectors / np.maximum(np.linalg.norm(vectors, axis=1, keepdims=True), 1e-12)
    if params["encoding_format"] == "base64":  # little-endian float32, as OpenAI's SDKs decode it
        data = [base64.b64encode(v.astype("<f4").tobytes()).decode() for v in vectors]
    else:
        data = vectors.tolist()
    body = {
        "object": "list",
        "data": [{"object": "embedding", "index": i, "embedding": v} for i, v in enumerate(data)],
        "model": name,
        "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
    }
    return json.dumps(body).encode()
