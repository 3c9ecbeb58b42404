"""Batched decoding on PyTorch for the decoder-only families (backends/files/architecture.py: Phi,
Llama and Mistral, Qwen2/3, Phi-3): the contract's Decoder (backends/__init__.py), in rooms.

- here, `BatchedDecoder`: the rows (a `Row` per active sequence), add, remove and step, the
  step's state (`StepState`), launching a decode step and collecting its tokens (`Draws`: the
  tokens chosen on the device);
- backends/torch/network.py: what the network computes (a block's math, the prefill, decode,
  fused and mixed passes, the logits) over the weights of backends/torch/weights.py;
- backends/torch/cuda/graphs.py: when a pass is replayed from a CUDA graph (the bucket tables);
- backends/torch/prefill.py: prompts in (pieces, the per-step budget, their logits);
- backends/torch/kv_pages.py: the paged KV cache and its accounting (`RowPages`).

Sequences join and leave between steps. Each active sequence owns one row (rows stay packed:
0..n-1) and the cache pages its row's table names, taken when it joins for its prompt and
max_new_tokens, so a decode step is one pass over rows 0..b-1 for every live sequence at once,
each at its own position, with its own sampling. New prompts are prefilled together, padded to
the longest of like length, at most `prefill_chunk` tokens a step, so a long prompt does not
stall the sequences already decoding for more than a chunk's time. On CUDA those pieces run on
a stream of their own, beside the decode steps (`_step`).

On CUDA a decode step is replayed from a CUDA graph; greedy and sampled steps are chained on the
device (sampled rows drawn there too), so the GPU does not wait for Python between them. On the
CPU the step runs eagerly and a step's prompt pieces go through the decode step's own pass.

While one sequence decodes alone, a step may verify a prompt-lookup draft instead
(`draft_tokens`, backends/prompt_lookup): its next input and the draft go through the prefill
path as one piece, and the tokens the model agrees with are kept; the columns of rejected ones
are written over by the next step, as a padded prefill's are. Measurements: BENCHMARKS.md.
"""

from __future__ import annotations

import itertools
import logging
import secrets
import weakref

import torch

from backends.contract import (
    KvCacheUsage,
    PromptCacheUsage,
    Sequence,
    StepLogprobs,
    TokenLogprob,
    prompt_cache_namespace,
)
from backends.decoding.drafts import PromptLookup, speculates
from backends.decoding.grammar import advance_together
from backends.torch.cuda.graphs import BATCH_BUCKETS, MIN_LENGTH_BUCKET, Graphs, bucket, length_buckets
from backends.torch.kv_pages import PAGE, PagedKV, RowPages
from backends.torch.logprobs import token_logprobs
from backends.torch.network import Network, decode_attention, norm  # noqa: F401 (re-exported: benchmarks/, tests/)
from backends.torch.prefill import InFlight, Prefill
from backends.torch.prompt_cache import PagedPrefixCache
from backends.torch.prompt_disk import NO_DISK
from backends.torch.sampling import (
    TokenChooser,
    choose_rows,
    sample_on_device,
    sampled_on_device,
    unpack_on_device,
    verify_draft,
)

# What torch_runtime.py, benchmarks/ and tests/ import from here, from the rooms it moved to.
from backends.torch.weights import QUANTIZED_HEAD_METHODS, Block, DecoderWeights, Shape, supports  # noqa: F401

log = logging.getLogger("phi2_server.torch_decoder")

# A prompt with this many tokens to compute takes the CPU's AMX-BF16 tiles for them, where the
# CPU has them (cpu_kernels.cpp, `bf16_product`): from about here a piece's products cost less
# there than the exact int8 ones, which a shorter one (a chat's next turn after its cached
# history) keeps. benchmarks/block_products.py, docs/decisions.md (D-prompt-tiles).
PROMPT_TILES_FROM = 32
# Prompt tokens a CPU step takes while no row decodes (64 while some do, so that they wait at
# most that): bigger eager passes cost less a token. A 1,000-token prompt's first token on
# SmolLM2, in bfloat16: 1.52 s in pieces of 64, 0.65 s in pieces of 256 (docs/decisions.md, D-alone-chunk).
CPU_ALONE_CHUNK = 256


class Launch:
    """A decode step started on the device and not yet read: the rows it decodes, its logits and
    tokens (on the host once `done`), its batch bucket."""

    def __init__(self, rows, logits, greedy, done, batch: int = 0, masked: list[int] = (), sampled: list[int] = ()):
        self.rows, self.logits, self.greedy, self.done = rows, logits, greedy, done
        self.batch = batch
        self.masked = masked  # rows whose token the device chooses under their grammar's mask (`_finish`)
        self.sampled = sampled  # rows whose token the device samples (`_finish`)
        self.piece_logits: torch.Tensor | None = None  # prompt pieces', prefilled in the same pass (`mixed_step`)


