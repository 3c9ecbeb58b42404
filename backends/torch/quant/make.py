"""Quantizing a model's matrices by PHI2_QUANTIZE's method, and restoring a stored one: the one
place that knows every kind (torch's own in methods.py, llama.cpp's blocks in blocks.py)."""

from __future__ import annotations

import torch

from backends.torch.quant.blocks import KINDS, BlockWeight
from backends.torch.quant.methods import STORED_METHODS, Int4Weight, Int8DynamicWeight, Int8Weight, QuantizedWeight


def quantize_weight(weight: torch.Tensor, method: str) -> QuantizedWeight:
    if method in STORED_METHODS:  # a file's K-quant or 5-bit kind: a matrix it holds in no such type in Q8_0
        return BlockWeight.quantize(weight, method if method in KINDS else "q8_0")
    return {"int8": Int8Weight, "int4": Int4Weight, "w8a8": Int8DynamicWeight}[method](weight)


def from_state(state: dict) -> QuantizedWeight:
    """A weight from its `state()`, as torch.load(weights_only=True) reads it back (quant_store)."""
    state = dict(state)
    weight = object.__new__(QuantizedWeight.kinds[state.pop("kind")])  # blocks.py's kind registered by the import above
    weight._restore(state)
    return weight


class QuantizedLinear(torch.nn.Module):
    """A Linear whose weight is quantized, for the generic (non-Phi) decoder."""

    def __init__(self, linear_module: torch.nn.Linear, method: str):
        super().__init__()
        self.weight_q = quantize_weight(linear_module.weight, method)
        self.bias = linear_module.bias
        self.in_features, self.out_features = linear_module.in_features, linear_module.out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.weight_q.linear(x, self.bias)


def quantize_linears(model, method: str) -> list[QuantizedWeight]:
    """Replace every Linear but the output head with a QuantizedLinear, in place."""
    head = model.get_output_embeddings()
    replaced = []
    for name, module in list(model.named_modules()):
        if isinstance(module, torch.nn.Linear) and module is not head:
            parent_name, _, child = name.rpartition(".")
            quantized = QuantizedLinear(module, method)
            setattr(model.get_submodule(parent_name) if parent_name else model, child, quantized)
            replaced.append(quantized.weight_q)
    return replaced
