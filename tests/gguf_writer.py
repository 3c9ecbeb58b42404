"""A transformers checkpoint written as a GGUF file the way llama.cpp's convert_hf_to_gguf.py writes
it (through the gguf package), for the families whose files the tests serve: its tensor names
(gguf's name map), its metadata, its byte-level vocabulary (a checkpoint with tokenizer.json and
no tokenizer.model: `_set_vocab_gpt2`), the embedding's rows cut to the tokenizer's vocabulary,
Gemma's norms stored as 1 + w (`Gemma3Model.norm_shift`), matrices in the type asked for (the
norms and biases float32, as its quantizer leaves one-dimensional tensors).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

# model_type -> (GGUF architecture, gguf's MODEL_ARCH name, what is added to a norm's weight)
ARCHITECTURES = {"gemma3_text": ("gemma3", "GEMMA3", 1.0), "qwen2": ("qwen2", "QWEN2", 0.0)}


def write_gguf(checkpoint: Path, out: Path, matrices: str = "F32") -> Path:
    import gguf
    import torch
    from safetensors.torch import load_file
    from transformers import AutoConfig, AutoTokenizer

    config = AutoConfig.from_pretrained(checkpoint)
    architecture, arch_name, norm_shift = ARCHITECTURES[config.model_type]
    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    writer = gguf.GGUFWriter(str(out), architecture)
    writer.add_name(checkpoint.name)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    rope = config.rope_parameters
    writer.add_rope_freq_base((rope.get("full_attention") or rope)["rope_theta"])
    if getattr(config, "final_logit_softcapping", None):
        writer.add_final_logit_softcapping(config.final_logit_softcapping)
    if config.model_type == "gemma3_text":
        writer.add_sliding_window(config.sliding_window)
    kind = gguf.GGMLQuantizationType[matrices]
    writer.add_file_type(gguf.LlamaFileType.ALL_F32 if matrices == "F32" else gguf.LlamaFileType[f"MOSTLY_{matrices}"])

    # the vocabulary: every id the tokenizer knows, its added tokens typed as control or user-defined
    vocab = {index: token for token, index in tokenizer.get_vocab().items()}
    added = {index: token.special for index, token in tokenizer.added_tokens_decoder.items()}
    size = len(vocab)
    types = [
        (gguf.TokenType.CONTROL if added[i] else gguf.TokenType.USER_DEFINED) if i in added else gguf.TokenType.NORMAL
        for i in range(size)
    ]
    merges = json.loads(tokenizer.backend_tokenizer.to_str())["model"]["merges"]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("gpt-2")
    writer.add_token_list([vocab[i] for i in range(size)])
    writer.add_token_types(types)
    writer.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in merges])
    for name in ("bos", "eos", "pad", "unk"):
        token_id = getattr(tokenizer, f"{name}_token_id")
        if token_id is not None:
            getattr(writer, f"add_{name}_token_id")(token_id)
    if tokenizer.chat_template:
        writer.add_chat_template(tokenizer.chat_template)

    names = gguf.get_tensor_name_map(getattr(gguf.MODEL_ARCH, arch_name), config.num_hidden_layers)
    state = {}
    for file in sorted(checkpoint.glob("*.safetensors")):
        state.update(load_file(str(file)))
    for name, tensor in state.items():
        if name == "lm_head.weight" and config.tie_word_embeddings:
            continue
        target = names.get_name(name, try_suffixes=(".weight", ".bias"))
        assert target is not None, name
        values = tensor.to(torch.float32)
        if name.endswith("norm.weight"):
            values = values + norm_shift
        if name == "model.embed_tokens.weight":
            values = values[:size]  # llama.cpp drops the rows past the tokenizer's vocabulary
        data = values.numpy()
        if data.ndim == 2 and kind != gguf.GGMLQuantizationType.F32:
            writer.add_tensor(target, gguf.quants.quantize(data, kind), raw_dtype=kind)
        else:
            writer.add_tensor(target, np.ascontiguousarray(data))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out
