"""A quantization option measured against the float default at start-up, on the CPU it runs on.

Which is faster depends on the CPU: on an AVX2-only EPYC torch's int4 decoded 3x slower than
float32 (issue 54); on a Xeon with AMX, bfloat16's prompt products (oneDNN's tiles) beat torch's
weight-only options' (the block types' prompt rows take AMX-BF16 tiles of their own there). So
when PHI2_QUANTIZE names a method on the CPU, the products of the first few quantized matrices (a
block's) are timed at one row (a decode step) and at PROMPT_ROWS rows (a prompt piece, as a long
prompt's tokens take them), against float matrices of the same shapes in the dtype `auto` picks:

- slower at one row than the float default: refused at start-up (quantizing would only make
  decoding slower), naming the faster choice with both times;
- slower over a prompt only: served (decoding is faster, and the weights smaller), with a
  warning in the log; /model/info's `quantization.measured` holds both figures either way.

Below CPU_BF16_MIN_PARAMETERS the weights sit in the caches and the times are noise: not measured;
nor where LoadOptions.speed_check is off (bench.py --perplexity loads every method for its quality).
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F

from backends.contract import ModelLoadError
from backends.torch.quant.methods import best_time

log = logging.getLogger("phi2_server.torch")

PROMPT_ROWS = 64
MATRICES = 4  # the first quantized matrices: one block's
SLOWER = 1.1  # a margin for timing noise: refused only when clearly slower


def _best_ms(fn) -> float:
    return best_time(fn) * 1e3


def measure(weights, activation_dtype: torch.dtype, float_dtype: torch.dtype, timer=None) -> dict:
    """Milliseconds for the first MATRICES quantized products and for float ones of the same
    shapes, at 1 and PROMPT_ROWS rows: {"1": {"quantized": ms, "float": ms}, "64": ...}."""
    timer = timer or _best_ms
    chosen = weights[:MATRICES]
    floats = [torch.full((w.out_features, w.in_features), 0.01, dtype=float_dtype) for w in chosen]
    figures = {}
    with torch.inference_mode():
        for rows in (1, PROMPT_ROWS):
            xs = [torch.randn(rows, w.in_features) for w in chosen]
            quantized = [x.to(activation_dtype) for x in xs]
            plain = [x.to(float_dtype) for x in xs]
            products = [w.prompt_product if rows > 1 else w.linear for w in chosen]
            figures[str(rows)] = {
                "quantized": round(timer(lambda q=quantized, p=products: [f(x) for f, x in zip(p, q, strict=True)]), 3),
                "float": round(timer(lambda p=plain: [F.linear(x, f) for f, x in zip(floats, p, strict=True)]), 3),
            }
    return figures


def check(method: str, weights, activation_dtype: torch.dtype, float_dtype: torch.dtype, timer=None) -> dict:
    """`measure`, then refuse (ModelLoadError) where decoding would be slower; see the module."""
    figures = measure(weights, activation_dtype, float_dtype, timer)
    name = str(float_dtype).removeprefix("torch.")
    decode, prompt = figures["1"], figures[str(PROMPT_ROWS)]
    if decode["quantized"] > SLOWER * decode["float"]:
        better = "q8_0 or q4_0 (llama.cpp's blocks, the compiled CPU kernels)" if method not in ("q8_0", "q4_0") else ""
        raise ModelLoadError(
            f"PHI2_QUANTIZE={method} is slower than {name} on this CPU: a block's products at one row (a decode "
            f"step) took {decode['quantized']:.2f} ms against {decode['float']:.2f} ms, so quantizing would only "
            f"make decoding slower. Leave PHI2_QUANTIZE unset ({name})" + (f", or try {better}" if better else "")
        )
    if prompt["quantized"] > SLOWER * prompt["float"]:
        log.warning(
            "PHI2_QUANTIZE=%s: faster than %s at one row (%.2f against %.2f ms) but slower over a %d-row prompt "
            "piece (%.2f against %.2f ms) on this CPU: prompts will take longer than unquantized",
            method,
            name,
            decode["quantized"],
            decode["float"],
            PROMPT_ROWS,
            prompt["quantized"],
            prompt["float"],
        )
    return {"against": name, "ms": figures}
