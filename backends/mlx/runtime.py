"""MLX runtime (mlx-lm): Metal on Apple Silicon; on Linux the CPU build runs the same code.

One sequence at a time steps mlx-lm's `generate_step`; several share one running batch of
mlx-lm's `BatchGenerator` (continuous batching: sequences join and leave between steps).
A sequence's LoRA adapter is applied to its own rows only (backends.mlx.lora): its ids go into
the model offset by its adapter slot, and come back out of the sampler offset the same way.
"""

from __future__ import annotations

import copy
import json
import logging
from collections.abc import Callable
from pathlib import Path

import mlx.core as mx
from mlx.utils import tree_flatten
from mlx_lm import load as mlx_load
from mlx_lm.generate import BatchGenerator, generate_step
from mlx_lm.models.cache import (
    LRUPromptCache,
    RotatingKVCache,
    can_trim_prompt_cache,
    make_prompt_cache,
    trim_prompt_cache,
)
from mlx_lm.tokenizer_utils import BPEStreamingDetokenizer
from mlx_lm.utils import quantize_model

from backends.contract import (
    KvCacheUsage,
    LoadOptions,
    ModelInfo,
    ModelLoadError,
    PromptCacheUsage,
    Sampling,
    Sequence,
    StepLogprobs,
    TokenLogprob,
    default_prompt_cache_bytes,
    physical_memory,
    prompt_cache_namespace,
)
from backends.decoding.drafts import DEFAULT_DRAFT_TOKENS, applied_draft_tokens, speculates
from backends.decoding.grammar import Grammars
from backends.decoding.guard import CompileGuard
from backends.decoding.text import TokenizerMethods, TokenizerText
from backends.files.adapters import AdapterRegistry, find_adapter
from backends.files.models import gguf_file, is_random
from backends.mlx import gguf_direct
from backends.mlx.drafts import LookupGeneration
from backends.mlx.gguf import keep_file_blocks
from backends.mlx.logprobs import token_logprobs
from backends.mlx.lora import (
    Router,
    SlotBank,
    block_linears,
    install_router,
    load_adapter_tensors,
    routed_sampler,
)
from backends.mlx.sampling import logits_processors, make_sampler

log = logging.getLogger("phi2_server.mlx")


# Prompt tokens prefilled per step: a long prompt joining the batch is processed over several
# steps, each also decoding one token for the running sequences, so they do not stall for
# the whole prefill.
PREFILL_STEP = 512


class MlxDetokenizer:
    """mlx-lm's streaming detokenizer, held to the server's one text convention.

    The text is the plain decoding of the generated ids: mlx-lm's BPE detokenizer drops the
    first segment's leading space (transformers' decode keeps it), so it starts primed as if
    text had been emitted; special tokens are skipped, as `skip_special_tokens` does.
    """

    def __init__(self, detokenizer, skipped: frozenset[int]):
        self._detokenizer = detokenizer
        self._skipped = skipped
        self._primed = isinstance(detokenizer, BPEStreamingDetokenizer)
        if self._primed:
            detokenizer.text = " "  # non-empty: no space is trimmed; sliced off below
        self._emitted = len(detokenizer.text)

    def add(self, token_id: int) -> str:
        if token_id in self._skipped:
            return ""
        self._detokenizer.add_token(token_id)
        return self._new_text()

    def flush(self) -> str:
        self._detokenizer.finalize()
        return self._new_text()

    def _new_text(self) -> str:
        text = self._detokenizer.text
        piece = text[self._emitted :]
        self._emitted = len(text)
        return piece


