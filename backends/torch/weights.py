"""The model's weights as the batched decoder's passes read them (backends/torch/network.py):
each block's Linears fused into as few matrices as its shape allows (`Block`), what a pass needs
of the architecture besides them (`Shape`), quantized in place (`DecoderWeights.quantize`), and
the rotary tables from the model's own rotary module.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from backends.files.architecture import GELU_TANH, Architecture
from backends.torch.lora import FusedMatrix
from backends.torch.quant.make import quantize_weight
from backends.torch.quant.methods import QuantizedWeight


def supports(model) -> bool:
    """Whether the general decoder serves this model (backends/files/architecture.py says which)."""
    return Architecture.of(model.config) is not None


def activation(name: str):
    """The MLP's activation as one kernel (transformers' NewGELU is six)."""
    if name in GELU_TANH:
        return lambda x: F.gelu(x, approximate="tanh")
    if name == "gelu":
        return F.gelu
    return F.silu


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
    q_norm: torch.Tensor | None = None  # Qwen3, Gemma 3: RMSNorm weights over a head of q, and of k
    k_norm: torch.Tensor | None = None
    attention_out_norm: torch.Tensor | None = None  # Gemma 3: RMSNorm of the attention's output
    mlp_out_norm: torch.Tensor | None = None  # and of the MLP's, before each joins the residual
    # Qwen3.5's Gated DeltaNet layers (backends/torch/hybrid.py): `w_in` is [qkv; z; b; a], `w_out`
    # out_proj; the convolution's weights [conv_dim, kernel], the decay's A_log and dt_bias, and
    # the gated RMSNorm's weight over a value head.
    conv: torch.Tensor | None = None
    a_log: torch.Tensor | None = None
    dt_bias: torch.Tensor | None = None
    mix_norm: torch.Tensor | None = None

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
    attention_gate: bool = False  # Qwen3.5: attention's output times sigmoid(the gate after q, k, v)


# The layout's names of the norms on a block's outputs (Gemma 3), in `Block`'s order.
OUTPUT_NORMS = ("attention_out_norm", "mlp_out_norm")

# The methods whose output head is quantized too. w8a8 is the CPU's fast choice: a float32 head
# beside int8 blocks is much of a step's read; weight-only int8 keeps its head faithful
# (BENCHMARKS.md, decisions). llama.cpp's block types: the head in Q8_0 (a GGUF file's own, where
# it stores one in a block type), as its quantizer keeps the output head at higher precision.
QUANTIZED_HEAD_METHODS = ("w8a8", "q8_0", "q4_0", "q4_1", "q5_0", "q5_1", "q4_k", "q5_k", "q6_k")
HEAD_METHODS = dict.fromkeys(("q4_0", "q4_1", "q5_0", "q5_1", "q4_k", "q5_k", "q6_k"), "q8_0")


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
        if (blocks_embed := getattr(inner.embed_tokens, "blocks", None)) is not None:  # its file's blocks
            from backends.torch.quant.blocks import RowLookup

            self.embed = RowLookup(blocks_embed)
        final = inner.final_layernorm if arch.family == "phi" else inner.norm
        self.final_norm = (norm_weight(self.arch, final.weight), getattr(final, "bias", None))
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
            arch.attention_gate,
        )
        # Each block's fused matrices' own Linears, in order (rows; Phi's w_out: columns), which a
        # GGUF file's stored blocks are found by (`quantize`'s `stored`).
        self.parts: list[dict[str, list]] = []
        if blocks is not None:
            self.layers = [Block(**fields) for fields in blocks]
        else:
            with torch.no_grad():
                self.layers = [self._block(layer, arch.mixers[i] == "delta") for i, layer in enumerate(inner.layers)]
        self.lora_matrices = lora_matrices(arch)

    def _block(self, layer, delta: bool = False) -> Block:
        arch, find = self.arch, layer.get_submodule
        names = arch.layout
        if "qkv" in names:
            attention_in = [find(names["qkv"])]
        elif not delta:
            attention_in = [find(names["q"]), find(names["k"]), find(names["v"])]
        norm1 = layer.input_layernorm
        if arch.parallel:  # [q; k; v; fc1] over LN(x), [o | fc2] into the residual
            columns = [find(names["o"]), find(names["fc2"])]
            self.parts.append({"w_in": [*attention_in, find(names["fc1"])], "w_out": columns})
            w_in, b_in = fuse_rows([*attention_in, find(names["fc1"])])
            o, fc2 = find(names["o"]), find(names["fc2"])
            w_out = torch.cat([o.weight, fc2.weight], dim=1)
            o.weight, fc2.weight = _param(w_out[:, : o.in_features]), _param(w_out[:, o.in_features :])
            b_out = _sum_bias(o.bias, fc2.bias)
            return Block(norm1.weight, getattr(norm1, "bias", None), w_in, b_in, w_out, b_out)
        if delta:  # Qwen3.5's linear attention: its four input Linears fused, out_proj
            attention_in = [find(name) for name in names["delta_in"]]
            w_in, b_in = fuse_rows(attention_in)
            o = find(names["delta_out"])
        elif arch.attention_gate:
            # q_proj's rows are each head's query then its gate: [q; k; v; gate] (a copy, so that
            # transformers' own q_proj keeps its order), the gate past what split_heads reads.
            q, k, v = attention_in
            if q.bias is not None:
                raise ValueError("Qwen3.5 attention with biases")
            pairs = q.weight.view(arch.heads, 2, arch.head_dim, -1)
            query, gate = pairs[:, 0].reshape(arch.q_size, -1), pairs[:, 1].reshape(arch.q_size, -1)
            w_in, b_in = torch.cat([query, k.weight, v.weight, gate]), None
            o = find(names["o"])
        else:
            w_in, b_in = fuse_rows(attention_in)
            o = find(names["o"])
        up = [find(names["gate_up"])] if "gate_up" in names else [find(names["gate"]), find(names["up"])]
        w_up, b_up = fuse_rows(up)
        down = find(names["down"])
        self.parts.append({"w_in": attention_in, "w_out": [o], "w_up": up, "w_down": [down]})
        norm2 = find(names.get("norm2", "post_attention_layernorm"))
        attention = layer.linear_attn if delta else layer.self_attn
        heads_normed = arch.qk_norm and not delta
        q_norm = norm_weight(self.arch, attention.q_norm.weight, arch.score_scale) if heads_normed else None
        k_norm = norm_weight(self.arch, attention.k_norm.weight) if heads_normed else None
        mix = (
            (attention.conv1d.weight[:, 0], attention.A_log, attention.dt_bias, attention.norm.weight) if delta else ()
        )
        after = [norm_weight(self.arch, find(names[n]).weight) if n in names else None for n in OUTPUT_NORMS]
        return Block(
            norm_weight(self.arch, norm1.weight),
            getattr(norm1, "bias", None),
            w_in,
            b_in,
            o.weight,
            o.bias,
            norm_weight(self.arch, norm2.weight),
            getattr(norm2, "bias", None),
            w_up,
            b_up,
            down.weight,
            down.bias,
            q_norm,
            k_norm,
            *after,
            *mix,
        )

    @property
    def device(self) -> torch.device:
        return self.embed.device

    @torch.no_grad()
    def quantize(self, model, method: str, stored: dict | None = None) -> list[QuantizedWeight]:
        """Quantize the fused block matrices (torch_quant) and free their full-precision copies.

        The model's own Linears in the blocks are views of those copies (or the copies
        themselves): they are emptied too, so a quantized model serves through this decoder
        only (transformers' forward would find no weights). Layer by layer, so the peak memory
        stays one layer above the full-precision model. `stored`: a GGUF file's matrices as it
        stores them, by parameter name (ggml_blocks.file_matrices); a fused matrix whose parts
        are all there, in one block type, is made of them as they are, else quantized
        (`method`)."""
        quantized = []
        module_names = {module: name for name, module in model.named_modules()} if stored else {}
        for index, (layer, block) in enumerate(zip(model.model.layers, self.layers, strict=False)):
            replaced = {}
            for name in block.matrices():
                replaced[name] = self._from_file(index, name, module_names, stored) if stored else None
                if replaced[name] is None:
                    replaced[name] = quantize_weight(getattr(block, name), method)
                quantized.append(replaced[name])
            self.layers[index] = block._replace(**replaced)
            for module in layer.modules():
                if isinstance(module, torch.nn.Linear):
                    module.weight = _param(torch.empty(0, dtype=block.w_in.dtype, device=block.w_in.device))
        if method in QUANTIZED_HEAD_METHODS:
            head = self._head_from_file(model, stored) if stored else None
            head = head or quantize_weight(self.lm_head[0], HEAD_METHODS.get(method, method))
            if model.lm_head.weight.data_ptr() != self.embed.data_ptr():  # a tied head is the embedding: kept
                model.lm_head.weight = _param(torch.empty(0, dtype=self.embed.dtype, device=self.embed.device))
            self.lm_head = (head, self.lm_head[1])
            quantized.append(head)
        return quantized

    def _from_file(self, index: int, name: str, module_names: dict, stored: dict) -> QuantizedWeight | None:
        from backends.torch.quant.blocks import BlockWeight

        parts = [stored.get(module_names[module] + ".weight") for module in self.parts[index][name]]
        columns = self.arch.parallel and name == "w_out"
        if any(part is None for part in parts) or (columns and len({part.ggml_type for part in parts}) != 1):
            return None
        return (BlockWeight.join_columns if columns else BlockWeight.stack_rows)(parts)

    def _head_from_file(self, model, stored: dict) -> QuantizedWeight | None:
        tied = model.lm_head.weight.data_ptr() == self.embed.data_ptr()
        return stored.get("lm_head.weight") or (stored.get("model.embed_tokens.weight") if tied else None)

    @property
    def quantized_head(self) -> QuantizedWeight | None:
        return self.lm_head[0] if isinstance(self.lm_head[0], QuantizedWeight) else None

    def rotary_tables(self, length: int, dtype) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """{rope kind: its table} for the kinds the layers use (`Architecture.rope_kinds`; Gemma 3
        asks its rotary module for each layer type's, the others have one, "default")."""
        kinds = sorted({kind for kind in self.arch.rope_kinds if kind is not None})
        return {kind: self.rotary_table(length, dtype, kind) for kind in kinds}

    def rotary_table(self, length: int, dtype, kind: str = "default") -> tuple[torch.Tensor, torch.Tensor]:
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
                positions = torch.arange(start, end, device=device)[None]
                cos, sin = rotary(x, positions) if kind == "default" else rotary(x, positions, kind)
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


def norm_weight(arch: Architecture, weight: torch.Tensor, scale: float | None = None) -> torch.Tensor:
    """An RMSNorm's weight as the passes multiply by it: Gemma's 1 + w (a copy, computed in float32
    as Gemma does; the model's own stays w), and q's norm times the scores' scale where it is not
    head_dim ** -0.5 (Gemma 3's query_pre_attn_scalar: rotary is linear, so scaling q before it
    scales the scores)."""
    if not arch.norm_offset and scale is None:
        return weight
    w = weight.float() + arch.norm_offset
    if scale is not None:
        w = w * (scale * arch.head_dim**0.5)
    return w.to(weight.dtype)


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
    output it writes. (None for Qwen3.5's hybrid stack, whose blocks differ: not adapted yet.)"""
    if arch.hybrid:
        return []
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


def _param(tensor: torch.Tensor) -> torch.nn.Parameter:
    return torch.nn.Parameter(tensor, requires_grad=False)
