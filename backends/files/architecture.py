"""What the general Torch decoder (backends/torch/decoder.py) needs to know of a model, read from
its Hugging Face config: one description for every decoder-only family it serves, not a copy of
the decoder per family.

The families differ in a handful of choices, each a field here:
- the norm: LayerNorm with a bias (Phi) or RMSNorm (Llama, Mistral, Qwen2/3, Phi-3);
- the block: parallel, x + attention(norm x) + mlp(norm x) (Phi), or sequential with a second
  norm before the MLP (the others);
- the MLP: fc1 -> activation -> fc2 (Phi) or gated, down(silu(gate) * up) (the others);
- attention: heads and key-value heads (GQA where fewer), the head size, biases on q/k/v
  (Qwen2) and on the output (Phi), per-head RMSNorms of q and k (Qwen3, Gemma 3), a sliding
  window per layer (Mistral, Phi-3, Qwen2 where its config turns it on, Gemma 3's local layers),
  the scale of its scores (Gemma 3: query_pre_attn_scalar);
- rotary embeddings on all of a head or its first part (Phi, Phi-4-mini), with whatever
  scaling the config names (rope tables come from transformers' own rotary module), a table
  per layer kind (Gemma 3's local and global bases) or none on some layers (SmolLM3's NoPE);
- Gemma's touches: RMSNorm weights stored as w - 1 (it multiplies by 1 + w), the embedding
  scaled by sqrt(hidden), a norm after attention and after the MLP besides those before, a
  GELU-gated MLP (GeGLU), and a tanh cap on the final logits where the config sets one;
- where the weights are: separate q/k/v and gate/up Linears, or fused ones (Phi-3).

A config this does not describe (another model type, or a feature outside the list) gets
None from `Architecture.of`, and the model is served one sequence at a time through
transformers' own forward.
"""

from __future__ import annotations

from dataclasses import dataclass

# model_type -> where its block's Linears are, by module name inside a layer.
LAYOUTS = {
    "phi": {
        "q": "self_attn.q_proj",
        "k": "self_attn.k_proj",
        "v": "self_attn.v_proj",
        "o": "self_attn.dense",
        "fc1": "mlp.fc1",
        "fc2": "mlp.fc2",
    },
    "llama": {
        "q": "self_attn.q_proj",
        "k": "self_attn.k_proj",
        "v": "self_attn.v_proj",
        "o": "self_attn.o_proj",
        "gate": "mlp.gate_proj",
        "up": "mlp.up_proj",
        "down": "mlp.down_proj",
    },
    "phi3": {
        "qkv": "self_attn.qkv_proj",
        "o": "self_attn.o_proj",
        "gate_up": "mlp.gate_up_proj",
        "down": "mlp.down_proj",
    },
}
LAYOUTS["mistral"] = LAYOUTS["qwen2"] = LAYOUTS["qwen3"] = LAYOUTS["smollm3"] = LAYOUTS["llama"]
# Gemma 3's norms: before attention, after it (on its output), before and after the MLP.
LAYOUTS["gemma3_text"] = {
    **LAYOUTS["llama"],
    "norm2": "pre_feedforward_layernorm",
    "attention_out_norm": "post_attention_layernorm",
    "mlp_out_norm": "post_feedforward_layernorm",
}
# Qwen3.5's hybrid stack: attention layers (their q_proj rows each head's query, then its output
# gate) and Gated DeltaNet layers, whose Linears are these.
LAYOUTS["qwen3_5_text"] = {
    **LAYOUTS["llama"],
    "delta_in": ["linear_attn.in_proj_qkv", "linear_attn.in_proj_z", "linear_attn.in_proj_b", "linear_attn.in_proj_a"],
    "delta_out": "linear_attn.out_proj",
}
QK_NORM_FAMILIES = ("qwen3", "gemma3_text", "qwen3_5_text")
OFFSET_NORM_FAMILIES = ("gemma3_text", "qwen3_5_text")  # RMSNorm x * (1 + w)


