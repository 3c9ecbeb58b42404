"""The native API (/generate, /generate/stream): its request schema (closed: an unknown field
is a 422), its translation onto a `Generation`, and its answers: a body {text, ...summary}, or
NDJSON lines `{"token": ...}` then `{"done": true, ...summary}`."""

from __future__ import annotations

import json
from json.encoder import encode_basestring as encode_json_string
from typing import Any

from backends.contract import MAX_LOGPROBS, Backend, Grammar, StepLogprobs
from backends.wire.base import Context, Generation, Wire, grammar_failed, sampling_of, stop_tuple, token_string
from backends.wire.schema import closed, parse
from backends.workers.engine import Event, Summary, Ticket

MAX_STOP = 4


# Sampling beyond temperature and top_p, on both APIs (vLLM's names; the order they apply in:
# backends.Sampling). Off by default.
SAMPLING_PROPERTIES: dict[str, Any] = {
    "top_k": {
        "type": "integer",
        "minimum": -1,
        "default": 0,
        "description": "keep the k most likely tokens (0 or -1: all)",
    },
    "min_p": {
        "type": "number",
        "minimum": 0,
        "maximum": 1,
        "default": 0.0,
        "description": "drop tokens less likely than min_p times the most likely",
    },
    # Bounded where the logits stay finite: a logit divided by 1e-300 is inf, and its softmax NaN.
    "repetition_penalty": {
        "type": "number",
        "minimum": 0.01,
        "maximum": 10,
        "default": 1.0,
        "description": "transformers' repetition penalty over prompt and generated tokens (1: off)",
    },
    "presence_penalty": {"type": "number", "minimum": -2, "maximum": 2, "default": 0.0},
    "frequency_penalty": {"type": "number", "minimum": -2, "maximum": 2, "default": 0.0},
    "logit_bias": {
        "type": "object",
        "propertyNames": {"pattern": "^[0-9]{1,9}$"},
        "additionalProperties": {"type": "number", "minimum": -100, "maximum": 100},
        "maxProperties": 1024,
        "default": {},
        "description": "{token id: added to its logit}, -100 to 100",
    },
}


# vLLM's field: requests share cached prompts only with requests of the same salt (and key).
CACHE_SALT = {
    "type": ["string", "null"],
    "minLength": 1,
    "maxLength": 256,
    "default": None,
    "description": "reuse cached prompts only of requests with this salt (and API key)",
}


GENERATE_SCHEMA: dict[str, Any] = closed(
    {
        "type": "object",
        "required": ["prompt"],
        "additionalProperties": False,
        "properties": {
            "prompt": {"type": "string", "minLength": 1},
            "max_tokens": {"type": "integer", "minimum": 1, "default": 128},
            "temperature": {"type": "number", "minimum": 0, "default": 0.0},
            "top_p": {"type": "number", "exclusiveMinimum": 0, "maximum": 1, "default": 1.0},
            "stop": {
                "anyOf": [
                    {"type": "string", "minLength": 1, "maxLength": 256},
                    {
                        "type": "array",
                        "maxItems": MAX_STOP,
                        "items": {"type": "string", "minLength": 1, "maxLength": 256},
                    },
                ],
                "default": [],
            },
            "seed": {"type": ["integer", "null"], "minimum": 0, "maximum": 2**63 - 1, "default": None},
            # Keep generating past end-of-text: benchmarks need a fixed token count.
            "ignore_eos": {"type": "boolean", "default": False},
            **SAMPLING_PROPERTIES,
            "logprobs": {
                "type": ["integer", "null"],
                "minimum": 0,
                "maximum": MAX_LOGPROBS,
                "default": None,
                "description": "report each generated token's logprob and this many most likely alternatives",
            },
            "json_schema": {
                "type": ["object", "null"],
                "default": None,
                "description": (
                    "constrain the text to JSON valid against this JSON Schema "
                    '({} or {"type": "object"}: any JSON object)'
                ),
            },
            "regex": {
                "type": ["string", "null"],
                "minLength": 1,
                "maxLength": 4096,
                "default": None,
                "description": "constrain the text to match this regular expression",
            },
            "cache_salt": CACHE_SALT,
            "adapter": {
                "type": ["string", "null"],
                "maxLength": 128,
                "default": None,
                "description": (
                    'a LoRA adapter: a folder name in ADAPTERS_DIR; "" for the base model; absent or null: '
                    "the default (ADAPTER_PATH)"
                ),
            },
        },
    }
)