class MlxBackend(TokenizerMethods):
    name = "mlx"

    def __init__(
        self,
        model,
        tokenizer,
        info: ModelInfo,
        adapters: AdapterRegistry,
        router: Router,
        max_batch: int = 1,
        max_adapters: int = 8,
        draft_tokens: int = 0,
    ):
        self.model = model
        self.draft_tokens = draft_tokens  # prompt-lookup draft tokens a step verifies while one sequence decodes
        self.tokenizer = tokenizer  # mlx-lm's TokenizerWrapper
        hf = wrapped_tokenizer(tokenizer)
        self.text = TokenizerText(hf)
        self.info = info
        self.max_batch = max_batch
        self.adapters = adapters
        self.max_adapters = max(max_adapters, 1)  # distinct adapters a batch decodes at once
        self.router = router
        self.eos_token_ids = frozenset(tokenizer.eos_token_ids) | self.text.turn_end_ids()
        self._skipped = frozenset(hf.all_special_ids) | frozenset(range(len(hf), self._model_vocab()))
        # Phi-2's model vocabulary exceeds its tokenizer's: the ids past it decode to nothing and
        # are never chosen (the samplers' rule, as on Torch); logprobs still cover them.
        self.decodable = self.text.vocab_size
        self.grammars = Grammars(hf, self._model_vocab(), guard=CompileGuard, ends=sorted(self.eos_token_ids))

    @classmethod
    def load(cls, path: Path, options: LoadOptions) -> MlxBackend:
        default_adapter = find_adapter(options.adapter_path, options.adapter_path_is_default)
        bits = quantize_bits(options.quantize)
        # A GGUF file's blocks are served as it stores them, unless PHI2_QUANTIZE asks otherwise
        # (`none`: all of it dequantized, as converted): built from the file (gguf_direct.py), or
        # for Phi-2's files its Q4_0, Q4_1 and Q8_0 matrices over the converted checkpoint.
        source = gguf_file(options.model) if not options.quantize else None
        kept = None
        try:
            if gguf_direct.applies(source, options.quantize):
                overrides = published_rope_fields(json.loads((path / "config.json").read_text()))
                model, tokenizer, config, kept = gguf_direct.load(source, path, overrides)
            elif is_random(options.model):
                model, tokenizer = random_model(path, options.dtype)
                config = json.loads((path / "config.json").read_text())
            else:
                # lazy where the file's blocks may replace the float matrices: those are never read
                overrides = published_rope_fields(json.loads((path / "config.json").read_text()))
                model, tokenizer, config = mlx_load(
                    str(path), model_config=overrides, return_config=True, lazy=source is not None
                )
                if source is not None:
                    kept = keep_file_blocks(model, source, config)
                    mx.eval(model.parameters())
        except (ValueError, KeyError, FileNotFoundError) as exc:
            raise ModelLoadError(f"PHI2_MODEL={options.model!r} could not be loaded by mlx-lm: {exc}") from exc
        if bits:
            if "quantization" in config:
                raise ModelLoadError(
                    f"PHI2_MODEL={options.model!r} is already quantized "
                    f"({config['quantization'].get('bits')}-bit): leave PHI2_QUANTIZE unset"
                )
            # mlx-lm's own quantization, as `mlx_lm.convert -q` does (group size 64, affine).
            model, config = quantize_model(model, config, group_size=None, bits=bits)
        # Adapters stay unmerged, over the (quantized) linears, applied per sequence; the
        # ADAPTER_PATH one is the default of requests that name none (the server's choice).
        adapters = AdapterRegistry(
            options.adapters_dir,
            default_adapter,
            load_tensors=load_adapter_tensors,
            linears=block_linears(model),
            blocks=len(model.layers),
            max_loaded=options.max_adapters,
        )
        adapters.load_default()  # a broken one fails the start, not a request
        # One token through the model on this thread: arrays a model makes lazily outside its
        # parameters (Gemma 4's rotary frequencies) are computed now, not left to this thread's
        # stream, which the generation thread cannot use (a server loads there; tests do not).
        mx.eval(model(mx.array([[0]])))
        router = install_router(model)
        info = ModelInfo(
            model=options.model,
            backend=cls.name,
            device=mx.default_device().type.name,  # gpu (Metal) or cpu
            dtype=_weights_dtype(model),
            quantization=kept or _quantization(config),
            context_length=min(int(config.get("max_position_embeddings") or 2048), options.max_context or 1 << 62),
            adapter_path=options.adapter_path,
            adapter_applied=default_adapter is not None,
            extra={
                "parameters": sum(v.size for _, v in tree_flatten(model.parameters())),
                "weight_bytes": sum(v.nbytes for _, v in tree_flatten(model.parameters())),
            },
        )
        backend = cls(
            model,
            tokenizer,
            info,
            adapters,
            router,
            max_batch=options.max_batch or 8,
            max_adapters=options.max_adapters,
            # A Mac's batch-1 step streams every weight for one token, as a CPU's does.
            draft_tokens=applied_draft_tokens(options.prompt_lookup_tokens, DEFAULT_DRAFT_TOKENS),
        )
        if options.warmup:
            backend.warm_up()  # the first request should not pay for kernel compilation
        return backend

    def detokenizer(self) -> MlxDetokenizer:
        return MlxDetokenizer(self.tokenizer.detokenizer, self._skipped)

    def decoder(
        self, max_batch: int = 1, prompt_cache_bytes: int | None = None
    ) -> SingleSequenceDecoder | BatchDecoder:
        if prompt_cache_bytes is None:  # a Mac's memory is unified: RAM is what the model runs in
            prompt_cache_bytes = default_prompt_cache_bytes(physical_memory(), on_gpu=False)
        if max_batch > 1:
            return BatchDecoder(self, max_batch, prompt_cache_bytes=prompt_cache_bytes)
        return SingleSequenceDecoder(self, prompt_cache_bytes)

    def warm_up(self) -> None:
        """A few steps through each decoder, so the first request pays for no kernel builds."""
        from backends.decoding.drive import drive

        prompt = self.encode("Hello") or [0]
        for decoder in (self.decoder(1), self.decoder(2)):
            drive(decoder, [Sequence(i, prompt, Sampling(), 4) for i in range(decoder.capacity)])

    def _model_vocab(self) -> int:
        head = getattr(self.model, "lm_head", None)
        weight = getattr(head, "weight", None)
        return int(weight.shape[0]) if weight is not None else self.text.vocab_size

    def slot_bank(self, size: int) -> SlotBank:
        """Adapter slots for a decoder: `size` adapters at once, over this backend's model."""
        return SlotBank(self.model, self.router, size)

    def lookup_generation(
        self,
        sequence: Sequence,
        cache: list,
        rest: list[int],
        bank: SlotBank,
        slot: int | None,
        prefill_step: int = PREFILL_STEP,
    ) -> LookupGeneration | None:
        """A sequence's generation with prompt-lookup drafts, if it takes them (None: it does not,
        or its cache cannot drop rejected positions)."""
        if not (self.draft_tokens and speculates(sequence) and drops_rejected(cache)):
            return None
        offset = self.router.offset(slot)
        return LookupGeneration(
            self.model,
            self.router,
            bank,
            sequence,
            cache,
            rest,
            offset,
            decodable=self.decodable,
            draft_tokens=self.draft_tokens,
            prefill_step=prefill_step,
        )

    def generation(self, prompt: list[int], sequence: Sequence, cache: list, offset: int = 0):
        """mlx-lm's own token generator for one sequence: `prompt` is what `cache` lacks of it;
        its ids go in, and come out, offset by its adapter slot's `offset`."""
        sampler, processors = self.sampler(sequence, offset)
        return generate_step(
            mx.array(prompt) + offset,
            self.model,
            max_tokens=sequence.max_new_tokens,
            sampler=sampler,
            logits_processors=processors,
            prompt_cache=cache,
        )

    def sampler(self, sequence: Sequence, offset: int = 0) -> tuple[Callable, list]:
        """A sequence's sampler, its choices offset by `offset`, and the logits processors it needs."""
        sampler = make_sampler(sequence.sampling, sequence.prompt_ids, self.decodable)
        return routed_sampler(sampler, offset), logits_processors(sampler)

    def start(
        self, sequence: Sequence, prompts: PromptReuse, offset: int = 0
    ) -> tuple[list | None, list[int], tuple[TokenLogprob, ...] | None]:
        """Where a sequence starts: a cache holding part of its prompt (or None), the ids left to
        prefill (plain), and its prompt's logprobs if it asked for them.

        A stored prefix comes from `prompts`; a prompt whose logprobs are asked for is prefilled
        here instead, all but its last id, keeping the logits of every position (mlx-lm's
        generators keep none). The model sees the ids offset by `offset`: call this with the
        sequence's slot bank in use."""
        prompt = sequence.prompt_ids
        if sequence.prompt_logprobs is None:
            return *prompts.fetch(prompt, prompt_cache_namespace(sequence)), None
        if len(prompt) < 2:
            return None, prompt, ()
        cache = make_prompt_cache(self.model)
        scores = []
        for start in range(0, len(prompt) - 1, PREFILL_STEP):
            piece = prompt[start : min(start + PREFILL_STEP, len(prompt) - 1)]
            logits = self.model(mx.array(piece)[None] + offset, cache=cache)[0]
            scores += token_logprobs(logits, prompt[start + 1 : start + 1 + len(piece)], sequence.prompt_logprobs)
        return cache, prompt[-1:], tuple(scores)


