"""Encoders on transformers' models (backends/encoders/ says what they compute): an embedding
model or reranker folder (`TorchEncoder`), and the chat model itself as the embedding model
(`TorchChatEncoder`). They run on the encode worker's thread."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import TYPE_CHECKING

from backends.contract import ModelLoadError
from backends.encoders.chat import Refused, chat_info
from backends.encoders.embeddings import (
    EncoderInfo,
    Item,
    Kind,
    SentenceConfig,
    TokenizerPart,
    encoder_limit,
    matryoshka,
    padded,
    read_sentence_config,
    reranker_activation,
)

if TYPE_CHECKING:
    import numpy as np


class TorchTeam:
    """torch's OpenMP team of the calling thread (each thread has its own)."""

    def get(self) -> int:
        import torch

        return torch.get_num_threads()

    def set(self, threads: int) -> None:
        import torch

        torch.set_num_threads(threads)


TORCH_TEAM = TorchTeam()


class TorchEncoder(TokenizerPart):
    """An encoder on transformers' AutoModel (or AutoModelForSequenceClassification), float32."""

    team = TORCH_TEAM

    def __init__(self, info: EncoderInfo, model, tokenizer, config: SentenceConfig | None, activation: str):
        super().__init__(tokenizer, info.max_tokens, config.lowercase if config else False)
        self.info = info
        self.model = model
        self.config = config
        self.activation = activation
        import inspect

        self.typed = "token_type_ids" in inspect.signature(model.forward).parameters

    @classmethod
    def load(cls, kind: Kind, spec: str, path: Path, device: str) -> TorchEncoder:
        import torch
        from transformers import AutoModel, AutoModelForSequenceClassification, AutoTokenizer

        from backends.torch.runtime import pick_device

        device = pick_device(device)
        config = read_sentence_config(path, spec) if kind == "embedding" else None
        folder = config.transformer if config else path
        name = "EMBEDDING_MODEL" if kind == "embedding" else "RERANK_MODEL"
        try:
            tokenizer = AutoTokenizer.from_pretrained(folder)
            auto = AutoModel if kind == "embedding" else AutoModelForSequenceClassification
            model = auto.from_pretrained(folder, dtype=torch.float32).to(device).eval()
        except (OSError, ValueError, KeyError) as exc:
            raise ModelLoadError(f"{name}={spec!r} ({folder}) could not be loaded by transformers: {exc}") from exc
        raw = json.loads((folder / "config.json").read_text())
        if kind == "rerank" and model.config.num_labels != 1:
            raise ModelLoadError(f"{name}={spec!r} has {model.config.num_labels} labels; a reranker has one score")
        info = EncoderInfo(
            kind,
            spec,
            str(path),
            "torch",
            device,
            "float32",
            encoder_limit(model.config, tokenizer, config.max_tokens if config else None),
            len(tokenizer),
            dimensions=int(model.config.hidden_size) if config else None,
            pooling=config.pooling if config else None,
            normalize=config.normalize if config else None,
            matryoshka=matryoshka(raw),
        )
        return cls(info, model, tokenizer, config, reranker_activation(raw))

    def _forward(self, batch: list[Item]):
        import torch

        ids, mask, types = padded(batch, self.pad_id)
        device = self.info.device
        inputs = {
            "input_ids": torch.tensor(ids, device=device),
            "attention_mask": torch.tensor(mask, device=device),
        }
        if self.typed:
            inputs["token_type_ids"] = torch.tensor(types, device=device)
        return self.model(**inputs), inputs["attention_mask"]

    def embed(self, batch: list[Item]) -> np.ndarray:
        import torch

        with torch.inference_mode():
            out, mask = self._forward(batch)
            vectors = pool_torch(out.last_hidden_state, mask, self.config.pooling)
            if self.config.normalize:
                vectors = torch.nn.functional.normalize(vectors, p=2, dim=1)
            return vectors.float().cpu().numpy()

    def score(self, batch: list[Item]) -> np.ndarray:
        import torch

        with torch.inference_mode():
            out, _ = self._forward(batch)
            logits = out.logits[:, 0].float()
            return (torch.sigmoid(logits) if self.activation == "sigmoid" else logits).cpu().numpy()


def pool_torch(hidden, mask, mode: str):
    """sentence-transformers' Pooling of right-padded hidden states, in its arithmetic."""
    import torch

    if mode == "cls":
        return hidden[:, 0]
    if mode == "last":
        return hidden[torch.arange(hidden.shape[0], device=hidden.device), mask.sum(1) - 1]
    expanded = mask.unsqueeze(-1).to(hidden.dtype)
    if mode == "max":
        return hidden.masked_fill(expanded == 0, -1e9).max(1).values
    sums = (hidden * expanded).sum(1)
    counts = expanded.sum(1).clamp(min=1e-9)
    return sums / (counts if mode == "mean" else counts.sqrt())


class TorchChatEncoder(TokenizerPart):
    """The chat model's transformers base model (the causal LM without its head)."""

    of_chat_model = True
    team = TORCH_TEAM

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
