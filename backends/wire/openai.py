"""What OpenAI's routes share: the common request fields (unset optional fields may come as null;
what a local server can ignore is accepted and logged: user, store, metadata, service_tier ...; what
it cannot do is a 400 naming it, `x-unsupported`), sampling onto `Generation`s, usage, SSE, and
OpenAI's logprobs shapes. docs/api.md, "OpenAI-compatible API"."""

from __future__ import annotations

import codecs
import json
import time
import uuid
from typing import Any

from backends.chat.plan import GrammarSpec
from backends.contract import Backend, StepLogprobs
from backends.wire import constraints
from backends.wire.base import Generation, grammar_failed, sampling_of, token_string
from backends.wire.errors import ApiError
from backends.wire.native import CACHE_SALT, GENERATE_SCHEMA, SAMPLING_PROPERTIES
from backends.workers.engine import Summary

MAX_CHOICES = 16  # n and best_of: each choice is a sequence of its own in the batch


MAX_PROMPTS = 64  # prompts in one completions request (lm-eval sends a batch of them)


def _unsupported(*allowed: Any) -> dict:
    return {"enum": [None, *allowed], "x-unsupported": True}


def _ignored(kind: str) -> dict:
    return {"type": kind, "description": "accepted and ignored"}


STOP_SCHEMA = GENERATE_SCHEMA["properties"]["stop"]


OPENAI_COMMON = {
    "model": {"type": "string"},
    "max_tokens": {"type": "integer", "minimum": 1},
    "temperature": {"type": "number", "minimum": 0, "maximum": 2, "default": 1.0},
    "top_p": {"type": "number", "exclusiveMinimum": 0, "maximum": 1, "default": 1.0},
    "stop": STOP_SCHEMA,
    "seed": GENERATE_SCHEMA["properties"]["seed"],
    "stream": {"type": "boolean", "default": False},
    "stream_options": {
        "type": "object",
        "properties": {
            "include_usage": {"type": "boolean"},
            "include_obfuscation": _ignored("boolean"),
            "continuous_usage_stats": _unsupported(False),  # vLLM's usage in every chunk
        },
        "default": {},
    },
    "n": {"type": "integer", "minimum": 1, "maximum": MAX_CHOICES, "default": 1},
    **SAMPLING_PROPERTIES,
    "ignore_eos": GENERATE_SCHEMA["properties"]["ignore_eos"],  # vLLM's: benchmark clients send it
    "cache_salt": CACHE_SALT,
    "user": _ignored("string"),
    "store": _ignored("boolean"),
    "metadata": _ignored("object"),
    "service_tier": _ignored("string"),
    "prompt_cache_key": _ignored("string"),
    "safety_identifier": _ignored("string"),
}


TOKEN_IDS = {"type": "array", "minItems": 1, "items": {"type": "integer", "minimum": 0}}


RESPONSE_FORMAT = {
    "type": "object",
    "required": ["type"],
    "x-check-first": "type",
    "properties": {
        "type": {"enum": ["text", "json_object", "json_schema"]},
        "json_schema": {
            "type": "object",
            "properties": {
                "name": {"type": "string"},
                "description": {"type": "string"},
                "schema": {"type": "object", "description": "a JSON Schema; absent: any JSON object"},
                "strict": {"type": "boolean", "description": "accepted: the output always follows the schema"},
            },
        },
    },
}


def openai_params(params: dict) -> dict:
    """/v1 parameters' checks beyond the schema's."""
    if params.get("top_logprobs") is not None and not params.get("logprobs"):
        raise ApiError(400, "top_logprobs needs logprobs: true", field="top_logprobs")
    return params


def response_grammar(params: dict) -> tuple[GrammarSpec | None, str | None]:
    """The reply's grammar and the field it came from: `response_format`'s, or vLLM's and
    llama.cpp's constraint fields' (backends.wire.constraints); (None, None) for none."""
    grammar, field = format_grammar(params)
    try:
        other, other_field = constraints.constraint(params, field)
    except constraints.Refused as exc:
        raise ApiError(400, str(exc), field=exc.field) from None
    return (other, other_field) if other else (grammar, field)


def format_grammar(params: dict) -> tuple[GrammarSpec | None, str | None]:
    """`response_format` as the grammar of the reply (json_object: any JSON object, or
    json_schema), and the field it came from; (None, None) for text."""
    response_format = params["response_format"]
    if response_format is None or response_format["type"] == "text":
        return None, None
    if response_format["type"] == "json_object":
        return GrammarSpec("json_object", ""), "response_format"
    if "json_schema" not in response_format:
        raise ApiError(
            400, "response_format.json_schema is required with type json_schema", field="response_format.json_schema"
        )
    schema = response_format["json_schema"].get("schema", {"type": "object"})
    return GrammarSpec("json_schema", json.dumps(schema)), "response_format.json_schema.schema"


