"""PyTorch + transformers runtime: the CPU, or CUDA where a GPU is (dtype rule: `pick_dtype`)."""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import inspect
import json
import logging
import threading
from collections.abc import Callable
from pathlib import Path

import torch
from transformers.cache_utils import DynamicCache, DynamicLayer
from transformers.utils import logging as transformers_logging

from backends.contract import (
    KvCacheUsage,
    LoadOptions,
    ModelInfo,
    ModelLoadError,
    PromptCacheUsage,
    Sampling,
    Sequence,
    StepLogprobs,
    available_memory,
    default_kv_cache_bytes,
    default_prompt_cache_bytes,
    physical_memory,
    prompt_cache_namespace,
)
from backends.decoding.drafts import DEFAULT_DRAFT_TOKENS, PromptLookup, applied_draft_tokens, speculates
from backends.decoding.grammar import Grammars
from backends.decoding.guard import CompileGuard
from backends.decoding.text import StreamDetokenizer, TokenizerMethods, TokenizerText
from backends.files.adapters import AdapterRegistry, block_count, find_adapter
from backends.files.models import converted_gguf, gguf_file, is_random
from backends.torch import gguf_direct, stored_model
from backends.torch.hybrid import RowStates
from backends.torch.logprobs import token_logprobs
from backends.torch.lora import LoraHooks, torch_linears
from backends.torch.prompt_cache import PrefixCache
from backends.torch.prompt_disk import NO_DISK
from backends.torch.quant.blocks import file_kind
from backends.torch.quant.make import quantize_linears
from backends.torch.quant.methods import STORED_METHODS, QuantizedWeight, describe, parse_method
from backends.torch.sampling import TokenChooser, verify_draft

log = logging.getLogger("phi2_server.torch")

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def pick_device(requested: str) -> str:
    if requested == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return requested


def cpu_has_bf16() -> bool:
    """Native bfloat16 arithmetic (AVX512-BF16 or AMX), as /proc/cpuinfo reports it."""
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:  # not Linux
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


# On a CPU, bfloat16 pays only where decoding is memory-bound: below ~4M parameters the weights
# sit in the caches and bfloat16 only adds conversions (docs/decisions.md, D-bf16-auto).
CPU_BF16_MIN_PARAMETERS = 4_000_000


def pick_dtype(requested: str, device: str, parameters: Callable[[], int]) -> torch.dtype:
    """The weights' dtype. `auto`: bfloat16 on CUDA; on a CPU with native bfloat16, bfloat16 for a
    model of at least CPU_BF16_MIN_PARAMETERS parameters; else float32."""
    if requested == "auto":
        if device.startswith("cuda"):
            return torch.bfloat16
        if cpu_has_bf16() and parameters() >= CPU_BF16_MIN_PARAMETERS:
            return torch.bfloat16
        return torch.float32
    if requested not in DTYPES:
        raise ModelLoadError(f"PHI2_DTYPE must be auto or one of {', '.join(DTYPES)}, not {requested!r}")
    return DTYPES[requested]


def prompt_cache_budget(requested: int | None, device: torch.device) -> int:
    """A decoder's prompt cache budget: as requested, else the device's default."""
    if requested is not None:
        return requested
    if device.type == "cuda":
        return default_prompt_cache_bytes(torch.cuda.get_device_properties(device).total_memory, on_gpu=True)
    return default_prompt_cache_bytes(physical_memory(), on_gpu=False)


def refuse_mlx_quantized(path: Path, spec: str) -> None:
    """A checkpoint `mlx_lm.convert -q` wrote (packed weights, `quantization` in config.json)
    would load into transformers as garbage: say which runtime serves it."""
    try:
        config = json.loads((path / "config.json").read_text())
    except (OSError, ValueError):
        return  # transformers will say what is wrong
    if (
        "quantization" in config
        and "quantization_config" not in config
        or config.get("quantization_config", {}).get("mode")
    ):
        raise ModelLoadError(
            f"PHI2_MODEL={spec!r} is an MLX-quantized checkpoint (mlx_lm.convert -q): serve it with PHI2_BACKEND=mlx, "
            "or give the full-precision checkpoint with PHI2_QUANTIZE=int8|int4|w8a8"
        )


