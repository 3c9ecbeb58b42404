"""phi2-server: a small local REST server for Phi-2 (and causal LMs of the same families).

HTTP only: configuration, routes, validation, wire formats, middleware, startup and shutdown.
The model lives behind `backends` (MLX or PyTorch) and is driven by one generation worker thread
(`backends.workers.engine`); handlers hand requests to it and stream its tokens back.

    python phi2_server.py --help

Routes, their handlers, and the section (`# -- ...`) each is in (`ROUTES`, near the end, registers
them and describes them in /openapi.json; tests/test_openapi.py holds this index equal to it):

    GET  /health                health                probes and model facts
    GET  /ready                 ready                 probes and model facts
    GET  /model/info            model_info            probes and model facts
    POST /generate              generate              the native API
    POST /generate/stream       generate_stream       the native API
    GET  /v1/models             v1_models             OpenAI-compatible API: models
    GET  /v1/models/{model}     v1_model              OpenAI-compatible API: models
    POST /v1/completions        v1_completions        OpenAI-compatible API: /v1/completions
    POST /v1/chat/completions   v1_chat_completions   OpenAI-compatible API: /v1/chat/completions
    POST /v1/responses          v1_responses          OpenAI Responses API
    GET  /v1/responses/{response_id}     v1_response          OpenAI Responses API: stored answers
    DELETE /v1/responses/{response_id}   v1_delete_response   OpenAI Responses API: stored answers
    POST /v1/messages           v1_messages           Anthropic Messages API
    POST /v1/messages/count_tokens  v1_count_tokens   Anthropic Messages API
    POST /tokenize              tokenize              tokenizer
    POST /detokenize            detokenize            tokenizer
    POST /v1/embeddings         v1_embeddings         embeddings and rerank
    POST /v1/rerank             v1_rerank             embeddings and rerank
    GET  /metrics               metrics               metrics
    GET  /openapi.json          openapi               OpenAPI: the document

A generating handler is parse -> generations -> `submit` -> `answer(request, tickets, wire)`:
one answer loop for every API, streamed or whole, and one `Wire` object per wire format
("answers"). Every request passes the middleware in `create_app`: request log, CORS preflight,
JSON errors, access (API keys, rate limits).
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import codecs
import dataclasses
import fnmatch
import hashlib
import hmac
import json
import logging
import math
import os
import re
import signal
import sys
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field, fields
from datetime import UTC, datetime
from functools import cached_property
from http import HTTPStatus
from json.encoder import encode_basestring as encode_json_string
from logging.handlers import RotatingFileHandler
from pathlib import Path
from typing import Any, TypeVar

import aiohttp.web_server
import prometheus_client
from aiohttp import web
from aiohttp.abc import AbstractAccessLogger
from aiohttp.http_exceptions import HttpProcessingError
from aiohttp.web_protocol import RequestHandler, RequestPayloadError
from prometheus_client import CollectorRegistry, Counter, GCCollector, Histogram, PlatformCollector, ProcessCollector
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, InfoMetricFamily
from prometheus_client.registry import Collector

from backends.chat.plan import ChatPlan, ChatRequest, GrammarSpec, ToolUse
from backends.chat.tools import Piece, ToolCall, ToolCallParser, argument_error
from backends.choose import chat_encoder, load_backend, load_encoder, select_backend
from backends.contract import (
    MAX_LOGPROBS,
    Backend,
    ChatError,
    Grammar,
    GrammarError,
    LoadOptions,
    ModelLoadError,
    Sampling,
    StepLogprobs,
    mean_logprob,
)
from backends.encoders.chat import POOLINGS, Refused
from backends.encoders.embeddings import Encoder, EncoderInfo, InputTooLong, Item, Kind
from backends.files.adapters import Adapter, AdapterError, AdapterFacts, UnknownAdapter
from backends.workers.encode import Busy, EncodeWorker, NotReady
from backends.workers.engine import (
    MIN_QUEUE,
    Engine,
    Event,
    NotAccepting,
    QueueFull,
    Request,
    Summary,
    Ticket,
    next_events,
)

VERSION = "0.9.0"
log = logging.getLogger("phi2_server")
T = TypeVar("T")


# -- configuration: the settings, each with its default and help -------------------------------


def setting(default: Any, help: str) -> Any:
    """A Settings field: its default and the line `--help` prints for it."""
    return field(default=default, metadata={"help": help})


DEFAULT_ADAPTER_PATH = "~/ml-experiment/experiments/2026-05-04-0014"
DEFAULT_ADAPTERS_DIR = str(Path(DEFAULT_ADAPTER_PATH).parent)  # the experiments next to the default one


@dataclass(frozen=True)
class Settings:
    """Every setting is an environment variable with a matching command-line flag."""

    model: str = setting(
        "microsoft/phi-2",
        "the model: a Hugging Face hub id, a local checkpoint directory, a .gguf file (converted once), `tiny` "
        "(the offline test model) or `random:phi-2` (Phi-2's architecture, random weights)",
    )
    backend: str = setting("auto", "runtime: auto (MLX on macOS arm64, else Torch), mlx or torch")
    adapter_path: str = setting(
        DEFAULT_ADAPTER_PATH,
        "the default mlx-lm LoRA adapter: requests that name no adapter get it; empty for none (the default path may "
        "be absent)",
    )
    adapters_dir: str = setting(
        DEFAULT_ADAPTERS_DIR,
        "a folder of mlx-lm LoRA adapter folders that requests choose by name (model base:name on /v1, adapter "
        "natively)",
    )
    max_adapters: int = setting(
        8, "adapters kept loaded (least recently used out first), and the most that decode at once"
    )
    host: str = setting("127.0.0.1", "address to listen on (0.0.0.0: every interface; set PHI2_API_KEY then)")
    port: int = setting(8000, "port to listen on")
    log_dir: str = setting("logs", "directory of the request log (requests.log), created at startup")
    device: str = setting("auto", "Torch device: auto (cuda when a GPU is present, else cpu), cpu, cuda or cuda:N")
    dtype: str = setting("auto", "Torch weights: auto (measured rule, see README), float32, bfloat16 or float16")
    compile: str = setting("auto", "Torch, Phi family: torch.compile the decode step (auto: on CUDA only)")
    quantize: str = setting(
        "",
        "quantize the weights at load: q8_0, q4_0, q4_1 (CPU), int8, int4 or w8a8 on Torch, 4 or 8 (bits) on MLX "
        "(empty: as stored, a GGUF file's own blocks on a CPU; none: dequantized)",
    )
    quantized_cache: bool = setting(
        True,
        "Torch: store PHI2_QUANTIZE's weights in PHI2_CACHE_DIR/quantized once and memory-map them at the next "
        "start (0: quantize at every start)",
    )
    max_body_bytes: int = setting(1024 * 1024, "largest request body in bytes; larger gets 413")
    max_queue: int = setting(
        0, "requests that may wait for a batch slot; more get 503 (0: twice MAX_BATCH as applied, at least 64)"
    )
    max_batch: int = setting(
        0, "sequences decoded together in one step (0: on CUDA a row per 512 positions of the KV pool; 8 elsewhere)"
    )
    max_model_len: int = setting(
        0,
        "the most tokens of context (prompt and completion) a request may use (0: the model's window, at most what "
        "one sequence fits in the KV budget)",
    )
    prompt_cache: bool = setting(
        True, "reuse the KV of prompts (and replies) computed before, for requests that start alike (0: off)"
    )
    prompt_cache_bytes: int = setting(
        0, "memory for reused prompt KV, in bytes (0: an eighth of RAM or GPU memory, at most 2 GiB, 8 GiB on a GPU)"
    )
    kv_cache_bytes: int = setting(
        0,
        "memory for the KV of the sequences decoding, in bytes (0: on a CPU, 3/4 of what is available after the "
        "weights and the prompt cache; on CUDA, 0.85 of the free GPU memory); requests wait for room in it",
    )
    prompt_lookup_tokens: int = setting(
        -1,
        "speculative decoding by prompt lookup: the most draft tokens (0-32) a step verifies while one sequence "
        "decodes, copied from where its text's last words occurred before (0: off; -1: 3 on a CPU and MLX, off on "
        "CUDA)",
    )
    max_tokens_limit: int = setting(
        0, "largest max_tokens a request may ask for (0: only the context window bounds it)"
    )
    max_request_tokens: int = setting(
        16384,
        "most tokens one request may ask for in all: its sequences (prompts x n or best_of) times max_tokens (0: no "
        "limit)",
    )
    request_timeout: float = setting(600.0, "seconds a request may take, queue wait included (0: no limit)")
    idle_timeout: float = setting(
        60.0,
        "seconds a connection may stay silent: before its request's headers are complete, and between requests "
        "(keep-alive)",
    )
    body_timeout: float = setting(
        30.0, "seconds a request's body may take to arrive once its headers have; longer gets 408 (0: no limit)"
    )
    write_timeout: float = setting(
        30.0,
        "seconds an answer may wait for its client to read; then the connection is closed and its generation ends "
        "(0: no limit)",
    )
    stream_buffer: int = setting(
        1024, "tokens a stream may have waiting for a client that does not read; then its generation ends"
    )
    responses_store: int = setting(
        1000, "Responses API answers kept for previous_response_id and GET /v1/responses/{id} (0: none stored)"
    )
    responses_store_bytes: int = setting(
        64 << 20, "bytes of JSON the stored Responses answers may hold together; the least recently used go first"
    )
    chat_template_kwargs: str = setting(
        "",
        'a JSON object every chat template gets besides the messages (e.g. {"enable_thinking": false}); a '
        "request's own chat_template_kwargs are laid over it",
    )
    thinking_budget: int = setting(
        -1,
        "tokens a reasoning model may think (in <think> tags) when a request sets no budget or effort; then "
        "</think> is forced and the answer follows (-1: no limit)",
    )
    temperature: str = setting(
        "",
        "the temperature of a request that sends none, 0 to 2 (empty: each API's own default, 1 on the OpenAI "
        "and Anthropic routes, 0 on the native ones); agents such as Claude Code send none",
    )
    first_tool_choice: str = setting(
        "auto",
        "auto, or required: a request that offers tools with tool_choice auto (sent or by default) must call one "
        "when it answers the user (no tool result since the last assistant message); answering a tool result it "
        "may end. For a small model that never calls a tool by itself behind an agent that sends auto",
    )
    stream_keepalive: float = setting(
        5.0,
        "seconds a stream with no token yet (queued, or prefilling a long prompt) waits before it sends its "
        "headers and a keep-alive (an SSE comment; Anthropic's ping), and again each such while (0: never)",
    )
    shutdown_grace: float = setting(10.0, "seconds in-flight generations get to finish on SIGTERM/SIGINT")
    drain_delay: float = setting(
        0.0,
        "seconds after SIGTERM/SIGINT during which /ready answers 503 and requests are still served, before the "
        "grace period (behind a load balancer: more than its health checks take to mark the server down)",
    )
    log_prompts: bool = setting(True, "write the first 100 characters of each prompt to the request log (0: never)")
    log_max_bytes: int = setting(10 * 1024 * 1024, "request log size in bytes before it rotates")
    log_backups: int = setting(5, "rotated request logs kept")
    api_key: str = setting(
        "", "API key(s) clients must send as Authorization: Bearer, comma-separated (empty: no keys)"
    )
    api_key_file: str = setting("", "a file of API keys, one a line (# comments allowed)")
    rate_limit: int = setting(0, "requests a minute per key, or per client address without keys (0: no limit)")
    served_model_name: str = setting(
        "",
        "the model's names on the OpenAI and Anthropic APIs, comma-separated aliases (empty: PHI2_MODEL); the "
        "first is the one /v1/models lists first; an alias with wildcards (claude-*, *) answers to the names "
        "it matches, unlisted",
    )
    cors_origins: str = setting("", "browser origins allowed to call the API, comma-separated, or * (empty: no CORS)")
    embedding_model: str = setting(
        "", "the /v1/embeddings model: a sentence-transformers folder or Hugging Face id (empty: none)"
    )
    rerank_model: str = setting("", "the /v1/rerank model: a cross-encoder folder or Hugging Face id (empty: none)")
    embedding_pooling: str = setting(
        "mean",
        "without EMBEDDING_MODEL, the chat model embeds: its final hidden states pooled by mean or last (token), "
        "L2-normalized; none: it does not",
    )
    embedding_threads: int = setting(
        0, "CPU threads of the embedding and rerank forwards (0: a quarter of the cores, at least 1)"
    )
    embedding_batch_tokens: int = setting(
        8192, "padded tokens one embedding or rerank forward may hold, which bounds its time"
    )

    # -- configuration: read from flags and the environment, checked --------------------------------

    ENV = {
        "model": "PHI2_MODEL",
        "backend": "PHI2_BACKEND",
        "device": "PHI2_DEVICE",
        "dtype": "PHI2_DTYPE",
        "compile": "PHI2_COMPILE",
        "quantize": "PHI2_QUANTIZE",
        "api_key": "PHI2_API_KEY",
        "api_key_file": "PHI2_API_KEY_FILE",
    }

    @classmethod
    def env_name(cls, name: str) -> str:
        return cls.ENV.get(name, name.upper())

    @classmethod
    def from_args(cls, argv: list[str] | None = None, environ: dict | None = None) -> Settings:
        environ = os.environ if environ is None else environ
        parser = argparse.ArgumentParser(
            description="Serve a causal LM (Phi-2 by default) over HTTP. "
            "Each flag's default comes from the environment variable named in its help."
        )
        for f in fields(cls):
            env = cls.env_name(f.name)
            kind = {"bool": _parse_bool, "int": int, "float": float}.get(f.type, str)
            default = f.default
            if env in environ:
                try:
                    default = kind(environ[env])
                except ValueError:
                    parser.error(f"{env}={environ[env]!r} is not a valid {f.type}")
            shown = "none; never logged" if f.name == "api_key" else repr(f.default)
            parser.add_argument(
                "--" + f.name.replace("_", "-"),
                type=kind,
                default=default,
                metavar=env,
                help=f"{f.metadata['help']} (env {env}; default: {shown})",
            )
        args = parser.parse_args(argv)
        return cls(**vars(args))

    def load_options(self) -> LoadOptions:
        adapter = str(Path(self.adapter_path).expanduser()) if self.adapter_path else None
        return LoadOptions(
            model=self.model,
            adapter_path=adapter,
            adapter_path_is_default=self.adapter_path == DEFAULT_ADAPTER_PATH,
            adapters_dir=self.adapters_dir or None,
            max_adapters=self.max_adapters,
            device=self.device,
            dtype=self.dtype,
            max_batch=self.max_batch,
            compile=None if self.compile == "auto" else _parse_bool(self.compile),
            quantize=self.quantize.strip().lower(),
            quantized_cache=self.quantized_cache,
            max_context=self.max_model_len,
            kv_cache_bytes=self.kv_cache_bytes,
            prompt_cache_bytes=self.prompt_cache_budget(),
            prompt_lookup_tokens=self.prompt_lookup_tokens,
        )

    @cached_property  # read once (create_app reads it first), not at every request
    def template_kwargs(self) -> dict:
        """CHAT_TEMPLATE_KWARGS as an object; a ValueError names a bad one."""
        try:
            value = json.loads(self.chat_template_kwargs or "{}")
        except ValueError:
            value = None
        if not isinstance(value, dict):
            raise ValueError(f"CHAT_TEMPLATE_KWARGS={self.chat_template_kwargs!r} must be a JSON object")
        return value

    @cached_property
    def default_temperature(self) -> float | None:
        """TEMPERATURE as a number, or None where unset; a ValueError names a bad one."""
        if not self.temperature.strip():
            return None
        try:
            value = float(self.temperature)
        except ValueError:
            value = math.nan
        if not 0 <= value <= 2:
            raise ValueError(f"TEMPERATURE={self.temperature!r} must be a number from 0 to 2, or empty")
        return value

    @cached_property
    def forces_first_tool_call(self) -> bool:
        """FIRST_TOOL_CHOICE as a switch; a ValueError names a bad one."""
        if self.first_tool_choice not in ("auto", "required"):
            raise ValueError(f"FIRST_TOOL_CHOICE={self.first_tool_choice!r} must be auto or required")
        return self.first_tool_choice == "required"

    def prompt_cache_budget(self) -> int | None:
        """Each decoder's prompt cache: None for the device's default, 0 for none."""
        return (self.prompt_cache_bytes or None) if self.prompt_cache else 0


def _parse_bool(value: str | bool) -> bool:
    if isinstance(value, bool):
        return value
    return value.strip().lower() not in ("0", "false", "no", "off", "")


# -- app state: typed keys ------------------------------------------------------------------------

# App state, typed (the annotations are lazy, so they may name classes defined further down).
SETTINGS: web.AppKey[Settings] = web.AppKey("settings")
ENGINE: web.AppKey[Engine] = web.AppKey("engine")
REQUEST_LOG: web.AppKey[RequestLog] = web.AppKey("request_log")
LOAD_DONE: web.AppKey[asyncio.Event] = web.AppKey("load_done")
DRAINING: web.AppKey[asyncio.Event] = web.AppKey("draining")  # set on SIGTERM while DRAIN_DELAY runs
LOADER: web.AppKey[Callable[[], Backend]] = web.AppKey("loader")
# Short CPU work off the loop (tokenizing, large bodies and answers, a grammar's per-sequence
# copies), apart from grammar compiles, which may take seconds each (GRAMMAR_COMPILER).
TOKENIZER_POOL: web.AppKey[ThreadPoolExecutor] = web.AppKey("tokenizer_pool")
GRAMMAR_COMPILER: web.AppKey[BoundedPool] = web.AppKey("grammar_compiler")
API_KEYS: web.AppKey[tuple[bytes, ...]] = web.AppKey("api_keys")
RATE_LIMITER: web.AppKey[TokenBuckets | None] = web.AppKey("rate_limiter")
AUTH_FAILURES: web.AppKey[TokenBuckets] = web.AppKey("auth_failures")  # wrong keys, by address
CORS_ORIGINS: web.AppKey[frozenset[str]] = web.AppKey("cors_origins")
METRICS: web.AppKey[Metrics] = web.AppKey("metrics")
OPENAPI: web.AppKey[dict] = web.AppKey("openapi")
RESPONSES: web.AppKey[ResponseStore] = web.AppKey("responses")
ENCODER: web.AppKey[EncodeWorker] = web.AppKey("encoder")  # EMBEDDING_MODEL and RERANK_MODEL's worker
ENCODER_LOADER: web.AppKey[Callable[[], dict] | None] = web.AppKey("encoder_loader")  # None: no encoder set
LOG_FACTS: web.RequestKey[dict[str, Any]] = web.RequestKey("log_facts")
REQUEST_ID: web.RequestKey[str] = web.RequestKey("request_id")
REQUEST_ID_FORMAT = re.compile(r"[A-Za-z0-9._:-]{1,128}")  # a client's id is echoed only if it is this tame
RECEIVED_AT: web.RequestKey[float] = web.RequestKey("received_at")
ARGUMENT_CHECKS: web.RequestKey[ArgumentChecks] = web.RequestKey("argument_checks")
# Whose prompt cache entries a request shares: its API key's where there are several keys.
CACHE_NAMESPACE: web.RequestKey[str] = web.RequestKey("cache_namespace")


# -- the native request schema -----------------------------------------------------------------


def closed(schema: dict) -> dict:
    """`schema` as `check` enforces it, said in the schema itself: an object with properties
    takes no field beyond them, at every depth (so /openapi.json publishes the same contract).
    Marks `schema` in place and returns it."""
    if "properties" in schema:
        schema.setdefault("additionalProperties", False)
        for value in schema["properties"].values():
            closed(value)
    if isinstance(schema.get("items"), dict):
        closed(schema["items"])
    for option in schema.get("anyOf", ()):
        closed(option)
    return schema


def tolerant(schema: dict) -> dict:
    """`schema` for a route whose clients add fields every month (OpenAI's and Anthropic's): a
    field beyond an object's properties is ignored (and logged, `parse`), not refused, as vLLM,
    llama.cpp and Ollama do. Nothing is marked: JSON Schema takes extra fields by default."""
    return schema


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


# -- validation: the schema checker, bodies read off the loop ----------------------------------
# `check` interprets the subset of JSON Schema the request schemas use, rather than jsonschema
# (which the tests use to hold the published schemas to it, tests/test_wire.py and
# test_openapi.py): its errors name the field as the APIs' error bodies do, it makes integral
# floats integers where an integer is asked for, and a list of 500,000 token ids is checked at
# once (`_plain_ints`), not item by item.


class Invalid(Exception):
    def __init__(self, field: str, message: str):
        super().__init__(message)
        self.field = field


def _type_ok(value: Any, kind: str) -> bool:
    if kind == "integer":  # 16.0 is an integer, as JSON Schema counts (clients that write floats send it)
        return isinstance(value, int) and not isinstance(value, bool) or isinstance(value, float) and value.is_integer()
    if kind == "number":
        return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    return isinstance(value, {"string": str, "boolean": bool, "array": list, "object": dict, "null": type(None)}[kind])


def _same(a: Any, b: Any) -> bool:
    return a == b and isinstance(a, bool) == isinstance(b, bool)  # True is not 1 here


def check(value: Any, schema: dict, field: str, ignored: list[str] | None = None) -> Any:
    """Validate against the small JSON Schema subset the request schemas use; returns the value
    with integral floats made integers where an integer is asked for. A field beyond an object's
    properties is refused where the object says `additionalProperties: false` (`closed`), else
    left out of the value and its path added to `ignored`."""
    if "anyOf" in schema:
        errors = []
        for option in schema["anyOf"]:
            mine: list[str] = []  # an option that fails ignores nothing
            try:
                value = check(value, option, field, mine)
            except Invalid as exc:
                errors.append(exc)
            else:
                if ignored is not None:
                    ignored += mine
                return value
        fitting = [
            e
            for e, option in zip(errors, schema["anyOf"], strict=False)
            if "type" in option and _type_ok(value, option["type"])
        ]
        if len(fitting) == 1 and "x-error" not in schema:  # the value is of that option's kind: its error says most
            raise fitting[0]
        messages = [str(e) for e in errors]
        raise Invalid(field, schema.get("x-error", " or ".join(messages) if len(messages) < 3 else messages[0]))
    if "enum" in schema and not any(_same(value, allowed) for allowed in schema["enum"]):
        if schema.get("x-unsupported"):
            supported = [json.dumps(v) for v in schema["enum"] if v is not None]
            only = f" (only {', '.join(supported)})" if supported else ""
            raise Invalid(field, f"{field} is not supported by this server{only}")
        raise Invalid(field, f"{field} must be one of {', '.join(json.dumps(v) for v in schema['enum'])}")
    kinds = schema.get("type", [])
    kinds = kinds if isinstance(kinds, list) else [kinds]
    if kinds and not any(_type_ok(value, kind) for kind in kinds):
        finite = " (finite)" if "number" in kinds else ""
        raise Invalid(field, f"{field} must be {' or '.join(kinds)}{finite}")
    if value is None:
        return value
    if isinstance(value, float) and "integer" in kinds and "number" not in kinds:
        value = int(value)
    if "minimum" in schema and value < schema["minimum"]:
        raise Invalid(field, f"{field} must be >= {schema['minimum']}")
    if "exclusiveMinimum" in schema and value <= schema["exclusiveMinimum"]:
        raise Invalid(field, f"{field} must be > {schema['exclusiveMinimum']}")
    if "maximum" in schema and value > schema["maximum"]:
        raise Invalid(field, f"{field} must be <= {schema['maximum']}")
    if isinstance(value, str):
        if len(value) < schema.get("minLength", 0):
            raise Invalid(field, f"{field} must not be empty")
        if len(value) > schema.get("maxLength", math.inf):
            raise Invalid(field, f"{field} must be at most {schema['maxLength']} characters")
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            raise Invalid(field, f"{field} is not valid Unicode (a lone surrogate)") from None
    if isinstance(value, list):
        if len(value) < schema.get("minItems", 0):
            raise Invalid(field, f"{field} must hold at least {schema['minItems']} item(s)")
        if len(value) > schema.get("maxItems", math.inf):
            raise Invalid(field, f"{field} may hold at most {schema['maxItems']} items")
        if "items" not in schema:  # an enum's list, checked whole above
            return value
        if _plain_ints(value, schema["items"]):  # token ids: 500,000 of them are checked at once
            return value
        return [check(item, schema["items"], f"{field}[{i}]", ignored) for i, item in enumerate(value)]
    if isinstance(value, dict) and "properties" in schema:

        def path(name: str) -> str:
            return name if field == "body" else f"{field}.{name}"

        first = schema.get("x-check-first")  # the field that says what the object is (a content part's type)
        if first in value:
            check(value[first], schema["properties"][first], path(first), ignored)
        for name in schema.get("required", []):
            if name not in value:
                raise Invalid(path(name), f"{path(name)} is required")
        properties = schema["properties"]
        unknown = [name for name in value if name not in properties]
        if unknown and schema.get("additionalProperties") is False:
            raise Invalid(path(unknown[0]), f"unknown field {path(unknown[0])!r}")
        if unknown and ignored is not None:
            ignored += (path(name) for name in unknown)
        known = (name for name in value if name in properties)
        return {name: check(value[name], properties[name], path(name), ignored) for name in known}
    if isinstance(value, dict) and "additionalProperties" in schema:  # a map, such as logit_bias
        pattern = re.compile(schema["propertyNames"]["pattern"])
        if len(value) > schema.get("maxProperties", math.inf):
            raise Invalid(field, f"{field} may hold at most {schema['maxProperties']} entries")
        for name in value:
            if not pattern.fullmatch(name):
                raise Invalid(field, f"{field} keys must be token ids, not {name!r}")
        item = schema["additionalProperties"]
        return {name: check(value[name], item, f"{field}.{name}", ignored) for name in value}
    return value


def _plain_ints(value: list, items: dict) -> bool:
    """Whether every item is an int (not a bool) that `items` (an integer schema with bounds at
    most) accepts as it is: then nothing needs checking one by one."""
    if set(items) - {"type", "minimum", "maximum", "description"} or items.get("type") != "integer" or not value:
        return False
    if not all(type(item) is int for item in value):
        return False
    return min(value) >= items.get("minimum", -math.inf) and max(value) <= items.get("maximum", math.inf)


def with_defaults(body: dict, schema: dict) -> dict:
    return {name: body.get(name, prop.get("default")) for name, prop in schema["properties"].items()}


def _reject_constant(name: str) -> None:
    raise ValueError(f"{name} is not valid JSON")


MAX_JSON_DEPTH = 256  # nesting levels of a request body (a JSON Schema 200 levels deep still fits)
OFF_LOOP_BYTES = 64 * 1024  # a body larger than this is parsed and validated on a pool, off the loop


async def read_body(request: web.Request, validate: Callable[[Any], T]) -> T:
    """The request body as JSON, checked by `validate` (which raises ApiError): any content type
    is accepted (curl -d sends a form type). A large body is parsed and validated on a pool:
    500,000 token ids take the loop a second or more otherwise."""
    raw = await read_raw(request)

    def work() -> T:
        return validate(json_of(raw))

    if len(raw) <= OFF_LOOP_BYTES:
        return work()
    return await asyncio.get_running_loop().run_in_executor(request.app[TOKENIZER_POOL], work)


async def read_raw(request: web.Request) -> bytes:
    """The body's bytes, within BODY_TIMEOUT: a client that stops sending mid-body is answered
    408 and its connection closed, not waited for."""
    timeout = request.app[SETTINGS].body_timeout
    try:
        async with asyncio.timeout(timeout or None):
            return await request.read()  # raises 413 past MAX_BODY_BYTES
    except TimeoutError:
        raise ApiError(
            408, f"the request body did not arrive within BODY_TIMEOUT ({timeout:g} s)", close=True
        ) from None
    except RequestPayloadError as exc:  # a Content-Encoding the body does not follow, a broken chunk
        raise ApiError(
            400, f"the request body cannot be read: {str(exc).splitlines()[-1].strip()}", close=True
        ) from None


def json_of(raw: bytes) -> Any:
    deep = ApiError(400, f"request body is nested too deeply: at most {MAX_JSON_DEPTH} levels of objects and arrays")
    try:
        body = json.loads(raw, parse_constant=_reject_constant)
    except (ValueError, UnicodeDecodeError) as exc:
        raise ApiError(400, f"request body is not valid JSON: {exc}") from None
    except RecursionError:  # deeper than the parser goes: past MAX_JSON_DEPTH anyway
        raise deep from None
    if too_deep(body):
        raise deep
    return body


def too_deep(value: Any) -> bool:
    """Whether objects and arrays nest past MAX_JSON_DEPTH (iteratively: the check must not
    recurse itself)."""
    stack = [(value, 1)] if isinstance(value, (dict, list)) else []
    while stack:
        item, depth = stack.pop()
        for child in item.values() if isinstance(item, dict) else item:
            if isinstance(child, (dict, list)):
                if depth >= MAX_JSON_DEPTH:
                    return True
                stack.append((child, depth + 1))
    return False


def without_nulls(value: Any) -> Any:
    """Objects without their null members, at any depth: OpenAI's clients send null for an
    optional field they leave unset (and in messages OpenAI itself returned)."""
    if isinstance(value, dict):
        return {name: without_nulls(item) for name, item in value.items() if item is not None}
    if isinstance(value, list):
        return [without_nulls(item) for item in value]
    return value


def parse(body: Any, schema: dict, ignored: list[str] | None = None) -> dict:
    """The validated parameters with defaults filled in, or a 422 naming the field. The paths of
    the fields a `tolerant` schema ignored are added to `ignored`."""
    try:
        body = check(body, schema, "body", ignored)
    except Invalid as exc:
        raise ApiError(422, str(exc), field=exc.field) from None
    return with_defaults(body, schema)


# -- validation: a /v1 body's parameters, what was ignored, the server's defaults -----------------
# What the OpenAI and Anthropic routes take (`tolerant` schemas): the fields they ignore go to
# the request log line, and TEMPERATURE fills in for a request that sends none.


MAX_IGNORED = 32  # field paths in a request's log line; a path's client-given names are cut short too


def ignored_paths(paths: list[str]) -> list[str]:
    """The fields a request's body carried that were ignored, once each (`messages[3].x` and
    `messages[4].x` are `messages[].x`), as the request log line records them."""
    names = dict.fromkeys(re.sub(r"\[\d+\]", "[]", path)[:128] for path in paths)
    return list(names)[:MAX_IGNORED]


def note_skipped(request: web.Request, types: list[str]) -> None:
    """The types of the tools a request offered that nothing here can run, in its log line."""
    if types:
        request[LOG_FACTS]["tools_skipped"] = sorted({kind[:64] for kind in types})[:MAX_IGNORED]


def with_temperature(request: web.Request, body: Any, params: dict, schema: dict) -> dict:
    """TEMPERATURE for a request that sends none (within its API's range), where one is set."""
    default = request.app[SETTINGS].default_temperature
    given = isinstance(body, dict) and body.get("temperature") is not None
    if default is None or given or "temperature" not in schema["properties"]:
        return params
    return {**params, "temperature": min(default, schema["properties"]["temperature"].get("maximum", default))}


async def read_params(request: web.Request, schema: dict, after: Callable[[dict], dict] | None = None) -> dict:
    """A /v1 body's parameters (nulls count as absent, OpenAI's clients send them for unset
    fields), then `after`'s checks; what the schema ignored goes to the request log."""
    ignored: list[str] = []

    def validate(body: Any) -> dict:
        params = parse(without_nulls(body), schema, ignored)
        params = with_temperature(request, body, params, schema)
        return after(params) if after else params

    params = await read_body(request, validate)
    if ignored:
        request[LOG_FACTS]["ignored"] = ignored_paths(ignored)
    return params


# -- errors -----------------------------------------------------------------------------------


class ApiError(Exception):
    """An error answer. `json_errors` renders it in the shape of the route's API."""

    def __init__(
        self,
        status: int,
        message: str,
        field: str | None = None,
        code: str | None = None,
        retry_after: int | None = None,
        headers: dict | None = None,
        close: bool = False,
    ):
        super().__init__(message)
        self.status, self.message, self.field, self.code = status, message, field, code
        self.close = close  # the connection cannot go on (a body left unread): closed after the answer
        self.headers = {**({"Retry-After": str(retry_after)} if retry_after else {}), **(headers or {})}


NATIVE_ERROR_TYPES = {
    400: "invalid_json",
    401: "unauthorized",
    408: "request_timeout",
    404: "not_found",
    405: "method_not_allowed",
    413: "body_too_large",
    422: "invalid_request",
    429: "rate_limited",
    503: "unavailable",
    504: "timeout",
}
OPENAI_ERROR_TYPES = {
    400: "invalid_request_error",
    404: "invalid_request_error",
    408: "invalid_request_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    401: "authentication_error",
    429: "rate_limit_error",
}


def is_openai(request: web.Request) -> bool:
    """Whether errors come in OpenAI's shape: /v1, and the vLLM tokenizer routes."""
    return request.path.startswith("/v1/") or request.path in TOKENIZER_PATHS


def error_payload(request: web.Request, error: ApiError) -> tuple[int, dict]:
    """(status, body): the native shape, or OpenAI's on /v1 routes (where invalid input is a 400)."""
    status = error.status
    if is_anthropic(request):
        status = 400 if status == 422 else status
        return status, anthropic_error(request, status, error.message)
    if is_openai(request):
        status = 400 if status == 422 else status
        kind = OPENAI_ERROR_TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")
        return status, {"error": {"message": error.message, "type": kind, "param": error.field, "code": error.code}}
    body: dict[str, Any] = {
        "message": error.message,
        "type": NATIVE_ERROR_TYPES.get(status, "server_error" if status >= 500 else "client_error"),
    }
    if error.field is not None:
        body["field"] = error.field
    return status, {"error": body}


def error_response(request: web.Request, error: ApiError, headers: dict | None = None) -> web.Response:
    status, body = error_payload(request, error)
    response = web.json_response(body, status=status, headers={**error.headers, **(headers or {})})
    if error.close:
        response.force_close()
    return response


@web.middleware
async def json_errors(request: web.Request, handler) -> web.StreamResponse:
    """Every error leaves as `{"error": {...}}`; a bug is a 500 with a message, never a traceback."""
    try:
        return await handler(request)
    except ApiError as exc:
        return error_response(request, exc)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        # aiohttp's own errors (404, 405, 413) come as text: same status, JSON body.
        headers = {k: v for k, v in exc.headers.items() if k.lower() not in ("content-type", "content-length")}
        message = exc.text if exc.status == 413 else f"{exc.reason}: {request.method} {request.path}"
        return error_response(request, ApiError(exc.status, message), headers)
    except (asyncio.CancelledError, ConnectionResetError):
        raise
    except Exception:
        log.exception("unhandled error in %s %r", request.method, request.path)
        return error_response(request, ApiError(500, "internal server error"))


# -- request log ------------------------------------------------------------------------------


# Characters JSON leaves as they are that a terminal or a line-based reader would act on: DEL and
# the C1 controls (U+0085 is a line break, U+009B and U+009D start escape sequences), the line
# and paragraph separators, and the bidirectional overrides. Written as \uXXXX: the same JSON.
LOG_UNSAFE = re.compile("[\x7f-\x9f\u2028\u2029\u200e\u200f\u202a-\u202e\u2066-\u2069\ufeff]")


class RequestLog:
    """One JSON object per request in LOG_DIR/requests.log, rotated by size."""

    def __init__(self, directory: str, max_bytes: int, backups: int):
        Path(directory).mkdir(parents=True, exist_ok=True)
        self.path = Path(directory) / "requests.log"
        self._handler = RotatingFileHandler(
            self.path, maxBytes=max_bytes, backupCount=backups, encoding="utf-8", errors="backslashreplace"
        )

    def write(self, record: dict) -> None:
        line = LOG_UNSAFE.sub(lambda m: f"\\u{ord(m.group()):04x}", json.dumps(record, ensure_ascii=False, default=str))
        self._handler.handle(logging.makeLogRecord({"msg": line, "levelno": logging.INFO}))

    def close(self) -> None:
        self._handler.close()


@web.middleware
async def request_log(request: web.Request, handler) -> web.StreamResponse:
    """Logs in `finally`, so rejected, failed and cancelled requests get their line too."""
    started = time.perf_counter()
    request[RECEIVED_AT] = started
    given = request.headers.get("X-Request-Id", "")
    request[REQUEST_ID] = given if REQUEST_ID_FORMAT.fullmatch(given) else uuid.uuid4().hex
    facts: dict[str, Any] = {}
    request[LOG_FACTS] = facts
    status = 500
    try:
        response = await handler(request)
        status = response.status
        if not response.prepared:  # a whole answer: sent here, so that its client has WRITE_TIMEOUT to read it
            try:
                async with write_deadline(request):
                    await response.prepare(request)
                    await response.write_eof()
            except TimeoutError:
                stalled(request)
        return response
    except web.HTTPException as exc:
        status = exc.status
        raise
    except (asyncio.CancelledError, ConnectionResetError):
        status = 499  # client closed the connection (nginx's convention)
        raise
    finally:
        if facts.pop("client_closed", False):
            status = 499
        if facts.pop("delivered", False) and status == 499:  # closed after the stream's last event
            status = 200
        seconds = time.perf_counter() - started
        summary = facts.pop("summary", None)
        record = {
            "ts": datetime.now(UTC).isoformat(timespec="milliseconds"),
            "request_id": request[REQUEST_ID],
            "method": request.method,
            "path": request.path,
            "status": status,
            "duration_ms": round(seconds * 1000, 2),
            **facts,
        }
        request.app[REQUEST_LOG].write(record)
        request.app[METRICS].observe(request, status, seconds, summary)


# -- access: API keys, rate limits, CORS ----------------------------------------------------------

OPEN_PATHS = {"/health", "/ready", "/openapi.json"}  # probes and the API description need no key


def load_api_keys(settings: Settings) -> tuple[bytes, ...]:
    keys = settings.api_key.split(",")
    if settings.api_key_file:
        keys += [key_of_line(line) for line in Path(settings.api_key_file).expanduser().read_text().splitlines()]
    return tuple(key.strip().encode() for key in keys if key.strip())


def key_of_line(line: str) -> str:
    """A PHI2_API_KEY_FILE line's key: a `#` at the start of the line or after a space begins a
    comment (`# note`, `key  # note`); what is left must be one word."""
    key = re.split(r"(?:^|\s)#", line, maxsplit=1)[0].strip()
    if len(key.split()) > 1:
        raise ValueError(
            f"PHI2_API_KEY_FILE holds a line that is not one key (keys have no spaces): {len(key)} characters"
        )
    return key


def key_matches(given: bytes, keys: tuple[bytes, ...]) -> bool:
    # compare_digest against every key: the time taken tells nothing about which (or how much) matched
    matched = False
    for key in keys:
        matched |= hmac.compare_digest(given, key)
    return matched


class TokenBuckets:
    """RATE_LIMIT requests a minute for each client (or AUTH_FAILURES_PER_MINUTE wrong keys an
    address): a bucket that holds a minute's worth."""

    def __init__(self, per_minute: int):
        self.capacity, self.rate = float(per_minute), per_minute / 60.0
        self.buckets: dict[str, tuple[float, float]] = {}  # client -> (tokens, when)

    def take(self, client: str, now: float) -> float:
        """0 when the request may go, else the seconds until it may."""
        tokens, when = self.buckets.get(client, (self.capacity, now))
        tokens = min(self.capacity, tokens + (now - when) * self.rate)
        if len(self.buckets) > 10_000:  # forget clients whose buckets have refilled
            self.buckets = {
                c: (t, w) for c, (t, w) in self.buckets.items() if t + (now - w) * self.rate < self.capacity
            }
        if tokens >= 1:
            self.buckets[client] = (tokens - 1, now)
            return 0.0
        self.buckets[client] = (tokens, now)
        return (1 - tokens) / self.rate

    def waiting(self, client: str, now: float) -> float:
        """0 when `take` would let the client go now, else the seconds it must wait; takes nothing."""
        tokens, when = self.buckets.get(client, (self.capacity, now))
        tokens = min(self.capacity, tokens + (now - when) * self.rate)
        return 0.0 if tokens >= 1 else (1 - tokens) / self.rate


AUTH_FAILURES_PER_MINUTE = 30  # wrong keys an address may send; then it waits (429), right key or not


@web.middleware
async def access(request: web.Request, handler) -> web.StreamResponse:
    """API keys (Authorization: Bearer) and rate limits, for everything but the open paths and
    the CORS preflights this server answers (a browser sends those without credentials)."""
    if request.path in OPEN_PATHS or is_preflight(request):
        return await handler(request)
    client = f"address:{request.remote}"
    keys = request.app[API_KEYS]
    if keys:
        failures = request.app[AUTH_FAILURES]
        wait = failures.waiting(client, time.monotonic())
        if wait:
            raise ApiError(
                429,
                f"too many wrong API keys from this address; retry in {math.ceil(wait)} s",
                code="rate_limit_exceeded",
                retry_after=math.ceil(wait),
            )
        given = presented_key(request)
        # A header's bytes that are not UTF-8 come as surrogates: compared as the same bytes.
        given_bytes = (given or "").encode("utf-8", "surrogateescape")
        if given is None or not key_matches(given_bytes, keys):
            failures.take(client, time.monotonic())
            raise ApiError(
                401,
                "a valid API key is required: Authorization: Bearer <key>",
                code="invalid_api_key",
                headers={"WWW-Authenticate": "Bearer"},
            )
        client = "key:" + hashlib.sha256(given_bytes).hexdigest()[:16]  # never the key itself
        if len(keys) > 1:  # clients of different keys share no cached prompt (one key: one client)
            request[CACHE_NAMESPACE] = client
    limiter = request.app[RATE_LIMITER]
    if limiter is not None and request.path != "/metrics":  # scrapers are not clients
        wait = limiter.take(client, time.monotonic())
        if wait:
            raise ApiError(
                429,
                f"rate limit of {request.app[SETTINGS].rate_limit} requests a minute reached",
                code="rate_limit_exceeded",
                retry_after=math.ceil(wait),
            )
    return await handler(request)


def presented_key(request: web.Request) -> str | None:
    """The key a request presents: `Authorization: Bearer <key>`, or Anthropic's `x-api-key`
    (its SDK's header) where there is no Authorization header."""
    if "Authorization" in request.headers:
        scheme, _, given = request.headers["Authorization"].partition(" ")
        return given.strip() if scheme.lower() == "bearer" else None
    given = request.headers.get("x-api-key")
    return given.strip() if given is not None else None


def is_preflight(request: web.Request) -> bool:
    """A CORS preflight from an allowed origin (answered by `cors_preflight`, without a key)."""
    return (
        request.method == "OPTIONS"
        and "Access-Control-Request-Method" in request.headers
        and cors_origin(request) is not None
    )


def cors_origin(request: web.Request) -> str | None:
    """The Origin to allow, if CORS_ORIGINS allows it."""
    origin = request.headers.get("Origin")
    allowed = request.app[CORS_ORIGINS]
    return origin if origin and ("*" in allowed or origin in allowed) else None


@web.middleware
async def cors_preflight(request: web.Request, handler) -> web.StreamResponse:
    if is_preflight(request):
        return web.Response(
            status=204,
            headers={
                "Access-Control-Allow-Methods": "GET, POST, OPTIONS",
                "Access-Control-Allow-Headers": (
                    "Authorization, Content-Type, X-Request-Id, X-Api-Key, Anthropic-Version"
                ),
                "Access-Control-Max-Age": "600",
            },
        )
    return await handler(request)


async def add_headers(request: web.Request, response: web.StreamResponse) -> None:
    """on_response_prepare: every response (streams and errors too) carries its request id."""
    if REQUEST_ID in request:
        response.headers["X-Request-Id"] = request[REQUEST_ID]
    granted = request.get(LOG_FACTS, {}).get("max_tokens_granted")
    if granted is not None:  # an asked max_tokens clipped to the context left (`submit`)
        response.headers["X-Max-Tokens-Granted"] = str(granted)
    origin = cors_origin(request)
    if origin:
        response.headers["Access-Control-Allow-Origin"] = origin
        response.headers["Access-Control-Expose-Headers"] = "X-Request-Id, Retry-After, X-Max-Tokens-Granted"
        response.headers["Vary"] = "Origin"


# -- probes and model facts: /health, /ready, /model/info --------------------------------------


def engine_ready(request: web.Request) -> Engine:
    engine = request.app[ENGINE]
    if engine.status != "ok":
        message = "the model is still loading" if engine.status == "loading" else "the model failed to load"
        raise ApiError(503, message, retry_after=5)
    return engine


async def health(request: web.Request) -> web.Response:
    engine = request.app[ENGINE]
    return web.json_response(
        {
            "status": engine.status,
            "model_loaded": engine.status == "ok",
            "queue": {"waiting": engine.waiting, "active": engine.active},
        }
    )


async def ready(request: web.Request) -> web.Response:
    """200 only while new requests would be served: loaded, and not shutting down."""
    engine = request.app[ENGINE]
    draining = request.app[DRAINING].is_set()
    encoders = request.app[ENCODER].status
    body = {
        "ready": engine.status == "ok" and encoders == "ok" and engine.accepting and not draining,
        "status": engine.status,
        "draining": draining,
    }
    if not body["ready"]:
        return web.json_response(body, status=503, headers={"Retry-After": "5"})
    return web.json_response(body)


async def model_info(request: web.Request) -> web.Response:
    engine = engine_ready(request)
    info = engine.backend.info
    return web.json_response(
        {
            "model": info.model,
            "backend": info.backend,
            "device": info.device,
            "dtype": info.dtype,
            "adapter_path": info.adapter_path,
            "adapter_applied": info.adapter_applied,
            "adapters": await adapters_info(engine.backend),
            "quantization": info.quantization,
            "load_time_s": round(engine.load_time_s, 3),
            "context_length": info.context_length,
            "max_batch": engine.max_batch,
            "stats": {**dataclasses.asdict(engine.stats), "waiting": engine.waiting, "active": engine.active},
            "prompt_cache": dataclasses.asdict(engine.prompt_cache_usage()),
            "kv_cache": dataclasses.asdict(engine.kv_cache_usage()),
            "prompt_lookup_tokens": engine.backend.draft_tokens,
            "encoders": encoders_info(request.app),
            **info.extra,
        }
    )


async def available_adapters(backend: Backend) -> list[AdapterFacts]:
    """The adapters requests may choose now: ADAPTERS_DIR is read again, off the loop."""
    return await asyncio.get_running_loop().run_in_executor(None, backend.adapters.available)


async def adapters_info(backend: Backend) -> dict:
    """The adapters requests may choose, the default, and the loaded ones."""
    registry = backend.adapters
    available = await available_adapters(backend)
    return {
        "dir": str(registry.directory) if registry.directory else None,
        "default": registry.default_name,
        "max_loaded": registry.max_loaded,
        "loaded": registry.loaded(),
        "available": [facts.describe() for facts in available],
    }


# -- generations: one record a choice, tokenized, checked and submitted ------------------------


@dataclass(frozen=True)
class Generation:
    prompt: str | list[int]  # text, or token ids (OpenAI's completions take both)
    max_tokens: int  # 0 only with prompt_logprobs: the prompt is scored, nothing generated
    max_tokens_given: bool  # False: a default, clipped to the context left instead of refused
    sampling: Sampling
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None  # each generated token's logprob and this many alternatives
    prompt_logprobs: int | None = None  # the same for the prompt (OpenAI's echo)
    prompt_field: str = "prompt"  # the field a prompt too long for the context names
    grammar: Grammar | None = None  # compiled; `submit` gives the sequence a matcher of its own
    grammar_field: str | None = None  # the field that gave it (what a failing grammar's error names)
    keep_tokens: tuple[tuple[int, str], ...] = ()  # tags the reply's text keeps (Request.keep_tokens)
    thought: tuple[int, int, bool] | None = None  # a reasoning reply's tags (Request.thought)

    def request(self, prompt_ids: list[int], max_tokens: int, **context: Any) -> Request:
        """The engine's request for this generation: every field the two records share comes from
        here (so a field added to both flows through), the tokenized prompt, the `max_tokens` the
        limits left, and what the HTTP request adds (`context`: its time, adapter, namespace)."""
        shared = {f.name: getattr(self, f.name) for f in fields(Request) if f.name in GENERATION_FIELDS}
        return Request(**{**shared, "prompt_ids": prompt_ids, "max_tokens": max_tokens, **context})


GENERATION_FIELDS = frozenset(f.name for f in fields(Generation))


def stop_tuple(stop: str | list[str] | None) -> tuple[str, ...]:
    return (stop,) if isinstance(stop, str) else tuple(stop or ())


def sampling_of(params: dict, temperature: float, top_p: float, seed: int | None) -> Sampling:
    return Sampling(
        temperature=temperature,
        top_p=top_p,
        seed=seed,
        top_k=max(params["top_k"], 0),
        min_p=params["min_p"],
        repetition_penalty=params["repetition_penalty"],
        presence_penalty=params["presence_penalty"],
        frequency_penalty=params["frequency_penalty"],
        logit_bias=tuple(sorted((int(token), float(bias)) for token, bias in params["logit_bias"].items())),
    )


# A request's first INLINE_ENCODE_CHARS characters of prompt text are tokenized on the loop, the
# rest on the app's pool: a short prompt's encoding costs less than the hop to the pool and back
# (BENCHMARKS.md, D-inline-encode). Per request, so many short prompts still go to the pool.
INLINE_ENCODE_CHARS = 256


async def prompt_ids_of(request: web.Request, backend: Backend, gen: Generation, inline: bool = False) -> list[int]:
    if isinstance(gen.prompt, list):
        if len(gen.prompt) > backend.info.context_length:
            return gen.prompt  # refused as too long, without a look at every id
        if min(gen.prompt) < 0 or max(gen.prompt) >= backend.vocab_size:
            raise ApiError(
                422,
                f"{gen.prompt_field} holds a token id outside the vocabulary (0 to {backend.vocab_size - 1})",
                field=gen.prompt_field,
            )
        return gen.prompt
    if inline:
        return backend.encode(gen.prompt)
    # Tokenizing a long prompt takes milliseconds: off the loop, on the app's own small pool.
    loop = asyncio.get_running_loop()
    return await loop.run_in_executor(request.app[TOKENIZER_POOL], backend.encode, gen.prompt)


def too_long(
    request: web.Request, gen: Generation, prompt_tokens: int, max_tokens: int | None, context: int
) -> ApiError:
    """A prompt (and completion) beyond the context window: Anthropic's wording on its route (Claude
    Code compacts its conversation when it reads it), OpenAI's wording and code on the others under
    /v1, which clients such as litellm recognise (ContextWindowExceededError)."""
    if is_anthropic(request):
        return ApiError(400, f"prompt is too long: {prompt_tokens} tokens > {context - 1} maximum", field="messages")
    if not is_openai(request):
        if max_tokens is None:
            return ApiError(
                422, f"prompt is {prompt_tokens} tokens; the context window is {context} tokens", field=gen.prompt_field
            )
        return ApiError(
            422,
            f"max_tokens is {max_tokens}, but the prompt is {prompt_tokens} tokens and the context "
            f"window is {context}: at most {context - prompt_tokens} tokens can be generated",
            field="max_tokens",
        )
    where = "messages" if gen.prompt_field == "messages" else "prompt"
    asked = prompt_tokens + (max_tokens or 0)
    return ApiError(
        400,
        f"This model's maximum context length is {context} tokens. However, you requested {asked} tokens "
        f"({prompt_tokens} in the {where}, {max_tokens or 0} in the completion). Please reduce the length of the "
        f"{where} or completion.",
        field=gen.prompt_field,
        code="context_length_exceeded",
    )


async def adapter_for(request: web.Request, name: str | None) -> Adapter | None:
    """The adapter a request chose, loaded (off the loop; the backend keeps the last MAX_ADAPTERS
    loaded): `name` None is the default (ADAPTER_PATH's, if there is one), "" the base model."""
    registry = engine_ready(request).backend.adapters
    if name is None:
        name = registry.default_name or ""
    if name == "":
        return None
    request[LOG_FACTS]["adapter"] = name
    field = "model" if is_openai(request) else "adapter"
    try:
        return await asyncio.get_running_loop().run_in_executor(None, registry.get, name)
    except UnknownAdapter as exc:
        if is_openai(request):
            raise ApiError(
                404,
                f"The model {request[LOG_FACTS].get('model_id', name)!r} does not exist: {exc}",
                field=field,
                code="model_not_found",
            ) from None
        raise ApiError(422, str(exc), field=field) from None
    except AdapterError as exc:  # a name that leads out of ADAPTERS_DIR, or a broken folder
        raise ApiError(422, str(exc), field=field, code="invalid_adapter") from None


async def submit(
    request: web.Request, gens: list[Generation], adapter: str | None = None, cache_salt: str | None = None
) -> list[Ticket]:
    """Tokenize (off the loop but for a short prompt), check the limits, and queue the requests
    for the worker, all or none: the choices of one HTTP request, with the adapter it chose (see
    `adapter_for`), in its prompt cache namespace (its key's where there are several keys, and
    its salt's)."""
    received_at = request[RECEIVED_AT]
    namespace = request.get(CACHE_NAMESPACE, "")
    if cache_salt is not None:
        namespace += "#" + hashlib.sha256(cache_salt.encode()).hexdigest()[:16]
    settings = request.app[SETTINGS]
    if settings.log_prompts and isinstance(gens[0].prompt, str):
        request[LOG_FACTS]["prompt"] = gens[0].prompt[:100]
    engine = engine_ready(request)
    backend = engine.backend
    loaded = await adapter_for(request, adapter)
    context = backend.info.context_length
    jobs, encoded = [], {}
    inline_left = INLINE_ENCODE_CHARS
    for gen in gens:
        key = gen.prompt if isinstance(gen.prompt, str) else tuple(gen.prompt)
        if key not in encoded:  # the n choices of a prompt share its tokens
            inline = isinstance(gen.prompt, str) and len(gen.prompt) <= inline_left
            inline_left -= len(gen.prompt) if inline else 0
            encoded[key] = await prompt_ids_of(request, backend, gen, inline)
        prompt_ids = encoded[key]
        if any(not 0 <= token < backend.vocab_size for token, _ in gen.sampling.logit_bias):
            raise ApiError(
                422,
                f"logit_bias holds a token id outside the vocabulary (0 to {backend.vocab_size - 1})",
                field="logit_bias",
            )
        room = context - len(prompt_ids)
        if not prompt_ids:
            raise ApiError(422, "prompt encodes to no tokens", field=gen.prompt_field)
        if room < 1 and not (gen.max_tokens == 0 and room == 0):
            raise too_long(request, gen, len(prompt_ids), None, context)
        max_tokens = gen.max_tokens
        limit = settings.max_tokens_limit or math.inf
        # The /v1 routes clip an asked max_tokens to what fits, as agents expect (Claude Code asks
        # for 32,000 whatever the model); the native route refuses it, naming the numbers.
        clip = not gen.max_tokens_given or request.path.startswith("/v1/")
        if clip and max_tokens > min(room, limit):
            max_tokens = min(room, limit)
            if gen.max_tokens_given:
                facts = request[LOG_FACTS]
                facts["max_tokens_granted"] = min(max_tokens, facts.get("max_tokens_granted", max_tokens))
        elif max_tokens > limit:
            raise ApiError(
                422,
                f"max_tokens is {max_tokens}; this server allows at most {limit} (MAX_TOKENS_LIMIT)",
                field="max_tokens",
            )
        elif max_tokens > room:
            raise too_long(request, gen, len(prompt_ids), max_tokens, context)
        jobs.append(
            gen.request(
                prompt_ids,
                max_tokens,
                received_at=received_at,
                timeout_s=settings.request_timeout or None,
                adapter=loaded,
                cache_namespace=namespace,
            )
        )
    asked = sum(job.max_tokens for job in jobs)
    if settings.max_request_tokens and asked > settings.max_request_tokens:
        raise ApiError(
            422,
            f"this request asks for {asked} tokens in all ({len(jobs)} sequences up to max_tokens each); "
            f"this server allows at most {settings.max_request_tokens} a request (MAX_REQUEST_TOKENS)",
            field="max_tokens",
        )
    if any(gen.grammar is not None for gen in gens):
        # Each constrained sequence walks a copy of its grammar of its own, made here: a large
        # grammar's copy is work the generation thread must never do.
        loop = asyncio.get_running_loop()
        matchers = await loop.run_in_executor(
            request.app[TOKENIZER_POOL], lambda: [gen.grammar and gen.grammar.matcher() for gen in gens]
        )
        jobs = [
            dataclasses.replace(job, sampling=dataclasses.replace(job.sampling, constraint=m)) if m else job
            for job, m in zip(jobs, matchers, strict=False)
        ]
    try:
        return engine.submit_all(jobs)
    except QueueFull as exc:
        raise ApiError(503, f"server busy: {exc}", retry_after=2) from None
    except NotAccepting as exc:
        raise ApiError(503, f"not accepting requests: {exc}", retry_after=5) from None


# -- grammars: compiled off the loop, bounded --------------------------------------------------


GRAMMAR_TIMEOUT_S = 10.0  # a grammar that takes longer to compile (queue wait included) is refused
GRAMMAR_WORKERS = 2  # compiles at once
GRAMMAR_BACKLOG = 8  # compiles in flight (running or queued); more get 503 at once


class BoundedPool:
    """A thread pool that takes at most `backlog` jobs in flight. A job whose caller stopped
    waiting (a compile past its time limit) cannot be interrupted: it keeps its place until it
    really ends, so a client sending slow grammars fills this pool, and only this one."""

    def __init__(self, workers: int, backlog: int, name: str):
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix=name)
        self._backlog = backlog
        self._in_flight = 0
        self._lock = threading.Lock()

    def submit(self, fn: Callable, *args) -> asyncio.Future | None:
        """An awaitable of fn(*args) run on the pool, or None when the backlog is full."""
        with self._lock:
            if self._in_flight >= self._backlog:
                return None
            self._in_flight += 1

        def job():
            try:
                return fn(*args)
            finally:
                with self._lock:
                    self._in_flight -= 1

        return asyncio.get_running_loop().run_in_executor(self._pool, job)

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


