"""Weight-only quantization for the Torch runtime (PHI2_QUANTIZE=int8|int4), on torch's own kernels.

Decode reads every weight once per token, so it runs at the speed weights stream from memory:
fewer bytes per weight is the speed-up, and the activations stay in the model's dtype.

- **int8**: symmetric, one scale per output channel. CPU: `aten._weight_int8pack_mm`. CUDA: the
  weight is dequantized inside the decode step, which torch.compile may fuse into the matrix
  product (as gpt-fast does); torch's CUDA int8pack kernel measured far slower (BENCHMARKS.md).
- **int4**: asymmetric, a scale and a zero per group of input channels (group size 128, or the
  largest of 128/64/32 dividing the input width). CPU: `aten._weight_int4pack_mm_for_cpu`; CUDA:
  `aten._weight_int4pack_mm` (tinygemm), both on tinygemm's layout: w = (q - 8) * scale + zero.

Only the big matrices are quantized (the Phi fast path's fused block weights, or every Linear
but the output head on other models); embeddings, norms, biases and the output head stay in the
model's dtype. The kernels were measured against each other on Phi-2's shapes (bench.py
--quant-kernels; BENCHMARKS.md).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from backends import ModelLoadError

METHODS = ("int8", "int4")
INT4_GROUP_SIZES = (128, 64, 32)


def parse_method(requested: str) -> str:
    """PHI2_QUANTIZE on Torch: int8 (CPU, CUDA), int4 (CPU, CUDA), or off."""
    if requested in ("", "none", "0"):
        return ""
    if requested not in METHODS:
        raise ModelLoadError(
            f"PHI2_QUANTIZE must be one of {', '.join(METHODS)} (or empty) on the Torch backend, not {requested!r}"
        )
    return requested


class QuantizedWeight:
    """A Linear weight (out_features x in_features) in fewer bits, and its matrix product."""

    bits: int
    group_size: int | None
    out_features: int
    in_features: int
    on_cuda: bool

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        y = self._product(x.reshape(-1, self.in_features))
        if bias is not None:
            y = y + bias
        return y.reshape(*x.shape[:-1], self.out_features)

    def _product(self, x: torch.Tensor) -> torch.Tensor:
        """x [rows, in_features] times the weight's transpose."""
        raise NotImplementedError

    @property
    def nbytes(self) -> int:
        raise NotImplementedError

    def state(self) -> dict:
        """Its tensors and sizes, as torch.load(weights_only=True) reads them back (quant_store)."""
        return {"bits": self.bits, **vars(self)}

    @staticmethod
    def from_state(state: dict) -> QuantizedWeight:
        state = dict(state)
        weight = object.__new__({8: Int8Weight, 4: Int4Weight}[state.pop("bits")])
        vars(weight).update(state)
        return weight


class Int8Weight(QuantizedWeight):
    bits, group_size = 8, None

    def __init__(self, weight: torch.Tensor):
        w = weight.detach().float()
        self.out_features, self.in_features = w.shape
        self.scales = (w.abs().amax(dim=1) / 127).clamp(min=1e-12)
        self.qweight = (w / self.scales[:, None]).round().clamp(-128, 127).to(torch.int8).contiguous()
        self.scales = self.scales.to(weight.dtype)
        self.on_cuda = weight.is_cuda

    def _product(self, x: torch.Tensor) -> torch.Tensor:
        # torch's int8pack kernel on the CPU; on CUDA it exists but measured 10x slower than
        # bfloat16 at batch 1 on an H200 (BENCHMARKS.md), so the weight is dequantized there.
        if self.on_cuda:
            return F.linear(x, self.qweight.to(x.dtype)) * self.scales
        return torch.ops.aten._weight_int8pack_mm(x, self.qweight, self.scales)

    @property
    def nbytes(self) -> int:
        return self.qweight.nbytes + self.scales.nbytes


