"""llama.cpp's block quantizations on the CPU: Q8_0, Q4_0 and Q4_1 weights, as GGUF files store
them, multiplied by this server's own kernels (backends/torch/cpu/kernels.cpp).

A weight row is a run of blocks of 32 input channels: a float16 scale d (Q4_1: and a float16
minimum m) and the block's values (Q8_0: w = d * q, q int8; Q4_0: w = d * (q - 8), q 4-bit;
Q4_1: w = d * q + m). A GGUF file's tensors are taken as they are, byte for byte, so the server
multiplies the numbers llama.cpp does; a float checkpoint is quantized as llama.cpp's reference
quantizer does (`BlockWeight.quantize`). Rows stack (q, k, v into one matrix) and columns join
(Phi's [o | fc2]) by their bytes: a block never straddles two matrices.
"""

from __future__ import annotations

import contextlib

import numpy as np
import torch

from backends.contract import ModelLoadError
from backends.files import gguf_phi2
from backends.torch.quant.methods import QuantizedWeight

# GGUF / ggml type ids, and each block's bytes.
KINDS = {"q4_0": 2, "q4_1": 3, "q8_0": 8}
NAMES = {kind: name for name, kind in KINDS.items()}
BLOCK_BYTES = {2: 18, 3: 20, 8: 34}
PACKED = 100  # a kind + PACKED: cpu_kernels.cpp's sixteen-row records
GROUP = 16  # rows a record interleaves
QK = 32


