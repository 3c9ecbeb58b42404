"""Prompts into the batched decoder: which prompt pieces a step prefills (the per-step token
budget, shared between a long prompt and short ones arriving behind it), in which passes
(prompts of like length together, padded to a graph's shape where one exists), launched on
the stream beside the decode steps or not, and read back as logits: the first tokens are drawn
by the decoder (backends/torch/decoder.py), not here.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import nullcontext

import torch

from backends.torch.cuda.graphs import PREFILL_GRAPH_TOKENS, PREFILL_LENGTHS, Graphs, Pieces
from backends.torch.network import Network, decode_block

# A new prompt of up to this many tokens is prefilled whole from a graph even where a stored
# prefix would shorten it (its tail would cost about as much); a longer one continues the prefix.
WHOLE_FROM_GRAPH = 256


class InFlight:
    """Prompt pieces launched and not yet read: each pass's pieces (row, ids, first position),
    last-position logits and every-position logits; `beside`: launched before a decode step, to
    be read once done (the decoder's `_step`); on CUDA, `side` is the stream they run on, and
    `done` the event that marks their end (on the CPU they are done once launched)."""

    def __init__(self, side, beside: bool = False):
        self.side = side
        self.beside = beside
        self.passes: list[tuple[list[tuple[object, list[int], int]], torch.Tensor, dict]] = []
        self.done: torch.cuda.Event | None = None

    def ready(self) -> bool:
        return self.done is None or self.done.query()

    def rows(self) -> list:
        """The decoder's `Row`s these pieces are for (rows move as sequences leave)."""
        return [row for group, _, _ in self.passes for row, _, _ in group]


class Prefill:
    """Plans and launches prompt pieces for the decoder's `rows` (its list of `Row`s, shared):
    up to `chunk` prompt tokens a step, or, with `overlap` (on CUDA with graphs), up to
    `overlap_budget` tokens in pieces of `chunk` on a stream of their own (`side`) while the
    decode steps run."""

    def __init__(
        self, rows: list, network: Network, graphs: Graphs, chunk: int, overlap: bool, context: int, alone: int = 0
    ):
        self.rows = rows
        self.network = network
        self.graphs = graphs
        self.chunk = chunk
        # Eager passes with no row decoding (nobody waits on the step but new arrivals): up to
        # this many prompt tokens a step, where bigger passes cost less a token.
        self.alone = max(chunk, alone)
        self.overlap = overlap
        # The most prompt tokens launched beside the steps at once (`start`).
        self.overlap_budget = max(chunk, min(context, PREFILL_GRAPH_TOKENS))
        self.context = context
        self.side = torch.cuda.Stream(network.device) if overlap and network.device.type == "cuda" else None

    def long_prompt(self, prompt: list[int]) -> bool:
        return self.network.long_prompts_from is not None and len(prompt) > self.network.long_prompts_from

    @torch.inference_mode()
    def run(
        self,
        pieces: Pieces,
        every_position: list[int] = (),
        lora_rows: list[int] | None = None,
        long_rope: list[bool] | None = None,
        draft: bool = False,
    ) -> tuple[torch.Tensor, dict]:
        """Run prompt pieces (row, ids, first position) through the model, padded to the longest,
        from a graph where one has their shape; write their keys and values to their rows;
        return each piece's last-token logits, and {piece: the logits of each of its positions}
        for the pieces in `every_position`. `lora_rows`: each piece's adapter slot (default:
        its row's). `draft`: the pieces verify a draft (`Network.prefill`)."""
        if lora_rows is None:
            lora_rows = [self.rows[i].lora_index for i, _, _ in pieces]
        shape = self.graphs.padded_shape(pieces, every_position, lora_rows, long_rope)
        if shape is not None:
            return self.graphs.prefill_padded(pieces, *shape), {}
        return self.network.prefill(pieces, every_position, lora_rows, long_rope, draft)

    def whole_from_graph(self, row: int, prompt: list[int], lora_index: int) -> bool:
        """Whether a new prompt is short enough to prefill whole from a graph, even where a
        stored prefix would shorten it (its tail would cost about as much: no reuse)."""
        return (
            len(prompt) <= WHOLE_FROM_GRAPH
            and self.graphs.padded_shape([(row, prompt, 0)], (), [lora_index], [self.long_prompt(prompt)]) is not None
        )

    # -- planning ------------------------------------------------------------------------------------

    def passes(self, overlap: bool) -> list[Pieces]:
        """The passes of prompt pieces (row, ids, first position) to launch now (`start`): up to
        `chunk` prompt tokens (shared as `takes` says), prompts of like length together in one
        padded pass (many clients arriving at once: a few passes, not one each); none if no
        prompt waits. With `overlap` (streams decode meanwhile), on the side stream, where the
        decode steps that follow run beside the passes instead of after them: then up to
        `overlap_budget` tokens, in pieces of `chunk`, queued one after another (one piece a
        step left an arriving prompt a step's wait a piece: BENCHMARKS.md, decisions)."""
        budget, piece = self.chunk, None
        if overlap:
            budget, piece = self.overlap_budget, self.chunk
        elif not any(row.next_token is not None for row in self.rows):
            if self.network.use_graphs:
                budget = max(budget, self.context)  # no stream waits on this step: whole prompts, one pass each
            else:
                budget = self.alone
        parts = []  # (row, the prompt ids to process now, their first position)
        order = []  # each part's place among its row's pieces
        for i, take in self.takes(budget).items():
            row = self.rows[i]
            for k, at in enumerate(range(row.cached, row.cached + take, piece or take)):
                end = min(at + (piece or take), row.cached + take)
                parts.append((i, row.sequence.prompt_ids[at:end], at))
                order.append(k)
        if not parts:
            return []
        groups: dict[tuple[int, bool, int], list] = {}
        for k, part in zip(order, parts, strict=True):  # padding to the longest in a group wastes at most half of it
            # New prompts apart from pieces that continue cached columns: those attend to more
            # columns, through a mask, which new ones need not. A prompt's later pieces in
            # passes after its earlier ones': they attend to what those write.
            groups.setdefault((k, part[2] == 0, len(part[1]).bit_length()), []).append(part)
        passes = []
        for key in sorted(groups, key=lambda key: key[0]):
            group = groups[key]
            # In as many rows as one prefill graph takes (512 new prompts arriving at once: two
            # graphed passes of 256 rather than one eager pass).
            size = self.graphs.graph_rows(group)
            passes += [group[k : k + size] for k in range(0, len(group), size)] if size else [group]
        return passes

    def takes(self, budget: int) -> dict[int, int]:
        """How many prompt tokens each waiting row prefills this step, within `budget`: with
        others waiting, the oldest prompt takes up to half of it first; then the prompts with the
        fewest tokens left take what remains, fewest first (like ones in arrival order). A short
        prompt that arrives behind a long one waits a step or two, not for all of the long one's
        pieces; the oldest still gets at least half of every step's budget, so prompts that keep
        arriving cannot hold it back, and like prompts arriving together are prefilled first
        come, first served."""
        waiting = sorted(
            (i for i, row in enumerate(self.rows) if row.next_token is None), key=lambda i: self.rows[i].arrival
        )
        rest = {i: len(self.rows[i].sequence.prompt_ids) - self.rows[i].cached for i in waiting}

        def whole(i: int) -> bool:
            # A new prompt that a graph prefills whole is not cut: its second piece would be a
            # pass of its own (BENCHMARKS.md, decisions).
            return self.graphs.prefill and self.rows[i].cached == 0 and rest[i] <= PREFILL_LENGTHS[-1]

        takes = {}
        if len(waiting) > 1:
            oldest = waiting[0]
            takes[oldest] = rest[oldest] if whole(oldest) and rest[oldest] <= budget else min(rest[oldest], budget // 2)
            budget -= takes[oldest]
        for i in sorted(waiting, key=lambda i: rest[i] - takes.get(i, 0)):  # a stable sort: arrival order among like
            left = rest[i] - takes.get(i, 0)
            if budget <= 0:
                break
            if not left or (left > budget and takes and whole(i)):
                continue  # (a prompt cut short waits for a later step)
            take = min(left, budget)
            takes[i] = takes.get(i, 0) + take
            budget -= take
        return {i: take for i, take in takes.items() if take}

    def fusable(self, passes: list[Pieces], decoding: bool) -> Pieces | None:
        """The prompt pieces of a step that go through one pass with its decode rows
        (`Network.mixed_step`), or None. On the CPU, eager and plain: one pass reads the weights
        once for both (BENCHMARKS.md, decisions). With no row decoding, only pieces that would
        take several passes (a long prompt's next piece and short prompts sharing the step,
        `takes`). Not with adapters, prompt logprobs or longrope's long factors (their passes
        differ)."""
        network = self.network
        if network.use_graphs or network.fused or self.graphs.prefill or network.layer is not decode_block:
            return None  # (graphs.prefill: CUDA's padded passes, which tests run on the CPU too)
        if not passes or not (decoding or len(passes) > 1):
            return None
        pieces = [part for group in passes for part in group]
        if len({row for row, _, _ in pieces}) < len(pieces):  # a row's later pieces read its earlier ones'
            return None
        for row, _, _ in pieces:
            sequence = self.rows[row].sequence
            if sequence.prompt_logprobs is not None or self.long_prompt(sequence.prompt_ids):
                return None
        if any(row.lora_index >= 0 for row in self.rows):
            return None
        return pieces

    # -- launch and read -----------------------------------------------------------------------------

    def start(self, passes: list[Pieces], overlap: bool) -> InFlight:
        """Launch `passes` (`passes`), on the side stream with `overlap`."""
        side = self.side if overlap else None
        if side is not None:
            side.wait_stream(torch.cuda.current_stream())  # the pages and tables as the host left them
        launched = InFlight(side, beside=overlap)
        with torch.cuda.stream(side) if side is not None else nullcontext():
            for group in passes:
                scored = [r for r, (i, _, _) in enumerate(group) if self.rows[i].sequence.prompt_logprobs is not None]
                logits, every = self.run(
                    group,
                    every_position=scored,
                    long_rope=[self.long_prompt(self.rows[i].sequence.prompt_ids) for i, _, _ in group],
                )
                launched.passes.append(([(self.rows[i], ids, start) for i, ids, start in group], logits, every))
            if side is not None:
                launched.done = torch.cuda.Event()
                launched.done.record(side)
        return launched

    def read(self, launched: InFlight, first_tokens: Callable[..., dict[int, int]]) -> dict[int, int]:
        """Read launched prompt pieces (waiting for them if need be): each pass's (pieces, logits,
        every-position logits) goes to `first_tokens` (the decoder's), on the stream they ran on;
        what it produced, merged."""
        side = launched.side
        if side is not None:
            launched.done.synchronize()  # on an event: the GIL is free meanwhile
            torch.cuda.current_stream().wait_stream(side)  # decode steps read what the pieces wrote
        produced = {}
        with torch.cuda.stream(side) if side is not None else nullcontext():
            for group, logits, every in launched.passes:
                produced.update(first_tokens(group, logits, every))
        return produced

    def after(self, launched: InFlight | None) -> None:
        """The device's next work on this stream waits for pieces in flight (no wait on the
        host): before their rows' pages or table rows change, or buffers that they read."""
        if launched is not None and launched.side is not None:
            torch.cuda.current_stream().wait_stream(launched.side)
