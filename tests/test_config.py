"""Configuration, backend selection on faked platforms, model resolution, the CLI."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from backends import ModelLoadError, select_backend
from backends.model_files import resolve_model
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
    for env in ["PHI2_MODEL", "PHI2_BACKEND", "ADAPTER_PATH", "HOST", "PORT", "LOG_DIR", "PHI2_DTYPE", "PHI2_DEVICE", "MAX_BODY_BYTES"]:
        assert env in out.stdout


def test_missing_directory_is_a_clear_error(tmp_path):
    with pytest.raises(ModelLoadError, match="PHI2_MODEL.*make demo"):
        resolve_model(str(tmp_path / "absent"))
    with pytest.raises(ModelLoadError, match="not a loadable checkpoint"):
        resolve_model(str(tmp_path))


def test_uncached_hub_model_is_a_clear_error():
    with pytest.raises(ModelLoadError, match="PHI2_MODEL='no-such-org/no-such-model'.*make demo"):
        resolve_model("no-such-org/no-such-model")


def test_server_exits_with_a_clear_message_when_the_model_cannot_load(tmp_path):
    env = {**os.environ, "PHI2_MODEL": str(tmp_path / "nothing-here"), "PORT": "0", "LOG_DIR": str(tmp_path / "logs")}
    out = subprocess.run([sys.executable, "phi2_server.py"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 1
    assert "PHI2_MODEL" in out.stderr and "make demo" in out.stderr
    assert "Traceback" not in out.stderr
