"""Many LoRA adapters chosen per request, through the real app on both runtimes: each adapter's
greedy text equals the same adapter merged into a transformers reference; base and adapters
decode in one batch; folders come and go while the server runs; bad names and broken folders
get clear errors and leave the server serving."""

from __future__ import annotations

import asyncio
import json
import shutil
from pathlib import Path

import pytest
from conftest import engine_of, wait_until, write_mlx_adapter
from fakes import Gate, GatedBackend
from lora_reference import merge_lora_into_torch

from backends.choose import load_backend
from backends.contract import LoadOptions

ADAPTERS = {  # name -> how write_mlx_adapter makes it: different ranks, scales and depths
    "exp-a": dict(num_layers=2, rank=4, scale=2.0),
    "exp-b": dict(num_layers=1, rank=8, scale=3.0),
    "exp-c": dict(num_layers=2, rank=2, scale=4.0),
}
PROMPT = "Once upon a time"
N = 12
RUNTIMES = ["torch", "mlx"]


@pytest.fixture(scope="module")
def adapter_sources(tiny_path, tmp_path_factory) -> dict[str, Path]:
    """The adapters, made once; tests copy them into the folders they serve."""
    root = tmp_path_factory.mktemp("adapter-sources")
    return {name: write_mlx_adapter(tiny_path, root / name, **options) for name, options in ADAPTERS.items()}


@pytest.fixture(scope="module")
def adapters_dir(adapter_sources, tmp_path_factory) -> Path:
    """ADAPTERS_DIR of the module's backends: the three adapters (tests that add or remove
    folders put them back)."""
    root = tmp_path_factory.mktemp("experiments")
    for name, source in adapter_sources.items():
        shutil.copytree(source, root / name)
    return root


