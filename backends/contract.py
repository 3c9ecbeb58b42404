"""The backend contract that both runtimes honour, and the choice between them.

A backend owns one loaded causal LM and its tokenizer. The server never touches a runtime
directly: it tokenizes and counts through `Backend`, and the generation worker
(`backends.workers.engine`) decodes through a `Decoder`, a token per sequence per step (or several, where
a prompt-lookup draft was accepted). Sampling
happens inside the runtime; detokenizing, stop sequences, limits and cancellation happen in
the worker, once for both runtimes.

Heavy imports (torch, mlx) happen only inside the runtime modules.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from backends.errors import ChatError, GrammarError, ModelLoadError  # noqa: F401  (part of the contract)

if TYPE_CHECKING:
    from pathlib import Path

    from backends.chat.plan import ChatPlan, ChatRequest
    from backends.files.adapters import Adapter, AdapterFacts


class Team(Protocol):
    """The calling thread's pool of compute threads (torch's OpenMP team: each thread has its
    own), which the two worker threads share a CPU's cores through (backends/workers/cores.py)."""

    def get(self) -> int: ...

    def set(self, threads: int) -> None: ...


class Constraint(Protocol):
    """One sequence's walk through a compiled grammar (backends.decoding.grammar.Matcher): it masks the
    tokens the grammar does not allow next. A sequence has its own; `Grammar.matcher()` makes
    one, off the generation thread (a large grammar's copy takes a while)."""

    error: str | None  # set once the grammar failed (its own reason): the engine ends that sequence alone

    def allowed_words(self): ...

    def consume(self, token: int) -> None: ...

    def constrains(self) -> bool:
        """Whether its mask is more than every token now (a lazy tool grammar: once armed); a
        decoder may then skip the mask for that step."""
        ...


class Grammar(Protocol):
    """A compiled grammar (backends.decoding.grammar): what every sequence constrained by it copies."""

    def matcher(self) -> Constraint: ...


@dataclass(frozen=True)
class Sampling:
    """How a sequence picks its next token. Both runtimes apply the same steps: a constraint's
    mask first, then in the order of transformers' `generate`: logit_bias, repetition_penalty
    (prompt and generated ids), then presence and frequency penalties (generated ids only, as
    OpenAI defines them); greedy takes the argmax of that; sampling divides by the temperature,
    then keeps top_k, top_p and min_p."""

    temperature: float = 0.0  # 0 means greedy
    top_p: float = 1.0
    seed: int | None = None
    top_k: int = 0  # 0: off
    min_p: float = 0.0  # 0: off
    repetition_penalty: float = 1.0  # 1: off; a logit l of a seen id becomes l / p if l > 0, else l * p
    presence_penalty: float = 0.0  # subtracted once from the logit of every id generated so far
    frequency_penalty: float = 0.0  # subtracted once per time an id was generated so far
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, added to its logit)
    # A grammar the text must follow (JSON Schema, JSON mode, regex), as this sequence's own
    # matcher: the tokens it does not allow next are masked out before every other step, so
    # only allowed tokens are chosen.
    constraint: Constraint | None = None

    @property
    def processed(self) -> bool:
        """Whether the logits change before the choice: if not, greedy is the raw argmax."""
        return self.processed_besides_constraint or self.constraint is not None

    @property
    def processed_besides_constraint(self) -> bool:
        return (
            bool(self.logit_bias)
            or self.repetition_penalty != 1.0
            or self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
        )

    @property
    def greedy(self) -> bool:
        # Below 1e-5 a temperature only overflows the scaled logits, and a top_p below 1e-6
        # rounds to 0 in float32 and drops every token: the limit of both is greedy anyway.
        return self.temperature < 1e-5 or self.top_p < 1e-6

    @property
    def scale(self) -> float:
        """1 / temperature, for sampling. Past 1e4 every token is as likely anyway, and a
        temperature beyond float32's range would turn the masked logits' -inf into NaN."""
        return 1.0 / min(self.temperature, 1e4)


MAX_LOGPROBS = 20  # the most alternatives a token may report (OpenAI's chat limit)


@dataclass(frozen=True)
class Sequence:
    """One generation as the decoder sees it."""

    id: int
    prompt_ids: list[int]
    sampling: Sampling
    max_new_tokens: int
    logprobs: int | None = None  # report each generated token's logprob and this many alternatives (None: nothing)
    prompt_logprobs: int | None = (
        None  # the same for every prompt token but the first (the prompt is then prefilled whole)
    )
    # The LoRA adapter this sequence decodes with (None: the base model), applied unmerged on its
    # rows of the batch; its prompt cache entries are its own.
    adapter: Adapter | None = None
    # Whose prompt cache entries it may reuse and add to: sequences of different namespaces (API
    # keys, cache salts) share none, so one client cannot learn another's prompts from cache hits.
    cache_namespace: str = ""