def wrapped_tokenizer(wrapper):
    """The Hugging Face tokenizer inside mlx-lm's TokenizerWrapper.

    The wrapper forwards attribute reads to it but has no public accessor for the object itself,
    which the shared tokenizer code needs (its length, its Rust backend for DecodeStream). This
    is the one place that reads the private attribute.
    """
    return wrapper._tokenizer


def random_model(path: Path, dtype: str):
    """The architecture in `path`/config.json with MLX's random initialization."""
    from mlx_lm.utils import load_model, load_tokenizer

    config = json.loads((path / "config.json").read_text())
    model, _ = load_model(path, strict=False)  # no weight files: the layers keep their initial values
    if dtype == "auto":  # Metal runs half precision well; the CPU build float32
        dtype = "float16" if mx.default_device().type == mx.DeviceType.gpu else "float32"
    model.set_dtype(getattr(mx, dtype))
    mx.eval(model.parameters())
    return model, load_tokenizer(path, eos_token_ids=config.get("eos_token_id"))


def _weights_dtype(model) -> str:
    """The floating dtype the model computes in (of its full-precision weights, or its
    quantized weights' scales)."""
    for _, value in tree_flatten(model.parameters()):
        if mx.issubdtype(value.dtype, mx.floating):
            return str(value.dtype).removeprefix("mlx.core.")
    return "unknown"


