"""Checkpoints written with torch and transformers, for the specs that need one made
(backends/files/models.py resolves the spec and keeps the cache; this writes into it): a GGUF
file dequantized into a float32 checkpoint, and the tiny test models (backends/torch/tiny.py)."""

from __future__ import annotations

from pathlib import Path

from backends.contract import ModelLoadError
from backends.files import gguf_phi2
from backends.files.architecture import unsupported
from backends.files.gguf_shell import llama_cpp_rules
from backends.files.models import Makers
from backends.torch.tiny import write_tiny_checkpoint, write_tiny_reranker


def convert_gguf(file: Path, folder: Path, spec: str, architecture: str) -> None:
    """Dequantize the file into a safetensors checkpoint with its tokenizer (chat template and
    special tokens from the file's metadata). Phi-2's own files through `convert_phi2`:
    transformers' reader refuses them."""
    if architecture == gguf_phi2.ARCHITECTURE:
        try:
            convert_phi2(file, folder)
        except ValueError as exc:
            raise ModelLoadError(f"PHI2_MODEL={spec!r}: {exc}") from exc
        return
    import torch
    from gguf import GGUFReader
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(file.parent, gguf_file=file.name)
    config = AutoConfig.from_pretrained(file.parent, gguf_file=file.name)
    fields = GGUFReader(str(file)).fields
    scalars = {key: field.contents() for key, field in fields.items() if key.startswith(f"{architecture}.")}
    for key, value in llama_cpp_rules(architecture, scalars, config.to_dict()).items():
        setattr(config, key, value)
    model = AutoModelForCausalLM.from_pretrained(file.parent, gguf_file=file.name, config=config, dtype=torch.float32)
    if reason := unsupported(model.config):
        raise ModelLoadError(f"PHI2_MODEL={spec!r}: {reason}, which the decoder does not serve")
    # Dequantized, the model is a plain float one: save_pretrained refuses it while it is marked GGUF.
    model.hf_quantizer = None
    del model.config.quantization_config
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)


def convert_phi2(file: Path, folder: Path) -> None:
    """Write the file as a float32 transformers checkpoint into `folder`: config.json,
    generation_config.json, model.safetensors (every tensor dequantized by gguf) and the
    tokenizer (transformers' GGUF tokenizer reader). ValueError naming a tensor that is missing
    or of the wrong shape."""
    import numpy as np
    import torch
    from gguf import GGUFReader
    from gguf.quants import dequantize
    from safetensors.torch import save_file
    from transformers import GenerationConfig, PhiConfig, PhiForCausalLM, PreTrainedTokenizerFast

    reader = GGUFReader(str(file))
    tensors = {tensor.name: tensor for tensor in reader.tensors}
    fields = gguf_phi2.read_config(reader)
    config = PhiConfig(**fields)
    with torch.device("meta"):
        expected = PhiForCausalLM(config).state_dict()
    state = {}
    for module, (stem, rows) in gguf_phi2.modules(fields, tensors).items():
        for part in ("weight", "bias"):
            name, tensor = f"{module}.{part}", tensors.get(f"{stem}.{part}")
            if name not in expected:
                continue
            if tensor is None:
                if name != "lm_head.bias":  # a tied head has no bias of its own: zeros
                    raise ValueError(f"the file holds no {stem}.{part} (for {name})")
                state[name] = torch.zeros(expected[name].shape)
                continue
            values = dequantize(np.asarray(tensor.data), tensor.tensor_type).astype(np.float32)
            values = values[rows] if rows is not None else values
            if tuple(values.shape) != tuple(expected[name].shape):
                raise ValueError(f"{stem}.{part} is {list(values.shape)}, {name} wants {list(expected[name].shape)}")
            state[name] = torch.from_numpy(np.ascontiguousarray(values))
    if missing := sorted(set(expected) - set(state)):
        raise ValueError(f"the file holds nothing for {', '.join(missing[:3])}")
    folder.mkdir(parents=True, exist_ok=True)
    save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})
    config.save_pretrained(folder)
    GenerationConfig(bos_token_id=fields["bos_token_id"], eos_token_id=fields["eos_token_id"]).save_pretrained(folder)
    PreTrainedTokenizerFast.from_pretrained(file.parent, gguf_file=file.name).save_pretrained(folder)


MAKERS = Makers(tiny=write_tiny_checkpoint, tiny_reranker=write_tiny_reranker, gguf=convert_gguf)
