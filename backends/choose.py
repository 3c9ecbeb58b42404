"""Which runtime serves, and loading it: the one module that knows both runtimes (it imports
them lazily, so the MLX one is never imported on Torch and the reverse)."""

from __future__ import annotations

import importlib.util
import platform
from collections.abc import Callable
from pathlib import Path

from backends.contract import Backend, LoadOptions, ModelLoadError
from backends.encoders.embeddings import Encoder, Kind

BACKEND_NAMES = ("auto", "mlx", "torch")


def select_backend(
    requested: str,
    system: str | None = None,
    machine: str | None = None,
    mlx_available: Callable[[], bool] | None = None,
) -> str:
    """Which runtime serves: `auto` is MLX on macOS arm64 when mlx-lm imports, else Torch."""
    if requested not in BACKEND_NAMES:
        raise ValueError(f"PHI2_BACKEND must be one of {', '.join(BACKEND_NAMES)}, not {requested!r}")
    if requested != "auto":
        return requested
    system = system or platform.system()
    machine = machine or platform.machine()
    mlx_available = mlx_available or (lambda: importlib.util.find_spec("mlx_lm") is not None)
    if system == "Darwin" and machine == "arm64" and mlx_available():
        return "mlx"
    return "torch"


def resolve_model(spec: str, weights: bool = True) -> Path:
    """PHI2_MODEL as a local checkpoint directory (backends/files/models.py), the checkpoints it
    needs made with torch (backends/torch/checkpoints.py; a Mac's requirements have torch too);
    a GGUF file's float weights unless `weights` is False."""
    from backends.files import models
    from backends.torch.checkpoints import MAKERS

    return models.resolve_model(spec, MAKERS, weights)


def resolve_folder(spec: str, setting: str) -> Path:
    """EMBEDDING_MODEL or RERANK_MODEL as a local folder (backends/files/models.py)."""
    from backends.files import models
    from backends.torch.checkpoints import MAKERS

    return models.resolve_folder(spec, setting, MAKERS)


def load_backend(name: str, options: LoadOptions) -> Backend:
    """Load the model with the named runtime ('mlx' or 'torch'). Blocking: minutes for Phi-2."""
    if name == "mlx":
        try:
            from backends.mlx import gguf_direct
            from backends.mlx.runtime import MlxBackend
        except ImportError as exc:
            raise ModelLoadError(
                f"PHI2_BACKEND=mlx needs mlx-lm ({exc}); install requirements-mac.txt, "
                "or on Linux `pip install 'mlx[cpu]' mlx-lm`"
            ) from exc
        from backends.files.models import gguf_file

        # a GGUF file's float weights only where MLX does not build the model from the file
        floats = not gguf_direct.applies(gguf_file(options.model), options.quantize)
        return MlxBackend.load(resolve_model(options.model, weights=floats), options)
    if name == "torch":
        from backends.torch.runtime import TorchBackend

        # Torch asks for a GGUF file's floats itself
        return TorchBackend.load(resolve_model(options.model, weights=False), options)
    raise ValueError(f"unknown backend {name!r}")


def load_encoder(runtime: str, kind: Kind, spec: str, device: str) -> Encoder:
    """EMBEDDING_MODEL or RERANK_MODEL (a local folder or a Hugging Face id in the local cache) on
    the runtime serving the chat model."""
    from transformers.utils import logging as transformers_logging

    transformers_logging.disable_progress_bar()  # the server log is for the server
    path = resolve_folder(spec, "EMBEDDING_MODEL" if kind == "embedding" else "RERANK_MODEL")
    name = (
        "tiny-reranker" if path.name.startswith("tiny-reranker") and spec == "tiny" else spec
    )  # not the chat's `tiny`
    if runtime == "mlx":
        from backends.mlx.encoder import MlxEncoder

        return MlxEncoder.load(kind, name, path)
    from backends.torch.encoder import TorchEncoder

    return TorchEncoder.load(kind, name, path, device)


def chat_encoder(backend, pooling: str):
    """The encoder over the loaded chat `backend` (a TorchBackend or MlxBackend); Refused says why
    there is none."""
    if backend.name == "mlx":
        from backends.mlx.encoder import MlxChatEncoder

        return MlxChatEncoder(backend, pooling)
    from backends.torch.encoder import TorchChatEncoder

    return TorchChatEncoder(backend, pooling)