class Row:
    """An active sequence in its row of the batch: how far its prompt is in the cache, its next
    input, what it generated, and how its tokens are chosen."""

    def __init__(
        self,
        sequence: Sequence,
        chooser: TokenChooser,
        lora_index: int,
        device_sampling: bool = False,
        draft_tokens: int = 0,
        arrival: int = 0,
    ):
        self.sequence = sequence
        self.arrival = arrival  # when it joined, counted by the decoder (rows move as others leave)
        self.chooser = chooser
        self.lora_index = lora_index  # its adapter's slot in FusedLoraSlots (torch_lora); -1: the base model
        self.cached = 0  # tokens in the cache: the prompt as far as prefilled, then the generated ones fed back
        # Whether its prompt's tokens take the CPU's AMX-BF16 tiles (`Network.prompt_tiles`): set
        # once it joins, from its own prompt and what the cache held of it, never from company.
        self.tiled = False
        self.next_token: int | None = None  # the input of the next decode step, once the prompt is in
        self.generated: list[int] = []
        self.prompt_scores: list[TokenLogprob] = []  # prompt logprobs so far, if asked for
        # The device's greedy argmax is its token: no logits to read back, and steps may chain.
        self.plain = chooser.plain and sequence.logprobs is None
        # Sampled with temperature/top_k/top_p/min_p only (under a grammar or not): drawn on the
        # device (`_finish`), from a seed of its own (the request's, or a random one) and the
        # token's position.
        self.sampled = device_sampling and sampled_on_device(sequence.sampling) and sequence.logprobs is None
        # Under a grammar, greedy or drawn on the device: its mask is applied there, after the
        # step's forward pass was launched (`_finish`).
        self.masked = chooser.constrained_greedy or (self.sampled and chooser.matcher is not None)
        seed = sequence.sampling.seed
        self.seed = (seed if seed is not None else secrets.randbits(31)) & 0x7FFFFFFF
        self.chains = (
            self.plain or self.sampled or (self.masked and sequence.logprobs is None)
        )  # may be fed its next input on the device
        # Its text's n-gram index, where it may take prompt-lookup drafts.
        self.lookup = PromptLookup(sequence.prompt_ids, draft_tokens) if draft_tokens and speculates(sequence) else None

    def cached_ids(self) -> list[int]:
        """The ids whose keys and values are in the cache."""
        return (self.sequence.prompt_ids + self.generated)[: self.cached]


class StepState:
    """What one step leaves for the next; `_step` reads it first. Each may be None:
    - `early`: tokens read ahead of their step, when rows changed while a step was in flight
      (`_drain`): the next step hands them out and launches nothing;
    - `launched`: a decode step chained on the device (CUDA), its tokens not read yet: the next
      step launches its successor first (fed on the device), then reads this one;
    - `pieces`: prompt pieces running beside the decode steps (CUDA's side stream): read by the
      step that finds them done, which gives their prompts their first tokens.
    All None: the next step starts from the host."""

    def __init__(self):
        self.early: dict[int, int] | None = None
        self.launched: Launch | None = None
        self.pieces: InFlight | None = None


