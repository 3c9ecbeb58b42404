"""Configuration, backend selection on faked platforms, model resolution, the CLI."""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import fields
from pathlib import Path

import pytest

from backends.choose import resolve_model, select_backend
from backends.contract import ModelLoadError
from phi2_server import Settings

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize(
    "requested, system, machine, mlx, expected",
    [
        ("auto", "Darwin", "arm64", True, "mlx"),
        ("auto", "Darwin", "arm64", False, "torch"),  # mlx-lm not installed
        ("auto", "Darwin", "x86_64", True, "torch"),  # Intel Mac: no MLX
        ("auto", "Linux", "x86_64", True, "torch"),  # MLX on Linux only when asked for
        ("auto", "Linux", "aarch64", True, "torch"),
        ("mlx", "Linux", "x86_64", True, "mlx"),
        ("torch", "Darwin", "arm64", True, "torch"),
    ],
)
def test_backend_selection(requested, system, machine, mlx, expected):
    assert select_backend(requested, system, machine, lambda: mlx) == expected


def test_unknown_backend_is_an_error():
    with pytest.raises(ValueError, match="PHI2_BACKEND"):
        select_backend("tensorflow")


def test_settings_come_from_environment_and_flags():
    env = {"PHI2_MODEL": "tiny", "PORT": "9001", "LOG_PROMPTS": "0", "PHI2_BACKEND": "torch"}
    settings = Settings.from_args([], env)
    assert (settings.model, settings.port, settings.log_prompts, settings.backend) == ("tiny", 9001, False, "torch")
    assert settings.host == "127.0.0.1"
    flags = Settings.from_args(["--port", "9002", "--host", "0.0.0.0"], env)
    assert (flags.port, flags.host) == (9002, "0.0.0.0")
    assert Settings.from_args([], {}).adapter_path == "~/ml-experiment/experiments/2026-05-04-0014"