def quantized_store(path: Path, options: LoadOptions, method: str, dtype: torch.dtype, device: str) -> Path | None:
    """Where PHI2_QUANTIZE's weights are stored for the next start (QUANTIZED_CACHE), or None:
    not quantized, or a model the general decoder does not serve (quantized at every start)."""
    from backends.torch.quant import store as quant_store

    if not method or not options.quantized_cache:
        return None
    file = quant_store.stored_file(path, options.model, method, dtype, torch.device(device))
    if file.exists():  # written for a model the general decoder serves: no config to read again
        return file
    from transformers import AutoConfig

    from backends.files.architecture import Architecture

    return file if Architecture.of(AutoConfig.from_pretrained(path)) is not None else None


def count_parameters(path: Path) -> int:
    """The model's parameter count, from its config alone (built on the meta device: no memory)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(path)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return sum(p.numel() for p in model.parameters())


class TorchBackend(TokenizerMethods):
    name = "torch"

    def __init__(self, model, tokenizer, info: ModelInfo):
        self.model = model
        self.text = TokenizerText(tokenizer)
        self.info = info
        self.device = torch.device(info.device)
        self.eos_token_ids = end_of_text_ids(model, tokenizer) | self.text.turn_end_ids()
        # Phi-2's model vocabulary (51200) is larger than its tokenizer's: those ids decode to
        # nothing, so they are never sampled (the same rule as the MLX runtime).
        self.undecodable_from = self.text.vocab_size
        self.grammars = Grammars(
            tokenizer, int(model.config.vocab_size), ends=sorted(self.eos_token_ids), guard=CompileGuard
        )
        self._fast_decoder = None  # kept: its CUDA graphs took seconds to capture
        self._fast_decoder_owner: threading.Thread | None = None
        self.max_batch = 1
        self.max_adapters = 8
        self.adapters: AdapterRegistry | None = None
        self.compile = False
        self.quantized = False
        # The KV budget (KV_CACHE_BYTES or the default): the CPU pool's limit, or the CUDA pool's size.
        self.kv_budget: int | None = None
        self.draft_tokens = 0  # prompt-lookup draft tokens a step verifies while one sequence decodes
        self.disk_options: tuple[str, int] | None = None  # PROMPT_CACHE_DIR and its budget
        self.disk_key: dict = {}
        self._prompt_disk = None
        self._cache_kw = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"

    # -- loading: the checkpoint, its weights, quantization ----------------------------------

    @classmethod
    def load(cls, path: Path, options: LoadOptions) -> TorchBackend:
        device = pick_device(options.device)
        method = parse_method(options.quantize)
        source = gguf_file(options.model)
        if source and not options.quantize and device == "cpu":
            method = file_kind(source, path) or ""  # a GGUF file's own blocks, as it stores them
        refuse_mlx_quantized(path, options.model)
        transformers_logging.disable_progress_bar()  # the server log is for the server
        try:
            # Block-quantized weights multiply float32 activations (backends/torch/cpu/kernels.cpp).
            requested = "float32" if method in STORED_METHODS and options.dtype == "auto" else options.dtype
            dtype = pick_dtype(requested, device, lambda: count_parameters(path))
            store = quantized_store(path, options, method, dtype, device)
            restored = restore_quantized(path, store, dtype, device) if store and store.exists() else None
            shell = restored[4] if restored else None
            if shell:  # the class AutoTokenizer chose (backends/torch/stored_model.py): it reads the config
                tokenizer = stored_model.tokenizer_class(shell).from_pretrained(path)
            else:
                from transformers import AutoTokenizer

                tokenizer = AutoTokenizer.from_pretrained(path)
            direct = None  # a GGUF file's model built from the file (backends/torch/gguf_direct.py)
            if restored:
                model, stored_blocks, stored_head, parameters, _ = restored
            elif is_random(options.model):
                model = random_model(path, dtype, device)
            elif gguf_direct.applies(source, method, device, options.quantize):
                model, stored_blocks, stored_head, parameters = direct = gguf_direct.load(source, path, method)
            else:
                from transformers import AutoModelForCausalLM

                if source:  # the file's float weights, converted once
                    from backends.torch.checkpoints import MAKERS

                    path = converted_gguf(source, options.model, MAKERS, weights=True)
                model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device).eval()
        except (OSError, ValueError, KeyError) as exc:
            raise ModelLoadError(
                f"PHI2_MODEL={options.model!r} ({path}) could not be loaded by transformers: {exc}; "
                "run `make demo` (PHI2_MODEL=tiny) for the offline demo model"
            ) from exc
        adapter = find_adapter(options.adapter_path, options.adapter_path_is_default)
        registry = AdapterRegistry(
            options.adapters_dir,
            adapter,
            load_tensors=_load_safetensors,
            linears=torch_linears(model),
            blocks=block_count(model),
            max_loaded=options.max_adapters,
        )
        registry.load_default()
        if not restored and not direct:
            parameters, stored_blocks, stored_head = sum(p.numel() for p in model.parameters()), None, None
        on_cuda = device.startswith("cuda")
        if options.max_batch:
            max_batch = options.max_batch
        elif on_cuda:
            max_batch = cuda_max_batch(model, options.max_context, torch.device(device), options.kv_cache_bytes)
        else:
            max_batch = 8
        info = ModelInfo(
            model=options.model,
            backend=cls.name,
            device=device,
            dtype=str(dtype).removeprefix("torch."),
            context_length=context_window(model, options.max_context, torch.device(device), options.kv_cache_bytes),
            adapter_path=options.adapter_path,
            adapter_applied=adapter is not None,
        )
        backend = cls(model, tokenizer, info)
        backend.adapters, backend.max_adapters = registry, max(options.max_adapters, 1)
        if method in STORED_METHODS:
            from backends.torch.cpu.kernels import kernels

            kernels()  # built now, or a clear startup error
        from_file = source and method in STORED_METHODS and not restored and not direct
        file_blocks = block_source(source, model, method, not options.quantize) if from_file else None
        # adapters: unmerged
        quantized = backend.quantize(method, stored_blocks, stored_head, file_blocks) if method else []
        if method in STORED_METHODS and device == "cpu":
            from backends.torch.quant.blocks import rehome

            rehome(quantized)
        measured = None
        if (
            options.speed_check
            and method
            and options.quantize
            and device == "cpu"
            and parameters >= CPU_BF16_MIN_PARAMETERS
        ):
            from backends.torch.quant.check import check

            # a requested method against the float default, on this CPU (quant_check.py)
            float_dtype = pick_dtype("auto", device, lambda: parameters)
            measured = check(method, quantized, torch.float32 if method in STORED_METHODS else dtype, float_dtype)
        if method in STORED_METHODS and device == "cpu" and not restored:
            _give_back_freed()
        if store and not restored:
            from backends.torch.quant import store as quant_store

            weights = backend.decoder_weights
            shell = stored_model.describe(model, tokenizer) if device == "cpu" else None
            quant_store.save(store, model, weights.layers, weights.quantized_head, parameters, shell)
        weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters()) + sum(q.nbytes for q in quantized)
        embed = getattr(getattr(getattr(model, "model", None), "embed_tokens", None), "blocks", None)
        if embed is not None and embed is not backend.decoder_weights.quantized_head:  # its file's blocks
            weight_bytes += embed.nbytes
        if on_cuda:
            # The KV pool, allocated whole by the decoder (graphs hold its address): measured
            # now, before the graphs and the warm-up take their share of the free memory.
            backend.kv_budget = int(cuda_kv_budget(torch.device(device), options.kv_cache_bytes))
        else:
            # Weights mapped from a stored file count as available (the page cache): not for us.
            available = available_memory() - (weight_bytes if restored else 0)
            prompt_cache = prompt_cache_budget(options.prompt_cache_bytes, torch.device(device))
            backend.kv_budget = options.kv_cache_bytes or default_kv_cache_bytes(available, prompt_cache)
            window = budget_window(model, info.context_length, backend.kv_budget)
            info = dataclasses.replace(info, context_length=window)
        backend.info = dataclasses.replace(
            info,
            quantization={**describe(method, quantized), **({"measured": measured} if measured else {})}
            if method
            else None,
            extra={
                "parameters": parameters,
                "weight_bytes": weight_bytes,
                "threads": torch.get_num_threads() if device == "cpu" else None,
            },
        )
        # torch.compile pays on CUDA, at a startup cost (docs/decisions.md, D-compile-off).
        backend.max_batch = max_batch
        backend.compile = on_cuda if options.compile is None else options.compile
        # Drafts pay on the CPU (with block weights too: their verify pass is the compiled step's,
        # docs/decisions.md, D-cpu-step); on CUDA a graphed step is cheaper than an eager verify pass.
        default_drafts = 0 if on_cuda else DEFAULT_DRAFT_TOKENS
        backend.draft_tokens = applied_draft_tokens(options.prompt_lookup_tokens, default_drafts)
        if options.prompt_cache_dir:
            from backends.torch.quant.store import WEIGHT_SUFFIXES

            backend.disk_options = (options.prompt_cache_dir, options.prompt_cache_disk_bytes or DISK_BYTES)
            files = [source] if source else sorted(f for f in path.iterdir() if f.name.endswith(WEIGHT_SUFFIXES))
            backend.disk_key = {
                "model": options.model,
                "files": [(f.name, f.stat().st_size, f.stat().st_mtime_ns) for f in files],
                "method": method,
                "template": hashlib.sha256(str(getattr(tokenizer, "chat_template", "")).encode()).hexdigest(),
            }
        if options.warmup:
            backend.warm_up(backend.max_batch)
        return backend

    def prompt_disk(self):
        """PROMPT_CACHE_DIR's files for the batched decoder's KV (made at the first decoder), or NO_DISK."""
        if self.disk_options is None:
            return NO_DISK
        if self._prompt_disk is None:
            from backends.torch.prompt_disk import PromptDisk

            weights = self.decoder_weights
            layout = (len(weights.layers), weights.arch.kv_heads, weights.head_dim)
            root, budget = self.disk_options
            self._prompt_disk = PromptDisk(Path(root).expanduser(), self.disk_key, budget, layout, weights.embed.dtype)
        return self._prompt_disk

    def quantize(
        self,
        method: str,
        stored_blocks: list[dict] | None = None,
        stored_head: QuantizedWeight | None = None,
        file_blocks: dict | None = None,
    ) -> list[QuantizedWeight]:
        """Quantize the weights in place: the general decoder's fused matrices and, for w8a8, its
        output head (it then serves at any batch size), else every Linear but the output head
        (torch_quant). `stored_blocks`, `stored_head`: the decoder's blocks and head as an
        earlier start stored them (quantized already)."""
        from backends.torch import decoder as torch_decoder

        if stored_blocks is not None:
            weights = torch_decoder.DecoderWeights(
                self.model, self.undecodable_from, self.info.context_length, stored_blocks, stored_head
            )
            self.__dict__["decoder_weights"] = weights  # the cached property, set
            quantized = [getattr(block, name) for block in weights.layers for name in block.matrices()]
            quantized += [stored_head] if stored_head else []
        elif torch_decoder.supports(self.model):
            quantized = self.decoder_weights.quantize(self.model, method, file_blocks)
        else:
            quantized = quantize_linears(self.model, method)
        self.quantized = True
        if self.device.type == "cpu" and stored_blocks is None:  # mapped weights leave nothing behind
            import gc

            gc.collect()  # the full-precision copies are garbage now: give their memory back
        return quantized

    # -- serving: detokenizers, decoders, the plain forward ------------------------------------

    def detokenizer(self) -> StreamDetokenizer:
        return StreamDetokenizer(self.text)

    def decoder(self, max_batch: int = 1, prompt_cache_bytes: int | None = None):
        """The batched general decoder for the families it knows (backends/files/architecture.py;
        always on CUDA: graphs), else one sequence at a time through transformers' forward (any
        causal LM)."""
        from backends.torch import decoder as torch_decoder

        budget = prompt_cache_budget(prompt_cache_bytes, self.device)
        if torch_decoder.supports(self.model) and (max_batch > 1 or self.device.type == "cuda" or self.quantized):
            # Reuse the decoder (and its CUDA graphs) that warm-up built, unless another thread
            # that is still alive holds it (tests run several workers over one backend).
            decoder, owner = self._fast_decoder, self._fast_decoder_owner
            mine = owner is None or owner is threading.current_thread() or not owner.is_alive()
            if (
                decoder is None
                or decoder.capacity != max_batch
                or decoder.adapter_slots != self.max_adapters
                or not mine
                # A CPU pool's room for the prompt cache is laid out when it is made (cheap to
                # make again, unlike a GPU's graphs; there a larger budget is cut to the room).
                or (decoder.kv.grows and not decoder.has_room_for(budget))
            ):
                decoder = torch_decoder.BatchedDecoder(
                    self.decoder_weights,
                    max_batch,
                    compile=self.compile,
                    adapter_slots=self.max_adapters,
                    kv_cache_bytes=RowStates.budget_left(self.decoder_weights, max_batch, self.kv_budget),
                    context=self.info.context_length,
                    # On CUDA its pool is allocated whole, with room for the prompt cache's blocks.
                    prompt_cache_bytes=budget,
                )
                self._fast_decoder = decoder
            decoder.clear(prompt_cache_bytes=budget)
            decoder.draft_tokens = 0 if self.decoder_weights.arch.hybrid else self.draft_tokens
            decoder.disk = self.prompt_disk() if budget > 0 else NO_DISK
            self._fast_decoder_owner = threading.current_thread()
            return decoder
        if max_batch > 1:
            from backends.files.architecture import unsupported

            log.warning(
                "%s: served one sequence at a time (the batched decoder does not know it: %s)",
                self.model.config.model_type,
                unsupported(self.model.config),
            )
        return SingleSequenceDecoder(self, budget)

    @functools.cached_property
    def decoder_weights(self):
        from backends.torch.decoder import DecoderWeights

        return DecoderWeights(self.model, self.undecodable_from, self.info.context_length)

    def warm_up(self, max_batch: int = 1) -> None:
        from backends.decoding.drive import drive
        from backends.torch.decoder import BatchedDecoder

        decoder = self.decoder(max_batch)
        prompt = self.encode("Hello, how are you today? I am fine, thank you.") or [0]
        if self.device.type == "cpu":
            # Nothing is compiled or captured on the CPU: one short generation pages in every
            # weight (a mapped quantized file's too) and makes the kernels' first calls; the CUDA
            # warm-up below made no first request faster here (docs/decisions.md, D-cpu-warmup).
            drive(decoder, [Sequence(0, prompt[:2], Sampling(), 2)])
            return
        # The same prompt twice: the second takes its prefix from the prompt cache and prefills
        # one token, a shape the first request that hits the cache should not pay for.
        for sequence_id in (0, 1):
            drive(decoder, [Sequence(sequence_id, prompt, Sampling(), 2)])
        if isinstance(decoder, BatchedDecoder):
            decoder.capture()  # CUDA graphs for the short lengths

    def forward(self, input_ids: list[int], cache, every_position: bool = False) -> torch.Tensor:
        """Raw logits for the position after `input_ids` ([vocab]), or for each of its positions
        ([len, vocab]), extending `cache` in place."""
        ids = torch.tensor([input_ids], device=self.device)
        with torch.inference_mode():
            out = self.model(
                input_ids=ids, use_cache=True, logits_to_keep=0 if every_position else 1, **{self._cache_kw: cache}
            )
        return out.logits[0] if every_position else out.logits[0, -1]

    def new_cache(self):
        return DynamicCache(config=self.model.config)


# What the batched decoder's KV cache may take of the GPU memory left after the weights (and
# the prompt cache's budget): the rest is for CUDA graphs, activations and the allocator.
KV_SHARE_OF_FREE = 0.85


def kv_bytes_per_position(model) -> int | None:
    """Keys and values of one position in every layer (None: an architecture the general
    decoder does not describe)."""
    from backends.files.architecture import Architecture

    arch = Architecture.of(model.config)
    if arch is None:
        return None
    return arch.layers * arch.kv_heads * arch.head_dim * 2 * next(model.parameters()).element_size()


def budget_window(model, window: int, budget: int) -> int:
    """On a CPU, the context window cut to what one sequence's KV takes within `budget` (its
    pages and the scratch page, backends/kv_pages), said in the log; a budget that holds almost
    nothing is a startup error."""
    from backends.torch.kv_pages import PAGE

    per_position = kv_bytes_per_position(model)
    if per_position is None:
        return window
    fits = (budget // (PAGE * per_position) - 1) * PAGE
    if fits >= window:
        return window
    if fits < 16:
        raise ModelLoadError(
            f"KV_CACHE_BYTES={budget} holds {max(fits, 0)} tokens of this model's KV ({per_position} bytes a token): "
            "set it larger (0: from the available memory)"
        )
    fits = fits // 256 * 256 if fits >= 512 else fits // 8 * 8
    log.warning(
        "context window cut from %d to %d tokens: one sequence's KV at full context must fit the KV budget of "
        "%.2f GiB (set KV_CACHE_BYTES, or MAX_MODEL_LEN to choose the window)",
        window,
        fits,
        budget / (1 << 30),
    )
    return fits


# PROMPT_CACHE_DISK_BYTES's default: room for a few agents' system prompts of a 1.5B model
# (Claude Code's 18,783 tokens of Qwen2.5-1.5B's KV in float32: 1.08 GB).
DISK_BYTES = 8 << 30


# MAX_BATCH's default on CUDA: a row for every CUDA_ROW_TOKENS positions the KV pool holds, of
# these (at most the largest, at least the first). The pool is paged (backends/kv_pages): rows
# are only an upper bound, and admission waits for pages, so rows beyond what the pool holds
# at full context cost nothing but their CUDA graphs (docs/decisions.md, D-cuda-rows).
CUDA_BATCHES = (64, 96, 128, 192, 256, 384, 512)
CUDA_ROW_TOKENS = 512


def model_window(model, requested: int) -> int:
    """The model's context window (max_position_embeddings), at most MAX_MODEL_LEN when set."""
    window = int(getattr(model.config, "max_position_embeddings", 0) or 2048)
    return min(window, requested) if requested else window