async def compile_constraint(
    request: web.Request, kind: str, spec: str, field: str, params: dict
) -> tuple[Grammar, str]:
    """A JSON Schema, JSON mode or a regex compiled for the model's tokenizer (off the loop,
    cached by the backend), and the field it came from; what cannot be compiled is a 422 (400 on
    /v1) naming the field. A grammar compiled before is taken from the cache at once, however
    busy the compiler is."""
    if params.get("ignore_eos"):
        raise ApiError(
            422,
            "ignore_eos cannot be combined with a constraint: generation ends where the grammar does",
            field="ignore_eos",
        )
    if params.get("stop"):
        raise ApiError(
            422,
            f"stop cannot be combined with {field}: the output ends where the grammar is complete, and a stop "
            "sequence could cut it short",
            field="stop",
        )
    backend = engine_ready(request).backend
    request[LOG_FACTS]["grammar"] = field
    grammar = backend.cached_constraint(kind, spec)
    if grammar is not None:
        return grammar, field
    work = request.app[GRAMMAR_COMPILER].submit(backend.constraint, kind, spec)
    if work is None:
        raise ApiError(
            503,
            f"the grammar compiler is busy ({GRAMMAR_BACKLOG} compiles in flight); retry later",
            field=field,
            retry_after=5,
        )
    try:
        return await asyncio.wait_for(work, GRAMMAR_TIMEOUT_S), field
    except GrammarError as exc:
        raise ApiError(422, f"{field} cannot be used: {exc}", field=field) from None
    except TimeoutError:
        raise ApiError(422, f"{field} did not compile within {GRAMMAR_TIMEOUT_S:.0f} s", field=field) from None


