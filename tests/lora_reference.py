"""The reference the per-request adapters are tested against: an mlx-lm LoRA adapter merged
into a transformers model's weights (the tests' own; the server never merges)."""

from __future__ import annotations

from pathlib import Path

from backends.files.adapters import WEIGHTS_FILE, block_count, check_modules, lora_settings, read_config
from backends.torch.lora import torch_linears


def merge_lora_into_torch(model, path: Path) -> int:
    """Merge an mlx-lm LoRA adapter into a transformers model in place; return layers changed
    (the reference the per-request adapters are tested against)."""
    import torch
    from safetensors.torch import load_file

    config = read_config(path)
    scale, _, _, _ = lora_settings(config)
    modules = check_modules(config, load_file(str(path / WEIGHTS_FILE)), torch_linears(model), block_count(model))
    with torch.no_grad():
        for name, (a, b) in modules.items():
            target = model.get_submodule(name)
            delta = scale * (a.double() @ b.double()).T  # (out, in), like the weight
            target.weight += delta.to(device=target.weight.device, dtype=target.weight.dtype)
    return len(modules)
