"""The block kernels' matrix products alone, against float32 and bfloat16 `F.linear` (issue 54): the
four matrices of one block of SmolLM2-135M or Phi-2 (random weights, quantized to q8_0 and
q4_0, packed as served), `x @ W.T` for each row count, best of repeated calls, in milliseconds:
as decode rows take them (exact int8 products) and, where the CPU has AMX-BF16, as a prompt's
tokens do ("prompt": bfloat16 tiles).

    python benchmarks/block_products.py smollm2 1 16 64 256 512
    PHI2_CPU_AMX=0 python benchmarks/block_products.py phi2 64 256   # without AMX's tiles
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path.cwd()))  # the tree under test: the one it is run from

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from backends.torch.quant.blocks import BlockWeight  # noqa: E402
from backends.torch.quant.methods import best_time  # noqa: E402

SHAPES = {  # (out, in) of [q; k; v], o, [gate; up] or fc1, down or fc2
    "smollm2": [(960, 576), (576, 576), (3072, 576), (576, 1536)],
    "phi2": [(7680, 2560), (2560, 2560), (10240, 2560), (2560, 10240)],
}


def main() -> None:
    shapes = SHAPES[sys.argv[1] if len(sys.argv) > 1 else "smollm2"]
    counts = [int(r) for r in sys.argv[2:]] or [1, 16, 64, 256]
    torch.manual_seed(0)
    floats = [torch.randn(o, i) * 0.02 for o, i in shapes]
    halves = [w.bfloat16() for w in floats]
    blocks = {name: [BlockWeight.quantize(w, name) for w in floats] for name in ("q8_0", "q4_0")}
    for weights in blocks.values():
        for weight in weights:
            weight.pack()
    from backends.torch.cpu.kernels import kernels

    mm, prompts = kernels().mm, kernels().prompt_tiles()
    threads = torch.get_num_threads()
    print(f"kernels: {kernels().simd()}, prompt rows in AMX-BF16 tiles: {prompts}; torch threads {threads}")
    macs = sum(o * i for o, i in shapes)
    for rows in counts:
        xs = [torch.randn(rows, i) for _, i in shapes]
        xh = [x.bfloat16() for x in xs]
        calls = max(3, min(50, 20_000_000_000 // (macs * rows)))
        line = {
            "float32": best_time(lambda: [F.linear(x, w) for x, w in zip(xs, floats, strict=True)], calls),
            "bfloat16": best_time(lambda: [F.linear(x, w) for x, w in zip(xh, halves, strict=True)], calls),
        }
        for name, weights in blocks.items():
            line[name] = best_time(lambda ws=weights: [w.linear(x) for x, w in zip(xs, ws, strict=True)], calls)
            if prompts:  # the same rows as a prompt's tokens: AMX-BF16's tiles
                line[f"{name} prompt"] = best_time(
                    lambda ws=weights: [mm(x, *w.operand, w.in_features, 0) for x, w in zip(xs, ws, strict=True)], calls
                )
        print(f"rows {rows:4d}: " + "  ".join(f"{k} {v * 1e3:8.2f} ms" for k, v in line.items()), flush=True)


if __name__ == "__main__":
    main()
