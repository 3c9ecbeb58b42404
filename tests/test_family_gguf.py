"""GGUF files of the families, written as llama.cpp writes them (tests/gguf_writer.py), served through
the server's own path (PHI2_MODEL=<the .gguf>) on both runtimes and held to the checkpoint they
were written from: a float32 file equal to it (logits, 20 greedy steps), a Q8_0 file served in
its blocks (Torch: the compiled CPU step; MLX: QuantizedLinear) and close to it.

The tiny Gemma 3 here has query_pre_attn_scalar = head_dim, as the published 270M-12B have: a
GGUF does not store it, and llama.cpp (and so the conversion, `llama_cpp_rules`) takes
1/sqrt(head_dim) but for the 27B.
"""

from __future__ import annotations

import pytest
import torch
from gguf_writer import write_gguf
from test_families import prompt_of, reference_steps

from backends.choose import load_backend
from backends.contract import LoadOptions, Sampling, Sequence
from backends.decoding.drive import drive
from backends.files.gguf_shell import llama_cpp_rules
from backends.torch.decoder import BatchedDecoder
from backends.torch.quant.blocks import BlockWeight
from backends.torch.tiny import write_tiny_family

pytest.importorskip("gguf")
RUNTIMES = ["torch", "mlx"]


@pytest.fixture(scope="module")
def gemma(tiny_path, tmp_path_factory):
    """(checkpoint, its Torch backend, {type: its GGUF file})."""
    root = tmp_path_factory.mktemp("gemma-gguf")
    checkpoint = write_tiny_family(root / "gemma3", "gemma3_text", tiny_path, query_pre_attn_scalar=32)
    files = {kind: write_gguf(checkpoint, root / f"gemma3-{kind}.gguf", kind) for kind in ("F32", "Q8_0")}
    backend = load_backend("torch", LoadOptions(model=str(checkpoint), dtype="float32", warmup=False))
    return checkpoint, backend, files


def first_logits(backend, prompt: list[int]) -> torch.Tensor:
    if backend.name == "torch":
        return BatchedDecoder(backend.decoder_weights, 1).logits_after(prompt)
    import mlx.core as mx
    import numpy as np

    return torch.from_numpy(np.array(backend.model(mx.array([prompt]))[0, -1].astype(mx.float32)))


def served(file, runtime: str, quantize: str = ""):
    if runtime == "mlx":
        pytest.importorskip("mlx_lm")
    return load_backend(runtime, LoadOptions(model=str(file), dtype="float32", quantize=quantize, warmup=False))


@pytest.mark.parametrize("runtime", RUNTIMES)
def test_a_float32_file_serves_as_its_checkpoint(gemma, runtime):
    _, checkpoint, files = gemma
    backend = served(files["F32"], runtime)
    text = "The quick brown fox jumps over the lazy dog. Numbers like 3.14159!"
    assert backend.encode(text) == checkpoint.encode(text)  # the file's byte-level vocabulary, read as such
    prompt = prompt_of(40)  # past the local layers' window (16)
    expected_ids, expected_logits = reference_steps(checkpoint, prompt, 20)
    got = first_logits(backend, prompt)
    rows = min(len(got), checkpoint.decoder_weights.decodable)  # llama.cpp cut the embedding to the tokenizer's
    scale = max(1.0, float(expected_logits[0].abs().max()))
    assert float((got[:rows] - expected_logits[0][:rows]).abs().max()) <= 1e-5 * scale
    assert drive(backend.decoder(1), [Sequence(1, prompt, Sampling(), 20)]).ids[1] == expected_ids
    sequences = [Sequence(i, prompt_of(n), Sampling(), 16) for i, n in enumerate([40, 9, 25])]
    together = drive(backend.decoder(3), sequences, arrive_at={2: 3}).ids
    assert together[0] == expected_ids[:16]
    for sequence in sequences[1:]:
        assert together[sequence.id] == reference_steps(checkpoint, sequence.prompt_ids, 16)[0]


@pytest.mark.parametrize("runtime", RUNTIMES)
def test_a_q8_0_file_is_served_in_its_blocks(gemma, runtime):
    _, checkpoint, files = gemma
    backend = served(files["Q8_0"], runtime)
    if runtime == "torch":
        weights = backend.decoder_weights
        assert all(isinstance(getattr(b, name), BlockWeight) for b in weights.layers for name in b.matrices())
        assert BatchedDecoder(weights, 1).network.cpu_step is not None  # Gemma's shape takes the compiled step
    else:
        assert backend.info.quantization["types"] == ["q8_0"]
    prompt = prompt_of(40)
    expected = first_logits(checkpoint, prompt)
    got = first_logits(backend, prompt)
    rows = min(len(got), checkpoint.decoder_weights.decodable)
    assert float((got[:rows] - expected[:rows]).norm() / expected[:rows].norm()) < 0.05
    sequences = [Sequence(i, prompt_of(n), Sampling(), 12) for i, n in enumerate([40, 9, 25])]
    together = drive(backend.decoder(3), sequences, arrive_at={2: 3}).ids
    for sequence in sequences:
        assert together[sequence.id] == drive(backend.decoder(1), [sequence]).ids[sequence.id]


def test_what_a_gemma3_file_leaves_to_llama_cpps_rules():
    small = {"num_hidden_layers": 26, "num_attention_heads": 4, "hidden_size": 1152, "head_dim": 256}
    assert llama_cpp_rules("gemma3", {}, small)["query_pre_attn_scalar"] == 256
    big = {"num_hidden_layers": 62, "num_attention_heads": 32, "hidden_size": 5376, "head_dim": 128}
    fields = {"gemma3.rope.scaling.type": "linear", "gemma3.rope.scaling.factor": 8.0, "gemma3.rope.freq_base": 1e6}
    rules = llama_cpp_rules("gemma3", fields, big)
    assert rules["query_pre_attn_scalar"] == 168
    assert rules["rope_parameters"]["full_attention"] == {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6}
    assert rules["rope_parameters"]["sliding_attention"] == {"rope_type": "default", "rope_theta": 10_000.0}
    assert llama_cpp_rules("llama", fields, big) == {}
