"""Phi-2's own GGUF files (llama.cpp's `phi2` architecture), which transformers' reader refuses:
backends/files/gguf_phi2.py converts them, and the file's Q8_0/Q4_0 blocks serve as they are stored.

The files are the tiny Phi checkpoint written as llama.cpp's convert_hf_to_gguf.py writes Phi-2
(its `Phi2Model`: a gpt2 vocabulary padded with `[PADn]` to the model's rows, q/k/v as separate
tensors, or fused as `attn_qkv` as in files converted from microsoft/phi-2's first checkpoint
format). The reference is the checkpoint itself: a float32 file must serve its logits, a
quantized file the logits of its own numbers dequantized.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from backends.choose import load_backend
from backends.contract import LoadOptions, Sampling, Sequence
from backends.decoding.drive import drive
from backends.files.gguf_phi2 import modules
from backends.torch.quant.blocks import file_matrices
from backends.torch.tiny import CORPUS

gguf = pytest.importorskip("gguf")

PROMPTS = ["Alice: What is two plus two?\nBob:", "Instruct: Write a short poem about the sea.\nOutput:"]


def phi2_gguf(checkpoint: Path, out: Path, qtype: str = "F32", fused: bool = False) -> Path:
    """The checkpoint as a phi2 GGUF file: its 2-D weights in `qtype` (F32, Q8_0 or Q4_0), norms
    and biases in F32, as llama.cpp's converter writes them."""
    from gguf import GGMLQuantizationType, GGUFWriter, TokenType, quants
    from safetensors.torch import load_file

    config = json.loads((checkpoint / "config.json").read_text())
    tokenizer = json.loads((checkpoint / "tokenizer.json").read_text())
    state = {name: tensor.float().numpy() for name, tensor in load_file(checkpoint / "model.safetensors").items()}
    heads, hidden = config["num_attention_heads"], config["hidden_size"]
    head_dim = hidden // heads
    rotary = config.get("partial_rotary_factor", config.get("rope_parameters", {}).get("partial_rotary_factor"))

    writer = GGUFWriter(str(out), "phi2")
    writer.add_name("tiny phi")
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(hidden)
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(config.get("num_key_value_heads") or heads)
    writer.add_layer_norm_eps(config["layer_norm_eps"])
    writer.add_rope_dimension_count(int(rotary * head_dim))
    vocab = {token: index for token, index in tokenizer["model"]["vocab"].items()}
    special = {added["content"]: added["id"] for added in tokenizer["added_tokens"]}
    vocab.update(special)
    by_id = {index: token for token, index in vocab.items()}
    tokens, types = [], []
    for index in range(config["vocab_size"]):
        if index not in by_id:
            tokens.append(f"[PAD{index}]")
            types.append(TokenType.UNUSED)
        else:
            tokens.append(by_id[index])
            types.append(TokenType.CONTROL if by_id[index] in special else TokenType.NORMAL)
    merges = [" ".join(merge) if isinstance(merge, list) else merge for merge in tokenizer["model"]["merges"]]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("gpt-2")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    writer.add_bos_token_id(config["bos_token_id"])
    writer.add_eos_token_id(config["eos_token_id"])
    writer.add_unk_token_id(config["eos_token_id"])
    writer.add_add_bos_token(False)

    kind = GGMLQuantizationType[qtype]
    names = {"output.weight"} | (
        {f"blk.{i}.attn_qkv.weight" for i in range(config["num_hidden_layers"])} if fused else set()
    )
    for module, (stem, rows) in modules(config, names).items():
        if rows is not None and rows.start:  # fused: written once, at q's turn
            continue
        for part in ("weight", "bias"):
            if f"{module}.{part}" not in state:
                continue
            values = state[f"{module}.{part}"]
            if rows is not None:
                values = np.concatenate(
                    [state[module.replace("q_proj", p) + f".{part}"] for p in ("q_proj", "k_proj", "v_proj")]
                )
            if values.ndim == 2 and kind != GGMLQuantizationType.F32:
                writer.add_tensor(f"{stem}.{part}", quants.quantize(values, kind), raw_dtype=kind)
            else:
                writer.add_tensor(f"{stem}.{part}", np.ascontiguousarray(values, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


def greedy(backend, prompts: list[str], n: int = 12) -> dict[int, list[int]]:
    """Greedy ids of the prompts decoded together (batched), by the backend's own decoder."""
    tokenizer = backend.text.tokenizer
    sequences = [
        Sequence(i, tokenizer.encode(p, add_special_tokens=False), Sampling(), n) for i, p in enumerate(prompts)
    ]
    return drive(backend.decoder(len(prompts)), sequences).ids


def logits(backend, prompt: str) -> torch.Tensor:
    from backends.torch.decoder import BatchedDecoder

    ids = backend.text.tokenizer.encode(prompt, add_special_tokens=False)
    return BatchedDecoder(backend.decoder_weights, 1).logits_after(ids, None)


@pytest.fixture(autouse=True)
def own_cache(cache_dir, tmp_path, monkeypatch):
    """Each test converts and stores its files in a cache of its own, not the session's (whose
    gguf folder other tests check stays empty)."""
    monkeypatch.setenv("PHI2_CACHE_DIR", str(tmp_path / "cache"))


@pytest.fixture(scope="module")
def reference(tiny_path, cache_dir):
    return load_backend("torch", LoadOptions(model=str(tiny_path), dtype="float32", quantize="none", warmup=False))


@pytest.mark.parametrize("fused", [False, True], ids=["q-k-v", "fused-qkv"])
def test_a_float_phi2_file_serves_the_checkpoints_numbers(tiny_path, cache_dir, tmp_path, reference, fused):
    file = phi2_gguf(tiny_path, tmp_path / "tiny-phi2.gguf", "F32", fused)
    served = load_backend("torch", LoadOptions(model=str(file), dtype="float32", warmup=False))
    assert served.info.quantization is None
    assert served.text.tokenizer.encode(CORPUS[0]) == reference.text.tokenizer.encode(CORPUS[0])
    assert served.text.tokenizer.eos_token_id == reference.text.tokenizer.eos_token_id
    for prompt in PROMPTS:
        torch.testing.assert_close(logits(served, prompt), logits(reference, prompt), rtol=1e-4, atol=1e-4)
    assert greedy(served, PROMPTS) == greedy(reference, PROMPTS)


@pytest.mark.parametrize(("qtype", "served_as"), [("Q8_0", "q8_0"), ("Q4_0", "q4_0"), ("Q5_0", "q5_0")])
@pytest.mark.parametrize("fused", [False, True], ids=["q-k-v", "fused-qkv"])
def test_a_quantized_phi2_file_serves_in_blocks(tiny_path, cache_dir, tmp_path, fused, qtype, served_as):
    """A Q8_0, Q4_0 or Q5_0 file's blocks are what the CPU multiplies (q, k and v cut from a
    fused matrix by rows).
    Either gives the logits of the file's numbers: those of the same file dequantized, within
    the kernels' error (they quantize activations to 8 bits: measured below 1% here)."""
    file = phi2_gguf(tiny_path, tmp_path / f"tiny-phi2-{qtype}.gguf", qtype, fused)
    served = load_backend("torch", LoadOptions(model=str(file), dtype="float32", warmup=False))
    assert served.info.quantization["method"] == "ggml-blocks"
    assert served.info.quantization["types"] == [served_as]
    floats = load_backend("torch", LoadOptions(model=str(file), dtype="float32", quantize="none", warmup=False))
    assert floats.info.quantization is None
    # The blocks taken from the file and the converted checkpoint read the same table alike.
    blocks = file_matrices(file, floats.model)
    parameters = dict(floats.model.named_parameters())
    assert len(blocks) == (2 + 6 * 2 if qtype == served_as.upper() else 0)  # the embedding, the head, 6 a layer
    for name, weight in blocks.items():
        assert torch.equal(weight.dequantize().float(), parameters[name]), name
    for prompt in PROMPTS:
        got, expected = logits(served, prompt), logits(floats, prompt)
        assert (got - expected).norm() / expected.norm() < 0.02, prompt
        assert int(got.argmax()) == int(expected.argmax()), prompt


@pytest.mark.parametrize("fused", [False, True], ids=["q-k-v", "fused-qkv"])
def test_mlx_keeps_a_phi2_files_blocks(tiny_path, cache_dir, tmp_path, fused):
    """On MLX, each Linear and the embedding hold the file's Q8_0 blocks (q, k and v cut from a
    fused matrix by rows), which dequantize to the converted checkpoint's matrices; the logits
    are those of the dequantized file, and Torch's."""
    pytest.importorskip("mlx_lm")
    import mlx.core as mx
    import mlx.nn as nn

    file = phi2_gguf(tiny_path, tmp_path / "tiny-phi2-q8_0.gguf", "Q8_0", fused)
    served = load_backend("mlx", LoadOptions(model=str(file)))
    floats = load_backend("mlx", LoadOptions(model=str(file), quantize="none"))
    assert served.info.quantization == {"method": "mlx-gguf", "types": ["q8_0"], "bits": 8, "group_size": 32}
    layers = {
        name: m
        for name, m in served.model.named_modules()
        if isinstance(m, (nn.QuantizedLinear, nn.QuantizedEmbedding))
    }
    assert len(layers) == 2 + 6 * 2, sorted(layers)
    by_name = dict(floats.model.named_modules())
    for name, layer in layers.items():
        values = mx.dequantize(layer.weight, layer.scales, layer.biases, group_size=layer.group_size, bits=layer.bits)
        assert mx.allclose(values, by_name[name].weight, rtol=1e-6, atol=1e-7).item(), name
    ids = served.tokenizer.encode(PROMPTS[0], add_special_tokens=False)
    got, expected = (np.array(backend.model(mx.array(ids)[None])[0, -1]) for backend in (served, floats))
    np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-4)
    # and Torch, on the same converted checkpoint, computes what MLX does
    torch_floats = load_backend("torch", LoadOptions(model=str(file), dtype="float32", quantize="none", warmup=False))
    np.testing.assert_allclose(logits(torch_floats, PROMPTS[0]).numpy(), expected, rtol=1e-3, atol=1e-3)


def test_a_phi2_file_chats_over_http(tiny_path, cache_dir, tmp_path):
    """The whole path a user takes: the file (fused q, k and v in Q4_0 blocks, no chat template,
    as Phi-2's files are) loaded by the server's own start, a chat through the openai SDK in base
    Phi-2's Alice/Bob format, ended where the next user turn would start."""
    import urllib.request

    import openai
    from conftest import LiveServer

    from phi2_server import Settings, create_app

    file = phi2_gguf(tiny_path, tmp_path / "tiny-phi2-q4_0.gguf", "Q4_0", fused=True)
    settings = Settings(
        model=str(file), backend="torch", dtype="float32", log_dir=str(tmp_path / "logs"), shutdown_grace=1.0
    )
    live = LiveServer(create_app(settings))
    try:
        sdk = openai.OpenAI(base_url=live.url + "/v1", api_key="unused", max_retries=0)
        with urllib.request.urlopen(live.url + "/model/info") as answer:
            assert json.load(answer)["quantization"]["method"] == "ggml-blocks"
        chat = sdk.chat.completions.create(
            model=str(file), messages=[{"role": "user", "content": "What is two plus two?"}], temperature=0
        )
        assert chat.choices[0].message.content == "Four."
        assert chat.choices[0].finish_reason == "stop"
    finally:
        live.close()


def test_a_phi2_file_missing_its_shape_is_a_clear_startup_error(cache_dir, tmp_path):
    from gguf import GGUFWriter

    from backends.contract import ModelLoadError

    file = tmp_path / "broken-phi2.gguf"
    writer = GGUFWriter(str(file), "phi2")
    writer.add_block_count(2)
    writer.add_tensor("token_embd.weight", np.zeros((16, 32), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ModelLoadError, match=r"lacks phi2\.context_length, phi2\.embedding_length"):
        load_backend("torch", LoadOptions(model=str(file), dtype="float32", warmup=False))


def test_a_phi2_files_next_start_maps_its_stored_blocks(tiny_path, cache_dir, tmp_path, caplog):
    """The second start of the same file builds no transformers model (backends/torch/stored_model.py)
    and decodes the same greedy tokens, batched, as the first."""
    file = phi2_gguf(tiny_path, tmp_path / "tiny-phi2-q8_0.gguf", "Q8_0", fused=True)
    first = load_backend("torch", LoadOptions(model=str(file), dtype="float32", warmup=False))
    with caplog.at_level("INFO"):
        second = load_backend("torch", LoadOptions(model=str(file), dtype="float32", warmup=False))
    assert "(no transformers model built)" in caplog.text
    assert type(second.model).__name__ == "StoredModel"
    assert greedy(second, PROMPTS) == greedy(first, PROMPTS)
