"""MLX and Torch on the same checkpoint: identical greedy ids, with and without a LoRA adapter."""

from __future__ import annotations

import json
import logging

import numpy as np
import pytest
from conftest import write_mlx_adapter

from backends.choose import load_backend
from backends.contract import LoadOptions, ModelLoadError, Sampling, Sequence

PROMPTS = ["The quick brown", "Once upon", "日本語の", "Hello world", "def f(x):\n", "zq"]


def greedy_ids(backend, prompt: str, n: int, adapter=None) -> list[int]:
    """n greedy token ids through the backend's own decoder, end-of-text ignored."""
    decoder = backend.decoder()
    decoder.add(Sequence(1, backend.encode(prompt), Sampling(), n, adapter=adapter))
    ids = []
    while len(ids) < n:
        ids += decoder.step().get(1, [])
    ids = ids[:n]
    decoder.remove(1)
    return ids


@pytest.mark.parametrize("prompt", PROMPTS)
def test_greedy_ids_match_across_runtimes(torch_backend, mlx_backend, prompt):
    assert torch_backend.encode(prompt) == mlx_backend.encode(prompt)
    assert greedy_ids(torch_backend, prompt, 60) == greedy_ids(mlx_backend, prompt, 60)


def default_adapter(backend):
    """The ADAPTER_PATH adapter, which requests that name none get (the HTTP layer chooses it)."""
    return backend.adapters.get(backend.adapters.default_name)


@pytest.mark.parametrize("prompt", PROMPTS)
def test_greedy_ids_match_across_runtimes_with_the_adapter(adapted_backends, prompt):
    torch_ids = greedy_ids(adapted_backends["torch"], prompt, 60, default_adapter(adapted_backends["torch"]))
    assert torch_ids == greedy_ids(adapted_backends["mlx"], prompt, 60, default_adapter(adapted_backends["mlx"]))


def test_the_adapter_changes_the_output(adapted_backends, torch_backend, mlx_backend):
    base = [greedy_ids(torch_backend, p, 30) for p in PROMPTS]
    for backend in adapted_backends.values():
        assert [greedy_ids(backend, p, 30, default_adapter(backend)) for p in PROMPTS] != base
        assert [greedy_ids(backend, p, 30) for p in PROMPTS] == base  # unmerged: the base model is still there
    assert base == [greedy_ids(mlx_backend, p, 30) for p in PROMPTS]


def test_merged_adapter_reproduces_mlx_lora_logits(tiny_path, adapter_path):
    # The tests' reference, W += scale * (A @ B).T on Torch, against mlx-lm's own LoRALinear computing x @ A @ B.
    import mlx.core as mx
    import torch
    from lora_reference import merge_lora_into_torch
    from mlx_lm import load as mlx_load
    from transformers import AutoModelForCausalLM

    merged = AutoModelForCausalLM.from_pretrained(tiny_path).eval()
    merge_lora_into_torch(merged, adapter_path)
    mlx_model, tokenizer = mlx_load(str(tiny_path), adapter_path=str(adapter_path))
    ids = tokenizer.encode("Once upon a time there was")
    with torch.inference_mode():
        torch_logits = merged(torch.tensor([ids])).logits[0].numpy()
    mlx_logits = np.array(mlx_model(mx.array([ids]))[0])
    assert np.abs(torch_logits - mlx_logits).max() < 1e-4


def test_adapter_is_reported_by_model_info(adapted_backends):
    for backend in adapted_backends.values():
        assert backend.info.adapter_applied is True


@pytest.mark.parametrize("runtime", ["torch", "mlx"])
def test_absent_adapter_serves_the_base_model_with_a_warning(tiny_path, tmp_path, caplog, runtime):
    with caplog.at_level(logging.WARNING):
        backend = load_backend(
            runtime, LoadOptions(model=str(tiny_path), adapter_path=str(tmp_path / "absent"), warmup=False)
        )
    assert backend.info.adapter_applied is False
    assert "does not exist" in caplog.text


