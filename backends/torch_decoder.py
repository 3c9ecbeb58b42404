"""Batched decoding on PyTorch for the decoder-only families (backends/architecture.py: Phi,
Llama and Mistral, Qwen2/3, Phi-3): a paged KV cache (backends/kv_pages), each block's Linears
fused into as few matrices as its shape allows, and on CUDA every decode step replayed from a
CUDA graph.

One decoder for every family: what differs between them (the norm, a parallel or a sequential
block, a gated MLP or not, grouped key-value heads, biases, q/k norms, sliding windows, the rotary
embedding's part of a head and its scaling) is read from the model's config into an
`Architecture`, and each step branches on those facts, never on a family's name.

Sequences join and leave between steps. Each active sequence owns one row (rows stay packed:
0..n-1) and the cache pages its row's table names, taken when it joins for its prompt and
max_new_tokens, so a decode step is one pass over rows 0..b-1 for every live sequence at once,
each at its own position, with its own sampling. New prompts are prefilled
together, padded to the longest of like length, at most `prefill_chunk` tokens a step, so a
long prompt does not stall the sequences already decoding for more than a chunk's time; short
prompts arriving behind a long one share that budget with it (`_prefill_takes`). On CUDA those
pieces run on a stream of their own, beside the decode steps (`_step`).

On CUDA a block's decode step is cuBLAS's GEMMs with Triton kernels between them
(backends/triton_decode: attention over each row's live columns, rotary, GELU or SiLU, the
norms, the residual), captured once per batch bucket and replayed from a CUDA graph; greedy and
sampled steps are chained on the device (sampled rows drawn there too), so the GPU does not wait
for Python between them. Quantized weights, a block neither parallel nor RMS-normed, and CUDA
without Triton take the step in torch ops (`decode_block`, compiled on CUDA by default), one
graph per (batch, attention-length) bucket.
On the CPU that step runs eagerly and the cache's pool grows and shrinks with what its
sequences hold; a step's prompt pieces go through the decode step's own pass (`_mixed_step`).

While one sequence decodes alone, a step may verify a prompt-lookup draft instead
(`draft_tokens`, backends/prompt_lookup): its next input and the draft go through the prefill
path as one piece, and the tokens the model agrees with are kept; the columns of rejected ones
are written over by the next step, as a padded prefill's are. Measurements: BENCHMARKS.md.
"""

from __future__ import annotations

import itertools
import logging
import secrets
from contextlib import nullcontext
from functools import partial
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right

from backends import KvCacheUsage, PromptCacheUsage, Sequence, StepLogprobs, TokenLogprob, prompt_cache_namespace
from backends.architecture import GELU_TANH, Architecture
from backends.grammar import advance_together
from backends.kv_pages import PAGE, PagedKV, pages_for
from backends.prompt_cache import PagedPrefixCache
from backends.prompt_lookup import PromptLookup, speculates
from backends.torch_logprobs import token_logprobs
from backends.torch_lora import FusedLoraSlots, FusedMatrix
from backends.torch_quant import QuantizedWeight, linear, quantize_weight
from backends.torch_sampling import (
    TokenChooser,
    choose_rows,
    sample_on_device,
    sampled_on_device,
    unpack_on_device,
    verify_draft,
)

log = logging.getLogger("phi2_server.torch_decoder")

# The batch sizes that CUDA graphs are captured for (a batch runs in the next one up, its idle
# rows on the scratch page), up to the most rows MAX_BATCH's default takes (CUDA_BATCHES). A
# batch past the last bucket was captured at its own size: at 512 clients on an H200 every size
# from 257 to 512 that joins and leaves made, a capture of tens of ms while every stream waited.
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 48, 64, 96, 128, 192, 256, 320, 384, 448, 512)
# Prefill of one piece after cached columns (a prompt continuing a stored prefix, or a chunk of a
# long one), on CUDA: from this many tokens, bottom-right causal attention (flash); shorter
# pieces, an explicit mask (memory-efficient kernel), or with the Triton kernels the paged
# attention kernel, which reads the row's blocks in place. On an H200 (tests/gpu/kernels.py
# --only continued): 1,050 tokens after 2 cached, 13.7 ms against 17.6 with the mask; 512 after
# 512, 13.9 against 10.8; 15-100 after 1,000, 12.2-15.0 against 9.9-10.2. Between 512 and 1,050
# it was not measured: 768 splits the difference. The paged kernel against the mask
# (tests/gpu/first_token.py): 400-512 tokens after 512-1,500, 8.3-10.2 ms against 9.6-11.9;
# 600 after 100, 12.3 against 12.0.
LOWER_RIGHT_FROM = 768
MIN_LENGTH_BUCKET = 128
# Prompt pieces prefilled on CUDA are padded to one of these lengths, and their group to a batch
# bucket, and replayed from a CUDA graph of that shape (`_prefill_padded`): an eager prefill of a
# short prompt was ~500 launches, 10-15 ms on an H200 against ~2 ms of weights to read.
# - New prompts (from position 0): groups of up to PREFILL_GRAPH_TOKENS.
# - Pieces that continue cached columns (a stored prefix's tail: a chat's next turn; a long
#   prompt's last chunk) attend to the columns before them too (with the Triton kernels through
#   the page tables, else a gather and a mask): graphs for spans of CONTINUE_SPANS columns,
#   groups of up to CONTINUE_GRAPH_TOKENS (past that the pass is compute-bound and launches cost
#   little) and CONTINUE_GRAPH_COLUMNS (what a gather copies, or the kernel reads).
# Longer pieces, bigger groups and longer spans run eagerly. 512 is the piece a long prompt is cut
# into while streams decode (`prefill_chunk`): eager, such a step took 17-22 ms on an H200, its
# launches, not its GEMMs, the most of it; graphed, 13 (BENCHMARKS.md, "A long row among short ones").
PREFILL_LENGTHS = (16, 32, 64, 128, 256, 512)
# A new prompt of up to this many tokens is prefilled whole from a graph even where a stored
# prefix would shorten it (its tail would cost about as much); a longer one continues the prefix.
WHOLE_FROM_GRAPH = 256
PREFILL_GRAPH_TOKENS = 8192
CONTINUE_SPANS = (512, 2048, 8192)
CONTINUE_GRAPH_TOKENS = 1024
CONTINUE_GRAPH_COLUMNS = 16384
# The CPU's pool keeps at least this many pages (backends/kv_pages) when it shrinks.
MIN_PAGES = MIN_LENGTH_BUCKET // PAGE


def supports(model) -> bool:
    """Whether the general decoder serves this model (backends/architecture.py says which)."""
    return Architecture.of(model.config) is not None


def activation(name: str):
    """The MLP's activation as one kernel (transformers' NewGELU is six)."""
    if name in GELU_TANH:
        return lambda x: F.gelu(x, approximate="tanh")
    if name == "gelu":
        return F.gelu
    return F.silu


