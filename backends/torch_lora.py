"""LoRA adapters applied per sequence, unmerged, on PyTorch (backends.adapters loads them).

The batched Phi step (torch_fast) reads two fused matrices a block: [q; k; v; fc1] over LN(x),
and [dense | fc2] over [attention, gelu(fc1)]. `FusedLoraSlots` lays each adapter in a decoder
slot out the same way, and every row of a step adds only its own slot's product:

    y += ((h @ A) * mask) @ B

with A = the slots' lora_a side by side ([in, slots * parts * rank]), B = their lora_b (scale
folded in) placed at the output columns of their module, and mask[row, column] = 1 where the
column belongs to the row's slot. Fixed shapes, no per-row gathering: a CUDA graph captures it
like the rest of the step, and rows for different adapters and for the base model share it.
Only the blocks some slot adapts carry buffers; a step with no adapter rows skips it all.

`LoraHooks` serves the one-sequence decoder (any causal LM through transformers' forward):
forward hooks add the same product to the outputs of the adapted Linear layers.
"""

from __future__ import annotations

import torch

from backends.adapters import Adapter, SlotTable, block_index

# Each adapted module's part of the fused block matrices (Phi's blocks have no other Linears,
# and adapters.check_modules lets through only modules the model has).
FUSED_IN = {"self_attn.q_proj": 0, "self_attn.k_proj": 1, "self_attn.v_proj": 2, "mlp.fc1": 3}
FUSED_OUT = {"self_attn.dense": 0, "mlp.fc2": 1}


class FusedLoraSlots:
    """The adapters a BatchedPhiDecoder's sequences use, one per slot, as per-block buffers:
    (a_in [hidden, S*4*r], b_in [S*4*r, 3*hidden + inner], a_out [hidden + inner, S*2*r],
    b_out [S*2*r, hidden]) for S slots of rank capacity r."""

    def __init__(self, hidden: int, inner: int, size: int, device: torch.device, dtype: torch.dtype):
        self.hidden, self.inner = hidden, inner
        self.table = SlotTable(size)
        self.device, self.dtype = device, dtype
        self.rank = 0
        self.blocks: dict[int, tuple[torch.Tensor, ...]] = {}
        self.held: list[Adapter | None] = [None] * size
        self.version = 0  # changes when the buffers are reallocated (CUDA graphs hold their addresses)
        self.cols_in = self.cols_out = torch.zeros(0, dtype=torch.long, device=device)

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

    def masks(self, row_slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Per row, 1 on the columns of its own slot (rows of the base model: -1, none)."""
        mask_in = (self.cols_in[None, :] == row_slots[:, None]).to(self.dtype)
        mask_out = (self.cols_out[None, :] == row_slots[:, None]).to(self.dtype)
        return mask_in, mask_out

    def _allocate(self) -> None:
        held = [a for a in self.held if a is not None]
        self.rank = max(a.rank for a in held)
        r, s, h, i = self.rank, self.size, self.hidden, self.inner
        blocks = set().union(*(a.blocks() for a in held))
        zeros = lambda *shape: torch.zeros(shape, dtype=self.dtype, device=self.device)  # noqa: E731
        self.blocks = {b: (zeros(h, s * 4 * r), zeros(s * 4 * r, 3 * h + i), zeros(h + i, s * 2 * r), zeros(s * 2 * r, h)) for b in sorted(blocks)}
        self.cols_in = torch.arange(s, device=self.device).repeat_interleave(4 * r)
        self.cols_out = torch.arange(s, device=self.device).repeat_interleave(2 * r)
        self.version += 1
        for slot in range(s):
            if self.held[slot] is not None:
                self._write(slot)

    @torch.no_grad()
    def _write(self, slot: int) -> None:
        r, h, i = self.rank, self.hidden, self.inner
        cols_in, cols_out = slice(slot * 4 * r, (slot + 1) * 4 * r), slice(slot * 2 * r, (slot + 1) * 2 * r)
        for a_in, b_in, a_out, b_out in self.blocks.values():  # the slot's old contents go
            a_in[:, cols_in] = 0
            b_in[cols_in] = 0
            a_out[:, cols_out] = 0
            b_out[cols_out] = 0
        adapter = self.held[slot]
        in_spans = [(0, h), (h, 2 * h), (2 * h, 3 * h), (3 * h, 3 * h + i)]  # q, k, v, fc1 columns of [q; k; v; fc1]
        out_spans = [(0, h), (h, h + i)]  # dense, fc2 rows of [dense | fc2] (their inputs)
        for name, (lora_a, lora_b) in adapter.modules.items():
            a_in, b_in, a_out, b_out = self.blocks[block_index(name)]
            module = name.split(".", 3)[3]  # model.layers.{i}.<module>
            a = lora_a.to(self.device, torch.float32)
            b = (adapter.scale * lora_b.to(self.device, torch.float32)).to(self.dtype)
            rank = a.shape[1]
            if module in FUSED_IN:
                part = FUSED_IN[module]
                first = slot * 4 * r + part * r
                start, end = in_spans[part]
                a_in[:, first : first + rank] = a.to(self.dtype)
                b_in[first : first + rank, start:end] = b
            else:
                part = FUSED_OUT[module]
                first = slot * 2 * r + part * r
                start, end = out_spans[part]
                a_out[start:end, first : first + rank] = a.to(self.dtype)
                b_out[first : first + rank] = b


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