async def native_constraint(request: web.Request, params: dict) -> tuple[Grammar | None, str | None]:
    if params["json_schema"] is not None and params["regex"] is not None:
        raise ApiError(422, "give json_schema or regex, not both", field="regex")
    if params["json_schema"] is not None:
        return await compile_constraint(
            request, "json_schema", json.dumps(params["json_schema"]), "json_schema", params
        )
    if params["regex"] is not None:
        return await compile_constraint(request, "regex", params["regex"], "regex", params)
    return None, None


# -- answers: one loop, one wire format object per API -----------------------------------------
# Every generating route ends in `answer(request, tickets, wire)`. The loop reads the choices'
# events (text, a token's logprobs, the end); a `Wire` turns them into what its API sends. A
# stream writes each event's chunk as it comes; a whole answer is a fold over the same events,
# then `wire.body()`. A new API is a new Wire, not a new loop.


async def json_answer(request: web.Request, build: Callable[[], dict], heavy: bool) -> web.Response:
    """A whole answer. One with logprobs (megabytes with n 16 and top_logprobs 20) is built and
    encoded on a pool: the loop would stop for a second or more otherwise."""
    if not heavy:
        return web.json_response(build())
    text = await asyncio.get_running_loop().run_in_executor(request.app[TOKENIZER_POOL], lambda: json.dumps(build()))
    return web.Response(text=text, content_type="application/json")


@dataclass
class Answer:
    """One choice as it comes back: its text, its tokens' logprobs (both kept only for a whole
    answer), its summary."""

    text: list[str] = field(default_factory=list)
    logprobs: list[StepLogprobs] = field(default_factory=list)
    summary: Summary | None = None


class Wire:
    """One API's wire format for one request. `add` takes each event in order; streaming, it
    returns the text to send for it (keeping what state the format needs), between `opening()`
    and `tail()`; whole, it keeps the event in `choices`, and `body()` builds the answer."""

    content_type = "text/event-stream"

    def __init__(self, request: web.Request, tickets: list[Ticket], streaming: bool):
        self.request, self.tickets, self.streaming = request, tickets, streaming
        self.backend: Backend = request.app[ENGINE].backend
        self.choices = [Answer() for _ in tickets]

    @property
    def heavy(self) -> bool:
        """Whether the whole body is worth building and encoding on a pool (logprobs)."""
        return False

    @property
    def finished(self) -> bool:
        return all(choice.summary is not None for choice in self.choices)

    def summaries(self) -> list[Summary]:
        return [choice.summary for choice in self.choices]

    def add(self, index: int, event: Event) -> str:
        choice = self.choices[index]
        if isinstance(event, Summary):
            choice.summary = event
        elif not self.streaming:
            (choice.text if isinstance(event, str) else choice.logprobs).append(event)
        return self.chunk(index, event) if self.streaming else ""

    def opening(self) -> str:
        """What a stream starts with, sent with its headers."""
        return ""

    def keepalive(self) -> str:
        """What a stream sends while it waits for its first token, so that clients and proxies
        do not time out: an SSE comment line (NDJSON has none: the headers alone)."""
        return ": keep-alive\n\n" if self.content_type == "text/event-stream" else ""

    def chunk(self, index: int, event: Event) -> str:
        raise NotImplementedError

    def tail(self) -> str:
        """What a stream ends with, once every choice has ended."""
        return ""

    def body(self) -> dict:
        raise NotImplementedError


async def answer(request: web.Request, tickets: list[Ticket], wire: Wire) -> web.StreamResponse:
    """Answer with the tickets' events in `wire`'s format, streamed or whole. Every ticket is
    cancelled on the way out (a no-op when finished; it stops the worker when the client went
    away). A whole answer whose generation did not finish is an error answer (`raise_unfinished`);
    a stream says so in its own format."""
    response = None
    if wire.streaming:
        response = web.StreamResponse(headers={"Content-Type": wire.content_type, "Cache-Control": "no-cache"})
        response.enable_chunked_encoding()
    started = time.perf_counter()
    # Until the first events, a stream is kept alive (STREAM_KEEPALIVE); after, its tokens do it.
    keepalive = request.app[SETTINGS].stream_keepalive if response is not None else 0
    try:
        while not wire.finished:
            try:
                if keepalive:
                    events = await asyncio.wait_for(next_events(tickets), keepalive)
                    keepalive = 0
                else:
                    events = await next_events(tickets)
            except TimeoutError:  # `take` keeps what it had: nothing is lost
                await send(request, response, tickets, wire, [wire.keepalive()], started)
                continue
            chunks = [wire.add(index, event) for index, event in events]
            if response is not None:
                if wire.finished:
                    chunks.append(wire.tail())
                await send(request, response, tickets, wire, chunks, started)
                # Its last event written: a client that closes now (Codex does, at
                # response.completed) had the whole answer, and the log says 200.
                request[LOG_FACTS]["delivered"] = wire.finished
        note_summary(request, combined(wire.summaries()))
        if response is not None:
            await settle_checks(request)
            async with write_deadline(request):
                await response.write_eof()
            return response
        for summary in wire.summaries():
            raise_unfinished(request, summary)
        whole = await json_answer(request, wire.body, wire.heavy)
        await settle_checks(request)
        return whole
    except ConnectionResetError:
        if response is None:
            raise
        request[LOG_FACTS]["client_closed"] = True
        return response
    except TimeoutError:
        if response is None:
            raise
        stalled(request)
        return response
    finally:
        for ticket in tickets:
            ticket.cancel()


async def send(
    request: web.Request,
    response: web.StreamResponse,
    tickets: list[Ticket],
    wire: Wire,
    chunks: list[str],
    started: float,
) -> None:
    """One write of a stream, within WRITE_TIMEOUT."""
    if not response.prepared:
        # Headers go out with the first events, so a queued request has not answered yet
        # and a client sees one consistent first byte.
        chunks.insert(0, wire.opening())
        async with write_deadline(request):
            await response.prepare(request)
        request[LOG_FACTS]["ttfb_ms"] = round((time.perf_counter() - started) * 1000, 2)
    data = "".join(chunks).encode()
    if not data:
        return
    for ticket in tickets:  # the worker may end a stream whose client stopped reading
        ticket.writing = True
    if takes_without_waiting(request, len(data)):
        await response.write(data)  # cannot wait: no deadline to arm (a timer a token costs)
    else:
        async with write_deadline(request):
            await response.write(data)
    for ticket in tickets:
        ticket.writing = False


# Room for what chunked encoding adds to a write (its length line and CRLF).
CHUNK_FRAMING = 32


def takes_without_waiting(request: web.Request, size: int) -> bool:
    """Whether a write of `size` bytes returns without waiting: the socket's buffer is not paused
    and stays within its high-water mark with them (only a paused transport makes a write wait
    for the client). At hundreds of streams a deadline armed and disarmed per write was a
    twentieth of the event loop's time."""
    transport = request.transport
    protocol = request.protocol
    if transport is None or protocol is None or protocol.writing_paused:
        return False
    _, high = transport.get_write_buffer_limits()
    return transport.get_write_buffer_size() + size + CHUNK_FRAMING <= high


def write_deadline(request: web.Request):
    """WRITE_TIMEOUT around a write: a client that stops reading blocks it once the socket's
    buffers are full (and the worker ends its generation once STREAM_BUFFER tokens wait)."""
    return asyncio.timeout(request.app[SETTINGS].write_timeout or None)


def stalled(request: web.Request) -> None:
    """The client stopped reading for WRITE_TIMEOUT: drop the connection (what is buffered for it
    is discarded) and log it as a client that left."""
    request[LOG_FACTS].update(
        client_closed=True,
        error=f"the client stopped reading for WRITE_TIMEOUT ({request.app[SETTINGS].write_timeout:g} s)",
    )
    if request.transport is not None:
        request.transport.abort()


def combined(summaries: list[Summary]) -> Summary:
    """One summary for the request log and metrics: the choices' tokens added up."""
    first = summaries[0]
    if len(summaries) == 1:
        return first
    return dataclasses.replace(
        first,
        tokens_used=sum(s.tokens_used for s in summaries),
        cached_tokens=sum(s.cached_tokens for s in summaries),
        finish_reason=next(
            (s.finish_reason for s in summaries if s.finish_reason not in ("stop", "length")), first.finish_reason
        ),
    )


def note_summary(request: web.Request, summary: Summary) -> None:
    request[LOG_FACTS].update(tokens_used=summary.tokens_used, finish_reason=summary.finish_reason, summary=summary)


def grammar_failed(summary: Summary) -> bool:
    """The request's own grammar failed while generating: the client's input, not the server."""
    return summary.finish_reason == "error" and summary.error_kind == "grammar"


def raise_unfinished(request: web.Request, summary: Summary) -> None:
    """An error answer for a generation that did not finish (whole responses only)."""
    reason = summary.finish_reason
    if grammar_failed(summary):
        field = request[LOG_FACTS].get("grammar")
        raise ApiError(422, f"{field} cannot be used: {summary.error}", field=field)
    if reason == "error":
        raise ApiError(500, summary.error or "generation failed")
    if reason == "timeout":
        raise ApiError(504, f"generation did not finish within REQUEST_TIMEOUT ({summary.total_ms / 1000:.1f} s)")
    if reason == "shutdown" and summary.tokens_used == 0:
        raise ApiError(503, "the server is shutting down", retry_after=5)


# -- the native API: /generate, /generate/stream -----------------------------------------------


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


