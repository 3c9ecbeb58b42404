"""phi2-server: a small local REST server for Phi-2 (and causal LMs of the same families).

HTTP only: configuration, routes, bodies, errors, middleware, the answer loop, startup and
shutdown. Each API's schema, translation and answer shape are in `backends/wire/`; the model lives
behind `backends` (MLX or PyTorch) and is driven by one generation worker thread
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
    POST /v1/chat/completions   v1_chat_completions   chat: one path for the three chat APIs
    POST /v1/responses          v1_responses          chat: one path for the three chat APIs
    GET  /v1/responses/{response_id}     v1_response          OpenAI Responses API: stored answers
    DELETE /v1/responses/{response_id}   v1_delete_response   OpenAI Responses API: stored answers
    POST /v1/messages           v1_messages           chat: one path for the three chat APIs
    POST /v1/messages/count_tokens  v1_count_tokens   chat: one path for the three chat APIs
    POST /tokenize              tokenize              tokenizer
    POST /detokenize            detokenize            tokenizer
    POST /v1/embeddings         v1_embeddings         embeddings and rerank
    POST /v1/rerank             v1_rerank             embeddings and rerank
    GET  /metrics               metrics               metrics
    GET  /openapi.json          openapi               OpenAPI: the document

A generating handler is parse -> generations -> `submit` -> `answer(request, tickets, wire)`:
one answer loop for every API, streamed or whole, and one `Wire` object per wire format
("answers"); the three chat APIs share one handler path (`chat_answer`) fed by each API's
translation. Every request passes the middleware in `create_app`: request log, CORS preflight,
JSON errors, access (API keys, rate limits).
"""

from __future__ import annotations

