"""The BERT encoder in MLX: embeddings and cross-encoder scores on Apple Silicon without torch.

A BERT-family folder (config.json's model_type `bert`: MiniLM, bge, e5, ms-marco cross-encoders)
is read from its safetensors by `mx.load` and run by the few operations below, which are
transformers' BertModel (post-LayerNorm blocks, exact GELU, absolute positions, token types) and
BertForSequenceClassification's pooler and classifier. Tokenizing, pooling choice and
normalization are `backends.encoders.embeddings`', as on Torch; tests/test_embeddings.py holds both
runtimes to sentence-transformers' vectors and transformers' scores. Other architectures
(XLM-RoBERTa rerankers, nomic-bert) run on Torch (PHI2_BACKEND=torch).
"""

from __future__ import annotations

import copy
import json
import math
import threading
from pathlib import Path

import mlx.core as mx
import numpy as np

from backends.contract import ModelLoadError
from backends.encoders.chat import chat_info
from backends.encoders.embeddings import (
    EncoderInfo,
    Item,
    Kind,
    TokenizerPart,
    encoder_limit,
    matryoshka,
    padded,
    read_sentence_config,
    reranker_activation,
)

SUPPORTED = ("bert",)


class Bert:
    """BertModel's forward over a dict of weights (transformers' names, without `bert.`)."""

    def __init__(self, weights: dict[str, mx.array], config: dict):
        self.w = weights
        self.layers = int(config["num_hidden_layers"])
        self.heads = int(config["num_attention_heads"])
        self.eps = float(config.get("layer_norm_eps", 1e-12))
        if config.get("hidden_act", "gelu") != "gelu":
            raise ValueError(f"hidden_act {config.get('hidden_act')!r} (only gelu)")

    def linear(self, x: mx.array, name: str) -> mx.array:
        return mx.addmm(self.w[f"{name}.bias"], x, self.w[f"{name}.weight"].T)

    def norm(self, x: mx.array, name: str) -> mx.array:
        return mx.fast.layer_norm(x, self.w[f"{name}.weight"], self.w[f"{name}.bias"], self.eps)

    def __call__(self, ids: mx.array, mask: mx.array, types: mx.array) -> mx.array:
        batch, width = ids.shape
        w = self.w
        x = (
            w["embeddings.word_embeddings.weight"][ids]
            + w["embeddings.position_embeddings.weight"][mx.arange(width)][None]
            + w["embeddings.token_type_embeddings.weight"][types]
        )
        x = self.norm(x, "embeddings.LayerNorm")
        hidden = x.shape[-1]
        size = hidden // self.heads
        # Padding keys get -inf-like scores (transformers' finfo.min), so they weigh nothing.
        bias = ((1.0 - mask.astype(mx.float32)) * np.finfo(np.float32).min)[:, None, None, :]
        for i in range(self.layers):
            at = f"encoder.layer.{i}"

            def heads(name: str) -> mx.array:
                return (
                    self.linear(x, f"{at}.attention.self.{name}").reshape(batch, width, self.heads, size).swapaxes(1, 2)
                )

            q, k, v = heads("query"), heads("key"), heads("value")
            context = mx.fast.scaled_dot_product_attention(q, k, v, scale=1.0 / math.sqrt(size), mask=bias)
            context = context.swapaxes(1, 2).reshape(batch, width, hidden)
            x = self.norm(self.linear(context, f"{at}.attention.output.dense") + x, f"{at}.attention.output.LayerNorm")
            inner = self.linear(x, f"{at}.intermediate.dense")
            inner = 0.5 * inner * (1.0 + mx.erf(inner / math.sqrt(2.0)))  # exact GELU, as transformers' "gelu"
            x = self.norm(self.linear(inner, f"{at}.output.dense") + x, f"{at}.output.LayerNorm")
        return x


def load_weights(folder: Path) -> dict[str, mx.array]:
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"{folder} has no safetensors weights (the MLX encoder reads only those)")
    weights: dict[str, mx.array] = {}
    for file in files:
        weights.update(mx.load(str(file)))
    renamed = {}
    for name, value in weights.items():  # old BERT checkpoints: LayerNorm.gamma/beta
        name = name.replace("LayerNorm.gamma", "LayerNorm.weight").replace("LayerNorm.beta", "LayerNorm.bias")
        renamed[name] = value.astype(mx.float32)
    mx.eval(renamed)  # computed here: a lazy array belongs to the loading thread's stream, not the worker's
    return renamed


