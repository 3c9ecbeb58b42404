"""Paged KV for the batched Torch decoder (issue 30): the keys and values of every sequence live in
pages of PAGE positions taken from one pool, and a table says which pages hold each row's
columns. vLLM's PagedAttention keeps its cache this way: memory follows what sequences hold, not
what the longest one could reach, so a GPU holds hundreds of short sequences where full-context
slots held a hundred, and a sequence leaving frees pages instead of moving rows.

Layout, per layer, keys and values alike: [kv_heads, pages, PAGE, head_dim] (heads outermost: a
row's pages gathered for one head are contiguous, `read`). The table is [rows, width] of page
ids (width: enough pages for every column 0..context). Page 0 is the scratch page: every entry a
row does not hold points at it, so idle rows, the padding of a padded prefill and the scratch
column (position `context`) write there, and nothing reads it as a sequence's own column.

Pages are shared: the prompt cache keeps the pages of stored prompts (`keep`), and a prompt that
starts as a stored one takes them into its own table (`assign`'s `shared`) instead of copies; a
page goes back to the pool once no row and no cache entry holds it. A row only ever writes the
positions past what it shares, so a shared page is never written: the page where a reused prefix
ends part-way is copied (`copy_page`), as vLLM shares only full blocks.

A row takes the pages of everything it may reach (prompt and max_tokens) when it is admitted
(`assign`), so a running sequence never waits for memory and none is preempted; admission waits
instead (the engine asks `fits`). The pool's most pages (`most_pages`: the budget's) are laid out
once and never copied: on a GPU allocated whole (CUDA graphs hold its address); on the CPU as
address space that the system backs with memory only where a page is first written (an anonymous
mapping), so that the memory follows what sequences use. There the pool's extent grows with what
rows take and shrinks once it holds over twice what its sequences use (`resize`): the pages held
past the new end move below it and the memory past it goes back to the system.
"""

from __future__ import annotations

import math
import mmap
import os

import torch

from backends.contract import KvCacheUsage

PAGE = 16  # positions a page: the Triton decode kernel's column block (triton_attention.ATTENTION)