@pytest.fixture(scope="module")
def reference(tiny_path, adapters_dir):
    """Greedy ids of a transformers model with the adapter merged (None: the base model)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_path)
    cache = {}

    def greedy(adapter: Path | str | None, prompt: str = PROMPT, n: int = N) -> str:
        key = (str(adapter), prompt, n)
        if key not in cache:
            model = AutoModelForCausalLM.from_pretrained(tiny_path).eval()
            if adapter is not None:
                merge_lora_into_torch(model, adapters_dir / adapter if isinstance(adapter, str) else adapter)
            ids = tokenizer.encode(prompt, add_special_tokens=False)
            out = []
            with torch.inference_mode():
                for _ in range(n):
                    token = int(model(torch.tensor([ids + out])).logits[0, -1, : len(tokenizer)].argmax())
                    out.append(token)
            cache[key] = tokenizer.decode(out, skip_special_tokens=True)
        return cache[key]

    return greedy


@pytest.fixture(scope="module", params=RUNTIMES)
def runtime(request) -> str:
    return request.param


@pytest.fixture(scope="module")
def served_backend(runtime, tiny_path, adapters_dir):
    """A backend over ADAPTERS_DIR with two adapter slots (and at most two loaded)."""
    return load_backend(
        runtime, LoadOptions(model=str(tiny_path), adapters_dir=str(adapters_dir), dtype="float32", max_adapters=2)
    )


@pytest.fixture(params=[1, 4], ids=["batch1", "batch4"])
def max_batch(request) -> int:
    return request.param


def generate_body(adapter=None, **extra) -> dict:
    body = {"prompt": PROMPT, "max_tokens": N, "ignore_eos": True, **extra}
    if adapter is not None:
        body["adapter"] = adapter
    return body


async def generate(client, adapter=None, **extra) -> dict:
    response = await client.post("/generate", json=generate_body(adapter, **extra))
    assert response.status == 200, await response.text()
    return await response.json()


async def test_each_adapter_equals_it_merged_into_a_reference(make_client, served_backend, reference):
    client = await make_client(lambda: served_backend)
    for name in ADAPTERS:
        answer = await generate(client, name)
        assert answer["text"] == reference(name), name
        assert answer["adapter"] == name
    base = await generate(client)
    assert base["text"] == reference(None)
    assert base["adapter"] is None
    assert len({reference(name) for name in [None, *ADAPTERS]}) == 4  # the adapters do change the text


async def test_openai_routes_choose_the_adapter_by_model_name(make_client, served_backend, reference):
    client = await make_client(lambda: served_backend, served_model_name="phi-2")
    body = {"model": "phi-2:exp-b", "prompt": PROMPT, "max_tokens": N, "temperature": 0, "ignore_eos": True}
    answer = await (await client.post("/v1/completions", json=body)).json()
    assert answer["choices"][0]["text"] == reference("exp-b")
    assert answer["model"] == "phi-2:exp-b"
    streamed = await client.post("/v1/completions", json={**body, "stream": True})
    text = ""
    async for line in streamed.content:
        if line.startswith(b"data: {"):
            text += "".join(c["text"] for c in json.loads(line[6:])["choices"])
    assert text == reference("exp-b")
    chat = {"model": "phi-2:exp-a", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, "temperature": 0}
    response = await client.post("/v1/chat/completions", json=chat)
    assert response.status == 200 and (await response.json())["model"] == "phi-2:exp-a"


async def test_base_and_adapters_decode_together(make_client, served_backend, reference, max_batch):
    """Concurrent requests for the base model and two adapters: each gets its own text, decoded
    in one batch where the decoder batches (held after their first token until all are in; the
    prompt cache on: nothing leaks between them)."""
    gate = Gate(after=1)
    client = await make_client(lambda: GatedBackend(served_backend, gate))
    choices = [None, "exp-a", "exp-b", None, "exp-a", "exp-b"]
    requests = [asyncio.ensure_future(generate(client, name, max_tokens=3 * N)) for name in choices]
    await wait_until(lambda: gate.live == min(max_batch, len(choices)))
    gate.release()
    answers = await asyncio.gather(*requests)
    for name, answer in zip(choices, answers, strict=False):
        assert answer["text"] == reference(name, n=3 * N), name
    assert gate.peak == min(max_batch, len(choices))  # base and both adapters in one batch
    assert sum(a["cached_tokens"] > 0 for a in answers) <= 3  # a prefix is reused only by its own adapter


async def test_more_adapters_than_slots_wait_their_turn(make_client, served_backend, reference, max_batch):
    """Two slots, three adapters at once: the third waits in the queue until a slot is free
    (the first two are held meanwhile), and all three are right."""
    gate = Gate(after=1)
    client = await make_client(lambda: GatedBackend(served_backend, gate))
    engine = engine_of(client)
    requests = [asyncio.ensure_future(generate(client, name)) for name in ADAPTERS]
    running = min(max_batch, 2)  # two adapter slots
    await wait_until(lambda: gate.live == running and engine.waiting == len(ADAPTERS) - running)
    gate.release()
    answers = await asyncio.gather(*requests)
    assert [a["text"] for a in answers] == [reference(name) for name in ADAPTERS]
    assert gate.peak == running


async def test_loaded_adapters_are_bounded_least_recently_used_first(make_client, served_backend):
    client = await make_client(lambda: served_backend)
    for name in ["exp-a", "exp-b", "exp-c", "exp-b"]:
        await generate(client, name, max_tokens=1)
    info = await (await client.get("/model/info")).json()
    assert info["adapters"]["max_loaded"] == 2
    assert info["adapters"]["loaded"] == ["exp-c", "exp-b"]


async def test_adapters_are_listed_with_their_config(make_client, served_backend, adapters_dir):
    client = await make_client(lambda: served_backend, served_model_name="phi-2")
    models = (await (await client.get("/v1/models")).json())["data"]
    ids = [m["id"] for m in models]
    assert ids == ["phi-2", "phi-2:exp-a", "phi-2:exp-b", "phi-2:exp-c"]
    card = models[2]
    assert card["parent"] == "phi-2" and card["root"] == str(adapters_dir.resolve() / "exp-b")
    assert card["adapter"] | {} == {
        "name": "exp-b",
        "path": card["root"],
        "fine_tune_type": "lora",
        "rank": 8,
        "scale": 3.0,
        "num_layers": 1,
        "problem": None,
    }
    one = await (await client.get("/v1/models/phi-2:exp-c")).json()
    assert one["id"] == "phi-2:exp-c" and one["adapter"]["rank"] == 2
    missing = await client.get("/v1/models/phi-2:nope")
    assert missing.status == 404 and (await missing.json())["error"]["code"] == "model_not_found"
    info = await (await client.get("/model/info")).json()
    assert [a["name"] for a in info["adapters"]["available"]] == ["exp-a", "exp-b", "exp-c"]
    assert info["adapters"]["dir"] == str(adapters_dir)


async def test_folders_added_changed_and_removed_while_serving(
    make_client, served_backend, adapters_dir, adapter_sources, reference, tmp_path
):
    client = await make_client(lambda: served_backend, served_model_name="phi-2")
    new = adapters_dir / "exp-new"
    shutil.copytree(adapter_sources["exp-c"], new)
    try:
        ids = [m["id"] for m in (await (await client.get("/v1/models")).json())["data"]]
        assert "phi-2:exp-new" in ids
        assert (await generate(client, "exp-new"))["text"] == reference("exp-c")
        # Changed in place (another experiment's weights): the next request loads the new version.
        shutil.copy(adapter_sources["exp-b"] / "adapters.safetensors", new / "adapters.safetensors")
        shutil.copy(adapter_sources["exp-b"] / "adapter_config.json", new / "adapter_config.json")
        assert (await generate(client, "exp-new"))["text"] == reference("exp-b")
    finally:
        shutil.rmtree(new)
    ids = [m["id"] for m in (await (await client.get("/v1/models")).json())["data"]]
    assert "phi-2:exp-new" not in ids
    gone = await client.post("/generate", json=generate_body("exp-new"))
    assert gone.status == 422 and (await gone.json())["error"]["field"] == "adapter"


async def test_the_default_adapter_serves_requests_that_name_none(
    make_client, runtime, tiny_path, adapters_dir, reference
):
    backend = load_backend(
        runtime,
        LoadOptions(
            model=str(tiny_path),
            adapter_path=str(adapters_dir / "exp-a"),
            adapters_dir=str(adapters_dir),
            dtype="float32",
            warmup=False,
        ),
    )
    client = await make_client(lambda: backend, served_model_name="phi-2")
    info = await (await client.get("/model/info")).json()
    assert info["adapter_applied"] is True and info["adapters"]["default"] == "exp-a"
    assert (await generate(client))["text"] == reference("exp-a")
    assert (await generate(client, ""))["text"] == reference(None)  # "": the base model
    assert (await generate(client, "exp-b"))["text"] == reference("exp-b")
    body = {"prompt": PROMPT, "max_tokens": N, "temperature": 0, "ignore_eos": True}
    default = await (await client.post("/v1/completions", json={**body, "model": "phi-2"})).json()
    base = await (await client.post("/v1/completions", json={**body, "model": "phi-2:"})).json()
    assert default["choices"][0]["text"] == reference("exp-a")
    assert base["choices"][0]["text"] == reference(None)


@pytest.mark.parametrize("name", ["nope", "../exp-a", "exp-a/..", "/etc", ".", "..", ".hidden", "a" * 129, "exp a"])
async def test_names_that_are_not_adapters_are_refused(make_client, served_backend, name, max_batch):
    client = await make_client(lambda: served_backend, served_model_name="phi-2")
    native = await client.post("/generate", json=generate_body(name))
    assert native.status == 422
    assert (await native.json())["error"]["field"] == "adapter"
    openai = await client.post("/v1/completions", json={"model": f"phi-2:{name}", "prompt": PROMPT, "max_tokens": 2})
    assert openai.status in (400, 404)
    error = (await openai.json())["error"]
    assert error["param"] == "model"
    if name == "nope":
        assert openai.status == 404 and error["code"] == "model_not_found"
    assert (await generate(client, "exp-a", max_tokens=2))["adapter"] == "exp-a"


async def test_a_link_out_of_the_directory_is_refused(make_client, served_backend, adapters_dir, adapter_sources):
    link = adapters_dir / "linked"
    link.symlink_to(adapter_sources["exp-a"])  # a real adapter, but outside ADAPTERS_DIR
    try:
        client = await make_client(lambda: served_backend, served_model_name="phi-2")
        response = await client.post("/generate", json=generate_body("linked"))
        assert response.status == 422
        assert "out of ADAPTERS_DIR" in (await response.json())["error"]["message"]
        ids = [m["id"] for m in (await (await client.get("/v1/models")).json())["data"]]
        assert "phi-2:linked" not in ids
    finally:
        link.unlink()


@pytest.mark.parametrize("linked", ["adapter_config.json", "adapters.safetensors"])
async def test_a_file_linked_from_outside_the_directory_is_refused(
    make_client, served_backend, adapters_dir, adapter_sources, tmp_path, linked
):
    """A folder inside ADAPTERS_DIR whose config or weights are links to files elsewhere: not
    read (so nothing of the outside file shows in an error), not listed."""
    outside = tmp_path / linked
    if linked == "adapter_config.json":
        outside.write_text(
            json.dumps(
                {"fine_tune_type": "lora", "num_layers": 2, "lora_parameters": {"rank": "SECRET-VALUE", "scale": 1.0}}
            )
        )
    else:
        shutil.copy(adapter_sources["exp-a"] / linked, outside)
    folder = adapters_dir / "file-linked"
    shutil.copytree(adapter_sources["exp-a"], folder)
    (folder / linked).unlink()
    (folder / linked).symlink_to(outside)
    try:
        client = await make_client(lambda: served_backend, served_model_name="phi-2")
        response = await client.post("/generate", json=generate_body("file-linked"))
        message = (await response.json())["error"]["message"]
        assert response.status == 422 and "out of ADAPTERS_DIR" in message and "SECRET" not in message, message
        ids = [m["id"] for m in (await (await client.get("/v1/models")).json())["data"]]
        assert "phi-2:file-linked" not in ids
    finally:
        shutil.rmtree(folder)


def broken_folders(tiny_path: Path, root: Path) -> dict[str, tuple[Path, str]]:
    """name -> (a folder in ADAPTERS_DIR that is not a usable adapter, what the error says)."""
    import mlx.core as mx

    cases = {}
    path = write_mlx_adapter(tiny_path, root / "no-weights")
    (path / "adapters.safetensors").unlink()
    cases["no-weights"] = (path, "adapters.safetensors missing")
    path = write_mlx_adapter(tiny_path, root / "bad-json")
    (path / "adapter_config.json").write_text("{not json")
    cases["bad-json"] = (path, "not valid JSON")
    path = write_mlx_adapter(tiny_path, root / "wrong-shapes")
    weights = dict(mx.load(str(path / "adapters.safetensors")))
    key = next(k for k in weights if k.endswith("fc1.lora_a"))
    weights[key] = mx.zeros((weights[key].shape[0] + 1, weights[key].shape[1]))
    mx.save_safetensors(str(path / "adapters.safetensors"), weights)
    cases["wrong-shapes"] = (path, "do not fit")
    path = write_mlx_adapter(tiny_path, root / "dora", dora=True)
    cases["dora"] = (path, "fine_tune_type 'dora'")
    path = root / "not-safetensors"
    shutil.copytree(cases["bad-json"][0], path)
    (path / "adapter_config.json").write_text(
        json.dumps(ADAPTERS["exp-a"] | {"lora_parameters": {"rank": 4, "scale": 2.0}})
    )
    (path / "adapters.safetensors").write_bytes(b"not a safetensors file")
    cases["not-safetensors"] = (path, "cannot be read")
    return cases


async def test_a_broken_folder_fails_only_its_own_requests(
    make_client, served_backend, adapters_dir, tiny_path, tmp_path, reference
):
    client = await make_client(lambda: served_backend, served_model_name="phi-2")
    cases = broken_folders(tiny_path, tmp_path)
    try:
        for name, (path, reason) in cases.items():
            shutil.copytree(path, adapters_dir / name)
            response = await client.post("/generate", json=generate_body(name))
            assert response.status == 422, name
            error = (await response.json())["error"]
            assert (
                error["field"] == "adapter"
                and reason in error["message"]
                and str(adapters_dir / name) in error["message"]
            ), (name, error)
            openai = await client.post(
                "/v1/completions", json={"model": f"phi-2:{name}", "prompt": PROMPT, "max_tokens": 2}
            )
            assert openai.status == 400, name
            assert (await openai.json())["error"]["code"] == "invalid_adapter"
        listed = {m["id"]: m for m in (await (await client.get("/v1/models")).json())["data"]}
        assert listed["phi-2:bad-json"]["adapter"]["problem"]  # its config already says it cannot work
        assert "phi-2:no-weights" not in listed  # not an adapter folder at all
        assert (await generate(client, "exp-a"))["text"] == reference("exp-a")
    finally:
        for name in cases:
            shutil.rmtree(adapters_dir / name, ignore_errors=True)


async def test_the_request_log_names_the_adapter(make_client, served_backend, log_dir):
    client = await make_client(lambda: served_backend)
    await generate(client, "exp-c", max_tokens=1)
    await generate(client, max_tokens=1)
    await wait_until(
        lambda: (log_dir / "requests.log").exists() and len((log_dir / "requests.log").read_text().splitlines()) >= 2
    )
    records = [json.loads(line) for line in (log_dir / "requests.log").read_text().splitlines()]
    assert [r.get("adapter") for r in records if r["path"] == "/generate"] == ["exp-c", None]


@pytest.mark.parametrize(
    "config",
    [
        {
            "fine_tune_type": "lora",
            "num_layers": 2,
            "lora_parameters": {"rank": "8", "scale": 2.0},
        },  # a string rank: listed as the number it is
        {"fine_tune_type": "lora", "num_layers": 2, "lora_parameters": {"rank": 4, "scale": float("nan")}},
        {"fine_tune_type": "lora", "num_layers": 2, "lora_parameters": {"rank": 0, "scale": 2.0}},
        {"fine_tune_type": 7, "num_layers": 2, "lora_parameters": {"rank": 4, "scale": 2.0}},
        {"num_layers": "two", "lora_parameters": {"rank": 4, "scale": 2.0}},
        ["not", "an", "object"],
    ],
)
async def test_odd_configs_are_listed_as_the_schema_says(
    make_client, served_backend, adapters_dir, adapter_sources, config, max_batch
):
    """Whatever a config holds, the listing stays valid JSON in the documented shape."""
    from jsonschema import Draft202012Validator

    from phi2_server import answer_schemas

    folder = adapters_dir / "odd"
    shutil.copytree(adapter_sources["exp-a"], folder)
    (folder / "adapter_config.json").write_text(json.dumps(config))
    try:
        client = await make_client(lambda: served_backend, served_model_name="phi-2")
        response = await client.get("/v1/models")

        def refuse(constant):
            raise AssertionError(f"{constant} is not JSON")

        cards = {m["id"]: m for m in json.loads(await response.text(), parse_constant=refuse)["data"]}
        card = cards["phi-2:odd"]
        Draft202012Validator(answer_schemas()["Model"]).validate(card)
        usable = card["adapter"]["problem"] is None
        answer = await client.post("/generate", json=generate_body("odd", max_tokens=2))
        assert answer.status == (200 if usable else 422)
    finally:
        shutil.rmtree(folder)
