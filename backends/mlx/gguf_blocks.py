"""A GGUF matrix's blocks as MLX's affine quantization (weight, scales, biases; groups of 32 inputs).

MLX's affine format is w = scale * q + bias per group of inputs, q an unsigned integer of 2-8 bits
packed as one little-endian bit stream (mlx 0.32: groups of 32, 64 or 128, not 16). Most of
llama.cpp's types are that already, in groups of 32, so their numbers are kept exactly:

  Q4_0  w = d (q - 8)           4 bits: scale d, bias -8d
  Q4_1  w = d q + m             4 bits: d, m
  Q5_0  w = d (q - 16)          5 bits: d, -16d
  Q5_1  w = d q + m             5 bits: d, m
  Q8_0  w = d q, q signed       8 bits: d, -128d over q + 128
  Q4_K  w = d sc q - dmin m     4 bits: a super-block's 8 sub-blocks of 32 each a group,
  Q5_K  (the same, 5 bits)             scale d * sc, bias -dmin * m (products exact in float32)

Scales and biases are float32 (d is float16 and sc, m are 6-bit integers: their products are
exact), so MLX's dequantized values equal gguf's dequantization (tests/test_mlx_kquants.py).
Q6_K's scales are per 16 values (and Q2_K's, Q3_K's), which no MLX group holds: those matrices are
dequantized (gguf) and quantized again by `mx.quantize`, 8 bits in groups of 64, so their values
move by up to that grid's step (a group's range / 255; half of one but at a clipped edge):
measured on Qwen2.5-Coder's Q6_K matrices, an RMS change of 0.5% of the weights' RMS, against
Q6_K's own error of ~2% (6 bits in groups of 32 would add 1.9%, as much again). That, and
nothing else, is where the model's logits differ from the file's.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
from gguf import GGMLQuantizationType as T
from gguf import quants

GROUP_SIZE = 32
# The types held exactly, and their bits.
EXACT = {T.Q4_0: 4, T.Q4_1: 4, T.Q5_0: 5, T.Q5_1: 5, T.Q8_0: 8, T.Q4_K: 4, T.Q5_K: 5}
# The types re-quantized, with (bits, group size): 8 bits, since 6 in groups of 32 doubles Q6_K's
# own error; groups of 64 (9 bits a weight, not 10) add 0.53% where 32 add 0.47% (measured above).
REQUANTIZED = {T.Q6_K: (8, 64), T.Q2_K: (8, 64), T.Q3_K: (8, 64)}
CHUNK_VALUES = 1 << 22  # values decoded at a time: bounded memory for a 150k-row vocabulary


def layout(kind: int) -> tuple[int, int] | None:
    """(bits, group size) a `kind` matrix gets on MLX, or None for a type not quantized here."""
    kind = T(kind)
    return (EXACT[kind], GROUP_SIZE) if kind in EXACT else REQUANTIZED.get(kind)


def affine(data: np.ndarray, kind: int, shape: tuple[int, int]) -> tuple[mx.array, mx.array, mx.array]:
    """(weight, scales, biases) in `layout(kind)` for a matrix of `shape` ([rows, inputs]) stored as `kind`
    blocks in `data` (uint8, the rows' bytes), a chunk of rows at a time."""
    kind = T(kind)
    rows, inputs = shape
    if layout(kind) is None:
        raise ValueError(f"{kind.name} blocks are not quantized for MLX")
    if inputs % layout(kind)[1]:
        raise ValueError(f"a row of {inputs} values is not whole groups of {layout(kind)[1]}")
    data = data.reshape(rows, -1)
    step = max(1, CHUNK_VALUES // inputs)
    parts = [_chunk(np.asarray(data[start : start + step]), kind, inputs) for start in range(0, rows, step)]
    return tuple(mx.concatenate([part[i] for part in parts]) if len(parts) > 1 else parts[0][i] for i in range(3))


def _chunk(rows: np.ndarray, kind: T, inputs: int) -> tuple[mx.array, mx.array, mx.array]:
    if kind in EXACT:
        q, scales, biases = _DECODE[kind](rows.reshape(-1, rows.shape[1] // _blocks(kind, inputs)))
        n = rows.shape[0]
        weight = _pack(q.reshape(n, inputs), EXACT[kind])
        return mx.array(weight), mx.array(scales.reshape(n, -1)), mx.array(biases.reshape(n, -1))
    bits, group_size = REQUANTIZED[kind]
    values = quants.dequantize(rows, kind).reshape(rows.shape[0], inputs)
    weight, scales, biases = mx.quantize(mx.array(values), group_size=group_size, bits=bits)
    mx.eval(weight, scales, biases)  # the chunk's floats go now
    return weight, scales, biases


def _blocks(kind: T, inputs: int) -> int:
    size, _ = quants.GGML_QUANT_SIZES[kind]
    return inputs // size


def _pack(q: np.ndarray, bits: int) -> np.ndarray:
    """[rows, n] integers below 2**bits as MLX packs them: a little-endian bit stream in uint32s."""
    rows, n = q.shape
    values = q.astype(np.uint64).reshape(rows, n // 32, 32)
    out = np.zeros((rows, n // 32, bits), np.uint64)
    for i in range(32):
        word, shift = divmod(i * bits, 32)
        out[:, :, word] |= values[:, :, i] << np.uint64(shift)
        if shift + bits > 32:
            out[:, :, word + 1] |= values[:, :, i] >> np.uint64(32 - shift)
    return (out & np.uint64(0xFFFFFFFF)).astype(np.uint32).reshape(rows, -1)


def _half(raw: np.ndarray) -> np.ndarray:
    return raw.copy().view(np.float16).astype(np.float32)


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """Legacy blocks' 16 bytes -> their 32 values' low 4 bits (value j low nibble, j + 16 high)."""
    return np.concatenate([qs & 0xF, qs >> 4], axis=-1)


def _fifth_bits(qh: np.ndarray) -> np.ndarray:
    """Q5_0/Q5_1's 4 bytes of high bits -> [blocks, 32]: value j's bit is bit j of the uint32."""
    word = qh.copy().view(np.uint32)
    return ((word >> np.arange(32, dtype=np.uint32)) & 1).astype(np.uint8) << 4


def _q4_0(b):
    d = _half(b[:, :2])
    return _nibbles(b[:, 2:]), d, -8 * d


def _q4_1(b):
    return _nibbles(b[:, 4:]), _half(b[:, :2]), _half(b[:, 2:4])


def _q5_0(b):
    d = _half(b[:, :2])
    return _nibbles(b[:, 6:]) | _fifth_bits(b[:, 2:6]), d, -16 * d


def _q5_1(b):
    return _nibbles(b[:, 8:]) | _fifth_bits(b[:, 4:8]), _half(b[:, :2]), _half(b[:, 2:4])


def _q8_0(b):
    d = _half(b[:, :2])
    return (b[:, 2:].view(np.int8).astype(np.int16) + 128).astype(np.uint8), d, -128 * d


def _k_scales(scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """A K-quant super-block's 12 bytes -> its 8 six-bit scales and minimums (ggml's get_scale_min_k4)."""
    s = scales.astype(np.uint8)
    sc = np.concatenate([s[:, 0:4] & 63, (s[:, 8:12] & 0xF) | ((s[:, 0:4] >> 6) << 4)], axis=-1)
    m = np.concatenate([s[:, 4:8] & 63, (s[:, 8:12] >> 4) | ((s[:, 4:8] >> 6) << 4)], axis=-1)
    return sc.astype(np.float32), m.astype(np.float32)


def _k_low(qs: np.ndarray) -> np.ndarray:
    """Q4_K/Q5_K's 128 bytes -> [blocks, 8 sub-blocks, 32]: each 32 bytes hold two sub-blocks,
    the first in the low nibbles."""
    pairs = qs.reshape(-1, 4, 1, 32) >> np.array([0, 4], np.uint8).reshape(1, 1, 2, 1)
    return (pairs & 0xF).reshape(-1, 8, 32)


def _k_affine(b, q):
    d, dmin = _half(b[:, 0:2]), _half(b[:, 2:4])
    sc, m = _k_scales(b[:, 4:16])
    return q, d * sc, -(dmin * m)


def _q4_k(b):
    return _k_affine(b, _k_low(b[:, 16:144]))


def _q5_k(b):
    high = (b[:, 16:48].reshape(-1, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 8, 1)) & 1
    return _k_affine(b, _k_low(b[:, 48:176]) | (high << 4))


_DECODE = {T.Q4_0: _q4_0, T.Q4_1: _q4_1, T.Q5_0: _q5_0, T.Q5_1: _q5_1, T.Q8_0: _q8_0, T.Q4_K: _q4_k, T.Q5_K: _q5_k}
