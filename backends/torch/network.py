"""What the network computes, for the batched decoder (backends/torch/decoder.py): a block's math
over the weights as backends/torch/weights.py fuses them, and the forward passes over the paged
KV cache (backends/kv_pages) that `Network` runs: prompt pieces (`prefill`, `padded_pass`), the
decode step (`decode_step` in torch ops, `fused_step` with the Triton kernels of
backends/torch/cuda/triton_*.py), a decode step with prompt pieces riding along (`mixed_step`, the CPU's)
and the logits. When a pass is replayed from a CUDA graph is backends/torch_graphs'.

One network for every family: what differs between them (the norm, a parallel or a sequential
block, a gated MLP or not, grouped key-value heads, biases, q/k norms, sliding windows, the rotary
embedding's part of a head and its scaling) is read from the model's config into an
`Architecture`, and each pass branches on those facts, never on a family's name.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from functools import partial

import torch
import torch.nn.functional as F

from backends.files.architecture import GELU_TANH, Architecture
from backends.torch.cpu import step as cpu_step
from backends.torch.cuda.graphs import PREFILL_LENGTHS, padded_rows
from backends.torch.hybrid import RowStates, decode_mix, piece_mix
from backends.torch.kv_pages import PAGE, PagedKV
from backends.torch.lora import FusedLoraSlots
from backends.torch.quant.blocks import BlockWeight, StackedBlocks
from backends.torch.quant.methods import QuantizedWeight, linear
from backends.torch.weights import Block, DecoderWeights, Shape

log = logging.getLogger("phi2_server.torch_decoder")

# Prefill of one piece after cached columns (a prompt continuing a stored prefix, or a chunk of a
# long one), on CUDA: from this many tokens, bottom-right causal attention (flash); shorter
# pieces, an explicit mask (memory-efficient kernel), or with the Triton kernels the paged
# attention kernel, which reads the row's blocks in place. Each was the faster on its side of
# this length (BENCHMARKS.md, decisions); between 512 and 1,050 it was not measured.
LOWER_RIGHT_FROM = 768


def prefill_attention():
    """The attention kernels prefill may use on CUDA: not cuDNN's, which builds an execution plan
    for every new (query, key) length, and a prompt continuing a cached prefix has a new one
    each time: a chat's next turn paid that plan on every layer (BENCHMARKS.md, decisions)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH])


def fused_available(weights: DecoderWeights, on_cuda_graphs: bool) -> bool:
    """The Triton step serves unquantized weights on CUDA, where Triton is installed, for the
    shapes its kernels know: one rotary table on every layer, a silu-gated MLP, no norms after
    attention or the MLP (Gemma 3 and SmolLM3 take the torch-ops step, graphed)."""
    arch = weights.arch
    if (
        not on_cuda_graphs
        or isinstance(weights.layers[0].w_in, QuantizedWeight)
        or not (arch.parallel or arch.rms_norm)
        or not triton_shape(arch)
    ):
        return False
    try:
        from backends.torch.cuda import triton_check
    except ImportError:
        log.warning("Triton is not installed: the CUDA decode step runs without its fused kernels")
        return False
    w = weights
    return triton_check.works(
        w.device, w.embed.dtype, heads_of(arch), w.hidden, w.inner, arch.parallel, arch.qk_norm, arch.gated
    )


def triton_shape(arch: Architecture) -> bool:
    """Whether the Triton kernels compute this architecture: what they do not know is Gemma 3's
    (two rotary tables, GeGLU, norms after attention and the MLP) and SmolLM3's NoPE layers."""
    one_table = set(arch.rope_kinds) == {"default"}
    silu = arch.parallel or arch.activation not in GELU_TANH
    return one_table and silu and arch.norm_offset == 0 and arch.embed_scale is None and arch.logit_softcap is None


def heads_of(arch: Architecture):
    """The attention's facts as the Triton kernels take them."""
    from backends.torch.cuda.triton_common import Heads

    return Heads(arch.heads, arch.kv_heads, arch.head_dim, arch.rotary_dim, arch.eps)


def rope_(x: torch.Tensor, cos: torch.Tensor | None, signed_sin: torch.Tensor, rotary_dim: int) -> None:
    """Rotary embedding, in place, on the first `rotary_dim` dims of each head of x ([..., heads, head_dim]);
    none where cos is None (a layer without rotary embeddings: SmolLM3's NoPE layers).

    transformers computes x*cos + rotate_half(x)*sin with rotate_half(x) = [-x2, x1]; that is
    roll(x, half) * [-1.., 1..], so the sign is folded into the sin table: three kernels."""
    if cos is None:
        return
    rot = x[..., :rotary_dim]
    rolled = rot.roll(rotary_dim // 2, dims=-1)
    rot.copy_(torch.addcmul(rot * cos, rolled, signed_sin))


def norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, eps: float, rms: bool) -> torch.Tensor:
    """LayerNorm, or RMSNorm as transformers computes it (in float32, cast back, then the weight)."""
    if not rms:
        return F.layer_norm(x, (x.shape[-1],), weight, bias, eps)
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


def split_heads(y: torch.Tensor, shape: Shape, q_norm=None, k_norm=None):
    """q [..., heads, head_dim], k and v [..., kv_heads, head_dim] from y = [q; k; v; ...]:
    views of y (copies only where Qwen3 normalizes q and k)."""
    q_size, kv_size = shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim
    lead = y.shape[:-1]
    q = y[..., :q_size].view(*lead, shape.heads, shape.head_dim)
    k = y[..., q_size : q_size + kv_size].view(*lead, shape.kv_heads, shape.head_dim)
    v = y[..., q_size + kv_size : q_size + 2 * kv_size].view(*lead, shape.kv_heads, shape.head_dim)
    if q_norm is not None:
        q, k = norm(q, q_norm, None, shape.eps, True), norm(k, k_norm, None, shape.eps, True)
    return q, k, v


