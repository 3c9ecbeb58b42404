"""A K-quant GGUF file served on a CUDA machine (issue 67): the file's blocks dequantized at load
into a checkpoint of the device's dtype (bfloat16 by default; float32 asked), then batched and
graphed like any checkpoint.

    python3 -P tests/gpu/gguf_cuda.py --out $OUT

A Qwen2-shaped tiny checkpoint (hidden 256, so its matrices are whole K-quant super-blocks) is
written as llama.cpp writes a file (tests/gguf_writer.py), then re-coded into Q4_K_M's types
(tests/kquant_files.py: Q4_K, Q6_K, the embedding Q6_K) with the same values also written as F32.
Checks, exit status 1 on any miss: the K-quant file in float32 on CUDA gives the same first logits
as its F32 twin (the blocks dequantized exactly), and the same greedy ids as the CPU serving the
blocks as stored; in bfloat16 (the default) its decoder is graphed and a batch of 6 prompts, two
arriving late, equals each prompt alone. Writes --out/gguf_cuda.json. With no GPU it runs the same
checks on the CPU (a smoke test of this script).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

import torch  # noqa: E402

from backends.choose import load_backend  # noqa: E402
from backends.contract import LoadOptions, Sampling, Sequence  # noqa: E402
from backends.decoding.drive import drive  # noqa: E402
from backends.torch.decoder import BatchedDecoder  # noqa: E402
from backends.torch.tiny import write_tiny_checkpoint, write_tiny_family  # noqa: E402


def prompt_of(length: int) -> list[int]:
    return [5 + (i * 37) % 580 for i in range(length)]


def first_logits(backend, prompt) -> torch.Tensor:
    return BatchedDecoder(backend.decoder_weights, 1).logits_after(prompt).float().cpu()


def greedy(backend, prompt, steps=12) -> list[int]:
    return drive(backend.decoder(1), [Sequence(1, prompt, Sampling(), steps)]).ids[1]


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    out = Path(parser.parse_args().out)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    results = {"torch": torch.__version__, "device": torch.cuda.get_device_name() if device == "cuda" else "cpu"}
    root = Path(tempfile.mkdtemp())
    from gguf_writer import write_gguf
    from kquant_files import k_quant_copy

    tiny = write_tiny_checkpoint(root / "tiny")
    checkpoint = write_tiny_family(
        root / "qwen2", "qwen2", tiny, hidden_size=256, intermediate_size=512, use_sliding_window=False
    )
    source = write_gguf(checkpoint, root / "qwen2-q8.gguf", "Q8_0")  # k_quant_copy re-codes quantized matrices
    kfile = k_quant_copy(source, root / "qwen2-Q4_K_M.gguf", root / "qwen2-floats.gguf")
    import gguf

    results["types"] = sorted({t.tensor_type.name for t in gguf.GGUFReader(str(kfile)).tensors})

    def load(path, dtype="auto", on=device):
        return load_backend("torch", LoadOptions(model=str(path), dtype=dtype, device=on, warmup=False))

    ok = True
    kquant32, floats32 = load(kfile, "float32"), load(root / "qwen2-floats.gguf", "float32")
    stored = load(kfile, on="cpu")  # the CPU serves the blocks as stored
    results["cpu_method"] = stored.info.quantization
    ok = bool(stored.info.quantization)
    for length in (10, 40):
        prompt = prompt_of(length)
        a, b = first_logits(kquant32, prompt), first_logits(floats32, prompt)
        results[f"float32_vs_twin_{length}"] = diff = float((a - b).abs().max() / b.abs().max())
        ok &= diff < 1e-4 or device == "cpu"  # the CPU multiplies int8 activations by the blocks
        ids, cpu_ids = greedy(kquant32, prompt), greedy(stored, prompt)
        results[f"greedy_equal_cpu_as_stored_{length}"] = same = ids[:6] == cpu_ids[:6]
        ok &= same

    default = load(kfile)
    decoder = default.decoder(4)
    results["default"] = {
        "dtype": str(default.info.dtype),
        "decoder": f"{type(decoder).__name__} graphs={getattr(decoder, 'use_graphs', None)}",
    }
    sequences = [Sequence(i, prompt_of(n), Sampling(), 16) for i, n in enumerate([3, 30, 17, 45, 9, 60])]
    together = drive(decoder, sequences, arrive_at={4: 3, 5: 5}).ids
    alone = [greedy(default, s.prompt_ids, 16) for s in sequences]
    results["default"]["batched_equals_alone"] = same = [together[s.id] == alone[s.id] for s in sequences]
    ok &= all(same)
    results["ok"] = bool(ok)
    print(json.dumps(results, indent=1), flush=True)
    out.mkdir(parents=True, exist_ok=True)
    (out / "gguf_cuda.json").write_text(json.dumps(results, indent=1))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