class Draws:
    """Tokens chosen on the device, for the decoder's `rows`: constrained rows' grammar masks and
    sampled rows' settings copied there through pinned buffers used in turns, and the draws from
    a step's logits (torch_sampling.sample_on_device, from each row's seed and position)."""

    def __init__(self, rows: list[Row], inputs: torch.Tensor, decodable: int, width: int, device):
        self.rows, self.inputs, self.decodable, self.width, self.device = rows, inputs, decodable, width, device
        self._mask_host: list[torch.Tensor] | None = None  # pinned: constrained rows' index and packed masks
        self._mask_flip = 0
        self._sampling_host: list | None = None  # pinned: sampled rows' index and settings
        self._sampling_flip = 0

    def masks_to_device(self, rows: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """The rows and their grammars' packed masks, copied to the device through pinned memory:
        a copy from pageable memory would first wait for the forward pass the masks are late for.
        Two buffers in turn: the one filled now was last copied two steps ago, long done."""
        words = [self.rows[i].chooser.matcher.allowed_words() for i in rows]
        if self._mask_host is None:
            pinned = self.device.type == "cuda"
            self._mask_host = [
                torch.zeros(self.width, 1 + len(words[0]), dtype=torch.int32, pin_memory=pinned) for _ in range(2)
            ]
        host = self._mask_host[self._mask_flip][: len(rows)]
        self._mask_flip ^= 1
        view = host.numpy()
        view[:, 0] = rows
        for r, row_words in enumerate(words):
            view[r, 1:] = row_words
        on_device = host.to(self.device, non_blocking=True)
        return on_device[:, 0].long(), on_device[:, 1:]

    def draw(self, rows: list[int], logits: torch.Tensor, allowed: torch.Tensor | None = None):
        """(the rows' index, their tokens), drawn on the device from the step's logits, under
        `allowed` (the rows' grammar masks, in `rows`' order) if given."""
        index, *settings, flags = self.sampling_to_device(rows)
        scores = logits[index, : self.decodable]
        if allowed is not None:
            scores = scores.masked_fill(~allowed, float("-inf"))
        return index, sample_on_device(scores, *settings, self.inputs[1].index_select(0, index), *flags)

    def sampling_to_device(self, rows: list[int]):
        """The sampled rows' index and settings (scale, top_k, top_p, min_p, seed) on the device,
        through pinned buffers, and which filters any row uses. Four buffers in turn: a step
        draws up to three times before it waits for the device (the decoder's `_finish`: the
        rows of grammars not armed yet, then the constrained ones, then the plain sampled rows),
        and a buffer may be filled again only once its copy has run; with two, the third draw
        wrote its rows' index and settings over the first's before the first was copied."""
        if self._sampling_host is None:
            pinned = self.device.type == "cuda"
            self._sampling_host = [
                (
                    torch.zeros(3, self.width, dtype=torch.long, pin_memory=pinned),
                    torch.zeros(3, self.width, dtype=torch.float32, pin_memory=pinned),
                )
                for _ in range(4)
            ]
        whole, real = self._sampling_host[self._sampling_flip]
        self._sampling_flip = (self._sampling_flip + 1) % len(self._sampling_host)
        n, decodable = len(rows), self.decodable
        ints, floats = whole.numpy()[:, :n], real.numpy()[:, :n]
        # Whole rows of settings at once: a row at a time into numpy cost a step three times as
        # much host time at hundreds of rows (BENCHMARKS.md, decisions).
        chosen = [self.rows[i] for i in rows]
        settings = [row.chooser.sampling for row in chosen]
        ints[0] = rows
        ints[1] = [s.top_k if 0 < s.top_k < decodable else 0 for s in settings]
        ints[2] = [row.seed for row in chosen]
        floats[0] = [s.scale for s in settings]
        floats[1] = [s.top_p if s.top_p < 1.0 else 2.0 for s in settings]
        floats[2] = [s.min_p for s in settings]
        flags = (int(ints[1].max()), bool((floats[1] <= 1.0).any()), bool((floats[2] > 0).any()))
        ints, floats = (
            whole.to(self.device, non_blocking=True)[:, :n],
            real.to(self.device, non_blocking=True)[:, :n],
        )  # whole: contiguous copies
        return ints[0], floats[0], ints[1], floats[1], floats[2], ints[2], flags


class BatchedDecoder:
    """The contract's Decoder for up to `max_batch` sequences at once (see the module docstring)."""

    @torch.inference_mode()  # the cache and buffers are inference tensors, as everything that writes them
    def __init__(
        self,
        weights: DecoderWeights,
        max_batch: int,
        prefill_chunk: int | None = None,
        cuda_graphs: bool | None = None,
        compile: bool = False,
        prompt_cache_bytes: int = 0,
        adapter_slots: int = 8,
        fused: bool | None = None,
        kv_cache_bytes: int | None = None,
        context: int | None = None,
        draft_tokens: int = 0,
        prefill_graphs: bool | None = None,
        overlap_prefill: bool | None = None,
    ):
        """`kv_cache_bytes`: on the CPU, the most bytes the KV cache may take (None: unbounded);
        `context`: the window served, if shorter than the weights' (a budget cut it);
        `draft_tokens`: the most prompt-lookup draft tokens a step verifies while one sequence
        decodes (0: none); `prefill_graphs`: prompt pieces padded to a graph's shape
        (backends/torch_graphs); None: with CUDA graphs and the fused step. Without CUDA graphs
        (the CPU, in tests) the padded pass runs eagerly. `overlap_prefill`: prompt pieces run
        on a CUDA stream of their own while decode steps run (None: on CUDA with graphs)."""
        self.weights = weights
        self.device = weights.device
        self.capacity = max_batch
        self.adapter_slots = adapter_slots
        if weights.arch.hybrid:  # Qwen3.5's states rule these out (backends/torch/hybrid.py says why)
            prompt_cache_bytes, draft_tokens, cuda_graphs, prefill_graphs, fused = 0, 0, False, False, False
        self.draft_tokens, self.disk = draft_tokens, NO_DISK  # disk: PROMPT_CACHE_DIR's files, the runtime's
        self.context = min(weights.context, context or weights.context)
        on_cuda = self.device.type == "cuda"
        use_graphs = on_cuda if cuda_graphs is None else cuda_graphs
        self.rows: list[Row] = []  # packed: rows 0..n-1 (shared with `prefill`, so changed in place)
        self.row_of: dict[int, int] = {}  # sequence id -> its row
        self._arrivals = itertools.count()  # each row's arrival, in the order they join
        self.width = bucket(max_batch, BATCH_BUCKETS) if use_graphs else max_batch  # rows the buffers hold
        # The KV cache: pages of PAGE positions from one pool, a table of each row's pages. A row
        # takes the pages of its prompt and max_new_tokens when it joins, and the engine admits a
        # sequence only if they fit (`fits`): one long prompt cannot take the process past its
        # memory (backends/kv_pages `RowPages`).
        arch = weights.arch
        self.pages = RowPages(
            len(weights.layers),
            arch.kv_heads,
            weights.head_dim,
            weights.embed.dtype,
            self.device,
            self.width,
            self.context,
            kv_cache_bytes,
            prompt_cache_bytes,
            whole=use_graphs or self.device.type != "cpu",
        )
        self.prompts = PagedPrefixCache(prompt_cache_bytes, self.kv, self.pages.cache_pages)
        self.network = Network(weights, self.kv, self.width, self.context, use_graphs, compile, fused, adapter_slots)
        rows = self.rows  # a check's prompt (`logits_after`) has a row past them, and no Row: it takes the tiles
        self.network.prompt_tiles = lambda i: i >= len(rows) or rows[i].tiled
        # Prompt pieces beside the decode steps: on CUDA with graphs, on a stream of their own
        # (`_step`), their graphs in a memory pool of their own, as the two run at once.
        overlap = use_graphs and on_cuda if overlap_prefill is None else overlap_prefill
        network, decoder = self.network, weakref.ref(self)  # weak: no cycle keeps the pool alive
        self.graphs = Graphs(
            network.decode_step,
            lambda rows, length, span: decoder()._padded_pass(rows, length, span),
            network.load_padded,
            network.idle_padded,
            network.uncompile,
            enabled=use_graphs,
            prefill=(use_graphs and network.fused) if prefill_graphs is None else prefill_graphs,
            apart=overlap and on_cuda,
            device=self.device,
            rows=self.width,
            context=self.context,
            windows=arch.windows,
        )
        chunk = prefill_chunk or (512 if on_cuda else 64)
        alone = prefill_chunk or (512 if on_cuda else CPU_ALONE_CHUNK)
        self.prefill = Prefill(self.rows, network, self.graphs, chunk, overlap, self.context, alone)
        self.state = StepState()
        self.logprobs: dict[int, StepLogprobs] = {}
        self.draws = Draws(self.rows, network.inputs, weights.decodable, self.width, self.device)
        # Pinned, two in turns (one may still be read): the tokens a chained step hands back.
        self._greedy_host = [torch.zeros(self.width, dtype=torch.long, pin_memory=on_cuda) for _ in range(2)]
        self._flip = 0

    # -- the other rooms, as the engine and the tests see them -------------------------------------

    @property
    def kv(self) -> PagedKV:
        return self.pages.kv

    @property
    def use_graphs(self) -> bool:
        """With CUDA graphs: decode steps bucketed, replayed and chained (tests/gpu turns it on
        over an eager CPU step to run CUDA's host logic)."""
        return self.graphs.enabled

    @use_graphs.setter
    def use_graphs(self, on: bool) -> None:
        self.graphs.enabled = self.network.use_graphs = on

    @property
    def slots(self) -> list[Row]:
        """The rows, by the name benchmarks/prompt_lookup.py and tests/test_kv_budget.py read."""
        return self.rows

    @property
    def long_prompts_from(self) -> int | None:
        """longrope's original length, past which a prompt takes the long factors (None: other
        rotaries); tests/test_families.py reads it here."""
        return self.network.long_prompts_from

    @property
    def cache_pages(self) -> int:
        return self.pages.cache_pages

    @property
    def per_position(self) -> int:
        return self.pages.per_position

    def kv_cache_usage(self) -> KvCacheUsage:
        return self.pages.usage()

    def has_room_for(self, prompt_cache_bytes: int) -> bool:
        """Whether the pool has room for a prompt cache of that budget (`clear`)."""
        return self.pages.has_room_for(prompt_cache_bytes)

    def fits(self, needs: list[int]) -> bool:
        """Whether new sequences of `needs` positions each fit beside the active ones."""
        return len(self.rows) + len(needs) <= self.capacity and self.pages.fits(needs)

    def capture(self, spans=(MIN_LENGTH_BUCKET, 2 * MIN_LENGTH_BUCKET)) -> None:
        """Capture the decode graphs that short requests use, before the first request needs them."""
        self.graphs.capture(self.network.fused, spans)

    def _prefill(self, *args, **kwargs) -> tuple[torch.Tensor, dict]:
        """`Prefill.run`, by the name benchmarks/prompt_lookup.py calls."""
        return self.prefill.run(*args, **kwargs)

    def _padded_pass(self, rows: int, length: int, span: int) -> torch.Tensor:
        """`Network.padded_pass`, by the name tests/test_families.py records the padded passes under."""
        return self.network.padded_pass(rows, length, span)

    def _need(self, sequence: Sequence) -> int:
        return len(sequence.prompt_ids) + sequence.max_new_tokens

    # -- the contract ------------------------------------------------------------------------------

    @torch.inference_mode()
    def clear(self, prompt_cache_bytes: int = 0) -> None:
        """Forget every sequence and stored prompt, with a new prompt cache budget (a fresh
        decoder for the worker, keeping the cache memory and the graphs)."""
        self._drain()
        self.state.early = None
        self.state.pieces = None  # what it wrote is forgotten with its rows
        self.rows.clear()
        self.row_of.clear()
        self.network.lora.table.users = [0] * self.network.lora.size  # the adapters stay in their slots, unused
        self.prompts.clear()
        self.kv.release([row for row, held in enumerate(self.kv.held) if held])
        # The pool was laid out with room for the prompt cache budget it was made with, which a
        # new one cannot exceed.
        prompt_cache_bytes = self.pages.cache_budget(prompt_cache_bytes)
        self.prompts = PagedPrefixCache(prompt_cache_bytes, self.kv, self.pages.cache_pages)
        self.pages.shrink()

    def prompt_cache_usage(self) -> PromptCacheUsage:
        return self.prompts.usage()

    @torch.inference_mode()
    def logits_after(self, ids: list[int], adapter=None, every_position: bool = False) -> torch.Tensor:
        """The next-token logits after `ids` (float32), with `adapter` if given, computed in a free
        row, which stays free; for checks and benchmarks (quantized weights, the GPU check).
        `every_position`: the logits after each prefix of `ids` ([len(ids), vocab])."""
        if len(self.rows) >= self.width:
            raise RuntimeError("no free row")
        self._drain()
        index = self._place(adapter)
        row = len(self.rows)
        self.pages.take(row, len(ids))
        try:
            last, every = self.prefill.run(
                [(row, ids, 0)],
                every_position=[0] if every_position else (),
                lora_rows=[index],
                long_rope=[self.prefill.long_prompt(ids)],
            )
            return (every[0] if every_position else last[0]).float()
        finally:
            self.kv.release([row])
            if index >= 0:
                self.network.lora.release(index)

    def _drain(self, prefill: bool = True) -> None:
        """Read a step still in flight before the rows change under it; with `prefill`, what
        the device does next waits for prompt pieces still running beside the steps."""
        if self.state.launched is not None:
            produced, self.state.launched = self._collect(self.state.launched), None
            self.state.early = {**(self.state.early or {}), **produced}
        if prefill:
            self.prefill.after(self.state.pieces)

    # -- rows: add and remove ----------------------------------------------------------------------

    @torch.inference_mode()
    def add(self, sequence: Sequence) -> int:
        if len(self.rows) >= self.capacity:
            raise RuntimeError("decoder is full")
        if self.state.early:  # a token drawn for an earlier sequence of the same id is not this one's
            self.state.early.pop(sequence.id, None)
        i = len(self.rows)
        chooser = TokenChooser(sequence.sampling, sequence.prompt_ids, self.weights.decodable, self.device)
        row = Row(
            sequence,
            chooser,
            self._place(sequence.adapter),
            device_sampling=self.network.fused and self.use_graphs,
            draft_tokens=self.draft_tokens,
            arrival=next(self._arrivals),
        )
        # A stored prefix goes straight into the row's pages (at least the last prompt token is
        # left to prefill: the first sampled token needs fresh logits). Prompt logprobs need
        # the logits of every prompt position: that prompt is prefilled whole.
        limit = 0 if sequence.prompt_logprobs is not None else len(sequence.prompt_ids) - 1
        prompt = sequence.prompt_ids
        if self.prefill.whole_from_graph(i, prompt, row.lora_index):
            # A new prompt this short is prefilled whole from a CUDA graph: its tail after a
            # stored prefix would cost about as much, so none is reused.
            limit = 0
        self.disk.restore(self, i, sequence, limit)  # PROMPT_CACHE_DIR's files, where memory holds less
        reused, nodes = self.prompts.match(sequence.prompt_ids, limit, namespace=self._namespace(sequence))
        # The stored prefix's pages go into the row's table as they are (no copy): those it
        # fills; the page where it ends part-way is copied, as the row writes the rest of it.
        stored = self.prompts.pages_of(nodes, reused) if reused else []
        whole = reused // PAGE
        self.pages.take(i, self.pages.columns(self._need(sequence)), stored[:whole])
        if reused % PAGE:
            self.kv.copy_page(stored[whole], self.kv.held[i][whole])
        self.row_of[sequence.id] = i
        self.rows.append(row)
        row.tiled = len(prompt) - reused >= PROMPT_TILES_FROM
        if reused:
            row.cached = reused
            if reused == len(prompt) - 1:
                # A prompt sent again: its last token is a decode step's input, not an eager
                # prefill of one token (hundreds of launches against a graphed step); the step's
                # token is its first, drawn at the same position (BENCHMARKS.md, decisions).
                row.next_token = prompt[-1]
        return reused

    def _namespace(self, sequence: Sequence) -> str:
        """Its prompt cache namespace; longrope's long prompts have their own (their KV was
        rotated with other factors at every position)."""
        long = self.prefill.long_prompt(sequence.prompt_ids)
        return prompt_cache_namespace(sequence) + ("/long-rope" if long else "")

    def _place(self, adapter) -> int:
        if adapter is None:
            return -1
        if adapter.key not in self.network.lora.table.keys:
            self._drain()  # its weights are about to be written (or the buffers replaced): no step may be reading them
        version = self.network.lora.version
        index = self.network.lora.place(adapter)
        if self.network.lora.version != version:  # new buffers: graphs that read the old ones are stale
            self.graphs.drop_adapted()
        return index

    def _store(self, i: int) -> None:
        """Keep row i's KV (its prompt so far, or its text as it ends) for later prompts: its pages, no copy."""
        if self.prompts.limit_bytes <= 0:  # off (or no room for a page): nothing to build the ids for
            return
        row = self.rows[i]
        held = self.kv.held[i]
        ids = row.cached_ids()[: len(held) * PAGE]  # (a decoder stepped past max_new_tokens wrote the scratch page)
        self.prompts.store_row(ids, held, self._namespace(row.sequence), row.sequence.adapter is None and self.disk)

    @torch.inference_mode()
    def remove(self, *sequence_ids: int) -> None:
        """Forget these sequences, keeping the rows packed (0..n-1): their pages go back to the
        pool, and the sequences in the last rows move into the freed rows by their page tables,
        not by copies of their rows (BENCHMARKS.md, decisions)."""
        gone = [i for i in dict.fromkeys(sequence_ids) if i in self.row_of]
        if not gone:
            return
        self._drain(prefill=False)
        kept = len(self.rows) - len(gone)
        if self.state.pieces is not None:
            # Pieces still running beside the steps write through their rows' tables: if one of
            # those rows is freed or moves, the device's next work waits for them (the host
            # does not). One whose sequences all left is not read.
            ids = [row.sequence.id for row in self.state.pieces.rows()]
            written = {self.row_of[sequence_id] for sequence_id in ids if sequence_id in self.row_of}
            leaving = {self.row_of[sequence_id] for sequence_id in gone}
            if any(i in leaving or i >= kept for i in written):
                self.prefill.after(self.state.pieces)
            if written <= leaving:
                self.state.pieces = None
        for sequence_id in gone:
            i = self.row_of[sequence_id]
            row = self.rows[i]
            if row.cached:  # with its text (a chat's next turn), or as far as its prefill went (a retry resumes)
                self._store(i)
            if row.lora_index >= 0:
                self.network.lora.release(row.lora_index)
        freed = {self.row_of.pop(sequence_id) for sequence_id in gone}
        holes = sorted(i for i in freed if i < kept)
        movers = [i for i in range(kept, len(self.rows)) if i not in freed]  # as many as the holes
        self.kv.release(sorted(freed))  # what the cache keeps stays held
        self.network.move_rows(holes, movers)  # their pages stay where they are: only the table rows move
        for hole, mover in zip(holes, movers, strict=True):
            self.rows[hole] = self.rows[mover]
            self.row_of[self.rows[hole].sequence.id] = hole
        del self.rows[kept:]
        self.pages.shrink()

    # -- the step ----------------------------------------------------------------------------------

    @torch.inference_mode()
    def step(self) -> dict[int, list[int]]:
        """One token for every sequence that is past its prompt (and maybe a first token for one
        whose prompt just finished), or for a sequence decoding alone the tokens of a verified
        draft (`_verify`). On CUDA, when every running sequence decodes greedily and no prompt
        waits, steps are chained: the next step is launched, fed its tokens on the device, before
        this one's are read, so the GPU never waits for Python. Prompt pieces launched while
        streams decode run beside the steps; a prompt's first token comes with the step that
        finds its last piece done."""
        self.logprobs = {}
        verified = self._verify()
        if verified is not None:
            return verified
        return {sequence_id: [token] for sequence_id, token in self._step().items()}

    def _verify(self) -> dict[int, list[int]] | None:
        """A step of prompt lookup, when one sequence decodes alone and its text offers a draft:
        its next input and the draft prefilled as one piece, and the longest prefix the model
        agrees with kept, with the model's own token after it. None: no draft this step."""
        if (
            self.draft_tokens <= 0
            or len(self.rows) != 1
            or self.state.early is not None
            or self.state.launched is not None
            or self.state.pieces is not None
        ):
            return None
        row = self.rows[0]
        if row.lookup is None or row.next_token is None:
            return None
        row.lookup.catch_up(row.generated)
        # No draft past max_new_tokens: its columns are all that the KV budget reserved (`_need`).
        draft = row.lookup.draft(row.sequence.max_new_tokens - len(row.generated) - 1, self.weights.decodable)
        if not draft:
            return None
        # The rotary tables of a decode step (longrope's long factors are a long prompt's prefill's).
        _, every = self.prefill.run([(0, [row.next_token, *draft], row.cached)], every_position=[0], draft=True)
        tokens = verify_draft(every[0], draft, row.chooser)
        row.lookup.verified(draft, tokens)
        row.cached += len(tokens)  # its next input and the draft ids it kept are in the cache now
        row.next_token = tokens[-1]
        row.generated += tokens
        return {row.sequence.id: tokens}

    def _step(self) -> dict[int, int]:
        """One token for each decoding row, from the state the last step left (`StepState`)."""
        state = self.state
        if state.early is not None:  # read early, when a sequence left while a step was in flight
            produced, state.early = state.early, None
            return {i: t for i, t in produced.items() if i in self.row_of}
        if state.launched is not None:
            return self._chained_step()
        return self._host_step()

    def _chained_step(self) -> dict[int, int]:
        """The tokens of the step in flight; if the rows still chain, its successor is launched
        first: its forward pass goes, then this step's tokens are read, the grammars take them
        and make the masks that the next step's choice needs, while the device computes it."""
        state = self.state
        if self._can_chain(state.launched):
            chained = self._launch(state.launched.rows, chained=True, finish=False)
            launched, state.launched = state.launched, None
            produced = self._collect(launched)
            self._finish(chained)
            state.launched = chained
            return produced
        produced, state.launched = self._collect(state.launched), None
        return produced

    def _host_step(self) -> dict[int, int]:
        """A step from the host: prompt pieces read if done, or launched (beside the decode
        step, before it, or in its own pass), then the decode step; it stays in flight if its
        rows chain (CUDA), else its tokens are read now."""
        state = self.state
        produced = {}
        if state.pieces is not None and state.pieces.ready():
            produced.update(self.prefill.read(state.pieces, self._first_tokens))
            state.pieces = None
        decoding = [i for i, s in enumerate(self.rows) if s.next_token is not None and s.sequence.id not in produced]
        pieces = None  # prompt pieces that the decode step's own pass takes along (`Prefill.fusable`)
        if state.pieces is None:
            # While streams decode, prompt pieces run beside their steps (on CUDA, on a stream of
            # their own: BENCHMARKS.md, decisions); their first tokens come with the step that
            # finds them done.
            overlap = bool(decoding) and self.prefill.overlap
            passes = self.prefill.passes(overlap)
            pieces = self.prefill.fusable(passes, bool(decoding)) if not overlap else None
            if pieces is None and passes:
                launched = self.prefill.start(passes, overlap)
                if launched.beside:
                    state.pieces = launched
                else:
                    produced.update(self.prefill.read(launched, self._first_tokens))
            elif pieces and not decoding:  # several passes' pieces, and no rows: one pass for them
                logits = self.network.mixed_step(0, 0, pieces)[2]
                produced.update(self._first_tokens(self._rows_of(pieces), logits, {}))
        if decoding:
            launched = self._launch(decoding, pieces=pieces)
            if self._can_chain(launched):
                state.launched = launched  # its tokens come with the next step
            else:
                produced.update(self._collect(launched))
            if pieces:  # prefilled in the step's own pass (`Network.mixed_step`)
                produced.update(self._first_tokens(self._rows_of(pieces), launched.piece_logits, {}))
        if state.pieces is not None and (not decoding or state.pieces.ready()):
            # Nothing else to do meanwhile: wait.
            produced.update(self.prefill.read(state.pieces, self._first_tokens))
            state.pieces = None
        return produced

    def _rows_of(self, pieces: list[tuple[int, list[int], int]]) -> list[tuple[Row, list[int], int]]:
        return [(self.rows[i], ids, start) for i, ids, start in pieces]

    def _can_chain(self, launched: Launch) -> bool:
        return (
            self.use_graphs
            and len(launched.rows) == len(self.rows)  # nobody joined or waits for a prompt
            and all(self.rows[i].chains for i in launched.rows)
            # A sequence alone that takes drafts (PROMPT_LOOKUP_TOKENS set on CUDA) is verified
            # from the host each step.
            and not (self.draft_tokens and len(self.rows) == 1 and self.rows[0].lookup is not None)
        )

    # -- tokens: a step's, prompts' first ones, logprobs -------------------------------------------

    def _collect(self, launched: Launch) -> dict[int, int]:
        """Wait for a launched step (on an event: the GIL is free meanwhile) and take its tokens."""
        if launched.done is not None:
            launched.done.synchronize()
        greedy = launched.greedy.tolist()
        if launched.masked:  # chosen on the device under their masks: the grammars move past them
            tokens = [greedy[i] for i in launched.masked]
            for i, token in zip(launched.masked, tokens, strict=False):
                self.rows[i].chooser.record(token, advance=False)
            advance_together([self.rows[i].chooser.matcher for i in launched.masked], tokens)
        # The others (sampled, or with penalties or logit_bias) choose from their logits here,
        # read back together.
        chosen = [
            i for i in launched.rows if not (self.rows[i].chooser.plain or self.rows[i].masked or self.rows[i].sampled)
        ]
        if chosen:
            index = torch.tensor(chosen, device=launched.logits.device)
            for i, token in zip(
                chosen, choose_rows(launched.logits[index], [self.rows[i].chooser for i in chosen]), strict=False
            ):
                greedy[i] = token
        produced = {}
        for i in launched.rows:
            row = self.rows[i]
            token = greedy[i]
            row.cached += 1  # its input token went into the cache in that step
            row.next_token = token
            row.generated.append(token)
            produced[row.sequence.id] = token
        self._report(launched.logits, [(i, i, produced[self.rows[i].sequence.id]) for i in launched.rows])
        return produced

    def _report(self, logits: torch.Tensor, chosen: list[tuple[int, int, int]]) -> None:
        """Logprobs of the tokens just chosen, (row, its row of `logits`, token), for the rows
        that asked (only their logits are read)."""
        asking = [(i, at, token) for i, at, token in chosen if self.rows[i].sequence.logprobs is not None]
        if not asking:
            return
        index = torch.tensor([at for _, at, _ in asking], device=logits.device)
        scores = token_logprobs(
            logits[index], [token for _, _, token in asking], [self.rows[i].sequence.logprobs for i, _, _ in asking]
        )
        for (i, _, _), score in zip(asking, scores, strict=False):
            row = self.rows[i]
            prompt = (
                tuple(row.prompt_scores)
                if row.sequence.prompt_logprobs is not None and len(row.generated) == 1
                else None
            )
            self.logprobs[row.sequence.id] = StepLogprobs(score, prompt)

    def _first_tokens(
        self, group: list[tuple[Row, list[int], int]], logits: torch.Tensor, every: dict
    ) -> dict[int, int]:
        """After a pass over prompt pieces (row, ids, first position): the rows' cache counts move
        past them, and the prompts they finished take their first tokens from `logits` (the
        pieces' last positions'); `every`: each position's logits, of the pieces whose prompt
        logprobs were asked for."""
        rows = {}  # the pass's piece -> its row's index now (rows move as sequences leave)
        for r, (row, _, _) in enumerate(group):
            i = self.row_of.get(row.sequence.id)
            if i is not None and self.rows[i] is row:
                rows[r] = i
        done = [r for r in rows if group[r][2] + len(group[r][1]) == len(group[r][0].sequence.prompt_ids)]
        tokens = logits[:, : self.weights.decodable].argmax(dim=-1)
        # Rows that draw their tokens on the device (no grammar) draw the first one there too,
        # from their seed and the last prompt position, as the decode steps draw the rest (a draw
        # on the host cost a first token time: BENCHMARKS.md, decisions).
        drawn = [r for r in done if group[r][0].sampled and group[r][0].chooser.matcher is None]
        if drawn:
            index = [rows[r] for r in drawn]
            _, *settings, flags = self.draws.sampling_to_device(index)
            at = torch.tensor([len(self.rows[i].sequence.prompt_ids) - 1 for i in index], device=self.device)
            picked = torch.tensor(drawn, device=self.device)
            scores = logits[picked, : self.weights.decodable]
            tokens.index_copy_(0, picked, sample_on_device(scores, *settings, at, *flags))
        greedy = tokens.tolist()
        # The first tokens of the other prompts that did not finish greedy-plain are chosen
        # together, read back with one wait (many sampled prompts arriving at once: one wait).
        chosen = [r for r in done if not group[r][0].chooser.plain and r not in drawn]
        if chosen:
            index = torch.tensor(chosen, device=logits.device)
            for r, token in zip(
                chosen, choose_rows(logits[index], [group[r][0].chooser for r in chosen]), strict=False
            ):
                greedy[r] = token
        first = []  # (row, its piece, its first token)
        produced = {}
        for r, i in rows.items():
            row, ids, start = group[r]
            token = greedy[r]
            if r in every:
                self._score_prompt(row, every[r], start, len(ids))
            row.cached = start + len(ids)
            if row.cached == len(row.sequence.prompt_ids):
                first.append((i, r, token))
                row.next_token = token
                row.generated.append(token)
                produced[row.sequence.id] = token
                # Its prompt, for requests that arrive while it generates (its pages: no copy).
                self._store(i)
        self._report(logits, first)
        return produced

    def _score_prompt(self, row: Row, logits: torch.Tensor, start: int, length: int) -> None:
        """Logprobs of the prompt ids that a prefilled piece's logits predict (each position
        predicts the next id, as far as the prompt goes)."""
        prompt = row.sequence.prompt_ids
        predicted = prompt[start + 1 : start + length + 1]
        if predicted:
            row.prompt_scores += token_logprobs(logits[: len(predicted)], predicted, row.sequence.prompt_logprobs)

    # -- launch ------------------------------------------------------------------------------------

    def _launch(
        self, rows: list[int], chained: bool = False, finish: bool = True, pieces: list | None = None
    ) -> Launch:
        """Start a decode step for `rows` (their inputs from the host, or, chained,
        from the previous step on the device). The other rows up to the batch bucket idle: they
        write to the cache's last column, which no sequence uses, and their output is dropped.
        Unless `finish`, the caller `_finish`es it (when its masks are known). `pieces`: prompt
        pieces (row, ids, first position) prefilled in the same pass (`Prefill.fusable`), their last
        positions' logits in the launch's `piece_logits`."""
        ahead = 1 if chained else 0  # a chained step's inputs sit one position past the rows' own count
        longest = max(self.rows[i].cached for i in rows) + 1 + ahead
        batch = bucket(len(self.rows), BATCH_BUCKETS) if self.use_graphs else len(self.rows)
        # The adapters' product only while a sequence uses one (its graphs are captured apart).
        lora = self.network.lora.version if any(self.rows[i].lora_index >= 0 for i in rows) else 0
        if self.network.fused:
            span = 0  # the fused step reads each row's live columns, whatever their number: one graph per batch
        else:
            span = min(bucket(longest, length_buckets(self.context)), self.context + 1) if self.use_graphs else longest
        if not chained:
            host = self.network.host_inputs.numpy()  # a view: plain writes, no tensor per row
            host[:, :batch] = 0
            host[1, :batch] = self.network.scratch
            host[3, :batch] = -1
            for i in rows:
                host[:, i] = (self.rows[i].next_token, self.rows[i].cached, 1, self.rows[i].lora_index)
            self.network.inputs[:, :batch].copy_(
                self.network.host_inputs[:, :batch], non_blocking=True
            )  # tokens, positions, advance, adapter
        piece_logits = None
        if pieces:
            logits, greedy, piece_logits = self.network.mixed_step(batch, span, pieces, self._reach_groups(batch))
        elif self.use_graphs:
            logits, greedy = self.graphs.replay(batch, span, lora)
        else:
            groups = self._reach_groups(batch) if self.network.grouped() else None
            logits, greedy = self.network.decode_step(batch, span, lora, groups)
        masked = [i for i in rows if self.rows[i].masked]
        launched = Launch(
            rows,
            logits,
            greedy,
            None,
            batch,
            masked,
            [i for i in rows if self.rows[i].sampled and not self.rows[i].masked],
        )
        launched.piece_logits = piece_logits
        if finish:
            self._finish(launched)
        return launched

    def _reach_groups(self, batch: int) -> list[tuple[torch.Tensor, int]] | None:
        """For an eager step: rows 0..batch-1 grouped by the columns they attend to (by length
        bucket), each group with its longest reach, or None if they share one bucket: a short
        row gathers no pages up to a long row's reach (BENCHMARKS.md, decisions). The reach comes
        from the step's host inputs (`_launch`): a decoding row's position + 1;
        idle rows (prefilling, or free) write to the scratch column, their output dropped: 1."""
        host = self.network.host_inputs.numpy()
        positions, advancing = host[1, :batch].tolist(), host[2, :batch].tolist()
        reach = [position + 1 if advance else 1 for position, advance in zip(positions, advancing, strict=True)]
        buckets = length_buckets(self.context)
        grouped: dict[int, list[int]] = {}
        for i, columns in enumerate(reach):
            grouped.setdefault(bucket(columns, buckets), []).append(i)
        if len(grouped) == 1:
            return None
        return [
            (torch.tensor(members, device=self.device), max(reach[i] for i in members)) for members in grouped.values()
        ]

    def _finish(self, launched: Launch) -> None:
        """After a step's forward pass, on the device, written over its greedy tokens: the tokens
        of its constrained rows under their masks (argmax, or drawn) and of its sampled rows;
        then, with graphs, feed the next step on the device and start copying the tokens to the host."""
        for draw in (False, True):  # constrained rows: greedy ones, then sampled ones
            rows = [i for i in launched.masked if self.rows[i].sampled == draw]
            # A lazy tool grammar not armed yet masks nothing: its row takes the plain greedy
            # token (already there) or a plain draw, with no mask copied or applied.
            dormant = [i for i in rows if not self.rows[i].chooser.matcher.constrains()]
            if dormant:
                rows = [i for i in rows if i not in dormant]
                if draw:
                    launched.greedy.index_copy_(0, *self.draws.draw(dormant, launched.logits))
            if rows:
                index, packed = self.draws.masks_to_device(rows)
                allowed = unpack_on_device(packed, self.weights.decodable)
                if draw:
                    launched.greedy.index_copy_(0, *self.draws.draw(rows, launched.logits, allowed))
                else:
                    scores = launched.logits[index, : self.weights.decodable].masked_fill(~allowed, float("-inf"))
                    launched.greedy.index_copy_(0, index, scores.argmax(dim=-1))
        if launched.sampled:
            launched.greedy.index_copy_(0, *self.draws.draw(launched.sampled, launched.logits))
        if not self.use_graphs:
            return
        batch, greedy = launched.batch, launched.greedy
        # Feed the next step on the device: its tokens are these greedy ones, one position on.
        self.network.inputs[0, :batch].copy_(greedy)
        self.network.inputs[1, :batch].add_(self.network.inputs[2, :batch])
        buffer = self._greedy_host[self._flip][:batch]  # two buffers: one may still be read
        self._flip ^= 1
        buffer.copy_(greedy, non_blocking=True)
        if self.device.type == "cuda":
            launched.done = torch.cuda.Event()
            launched.done.record()
        launched.greedy = buffer
