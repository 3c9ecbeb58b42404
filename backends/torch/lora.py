"""LoRA adapters applied per sequence, unmerged, on PyTorch (backends.files.adapters loads them).

The batched step (torch_decoder) reads a few fused matrices a block (its `Block`): for Phi
[q; k; v; fc1] over LN(x) and [dense | fc2] over [attention, gelu(fc1)]; for the sequential
families [q; k; v], o, [gate; up] and down. Each adaptable module is a part of one of them
(`FusedMatrix`: the rows of the matrix's input it reads, the columns of its output it writes).
`FusedLoraSlots` lays each adapter in a decoder slot out the same way, and every row of a step
adds only its own slot's product:

    y += ((x @ A) * mask) @ B

with A = the slots' lora_a side by side ([in, slots * parts * rank], each at its input rows),
B = their lora_b (scale folded in) placed at the output columns of their module, and
mask[row, column] = 1 where the column belongs to the row's slot. Fixed shapes, no per-row
gathering: a CUDA graph captures it like the rest of the step, and rows for different adapters
and for the base model share it. Only the blocks some slot adapts carry buffers; a step with no
adapter rows skips it all.

`LoraHooks` serves the one-sequence decoder (any causal LM through transformers' forward):
forward hooks add the same product to the outputs of the adapted Linear layers.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from backends.files.adapters import Adapter, SlotTable, block_index


@dataclass(frozen=True)
class FusedMatrix:
    """One fused matrix of a block: its input and output widths, and its parts by module name
    (the name inside a layer, as mlx-lm's adapters call it) -> (in_start, in_end, out_start, out_end)."""

    in_features: int
    out_features: int
    parts: dict[str, tuple[int, int, int, int]]


class FusedLoraSlots:
    """The adapters a BatchedDecoder's sequences use, one per slot, as per-block buffers: for
    each fused matrix, A [in, S * parts * r] and B [S * parts * r, out] for S slots of rank
    capacity r."""

    def __init__(self, matrices: list[FusedMatrix], size: int, device: torch.device, dtype: torch.dtype):
        self.matrices = matrices
        self.table = SlotTable(size)
        self.device, self.dtype = device, dtype
        self.rank = 0
        self.blocks: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = {}
        self.held: list[Adapter | None] = [None] * size
        self.version = 0  # changes when the buffers are reallocated (CUDA graphs hold their addresses)
        self.columns = [torch.zeros(0, dtype=torch.long, device=device) for _ in matrices]
        self.where = {
            name: (m, p) for m, matrix in enumerate(matrices) for p, name in enumerate(matrix.parts)
        }  # module -> (matrix, part)

    @property
    def size(self) -> int:
        return self.table.size

    def active(self) -> bool:
        return self.table.active()

    def place(self, adapter: Adapter) -> int:
        """The slot a sequence using `adapter` reads; its weights are written there if new."""
        slot, fresh = self.table.acquire(adapter.key)
        if fresh:
            self.held[slot] = adapter
            if adapter.rank > self.rank or not adapter.blocks() <= set(self.blocks):
                self._allocate()
            else:
                self._write(slot)
        return slot

    def release(self, slot: int) -> None:
        self.table.release(slot)

    def masks(self, row_slots: torch.Tensor) -> list[torch.Tensor]:
        """Per matrix, per row: 1 on the columns of its own slot (rows of the base model: -1, none)."""
        return [(columns[None, :] == row_slots[:, None]).to(self.dtype) for columns in self.columns]

    def _allocate(self) -> None:
        held = [a for a in self.held if a is not None]
        self.rank = max(a.rank for a in held)
        r, s = self.rank, self.size
        blocks = set().union(*(a.blocks() for a in held))
        zeros = lambda *shape: torch.zeros(shape, dtype=self.dtype, device=self.device)  # noqa: E731
        self.blocks = {
            b: [
                (zeros(m.in_features, s * len(m.parts) * r), zeros(s * len(m.parts) * r, m.out_features))
                for m in self.matrices
            ]
            for b in sorted(blocks)
        }
        self.columns = [torch.arange(s, device=self.device).repeat_interleave(len(m.parts) * r) for m in self.matrices]
        self.version += 1
        for slot in range(s):
            if self.held[slot] is not None:
                self._write(slot)

    @torch.no_grad()
    def _write(self, slot: int) -> None:
        r = self.rank
        for pairs in self.blocks.values():  # the slot's old contents go
            for (a, b), matrix in zip(pairs, self.matrices, strict=False):
                width = len(matrix.parts) * r
                a[:, slot * width : (slot + 1) * width] = 0
                b[slot * width : (slot + 1) * width] = 0
        adapter = self.held[slot]
        for name, (lora_a, lora_b) in adapter.modules.items():
            pairs = self.blocks[block_index(name)]
            m, part = self.where[name.split(".", 3)[3]]  # model.layers.{i}.<module>
            a, b = pairs[m]
            in_start, in_end, out_start, out_end = self.matrices[m].parts[name.split(".", 3)[3]]
            first = slot * len(self.matrices[m].parts) * r + part * r
            rank = lora_a.shape[1]
            a[in_start:in_end, first : first + rank] = lora_a.to(self.device, torch.float32).to(self.dtype)
            b[first : first + rank, out_start:out_end] = (adapter.scale * lora_b.to(self.device, torch.float32)).to(
                self.dtype
            )


class LoraHooks:
    """One adapter at a time on a transformers model: forward hooks on its Linear layers add
    scale * (x @ lora_a) @ lora_b to their outputs."""

    def __init__(self, model):
        self._model = model
        self._handles = []

    def apply(self, adapter: Adapter | None) -> None:
        self.clear()
        if adapter is None:
            return
        for name, (lora_a, lora_b) in adapter.modules.items():
            module = self._model.get_submodule(name)
            weight = module.weight
            a = lora_a.to(weight.device, torch.float32)
            b = adapter.scale * lora_b.to(weight.device, torch.float32)
            self._handles.append(module.register_forward_hook(_adds(a, b)))

    def clear(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()


def _adds(a: torch.Tensor, b: torch.Tensor):
    def hook(module, inputs, output):
        x = inputs[0]
        return output + ((x.to(a.dtype) @ a) @ b).to(output.dtype)

    return hook


def torch_linears(model) -> dict[str, tuple[int, int]]:
    """(in, out) of each Linear inside the model's blocks, by module name."""
    return {
        name: (m.in_features, m.out_features)
        for name, m in model.named_modules()
        if isinstance(m, torch.nn.Linear) and block_index(name) is not None
    }
