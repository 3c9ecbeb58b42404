"""K-quant GGUF files for the tests, written by the format's documented layout (gguf-py quantizes
Q5_0 and Q5_1 but not the K-quants): a simple quantizer per type, and a copy of a GGUF file with
its matrices in the types llama.cpp's Q4_K_M gives them."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType as T
from gguf import quants


def _halves(values: np.ndarray) -> np.ndarray:
    return values.astype(np.float16).view(np.uint8).reshape(*values.shape, 2)


def _k4_scales(sc: np.ndarray, m: np.ndarray) -> np.ndarray:
    """8 6-bit scales and minimums a super-block in their 12 bytes (ggml's get_scale_min_k4 inverse)."""
    out = np.zeros((*sc.shape[:-1], 12), np.uint8)
    out[..., 0:4] = (sc[..., :4] & 63) | ((sc[..., 4:] >> 4) << 6)
    out[..., 4:8] = (m[..., :4] & 63) | ((m[..., 4:] >> 4) << 6)
    out[..., 8:12] = (sc[..., 4:] & 0xF) | ((m[..., 4:] & 0xF) << 4)
    return out


def quantize_k(x: np.ndarray, kind) -> np.ndarray:
    """[rows, n] float32 (n a multiple of 256) as `kind` blocks (Q4_K, Q5_K, Q6_K): [rows, bytes]."""
    rows = x.shape[0]
    sb = x.astype(np.float32).reshape(rows, -1, 256)
    if kind == T.Q6_K:
        sub = sb.reshape(rows, -1, 16, 16)
        scale = np.abs(sub).max(-1) / 31
        d = np.maximum(scale.max(-1), 1e-30) / 127
        sc = np.clip(np.round(scale / d[..., None]), 0, 127).astype(np.int8)
        d16 = d.astype(np.float16).astype(np.float32)
        step = d16[..., None] * sc
        ratio = np.divide(sub, step[..., None], out=np.zeros_like(sub), where=step[..., None] > 0)
        q = np.clip(np.round(ratio) + 32, 0, 63)
        q = q.astype(np.uint8).reshape(rows, -1, 2, 4, 32)  # [half, s, l]: value 128 half + 32 s + l
        low = q & 0xF  # [rows, n, 2 halves, 4 s, 32]: s 0 and 1 in low nibbles, 2 and 3 in high ones
        ql = np.concatenate([low[:, :, :, 0] | (low[:, :, :, 2] << 4), low[:, :, :, 1] | (low[:, :, :, 3] << 4)], -1)
        qh = sum(((q[:, :, :, s] >> 4) & 3) << (2 * s) for s in range(4))  # [rows, n, 2, 32]
        parts = [ql.reshape(rows, -1, 128), qh.reshape(rows, -1, 64).astype(np.uint8), sc.view(np.uint8), _halves(d)]
        return np.concatenate(parts, -1).reshape(rows, -1)
    levels = 15 if kind == T.Q4_K else 31
    sub = sb.reshape(rows, -1, 8, 32)
    low = np.minimum(sub.min(-1), 0)
    scale = (sub.max(-1) - low) / levels
    d = np.maximum(scale.max(-1), 1e-30) / 63
    dmin = np.maximum((-low).max(-1), 1e-30) / 63
    d16, dmin16 = d.astype(np.float16).astype(np.float32), dmin.astype(np.float16).astype(np.float32)
    sc = np.clip(np.round(scale / d16[..., None]), 0, 63).astype(np.uint8)
    m = np.clip(np.round(-low / dmin16[..., None]), 0, 63).astype(np.uint8)
    step = (d16[..., None] * sc)[..., None]
    shifted = sub + (dmin16[..., None] * m)[..., None]
    q = np.clip(np.round(np.divide(shifted, step, out=np.zeros_like(sub), where=step > 0)), 0, levels).astype(np.uint8)
    pairs = q.reshape(rows, -1, 4, 2, 32)
    qs = ((pairs[:, :, :, 0] & 0xF) | ((pairs[:, :, :, 1] & 0xF) << 4)).reshape(rows, -1, 128)
    parts = [_halves(d), _halves(dmin), _k4_scales(sc, m)]
    if kind == T.Q5_K:
        parts.append(sum(((q[:, :, j] >> 4) & 1) << j for j in range(8)).astype(np.uint8))  # [rows, n, 32]
    parts.append(qs)
    return np.concatenate(parts, -1).reshape(rows, -1)


def q4_k_m_type(name: str, width: int):
    """The type llama.cpp's Q4_K_M gives a matrix: Q6_K for some layers' ffn_down and attn_v
    (here the even layers'), Q4_K else, Q5_0 where a row is not whole super-blocks."""
    if width % 256:
        return T.Q5_0
    layer = int(name.split(".")[1]) if name.startswith("blk.") else 0
    return T.Q6_K if (".ffn_down." in name or ".attn_v." in name) and layer % 2 == 0 else T.Q4_K


def k_quant_copy(source: Path, out: Path, floats: Path | None = None) -> Path:
    """`source` with its quantized matrices in Q4_K_M's types (`q4_k_m_type`), the embedding in
    Q6_K where it is whole super-blocks, everything else as it is; `floats`: the same values
    written as F32 (the reference the served blocks are compared with)."""
    import gguf

    reader = gguf.GGUFReader(str(source))
    architecture = reader.fields["general.architecture"].contents()
    writers = [gguf.GGUFWriter(str(path), architecture) for path in (out, floats) if path]
    for writer in writers:
        for field in reader.fields.values():
            if field.name == "general.architecture" or field.name.startswith("GGUF."):
                continue
            sub_type = field.types[-1] if len(field.types) > 1 else None
            writer.add_key_value(field.name, field.contents(), field.types[0], sub_type=sub_type)
    for tensor in reader.tensors:
        data = np.asarray(tensor.data)
        if len(tensor.shape) == 2 and tensor.tensor_type not in (T.F32, T.F16):
            values = quants.dequantize(data, tensor.tensor_type)
            kind = T.Q6_K if tensor.name == "token_embd.weight" else q4_k_m_type(tensor.name, values.shape[1])
            if kind == T.Q6_K and values.shape[1] % 256:
                kind = T.Q8_0
            blocks = quants.quantize(values, kind) if kind in (T.Q5_0, T.Q8_0) else quantize_k(values, kind)
            writers[0].add_tensor(tensor.name, blocks, raw_dtype=kind)
            if floats:
                writers[1].add_tensor(tensor.name, quants.dequantize(blocks, kind))
        else:
            for writer in writers:
                writer.add_tensor(tensor.name, data, raw_dtype=tensor.tensor_type)
    for writer in writers:
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
    return out