def pages_for(columns: int) -> int:
    return -(-columns // PAGE)


class PagedKV:
    def __init__(
        self,
        layers: int,
        kv_heads: int,
        head_dim: int,
        dtype,
        device,
        rows: int,
        context: int,
        pages: int,
        most_pages: int | None = None,
        whole: bool | None = None,
    ):
        """A pool of `pages` pages (the scratch page included) for `rows` rows of up to
        `context` + 1 columns each, which may grow to `most_pages` (default `pages`); `whole`
        (default: off the CPU), it is `most_pages` pages from the start, allocated."""
        self.layers, self.kv_heads, self.head_dim = layers, kv_heads, head_dim
        self.dtype, self.device = dtype, device
        self.page_bytes = 2 * layers * kv_heads * PAGE * head_dim * dtype.itemsize
        self.width = pages_for(context + 1)
        self.table = torch.zeros(rows, self.width, dtype=torch.long, device=device)
        self.held: list[list[int]] = [[] for _ in range(rows)]  # each row's pages, on the host
        # How many rows, and how many cache entries, hold each page (by page id); and the cache's
        # page lists (`keep`), by id(list), which a shrink renumbers in place.
        self.row_refs: list[int] = []
        self.kept_refs: list[int] = []
        self.kept: dict[int, list[int]] = {}
        self.row_pages = 0  # pages that some row holds
        self.grows = device.type == "cpu" if whole is None else not whole
        assert not self.grows or device.type == "cpu", "a pool grows only in the CPU's memory"
        self.most_pages = max(most_pages or pages, pages, 1)
        # Keys and values of every layer: [2, layers, kv_heads, most_pages, PAGE, head_dim]. Each
        # layer's k and v are its whole (contiguous) part, `most_pages` pages of which the tables
        # name only the first `pages`: on the CPU a view of fewer pages is not contiguous, and
        # index_select and index_put on it copied the layer first (BENCHMARKS.md, decisions).
        self._region: mmap.mmap | None = None
        if self.grows:
            self._whole = self._reserve((2, layers, *self._shape(self.most_pages)))
        else:
            self._whole = torch.zeros(2, layers, *self._shape(self.most_pages), dtype=dtype, device=device)
            pages = self.most_pages
        self.k: list[torch.Tensor] = list(self._whole[0].unbind())
        self.v: list[torch.Tensor] = list(self._whole[1].unbind())
        self.pages = 0
        self.free: list[int] = []  # a stack: the pages freed last are taken first (the CPU's are warm)
        self.peak_pages = 0
        self._gather_buffers: tuple[torch.Tensor, torch.Tensor] | None = None  # `gathered`'s, on the CPU
        self.resize(pages)

    @property
    def whole(self) -> torch.Tensor:
        """Every layer's keys and values, [2, layers, kv_heads, most_pages, PAGE, head_dim] (the CPU step's)."""
        return self._whole

    # -- pages -----------------------------------------------------------------------------------

    @property
    def held_pages(self) -> int:
        return self.pages - 1 - len(self.free)

    @property
    def nbytes(self) -> int:
        return self.pages * self.page_bytes

    def assign(self, row: int, columns: int, shared: list[int] = ()) -> None:
        """Give `row` (which holds none) the pages of `columns` columns from 0: `shared` (pages
        that hold a stored prefix, which the row will not write) first, then free ones; the
        caller has made sure that the pool has them (`resize`)."""
        n = pages_for(columns)
        assert not self.held[row] and len(shared) <= n <= len(self.free) + len(shared) and n <= self.width
        taken = [*shared, *(self.free.pop() for _ in range(n - len(shared)))]
        for page in taken:
            if self.row_refs[page] == 0:
                self.row_pages += 1
            self.row_refs[page] += 1
        self.held[row] = taken
        self.table[row, :n].copy_(self._longs(taken), non_blocking=True)

    def release(self, rows: list[int]) -> None:
        """Give up these rows' pages (each goes back to the pool unless another row or the cache
        holds it); their table rows point at the scratch page."""
        for row in rows:
            for page in reversed(self.held[row]):
                self.row_refs[page] -= 1
                if self.row_refs[page] == 0:
                    self.row_pages -= 1
                    if self.kept_refs[page] == 0:
                        self.free.append(page)
            self.held[row] = []
        if rows:
            self.table.index_fill_(0, self._longs(rows), 0)

    def keep(self, pages: list[int]) -> list[int]:
        """Hold `pages` for the prompt cache: a list of them that stays valid (a shrink renumbers
        it in place) until `drop`."""
        kept = list(pages)
        for page in kept:
            self.kept_refs[page] += 1
        self.kept[id(kept)] = kept
        return kept

    def drop(self, kept: list[int]) -> None:
        del self.kept[id(kept)]
        for page in reversed(kept):
            self.kept_refs[page] -= 1
            if self.kept_refs[page] == 0 and self.row_refs[page] == 0:
                self.free.append(page)

    def copy_page(self, source: int, target: int) -> None:
        """Page `target` holds what `source` does, in every layer (a shared prefix that ends
        part-way into a page: the row writes the rest of its copy)."""
        # One copy for every layer (one kernel on a GPU, not a launch a layer, in a prompt cache
        # hit's first token: BENCHMARKS.md, decisions).
        self._whole[:, :, :, target] = self._whole[:, :, :, source]

    def move(self, targets: list[int], sources: list[int]) -> None:
        """Rows `sources` become rows `targets` (which hold nothing): a table copy, no KV copy."""
        if not targets:
            return
        target, source = self._longs(targets), self._longs(sources)
        self.table.index_copy_(0, target, self.table.index_select(0, source))
        self.table.index_fill_(0, source, 0)
        for t, s in zip(targets, sources, strict=True):
            self.held[t], self.held[s] = self.held[s], []

    def resize(self, pages: int) -> None:
        """The pool's first `pages` pages (within `most_pages`), the held ones kept at their ids;
        shrinking first moves the pages held past the new end into free ones below it (and their
        table entries) and gives the memory past it back. Nothing is copied or zeroed: the pages
        a row takes hold zeros (never written, or given back) or what an earlier row wrote, which
        it writes before it reads them unmasked."""
        pages = max(pages, 1)
        assert pages <= self.most_pages and (self.grows or not self.pages)
        if pages < self.pages:
            self._compact(pages)
            self._gather_buffers = None  # sequences left: the next gather sizes them again
            self._give_back(pages)
        if pages > self.pages:
            self.free = list(range(pages - 1, max(self.pages, 1) - 1, -1)) + self.free
            grown = pages - len(self.row_refs)
            self.row_refs += [0] * grown
            self.kept_refs += [0] * grown
        else:
            self.free = [page for page in self.free if page < pages]
            del self.row_refs[pages:], self.kept_refs[pages:]
        self.pages = pages
        self.peak_pages = max(self.peak_pages, pages)

    def _reserve(self, shape: tuple[int, ...]) -> torch.Tensor:
        """A zeroed CPU tensor of `shape` whose memory is taken only where it is written: an
        anonymous private mapping (the system backs a page with zeros when it is first touched),
        without transparent huge pages (one 2 MB page a (layer, head) where a few KB are used).
        Growing a pool by copies instead held the worker for seconds (the copy, and zeroing memory
        backed on first touch) while a short prompt's admission waited (BENCHMARKS.md,
        decisions). Where there is no such mapping (not POSIX), the tensor is allocated zeroed,
        whole."""
        size = math.prod(shape) * self.dtype.itemsize
        if os.name != "posix":
            return torch.zeros(shape, dtype=self.dtype)
        self._region = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE)
        if hasattr(mmap, "MADV_NOHUGEPAGE"):
            self._region.madvise(mmap.MADV_NOHUGEPAGE)
        # The tensor holds the mapping (a buffer export) for as long as it lives.
        return torch.frombuffer(self._region, dtype=torch.uint8).view(self.dtype).view(shape)

    def _give_back(self, pages: int) -> None:
        """The memory of pages `pages`.. of every (layer, head) goes back to the system (Linux's
        MADV_DONTNEED: they read as zeros after; elsewhere advice only)."""
        if self._region is None or not hasattr(mmap, "MADV_DONTNEED"):
            return
        page = PAGE * self.head_dim * self.dtype.itemsize  # one head's page, in bytes
        stripe = self.most_pages * page  # one (k or v, layer, head)'s pages
        system = mmap.PAGESIZE
        for i in range(2 * self.layers * self.kv_heads):
            start = -(-(i * stripe + pages * page) // system) * system
            end = (i + 1) * stripe // system * system
            if end > start:
                self._region.madvise(mmap.MADV_DONTNEED, start, end - start)

    def _longs(self, values: list[int]) -> torch.Tensor:
        """Ids for the table, on its device without a wait: a plain host tensor's copy to a GPU
        waits for the work queued before it (a decode step in flight), pinned memory's does not
        (torch's pinned allocator keeps the block until its copy has run)."""
        if self.device.type != "cuda":
            return torch.tensor(values, dtype=torch.long)
        return torch.tensor(values, dtype=torch.long, pin_memory=True).to(self.device, non_blocking=True)

    def _shape(self, pages: int) -> tuple[int, int, int, int]:
        return (self.kv_heads, pages, PAGE, self.head_dim)

    def _compact(self, pages: int) -> None:
        low = sorted(page for page in self.free if page < pages)
        low.reverse()  # popped from the end: lowest first
        moves: dict[int, int] = {}
        for held in [*self.held, *self.kept.values()]:  # in place: the cache's lists see the move
            for i, page in enumerate(held):
                if page >= pages:
                    if page not in moves:  # a shared page moves once
                        moves[page] = low.pop()
                    held[i] = moves[page]
        if not moves:
            return
        for old_page, new_page in moves.items():
            self.row_refs[new_page], self.row_refs[old_page] = self.row_refs[old_page], 0
            self.kept_refs[new_page], self.kept_refs[old_page] = self.kept_refs[old_page], 0
        old = torch.tensor(list(moves), device=self.device)
        new = torch.tensor(list(moves.values()), device=self.device)
        self._whole[:, :, :, new] = self._whole[:, :, :, old]  # every layer's keys and values at once
        for row, held in enumerate(self.held):
            if held:
                self.table[row, : len(held)].copy_(torch.tensor(held, dtype=torch.long))
        held = {page for pages_of in [*self.held, *self.kept.values()] for page in pages_of}
        self.free = [page for page in range(pages - 1, 0, -1) if page not in held]

    # -- keys and values -------------------------------------------------------------------------

    def where(self, rows: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(page, offset) of each (row, position), broadcast together."""
        return self.table[rows, positions // PAGE], positions % PAGE

    def write(self, layer: int, rows: torch.Tensor, positions: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
        """k and v [*S, kv_heads, head_dim] to the columns at (rows, positions) (both broadcast to S)."""
        page, offset = self.where(rows, positions)
        self.k[layer][:, page, offset] = k.movedim(-2, 0)
        self.v[layer][:, page, offset] = v.movedim(-2, 0)

    def read(self, layer: int, rows: torch.Tensor, span: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Columns 0..span-1 of `rows`, keys and values [n, kv_heads, span, head_dim] (a gather,
        `gathered`: contiguous for each (row, head) across its pages)."""
        pages = self.table[rows, : pages_for(span)]  # [n, p]
        n = pages.shape[0]
        keys, values = self.gathered(layer, pages.reshape(-1))
        return tuple(
            whole.view(self.kv_heads, n, -1, self.head_dim)[:, :, :span].transpose(0, 1) for whole in (keys, values)
        )

    def gathered(self, layer: int, pages: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The keys and values of `pages` (ids [n]) in that order, [kv_heads, n, PAGE, head_dim]
        each: on the CPU a view of the pool where the pages are consecutive, else a copy, by
        index_select of whole pages (faster on the CPU than indexing the pool with the table).
        On the CPU the copies go to two kept buffers, which the next call overwrites: there a
        fresh tensor of tens of MB cost more than the copy itself, in page faults (BENCHMARKS.md,
        decisions). The buffers keep the largest gather's size until the pool shrinks: at most
        one layer's keys and values for every row at full context."""
        k, v = self.k[layer], self.v[layer]
        if self.device.type != "cpu":
            return k.index_select(1, pages), v.index_select(1, pages)
        count = pages.numel()
        first = int(pages[0]) if count else 0
        if count > 1 and int(pages[-1]) == first + count - 1 and bool((pages.diff() == 1).all()):
            # Consecutive pages (a row alone in its pool takes them in order): a view, no copy.
            return k[:, first : first + count], v[:, first : first + count]
        shape = (self.kv_heads, count, PAGE, self.head_dim)
        size = math.prod(shape)
        if self._gather_buffers is None or self._gather_buffers[0].numel() < size:
            self._gather_buffers = None  # the old pair freed before the new one is taken
            self._gather_buffers = tuple(torch.empty(size, dtype=self.dtype) for _ in range(2))
        k_out, v_out = (buffer[:size].view(shape) for buffer in self._gather_buffers)
        return torch.index_select(k, 1, pages, out=k_out), torch.index_select(v, 1, pages, out=v_out)

    def read_columns(self, pages: list[int], start: int, end: int) -> torch.Tensor:
        """Columns start..end-1 held in `pages` (a row's, from column 0), every layer's keys and
        values as [2, layers, kv_heads, n, head_dim] on the host (a copy: the prompt cache's files)."""
        first = start // PAGE
        block = self._whole.index_select(3, self._longs(pages[first : (end - 1) // PAGE + 1]))
        return block.flatten(3, 4)[:, :, :, start - first * PAGE : end - first * PAGE].cpu()

    def write_columns(self, pages: list[int], kv: torch.Tensor) -> None:
        """Columns 0..n-1 of `pages` (a row's) take `kv` ([2, layers, kv_heads, n, head_dim]; the
        prompt cache's files): every layer in one write."""
        n = kv.shape[3]
        count = pages_for(n)
        padded = kv.new_zeros(*kv.shape[:3], count * PAGE, kv.shape[4])
        padded[:, :, :, :n] = kv
        shape = (*kv.shape[:3], count, PAGE, kv.shape[4])
        self._whole[:, :, :, self._longs(pages[:count])] = padded.view(shape).to(self.device, self.dtype)

    def columns_of(self, pages: list[int], start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Columns start..end-1 held in `pages` (a row's) in every layer, [layers, kv_heads, n,
        head_dim] each (a copy: for checks)."""
        positions = torch.arange(start, end, device=self.device)
        page, offset = self._longs(pages)[positions // PAGE], positions % PAGE
        return torch.stack([k[:, page, offset] for k in self.k]), torch.stack([v[:, page, offset] for v in self.v])


# The CPU's pool keeps at least this many pages when it shrinks (torch_model.MIN_LENGTH_BUCKET's).
MIN_PAGES = 128 // PAGE


class RowPages:
    """The decoder's page accounting: one pool laid out for the KV budget and the prompt cache's,
    which rows take pages from when they join (`take`) and the engine admits by (`fits`).

    The pool is laid out once for `kv_cache_bytes` (or a full-context row for each row) and the
    prompt cache's budget: on a GPU allocated whole (graphs hold its address), on the CPU as
    address space that memory backs where rows write, its extent grown and shrunk with use."""

    def __init__(
        self,
        layers: int,
        kv_heads: int,
        head_dim: int,
        dtype,
        device,
        rows: int,
        context: int,
        kv_cache_bytes: int | None,
        prompt_cache_bytes: int,
        whole: bool,
    ):
        self.per_position = 2 * layers * kv_heads * head_dim * dtype.itemsize
        self.budget = kv_cache_bytes
        self.context = context
        page_bytes = PAGE * self.per_position
        # The prompt cache keeps its pages in the same pool (it shares them with the rows that
        # reuse them): room for its budget besides the rows'.
        self.cache_pages = cache_pages(prompt_cache_bytes, page_bytes)
        full_rows = rows * pages_for(context + 1)
        rows_pages = int(kv_cache_bytes // page_bytes) - 1 if kv_cache_bytes else full_rows
        most_pages = 1 + rows_pages + self.cache_pages
        self.kv = PagedKV(
            layers,
            kv_heads,
            head_dim,
            dtype,
            device,
            rows,
            context,
            min(1 + MIN_PAGES, most_pages),  # on the CPU: its extent grows with what rows take
            most_pages,
            whole=whole,
        )

    def usage(self) -> KvCacheUsage:
        kv = self.kv
        # On a GPU the whole pool but the prompt cache's share is the budget: allocated at once,
        # in what KV_CACHE_BYTES allowed. Blocks count the cache's too (one pool).
        budget = self.budget or 0 if kv.grows else (kv.pages - self.cache_pages) * kv.page_bytes
        return KvCacheUsage(
            budget_bytes=budget,
            used_bytes=kv.row_pages * kv.page_bytes,
            reserved_bytes=kv.row_pages * kv.page_bytes,  # they take their pages when they join
            peak_bytes=kv.peak_pages * kv.page_bytes,
            bytes_per_token=self.per_position,
            allocated_bytes=kv.nbytes,
            block_tokens=PAGE,
            blocks=kv.pages - 1,
            blocks_used=kv.held_pages,
        )

    def columns(self, need: int) -> int:
        """The cache columns a sequence of `need` positions (its prompt and max_new_tokens) may
        use: its positions and one more that a last decode step may write."""
        return min(need + 1, self.context)

    def row_page_limit(self) -> int:
        """The most pages the rows may hold, the scratch page included: the pool's but the
        prompt cache's share."""
        return self.kv.most_pages - self.cache_pages

    def has_room_for(self, prompt_cache_bytes: int) -> bool:
        """Whether the pool has room for a prompt cache of that budget."""
        return cache_pages(prompt_cache_bytes, self.kv.page_bytes) <= self.cache_pages

    def cache_budget(self, prompt_cache_bytes: int) -> int:
        """Take a new prompt cache budget, cut to the room the pool was laid out with; the bytes
        taken."""
        if not self.has_room_for(prompt_cache_bytes):
            prompt_cache_bytes = self.cache_pages * self.kv.page_bytes
        self.cache_pages = cache_pages(prompt_cache_bytes, self.kv.page_bytes)
        return prompt_cache_bytes

    def fits(self, needs: list[int]) -> bool:
        """Whether new sequences of `needs` positions each have pages beside the held ones
        (counted whole: what they may share of stored prompts is not known yet)."""
        wanted = sum(pages_for(self.columns(n)) for n in needs)
        return 1 + self.kv.row_pages + wanted <= self.row_page_limit()

    def take(self, row: int, columns: int, shared: list[int] = ()) -> None:
        """Give a row the pages of `columns` columns, `shared` (a stored prefix's) first, the
        CPU's pool's extent grown for the rest (no copy)."""
        kv = self.kv
        short = pages_for(columns) - len(shared) - len(kv.free)
        if short > 0:
            if not kv.grows or kv.pages + short > kv.most_pages:
                raise RuntimeError("the KV pool is full")  # `fits` admits no sequence past it
            kv.resize(kv.pages + short)
        kv.assign(row, columns, shared)

    def shrink(self) -> None:
        """On the CPU, give memory back once the pool holds over twice what its sequences use."""
        if not self.kv.grows:
            return
        kv = self.kv
        enough = max(kv.held_pages, MIN_PAGES) + 1
        if kv.pages > 2 * enough:
            kv.resize(enough)


def cache_pages(prompt_cache_bytes: int, page_bytes: int) -> int:
    """The most pages the prompt cache keeps: its budget's."""
    return prompt_cache_bytes // page_bytes
