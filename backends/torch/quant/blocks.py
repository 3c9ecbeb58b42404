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
import itertools

import numpy as np
import torch

from backends.contract import ModelLoadError
from backends.files import gguf_phi2
from backends.torch.quant.methods import QuantizedWeight

# GGUF / ggml type ids, and each block's bytes.
KINDS = {"q4_0": 2, "q4_1": 3, "q8_0": 8}  # what BlockWeight.quantize writes (PHI2_QUANTIZE)
# A GGUF file's types served as stored (backends/cpu_kquants.h): the K-quants and 5-bit blocks.
STORED_KINDS = {**KINDS, "q5_0": 6, "q5_1": 7, "q4_k": 12, "q5_k": 13, "q6_k": 14}
NAMES = {kind: name for name, kind in STORED_KINDS.items()}
BLOCK_BYTES = {2: 18, 3: 20, 8: 34, 6: 22, 7: 24, 12: 144, 13: 176, 14: 210}
BLOCK_VALUES = {kind: 256 if kind >= 12 else 32 for kind in BLOCK_BYTES}
# bytes of a sixteen-row record a block (torch/cpu/kernels.cpp, kquants.h): the 6-bit scales of
# Q4_K and Q5_K kept a byte each, Q4_0 with a minimum slot its blocks do not hold, Q6_K padded
# to whole 64-byte lines
RECORD_BYTES = {8: 544, 2: 320, 3: 320, 6: 352, 7: 384, 12: 2368, 13: 2880, 14: 3392}
BITS = {8: 8, 2: 4, 3: 4, 6: 5, 7: 5, 12: 4, 13: 5, 14: 6}
PACKED = 100  # a kind + PACKED: cpu_kernels.cpp's sixteen-row records
GROUP = 16  # rows a record interleaves
QK = 32


class BlockWeight(QuantizedWeight):
    """A matrix of llama.cpp blocks: `raw` uint8 [out_features, in_features / 32 * block bytes]."""

    group_size, on_cuda = QK, False

    def __init__(self, raw: torch.Tensor, kind: int, in_features: int):
        if in_features % BLOCK_VALUES[kind] or raw.shape[1] != in_features // BLOCK_VALUES[kind] * BLOCK_BYTES[kind]:
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
        kind = self.ggml_type
        return self.out_features // GROUP * self.in_features // BLOCK_VALUES[kind] * RECORD_BYTES[kind]

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
        return BITS[self.ggml_type]

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
    def stack_rows(parts: list[BlockWeight]) -> BlockWeight | StackedBlocks:
        """[a; b; ...]: one product for matrices over the same input (of one block type; else a
        product each, `StackedBlocks`)."""
        if len({p.ggml_type for p in parts}) > 1:  # each run of one type one matrix: [q; k] and v
            runs = [list(run) for _, run in itertools.groupby(parts, key=lambda p: p.ggml_type)]
            return StackedBlocks([BlockWeight.stack_rows(run) if len(run) > 1 else run[0] for run in runs])
        return BlockWeight(torch.cat([p.rows() for p in parts]), parts[0].ggml_type, parts[0].in_features)

    @staticmethod
    def join_columns(parts: list[BlockWeight]) -> BlockWeight:
        """[a | b | ...]: one product over inputs laid side by side."""
        _same_kind(parts)
        raw = torch.cat([p.rows() for p in parts], dim=1)
        return BlockWeight(raw, parts[0].ggml_type, sum(p.in_features for p in parts))


