"""The compiled decode step (backends/torch/cpu/step.h, built with the products in kernels.cpp)
over a model's weights: `decode_step` hands it the weights' matrices, block records or float32."""

from __future__ import annotations

import logging

import torch

from backends.errors import ModelLoadError
from backends.files.architecture import GELU_TANH
from backends.torch.cpu.kernels import kernels
from backends.torch.quant.blocks import BlockWeight, StackedBlocks

log = logging.getLogger("phi2.cpu_kernels")


def decode_step(weights, kv, tables: dict):
    """The compiled decode step (cpu_kernels.cpp's `Step`) over these weights and this paged
    pool, or None where it does not apply: not the CPU, not float32, a matrix neither float32
    nor of a block type, or no kernels. `tables`: the rotary tables by kind (the Network's),
    each block told the index of its layer's in `rotary_stack(tables)` (-1: none)."""
    if weights.device.type != "cpu" or weights.embed.dtype != torch.float32 or kv.dtype != torch.float32:
        return None
    matrices = [getattr(block, name) for block in weights.layers for name in block.matrices()]
    blocks = (BlockWeight, StackedBlocks)
    plain = (isinstance(m, blocks) or (isinstance(m, torch.Tensor) and m.dtype == torch.float32) for m in matrices)
    if not all(plain):
        return None
    try:
        module = kernels()
    except ModelLoadError as exc:
        log.info("the decode step runs on torch's operators: %s", exc)
        return None
    arch, shape = weights.arch, weights.shape
    activation = 1 if arch.activation in GELU_TANH else 2 if arch.activation == "gelu" else 0
    step = module.Step(
        shape.hidden,
        shape.heads,
        shape.kv_heads,
        shape.head_dim,
        shape.rotary_dim,
        shape.inner,
        float(shape.eps),
        shape.rms_norm,
        shape.parallel,
        shape.gated,
        activation,
    )

    def matrix(m):
        if isinstance(m, StackedBlocks):  # its first part here, all of them by set_parts below
            return m.parts[0].operand
        return m.operand if isinstance(m, BlockWeight) else (m.detach(), -1)

    kinds = sorted(tables)
    for layer, block in enumerate(weights.layers):
        kind = arch.rope_kinds[layer]
        up = matrix(block.w_up) if block.w_up is not None else (None, -1)
        down = matrix(block.w_down) if block.w_down is not None else (None, -1)
        step.add_block(
            block.norm1_w.detach(),
            _plain(block.norm1_b),
            *matrix(block.w_in),
            _plain(block.b_in),
            *matrix(block.w_out),
            _plain(block.b_out),
            _plain(block.norm2_w),
            _plain(block.norm2_b),
            *up,
            _plain(block.b_up),
            *down,
            _plain(block.b_down),
            _plain(block.q_norm),
            _plain(block.k_norm),
            arch.windows[layer] or 0,
            -1 if kind is None else kinds.index(kind),
            _plain(block.attention_out_norm),
            _plain(block.mlp_out_norm),
        )
        for which, name in enumerate(("w_in", "w_out", "w_up", "w_down")):
            if isinstance(m := getattr(block, name), StackedBlocks):
                step.set_parts(layer, which, *map(list, zip(*(part.operand for part in m.parts), strict=True)))
    return step


def rotary_stack(tables: dict):
    """The rotary tables as the step takes them: cos and sin [kinds, positions, rotary_dim], the
    kinds in sorted order (one kind: views, no copy)."""
    kinds = sorted(tables)
    if len(kinds) == 1:
        cos, sin = tables[kinds[0]]
        return cos[None], sin[None]
    return torch.stack([tables[k][0] for k in kinds]), torch.stack([tables[k][1] for k in kinds])


def _plain(tensor):
    return None if tensor is None else tensor.detach().float().contiguous()
