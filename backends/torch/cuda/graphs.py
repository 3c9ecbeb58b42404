"""When a pass of the batched decoder is replayed from a CUDA graph: the bucket tables that
shapes are rounded up to, and the capture and replay of the decode step (one graph per batch
bucket, and per attention-length bucket without the Triton kernels) and of padded prompt
pieces (one per rows x length x span). The passes themselves are backends/torch_model's,
handed in as callables: this room knows shapes, pools and streams, not what a pass computes.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

log = logging.getLogger("phi2_server.torch_decoder")

# The batch sizes that CUDA graphs are captured for (a batch runs in the next one up, its idle
# rows on the scratch page), up to the most rows MAX_BATCH's default takes (CUDA_BATCHES): a
# batch past the last was captured at its own size, tens of ms each (BENCHMARKS.md, decisions).
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 48, 64, 96, 128, 192, 256, 320, 384, 448, 512)
MIN_LENGTH_BUCKET = 128
# Prompt pieces prefilled on CUDA are padded to one of these lengths, and their group to a batch
# bucket, and replayed from a CUDA graph of that shape (`prefill_padded`): an eager prefill of a
# short prompt is hundreds of launches against a few ms of weights to read.
# - New prompts (from position 0): groups of up to PREFILL_GRAPH_TOKENS.
# - Pieces that continue cached columns (a stored prefix's tail: a chat's next turn; a long
#   prompt's last chunk) attend to the columns before them too (with the Triton kernels through
#   the page tables, else a gather and a mask): graphs for spans of CONTINUE_SPANS columns,
#   groups of up to CONTINUE_GRAPH_TOKENS (past that the pass is compute-bound and launches cost
#   little) and CONTINUE_GRAPH_COLUMNS (what a gather copies, or the kernel reads).
# Longer pieces, bigger groups and longer spans run eagerly. 512 is the piece a long prompt is cut
# into while streams decode (`prefill_chunk`): eager, its launches cost more than its GEMMs
# (BENCHMARKS.md, decisions).
PREFILL_LENGTHS = (16, 32, 64, 128, 256, 512)
PREFILL_GRAPH_TOKENS = 8192
CONTINUE_SPANS = (512, 2048, 8192)
CONTINUE_GRAPH_TOKENS = 1024
CONTINUE_GRAPH_COLUMNS = 16384

Pieces = list[tuple[int, list[int], int]]  # prompt pieces: (row, ids, first position)


def bucket(n: int, buckets) -> int:
    return next((b for b in buckets if b >= n), n)


def length_buckets(context: int) -> list[int]:
    """The attention-length buckets of a context: powers of two from MIN_LENGTH_BUCKET, and its
    whole length (context + 1 columns)."""
    n, buckets = MIN_LENGTH_BUCKET, []
    while n < context + 1:
        buckets.append(n)
        n *= 2
    return buckets + [context + 1]


def padded_rows() -> int:
    """The most rows a padded prefill graph takes: its buffers' (torch_model.Network.padded_buffers)."""
    return max(b for b in BATCH_BUCKETS if b * PREFILL_LENGTHS[0] <= PREFILL_GRAPH_TOKENS)


