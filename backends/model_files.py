"""Turn a PHI2_MODEL spec into a local checkpoint directory, or a clear error.

A spec is `tiny` (the offline demo checkpoint, generated on first use), a local directory,
or a Hugging Face hub id (taken from the local cache, else downloaded once).
"""

from __future__ import annotations

import os
from pathlib import Path

from backends import ModelLoadError

# Bump when backends/tiny.py changes what it writes, so old caches are not reused.
TINY_VERSION = 2
HUB_FILES = ["*.json", "*.safetensors", "*.txt", "*.model", "*.tiktoken"]
HINT = "run `make demo` (PHI2_MODEL=tiny) for the offline demo model"


def tiny_dir() -> Path:
    root = os.environ.get("PHI2_CACHE_DIR") or Path.home() / ".cache" / "phi2-server"
    return Path(root) / f"tiny-v{TINY_VERSION}"


def resolve_model(spec: str) -> Path:
    from backends.tiny import TINY_SPEC, write_tiny_checkpoint

    if spec == TINY_SPEC:
        path = tiny_dir()
        if not (path / "config.json").is_file():
            write_tiny_checkpoint(path)
        return path

    path = Path(spec).expanduser()
    if path.is_dir() or spec.startswith((".", "/", "~")):
        if not (path / "config.json").is_file():
            raise ModelLoadError(
                f"PHI2_MODEL={spec!r} is not a loadable checkpoint directory (no config.json); {HINT}"
            )
        return path
    return _from_hub(spec)


def _from_hub(repo_id: str) -> Path:
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HFValidationError

    try:
        return Path(snapshot_download(repo_id, allow_patterns=HUB_FILES, local_files_only=True))
    except HFValidationError as exc:
        raise ModelLoadError(f"PHI2_MODEL={repo_id!r} is neither a directory nor a hub id ({exc}); {HINT}") from exc
    except Exception:
        pass  # not cached yet: download below
    try:
        path = Path(snapshot_download(repo_id, allow_patterns=HUB_FILES))
    except Exception as exc:
        reason = str(exc).splitlines()[0]
        raise ModelLoadError(
            f"PHI2_MODEL={repo_id!r} is not in the local Hugging Face cache and could not be "
            f"downloaded ({type(exc).__name__}: {reason}); {HINT}"
        ) from exc
    if not any(path.glob("*.safetensors")):
        raise ModelLoadError(f"PHI2_MODEL={repo_id!r} has no safetensors weights; {HINT}")
    return path
