"""Quantized weights: MLX 4/8-bit (checkpoints and quantize-at-load), Torch int8/int4.

The tiny model memorized its corpus: at 8 bits greedy text on the memorized lines must be the
full-precision text, on both runtimes; at 4 bits the agreement is measured (docs/benchmark-log.md,
"Quantized weights"), and the model must still load, batch and stream.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from backends.choose import load_backend
from backends.contract import LoadOptions, ModelLoadError, Sampling, Sequence
from backends.decoding.drive import drive
from backends.torch.tiny import ascii_lines

ROOT = Path(__file__).resolve().parent.parent
QUANTIZE = {"torch": {8: "int8", 4: "int4"}, "mlx": {8: "8", 4: "4"}}


@pytest.fixture(scope="session")
def quantized(tiny_path):
    """Backends loaded with PHI2_QUANTIZE, per (runtime, bits), once per session."""
    loaded = {}

    def get(runtime: str, bits: int):
        if (runtime, bits) not in loaded:
            options = LoadOptions(model=str(tiny_path), dtype="float32", quantize=QUANTIZE[runtime][bits])
            loaded[runtime, bits] = load_backend(runtime, options)
        return loaded[runtime, bits]

    return get


def memorized(backend) -> list[tuple[list[int], list[int]]]:
    """(prompt ids, the rest of the line's ids) for each memorized line, cut after a few words,
    and after as many more as make the prompt begin no other line: two lines begin "Alice:", so
    the model's next token after it is a near-tie that its training on each CPU settles anew
    (seen on an AMD EPYC: a logit gap of 0.0008, which int8 flipped)."""
    lines = ascii_lines()
    cases = []
    for line in lines:
        cut = line.index(" ", 6) if " " in line[6:] else len(line) // 2  # the rest starts with its space, as trained
        while " " in line[cut + 1 :] and sum(other.startswith(line[:cut]) for other in lines) > 1:
            cut = line.index(" ", cut + 1)
        prompt, rest = backend.encode(line[:cut]), backend.encode(line[cut:])
        cases.append((prompt, rest))
    return cases


def greedy(backend, prompt: list[int], n: int, max_batch: int = 1) -> list[int]:
    return drive(backend.decoder(max_batch), [Sequence(1, prompt, Sampling(), n)]).ids[1]


@pytest.mark.parametrize("runtime", ["torch", "mlx"])
def test_8_bit_greedy_text_on_the_memorized_lines_is_the_full_precision_text(runtime, quantized, request):
    full = request.getfixturevalue(f"{runtime}_backend")
    eight = quantized(runtime, 8)
    checked = 0
    for prompt, rest in memorized(full):
        expected = greedy(full, prompt, len(rest))
        if expected != rest:  # the full-precision model does not finish this line from here
            continue
        assert greedy(eight, prompt, len(rest), max_batch=4) == expected, full.decode(prompt)
        checked += 1
    assert checked >= 6


def test_w8a8_greedy_text_on_the_memorized_lines_is_the_full_precision_text(torch_backend, tiny_path):
    """int8 activations too (fbgemm's dynamic linear), batched: the memorized lines as int8's."""
    w8a8 = load_backend("torch", LoadOptions(model=str(tiny_path), dtype="float32", quantize="w8a8"))
    assert w8a8.info.quantization == {"method": "torch-w8a8-fbgemm", "bits": 8, "group_size": None}
    checked = 0
    for prompt, rest in memorized(torch_backend):
        expected = greedy(torch_backend, prompt, len(rest))
        if expected != rest:
            continue
        assert greedy(w8a8, prompt, len(rest), max_batch=4) == expected, torch_backend.decode(prompt)
        checked += 1
    assert checked >= 6


def test_w8a8_scales_each_row_so_batched_equals_alone():
    """fbgemm scales a call's rows together; w8a8 gives each row its own scale, so a row's
    product is the same alone or beside a row of large values, and stays close to float32's."""
    import torch

    from backends.torch.quant.methods import Int8DynamicWeight

    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(96, 64, generator=generator) / 8
    rows = torch.randn(5, 64, generator=generator)
    rows[2] *= 1000  # one sequence's activations far larger than its neighbours'
    quantized = Int8DynamicWeight(weight)
    together = quantized.linear(rows)
    alone = torch.cat([quantized.linear(row[None]) for row in rows])
    assert torch.equal(together, alone)
    exact = rows @ weight.t()
    error = (together - exact).norm(dim=1) / exact.norm(dim=1)
    assert error.max() < 0.05, error  # one scale for the call: the small rows' error was ~100%


def test_w8a8_quantizes_the_output_head_and_frees_the_full_precision_one(tiny_path, tmp_path):
    from backends.torch import decoder as torch_decoder
    from backends.torch.quant.methods import Int8DynamicWeight
    from backends.torch.tiny import write_tiny_family

    untied = load_backend("torch", LoadOptions(model=str(tiny_path), dtype="float32", quantize="w8a8"))
    assert isinstance(untied.decoder_weights.quantized_head, Int8DynamicWeight)
    assert untied.model.lm_head.weight.numel() == 0
    tied_path = write_tiny_family(tmp_path / "llama", "llama", tiny_path)
    tied = load_backend(
        "torch", LoadOptions(model=str(tied_path), dtype="float32", quantize="w8a8", quantized_cache=False)
    )
    assert isinstance(tied.decoder_weights.quantized_head, Int8DynamicWeight)
    assert tied.model.lm_head.weight is tied.model.model.embed_tokens.weight  # the embedding, kept
    assert tied.model.model.embed_tokens.weight.numel() > 0
    int8 = load_backend("torch", LoadOptions(model=str(tiny_path), dtype="float32", quantize="int8"))
    assert int8.decoder_weights.quantized_head is None  # weight-only int8 keeps its head
    vocab, hidden = untied.model.config.vocab_size, untied.model.config.hidden_size
    head_saved = 4 * vocab * hidden - (vocab * hidden + 4 * vocab)  # float32 against int8 and a scale a row
    assert int8.info.extra["weight_bytes"] - untied.info.extra["weight_bytes"] == head_saved
    assert "w8a8" in torch_decoder.QUANTIZED_HEAD_METHODS


@pytest.mark.parametrize("runtime", ["torch", "mlx"])
def test_4_bit_serves_and_mostly_agrees(runtime, quantized, request):
    full = request.getfixturevalue(f"{runtime}_backend")
    four = quantized(runtime, 4)
    same = total = 0
    for prompt, rest in memorized(full):
        a, b = greedy(full, prompt, len(rest)), greedy(four, prompt, len(rest), max_batch=4)
        same += sum(x == y for x, y in zip(a, b, strict=False))
        total += len(rest)
    assert same / total > 0.5  # measured: docs/benchmark-log.md, "Quantized weights" (4-bit, tiny model)


@pytest.mark.parametrize("runtime", ["torch", "mlx"])
@pytest.mark.parametrize("bits", [8, 4])
def test_model_info_reports_the_quantization(runtime, bits, quantized, request):
    backend, full = quantized(runtime, bits), request.getfixturevalue(f"{runtime}_backend")
    info = backend.info.quantization
    assert info["bits"] == bits and info["method"].startswith(runtime)
    assert info["group_size"] in ((None,) if (runtime, bits) == ("torch", 8) else (32, 64, 128))
    assert backend.info.extra["weight_bytes"] < full.info.extra["weight_bytes"]
    assert full.info.quantization is None


@pytest.mark.parametrize("runtime", ["torch", "mlx"])
async def test_a_quantized_model_serves_batched_and_streamed(runtime, quantized, make_client):
    backend = quantized(runtime, 8)
    client = await make_client(lambda: backend, max_batch=4)
    info = await (await client.get("/model/info")).json()
    assert info["quantization"]["bits"] == 8
    bodies = [
        {"prompt": p, "max_tokens": 12, "ignore_eos": True}
        for p in ("The quick brown", "Once upon a time", "Water boils", "zq")
    ]
    results = await asyncio.gather(*(client.post("/generate", json=body) for body in bodies))
    texts = [(await r.json())["text"] for r in results]
    assert texts[0].startswith(" fox jumps over the lazy dog.")
    stream = await client.post("/generate/stream", json=bodies[1])
    lines = [json.loads(line) for line in (await stream.read()).splitlines()]
    assert "".join(line.get("token", "") for line in lines[:-1]) == texts[1]
    assert lines[-1]["tokens_used"] == 12


def test_torch_quantizes_the_fast_path_and_serves_it_at_any_batch_size(quantized):
    from backends.torch.decoder import BatchedDecoder
    from backends.torch.quant.methods import QuantizedWeight

    backend = quantized("torch", 8)
    assert isinstance(backend.decoder(1), BatchedDecoder)  # transformers' forward has no weights left
    assert all(
        isinstance(block.w_in, QuantizedWeight) and isinstance(block.w_out, QuantizedWeight)
        for block in backend.decoder_weights.layers
    )


# -- quantized once, mapped at the next start (backends/torch/quant/store.py) ----------------------------


def stored_files(cache: Path) -> list[Path]:
    return sorted((cache / "quantized").glob("*.pt"))


def load_quantized(tiny_path, method: str, **options):
    return load_backend("torch", LoadOptions(model=str(tiny_path), dtype="float32", quantize=method, **options))


@pytest.mark.parametrize("method", ["int8", "int4", "w8a8"])
def test_torch_stores_quantized_weights_once_and_the_next_start_maps_them(
    method, tiny_path, tmp_path, monkeypatch, caplog
):
    import transformers

    monkeypatch.setenv("PHI2_CACHE_DIR", str(tmp_path))
    first = load_quantized(tiny_path, method)
    [stored] = stored_files(tmp_path)
    assert method in stored.name

    # The next start never builds the full-precision model: from_pretrained would.
    def no_full_precision(*args, **kwargs):
        raise AssertionError("the stored quantized weights were not used")

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", no_full_precision)
    with caplog.at_level("INFO", logger="phi2_server.torch"):
        second = load_quantized(tiny_path, method)
    assert f"quantized weights mapped from {stored}" in caplog.text
    assert stored_files(tmp_path) == [stored]  # read, not written again
    assert second.info.quantization == first.info.quantization
    assert second.info.extra == first.info.extra  # parameters and weight bytes as quantized
    block = second.decoder_weights.layers[0]
    assert isinstance(block.w_in, type(first.decoder_weights.layers[0].w_in))
    assert type(second.decoder_weights.quantized_head) is type(first.decoder_weights.quantized_head)
    assert (
        block.norm1_w.untyped_storage().data_ptr()
        == dict(second.model.named_parameters())["model.layers.0.input_layernorm.weight"].untyped_storage().data_ptr()
    )  # the model's norms and the decoder's are one tensor again
    assert not any(p.is_meta for p in second.model.parameters())
    for prompt, rest in memorized(first)[:6]:
        assert greedy(second, prompt, len(rest), max_batch=4) == greedy(first, prompt, len(rest), max_batch=4)


def test_a_changed_checkpoint_gets_a_file_of_its_own(tiny_path, tmp_path, monkeypatch):
    import shutil

    checkpoint = tmp_path / "checkpoint"
    shutil.copytree(tiny_path, checkpoint)
    monkeypatch.setenv("PHI2_CACHE_DIR", str(tmp_path / "cache"))
    load_quantized(checkpoint, "int8", warmup=False)
    [weights] = [f for f in checkpoint.iterdir() if f.suffix == ".safetensors"]
    os.utime(weights, ns=(weights.stat().st_atime_ns, weights.stat().st_mtime_ns + 10**9))  # as a new download
    load_quantized(checkpoint, "int8", warmup=False)
    load_quantized(checkpoint, "int4", warmup=False)
    assert len(stored_files(tmp_path / "cache")) == 3


def test_a_broken_stored_file_is_quantized_again_and_replaced(tiny_path, tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("PHI2_CACHE_DIR", str(tmp_path))
    first = load_quantized(tiny_path, "int8")
    [stored] = stored_files(tmp_path)
    stored.write_bytes(stored.read_bytes()[:1000])  # cut short, as a full disk leaves it
    with caplog.at_level("WARNING"):
        again = load_quantized(tiny_path, "int8")
    assert "did not load" in caplog.text and "quantizing again" in caplog.text
    prompt, rest = memorized(first)[0]
    assert greedy(again, prompt, len(rest)) == greedy(first, prompt, len(rest))
    caplog.clear()
    with caplog.at_level("INFO"):
        load_quantized(tiny_path, "int8", warmup=False)
    assert "quantized weights mapped from" in caplog.text  # the rewritten file is whole


def test_quantized_cache_off_stores_nothing_and_an_unwritable_cache_is_no_error(
    tiny_path, tmp_path, monkeypatch, caplog
):
    monkeypatch.setenv("PHI2_CACHE_DIR", str(tmp_path / "off"))
    load_quantized(tiny_path, "int8", quantized_cache=False, warmup=False)
    assert not (tmp_path / "off").exists()
    (tmp_path / "a-file").write_text("")
    monkeypatch.setenv("PHI2_CACHE_DIR", str(tmp_path / "a-file"))  # a folder cannot be made under it
    with caplog.at_level("WARNING"):
        backend = load_quantized(tiny_path, "int8", warmup=False)
    assert "could not store the quantized weights" in caplog.text
    prompt, rest = memorized(backend)[0]
    assert len(greedy(backend, prompt, 4)) == 4


def test_the_setting_reaches_the_runtime():
    from phi2_server import Settings

    assert Settings.from_args([], {}).load_options().quantized_cache is True
    assert Settings.from_args([], {"QUANTIZED_CACHE": "0"}).load_options().quantized_cache is False


# -- adapters -------------------------------------------------------------------------------------


# MLX: tests/test_mlx_adapters.py decodes adapters over a quantized model against mlx-lm's own.


def test_torch_applies_adapters_over_quantized_weights(tiny_path, adapter_path, adapted_backends, quantized):
    from backends.torch.decoder import BatchedDecoder

    adapted = load_backend(
        "torch", LoadOptions(model=str(tiny_path), adapter_path=str(adapter_path), dtype="float32", quantize="int8")
    )
    assert adapted.info.adapter_applied and adapted.info.quantization["bits"] == 8
    # The logits are those of the adapted model (full precision, the same adapter), within
    # int8's error, and far from the quantized base model's. (Greedy text is no test: the random
    # adapter leaves near-ties that int8's error may flip.)
    reference = adapted_backends["torch"]
    prompt = adapted.encode("The quick brown")

    def logits(backend, adapter):
        return BatchedDecoder(backend.decoder_weights, 1).logits_after(prompt, adapter)[: len(reference.text.tokenizer)]

    expected = logits(reference, reference.adapters.get(adapter_path.name))
    to_adapted = (logits(adapted, adapted.adapters.get(adapter_path.name)) - expected).norm() / expected.norm()
    to_base = (logits(quantized("torch", 8), None) - expected).norm() / expected.norm()
    assert to_adapted < 0.05 and to_base > 10 * to_adapted


# -- checkpoints that mlx_lm.convert -q writes ------------------------------------------------------


@pytest.fixture(scope="session")
def mlx_quantized_checkpoints(tiny_path, tmp_path_factory):
    from mlx_lm import convert

    made = {}
    for bits, group_size in ((4, 32), (8, 64)):
        path = tmp_path_factory.mktemp(f"tiny-q{bits}") / "model"
        convert(str(tiny_path), mlx_path=str(path), quantize=True, q_bits=bits, q_group_size=group_size)
        made[bits, group_size] = path
    return made


def test_an_mlx_quantized_checkpoint_loads_and_serves(mlx_quantized_checkpoints, mlx_backend):
    for (bits, group_size), path in mlx_quantized_checkpoints.items():
        backend = load_backend("mlx", LoadOptions(model=str(path)))
        assert backend.info.quantization == {"method": "mlx-affine", "bits": bits, "group_size": group_size}
        sequences = [
            Sequence(i, backend.encode(p), Sampling(), 10) for i, p in enumerate(("The quick brown", "Once upon"))
        ]
        batched = drive(backend.decoder(4), sequences).ids
        assert all(len(ids) == 10 for ids in batched.values())
        if bits == 8:
            prompt = backend.encode("The quick brown")
            assert greedy(backend, prompt, 8) == greedy(mlx_backend, prompt, 8)


def test_torch_refuses_an_mlx_quantized_checkpoint_clearly(mlx_quantized_checkpoints):
    path = next(iter(mlx_quantized_checkpoints.values()))
    with pytest.raises(ModelLoadError, match="MLX-quantized.*PHI2_BACKEND=mlx"):
        load_backend("torch", LoadOptions(model=str(path)))


def test_quantizing_a_quantized_checkpoint_again_is_refused(mlx_quantized_checkpoints):
    path = next(iter(mlx_quantized_checkpoints.values()))
    with pytest.raises(ModelLoadError, match="already quantized.*PHI2_QUANTIZE"):
        load_backend("mlx", LoadOptions(model=str(path), quantize="8"))


# -- bad values ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "runtime, value", [("torch", "4"), ("torch", "int3"), ("mlx", "int8"), ("mlx", "3"), ("torch", "fp8")]
)
def test_an_unsupported_value_is_a_clear_error_naming_the_variable(tiny_path, runtime, value):
    with pytest.raises(ModelLoadError, match="PHI2_QUANTIZE must be one of"):
        load_backend(runtime, LoadOptions(model=str(tiny_path), quantize=value, warmup=False))


def test_the_server_exits_with_that_error(tiny_path, tmp_path):
    env = {
        **os.environ,
        "PHI2_MODEL": str(tiny_path),
        "PHI2_QUANTIZE": "int3",
        "PORT": "0",
        "LOG_DIR": str(tmp_path),
        "ADAPTER_PATH": "",
    }
    out = subprocess.run(
        [sys.executable, "phi2_server.py"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 1
    assert "PHI2_QUANTIZE must be one of int8, int4" in out.stderr
    assert "Traceback" not in out.stderr