@dataclass(frozen=True)
class Delta:
    """A Gated DeltaNet layer's shape (Qwen3.5's linear attention, backends/torch/hybrid.py)."""

    k_heads: int
    v_heads: int
    k_dim: int
    v_dim: int
    kernel: int  # the short causal convolution's width over q, k and v

    @property
    def key_size(self) -> int:
        return self.k_heads * self.k_dim

    @property
    def value_size(self) -> int:
        return self.v_heads * self.v_dim

    @property
    def conv_dim(self) -> int:
        return 2 * self.key_size + self.value_size


GATED_ACTIVATIONS = ("silu", "swish")
GELU_TANH = ("gelu_new", "gelu_pytorch_tanh", "gelu_fast")


@dataclass(frozen=True)
class Architecture:
    family: str  # the config's model_type
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    rotary_dim: int  # the leading dims of a head that rotary embeddings turn (all of it, or a part)
    inner: int  # the MLP's width
    rms_norm: bool  # RMSNorm; else LayerNorm with a bias
    eps: float
    parallel: bool  # x + attention(norm x) + mlp(norm x), one norm a block (Phi)
    gated: bool  # down(silu(gate) * up); else fc2(activation(fc1))
    activation: str  # hidden_act
    qk_norm: bool  # RMSNorm of each head of q and k before rotary (Qwen3, Gemma 3)
    windows: tuple[int | None, ...]  # per layer: the sliding window (a row sees its last `window` columns), or None
    layout: dict  # where the Linears are (LAYOUTS)
    # per layer: the rotary table it turns q and k with (a key of `DecoderWeights.rotary_tables`),
    # or None for a layer without rotary embeddings (SmolLM3's NoPE layers)
    rope_kinds: tuple[str | None, ...] = ()
    norm_offset: float = 0.0  # added to every RMSNorm weight (Gemma: x * (1 + w))
    embed_scale: float | None = None  # the embedding's rows times this (Gemma: sqrt(hidden))
    score_scale: float | None = None  # attention scores times this, where not head_dim ** -0.5 (Gemma 3)
    logit_softcap: float | None = None  # logits = cap * tanh(logits / cap) (Gemma 3 where set)
    # per layer: "attention", or "delta" (Qwen3.5's Gated DeltaNet: a state per sequence, `delta`)
    mixers: tuple[str, ...] = ()
    delta: Delta | None = None
    attention_gate: bool = False  # attention's output times sigmoid(a gate q_proj gives per head) (Qwen3.5)

    @property
    def hybrid(self) -> bool:
        return "delta" in self.mixers

    @property
    def q_size(self) -> int:
        return self.heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.kv_heads * self.head_dim

    @property
    def group(self) -> int:
        """Query heads per key-value head (1: plain multi-head attention)."""
        return self.heads // self.kv_heads

    @classmethod
    def of(cls, config) -> Architecture | None:
        """The description of a config the decoder serves, else None (see `unsupported`)."""
        return None if unsupported(config) else cls._read(config)

    @classmethod
    def _read(cls, config) -> Architecture:
        family = config.model_type
        heads = config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        rope = getattr(config, "rope_parameters", None) or {}
        factor = rope.get("partial_rotary_factor", getattr(config, "partial_rotary_factor", 1.0)) or 1.0
        phi = family == "phi"
        gemma = family == "gemma3_text"
        qwen35 = family == "qwen3_5_text"
        layers = config.num_hidden_layers
        mixers = (
            tuple("delta" if kind == "linear_attention" else "attention" for kind in config.layer_types[:layers])
            if qwen35
            else ("attention",) * layers
        )
        scalar = getattr(config, "query_pre_attn_scalar", None) if gemma else None
        return cls(
            family=family,
            layers=config.num_hidden_layers,
            hidden=config.hidden_size,
            heads=heads,
            kv_heads=getattr(config, "num_key_value_heads", None) or heads,
            head_dim=head_dim,
            rotary_dim=int(head_dim * factor),
            inner=config.intermediate_size,
            rms_norm=not phi,
            eps=config.layer_norm_eps if phi else config.rms_norm_eps,
            parallel=phi,
            gated=not phi,
            activation=activation_of(config),
            qk_norm=family in QK_NORM_FAMILIES,
            windows=sliding_windows(config),
            layout=LAYOUTS[family],
            rope_kinds=rope_kinds(config),
            norm_offset=1.0 if family in OFFSET_NORM_FAMILIES else 0.0,
            embed_scale=config.hidden_size**0.5 if gemma else None,
            score_scale=scalar**-0.5 if scalar and scalar != head_dim else None,
            logit_softcap=getattr(config, "final_logit_softcapping", None) if gemma else None,
            mixers=mixers,
            delta=Delta(
                config.linear_num_key_heads,
                config.linear_num_value_heads,
                config.linear_key_head_dim,
                config.linear_value_head_dim,
                config.linear_conv_kernel_dim,
            )
            if qwen35
            else None,
            attention_gate=qwen35,
        )


