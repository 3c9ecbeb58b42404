"""LoRA adapters in mlx-lm's format: find them, and merge them into PyTorch weights.

An adapter directory holds `adapter_config.json` (`fine_tune_type`, `num_layers`: LoRA on the
LAST n blocks, `lora_parameters`: `rank`, `scale`, `dropout`, optional `keys`) and
`adapters.safetensors` with `model.layers.{i}.<module>.lora_a` (in, r) and `.lora_b` (r, out).
mlx-lm's LoRA layer computes y = W x + scale * (x @ lora_a) @ lora_b, with `scale` used as is
(not alpha / rank as in PEFT), so the same update merged into a transformers Linear, whose
weight is (out, in), is W += scale * (lora_a @ lora_b).T.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

from backends import ModelLoadError

log = logging.getLogger("phi2_server.adapters")

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapters.safetensors"


def find_adapter(adapter_path: str | None, is_default: bool = False) -> Path | None:
    """The adapter directory to apply, or None when none is configured or it is absent.

    An absent directory means the base model is served. For the default path that is the usual
    case on most machines, said once at info level; a path the user chose and that is missing
    is a warning. A directory that exists but is not a valid adapter is an error: serving the
    base model silently would hide a broken fine-tune.
    """
    if not adapter_path:
        return None
    path = Path(adapter_path).expanduser()
    if not path.exists():
        if is_default:
            log.info("no adapter at the default ADAPTER_PATH (%s): serving the base model", path)
        else:
            log.warning("ADAPTER_PATH=%s does not exist: serving the base model without an adapter", path)
        return None
    if not path.is_dir():
        raise ModelLoadError(f"ADAPTER_PATH={path} is not a directory")
    missing = [name for name in (CONFIG_FILE, WEIGHTS_FILE) if not (path / name).is_file()]
    if missing:
        raise ModelLoadError(f"ADAPTER_PATH={path} is not an mlx-lm LoRA adapter: {', '.join(missing)} missing")
    read_config(path)
    return path


def read_config(path: Path) -> dict:
    try:
        config = json.loads((path / CONFIG_FILE).read_text())
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"ADAPTER_PATH={path}: {CONFIG_FILE} is not valid JSON ({exc})") from exc
    if not isinstance(config, dict):
        raise ModelLoadError(f"ADAPTER_PATH={path}: {CONFIG_FILE} is not a JSON object")
    return config


def merge_lora_into_torch(model, path: Path) -> int:
    """Merge an mlx-lm LoRA adapter into a transformers model in place; return layers changed.

    Accepts exactly what mlx-lm's loader accepts (tensors only for the configured keys of the
    last `num_layers` blocks, with matching shapes) and refuses adapter kinds that are not a
    plain low-rank update (DoRA, full fine-tunes).
    """
    import torch
    from safetensors.torch import load_file

    config = read_config(path)
    kind = config.get("fine_tune_type", "lora")
    if kind != "lora":
        raise ModelLoadError(
            f"ADAPTER_PATH={path}: fine_tune_type {kind!r} is not supported on the Torch backend "
            "(only 'lora'); use PHI2_BACKEND=mlx, or fuse it with `mlx_lm.fuse`"
        )
    try:
        params = config["lora_parameters"]
        scale = float(params["scale"])
        num_layers = int(config["num_layers"])
    except (KeyError, TypeError, ValueError) as exc:
        raise ModelLoadError(f"ADAPTER_PATH={path}: {CONFIG_FILE} lacks {exc} (needs num_layers, lora_parameters.scale)") from exc

    tensors = load_file(str(path / WEIGHTS_FILE))
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in tensors.items():
        module, _, leaf = name.rpartition(".")
        if leaf not in ("lora_a", "lora_b"):
            raise ModelLoadError(f"ADAPTER_PATH={path}: tensor {name!r} is not a LoRA parameter (DoRA is not supported on Torch)")
        pairs.setdefault(module, {})[leaf] = tensor

    blocks = _blocks(model)
    first_adapted = 0 if num_layers < 0 else max(len(blocks) - num_layers, 0)
    keys = params.get("keys")
    problems = []
    updates = []
    for module_name, pair in sorted(pairs.items()):
        target = _linear(model, module_name)
        block = _block_index(module_name)
        if target is None or block is None:
            problems.append(f"{module_name}: no such Linear layer in the model")
            continue
        if block < first_adapted:
            problems.append(f"{module_name}: block {block} is outside the last num_layers={num_layers} blocks")
            continue
        if keys is not None and module_name.split(f".{block}.", 1)[1] not in keys:
            problems.append(f"{module_name}: not among lora_parameters.keys")
            continue
        if set(pair) != {"lora_a", "lora_b"}:
            problems.append(f"{module_name}: needs both lora_a and lora_b")
            continue
        a, b = pair["lora_a"], pair["lora_b"]
        if a.ndim != 2 or b.ndim != 2 or a.shape[0] != target.in_features or b.shape[1] != target.out_features or a.shape[1] != b.shape[0]:
            problems.append(
                f"{module_name}: lora_a {tuple(a.shape)} / lora_b {tuple(b.shape)} do not fit a Linear "
                f"({target.in_features} -> {target.out_features})"
            )
            continue
        updates.append((target, a, b))
    if problems:
        raise ModelLoadError(f"ADAPTER_PATH={path} does not fit the model:\n  " + "\n  ".join(problems))

    with torch.no_grad():
        for target, a, b in updates:
            delta = scale * (a.double() @ b.double()).T  # (out, in), like the weight
            target.weight += delta.to(device=target.weight.device, dtype=target.weight.dtype)
    return len(updates)


def _blocks(model):
    inner = getattr(model, "model", model)
    return getattr(inner, "layers", [])


def _block_index(module_name: str) -> int | None:
    parts = module_name.split(".")
    for i, part in enumerate(parts[:-1]):
        if part == "layers" and parts[i + 1].isdigit():
            return int(parts[i + 1])
    return None


def _linear(model, module_name: str):
    import torch

    try:
        module = model.get_submodule(module_name)
    except AttributeError:
        return None
    return module if isinstance(module, torch.nn.Linear) else None