class StackedBlocks(QuantizedWeight):
    """Matrices over one input stacked by rows, in block types that differ (a Q4_K_M file's q
    and k in Q4_K, its v in Q6_K): a product each, their outputs side by side. The compiled
    step takes the parts as one Linear (cpu_step.h's `Linear::parts`)."""

    group_size, on_cuda = QK, False

    def __init__(self, parts: list[BlockWeight]):
        self.parts = [q for p in parts for q in (p.parts if isinstance(p, StackedBlocks) else [p])]
        self.in_features = self.parts[0].in_features
        self.out_features = sum(p.out_features for p in self.parts)

    def _product(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([p._product(x) for p in self.parts], dim=-1)

    def prompt_product(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([p.prompt_product(x) for p in self.parts], dim=-1)

    def dequantize(self) -> torch.Tensor:
        return torch.cat([p.dequantize() for p in self.parts])

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.parts)

    @property
    def bits(self) -> int:
        return min(p.bits for p in self.parts)

    @property
    def names(self) -> list[str]:
        return [p.name for p in self.parts]

    def state(self) -> dict:
        return {"kind": type(self).__name__, "parts": [p.state() for p in self.parts]}

    def _restore(self, state: dict) -> None:
        parts = []
        for part in state["parts"]:
            parts.append(object.__new__(BlockWeight))
            parts[-1]._restore({key: value for key, value in part.items() if key != "kind"})
        self.__init__(parts)


class RowLookup:
    """A token embedding kept in its file's block type (`embed[ids]`, as a float tensor is
    indexed): the rows asked for are dequantized, and no float copy of the vocabulary is made
    (Qwen2.5's 151,936 x 1,536 would be 0.93 GB in float32). `weight` may be the output head's
    own blocks (tied embeddings), packed for its products: a lookup reads the row's group."""

    dtype = torch.float32
    device = torch.device("cpu")

    def __init__(self, weight: BlockWeight):
        self.weight = weight

    def __getitem__(self, ids) -> torch.Tensor:
        from backends.torch.cpu.kernels import kernels

        ids = torch.as_tensor(ids)
        rows = kernels().embed(*self.weight.operand, self.weight.in_features, ids.reshape(-1))
        return rows.view(*ids.shape, self.weight.in_features)

    @property
    def shape(self) -> torch.Size:
        return torch.Size((self.weight.out_features, self.weight.in_features))

    def data_ptr(self) -> int:
        return self.weight.operand[0].data_ptr()


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
    from transformers.modeling_gguf_pytorch_utils import TENSOR_PROCESSORS, TensorProcessor

    reader = GGUFReader(str(file))
    config = model.config.to_dict()
    architecture = reader.get_field("general.architecture").contents()
    if architecture == gguf_phi2.ARCHITECTURE:
        return _phi2_matrices(reader, config)
    processor = TENSOR_PROCESSORS.get(architecture, TensorProcessor)(config=config)
    names = gguf_names(model, processor)
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


def gguf_names(model, processor) -> dict[str, str]:
    """GGUF tensor name -> the model's parameter name, as transformers' get_gguf_hf_weights_map
    maps them for a causal LM's own state dict. That function builds gguf's name map again for
    every submodule it recurses into (397 times for SmolLM2: a minute on 2 cores); the model's
    top-level names are all the decoder families have, so the map is built once here."""
    from gguf import MODEL_ARCH_NAMES, get_tensor_name_map

    config = model.config
    served = {"gemma3_text": "gemma3"}.get(config.model_type, config.model_type)  # as transformers' own map renames it
    arch = next(key for key, value in MODEL_ARCH_NAMES.items() if value == served)
    name_map = get_tensor_name_map(arch, config.num_hidden_layers)
    names = {}
    for hf_name in model.state_dict():
        hf_name = processor.preprocess_name(hf_name)
        stem, dot, suffix = hf_name.rpartition(".") if hf_name.endswith((".weight", ".bias")) else (hf_name, "", "")
        gguf_name = name_map.get_name(stem)
        if gguf_name is None:
            processor.perform_fallback_tensor_mapping(names, dot + suffix, "", hf_name)
        else:
            names[gguf_name + dot + suffix] = hf_name
    return names


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


# Quantized types these kernels do not multiply (Q2_K, Q3_K): a file mostly of them is served in
# Q8_0 blocks, each matrix quantized again from its dequantized values, as PHI2_QUANTIZE=q8_0
# quantizes a float checkpoint. Q4_K, Q5_K, Q6_K, Q5_0 and Q5_1 are served as stored (issue 67;
# before, they were re-coded into Q8_0 blocks too: docs/decisions.md, D-k-quants).
REQUANTIZED = {10, 11}
KIND_RULE = 3  # the rule of `file_kind`, kept with its answer: an answer by another is read again


def file_kind(file, folder=None) -> str | None:
    """The block type to serve the file in: the one most of its matrices are stored in (STORED_KINDS),
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
    from backends.files import gguf_tensors  # the header only (gguf's reader parses the whole vocabulary)

    counts = Counter(t.ggml_type for t in gguf_tensors.read(file).tensors if len(t.shape) == 2)
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


def rehome(weights: list) -> None:
    """Pack the blocks sixteen rows at a time (`BlockWeight.pack`) into one anonymous mapping backed
    by transparent huge pages, where the system offers them (Linux, THP `madvise` or `always`): a
    decode step reads every block once, and on 4 KB pages, in a VM, its page walks cost a third of
    a SmolLM2 step (docs/decisions.md, D-cpu-step). Elsewhere, or if the mapping fails, they are
    packed where they are."""
    import mmap

    flat = [part for w in weights for part in (w.parts if isinstance(w, StackedBlocks) else [w])]
    weights = list({id(w): w for w in flat if isinstance(w, BlockWeight)}.values())  # a tied head once
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
            mapped, weight.packed = weight.packed, into(weight.packed)
            _drop_pages(mapped)
        elif weight.out_features % GROUP:
            weight.raw = into(weight.raw)
        else:
            weight.pack(into)


def _drop_pages(mapped: torch.Tensor) -> None:
    """A stored file's mapped tensor, copied onto huge pages, out of this process's resident
    memory: the copy read every page, and the mapping stays while its other tensors (norms,
    biases) live, so the file's bytes would count twice. Its whole pages are dropped
    (MADV_DONTNEED: a private mapping nobody wrote reads the file again if touched)."""
    import ctypes
    import mmap

    start, end = mapped.data_ptr(), mapped.data_ptr() + mapped.nbytes
    first, last = -(-start // mmap.PAGESIZE) * mmap.PAGESIZE, end // mmap.PAGESIZE * mmap.PAGESIZE
    if last > first and hasattr(mmap, "MADV_DONTNEED"):
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL(None).madvise(ctypes.c_void_p(first), ctypes.c_size_t(last - first), mmap.MADV_DONTNEED)