def openai_generations(
    params: dict, prompt: str | list[int], copies: int, max_tokens: int | None, default_max: int, **options
) -> list[Generation]:
    """`copies` generations of one prompt (the choices n or best_of); a seed gives each its own
    (seed, seed + 1, ...): reproducible, yet not n copies of one text."""
    seed = params["seed"]
    return [
        Generation(
            prompt=prompt,
            max_tokens=default_max if max_tokens is None else max_tokens,
            max_tokens_given=max_tokens is not None,
            sampling=sampling_of(
                params, params["temperature"], params["top_p"], None if seed is None else (seed + i) % 2**63
            ),
            ignore_eos=params["ignore_eos"],
            **options,
        )
        for i in range(copies)
    ]


def usage(summaries: list[Summary], prompts: int, reasoning: bool = False) -> dict:
    """Token counts of a request: each prompt counted once (its `copies` choices share it),
    every choice's tokens (and, for a chat with a model that thinks, its reasoning's)."""
    copies = len(summaries) // prompts
    prompt_summaries = summaries[::copies]
    prompt_tokens = sum(s.prompt_tokens for s in prompt_summaries)
    completion = sum(s.tokens_used for s in summaries)
    counts = {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion,
        "total_tokens": prompt_tokens + completion,
        "prompt_tokens_details": {"cached_tokens": sum(s.cached_tokens for s in prompt_summaries)},
    }
    if reasoning:
        counts["completion_tokens_details"] = {"reasoning_tokens": sum(s.reasoning_tokens for s in summaries)}
    return counts


def sse(payload: dict | str) -> str:
    return f"data: {payload if isinstance(payload, str) else json.dumps(payload, ensure_ascii=False)}\n\n"


def sse_error(facts: dict, summary: Summary) -> str:
    if grammar_failed(summary):  # the request's own grammar: its field, as a 400 would name it
        return sse(
            {
                "error": {
                    "message": summary.error,
                    "type": "invalid_request_error",
                    "param": facts.get("grammar"),
                    "code": None,
                }
            }
        )
    return sse({"error": {"message": summary.error, "type": "server_error", "param": None, "code": None}})


def response_head(name: str, kind: str) -> dict:
    return {
        "id": f"{'chatcmpl' if kind.startswith('chat') else 'cmpl'}-{uuid.uuid4().hex}",
        "object": kind,
        "created": int(time.time()),
        "model": name,
    }


class TextOffsets:
    """Where each token's text starts in the decoded text, token after token (from `start`): a
    token holding the end of a split character starts where that character does."""

    def __init__(self, start: int = 0):
        self.at = start
        self._decoder = codecs.getincrementaldecoder("utf-8")("replace")

    def __call__(self, pieces: list[bytes]) -> list[int]:
        offsets = []
        for data in pieces:
            offsets.append(self.at)
            self.at += len(self._decoder.decode(data))
        return offsets


class CompletionLogprobs:
    """The legacy completions' logprobs of one choice ({tokens, token_logprobs, top_logprobs,
    text_offset}), built as its tokens come: `top_logprobs` holds the `k` most likely tokens and
    the chosen one (so up to k + 1, as OpenAI says); offsets count from the prompt's start."""

    def __init__(self, backend: Backend, k: int, offset: int):
        self.backend, self.k, self.offsets = backend, k, TextOffsets(offset)

    def shape(self, entries: list[tuple[int, float | None, tuple]]) -> dict:
        pieces = [self.backend.token_bytes(token) for token, _, _ in entries]
        offsets = self.offsets(pieces)
        tops = []
        for (_, logprob, top), piece in zip(entries, pieces, strict=True):
            if logprob is None:  # a prompt's first token: nothing predicts it
                tops.append(None)
                continue
            alternatives = {token_string(self.backend.token_bytes(t)): lp for t, lp in top[: self.k]}
            alternatives.setdefault(token_string(piece), logprob)
            tops.append(alternatives)
        return {
            "tokens": [token_string(piece) for piece in pieces],
            "token_logprobs": [logprob for _, logprob, _ in entries],
            "top_logprobs": tops,
            "text_offset": offsets,
        }

    @staticmethod
    def prompt_entries(prompt_ids: list[int], scores: list[StepLogprobs]) -> list[tuple[int, float | None, tuple]]:
        scored = next((s.prompt for s in scores if s.prompt is not None), ())
        return [(prompt_ids[0], None, ())] + [(t.token, t.logprob, t.top) for t in scored]

    @staticmethod
    def token_entries(scores: list[StepLogprobs]) -> list[tuple[int, float | None, tuple]]:
        return [(s.token.token, s.token.logprob, s.token.top) for s in scores if s.token is not None]


def chat_logprobs(backend: Backend, scores: list[StepLogprobs], k: int) -> dict:
    """Chat's logprobs: {content: [{token, logprob, bytes, top_logprobs: [...]}], refusal: null}."""

    def entry(token: int, logprob: float) -> dict:
        piece = backend.token_bytes(token)
        return {"token": token_string(piece), "logprob": logprob, "bytes": list(piece)}

    content = [
        {**entry(s.token.token, s.token.logprob), "top_logprobs": [entry(t, lp) for t, lp in s.token.top[:k]]}
        for s in scores
        if s.token
    ]
    return {"content": content, "refusal": None}
