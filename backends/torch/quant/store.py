"""Quantized weights stored once, memory-mapped at the next start (PHI2_QUANTIZE on Torch).

Quantizing Phi-2 to int8 took 57 s at every start and peaked at the full-precision model plus a
layer; llama.cpp starts in 2 s because its file is quantized already. So the first start writes
what the general decoder reads (its quantized block matrices and every weight the model keeps:
embeddings, norms, biases, the output head) to one file, and the next start builds the model on
the meta device and memory-maps that file: no full-precision copy is made, and the pages come
from the page cache.

The file is named by a key of all that decides its content: the checkpoint's config.json, its
weight files' names, sizes and modification times (hashing 11 GB would cost the seconds this
saves), the method, the dtype, the device type (and GPU generation), torch's version and
FORMAT. A changed checkpoint gets a new file; old ones stay until removed (`rm -r
$PHI2_CACHE_DIR/quantized`). It is written under a temporary name and renamed, so a replica
starting beside this one reads a whole file or none; a file that does not load is quantized
again and rewritten.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from backends.files.models import cache_root
from backends.torch.quant.make import from_state
from backends.torch.quant.methods import QuantizedWeight

log = logging.getLogger("phi2.quant_store")

FORMAT = 7  # bump when what is stored, or how the decoder reads it, changes
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth")


def stored_file(checkpoint: Path, spec: str, method: str, dtype: torch.dtype, device: torch.device) -> Path:
    """Where the quantized weights of this checkpoint, method, dtype and device type live."""
    files = sorted(
        (f.name, f.stat().st_size, f.stat().st_mtime_ns)
        for f in checkpoint.iterdir()
        if f.is_file() and f.name.endswith(WEIGHT_SUFFIXES)
    )
    key = {
        "format": FORMAT,
        "config": (checkpoint / "config.json").read_text(),
        "files": files,
        "random": spec if spec.startswith("random:") else None,  # weights drawn from seed 0 at load
        "method": method,
        "dtype": str(dtype),
        "device": device.type,  # and the GPU's generation: int4's packed layout is the kernel's
        "capability": list(torch.cuda.get_device_capability(device)) if device.type == "cuda" else None,
        "torch": torch.__version__,
    }
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:32]
    return cache_root() / "quantized" / f"{checkpoint.name}-{method}-{digest}.pt"


def save(
    file: Path, model, blocks: list, head: QuantizedWeight | None, parameters: int, shell: dict | None = None
) -> None:
    """Write the quantized model (its state dict, whose block Linears are empty, the decoder's
    blocks, and its output head where that is quantized), and `shell`: what the next start
    builds the model from without transformers' modelling code (backends/torch/stored_model.py), or
    None. Tensors that share storage (the model's biases are views of the fused ones) are
    written once. A failure is logged: the server serves on, quantizing again next time."""
    layers = [{name: _pack(value) for name, value in block._asdict().items()} for block in blocks]
    saved = {"format": FORMAT, "parameters": parameters, "state": model.state_dict(), "blocks": layers, "shell": shell}
    saved["head"] = _pack(head) if head is not None else None
    embed = getattr(model.model.embed_tokens, "blocks", None)  # a GGUF file's embedding in its blocks
    saved["embed"] = _pack(embed) if embed is not None else None
    temporary = file.with_name(f".{file.name}.{os.getpid()}.tmp")
    try:
        file.parent.mkdir(parents=True, exist_ok=True)
        torch.save(saved, temporary)
        os.replace(temporary, file)
        log.info("quantized weights stored in %s (%.2f GB): the next start maps them", file, file.stat().st_size / 1e9)
    except (OSError, RuntimeError) as exc:  # torch.save's writer raises RuntimeError on a full disk
        with contextlib.suppress(OSError):
            temporary.unlink(missing_ok=True)
        log.warning("could not store the quantized weights in %s (%s): the next start quantizes again", file, exc)


def load(file: Path, device: torch.device) -> dict:
    """The stored file, memory-mapped on the CPU (`restore` reads it). Raises ValueError for a
    file of another FORMAT."""
    saved = torch.load(file, mmap=True, weights_only=True, map_location=device)
    if saved.get("format") != FORMAT:
        raise ValueError(f"format {saved.get('format')}, not {FORMAT}")
    return saved


def restore(saved: dict, model) -> tuple[list[dict], QuantizedWeight | None, int]:
    """Fill `model` (built on the meta device) from the stored file (`load`); return the
    decoder's block fields, its quantized output head (or None: the model's own) and the full
    model's parameter count. Raises ValueError when the file does not fit the model (then the
    caller quantizes again)."""
    for name, tensor in saved["state"].items():
        owner, _, leaf = name.rpartition(".")
        module = model.get_submodule(owner)
        if leaf in module._parameters:
            module._parameters[leaf] = torch.nn.Parameter(tensor, requires_grad=False)
        elif leaf in module._buffers:
            module._buffers[leaf] = tensor
        else:
            raise ValueError(f"{name} is not in the model")
    missing = [name for name, p in model.named_parameters() if p.is_meta]
    if missing:
        raise ValueError(f"no weights for {missing[:3]}")
    return decoder_parts(saved)


def decoder_parts(saved: dict) -> tuple[list[dict], QuantizedWeight | None, int]:
    """The decoder's block fields, its quantized output head (or None) and the full model's
    parameter count, from the stored file (`load`)."""
    # Layers in parallel: w8a8's weights are packed again for fbgemm, one thread a matrix (in one
    # thread most of a start: docs/decisions.md, D-w8a8-threads); the other kinds are views of the file.
    with ThreadPoolExecutor(max(1, torch.get_num_threads())) as pool:
        blocks = list(pool.map(lambda layer: {name: _unpack(value) for name, value in layer.items()}, saved["blocks"]))
    head = _unpack(saved["head"]) if saved.get("head") is not None else None
    return blocks, head, saved["parameters"]


def embedding(saved: dict, head: QuantizedWeight | None) -> QuantizedWeight | None:
    """The token embedding's blocks where they were stored (torch/quant/blocks.py: RowLookup), or None: the
    head's own object where they are its bytes (tied), so they are packed and held once."""
    embed = _unpack(saved["embed"]) if saved.get("embed") is not None else None
    if embed is not None and head is not None and embed.state().keys() == head.state().keys():
        if all(
            not isinstance(a, torch.Tensor) or a.data_ptr() == b.data_ptr()
            for a, b in zip(embed.state().values(), head.state().values(), strict=True)
        ):
            return head
    return embed


def _pack(value):
    return {"quantized": value.state()} if isinstance(value, QuantizedWeight) else value


def _unpack(value):
    return from_state(value["quantized"]) if isinstance(value, dict) else value