class Graphs:
    """The decode step's and the padded prefill's CUDA graphs, captured when a shape is first
    needed (or up front, `capture`) and replayed after.

    `decode(batch, span, lora)` and `padded(rows, length, span)` are the passes (reading their
    inputs from buffers); `load_padded(pieces, rows, length)` fills the padded pass's buffers and
    `idle_padded()` fills them with inputs that write only the scratch column; `uncompile()`
    takes the uncompiled decode block, False if it was not compiled. `apart`: prompt pieces run
    beside the decode steps (a stream of their own), so their graphs keep a pool and a capture
    stream of their own."""

    def __init__(
        self,
        decode: Callable,
        padded: Callable,
        load_padded: Callable,
        idle_padded: Callable,
        uncompile: Callable[[], bool],
        *,
        enabled: bool,
        prefill: bool,
        apart: bool,
        device,
        rows: int,
        context: int,
        windows,
    ):
        self.decode, self.padded, self.load_padded, self.idle_padded = decode, padded, load_padded, idle_padded
        self.uncompile = uncompile
        self.enabled = enabled  # with CUDA graphs (without, the same passes run eagerly)
        self.prefill = prefill  # prompt pieces padded to a graph's shape (eagerly without graphs)
        self.apart = apart
        self.device, self.rows, self.context, self.windows = device, rows, context, windows
        self.decode_graphs: dict[tuple[int, int, int], tuple[torch.cuda.CUDAGraph, tuple]] = {}
        self.padded_graphs: dict[tuple[int, int, int], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self._pool = None
        self._prefill_pool = None
        self._prefill_capture: torch.cuda.Stream | None = None  # the stream prefill graphs are captured on

    # -- the decode step ---------------------------------------------------------------------------

    def replay(self, batch: int, span: int, lora: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        key = (batch, span, lora)
        if key not in self.decode_graphs:
            try:
                self.decode_graphs[key] = self._capture_decode(batch, span, lora)
            except Exception:
                if not self.uncompile():
                    raise
                # torch.compile needs Triton and a C compiler; without them, serve uncompiled.
                log.exception("torch.compile failed: the decode step runs uncompiled")
                self._pool = None
                self.decode_graphs.clear()
                self.decode_graphs[key] = self._capture_decode(batch, span, lora)
        graph, out = self.decode_graphs[key]
        graph.replay()
        return out

    def drop_adapted(self) -> None:
        """Forget the decode graphs that read the adapters' buffers (replaced by new ones)."""
        self.decode_graphs = {key: graph for key, graph in self.decode_graphs.items() if key[2] == 0}

    def _capture_decode(self, batch: int, span: int, lora: int = 0):
        captured = self._capture(lambda: self.decode(batch, span, lora), warmups=2)
        log.info(
            "captured a decode step for batch %d, attention length %d%s", batch, span, " with adapters" if lora else ""
        )
        return captured

    # -- padded prompt pieces ------------------------------------------------------------------------

    def padded_shape(self, pieces: Pieces, every_position, adapters: list[int], long_rope) -> tuple | None:
        """The (rows, length, span) graph shape that these pieces are prefilled in, padded, or
        None (eagerly, as they are). `span`: 0 for new prompts, from position 0 (causal over
        their own columns); else the columns that pieces after cached columns attend to,
        bucketed. Only pieces with no adapter, no prompt logprobs and no longrope factors."""
        if not self.prefill or every_position or (long_rope and any(long_rope)):
            return None
        if max(adapters) >= 0:
            return None
        rows = bucket(len(pieces), BATCH_BUCKETS)
        length = bucket(max(len(ids) for _, ids, _ in pieces), PREFILL_LENGTHS)
        span = self.span(pieces)
        return (rows, length, span) if self.graphable(rows, length, span) else None

    @staticmethod
    def span(pieces: Pieces) -> int:
        """0 for new prompts only; else the columns the pieces reach, in a CONTINUE_SPANS bucket."""
        if not any(start for _, _, start in pieces):
            return 0
        return bucket(max(start + len(ids) for _, ids, start in pieces), CONTINUE_SPANS)

    def graph_rows(self, pieces: Pieces) -> int:
        """The most of these pieces that one prefill graph takes (0: none)."""
        longest = max(len(ids) for _, ids, _ in pieces)
        if not self.prefill or longest > PREFILL_LENGTHS[-1]:
            return 0
        length, span = bucket(longest, PREFILL_LENGTHS), self.span(pieces)
        return max((rows for rows in BATCH_BUCKETS if self.graphable(rows, length, span)), default=0)

    def graphable(self, rows: int, length: int, span: int = 0) -> bool:
        """Whether a prefill graph of rows x length (after cached columns: attending to `span`)
        exists: buckets, within the group limits and the cache; new prompts' with no sliding
        window shorter than the length (theirs is plain causal attention, no mask)."""
        if span:
            fits = (
                span in CONTINUE_SPANS
                and span <= self.context
                and rows * length <= CONTINUE_GRAPH_TOKENS
                and rows * span <= CONTINUE_GRAPH_COLUMNS
            )
        else:
            fits = rows * length <= PREFILL_GRAPH_TOKENS and not any(w is not None and w < length for w in self.windows)
        return fits and rows in BATCH_BUCKETS and length in PREFILL_LENGTHS and length <= self.context

    def prefill_padded(self, pieces: Pieces, rows: int, length: int, span: int) -> torch.Tensor:
        """The last-token logits of prompt pieces, prefilled together padded to rows x length
        (`load_padded` says where the padding writes): from a graph, or eagerly without graphs."""
        if self.enabled and (rows, length, span) not in self.padded_graphs:
            self.padded_graphs[rows, length, span] = self._capture_padded(rows, length, span)
        self.load_padded(pieces, rows, length)
        if not self.enabled:
            return self.padded(rows, length, span)[: len(pieces)]
        graph, logits = self.padded_graphs[rows, length, span]
        graph.replay()
        return logits[: len(pieces)].clone()  # the graph's output is written over by its next replay

    def _capture_padded(self, rows: int, length: int, span: int):
        """A CUDA graph of the padded pass at its shape, captured with inputs that write only the
        scratch column (captures may happen between requests' steps)."""
        self.idle_padded()
        return self._capture(lambda: self.padded(rows, length, span), warmups=1, prefill=True)

    # -- capture -------------------------------------------------------------------------------------

    def _capture(self, run, warmups: int, prefill: bool = False):
        """(a CUDA graph of `run`, its output), in the graphs' shared memory pool (the prefill
        graphs in one of their own when they run beside the decode steps: graphs that share a
        pool must not run at once); `run` runs `warmups` times first, outside the capture, for
        its kernels and workspaces."""
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(warmups):
                run()
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        apart = prefill and self.apart
        if apart:
            # Captured on a stream of their own as well: cuBLAS's workspace is the capturing
            # stream's, and two graphs running at once must not share one.
            if self._prefill_capture is None:
                self._prefill_capture = torch.cuda.Stream(self.device)
            capturing = torch.cuda.graph(graph, pool=self._prefill_pool, stream=self._prefill_capture)
        else:
            capturing = torch.cuda.graph(graph, pool=self._pool)
        with capturing:
            out = run()
        if apart:
            self._prefill_pool = graph.pool()
        else:
            self._pool = graph.pool()
        return graph, out

    @torch.inference_mode()
    def capture(self, fused: bool, spans=(MIN_LENGTH_BUCKET, 2 * MIN_LENGTH_BUCKET)) -> None:
        """Capture the decode graphs that short requests use, before the first request needs them,
        and every padded prefill graph (`fused`: the decode step reads any length, one graph a
        batch)."""
        if not self.enabled:
            return
        for batch in BATCH_BUCKETS:
            if batch > self.rows:
                break
            for span in (0,) if fused else spans:
                self.replay(batch, min(span, self.context + 1))
        if self.prefill:
            for span in (0, *CONTINUE_SPANS):
                for rows in BATCH_BUCKETS:
                    for length in PREFILL_LENGTHS:
                        shape = rows, length, span
                        if rows <= self.rows and self.graphable(*shape) and shape not in self.padded_graphs:
                            self.padded_graphs[shape] = self._capture_padded(*shape)
            log.info(
                "captured %d prefill graphs: %d for new prompts, %d for pieces after cached columns",
                len(self.padded_graphs),
                sum(1 for _, _, span in self.padded_graphs if not span),
                sum(1 for _, _, span in self.padded_graphs if span),
            )
