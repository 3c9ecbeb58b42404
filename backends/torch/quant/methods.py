"""Quantization for the Torch runtime (PHI2_QUANTIZE=int8|int4|w8a8), on torch's own kernels.

Decode reads every weight once per token, so it runs at the speed weights stream from memory:
fewer bytes per weight is the speed-up. int8 and int4 are weight-only (the activations stay in
the model's dtype); w8a8 quantizes the activations too, which pays most in prefill, where the
CPU is compute-bound.

- **int8**: symmetric, one scale per output channel. CPU: `aten._weight_int8pack_mm`. CUDA: the
  weight is dequantized inside the decode step, which torch.compile may fuse into the matrix
  product (as gpt-fast does); torch's CUDA int8pack kernel measured far slower (BENCHMARKS.md,
  D-int8-cuda).
- **int4**: asymmetric, a scale and a zero per group of input channels (group size 128, or the
  largest of 128/64/32 dividing the input width). CPU: `aten._weight_int4pack_mm_for_cpu`; CUDA:
  `aten._weight_int4pack_mm` (tinygemm), both on tinygemm's layout: w = (q - 8) * scale + zero.
- **w8a8** (the CPU): int8's weights, and activations quantized per row (`Int8DynamicWeight`).

Only the big matrices are quantized (the Phi fast path's fused block weights, or every Linear
but the output head on other models); embeddings, norms, biases and the output head stay in the
model's dtype. The kernels were measured against each other on Phi-2's shapes (bench.py
--quant-kernels; BENCHMARKS.md).
"""

from __future__ import annotations

import threading
import warnings

import torch
import torch.nn.functional as F

from backends.contract import ModelLoadError

METHODS = ("int8", "int4", "w8a8", "q8_0", "q4_0", "q4_1")
# llama.cpp's block types, on this server's own CPU kernels (backends/torch/quant/blocks.py).
BLOCK_METHODS = ("q8_0", "q4_0", "q4_1")
# and the types a GGUF file's blocks are served in as stored (its own, never PHI2_QUANTIZE's)
STORED_METHODS = (*BLOCK_METHODS, "q5_0", "q5_1", "q4_k", "q5_k", "q6_k")

INT4_GROUP_SIZES = (128, 64, 32)

