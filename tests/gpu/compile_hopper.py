"""Compile the paged prefill attention kernel (backends/triton_decode.py) for an H200 (sm_90)
on a machine without a GPU: Triton's front end checks what its interpreter does not (a variable
whose type differs between branches, for one), and the back end builds the PTX.

    python3 -m pip install --target /tmp/triton-interp triton==3.6.0 "numpy<2.3"
    PYTHONPATH=/tmp/triton-interp .venv/bin/python tests/gpu/compile_hopper.py

Not part of `make test`: Triton is no dependency of the CPU install.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from backends import triton_decode  # noqa: E402

ARGUMENTS = {
    "q_ptr": "*{t}",
    "stride_q_row": "i32",
    "stride_q_token": "i32",
    "out_ptr": "*{t}",
    "stride_o_row": "i32",
    "stride_o_token": "i32",
    "k_ptr": "*{t}",
    "v_ptr": "*{t}",
    "stride_head": "i64",
    "stride_page": "i32",
    "table_ptr": "*i64",
    "stride_table": "i32",
    "slots_ptr": "*i64",
    "starts_ptr": "*i64",
    "lens_ptr": "*i64",
    "length": "i32",
    "scale": "fp32",
    "window": "i32",
}
# (the element type, the constants): Phi-2's heads in bfloat16, Llama's grouped ones in float32.
SHAPES = [
    ("bf16", dict(GROUP=1, HEAD_DIM=80, D_PAD=128, PRECISION="tf32")),
    ("fp32", dict(GROUP=4, HEAD_DIM=64, D_PAD=64, PRECISION="ieee")),
    ("bf16", dict(GROUP=7, HEAD_DIM=128, D_PAD=128, PRECISION="tf32")),
]


def main() -> int:
    launch = triton_decode.PREFILL_ATTENTION
    for element, constants in SHAPES:
        constants = {
            **constants,
            "BLOCK_M": launch["BLOCK_M"],
            "BLOCK_N": launch["BLOCK_N"],
            "PAGE": triton_decode.PAGE,
        }
        signature = {name: kind.format(t=element) for name, kind in ARGUMENTS.items()}
        signature.update(dict.fromkeys(constants, "constexpr"))
        source = ASTSource(fn=triton_decode._paged_prefill_attention, signature=signature, constexprs=constants)
        compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32))
        print(f"ok   {element} {constants}: {len(compiled.asm['ptx'])} characters of PTX", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
