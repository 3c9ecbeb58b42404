"""LoRA adapters in mlx-lm's format: find them in a directory, load them on first use (a bounded
LRU), and check them against the model; also the merge into PyTorch weights that tests compare
against.

An adapter directory holds `adapter_config.json` (`fine_tune_type`, `num_layers`: LoRA on the
LAST n blocks, `lora_parameters`: `rank`, `scale`, `dropout`, optional `keys`) and
`adapters.safetensors` with `model.layers.{i}.<module>.lora_a` (in, r) and `.lora_b` (r, out).
mlx-lm's LoRA layer computes y = W x + scale * (x @ lora_a) @ lora_b, with `scale` used as is
(not alpha / rank as in PEFT). The runtimes apply that extra product per sequence, unmerged
(torch_lora, mlx_lora), so requests for different adapters share a batch; merged into a
transformers Linear, whose weight is (out, in), the same update is W += scale * (lora_a @ lora_b).T.

Adapters are named after their folders in ADAPTERS_DIR. The directory is read again on every
listing and every request that names an adapter, so a folder added, changed or removed while
the server runs is noticed then (no reload endpoint). A changed folder (its files' size or
modification time) is a new version: it is loaded again, and it shares no prompt cache or
decoder slot with the old one.
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
import threading
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from backends.errors import ModelLoadError

log = logging.getLogger("phi2_server.adapters")

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapters.safetensors"
# A folder name: no separators, and no leading dot (so neither `..` nor hidden folders).
ADAPTER_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._+-]{0,127}")


class AdapterError(Exception):
    """An adapter a request names cannot be used; the message says which and why."""


class UnknownAdapter(AdapterError):
    """No adapter of that name."""


class InvalidAdapterName(AdapterError):
    """A name that is not a plain folder name in ADAPTERS_DIR (or leads out of it)."""


class BrokenAdapter(AdapterError):
    """The folder exists but is not an adapter this model can use."""


@dataclass(frozen=True, eq=False)
class Adapter:
    """A LoRA adapter loaded for per-request use: the runtime's tensors, checked against the model."""

    name: str
    path: str
    key: str  # name and file version: what decoder slots and the prompt cache tell apart
    scale: float
    rank: int
    # "model.layers.{i}.self_attn.q_proj" -> (lora_a [in, r], lora_b [r, out]) as the runtime loaded them
    modules: dict[str, tuple[Any, Any]] = field(repr=False)

    def blocks(self) -> set[int]:
        return {block_index(name) for name in self.modules}


@dataclass(frozen=True)
class AdapterFacts:
    """What a listing shows of an adapter folder (read from its config; weights not loaded)."""

    name: str
    path: str
    fine_tune_type: str | None = None
    rank: int | None = None
    scale: float | None = None
    num_layers: int | None = None
    keys: list[str] | None = None
    problem: str | None = None  # why it cannot be used, when that shows without loading it

    def describe(self) -> dict:
        return {k: v for k, v in self.__dict__.items() if v is not None or k == "problem"}


def find_adapter(adapter_path: str | None, is_default: bool = False) -> Path | None:
    """The ADAPTER_PATH directory (the default adapter), or None when none is configured or it is absent.

    An absent directory means requests that name no adapter get the base model. For the default
    path that is the usual case on most machines, said once at info level; a path the user
    chose and that is missing is a warning. Whether it is a valid adapter is checked when the
    registry loads it at start-up (`AdapterRegistry.load_default`).
    """
    if not adapter_path:
        return None
    path = Path(adapter_path).expanduser()
    if not path.exists():
        if is_default:
            log.info("no adapter at the default ADAPTER_PATH (%s): serving the base model", path)
        else:
            log.warning("ADAPTER_PATH=%s does not exist: serving the base model without an adapter", path)
        return None
    if not path.is_dir():
        raise ModelLoadError(f"ADAPTER_PATH={path} is not a directory")
    return path


def read_config(path: Path) -> dict:
    try:
        config = json.loads((path / CONFIG_FILE).read_text())
    except (OSError, ValueError) as exc:
        raise BrokenAdapter(f"{CONFIG_FILE} is not valid JSON ({exc})") from exc
    if not isinstance(config, dict):
        raise BrokenAdapter(f"{CONFIG_FILE} is not a JSON object")
    return config