# torch 2.13 deprecates quantized tensors, which fbgemm's linear takes (w8a8). Filtered once here,
# by its message, and not with catch_warnings per weight: that swaps the process's filters and
# is not safe in the threads that unpack stored weights (quant_store).
warnings.filterwarnings("ignore", message="torch.quantize_per_tensor, torch.quantize_per_channel", category=UserWarning)


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

    def prompt_product(self, x: torch.Tensor) -> torch.Tensor:
        """x [rows, in_features] times the weight's transpose as a long prompt's tokens take it:
        as any rows, unless a kind has a path of its own for them (ggml_blocks.BlockWeight)."""
        return self._product(x)

    @property
    def nbytes(self) -> int:
        raise NotImplementedError

    def state(self) -> dict:
        """Its tensors and sizes, as torch.load(weights_only=True) reads them back (quant_store)."""
        return {"kind": type(self).__name__, **vars(self)}

    kinds: dict[str, type] = {}

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        QuantizedWeight.kinds[cls.__name__] = cls

    def _restore(self, state: dict) -> None:
        vars(self).update(state)


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
        # torch's int8pack kernel on the CPU; on CUDA it is far slower than bfloat16, so the weight
        # is dequantized there (docs/decisions.md, D-int8-cuda).
        if self.on_cuda:
            return F.linear(x, self.qweight.to(x.dtype)) * self.scales
        if x.dtype == torch.float32:
            # int8pack's float32 kernel is slower than float32 weights, its bfloat16 one far faster:
            # a float32 model multiplies in bfloat16 too (docs/decisions.md, D-int8-bf16-act).
            y = torch.ops.aten._weight_int8pack_mm(x.to(torch.bfloat16), self.qweight, self.scales.to(torch.bfloat16))
            return y.float()
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
        if weight.is_cuda and k % (self.INNER_K_TILES * 16):  # tinygemm's CUDA tiles: else a RuntimeError
            raise ModelLoadError(
                f"PHI2_QUANTIZE=int4 on CUDA needs input widths divisible by {self.INNER_K_TILES * 16}; this model "
                f"has a Linear of width {k} (int8 has no such rule)"
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


class Int8DynamicWeight(QuantizedWeight):
    """w8a8, the CPU only: int8 weights (a scale per output channel) and int8 activations, as
    llama.cpp's Q8_0 dot products do. fbgemm's dynamic int8 linear quantizes its input on the
    fly, multiplies in integers (AVX2 `vpmaddubsw`, VNNI where present) and scales back to
    float32. `reduce_range` keeps the activations to 7 bits, so that AVX2's 16-bit pairwise
    sums cannot saturate. Measured against weight-only int8 and float32 (docs/decisions.md, D-w8a8);
    it needs no bfloat16 (the activations are float32 whatever the model's dtype).

    fbgemm takes one range for all the rows of a call (a decode step's sequences, a prefill
    piece), so one row with large values coarsened every other row's grid, and a sequence's
    output depended on its neighbours. Each row gets its own range instead: it is mapped onto
    [0, 1] before the call, (x - low) / span, and its output mapped back, span * y + low *
    (the weight's row sums), as the product is linear. One more row holding 1 and 0 pins the
    call's range to [0, 1] whatever the other rows hold. A row is then quantized alike alone
    or in any batch, so batched equals alone exactly, and its 128 levels span its own values
    (as fine as fbgemm's grid for a row alone; a symmetric [-max, max] grid lost a bit on the
    one-sided rows that follow a GELU)."""

    bits, group_size, on_cuda = 8, None, False

    def __init__(self, weight: torch.Tensor):
        if weight.is_cuda:
            raise ModelLoadError("PHI2_QUANTIZE=w8a8 is for the CPU (fbgemm); use int8 or int4 on CUDA")
        w = weight.detach().float()
        self.out_features, self.in_features = w.shape
        scales = (w.abs().amax(dim=1) / 127).clamp(min=1e-12)
        qweight = (w / scales[:, None]).round().clamp(-128, 127).to(torch.int8)
        self._restore({"qweight": qweight, "scales": scales, "out_features": w.shape[0], "in_features": w.shape[1]})

    def _restore(self, state: dict) -> None:
        self.out_features, self.in_features = state["out_features"], state["in_features"]
        zeros = torch.zeros(self.out_features, dtype=torch.long)
        q = torch._make_per_channel_quantized_tensor(state["qweight"], state["scales"].double(), zeros, 0)
        self.packed = torch.ops.quantized.linear_prepack(q, None)
        self._range_row = torch.zeros(1, self.in_features)
        self._range_row[0, 0] = 1.0
        # The weight's row sums, from its packed form: a row of ones quantizes exactly (to 127 at a
        # scale of 1/127), so this product is the sum; summing the mapped file was slow
        # (docs/decisions.md, D-row-sums).
        self._row_sums = torch.ops.quantized.linear_dynamic(torch.ones(1, self.in_features), self.packed, True)[0]

    def state(self) -> dict:
        qweight, _ = torch.ops.quantized.linear_unpack(self.packed)
        return {
            "kind": type(self).__name__,
            "qweight": qweight.int_repr(),
            "scales": qweight.q_per_channel_scales().float(),
            "out_features": self.out_features,
            "in_features": self.in_features,
        }

    def _product(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.float()
        low = rows.amin(dim=1, keepdim=True)
        span = (rows.amax(dim=1, keepdim=True) - low).clamp(min=torch.finfo(torch.float32).tiny)
        pinned = torch.cat([(rows - low) / span, self._range_row])
        y = torch.ops.quantized.linear_dynamic(pinned, self.packed, True)[:-1] * span + low * self._row_sums
        return y.to(x.dtype)

    @property
    def nbytes(self) -> int:
        return self.out_features * self.in_features + 4 * self.out_features


def linear(x: torch.Tensor, weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear for a full-precision or a quantized weight."""
    if isinstance(weight, QuantizedWeight):
        return weight.linear(x, bias)
    if x.dim() == 2 and 1 < x.shape[0] <= SKINNY_ROWS and not x.is_cuda and _weight_first(x.shape[0], weight):
        y = (weight @ x.t()).t().contiguous()
        return y if bias is None else y + bias
    if x.dtype == torch.bfloat16 and x.numel() == x.shape[-1] and not x.is_cuda and _gemv_without_onednn(weight):
        return _without_onednn(F.linear, x, weight, bias)
    return F.linear(x, weight, bias)


# One row in bfloat16 (a decode step alone) on the CPU: ATen's own GEMV (oneDNN off) can stream
# faster than oneDNN's, which wins from 4 rows (docs/decisions.md, D-onednn-gemv). Which is faster for
# one row depends on the CPU, so it is measured once per dtype on the first such product. The
# switch is torch's process-wide oneDNN flag, held off only around the product (under a lock):
# while serving, the worker thread is the only one that multiplies.
_GEMV_WITHOUT_ONEDNN: dict[torch.dtype, bool] = {}
_ONEDNN_SWITCH = threading.Lock()


def _without_onednn(fn, *args):
    with _ONEDNN_SWITCH:
        enabled = torch._C._get_mkldnn_enabled()
        torch._C._set_mkldnn_enabled(False)
        try:
            return fn(*args)
        finally:
            torch._C._set_mkldnn_enabled(enabled)


def _gemv_without_onednn(weight: torch.Tensor) -> bool:
    if weight.dtype not in _GEMV_WITHOUT_ONEDNN:
        x = torch.randn(1, weight.shape[1], dtype=weight.dtype)
        onednn = best_time(lambda: F.linear(x, weight))
        _GEMV_WITHOUT_ONEDNN[weight.dtype] = best_time(lambda: _without_onednn(F.linear, x, weight)) < 0.8 * onednn
    return _GEMV_WITHOUT_ONEDNN[weight.dtype]


def best_time(fn, repeats: int = 3) -> float:
    """Seconds: the fastest of `repeats` calls of `fn`, after one to warm up."""
    import time

    fn()
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return min(times)


# A decode step on the CPU multiplies a few rows (one a sequence) by each weight; with some BLAS
# x @ W.T is far slower for 2-8 rows than W @ x.T, the same product (docs/decisions.md, D-skinny-rows).
# Which is faster depends on the CPU and the BLAS, so it is measured once per (rows, dtype) on the
# first such product, and that one is used from then on.
SKINNY_ROWS = 16
_WEIGHT_FIRST: dict[tuple[int, torch.dtype], bool] = {}


def _weight_first(rows: int, weight: torch.Tensor) -> bool:
    key = (rows, weight.dtype)
    if key not in _WEIGHT_FIRST:
        x = torch.randn(rows, weight.shape[1], dtype=weight.dtype)
        _WEIGHT_FIRST[key] = best_time(lambda: weight @ x.t()) < 0.8 * best_time(lambda: F.linear(x, weight))
    return _WEIGHT_FIRST[key]


def describe(method: str, weights: list[QuantizedWeight]) -> dict:
    """/model/info's `quantization`."""
    group_sizes = sorted({w.group_size for w in weights if w.group_size})
    if method in STORED_METHODS or method == "gguf":
        kinds = sorted({name for w in weights for name in getattr(w, "names", [getattr(w, "name", None)]) if name})
        return {"method": "ggml-blocks", "types": kinds, "bits": min(w.bits for w in weights), "group_size": 32}
    return {
        "method": "torch-w8a8-fbgemm" if method == "w8a8" else f"torch-{method}-weight-only",
        "bits": 4 if method == "int4" else 8,
        "group_size": group_sizes[0] if len(group_sizes) == 1 else (group_sizes or None),
    }