QUANTIZE_BITS = ("4", "8")


def quantize_bits(requested: str) -> int:
    """PHI2_QUANTIZE on MLX: 4 or 8 bits (mlx-lm's affine quantization), or off."""
    if requested in ("", "none", "0"):
        return 0
    if requested not in QUANTIZE_BITS:
        raise ModelLoadError(
            f"PHI2_QUANTIZE must be one of {', '.join(QUANTIZE_BITS)} (or empty) on the MLX backend, not {requested!r}"
        )
    return int(requested)


def _quantization(config: dict) -> dict | None:
    quantization = config.get("quantization")
    if not quantization:
        return None
    return {
        "method": f"mlx-{quantization.get('mode', 'affine')}",
        "bits": quantization.get("bits"),
        "group_size": quantization.get("group_size"),
    }


# Entries of a prompt cache: the byte budget is what bounds it; this only bounds the trie's size.
PROMPT_CACHE_ENTRIES = 256


def drops_rejected(cache: list) -> bool:
    """Whether a draft's rejected positions can always be trimmed off this cache: not where a
    layer keeps a sliding window (Gemma 3's RotatingKVCache), which mlx-lm trims only until it
    first fills (then `trim_prompt_cache` does nothing, and the rejected keys stayed)."""
    return can_trim_prompt_cache(cache) and not any(isinstance(c, RotatingKVCache) for c in cache)


# transformers' text-only model types whose mlx-lm model is the multimodal one's (which reads a
# config without text_config as the text model's own).
MLX_MODEL_TYPES = {"qwen3_5_text": "qwen3_5"}


def published_rope_fields(config: dict) -> dict:
    """The fields of a config.json as mlx-lm's models read them (rope_theta, rope_scaling; Gemma
    3's rope_local_base_freq and sliding_window_pattern; Gemma 4's global_head_dim; a model type
    by mlx-lm's name), where transformers 5 wrote them otherwise (`rope_parameters`,
    `layer_types`, `per_layer_config`: a checkpoint it saved): mlx-lm would take its defaults
    (SmolLM3's rope_theta 10,000 for 2,000,000). Empty where the published fields are there."""
    fields = {}
    per_layer = config.get("per_layer_config") or {}
    if "global_head_dim" not in config and per_layer:  # Gemma 4: its global layers' head, per layer
        types = config.get("layer_types") or []
        dims = {
            per_layer[i].get("head_dim") for i in per_layer if int(i) < len(types) and types[int(i)] == "full_attention"
        }
        if len(dims) == 1 and None not in dims:
            fields["global_head_dim"] = dims.pop()
    if config.get("model_type") in MLX_MODEL_TYPES:  # a text-only model type mlx-lm knows by another name
        fields["model_type"] = MLX_MODEL_TYPES[config["model_type"]]
    rope = config.get("rope_parameters")
    if "rope_theta" in config or not isinstance(rope, dict):
        return fields
    if isinstance(rope.get("full_attention"), dict):  # Gemma 3: {layer type: its parameters}
        local = rope.get("sliding_attention") or {}
        if "rope_theta" in local:
            fields["rope_local_base_freq"] = local["rope_theta"]
        rope = rope["full_attention"]
        types = config.get("layer_types") or []
        if "full_attention" in types and "sliding_window_pattern" not in config:
            pattern = types.index("full_attention") + 1
            if all((kind == "full_attention") == ((i + 1) % pattern == 0) for i, kind in enumerate(types)):
                fields["sliding_window_pattern"] = pattern
    if "rope_theta" in rope:
        fields["rope_theta"] = rope["rope_theta"]
    if rope.get("rope_type", "default") != "default" and "rope_scaling" not in config:
        scaling = {key: value for key, value in rope.items() if key != "rope_theta"}
        fields["rope_scaling"] = {**scaling, "type": rope["rope_type"]}  # (older models read "type")
    return fields


