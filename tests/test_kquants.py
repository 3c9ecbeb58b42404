"""llama.cpp's K-quants (Q4_K, Q5_K, Q6_K) and 5-bit blocks (Q5_0, Q5_1) as stored, on the CPU's own
kernels (backends/torch/cpu/kquants.h): dequantized as gguf-py dequantizes them, multiplied as the
dequantized weights times int8 activation blocks, on the native build and the AVX2 one.

The blocks are written by the format's layout (`blocks`): any bytes are a valid block once its
float16 scales are finite, so random bytes with chosen scales cover every value and scale."""

from __future__ import annotations

import platform

import numpy as np
import pytest
import torch

from backends.torch.cpu.kernels import kernels, variant

gguf = pytest.importorskip("gguf")
from gguf import GGML_QUANT_SIZES  # noqa: E402
from gguf import GGMLQuantizationType as T  # noqa: E402
from gguf.quants import dequantize, quantize  # noqa: E402

TYPES = [T.Q5_0, T.Q5_1, T.Q4_K, T.Q5_K, T.Q6_K]
PACKED = 100  # cpu_kernels.cpp: a kind + 100 is its sixteen-row records


def blocks(kind, out: int, width: int, seed: int = 0) -> np.ndarray:
    """[out, bytes] of `kind` blocks: random values and integer scales, float16 scales in range."""
    rng = np.random.default_rng(seed)
    size, nbytes = GGML_QUANT_SIZES[kind]
    raw = rng.integers(0, 256, (out, width // size, nbytes), dtype=np.uint8)

    def halves(low, high):
        return rng.uniform(low, high, raw.shape[:2]).astype(np.float16).view(np.uint8).reshape(*raw.shape[:2], 2)

    if kind in (T.Q4_K, T.Q5_K):
        raw[..., 0:2], raw[..., 2:4] = halves(0.001, 0.01), halves(0.001, 0.01)  # d, dmin
    elif kind == T.Q6_K:
        raw[..., 208:210] = halves(0.001, 0.01)
    elif kind == T.Q5_0:
        raw[..., 0:2] = halves(-0.1, 0.1)
    else:
        raw[..., 0:2], raw[..., 2:4] = halves(0.001, 0.01), halves(-0.1, 0.1)
    raw[1] = 0  # an all-zero row: zero weights
    return raw.reshape(out, -1)


@pytest.fixture(scope="module", params=["native", "x86-64-v3"])
def built(request):
    if request.param == "native":
        return kernels()
    if platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip("x86 targets")
    return variant(request.param)


@pytest.mark.parametrize("kind", TYPES, ids=lambda k: k.name)
def test_blocks_dequantize_as_gguf_does_and_pack_both_ways(built, kind):
    raw = blocks(kind, 48, 512)
    ours = built.dequantize(torch.from_numpy(raw), int(kind), 512)
    assert torch.equal(ours, torch.from_numpy(dequantize(raw, kind)))
    packed = built.pack(torch.from_numpy(raw), int(kind), 512)
    assert packed.shape[0] == 3
    assert torch.equal(built.unpack(packed, int(kind), 512), torch.from_numpy(raw))
    ids = torch.tensor([[0, 17], [47, 1]])
    expected = torch.from_numpy(dequantize(raw, kind))[ids.reshape(-1)]
    assert torch.equal(built.embed(packed, int(kind) + PACKED, 512, ids.reshape(-1)), expected)
    assert torch.equal(built.embed(torch.from_numpy(raw), int(kind), 512, ids.reshape(-1)), expected)


@pytest.mark.parametrize("rows", [1, 3, 4, 9])
@pytest.mark.parametrize("kind", TYPES, ids=lambda k: k.name)
def test_a_product_is_the_dequantized_blocks_times_int8_activations(built, kind, rows):
    """x's rows quantized to Q8_0 blocks (as llama.cpp's dot products take them) times the
    dequantized weight, in float64: what the kernel computes, up to float32 sums. 40 rows: a
    matrix that is not whole groups of 16 (the last padded); 4 rows and more: a group's records
    unpacked once for 4 rows."""
    for out, width in ((48, 512), (40, 768)):
        raw = torch.from_numpy(blocks(kind, out, width, seed=rows))
        x = torch.randn(rows, width, generator=torch.Generator().manual_seed(rows))
        x[0, :32] = 0.0  # an all-zero activation block
        x_q8 = dequantize(quantize(x.numpy(), T.Q8_0), T.Q8_0)
        weight = torch.from_numpy(dequantize(raw.numpy(), kind))
        expected = torch.from_numpy(x_q8).double() @ weight.double().t()
        got = built.mm(x, raw, int(kind), width)
        assert got.shape == (rows, out)
        assert float((got.double() - expected).norm() / expected.norm()) < 2e-3
        assert torch.equal(built.mm(x[-1:], raw, int(kind), width), got[-1:])  # alone as in company
        if out % 16 == 0:
            packed = built.pack(raw, int(kind), width)
            assert torch.equal(built.mm(x, packed, int(kind) + PACKED, width), got)


@pytest.mark.parametrize("kind", TYPES, ids=lambda k: k.name)
def test_every_simd_path_computes_the_same_products(kind):
    """The AVX2 build and the plain C++ one give the native build's products up to float32 sums."""
    if platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip("x86 targets")
    raw = torch.from_numpy(blocks(kind, 32, 512))
    x = torch.randn(6, 512, generator=torch.Generator().manual_seed(7))
    native = kernels().mm(x, raw, int(kind), 512)
    for march in ("x86-64-v3", "x86-64"):
        other = variant(march).mm(x, raw, int(kind), 512)
        assert float((other - native).abs().max()) <= 1e-4 * float(native.abs().max()), march