def summary_fields(request: web.Request, summary: Summary, backend: Backend) -> dict:
    fields_ = {
        "request_id": request[REQUEST_ID],
        "tokens_used": summary.tokens_used,
        "prompt_tokens": summary.prompt_tokens,
        "cached_tokens": summary.cached_tokens,
        "finish_reason": summary.finish_reason,
        "model": backend.info.model,
        "adapter": request[LOG_FACTS].get("adapter"),
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

    def __init__(self, request: web.Request, tickets: list[Ticket], streaming: bool, params: dict):
        super().__init__(request, tickets, streaming)
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
        return rest + json.dumps({"done": True, **summary_fields(self.request, event, self.backend)}) + "\n"

    def body(self) -> dict:
        (choice,) = self.choices
        out = {"text": "".join(choice.text), **summary_fields(self.request, choice.summary, self.backend)}
        if self.logprobs:
            out["logprobs"] = native_logprobs(self.backend, choice.logprobs)
        return out


async def native_answer(request: web.Request, streaming: bool) -> web.StreamResponse:
    body, params = await read_body(request, native_params)
    params = with_temperature(request, body, params, GENERATE_SCHEMA)
    generation = native_generation(params, body, await native_constraint(request, params))
    tickets = await submit(request, [generation], params["adapter"], params["cache_salt"])
    return await answer(request, tickets, NativeWire(request, tickets, streaming, params))


async def generate(request: web.Request) -> web.StreamResponse:
    return await native_answer(request, streaming=False)


async def generate_stream(request: web.Request) -> web.StreamResponse:
    return await native_answer(request, streaming=True)


# -- OpenAI-compatible API: request schemas ----------------------------------------------------
# The same worker, limits and log as the native routes; OpenAI's wire format and defaults.
# Unset optional fields may come as null, and what a local server can ignore is accepted (user,
# store, metadata, service_tier ...); a field that asks for what this server cannot do (audio, content
# parts or modalities other than text, prediction, web_search_options, a completion's suffix) is a
# 400 that names it (`x-unsupported`). Tools and response_format (text, json_object, json_schema)
# are served. docs/api.md, "OpenAI-compatible API".

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
COMPLETIONS_SCHEMA: dict[str, Any] = tolerant(
    {
        "type": "object",
        "required": ["prompt"],
        "properties": {
            **OPENAI_COMMON,
            "prompt": {
                "anyOf": [
                    {"type": "string", "minLength": 1},
                    {
                        "type": "array",
                        "minItems": 1,
                        "maxItems": MAX_PROMPTS,
                        "items": {"type": "string", "minLength": 1},
                    },
                    TOKEN_IDS,
                    {"type": "array", "minItems": 1, "maxItems": MAX_PROMPTS, "items": TOKEN_IDS},
                ],
                "x-error": (
                    "prompt must be a string, a list of token ids, or a list of up to "
                    f"{MAX_PROMPTS} of either (none empty)"
                ),
            },
            # OpenAI's default is 16, applied in v1_completions: a schema default here would count
            # as asked for, and refuse a prompt that leaves less room instead of clipping to it.
            # 0 scores the prompt alone (with echo).
            "max_tokens": {"type": "integer", "minimum": 0},
            "echo": {"type": "boolean", "default": False},
            "logprobs": {"type": "integer", "minimum": 0, "maximum": 5},
            "best_of": {"type": "integer", "minimum": 1, "maximum": MAX_CHOICES},
            "suffix": _unsupported(""),
            "response_format": RESPONSE_FORMAT,
        },
    }
)
CONTENT_PART = {
    "type": "object",
    "required": ["type", "text"],
    "properties": {"type": {"enum": ["text"], "x-unsupported": True}, "text": {"type": "string"}},
    "x-check-first": "type",
}
FUNCTION_CALL = {
    "type": "object",
    "required": ["name"],
    "properties": {
        "name": {"type": "string"},
        "arguments": {"type": "string", "description": "a JSON object, as text"},
    },
}
CUSTOM_CALL = {  # a custom tool's call: its input as text
    "type": "object",
    "required": ["name", "input"],
    "properties": {"name": {"type": "string"}, "input": {"type": "string"}},
}
TOOL_CALL = {  # a function's call, or a custom tool's (type "custom")
    "type": "object",
    "properties": {
        "id": {"type": "string"},
        "type": {"enum": ["function", "custom"]},
        "function": FUNCTION_CALL,
        "custom": CUSTOM_CALL,
    },
}
MESSAGE = {
    "type": "object",
    "required": ["role"],
    "properties": {
        "role": {"enum": ["system", "developer", "user", "assistant", "tool", "function"]},
        "content": {"anyOf": [{"type": "string"}, {"type": "array", "items": CONTENT_PART}]},
        "name": {"type": "string"},
        "tool_calls": {"type": "array", "items": TOOL_CALL},
        "tool_call_id": {"type": "string", "description": "a tool message: the call it answers"},
        "function_call": FUNCTION_CALL,  # the deprecated single call of an assistant message
        # What a reasoning server returns: clients send it back as it is (it is not rendered).
        "reasoning_content": _ignored("string"),
        # What OpenAI puts in the assistant messages it returns: clients send them back as they are.
        "refusal": _ignored("string"),
        "annotations": {"type": "array", "items": {}, "description": "accepted and ignored"},
        "audio": _unsupported(),
    },
}
FUNCTION = {
    "type": "object",
    "required": ["name"],
    "properties": {
        "name": {"type": "string", "minLength": 1, "maxLength": 64},
        "description": {"type": "string"},
        "parameters": {"type": "object", "description": "a JSON Schema of the arguments; absent: any object"},
        "strict": {"type": "boolean", "description": "accepted: a call always follows its schema"},
    },
}
# OpenAI's custom tool: its input is text, free or in a grammar of the client's (Lark or a
# regex), which constrains it as a schema does a function's arguments (backends.chat.tools). Chat
# nests the grammar (`format.grammar.syntax`), Responses does not (`format.syntax`).
GRAMMAR = {
    "type": "object",
    "properties": {"syntax": {"enum": ["lark", "regex"]}, "definition": {"type": "string", "minLength": 1}},
}
CUSTOM_FORMAT = {
    "type": "object",
    "required": ["type"],
    "x-check-first": "type",
    "properties": {"type": {"enum": ["text", "grammar"]}, "grammar": GRAMMAR, **GRAMMAR["properties"]},
}
CUSTOM_TOOL = {
    "type": "object",
    "required": ["name"],
    "properties": {
        "name": FUNCTION["properties"]["name"],
        "description": {"type": "string"},
        "format": CUSTOM_FORMAT,
    },
}
TOOL = {
    "type": "object",
    "required": ["type"],
    "properties": {
        "type": {"enum": ["function", "custom"], "x-unsupported": True},
        "function": FUNCTION,
        "custom": CUSTOM_TOOL,
    },
    "x-check-first": "type",
}
NAME_ONLY = {"type": "object", "required": ["name"], "properties": {"name": {"type": "string"}}}
NAMED_TOOL = {
    "type": "object",
    "required": ["type"],
    "properties": {"type": {"enum": ["function", "custom"]}, "function": NAME_ONLY, "custom": NAME_ONLY},
}
MAX_TOOLS = 128  # OpenAI's limit
# A reasoning model's switches (backends.chat.plan.ChatRequest): vLLM's chat_template_kwargs and
# thinking_token_budget, and OpenAI's reasoning_effort ("none": no thinking; a degree: a budget).
REASONING_CONTROLS = {
    "chat_template_kwargs": {"type": "object", "description": "what the chat template reads besides the messages"},
    "reasoning_effort": {"type": "string", "description": '"none" asks a reasoning model not to think'},
    "thinking_token_budget": {"type": "integer", "minimum": -1, "description": "tokens of reasoning (-1: no limit)"},
}
# An effort's thinking budget in tokens (None: no limit; "none": no thinking at all), for OpenAI's
# reasoning_effort and reasoning.effort and Anthropic's output_config.effort. An effort not named
# here sets no budget. Chosen for the small local models this server runs (an 8k context):
# docs/api.md, "Reasoning".
EFFORT_BUDGETS = {"minimal": 256, "low": 1024, "medium": 4096, "high": None, "xhigh": None, "max": None}
CHAT_DEFAULT_MAX_TOKENS = 512  # OpenAI has no default cap; a local server wants one
CHAT_SCHEMA: dict[str, Any] = tolerant(
    {
        "type": "object",
        "required": ["messages"],
        "properties": {
            **OPENAI_COMMON,
            "messages": {"type": "array", "minItems": 1, "items": MESSAGE},
            "max_completion_tokens": {"type": "integer", "minimum": 1},
            "logprobs": {"type": "boolean", "default": False},
            "top_logprobs": {"type": "integer", "minimum": 0, "maximum": MAX_LOGPROBS},
            "tools": {"type": "array", "maxItems": MAX_TOOLS, "items": TOOL},
            "tool_choice": {
                "anyOf": [{"enum": ["none", "auto", "required"]}, NAMED_TOOL],
                "x-error": (
                    'tool_choice must be "none", "auto", "required", {"type": "function", "function": {"name": ...}} '
                    'or {"type": "custom", "custom": {"name": ...}}'
                ),
            },
            "parallel_tool_calls": {"type": "boolean", "default": True},
            # The deprecated forms of tools and tool_choice.
            "functions": {"type": "array", "maxItems": MAX_TOOLS, "items": FUNCTION},
            "function_call": {
                "anyOf": [
                    {"enum": ["none", "auto"]},
                    {"type": "object", "required": ["name"], "properties": {"name": {"type": "string"}}},
                ],
                "x-error": 'function_call must be "none", "auto" or {"name": ...}',
            },
            "response_format": RESPONSE_FORMAT,
            "modalities": _unsupported(["text"]),
            **REASONING_CONTROLS,
            "audio": _unsupported(),
            "prediction": _unsupported(),
            "web_search_options": _unsupported(),
        },
    }
)


# -- OpenAI-compatible API: models, /v1/models -------------------------------------------------


WILDCARDS = re.compile(r"[*?\[]")


def served_names(request: web.Request) -> list[str]:
    """The names the model answers to on /v1 and lists: SERVED_MODEL_NAME's aliases, else PHI2_MODEL."""
    settings = request.app[SETTINGS]
    names = [name.strip() for name in settings.served_model_name.split(",") if name.strip()]
    return [name for name in names if not WILDCARDS.search(name)] or [settings.model]


def name_patterns(request: web.Request) -> list[str]:
    """SERVED_MODEL_NAME's wildcard aliases (`claude-*`, `*`): names a client may use that are not
    listed, such as the small model Claude Code asks for in the background."""
    names = (name.strip() for name in request.app[SETTINGS].served_model_name.split(","))
    return [name for name in names if WILDCARDS.search(name)]


def model_named(request: web.Request, name: str | None) -> tuple[str, str | None]:
    """The name to answer with (the one the request used) and the adapter it names: a served
    name alone is the default adapter (None), `name:adapter` that adapter, `name:` the base model.
    Whether the adapter exists is for `adapter_for` to say."""
    names = served_names(request)
    if name is None:
        return names[0], None
    if name in names:
        return name, None
    base, colon, adapter = name.rpartition(":")
    if not colon or base not in names:
        if any(fnmatch.fnmatchcase(name, pattern) for pattern in name_patterns(request)):
            return name, None
        raise ApiError(
            404,
            f"The model {name!r} does not exist; this server serves {', '.join(map(repr, names))} and their adapters "
            "(name:adapter, GET /v1/models)",
            field="model",
            code="model_not_found",
        )
    request[LOG_FACTS]["model_id"] = name
    return name, adapter


async def v1_models(request: web.Request) -> web.Response:
    """The served names, then `name:adapter` for every adapter there is now (ADAPTERS_DIR is read
    again for each listing), with its config's facts (as vLLM lists LoRA modules: parent, root)."""
    engine = engine_ready(request)
    names = served_names(request)
    cards = [model_card(engine, name) for name in names]
    facts = await available_adapters(engine.backend)
    cards += [adapter_card(engine, names[0], adapter) for adapter in facts]
    for kind, encoder in request.app[ENCODER].encoders.items():  # EMBEDDING_MODEL, RERANK_MODEL
        if of_chat_model(encoder):  # the chat model's cards say it embeds too
            cards[: len(names)] = [{**card, "tasks": ["chat", "embedding"]} for card in cards[: len(names)]]
        else:
            cards.append({**model_card(engine, encoder_names(request, encoder)[0]), "task": kind})
    return web.json_response({"object": "list", "data": cards})


async def v1_model(request: web.Request) -> web.Response:
    engine = engine_ready(request)
    embeds = False
    for kind, encoder in request.app[ENCODER].encoders.items():
        embeds = embeds or of_chat_model(encoder)
        if not of_chat_model(encoder) and request.match_info["model"] in encoder_names(request, encoder):
            return web.json_response({**model_card(engine, request.match_info["model"]), "task": kind})
    name, adapter = model_named(request, request.match_info["model"])
    if not adapter:
        return web.json_response({**model_card(engine, name), **({"tasks": ["chat", "embedding"]} if embeds else {})})
    facts = await available_adapters(engine.backend)
    found = next((f for f in facts if f.name == adapter), None)
    if found is None:
        raise ApiError(
            404, f"The model {name!r} does not exist: no adapter {adapter!r}", field="model", code="model_not_found"
        )
    return web.json_response(adapter_card(engine, name.rpartition(":")[0], found))


def model_card(engine: Engine, name: str) -> dict:
    created = int(time.time() - (time.perf_counter() - engine.loaded_at))
    return {"id": name, "object": "model", "created": created, "owned_by": "phi2-server"}


def adapter_card(engine: Engine, base: str, facts: AdapterFacts) -> dict:
    return {
        **model_card(engine, f"{base}:{facts.name}"),
        "parent": base,
        "root": facts.path,
        "adapter": facts.describe(),
    }


# -- OpenAI-compatible API: parameters, usage, logprobs, SSE -----------------------------------


def openai_params(params: dict) -> dict:
    """/v1 parameters' checks beyond the schema's."""
    if params.get("top_logprobs") is not None and not params.get("logprobs"):
        raise ApiError(400, "top_logprobs needs logprobs: true", field="top_logprobs")
    return params


def response_grammar(params: dict) -> tuple[GrammarSpec | None, str | None]:
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


async def grammar_options(request: web.Request, grammar: GrammarSpec | None, field: str | None, checks: dict) -> dict:
    """A grammar compiled, as Generation's grammar and grammar_field (none: {})."""
    if grammar is None:
        return {}
    compiled, field = await compile_constraint(request, grammar.kind, grammar.spec, field, checks)
    return {"grammar": compiled, "grammar_field": field}


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


def check_sequences(request: web.Request, gens: list[Generation]) -> None:
    limit = request.app[ENGINE].max_queue
    if len(gens) > limit:
        raise ApiError(
            400,
            f"this request asks for {len(gens)} sequences (prompts x choices); the server queues at most {limit} "
            "(MAX_QUEUE)",
            field="n",
        )


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


def sse_error(request: web.Request, summary: Summary) -> str:
    if grammar_failed(summary):  # the request's own grammar: its field, as a 400 would name it
        return sse(
            {
                "error": {
                    "message": summary.error,
                    "type": "invalid_request_error",
                    "param": request[LOG_FACTS].get("grammar"),
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


# How OpenAI shows tokens: wire formatting, so here rather than in backends.


def token_string(data: bytes) -> str:
    """A token as text, as OpenAI shows it: the bytes of part of a character as `bytes:\\xNN`."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{b:02x}" for b in data)


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


# -- OpenAI-compatible API: /v1/completions ----------------------------------------------------


class CompletionsWire(Wire):
    """/v1/completions: a `text_completion` body, or its SSE chunks then `[DONE]`. Choices come
    `copies` (best_of) a prompt; a whole answer keeps each prompt's `n` best by mean logprob."""

    def __init__(self, request: web.Request, tickets: list[Ticket], params: dict, name: str, texts: list[str]):
        super().__init__(request, tickets, params["stream"])
        self.n, self.echo, self.k = params["n"], params["echo"], params["logprobs"]
        self.copies = params["best_of"] or self.n
        self.texts = texts  # the prompts as text, where echo shows them or logprobs count offsets from them
        self.prompts = len(tickets) // self.copies
        self.envelope = response_head(name, "text_completion")
        self.include_usage = bool(params["stream_options"].get("include_usage"))
        self.pending: dict[int, list[StepLogprobs]] = {i: [] for i in range(len(tickets))}
        self.echoed: set[int] = set()
        self.shapers: dict[int, CompletionLogprobs] = {}  # a streamed choice's: its text offsets run on

    @property
    def heavy(self) -> bool:
        return self.k is not None or self.copies > self.n

    def shaper(self, prompt: int) -> CompletionLogprobs:
        return CompletionLogprobs(self.backend, self.k, 0 if self.echo else len(self.texts[prompt]))

    def sse_chunk(self, index: int, text: str, entries: list | None = None, finish: str | None = None) -> str:
        logprobs = None
        if self.k is not None and entries:
            if index not in self.shapers:
                self.shapers[index] = self.shaper(index // self.n)
            logprobs = self.shapers[index].shape(entries)
        payload = {
            **self.envelope,
            "choices": [{"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish}],
        }
        return sse({**payload, "usage": None} if self.include_usage else payload)

    def chunk(self, index: int, event: Event) -> str:
        out = ""
        if self.echo and index not in self.echoed:  # the prompt first, with its logprobs
            self.echoed.add(index)
            scores = [event] if isinstance(event, StepLogprobs) else []
            prompt_ids = self.tickets[index].request.prompt_ids
            out = self.sse_chunk(
                index, self.texts[index // self.n], CompletionLogprobs.prompt_entries(prompt_ids, scores)
            )
        if isinstance(event, StepLogprobs):
            self.pending[index].append(event)
            return out
        entries = CompletionLogprobs.token_entries(self.pending[index])
        self.pending[index].clear()
        if isinstance(event, str):
            return out + self.sse_chunk(index, event, entries)
        if event.finish_reason == "error":  # the SDKs raise on an error event
            return out + sse_error(self.request, event)
        return out + self.sse_chunk(index, "", entries, finish=event.finish_reason)

    def tail(self) -> str:
        end = ""
        if self.include_usage:
            end = sse({**self.envelope, "choices": [], "usage": usage(self.summaries(), self.prompts)})
        return end + sse("[DONE]")

    def body(self) -> dict:
        choices = []
        for p in range(self.prompts):
            group = list(zip(self.tickets, self.choices, strict=True))[p * self.copies : (p + 1) * self.copies]
            if self.copies > self.n:
                group = sorted(group, key=lambda pair: mean_logprob(pair[1].logprobs), reverse=True)[: self.n]
            for j, (ticket, choice) in enumerate(group):
                text = "".join(choice.text)
                logprobs = None
                if self.k is not None:
                    entries = CompletionLogprobs.token_entries(choice.logprobs)
                    if self.echo:
                        entries = (
                            CompletionLogprobs.prompt_entries(ticket.request.prompt_ids, choice.logprobs) + entries
                        )
                    logprobs = self.shaper(p).shape(entries)
                choices.append(
                    {
                        "index": p * self.n + j,
                        "text": self.texts[p] + text if self.echo else text,
                        "logprobs": logprobs,
                        "finish_reason": choice.summary.finish_reason,
                    }
                )
        return {**self.envelope, "choices": choices, "usage": usage(self.summaries(), self.prompts)}


async def v1_completions(request: web.Request) -> web.StreamResponse:
    params = await read_params(request, COMPLETIONS_SCHEMA, openai_params)
    name, adapter = model_named(request, params["model"])
    prompt = params["prompt"]
    # One prompt or several; a prompt is text or token ids.
    prompts = [prompt] if isinstance(prompt, str) or isinstance(prompt[0], int) else prompt
    n, echo, k = params["n"], params["echo"], params["logprobs"]
    best_of = params["best_of"] or n
    if best_of < n:
        raise ApiError(400, f"best_of ({best_of}) must be at least n ({n})", field="best_of")
    if best_of > n and params["stream"]:
        raise ApiError(400, "best_of cannot be streamed: the best choices are known only at the end", field="best_of")
    if params["max_tokens"] == 0 and not echo:
        raise ApiError(400, "max_tokens must be at least 1 (0 only with echo, to score the prompt)", field="max_tokens")
    options = dict(
        stop=stop_tuple(params["stop"]),
        logprobs=k if k is not None else (0 if best_of > n else None),  # best_of ranks by logprob
        prompt_logprobs=k if echo else None,
        **await grammar_options(request, *response_grammar(params), params),
    )
    gens = [g for p in prompts for g in openai_generations(params, p, best_of, params["max_tokens"], 16, **options)]
    check_sequences(request, gens)
    tickets = await submit(request, gens, adapter, params["cache_salt"])
    backend = request.app[ENGINE].backend
    texts = [p if isinstance(p, str) else backend.decode(p) for p in prompts] if echo or k is not None else []
    return await answer(request, tickets, CompletionsWire(request, tickets, params, name, texts))


# -- chat: each API's messages in one shared form -----------------------------------------------
# The three chat APIs translate their requests onto one `ChatRequest` (messages as
# `chat_messages` checks them, tools as `chat_tools` does, below); the backend answers with one
# `ChatPlan` (backends.chat.plan): prompt, stops, grammar, kept tags, a parser per choice.


def chat_messages(params: dict) -> list[dict]:
    """The request's messages as a `ChatRequest` holds them: content as text; an
    assistant's `tool_calls` (or deprecated `function_call`) with arguments that parse to an
    object; a `tool` result answering a call made before it. What does not hold is a 400 naming
    the field."""
    messages, calls = [], set()
    for i, m in enumerate(params["messages"]):
        content = m.get("content")
        role = m["role"]
        if content is None:
            if role != "assistant":  # an assistant turn that only called tools has none
                raise ApiError(400, f"messages[{i}].content is required", field=f"messages[{i}].content")
            content = ""
        message: dict[str, Any] = {
            "role": "tool" if role == "function" else role,
            "content": content if isinstance(content, str) else "".join(p["text"] for p in content),
        }
        tool_calls = m.get("tool_calls") or ([{"function": m["function_call"]}] if m.get("function_call") else [])
        if tool_calls and role != "assistant":
            raise ApiError(
                400, f"messages[{i}].tool_calls is for assistant messages", field=f"messages[{i}].tool_calls"
            )
        if tool_calls:
            message["tool_calls"] = []
            for j, call in enumerate(tool_calls):
                call = history_call(call, f"messages[{i}].tool_calls[{j}]")
                where = f"messages[{i}].tool_calls[{j}].function.arguments"
                try:
                    arguments = json.loads(call["function"].get("arguments") or "{}")
                except json.JSONDecodeError as exc:
                    raise ApiError(400, f"{where} is not JSON: {exc}", field=where) from None
                except RecursionError:  # text nested past the JSON depth any body may have
                    raise ApiError(400, f"{where} is nested too deeply", field=where) from None
                if not isinstance(arguments, dict):
                    raise ApiError(400, f"{where} must be a JSON object", field=where)
                if too_deep(arguments):  # the body's own bound, for the JSON inside its text
                    raise ApiError(400, f"{where} is nested past {MAX_JSON_DEPTH} levels", field=where)
                call_id = call.get("id") or f"call_{i}_{j}"
                calls.add(call_id)
                message["tool_calls"].append(
                    {
                        "id": call_id,
                        "type": "function",
                        "function": {**call["function"], "arguments": json.dumps(arguments)},
                    }
                )
        if role in ("tool", "function"):
            call_id = m.get("tool_call_id")
            if role == "tool" and call_id is None:
                raise ApiError(400, f"messages[{i}].tool_call_id is required", field=f"messages[{i}].tool_call_id")
            if call_id is not None and call_id not in calls:
                raise ApiError(
                    400,
                    f"messages[{i}].tool_call_id {call_id!r} answers no tool call made before it",
                    field=f"messages[{i}].tool_call_id",
                )
            message.update({k: v for k, v in (("tool_call_id", call_id), ("name", m.get("name"))) if v is not None})
        messages.append(message)
    return messages


def history_call(call: dict, where: str) -> dict:
    """A call in the history as a function's: a custom tool's input as the one string argument
    the prompt shows it taking (backends.chat.tools.as_function)."""
    if call.get("type") == "custom" or ("custom" in call and "function" not in call):
        if "custom" not in call:
            raise ApiError(400, f"{where}.custom is required", field=f"{where}.custom")
        arguments = json.dumps({"input": call["custom"]["input"]}, ensure_ascii=False)
        return {**pick(call, "id"), "function": {"name": call["custom"]["name"], "arguments": arguments}}
    if "function" not in call:
        raise ApiError(400, f"{where}.function is required", field=f"{where}.function")
    return call


# -- chat: tools, reasoning switches, and the model's plan ---------------------------------------


TOOL_NAME = re.compile(r"[A-Za-z0-9_.:-]{1,64}")


def custom_tool(tool: dict, where: str, flat: bool) -> dict:
    """A custom tool as ToolUse holds it: {name, description, custom: {syntax, definition}}
    (syntax "text": free text). `flat`: the grammar's fields in `format` (Responses), else in
    `format.grammar` (chat)."""
    form = tool.get("format") or {"type": "text"}
    spec = {"syntax": "text"}
    if form["type"] == "grammar":
        grammar, at = (form, f"{where}.format") if flat else (form.get("grammar"), f"{where}.format.grammar")
        if grammar is None:
            raise ApiError(400, f"{at} is required", field=at)
        for key in ("syntax", "definition"):
            if key not in grammar:
                raise ApiError(400, f"{at}.{key} is required", field=f"{at}.{key}")
        spec = {"syntax": grammar["syntax"], "definition": grammar["definition"]}
    return {**pick(tool, "name", "description"), "custom": spec}


def chat_tools(params: dict, flat: bool = False) -> ToolUse | None:
    """`tools`/`tool_choice` (or the deprecated `functions`/`function_call`), checked. None where
    nothing may be called: no tools, or tool_choice "none" (the tools are then not rendered
    either, so the model has nothing to call; docs/api.md, "Tool calls")."""
    if params["tools"] is not None and params["functions"] is not None:
        raise ApiError(400, "give tools or functions, not both", field="functions")
    if params["tool_choice"] is not None and params["function_call"] is not None:
        raise ApiError(400, "give tool_choice or function_call, not both", field="function_call")
    given = "tools" if params["functions"] is None else "functions"
    tools = [tool_of(t, f"tools[{i}]", flat) for i, t in enumerate(params["tools"] or [])]
    tools = tools or list(params["functions"] or [])
    choice = params["tool_choice"] if params["function_call"] is None else params["function_call"]
    choice_field = "tool_choice" if params["function_call"] is None else "function_call"
    kind = None  # a named tool's kind: function or custom
    if isinstance(choice, dict):
        kind = "custom" if choice.get("type") == "custom" else "function"
        named = choice.get(kind) or choice  # chat's {"type", kind: {"name"}}, or flat {"type", "name"}
        if "name" not in named:
            raise ApiError(400, f"{choice_field}.{kind}.name is required", field=f"{choice_field}.{kind}.name")
        choice = named["name"]
    names = [t["name"] for t in tools]
    for i, name in enumerate(names):
        # OpenAI's and Anthropic's rule (and '.', ':' that MCP names use): a name is written into
        # the prompt and the call's JSON, so no tag or quote can hide in it.
        if not TOOL_NAME.fullmatch(name):
            inside = "custom" if "custom" in tools[i] else "function"
            where = f"{given}[{i}].{inside}.name" if given == "tools" and not flat else f"{given}[{i}].name"
            raise ApiError(400, f"{where} must be 1 to 64 of a-z, A-Z, 0-9, _, -, . or :", field=where)
    if len(set(names)) < len(names):
        raise ApiError(400, f"{given} names a function twice", field=given)
    kinds = {t["name"]: "custom" if "custom" in t else "function" for t in tools}
    if choice not in (None, "none", "auto", "required") and kinds.get(choice) != (kind or "function"):
        which = f"{kind or 'function'} tools" if given == "tools" else given
        raise ApiError(400, f"{choice_field} names {choice!r}, which is not one of the {which}", field=choice_field)
    if choice == "required" and not tools:
        raise ApiError(400, f'{choice_field} "required" needs {given}', field=choice_field)
    if not tools or choice == "none":
        return None
    return ToolUse(
        [t if "custom" in t else pick(t, "name", "description", "parameters") for t in tools],
        choice or "auto",
        # A named function is called once; function_call (deprecated) was always one call.
        params["parallel_tool_calls"] and choice_field == "tool_choice" and choice in (None, "auto", "required"),
    )


def tool_of(tool: dict, where: str, flat: bool) -> dict:
    """One of `tools`: a function ({"function": ...}), or a custom tool ({"custom": ...})."""
    if tool.get("type") == "custom" or ("custom" in tool and "function" not in tool):
        if "custom" not in tool:
            raise ApiError(400, f"{where}.custom is required", field=f"{where}.custom")
        return custom_tool(tool["custom"], where if flat else f"{where}.custom", flat)
    if "function" not in tool:
        raise ApiError(400, f"{where}.function is required", field=f"{where}.function")
    return tool["function"]


def first_tool_choice(request: web.Request, use: ToolUse | None, messages: list[dict]) -> ToolUse | None:
    """FIRST_TOOL_CHOICE=required: tool_choice auto made required where the model answers the
    user, that is where a user message and no tool result follow the last assistant message. A
    turn answering a tool result keeps auto, so an agent's loop can end; the log line says so."""
    if use is None or use.choice != "auto" or not request.app[SETTINGS].forces_first_tool_call:
        return use
    since = []
    for message in reversed(messages):
        if message["role"] == "assistant":
            break
        since.append(message["role"])
    if "user" not in since or "tool" in since:
        return use
    request[LOG_FACTS]["tool_choice"] = "required"
    return dataclasses.replace(use, choice="required")


def pick(mapping: dict, *keys: str) -> dict:
    return {k: mapping[k] for k in keys if k in mapping}


def template_options(
    request: web.Request,
    kwargs: dict | None,
    thinking: bool | None = None,
    effort: str | None = None,
    budget: int | None = None,
) -> dict:
    """ChatRequest's reasoning fields: template_kwargs (CHAT_TEMPLATE_KWARGS, the request's over
    them); thinking (off for effort "none"); and the thinking budget, the request's own (-1: no
    limit), else its effort's (EFFORT_BUDGETS), else THINKING_BUDGET."""
    settings = request.app[SETTINGS]
    if effort is not None and thinking is None:
        thinking = effort != "none"
    if budget is None and effort in EFFORT_BUDGETS:
        budget = -1 if EFFORT_BUDGETS[effort] is None else EFFORT_BUDGETS[effort]
    if budget is None:
        budget = settings.thinking_budget
    return {
        "template_kwargs": {**settings.template_kwargs, **(kwargs or {})},
        "thinking": thinking,
        "thinking_budget": None if budget < 0 else budget,
    }


def chat_plan(backend: Backend, chat: ChatRequest) -> ChatPlan:
    """The model's plan for a chat; a chat its template cannot render is a 400 saying why."""
    try:
        return backend.chat_plan(chat)
    except ChatError as exc:
        raise ApiError(400, str(exc), field="messages") from None


def tools_or_format(use: ToolUse | None, format_type: str | None, field: str) -> None:
    """A reply is its calls' grammar or a response format's, not both."""
    if use is not None and format_type not in (None, "text"):
        raise ApiError(400, f"{field} cannot be combined with tools here; give one or the other", field=field)


class ArgumentChecks:
    """A request's calls checked against their tools' full JSON Schemas (the grammar held them to
    a lenient form: backends.chat.tools.CALL_JSON), each on the tokenizer pool as its call is given
    out. A call that breaks its schema is still the answer (agents check calls themselves and
    tell the model what was wrong); the request log names its tool (`tool_arguments_invalid`)
    and /metrics counts it. docs/api.md, "Tool calls"."""

    def __init__(self, request: web.Request, schemas: dict[str, dict]):
        self.pool = request.app[TOKENIZER_POOL]
        self.schemas = schemas
        self.pending: list[tuple[str, Future]] = []

    def __call__(self, call: ToolCall) -> None:  # on the event loop, or the pool building a whole answer
        schema = None if call.custom else self.schemas.get(call.name)
        if schema:
            self.pending.append((call.name, self.pool.submit(argument_error, schema, call.arguments)))

    async def settle(self, request: web.Request) -> None:
        broken = [name for name, future in self.pending if await asyncio.wrap_future(future)]
        self.pending = []
        if broken:
            request[LOG_FACTS]["tool_arguments_invalid"] = sorted(set(broken))[:MAX_IGNORED]
            request.app[METRICS].invalid_arguments.inc(len(broken))


def check_arguments(request: web.Request, use: ToolUse | None) -> ToolUse | None:
    """`use`, its function tools' calls to be checked against their schemas (`ArgumentChecks`)."""
    schemas = {t["name"]: t["parameters"] for t in use.tools if t.get("parameters")} if use else {}
    if schemas:
        request[ARGUMENT_CHECKS] = ArgumentChecks(request, schemas)
    return use


def checked_parser(request: web.Request, plan: ChatPlan) -> ToolCallParser:
    """A parser for one choice's text whose calls are checked (`ArgumentChecks`), if any may come."""
    parser = plan.parser()
    parser.on_call = request.get(ARGUMENT_CHECKS)
    return parser


async def settle_checks(request: web.Request) -> None:
    """The answer's calls checked, before its log line is written."""
    if (checks := request.get(ARGUMENT_CHECKS)) is not None:
        await checks.settle(request)


async def chat_options(
    request: web.Request, plan: ChatPlan, stop: tuple[str, ...], ignore_eos: bool, format_field: str | None = None
) -> dict:
    """A plan as Generation's fields: the request's stops and then the format's, the tags the
    reply keeps, and its grammar compiled (errors name `tools`, or the response format's field)."""
    field = "tools" if plan.tool_names is not None else format_field
    # Lazy (tool_choice auto): text beside a call may end at a stop sequence as usual.
    checks = {} if plan.grammar is None or plan.grammar.lazy else {"stop": stop, "ignore_eos": ignore_eos}
    grammar = await grammar_options(request, plan.grammar, field, checks)
    return {"stop": stop + plan.stop, "keep_tokens": plan.keep_tokens, "thought": plan.thought, **grammar}


# -- OpenAI-compatible API: /v1/chat/completions -----------------------------------------------


class ChatWire(Wire):
    """/v1/chat/completions: a `chat.completion` body, or `chat.completion.chunk`s (each choice's
    role first) then `[DONE]`. Each choice's text goes through its plan's parser: content,
    `reasoning_content` and `tool_calls` (a call streamed as its id and name, then its arguments)."""

    def __init__(
        self,
        request: web.Request,
        tickets: list[Ticket],
        params: dict,
        name: str,
        k: int | None,
        plan: ChatPlan,
    ):
        super().__init__(request, tickets, params["stream"])
        self.k = k
        self.envelope = response_head(name, "chat.completion.chunk" if self.streaming else "chat.completion")
        self.include_usage = bool(params["stream_options"].get("include_usage"))
        self.parser = lambda: checked_parser(request, plan)
        self.thinks = plan.thought is not None  # usage then counts the reasoning's tokens
        self.parsers = [self.parser() for _ in tickets]
        self.calls = [0 for _ in tickets]  # tool calls streamed so far, per choice
        self.pending: dict[int, list[StepLogprobs]] = {i: [] for i in range(len(tickets))}

    @property
    def heavy(self) -> bool:
        return self.k is not None

    def sse_chunk(self, index: int, delta: dict, finish: str | None = None) -> str:
        logprobs = None
        if self.k is not None and self.pending[index] and "tool_calls" not in delta:
            logprobs = chat_logprobs(self.backend, self.pending[index], self.k)
            self.pending[index].clear()
        choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
        payload = {**self.envelope, "choices": [choice]}
        return sse({**payload, "usage": None} if self.include_usage else payload)

    def opening(self) -> str:
        return "".join(self.sse_chunk(i, {"role": "assistant", "content": ""}) for i in range(len(self.tickets)))

    def pieces(self, index: int, pieces: list[Piece]) -> str:
        out = []
        for piece in pieces:
            if piece.kind == "call":  # its id, type and name first, then its arguments (or input)
                at, self.calls[index] = self.calls[index], self.calls[index] + 1
                kind, field, text = call_parts(piece.call)
                head = {"index": at, "id": call_id(), "type": kind, kind: {"name": piece.call.name, field: ""}}
                out.append(self.sse_chunk(index, {"tool_calls": [head]}))
                out.append(self.sse_chunk(index, {"tool_calls": [{"index": at, kind: {field: text}}]}))
            else:
                out.append(
                    self.sse_chunk(index, {"content" if piece.kind == "content" else "reasoning_content": piece.text})
                )
        return "".join(out)

    def chunk(self, index: int, event: Event) -> str:
        if isinstance(event, StepLogprobs):
            self.pending[index].append(event)
            return ""
        if isinstance(event, str):
            return self.pieces(index, self.parsers[index].feed(event))  # logprobs wait for text
        if event.finish_reason == "error":  # the SDKs raise on an error event
            return sse_error(self.request, event)
        rest = self.pieces(index, self.parsers[index].finish())
        return rest + self.sse_chunk(index, {}, finish=chat_finish(event, self.parsers[index]))

    def tail(self) -> str:
        end = (
            sse({**self.envelope, "choices": [], "usage": usage(self.summaries(), 1, reasoning=self.thinks)})
            if self.include_usage
            else ""
        )
        return end + sse("[DONE]")

    def body(self) -> dict:
        choices = []
        for i, choice in enumerate(self.choices):
            parser = self.parser()
            pieces = parser.feed("".join(choice.text)) + parser.finish()
            content = "".join(p.text for p in pieces if p.kind == "content")
            reasoning = "".join(p.text for p in pieces if p.kind == "reasoning")
            calls = [chat_call(p.call) for p in pieces if p.kind == "call"]
            message = {"role": "assistant", "content": content if content or not calls else None, "refusal": None}
            if reasoning:
                message["reasoning_content"] = reasoning
            if calls:
                message["tool_calls"] = calls
            choices.append(
                {
                    "index": i,
                    "message": message,
                    "logprobs": chat_logprobs(self.backend, choice.logprobs, self.k) if self.k is not None else None,
                    "finish_reason": chat_finish(choice.summary, parser),
                }
            )
        return {**self.envelope, "choices": choices, "usage": usage(self.summaries(), 1, reasoning=self.thinks)}


def call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def call_parts(call: ToolCall) -> tuple[str, str, str]:
    """A call's type on chat, the field of its text, and that text: a function's arguments or
    a custom tool's input."""
    return ("custom", "input", call.input) if call.custom else ("function", "arguments", call.arguments)


def chat_call(call: ToolCall) -> dict:
    kind, field, text = call_parts(call)
    return {"id": call_id(), "type": kind, kind: {"name": call.name, field: text}}


def chat_finish(summary: Summary, parser: ToolCallParser) -> str:
    """ "tool_calls" for a reply that called and then ended as it chose to; a call cut short by
    max_tokens is "length" (its part is dropped: never given out as a call)."""
    return "tool_calls" if parser.calls and summary.finish_reason == "stop" else summary.finish_reason


async def v1_chat_completions(request: web.Request) -> web.StreamResponse:
    params = await read_params(request, CHAT_SCHEMA, openai_params)
    name, adapter = model_named(request, params["model"])
    backend = engine_ready(request).backend
    use = check_arguments(request, chat_tools(params))
    messages = chat_messages(params)
    use = first_tool_choice(request, use, messages)
    tools_or_format(use, (params["response_format"] or {}).get("type"), "response_format")
    output, output_field = response_grammar(params)
    options = template_options(
        request,
        params["chat_template_kwargs"],
        effort=params["reasoning_effort"],
        budget=params["thinking_token_budget"],
    )
    plan = chat_plan(backend, ChatRequest(messages, use, output, **options))
    k = (params["top_logprobs"] or 0) if params["logprobs"] else None
    options = await chat_options(request, plan, stop_tuple(params["stop"]), params["ignore_eos"], output_field)
    options.update(logprobs=k, prompt_field="messages")
    max_tokens = params["max_completion_tokens"] or params["max_tokens"]
    gens = openai_generations(params, plan.prompt, params["n"], max_tokens, CHAT_DEFAULT_MAX_TOKENS, **options)
    check_sequences(request, gens)
    tickets = await submit(request, gens, adapter, params["cache_salt"])
    return await answer(request, tickets, ChatWire(request, tickets, params, name, k, plan))


# -- OpenAI Responses API: the request, as a chat ----------------------------------------------
# OpenAI's newer API over the same answer loop: `input` (a string, or message, function_call and
# function_call_output items) and `instructions` become chat messages; tools, tool_choice and
# text.format work as on /v1/chat/completions. An answer is stored (`store`, the default) for a
# later request's `previous_response_id` ("stored answers" below). docs/api.md, "Responses API".

INPUT_PART = {
    "type": "object",
    "required": ["type"],
    "x-check-first": "type",
    "properties": {
        "type": {"enum": ["input_text", "output_text", "text"], "x-unsupported": True},
        "text": {"type": "string"},
        "annotations": {"type": "array", "items": {}, "description": "accepted and ignored"},
        "logprobs": {"type": "array", "items": {}, "description": "accepted and ignored"},
    },
}
INPUT_ITEM = {
    "type": "object",
    "x-check-first": "type",
    "properties": {
        "type": {
            "enum": [
                "message",
                "function_call",
                "function_call_output",
                "custom_tool_call",
                "custom_tool_call_output",
                "reasoning",
            ],
            "x-unsupported": True,
        },
        "role": {"enum": ["user", "system", "developer", "assistant"]},
        "content": {"anyOf": [{"type": "string"}, {"type": "array", "items": INPUT_PART}]},
        "id": {"type": "string"},
        "status": {"type": "string"},
        "call_id": {"type": "string", "description": "function_call, function_call_output: the call"},
        "name": {"type": "string", "description": "function_call: the function called"},
        "arguments": {"type": "string", "description": "function_call: a JSON object, as text"},
        "output": {"type": "string", "description": "function_call_output: what the function returned"},
        "input": {"type": "string", "description": "custom_tool_call: the custom tool's input"},
        "summary": {"type": "array", "items": {}, "description": "reasoning: accepted and ignored"},
        "encrypted_content": _ignored("string"),
    },
}
# The chat route's function, flat: {"type": "function", "name": ...}. A `namespace` (Codex's)
# holds such functions, offered as they are; a hosted tool OpenAI runs itself (web_search,
# file_search, ...) is skipped and logged, as llama.cpp does: nothing here can run it.
FLAT_FUNCTION = {
    "type": "object",
    "required": ["type", "name"],
    "x-check-first": "type",
    "properties": {"type": {"enum": ["function"], "x-unsupported": True}, **FUNCTION["properties"]},
}
RESPONSE_TOOL = {
    "type": "object",
    "required": ["type"],
    "x-check-first": "type",
    "properties": {
        "type": {"type": "string"},
        **FUNCTION["properties"],
        "format": {**CUSTOM_FORMAT, "description": "a custom tool's input: text, or a grammar's"},
        "tools": {"type": "array", "maxItems": MAX_TOOLS, "items": FLAT_FUNCTION, "description": "a namespace's"},
    },
}
TEXT_FORMAT = {  # response_format, flat: {"type": "json_schema", "schema": ...}
    "type": "object",
    "required": ["type"],
    "x-check-first": "type",
    "properties": {
        "type": RESPONSE_FORMAT["properties"]["type"],
        **RESPONSE_FORMAT["properties"]["json_schema"]["properties"],
    },
}
RESPONSES_SCHEMA: dict[str, Any] = tolerant(
    {
        "type": "object",
        "required": ["input"],
        "properties": {
            "model": {"type": "string"},
            "input": {
                "anyOf": [{"type": "string", "minLength": 1}, {"type": "array", "minItems": 1, "items": INPUT_ITEM}]
            },
            "instructions": {"type": "string"},
            "tools": {"type": "array", "maxItems": MAX_TOOLS, "items": RESPONSE_TOOL},
            "tool_choice": {
                "anyOf": [
                    {"enum": ["none", "auto", "required"]},
                    {
                        "type": "object",
                        "required": ["type", "name"],
                        "properties": {"type": {"enum": ["function", "custom"]}, "name": {"type": "string"}},
                    },
                ],
                "x-error": (
                    'tool_choice must be "none", "auto", "required" or {"type": "function" or "custom", "name": ...}'
                ),
            },
            "parallel_tool_calls": {"type": "boolean", "default": True},
            "max_output_tokens": {"type": "integer", "minimum": 1},
            "temperature": {"type": "number", "minimum": 0, "maximum": 2, "default": 1.0},
            "top_p": {"type": "number", "exclusiveMinimum": 0, "maximum": 1, "default": 1.0},
            "seed": GENERATE_SCHEMA["properties"]["seed"],
            **SAMPLING_PROPERTIES,
            "text": {
                "type": "object",
                "properties": {"format": TEXT_FORMAT, "verbosity": _ignored("string")},
                "default": {},
            },
            "stream": {"type": "boolean", "default": False},
            "store": {"type": "boolean", "default": True, "description": "keep the answer (RESPONSES_STORE)"},
            "previous_response_id": {
                "type": "string",
                "maxLength": 128,
                "description": "a stored answer this one continues",
            },
            "truncation": {"enum": ["disabled"], "x-unsupported": True},
            "reasoning": {
                "type": "object",
                "properties": {"effort": REASONING_CONTROLS["reasoning_effort"], "summary": _ignored("string")},
            },
            "chat_template_kwargs": REASONING_CONTROLS["chat_template_kwargs"],
            "thinking_token_budget": REASONING_CONTROLS["thinking_token_budget"],
            "include": {"type": "array", "items": {}, "description": "accepted and ignored"},
            "metadata": _ignored("object"),
            "user": _ignored("string"),
            "service_tier": _ignored("string"),
            "prompt_cache_key": _ignored("string"),
            "safety_identifier": _ignored("string"),
            "stream_options": _ignored("object"),
            "background": _unsupported(False),
            "conversation": _unsupported(),
            "prompt": _unsupported(),
            "top_logprobs": _unsupported(0),
            "cache_salt": CACHE_SALT,
        },
    }
)


def responses_chat(params: dict) -> list[dict]:
    """`instructions` and `input` as the chat messages `chat_messages` checks: function_call
    items (consecutive ones together) as an assistant's tool_calls, function_call_output items
    as tool results, reasoning items left out."""
    messages = [{"role": "system", "content": params["instructions"]}] if params["instructions"] else []
    items = [{"role": "user", "content": params["input"]}] if isinstance(params["input"], str) else params["input"]
    for i, item in enumerate(items):
        kind = item.get("type", "message")
        needs = {
            "message": ("role", "content"),
            "function_call": ("call_id", "name", "arguments"),
            "function_call_output": ("call_id", "output"),
            "custom_tool_call": ("call_id", "name", "input"),
            "custom_tool_call_output": ("call_id", "output"),
            "reasoning": (),
        }
        for key in needs[kind]:
            if key not in item:
                raise ApiError(400, f"input[{i}].{key} is required", field=f"input[{i}].{key}")
        if kind == "message":
            content = item["content"]
            text = content if isinstance(content, str) else "".join(p.get("text", "") for p in content)
            messages.append({"role": item["role"], "content": text})
        elif kind in ("function_call", "custom_tool_call"):
            if kind == "custom_tool_call":  # as chat_messages takes a custom tool's call
                call = {
                    "id": item["call_id"],
                    "type": "custom",
                    "custom": {"name": item["name"], "input": item["input"]},
                }
            else:
                call = {"id": item["call_id"], "function": {"name": item["name"], "arguments": item["arguments"]}}
            if messages and messages[-1]["role"] == "assistant" and "tool_calls" in messages[-1]:
                messages[-1]["tool_calls"].append(call)
            else:
                messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind in ("function_call_output", "custom_tool_call_output"):
            messages.append({"role": "tool", "tool_call_id": item["call_id"], "content": item["output"]})
    if not any(m["role"] not in ("system", "developer") for m in messages):
        raise ApiError(400, "input holds no message to answer", field="input")
    try:
        return chat_messages({"messages": messages})
    except ApiError as exc:  # name the field of this API: input[i], not messages[i]
        raise ApiError(
            400, exc.message.replace("messages[", "input["), field=(exc.field or "input").replace("messages[", "input[")
        ) from None


def responses_functions(request: web.Request, params: dict) -> list[dict]:
    """The request's function and custom tools as chat_tools takes them, a namespace's functions
    among them; the tools of other kinds (hosted ones) skipped, their types in the request log."""
    functions, skipped = [], []
    for i, tool in enumerate(params["tools"] or []):
        if tool["type"] in ("function", "custom"):
            if "name" not in tool:
                raise ApiError(400, f"tools[{i}].name is required", field=f"tools[{i}].name")
            functions.append(tool)
        elif tool["type"] == "namespace":
            functions += tool.get("tools") or []
        else:
            skipped.append(tool["type"])
    note_skipped(request, skipped)
    return [
        {"type": "custom", "custom": pick(t, "name", "description", "format")}
        if t["type"] == "custom"
        else {"function": pick(t, "name", "description", "parameters")}
        for t in functions
    ]


def responses_tools(request: web.Request, params: dict) -> ToolUse | None:
    choice = params["tool_choice"]
    return chat_tools(
        {
            "tools": responses_functions(request, params) or None,
            "functions": None,
            "tool_choice": choice,
            "function_call": None,
            "parallel_tool_calls": params["parallel_tool_calls"],
        },
        flat=True,
    )


def responses_format(params: dict, use: ToolUse | None) -> tuple[GrammarSpec | None, str | None]:
    """`text.format` as the reply's grammar (json_object, json_schema) and its field; (None, None)
    for text."""
    text_format = (params["text"] or {}).get("format") or {"type": "text"}
    tools_or_format(use, text_format["type"], "text.format")
    if text_format["type"] == "json_object":
        return GrammarSpec("json_object", ""), "text.format"
    if text_format["type"] == "json_schema":
        schema = json.dumps(text_format.get("schema", {"type": "object"}))
        return GrammarSpec("json_schema", schema), "text.format.schema"
    return None, None


# -- OpenAI Responses API: /v1/responses --------------------------------------------------------


# A call's output item as the Responses API streams it, by whether it is a custom tool's: its
# type, its id's prefix, the field of its text, and its text's events (`.delta`, `.done`).
CALL_ITEMS = {
    False: ("function_call", "fc", "arguments", "response.function_call_arguments"),
    True: ("custom_tool_call", "ctc", "input", "response.custom_tool_call_input"),
}


class ResponsesWire(Wire):
    """A `response` object; streamed, its events (`response.created`, each output item's
    `output_item.added`, text deltas or function-call arguments, `output_item.done`, then
    `response.completed`, or `response.incomplete` at max_output_tokens), each with its
    `sequence_number`. The items are built once, as the pieces come, for both."""

    def __init__(self, request: web.Request, tickets: list[Ticket], params: dict, name: str, plan: ChatPlan):
        super().__init__(request, tickets, params["stream"])
        self.params = params
        self.parser = checked_parser(request, plan)
        self.response = {
            "id": f"resp_{uuid.uuid4().hex}",
            "object": "response",
            "created_at": int(time.time()),
            "model": name,
            "instructions": params["instructions"],
            "max_output_tokens": params["max_output_tokens"],
            "parallel_tool_calls": params["parallel_tool_calls"],
            "previous_response_id": params["previous_response_id"],
            "store": params["store"],
            "temperature": params["temperature"],
            "top_p": params["top_p"],
            "text": {"format": (params["text"] or {}).get("format") or {"type": "text"}},
            "tool_choice": params["tool_choice"] or ("auto" if params["tools"] else "none"),
            "tools": params["tools"] or [],
            "truncation": "disabled",
            "metadata": params["metadata"] or {},
            "user": None,
            "reasoning": {"effort": None, "summary": None},
        }
        self.output: list[dict] = []
        self.open: dict | None = None  # the message item whose text is streaming
        self.events = 0
        self.thought = ""  # reasoning not given out yet
        self.start()

    def event(self, kind: str, **payload) -> str:
        self.events += 1
        body = {"type": kind, "sequence_number": self.events - 1, **payload}
        return f"event: {kind}\ndata: {json.dumps(body, ensure_ascii=False)}\n\n" if self.streaming else ""

    def snapshot(self, status: str, **more) -> dict:
        return {
            **self.response,
            "status": status,
            "output": self.output,
            "error": None,
            "incomplete_details": None,
            "usage": None,
            **more,
        }

    def opening(self) -> str:
        return self.head

    def start(self) -> None:
        """The stream's first events, numbered first (the answer loop asks for the opening only
        once the first events are in), with nothing in the output yet."""
        head = self.snapshot("in_progress")
        self.head = self.event("response.created", response=head) + self.event("response.in_progress", response=head)

    def close_message(self) -> str:
        item, self.open = self.open, None
        if item is None:
            return ""
        at, part = len(self.output) - 1, item["content"][0]
        item["status"] = "completed"
        ids = {"item_id": item["id"], "output_index": at, "content_index": 0}
        return (
            self.event("response.output_text.done", **ids, text=part["text"], logprobs=[])
            + self.event("response.content_part.done", **ids, part=part)
            + self.event("response.output_item.done", output_index=at, item=item)
        )

    def add_item(self, item: dict) -> str:
        out = self.close_message()
        self.output.append(item)
        return out + self.event(
            "response.output_item.added",
            output_index=len(self.output) - 1,
            item=dict(item, **({"content": []} if item["type"] == "message" else {})),
        )

    def pieces(self, pieces: list[Piece], final: bool = False) -> str:
        out = ""
        for piece in pieces:
            if piece.kind != "reasoning":
                out += self.think()
            if piece.kind == "content":
                if self.open is None:
                    item = {
                        "type": "message",
                        "id": f"msg_{uuid.uuid4().hex}",
                        "status": "in_progress",
                        "role": "assistant",
                        "content": [],
                    }
                    out += self.add_item(item)
                    self.open = item
                    part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
                    item["content"].append(part)
                    ids = {"item_id": item["id"], "output_index": len(self.output) - 1, "content_index": 0}
                    out += self.event("response.content_part.added", **ids, part=dict(part))
                self.open["content"][0]["text"] += piece.text
                ids = {"item_id": self.open["id"], "output_index": len(self.output) - 1, "content_index": 0}
                out += self.event("response.output_text.delta", **ids, delta=piece.text, logprobs=[])
            elif piece.kind == "reasoning":  # given out as one item once the thought ends
                self.thought += piece.text
                continue
            else:  # a call: its item, then its text (a function's arguments, a custom tool's input)
                call = piece.call
                kind, prefix, field, stem = CALL_ITEMS[call.custom]
                text = call.input if call.custom else call.arguments
                item = {
                    "type": kind,
                    "id": f"{prefix}_{uuid.uuid4().hex}",
                    "call_id": call_id(),
                    "name": call.name,
                    field: "",
                    "status": "in_progress",
                }
                out += self.add_item(item)
                at = len(self.output) - 1
                item.update({field: text, "status": "completed"})
                ids = {"item_id": item["id"], "output_index": at}
                named = {} if call.custom else {"name": call.name}  # only a function's .done names it
                out += self.event(f"{stem}.delta", **ids, delta=text)
                out += self.event(f"{stem}.done", **ids, **named, **{field: text})
                out += self.event("response.output_item.done", output_index=at, item=item)
        return out + (self.think() if final else "")

    def think(self) -> str:
        """The reasoning so far as its output item (a reasoning model's <think> text)."""
        if not self.thought:
            return ""
        content = [{"type": "reasoning_text", "text": self.thought}]
        item = {"type": "reasoning", "id": f"rs_{uuid.uuid4().hex}", "summary": [], "content": content}
        self.thought = ""
        added = self.add_item(item)
        return added + self.event("response.output_item.done", output_index=len(self.output) - 1, item=item)

    def chunk(self, index: int, event: Event) -> str:
        if isinstance(event, StepLogprobs):
            return ""
        if isinstance(event, str):
            return self.pieces(self.parser.feed(event))
        if event.finish_reason == "error" or event.finish_reason not in ("stop", "length"):
            error = {
                "code": "invalid_prompt" if grammar_failed(event) else "server_error",
                "message": event.error or event.finish_reason,
            }
            return self.close_message() + self.event("response.failed", response=self.snapshot("failed", error=error))
        out = self.pieces(self.parser.finish(), final=True) + self.close_message()
        final = self.final(event)
        self.keep(final)  # before the event goes: the client's next request may continue it
        return out + self.event(f"response.{final['status']}", response=final)

    def keep(self, final: dict) -> None:
        """A finished answer into the store (`store`), with the conversation it ends."""
        if self.params["store"]:
            items = (
                self.params["input"]
                if isinstance(self.params["input"], list)
                else [{"role": "user", "content": self.params["input"]}]
            )
            self.request.app[RESPONSES].put(self.request.get(CACHE_NAMESPACE, ""), final, [*items, *final["output"]])

    def final(self, summary: Summary) -> dict:
        incomplete = summary.finish_reason == "length"
        return self.snapshot(
            "incomplete" if incomplete else "completed",
            incomplete_details={"reason": "max_output_tokens"} if incomplete else None,
            usage={
                "input_tokens": summary.prompt_tokens,
                "input_tokens_details": {"cached_tokens": summary.cached_tokens},
                "output_tokens": summary.tokens_used,
                "output_tokens_details": {"reasoning_tokens": summary.reasoning_tokens},
                "total_tokens": summary.prompt_tokens + summary.tokens_used,
            },
        )

    def body(self) -> dict:
        (choice,) = self.choices
        self.pieces(self.parser.feed("".join(choice.text)) + self.parser.finish(), final=True)
        self.close_message()
        final = self.final(choice.summary)
        self.keep(final)
        return final


async def v1_responses(request: web.Request) -> web.StreamResponse:
    params = await read_params(request, RESPONSES_SCHEMA)
    name, adapter = model_named(request, params["model"])
    if params["previous_response_id"] is not None:  # its conversation first (not its instructions)
        before = stored(request, params["previous_response_id"], "previous_response_id")
        given = params["input"] if isinstance(params["input"], list) else [{"role": "user", "content": params["input"]}]
        params = {**params, "input": [*before.items, *given]}
    backend = engine_ready(request).backend
    use = check_arguments(request, responses_tools(request, params))
    messages = responses_chat(params)
    use = first_tool_choice(request, use, messages)
    output, output_field = responses_format(params, use)
    effort = (params["reasoning"] or {}).get("effort")
    options = template_options(
        request, params["chat_template_kwargs"], effort=effort, budget=params["thinking_token_budget"]
    )
    plan = chat_plan(backend, ChatRequest(messages, use, output, **options))
    as_chat = {**params, "ignore_eos": False}  # the chat route's sampling fields
    options = await chat_options(request, plan, (), False, output_field)
    gens = openai_generations(
        as_chat, plan.prompt, 1, params["max_output_tokens"], CHAT_DEFAULT_MAX_TOKENS, prompt_field="input", **options
    )
    tickets = await submit(request, gens, adapter, params["cache_salt"])
    return await answer(request, tickets, ResponsesWire(request, tickets, params, name, plan))


# -- OpenAI Responses API: stored answers, GET and DELETE /v1/responses/{id} ---------------------
# With `store` (OpenAI's default) an answer is kept with the conversation it ends, so that a
# request may continue it (`previous_response_id`) and a client may read or delete it. Bounded
# (RESPONSES_STORE entries, RESPONSES_STORE_BYTES of JSON, least recently used out first) and in
# memory only: a restart forgets them. Each API key sees only its own (its cache namespace).


@dataclass
class Stored:
    response: dict  # the answer as it was given
    items: list[dict]  # the conversation it ends: its input items (a continued one's too), then its output
    size: int  # bytes of JSON, what the store counts


class ResponseStore:
    def __init__(self, entries: int, size: int):
        self.entries, self.size = entries, size
        self._kept: OrderedDict[tuple[str, str], Stored] = OrderedDict()
        self._bytes = 0

    def put(self, namespace: str, response: dict, items: list[dict]) -> None:
        size = len(json.dumps([response, items]))
        if self.entries <= 0 or size > self.size:
            return
        self._kept[namespace, response["id"]] = Stored(response, items, size)
        self._bytes += size
        while len(self._kept) > self.entries or self._bytes > self.size:
            self._bytes -= self._kept.popitem(last=False)[1].size

    def get(self, namespace: str, response_id: str) -> Stored | None:
        found = self._kept.get((namespace, response_id))
        if found is not None:
            self._kept.move_to_end((namespace, response_id))
        return found

    def delete(self, namespace: str, response_id: str) -> bool:
        found = self._kept.pop((namespace, response_id), None)
        self._bytes -= found.size if found else 0
        return found is not None


def stored(request: web.Request, response_id: str, field: str | None = None) -> Stored:
    """A stored answer of this request's key, or OpenAI's 404 for an id it does not know."""
    found = request.app[RESPONSES].get(request.get(CACHE_NAMESPACE, ""), response_id)
    if found is None:
        kind = "Previous response" if field else "Response"
        code = "previous_response_not_found" if field else None
        raise ApiError(404, f"{kind} with id {response_id!r} not found.", field=field, code=code)
    return found


async def v1_response(request: web.Request) -> web.Response:
    return web.json_response(stored(request, request.match_info["response_id"]).response)


async def v1_delete_response(request: web.Request) -> web.Response:
    response_id = request.match_info["response_id"]
    stored(request, response_id)
    request.app[RESPONSES].delete(request.get(CACHE_NAMESPACE, ""), response_id)
    return web.json_response({"id": response_id, "object": "response", "deleted": True})


# -- Anthropic Messages API: the request, as a chat; errors in its shape -----------------------
# Anthropic's request and answer shapes over the same worker, limits and log; its SSE event
# sequence when streamed; its error shape (`anthropic_error`). A key comes as `x-api-key` or as
# `Authorization: Bearer`. Tools as on the chat route (`anthropic_tools`, `tool_use` blocks out);
# what agents send (system turns anywhere, thinking, output_config) is taken; images, documents
# or an assistant message last (a prefill) are a 400 naming the field. docs/api.md, "Anthropic".

ANTHROPIC_PATHS = ("/v1/messages",)  # and what is under it
TEXT_BLOCK = {
    "type": "object",
    "required": ["type", "text"],
    "x-check-first": "type",
    "properties": {
        "type": {"enum": ["text"], "x-unsupported": True},
        "text": {"type": "string"},
        "cache_control": _ignored("object"),
        "citations": {"type": ["array", "null"], "description": "accepted and ignored"},
    },
}
# A message's blocks: text, and the tool calls (`tool_use`) and results (`tool_result`) of a
# conversation with tools. Each type's own required fields are checked in `anthropic_chat`.
CONTENT_BLOCK = {
    "type": "object",
    "required": ["type"],
    "x-check-first": "type",
    "properties": {
        "type": {"enum": ["text", "tool_use", "tool_result", "thinking", "redacted_thinking"], "x-unsupported": True},
        "text": {"type": "string"},
        # An earlier turn's thought, sent back: taken, not rendered (Anthropic's models drop it too).
        "thinking": {"type": "string"},
        "signature": {"type": "string", "description": "thinking: not checked (this server's, or another's)"},
        "data": {"type": "string", "description": "redacted_thinking"},
        "id": {"type": "string", "description": "tool_use: the call's id"},
        "name": {"type": "string", "description": "tool_use: the tool called"},
        "input": {"type": "object", "description": "tool_use: the call's arguments"},
        "tool_use_id": {"type": "string", "description": "tool_result: the call it answers"},
        "content": {
            "anyOf": [{"type": "string"}, {"type": "array", "items": TEXT_BLOCK}],
            "description": "tool_result: what the tool returned",
        },
        "is_error": {"type": "boolean", "description": "tool_result: the tool failed (said in its text)"},
        "cache_control": _ignored("object"),
        "citations": {"type": ["array", "null"], "description": "accepted and ignored"},
    },
}
ANTHROPIC_CONTENT = {"anyOf": [{"type": "string"}, {"type": "array", "items": CONTENT_BLOCK}]}
ANTHROPIC_TOOL = {
    "type": "object",
    "required": ["name"],
    "properties": {
        "name": {"type": "string", "minLength": 1, "maxLength": 64},
        "description": {"type": "string"},
        "input_schema": {"type": "object", "description": "a JSON Schema of the input"},
        # Absent or "custom": the client's tool. Anthropic's server tools (web_search_20250305, ...)
        # are skipped and logged: nothing here runs them (`anthropic_tools`).
        "type": {"type": "string"},
        "cache_control": _ignored("object"),
        "strict": {"type": "boolean", "description": "accepted: a call always follows its schema"},
    },
}
ANTHROPIC_TOOL_CHOICE = {
    "type": "object",
    "required": ["type"],
    "x-check-first": "type",
    "properties": {
        "type": {"enum": ["auto", "any", "tool", "none"]},
        "name": {"type": "string"},
        "disable_parallel_tool_use": {"type": "boolean"},
    },
}
ANTHROPIC_INPUT = {
    "model": {"type": "string"},
    "messages": {
        "type": "array",
        "minItems": 1,
        "items": {
            "type": "object",
            "required": ["role", "content"],
            # A system turn mid-conversation (Claude Code's): rendered where the template allows.
            "properties": {"role": {"enum": ["user", "assistant", "system"]}, "content": ANTHROPIC_CONTENT},
        },
    },
    "system": {"anyOf": [{"type": "string"}, {"type": "array", "items": TEXT_BLOCK}]},
    "tools": {"type": "array", "maxItems": MAX_TOOLS, "items": ANTHROPIC_TOOL},
    "tool_choice": ANTHROPIC_TOOL_CHOICE,
    # Extended thinking: a reasoning model thinks within budget_tokens (enabled), or as output_config's
    # effort says (adaptive); a model that does not reason answers as without it.
    "thinking": {
        "type": "object",
        "required": ["type"],
        "x-check-first": "type",
        "properties": {
            "type": {"enum": ["enabled", "disabled", "adaptive"]},
            "budget_tokens": {"type": "integer", "minimum": 0},
        },
    },
}
MESSAGES_SCHEMA: dict[str, Any] = tolerant(
    {
        "type": "object",
        "required": ["model", "max_tokens", "messages"],
        "properties": {
            **ANTHROPIC_INPUT,
            "max_tokens": {"type": "integer", "minimum": 1},
            "stop_sequences": {"type": "array", "maxItems": MAX_STOP, "items": {"type": "string", "minLength": 1}},
            "temperature": {"type": "number", "minimum": 0, "maximum": 1, "default": 1.0},
            "top_p": {"type": "number", "exclusiveMinimum": 0, "maximum": 1, "default": 1.0},
            "top_k": {"type": "integer", "minimum": 0, "default": 0},
            "stream": {"type": "boolean", "default": False},
            "metadata": _ignored("object"),
            "service_tier": _ignored("string"),
            "cache_control": _ignored("object"),  # the prompt cache here is automatic
            "inference_geo": _ignored("string"),
            "user_profile_id": _ignored("string"),
            "workspace_id": _ignored("string"),
            "output_config": {
                "type": "object",
                "properties": {
                    "effort": {"type": "string", "description": "a reasoning model's thinking budget (EFFORT_BUDGETS)"},
                    # Structured output, as response_format's json_schema (Claude Code's title request).
                    "format": {
                        "type": "object",
                        "required": ["type"],
                        "x-check-first": "type",
                        "properties": {"type": {"enum": ["json_schema"]}, "schema": {"type": "object"}},
                    },
                },
            },
            "cache_salt": CACHE_SALT,
        },
    }
)
COUNT_TOKENS_SCHEMA: dict[str, Any] = tolerant(
    {"type": "object", "required": ["model", "messages"], "properties": ANTHROPIC_INPUT}
)
ANTHROPIC_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    408: "timeout_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
}


def is_anthropic(request: web.Request) -> bool:
    return request.path.startswith(ANTHROPIC_PATHS)


def anthropic_error(request: web.Request, status: int, message: str) -> dict:
    kind = ANTHROPIC_ERROR_TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")
    return {"type": "error", "error": {"type": kind, "message": message}, "request_id": request.get(REQUEST_ID)}


def anthropic_text(content: str | list[dict]) -> str:
    return content if isinstance(content, str) else "".join(block.get("text", "") for block in content)


def anthropic_chat(params: dict) -> list[dict]:
    """The request as OpenAI-shaped chat messages (what `chat_messages` checks and a
    `ChatRequest` holds): an assistant's `tool_use` blocks as its tool_calls, a user's
    `tool_result` blocks as tool messages before the rest of its text."""
    messages = [{"role": "system", "content": anthropic_text(params["system"])}] if params["system"] else []
    for i, m in enumerate(params["messages"]):
        blocks = [{"type": "text", "text": m["content"]}] if isinstance(m["content"], str) else m["content"]
        for j, block in enumerate(blocks):
            where = f"messages[{i}].content[{j}]"
            needs = {"text": ("text",), "tool_use": ("id", "name", "input"), "tool_result": ("tool_use_id",)}
            for key in needs.get(block["type"], ()):
                if key not in block:
                    raise ApiError(400, f"{where}.{key} is required", field=f"{where}.{key}")
            calling = block["type"] in ("tool_use", "tool_result")
            if calling and (block["type"] == "tool_use") != (m["role"] == "assistant"):
                raise ApiError(400, f"{where}: a {block['type']} block is not for the {m['role']}", field=where)
        text = "".join(b["text"] for b in blocks if b["type"] == "text")
        results = [b for b in blocks if b["type"] == "tool_result"]
        messages += [
            {"role": "tool", "tool_call_id": b["tool_use_id"], "content": anthropic_text(b.get("content") or "")}
            for b in results
        ]
        calls = [
            {"id": b["id"], "function": {"name": b["name"], "arguments": json.dumps(b["input"])}}
            for b in blocks
            if b["type"] == "tool_use"
        ]
        if calls:
            messages.append({"role": "assistant", "content": text, "tool_calls": calls})
        elif text or not results:
            messages.append({"role": m["role"], "content": text})
    if params["messages"][-1]["role"] == "assistant":
        field = f"messages[{len(params['messages']) - 1}]"
        raise ApiError(400, f"{field}: a final assistant message (a prefill) is not supported", field=field)
    return chat_messages({"messages": messages})


def anthropic_tools(request: web.Request, params: dict) -> ToolUse | None:
    """Anthropic's tools and tool_choice as the chat route's (auto, any: required, tool: named,
    none: no tools at all); its server tools skipped, their types in the request log."""
    choice = params["tool_choice"] or {"type": "auto"}
    tools, skipped = [], []
    for i, t in enumerate(params["tools"] or []):
        if t.get("type", "custom") != "custom":
            skipped.append(t["type"])
        elif "input_schema" not in t:
            raise ApiError(400, f"tools[{i}].input_schema is required", field=f"tools[{i}].input_schema")
        else:
            tools.append({"function": {"name": t["name"], **pick(t, "description"), "parameters": t["input_schema"]}})
    note_skipped(request, skipped)
    mapped = {"auto": "auto", "any": "required", "none": "none", "tool": {"function": {"name": choice.get("name")}}}
    if choice["type"] == "tool" and choice.get("name") is None:
        raise ApiError(400, "tool_choice.name is required with type tool", field="tool_choice.name")
    return chat_tools(
        {
            "tools": tools or None,
            "functions": None,
            "tool_choice": mapped[choice["type"]] if tools or choice["type"] != "auto" else None,
            "function_call": None,
            "parallel_tool_calls": not choice.get("disable_parallel_tool_use", False),
        },
        flat=True,
    )


def anthropic_plan(request: web.Request, params: dict) -> ChatPlan:
    """The request's chat plan: what /v1/messages generates from and count_tokens counts."""
    backend = engine_ready(request).backend
    use = check_arguments(request, anthropic_tools(request, params))
    format = (params.get("output_config") or {}).get("format")
    tools_or_format(use, format and "json_schema", "output_config.format")
    schema = format and GrammarSpec("json_schema", json.dumps(format.get("schema", {"type": "object"})))
    thinking = params.get("thinking") or {}
    options = template_options(
        request,
        None,
        None if not thinking else thinking["type"] != "disabled",
        effort=(params.get("output_config") or {}).get("effort"),
        budget=thinking.get("budget_tokens") if thinking.get("type") == "enabled" else None,
    )
    messages = anthropic_chat(params)
    use = first_tool_choice(request, use, messages)
    return chat_plan(backend, ChatRequest(messages, use, response_format=schema or None, **options))


# -- Anthropic Messages API: /v1/messages, /v1/messages/count_tokens ----------------------------


def anthropic_stop_reason(summary: Summary, stop_sequences: tuple[str, ...]) -> str:
    if summary.finish_reason == "length":
        return "max_tokens"
    if summary.stop_sequence is not None and summary.stop_sequence in stop_sequences:
        return "stop_sequence"
    return "end_turn"  # end-of-text, or the chat format's own end of turn


def anthropic_usage(summary: Summary) -> dict:
    """Anthropic's counts: `input_tokens` are the prompt tokens computed, the cached ones apart."""
    return {
        "input_tokens": summary.prompt_tokens - summary.cached_tokens,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": summary.cached_tokens,
        "output_tokens": summary.tokens_used,
    }


def sse_event(kind: str, payload: dict) -> str:
    return f"event: {kind}\ndata: {json.dumps({'type': kind, **payload}, ensure_ascii=False)}\n\n"


class AnthropicWire(Wire):
    """A `message` body; streamed, message_start, then each block's start, deltas and stop (a
    text block at once without tools; with tools, blocks as the reply's text and calls come:
    `tool_use` with its input as one `input_json_delta`), then message_delta (stop reason,
    usage) and message_stop; a failure is an `error` event. A reasoning model's thought is a
    `thinking` block (its text, then its signature) where the request asked for thinking, else
    left out."""

    def __init__(
        self,
        request: web.Request,
        tickets: list[Ticket],
        params: dict,
        name: str,
        stop: tuple[str, ...],
        plan: ChatPlan,
    ):
        super().__init__(request, tickets, params["stream"])
        self.stop_sequences = stop
        self.message = {"id": f"msg_{uuid.uuid4().hex}", "type": "message", "role": "assistant", "model": name}
        self.tools = plan.tool_names is not None
        self.thinks = (params.get("thinking") or {}).get("type") in ("enabled", "adaptive")
        self.thought = ""  # the open thinking block's text, for its signature
        self.parser = lambda: checked_parser(request, plan)
        self.stream_parser = self.parser()
        self.blocks = 0  # blocks started
        self.open: str | None = None  # the type of the block open now
        # Made now, before any event: the answer loop asks for the opening with the first events.
        prompt_tokens = len(self.tickets[0].request.prompt_ids)
        usage = {"input_tokens": prompt_tokens, "output_tokens": 0}
        start = {**self.message, "content": [], "stop_reason": None, "stop_sequence": None, "usage": usage}
        later = self.tools or (self.thinks and plan.reasoning)  # the first block is the reply's own
        self.head = sse_event("message_start", {"message": start}) + ("" if later else self.start_block("text"))

    def opening(self) -> str:
        return self.head

    def keepalive(self) -> str:
        return sse_event("ping", {})  # Anthropic's own keep-alive, after message_start

    def start_block(self, kind: str, **fields) -> str:
        out = self.stop_block()
        block = {"type": kind, **fields, "input": {}} if kind == "tool_use" else {"type": kind, kind: ""}
        out += sse_event("content_block_start", {"index": self.blocks, "content_block": block})
        if self.blocks == 0:
            out += sse_event("ping", {})
        self.blocks, self.open = self.blocks + 1, kind
        return out

    def stop_block(self) -> str:
        if self.open is None:
            return ""
        out = ""
        if self.open == "thinking":  # its signature last, as Anthropic sends it
            delta = {"type": "signature_delta", "signature": thought_signature(self.thought)}
            out, self.thought = sse_event("content_block_delta", {"index": self.blocks - 1, "delta": delta}), ""
        self.open = None
        return out + sse_event("content_block_stop", {"index": self.blocks - 1})

    def pieces(self, pieces: list[Piece]) -> str:
        out = ""
        for piece in pieces:
            if piece.kind == "call":
                out += self.start_block("tool_use", id=tool_use_id(), name=piece.call.name)
                delta = {"type": "input_json_delta", "partial_json": piece.call.arguments}
                out += sse_event("content_block_delta", {"index": self.blocks - 1, "delta": delta})
                out += self.stop_block()
            elif piece.kind == "reasoning" and piece.text and self.thinks:
                if self.open != "thinking":
                    out += self.start_block("thinking")
                self.thought += piece.text
                delta = {"type": "thinking_delta", "thinking": piece.text}
                out += sse_event("content_block_delta", {"index": self.blocks - 1, "delta": delta})
            elif piece.kind == "content" and piece.text:
                if self.open != "text":
                    out += self.start_block("text")
                delta = {"type": "text_delta", "text": piece.text}
                out += sse_event("content_block_delta", {"index": self.blocks - 1, "delta": delta})
        return out

    def chunk(self, index: int, item: Event) -> str:
        if isinstance(item, StepLogprobs):
            return ""
        if isinstance(item, str):
            return self.pieces(self.stream_parser.feed(item))
        if item.finish_reason in ("error", "timeout"):
            status = 400 if grammar_failed(item) else 504 if item.finish_reason == "timeout" else 500
            return sse_event(
                "error", {"error": anthropic_error(self.request, status, item.error or item.finish_reason)["error"]}
            )
        out = self.pieces(self.stream_parser.finish())
        if self.blocks == 0:  # an empty reply: one empty text block, as without tools
            out += self.start_block("text")
        delta = self.stop_fields(item, self.stream_parser)
        return (
            out
            + self.stop_block()
            + sse_event("message_delta", {"delta": delta, "usage": anthropic_usage(item)})
            + sse_event("message_stop", {})
        )

    def stop_fields(self, summary: Summary, parser: ToolCallParser) -> dict:
        reason = anthropic_stop_reason(summary, self.stop_sequences)
        if parser.calls and summary.finish_reason == "stop":
            reason = "tool_use"
        return {"stop_reason": reason, "stop_sequence": summary.stop_sequence if reason == "stop_sequence" else None}

    def body(self) -> dict:
        (choice,) = self.choices
        parser = self.parser()
        content = []
        for piece in parser.feed("".join(choice.text)) + parser.finish():
            if piece.kind == "call":
                arguments = json.loads(piece.call.arguments)
                content.append({"type": "tool_use", "id": tool_use_id(), "name": piece.call.name, "input": arguments})
            elif piece.kind == "reasoning":
                if not self.thinks or not piece.text:
                    continue
                if not content or content[-1]["type"] != "thinking":
                    content.append({"type": "thinking", "thinking": "", "signature": ""})
                content[-1]["thinking"] += piece.text
            elif content and content[-1]["type"] == "text":
                content[-1]["text"] += piece.text
            else:
                content.append({"type": "text", "text": piece.text})
        for block in content:
            if block["type"] == "thinking":
                block["signature"] = thought_signature(block["thinking"])
        return {
            **self.message,
            "content": content or [{"type": "text", "text": ""}],
            **self.stop_fields(choice.summary, parser),
            "usage": anthropic_usage(choice.summary),
        }


def tool_use_id() -> str:
    return f"toolu_{uuid.uuid4().hex[:24]}"


SIGNATURE_KEY = os.urandom(32)  # this process's: a thought's signature is not checked when it comes back


def thought_signature(text: str) -> str:
    """A thinking block's signature: this server's HMAC of its text (clients send it back as
    they got it; nothing here depends on it)."""
    return base64.b64encode(hmac.new(SIGNATURE_KEY, text.encode(), hashlib.sha256).digest()).decode()


async def v1_messages(request: web.Request) -> web.StreamResponse:
    params = await read_params(request, MESSAGES_SCHEMA)
    name, adapter = model_named(request, params["model"])
    plan = anthropic_plan(request, params)
    stop = tuple(params["stop_sequences"] or ())
    defaults = {key: schema["default"] for key, schema in SAMPLING_PROPERTIES.items()}
    generation = Generation(
        prompt=plan.prompt,
        max_tokens=params["max_tokens"],
        max_tokens_given=True,
        sampling=sampling_of({**defaults, "top_k": params["top_k"]}, params["temperature"], params["top_p"], None),
        prompt_field="messages",
        **await chat_options(request, plan, stop, False, "output_config.format.schema"),
    )
    tickets = await submit(request, [generation], adapter, params["cache_salt"])
    return await answer(request, tickets, AnthropicWire(request, tickets, params, name, stop, plan))


async def v1_count_tokens(request: web.Request) -> web.Response:
    """{input_tokens}: the prompt's tokens as /v1/messages would compute them."""
    params = await read_params(request, COUNT_TOKENS_SCHEMA)
    model_named(request, params["model"])
    backend = engine_ready(request).backend
    text = anthropic_plan(request, params).prompt
    tokens = await asyncio.get_running_loop().run_in_executor(request.app[TOKENIZER_POOL], backend.encode, text)
    return web.json_response({"input_tokens": len(tokens)})


# -- tokenizer: /tokenize, /detokenize (vLLM's shapes) ------------------------------------------
# The ids a prompt or a chat is generated from, exactly as the generating routes tokenize it: a
# chat through the model's chat template with its generation prompt, and no special token added
# beyond what the template writes. llama.cpp's `content` is accepted for `prompt`. Errors come in
# OpenAI's shape, as vLLM's do.

TOKENIZER_PATHS = frozenset({"/tokenize", "/detokenize"})
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


async def tokenize(request: web.Request) -> web.Response:
    """{tokens, count, max_model_len} (and token_strs with return_token_strs), as vLLM answers."""
    params = await read_params(request, TOKENIZE_SCHEMA, tokenize_params)
    model_named(request, params["model"])
    backend = engine_ready(request).backend
    if params["messages"] is not None:
        as_chat = {"tools": params["tools"], "functions": None, "tool_choice": None, "function_call": None}
        use = chat_tools({**as_chat, "parallel_tool_calls": True})  # as chat renders them with tool_choice auto
        options = template_options(request, params["chat_template_kwargs"], effort=params["reasoning_effort"])
        text = chat_plan(backend, ChatRequest(chat_messages(params), use, **options)).prompt
    else:
        text = params["prompt"] if params["prompt"] is not None else params["content"]
    loop = asyncio.get_running_loop()
    tokens = await loop.run_in_executor(request.app[TOKENIZER_POOL], backend.encode, text)
    out: dict[str, Any] = {"count": len(tokens), "max_model_len": backend.info.context_length, "tokens": tokens}
    if params["return_token_strs"]:
        out["token_strs"] = [token_string(backend.token_bytes(t)) for t in tokens]
    return web.json_response(out)


async def detokenize(request: web.Request) -> web.Response:
    """{prompt}: the text of `tokens`, special tokens skipped, as generation decodes it."""
    params = await read_params(request, DETOKENIZE_SCHEMA)
    model_named(request, params["model"])
    backend = engine_ready(request).backend
    tokens = params["tokens"]
    if tokens and (min(tokens) < 0 or max(tokens) >= backend.vocab_size):
        raise ApiError(
            400, f"tokens holds an id outside the vocabulary (0 to {backend.vocab_size - 1})", field="tokens"
        )
    text = await asyncio.get_running_loop().run_in_executor(request.app[TOKENIZER_POOL], backend.decode, tokens)
    return web.json_response({"prompt": text})


# -- embeddings and rerank: /v1/embeddings, /v1/rerank -----------------------------------------
# EMBEDDING_MODEL and RERANK_MODEL run on the encode worker (backends/workers/encode.py), apart
# from the generation thread: inputs are tokenized on the pool, checked against the model's
# length (an error naming it, or cut with `truncate`), batched with other requests' inputs, and
# share MAX_QUEUE, REQUEST_TIMEOUT, the keys and rate limits. OpenAI's embeddings shape; the
# Cohere/Jina rerank shape llama.cpp and vLLM serve. docs/api.md, "Embeddings and rerank".

MAX_INPUTS = 2048  # inputs of one embeddings request, documents of one rerank request (OpenAI's limit)
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


def encoder_for(request: web.Request, kind: Kind, name: str | None) -> Encoder:
    """The encoder a request names (its EMBEDDING_MODEL or RERANK_MODEL, or that folder's name;
    None: the one there is)."""
    try:
        encoder = request.app[ENCODER].encoder(kind)
    except NotReady as exc:
        loading = request.app[ENCODER].status != "error" and str(exc).startswith("the")
        raise ApiError(503 if loading else 400, str(exc), retry_after=5 if loading else None) from None
    if of_chat_model(encoder):
        if name is not None and model_named(request, name)[1]:  # a 404 in its shape for a name not served
            raise ApiError(400, "the chat model's embeddings are its base model's: name no adapter", field="model")
        return encoder
    names = encoder_names(request, encoder)
    if name is not None and name not in names:
        raise ApiError(
            404,
            f"The model {name!r} does not exist; this server's {kind} model is {names[0]!r}",
            field="model",
            code="model_not_found",
        )
    return encoder


def of_chat_model(encoder: Encoder) -> bool:
    """Whether the encoder is the chat model's (backends/encoders/chat.py): no EMBEDDING_MODEL."""
    return getattr(encoder, "of_chat_model", False)


def encoder_names(request: web.Request, encoder: Encoder) -> list[str]:
    """The names an encoder answers to: its setting as given, and its folder's name (the chat
    model's: its served names)."""
    if of_chat_model(encoder):
        return served_names(request)
    spec = encoder.info.model
    return list(dict.fromkeys([spec, Path(spec.rstrip("/")).name]))


async def run_encoder(request: web.Request, kind: Kind, items: list[Item]) -> list:
    """The encode worker's rows for `items`, within REQUEST_TIMEOUT; a request that ends first
    (its client gone, or the timeout) drops its inputs still waiting."""
    try:
        job = request.app[ENCODER].submit(kind, items)
    except Busy as exc:
        raise ApiError(503, f"server busy: {exc}", retry_after=2) from None
    except NotReady as exc:
        raise ApiError(503, f"not accepting requests: {exc}", retry_after=5) from None
    timeout = request.app[SETTINGS].request_timeout
    try:
        async with asyncio.timeout(timeout or None):
            return await job.future
    except TimeoutError:
        raise ApiError(504, f"the request did not finish within REQUEST_TIMEOUT ({timeout:g} s)") from None
    finally:
        job.cancel()


async def off_loop(request: web.Request, fn: Callable[..., T], *args) -> T:
    return await asyncio.get_running_loop().run_in_executor(request.app[TOKENIZER_POOL], fn, *args)


def embedding_items(encoder: Encoder, given: Any, truncate: bool) -> list[Item]:
    """A request's `input` as the encoder's items (on the pool: tokenizing 2048 texts takes a while)."""
    if isinstance(given, str) or given and isinstance(given[0], int):
        given = [given]
    if isinstance(given[0], str):
        try:
            return encoder.tokenize(given, truncate)
        except InputTooLong as exc:
            raise ApiError(400, str(exc), field="input", code="context_length_exceeded") from None
    limit, vocab = encoder.info.max_tokens, encoder.info.vocab_size
    items = []
    for index, ids in enumerate(given):
        if max(ids) >= vocab:
            raise ApiError(400, f"input[{index}] holds a token id outside the vocabulary (0 to {vocab - 1})", "input")
        if len(ids) > limit and not truncate:
            raise ApiError(400, str(InputTooLong(index, len(ids), limit)), "input", "context_length_exceeded")
        items.append(Item(ids[:limit]))
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


async def v1_embeddings(request: web.Request) -> web.Response:
    """OpenAI's embeddings: a vector an input, in input order, with the tokens they took."""
    params = await read_params(request, EMBEDDINGS_SCHEMA)
    encoder = encoder_for(request, "embedding", params["model"])
    info = encoder.info
    dimensions = params["dimensions"]
    if (
        dimensions is not None
        and dimensions != info.dimensions
        and not (info.matryoshka and dimensions < info.dimensions)
    ):
        allowed = (
            f"at most {info.dimensions}" if info.matryoshka else f"{info.dimensions} (its vectors cannot be cut short)"
        )
        raise ApiError(400, f"dimensions must be {allowed} for this model", field="dimensions")
    items = await off_loop(request, embedding_items, encoder, params["input"], params["truncate"])
    rows = await run_encoder(request, "embedding", items)
    tokens = sum(len(item.ids) for item in items)
    name = params["model"] or encoder_names(request, encoder)[0]
    body = await off_loop(request, embeddings_body, rows, params, info, name, tokens)
    request[LOG_FACTS]["prompt_tokens"] = tokens
    return web.Response(body=body, content_type="application/json")


async def v1_rerank(request: web.Request) -> web.Response:
    """Cohere's and Jina's rerank: the documents' relevance to the query, best first."""
    params = await read_params(request, RERANK_SCHEMA)
    encoder = encoder_for(request, "rerank", params["model"])
    texts = [doc if isinstance(doc, str) else doc["text"] for doc in params["documents"]]
    try:
        items = await off_loop(request, encoder.pairs, params["query"], texts, params["truncate"])
    except InputTooLong as exc:
        raise ApiError(400, str(exc), field="documents", code="context_length_exceeded") from None
    scores = await run_encoder(request, "rerank", items)
    ranked = sorted(range(len(texts)), key=lambda i: -float(scores[i]))[: params["top_n"] or None]
    results = []
    for index in ranked:
        result: dict[str, Any] = {"index": index, "relevance_score": float(scores[index])}
        if params["return_documents"]:
            result["document"] = {"text": texts[index]}
        results.append(result)
    tokens = sum(len(item.ids) for item in items)
    request[LOG_FACTS]["prompt_tokens"] = tokens
    return web.json_response(
        {
            "id": f"rerank-{uuid.uuid4().hex}",
            "model": params["model"] or encoder_names(request, encoder)[0],
            "results": results,
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
        }
    )


def encoder_loader(settings: Settings) -> Callable[[], dict[Kind, Encoder]]:
    """EMBEDDING_MODEL and RERANK_MODEL, loaded by the encode worker on its thread."""

    def load() -> dict[Kind, Encoder]:
        runtime = select_backend(settings.backend)
        wanted: dict[Kind, str] = {"embedding": settings.embedding_model, "rerank": settings.rerank_model}
        encoders = {}
        for kind, spec in wanted.items():
            if spec:
                log.info("loading the %s model %s with the %s backend", kind, spec, runtime)
                encoders[kind] = load_encoder(runtime, kind, spec, settings.device)
        return encoders

    return load


def encoders_info(app: web.Application) -> dict:
    """/model/info's `encoders`: each loaded one's facts and counters."""
    worker = app[ENCODER]
    out: dict[str, Any] = {"status": worker.status, "waiting": worker.waiting}
    if worker.load_error is not None:
        out["error"] = str(worker.load_error)
    for kind, encoder in worker.encoders.items():
        out[kind] = {**encoder.info.describe(), "stats": dataclasses.asdict(worker.stats[kind])}
    return out


# -- metrics (Prometheus, through prometheus-client) ------------------------------------------------


class EngineCollector(Collector):
    """The worker's own counters and gauges, read from the engine at scrape time."""

    def __init__(self, app: web.Application):
        self._app = app

    def collect(self):
        engine, settings = self._app[ENGINE], self._app[SETTINGS]
        stats = engine.stats
        info = engine.backend.info if engine.backend is not None else None
        yield InfoMetricFamily(
            "phi2_build",
            "Server version and the model it serves.",
            value={
                "version": VERSION,
                "model": settings.model,
                "backend": info.backend if info else "",
                "device": info.device if info else "",
                "dtype": info.dtype if info else "",
            },
        )
        outcomes = CounterMetricFamily("phi2_generations", "Generations ended, by outcome.", labels=["outcome"])
        for outcome in ("completed", "cancelled", "timeouts", "errors"):
            outcomes.add_metric([outcome], getattr(stats, outcome))
        yield outcomes
        yield CounterMetricFamily(
            "phi2_decode_steps", "Decode steps of the generation worker.", value=stats.decode_steps
        )
        yield CounterMetricFamily("phi2_decode_seconds", "Time inside decode steps.", value=stats.decode_seconds)
        yield CounterMetricFamily(
            "phi2_draft_tokens_accepted",
            "Generated tokens that came from accepted prompt-lookup drafts (beyond a step's one).",
            value=stats.draft_tokens_accepted,
        )
        yield GaugeMetricFamily("phi2_queue_waiting", "Requests waiting for a batch slot.", value=engine.waiting)
        yield GaugeMetricFamily("phi2_active_sequences", "Sequences being generated.", value=engine.active)
        yield GaugeMetricFamily("phi2_max_batch", "Batch slots of the worker.", value=engine.max_batch)
        yield CounterMetricFamily(
            "phi2_prompt_cache_hit_tokens",
            "Prompt tokens whose KV came from the prompt cache.",
            value=stats.prompt_tokens_cached,
        )
        yield CounterMetricFamily(
            "phi2_prompt_cache_miss_tokens",
            "Prompt tokens prefilled (not in the prompt cache).",
            value=stats.prompt_tokens_computed,
        )
        usage = engine.prompt_cache_usage()
        yield GaugeMetricFamily("phi2_prompt_cache_bytes", "Bytes of KV the prompt cache holds.", value=usage.bytes)
        yield GaugeMetricFamily(
            "phi2_prompt_cache_entries", "Prompts (and replies) the prompt cache holds.", value=usage.entries
        )
        yield GaugeMetricFamily(
            "phi2_prompt_cache_budget_bytes", "The prompt cache's byte budget (0: off).", value=usage.budget_bytes
        )
        kv = engine.kv_cache_usage()
        for name, value, about in (
            ("budget_bytes", kv.budget_bytes, "The KV budget of decoding sequences (KV_CACHE_BYTES; 0: none)."),
            ("used_bytes", kv.used_bytes, "Bytes of KV blocks the decoding sequences hold now."),
            ("reserved_bytes", kv.reserved_bytes, "Bytes the decoding sequences' KV may reach."),
            ("peak_bytes", kv.peak_bytes, "The most bytes the KV cache has allocated."),
            ("allocated_bytes", kv.allocated_bytes, "Bytes the KV block pool (the prompt cache's too) has now."),
            ("block_tokens", kv.block_tokens, "Positions a KV block holds."),
            ("blocks", kv.blocks, "KV blocks in the pool now."),
            ("blocks_used", kv.blocks_used, "KV blocks the decoding sequences or the prompt cache hold now."),
        ):
            if value is not None:  # MLX does not count them
                yield GaugeMetricFamily(f"phi2_kv_cache_{name}", about, value=value)
        yield from encoder_metrics(self._app[ENCODER])
        yield GaugeMetricFamily("phi2_model_loaded", "1 once the model is loaded.", value=int(engine.status == "ok"))
        yield GaugeMetricFamily(
            "phi2_model_load_seconds", "How long loading the model took.", value=engine.load_time_s or 0
        )


ENCODER_COUNTERS = (
    ("requests", "Embedding and rerank requests answered, by kind."),
    ("inputs", "Inputs (texts, token id lists, query-document pairs) encoded, by kind."),
    ("tokens", "Tokens of the inputs encoded, by kind."),
    ("forwards", "Forward passes of the encode worker (batches), by kind."),
    ("seconds", "Time inside the encode worker's forward passes, by kind."),
    ("errors", "Forward passes that failed, by kind."),
)


def encoder_metrics(worker: EncodeWorker):
    """EMBEDDING_MODEL's and RERANK_MODEL's: which model, and what the encode worker did."""
    models = InfoMetricFamily("phi2_encoder", "The embedding and rerank models served.", labels=["kind"])
    for kind, encoder in worker.encoders.items():
        info = encoder.info
        models.add_metric([kind], {"model": info.model, "backend": info.backend, "device": info.device})
    yield models
    for name, about in ENCODER_COUNTERS:
        family = CounterMetricFamily(f"phi2_encoder_{name}", about, labels=["kind"])
        for kind, stats in worker.stats.items():
            family.add_metric([kind], getattr(stats, name))
        yield family
    yield GaugeMetricFamily("phi2_encoder_waiting", "Embedding and rerank requests waiting.", value=worker.waiting)


class Metrics:
    """The app's own registry (tests run many apps in one process): request metrics, updated by
    the request-log middleware on the event loop; the engine's, collected at scrape time; and
    prometheus-client's process and Python metrics."""

    def __init__(self, app: web.Application):
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "phi2_requests", "HTTP requests by route, method and status.", ["route", "method", "status"], registry=r
        )
        self.durations = Histogram(
            "phi2_request_duration_seconds",
            "Whole request time, a stream's included.",
            ["route"],
            registry=r,
            buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300),
        )
        self.ttft = Histogram(
            "phi2_time_to_first_token_seconds",
            "From a request's arrival to its first generated token.",
            registry=r,
            buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
        )
        self.rate = Histogram(
            "phi2_generation_tokens_per_second",
            "Decode rate of each generation after its first token.",
            registry=r,
            buckets=(1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000),
        )
        self.generated = Counter(
            "phi2_generated_tokens", "Tokens generated (rate() of it is the server's tokens/s).", registry=r
        )
        self.prompt = Counter("phi2_prompt_tokens", "Prompt tokens of generation requests.", registry=r)
        self.invalid_arguments = Counter(
            "phi2_tool_arguments_invalid",
            "Tool calls given out whose arguments break their tool's full JSON Schema (the grammar's is lenient).",
            registry=r,
        )
        r.register(EngineCollector(app))
        ProcessCollector(registry=r)
        PlatformCollector(registry=r)
        GCCollector(registry=r)

    def observe(self, request: web.Request, status: int, seconds: float, summary: Summary | None) -> None:
        resource = request.match_info.route.resource
        route = resource.canonical if resource is not None else "unmatched"  # no label per unknown path
        self.requests.labels(route, request.method, str(status)).inc()
        self.durations.labels(route).observe(seconds)
        if summary is not None:
            self.generated.inc(summary.tokens_used)
            self.prompt.inc(summary.prompt_tokens)
            if summary.ttft_ms is not None:
                self.ttft.observe(summary.ttft_ms / 1000)
            if summary.tokens_used > 1:
                self.rate.observe(summary.tokens_per_second)


async def metrics(request: web.Request) -> web.Response:
    body = prometheus_client.generate_latest(request.app[METRICS].registry)
    return web.Response(
        body=body, headers={"Content-Type": prometheus_client.CONTENT_TYPE_LATEST, "X-Content-Type-Options": "nosniff"}
    )


# -- OpenAPI: the document, /openapi.json ------------------------------------------------------
# Built from ROUTES: the requests' schemas are the validation's own; the answers' are data, in
# docs/openapi-answers.json (the tests validate answers against the served document).

ANSWERS_FILE = Path(__file__).parent / "docs" / "openapi-answers.json"


def answer_schemas(path: Path = ANSWERS_FILE) -> dict[str, Any]:
    """The answers' schemas by name, each {"$ref": "#/..."} replaced by a copy of what it points to:
    the file shares its parts, the served document holds them whole."""
    data = json.loads(path.read_text(encoding="utf-8"))

    def whole(node: Any) -> Any:
        if isinstance(node, dict):
            if "$ref" in node:
                target = data
                for key in node["$ref"].removeprefix("#/").split("/"):
                    target = target[key]
                return whole(target)
            return {key: whole(value) for key, value in node.items()}
        if isinstance(node, list):
            return [whole(value) for value in node]
        return node

    return {name: whole(schema) for name, schema in data.items() if not name.startswith("$")}


def openapi_document(routes: list[Route]) -> dict:
    schemas = answer_schemas()
    paths: dict[str, dict] = {}
    for route in routes:
        if route.summary:
            paths.setdefault(route.openapi_path, {})[route.method.lower()] = operation(route, schemas)
    return {
        "openapi": "3.1.0",
        "info": {
            "title": "phi2-server",
            "version": VERSION,
            "description": (
                "The native API, and the OpenAI-compatible /v1 routes as far as this server fills "
                "OpenAI's shapes (request fields: what is accepted; null counts as absent on /v1)."
            ),
        },
        "components": {"securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}}},
        "paths": paths,
    }


def operation(route: Route, schemas: dict[str, Any]) -> dict:
    """A route's entry in the document."""

    def described(description: str, schema: str) -> dict:
        return {"description": description, "content": {"application/json": {"schema": schemas[schema]}}}

    ok = {"description": "OK", "content": {route.media: {"schema": schemas[route.answer]}}}
    if route.events:
        ok["content"]["text/event-stream"] = {"schema": schemas[route.events]}
    entry: dict[str, Any] = {"summary": route.summary}
    if route.path not in OPEN_PATHS:
        entry["security"] = [{}, {"bearer": []}]  # a key is needed when PHI2_API_KEY is set
    if names := re.findall(r"\{(\w+)\}", route.openapi_path):
        entry["parameters"] = [{"name": n, "in": "path", "required": True, "schema": {"type": "string"}} for n in names]
    if route.request is not None:
        entry["requestBody"] = {"required": True, "content": {"application/json": {"schema": route.request}}}
    entry["responses"] = {
        "200": ok,
        **{str(status): described(HTTPStatus(status).phrase, route.error) for status in route.errors},
        **{str(status): described(description, schema) for status, description, schema in route.other},
    }
    return entry


async def openapi(request: web.Request) -> web.Response:
    return web.json_response(request.app[OPENAPI])


# -- routes: one table, registered by create_app, described by /openapi.json -------------------
# The module docstring's index lists the same routes (tests/test_openapi.py holds them equal).

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


@dataclass(frozen=True)
class Route:
    """A route and what its /openapi.json entry needs; schemas are named by docs/openapi-answers.json."""

    method: str  # GET (aiohttp answers HEAD too), POST or DELETE
    path: str  # aiohttp's; a `{name:regex}` part reads `{name}` in the index and the document
    handler: Handler
    section: str  # the `# -- ...` header the handler is under (its start)
    summary: str = ""  # the document's; empty: not in the document (the document itself)
    request: dict | None = None  # the body's schema: the validation's own
    answer: str = ""  # the 200 answer's schema
    media: str = "application/json"  # the 200 answer's
    events: str = ""  # the 200 answer's schema as text/event-stream (with stream), if it streams so
    errors: tuple[int, ...] = ()  # statuses answered with `error`
    error: str = "Error"
    other: tuple[tuple[int, str, str], ...] = ()  # more answers: (status, description, schema)

    @property
    def openapi_path(self) -> str:
        return re.sub(r"\{(\w+):[^}]*\}", r"{\1}", self.path)


# What a kind of route answers besides 200's body: error statuses, their schema, the stream's.
NATIVE_ANSWERS = {"errors": (400, 401, 413, 422, 429, 500, 503, 504)}
OPENAI_ANSWERS = {"errors": (400, 401, 404, 413, 429, 500, 503, 504), "error": "OpenAIError", "events": "OpenAIEvents"}
ANTHROPIC_ANSWERS = {**OPENAI_ANSWERS, "error": "AnthropicError", "events": "AnthropicEvents"}
TOKENIZER_ANSWERS = {"errors": (400, 401, 404, 413, 429, 503), "error": "OpenAIError"}
IN_PROBES, IN_NATIVE, IN_MODELS = "probes and model facts", "the native API", "OpenAI-compatible API: models"
IN_COMPLETIONS, IN_CHAT = "OpenAI-compatible API: /v1/completions", "OpenAI-compatible API: /v1/chat/completions"
IN_RESPONSES, IN_MESSAGES, IN_TOKENIZER = "OpenAI Responses API", "Anthropic Messages API", "tokenizer"
IN_STORED = "OpenAI Responses API: stored answers"
IN_ENCODERS = "embeddings and rerank"
ENCODER_ANSWERS = {"errors": (400, 401, 404, 413, 429, 500, 503, 504), "error": "OpenAIError"}

# fmt: off
ROUTES = [  # method, path, handler, section; the document's summary, request schema, 200 answer, the rest
    Route("GET", "/health", health, IN_PROBES, "Liveness", answer="Health"),
    Route("GET", "/ready", ready, IN_PROBES, "Readiness", answer="Ready", other=((503, "Not ready", "Ready"),)),
    Route("GET", "/model/info", model_info, IN_PROBES, "The loaded model", answer="Info", errors=(401, 429, 503)),
    Route("POST", "/generate", generate, IN_NATIVE, "Generate text", GENERATE_SCHEMA, "GenerateResponse",
          **NATIVE_ANSWERS),
    Route("POST", "/generate/stream", generate_stream, IN_NATIVE, "Generate text, streamed as NDJSON",
          GENERATE_SCHEMA, "GenerateStream", media="application/x-ndjson", **NATIVE_ANSWERS),
    Route("GET", "/v1/models", v1_models, IN_MODELS, "The served model names (OpenAI)", answer="ModelList",
          errors=(401, 429, 503), error="OpenAIError"),
    Route("GET", "/v1/models/{model:.+}", v1_model, IN_MODELS, "One served model name (OpenAI)", answer="Model",
          errors=(401, 404, 429, 503), error="OpenAIError"),  # a model's id may hold slashes (microsoft/phi-2)
    Route("POST", "/v1/completions", v1_completions, IN_COMPLETIONS,
          "Complete prompts (OpenAI's legacy completions)", COMPLETIONS_SCHEMA, "CompletionResponse", **OPENAI_ANSWERS),
    Route("POST", "/v1/chat/completions", v1_chat_completions, IN_CHAT, "Chat (OpenAI)", CHAT_SCHEMA,
          "ChatResponse", **OPENAI_ANSWERS),
    Route("POST", "/v1/responses", v1_responses, IN_RESPONSES, "A response (OpenAI's Responses API)",
          RESPONSES_SCHEMA, "Response", **OPENAI_ANSWERS),
    Route("GET", "/v1/responses/{response_id}", v1_response, IN_STORED, "A stored response (OpenAI)",
          answer="Response", errors=(401, 404, 429), error="OpenAIError"),
    Route("DELETE", "/v1/responses/{response_id}", v1_delete_response, IN_STORED, "Delete a stored response",
          answer="DeletedResponse", errors=(401, 404, 429), error="OpenAIError"),
    Route("POST", "/v1/messages", v1_messages, IN_MESSAGES, "A message (Anthropic's Messages API)",
          MESSAGES_SCHEMA, "AnthropicMessage", **ANTHROPIC_ANSWERS),
    Route("POST", "/v1/messages/count_tokens", v1_count_tokens, IN_MESSAGES,
          "The input tokens of a message (Anthropic)", COUNT_TOKENS_SCHEMA, "CountTokensResponse", **ANTHROPIC_ANSWERS),
    Route("POST", "/tokenize", tokenize, IN_TOKENIZER, "The ids a prompt or a chat is generated from (vLLM)",
          TOKENIZE_SCHEMA, "TokenizeResponse", **TOKENIZER_ANSWERS),
    Route("POST", "/detokenize", detokenize, IN_TOKENIZER, "The text of token ids (vLLM)", DETOKENIZE_SCHEMA,
          "DetokenizeResponse", **TOKENIZER_ANSWERS),
    Route("POST", "/v1/embeddings", v1_embeddings, IN_ENCODERS, "Embeddings of texts or token ids (OpenAI)",
          EMBEDDINGS_SCHEMA, "EmbeddingsResponse", **ENCODER_ANSWERS),
    Route("POST", "/v1/rerank", v1_rerank, IN_ENCODERS, "Documents ranked by relevance to a query (Cohere, Jina)",
          RERANK_SCHEMA, "RerankResponse", **ENCODER_ANSWERS),
    Route("GET", "/metrics", metrics, "metrics", "Prometheus metrics", answer="Metrics", media="text/plain",
          errors=(401,)),
    Route("GET", "/openapi.json", openapi, "OpenAPI: the document"),  # not in the document it serves
]
# fmt: on


# -- application: the app factory, the worker's start and stop ---------------------------------


def model_loader(settings: Settings) -> Callable[[], Backend]:
    def load() -> Backend:
        name = select_backend(settings.backend)
        log.info("loading %s with the %s backend", settings.model, name)
        return load_backend(name, settings.load_options())

    return load


async def start_worker(app: web.Application) -> None:
    settings = app[SETTINGS]
    app[REQUEST_LOG] = RequestLog(settings.log_dir, settings.log_max_bytes, settings.log_backups)
    app[TOKENIZER_POOL] = ThreadPoolExecutor(max_workers=2, thread_name_prefix="tokenizer")
    app[GRAMMAR_COMPILER] = BoundedPool(GRAMMAR_WORKERS, GRAMMAR_BACKLOG, "grammar")
    loop = asyncio.get_running_loop()
    load_done = app[LOAD_DONE]
    chat_loaded = threading.Event()

    def on_load_done() -> None:
        chat_loaded.set()
        loop.call_soon_threadsafe(load_done.set)

    def load_encoders() -> dict:
        # After the chat model: two threads importing transformers' lazy module at once failed
        # ("cannot import name 'AutoModel'"), and one load at a time keeps the peak memory lower.
        chat_loaded.wait()
        return app[ENCODER_LOADER]()

    def chat_embedder() -> Encoder:
        chat_loaded.wait()
        if engine.status != "ok":
            raise Refused("the chat model did not load")
        return chat_encoder(engine.backend, settings.embedding_pooling)

    engine = Engine(
        app[LOADER],
        max_queue=settings.max_queue,
        max_batch=settings.max_batch,
        prompt_cache_bytes=settings.prompt_cache_budget(),
        stream_buffer=settings.stream_buffer,
        on_load_done=on_load_done,
    )
    app[ENGINE] = engine
    engine.start()
    threads = settings.embedding_threads or max(1, (os.cpu_count() or 1) // 4)
    app[ENCODER] = EncodeWorker(
        load_encoders if app[ENCODER_LOADER] else None,  # None: nothing to load, ready at once
        lambda: engine.max_queue or MIN_QUEUE,
        settings.embedding_batch_tokens,
        threads,
        chat_embedder if settings.embedding_pooling != "none" else None,  # where no EMBEDDING_MODEL is loaded
    )
    app[ENCODER].start()


async def drain_worker(app: web.Application) -> None:
    """On shutdown: take nothing new, give in-flight requests the grace period, end the rest."""
    engine = app[ENGINE]
    engine.stop_accepting()
    deadline = time.monotonic() + app[SETTINGS].shutdown_grace
    while (engine.waiting or engine.active) and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    engine.abort("shutdown")


async def stop_worker(app: web.Application) -> None:
    await asyncio.to_thread(app[ENGINE].stop, 30)
    await asyncio.to_thread(app[ENCODER].stop, 30)
    app[TOKENIZER_POOL].shutdown(wait=False, cancel_futures=True)
    app[GRAMMAR_COMPILER].shutdown()
    app[REQUEST_LOG].close()


def create_app(
    settings: Settings | None = None,
    load: Callable[[], Backend] | None = None,
    load_encoders: Callable[[], dict[Kind, Encoder]] | None = None,
) -> web.Application:
    """The application; `load` builds the backend on the worker thread, `load_encoders` the
    embedding and rerank models on theirs (tests inject them)."""
    settings = settings or Settings()
    process_setup()
    middlewares = [request_log, cors_preflight, json_errors, access]  # outermost first
    app = web.Application(middlewares=middlewares, client_max_size=settings.max_body_bytes)
    app[SETTINGS] = settings
    # Read once: a bad one stops the start, naming it.
    _ = settings.default_temperature, settings.template_kwargs, settings.forces_first_tool_call
    if settings.embedding_pooling not in POOLINGS:
        raise ValueError(f"EMBEDDING_POOLING={settings.embedding_pooling!r} must be one of {', '.join(POOLINGS)}")
    app[API_KEYS] = load_api_keys(settings)
    app[RATE_LIMITER] = TokenBuckets(settings.rate_limit) if settings.rate_limit > 0 else None
    app[AUTH_FAILURES] = TokenBuckets(AUTH_FAILURES_PER_MINUTE)
    app[CORS_ORIGINS] = frozenset(o.strip() for o in settings.cors_origins.split(",") if o.strip())
    app[METRICS] = Metrics(app)
    app[OPENAPI] = openapi_document(ROUTES)
    app.on_response_prepare.append(add_headers)
    app[LOAD_DONE] = asyncio.Event()
    app[DRAINING] = asyncio.Event()
    app[LOADER] = load or model_loader(settings)
    wanted = settings.embedding_model or settings.rerank_model
    app[ENCODER_LOADER] = load_encoders or (encoder_loader(settings) if wanted else None)
    app.on_startup.append(start_worker)
    app.on_shutdown.append(drain_worker)
    app.on_cleanup.append(stop_worker)
    app[RESPONSES] = ResponseStore(settings.responses_store, settings.responses_store_bytes)
    add = {"GET": app.router.add_get, "POST": app.router.add_post, "DELETE": app.router.add_delete}
    for route in ROUTES:
        add[route.method](route.path, route.handler)
    return app


def describe_load_error(exc: BaseException, settings: Settings) -> str:
    if isinstance(exc, (ModelLoadError, ValueError)):
        return str(exc)
    return (
        f"PHI2_MODEL={settings.model!r} could not be loaded ({type(exc).__name__}: {exc}); "
        "run `make demo` (PHI2_MODEL=tiny) for the offline demo model"
    )


# -- serving: the HTTP server, its protocol errors, signals, main ------------------------------


class ProtocolErrorLog(AbstractAccessLogger):
    """The request-log line of a request aiohttp answered itself.

    A request that is not valid HTTP (a NUL byte in a header, a broken request line) gets
    aiohttp's own 400 before any middleware runs, so `request_log` never sees it; aiohttp's
    access-log hook does. Requests that reached the app already have their line (the hook is
    called for those too: they carry a request id, and are skipped here).
    """

    app: web.Application  # set by `runner_options`

    def log(self, request: web.BaseRequest, response: web.StreamResponse, time: float) -> None:
        if REQUEST_ID in request or REQUEST_LOG not in self.app:
            return
        self.app[REQUEST_LOG].write(
            {
                "ts": datetime.now(UTC).isoformat(timespec="milliseconds"),
                "request_id": uuid.uuid4().hex,
                "method": request.method,  # UNKNOWN: the request line could not be read
                "path": None,
                "status": response.status,
                "duration_ms": round(time * 1000, 2),
                "error": "not a valid HTTP request",
            }
        )


def parse_error_reason(error: HttpProcessingError) -> str:
    """What is wrong with a request aiohttp cannot parse, without the bytes it quotes (the line
    of a malformed header, an Authorization header's key included)."""
    text = (error.message or str(error)).strip()
    return text.splitlines()[0].rstrip(":") if text else "malformed request"


class ClientErrorsQuietly(logging.Filter):
    """aiohttp logs a request it cannot parse as an ERROR with a traceback; that is the client's
    mistake, not the server's: one warning line instead, naming the problem but not the bytes."""

    def filter(self, record: logging.LogRecord) -> bool:
        error = record.exc_info[1] if record.exc_info else None
        if isinstance(error, HttpProcessingError):
            record.msg, record.args = f"{record.msg}: %s", (*(record.args or ()), parse_error_reason(error))
            record.levelno, record.levelname = logging.WARNING, "WARNING"
            record.exc_info = record.exc_text = None
        return True


class QuietRequestHandler(RequestHandler):
    """aiohttp's connection handler, except for its answer to a request it cannot parse: a JSON
    error naming the problem, where aiohttp's plain text quotes the offending line (a malformed
    Authorization header's key with it). aiohttp has no option for this; `web_server` makes its
    handlers from this module-level name, so it is replaced there, once, for every server of
    this process (the tests' included)."""

    def handle_error(
        self, request, status: int = 500, exc: BaseException | None = None, message: str | None = None
    ) -> web.StreamResponse:
        if isinstance(exc, HttpProcessingError):
            message = json.dumps(
                {
                    "error": {
                        "message": f"not a valid HTTP request: {parse_error_reason(exc)}",
                        "type": NATIVE_ERROR_TYPES.get(status, "client_error"),
                    }
                }
            )
            response = super().handle_error(request, status, exc, message)
            response.content_type = "application/json"
            return response
        return super().handle_error(request, status, exc, message)


HTTP_LOG = logging.getLogger("phi2_server.http")


def process_setup() -> None:
    """What serving an app changes for the whole process, done when one is made (idempotent):
    no Prometheus `_created` series (they double every counter and histogram, and no dashboard
    here uses them); aiohttp's parse errors answered and logged quietly (`QuietRequestHandler`,
    `ClientErrorsQuietly`)."""
    prometheus_client.disable_created_metrics()
    aiohttp.web_server.RequestHandler = QuietRequestHandler
    if not any(isinstance(f, ClientErrorsQuietly) for f in HTTP_LOG.filters):
        HTTP_LOG.addFilter(ClientErrorsQuietly())


def runner_options(app: web.Application) -> dict[str, Any]:
    """How the app is served (also by the tests' servers): a handler is cancelled when its client
    leaves, and requests aiohttp answers itself are logged, quietly."""
    access_log_class = type("AppProtocolErrorLog", (ProtocolErrorLog,), {"app": app})
    return {
        "handler_cancellation": True,
        "keepalive_timeout": app[SETTINGS].idle_timeout,  # also bounds a connection that never completes its headers
        "access_log_class": access_log_class,
        "access_log": HTTP_LOG,
        "logger": HTTP_LOG,
    }


# Connections the kernel completes before the server accepts them: aiohttp's 128 overflowed while
# the loop handed a step's stream ends over, and a dropped SYN is resent only after a second
# (BENCHMARKS.md, D-backlog). uvicorn and gunicorn use 2048 too; the kernel caps it at somaxconn.
LISTEN_BACKLOG = 2048


async def listen(runner: web.AppRunner, host: str, port: int) -> web.TCPSite:
    """Serve `runner` on host:port (also the tests' servers: the same listening socket)."""
    site = web.TCPSite(runner, host, port, backlog=LISTEN_BACKLOG)
    await site.start()
    return site


async def serve(app: web.Application) -> int:
    settings = app[SETTINGS]
    if not app[API_KEYS] and settings.host not in ("127.0.0.1", "localhost", "::1"):
        log.warning(
            "!!! HOST=%s and no PHI2_API_KEY: anyone who can reach this port can use the model. "
            "Set PHI2_API_KEY (or PHI2_API_KEY_FILE), or listen on 127.0.0.1 only. !!!",
            settings.host,
        )
    runner = web.AppRunner(app, shutdown_timeout=settings.shutdown_grace + 5, **runner_options(app))
    await runner.setup()
    try:
        await listen(runner, settings.host, settings.port)
    except OSError as exc:
        print(f"error: cannot listen on {settings.host}:{settings.port}: {exc.strerror or exc}", file=sys.stderr)
        await runner.cleanup()
        return 1
    log.info("listening on http://%s:%d (the model loads in the background)", settings.host, settings.port)

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()

    def on_signal() -> None:
        if stop.is_set():  # a second Ctrl-C: the user does not want to wait for the grace period
            log.warning("second signal: exiting now")
            os._exit(130)
        stop.set()

    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, on_signal)
    engine = app[ENGINE]

    async def watch_load() -> None:
        await app[LOAD_DONE].wait()
        if engine.status == "error":
            stop.set()
        else:
            info = engine.backend.info
            registry = engine.backend.adapters
            available = await available_adapters(engine.backend)
            log.info(
                "model ready in %.1f s: %s on %s (%s, %s); default adapter: %s; adapters in %s: %d",
                engine.load_time_s,
                info.model,
                info.backend,
                info.device,
                info.dtype,
                registry.default_name or "none",
                registry.directory or "(no ADAPTERS_DIR)",
                len(available),
            )

    watcher = asyncio.create_task(watch_load())
    await stop.wait()
    watcher.cancel()
    code = 0
    if engine.status == "error":
        print(f"error: {describe_load_error(engine.load_error, settings)}", file=sys.stderr)
        code = 1
    else:
        if settings.drain_delay > 0:
            # Behind a load balancer: first tell its health checks (/ready 503) and keep serving
            # what still arrives, then stop taking connections. A second signal exits at once.
            app[DRAINING].set()
            log.info("draining: /ready answers 503; requests are served for %.1f s more", settings.drain_delay)
            await asyncio.sleep(settings.drain_delay)
        log.info("shutting down: %.0f s grace for in-flight requests", settings.shutdown_grace)
    await runner.cleanup()
    return code


def configure_logging() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")


def main(argv: list[str] | None = None) -> int:
    settings = Settings.from_args(argv)
    configure_logging()
    try:
        app = create_app(settings)
    except OSError as exc:  # PHI2_API_KEY_FILE unreadable
        print(f"error: PHI2_API_KEY_FILE={settings.api_key_file!r}: {exc.strerror or exc}", file=sys.stderr)
        return 1
    except ValueError as exc:  # PHI2_API_KEY_FILE malformed (the message shows no key)
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return run(app)


def run(app: web.Application) -> int:
    """Serve `app` until SIGTERM or SIGINT; the exit status."""
    # The worker thread and the event loop share the GIL; a shorter switch interval than the
    # default 5 ms hands it over sooner (measured within the spread: BENCHMARKS.md, D-switch-interval).
    sys.setswitchinterval(0.001)
    return asyncio.run(serve(app))


if __name__ == "__main__":
    sys.exit(main())