class MlxEncoder(TokenizerPart):
    """An embedding model or a cross-encoder on MLX (float32)."""

    team = None  # MLX has no per-thread pool of compute threads

    def __init__(self, info: EncoderInfo, bert: Bert, tokenizer, config, activation: str, weights: dict):
        super().__init__(tokenizer, info.max_tokens, config.lowercase if config else False)
        self.info = info
        self.bert = bert
        self.config = config
        self.activation = activation
        self.weights = weights  # the classifier's, for a reranker
        self.streams = threading.local()  # MLX streams are a thread's: the encode worker's, made at its first forward

    @classmethod
    def load(cls, kind: Kind, spec: str, path: Path) -> MlxEncoder:
        from transformers import AutoTokenizer

        setting = "EMBEDDING_MODEL" if kind == "embedding" else "RERANK_MODEL"
        config = read_sentence_config(path, spec) if kind == "embedding" else None
        folder = config.transformer if config else path
        raw = json.loads((folder / "config.json").read_text())
        if raw.get("model_type") not in SUPPORTED:
            raise ModelLoadError(
                f"{setting}={spec!r} is a {raw.get('model_type')!r} model; the MLX encoder runs BERT-family models "
                "(model_type bert); serve it with PHI2_BACKEND=torch"
            )
        weights = load_weights(folder)
        if kind == "rerank":
            if int(raw.get("num_labels", len(raw.get("id2label", {0: 0})))) != 1:
                raise ModelLoadError(f"{setting}={spec!r} has several labels; a reranker has one score")
            weights = {name.removeprefix("bert."): value for name, value in weights.items()}
        try:
            bert = Bert(weights, raw)
        except (KeyError, ValueError) as exc:
            raise ModelLoadError(
                f"{setting}={spec!r} ({folder}) is not a BERT model the MLX encoder runs: {exc}"
            ) from exc
        tokenizer = AutoTokenizer.from_pretrained(folder)
        limit = encoder_limit(_Config(raw), tokenizer, config.max_tokens if config else None)
        info = EncoderInfo(
            kind,
            spec,
            str(path),
            "mlx",
            mx.default_device().type.name,  # gpu (Metal) or cpu
            "float32",
            limit,
            len(tokenizer),
            dimensions=int(raw["hidden_size"]) if config else None,
            pooling=config.pooling if config else None,
            normalize=config.normalize if config else None,
            matryoshka=matryoshka(raw),
        )
        return cls(info, bert, tokenizer, config, reranker_activation(raw), weights)

    def _forward(self, batch: list[Item]) -> tuple[mx.array, mx.array]:
        ids, mask, types = padded(batch, self.pad_id)
        mask_array = mx.array(mask)
        return self.bert(mx.array(ids), mask_array, mx.array(types)), mask_array

    def _on_stream(self, fn):
        stream = getattr(self.streams, "stream", None)
        if stream is None:  # this thread's own: the generation thread has its
            stream = self.streams.stream = mx.new_stream(mx.default_device())
        with mx.stream(stream):
            out = fn()
            mx.eval(out)
        return np.array(out)

    def embed(self, batch: list[Item]) -> np.ndarray:
        def run() -> mx.array:
            hidden, mask = self._forward(batch)
            vectors = pool_mlx(hidden, mask, self.config.pooling)
            if self.config.normalize:
                vectors = vectors / mx.maximum(mx.linalg.norm(vectors, axis=1, keepdims=True), 1e-12)
            return vectors

        return self._on_stream(run)

    def score(self, batch: list[Item]) -> np.ndarray:
        def run() -> mx.array:
            hidden, _ = self._forward(batch)
            w = self.weights
            pooled = mx.tanh(mx.addmm(w["pooler.dense.bias"], hidden[:, 0], w["pooler.dense.weight"].T))
            logits = mx.addmm(w["classifier.bias"], pooled, w["classifier.weight"].T)[:, 0]
            return mx.sigmoid(logits) if self.activation == "sigmoid" else logits

        return self._on_stream(run)


class _Config:
    """config.json's values as attributes (encoder_limit reads max_position_embeddings)."""

    def __init__(self, raw: dict):
        self.max_position_embeddings = raw.get("max_position_embeddings")


def pool_mlx(hidden: mx.array, mask: mx.array, mode: str) -> mx.array:
    """sentence-transformers' Pooling of right-padded hidden states (pool_torch's, in MLX)."""
    if mode == "cls":
        return hidden[:, 0]
    lengths = mask.sum(axis=1)
    if mode == "last":
        return hidden[mx.arange(hidden.shape[0]), lengths - 1]
    expanded = mask[:, :, None].astype(hidden.dtype)
    if mode == "max":
        return mx.where(expanded == 0, -1e9, hidden).max(axis=1)
    sums = (hidden * expanded).sum(axis=1)
    counts = mx.maximum(expanded.sum(axis=1), 1e-9)
    return sums / (counts if mode == "mean" else mx.sqrt(counts))


class MlxChatEncoder(TokenizerPart):
    """mlx-lm's inner model (the layers and the final norm, no head), on the worker's own stream."""

    of_chat_model = True
    team = None

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
    adapter routing (backends.mlx.lora's RoutedEmbedding and SlotLoRALinear) replaced by what it
    wraps: those read the router the generation thread sets while it builds a forward."""
    import mlx.nn as nn

    from backends.mlx.lora import RoutedEmbedding, SlotLoRALinear

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