def lora_settings(config: dict) -> tuple[float, int, int, list[str] | None]:
    """(scale, rank, num_layers, keys) of a plain LoRA adapter's config; BrokenAdapter otherwise."""
    kind = config.get("fine_tune_type", "lora")
    if kind != "lora":
        raise BrokenAdapter(
            f"fine_tune_type {kind!r} cannot be applied per request (only 'lora': DoRA and full fine-tunes "
            "change the weights themselves); fuse it into a model with `mlx_lm.fuse` and serve that"
        )
    try:
        params = config["lora_parameters"]
        scale, rank, num_layers = float(params["scale"]), int(params["rank"]), int(config["num_layers"])
        if not math.isfinite(scale) or rank < 1:
            raise ValueError(
                f"lora_parameters.scale {scale} and .rank {rank} (needs a finite scale and a rank of at least 1)"
            )
        keys = params.get("keys")
        if keys is not None and not (isinstance(keys, list) and all(isinstance(k, str) for k in keys)):
            raise ValueError("lora_parameters.keys is not a list of names")
    except (KeyError, TypeError, ValueError) as exc:
        raise BrokenAdapter(f"{CONFIG_FILE} lacks {exc} (needs num_layers, lora_parameters.rank and .scale)") from exc
    return scale, rank, num_layers, keys


def check_modules(
    config: dict, tensors: dict[str, Any], linears: dict[str, tuple[int, int]], blocks: int
) -> dict[str, tuple[Any, Any]]:
    """An adapter's tensors as {module: (lora_a, lora_b)}, accepting exactly what mlx-lm's loader
    accepts: LoRA pairs only, for the configured keys of the last `num_layers` blocks, with
    shapes that fit the model's Linear layers (`linears`: module name -> (in, out))."""
    _, _, num_layers, keys = lora_settings(config)
    pairs: dict[str, dict[str, Any]] = {}
    for name, tensor in tensors.items():
        module, _, leaf = name.rpartition(".")
        if leaf not in ("lora_a", "lora_b"):
            raise BrokenAdapter(
                f"tensor {name!r} is not a LoRA parameter (DoRA's magnitudes are not supported per request)"
            )
        pairs.setdefault(module, {})[leaf] = tensor
    first_adapted = 0 if num_layers < 0 else max(blocks - num_layers, 0)
    problems, modules = [], {}
    for module_name, pair in sorted(pairs.items()):
        shape = linears.get(module_name)
        block = block_index(module_name)
        if shape is None or block is None:
            problems.append(f"{module_name}: no such Linear layer in the model")
            continue
        if block < first_adapted:
            problems.append(f"{module_name}: block {block} is outside the last num_layers={num_layers} blocks")
            continue
        if keys is not None and module_name.split(f".{block}.", 1)[1] not in keys:
            problems.append(f"{module_name}: not among lora_parameters.keys")
            continue
        if set(pair) != {"lora_a", "lora_b"}:
            problems.append(f"{module_name}: needs both lora_a and lora_b")
            continue
        a, b = pair["lora_a"], pair["lora_b"]
        (n_in, n_out) = shape
        if (
            len(a.shape) != 2
            or len(b.shape) != 2
            or a.shape[0] != n_in
            or b.shape[1] != n_out
            or a.shape[1] != b.shape[0]
        ):
            problems.append(
                f"{module_name}: lora_a {tuple(a.shape)} / lora_b {tuple(b.shape)} "
                f"do not fit a Linear ({n_in} -> {n_out})"
            )
            continue
        modules[module_name] = (a, b)
    if problems:
        raise BrokenAdapter("does not fit the model (trained for another base?):\n  " + "\n  ".join(problems))
    if not modules:
        raise BrokenAdapter(f"{WEIGHTS_FILE} holds no LoRA tensors")
    return modules


def block_index(module_name: str) -> int | None:
    parts = module_name.split(".")
    for i, part in enumerate(parts[:-1]):
        if part == "layers" and parts[i + 1].isdigit():
            return int(parts[i + 1])
    return None


def _version(path: Path) -> str:
    """Changes when either file is replaced or rewritten."""
    stats = [(path / name).stat() for name in (CONFIG_FILE, WEIGHTS_FILE)]
    return "-".join(f"{s.st_mtime_ns:x}.{s.st_size:x}" for s in stats)


