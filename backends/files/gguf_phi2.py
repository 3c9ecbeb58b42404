"""Phi-2's own GGUF files (llama.cpp's `phi2` architecture: phi-2.Q4_K_M.gguf and the like),
which transformers' GGUF reader refuses (5.24: "GGUF model with architecture phi2 is not
supported yet"). Its tokenizer reader does read them.

One table, `modules`, says where each of transformers' PhiForCausalLM modules lies in the file:
a tensor's stem and, where q, k and v are one fused `attn_qkv` (files converted from
microsoft/phi-2's first checkpoint format, as the early Phi-2 GGUF uploads were), the rows that
are each. `convert` writes the float32 checkpoint from it; the CPU's block path
(ggml_blocks.file_matrices) and MLX's (mlx_gguf) take the file's own blocks by it. Slicing rows
keeps blocks whole: a row of a block type is its own run of blocks.
"""

from __future__ import annotations

ARCHITECTURE = "phi2"

# PhiConfig's fields from the file's `phi2.*` keys, as llama.cpp's convert_hf_to_gguf.py writes them.
CONFIG_KEYS = {
    "max_position_embeddings": "context_length",
    "hidden_size": "embedding_length",
    "intermediate_size": "feed_forward_length",
    "num_hidden_layers": "block_count",
    "num_attention_heads": "attention.head_count",
    "layer_norm_eps": "attention.layer_norm_epsilon",
}


def read_config(reader) -> dict:
    """config.json's fields for PhiForCausalLM from the file's metadata; ValueError naming a key
    the file lacks."""

    def field(key: str, default=None):
        found = reader.get_field(f"{ARCHITECTURE}.{key}")
        return found.contents() if found is not None else default

    config = {name: field(key) for name, key in CONFIG_KEYS.items()}
    if missing := [f"{ARCHITECTURE}.{CONFIG_KEYS[name]}" for name, value in config.items() if value is None]:
        raise ValueError(f"the file's metadata lacks {', '.join(missing)}")
    tensors = {tensor.name: tensor for tensor in reader.tensors}
    if "token_embd.weight" not in tensors:
        raise ValueError("the file holds no token_embd.weight")
    head_dim = config["hidden_size"] // config["num_attention_heads"]

    def token(key: str):
        found = reader.get_field(f"tokenizer.ggml.{key}")
        return int(found.contents()) if found is not None else None

    return {
        "architectures": ["PhiForCausalLM"],
        "model_type": "phi",
        **config,
        "num_key_value_heads": field("attention.head_count_kv", config["num_attention_heads"]),
        "vocab_size": int(tensors["token_embd.weight"].shape[1]),  # GGUF shapes are [inputs, rows]
        "hidden_act": "gelu_new",  # ggml's gelu is the tanh approximation, as gelu_new is
        "partial_rotary_factor": field("rope.dimension_count", head_dim) / head_dim,
        "rope_theta": float(field("rope.freq_base", 10000.0)),
        "qk_layernorm": False,
        "tie_word_embeddings": "output.weight" not in tensors,
        "bos_token_id": token("bos_token_id"),
        "eos_token_id": token("eos_token_id"),
    }


def modules(config: dict, names) -> dict[str, tuple[str, slice | None]]:
    """transformers' module name -> (the file's tensor stem, the rows of it that are the module's,
    or None for all), for the tensor `names` the file holds."""
    head_dim = config["hidden_size"] // config["num_attention_heads"]
    q, kv = config["num_attention_heads"] * head_dim, config["num_key_value_heads"] * head_dim
    table = {
        "model.embed_tokens": ("token_embd", None),
        "model.final_layernorm": ("output_norm", None),
        "lm_head": ("output" if "output.weight" in names else "token_embd", None),
    }
    for i in range(config["num_hidden_layers"]):
        block, layer = f"blk.{i}", f"model.layers.{i}"
        table[f"{layer}.input_layernorm"] = (f"{block}.attn_norm", None)
        fused = f"{block}.attn_qkv.weight" in names
        for part, rows in (("q", slice(0, q)), ("k", slice(q, q + kv)), ("v", slice(q + kv, q + 2 * kv))):
            table[f"{layer}.self_attn.{part}_proj"] = (
                (f"{block}.attn_qkv", rows) if fused else (f"{block}.attn_{part}", None)
            )
        table[f"{layer}.self_attn.dense"] = (f"{block}.attn_output", None)
        table[f"{layer}.mlp.fc1"] = (f"{block}.ffn_up", None)
        table[f"{layer}.mlp.fc2"] = (f"{block}.ffn_down", None)
    return table