def native_params(body: Any) -> tuple[Any, dict]:
    return body, parse(body, GENERATE_SCHEMA)


def native_generation(params: dict, body: dict, grammar: tuple[Grammar | None, str | None]) -> Generation:
    return Generation(
        prompt=params["prompt"],
        max_tokens=params["max_tokens"],
        max_tokens_given="max_tokens" in body,
        sampling=sampling_of(params, params["temperature"], params["top_p"], params["seed"]),
        stop=stop_tuple(params["stop"]),
        ignore_eos=params["ignore_eos"],
        logprobs=params["logprobs"],
        grammar=grammar[0],
        grammar_field=grammar[1],
    )


def summary_fields(ctx: Context, summary: Summary, backend: Backend) -> dict:
    fields_ = {
        "request_id": ctx.request_id,
        "tokens_used": summary.tokens_used,
        "prompt_tokens": summary.prompt_tokens,
        "cached_tokens": summary.cached_tokens,
        "finish_reason": summary.finish_reason,
        "model": backend.info.model,
        "adapter": ctx.facts.get("adapter"),
        "backend": backend.info.backend,
        "timings": summary.timings(),
    }
    if summary.error:
        fields_["error"] = {
            "message": summary.error,
            "type": "invalid_request" if grammar_failed(summary) else "server_error",
        }
    return fields_


def native_logprobs(backend: Backend, scores: list[StepLogprobs]) -> list[dict]:
    """The native shape: one entry a generated token, {id, token, logprob, top: [{id, token, logprob}]}."""

    def entry(token: int, logprob: float) -> dict:
        return {"id": token, "token": token_string(backend.token_bytes(token)), "logprob": logprob}

    return [{**entry(s.token.token, s.token.logprob), "top": [entry(t, lp) for t, lp in s.token.top]} for s in scores]


class NativeWire(Wire):
    """/generate's body {text, ...summary}, and /generate/stream's NDJSON: `{"token": ...}` lines
    as text is decoded, then one `{"done": true, ...summary}` line. With logprobs, each line
    carries those of the tokens whose text it brings (a token that brings no text of its own,
    such as end-of-text, comes in a line of its own before the end)."""

    content_type = "application/x-ndjson"

    def __init__(self, ctx: Context, tickets: list[Ticket], streaming: bool, params: dict):
        super().__init__(ctx, tickets, streaming)
        self.logprobs = params["logprobs"] is not None
        self.pending: list[StepLogprobs] = []

    @property
    def heavy(self) -> bool:
        return self.logprobs

    def line(self, text: str) -> str:
        if not self.logprobs:
            # json.dumps({"token": text}, ensure_ascii=False), without building and walking a
            # dict for every token (the encoder's own string escaping, the same bytes).
            return '{"token": ' + encode_json_string(text) + "}\n"
        out: dict[str, Any] = {"token": text, "logprobs": native_logprobs(self.backend, self.pending)}
        self.pending.clear()
        return json.dumps(out, ensure_ascii=False) + "\n"

    def chunk(self, index: int, event: Event) -> str:
        if isinstance(event, StepLogprobs):
            self.pending.append(event)
            return ""
        if isinstance(event, str):
            return self.line(event)
        rest = self.line("") if self.pending else ""
        return rest + json.dumps({"done": True, **summary_fields(self.ctx, event, self.backend)}) + "\n"

    def body(self) -> dict:
        (choice,) = self.choices
        out = {"text": "".join(choice.text), **summary_fields(self.ctx, choice.summary, self.backend)}
        if self.logprobs:
            out["logprobs"] = native_logprobs(self.backend, choice.logprobs)
        return out
