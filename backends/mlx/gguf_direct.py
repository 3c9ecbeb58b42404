"""A GGUF file's model on MLX built from the file itself: no float checkpoint (issue 67).

The first start of a K-quant file used to dequantize the whole file into a float32 checkpoint
(transformers' reader: minutes and gigabytes on disk), which MLX loaded. Here mlx-lm builds the
model from the config alone (backends/files/gguf_shell.py writes it and the tokenizer from the
file's metadata), each Linear and the token embedding become an `nn.QuantizedLinear` /
`nn.QuantizedEmbedding` holding the file's blocks in MLX's affine format
(backends/mlx/gguf_blocks.py: Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K and Q5_K exactly, in groups of
32 at their own bits; Q6_K, Q2_K and Q3_K re-quantized to 8 bits in groups of 64, the only change
from the file's numbers), and the norms and biases are the file's floats. A matrix the file keeps
in floats stays a float Linear. A matrix is decoded a chunk of rows at a time, so memory holds
the model and one chunk's floats.
"""

from __future__ import annotations

import logging
import struct
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten, tree_unflatten

from backends.files import gguf_tensors
from backends.mlx import gguf_blocks
from backends.mlx.gguf import name_map

log = logging.getLogger("phi2_server.mlx")

# The GGUF architectures whose tensors gguf's name map gives mlx-lm's (Hugging Face's) names; Phi-2's
# files (fused q, k and v rows, backends/files/gguf_phi2.py) are converted and take backends/mlx/gguf.py.
ARCHITECTURES = ("llama", "qwen2", "qwen3", "phi3")


def applies(file: Path | None, quantize: str) -> bool:
    """Whether the model is built from `file`: a GGUF file of those architectures, served as
    stored (PHI2_QUANTIZE unset; `none` or a method asks for the float checkpoint)."""
    if file is None or quantize:
        return False
    try:
        return gguf_tensors.read(file).architecture in ARCHITECTURES
    except (OSError, ValueError, struct.error):  # not a GGUF file: resolving it says so
        return False


def load(file: Path, path: Path, model_config: dict | None = None):
    """(model, tokenizer, config, /model/info's quantization) for `file`, its config and tokenizer
    in `path` (`model_config`: fields over config.json's, as mlx_lm.load takes them). ValueError
    naming a parameter the file does not hold or a matrix of the wrong shape."""
    from gguf.quants import dequantize
    from mlx_lm.utils import load_model, load_tokenizer

    # lazy: its random weights are never made
    model, config = load_model(path, lazy=True, strict=False, model_config=model_config)
    header = gguf_tensors.read(file)
    tensors = {info.name: info for info in header.tensors}
    names = name_map(header.architecture, config, tensors)
    mapped = np.memmap(file, mode="r", dtype=np.uint8)

    def stored(module_path: str, leaf: str):
        stem = names(module_path)[0]
        return tensors.get(f"{stem}.{leaf}") if stem else None

    def rows_of(info) -> np.ndarray:
        data = mapped[info.start : info.start + info.nbytes].reshape(info.shape[0], -1)
        if header.architecture == "llama" and (".attn_q." in info.name or ".attn_k." in info.name):
            data = _unpermute(data, info.name, config)
        return data

    replaced, assigned, kinds, requantized = [], set(), set(), set()
    for module_path, module in model.named_modules():
        if not isinstance(module, (nn.Linear, nn.Embedding)) or (info := stored(module_path, "weight")) is None:
            continue
        if tuple(module.weight.shape) != info.shape:
            raise ValueError(f"{info.name} is {list(info.shape)}, {module_path} {list(module.weight.shape)}")
        layout = gguf_blocks.layout(info.ggml_type)
        if layout is None:  # a float matrix: kept as the file's floats
            continue
        weight, scales, biases = gguf_blocks.affine(rows_of(info), info.ggml_type, info.shape)
        replaced.append((module_path, _quantized(module, weight, scales, biases, *layout)))
        assigned.update(f"{module_path}.{leaf}" for leaf in ("weight", "scales", "biases"))
        kind = gguf_blocks.T(info.ggml_type)
        kinds.add(kind.name.lower())
        if kind in gguf_blocks.REQUANTIZED:
            requantized.add(kind.name.lower())
    model.update_modules(tree_unflatten(replaced))
    floats, missing = [], []
    for name, _ in tree_flatten(model.parameters()):
        if name in assigned:
            continue
        module_path, _, leaf = name.rpartition(".")
        info = stored(module_path, leaf)
        if info is None:
            missing.append(name)
            continue
        raw = rows_of(info) if len(info.shape) == 2 else mapped[info.start : info.start + info.nbytes]
        values = dequantize(raw, info.ggml_type)
        floats.append((name, mx.array(np.asarray(values, dtype=np.float32).reshape(info.shape))))
    if missing:
        more = f" (and {len(missing) - 1} more)" if missing[1:] else ""
        raise ValueError(f"the file holds no tensor for {missing[0]}{more}")
    model.load_weights(floats, strict=False)
    mx.eval(model.parameters())
    tokenizer = load_tokenizer(path, eos_token_ids=config.get("eos_token_id"))
    log.info("%s: built from its blocks (%s), no float checkpoint", file.name, ", ".join(sorted(kinds)) or "floats")
    quantization = None
    if replaced:
        quantization = {
            "method": "mlx-gguf",
            "types": sorted(kinds),
            "bits": min(layer.bits for _, layer in replaced),
            "group_size": gguf_blocks.GROUP_SIZE,
        }
        if requantized:  # their numbers are MLX's 8-bit ones, not the file's
            quantization["requantized"] = sorted(requantized)
    return model, tokenizer, config, quantization


def _unpermute(rows: np.ndarray, name: str, config: dict) -> np.ndarray:
    """llama.cpp stores Llama's q and k rows permuted for its rotary layout; transformers' reader
    puts them back (`LlamaTensorProcessor`). Whole rows of blocks move alike."""
    from transformers.modeling_gguf_pytorch_utils import LlamaTensorProcessor

    return LlamaTensorProcessor(config=config).process(np.array(rows), name).weights


def _quantized(module, weight: mx.array, scales: mx.array, biases: mx.array, bits: int, group_size: int):
    rows, inputs = module.weight.shape
    if isinstance(module, nn.Embedding):
        layer = nn.QuantizedEmbedding(rows, inputs, group_size=group_size, bits=bits)
    else:
        layer = nn.QuantizedLinear(inputs, rows, bias="bias" in module, group_size=group_size, bits=bits)
    layer.weight, layer.scales, layer.biases = weight, scales, biases
    return layer