def output_gate(attention, y, shape: Shape):
    """Qwen3.5's gated attention: the output times sigmoid of each head's gate (the rows of y
    after q, k and v, `DecoderWeights._block`)."""
    if not shape.attention_gate:
        return attention
    start = shape.heads * shape.head_dim + 2 * shape.kv_heads * shape.head_dim
    return attention * torch.sigmoid(y[..., start : start + shape.heads * shape.head_dim])


def mlp_and_residual(x, attention, y, block: Block, shape: Shape, lora):
    """After attention: the block's output added to the residual x. Parallel: one GEMM over
    [attention, act(fc1)]; sequential: the output projection, then the second norm and the MLP."""
    if shape.parallel:
        mixed = torch.cat(
            (attention, shape.activation(y[..., shape.heads * shape.head_dim + 2 * shape.kv_heads * shape.head_dim :])),
            dim=-1,
        )
        out = linear(mixed, block.w_out, block.b_out)
        if lora is not None:
            out = out + lora_product(mixed, *lora[1])
        return x + out
    out = linear(attention, block.w_out, block.b_out)
    if lora is not None:
        out = out + lora_product(attention, *lora[1])
    if block.attention_out_norm is not None:  # Gemma 3: a norm on each output before the residual
        out = norm(out, block.attention_out_norm, None, shape.eps, True)
    x = x + out
    h = norm(x, block.norm2_w, block.norm2_b, shape.eps, shape.rms_norm)
    u = linear(h, block.w_up, block.b_up)
    if lora is not None:
        u = u + lora_product(h, *lora[2])
    g = shape.activation(u[..., : shape.inner]) * u[..., shape.inner :] if shape.gated else shape.activation(u)
    out = linear(g, block.w_down, block.b_down)
    if lora is not None:
        out = out + lora_product(g, *lora[3])
    if block.mlp_out_norm is not None:
        out = norm(out, block.mlp_out_norm, None, shape.eps, True)
    return x + out


