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

import logging
from typing import TYPE_CHECKING

from backends.contract import ModelLoadError
from backends.encoders.embeddings import EncoderInfo

if TYPE_CHECKING:
    pass

log = logging.getLogger("phi2_server.embeddings")

POOLINGS = ("mean", "last", "none")  # EMBEDDING_POOLING; none: the chat model does not embed


class Refused(ModelLoadError):
    """The chat model cannot embed (a quantized model whose transformers forward has no weights)."""


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