class BlockWeight(QuantizedWeight):
    """A matrix of llama.cpp blocks: `raw` uint8 [out_features, in_features / 32 * block bytes]."""

    group_size, on_cuda = QK, False

    def __init__(self, raw: torch.Tensor, kind: int, in_features: int):
        if in_features % QK or raw.shape[1] != in_features // QK * BLOCK_BYTES[kind]:
            raise ValueError(f"{NAMES[kind]} rows of {raw.shape[1]} bytes do not hold {in_features} channels")
        self.raw, self.ggml_type = raw.contiguous(), kind
        self.out_features, self.in_features = raw.shape[0], in_features
        self.packed: torch.Tensor | None = None  # sixteen rows interleaved (`pack`), in place of `raw`

    def pack(self, into=None) -> None:
        """Sixteen rows' blocks interleaved (cpu_kernels.cpp's records: one dot-product
        instruction covers 16 rows), in place of the rows as stored; `into(tensor)` gives where
        they go."""
        from backends.torch.cpu.kernels import kernels

        if self.packed is not None or self.out_features % GROUP:
            return
        packed = kernels().pack(self.raw, self.ggml_type, self.in_features)
        self.packed, self.raw = (into(packed) if into else packed), None

    def rows(self) -> torch.Tensor:
        """The matrix as GGUF stores it (uint8 [out_features, blocks' bytes])."""
        if self.raw is not None:
            return self.raw
        from backends.torch.cpu.kernels import kernels

        return kernels().unpack(self.packed, self.ggml_type, self.in_features)

    @property
    def packed_nbytes(self) -> int:
        """Its bytes once packed (Q4_0's records hold a minimum slot its blocks do not)."""
        if self.out_features % GROUP:
            return self.nbytes
        record = GROUP * QK + 2 * GROUP if self.ggml_type == KINDS["q8_0"] else GROUP * (QK // 2) + 4 * GROUP
        return self.out_features // GROUP * self.in_features // QK * record

    @property
    def operand(self) -> tuple[torch.Tensor, int]:
        """(its bytes, its kind) as cpu_kernels.cpp's products take them."""
        return (self.raw, self.ggml_type) if self.packed is None else (self.packed, self.ggml_type + PACKED)

    def state(self) -> dict:
        """As it is held: packed records are stored packed, so the next start does not pack them
        again (1.1 s of a Phi-2 start), only copies them (`rehome`)."""
        held = {"raw": self.raw} if self.packed is None else {"packed": self.packed}
        return {
            "kind": type(self).__name__,
            **held,
            "ggml_type": self.ggml_type,
            "out_features": self.out_features,
            "in_features": self.in_features,
        }

    def _restore(self, state: dict) -> None:
        vars(self).update({"raw": None, "packed": None, **state})

    @property
    def bits(self) -> int:
        return 8 if self.ggml_type == KINDS["q8_0"] else 4

    @property
    def name(self) -> str:
        return NAMES[self.ggml_type]

    def _product(self, x: torch.Tensor) -> torch.Tensor:
        from backends.torch.cpu.kernels import kernels

        return kernels().mm(x.float(), *self.operand, self.in_features).to(x.dtype)

    def prompt_product(self, x: torch.Tensor) -> torch.Tensor:
        """x [rows, in_features] times the weight's transpose as a long prompt's tokens take it in
        the compiled step: AMX-BF16's tiles where the CPU has them (cpu_kernels.cpp), else the
        exact products."""
        from backends.torch.cpu.kernels import kernels

        return kernels().mm(x.float(), *self.operand, self.in_features, prompt_from=0).to(x.dtype)

    def dequantize(self) -> torch.Tensor:
        from backends.torch.cpu.kernels import kernels

        return kernels().dequantize(self.rows(), self.ggml_type, self.in_features)

    @property
    def nbytes(self) -> int:
        return (self.raw if self.packed is None else self.packed).nbytes

    @staticmethod
    def quantize(weight: torch.Tensor, name: str) -> BlockWeight:
        """`weight` [out, in] as llama.cpp's reference quantizer writes `name` (quantize_row_*_ref)."""
        if weight.is_cuda:
            raise ModelLoadError(f"PHI2_QUANTIZE={name} is for the CPU; use int8 or int4 on CUDA")
        out_features, in_features = weight.shape
        if in_features % QK:
            raise ModelLoadError(f"PHI2_QUANTIZE={name} needs input widths that are multiples of 32, not {in_features}")
        x = weight.detach().float().reshape(out_features, -1, QK)
        if name == "q8_0":
            d = x.abs().amax(-1) / 127
            q = torch.round(x * _inverse(d)[..., None]).to(torch.int8)  # roundf: half away from zero, as torch
            parts = [_halves(d), q.view(torch.uint8)]
        elif name == "q4_0":
            signed_max = x.gather(-1, x.abs().argmax(-1, keepdim=True))[..., 0]
            d = signed_max / -8
            q = torch.clamp(torch.trunc(x * _inverse(d)[..., None] + 8.5), max=15).to(torch.uint8)
            parts = [_halves(d), _nibbles(q)]
        elif name == "q4_1":
            low, high = x.amin(-1), x.amax(-1)
            d = (high - low) / 15
            q = torch.clamp(torch.trunc((x - low[..., None]) * _inverse(d)[..., None] + 0.5), max=15).to(torch.uint8)
            parts = [_halves(d), _halves(low), _nibbles(q)]
        else:
            raise ValueError(name)
        raw = torch.cat(parts, dim=-1).reshape(out_features, -1)
        return BlockWeight(raw, KINDS[name], in_features)

    @staticmethod
    def stack_rows(parts: list[BlockWeight]) -> BlockWeight:
        """[a; b; ...]: one product for matrices over the same input."""
        _same_kind(parts)
        return BlockWeight(torch.cat([p.rows() for p in parts]), parts[0].ggml_type, parts[0].in_features)

    @staticmethod
    def join_columns(parts: list[BlockWeight]) -> BlockWeight:
        """[a | b | ...]: one product over inputs laid side by side."""
        _same_kind(parts)
        raw = torch.cat([p.rows() for p in parts], dim=1)
        return BlockWeight(raw, parts[0].ggml_type, sum(p.in_features for p in parts))


def _same_kind(parts: list[BlockWeight]) -> None:
    if len({p.ggml_type for p in parts}) != 1:
        raise ValueError("matrices of different block types do not fuse")


def _inverse(d: torch.Tensor) -> torch.Tensor:
    return torch.where(d != 0, 1 / d, torch.zeros_like(d))


def _halves(values: torch.Tensor) -> torch.Tensor:
    """float16 values as their two bytes, little-endian ([..., 2])."""
    return values.half().contiguous().view(torch.uint8).reshape(*values.shape, 2)


def _nibbles(q: torch.Tensor) -> torch.Tensor:
    """32 4-bit values a block as 16 bytes: value j low, value j + 16 high."""
    return q[..., : QK // 2] | (q[..., QK // 2 :] << 4)


# -- a GGUF file's matrices as they are stored ----------------------------------------------------


def file_matrices(file, model) -> dict[str, BlockWeight]:
    """The model's weight matrices that `file` holds in a block type of KINDS, by the model's
    parameter names (transformers' GGUF name map), memory-mapped from the file. Llama's q and k
    rows are put back in transformers' order (its reader un-permutes llama.cpp's rotary layout
    the same way, on whole rows)."""
    from gguf import GGUFReader
    from transformers.modeling_gguf_pytorch_utils import TENSOR_PROCESSORS, TensorProcessor, get_gguf_hf_weights_map

    reader = GGUFReader(str(file))
    config = model.config.to_dict()
    architecture = reader.get_field("general.architecture").contents()
    if architecture == gguf_phi2.ARCHITECTURE:
        return _phi2_matrices(reader, config)
    processor = TENSOR_PROCESSORS.get(architecture, TensorProcessor)(config=config)
    names = get_gguf_hf_weights_map(model, processor)
    found = {}
    for tensor in reader.tensors:
        kind = int(tensor.tensor_type)
        if kind not in BLOCK_BYTES or len(tensor.shape) != 2 or tensor.name not in names:
            continue
        rows = np.asarray(tensor.data)  # [out, bytes], a view of the mapped file
        if architecture == "llama" and (".attn_q." in tensor.name or ".attn_k." in tensor.name):
            rows = processor.process(rows, tensor.name).weights
        matrix = torch.from_numpy(np.array(rows))  # a copy: the mapped file is read-only
        found[names[tensor.name]] = BlockWeight(matrix, kind, int(tensor.shape[0]))
    return found


def _phi2_matrices(reader, config: dict) -> dict[str, BlockWeight]:
    """file_matrices for a Phi-2 file, by backends/files/gguf_phi2.py's table (transformers has no name
    map for it): a fused attn_qkv gives q, k and v their rows."""
    tensors = {tensor.name: tensor for tensor in reader.tensors}
    found = {}
    for module, (stem, rows) in gguf_phi2.modules(config, tensors).items():
        tensor = tensors.get(f"{stem}.weight")
        if tensor is None or int(tensor.tensor_type) not in BLOCK_BYTES or len(tensor.shape) != 2:
            continue
        data = np.asarray(tensor.data)  # [out, bytes], a view of the mapped file
        matrix = torch.from_numpy(np.array(data[rows] if rows is not None else data))
        found[f"{module}.weight"] = BlockWeight(matrix, int(tensor.tensor_type), int(tensor.shape[0]))
    return found


# Quantized types these kernels do not multiply (Q5_0, Q5_1, the K-quants Q2_K to Q6_K): a file
# mostly of them (Q4_K_M, the most common GGUF download) is served in Q8_0 blocks, each matrix
# quantized again from its dequantized values, as PHI2_QUANTIZE=q8_0 quantizes a float
# checkpoint. SmolLM2 in Q4_K_M: perplexity 22.395 against 22.316 dequantized (llama.cpp's on the
# file 22.402), decode 120.9 tok/s against float32's 21.5, what such a file was served as before
# (docs/decisions.md, D-k-quants).
REQUANTIZED = {6, 7, 10, 11, 12, 13, 14}
KIND_RULE = 2  # the rule of `file_kind`, kept with its answer: an answer by another is read again


def file_kind(file, folder=None) -> str | None:
    """The block type to serve the file in: the one most of its matrices are stored in (KINDS),
    q8_0 where most are in REQUANTIZED's types, or None (a float file: it is served as
    float32). Reading a GGUF file's header parses its whole vocabulary (1-2 s for SmolLM2's):
    the answer is kept in `folder` (the file's converted checkpoint, keyed by the file) for the
    next start."""
    import json
    from collections import Counter

    kept = folder / "block_type.json" if folder is not None else None
    if kept is not None and kept.is_file():
        answer = json.loads(kept.read_text())
        if answer.get("rule") == KIND_RULE:
            return answer["type"]
    from gguf import GGUFReader

    counts = Counter(int(t.tensor_type) for t in GGUFReader(str(file)).tensors if len(t.shape) == 2)
    blocks = {kind: count for kind, count in counts.items() if kind in BLOCK_BYTES}
    requantized = sum(count for kind, count in counts.items() if kind in REQUANTIZED)
    if requantized > sum(blocks.values()):
        kind = "q8_0"
    else:
        kind = NAMES[max(blocks, key=blocks.get)] if blocks else None
    if kept is not None:
        with contextlib.suppress(OSError):
            kept.write_text(json.dumps({"type": kind, "rule": KIND_RULE}) + "\n")
    return kind


def rehome(weights: list[BlockWeight]) -> None:
    """Pack the blocks sixteen rows at a time (`BlockWeight.pack`) into one anonymous mapping backed
    by transparent huge pages, where the system offers them (Linux, THP `madvise` or `always`): a
    decode step reads every block once, and on 4 KB pages, in a VM, its page walks cost a third of
    a SmolLM2 step (docs/decisions.md, D-cpu-step). Elsewhere, or if the mapping fails, they are
    packed where they are."""
    import mmap

    if not weights:
        return
    region = None
    if hasattr(mmap, "MADV_HUGEPAGE"):
        size = sum(-(-w.packed_nbytes // 64) * 64 for w in weights)
        try:
            region = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
            region.madvise(mmap.MADV_HUGEPAGE)
        except (OSError, ValueError):
            region = None
    if region is None:
        for weight in weights:
            weight.pack()
        return
    arena = torch.frombuffer(region, dtype=torch.uint8)  # keeps the mapping alive
    offset = 0

    def into(tensor: torch.Tensor) -> torch.Tensor:
        nonlocal offset
        target = arena[offset : offset + tensor.numel()].view(tensor.shape)
        target.copy_(tensor)
        offset += -(-tensor.numel() // 64) * 64
        return target

    for weight in weights:
        if weight.packed is not None:  # restored packed, from a stored file's mapping
            weight.packed = into(weight.packed)
        elif weight.out_features % GROUP:
            weight.raw = into(weight.raw)
        else:
            weight.pack(into)