class AdapterRegistry:
    """The adapters a server offers: the folders of ADAPTERS_DIR, plus the ADAPTER_PATH one
    (the default for requests that name none), and up to `max_loaded` of them loaded (LRU).

    `load_tensors(path)` reads a weights file into the runtime's tensors; `linears` gives the
    model's Linear layers' (in, out) by module name, which every adapter is checked against.
    Thread-safe: handlers load adapters on a thread pool, never on the event loop.
    """

    def __init__(
        self,
        directory: str | None,
        default: Path | None,
        *,
        load_tensors: Callable[[Path], dict],
        linears: dict[str, tuple[int, int]],
        blocks: int,
        max_loaded: int = 8,
    ):
        self.directory = Path(directory).expanduser() if directory else None
        self.default_path = default
        self.default_name = default.name if default is not None else None
        self.max_loaded = max(max_loaded, 1)
        self._load_tensors = load_tensors
        self._linears = linears
        self._blocks = blocks
        self._loaded: OrderedDict[str, Adapter] = OrderedDict()  # name -> adapter, least recently used first
        self._lock = threading.Lock()

    # -- discovery ---------------------------------------------------------------------------

    def available(self) -> list[AdapterFacts]:
        """Every adapter there is now, by name: the default first, then ADAPTERS_DIR's folders."""
        found = {}
        if self.default_path is not None and self.default_path.is_dir():
            found[self.default_name] = self.default_path
        for path in self._folders():
            found.setdefault(path.name, path)
        return [self._facts(name, path) for name, path in found.items()]

    def _folders(self) -> list[Path]:
        if self.directory is None or not self.directory.is_dir():
            return []
        root = self.directory.resolve()
        try:
            entries = sorted(os.scandir(root), key=lambda e: e.name)
        except OSError:
            return []
        out = []
        for entry in entries:
            path = Path(entry.path)
            if (
                ADAPTER_NAME.fullmatch(entry.name)
                and path.is_dir()
                and _inside(path, root)
                and (path / CONFIG_FILE).is_file()
                and (path / WEIGHTS_FILE).is_file()
            ):
                out.append(path)
        return out

    def _facts(self, name: str, path: Path) -> AdapterFacts:
        """Its config's facts, as checked (a config that cannot work shows why instead)."""
        try:
            config = read_config(path)
        except BrokenAdapter as exc:
            return AdapterFacts(name, str(path), problem=str(exc))
        try:
            scale, rank, num_layers, keys = lora_settings(config)
        except BrokenAdapter as exc:
            kind = config.get("fine_tune_type")
            return AdapterFacts(
                name, str(path), fine_tune_type=kind if isinstance(kind, str) else None, problem=str(exc)
            )
        return AdapterFacts(name, str(path), "lora", rank, scale, num_layers, keys)

    def path_of(self, name: str) -> Path:
        """The folder a request's adapter name stands for; UnknownAdapter or InvalidAdapterName if none."""
        if name == self.default_name and self.default_path is not None:
            if not self.default_path.is_dir():
                raise UnknownAdapter(f"adapter {name!r} (ADAPTER_PATH={self.default_path}) is gone")
            return self.default_path
        if not ADAPTER_NAME.fullmatch(name) or name in (".", ".."):
            raise InvalidAdapterName(
                "adapter names are folder names in ADAPTERS_DIR (letters, digits, . _ + -, at most 128); "
                f"{name!r} is not one"
            )
        if self.directory is None:
            raise UnknownAdapter(f"no adapter {name!r}: no ADAPTERS_DIR is set")
        if not self.directory.is_dir():
            raise UnknownAdapter(f"no adapter {name!r}: ADAPTERS_DIR ({self.directory}) does not exist")
        root = self.directory.resolve()
        path = root / name
        if not path.exists():
            raise UnknownAdapter(f"no adapter {name!r} in ADAPTERS_DIR ({self.directory})")
        if not _inside(path, root):
            raise InvalidAdapterName(
                f"adapter {name!r}, or a file in it, leads out of ADAPTERS_DIR ({self.directory}): refused"
            )
        if not path.is_dir():
            raise BrokenAdapter(f"adapter {name!r} ({path}) is not a folder")
        return path

    # -- loading -----------------------------------------------------------------------------

    def get(self, name: str) -> Adapter:
        """The adapter of that name, loaded (blocking: from the LRU, or read and checked now)."""
        path = self.path_of(name)
        try:
            missing = [f for f in (CONFIG_FILE, WEIGHTS_FILE) if not (path / f).is_file()]
            if missing:
                raise BrokenAdapter(f"{', '.join(missing)} missing: not an mlx-lm LoRA adapter")
            key = f"{name}@{_version(path)}"
            with self._lock:
                cached = self._loaded.get(name)
                if cached is not None and cached.key == key:
                    self._loaded.move_to_end(name)
                    return cached
            # Read without the lock: the event loop takes it to list the loaded adapters. Two
            # requests may read the same new adapter at once; the second insert wins, harmlessly.
            adapter = self._read(name, path, key)
            with self._lock:
                self._loaded[name] = adapter
                self._loaded.move_to_end(name)
                while len(self._loaded) > self.max_loaded:
                    evicted, _ = self._loaded.popitem(last=False)
                    log.info("adapter %s unloaded (MAX_ADAPTERS=%d)", evicted, self.max_loaded)
            return adapter
        except BrokenAdapter as exc:
            raise BrokenAdapter(f"adapter {name!r} ({path}) cannot be used: {exc}") from None
        except OSError as exc:
            raise BrokenAdapter(f"adapter {name!r} ({path}) cannot be read: {exc}") from None

    def _read(self, name: str, path: Path, key: str) -> Adapter:
        config = read_config(path)
        scale, rank, _, _ = lora_settings(config)
        try:
            tensors = self._load_tensors(path / WEIGHTS_FILE)
        except Exception as exc:  # the safetensors readers raise their own kinds
            raise BrokenAdapter(f"{WEIGHTS_FILE} cannot be read ({exc})") from exc
        modules = check_modules(config, tensors, self._linears, self._blocks)
        ranks = {a.shape[1] for a, _ in modules.values()}
        log.info(
            "adapter %s loaded from %s (%d layers, rank %s)",
            name,
            path,
            len(modules),
            "/".join(map(str, sorted(ranks))),
        )
        return Adapter(name, str(path), key, scale, max(ranks), modules)

    def load_default(self) -> None:
        """Load the ADAPTER_PATH adapter, if there is one, at start-up: one that is not a valid
        adapter stops the start (serving the base model silently would hide a broken fine-tune)."""
        if self.default_name is None:
            return
        try:
            self.get(self.default_name)
        except AdapterError as exc:
            raise ModelLoadError(f"ADAPTER_PATH={self.default_path}: {exc}") from exc

    def loaded(self) -> list[str]:
        with self._lock:
            return list(self._loaded)


