"""A stored quantized model, served on the CPU without transformers' modelling code.

The second start of a quantized model (a GGUF file's own blocks, or PHI2_QUANTIZE) maps the file
that backends/torch/quant/store.py wrote. Building transformers' model for it costs more than the
mapping: its config and modelling modules import torch.distributed.tensor, sympy and the masking
code, 2-3 s of a 7 s start on 2 cores (`python -X importtime`), only to hold tensors the batched
decoder reads directly. So on the CPU the first start stores, beside the weights, what the server
reads from the model (`describe`): the resolved config, the end-of-text ids, the tokenizer's
class, each Linear's shape (adapters are checked against them) and the rotary tables. The next
start builds `StoredModel` from them (`build`): the stored tensors under transformers' names, in
the same module tree (so DecoderWeights, the adapter registry and the KV sizing read it as they
read transformers' model), with a rotary module that looks its rows up in the stored tables.

It has no forward of its own: a quantized model always serves through the batched decoder
(TorchBackend.decoder), whose steps are this server's. Models it does not fit (rotary scalings
that depend on the sequence's length, tables over MAX_TABLE_VALUES) are stored without it, and
their next start builds transformers' model as before.
"""

from __future__ import annotations

import importlib
import json
import types

import torch

# Rotary tables longer than this many values each (128k-position Llama 3.1: 16.8M) are not stored:
# such models take transformers' path (their weights' I/O dominates their start anyway).
MAX_TABLE_VALUES = 1 << 22
# transformers updates these frequencies with the sequence's length (modeling_rope_utils'
# dynamic_rope_update): a stored table of positions would not say what it computes.
LENGTH_DEPENDENT_ROPE = ("dynamic", "longrope")


def describe(model, tokenizer) -> dict | None:
    """What `build` needs besides the state dict, from the model transformers built (and the
    tokenizer AutoTokenizer chose); None where the model does not fit (see the module's doc)."""
    rotary = getattr(model.model, "rotary_emb", None)
    rope_type = getattr(rotary, "rope_type", "default")
    positions = int(model.config.max_position_embeddings)
    if rotary is None or not isinstance(rope_type, str) or rope_type in LENGTH_DEPENDENT_ROPE:
        return None
    if not type(tokenizer).__module__.startswith("transformers."):  # a checkpoint's own code
        return None
    with torch.no_grad():
        x = torch.zeros(1, dtype=torch.float32, device=model.model.embed_tokens.weight.device)
        dim = rotary(x, torch.zeros(1, 1, dtype=torch.long, device=x.device))[0].shape[-1]
        if positions * dim > MAX_TABLE_VALUES:
            return None
        cos, sin = rotary(x, torch.arange(positions, device=x.device)[None])
    state = model.state_dict()
    return {
        "config": model.config.to_json_string(use_diff=False),
        "generation_eos": json.dumps(getattr(model.generation_config, "eos_token_id", None)),
        "tokenizer": f"{type(tokenizer).__module__}:{type(tokenizer).__qualname__}",
        "linears": {
            name: [m.in_features, m.out_features, m.bias is not None]
            for name, m in model.named_modules()
            if isinstance(m, torch.nn.Linear)
        },
        "buffers": [name for name, _ in model.named_buffers() if name in state],
        "rope_type": rope_type,
        "cos": cos[0].float().cpu().contiguous(),
        "sin": sin[0].float().cpu().contiguous(),
    }


class StoredRotary(torch.nn.Module):
    """transformers' rotary module's answer, `(cos, sin)` for `position_ids` ([batch, n]), from
    the tables it computed when the model was stored (float32, as it computes them)."""

    def __init__(self, rope_type: str, cos: torch.Tensor, sin: torch.Tensor):
        super().__init__()
        self.rope_type = rope_type
        self.cos, self.sin = cos, sin

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        positions = position_ids.to(self.cos.device)
        return self.cos[positions].to(x.device, x.dtype), self.sin[positions].to(x.device, x.dtype)


class StoredModel(torch.nn.Module):
    """The stored tensors in transformers' module tree, with its config and end-of-text ids."""

    def __init__(self, config, eos_token_id):
        super().__init__()
        self.config = config
        self.generation_config = types.SimpleNamespace(eos_token_id=eos_token_id)


def build(shell: dict, state: dict[str, torch.Tensor]) -> StoredModel:
    """The model `describe` described, holding `state` (tensors mapped from the stored file).
    Raises ValueError when they do not fit each other (the caller quantizes again)."""
    from transformers import PretrainedConfig  # its module alone: none of the modelling imports

    config = PretrainedConfig.from_dict(json.loads(shell["config"]))
    model = StoredModel(config, json.loads(shell["generation_eos"]))
    linears, buffers = dict(shell["linears"]), set(shell["buffers"])
    for name, tensor in state.items():  # in the state dict's order: the parameters' order too
        owner, _, leaf = name.rpartition(".")
        if owner in linears:
            fan_in, fan_out, bias = linears.pop(owner)
            parent, _, attribute = owner.rpartition(".")
            _attach(_module(model, parent), attribute, torch.nn.Linear(fan_in, fan_out, bias=bias, device="meta"))
        module = _module(model, owner)
        if name in buffers:
            module.register_buffer(leaf, tensor)
        else:
            module._parameters[leaf] = torch.nn.Parameter(tensor, requires_grad=False)
    missing = [name for name, p in model.named_parameters() if p.is_meta]
    if missing:
        raise ValueError(f"no weights for {missing[:3]}")
    model.model.rotary_emb = StoredRotary(shell["rope_type"], shell["cos"], shell["sin"])
    return model.eval()


def tokenizer_class(shell: dict):
    """The tokenizer class AutoTokenizer chose when the model was stored."""
    module, _, name = shell["tokenizer"].partition(":")
    owner = importlib.import_module(module)
    for part in name.split("."):
        owner = getattr(owner, part)
    return owner


def _module(root: torch.nn.Module, path: str) -> torch.nn.Module:
    """The module at `path`, made (a ModuleList where the next name is an index) if missing."""
    module = root
    parts = path.split(".") if path else []
    for index, part in enumerate(parts):
        if part not in module._modules:
            numbered = index + 1 < len(parts) and parts[index + 1].isdigit()
            _attach(module, part, torch.nn.ModuleList() if numbered else torch.nn.Module())
        module = module._modules[part]
    return module


def _attach(parent: torch.nn.Module, name: str, child: torch.nn.Module) -> None:
    """`child` as `parent`'s `name`: an index into a ModuleList (filled up to it), else an attribute."""
    if isinstance(parent, torch.nn.ModuleList):
        while len(parent) <= int(name):
            parent.append(torch.nn.Module())
        parent[int(name)] = child
    else:
        parent.add_module(name, child)