def cuda_kv_budget(device: torch.device, kv_cache_bytes: int = 0) -> float:
    """The bytes the batched decoder's KV cache may take on the GPU: KV_CACHE_BYTES, or a share
    of the memory free after the weights and the prompt cache's budget."""
    free, total = torch.cuda.mem_get_info(device)
    return kv_cache_bytes or KV_SHARE_OF_FREE * (free - default_prompt_cache_bytes(total, on_gpu=True))


def cuda_max_batch(model, requested_context: int, device: torch.device, kv_cache_bytes: int = 0) -> int:
    """MAX_BATCH's default on CUDA (CUDA_BATCHES): a row for each CUDA_ROW_TOKENS positions of
    the KV budget."""
    per_position = kv_bytes_per_position(model)
    if per_position is None:
        return CUDA_BATCHES[0]
    rows = cuda_kv_budget(device, kv_cache_bytes) // (CUDA_ROW_TOKENS * per_position)
    return max([b for b in CUDA_BATCHES if b <= rows], default=CUDA_BATCHES[0])


def context_window(model, requested: int, device: torch.device, kv_cache_bytes: int = 0) -> int:
    """The context window served: the model's (max_position_embeddings), at most MAX_MODEL_LEN
    when that is set. On CUDA it is also cut to what one sequence's pages take of the KV pool
    (KV_CACHE_BYTES, or by default a share of the GPU's free memory), said in the log."""
    from backends.files.architecture import Architecture
    from backends.torch.kv_pages import PAGE

    window = model_window(model, requested)
    if device.type != "cuda" or Architecture.of(model.config) is None:
        return window
    per_position = kv_bytes_per_position(model)
    pages = int(cuda_kv_budget(device, kv_cache_bytes) // (PAGE * per_position)) - 1  # the scratch page
    fits = pages * PAGE - 1  # a sequence's columns and the one a last step may write
    if fits < window:
        fits = max(256, fits // 256 * 256)
        log.warning(
            "context window cut from %d to %d tokens: one sequence's KV at full context must fit the GPU's KV "
            "pool (set KV_CACHE_BYTES, or MAX_MODEL_LEN to choose the window)",
            window,
            fits,
        )
        window = fits
    return window


def end_of_text_ids(model, tokenizer) -> frozenset[int]:
    """Every id that ends a generation: the generation config's (Llama-3 lists <|end_of_text|>,
    <|eom_id|> and <|eot_id|>; Qwen2.5 <|im_end|>; Phi-3 <|end|>), the model config's and the
    tokenizer's end-of-text."""
    ids = set()
    for eos in (model.generation_config.eos_token_id, model.config.eos_token_id, tokenizer.eos_token_id):
        ids.update(eos if isinstance(eos, list) else [eos] if eos is not None else [])
    return frozenset(ids)


def _load_safetensors(path: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(str(path))


def _give_back_freed() -> None:
    """Return the memory the load freed (rows as stored, once packed) to the system: glibc keeps
    freed heap pages for reuse (1.6 GB of them after a 1.5B K-quant file's first start)."""
    import ctypes

    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        pass


def meta_model(path: Path, dtype: torch.dtype):
    """The architecture in `path`/config.json on the meta device: shapes, no memory."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(path)
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config, dtype=dtype)


def rebuild_rotary(model, device: str) -> None:
    """A model built on the meta device has no rotary frequencies (non-persistent buffers, in no
    checkpoint): build its rotary modules again on `device`."""
    for name, module in model.named_modules():
        if name.endswith("rotary_emb"):
            fresh = type(module)(config=model.config).to(device)
            parent = model.get_submodule(name.rpartition(".")[0]) if "." in name else model
            setattr(parent, name.rpartition(".")[2], fresh)


def random_model(path: Path, dtype: torch.dtype, device: str):
    """The architecture in `path`/config.json with random weights, built without a CPU copy."""
    model = meta_model(path, dtype)
    model.to_empty(device=device)
    model.tie_weights()  # to_empty gave a tied output head storage of its own
    generator = torch.Generator(device=device).manual_seed(0)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "layernorm" in name or "norm." in name:  # as trained models have: no denormal-sized activations
                parameter.fill_(1.0 if name.endswith("weight") else 0.0)
            else:
                parameter.normal_(0.0, 0.02, generator=generator)
    rebuild_rotary(model, device)  # to_empty left them as garbage
    return model.eval()


def block_source(file: Path, model, method: str, every: bool) -> dict:
    """The GGUF file's matrices as stored: `every` type the kernels multiply (the file's own
    blocks served), else those in `method`'s block type and the head's (PHI2_QUANTIZE)."""
    from backends.torch.quant.blocks import file_matrices
    from backends.torch.weights import HEAD_METHODS

    kinds = {method, HEAD_METHODS.get(method, method)}
    return {name: weight for name, weight in file_matrices(file, model).items() if every or weight.name in kinds}


def restore_quantized(path: Path, file: Path, dtype: torch.dtype, device: str):
    """The model, its decoder blocks and head, its parameter count and its shell (or None) from
    quantized weights stored by an earlier start (backends/torch/quant/store.py), with no
    full-precision copy; None when the file does not load. On the CPU, where the file holds a
    shell, the model is built from it (backends/torch/stored_model.py), not by transformers."""
    import pickle

    from backends.torch.quant import store as quant_store

    try:
        saved = quant_store.load(file, torch.device(device))
        shell = saved.get("shell") if device == "cpu" else None
        if shell:
            model = stored_model.build(shell, saved["state"])
            blocks, head, parameters = quant_store.decoder_parts(saved)
        else:
            model = meta_model(path, dtype)
            blocks, head, parameters = quant_store.restore(saved, model)
        if (embed := quant_store.embedding(saved, head)) is not None:  # its file's blocks (RowLookup)
            model.model.embed_tokens.blocks = embed
    except (OSError, RuntimeError, ValueError, KeyError, AttributeError, pickle.UnpicklingError) as exc:
        log.warning("stored quantized weights %s did not load (%s): quantizing again", file, exc)
        return None
    if not shell:
        from transformers import GenerationConfig

        rebuild_rotary(model, device)
        try:  # from_pretrained reads it too: the checkpoint's end-of-text ids
            model.generation_config = GenerationConfig.from_pretrained(path)
        except OSError:
            pass
    log.info("quantized weights mapped from %s%s", file, " (no transformers model built)" if shell else "")
    return model.eval(), blocks, head, parameters, shell


class SingleSequenceDecoder:
    """Decodes one sequence at a time with transformers' dynamic KV cache (any causal LM).

    Its prompt cache holds each finished sequence's KV as the Phi fast path lays it out, and
    rebuilds a DynamicCache from a stored prefix: only for models whose cache layers are all
    plain `DynamicLayer`s (no sliding windows, no linear attention), whose KV is just that.
    """

    capacity = 1
    adapter_slots = 1

    def __init__(self, backend: TorchBackend, prompt_cache_bytes: int = 0):
        self._backend = backend
        self._lora = LoraHooks(backend.model)  # the sequence's adapter, if it has one
        self._sequence: Sequence | None = None
        self._cache = None
        self.logprobs: dict[int, StepLogprobs] = {}
        reusable = all(type(layer) is DynamicLayer for layer in backend.new_cache().layers)
        self.prompts = PrefixCache(prompt_cache_bytes if reusable else 0)
        self._reusable = reusable
        # Prompt-lookup drafts need a cache that can drop the positions of rejected ones: plain
        # layers (a sliding window's or a linear attention's state cannot be cut back).
        self._draft_tokens = backend.draft_tokens if reusable else 0
        self._lookup: PromptLookup | None = None
        self._per_position = kv_bytes_per_position(backend.model) or 0
        self._peak = 0

    def prompt_cache_usage(self) -> PromptCacheUsage:
        return self.prompts.usage()

    def fits(self, needs: list[int]) -> bool:
        # One sequence, whose KV grows as it goes (the window was cut to what one fits).
        return self._sequence is None and len(needs) <= 1

    def kv_cache_usage(self) -> KvCacheUsage:
        sequence = self._sequence
        used = len(self._ids) * self._per_position if sequence is not None else 0
        reserved = (len(sequence.prompt_ids) + sequence.max_new_tokens) * self._per_position if sequence else 0
        return KvCacheUsage(
            budget_bytes=self._backend.kv_budget or 0,
            used_bytes=used,
            reserved_bytes=reserved,
            peak_bytes=self._peak,
            bytes_per_token=self._per_position,
        )

    def add(self, sequence: Sequence) -> int:
        self._sequence = sequence
        self._lora.apply(sequence.adapter)
        self._cache = self._backend.new_cache()
        self._ids = list(sequence.prompt_ids)  # then the generated ones
        # Prompt logprobs need the logits of every prompt position: that prompt is prefilled whole.
        limit = 0 if sequence.prompt_logprobs is not None else len(sequence.prompt_ids) - 1
        reused, nodes = self.prompts.match(sequence.prompt_ids, limit, namespace=prompt_cache_namespace(sequence))
        if reused:
            k = torch.cat([node.k[:, :, :n] for node, n in nodes], dim=2)
            v = torch.cat([node.v[:, :, :n] for node, n in nodes], dim=2)
            for layer in range(k.shape[0]):  # the cache concatenates new tokens into fresh tensors
                self._cache.update(k[layer, None], v[layer, None], layer)
        self._next_input = sequence.prompt_ids[reused:]
        self._chooser = TokenChooser(
            sequence.sampling, sequence.prompt_ids, self._backend.undecodable_from, self._backend.device
        )
        drafts = self._draft_tokens and speculates(sequence)
        self._lookup = PromptLookup(sequence.prompt_ids, self._draft_tokens) if drafts else None
        return reused

    def step(self) -> dict[int, list[int]]:
        self.logprobs = {}
        sequence = self._sequence
        if sequence is None:
            return {}
        prefill = len(self._ids) == len(sequence.prompt_ids)
        if not prefill and self._lookup is not None:
            self._lookup.extend(self._ids[len(self._lookup.ids) :])  # its text is the lookup's
            generated = len(self._ids) - len(sequence.prompt_ids)
            draft = self._lookup.draft(sequence.max_new_tokens - generated - 1, self._backend.undecodable_from)
            if draft:  # its next input and the draft in one pass; the KV of rejected ids dropped
                logits = self._backend.forward(self._next_input + draft, self._cache, every_position=True)
                tokens = verify_draft(logits, draft, self._chooser)
                self._lookup.verified(draft, tokens)
                self._cache.crop(-(len(draft) + 1 - len(tokens)))
                self._next_input = tokens[-1:]
                self._ids += tokens
                self._peak = max(self._peak, len(self._ids) * self._per_position)
                return {sequence.id: tokens}
        scored = prefill and sequence.prompt_logprobs is not None
        logits = self._backend.forward(self._next_input, self._cache, every_position=scored)
        prompt = None
        if scored:  # position i predicts prompt id i + 1; the last position, the first new token
            prompt = tuple(token_logprobs(logits[:-1], sequence.prompt_ids[1:], sequence.prompt_logprobs))
            logits = logits[-1]
        token = self._chooser.choose(logits)
        if sequence.logprobs is not None:
            (score,) = token_logprobs(logits[None], [token], sequence.logprobs)
            self.logprobs[sequence.id] = StepLogprobs(score, prompt)
        self._next_input = [token]
        self._ids.append(token)
        self._peak = max(self._peak, len(self._ids) * self._per_position)
        return {sequence.id: [token]}

    def remove(self, *sequence_ids: int) -> None:
        for sequence_id in sequence_ids:
            self._remove(sequence_id)

    def _remove(self, sequence_id: int) -> None:
        if self._sequence is not None and self._sequence.id == sequence_id:
            # its prefill completed, and its cache is plain keys and values (Qwen3.5's linear
            # attention layers keep a state, which this cache does not store)
            if self._reusable and len(self._ids) > len(self._sequence.prompt_ids):
                self._store()
            self._sequence = None
            self._cache = None
            self._lora.clear()

    def _store(self) -> None:
        layers = self._cache.layers
        n = self._cache.get_seq_length()
        per_id = sum(layer.keys[0, :, :1].nbytes + layer.values[0, :, :1].nbytes for layer in layers)

        def kv(start: int, end: int):
            return tuple(
                torch.stack([getattr(layer, which)[0, :, start:end] for layer in layers])
                for which in ("keys", "values")
            )

        self.prompts.store(self._ids[:n], per_id, kv, namespace=prompt_cache_namespace(self._sequence))
