"""The chat model as the embedding model, when no EMBEDDING_MODEL is set (as llama.cpp serves
/v1/embeddings with its one model and `--pooling`).

An input's vector is the chat model's final hidden states (after its final norm, before the LM
head), pooled by EMBEDDING_POOLING (`mean` of the input's tokens, or the `last` token's) and L2
normalized, as llama.cpp's OpenAI route normalizes (`embd_normalize` 2). The text is tokenized
with the tokenizer's special tokens (a BOS where the model adds one), as llama.cpp does.

No second copy of the weights: the encoders here run the resident model (transformers' base
model on Torch, mlx-lm's inner model on MLX) on the encode worker's thread. They run a view of
it without its per-request LoRA machinery: the adapters are applied per sequence by forward
hooks (Torch, one sequence at a time) or by a router that the forward being built reads (MLX),
state the generation thread changes while it decodes. The view is the same modules, shallow
copies sharing every weight, with neither: the vectors are always the base model's.

A batch is right-padded: in a causal model no real token attends to the padding after it, so
its hidden states are those of the input alone (MLX's mlx-lm forward takes no padding mask and
needs none); `last` takes each input's last real token, `mean` its real tokens.
"""

from __future__ import annotations

import copy
import logging
import threading
from typing import TYPE_CHECKING

from backends import ModelLoadError
from backends.embeddings import EncoderInfo, Item, TokenizerPart, padded

if TYPE_CHECKING:
    import numpy as np

log = logging.getLogger("phi2_server.embeddings")

POOLINGS = ("mean", "last", "none")  # EMBEDDING_POOLING; none: the chat model does not embed


class Refused(ModelLoadError):
    """The chat model cannot embed (a quantized model whose transformers forward has no weights)."""


def chat_encoder(backend, pooling: str):
    """The encoder over the loaded chat `backend` (a TorchBackend or MlxBackend); Refused says why
    there is none."""
    if backend.name == "mlx":
        return MlxChatEncoder(backend, pooling)
    return TorchChatEncoder(backend, pooling)


def chat_info(backend, pooling: str, dimensions: int, vocab: int) -> EncoderInfo:
    info = backend.info
    return EncoderInfo(
        "embedding",
        info.model,
        info.model,
        backend.name,
        info.device,
        info.dtype,
        info.context_length,
        vocab,
        dimensions=dimensions,
        pooling=pooling,
        normalize=True,
        extra={"chat_model": True},
    )


class TorchChatEncoder(TokenizerPart):
    """The chat model's transformers base model (the causal LM without its head)."""

    of_chat_model = True

    def __init__(self, backend, pooling: str):
        import torch

        if backend.quantized and "decoder_weights" in vars(backend):
            raise Refused(
                "the chat model is quantized for its decoder (PHI2_QUANTIZE), which leaves transformers' forward "
                "no weights to embed with: set EMBEDDING_MODEL"
            )
        super().__init__(backend.text.tokenizer, backend.info.context_length)
        self.base = without_hooks(backend.model.base_model)
        self.pooling = pooling
        self.device = backend.device
        self.stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        config = backend.model.config
        self.info = chat_info(backend, pooling, int(config.hidden_size), int(config.vocab_size))

    def embed(self, batch: list[Item]) -> np.ndarray:
        import contextlib

        import torch

        from backends.embeddings import pool_torch

        ids, mask, _ = padded(batch, self.pad_id)
        # On CUDA a stream of its own, as on MLX: the generation thread's graphs are captured and
        # replayed on theirs.
        on_stream = torch.cuda.stream(self.stream) if self.stream is not None else contextlib.nullcontext()
        with torch.inference_mode(), on_stream:
            ids_tensor, mask_tensor = torch.tensor(ids, device=self.device), torch.tensor(mask, device=self.device)
            out = self.base(input_ids=ids_tensor, attention_mask=mask_tensor, use_cache=False)
            vectors = pool_torch(out.last_hidden_state.float(), mask_tensor, self.pooling)
            return torch.nn.functional.normalize(vectors, p=2, dim=1).cpu().numpy()

    def score(self, batch: list[Item]) -> np.ndarray:
        raise NotImplementedError("the chat model does not rerank")


def without_hooks(module):
    """`module`'s tree again, each module a shallow copy (the same parameters and buffers) with no
    forward hooks: LoraHooks adds an adapter's to the model's Linears while a sequence decodes."""
    from collections import OrderedDict

    clone = copy.copy(module)
    clone.__dict__["_modules"] = type(module._modules)(
        (name, None if child is None else without_hooks(child)) for name, child in module._modules.items()
    )
    for hooks in (
        "_forward_hooks",
        "_forward_hooks_with_kwargs",
        "_forward_hooks_always_called",
        "_forward_pre_hooks",
        "_forward_pre_hooks_with_kwargs",
    ):
        if hooks in module.__dict__:
            clone.__dict__[hooks] = OrderedDict()
    return clone


class MlxChatEncoder(TokenizerPart):
    """mlx-lm's inner model (the layers and the final norm, no head), on the worker's own stream."""

    of_chat_model = True

    def __init__(self, backend, pooling: str):
        super().__init__(backend.text.tokenizer, backend.info.context_length)
        self.inner = without_routing(backend.model.model)
        self.pooling = pooling
        self.streams = threading.local()  # MLX streams are a thread's: the encode worker's, made at its first forward
        hidden = self.embed([Item([0])]).shape[1]  # mlx-lm's models keep their config in no one place
        self.info = chat_info(backend, pooling, int(hidden), backend._model_vocab())

    def embed(self, batch: list[Item]) -> np.ndarray:
        import mlx.core as mx
        import numpy as np

        from backends.mlx_embeddings import pool_mlx

        ids, mask, _ = padded(batch, self.pad_id)
        stream = getattr(self.streams, "stream", None)
        if stream is None:  # this thread's own: the generation thread has its
            stream = self.streams.stream = mx.new_stream(mx.default_device())
        with mx.stream(stream):
            hidden = self.inner(mx.array(ids), cache=None).astype(mx.float32)
            vectors = pool_mlx(hidden, mx.array(mask), self.pooling)
            vectors = vectors / mx.maximum(mx.linalg.norm(vectors, axis=1, keepdims=True), 1e-12)
            mx.eval(vectors)
        return np.array(vectors)

    def score(self, batch: list[Item]) -> np.ndarray:
        raise NotImplementedError("the chat model does not rerank")


def without_routing(module):
    """`module`'s tree again, each module a shallow copy (the same weight arrays), with the
    adapter routing (backends.mlx_lora's RoutedEmbedding and SlotLoRALinear) replaced by what it
    wraps: those read the router the generation thread sets while it builds a forward."""
    import mlx.nn as nn

    from backends.mlx_lora import RoutedEmbedding, SlotLoRALinear

    if isinstance(module, SlotLoRALinear):
        return without_routing(module.base)
    if isinstance(module, RoutedEmbedding):
        return without_routing(module.inner)
    clone = copy.copy(module)
    for key, value in module.items():
        if isinstance(value, nn.Module):
            clone[key] = without_routing(value)
        elif isinstance(value, (list, tuple)):
            clone[key] = type(value)(without_routing(v) if isinstance(v, nn.Module) else v for v in value)
    return clone