def prefill_attention():
    """The attention kernels prefill may use on CUDA: not cuDNN's, which builds an execution plan
    for every new (query, key) length, and a prompt continuing a cached prefix has a new one
    each time. Measured on an H200, 30 new tokens after 1,000 cached: 2 ms a layer with cuDNN's
    kernel chosen (time to first token 78-85 ms), 0.03 ms without (10-15 ms)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH])


def bucket(n: int, buckets) -> int:
    return next((b for b in buckets if b >= n), n)


class Block(NamedTuple):
    """One block's weights as the step reads them (None where the family has none).

    Parallel blocks (Phi: x + attention(LN x) + mlp(LN x)) read LN(x) once for q, k, v and fc1:
    `w_in` is [q; k; v; fc1], and the output Linears add to the same residual: `w_out` is
    [o | fc2] over [attention, act(fc1)], `b_out` their biases summed. Sequential blocks: `w_in`
    is [q; k; v], `w_out` the output projection; then `norm2`, `w_up` ([gate; up] in a gated
    MLP, else fc1) and `w_down`. Two GEMMs a block for Phi, four for the others, where
    transformers runs six or seven."""

    norm1_w: torch.Tensor
    norm1_b: torch.Tensor | None
    w_in: torch.Tensor
    b_in: torch.Tensor | None
    w_out: torch.Tensor
    b_out: torch.Tensor | None
    norm2_w: torch.Tensor | None = None
    norm2_b: torch.Tensor | None = None
    w_up: torch.Tensor | None = None
    b_up: torch.Tensor | None = None
    w_down: torch.Tensor | None = None
    b_down: torch.Tensor | None = None
    q_norm: torch.Tensor | None = None  # Qwen3: RMSNorm weights over a head of q, and of k
    k_norm: torch.Tensor | None = None

    def matrices(self) -> list[str]:
        return [name for name in ("w_in", "w_out", "w_up", "w_down") if getattr(self, name) is not None]


class Shape(NamedTuple):
    """What a step needs of the architecture besides the weights (static for torch.compile)."""

    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    rotary_dim: int
    inner: int
    eps: float
    rms_norm: bool
    parallel: bool
    gated: bool
    activation: object


# The methods whose output head is quantized too. w8a8 is the fast choice on the CPU: there the
# float32 head of Phi-2 (51,200 x 2,560) was a sixth of the bytes a decode step reads beside the
# int8 blocks, and llama.cpp's Q8_0 files quantize theirs. Weight-only int8 stays the faithful
# choice, with its head in the model's dtype (BENCHMARKS.md "int8 activations").
QUANTIZED_HEAD_METHODS = ("w8a8",)


class DecoderWeights:
    """The model's weights as the step reads them, fused (see `Block`), and its rotary tables.

    The model's own Linears are re-pointed at views of the fused matrices, so nothing is stored
    twice and transformers' forward still works on the same weights."""

    def __init__(
        self, model, decodable: int, context: int, blocks: list[dict] | None = None, head: QuantizedWeight | None = None
    ):
        """`blocks`: each layer's `Block` fields as stored by quant_store (quantized already), in
        place of fusing the model's Linears (which are empty then); `head`: the output head as
        stored quantized (w8a8), in place of the model's own."""
        arch = Architecture.of(model.config)
        if arch is None:
            raise ValueError(f"{model.config.model_type} is not served by the general decoder")
        self.arch = arch
        self.model = model
        inner = model.model
        self.decodable = decodable  # ids from here on decode to nothing: they are never sampled
        self.context = context
        self.hidden, self.heads, self.head_dim, self.inner = arch.hidden, arch.heads, arch.head_dim, arch.inner
        self.embed = inner.embed_tokens.weight
        final = inner.final_layernorm if arch.family == "phi" else inner.norm
        self.final_norm = (final.weight, getattr(final, "bias", None))
        self.lm_head = (head or model.lm_head.weight, getattr(model.lm_head, "bias", None))
        self.activation = activation(arch.activation)
        self.shape = Shape(
            arch.hidden,
            arch.heads,
            arch.kv_heads,
            arch.head_dim,
            arch.rotary_dim,
            arch.inner,
            arch.eps,
            arch.rms_norm,
            arch.parallel,
            arch.gated,
            self.activation,
        )
        if blocks is not None:
            self.layers = [Block(**fields) for fields in blocks]
        else:
            with torch.no_grad():
                self.layers = [self._block(layer) for layer in inner.layers]
        self.lora_matrices = lora_matrices(arch)

    def _block(self, layer) -> Block:
        arch, find = self.arch, layer.get_submodule
        names = arch.layout
        if "qkv" in names:
            attention_in = [find(names["qkv"])]
        else:
            attention_in = [find(names["q"]), find(names["k"]), find(names["v"])]
        norm1 = layer.input_layernorm
        if arch.parallel:  # [q; k; v; fc1] over LN(x), [o | fc2] into the residual
            w_in, b_in = fuse_rows([*attention_in, find(names["fc1"])])
            o, fc2 = find(names["o"]), find(names["fc2"])
            w_out = torch.cat([o.weight, fc2.weight], dim=1)
            o.weight, fc2.weight = _param(w_out[:, : o.in_features]), _param(w_out[:, o.in_features :])
            b_out = _sum_bias(o.bias, fc2.bias)
            return Block(norm1.weight, getattr(norm1, "bias", None), w_in, b_in, w_out, b_out)
        w_in, b_in = fuse_rows(attention_in)
        o = find(names["o"])
        up = [find(names["gate_up"])] if "gate_up" in names else [find(names["gate"]), find(names["up"])]
        w_up, b_up = fuse_rows(up)
        down = find(names["down"])
        norm2 = layer.post_attention_layernorm
        attention = layer.self_attn
        q_norm = attention.q_norm.weight if arch.qk_norm else None
        k_norm = attention.k_norm.weight if arch.qk_norm else None
        return Block(
            norm1.weight,
            getattr(norm1, "bias", None),
            w_in,
            b_in,
            o.weight,
            o.bias,
            norm2.weight,
            getattr(norm2, "bias", None),
            w_up,
            b_up,
            down.weight,
            down.bias,
            q_norm,
            k_norm,
        )

    @property
    def device(self) -> torch.device:
        return self.embed.device

    @torch.no_grad()
    def quantize(self, model, method: str) -> list[QuantizedWeight]:
        """Quantize the fused block matrices (torch_quant) and free their full-precision copies.

        The model's own Linears in the blocks are views of those copies (or the copies
        themselves): they are emptied too, so a quantized model serves through this decoder
        only (transformers' forward would find no weights). Layer by layer, so the peak memory
        stays one layer above the full-precision model."""
        quantized = []
        for index, (layer, block) in enumerate(zip(model.model.layers, self.layers, strict=False)):
            replaced = {}
            for name in block.matrices():
                replaced[name] = quantize_weight(getattr(block, name), method)
                quantized.append(replaced[name])
            self.layers[index] = block._replace(**replaced)
            for module in layer.modules():
                if isinstance(module, torch.nn.Linear):
                    module.weight = _param(torch.empty(0, dtype=block.w_in.dtype, device=block.w_in.device))
        if method in QUANTIZED_HEAD_METHODS:
            head = quantize_weight(self.lm_head[0], method)
            if model.lm_head.weight.data_ptr() != self.embed.data_ptr():  # a tied head is the embedding: kept
                model.lm_head.weight = _param(torch.empty(0, dtype=self.embed.dtype, device=self.embed.device))
            self.lm_head = (head, self.lm_head[1])
            quantized.append(head)
        return quantized

    @property
    def quantized_head(self) -> QuantizedWeight | None:
        return self.lm_head[0] if isinstance(self.lm_head[0], QuantizedWeight) else None

    def rotary_tables(self, length: int, dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sign-folded sin for positions 0..length-1 (see `rope_`), from the model's own
        rotary module (so every scaling transformers knows is applied as it applies it), in
        float32 then cast, as transformers does.

        A rotary scaling that depends on the sequence's length is taken per position here:
        longrope (Phi-3's 128k models) turns position p with its long factors when p is past
        `original_max_position_embeddings` (transformers uses them for every position of a
        sequence once it is longer than that); dynamic NTK scaling only starts past the context
        window, which the server does not go beyond. Positions the table does not cover (the
        cache's scratch column) repeat the last one."""
        rotary = self.model.model.rotary_emb
        device = self.embed.device
        x = torch.zeros(1, dtype=torch.float32, device=device)
        covered = min(length, self.context)
        cuts = [0, covered]
        original = (getattr(self.model.config, "rope_parameters", None) or {}).get("original_max_position_embeddings")
        if getattr(rotary, "rope_type", "default") == "longrope" and original and original < covered:
            cuts = [0, original, covered]
        cos_parts, sin_parts = [], []
        with torch.no_grad():
            for start, end in zip(cuts, cuts[1:], strict=False):
                cos, sin = rotary(x, torch.arange(start, end, device=device)[None])
                cos_parts.append(cos[0].float())
                sin_parts.append(sin[0].float())
        return self._table(torch.cat(cos_parts), torch.cat(sin_parts), length, dtype)

    @property
    def long_prompts_from(self) -> int | None:
        """longrope: a prompt longer than this is prefilled with the long factors at every
        position, as transformers does (`long_rotary_tables`); None for other rotaries."""
        rotary = self.model.model.rotary_emb
        if getattr(rotary, "rope_type", "default") != "longrope":
            return None
        return (getattr(self.model.config, "rope_parameters", None) or {}).get("original_max_position_embeddings")

    def long_rotary_tables(self, length: int, dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """longrope's long factors at every position 0..length-1 (see `rotary_tables`)."""
        rotary = self.model.model.rotary_emb
        device = self.embed.device
        covered = min(length, self.context)
        with torch.no_grad():  # positions past the original length: transformers takes the long factors
            cos, sin = rotary(
                torch.zeros(1, dtype=torch.float32, device=device), torch.arange(covered, device=device)[None]
            )
        return self._table(cos[0].float(), sin[0].float(), length, dtype)

    def _table(self, cos: torch.Tensor, sin: torch.Tensor, length: int, dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sign-folded sin, as long as `length` (the last position repeated), in `dtype`."""
        if len(cos) < length:
            cos = torch.cat([cos, cos[-1:].expand(length - len(cos), -1)])
            sin = torch.cat([sin, sin[-1:].expand(length - len(sin), -1)])
        half = cos.shape[-1] // 2
        sign = torch.cat((-torch.ones(half), torch.ones(half))).to(cos.device)
        return cos.to(dtype), (sin * sign).to(dtype)


def fuse_rows(modules) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The Linears' weights stacked ([out_1 + out_2 + ..., in]: one GEMM over the same input), and
    their biases (zeros for a module without one, if another has one); each module's weight and
    bias become views of them."""
    if len(modules) == 1:
        return modules[0].weight, modules[0].bias
    weight = torch.cat([m.weight for m in modules])
    with_bias = any(m.bias is not None for m in modules)
    bias = (
        torch.cat([m.bias if m.bias is not None else weight.new_zeros(m.out_features) for m in modules])
        if with_bias
        else None
    )
    row = 0
    for m in modules:
        rows = slice(row, row + m.out_features)
        m.weight = _param(weight[rows])
        if m.bias is not None:
            m.bias = _param(bias[rows])
        row += m.out_features
    return weight, bias


def _sum_bias(a, b):
    if a is None or b is None:
        return a if b is None else b
    return a + b


def lora_matrices(arch: Architecture) -> list[FusedMatrix]:
    """Where each adaptable module (by the name mlx-lm gives it) sits in a block's fused matrices,
    in `Block.matrices()` order: the rows of the matrix's input it reads, and the columns of its
    output it writes."""
    names, h, q, kv, inner = arch.layout, arch.hidden, arch.q_size, arch.kv_size, arch.inner
    qkv = q + 2 * kv
    if "qkv" in names:
        attention = {names["qkv"]: (0, h, 0, qkv)}
    else:
        attention = {names["q"]: (0, h, 0, q), names["k"]: (0, h, q, q + kv), names["v"]: (0, h, q + kv, qkv)}
    if arch.parallel:
        return [
            FusedMatrix(h, qkv + inner, {**attention, names["fc1"]: (0, h, qkv, qkv + inner)}),
            FusedMatrix(q + inner, h, {names["o"]: (0, q, 0, h), names["fc2"]: (q, q + inner, 0, h)}),
        ]
    up = (
        {names["gate_up"]: (0, h, 0, 2 * inner)}
        if "gate_up" in names
        else {names["gate"]: (0, h, 0, inner), names["up"]: (0, h, inner, 2 * inner)}
    )
    return [
        FusedMatrix(h, qkv, attention),
        FusedMatrix(q, h, {names["o"]: (0, q, 0, h)}),
        FusedMatrix(h, 2 * inner, up),
        FusedMatrix(inner, h, {names["down"]: (0, inner, 0, h)}),
    ]


def _fused_available(weights: DecoderWeights, on_cuda_graphs: bool) -> bool:
    """The Triton step serves unquantized weights on CUDA, where Triton is installed."""
    arch = weights.arch
    if (
        not on_cuda_graphs
        or isinstance(weights.layers[0].w_in, QuantizedWeight)
        or not (arch.parallel or arch.rms_norm)
    ):
        return False
    try:
        from backends import triton_decode
    except ImportError:
        log.warning("Triton is not installed: the CUDA decode step runs without its fused kernels")
        return False
    w = weights
    return triton_decode.works(
        w.device, w.embed.dtype, heads_of(arch), w.hidden, w.inner, arch.parallel, arch.qk_norm, arch.gated
    )


def heads_of(arch: Architecture):
    """The attention's facts as the Triton kernels take them."""
    from backends.triton_decode import Heads

    return Heads(arch.heads, arch.kv_heads, arch.head_dim, arch.rotary_dim, arch.eps)


def _param(tensor: torch.Tensor) -> torch.nn.Parameter:
    return torch.nn.Parameter(tensor, requires_grad=False)


def rope_(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor, rotary_dim: int) -> None:
    """Rotary embedding, in place, on the first `rotary_dim` dims of each head of x ([..., heads, head_dim]).

    transformers computes x*cos + rotate_half(x)*sin with rotate_half(x) = [-x2, x1]; that is
    roll(x, half) * [-1.., 1..], so the sign is folded into the sin table: three kernels."""
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
    x = x + out
    h = norm(x, block.norm2_w, block.norm2_b, shape.eps, shape.rms_norm)
    u = linear(h, block.w_up, block.b_up)
    if lora is not None:
        u = u + lora_product(h, *lora[2])
    g = shape.activation(u[..., : shape.inner]) * u[..., shape.inner :] if shape.gated else shape.activation(u)
    out = linear(g, block.w_down, block.b_down)
    if lora is not None:
        out = out + lora_product(g, *lora[3])
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
    return mlp_and_residual(x, attention, y, block, shape, lora)


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


class _Placement:
    """Where prefill pieces go: their slots [n], positions [n, length], the key span to attend
    over, and the mask (None: plain causal from position 0); with the Triton kernels, pieces
    after cached columns give their first positions and lengths [n] instead (`paged`), and
    attend through the rows' page tables (`triton_decode.paged_prefill_attention`)."""

    def __init__(self, slots, positions, span: int, mask, starts=None, lens=None):
        self.slots, self.positions, self.span, self.mask = slots, positions, span, mask
        self.starts, self.lens = starts, lens

    @property
    def paged(self) -> bool:
        return self.starts is not None


class _Launch:
    """A decode step started on the device and not yet read."""

    def __init__(self, rows, logits, greedy, done, batch: int = 0, masked: list[int] = (), sampled: list[int] = ()):
        self.rows, self.logits, self.greedy, self.done = rows, logits, greedy, done
        self.batch = batch
        self.masked = masked  # rows whose token the device chooses under their grammar's mask (`_finish`)
        self.sampled = sampled  # rows whose token the device samples (`_finish`)
        self.piece_logits: torch.Tensor | None = None  # prompt pieces', prefilled in the same pass (`_mixed_step`)


class _Prefill:
    """Prompt pieces launched and not yet read: each pass's pieces (slot, ids, first position),
    last-position logits and every-position logits; `beside`: launched before a decode step, to
    be read once done (`_step`); on CUDA, `side` is the stream they run on, and `done` the event
    that marks their end (on the CPU they are done once launched)."""

    def __init__(self, side, beside: bool = False):
        self.side = side
        self.beside = beside
        self.passes: list[tuple[list[tuple[_Slot, list[int], int]], torch.Tensor, dict]] = []
        self.done: torch.cuda.Event | None = None

    def ready(self) -> bool:
        return self.done is None or self.done.query()

    def slots(self) -> list[_Slot]:
        return [slot for group, _, _ in self.passes for slot, _, _ in group]


class _Slot:
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
        self.lora_index = lora_index  # its adapter's slot in the decoder's FusedLoraSlots; -1: the base model
        self.cached = 0  # tokens in the cache: the prompt as far as prefilled, then the generated ones fed back
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
        (`_prefill_padded`); None: with CUDA graphs and the fused step. Without CUDA graphs
        (the CPU, in tests) the padded pass runs eagerly. `overlap_prefill`: prompt pieces run
        on a CUDA stream of their own while decode steps run (None: on CUDA with graphs)."""
        self.weights = weights
        self.device = weights.device
        self.dtype = weights.embed.dtype
        self.capacity = max_batch
        self.adapter_slots = adapter_slots
        self.draft_tokens = draft_tokens
        self.lora = FusedLoraSlots(weights.lora_matrices, adapter_slots, self.device, self.dtype)
        self.context = min(weights.context, context or weights.context)
        on_cuda = self.device.type == "cuda"
        self.prefill_chunk = prefill_chunk or (512 if on_cuda else 64)
        self.use_graphs = on_cuda if cuda_graphs is None else cuda_graphs
        self.cos, self.sin = self.weights.rotary_tables(self.context + 1, self.dtype)
        # longrope: a prompt longer than its original length is prefilled with the long factors.
        self.long_prompts_from = self.weights.long_prompts_from
        self.cos_long = self.sin_long = None
        if self.long_prompts_from is not None:
            self.cos_long, self.sin_long = self.weights.long_rotary_tables(self.context + 1, self.dtype)
        self.slots: list[_Slot] = []
        self.index: dict[int, int] = {}  # sequence id -> slot
        self._arrivals = itertools.count()  # each slot's arrival, in the order they join
        self.rows = bucket(max_batch, BATCH_BUCKETS) if self.use_graphs else max_batch
        # The KV cache: pages of PAGE positions from one pool, a table of each row's pages
        # (backends/kv_pages). A row takes the pages of its prompt and max_new_tokens when it
        # joins, and the engine admits a sequence only if they fit (`fits`): one long prompt
        # cannot take the process past its memory. The pool is laid out once for
        # `kv_cache_bytes` (or a full-context row for each row) and the prompt cache's budget:
        # on a GPU allocated whole (graphs hold its address), on the CPU as address space that
        # memory backs where rows write (backends/kv_pages).
        arch = weights.arch
        self.per_position = 2 * len(weights.layers) * arch.kv_heads * weights.head_dim * self.dtype.itemsize
        self.kv_budget = kv_cache_bytes
        self.scratch = self.context  # the column idle rows and padding write: past every sequence's reach
        page_bytes = PAGE * self.per_position
        # The prompt cache keeps its pages in the same pool (it shares them with the rows that
        # reuse them): room for its budget besides the rows'.
        self.cache_pages = self._cache_pages(prompt_cache_bytes, page_bytes)
        full_rows = self.rows * pages_for(self.context + 1)
        rows_pages = int(kv_cache_bytes // page_bytes) - 1 if kv_cache_bytes else full_rows
        most_pages = 1 + rows_pages + self.cache_pages
        self.kv = PagedKV(
            len(weights.layers),
            arch.kv_heads,
            weights.head_dim,
            self.dtype,
            self.device,
            self.rows,
            self.context,
            min(1 + MIN_PAGES, most_pages),  # on the CPU: its extent grows with what rows take
            most_pages,
            whole=self.use_graphs or self.device.type != "cpu",
        )
        self.prompts = PagedPrefixCache(prompt_cache_bytes, self.kv, self.cache_pages)
        self._shape = self.weights.shape
        # torch.compile fuses each block's small kernels (norms, rotary, activations, residuals);
        # dynamic shapes: one compilation serves every batch and length bucket.
        self._layer = torch.compile(decode_block, dynamic=True, fullgraph=True) if compile else decode_block
        # On CUDA the decode step puts Triton kernels between cuBLAS's GEMMs (backends/triton_decode),
        # adapters too; quantized weights take the step above.
        self.fused = _fused_available(weights, self.use_graphs) if fused is None else fused
        self.heads = heads_of(weights.arch) if self.fused else None
        # Per row: input token, position, 1 if the row decodes (its position advances when
        # chained), and its adapter's slot (-1: none).
        self.inputs = torch.zeros(4, self.rows, dtype=torch.long, device=self.device)
        pinned = self.device.type == "cuda"
        self._host_inputs = torch.zeros(4, self.rows, dtype=torch.long, pin_memory=pinned)
        self._greedy_host = [torch.zeros(self.rows, dtype=torch.long, pin_memory=pinned) for _ in range(2)]
        self._flip = 0
        self._mask_host: list[torch.Tensor] | None = (
            None  # pinned: constrained rows' index and packed masks (`_masks_to_device`)
        )
        self._mask_flip = 0
        self._sampling_host: list | None = None  # pinned: sampled rows' index and settings (`_sampling_to_device`)
        self._sampling_flip = 0
        self._inflight: _Launch | None = None
        self._stash: dict[int, int] | None = None
        # Prompt pieces beside the decode steps: on CUDA with graphs, on a stream of their own
        # (`_step`), their graphs in a memory pool of their own, as the two run at once.
        self.overlap_prefill = self.use_graphs and on_cuda if overlap_prefill is None else overlap_prefill
        # The most prompt tokens launched beside the steps at once (`_start_prefill`).
        self.overlap_budget = max(self.prefill_chunk, min(self.context, PREFILL_GRAPH_TOKENS))
        self._side = torch.cuda.Stream(self.device) if self.overlap_prefill and on_cuda else None
        self._prefilling: _Prefill | None = None
        self._prefill_pool = None
        self._prefill_capture: torch.cuda.Stream | None = None  # the stream their graphs are captured on
        self.logprobs: dict[int, StepLogprobs] = {}
        self.graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, tuple[torch.Tensor, torch.Tensor]]] = {}
        self._pool = None
        self.prefill_graphs = (self.use_graphs and self.fused) if prefill_graphs is None else prefill_graphs
        self._padded_graphs: dict[tuple[int, int, int], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self._padded_inputs: tuple[torch.Tensor, torch.Tensor] | None = None  # `_padded_buffers`

    @property
    def k(self) -> list[torch.Tensor]:
        """Each layer's key pages [kv_heads, pages, PAGE, head_dim] (backends/kv_pages)."""
        return self.kv.k

    @property
    def v(self) -> list[torch.Tensor]:
        return self.kv.v

    def kv_cache_usage(self) -> KvCacheUsage:
        kv = self.kv
        # On a GPU the whole pool but the prompt cache's share is the budget: allocated at once,
        # in what KV_CACHE_BYTES allowed. Blocks count the cache's too (one pool).
        budget = self.kv_budget or 0 if kv.grows else (kv.pages - self.cache_pages) * kv.page_bytes
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

    def _columns(self, need: int) -> int:
        """The cache columns a sequence of `need` positions (its prompt and max_new_tokens) may
        use: its positions and one more that a last decode step may write."""
        return min(need + 1, self.context)

    def _need(self, sequence: Sequence) -> int:
        return len(sequence.prompt_ids) + sequence.max_new_tokens

    def _row_page_limit(self) -> int:
        """The most pages the rows may hold, the scratch page included: the pool's but the
        prompt cache's share."""
        return self.kv.most_pages - self.cache_pages

    def _cache_pages(self, prompt_cache_bytes: int, page_bytes: int) -> int:
        """The most pages the prompt cache keeps: its budget's."""
        return prompt_cache_bytes // page_bytes

    def has_room_for(self, prompt_cache_bytes: int) -> bool:
        """Whether the pool has room for a prompt cache of that budget (`clear`)."""
        return self._cache_pages(prompt_cache_bytes, self.kv.page_bytes) <= self.cache_pages

    def fits(self, needs: list[int]) -> bool:
        """Whether new sequences of `needs` positions each fit beside the active ones (counted
        whole: what they may share of stored prompts is not known yet)."""
        if len(self.slots) + len(needs) > self.capacity:
            return False
        wanted = sum(pages_for(self._columns(n)) for n in needs)
        return 1 + self.kv.row_pages + wanted <= self._row_page_limit()

    def _take_pages(self, row: int, columns: int, shared: list[int] = ()) -> None:
        """Give a row the pages of `columns` columns, `shared` (a stored prefix's) first, the
        CPU's pool's extent grown for the rest (no copy: backends/kv_pages)."""
        kv = self.kv
        short = pages_for(columns) - len(shared) - len(kv.free)
        if short > 0:
            if not kv.grows or kv.pages + short > kv.most_pages:
                raise RuntimeError("the KV pool is full")  # `fits` admits no sequence past it
            kv.resize(kv.pages + short)
        kv.assign(row, columns, shared)

    def _shrink(self) -> None:
        """On the CPU, give memory back once the pool holds over twice what its sequences use."""
        if not self.kv.grows:
            return
        kv = self.kv
        enough = max(kv.held_pages, MIN_PAGES) + 1
        if kv.pages > 2 * enough:
            kv.resize(enough)

    # -- the contract ----------------------------------------------------------------------------

    @torch.inference_mode()
    def clear(self, prompt_cache_bytes: int = 0) -> None:
        """Forget every sequence and stored prompt, with a new prompt cache budget (a fresh
        decoder for the worker, keeping the cache memory and the graphs)."""
        self._drain()
        self._stash = None
        self._prefilling = None  # what it wrote is forgotten with its rows
        self.slots.clear()
        self.index.clear()
        self.lora.table.users = [0] * self.lora.size  # the adapters stay in their slots, unused
        self.prompts.clear()
        self.kv.release([row for row, held in enumerate(self.kv.held) if held])
        # The pool was laid out with room for the prompt cache budget it was made with, which a
        # new one cannot exceed.
        if not self.has_room_for(prompt_cache_bytes):
            prompt_cache_bytes = self.cache_pages * self.kv.page_bytes
        self.cache_pages = self._cache_pages(prompt_cache_bytes, self.kv.page_bytes)
        self.prompts = PagedPrefixCache(prompt_cache_bytes, self.kv, self.cache_pages)
        self._shrink()

    def prompt_cache_usage(self) -> PromptCacheUsage:
        return self.prompts.usage()

    @torch.inference_mode()
    def logits_after(self, ids: list[int], adapter=None, every_position: bool = False) -> torch.Tensor:
        """The next-token logits after `ids` (float32), with `adapter` if given, computed in a free
        row, which stays free; for checks and benchmarks (quantized weights, the GPU check).
        `every_position`: the logits after each prefix of `ids` ([len(ids), vocab])."""
        if len(self.slots) >= self.rows:
            raise RuntimeError("no free row")
        self._drain()
        index = self._place(adapter)
        row = len(self.slots)
        self._take_pages(row, len(ids))
        try:
            last, every = self._prefill(
                [(row, ids, 0)],
                every_position=[0] if every_position else (),
                lora_rows=[index],
                long_rope=[self._long_prompt(ids)],
            )
            return (every[0] if every_position else last[0]).float()
        finally:
            self.kv.release([row])
            if index >= 0:
                self.lora.release(index)

    def _drain(self, prefill: bool = True) -> None:
        """Read a step still in flight before the slots change under it; with `prefill`, what
        the device does next waits for prompt pieces still running beside the steps."""
        if self._inflight is not None:
            produced, self._inflight = self._collect(self._inflight), None
            self._stash = {**(self._stash or {}), **produced}
        if prefill:
            self._after_prefill()

    def _after_prefill(self) -> None:
        """The device's next work on this stream waits for the prompt pieces in flight (no wait
        on the host): before their rows' pages or table rows change, or buffers that they read."""
        if self._prefilling is not None and self._prefilling.side is not None:
            torch.cuda.current_stream().wait_stream(self._prefilling.side)

    @torch.inference_mode()
    def add(self, sequence: Sequence) -> int:
        if len(self.slots) >= self.capacity:
            raise RuntimeError("decoder is full")
        if self._stash:  # a token drawn for an earlier sequence of the same id is not this one's
            self._stash.pop(sequence.id, None)
        row = len(self.slots)
        chooser = TokenChooser(sequence.sampling, sequence.prompt_ids, self.weights.decodable, self.device)
        slot = _Slot(
            sequence,
            chooser,
            self._place(sequence.adapter),
            device_sampling=self.fused and self.use_graphs,
            draft_tokens=self.draft_tokens,
            arrival=next(self._arrivals),
        )
        # A stored prefix goes straight into the slot's rows (at least the last prompt token is
        # left to prefill: the first sampled token needs fresh logits). Prompt logprobs need
        # the logits of every prompt position: that prompt is prefilled whole.
        limit = 0 if sequence.prompt_logprobs is not None else len(sequence.prompt_ids) - 1
        prompt = sequence.prompt_ids
        if len(prompt) <= WHOLE_FROM_GRAPH and self._padded_shape(
            [(row, prompt, 0)], (), [slot.lora_index], [self._long_prompt(prompt)]
        ):
            # A new prompt this short is prefilled whole from a CUDA graph (24 tokens of Phi-2 on
            # an H200: 3 ms, the weights' read): its tail after a stored prefix would cost about
            # as much, so none is reused.
            limit = 0
        reused, nodes = self.prompts.match(sequence.prompt_ids, limit, namespace=self._namespace(sequence))
        # The stored prefix's pages go into the row's table as they are (no copy): those it
        # fills; the page where it ends part-way is copied, as the row writes the rest of it.
        stored = self.prompts.pages_of(nodes, reused) if reused else []
        whole = reused // PAGE
        self._take_pages(row, self._columns(self._need(sequence)), stored[:whole])
        if reused % PAGE:
            self.kv.copy_page(stored[whole], self.kv.held[row][whole])
        self.index[sequence.id] = row
        self.slots.append(slot)
        if reused:
            slot.cached = reused
            if reused == len(prompt) - 1:
                # A prompt sent again: its last token is a decode step's input, not an eager
                # prefill of one token (~500 launches, 12 ms on an H200, against a graphed
                # step's ~2); the step's token is its first, drawn at the same position.
                slot.next_token = prompt[-1]
        return reused

    def _long_prompt(self, prompt: list[int]) -> bool:
        return self.long_prompts_from is not None and len(prompt) > self.long_prompts_from

    def _namespace(self, sequence: Sequence) -> str:
        """Its prompt cache namespace; longrope's long prompts have their own (their KV was
        rotated with other factors at every position)."""
        return prompt_cache_namespace(sequence) + ("/long-rope" if self._long_prompt(sequence.prompt_ids) else "")

    def _place(self, adapter) -> int:
        if adapter is None:
            return -1
        if adapter.key not in self.lora.table.keys:
            self._drain()  # its weights are about to be written (or the buffers replaced): no step may be reading them
        version = self.lora.version
        index = self.lora.place(adapter)
        if self.lora.version != version:  # new buffers: graphs that read the old ones are stale
            self.graphs = {key: graph for key, graph in self.graphs.items() if key[2] == 0}
        return index

    def _store(self, row: int) -> None:
        """Keep the KV of a slot (its prompt complete, or its text as it ends) for later prompts
        that start alike: the cache keeps the row's pages, no copy. Only the positions stored
        are read from them; the row, still decoding, writes past them."""
        if self.prompts.limit_bytes <= 0:  # off (or no room for a page): nothing to build the ids for
            return
        slot = self.slots[row]
        held = self.kv.held[row]
        ids = slot.cached_ids()[: len(held) * PAGE]  # (a decoder stepped past max_new_tokens wrote the scratch page)
        self.prompts.store_pages(ids, held, namespace=self._namespace(slot.sequence))

    @torch.inference_mode()
    def remove(self, *sequence_ids: int) -> None:
        """Forget these sequences, keeping the slots packed (0..n-1): their pages go back to the
        pool, and the sequences in the last rows move into the freed rows by their page tables
        (before paging, 64 sequences ending in one step were 64 x 2 x layers row copies, 90 ms on
        an H200, which the next requests waited for)."""
        gone = [i for i in dict.fromkeys(sequence_ids) if i in self.index]
        if not gone:
            return
        self._drain(prefill=False)
        kept = len(self.slots) - len(gone)
        if self._prefilling is not None:
            # Pieces still running beside the steps write through their rows' tables: if one of
            # those rows is freed or moves, the device's next work waits for them (the host
            # does not). One whose sequences all left is not read.
            rows = {self.index[slot.sequence.id] for slot in self._prefilling.slots() if slot.sequence.id in self.index}
            leaving = {self.index[i] for i in gone}
            if any(row in leaving or row >= kept for row in rows):
                self._after_prefill()
            if rows <= leaving:
                self._prefilling = None
        for sequence_id in gone:
            row = self.index[sequence_id]
            slot = self.slots[row]
            if slot.next_token is not None:  # its prefill completed: stored with its text, for a chat's next turn
                self._store(row)
            if slot.lora_index >= 0:
                self.lora.release(slot.lora_index)
        freed = {self.index.pop(sequence_id) for sequence_id in gone}
        holes = sorted(row for row in freed if row < kept)
        movers = [row for row in range(kept, len(self.slots)) if row not in freed]  # as many as the holes
        self.kv.release(sorted(freed))  # what the cache keeps stays held
        self.kv.move(holes, movers)  # their pages stay where they are: only the table rows move
        for hole, mover in zip(holes, movers, strict=True):
            self.slots[hole] = self.slots[mover]
            self.index[self.slots[hole].sequence.id] = hole
        del self.slots[kept:]
        self._shrink()

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
            or len(self.slots) != 1
            or self._stash is not None
            or self._inflight is not None
            or self._prefilling is not None
        ):
            return None
        slot = self.slots[0]
        if slot.lookup is None or slot.next_token is None:
            return None
        slot.lookup.catch_up(slot.generated)
        # No draft past max_new_tokens: its columns are all that the KV budget reserved (`_need`).
        draft = slot.lookup.draft(slot.sequence.max_new_tokens - len(slot.generated) - 1, self.weights.decodable)
        if not draft:
            return None
        # The rotary tables of a decode step (longrope's long factors are a long prompt's prefill's).
        _, every = self._prefill([(0, [slot.next_token, *draft], slot.cached)], every_position=[0])
        tokens = verify_draft(every[0], draft, slot.chooser)
        slot.lookup.verified(draft, tokens)
        slot.cached += len(tokens)  # its next input and the draft ids it kept are in the cache now
        slot.next_token = tokens[-1]
        slot.generated += tokens
        return {slot.sequence.id: tokens}

    def _step(self) -> dict[int, int]:
        if self._stash is not None:  # read early, when a sequence left while a step was in flight
            produced, self._stash = self._stash, None
            return {i: t for i, t in produced.items() if i in self.index}
        if self._inflight is not None:
            if self._can_chain(self._inflight):
                # The next step's forward pass goes first; then this step's tokens are read, the
                # grammars take them and make the masks that the next step's choice needs, while
                # the device computes it.
                chained = self._launch(self._inflight.rows, chained=True, finish=False)
                inflight, self._inflight = self._inflight, None
                produced = self._collect(inflight)
                self._finish(chained)
                self._inflight = chained
                return produced
            produced, self._inflight = self._collect(self._inflight), None
            return produced
        produced = {}
        if self._prefilling is not None and self._prefilling.ready():
            produced.update(self._end_prefill(self._prefilling))
            self._prefilling = None
        decoding = [i for i, s in enumerate(self.slots) if s.next_token is not None and s.sequence.id not in produced]
        pieces = None  # prompt pieces that the decode step's own pass takes along (`_fusable`)
        if self._prefilling is None:
            # While streams decode, prompt pieces run beside their steps (on CUDA, on a stream of
            # their own: a 512-token piece of Phi-2 took 6 ms on an H200 and a 64-row decode step
            # 5.6, one after the other 11.5; side by side, two steps of 7.8 ms ran while it took
            # 15.8). Their first tokens come with the step in which they are found done.
            overlap = bool(decoding) and self.overlap_prefill
            passes = self._prefill_passes(overlap)
            pieces = self._fusable(passes, bool(decoding)) if not overlap else None
            if pieces is None and passes:
                launched = self._start_prefill(passes, overlap)
                if launched.beside:
                    self._prefilling = launched
                else:
                    produced.update(self._end_prefill(launched))
            elif pieces and not decoding:  # several passes' pieces, and no rows: one pass for them
                produced.update(self._first_tokens(self._slots_of(pieces), self._mixed_step(0, 0, pieces)[2], {}))
        if decoding:
            launched = self._launch(decoding, pieces=pieces)
            if self._can_chain(launched):
                self._inflight = launched  # its tokens come with the next step
            else:
                produced.update(self._collect(launched))
            if pieces:  # prefilled in the step's own pass (`_mixed_step`)
                produced.update(self._first_tokens(self._slots_of(pieces), launched.piece_logits, {}))
        if self._prefilling is not None and (not decoding or self._prefilling.ready()):
            produced.update(self._end_prefill(self._prefilling))  # nothing else to do meanwhile: wait
            self._prefilling = None
        return produced

    def _slots_of(self, pieces: list[tuple[int, list[int], int]]) -> list[tuple[_Slot, list[int], int]]:
        return [(self.slots[i], ids, start) for i, ids, start in pieces]

    def _can_chain(self, launched: _Launch) -> bool:
        return (
            self.use_graphs
            and len(launched.rows) == len(self.slots)  # nobody joined or waits for a prompt
            and all(self.slots[i].chains for i in launched.rows)
            # A sequence alone that takes drafts (PROMPT_LOOKUP_TOKENS set on CUDA) is verified
            # from the host each step.
            and not (self.draft_tokens and len(self.slots) == 1 and self.slots[0].lookup is not None)
        )

    def _collect(self, launched: _Launch) -> dict[int, int]:
        """Wait for a launched step (on an event: the GIL is free meanwhile) and take its tokens."""
        if launched.done is not None:
            launched.done.synchronize()
        greedy = launched.greedy.tolist()
        if launched.masked:  # chosen on the device under their masks: the grammars move past them
            tokens = [greedy[i] for i in launched.masked]
            for i, token in zip(launched.masked, tokens, strict=False):
                self.slots[i].chooser.record(token, advance=False)
            advance_together([self.slots[i].chooser.matcher for i in launched.masked], tokens)
        # The others (sampled, or with penalties or logit_bias) choose from their logits here,
        # read back together.
        chosen = [
            i
            for i in launched.rows
            if not (self.slots[i].chooser.plain or self.slots[i].masked or self.slots[i].sampled)
        ]
        if chosen:
            index = torch.tensor(chosen, device=launched.logits.device)
            for i, token in zip(
                chosen, choose_rows(launched.logits[index], [self.slots[i].chooser for i in chosen]), strict=False
            ):
                greedy[i] = token
        produced = {}
        for i in launched.rows:
            slot = self.slots[i]
            token = greedy[i]
            slot.cached += 1  # its input token went into the cache in that step
            slot.next_token = token
            slot.generated.append(token)
            produced[slot.sequence.id] = token
        self._report(launched.logits, [(i, i, produced[self.slots[i].sequence.id]) for i in launched.rows])
        return produced

    def _report(self, logits: torch.Tensor, chosen: list[tuple[int, int, int]]) -> None:
        """Logprobs of the tokens just chosen, (slot, its row of `logits`, token), for the slots
        that asked (only their rows are read)."""
        asking = [(i, row, token) for i, row, token in chosen if self.slots[i].sequence.logprobs is not None]
        if not asking:
            return
        rows = torch.tensor([row for _, row, _ in asking], device=logits.device)
        scores = token_logprobs(
            logits[rows], [token for _, _, token in asking], [self.slots[i].sequence.logprobs for i, _, _ in asking]
        )
        for (i, _, _), score in zip(asking, scores, strict=False):
            slot = self.slots[i]
            prompt = (
                tuple(slot.prompt_scores)
                if slot.sequence.prompt_logprobs is not None and len(slot.generated) == 1
                else None
            )
            self.logprobs[slot.sequence.id] = StepLogprobs(score, prompt)

    # -- prefill ---------------------------------------------------------------------------------

    def _prefill_passes(self, overlap: bool) -> list[list[tuple[int, list[int], int]]]:
        """The passes of prompt pieces (slot, ids, first position) to launch now (`_start_prefill`):
        up to `prefill_chunk` prompt tokens (shared as `_prefill_takes` says), prompts of like
        length together in one padded pass (64 clients arriving at once: a few passes, not 64);
        none if no prompt waits. With `overlap` (streams decode meanwhile), on the side stream,
        where the decode steps that follow run beside the passes instead of after them
        (`_step`): then up to `overlap_budget` tokens, in pieces of `prefill_chunk`, one after
        another (a piece read by the side stream's idle time between steps cost an arriving
        1,052-token prompt a step's wait for each of its three pieces)."""
        budget, piece = self.prefill_chunk, None
        if overlap:
            budget, piece = self.overlap_budget, self.prefill_chunk
        elif self.use_graphs and not any(slot.next_token is not None for slot in self.slots):
            budget = max(budget, self.context)  # no stream waits on this step: whole prompts, one pass each
        parts = []  # (slot, the prompt ids to process now, their first position)
        order = []  # each part's place among its slot's pieces
        for i, take in self._prefill_takes(budget).items():
            slot = self.slots[i]
            for k, at in enumerate(range(slot.cached, slot.cached + take, piece or take)):
                end = min(at + (piece or take), slot.cached + take)
                parts.append((i, slot.sequence.prompt_ids[at:end], at))
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
            size = self._graph_rows(group)
            passes += [group[k : k + size] for k in range(0, len(group), size)] if size else [group]
        return passes

    def _prefill_takes(self, budget: int) -> dict[int, int]:
        """How many prompt tokens each waiting slot prefills this step, within `budget`: with
        others waiting, the oldest prompt takes up to half of it first; then the prompts with the
        fewest tokens left take what remains, fewest first (like ones in arrival order). A short
        prompt that arrives behind a long one waits a step or two, not for all of the long one's
        pieces (on the CPU, 64 tokens a step, 4 short prompts behind a 2,032-token one waited
        ~30 s for their first tokens); the oldest still gets at least half of every step's
        budget, so prompts that keep arriving cannot hold it back, and like prompts arriving
        together are prefilled first come, first served."""
        waiting = sorted(
            (i for i, slot in enumerate(self.slots) if slot.next_token is None), key=lambda i: self.slots[i].arrival
        )
        rest = {i: len(self.slots[i].sequence.prompt_ids) - self.slots[i].cached for i in waiting}

        def whole(i: int) -> bool:
            # A new prompt that a graph prefills whole is not cut: its second piece would be a
            # pass of its own (and before pieces after cached columns were graphed, an eager
            # one: at 512 clients on an H200 the eager passes were a quarter of the worker's time).
            return self.prefill_graphs and self.slots[i].cached == 0 and rest[i] <= PREFILL_LENGTHS[-1]

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

    def _start_prefill(self, passes: list[list[tuple[int, list[int], int]]], overlap: bool) -> _Prefill:
        """Launch `passes` (`_prefill_passes`), on the side stream with `overlap`."""
        side = self._side if overlap else None
        if side is not None:
            side.wait_stream(torch.cuda.current_stream())  # the pages and tables as the host left them
        launched = _Prefill(side, beside=overlap)
        with torch.cuda.stream(side) if side is not None else nullcontext():
            for group in passes:
                scored = [r for r, (i, _, _) in enumerate(group) if self.slots[i].sequence.prompt_logprobs is not None]
                logits, every = self._prefill(
                    group,
                    every_position=scored,
                    long_rope=[self._long_prompt(self.slots[i].sequence.prompt_ids) for i, _, _ in group],
                )
                launched.passes.append(([(self.slots[i], ids, start) for i, ids, start in group], logits, every))
            if side is not None:
                launched.done = torch.cuda.Event()
                launched.done.record(side)
        return launched

    def _end_prefill(self, launched: _Prefill) -> dict[int, int]:
        """Read launched prompt pieces (waiting for them if need be): the prompts they finished
        take their first tokens, and are stored in the prompt cache. Pieces whose sequence left
        meanwhile are passed over."""
        side = launched.side
        if side is not None:
            launched.done.synchronize()  # on an event: the GIL is free meanwhile
            torch.cuda.current_stream().wait_stream(side)  # decode steps read what the pieces wrote
        produced = {}
        with torch.cuda.stream(side) if side is not None else nullcontext():
            for group, logits, every in launched.passes:
                produced.update(self._first_tokens(group, logits, every))
        return produced

    def _first_tokens(
        self, group: list[tuple[_Slot, list[int], int]], logits: torch.Tensor, every: dict
    ) -> dict[int, int]:
        """After a pass over prompt pieces (slot, ids, first position): the slots' cache counts
        move past them, and the prompts they finished take their first tokens from `logits`
        (the pieces' last positions'); `every`: each position's logits, of the pieces whose
        prompt logprobs were asked for."""
        rows = {}  # the pass's row -> its slot's row now (rows move as sequences leave)
        for r, (slot, _, _) in enumerate(group):
            row = self.index.get(slot.sequence.id)
            if row is not None and self.slots[row] is slot:
                rows[r] = row
        done = [r for r in rows if group[r][2] + len(group[r][1]) == len(group[r][0].sequence.prompt_ids)]
        tokens = logits[:, : self.weights.decodable].argmax(dim=-1)
        # Rows that draw their tokens on the device (no grammar) draw the first one there too,
        # from their seed and the last prompt position, as the decode steps draw the rest: a
        # draw on the host cost a 35-token prompt's first token ~4 ms on an H200.
        drawn = [r for r in done if group[r][0].sampled and group[r][0].chooser.matcher is None]
        if drawn:
            slots = [rows[r] for r in drawn]
            _, *settings, flags = self._sampling_to_device(slots)
            at = torch.tensor([len(self.slots[i].sequence.prompt_ids) - 1 for i in slots], device=self.device)
            picked = torch.tensor(drawn, device=self.device)
            scores = logits[picked, : self.weights.decodable]
            tokens.index_copy_(0, picked, sample_on_device(scores, *settings, at, *flags))
        greedy = tokens.tolist()
        # The first tokens of the other prompts that did not finish greedy-plain are chosen
        # together, read back with one wait (64 sampled prompts arriving at once: one wait, not 64).
        chosen = [r for r in done if not group[r][0].chooser.plain and r not in drawn]
        if chosen:
            index = torch.tensor(chosen, device=logits.device)
            for r, token in zip(
                chosen, choose_rows(logits[index], [group[r][0].chooser for r in chosen]), strict=False
            ):
                greedy[r] = token
        first = []  # (slot, row, its first token)
        produced = {}
        for r, i in rows.items():
            slot, ids, start = group[r]
            token = greedy[r]
            if r in every:
                self._score_prompt(slot, every[r], start, len(ids))
            slot.cached = start + len(ids)
            if slot.cached == len(slot.sequence.prompt_ids):
                first.append((i, r, token))
                slot.next_token = token
                slot.generated.append(token)
                produced[slot.sequence.id] = token
                # Its prompt, for requests that arrive while it generates (its pages: no copy).
                self._store(i)
        self._report(logits, first)
        return produced

    def _score_prompt(self, slot: _Slot, logits: torch.Tensor, start: int, length: int) -> None:
        """Logprobs of the prompt ids that a prefilled piece's logits predict (each position
        predicts the next id, as far as the prompt goes)."""
        prompt = slot.sequence.prompt_ids
        predicted = prompt[start + 1 : start + length + 1]
        if predicted:
            slot.prompt_scores += token_logprobs(logits[: len(predicted)], predicted, slot.sequence.prompt_logprobs)

    @torch.inference_mode()
    def _prefill(
        self,
        parts: list[tuple[int, list[int], int]],
        every_position: list[int] = (),
        lora_rows: list[int] | None = None,
        long_rope: list[bool] | None = None,
    ) -> tuple[torch.Tensor, dict]:
        """Run prompt pieces (slot, ids, first position) through the model, padded to the longest;
        write their keys and values to their slots; return each piece's last-token logits, and
        {piece: the logits of each of its positions} for the pieces in `every_position`.

        Padding writes past a piece's end, in columns its sequence has not reached: a decode
        step writes a column before any query reads it, and the mask hides the rest."""
        shape = self._padded_shape(parts, every_position, lora_rows, long_rope)
        if shape is not None:
            return self._prefill_padded(parts, *shape), {}
        w = self.weights
        n, length = len(parts), max(len(ids) for _, ids, _ in parts)
        slots = torch.tensor([slot for slot, _, _ in parts], device=self.device)
        if self.use_graphs and n == 1:
            # One piece (a long prompt, or a prompt alone): no padding, no mask to build, and
            # causal flash attention over its slot's columns.
            slot, ids, start = parts[0]
            tokens = torch.tensor([ids], device=self.device)
            positions = torch.arange(start, start + length, device=self.device)[None, :]
            span, mask = start + length, None  # from position 0: causal flash attention, no mask
            if start and length >= LOWER_RIGHT_FROM:  # after cached columns, a long piece: bottom-right causal
                mask = causal_lower_right(length, span)
            elif start:
                # A short piece after cached columns: an explicit mask and the memory-efficient
                # kernel (keys padded to a multiple of 8), as padded pieces have (or the paged
                # kernel, `_prefill_layers`).
                span = min(-(-span // 8) * 8, self.context + 1)
                mask = self._prefill_mask(positions, span)
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
            mask = self._prefill_mask(positions, span)
        starts = lens = None
        if mask is not None and self.fused:  # the paged kernel's, where `_prefill_layers` takes it
            starts = torch.tensor([start for _, _, start in parts], device=self.device)
            lens = torch.tensor([len(ids) for _, ids, _ in parts], device=self.device)
        placed = _Placement(slots, positions, span, mask, starts, lens)
        x = w.embed[tokens]  # [n, length, hidden]
        lora_rows = lora_rows or [self.slots[row].lora_index for row, _, _ in parts]
        adapted = (
            self._lora_layers(torch.tensor(lora_rows, device=self.device), prefill=True) if max(lora_rows) >= 0 else {}
        )
        with prefill_attention():
            x = self._prefill_layers(x, placed, adapted, long_rope)
        last = torch.tensor([len(ids) - 1 for _, ids, _ in parts], device=self.device)
        every = {r: self._logits(x[r, : len(parts[r][1])]) for r in every_position}
        return self._logits(x[torch.arange(n, device=self.device), last]), every

    def _padded_shape(self, parts, every_position, lora_rows, long_rope) -> tuple[int, int, int] | None:
        """The (rows, length, span) graph shape that these pieces are prefilled in, padded, or
        None (eagerly, as they are). `span`: 0 for new prompts, from position 0 (causal over
        their own columns); else the columns that pieces after cached columns attend to,
        bucketed. Only pieces with no adapter, no prompt logprobs and no longrope factors."""
        if not self.prefill_graphs or every_position or (long_rope and any(long_rope)):
            return None
        adapters = lora_rows if lora_rows is not None else [self.slots[i].lora_index for i, _, _ in parts]
        if max(adapters) >= 0:
            return None
        rows = bucket(len(parts), BATCH_BUCKETS)
        length = bucket(max(len(ids) for _, ids, _ in parts), PREFILL_LENGTHS)
        span = self._span(parts)
        return (rows, length, span) if self._graphable(rows, length, span) else None

    @staticmethod
    def _span(parts: list[tuple[int, list[int], int]]) -> int:
        """0 for new prompts only; else the columns the pieces reach, in a CONTINUE_SPANS bucket."""
        if not any(start for _, _, start in parts):
            return 0
        return bucket(max(start + len(ids) for _, ids, start in parts), CONTINUE_SPANS)

    def _graph_rows(self, parts: list[tuple[int, list[int], int]]) -> int:
        """The most of these pieces that one prefill graph takes (0: none)."""
        longest = max(len(ids) for _, ids, _ in parts)
        if not self.prefill_graphs or longest > PREFILL_LENGTHS[-1]:
            return 0
        length, span = bucket(longest, PREFILL_LENGTHS), self._span(parts)
        return max((rows for rows in BATCH_BUCKETS if self._graphable(rows, length, span)), default=0)

    def _graphable(self, rows: int, length: int, span: int = 0) -> bool:
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
            fits = rows * length <= PREFILL_GRAPH_TOKENS and not any(
                w is not None and w < length for w in self.weights.arch.windows
            )
        return fits and rows in BATCH_BUCKETS and length in PREFILL_LENGTHS and length <= self.context

    def _padded_buffers(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The graphs' inputs: [tokens; positions] [2, rows, length] and [slots; last index]
        [2, rows], at their largest; each graph reads a corner."""
        if self._padded_inputs is None:
            rows = max(b for b in BATCH_BUCKETS if b * PREFILL_LENGTHS[0] <= PREFILL_GRAPH_TOKENS)
            grid = torch.zeros(2, rows, PREFILL_LENGTHS[-1], dtype=torch.long, device=self.device)
            self._padded_inputs = grid, torch.zeros(2, rows, dtype=torch.long, device=self.device)
        return self._padded_inputs

    def _prefill_padded(
        self, parts: list[tuple[int, list[int], int]], rows: int, length: int, span: int
    ) -> torch.Tensor:
        """The last-token logits of prompt pieces (slot, ids, first position), prefilled together
        padded to rows x length. A piece's padding tokens write its slot's columns past its end
        (its own pages: a stored prefix's shared pages end before the piece), which a decode
        step writes before any query reads them; the padding rows write the cache's scratch
        column of row 0, as a decode step's idle rows do; columns past a row's pages land in the
        scratch page."""
        grid, index = self._padded_buffers()
        if self.use_graphs and (rows, length, span) not in self._padded_graphs:
            self._padded_graphs[rows, length, span] = self._capture_padded(rows, length, span)
        # Pinned: copied without a wait for the stream's work before it (the pinned allocator
        # keeps the block until its copy has run), so the passes of one step queue at once.
        pinned = self.device.type == "cuda"
        host_grid = torch.zeros(2, rows, length, dtype=torch.long, pin_memory=pinned)
        host_grid[1] = self.scratch
        host_index = torch.zeros(2, rows, dtype=torch.long, pin_memory=pinned)
        host_index[1] = -1  # padding rows: no token (the paged kernel reads none of their columns)
        for r, (slot, ids, start) in enumerate(parts):
            host_grid[0, r, : len(ids)] = torch.tensor(ids)
            host_grid[1, r] = torch.arange(start, start + length).clamp(max=self.scratch)
            host_index[:, r] = torch.tensor([slot, len(ids) - 1])
        grid[:, :rows, :length].copy_(host_grid, non_blocking=pinned)
        index[:, :rows].copy_(host_index, non_blocking=pinned)
        if not self.use_graphs:
            return self._padded_pass(rows, length, span)[: len(parts)]
        graph, logits = self._padded_graphs[rows, length, span]
        graph.replay()
        return logits[: len(parts)].clone()  # the graph's output is written over by its next replay

    def _padded_pass(self, rows: int, length: int, span: int) -> torch.Tensor:
        """The forward pass of `_prefill_padded`, reading its inputs from the buffers (what a
        graph captures): each token's attention over its row's columns up to its own
        position, through the page tables with the Triton kernels; else, for new prompts,
        causal attention over a gather of their own columns, and for pieces after cached
        columns (a span) a mask made here from the positions."""
        grid, index = self._padded_buffers()
        tokens, positions = grid[0, :rows, :length], grid[1, :rows, :length]
        slots, last = index[0, :rows], index[1, :rows]
        if self.fused:
            # Through the rows' page tables, new prompts too (their own keys and values, written
            # a kernel earlier): no gather of their columns, no mask. A new 24-token prompt of
            # Phi-2 on an H200: the gather and flash attention took 0.5 of its 2.75 ms.
            placed = _Placement(slots, positions, span or length, None, positions[:, 0].contiguous(), last + 1)
        elif not span:
            placed = _Placement(slots, positions, length, None)
        else:
            placed = _Placement(slots, positions, span, self._prefill_mask(positions, span))
        x = self.weights.embed[tokens]
        with prefill_attention():
            x = self._prefill_layers(x, placed, {})
        return self._logits(x[torch.arange(rows, device=self.device), last])

    def _capture_padded(self, rows: int, length: int, span: int):
        """A CUDA graph of `_padded_pass` at its shape, captured with inputs that write only the
        scratch column (captures may happen between requests' steps)."""
        grid, index = self._padded_buffers()
        grid[0].zero_()
        grid[1].fill_(self.scratch)
        index.zero_()
        return self._capture_graph(lambda: self._padded_pass(rows, length, span), warmups=1, prefill=True)

    def _prefill_mask(self, positions: torch.Tensor, span: int, window: int | None = None) -> torch.Tensor:
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

    def _prefill_layers(
        self, x, placed: _Placement, adapted: dict, long_rope: list[bool] | None = None
    ) -> torch.Tensor:
        w, shape = self.weights, self.weights.shape
        n, length = x.shape[:2]
        long_rope = long_rope if long_rope and any(long_rope) else None
        # The rotary kernel takes one table: a group mixing longrope's long prompts with others
        # rotates in torch ops.
        kernels = self.fused and (long_rope is None or all(long_rope))
        paged = kernels and placed.paged
        if kernels:
            from backends import triton_decode as fused

            token_slots, token_positions = placed.slots.repeat_interleave(length), placed.positions.reshape(-1)
            tables = (self.cos_long, self.sin_long) if long_rope else (self.cos, self.sin)
        else:
            cos, sin = self.cos[placed.positions], self.sin[placed.positions]
            if long_rope:
                long = torch.tensor(long_rope, device=self.device)[:, None, None]
                cos = torch.where(long, self.cos_long[placed.positions], cos)
                sin = torch.where(long, self.sin_long[placed.positions], sin)
            cos, sin = cos[:, :, None, :], sin[:, :, None, :]
        masks = {}  # window -> the attention mask of its layers (None: plain causal)
        for layer, block in enumerate(w.layers):
            lora = adapted.get(layer)
            h = norm(x, block.norm1_w, block.norm1_b, shape.eps, shape.rms_norm)
            y = linear(h, block.w_in, block.b_in)
            if lora is not None:
                y = y + lora_product(h, *lora[0])
            if kernels:  # one kernel: rotary on q in place, k and v to the cache
                fused.prefill_rotary(
                    y.view(n * length, -1),
                    *tables,
                    token_positions,
                    token_slots,
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
                rope_(q, cos, sin, shape.rotary_dim)
                rope_(k, cos, sin, shape.rotary_dim)
                self.kv.write(layer, placed.slots[:, None], placed.positions, k, v)
            if paged:  # after cached columns: read through the page tables, its window in the kernel
                attention = fused.paged_prefill_attention(
                    y, self.kv.k[layer], self.kv.v[layer], self.kv.table, placed.slots, placed.starts, placed.lens,
                    self.heads, window=w.arch.windows[layer], reach=placed.span,
                )  # fmt: skip
            else:
                attention = self._gathered_attention(layer, q, placed, masks)
            x = mlp_and_residual(x, attention, y, block, shape, lora)
        return x

    def _gathered_attention(self, layer: int, q: torch.Tensor, placed: _Placement, masks: dict) -> torch.Tensor:
        """SDPA of q [n, length, heads, head_dim] over a copy of the rows' first `placed.span`
        columns, through the placement's mask (its sliding-window variants made once a pass, in
        `masks`); [n, length, q_size]."""
        w = self.weights
        keys, values = self.kv.read(layer, placed.slots, placed.span)
        window = w.arch.windows[layer]
        if window is not None and window >= placed.span:  # a window no shorter than every row's reach
            window = None
        if window not in masks:
            masks[window] = placed.mask if window is None else self._prefill_mask(placed.positions, placed.span, window)
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

    def _logits(self, x: torch.Tensor, normalize=norm) -> torch.Tensor:
        """The raw logits over the whole model vocabulary (logprobs are taken over all of it;
        the choice of a token is limited to the ids the tokenizer can decode). `normalize`: the
        final norm (the fused step passes its Triton kernel, `triton_decode.norm`)."""
        w = self.weights
        x = normalize(x, *w.final_norm, w.shape.eps, w.shape.rms_norm)
        return linear(x, *w.lm_head)

    # -- decode ----------------------------------------------------------------------------------

    def _launch(
        self, rows: list[int], chained: bool = False, finish: bool = True, pieces: list | None = None
    ) -> _Launch:
        """Start a decode step for the slots in `rows` (their inputs from the host, or, chained,
        from the previous step on the device). The other rows up to the batch bucket idle: they
        write to the cache's last column, which no sequence uses, and their output is dropped.
        Unless `finish`, the caller `_finish`es it (when its masks are known). `pieces`: prompt
        pieces (slot, ids, first position) prefilled in the same pass (`_fusable`), their last
        positions' logits in the launch's `piece_logits`."""
        ahead = 1 if chained else 0  # a chained step's inputs sit one position past the slots' own count
        longest = max(self.slots[i].cached for i in rows) + 1 + ahead
        batch = bucket(len(self.slots), BATCH_BUCKETS) if self.use_graphs else len(self.slots)
        # The adapters' product only while a sequence uses one (its graphs are captured apart).
        lora = self.lora.version if any(self.slots[i].lora_index >= 0 for i in rows) else 0
        if self.fused:
            span = 0  # the fused step reads each row's live columns, whatever their number: one graph per batch
        else:
            span = min(bucket(longest, self._length_buckets()), self.context + 1) if self.use_graphs else longest
        if not chained:
            host = self._host_inputs.numpy()  # a view: plain writes, no tensor per row
            host[:, :batch] = 0
            host[1, :batch] = self.scratch
            host[3, :batch] = -1
            for i in rows:
                host[:, i] = (self.slots[i].next_token, self.slots[i].cached, 1, self.slots[i].lora_index)
            self.inputs[:, :batch].copy_(
                self._host_inputs[:, :batch], non_blocking=True
            )  # tokens, positions, advance, adapter
        piece_logits = None
        if pieces:
            logits, greedy, piece_logits = self._mixed_step(batch, span, pieces)
        elif self.use_graphs:
            logits, greedy = self._replay(batch, span, lora)
        else:
            logits, greedy = self._decode_step(batch, span, lora)
        masked = [i for i in rows if self.slots[i].masked]
        launched = _Launch(
            rows,
            logits,
            greedy,
            None,
            batch,
            masked,
            [i for i in rows if self.slots[i].sampled and not self.slots[i].masked],
        )
        launched.piece_logits = piece_logits
        if finish:
            self._finish(launched)
        return launched

    def _finish(self, launched: _Launch) -> None:
        """After a step's forward pass, on the device, written over its greedy tokens: the tokens
        of its constrained rows under their masks (argmax, or drawn) and of its sampled rows;
        then, with graphs, feed the next step on the device and start copying the tokens to the host."""
        for draw in (False, True):  # constrained rows: greedy ones, then sampled ones
            rows = [i for i in launched.masked if self.slots[i].sampled == draw]
            # A lazy tool grammar not armed yet masks nothing: its row takes the plain greedy
            # token (already there) or a plain draw, with no mask copied or applied.
            dormant = [i for i in rows if not self.slots[i].chooser.matcher.constrains()]
            if dormant:
                rows = [i for i in rows if i not in dormant]
                if draw:
                    launched.greedy.index_copy_(0, *self._draw(dormant, launched.logits))
            if rows:
                index, packed = self._masks_to_device(rows)
                allowed = unpack_on_device(packed, self.weights.decodable)
                if draw:
                    launched.greedy.index_copy_(0, *self._draw(rows, launched.logits, allowed))
                else:
                    scores = launched.logits[index, : self.weights.decodable].masked_fill(~allowed, float("-inf"))
                    launched.greedy.index_copy_(0, index, scores.argmax(dim=-1))
        if launched.sampled:
            launched.greedy.index_copy_(0, *self._draw(launched.sampled, launched.logits))
        if not self.use_graphs:
            return
        batch, greedy = launched.batch, launched.greedy
        # Feed the next step on the device: its tokens are these greedy ones, one position on.
        self.inputs[0, :batch].copy_(greedy)
        self.inputs[1, :batch].add_(self.inputs[2, :batch])
        buffer = self._greedy_host[self._flip][:batch]  # two buffers: one may still be read
        self._flip ^= 1
        buffer.copy_(greedy, non_blocking=True)
        if self.device.type == "cuda":
            launched.done = torch.cuda.Event()
            launched.done.record()
        launched.greedy = buffer

    def _masks_to_device(self, rows: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """The rows and their grammars' packed masks, copied to the device through pinned memory:
        a copy from pageable memory would first wait for the forward pass the masks are late for.
        Two buffers in turn: the one filled now was last copied two steps ago, long done."""
        words = [self.slots[i].chooser.matcher.allowed_words() for i in rows]
        if self._mask_host is None:
            pinned = self.device.type == "cuda"
            self._mask_host = [
                torch.zeros(self.rows, 1 + len(words[0]), dtype=torch.int32, pin_memory=pinned) for _ in range(2)
            ]
        host = self._mask_host[self._mask_flip][: len(rows)]
        self._mask_flip ^= 1
        view = host.numpy()
        view[:, 0] = rows
        for r, row_words in enumerate(words):
            view[r, 1:] = row_words
        on_device = host.to(self.device, non_blocking=True)
        return on_device[:, 0].long(), on_device[:, 1:]

    def _draw(self, rows: list[int], logits: torch.Tensor, allowed: torch.Tensor | None = None):
        """(the rows' index, their tokens), drawn on the device from the step's logits, under
        `allowed` (the rows' grammar masks, in `rows`' order) if given."""
        index, *settings, flags = self._sampling_to_device(rows)
        scores = logits[index, : self.weights.decodable]
        if allowed is not None:
            scores = scores.masked_fill(~allowed, float("-inf"))
        return index, sample_on_device(scores, *settings, self.inputs[1].index_select(0, index), *flags)

    def _sampling_to_device(self, rows: list[int]):
        """The sampled rows' index and settings (scale, top_k, top_p, min_p, seed) on the device,
        through pinned buffers, and which filters any row uses. Four buffers in turn: a step
        draws up to three times before it waits for the device (`_finish`: the rows of grammars
        not armed yet, then the constrained ones, then the plain sampled rows), and a buffer may
        be filled again only once its copy has run; with two, the third draw wrote its rows'
        index and settings over the first's before the first was copied."""
        if self._sampling_host is None:
            pinned = self.device.type == "cuda"
            self._sampling_host = [
                (
                    torch.zeros(3, self.rows, dtype=torch.long, pin_memory=pinned),
                    torch.zeros(3, self.rows, dtype=torch.float32, pin_memory=pinned),
                )
                for _ in range(4)
            ]
        whole, real = self._sampling_host[self._sampling_flip]
        self._sampling_flip = (self._sampling_flip + 1) % len(self._sampling_host)
        n, decodable = len(rows), self.weights.decodable
        ints, floats = whole.numpy()[:, :n], real.numpy()[:, :n]
        # Whole rows of settings at once: a row at a time into numpy took 0.64 ms a step at 512
        # rows on a 2-vCPU EPYC, these lists 0.21 ms.
        slots = [self.slots[i] for i in rows]
        settings = [slot.chooser.sampling for slot in slots]
        ints[0] = rows
        ints[1] = [s.top_k if 0 < s.top_k < decodable else 0 for s in settings]
        ints[2] = [slot.seed for slot in slots]
        floats[0] = [s.scale for s in settings]
        floats[1] = [s.top_p if s.top_p < 1.0 else 2.0 for s in settings]
        floats[2] = [s.min_p for s in settings]
        flags = (int(ints[1].max()), bool((floats[1] <= 1.0).any()), bool((floats[2] > 0).any()))
        ints, floats = (
            whole.to(self.device, non_blocking=True)[:, :n],
            real.to(self.device, non_blocking=True)[:, :n],
        )  # whole: contiguous copies
        return ints[0], floats[0], ints[1], floats[1], floats[2], ints[2], flags

    def _length_buckets(self):
        n, buckets = MIN_LENGTH_BUCKET, []
        while n < self.context + 1:
            buckets.append(n)
            n *= 2
        return buckets + [self.context + 1]

    def _reach_groups(self, batch: int) -> list[tuple[torch.Tensor, int]] | None:
        """For an eager step: rows 0..batch-1 grouped by the columns they attend to (by length
        bucket), each group with its longest reach, or None if they share one bucket. Gathering
        every row's pages up to the longest row's reach cost a 2-vCPU EPYC 3.7 s a step for one
        row at 1,040 columns beside 4 short ones (random Phi-2, float32), against 1.3 s before
        the cache was paged, when attention read the rows in place. The reach comes from the
        step's host inputs (`_launch`): a decoding row's position + 1; idle rows (prefilling,
        or free) write to the scratch column and their output is dropped: they attend to 1."""
        host = self._host_inputs.numpy()
        positions, advancing = host[1, :batch].tolist(), host[2, :batch].tolist()
        reach = [position + 1 if advance else 1 for position, advance in zip(positions, advancing, strict=True)]
        buckets = self._length_buckets()
        grouped: dict[int, list[int]] = {}
        for i, columns in enumerate(reach):
            grouped.setdefault(bucket(columns, buckets), []).append(i)
        if len(grouped) == 1:
            return None
        return [
            (torch.tensor(members, device=self.device), max(reach[i] for i in members)) for members in grouped.values()
        ]

    @torch.inference_mode()
    def _decode_step(self, batch: int, span: int, lora: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """Logits and greedy tokens for rows 0..batch-1, attending to cache columns 0..span-1
        (eager and not compiled: in groups of like reach, `_reach_groups`), with each row's
        adapter if `lora` (the adapter buffers' version) is not 0."""
        if self.fused:
            return self._fused_step(batch, lora)
        w = self.weights
        tokens, positions = self.inputs[0, :batch], self.inputs[1, :batch]
        rows = torch.arange(batch, device=self.device)
        x = w.embed[tokens]  # [b, hidden]
        cos, sin = self.cos[positions][:, None, :], self.sin[positions][:, None, :]
        biases = self._decode_biases(positions, span)
        adapted = self._lora_layers(self.inputs[3, :batch]) if lora else {}
        # Eager and not compiled: groups and the kept gather buffers (python state a graph or
        # torch.compile would not follow).
        plain = not self.use_graphs and self._layer is decode_block
        groups = self._reach_groups(batch) if plain else None
        for layer, block in enumerate(w.layers):
            bias = biases[w.arch.windows[layer]]
            x = self._layer(
                x,
                cos,
                sin,
                bias,
                positions,
                rows,
                self.kv.k[layer],
                self.kv.v[layer],
                self.kv.table,
                *block,
                shape=self._shape,
                lora=adapted.get(layer),
                groups=groups,
                gather=partial(self.kv.gathered, layer) if plain else None,
            )
        logits = self._logits(x)
        return logits, logits[:, : w.decodable].argmax(dim=-1)

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
            visible[:, 0] |= ~visible.any(dim=-1)  # see `_prefill_mask`
            bias = torch.zeros(batch, span, dtype=self.dtype, device=self.device).masked_fill_(~visible, float("-inf"))
            biases[window] = bias[None, :, None, :].expand(kv_heads, batch, 1, span).reshape(kv_heads * batch, 1, span)
        return biases

    def _fusable(self, passes: list[list[tuple[int, list[int], int]]], decoding: bool) -> list | None:
        """The prompt pieces (slot, ids, first position) of a step that go through one pass with
        its decode rows (`_mixed_step`), or None. On the CPU, eager and plain: a step that
        prefilled a 64-token piece and then decoded 4 rows read the weights twice (659 + 231 ms
        of random Phi-2 in bfloat16 on 2 AMX cores), where one pass over both is about the
        piece's alone. With no row decoding, only pieces that would take several passes (a
        long prompt's next piece and short prompts sharing the step, `_prefill_takes`). Not
        with adapters, prompt logprobs or longrope's long factors (their passes differ)."""
        if self.use_graphs or self.fused or self.prefill_graphs or self._layer is not decode_block:
            return None  # (prefill_graphs: CUDA's padded passes, which tests run on the CPU too)
        if not passes or not (decoding or len(passes) > 1):
            return None
        pieces = [part for group in passes for part in group]
        if len({slot for slot, _, _ in pieces}) < len(pieces):  # a slot's later pieces read its earlier ones'
            return None
        for slot, _, _ in pieces:
            sequence = self.slots[slot].sequence
            if sequence.prompt_logprobs is not None or self._long_prompt(sequence.prompt_ids):
                return None
        if any(s.lora_index >= 0 for s in self.slots):
            return None
        return pieces

    @torch.inference_mode()
    def _mixed_step(self, batch: int, span: int, pieces: list[tuple[int, list[int], int]]):
        """One eager pass for a decode step (rows 0..batch-1, as `_decode_step`; none if batch is
        0) and prompt pieces (slot, ids, first position) together: every GEMM over the step's
        rows and the pieces' tokens at once, attention apart (the rows in groups of like reach,
        each piece causally over its slot's columns). Returns the rows' logits and greedy tokens
        (None without rows), and the logits of each piece's last position ([pieces, vocab])."""
        w, shape = self.weights, self._shape
        ids = [token for _, piece, _ in pieces for token in piece]
        tokens, positions = self.inputs[0, :batch], self.inputs[1, :batch]
        rows = torch.arange(batch, device=self.device)
        starts = torch.tensor([start for _, _, start in pieces])
        lengths = torch.tensor([len(piece) for _, piece, _ in pieces])
        # Each piece token's position: its piece's start plus its place in the piece.
        offsets = torch.arange(len(ids)) - (lengths.cumsum(0) - lengths).repeat_interleave(lengths)
        piece_positions = (starts.repeat_interleave(lengths) + offsets).to(self.device)
        slots = torch.tensor([slot for slot, _, _ in pieces]).repeat_interleave(lengths).to(self.device)
        x = w.embed[torch.cat((tokens, torch.tensor(ids, device=self.device)))]  # [b + tokens, hidden]
        at = torch.cat((positions, piece_positions))
        owners = torch.cat((rows, slots))  # each token's cache row
        cos, sin = self.cos[at][:, None, :], self.sin[at][:, None, :]
        biases = self._decode_biases(positions, span) if batch else {}
        groups = self._reach_groups(batch) if batch else None
        # Each piece's attention as a padded prefill's (`_gathered_attention`): its slot's
        # columns up to its end, through a causal mask (each piece's sliding-window variants
        # made once a pass, in its own dict).
        placed, bounds, end = [], [], batch
        for slot, piece, start in pieces:
            at_piece = torch.arange(start, start + len(piece), device=self.device)[None, :]
            reach = min(-(-(start + len(piece)) // 8) * 8, self.context + 1)
            placed.append(
                (
                    _Placement(
                        torch.tensor([slot], device=self.device), at_piece, reach, self._prefill_mask(at_piece, reach)
                    ),
                    {},
                )
            )
            bounds.append((end, end + len(piece)))
            end += len(piece)
        for layer, block in enumerate(w.layers):
            h = norm(x, block.norm1_w, block.norm1_b, shape.eps, shape.rms_norm)
            y = linear(h, block.w_in, block.b_in)
            q, k, v = split_heads(y, shape, block.q_norm, block.k_norm)  # [b + tokens, heads, head_dim]
            rope_(q, cos, sin, shape.rotary_dim)
            rope_(k, cos, sin, shape.rotary_dim)
            self.kv.write(layer, owners, at, k, v)
            parts = [
                self._gathered_attention(layer, q[None, lo:hi], where, masks)[0]
                for (where, masks), (lo, hi) in zip(placed, bounds, strict=True)
            ]
            if batch:
                gather = partial(self.kv.gathered, layer)
                bias = biases[w.arch.windows[layer]]
                parts.insert(0, grouped_decode_attention(q[:batch], gather, self.kv.table, bias, shape, groups))
            x = mlp_and_residual(x, torch.cat(parts), y, block, shape, None)
        last = torch.tensor([hi - 1 for _, hi in bounds], device=self.device)
        piece_logits = self._logits(x[last])
        if not batch:
            return None, None, piece_logits
        logits = self._logits(x[:batch])
        return logits, logits[:, : w.decodable].argmax(dim=-1), piece_logits

    def _fused_step(self, batch: int, lora: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """The decode step: cuBLAS for the GEMMs of a block (two for Phi, four for the others),
        Triton for what lies between them (backends/triton_decode), and each row's adapter
        product if `lora`."""
        from backends import triton_decode as fused

        w = self.weights
        tokens, positions, active = self.inputs[0, :batch], self.inputs[1, :batch], self.inputs[2, :batch]
        adapted = self._lora_layers(self.inputs[3, :batch]) if lora else {}
        x = w.embed[tokens]
        arch, eps = w.arch, w.shape.eps
        for layer, block in enumerate(w.layers):
            lora = adapted.get(layer)
            h = fused.norm(x, block.norm1_w, block.norm1_b, eps, arch.rms_norm)
            y = F.linear(h, block.w_in, block.b_in)
            if lora is not None:
                y = y + lora_product(h, *lora[0])
            if arch.parallel:
                mixed, xb = fused.attention(
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
            attended = fused.attention(
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
            h = fused.norm(x, block.norm2_w, None, eps, rms=True)
            u = F.linear(h, block.w_up, block.b_up)
            if lora is not None:
                u = u + lora_product(h, *lora[2])
            g = fused.silu_mul(u, w.inner)
            x = torch.addmm(x if block.b_down is None else x + block.b_down, g, block.w_down.t())
            if lora is not None:
                x = x + lora_product(g, *lora[3])
        logits = self._logits(x, fused.norm)
        return logits, logits[:, : w.decodable].argmax(dim=-1)

    def _lora_layers(self, row_slots: torch.Tensor, prefill: bool = False) -> dict[int, list[tuple]]:
        """{block: [(a, b, mask) for each fused matrix of the block]} for the adapted blocks,
        masked by each row's adapter slot (prefill rows hold several positions: the mask broadcasts)."""
        masks = self.lora.masks(row_slots)
        if prefill:
            masks = [mask[:, None] for mask in masks]
        return {
            layer: [(a, b, mask) for (a, b), mask in zip(pairs, masks, strict=False)]
            for layer, pairs in self.lora.blocks.items()
        }

    def _replay(self, batch: int, span: int, lora: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        key = (batch, span, lora)
        if key not in self.graphs:
            try:
                self.graphs[key] = self._capture(batch, span, lora)
            except Exception:
                if self._layer is decode_block:
                    raise
                # torch.compile needs Triton and a C compiler; without them, serve uncompiled.
                log.exception("torch.compile failed: the decode step runs uncompiled")
                self._layer, self._pool = decode_block, None
                self.graphs.clear()
                self.graphs[key] = self._capture(batch, span, lora)
        graph, out = self.graphs[key]
        graph.replay()
        return out

    def _capture(self, batch: int, span: int, lora: int = 0):
        captured = self._capture_graph(lambda: self._decode_step(batch, span, lora), warmups=2)
        log.info(
            "captured a decode step for batch %d, attention length %d%s", batch, span, " with adapters" if lora else ""
        )
        return captured

    def _capture_graph(self, run, warmups: int, prefill: bool = False):
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
        apart = prefill and self._side is not None
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
    def capture(self, spans=(MIN_LENGTH_BUCKET, 2 * MIN_LENGTH_BUCKET)) -> None:
        """Capture the decode graphs that short requests use, before the first request needs them."""
        if not self.use_graphs:
            return
        for batch in BATCH_BUCKETS:
            if batch > self.rows:
                break
            for span in (0,) if self.fused else spans:
                self._replay(batch, min(span, self.context + 1))
        if self.prefill_graphs:
            for span in (0, *CONTINUE_SPANS):
                for rows in BATCH_BUCKETS:
                    for length in PREFILL_LENGTHS:
                        shape = rows, length, span
                        if rows <= self.rows and self._graphable(*shape) and shape not in self._padded_graphs:
                            self._padded_graphs[shape] = self._capture_padded(*shape)
            log.info(
                "captured %d prefill graphs: %d for new prompts, %d for pieces after cached columns",
                len(self._padded_graphs),
                sum(1 for _, _, span in self._padded_graphs if not span),
                sum(1 for _, _, span in self._padded_graphs if span),
            )