def _inside(path: Path, root: Path) -> bool:
    """Whether `path`, links followed, lies inside `root` (a link out of the directory does not),
    and so do its config and weights files (a file linked from elsewhere would be read, and its
    values shown in errors)."""
    try:
        folder = path.resolve()
        return folder.parent == root and all(
            root in (folder / name).resolve().parents for name in (CONFIG_FILE, WEIGHTS_FILE)
        )
    except (OSError, RuntimeError):
        return False


class SlotTable:
    """Which adapter each of a decoder's `size` adapter slots holds, and how many running
    sequences use it. The engine never runs more distinct adapters at once than there are slots,
    so `acquire` always finds one: the adapter's own, else a free one, else the least recently
    used one no sequence uses (whose contents the caller then overwrites)."""

    def __init__(self, size: int):
        self.size = size
        self.keys: list[str | None] = [None] * size
        self.users = [0] * size
        self.used = [0] * size  # when each slot was last acquired (a counter)
        self._clock = 0

    def acquire(self, key: str) -> tuple[int, bool]:
        """(slot, whether its contents must be written) for a sequence using adapter `key`."""
        self._clock += 1
        if key in self.keys:
            slot, fresh = self.keys.index(key), False
        else:
            idle = [i for i in range(self.size) if self.users[i] == 0]
            if not idle:
                raise RuntimeError(f"all {self.size} adapter slots are in use")
            slot, fresh = min(idle, key=lambda i: (self.keys[i] is not None, self.used[i])), True
            self.keys[slot] = key
        self.users[slot] += 1
        self.used[slot] = self._clock
        return slot, fresh

    def release(self, slot: int) -> None:
        self.users[slot] -= 1

    def active(self) -> bool:
        return any(self.users)


def block_count(model) -> int:
    """How many blocks a transformers causal LM has (what `num_layers` counts from the end of)."""
    inner = getattr(model, "model", model)
    return len(getattr(inner, "layers", []))