def test_help_lists_every_environment_variable():
    out = subprocess.run([sys.executable, "phi2_server.py", "--help"], cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 0
    for env in [
        "PHI2_MODEL",
        "PHI2_BACKEND",
        "ADAPTER_PATH",
        "HOST",
        "PORT",
        "LOG_DIR",
        "PHI2_DTYPE",
        "PHI2_DEVICE",
        "MAX_BODY_BYTES",
    ]:
        assert env in out.stdout


def test_missing_directory_is_a_clear_error(tmp_path):
    with pytest.raises(ModelLoadError, match="PHI2_MODEL.*make demo"):
        resolve_model(str(tmp_path / "absent"))
    with pytest.raises(ModelLoadError, match="not a loadable checkpoint"):
        resolve_model(str(tmp_path))


def test_uncached_hub_model_is_a_clear_error():
    with pytest.raises(ModelLoadError, match="PHI2_MODEL='no-such-org/no-such-model'.*make demo"):
        resolve_model("no-such-org/no-such-model")


def write_gguf(path: Path, architecture: str, tensor_type: str = "F32") -> Path:
    """A GGUF file holding one tensor of the type and no other metadata than its architecture."""
    import numpy as np
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFWriter

    kind = GGMLQuantizationType[tensor_type]
    writer = GGUFWriter(str(path), architecture)
    writer.add_tensor("token_embd.weight", np.zeros((2, GGML_QUANT_SIZES[kind][1]), np.uint8), raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_gguf_files_that_are_not_served_are_clear_errors(tmp_path):
    with pytest.raises(ModelLoadError, match="GGUF architecture 'gpt2' is not served"):
        resolve_model(str(write_gguf(tmp_path / "gpt.gguf", "gpt2")))
    with pytest.raises(ModelLoadError, match="GGUF tensor type IQ2_XXS is not supported"):
        resolve_model(str(write_gguf(tmp_path / "iq.gguf", "llama", "IQ2_XXS")))
    with pytest.raises(ModelLoadError, match=r"holds 2 GGUF files \(gpt.gguf, iq.gguf\): name one"):
        resolve_model(str(tmp_path))
    with pytest.raises(ModelLoadError, match="no such GGUF file"):
        resolve_model(str(tmp_path / "absent.gguf"))
    (tmp_path / "weights.bin").write_bytes(b"not a gguf")
    with pytest.raises(ModelLoadError, match="not a readable GGUF file"):
        resolve_model(str(tmp_path / "weights.bin"))


def test_a_gguf_that_fails_to_convert_leaves_no_folder(tmp_path, cache_dir):
    # A llama file without the metadata transformers needs (its hyperparameters, its tokenizer).
    with pytest.raises(ModelLoadError, match="bare.gguf.: the GGUF file could not be converted"):
        resolve_model(str(write_gguf(tmp_path / "bare.gguf", "llama")))
    assert not any((cache_dir / "gguf").glob("*"))


def test_a_conversion_cut_short_leaves_no_half_folder(tmp_path, cache_dir, monkeypatch):
    import backends.files.models

    def half_written(file, folder, spec, architecture):
        folder.mkdir(parents=True)
        (folder / "config.json").write_text("{}")
        raise OSError("No space left on device")

    monkeypatch.setattr(backends.files.models, "check_gguf", lambda file, spec: None)
    makers = backends.files.models.Makers(tiny=None, tiny_reranker=None, gguf=half_written)
    with pytest.raises(ModelLoadError, match="could not write its converted checkpoint.*No space left"):
        backends.files.models.resolve_model(str(write_gguf(tmp_path / "cut.gguf", "llama")), makers)
    assert not any((cache_dir / "gguf").glob("*")), "neither the folder nor its temporary one stays"


def test_server_exits_with_a_clear_message_when_the_model_cannot_load(tmp_path):
    env = {**os.environ, "PHI2_MODEL": str(tmp_path / "nothing-here"), "PORT": "0", "LOG_DIR": str(tmp_path / "logs")}
    out = subprocess.run(
        [sys.executable, "phi2_server.py"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 1
    assert "PHI2_MODEL" in out.stderr and "make demo" in out.stderr
    assert "Traceback" not in out.stderr


@pytest.mark.parametrize(
    "device, native_bf16, parameters, expected",
    [
        ("cuda", False, 1, "bfloat16"),
        ("cpu", False, 3_000_000_000, "float32"),  # emulated bfloat16 never pays
        ("cpu", True, 3_000_000_000, "bfloat16"),  # Phi-2: decoding is memory-bound
        ("cpu", True, 231_936, "float32"),  # the tiny demo model: its weights sit in the caches
    ],
)
def test_auto_dtype_follows_the_measured_rule(monkeypatch, device, native_bf16, parameters, expected):
    import torch

    from backends.torch import runtime as torch_runtime

    monkeypatch.setattr(torch_runtime, "cpu_has_bf16", lambda: native_bf16)  # a faked CPU
    assert torch_runtime.pick_dtype("auto", device, lambda: parameters) == getattr(torch, expected)
    assert torch_runtime.pick_dtype("float16", device, lambda: parameters) == torch.float16


def test_parameters_are_counted_from_the_config_alone(tiny_path):
    from backends.torch.runtime import count_parameters

    assert count_parameters(tiny_path) == 231_936


def test_an_absent_default_adapter_path_is_normal_and_an_explicit_one_is_warned(tmp_path, caplog):
    from backends.files.adapters import find_adapter

    caplog.set_level("INFO", logger="phi2_server.adapters")
    assert find_adapter(str(tmp_path / "absent"), is_default=True) is None
    assert [r.levelname for r in caplog.records] == ["INFO"]
    assert find_adapter(str(tmp_path / "absent")) is None
    assert [r.levelname for r in caplog.records] == ["INFO", "WARNING"]


def test_every_flag_says_what_it_does():
    out = subprocess.run(
        [sys.executable, "phi2_server.py", "--help"], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    for f in fields(Settings):
        flag = "--" + f.name.replace("_", "-")
        assert flag in out.stdout
        assert f.metadata["help"].split()[0] in out.stdout
