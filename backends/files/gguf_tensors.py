"""A GGUF file's tensor table, read from its header alone.

gguf's reader (GGUFReader) parses every metadata array element into objects: 33 s for Qwen2.5's
151,936-token vocabulary on 2 cores. transformers' fast reader refuses the tensor types it does not
dequantize (Q5_0, Q5_1). This reads what loading needs, the architecture and each tensor's name,
shape, type and place, skipping the metadata's values by their sizes.
"""

from __future__ import annotations

import struct
from math import prod
from pathlib import Path
from typing import NamedTuple

import numpy as np

_SCALAR = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9


class Tensor(NamedTuple):
    name: str
    shape: tuple[int, ...]  # torch's order: [rows, row values] for a matrix
    ggml_type: int
    start: int  # from the file's start
    nbytes: int


class Header(NamedTuple):
    architecture: str | None
    tensors: list[Tensor]


def read(file: Path | str) -> Header:
    """The file's architecture and tensor table. Raises ValueError for a file that is not GGUF."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    blob = np.memmap(file, mode="r", dtype=np.uint8)
    if bytes(blob[:4]) != b"GGUF":
        raise ValueError(f"{file} is not a GGUF file")
    version, count, fields = struct.unpack_from("<IQQ", blob, 4)
    if version not in (2, 3):
        raise ValueError(f"{file} is GGUF version {version}")
    pos, wanted = 24, {}
    for _ in range(fields):
        key, pos = _string(blob, pos)
        (kind,) = struct.unpack_from("<I", blob, pos)
        if key in ("general.architecture", "general.alignment") and kind == _STRING:
            wanted[key] = _string(blob, pos + 4)[0]
        elif key in ("general.architecture", "general.alignment") and kind in _SCALAR:
            wanted[key] = struct.unpack_from(_SCALAR[kind], blob, pos + 4)[0]
        pos = _skip(blob, pos + 4, kind)
    table = []
    for _ in range(count):
        name, pos = _string(blob, pos)
        (dims,) = struct.unpack_from("<I", blob, pos)
        shape = struct.unpack_from(f"<{dims}Q", blob, pos + 4)
        ggml_type, offset = struct.unpack_from("<IQ", blob, pos + 4 + 8 * dims)
        pos += 4 + 8 * dims + 12
        table.append((name, tuple(reversed(shape)), ggml_type, offset))
    alignment = int(wanted.get("general.alignment", 32))
    data = -(-pos // alignment) * alignment
    tensors = []
    for name, shape, ggml_type, offset in table:
        try:
            block, size = GGML_QUANT_SIZES[GGMLQuantizationType(ggml_type)]
        except (ValueError, KeyError):
            block, size = 1, 0  # a type gguf does not know: its size is not needed to refuse it
        tensors.append(Tensor(name, shape, ggml_type, data + offset, prod(shape) // block * size))
    return Header(wanted.get("general.architecture"), tensors)


def _string(blob, pos: int) -> tuple[str, int]:
    (length,) = struct.unpack_from("<Q", blob, pos)
    return bytes(blob[pos + 8 : pos + 8 + length]).decode("utf-8", errors="replace"), pos + 8 + length


def _skip(blob, pos: int, kind: int) -> int:
    """The position after a value of `kind` at `pos`."""
    if kind == _STRING:
        (length,) = struct.unpack_from("<Q", blob, pos)
        return pos + 8 + length
    if kind == _ARRAY:
        item, n = struct.unpack_from("<IQ", blob, pos)
        pos += 12
        if item in _SCALAR:
            return pos + n * struct.calcsize(_SCALAR[item])
        for _ in range(n):
            pos = _skip(blob, pos, item)
        return pos
    return pos + struct.calcsize(_SCALAR[kind])
