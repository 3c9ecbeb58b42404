"""A GGUF file's Q4_0, Q4_1 and Q8_0 matrices on MLX, kept quantized over its converted checkpoint
(issue 54): Phi-2's own files. Files of the architectures gguf's name map serves are built from
their blocks with no checkpoint (backends/mlx/gguf_direct.py), which reads `name_map` here.

MLX reads GGUF files itself (`mx.load`): it hands those three types back as MLX's affine
quantization, (weight, scales, biases) with groups of 32 inputs: Q4_0's w = d * (q - 8) is scale
d and bias -8d, Q4_1's w = d * q + m is d and m, Q8_0's w = d * q is d and -128d over q + 128,
all exact. So each Linear (and the token embedding) the file stores in one of them becomes an
`nn.QuantizedLinear` (`nn.QuantizedEmbedding`) of 4 or 8 bits holding the file's numbers; the
rest of the model (norms, biases, matrices of other types) is the converted checkpoint's, the
file's values dequantized by transformers (backends/files/models.py). The model's structure is
mlx-lm's, from that checkpoint's config.json.
"""

from __future__ import annotations

import logging
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_unflatten

log = logging.getLogger("phi2_server.mlx")

GROUP_SIZE = 32
# The types mx.load keeps quantized, and their bits.
KEPT = {"Q4_0": 4, "Q4_1": 4, "Q8_0": 8}
# What else mx.load reads (mlx 0.32, tried on each type): floats, and Q2_K, Q4_K and Q6_K
# dequantized to float16. A file holding Q5_0, Q5_1, Q3_K or Q5_K fails the whole load
# ("[load_gguf] gguf_tensor_to_f16 failed"): such a file is served dequantized.
READABLE = {"F32", "F16", "BF16", "Q2_K", "Q4_K", "Q6_K", *KEPT}


def keep_file_blocks(model: nn.Module, file: Path, config: dict) -> dict | None:
    """Replace, in place, each of the model's Linears and its token embedding that `file` stores
    as Q4_0, Q4_1 or Q8_0 by a quantized layer holding the file's blocks. Returns /model/info's
    `quantization`, or None where nothing is replaced (the reason is logged): the model stays
    the converted checkpoint's float one."""
    from gguf import GGUFReader

    reader = GGUFReader(str(file))
    types = {tensor.name: tensor.tensor_type.name for tensor in reader.tensors}
    field = reader.get_field("general.architecture")
    architecture = field.contents() if field is not None else None
    if not any(kind in KEPT for kind in types.values()):
        log.info("%s holds no Q4_0, Q4_1 or Q8_0 matrix: served dequantized", file.name)
        return None
    if unread := sorted(set(types.values()) - READABLE):
        log.warning("%s holds %s, which MLX does not read: served dequantized", file.name, ", ".join(unread))
        return None
    names = name_map(architecture, config, types)
    if names is None:
        log.warning("%s: GGUF architecture %r has no name map in gguf: served dequantized", file.name, architecture)
        return None
    try:
        tensors = mx.load(str(file))
    except RuntimeError as exc:
        log.warning("%s could not be read by MLX (%s): served dequantized", file.name, exc)
        return None
    replaced, kinds = [], set()
    for path, module in model.named_modules():
        if not isinstance(module, (nn.Linear, nn.Embedding)):
            continue
        stem, rows = names(path)
        if stem is None or types.get(f"{stem}.weight") not in KEPT:
            continue
        parts = [tensors[f"{stem}.{part}"] for part in ("weight", "scales", "biases")]
        if rows is not None:  # q, k or v of a fused attn_qkv (Phi-2's files): whole rows of blocks
            parts = [part[rows] for part in parts]
        if architecture == "llama" and stem.endswith((".attn_q", ".attn_k")):
            parts = _unpermute(parts, stem, config)
        layer = _quantized(module, *parts, KEPT[types[f"{stem}.weight"]])
        if layer is None:
            log.warning("%s: %s does not fit %s; it stays float", file.name, stem, path)
            continue
        replaced.append((path, layer))
        kinds.add(types[f"{stem}.weight"].lower())
    del tensors  # the float16 matrices mx.load dequantized; the checkpoint's float32 ones are used
    if not replaced:
        log.warning("%s: none of its quantized matrices fits the model: served dequantized", file.name)
        return None
    model.update_modules(tree_unflatten(replaced))
    bits = min(layer.bits for _, layer in replaced)
    return {"method": "mlx-gguf", "types": sorted(kinds), "bits": bits, "group_size": GROUP_SIZE}


def name_map(architecture: str | None, config: dict, names):
    """A module's name (Hugging Face's; mlx-lm's are the same) -> (the file's tensor stem or None,
    the rows of it that are the module's or None): gguf's map, or for Phi-2's files
    backends/files/gguf_phi2.py's table. None where the architecture has neither."""
    import gguf

    from backends.files import gguf_phi2

    if architecture == gguf_phi2.ARCHITECTURE:
        table = gguf_phi2.modules(config, names)
        return lambda path: table.get(path, (None, None))
    arch = {name: arch for arch, name in gguf.MODEL_ARCH_NAMES.items()}.get(architecture)
    if arch is None:
        return None
    tensors = gguf.get_tensor_name_map(arch, int(config["num_hidden_layers"]))
    return lambda path: (tensors.get_name(path), None)


def _unpermute(parts: list[mx.array], stem: str, config: dict) -> list[mx.array]:
    """llama.cpp stores Llama's q and k rows permuted for its rotary layout; transformers' reader
    puts them back (`LlamaTensorProcessor`). A row's blocks move with it: the same permutation
    of whole rows, applied to the weight, the scales and the biases alike."""
    from transformers.modeling_gguf_pytorch_utils import LlamaTensorProcessor

    processor = LlamaTensorProcessor(config=config)
    return [mx.array(processor.process(np.array(part), f"{stem}.weight").weights) for part in parts]


def _quantized(module, weight: mx.array, scales: mx.array, biases: mx.array, bits: int):
    """The quantized layer for `module` holding these blocks, or None where their shape is not
    the module's. Scales and biases take the dtype of the float weight they replace (float16 to
    float32 is exact), so the model computes in one dtype."""
    rows, inputs = module.weight.shape
    if weight.shape != (rows, inputs * bits // 32) or scales.shape != (rows, inputs // GROUP_SIZE):
        return None
    dtype = module.weight.dtype
    if isinstance(module, nn.Embedding):
        layer = nn.QuantizedEmbedding(rows, inputs, group_size=GROUP_SIZE, bits=bits)
    else:
        layer = nn.QuantizedLinear(inputs, rows, bias="bias" in module, group_size=GROUP_SIZE, bits=bits)
        if "bias" in module:
            layer.bias = module.bias
    layer.weight, layer.scales, layer.biases = weight, scales.astype(dtype), biases.astype(dtype)
    return layer