import argparse
import asyncio
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
from collections.abc import Awaitable, Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field, fields
from datetime import UTC, datetime
from functools import cached_property
from http import HTTPStatus
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
from backends.chat.tools import ToolCall, argument_error
from backends.choose import chat_encoder, load_backend, load_encoder, select_backend
from backends.contract import (
    Backend,
    ChatError,
    Grammar,
    GrammarError,
    LoadOptions,
    ModelLoadError,
)
from backends.encoders.chat import POOLINGS, Refused
from backends.encoders.embeddings import Encoder, InputTooLong, Item, Kind
from backends.files.adapters import Adapter, AdapterError, AdapterFacts, UnknownAdapter
from backends.wire import anthropic, bodies, completions, openai_chat, responses
from backends.wire.anthropic import COUNT_TOKENS_SCHEMA, MESSAGES_SCHEMA, anthropic_error
from backends.wire.base import Context, Generation, Wire, combined, grammar_failed, token_string
from backends.wire.chat import (
    CHAT_DEFAULT_MAX_TOKENS,
    ChatCall,
    Reasoning,
    chat_messages,
    chat_tools,
    first_tool_choice,
    template_options,
)
from backends.wire.completions import COMPLETIONS_SCHEMA
from backends.wire.encoders import EMBEDDINGS_SCHEMA, RERANK_SCHEMA, embedding_items, embeddings_body, within_budget
from backends.wire.errors import NATIVE_ERROR_TYPES, OPENAI_ERROR_TYPES, ApiError
from backends.wire.native import GENERATE_SCHEMA, NativeWire, native_generation, native_params
from backends.wire.openai import openai_generations, openai_params, response_grammar
from backends.wire.openai_chat import CHAT_SCHEMA
from backends.wire.responses import RESPONSES_SCHEMA
from backends.wire.schema import MAX_IGNORED, ignored_paths, json_of, parse, without_nulls
from backends.wire.store import ResponseStore, stored
from backends.wire.tokenizer import DETOKENIZE_SCHEMA, TOKENIZE_SCHEMA, tokenize_params
from backends.workers.encode import Busy, EncodeWorker, NotReady
from backends.workers.engine import (
    MIN_QUEUE,
    Engine,
    NotAccepting,
    QueueFull,
    Summary,
    Ticket,
    next_events,
)
from backends.workers.faults import FaultLog

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
    prompt_cache_dir: str = setting(
        "",
        "Torch: a folder where the prompt cache's entries are also written (behind, prompts of 256+ new tokens), "
        "for the next start to read when a request starts alike (empty: memory only)",
    )
    prompt_cache_disk_bytes: int = setting(0, "the most bytes PROMPT_CACHE_DIR's files take (0: 8 GiB)")
    warm_prompts: str = setting(
        "",
        "files of prompts to compute once the model is loaded, comma-separated: a request captured as JSON "
        '({"path": "/v1/messages", "body": {...}}), or text (a raw prompt); each is sent to this server with one '
        "token to generate, so its prompt is in the prompt cache when clients come",
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
        0,
        "padded tokens one embedding or rerank forward may hold, which bounds its time (0: 2048 where the encoder "
        "runs on a CPU, 8192 on a GPU)",
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
            prompt_cache_dir=self.prompt_cache_dir if self.prompt_cache else "",
            prompt_cache_disk_bytes=self.prompt_cache_disk_bytes,
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
FAULTS: web.AppKey[FaultLog] = web.AppKey("faults")  # the server process's only (main)
LOG_FACTS: web.RequestKey[dict[str, Any]] = web.RequestKey("log_facts")
REQUEST_ID: web.RequestKey[str] = web.RequestKey("request_id")
REQUEST_ID_FORMAT = re.compile(r"[A-Za-z0-9._:-]{1,128}")  # a client's id is echoed only if it is this tame
RECEIVED_AT: web.RequestKey[float] = web.RequestKey("received_at")
ARGUMENT_CHECKS: web.RequestKey[ArgumentChecks] = web.RequestKey("argument_checks")
# Whose prompt cache entries a request shares: its API key's where there are several keys.
CACHE_NAMESPACE: web.RequestKey[str] = web.RequestKey("cache_namespace")


# -- bodies: read within their time, parsed and checked off the loop when large -------------------
# Each API's request schema and checker are in backends/wire/ (schema.py: `check`, `parse`).


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
    408 and its connection closed, not waited for. A compressed body is inflated on a pool, in
    bounded pieces, and refused past MAX_BODY_BYTES (backends.wire.bodies)."""
    timeout = request.app[SETTINGS].body_timeout
    try:
        async with asyncio.timeout(timeout or None):
            raw = await request.read()  # raises 413 past MAX_BODY_BYTES (as sent: runner_options)
        if encoding := request.headers.get("Content-Encoding", ""):
            limit = request.app[SETTINGS].max_body_bytes
            pool = request.app[TOKENIZER_POOL]
            raw = await asyncio.get_running_loop().run_in_executor(pool, bodies.decoded, raw, encoding, limit)
        return raw
    except bodies.TooLarge:
        limit = request.app[SETTINGS].max_body_bytes
        raise ApiError(413, f"the request body decompresses past MAX_BODY_BYTES ({limit} bytes)", close=True) from None
    except bodies.Unreadable as exc:
        raise ApiError(415 if exc.unsupported else 400, f"the request body cannot be read: {exc}", close=True) from None
    except TimeoutError:
        raise ApiError(
            408, f"the request body did not arrive within BODY_TIMEOUT ({timeout:g} s)", close=True
        ) from None
    except RequestPayloadError as exc:  # a Content-Encoding the body does not follow, a broken chunk
        raise ApiError(
            400, f"the request body cannot be read: {str(exc).splitlines()[-1].strip()}", close=True
        ) from None


# -- validation: a /v1 body's parameters, what was ignored, the server's defaults -----------------
# What the OpenAI and Anthropic routes take (`tolerant` schemas): the fields they ignore go to
# the request log line, and TEMPERATURE fills in for a request that sends none.


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


def is_openai(request: web.Request) -> bool:
    """Whether errors come in OpenAI's shape: /v1, and the vLLM tokenizer routes."""
    return request.path.startswith("/v1/") or request.path in TOKENIZER_PATHS


def error_payload(request: web.Request, error: ApiError) -> tuple[int, dict]:
    """(status, body): the native shape, or OpenAI's on /v1 routes (where invalid input is a 400)."""
    status = error.status
    if is_anthropic(request):
        status = 400 if status == 422 else status
        return status, anthropic_error(request.get(REQUEST_ID), status, error.message)
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
    if (facts := request.get(LOG_FACTS)) is not None:
        facts["error"] = error.message[:300]  # what the client was told, for whoever reads the log
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
    if faults := request.app.get(FAULTS):  # the ids a fault's stack dump names (backends.workers.faults)
        faults.started(request[REQUEST_ID])
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
        if faults:
            faults.ended(request[REQUEST_ID])
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


# A request's first INLINE_ENCODE_CHARS characters of prompt text are tokenized on the loop, the
# rest on the app's pool: a short prompt's encoding costs less than the hop to the pool and back
# (docs/decisions.md, D-inline-encode). Per request, so many short prompts still go to the pool.
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
        # for 32,000 whatever the model); the native route refuses it, naming the numbers. What
        # fits: the context left, MAX_TOKENS_LIMIT, and for one sequence MAX_REQUEST_TOKENS (on a
        # 32k-context model, Claude Code's title request was a 400 there); n or best_of past it
        # is still refused below.
        alone = settings.max_request_tokens if len(gens) == 1 and settings.max_request_tokens else math.inf
        clip = not gen.max_tokens_given or request.path.startswith("/v1/")
        if clip and max_tokens > min(room, limit, alone):
            max_tokens = min(room, limit, alone)
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
    owner = request.get(CACHE_NAMESPACE, "")  # an API key's grammars are its own (issue 65)
    grammar = backend.cached_constraint(kind, spec, owner)
    if grammar is not None:
        return grammar, field
    busy = ApiError(
        503, f"the grammar compiler is busy ({GRAMMAR_BACKLOG} compiles in flight); retry later", field, retry_after=5
    )
    if not backend.constraints_ready():
        # The first grammar's set-up (the compiler's tokenizer, the guard's child) is not the
        # grammar's time: on a loaded 2-core machine it ran past GRAMMAR_TIMEOUT_S, a 400 on
        # Claude Code's first request. Once a process; bounded (the child's start has 60 s).
        setup = request.app[GRAMMAR_COMPILER].submit(backend.prepare_constraints)
        if setup is None:
            raise busy
        await setup
    work = request.app[GRAMMAR_COMPILER].submit(backend.constraint, kind, spec, owner)
    if work is None:
        raise busy
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


def note_summary(request: web.Request, summary: Summary) -> None:
    """The request log line's counts: tokens made, the prompt's and how many of them were cached."""
    request[LOG_FACTS].update(
        tokens_used=summary.tokens_used,
        prompt_tokens=summary.prompt_tokens,
        cached_tokens=summary.cached_tokens,
        finish_reason=summary.finish_reason,
        summary=summary,
    )


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


async def native_answer(request: web.Request, streaming: bool) -> web.StreamResponse:
    body, params = await read_body(request, native_params)
    params = with_temperature(request, body, params, GENERATE_SCHEMA)
    generation = native_generation(params, body, await native_constraint(request, params))
    tickets = await submit(request, [generation], params["adapter"], params["cache_salt"])
    return await answer(request, tickets, NativeWire(wire_context(request), tickets, streaming, params))


async def generate(request: web.Request) -> web.StreamResponse:
    return await native_answer(request, streaming=False)


async def generate_stream(request: web.Request) -> web.StreamResponse:
    return await native_answer(request, streaming=True)


# -- OpenAI-compatible API: models, /v1/models -------------------------------------------------


WILDCARDS = re.compile(r"[*?\[]")


def served_names(request: web.Request) -> list[str]:
    """The names the model answers to on /v1 and lists: SERVED_MODEL_NAME's aliases, else PHI2_MODEL."""
    return names_served(request.app[SETTINGS])


def names_served(settings: Settings) -> list[str]:
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
    embeds = chat_embeds(request)
    cards = [chat_card(engine, name, embeds) for name in names]
    facts = await available_adapters(engine.backend)
    cards += [adapter_card(engine, names[0], adapter) for adapter in facts]
    for kind, encoder in request.app[ENCODER].encoders.items():  # EMBEDDING_MODEL, RERANK_MODEL
        if not of_chat_model(encoder):
            cards.append({**model_card(engine, encoder_names(request, encoder)[0]), "task": kind})
    return web.json_response({"object": "list", "data": cards})


async def v1_model(request: web.Request) -> web.Response:
    engine = engine_ready(request)
    for kind, encoder in request.app[ENCODER].encoders.items():
        if not of_chat_model(encoder) and request.match_info["model"] in encoder_names(request, encoder):
            return web.json_response({**model_card(engine, request.match_info["model"]), "task": kind})
    name, adapter = model_named(request, request.match_info["model"])
    if not adapter:
        return web.json_response(chat_card(engine, name, chat_embeds(request)))
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


def chat_embeds(request: web.Request) -> bool:
    """Whether the chat model answers /v1/embeddings (no EMBEDDING_MODEL: the chat model's encoder)."""
    return any(of_chat_model(encoder) for encoder in request.app[ENCODER].encoders.values())


def chat_card(engine: Engine, name: str, embeds: bool = False) -> dict:
    """The chat model's card: its context window under the names clients read (llama.cpp's and
    Ollama's `context_length`, vLLM's `max_model_len`, agents' `context_window`) and what it does."""
    backend = engine.backend
    context = backend.info.context_length
    card = {
        **model_card(engine, name),
        "context_length": context,
        "max_model_len": context,
        "context_window": context,
        "capabilities": {"chat": True, "tools": True, "reasoning": backend.reasons(), "embeddings": embeds},
    }
    return {**card, "tasks": ["chat", "embedding"]} if embeds else card


def adapter_card(engine: Engine, base: str, facts: AdapterFacts) -> dict:
    return {
        **chat_card(engine, f"{base}:{facts.name}"),
        "parent": base,
        "root": facts.path,
        "adapter": facts.describe(),
    }


# -- OpenAI-compatible API: /v1/completions ----------------------------------------------------
# The same worker, limits and log as the native routes; OpenAI's wire format and defaults
# (backends/wire/openai.py, completions.py). docs/api.md, "OpenAI-compatible API".


async def grammar_options(request: web.Request, grammar: GrammarSpec | None, field: str | None, checks: dict) -> dict:
    """A grammar compiled, as Generation's grammar and grammar_field (none: {})."""
    if grammar is None:
        return {}
    compiled, field = await compile_constraint(request, grammar.kind, grammar.spec, field, checks)
    return {"grammar": compiled, "grammar_field": field}


def check_sequences(request: web.Request, gens: list[Generation]) -> None:
    limit = request.app[ENGINE].max_queue
    if len(gens) > limit:
        raise ApiError(
            400,
            f"this request asks for {len(gens)} sequences (prompts x choices); the server queues at most {limit} "
            "(MAX_QUEUE)",
            field="n",
        )


async def v1_completions(request: web.Request) -> web.StreamResponse:
    params = await read_params(request, completions.SCHEMA, openai_params)
    name, adapter = model_named(request, params["model"])
    completions.check(params)
    gens = completions.generations(params, await grammar_options(request, *response_grammar(params), params))
    check_sequences(request, gens)
    tickets = await submit(request, gens, adapter, params["cache_salt"])
    texts = completions.texts(params, engine_ready(request).backend.decode)
    return await answer(request, tickets, completions.Answer(wire_context(request), tickets, params, name, texts))


# -- chat: one path for the three chat APIs -------------------------------------------------------
# Chat completions, Responses and Messages each translate their request onto one `ChatCall`
# (backends/wire/: openai_chat, responses, anthropic); the backend answers with one `ChatPlan`
# (backends/chat/plan.py: prompt, stops, grammar, kept tags, a parser per choice); one path
# submits it and answers through the API's Wire. Each API's module gives SCHEMA, check, translate
# and Answer (its Wire).


def wire_context(request: web.Request) -> Context:
    """What the wire formats read of this request (backends/wire/base.py)."""
    return Context(
        engine_ready(request).backend,
        request[REQUEST_ID],
        request[LOG_FACTS],
        namespace=request.get(CACHE_NAMESPACE, ""),
        on_call=request.get(ARGUMENT_CHECKS),
        store=request.app[RESPONSES],
    )


def chat_plan(backend: Backend, chat: ChatRequest) -> ChatPlan:
    """The model's plan for a chat; a chat its template cannot render is a 400 saying why."""
    try:
        return backend.chat_plan(chat)
    except ChatError as exc:
        raise ApiError(400, str(exc), field=exc.field) from None


def plan_of(request: web.Request, call: ChatCall) -> ChatPlan:
    """A translated chat's plan: its tools' calls to be checked, FIRST_TOOL_CHOICE, the server's
    template kwargs and thinking budget under the request's own."""
    settings = request.app[SETTINGS]
    use = first_tool_choice(call.tools, call.messages, settings.forces_first_tool_call, request[LOG_FACTS])
    options = template_options(call.reasoning, settings.template_kwargs, settings.thinking_budget)
    return chat_plan(engine_ready(request).backend, ChatRequest(call.messages, use, call.output, **options))


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


def check_arguments(request: web.Request, use: ToolUse | None) -> None:
    """`use`'s function tools' calls to be checked against their schemas (`ArgumentChecks`)."""
    schemas = {t["name"]: t["parameters"] for t in use.tools if t.get("parameters")} if use else {}
    if schemas:
        request[ARGUMENT_CHECKS] = ArgumentChecks(request, schemas)


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


async def chat_answer(request: web.Request, api) -> web.StreamResponse:
    """The one chat path: the API's body, its translation, the plan, the generations, the answer."""
    params = await read_params(request, api.SCHEMA, api.check)
    name, adapter = model_named(request, params["model"])
    call = api.translate(params, wire_context(request))
    check_arguments(request, call.tools)
    plan = plan_of(request, call)
    options = await chat_options(request, plan, call.stop, call.sampling["ignore_eos"], call.output_field)
    gens = openai_generations(
        call.sampling,
        plan.prompt,
        call.choices,
        call.max_tokens,
        CHAT_DEFAULT_MAX_TOKENS,
        logprobs=call.logprobs,
        prompt_field=call.prompt_field,
        **options,
    )
    check_sequences(request, gens)
    tickets = await submit(request, gens, adapter, params["cache_salt"])
    return await answer(request, tickets, api.Answer(wire_context(request), tickets, call, name, plan))


async def v1_chat_completions(request: web.Request) -> web.StreamResponse:
    return await chat_answer(request, openai_chat)


async def v1_responses(request: web.Request) -> web.StreamResponse:
    return await chat_answer(request, responses)


async def v1_messages(request: web.Request) -> web.StreamResponse:
    return await chat_answer(request, anthropic)


async def v1_count_tokens(request: web.Request) -> web.Response:
    """{input_tokens}: the prompt's tokens as /v1/messages would compute them."""
    params = await read_params(request, COUNT_TOKENS_SCHEMA)
    model_named(request, params["model"])
    backend = engine_ready(request).backend
    text = plan_of(request, anthropic.translate(params, wire_context(request))).prompt
    tokens = await asyncio.get_running_loop().run_in_executor(request.app[TOKENIZER_POOL], backend.encode, text)
    return web.json_response({"input_tokens": len(tokens)})


# -- OpenAI Responses API: stored answers, GET and DELETE /v1/responses/{id} ---------------------
# backends/wire/store.py keeps them, bounded and in memory; each API key sees only its own.


async def v1_response(request: web.Request) -> web.Response:
    found = stored(request.app[RESPONSES], request.get(CACHE_NAMESPACE, ""), request.match_info["response_id"])
    return web.Response(body=found.response_json, content_type="application/json")  # as kept


async def v1_delete_response(request: web.Request) -> web.Response:
    response_id, namespace = request.match_info["response_id"], request.get(CACHE_NAMESPACE, "")
    stored(request.app[RESPONSES], namespace, response_id)
    request.app[RESPONSES].delete(namespace, response_id)
    return web.json_response({"id": response_id, "object": "response", "deleted": True})


ANTHROPIC_PATHS = ("/v1/messages",)  # and what is under it: errors in Anthropic's shape


def is_anthropic(request: web.Request) -> bool:
    return request.path.startswith(ANTHROPIC_PATHS)


# -- tokenizer: /tokenize, /detokenize (vLLM's shapes) ------------------------------------------
# The ids a prompt or a chat is generated from, exactly as the generating routes tokenize it: a
# chat through the model's chat template with its generation prompt, and no special token added
# beyond what the template writes. llama.cpp's `content` is accepted for `prompt`. Errors come in
# OpenAI's shape, as vLLM's do.

TOKENIZER_PATHS = frozenset({"/tokenize", "/detokenize"})


async def tokenize(request: web.Request) -> web.Response:
    """{tokens, count, max_model_len} (and token_strs with return_token_strs), as vLLM answers."""
    params = await read_params(request, TOKENIZE_SCHEMA, tokenize_params)
    model_named(request, params["model"])
    backend = engine_ready(request).backend
    if params["messages"] is not None:
        as_chat = {"tools": params["tools"], "functions": None, "tool_choice": None, "function_call": None}
        use = chat_tools({**as_chat, "parallel_tool_calls": True})  # as chat renders them with tool_choice auto
        settings = request.app[SETTINGS]
        reasoning = Reasoning(params["chat_template_kwargs"], None, params["reasoning_effort"])
        options = template_options(reasoning, settings.template_kwargs, settings.thinking_budget)
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
    tokens = within_budget(items, "documents")
    scores = await run_encoder(request, "rerank", items)
    ranked = sorted(range(len(texts)), key=lambda i: -float(scores[i]))[: params["top_n"] or None]
    results = []
    for index in ranked:
        result: dict[str, Any] = {"index": index, "relevance_score": float(scores[index])}
        if params["return_documents"]:
            result["document"] = {"text": texts[index]}
        results.append(result)
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
IN_COMPLETIONS, IN_CHAT = "OpenAI-compatible API: /v1/completions", "chat: one path for the three chat APIs"
IN_RESPONSES, IN_MESSAGES, IN_TOKENIZER = IN_CHAT, IN_CHAT, "tokenizer"
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
        "auto_decompress": False,  # read_raw inflates a body off the loop, bounded (issue 65)
        "keepalive_timeout": app[SETTINGS].idle_timeout,  # also bounds a connection that never completes its headers
        "access_log_class": access_log_class,
        "access_log": HTTP_LOG,
        "logger": HTTP_LOG,
    }