class PromptReuse:
    """mlx-lm's own prompt cache (`LRUPromptCache`: a trie of token ids, least recently used
    out first, within a byte budget), as both MLX decoders use it.

    Its "model" key is the sequence's namespace (`prompt_cache_namespace`: its client's, and its
    adapter's), so no adapter or client reuses another's KV;
    its ids are plain (not offset by a slot), so an adapter's entries serve it in any slot."""

    def __init__(self, budget_bytes: int):
        self.budget_bytes = budget_bytes
        self._lru = LRUPromptCache(max_size=PROMPT_CACHE_ENTRIES, max_bytes=budget_bytes) if budget_bytes > 0 else None

    def fetch(self, prompt: list[int], key: str) -> tuple[list | None, list[int]]:
        """A cache holding the longest stored prefix of `prompt` (a copy), and the ids left to
        prefill: always at least the last one, whose logits give the first token."""
        if self._lru is None:
            return None, prompt
        cache, rest = self._lru.fetch_nearest_cache(key, prompt)
        if cache is not None and not rest:  # all of it is stored
            if not can_trim_prompt_cache(cache):
                return None, prompt
            trim_prompt_cache(cache, 1)
            rest = prompt[-1:]
        return cache, list(rest)

    def store(self, tokens: list[int], cache: list, key: str) -> None:
        """Keep a cache holding exactly `tokens`; one larger than the whole budget is not kept
        (mlx-lm would evict every other entry before dropping it).

        The cache is evaluated first: one that BatchGenerator extracted from its batch is lazy
        (a copy of one row, not made yet), and would keep the whole batch's buffers alive while
        it waits here, eight times or more the bytes the budget counts (measured, issue 25's soak)."""
        if self._lru is not None and tokens and sum(c.nbytes for c in cache) <= self.budget_bytes:
            mx.eval([c.state for c in cache])
            self._lru.insert_cache(key, list(tokens), cache)

    def usage(self) -> PromptCacheUsage:
        if self._lru is None:
            return PromptCacheUsage()
        return PromptCacheUsage(self.budget_bytes, self._lru.nbytes, len(self._lru))