def activation_of(config) -> str:
    """The MLP's activation (Gemma names it hidden_activation)."""
    return getattr(config, "hidden_activation", None) or config.hidden_act


def rope_kinds(config) -> tuple[str | None, ...]:
    """Each layer's rotary table: Gemma 3's by its layer type (local and global bases), none on
    SmolLM3's NoPE layers (`no_rope_layers[i]` 0), else the model's one table ("default")."""
    layers = config.num_hidden_layers
    if config.model_type == "gemma3_text":
        return tuple(config.layer_types[:layers])
    if config.model_type == "smollm3":
        return tuple("default" if use else None for use in config.no_rope_layers[:layers])
    if config.model_type == "qwen3_5_text":  # its linear-attention layers have no rotary
        return tuple("default" if kind != "linear_attention" else None for kind in config.layer_types[:layers])
    return ("default",) * layers


def unsupported(config) -> str | None:
    """Why the general decoder cannot serve this config (None: it can)."""
    family = getattr(config, "model_type", None)
    if family not in LAYOUTS:
        return f"model type {family!r} is not one of {', '.join(sorted(LAYOUTS))}"
    if family == "phi" and getattr(config, "qk_layernorm", False):
        return "Phi with qk_layernorm"
    if family == "phi" and config.hidden_act not in GELU_TANH and config.hidden_act != "gelu":
        return f"Phi with hidden_act {config.hidden_act!r}"
    gated = GATED_ACTIVATIONS + (GELU_TANH if family == "gemma3_text" else ())
    if family != "phi" and activation_of(config) not in gated:
        return f"hidden_act {activation_of(config)!r} in a gated MLP"
    if getattr(config, "attn_logit_softcapping", None) or getattr(config, "use_bidirectional_attention", False):
        return "attention logit softcapping or bidirectional attention"
    heads, kv_heads = (
        config.num_attention_heads,
        getattr(config, "num_key_value_heads", None) or config.num_attention_heads,
    )
    if heads % kv_heads:
        return f"{heads} attention heads over {kv_heads} key-value heads"
    rope = getattr(config, "rope_parameters", None) or {}
    kinds = rope.values() if family == "gemma3_text" else [rope]  # Gemma 3: {layer type: parameters}
    for parameters in kinds:
        kind = (parameters or {}).get("rope_type", "default")
        if kind not in ("default", "linear", "dynamic", "llama3", "longrope", "yarn"):
            return f"rope_type {kind!r}"
    return None


def sliding_windows(config) -> tuple[int | None, ...]:
    """Each layer's sliding window, as transformers applies it: Mistral and Phi-3 on every layer
    when `sliding_window` is set; Qwen2/3, Gemma 3 and SmolLM3 (where use_sliding_window) on the
    layers `layer_types` calls sliding_attention."""
    window = getattr(config, "sliding_window", None)
    layers = config.num_hidden_layers
    types = getattr(config, "layer_types", None)
    if config.model_type in ("qwen2", "qwen3", "gemma3_text", "smollm3"):
        types = types or ["full_attention"] * layers
        if config.model_type == "smollm3" and not getattr(config, "use_sliding_window", False):
            window = None
        return tuple(window if kind == "sliding_attention" else None for kind in types[:layers])
    if config.model_type in ("mistral", "phi3"):
        return (window,) * layers
    return (None,) * layers