# Connections the kernel completes before the server accepts them: aiohttp's 128 overflowed while
# the loop handed a step's stream ends over, and a dropped SYN is resent only after a second
# (docs/decisions.md, D-backlog). uvicorn and gunicorn use 2048 too; the kernel caps it at somaxconn.
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
            if settings.warm_prompts:
                poster = local_poster(app, settings.host, settings.port)
                await warm_prompts(settings.warm_prompts, poster, names_served(settings)[0])

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


# -- warm prompts (WARM_PROMPTS) -----------------------------------------------------------------

# The field that asks for one token, per route (a warm prompt's answer is not read).
ONE_TOKEN = {"/v1/responses": "max_output_tokens", "/v1/chat/completions": "max_completion_tokens"}


def warm_request(path: str, model: str) -> tuple[str, dict]:
    """The request WARM_PROMPTS' file `path` holds: a captured request's route and body (asking
    for one token, not streamed, of `model`: the name it was captured with may be another
    server's), or its text as a raw prompt on /generate."""
    text = Path(path).expanduser().read_text()
    try:
        captured = json.loads(text)
    except ValueError:
        captured = None
    if isinstance(captured, dict) and isinstance(captured.get("path"), str) and isinstance(captured.get("body"), dict):
        route = captured["path"].split("?")[0]
        body = {**captured["body"], "stream": False}
        if "model" in body:
            body["model"] = model
        body.pop("max_tokens", None)
        body[ONE_TOKEN.get(route, "max_tokens")] = 1
        return route, body
    return "/generate", {"prompt": text, "max_tokens": 1}