class SingleSequenceDecoder:
    """Steps mlx-lm's `generate_step` for one sequence at a time."""

    capacity = 1
    adapter_slots = 1  # one sequence, so one adapter, at a time

    def __init__(self, backend: MlxBackend, prompt_cache_bytes: int = 0):
        self._backend = backend
        self._router = backend.router
        self._bank = backend.slot_bank(self.adapter_slots)
        self._sequence: Sequence | None = None
        self._slot: int | None = None
        self._tokens = None  # mlx-lm's generate_step, or
        self._drafted: LookupGeneration | None = None  # for a sequence that takes prompt-lookup drafts
        self._prompts = PromptReuse(prompt_cache_bytes)
        self.logprobs: dict[int, StepLogprobs] = {}

    def prompt_cache_usage(self) -> PromptCacheUsage:
        return self._prompts.usage()

    def fits(self, needs: list[int]) -> bool:
        return self._sequence is None and len(needs) <= 1

    def kv_cache_usage(self) -> KvCacheUsage:
        return KvCacheUsage()  # mlx-lm's cache grows by use; not counted (backends.KvCacheUsage)

    def add(self, sequence: Sequence) -> int:
        if self._sequence is not None:
            self.remove(self._sequence.id)
        slot = self._bank.acquire(sequence.adapter)
        offset = self._router.offset(slot)
        try:
            with self._router.using(self._bank):
                cache, rest, prompt_scores = self._backend.start(sequence, self._prompts, offset)
            cache = cache if cache is not None else make_prompt_cache(self._backend.model)
            drafted = self._backend.lookup_generation(sequence, cache, rest, self._bank, slot)
            tokens = self._backend.generation(rest, sequence, cache, offset) if drafted is None else None
        except BaseException:  # the engine removes no sequence it could not add
            self._bank.release(slot)
            raise
        self._sequence, self._slot, self._cache, self._tokens = sequence, slot, cache, tokens
        self._drafted = drafted
        self._prompt_scores = prompt_scores
        self._ids = list(sequence.prompt_ids)  # then the generated ones (plain, as the prompt cache keeps them)
        return len(sequence.prompt_ids) - len(rest) if prompt_scores is None else 0

    def step(self) -> dict[int, list[int]]:
        self.logprobs = {}
        sequence = self._sequence
        if sequence is None:
            return {}
        if self._drafted is not None:
            tokens = self._drafted.step()
            self._ids += tokens
            return {sequence.id: tokens} if tokens else {}
        with self._router.using(self._bank):
            token, logprobs = next(self._tokens)
        token = int(token) % self._router.vocab
        self._ids.append(token)
        if sequence.logprobs is not None:
            (score,) = token_logprobs(logprobs[None], [token], sequence.logprobs)
            prompt, self._prompt_scores = self._prompt_scores, None
            self.logprobs[sequence.id] = StepLogprobs(score, prompt)
        return {sequence.id: [token]}

    def remove(self, *sequence_ids: int) -> None:
        for sequence_id in sequence_ids:
            self._remove(sequence_id)

    def _remove(self, sequence_id: int) -> None:
        if self._sequence is not None and self._sequence.id == sequence_id:
            # Close the generator here, on the generation thread: it holds an MLX stream
            # context that must not be torn down by the garbage collector on another thread.
            if self._tokens is not None:
                self._tokens.close()
            if len(self._ids) > len(
                self._sequence.prompt_ids
            ):  # its prefill completed; generate_step fed every token it gave
                # the positions the cache holds, as a KV layer counts them (Qwen3.5's linear
                # layers keep a state, no count: the entry serves prompts that extend all of it)
                held = next((c.offset for c in self._cache if hasattr(c, "offset")), None)
                if held is not None:
                    self._prompts.store(self._ids[:held], self._cache, prompt_cache_namespace(self._sequence))
            self._bank.release(self._slot)
            self._sequence = None
            self._slot = None
            self._tokens = None
            self._drafted = None
            self._cache = None


