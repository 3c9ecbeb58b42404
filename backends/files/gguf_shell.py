"""A GGUF file's config and tokenizer as a checkpoint folder, from the file's metadata alone.

transformers' GGUF config reader (`load_gguf_checkpoint`) parses every metadata array with gguf's
reader: 33 s for Qwen2.5's 151,936-token vocabulary and merges on 2 cores, before a weight is
read. Its own fast reader (`read_gguf_metadata`, which its tokenizer path uses) reads the same
header in 0.3 s; the config is made from it by transformers' own name map (`GGUF_CONFIG_MAPPING`),
as `load_gguf_checkpoint` makes it, for the architectures served (backends/files/models.py's
GGUF_ARCHITECTURES; Phi-2's files are converted by backends/torch/checkpoints.py). The weights are not
written: the CPU serves the file's own blocks from the file (backends/torch/gguf_direct.py), and
a runtime that needs float weights asks for them (files/models.converted_gguf(weights=True)).
"""

from __future__ import annotations

import json
from pathlib import Path


def config_dict(metadata: dict, tensor_names: tuple[str, ...]) -> dict:
    """transformers' config fields for a file with this metadata, as load_gguf_checkpoint reads them."""
    from transformers.integrations.ggml import GGUF_CONFIG_DEFAULTS_MAPPING, GGUF_CONFIG_MAPPING

    architecture = metadata["general.architecture"]
    # llama.cpp writes Mistral as llama; transformers tells them apart by the model's name
    served = "mistral" if architecture == "llama" and metadata.get("general.name") == "mistral" else architecture
    config = {"tie_word_embeddings": "output.weight" not in tensor_names}
    config.update(GGUF_CONFIG_DEFAULTS_MAPPING.get(served, GGUF_CONFIG_DEFAULTS_MAPPING.get(architecture) or {}))
    for key, value in metadata.items():
        prefix, _, rest = key.replace(architecture, served).partition(".")
        renamed = GGUF_CONFIG_MAPPING.get(prefix, {}).get(rest)
        if renamed is None or renamed == -1:
            continue
        if isinstance(value, str) and architecture in value:
            value = value.replace(architecture, served)
        config[renamed] = value
    if architecture == "gemma3":  # transformers' reader names its text model so (load_gguf_checkpoint)
        config["model_type"] = "gemma3_text"
    config.update(llama_cpp_rules(architecture, metadata, config))
    if "vocab_size" not in config:  # the reader counts an array it does not read
        tokens = metadata.get("tokenizer.ggml.tokens")
        config["vocab_size"] = tokens if isinstance(tokens, int) else len(tokens)
    return config


def llama_cpp_rules(architecture: str, fields: dict, config: dict) -> dict:
    """What a GGUF file leaves to llama.cpp's own rules (src/llama-model.cpp) and transformers'
    reader would take its defaults for, as config fields to set: Gemma 3's score scale (1/sqrt of
    the head's size; the 62-layer 27B: hidden / heads) where transformers assumes 256, its
    global layers' linear rope scaling (4B and up: factor 8), the local layers' base and a logit
    cap where the file names them. `fields`: the file's metadata, {key: value}."""
    if architecture != "gemma3":
        return {}
    layers, heads = config["num_hidden_layers"], config["num_attention_heads"]
    rules = {"query_pre_attn_scalar": config["hidden_size"] // heads if layers == 62 else config["head_dim"]}
    rope = {
        kind: dict(parameters or {"rope_type": "default"})
        for kind, parameters in (config.get("rope_parameters") or {}).items()
    }
    full = rope.setdefault("full_attention", {"rope_type": "default"})
    full.setdefault("rope_theta", fields.get("gemma3.rope.freq_base", 1_000_000.0))
    if fields.get("gemma3.rope.scaling.type") == "linear":
        full.update(rope_type="linear", factor=float(fields["gemma3.rope.scaling.factor"]))
    local = rope.setdefault("sliding_attention", {"rope_type": "default"})
    local["rope_theta"] = fields.get("gemma3.rope.freq_base_swa", 10_000.0)
    rules["rope_parameters"] = rope
    if "gemma3.final_logit_softcapping" in fields:
        rules["final_logit_softcapping"] = fields["gemma3.final_logit_softcapping"]
    return rules


def write(file: Path, folder: Path) -> str:
    """config.json, generation_config.json and the tokenizer's files for `file` into `folder`;
    returns the file's GGUF architecture."""
    from transformers import AutoConfig, GenerationConfig
    from transformers.integrations.gguf.reader import read_gguf_metadata
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    from transformers.models.auto.tokenization_auto import TOKENIZER_MAPPING_NAMES, tokenizer_class_from_name

    metadata, tensor_names = read_gguf_metadata(str(file))
    config = AutoConfig.for_model(**config_dict(metadata, tensor_names))
    config.architectures = [MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[config.model_type]]
    config.dtype = "float32"
    folder.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(folder)
    GenerationConfig.from_model_config(config).save_pretrained(folder)
    # the class AutoTokenizer picks for the model type; its own GGUF path reads the vocabulary
    name = TOKENIZER_MAPPING_NAMES.get(config.model_type) or "TokenizersBackend"
    if metadata.get("tokenizer.ggml.model") == "gpt2" and name == "GemmaTokenizer":
        # a byte-level vocabulary (llama.cpp writes one for a checkpoint without tokenizer.model),
        # which GemmaTokenizer would read as SentencePiece: its spaces became unknown tokens
        name = "TokenizersBackend"
    tokenizer = tokenizer_class_from_name(name).from_pretrained(str(file.parent), gguf_file=file.name)
    tokenizer.save_pretrained(folder)
    return metadata["general.architecture"]


def same_config(a: Path, b: Path) -> bool:
    """Whether two config.json files say the same (for the tests: the shell against transformers')."""
    ignore = ("transformers_version",)
    load = [{k: v for k, v in json.loads(p.read_text()).items() if k not in ignore} for p in (a, b)]
    return load[0] == load[1]