def broken_adapters(tiny_path, root):
    """name -> adapter directory that exists but is not a valid adapter for the tiny model."""
    cases = {}
    cases["empty directory"] = root / "empty"
    cases["empty directory"].mkdir()

    cases["no weights"] = write_mlx_adapter(tiny_path, root / "no-weights")
    (cases["no weights"] / "adapters.safetensors").unlink()

    cases["bad json"] = write_mlx_adapter(tiny_path, root / "bad-json")
    (cases["bad json"] / "adapter_config.json").write_text("{not json")

    def rewrite(name, change):
        import mlx.core as mx

        path = write_mlx_adapter(tiny_path, root / name)
        weights = dict(mx.load(str(path / "adapters.safetensors")))
        change(weights)
        mx.save_safetensors(str(path / "adapters.safetensors"), weights)
        cases[name] = path

    def wrong_shape(weights):
        key = next(k for k in weights if k.endswith("fc1.lora_a"))
        weights[key] = weights[key][:-1]

    def missing_layer(weights):
        key = next(k for k in weights if k.endswith("q_proj.lora_a"))
        weights[key.replace("layers.1.", "layers.7.")] = weights[key]

    def not_adapted_layer(weights):  # num_layers=1 adapts only the last of the 2 blocks
        key = next(k for k in weights if ".layers.1." in k)
        weights[key.replace("layers.1.", "layers.0.")] = weights[key]

    rewrite("wrong shape", wrong_shape)
    rewrite("layer the model lacks", missing_layer)
    path = write_mlx_adapter(tiny_path, root / "outside num_layers", num_layers=1)
    import mlx.core as mx

    weights = dict(mx.load(str(path / "adapters.safetensors")))
    not_adapted_layer(weights)
    mx.save_safetensors(str(path / "adapters.safetensors"), weights)
    cases["outside num_layers"] = path
    return cases


@pytest.fixture(scope="module")
def broken(tiny_path, tmp_path_factory):
    return broken_adapters(tiny_path, tmp_path_factory.mktemp("broken"))


@pytest.mark.parametrize("runtime", ["torch", "mlx"])
@pytest.mark.parametrize(
    "case", ["empty directory", "no weights", "bad json", "wrong shape", "layer the model lacks", "outside num_layers"]
)
def test_broken_adapter_is_a_clear_startup_error(tiny_path, broken, runtime, case):
    with pytest.raises(ModelLoadError, match="ADAPTER_PATH"):
        load_backend(runtime, LoadOptions(model=str(tiny_path), adapter_path=str(broken[case]), warmup=False))


@pytest.mark.parametrize("runtime", ["torch", "mlx"])
def test_dora_and_full_fine_tunes_are_refused_with_what_to_do(tiny_path, tmp_path, runtime):
    # Neither is a low-rank product that can be added per request: `mlx_lm.fuse` makes a model of them.
    dora = write_mlx_adapter(tiny_path, tmp_path / "dora", dora=True)
    with pytest.raises(ModelLoadError, match="fine_tune_type 'dora' cannot be applied per request.*mlx_lm.fuse"):
        load_backend(runtime, LoadOptions(model=str(tiny_path), adapter_path=str(dora), warmup=False))
    full = write_mlx_adapter(tiny_path, tmp_path / "full")
    config = json.loads((full / "adapter_config.json").read_text())
    (full / "adapter_config.json").write_text(json.dumps({**config, "fine_tune_type": "full"}))
    with pytest.raises(ModelLoadError, match="fine_tune_type 'full' cannot be applied per request"):
        load_backend(runtime, LoadOptions(model=str(tiny_path), adapter_path=str(full), warmup=False))


def test_detokenizers_follow_one_convention(torch_backend, mlx_backend):
    # Leading spaces kept, split characters held back, special tokens skipped, and the
    # whole equals decode(ids), on both runtimes.
    text = " 日本 😀 and\n\ttabs  <|endoftext|> end 東"
    ids = torch_backend.encode(text)
    ids = ids + torch_backend.encode("京")[:1]  # stop inside a character
    expected = torch_backend.decode(ids)
    assert expected.startswith(" 日本") and expected.endswith("\ufffd")
    for backend in (torch_backend, mlx_backend):
        detokenizer = backend.detokenizer()
        pieces = [detokenizer.add(i) for i in ids]
        pieces.append(detokenizer.flush())
        assert "".join(pieces) == expected, backend.info.backend
        assert not any("\ufffd" in piece for piece in pieces[:-1])


@pytest.mark.parametrize("runtime", ["torch", "mlx"])
async def test_server_reports_and_serves_the_adapter(make_client, adapted_backends, adapter_path, request, runtime):
    backend = request.getfixturevalue(f"{runtime}_backend")
    adapted = await make_client(lambda: adapted_backends[runtime])
    info = await (await adapted.get("/model/info")).json()
    assert info["adapter_applied"] is True
    assert info["backend"] == runtime
    body = {"prompt": "Once upon", "max_tokens": 20, "ignore_eos": True}
    with_adapter = await (await adapted.post("/generate", json=body)).json()
    base = backend.decode(greedy_ids(backend, "Once upon", 20))
    assert with_adapter["text"] != base
    adapted_backend = adapted_backends[runtime]
    assert with_adapter["text"] == adapted_backend.decode(
        greedy_ids(adapted_backend, "Once upon", 20, default_adapter(adapted_backend))
    )
    assert with_adapter["adapter"] == adapter_path.name