async def warm_prompts(files: str, post: Callable[[str, dict], Awaitable[tuple[int, dict]]], model: str) -> None:
    """Send each of WARM_PROMPTS' files (`post(route, body)` -> status, answer), one at a time, for
    the model named `model`; a file that fails is logged, never fatal."""
    for path in (part.strip() for part in files.split(",") if part.strip()):
        try:
            route, body = warm_request(path, model)
            status, answer = await post(route, body)
        except (OSError, aiohttp.ClientError, ValueError) as exc:
            log.warning("WARM_PROMPTS: %s not sent: %s", path, exc)
            continue
        if status == 200:
            usage = answer.get("usage") or {key: answer.get(key) for key in ("prompt_tokens", "cached_tokens")}
            log.info("WARM_PROMPTS: %s prefilled (%s %s)", path, route, json.dumps(usage)[:200])
        else:
            log.warning("WARM_PROMPTS: %s got %d: %s", path, status, json.dumps(answer)[:300])


def local_poster(app: web.Application, host: str, port: int):
    """post(route, body) to this server itself, with its first API key where it has any."""
    address = "127.0.0.1" if host in ("0.0.0.0", "") else "[::1]" if host == "::" else host
    headers = {"Authorization": f"Bearer {app[API_KEYS][0].decode()}"} if app[API_KEYS] else {}

    async def post(route: str, body: dict) -> tuple[int, dict]:
        timeout = aiohttp.ClientTimeout(total=None)
        async with aiohttp.ClientSession(timeout=timeout) as session:
            async with session.post(f"http://{address}:{port}{route}", json=body, headers=headers) as response:
                return response.status, await response.json(content_type=None)

    return post


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
    # default 5 ms hands it over sooner (measured within the spread: docs/decisions.md, D-switch-interval).
    sys.setswitchinterval(0.001)
    app[FAULTS] = faults = FaultLog(app[SETTINGS].log_dir)
    if faults.previous:
        log.warning("the last server process ended without shutting down (%s): %s", *faults.previous)
    try:
        return asyncio.run(serve(app))
    finally:
        faults.close()


if __name__ == "__main__":
    sys.exit(main())
