"""Compile the paged attention kernels (backends/torch/cuda/triton_*.py: the prefill one, whole and
split with its combine, and the decode step's split attention, which share `_paged_columns`)
for an H200 (sm_90) on a machine without a GPU: Triton's front end checks what its interpreter
does not (a variable whose type differs between branches, for one), and the back end builds
the PTX. First, that the paged prefill kernels are compiled once for any piece length.

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

from backends.torch import kv_pages  # noqa: E402
from backends.torch.cuda import triton_attention, triton_prefill  # noqa: E402

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
    "part_ptr": "*fp32",
}
# Its splits' combine (`paged_prefill_attention` with splits > 1).
COMBINE_ARGUMENTS = {
    "part_ptr": "*fp32",
    "lens_ptr": "*i64",
    "out_ptr": "*{t}",
    "stride_o_row": "i32",
    "stride_o_token": "i32",
    "length": "i32",
}
# (the element type, the constants): Phi-2's heads in bfloat16, Llama's grouped ones in float32.
SHAPES = [
    ("bf16", dict(GROUP=1, HEAD_DIM=80, D_PAD=128, PRECISION="tf32")),
    ("fp32", dict(GROUP=4, HEAD_DIM=64, D_PAD=64, PRECISION="ieee")),
    ("bf16", dict(GROUP=7, HEAD_DIM=128, D_PAD=128, PRECISION="tf32")),
]


# The decode step's `_attention_split` for Phi-2's heads in bfloat16 (as `attention` launches it).
SPLIT_ARGUMENTS = {
    "y_ptr": "*bf16",
    "stride_y": "i32",
    "cos_ptr": "*bf16",
    "sin_ptr": "*bf16",
    "stride_rot": "i32",
    "pos_ptr": "*i64",
    "active_ptr": "*i64",
    "k_ptr": "*bf16",
    "v_ptr": "*bf16",
    "stride_head": "i64",
    "stride_page": "i32",
    "table_ptr": "*i64",
    "stride_table": "i32",
    "part_ptr": "*fp32",
    "scale": "fp32",
    "window": "i32",
    "q_norm_ptr": "*bf16",
    "k_norm_ptr": "*bf16",
    "eps": "fp32",
    "fill": "i32",
    "split_columns": "i32",
}
SPLIT_CONSTANTS = dict(
    Q_SIZE=2560,
    KV_SIZE=2560,
    GROUP=1,
    HEAD_DIM=80,
    ROT=32,
    D_PAD=128,
    D_LO=triton_attention._tiles(80)[0],
    D_HI=triton_attention._tiles(80)[1],
    BLOCK_N=triton_attention.attention_block(80),
    SPLITS=16,
    QK_NORM=False,
    PAGE=16,
)


def build(fn, signature: dict, constants: dict, options: dict | None = None) -> None:
    source = ASTSource(fn=fn, signature={**signature, **dict.fromkeys(constants, "constexpr")}, constexprs=constants)
    compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options)
    print(f"ok   {fn.__name__} {constants}: {len(compiled.asm['ptx'])} characters of PTX", flush=True)


def one_variant_for_every_length() -> None:
    """The paged prefill kernels compile once whatever a piece's length (and window): Triton
    would otherwise build a variant for 1, multiples of 16 and the rest, ~0.9 s each."""
    from triton._C.libtriton import native_specialize_impl
    from triton.backends.nvidia.compiler import CUDABackend

    for fn, names in (
        (triton_prefill._paged_prefill_attention, ("length", "window")),
        (triton_prefill._paged_prefill_combine, ("length",)),
    ):
        for name in names:
            param = next(p for p in fn.params if p.name == name)
            specialize = not param.do_not_specialize
            keys = {native_specialize_impl(CUDABackend, v, False, specialize, True) for v in (1, 16, 1052)}
            assert len(keys) == 1, f"{fn.__name__}({name}) compiles per value class: {keys}"
            print(f"ok   {fn.__name__}: one variant for any {name}", flush=True)


def main() -> int:
    one_variant_for_every_length()
    launch = triton_prefill.PREFILL_ATTENTION
    for element, constants in SHAPES:
        constants = {
            **constants,
            "BLOCK_M": launch["BLOCK_M"],
            "BLOCK_N": launch["BLOCK_N"],
            "PAGE": kv_pages.PAGE,
        }
        signature = {name: kind.format(t=element) for name, kind in ARGUMENTS.items()}
        for splits in (1, 2, 4, 8, 16):  # every count `prefill_splits` may choose
            build(
                triton_prefill._paged_prefill_attention,
                signature,
                {**constants, "SPLITS": splits},
                {"num_warps": launch["num_warps"], "num_stages": launch["num_stages"]},
            )
        combine = {name: kind.format(t=element) for name, kind in COMBINE_ARGUMENTS.items()}
        build(
            triton_prefill._paged_prefill_combine,
            combine,
            {"HEAD_DIM": constants["HEAD_DIM"], "D_PAD": constants["D_PAD"], "BLOCK_M": launch["BLOCK_M"], "SPLITS": 8},
        )
    build(triton_attention._attention_split, SPLIT_ARGUMENTS, SPLIT_CONSTANTS)
    return 0


if __name__ == "__main__":
    sys.exit(main())