class Int4Weight(QuantizedWeight):
    bits = 4
    INNER_K_TILES = 8

    def __init__(self, weight: torch.Tensor):
        w = weight.detach().float()
        self.out_features, self.in_features = n, k = w.shape
        self.group_size = next((g for g in INT4_GROUP_SIZES if k % g == 0), None)
        if self.group_size is None:
            raise ModelLoadError(
                f"PHI2_QUANTIZE=int4 needs input widths divisible by 32; this model has a Linear of width {k}"
            )
        groups = w.view(n, k // self.group_size, self.group_size)
        low, high = groups.amin(-1, keepdim=True), groups.amax(-1, keepdim=True)
        scale = ((high - low) / 15).clamp(min=1e-12)
        q = ((groups - low) / scale).round().clamp(0, 15).view(n, k).to(torch.int32)
        zero = low + 8 * scale  # tinygemm dequantizes (q - 8) * scale + zero
        scales_and_zeros = torch.stack([scale.view(n, -1), zero.view(n, -1)], dim=-1).transpose(0, 1)
        self.scales_and_zeros = scales_and_zeros.contiguous().to(weight.dtype)  # [k / group, n, 2]
        self.on_cuda = weight.is_cuda
        if self.on_cuda:
            packed = (q[:, ::2] << 4 | q[:, 1::2]).to(torch.uint8)  # two nibbles a byte
            self.packed = torch.ops.aten._convert_weight_to_int4pack(packed, self.INNER_K_TILES)
        else:
            self.packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, self.INNER_K_TILES)

    def _product(self, x: torch.Tensor) -> torch.Tensor:
        product = torch.ops.aten._weight_int4pack_mm if self.on_cuda else torch.ops.aten._weight_int4pack_mm_for_cpu
        return product(x, self.packed, self.group_size, self.scales_and_zeros)

    @property
    def nbytes(self) -> int:
        return self.packed.nbytes + self.scales_and_zeros.nbytes


def quantize_weight(weight: torch.Tensor, method: str) -> QuantizedWeight:
    return Int8Weight(weight) if method == "int8" else Int4Weight(weight)


def linear(x: torch.Tensor, weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear for a full-precision or a quantized weight."""
    if isinstance(weight, QuantizedWeight):
        return weight.linear(x, bias)
    if x.dim() == 2 and 1 < x.shape[0] <= SKINNY_ROWS and not x.is_cuda and _weight_first(x.shape[0], weight):
        y = (weight @ x.t()).t().contiguous()
        return y if bias is None else y + bias
    return F.linear(x, weight, bias)


# A decode step on the CPU multiplies a few rows (one a sequence) by each weight. For x @ W.T
# with 2-8 rows, MKL's sgemm ran 3-4x slower than one row on an AMD EPYC (AVX2), while W @ x.T,
# the same product, ran as fast as one row: the weights streamed once, as a step should
# (8192 x 2048 float32: 1 row 4.7 ms, 4 rows 20.7 ms as x @ W.T and 5.2 ms as W @ x.T). Which
# is faster depends on the CPU and the BLAS, so it is measured once per (rows, dtype) on the
# first such product, and that one is used from then on.
SKINNY_ROWS = 16
_WEIGHT_FIRST: dict[tuple[int, torch.dtype], bool] = {}


def _weight_first(rows: int, weight: torch.Tensor) -> bool:
    key = (rows, weight.dtype)
    if key not in _WEIGHT_FIRST:
        import time

        x = torch.randn(rows, weight.shape[1], dtype=weight.dtype)

        def best(fn) -> float:
            fn()
            times = []
            for _ in range(3):
                started = time.perf_counter()
                fn()
                times.append(time.perf_counter() - started)
            return min(times)

        _WEIGHT_FIRST[key] = best(lambda: weight @ x.t()) < 0.8 * best(lambda: F.linear(x, weight))
    return _WEIGHT_FIRST[key]


def describe(method: str, weights: list[QuantizedWeight]) -> dict:
    """/model/info's `quantization`."""
    group_sizes = sorted({w.group_size for w in weights if w.group_size})
    return {
        "method": f"torch-{method}-weight-only",
        "bits": 8 if method == "int8" else 4,
        "group_size": group_sizes[0] if len(group_sizes) == 1 else (group_sizes or None),
    }


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
