"""Encoders beside the chat model: an embedding model (/v1/embeddings) and a cross-encoder
reranker (/v1/rerank).

An embedding model is a sentence-transformers folder (or a plain transformers encoder): its
`modules.json` names the transformer, a Pooling module (`1_Pooling/config.json`: CLS, mean, max,
mean-sqrt-len or last token) and, where the vectors are normalized, a Normalize module;
`sentence_bert_config.json` gives the longest input and whether text is lowercased. A folder
without modules.json is pooled by the mean of its tokens, unnormalized (sentence-transformers'
own default). A reranker is a sequence-classification model with one label: a (query, document)
pair's score is the sigmoid of its logit (sentence-transformers' CrossEncoder default).

Both runtimes read the folder the same way (`SentenceConfig`); `backends.torch.encoder.TorchEncoder`
runs it through transformers' AutoModel, `backends.mlx.encoder.MlxEncoder` in MLX
(`backends.choose.load_encoder` picks). They run on the encode
worker's thread (`backends.workers.encode`), never on the generation thread or the event loop.
"""

from __future__ import annotations

import copy
import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Literal, Protocol

from backends.contract import ModelLoadError, Team

if TYPE_CHECKING:
    import numpy as np

log = logging.getLogger("phi2_server.embeddings")

Kind = Literal["embedding", "rerank"]
POOLING_MODES = {  # 1_Pooling/config.json's keys, and the name each mode has here
    "pooling_mode_cls_token": "cls",
    "pooling_mode_mean_tokens": "mean",
    "pooling_mode_max_tokens": "max",
    "pooling_mode_mean_sqrt_len_tokens": "mean_sqrt_len",
    "pooling_mode_lasttoken": "last",
}
# A sentence-transformers module type, by its class's last name: what this server runs of it.
KNOWN_MODULES = ("Transformer", "Pooling", "Normalize")


@dataclass(frozen=True)
class Item:
    """One input of an encoder: its ids as the model reads them (special tokens included), and
    for a (query, document) pair the segment of each id."""

    ids: list[int]
    token_types: list[int] | None = None


@dataclass(frozen=True)
class SentenceConfig:
    """What a folder's sentence-transformers files say about running it."""

    transformer: Path  # the folder of the transformers model (modules.json's Transformer path)
    pooling: str = "mean"
    normalize: bool = False
    max_tokens: int | None = None  # sentence_bert_config.json's max_seq_length
    lowercase: bool = False  # do_lower_case: the text is lowercased before it is tokenized


def read_sentence_config(path: Path, spec: str) -> SentenceConfig:
    """The pooling and normalization `path`'s modules.json names; ModelLoadError for modules
    this server cannot run (a Dense layer, several pooling modes at once)."""
    modules_file = path / "modules.json"
    if not modules_file.is_file():
        return SentenceConfig(path, **_bert_config(path))
    modules = json.loads(modules_file.read_text())
    transformer, pooling, normalize = path, "mean", False
    for module in modules:
        kind = module.get("type", "").rpartition(".")[2]
        where = path / module.get("path", "")
        if kind == "Transformer":
            transformer = where
        elif kind == "Pooling":
            pooling = _pooling_mode(where / "config.json", spec)
        elif kind == "Normalize":
            normalize = True
        else:
            raise ModelLoadError(
                f"EMBEDDING_MODEL={spec!r}: its modules.json holds a {kind or module!r} module; this server runs "
                f"{', '.join(KNOWN_MODULES)} only"
            )
    settings = _bert_config(transformer) or _bert_config(path)
    return SentenceConfig(transformer, pooling, normalize, **settings)


def _bert_config(folder: Path) -> dict:
    file = folder / "sentence_bert_config.json"
    if not file.is_file():
        return {}
    data = json.loads(file.read_text())
    return {"max_tokens": data.get("max_seq_length"), "lowercase": bool(data.get("do_lower_case", False))}


def _pooling_mode(file: Path, spec: str) -> str:
    config = json.loads(file.read_text()) if file.is_file() else {"pooling_mode_mean_tokens": True}
    modes = [name for key, name in POOLING_MODES.items() if config.get(key)]
    others = [key for key, on in config.items() if key.startswith("pooling_mode_") and on and key not in POOLING_MODES]
    if len(modes) != 1 or others:
        raise ModelLoadError(
            f"EMBEDDING_MODEL={spec!r}: its pooling config sets {modes + others or 'no mode'}; this server pools by "
            f"one of {', '.join(POOLING_MODES.values())}"
        )
    return modes[0]


def matryoshka(config: dict) -> bool:
    """Whether a model's vectors may be cut short (`dimensions`): its config says it was trained
    so (`matryoshka_dimensions`, vLLM's key, or `is_matryoshka`)."""
    return bool(config.get("matryoshka_dimensions") or config.get("is_matryoshka"))


@dataclass
class EncoderInfo:
    """What /model/info, /metrics and /v1/models say about a loaded encoder."""

    kind: Kind
    model: str  # EMBEDDING_MODEL or RERANK_MODEL as given
    path: str
    backend: str
    device: str
    dtype: str
    max_tokens: int  # the longest input (a pair's, for a reranker), special tokens included
    vocab_size: int
    dimensions: int | None = None  # an embedding's length
    pooling: str | None = None
    normalize: bool | None = None
    matryoshka: bool = False  # `dimensions` may cut the vectors short
    extra: dict = field(default_factory=dict)

    def describe(self) -> dict:
        return {
            "model": self.model,
            "path": self.path,
            "backend": self.backend,
            "device": self.device,
            "dtype": self.dtype,
            "max_tokens": self.max_tokens,
            **(
                {"dimensions": self.dimensions, "pooling": self.pooling, "normalize": self.normalize}
                if self.kind == "embedding"
                else {}
            ),
            **self.extra,
        }