class BatchDecoder:
    """Up to `capacity` sequences in one running batch of mlx-lm's `BatchGenerator`.

    BatchGenerator pipelines: a step returns the tokens sampled in the previous step while
    the next ones compute, and a newly inserted prompt is prefilled in the steps after its
    insertion, so its first token comes a step or two later (`step()` omits it until then).
    The engine alone decides when a sequence ends (end-of-text, stop strings, limits,
    cancellation) and calls `remove`: BatchGenerator gets no stop tokens, and its length
    limit equals the engine's, so at that limit it still returns the last token and drops
    the sequence itself; the engine's `remove` then finds nothing left to do.

    Prompt reuse follows mlx-lm's server: a stored prefix goes in with the sequence
    (`insert(caches=...)`); a prompt's cache is stored once its prefill is complete (all but
    its last token, BatchGenerator's end of the first segment), and again with the generated
    ids when the sequence ends.

    Sequences of up to `adapter_slots` distinct adapters share the batch, each in a slot of the
    decoder's bank: BatchGenerator holds their ids offset by their slot (mlx_lora), which the
    decoder takes off again for the engine and the prompt cache.

    A sequence that joins an empty decoder and takes prompt-lookup drafts decodes alone, outside
    BatchGenerator (`_Solo`, backends/mlx_lookup), until another joins: it then goes into the
    batch with its cache, as a stored prefix would, and the rest of its tokens come from there.
    """

    def __init__(
        self, backend: MlxBackend, capacity: int, prefill_step: int = PREFILL_STEP, prompt_cache_bytes: int = 0
    ):
        self.capacity = capacity
        self.adapter_slots = backend.max_adapters
        self._backend = backend
        self._router = backend.router
        self._bank = backend.slot_bank(self.adapter_slots)
        self._prefill_step = prefill_step
        self._generator: BatchGenerator | None = None
        self._uids: dict[int, int] = {}  # sequence id -> BatchGenerator uid
        self._ids: dict[int, int] = {}  # BatchGenerator uid -> sequence id
        self._generating: set[int] = set()  # uids past their prefill
        self._prompts = PromptReuse(prompt_cache_bytes)
        self._sequences: dict[int, Sequence] = {}  # uid -> its sequence
        self._slots: dict[int, int | None] = {}  # uid -> its adapter slot (None: the base model)
        self._prompt_scores: dict[
            int, tuple[TokenLogprob, ...]
        ] = {}  # uid -> its prompt's logprobs, until its first token
        self.logprobs: dict[int, StepLogprobs] = {}
        self._solo: _Solo | None = None
        # Whether a sequence alone may take drafts: its cache must drop rejected positions.
        self._drafts = backend.draft_tokens > 0 and drops_rejected(make_prompt_cache(backend.model))

    def prompt_cache_usage(self) -> PromptCacheUsage:
        return self._prompts.usage()

    def fits(self, needs: list[int]) -> bool:
        return len(self._uids) + (self._solo is not None) + len(needs) <= self.capacity

    def kv_cache_usage(self) -> KvCacheUsage:
        return KvCacheUsage()  # BatchGenerator's caches grow by use; not counted (backends.KvCacheUsage)

    @property
    def generator(self) -> BatchGenerator | None:
        """The running BatchGenerator (None while no sequence runs), for its own statistics."""
        return self._generator

    def add(self, sequence: Sequence) -> int:
        if self._solo is not None:
            self._store_solo_prompt()
            self._join_batch()  # drafts are verified only while one sequence decodes
        elif not self._uids and self._drafts and speculates(sequence):
            return self._start_solo(sequence)
        slot = self._bank.acquire(sequence.adapter)
        try:
            with self._router.using(self._bank):
                cache, rest, scores = self._backend.start(sequence, self._prompts, self._router.offset(slot))
            reused = len(sequence.prompt_ids) - len(rest)
            uid = self._insert(sequence, slot, rest, sequence.prompt_ids[:reused], cache, sequence.max_new_tokens)
        except BaseException:  # the engine removes no sequence it could not add
            self._bank.release(slot)
            raise
        if scores is not None:
            self._prompt_scores[uid] = scores
        return reused if scores is None else 0

    def _store_solo_prompt(self) -> None:
        """The prompt of the sequence decoding alone, for requests that arrive while it generates
        (as a batch's is stored once prefilled): a copy, made after its first token went out
        (at the next step or `add`), while the cache holds just the prompt."""
        solo = self._solo
        if solo is None or solo.stored or solo.generation.next is None:
            return
        cache = copy.deepcopy(solo.generation.cache)
        self._prompts.store(solo.ids[:-1], cache, prompt_cache_namespace(solo.generation.sequence))
        solo.stored = True

    def _start_solo(self, sequence: Sequence) -> int:
        slot = self._bank.acquire(sequence.adapter)
        try:
            with self._router.using(self._bank):
                cache, rest, _ = self._backend.start(sequence, self._prompts, self._router.offset(slot))
            cache = cache if cache is not None else make_prompt_cache(self._backend.model)
            drafted = self._backend.lookup_generation(sequence, cache, rest, self._bank, slot, self._prefill_step)
            if drafted is None:  # (`_drafts` said its cache can drop positions)
                raise RuntimeError("this model's cache cannot drop rejected draft positions")
        except BaseException:  # the engine removes no sequence it could not add
            self._bank.release(slot)
            raise
        self._solo = _Solo(drafted, slot)
        return len(sequence.prompt_ids) - len(rest)

    def _join_batch(self) -> None:
        """The sequence decoding alone goes into the batch: its cache, and the ids the cache lacks
        (the rest of its prompt, or its next input) as its prompt."""
        solo, self._solo = self._solo, None
        drafted, sequence = solo.generation, solo.generation.sequence
        if drafted.next is None:
            rest, left = drafted.rest, sequence.max_new_tokens
        else:
            rest, left = [drafted.next], sequence.max_new_tokens - drafted.generated
        self._insert(sequence, solo.slot, rest, solo.ids[: len(solo.ids) - len(rest)], drafted.cache, left)

    def _insert(
        self, sequence: Sequence, slot: int | None, rest: list[int], held: list[int], cache: list, max_tokens: int
    ) -> int:
        """Put a sequence into the batch (a generator made first if none runs): `rest`, the ids
        its `cache` lacks, go in as its prompt; `held` are the ids the cache holds (plain)."""
        if self._generator is None:
            self._generator = BatchGenerator(
                self._backend.model,
                completion_batch_size=self.capacity,
                prefill_batch_size=self.capacity,
                prefill_step_size=self._prefill_step,
            )
        offset = self._router.offset(slot)
        sampler, processors = self._backend.sampler(sequence, offset)
        (uid,) = self._generator.insert(
            [[i + offset for i in rest]],
            max_tokens=[max_tokens],
            caches=[cache],
            all_tokens=[[i + offset for i in held]],
            samplers=[sampler],
            logits_processors=[processors],  # the repetition penalty reads raw logits
        )
        self._uids[sequence.id] = uid
        self._ids[uid] = sequence.id
        self._sequences[uid] = sequence
        self._slots[uid] = slot
        return uid

    def step(self) -> dict[int, list[int]]:
        solo = self._solo
        if solo is not None:
            self.logprobs = {}
            self._store_solo_prompt()
            drafted = solo.generation
            tokens = drafted.step()
            solo.ids += tokens
            return {drafted.sequence.id: tokens} if tokens else {}
        if self._generator is None:
            return {}
        with self._router.using(self._bank):
            prompts, generated = self._generator.next()
        prefilled = [r.uid for r in prompts if r.end_of_segment and not r.end_of_prompt]
        for uid, (cache, tokens) in self._generator.extract_cache(prefilled).items():
            self._store(self._sequences[uid], tokens, cache)
        out = {}
        self.logprobs = {}
        asking = []
        for r in generated:
            token = r.token % self._router.vocab
            out[self._ids[r.uid]] = [token]
            self._generating.add(r.uid)
            if self._sequences[r.uid].logprobs is not None:
                asking.append((r, token))
            if r.finish_reason is not None:  # at its length limit BatchGenerator drops it itself
                self._store(self._sequences[r.uid], r.all_tokens, r.prompt_cache)
                self._generating.discard(r.uid)
        if asking:
            tops = [self._sequences[r.uid].logprobs for r, _ in asking]
            rows = mx.stack([r.logprobs.reshape(-1) for r, _ in asking])
            scores = token_logprobs(rows, [token for _, token in asking], tops)
            for (r, _), score in zip(asking, scores, strict=False):
                self.logprobs[self._ids[r.uid]] = StepLogprobs(score, self._prompt_scores.pop(r.uid, None))
        return out

    def remove(self, *sequence_ids: int) -> None:
        for sequence_id in sequence_ids:
            self._remove(sequence_id)

    def _remove(self, sequence_id: int) -> None:
        solo = self._solo
        if solo is not None and solo.generation.sequence.id == sequence_id:
            self._solo = None
            drafted = solo.generation
            if drafted.next is not None:  # its prefill completed: the cache holds all but its next input
                self._prompts.store(solo.ids[:-1], drafted.cache, prompt_cache_namespace(drafted.sequence))
            self._bank.release(solo.slot)
            return
        uid = self._uids.pop(sequence_id, None)
        if uid is None:
            return
        del self._ids[uid]
        sequence = self._sequences.pop(uid)
        self._prompt_scores.pop(uid, None)
        generating = uid in self._generating
        self._generating.discard(uid)
        # Nothing more is computed for it from the next step; a sequence past its prefill
        # leaves its cache behind (one still in its prefill leaves nothing).
        caches = self._generator.remove([uid], return_prompt_caches=generating)
        self._bank.release(self._slots.pop(uid))  # its rows are gone from the batch
        for cache, tokens in caches.values():
            self._store(sequence, tokens, cache)
        if not self._uids:
            # Drop the idle generator here, on the generation thread (as mlx-lm's server does):
            # its close() synchronizes its thread-local stream.
            self._generator.close()
            self._generator = None

    def _store(self, sequence: Sequence, tokens: list[int], cache: list) -> None:
        """Keep the cache of a sequence's `tokens` (as BatchGenerator holds them: offset)."""
        self._prompts.store(self._router.plain(tokens), cache, prompt_cache_namespace(sequence))


class _Solo:
    """A sequence decoding alone with prompt-lookup drafts, outside BatchGenerator."""

    def __init__(self, generation: LookupGeneration, slot: int | None):
        self.generation = generation
        self.slot = slot  # its adapter slot in the decoder's bank (None: the base model)
        self.ids = list(generation.sequence.prompt_ids)  # then the generated ones (plain)
        self.stored = False  # whether its prompt's cache went into the prompt cache
