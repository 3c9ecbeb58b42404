"""A GGUF file's model built from the file itself on the CPU: its blocks as stored, no float model.

The first start of a GGUF file used to dequantize it into a float32 checkpoint (transformers'
reader), load that, and quantize again: 154 s and 6 GB on disk for a 1 GB Q4_K_M file. Here the
model is made on the meta device from the config (backends/files/gguf_shell.py), its norms and biases
are read from the file, and every matrix is the file's blocks (quant/blocks.BlockWeight; a matrix
in a type the kernels do not multiply, float or Q2_K/Q3_K, is quantized to Q8_0 from its own
values), fused by their bytes (torch/weights.DecoderWeights). The token embedding stays in its
block type too (quant/blocks.RowLookup). What it returns is what a stored file restores
(torch/runtime.restore_quantized), and the caller stores it for the next start (torch/quant/store.py).
"""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import torch

from backends.torch.quant.blocks import BLOCK_BYTES, REQUANTIZED, BlockWeight, gguf_names

log = logging.getLogger("phi2.gguf_direct")

EMBEDDING = "model.embed_tokens.weight"


def applies(file: Path | None, method: str, device: str, quantize: str) -> bool:
    """Whether the model is built from the file: a GGUF file served as stored on the CPU (not
    PHI2_QUANTIZE), of a family transformers' name map reads (Phi-2's own files take
    backends/gguf_phi2.py's conversion) and whose fused matrices stack by rows."""
    from backends.torch.quant.blocks import STORED_KINDS

    if file is None or device != "cpu" or quantize or method not in STORED_KINDS:
        return False
    from backends.files import gguf_tensors

    return gguf_tensors.read(file).architecture in ("llama", "qwen2", "qwen3", "phi3")


def load(file: Path, path: Path, method: str):
    """(model, the decoder's block fields, its output head, the parameter count) from `file`, the
    config and tokenizer in `path`; the model's embedding blocks as `embed_tokens.blocks`."""
    from gguf.quants import dequantize
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import TENSOR_PROCESSORS, TensorProcessor

    from backends.files import gguf_tensors
    from backends.torch.weights import DecoderWeights

    config = AutoConfig.from_pretrained(path)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    parameters = sum(p.numel() for p in model.parameters())
    header = gguf_tensors.read(file)
    processor = TENSOR_PROCESSORS.get(header.architecture, TensorProcessor)(config=config.to_dict())
    names = gguf_names(model, processor)
    mapped = np.memmap(file, mode="r", dtype=np.uint8)
    matrices, linears = {}, {name for name, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    for info in header.tensors:
        name = names.get(info.name)
        if name is None:
            continue
        data = mapped[info.start : info.start + info.nbytes]
        matrix = len(info.shape) == 2 and (name == EMBEDDING or name.removesuffix(".weight") in linears)
        if not matrix:
            values = np.array(dequantize(data, info.ggml_type), dtype=np.float32).reshape(info.shape)
            _assign(model, name, torch.from_numpy(values))
            continue
        rows = data.reshape(info.shape[0], -1)
        if header.architecture == "llama" and (".attn_q." in info.name or ".attn_k." in info.name):
            rows = processor.process(rows, info.name).weights  # transformers' q/k order, on whole rows
        if info.ggml_type in BLOCK_BYTES and info.ggml_type not in REQUANTIZED:
            matrices[name] = BlockWeight(torch.from_numpy(np.array(rows)), info.ggml_type, info.shape[1])
        else:  # float or Q2_K/Q3_K: Q8_0 blocks from the matrix's own values, one matrix at a time
            values = torch.from_numpy(dequantize(np.array(rows), info.ggml_type).reshape(info.shape))
            matrices[name] = BlockWeight.quantize(values, "q8_0")
    if config.tie_word_embeddings:
        matrices.setdefault("lm_head.weight", matrices.get(EMBEDDING))
    missing = [name for name in (f"{linear}.weight" for linear in linears) if name not in matrices]
    if missing or EMBEDDING not in matrices:
        raise ValueError(f"the file holds no {(missing or [EMBEDDING])[0]}")
    fused = DecoderWeights(model, config.vocab_size, 0)  # fuses meta matrices: shapes only
    fused.quantize(model, method, matrices)
    blocks = [block._asdict() for block in fused.layers]
    for module in model.modules():  # the Linears' and the embedding's meta weights: empty
        for leaf, parameter in list(module._parameters.items()):
            if parameter is not None and parameter.is_meta:
                module._parameters[leaf] = torch.nn.Parameter(torch.empty(0), requires_grad=False)
    model.model.embed_tokens.blocks = matrices[EMBEDDING]
    for name, module in model.named_modules():  # rotary frequencies: non-persistent, built again
        if name.endswith("rotary_emb"):
            parent, _, leaf = name.rpartition(".")
            setattr(model.get_submodule(parent) if parent else model, leaf, type(module)(config=config))
    log.info("%s: its blocks as stored (no float copy)", file.name)
    return model.eval(), blocks, fused.quantized_head, parameters


def _assign(model, name: str, tensor: torch.Tensor) -> None:
    owner, _, leaf = name.rpartition(".")
    model.get_submodule(owner)._parameters[leaf] = torch.nn.Parameter(tensor, requires_grad=False)