class InputTooLong(ValueError):
    """An input past the encoder's length; the message names the limit."""

    def __init__(self, index: int, tokens: int, limit: int, what: str = "input"):
        super().__init__(
            f"{what}[{index}] has {tokens} tokens; this model takes at most {limit} (send truncate: true to cut "
            "longer inputs to that)"
        )
        self.index = index


class Encoder(Protocol):
    """A loaded embedding model or reranker; `embed` and `score` run on the encode worker's thread."""

    info: EncoderInfo
    team: Team | None  # its runtime's per-thread compute pool where it has one (torch), else None

    def tokenize(self, texts: list[str], truncate: bool) -> list[Item]:
        """Each text's ids with the model's special tokens; InputTooLong past info.max_tokens
        unless `truncate` (then cut to it)."""
        ...

    def pairs(self, query: str, documents: list[str], truncate: bool) -> list[Item]:
        """(query, document) pairs as a cross-encoder reads them; with `truncate` the document is
        cut to fit."""
        ...

    def embed(self, batch: list[Item]) -> np.ndarray:
        """Pooled (and, where the model says so, normalized) vectors, float32, a row an item."""
        ...

    def score(self, batch: list[Item]) -> np.ndarray:
        """A reranker's relevance score of each pair, float32."""
        ...


class TokenizerPart:
    """Tokenizing for both runtimes, through transformers' tokenizer of the folder."""

    def __init__(self, tokenizer, max_tokens: int, lowercase: bool = False):
        self.tokenizer = tokenizer
        self.max_tokens = max_tokens
        self.lowercase = lowercase
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0

    def tokenize(self, texts: list[str], truncate: bool) -> list[Item]:
        texts = [text.lower() for text in texts] if self.lowercase else texts
        encoded = self.tokenizer(
            texts, truncation=truncate, max_length=self.max_tokens if truncate else None, verbose=False
        )
        items = []
        for index, ids in enumerate(encoded["input_ids"]):
            if len(ids) > self.max_tokens:
                raise InputTooLong(index, len(ids), self.max_tokens)
            items.append(Item(ids))
        return items

    def pairs(self, query: str, documents: list[str], truncate: bool) -> list[Item]:
        """The query tokenized once, the documents in one batch, each pair put together by the
        tokenizer's own post-processor (issue 65: the query tokenized again a document, a ~1 MB
        query times 2,048 documents took minutes)."""
        fast = getattr(self.tokenizer, "backend_tokenizer", None)
        if fast is None:
            return self._pairs_one_by_one(query, documents, truncate)
        fast = copy.copy(fast)  # the encodings alone: no padding or truncation of the last call's
        fast.no_padding()
        fast.no_truncation()
        asked = fast.encode(query, add_special_tokens=False)
        specials = self.tokenizer.num_special_tokens_to_add(pair=True)
        room = self.max_tokens - specials - len(asked.ids)
        types = "token_type_ids" in getattr(self.tokenizer, "model_input_names", ("token_type_ids",))
        items = []
        for index, document in enumerate(fast.encode_batch(documents, add_special_tokens=False)):
            if len(document.ids) > room and truncate and room > 0:
                document.truncate(room)
            if len(document.ids) > room:
                raise InputTooLong(index, len(asked.ids) + len(document.ids) + specials, self.max_tokens, "documents")
            pair = fast.post_process(asked, document, add_special_tokens=True)
            items.append(Item(list(pair.ids), list(pair.type_ids) if types else None))
        return items

    def _pairs_one_by_one(self, query: str, documents: list[str], truncate: bool) -> list[Item]:
        items = []
        for index, document in enumerate(documents):
            encoded = self.tokenizer(query, document, verbose=False)
            if len(encoded["input_ids"]) > self.max_tokens and truncate:
                try:
                    encoded = self.tokenizer(query, document, truncation="only_second", max_length=self.max_tokens)
                except Exception:  # the query alone is too long: nothing of the document can make it fit
                    pass
            if len(encoded["input_ids"]) > self.max_tokens:
                raise InputTooLong(index, len(encoded["input_ids"]), self.max_tokens, "documents")
            items.append(Item(list(encoded["input_ids"]), encoded.get("token_type_ids")))
        return items


def padded(batch: list[Item], pad_id: int) -> tuple[list[list[int]], list[list[int]], list[list[int]]]:
    """ids, attention mask and token types of a batch, right-padded to its longest item."""
    width = max(len(item.ids) for item in batch)
    ids, mask, types = [], [], []
    for item in batch:
        pad = width - len(item.ids)
        ids.append(item.ids + [pad_id] * pad)
        mask.append([1] * len(item.ids) + [0] * pad)
        types.append(list(item.token_types or [0] * len(item.ids)) + [0] * pad)
    return ids, mask, types


def encoder_limit(config, tokenizer, configured: int | None) -> int:
    """The longest input: sentence-transformers' max_seq_length where given, else the tokenizer's
    model_max_length, and never past the model's position embeddings."""
    positions = getattr(config, "max_position_embeddings", None) or 512
    limit = configured or getattr(tokenizer, "model_max_length", None) or positions
    return int(min(limit, positions))


def reranker_activation(config: dict) -> str:
    """`sigmoid` (CrossEncoder's default for one label) or `identity` where the folder's config
    names it (sentence-transformers writes config.json's sentence_transformers.activation_fn)."""
    named = (config.get("sentence_transformers") or {}).get("activation_fn", "")
    return "identity" if named.endswith("Identity") else "sigmoid"