def decode_block(
    x, cos, sin, bias, positions, rows, k_pool, v_pool, table, *block, shape: Shape, lora=None, groups=None, gather=None
):
    """One block for one new token per row: x [b, hidden] at `positions`, the keys and values of
    each row in pages of k_pool/v_pool [kv_heads, pages, PAGE, head_dim] that `table` [rows,
    width] names (backends/kv_pages); `bias` masks the columns a row must not see ([kv_heads *
    b, 1, span], key-value head outermost: its future, and what is past its sliding window);
    `lora`, if the block is adapted, is each row's adapter product per fused matrix (torch_lora);
    `groups`, if given, the rows' attention in groups of like reach (`decode_attention`);
    `gather`, if given, takes page ids to their keys and values (`PagedKV.gathered`).
    Compilable: shapes come from the tensors, the block's weights are plain arguments."""
    block = Block(*block)
    h = norm(x, block.norm1_w, block.norm1_b, shape.eps, shape.rms_norm)
    y = linear(h, block.w_in, block.b_in)
    if lora is not None:
        y = y + lora_product(h, *lora[0])
    q, k, v = split_heads(y, shape, block.q_norm, block.k_norm)
    rope_(q, cos, sin, shape.rotary_dim)
    rope_(k, cos, sin, shape.rotary_dim)
    page, offset = table[rows, positions // PAGE], positions % PAGE
    k_pool[:, page, offset] = k.transpose(0, 1)
    v_pool[:, page, offset] = v.transpose(0, 1)
    gather = gather or (lambda pages: (k_pool.index_select(1, pages), v_pool.index_select(1, pages)))
    attention = grouped_decode_attention(q, gather, table, bias, shape, groups)
    return mlp_and_residual(x, output_gate(attention, y, shape), y, block, shape, lora)


def grouped_decode_attention(q, gather, table, bias, shape: Shape, groups=None) -> torch.Tensor:
    """`decode_attention` of rows 0..b-1 (q [b, heads, head_dim]), all at once or, with
    `groups`, in groups of like reach (each attending to its own longest reach only)."""
    batch = q.shape[0]
    if groups is None:
        return decode_attention(q, gather, table[:batch], bias, shape)
    attention = q.new_empty(batch, shape.heads * shape.head_dim)
    kv_heads, full = shape.kv_heads, bias.shape[-1]
    for index, span in groups:
        group_bias = bias.view(kv_heads, batch, 1, full)[:, index, :, :span].reshape(-1, 1, span)
        attention[index] = decode_attention(q[index], gather, table[index], group_bias, shape)
    return attention


def decode_attention(q, gather, table, bias, shape: Shape) -> torch.Tensor:
    """Attention of one query per row (q [b, heads, head_dim]) over its columns, gathered (by
    `gather`, page ids to keys and values [kv_heads, pages, PAGE, head_dim]) from the pages
    that `table` [b, width] names up to the span of `bias` [kv_heads * b, 1, span]; [b, heads
    * head_dim]. The query heads that share a key-value head attend together, [kv_heads * b,
    group, head_dim] against [kv_heads * b, span, head_dim] (the gather's own layout: no
    second copy)."""
    batch, span = q.shape[0], bias.shape[-1]
    kv_heads, group, head_dim = shape.kv_heads, shape.heads // shape.kv_heads, shape.head_dim
    keys, values = gather(table[:, : -(-span // PAGE)].reshape(-1))
    # reshape, not view: a gather may be a view of the pool (`PagedKV.gathered`), which several
    # rows' consecutive pages cannot be viewed as [kv_heads * batch, ...] from (then a copy).
    keys = keys.reshape(kv_heads * batch, -1, head_dim)[:, :span]
    values = values.reshape(kv_heads * batch, -1, head_dim)[:, :span]
    queries = q.reshape(batch, kv_heads, group, head_dim).transpose(0, 1).reshape(kv_heads * batch, group, head_dim)
    scores = torch.baddbmm(bias, queries, keys.transpose(1, 2), alpha=head_dim**-0.5)
    attention = torch.bmm(torch.softmax(scores, dim=-1), values)
    return attention.view(kv_heads, batch, group * head_dim).transpose(0, 1).reshape(batch, shape.heads * head_dim)


def lora_product(x, a, b, mask):
    """Each row's own adapter's x @ A @ B: the mask keeps its slot's columns (torch_lora)."""
    return ((x @ a) * mask) @ b


class Placement:
    """Where prefill pieces go: their rows [n], positions [n, length], the key span to attend
    over, and the mask (None: plain causal from position 0); with the Triton kernels, pieces
    after cached columns give their first positions and lengths [n] instead (`paged`), and
    attend through the rows' page tables (`triton_prefill.paged_prefill_attention`)."""

    def __init__(self, rows, positions, span: int, mask, starts=None, lens=None, pieces=()):
        self.rows, self.positions, self.span, self.mask = rows, positions, span, mask
        self.starts, self.lens = starts, lens
        self.pieces = pieces  # (row, length, first position) of each, for layers with a state (Qwen3.5)

    @property
    def paged(self) -> bool:
        return self.starts is not None


class Network:
    """The forward passes over the paged cache. They read their inputs from buffers (`inputs`,
    `padded_buffers`), so that a CUDA graph of a pass replays on new ones (backends/torch_graphs);
    the adapters' buffers (`lora`) and the rotary tables are theirs too.

    `inputs` [4, rows]: per row, input token, position, 1 if the row decodes (its position
    advances when steps chain), and its adapter's slot (-1: none); the decoder fills them
    through `host_inputs` (pinned on CUDA) or, chained, on the device."""

    def __init__(
        self,
        weights: DecoderWeights,
        kv: PagedKV,
        rows: int,
        context: int,
        use_graphs: bool,
        compile: bool = False,
        fused: bool | None = None,
        adapter_slots: int = 8,
    ):
        self.weights = weights
        self.device = weights.device
        self.dtype = weights.embed.dtype
        self.kv = kv
        self.context = context
        self.scratch = context  # the column idle rows and padding write: past every sequence's reach
        self.use_graphs = use_graphs  # (eager passes keep python state that a graph would not follow)
        self.lora = FusedLoraSlots(weights.lora_matrices, adapter_slots, self.device, self.dtype)
        # {rope kind: (cos, sin)} and each layer's kind (None: no rotary); self.cos and self.sin
        # are the one table of a family that has one (what the Triton kernels and longrope take).
        self.tables = weights.rotary_tables(context + 1, self.dtype)
        self.rope_kinds = weights.arch.rope_kinds
        self.cos, self.sin = self.tables.get("default", next(iter(self.tables.values()), (None, None)))
        # Qwen3.5's linear-attention layers: each row's state (backends/torch/hybrid.py)
        self.states = RowStates(weights.arch, rows, self.device, self.dtype) if weights.arch.hybrid else None
        scale = weights.arch.embed_scale
        self.embed_scale = None if scale is None else torch.tensor(scale, dtype=self.dtype, device=self.device)
        # longrope: a prompt longer than its original length is prefilled with the long factors.
        self.long_prompts_from = weights.long_prompts_from
        self.cos_long = self.sin_long = None
        if self.long_prompts_from is not None:
            self.cos_long, self.sin_long = weights.long_rotary_tables(context + 1, self.dtype)
        self.shape = weights.shape
        # torch.compile fuses each block's small kernels (norms, rotary, activations, residuals);
        # dynamic shapes: one compilation serves every batch and length bucket.
        self.layer = torch.compile(decode_block, dynamic=True, fullgraph=True) if compile else decode_block
        # On CUDA the decode step puts Triton kernels between cuBLAS's GEMMs (backends/torch/cuda/triton_*.py),
        # adapters too; quantized weights take the step above.
        self.fused = fused_available(weights, use_graphs) if fused is None else fused
        self.heads = heads_of(weights.arch) if self.fused else None
        # On the CPU, an eager decode step without adapters runs as one compiled call
        # (backends/torch/cpu/kernels.cpp; docs/decisions.md, D-cpu-step).
        quantized = any(isinstance(w, (BlockWeight, StackedBlocks)) for block in weights.layers for w in block)
        stepped = quantized and not use_graphs and not compile and not weights.arch.hybrid  # (hybrid: torch ops)
        self.cpu_step = cpu_step.decode_step(weights, kv, self.tables) if stepped else None
        self.cpu_tables = cpu_step.rotary_stack(self.tables) if self.device.type == "cpu" else None
        # Whether the prompt pieces of row i take the compiled step's AMX-BF16 tiles (`_cpu_pass`):
        # the decoder's rule (torch_decoder.PROMPT_TILES_FROM); none until it says.
        self.prompt_tiles: Callable[[int], bool] = lambda i: False
        self.inputs = torch.zeros(4, rows, dtype=torch.long, device=self.device)
        self.host_inputs = torch.zeros(4, rows, dtype=torch.long, pin_memory=self.device.type == "cuda")
        self._padded_inputs: tuple[torch.Tensor, torch.Tensor] | None = None  # `padded_buffers`

    def uncompile(self) -> bool:
        """Take the uncompiled block from now on; False if it was not compiled."""
        if self.layer is decode_block:
            return False
        self.layer = decode_block
        return True

    # -- prompt pieces -----------------------------------------------------------------------------

    @torch.inference_mode()
    def prefill(
        self,
        parts: list[tuple[int, list[int], int]],
        every_position: list[int] = (),
        lora_rows: list[int] = (),
        long_rope: list[bool] | None = None,
        draft: bool = False,
    ) -> tuple[torch.Tensor, dict]:
        """Run prompt pieces (row, ids, first position) through the model eagerly, padded to the
        longest, with each row's adapter (`lora_rows`); write their keys and values to their
        rows; return each piece's last-token logits, and {piece: the logits of each of its
        positions} for the pieces in `every_position`. `draft`: the pieces verify a draft, so
        their products are the decode rows' exact ones (the compiled step's `prompt_from`).

        Padding writes past a piece's end, in columns its sequence has not reached: a decode
        step writes a column before any query reads it, and the mask hides the rest."""
        if self.cpu_step is not None and not any(r >= 0 for r in lora_rows) and not any(long_rope or ()):
            x, bounds = self._cpu_pieces(parts, exact=draft)
            every = {r: self.logits(x[bounds[r][0] : bounds[r][1]]) for r in every_position}
            return self.logits(x[torch.tensor([hi - 1 for _, hi in bounds])]), every
        n, length = len(parts), max(len(ids) for _, ids, _ in parts)
        rows = torch.tensor([row for row, _, _ in parts], device=self.device)
        if self.use_graphs and n == 1:
            # One piece (a long prompt, or a prompt alone): no padding, no mask to build, and
            # causal flash attention over its row's columns.
            _, ids, start = parts[0]
            tokens = torch.tensor([ids], device=self.device)
            positions = torch.arange(start, start + length, device=self.device)[None, :]
            span, mask = start + length, None  # from position 0: causal flash attention, no mask
            if start and length >= LOWER_RIGHT_FROM:  # after cached columns, a long piece: bottom-right causal
                # Imported here: its module imports torch._dynamo (~1 s of a CPU start, which never comes here).
                from torch.nn.attention.bias import causal_lower_right

                mask = causal_lower_right(length, span)
            elif start:
                # A short piece after cached columns: an explicit mask and the memory-efficient
                # kernel (keys padded to a multiple of 8), as padded pieces have (or the paged
                # kernel, `_prefill_layers`).
                span = min(-(-span // 8) * 8, self.context + 1)
                mask = self.prefill_mask(positions, span)
        else:
            # Keys padded to a multiple of 8: the memory-efficient attention kernel wants its mask
            # rows aligned (the padded columns hold zeros and are masked out).
            span = -(-(max(start for _, _, start in parts) + length) // 8) * 8
            span = min(span, self.context + 1)
            tokens = torch.zeros(n, length, dtype=torch.long)
            for r, (_, ids, _) in enumerate(parts):
                tokens[r, : len(ids)] = torch.tensor(ids)
            starts = torch.tensor([start for _, _, start in parts])
            positions = (starts[:, None] + torch.arange(length)[None, :]).clamp(max=self.scratch).to(self.device)
            tokens = tokens.to(self.device)
            mask = self.prefill_mask(positions, span)
        starts = lens = None
        if mask is not None and self.fused:  # the paged kernel's, where `_prefill_layers` takes it
            starts = torch.tensor([start for _, _, start in parts], device=self.device)
            lens = torch.tensor([len(ids) for _, ids, _ in parts], device=self.device)
        pieces = [(row, len(ids), start) for row, ids, start in parts]
        placed = Placement(rows, positions, span, mask, starts, lens, pieces)
        x = self.embed(tokens)  # [n, length, hidden]
        adapted = (
            self.lora_layers(torch.tensor(lora_rows, device=self.device), prefill=True) if max(lora_rows) >= 0 else {}
        )
        with prefill_attention():
            x = self._prefill_layers(x, placed, adapted, long_rope)
        last = torch.tensor([len(ids) - 1 for _, ids, _ in parts], device=self.device)
        every = {r: self.logits(x[r, : len(parts[r][1])]) for r in every_position}
        return self.logits(x[torch.arange(n, device=self.device), last]), every

    def padded_buffers(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The graphs' inputs: [tokens; positions] [2, rows, length] and [rows; last index]
        [2, rows], at their largest; each graph reads a corner."""
        if self._padded_inputs is None:
            rows = padded_rows()
            grid = torch.zeros(2, rows, PREFILL_LENGTHS[-1], dtype=torch.long, device=self.device)
            self._padded_inputs = grid, torch.zeros(2, rows, dtype=torch.long, device=self.device)
        return self._padded_inputs

    def load_padded(self, parts: list[tuple[int, list[int], int]], rows: int, length: int) -> None:
        """Write prompt pieces (row, ids, first position) into the padded pass's buffers, padded
        to rows x length. A piece's padding tokens write its row's columns past its end (its own
        pages: a stored prefix's shared pages end before the piece), which a decode step writes
        before any query reads them; the padding rows write the cache's scratch column of row 0,
        as a decode step's idle rows do; columns past a row's pages land in the scratch page."""
        grid, index = self.padded_buffers()
        # Pinned: copied without a wait for the stream's work before it (the pinned allocator
        # keeps the block until its copy has run), so the passes of one step queue at once.
        pinned = self.device.type == "cuda"
        host_grid = torch.zeros(2, rows, length, dtype=torch.long, pin_memory=pinned)
        host_grid[1] = self.scratch
        host_index = torch.zeros(2, rows, dtype=torch.long, pin_memory=pinned)
        host_index[1] = -1  # padding rows: no token (the paged kernel reads none of their columns)
        for r, (row, ids, start) in enumerate(parts):
            host_grid[0, r, : len(ids)] = torch.tensor(ids)
            host_grid[1, r] = torch.arange(start, start + length).clamp(max=self.scratch)
            host_index[:, r] = torch.tensor([row, len(ids) - 1])
        grid[:, :rows, :length].copy_(host_grid, non_blocking=pinned)
        index[:, :rows].copy_(host_index, non_blocking=pinned)

    def idle_padded(self) -> None:
        """Padded inputs that write only the scratch column (for a capture between steps)."""
        grid, index = self.padded_buffers()
        grid[0].zero_()
        grid[1].fill_(self.scratch)
        index.zero_()

    def padded_pass(self, rows: int, length: int, span: int) -> torch.Tensor:
        """The forward pass of pieces in the padded buffers (`load_padded`), reading its inputs from the buffers (what a
        graph captures): each token's attention over its row's columns up to its own
        position, through the page tables with the Triton kernels; else, for new prompts,
        causal attention over a gather of their own columns, and for pieces after cached
        columns (a span) a mask made here from the positions."""
        grid, index = self.padded_buffers()
        tokens, positions = grid[0, :rows, :length], grid[1, :rows, :length]
        owners, last = index[0, :rows], index[1, :rows]
        if self.fused:
            # Through the rows' page tables, new prompts too (their own keys and values, written
            # a kernel earlier): no gather of their columns, no mask (BENCHMARKS.md, decisions).
            placed = Placement(owners, positions, span or length, None, positions[:, 0].contiguous(), last + 1)
        elif not span:
            placed = Placement(owners, positions, length, None)
        else:
            placed = Placement(owners, positions, span, self.prefill_mask(positions, span))
        x = self.embed(tokens)
        with prefill_attention():
            x = self._prefill_layers(x, placed, {})
        return self.logits(x[torch.arange(rows, device=self.device), last])

    def prefill_mask(self, positions: torch.Tensor, span: int, window: int | None = None) -> torch.Tensor:
        """The additive attention mask [n, 1, length, span] of pieces at `positions` [n, length]:
        each sees the columns up to its own position (and, with a sliding window, only the last
        `window` of them)."""
        columns = torch.arange(span, device=self.device)[None, None, :]
        visible = columns <= positions[:, :, None]
        if window is not None:
            visible &= columns > positions[:, :, None] - window
        # A row that sees nothing is padding or an idle row (a token sees its own column): it
        # sees column 0, so that its softmax, and the keys and values it writes (to the scratch
        # page, which gathers read as masked columns), stay finite.
        visible[:, :, 0] |= ~visible.any(dim=-1)
        visible = visible[:, None]
        return torch.zeros(visible.shape, dtype=self.dtype, device=self.device).masked_fill_(~visible, float("-inf"))

    def _prefill_layers(self, x, placed: Placement, adapted: dict, long_rope: list[bool] | None = None) -> torch.Tensor:
        w, shape = self.weights, self.weights.shape
        n, length = x.shape[:2]
        long_rope = long_rope if long_rope and any(long_rope) else None
        # The rotary kernel takes one table: a group mixing longrope's long prompts with others
        # rotates in torch ops.
        kernels = self.fused and (long_rope is None or all(long_rope))
        paged = kernels and placed.paged
        if kernels:
            from backends.torch.cuda import triton_prefill

            token_rows, token_positions = placed.rows.repeat_interleave(length), placed.positions.reshape(-1)
            tables = (self.cos_long, self.sin_long) if long_rope else (self.cos, self.sin)
        else:
            turns = self.turns(placed.positions)
            if long_rope:  # longrope: one table (Phi-3's), its long prompts' rows from the long one
                long = torch.tensor(long_rope, device=self.device)[:, None, None, None]
                cos, sin = turns[0]
                cos = torch.where(long, self.cos_long[placed.positions][:, :, None, :], cos)
                sin = torch.where(long, self.sin_long[placed.positions][:, :, None, :], sin)
                turns = [(cos, sin)] * len(turns)
        masks = {}  # window -> the attention mask of its layers (None: plain causal)
        for layer, block in enumerate(w.layers):
            if w.arch.mixers[layer] == "delta":
                x = self._delta_pieces(x, layer, block, placed.pieces)
                continue
            lora = adapted.get(layer)
            h = norm(x, block.norm1_w, block.norm1_b, shape.eps, shape.rms_norm)
            y = linear(h, block.w_in, block.b_in)
            if lora is not None:
                y = y + lora_product(h, *lora[0])
            if kernels:  # one kernel: rotary on q in place, k and v to the cache
                triton_prefill.prefill_rotary(
                    y.view(n * length, -1),
                    *tables,
                    token_positions,
                    token_rows,
                    self.kv.k[layer],
                    self.kv.v[layer],
                    self.kv.table,
                    self.heads,
                    block.q_norm,
                    block.k_norm,
                )
                q = y[..., : w.arch.q_size].view(n, length, w.heads, w.head_dim)
            else:
                q, k, v = split_heads(y, shape, block.q_norm, block.k_norm)  # [n, length, heads, head_dim]
                rope_(q, *turns[layer], shape.rotary_dim)
                rope_(k, *turns[layer], shape.rotary_dim)
                self.kv.write(layer, placed.rows[:, None], placed.positions, k, v)
            if paged:  # after cached columns: read through the page tables, its window in the kernel
                attention = triton_prefill.paged_prefill_attention(
                    y, self.kv.k[layer], self.kv.v[layer], self.kv.table, placed.rows, placed.starts, placed.lens,
                    self.heads, window=w.arch.windows[layer], reach=placed.span,
                )  # fmt: skip
            else:
                attention = self._gathered_attention(layer, q, placed, masks)
            x = mlp_and_residual(x, output_gate(attention, y, shape), y, block, shape, lora)
        return x

    def _gathered_attention(self, layer: int, q: torch.Tensor, placed: Placement, masks: dict) -> torch.Tensor:
        """SDPA of q [n, length, heads, head_dim] over a copy of the rows' first `placed.span`
        columns, through the placement's mask (its sliding-window variants made once a pass, in
        `masks`); [n, length, q_size]."""
        w = self.weights
        keys, values = self.kv.read(layer, placed.rows, placed.span)
        window = w.arch.windows[layer]
        if window is not None and window >= placed.span:  # a window no shorter than every row's reach
            window = None
        if window not in masks:
            masks[window] = placed.mask if window is None else self.prefill_mask(placed.positions, placed.span, window)
        mask, grouped = masks[window], w.arch.group > 1
        if mask is None:  # a piece from position 0: plain causal
            attention = F.scaled_dot_product_attention(
                q.transpose(1, 2), keys, values, is_causal=True, enable_gqa=grouped
            )
        else:
            attention = F.scaled_dot_product_attention(
                q.transpose(1, 2), keys, values, attn_mask=mask, enable_gqa=grouped
            )
        n, length = q.shape[:2]
        return attention.transpose(1, 2).reshape(n, length, w.arch.q_size)

    # -- logits ------------------------------------------------------------------------------------

    def logits(self, x: torch.Tensor, normalize=norm) -> torch.Tensor:
        """The raw logits over the whole model vocabulary (logprobs are taken over all of it;
        the choice of a token is limited to the ids the tokenizer can decode). `normalize`: the
        final norm (the fused step passes its Triton kernel, `triton_ops.norm`)."""
        w = self.weights
        x = normalize(x, *w.final_norm, w.shape.eps, w.shape.rms_norm)
        logits = linear(x, *w.lm_head)
        cap = w.arch.logit_softcap
        return logits if cap is None else torch.tanh(logits / cap) * cap

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        """The tokens' embeddings (Gemma's scaled by sqrt(hidden), rounded to the dtype as it does)."""
        x = self.weights.embed[tokens]
        return x if self.embed_scale is None else x * self.embed_scale

    def turns(self, positions: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor] | tuple[None, None]]:
        """Each layer's (cos, sin) rows at `positions`, [..., 1, rotary_dim] (broadcast over the
        heads), looked up once a kind; (None, None) for a layer without rotary embeddings."""
        rows = {kind: (c[positions][..., None, :], s[positions][..., None, :]) for kind, (c, s) in self.tables.items()}
        return [rows[kind] if kind is not None else (None, None) for kind in self.rope_kinds]

    # -- linear-attention layers (Qwen3.5) and row moves -------------------------------------------

    def move_rows(self, targets: list[int], sources: list[int]) -> None:
        """Rows `sources` become rows `targets` (the decoder keeps its rows packed): their page
        tables move, and a linear-attention layer's state, each row's own (backends/torch/hybrid.py)."""
        self.kv.move(targets, sources)
        if self.states is not None:
            self.states.move(targets, sources)

    def _delta_decode(self, x, layer: int, block: Block, rows, active) -> torch.Tensor:
        """A linear-attention layer (Qwen3.5) for decode rows: its state instead of the KV pages."""
        shape = self.shape
        h = norm(x, block.norm1_w, block.norm1_b, shape.eps, shape.rms_norm)
        mixed = decode_mix(h, block, self.states, layer, rows, active, self.weights.arch.delta, shape.eps)
        return mlp_and_residual(x, mixed, None, block, shape._replace(attention_gate=False), None)

    def _delta_pieces(self, x, layer: int, block: Block, pieces) -> torch.Tensor:
        """A linear-attention layer (Qwen3.5) for prompt pieces: x [n, length, hidden] padded,
        `pieces` each (row, length, first position); each piece from its row's state, in turn."""
        shape = self.shape
        h = norm(x, block.norm1_w, block.norm1_b, shape.eps, shape.rms_norm)
        mixed = h.new_zeros(*h.shape[:-1], self.weights.arch.delta.value_size)
        for r, (row, length, start) in enumerate(pieces):
            mixed[r, :length] = piece_mix(
                h[r, :length], block, self.states, layer, row, start, self.weights.arch.delta, shape.eps
            )
        return mlp_and_residual(x, mixed, None, block, shape._replace(attention_gate=False), None)

    def _delta_mixed(self, x, layer: int, block: Block, batch: int, pieces, bounds) -> torch.Tensor:
        """A linear-attention layer for a mixed step's tokens (`mixed_step`): its decode rows
        as a step's, then each piece from its row's state."""
        rows = torch.arange(batch, device=self.device)
        rows_x = self._delta_decode(x[:batch], layer, block, rows, self.inputs[2, :batch]) if batch else x[:0]
        spans = [(row, hi - lo, start) for (row, _, start), (lo, hi) in zip(pieces, bounds, strict=True)]
        parts = [
            self._delta_pieces(x[None, lo:hi], layer, block, [span])[0]
            for span, (lo, hi) in zip(spans, bounds, strict=True)
        ]
        return torch.cat([rows_x, *parts])

    # -- the decode step ----------------------------------------------------------------------------

    def grouped(self) -> bool:
        """Whether an eager decode step's rows attend in groups of like reach (the `groups` of
        `decode_step`): eager, uncompiled torch ops, whose python state a graph would not follow."""
        return not self.use_graphs and not self.fused and self.layer is decode_block

    @torch.inference_mode()
    def decode_step(self, batch: int, span: int, lora: int = 0, groups=None) -> tuple[torch.Tensor, torch.Tensor]:
        """Logits and greedy tokens for rows 0..batch-1, attending to cache columns 0..span-1
        (eager and not compiled: in `groups` of like reach, if given), with each row's
        adapter if `lora` (the adapter buffers' version) is not 0."""
        if self.fused:
            return self.fused_step(batch, lora)
        w = self.weights
        tokens, positions = self.inputs[0, :batch], self.inputs[1, :batch]
        if self.cpu_step is not None and not lora:
            rows = torch.arange(batch)
            logits = self.logits(self._cpu_pass(tokens, positions, rows, self.inputs[2, :batch], prompt_from=batch))
            return logits, logits[:, : w.decodable].argmax(dim=-1)
        rows = torch.arange(batch, device=self.device)
        x = self.embed(tokens)  # [b, hidden]
        turns = self.turns(positions)
        biases = self._decode_biases(positions, span)
        adapted = self.lora_layers(self.inputs[3, :batch]) if lora else {}
        # Eager and not compiled: groups and the kept gather buffers (python state a graph or
        # torch.compile would not follow).
        plain = not self.use_graphs and self.layer is decode_block
        groups = groups if plain else None
        for layer, block in enumerate(w.layers):
            if w.arch.mixers[layer] == "delta":
                x = self._delta_decode(x, layer, block, rows, self.inputs[2, :batch])
                continue
            bias = biases[w.arch.windows[layer]]
            x = self.layer(
                x,
                *turns[layer],
                bias,
                positions,
                rows,
                self.kv.k[layer],
                self.kv.v[layer],
                self.kv.table,
                *block,
                shape=self.shape,
                lora=adapted.get(layer),
                groups=groups,
                gather=partial(self.kv.gathered, layer) if plain else None,
            )
        logits = self.logits(x)
        return logits, logits[:, : w.decodable].argmax(dim=-1)

    def _cpu_pass(self, tokens, positions, owners, advance, cos=None, sin=None, *, prompt_from: int) -> torch.Tensor:
        """The compiled CPU pass (cpu_kernels.cpp's `Step.forward`): the last hidden states of
        `tokens`, each at its position in its owner's row of the cache. The tokens from
        `prompt_from` on are a prompt's: where the CPU has AMX-BF16, their products take its
        tiles (bfloat16's rounding, as the float default's); those before it, decode rows and
        drafts, the exact int8 products, so batching, drafts and company never change a decode row."""
        cos, sin = self.cpu_tables if cos is None else (cos, sin)
        x = self.embed(tokens)
        return self.cpu_step.forward(x, positions, owners, advance, self.kv.table, self.kv.whole, cos, sin, prompt_from)

    def _cpu_pieces(
        self, parts, batch: int = 0, cos=None, sin=None, exact: bool = False
    ) -> tuple[torch.Tensor, list[tuple[int, int]]]:
        """Decode rows 0..batch-1 (as `decode_step`) and prompt pieces (row, ids, first position)
        in one compiled pass: the hidden states of all, and each piece's (first, end) in them.
        `exact`: the pieces take the decode rows' products too (a draft's)."""
        # the pieces whose prompts take the tiles after the others: rows from `prompt_from` on
        tiled = [not exact and self.prompt_tiles(row) for row, _, _ in parts]
        order = sorted(range(len(parts)), key=lambda k: tiled[k])
        ids = [token for k in order for token in parts[k][1]]
        positions = [parts[k][2] + i for k in order for i in range(len(parts[k][1]))]
        owners = [parts[k][0] for k in order for _ in parts[k][1]]
        tokens = torch.cat((self.inputs[0, :batch], torch.tensor(ids, dtype=torch.long)))
        at = torch.cat((self.inputs[1, :batch], torch.tensor(positions, dtype=torch.long)))
        rows = torch.cat((torch.arange(batch), torch.tensor(owners, dtype=torch.long)))
        advance = torch.cat((self.inputs[2, :batch], torch.ones(len(ids), dtype=torch.long)))
        bounds, end, prompt_from = [None] * len(parts), batch, len(tokens)
        for k in order:
            if tiled[k]:
                prompt_from = min(prompt_from, end)
            bounds[k] = (end, end + len(parts[k][1]))
            end += len(parts[k][1])
        return self._cpu_pass(tokens, at, rows, advance, cos, sin, prompt_from=prompt_from), bounds

    def _decode_biases(self, positions: torch.Tensor, span: int) -> dict:
        """For decode rows at `positions` [b]: per sliding window (None: none), the columns
        0..span-1 each row may not see, per key-value head ([kv_heads * b, 1, span])."""
        batch, kv_heads = positions.shape[0], self.weights.arch.kv_heads
        columns = torch.arange(span, device=self.device)[None, :]
        biases = {}
        for window in set(self.weights.arch.windows):
            visible = columns <= positions[:, None]
            if window is not None:
                visible &= columns > positions[:, None] - window
            visible[:, 0] |= ~visible.any(dim=-1)  # see `prefill_mask`
            bias = torch.zeros(batch, span, dtype=self.dtype, device=self.device).masked_fill_(~visible, float("-inf"))
            biases[window] = bias[None, :, None, :].expand(kv_heads, batch, 1, span).reshape(kv_heads * batch, 1, span)
        return biases

    @torch.inference_mode()
    def mixed_step(self, batch: int, span: int, pieces: list[tuple[int, list[int], int]], groups=None):
        """One eager pass for a decode step (rows 0..batch-1, as `decode_step`; none if batch is
        0) and prompt pieces (row, ids, first position) together: every GEMM over the step's
        rows and the pieces' tokens at once, attention apart (the rows in groups of like reach,
        each piece causally over its row's columns). Returns the rows' logits and greedy tokens
        (None without rows), and the logits of each piece's last position ([pieces, vocab])."""
        w, shape = self.weights, self.shape
        if self.cpu_step is not None:
            x, bounds = self._cpu_pieces(pieces, batch)
            piece_logits = self.logits(x[torch.tensor([hi - 1 for _, hi in bounds])])
            if not batch:
                return None, None, piece_logits
            logits = self.logits(x[:batch])
            return logits, logits[:, : w.decodable].argmax(dim=-1), piece_logits
        ids = [token for _, piece, _ in pieces for token in piece]
        tokens, positions = self.inputs[0, :batch], self.inputs[1, :batch]
        rows = torch.arange(batch, device=self.device)
        starts = torch.tensor([start for _, _, start in pieces])
        lengths = torch.tensor([len(piece) for _, piece, _ in pieces])
        # Each piece token's position: its piece's start plus its place in the piece.
        offsets = torch.arange(len(ids)) - (lengths.cumsum(0) - lengths).repeat_interleave(lengths)
        piece_positions = (starts.repeat_interleave(lengths) + offsets).to(self.device)
        piece_rows = torch.tensor([row for row, _, _ in pieces]).repeat_interleave(lengths).to(self.device)
        x = self.embed(torch.cat((tokens, torch.tensor(ids, device=self.device))))  # [b + tokens, hidden]
        at = torch.cat((positions, piece_positions))
        owners = torch.cat((rows, piece_rows))  # each token's cache row
        turns = self.turns(at)
        biases = self._decode_biases(positions, span) if batch else {}
        # Each piece's attention as a padded prefill's (`_gathered_attention`): its row's
        # columns up to its end, through a causal mask (each piece's sliding-window variants
        # made once a pass, in its own dict).
        placed, bounds, end = [], [], batch
        for row, piece, start in pieces:
            at_piece = torch.arange(start, start + len(piece), device=self.device)[None, :]
            reach = min(-(-(start + len(piece)) // 8) * 8, self.context + 1)
            placed.append(
                (
                    Placement(
                        torch.tensor([row], device=self.device), at_piece, reach, self.prefill_mask(at_piece, reach)
                    ),
                    {},
                )
            )
            bounds.append((end, end + len(piece)))
            end += len(piece)
        for layer, block in enumerate(w.layers):
            if w.arch.mixers[layer] == "delta":
                x = self._delta_mixed(x, layer, block, batch, pieces, bounds)
                continue
            h = norm(x, block.norm1_w, block.norm1_b, shape.eps, shape.rms_norm)
            y = linear(h, block.w_in, block.b_in)
            q, k, v = split_heads(y, shape, block.q_norm, block.k_norm)  # [b + tokens, heads, head_dim]
            rope_(q, *turns[layer], shape.rotary_dim)
            rope_(k, *turns[layer], shape.rotary_dim)
            self.kv.write(layer, owners, at, k, v)
            parts = [
                self._gathered_attention(layer, q[None, lo:hi], where, masks)[0]
                for (where, masks), (lo, hi) in zip(placed, bounds, strict=True)
            ]
            if batch:
                gather = partial(self.kv.gathered, layer)
                bias = biases[w.arch.windows[layer]]
                parts.insert(0, grouped_decode_attention(q[:batch], gather, self.kv.table, bias, shape, groups))
            x = mlp_and_residual(x, output_gate(torch.cat(parts), y, shape), y, block, shape, None)
        last = torch.tensor([hi - 1 for _, hi in bounds], device=self.device)
        piece_logits = self.logits(x[last])
        if not batch:
            return None, None, piece_logits
        logits = self.logits(x[:batch])
        return logits, logits[:, : w.decodable].argmax(dim=-1), piece_logits

    def fused_step(self, batch: int, lora: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """The decode step: cuBLAS for the GEMMs of a block (two for Phi, four for the others),
        Triton for what lies between them (backends/torch/cuda/triton_*.py), and each row's adapter
        product if `lora`."""
        from backends.torch.cuda import triton_attention, triton_ops

        w = self.weights
        tokens, positions, active = self.inputs[0, :batch], self.inputs[1, :batch], self.inputs[2, :batch]
        adapted = self.lora_layers(self.inputs[3, :batch]) if lora else {}
        x = self.embed(tokens)
        arch, eps = w.arch, w.shape.eps
        for layer, block in enumerate(w.layers):
            lora = adapted.get(layer)
            h = triton_ops.norm(x, block.norm1_w, block.norm1_b, eps, arch.rms_norm)
            y = F.linear(h, block.w_in, block.b_in)
            if lora is not None:
                y = y + lora_product(h, *lora[0])
            if arch.parallel:
                mixed, xb = triton_attention.attention(
                    y,
                    self.cos,
                    self.sin,
                    positions,
                    active,
                    self.kv.k[layer],
                    self.kv.v[layer],
                    self.kv.table,
                    self.heads,
                    x=x,
                    b_out=block.b_out,
                    inner=w.inner,
                )
                x = torch.addmm(xb, mixed, block.w_out.t())  # x + b_out + mixed @ w_out.T, in cuBLAS's epilogue
                if lora is not None:
                    x = x + lora_product(mixed, *lora[1])
                continue
            attended = triton_attention.attention(
                y,
                self.cos,
                self.sin,
                positions,
                active,
                self.kv.k[layer],
                self.kv.v[layer],
                self.kv.table,
                self.heads,
                window=arch.windows[layer],
                q_norm=block.q_norm,
                k_norm=block.k_norm,
            )
            x = torch.addmm(x if block.b_out is None else x + block.b_out, attended, block.w_out.t())
            if lora is not None:
                x = x + lora_product(attended, *lora[1])
            h = triton_ops.norm(x, block.norm2_w, None, eps, rms=True)
            u = F.linear(h, block.w_up, block.b_up)
            if lora is not None:
                u = u + lora_product(h, *lora[2])
            g = triton_ops.silu_mul(u, w.inner)
            x = torch.addmm(x if block.b_down is None else x + block.b_down, g, block.w_down.t())
            if lora is not None:
                x = x + lora_product(g, *lora[3])
        logits = self.logits(x, triton_ops.norm)
        return logits, logits[:, : w.decodable].argmax(dim=-1)

    def lora_layers(self, row_slots: torch.Tensor, prefill: bool = False) -> dict[int, list[tuple]]:
        """{block: [(a, b, mask) for each fused matrix of the block]} for the adapted blocks,
        masked by each row's adapter slot (prefill rows hold several positions: the mask broadcasts)."""
        masks = self.lora.masks(row_slots)
        if prefill:
            masks = [mask[:, None] for mask in masks]
        return {
            layer: [(a, b, mask) for (a, b), mask in zip(pairs, masks, strict=False)]
            for layer, pairs in self.lora.blocks.items()
        }