def prompt_cache_namespace(sequence: Sequence) -> str:
    """The part of a prompt cache a sequence's KV belongs to: its client's namespace, and in it
    its adapter's (KV computed with one adapter is of no use to another, or to the base model;
    adapter keys hold an '@', so no adapter is called "base")."""
    adapter = sequence.adapter.key if sequence.adapter is not None else "base"
    return f"{sequence.cache_namespace}/{adapter}"


@dataclass(frozen=True)
class TokenLogprob:
    """A token's log-probability under the model: the log-softmax of the raw logits in float32,
    over the whole model vocabulary, from the pass that chose it. Temperature, penalties,
    logit_bias and top_k/top_p/min_p do not apply (as vLLM's default: the model's own view)."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()  # the most likely ids at this position, most likely first


@dataclass(frozen=True)
class StepLogprobs:
    """What a decode step reports for a sequence that asked for logprobs."""

    token: TokenLogprob | None  # None only where the engine passes on a prompt's logprobs alone (max_tokens 0)
    prompt: tuple[TokenLogprob, ...] | None = None  # with the first token, if prompt logprobs were asked for


def mean_logprob(scores: list[StepLogprobs]) -> float:
    """A sequence's mean logprob a generated token: best_of's ranking (OpenAI: "the highest log
    probability per token"); -inf for a sequence without a token."""
    values = [s.token.logprob for s in scores if s.token is not None]
    return sum(values) / len(values) if values else -math.inf


@dataclass(frozen=True)
class ModelInfo:
    model: str
    backend: str
    device: str
    dtype: str
    context_length: int
    adapter_path: str | None = None
    adapter_applied: bool = False
    quantization: dict | None = None  # {method, bits, group_size} of quantized weights; None: full precision
    extra: dict = field(default_factory=dict)


class Detokenizer(Protocol):
    """Incremental decoding of one sequence's generated ids.

    The concatenation of everything `add` and `flush` return equals the plain decoding of
    all ids added (special tokens skipped); a character whose bytes span several tokens is
    returned only once complete, so no U+FFFD is ever emitted for it.
    """

    def add(self, token_id: int) -> str: ...

    def flush(self) -> str: ...


@dataclass(frozen=True)
class PromptCacheUsage:
    """What a decoder's prompt cache holds (all zero when it has none)."""

    budget_bytes: int = 0  # 0: prompt reuse is off
    bytes: int = 0
    entries: int = 0


@dataclass(frozen=True)
class KvCacheUsage:
    """What a decoder's KV cache (of the sequences decoding, not the prompt cache) takes."""

    budget_bytes: int = 0  # KV_CACHE_BYTES as applied (0: no budget; the runtime allocates as it goes)
    # None where the runtime does not count them (MLX: mlx-lm's caches grow by use, 256 positions
    # at a time, with no budget yet).
    used_bytes: int | None = None  # held by the decoding sequences now
    reserved_bytes: int | None = None  # what the active sequences may reach: prompt and max_tokens each
    peak_bytes: int | None = None  # the most it has allocated
    bytes_per_token: int | None = None  # keys and values of one position, every layer
    # A paged cache (the Torch batched decoder, backends/kv_pages): what its pool has allocated,
    # its block (page) size in positions, its blocks (the scratch block not counted) and those
    # that sequences hold.
    allocated_bytes: int | None = None
    block_tokens: int | None = None
    blocks: int | None = None
    blocks_used: int | None = None


class Decoder(Protocol):
    """The sequences a backend decodes together; lives on the generation thread only.

    A decoder keeps the KV of prompts (and of their generated text) it has computed, in its
    prompt cache, within a byte budget: a sequence whose prompt starts with ids it still holds
    prefills only the rest, and always at least its last token. Only a complete prefill is ever
    stored. The cache lives and dies with the decoder, so a decoder replaced after a failure
    reuses nothing of the old one's.
    """

    capacity: int  # how many sequences may be active at once
    adapter_slots: int  # how many distinct adapters its active sequences may use at once (the engine keeps to it)

    def add(self, sequence: Sequence) -> int:
        """Start a sequence; returns how many of its prompt ids came from the prompt cache."""
        ...

    def step(self) -> dict[int, list[int]]:
        """Advance every active sequence: {sequence id: its new token ids, in order}.

        Mostly one token each. A sequence whose prompt is still being prefilled may have none
        yet (absent: a batch prefills a joining prompt over the next steps while the others keep
        decoding); one whose prompt-lookup draft the model accepted gets several (speculative
        decoding, `backends.decoding.drafts`: the same tokens as one a step). The engine ends a
        sequence within a step's tokens as it would between steps; whatever follows is dropped.
        Sequences that asked for logprobs get one token a step and find its logprobs in
        `logprobs` until the next step.
        """
        ...

    logprobs: dict[int, StepLogprobs]  # of the last step: {sequence id: its logprobs}, for those that asked

    def remove(self, *sequence_ids: int) -> None:
        """Forget these sequences (ids it does not hold are ignored). The engine removes those
        that ended in one step with one call, so a decoder may rearrange its rows once."""
        ...

    def fits(self, needs: list[int]) -> bool:
        """Whether new sequences that may reach `needs` positions each (prompt and max_new_tokens)
        fit beside the active ones: in `capacity`, and in the KV budget where there is one. The
        engine keeps a request waiting (in arrival order) until it fits; the served context
        guarantees that any one sequence fits alone."""
        ...

    def prompt_cache_usage(self) -> PromptCacheUsage: ...

    def kv_cache_usage(self) -> KvCacheUsage: ...


class Adapters(Protocol):
    """The LoRA adapters a backend offers requests, as the HTTP layer sees them
    (`backends.files.adapters.AdapterRegistry` is the one implementation, shared by both runtimes)."""

    directory: Path | None  # ADAPTERS_DIR: its folders are adapters requests choose by name
    default_name: str | None  # ADAPTER_PATH's folder name: the adapter of requests that name none
    max_loaded: int  # adapters held loaded at once (MAX_ADAPTERS), least recently used dropped

    def available(self) -> list[AdapterFacts]:
        """Every adapter there is now (ADAPTERS_DIR read again), the default first. Reads files."""
        ...

    def loaded(self) -> list[str]:
        """The names of the adapters loaded now, least recently used first."""
        ...

    def get(self, name: str) -> Adapter:
        """The adapter `name`, loaded if it is not (reads files); raises `UnknownAdapter` for a
        name there is none of, `AdapterError` for a broken one or a name that leads elsewhere."""
        ...


class Backend(Protocol):
    info: ModelInfo
    eos_token_ids: frozenset[int]
    max_batch: int  # the batch size its decoder serves (MAX_BATCH, or the runtime's default)
    adapters: Adapters  # the LoRA adapters requests may name, loaded on first use

    def encode(self, text: str) -> list[int]: ...

    def decode(self, token_ids: list[int]) -> str: ...

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes one token stands for (logprobs show tokens one by one)."""
        ...

    @property
    def vocab_size(self) -> int:
        """Ids the tokenizer knows: token-id prompts and logit_bias may use these (the model's
        vocabulary may be larger; its extra ids are never generated)."""
        ...

    def reasons(self) -> bool:
        """Whether the model writes a thought first (<think> tags in its vocabulary): /v1/models
        says so among its capabilities."""
        ...

    def chat_plan(self, chat: ChatRequest) -> ChatPlan:
        """One chat as this model serves it (backends.chat.plan), for every chat API alike: the
        prompt its chat template renders (tools in it, or the default tools block where it knows
        none), the stops its format needs, the grammar of its calls or of the response format,
        the tags the reply keeps, and a parser per choice (content, reasoning, calls)."""
        ...

    # PROMPT_LOOKUP_TOKENS as applied: the most prompt-lookup draft tokens a step verifies while
    # one sequence decodes (backends.decoding.drafts; 0: off).
    draft_tokens: int

    def constraint(self, kind: str, spec: str, owner: str = "") -> Grammar:
        """A grammar for this model's tokenizer: kind `json_schema` (spec: the schema as JSON),
        `json_object` (any JSON object), `regex` or `tool_calls` (spec: a ChatPlan's grammar).
        Compiled once (cached for `owner`, an API key); GrammarError if not, or if compiling it
        crashes, runs out of time or memory (backends.decoding.guard).
        Slow for a large grammar (seconds): call it on a pool, never on the event loop."""
        ...

    def cached_constraint(self, kind: str, spec: str, owner: str = "") -> Grammar | None:
        """The grammar if `constraint` compiled it before and still holds it, else None; cheap."""
        ...

    def constraints_ready(self) -> bool:
        """Whether `prepare_constraints` ran (cheap)."""
        ...

    def prepare_constraints(self) -> None:
        """The set-up of the first grammar, once: the compiler's view of the tokenizer, the
        guard's first child. Seconds; on a pool, like `constraint`."""
        ...

    def detokenizer(self) -> Detokenizer: ...

    def decoder(self, max_batch: int = 1, prompt_cache_bytes: int | None = None) -> Decoder:
        """A decoder for up to `max_batch` sequences at once (fewer if the runtime cannot batch),
        with a prompt cache of `prompt_cache_bytes` (None: the device's default; 0: none)."""
        ...


@dataclass(frozen=True)
class LoadOptions:
    """What a runtime needs to load a model (from the server's settings)."""

    model: str
    adapter_path: str | None = None
    adapter_path_is_default: bool = False  # absent is then normal: said at info level, not warned
    device: str = "auto"
    dtype: str = "auto"
    max_batch: int = 0  # sequences per decode step; 0: the runtime's default (CUDA graphs are captured for it)
    adapters_dir: str | None = None  # a folder of mlx-lm adapter folders, chosen per request by name
    max_adapters: int = 8  # adapters held loaded (LRU), and distinct adapters decoding at once
    compile: bool | None = None  # torch.compile the Phi fast path's step; None: on CUDA only
    quantize: str = ""  # PHI2_QUANTIZE: quantize the weights at load (each runtime says which values it takes)
    quantized_cache: bool = True  # QUANTIZED_CACHE, Torch: store them once, map them at the next start
    max_context: int = 0  # MAX_MODEL_LEN: the most tokens of context served (0: the model's own window)
    kv_cache_bytes: int = 0  # KV_CACHE_BYTES: the decoding sequences' KV budget (0: from the free memory)
    # PROMPT_LOOKUP_TOKENS: the most draft tokens a step verifies while one sequence decodes
    # (backends.decoding.drafts); -1: the runtime's default (where it pays), 0: off.
    prompt_lookup_tokens: int = -1
    prompt_cache_bytes: int | None = None  # PROMPT_CACHE_BYTES as the decoder gets it (the KV budget leaves it room)
    prompt_cache_dir: str = ""  # PROMPT_CACHE_DIR: the prompt cache's files (Torch; empty: memory only)
    prompt_cache_disk_bytes: int = 0  # PROMPT_CACHE_DISK_BYTES: their budget
    warmup: bool = True
    # Torch on a CPU: time a PHI2_QUANTIZE method against the float default at start-up and refuse
    # it where decoding would be slower (backends/torch/quant/check.py); off for quality measurements.
    speed_check: bool = True


GiB = 1 << 30


def default_prompt_cache_bytes(device_memory: int, on_gpu: bool) -> int:
    """The prompt cache's budget when PROMPT_CACHE_BYTES is not set: an eighth of the memory the
    model runs in (RAM, a Mac's unified memory, or the GPU's), at most 2 GiB on a CPU or a Mac
    and 8 GiB on a GPU. Phi-2's KV takes 320 KiB a token in 16 bits: 2 GiB hold ~6,500 tokens."""
    return min(device_memory // 8, (8 if on_gpu else 2) * GiB)


# Of the memory still available once the weights are loaded, and after the prompt cache's
# budget, what the KV cache of decoding sequences may take by default on a CPU: the rest is for
# activations (a prefill chunk's, the logits), the allocator and the rest of the machine.
KV_SHARE_OF_AVAILABLE = 0.75


def default_kv_cache_bytes(available: int, prompt_cache_bytes: int) -> int:
    """The KV budget when KV_CACHE_BYTES is not set, on a CPU: 3/4 of the memory available
    after the weights, less the prompt cache's budget."""
    return max(int(KV_SHARE_OF_AVAILABLE * (available - prompt_cache_bytes)), 0)


def available_memory() -> int:
    """Bytes this process may still take: Linux's MemAvailable, and less where a cgroup (a
    container's memory limit) allows less; elsewhere half the RAM."""
    try:
        with open("/proc/meminfo") as meminfo:
            fields = dict(line.split(":", 1) for line in meminfo)
        available = int(fields["MemAvailable"].split()[0]) * 1024
    except (OSError, KeyError, ValueError):
        return physical_memory() // 2
    try:
        with open("/sys/fs/cgroup/memory.max") as limit, open("/sys/fs/cgroup/memory.current") as current:
            cap = limit.read().strip()
            if cap != "max":
                available = min(available, int(cap) - int(current.read()))
    except (OSError, ValueError):
        pass
    return max(available, 0)


def physical_memory() -> int:
    """This machine's RAM in bytes (Linux and macOS)."""
    import os

    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
