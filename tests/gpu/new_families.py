"""Gemma 3, SmolLM3 and Qwen3.5 (issue 66) on a CUDA machine, float32: the batched decoder's first
logits and 20 greedy steps against transformers' forward, and a batch of prompts against each
alone, through the decoder the runtime builds there (Gemma 3 and SmolLM3: CUDA graphs over the
torch-ops step, compiled; Qwen3.5: eager, its states beside the KV).

    python3 tests/gpu/new_families.py --out $OUT
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import traceback
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


def reference(backend, prompt, steps):
    from transformers import DynamicCache

    model, ids = backend.model, []
    cache = DynamicCache(config=model.config)
    with torch.inference_mode():
        out = model(torch.tensor([prompt], device="cuda"), cache=cache, use_cache=True)
        first = out.logits[0, -1].float()
        for _ in range(steps):
            ids.append(int(out.logits[0, -1, : backend.undecodable_from].argmax()))
            position = torch.tensor([[len(prompt) + len(ids) - 1]], device="cuda")
            out = model(torch.tensor([[ids[-1]]], device="cuda"), cache=cache, use_cache=True, position_ids=position)
    return ids, first


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    out = Path(parser.parse_args().out)
    results = {"torch": torch.__version__, "device": torch.cuda.get_device_name()}
    root = Path(tempfile.mkdtemp())
    tiny = write_tiny_checkpoint(root / "tiny")
    for family in ("gemma3_text", "smollm3", "qwen3_5_text"):
        try:
            path = write_tiny_family(root / family, family, tiny)
            backend = load_backend("torch", LoadOptions(model=str(path), dtype="float32", device="cuda", warmup=False))
            row = {}
            for length in (10, 40):
                prompt = prompt_of(length)
                ids, first = reference(backend, prompt, 20)
                got = BatchedDecoder(backend.decoder_weights, 1).logits_after(prompt).float()
                row[f"first_diff_{length}"] = float((got - first).abs().max()) / max(1.0, float(first.abs().max()))
                decoder = backend.decoder(4)
                row["decoder"] = f"{type(decoder).__name__} graphs={decoder.use_graphs} fused={decoder.network.fused}"
                row[f"greedy_equal_{length}"] = drive(decoder, [Sequence(1, prompt, Sampling(), 20)]).ids[1] == ids
            sequences = [Sequence(i, prompt_of(n), Sampling(), 16) for i, n in enumerate([3, 30, 17, 45, 9, 60])]
            together = drive(backend.decoder(4), sequences, arrive_at={4: 3, 5: 5}).ids
            row["batched_equals_reference"] = [
                together[s.id] == reference(backend, s.prompt_ids, 16)[0] for s in sequences
            ]
            results[family] = row
        except Exception:
            results[family] = {"error": traceback.format_exc()[-2000:]}
        print(family, json.dumps(results[family], indent=1), flush=True)
    out.mkdir(parents=True, exist_ok=True)
    (out / "new_families.json").write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
